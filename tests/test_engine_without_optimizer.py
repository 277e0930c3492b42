"""``shardkit.initialize`` without any optimizer: DeepSpeed's forward-only engines (DeepSpeed-Chat
step 3's reference, reward and EMA models, "ZeRO-3 inference").

One world of 2 gloo ranks. At stages 0-3 (fp32, and bf16 autocast) the engine's outputs equal
the plain model's (rank 0's weights: rank 1 starts from other ones) through ``engine(x)``,
``engine.module(x)``, ``eval()``/``train()`` and ``torch.no_grad()``, and Hugging Face's
``generate()`` through a stage-3 engine equals the plain model's. Stage 3 holds ``4Ψ/N`` bytes
of parameters per rank (storages measured), no gradients, no optimizer state; stages 0-2 hold
the whole model (``4Ψ``; under bf16 its weights are cast to bf16, ``2Ψ``, as DeepSpeed halves
the module). ``backward``/``step`` raise on every rank before any collective; a config
``scheduler`` without an optimizer is a ConfigError. ``module_state_dict``,
``save_16bit_model``, ``save_checkpoint``/``load_checkpoint`` round-trip (and a training
engine's checkpoint gives a reference engine its weights). DeepSpeed-Chat's ``moving_average``
between a training stage-3 engine and an optimizer-less stage-3 EMA engine follows the EMA rule.
"""

import copy
import os

import pytest
import torch

import shardkit
from shardkit import distributed
from shardkit.checkpoint.sharded import CheckpointError
from shardkit.config import ConfigError
from shardkit.testing import MLP, world_fixture
from shardkit.utils.memory import model_state_bytes
from tests.hf.hf_common import SEQ, VOCAB, build

WIDTH = 12
TOL = 1e-6

world2 = world_fixture(2)


def _config(stage, dtype="fp32", **extra):
    config = {"train_batch_size": 2 * distributed.get_world_size(),
              "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": stage}, **extra}
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    return config


def _chat_eval_config(stage, dtype="bf16", offload=True):
    """DeepSpeed-Chat's ``get_eval_ds_config(offload, dtype, stage)`` (its reference, reward and
    EMA engines), with the batch sizes ``_init_ref`` sets; ``dtype="fp32"`` leaves the
    precision section out (DeepSpeed-Chat always sets one; fp32 for exact parity)."""
    config = {"train_batch_size": 2 * distributed.get_world_size(),
              "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                                    "offload_param": {"device": "cpu" if offload else "none"},
                                    "memory_efficient_linear": False},
              "gradient_clipping": 1.0, "prescale_gradients": False,
              "wall_clock_breakdown": False}
    if dtype != "fp32":
        config[{"bf16": "bfloat16"}.get(dtype, dtype)] = {"enabled": True}
    return config


def _rank_model(seed=3):
    """The same MLP on every rank, except that rank 1 perturbs its weights: the engine must
    start from rank 0's, as DeepSpeed's does."""
    model = MLP(WIDTH, depth=3, out=5, seed=seed)
    if distributed.get_rank() != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def _diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# ----------------------------------------------------------------------------- rank side


def _forward_parity(stage, dtype):
    oracle = MLP(WIDTH, depth=3, out=5, seed=3)
    engine, optimizer, loader, scheduler = shardkit.initialize(
        model=_rank_model(), config=_config(stage, dtype))
    out = {"returned": [optimizer is None, loader is None, scheduler is None,
                        engine.optimizer is None, engine.lr_scheduler is None,
                        engine.zero_optimization_stage() == stage, engine.get_lr() == []]}
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(7 + distributed.get_rank()))
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
           else torch.autocast("cpu", enabled=False))
    with ctx:
        want = oracle(x)
    diffs = {}
    engine.eval()
    with torch.no_grad():
        diffs["eval no_grad"] = _diff(engine(x), want)
    engine.train()
    diffs["train"] = _diff(engine(x), want)
    if dtype == "fp32":  # the module itself runs without the engine's autocast
        with torch.no_grad():
            diffs["module"] = _diff(engine.module(x), want)
    if stage < 3:  # forwards are local: rank 0 runs one more, then a collective still pairs up
        if distributed.get_rank() == 0:
            with torch.no_grad():
                engine(x)
        flag = torch.ones(1)
        distributed.all_reduce(flag)
        out["uneven_forwards"] = flag.item()
    out["diffs"] = diffs
    out["training_mode"] = [engine.module.training, engine.training]
    engine.eval()
    out["eval_mode"] = [engine.module.training, engine.training]
    memory = model_state_bytes(module=engine.wrapped, optimizer=engine.optimizer)
    out["memory"] = memory.as_dict()
    world = distributed.get_world_size()
    if stage == 3:  # every parameter's rows, padded to a multiple of N on dim 0
        out["expected_params"] = sum(
            -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * 4 for p in oracle.parameters())
    else:  # the whole model: fp32, or cast to bf16 (2Ψ) as DeepSpeed halves the module
        width = 4 if dtype == "fp32" else 2
        out["expected_params"] = sum(p.numel() * width for p in oracle.parameters())
    out["weight_dtypes"] = sorted({str(p.dtype) for p in engine.module.parameters()})
    out["psi_bytes"] = sum(p.numel() * 4 for p in oracle.parameters())
    return out


def _refusals(stage):
    out = {}
    engine, *_ = shardkit.initialize(model=MLP(WIDTH, depth=2, out=5, seed=1),
                                     config=_config(stage))
    loss = engine(torch.randn(2, WIDTH)).sum()
    for name, call in (("backward", lambda: engine.backward(loss)),
                       ("step", lambda: engine.step())):
        try:
            call()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = str(error)
    # no collective was started: a world-wide one right after still pairs up on every rank
    flag = torch.ones(1)
    distributed.all_reduce(flag)
    out["after"] = flag.item()
    out["steps"] = [engine.global_steps, engine.micro_steps]
    # recipes.compose without an optimizer: OSS's options have nothing to act on
    from shardkit.recipes import compose
    try:
        compose(MLP(WIDTH, depth=2, out=5, seed=1), 1, None, reduce_to_owners=True)
        out["compose"] = "no error"
    except ValueError as error:
        out["compose"] = str(error)
    try:
        compose(MLP(WIDTH, depth=2, out=5, seed=1), stage, None).training_setup(None)
        out["training_setup"] = "no error"
    except ValueError as error:
        out["training_setup"] = str(error)
    try:
        shardkit.initialize(model=MLP(WIDTH, depth=2, out=5, seed=1), config=_config(
            stage, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2}}))
        out["scheduler"] = "no error"
    except ConfigError as error:
        out["scheduler"] = str(error)
    try:
        shardkit.initialize(model=MLP(WIDTH, depth=2, out=5, seed=1), config=_config(stage),
                            lr_scheduler=lambda opt: None)
        out["lr_scheduler"] = "no error"
    except ConfigError as error:
        out["lr_scheduler"] = str(error)
    return out


def _checkpoints(stage, tmp):
    rank = distributed.get_rank()
    oracle = MLP(WIDTH, depth=3, out=5, seed=3)
    engine, *_ = shardkit.initialize(model=_rank_model(), config=_config(stage))
    out = {}
    full = engine.module_state_dict()
    out["state_dict"] = max(_diff(full[k], v) for k, v in oracle.state_dict().items())
    out["state_keys"] = sorted(full) == sorted(oracle.state_dict())
    engine.save_16bit_model(os.path.join(tmp, "export"))
    saved = torch.load(os.path.join(tmp, "export", "pytorch_model.bin"), weights_only=True)
    out["export"] = max(_diff(saved[k], v) for k, v in oracle.state_dict().items())
    path = engine.save_checkpoint(os.path.join(tmp, "ckpt"), tag="t0", client_state={"k": 1})
    out["path"] = os.path.basename(path)
    # a second engine from other weights loads them back
    other, *_ = shardkit.initialize(model=MLP(WIDTH, depth=3, out=5, seed=11),
                                    config=_config(stage))
    loaded, client = other.load_checkpoint(os.path.join(tmp, "ckpt"))
    out["client"] = client
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5 + rank))
    with torch.no_grad():
        out["reloaded"] = _diff(other(x), oracle(x))
    # a training engine's checkpoint (with optimizer state) gives a reference engine its
    # weights; a training engine reads the reference's back with load_optimizer_states=False
    trained = MLP(WIDTH, depth=3, out=5, seed=21)
    actor, *_ = shardkit.initialize(model=trained, config=_config(
        stage, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}))
    actor.backward(actor(x).pow(2).mean())
    actor.step()
    actor.save_checkpoint(os.path.join(tmp, "actor"), tag="a1")
    actor_weights = actor.module_state_dict()
    ref, *_ = shardkit.initialize(model=MLP(WIDTH, depth=3, out=5, seed=3),
                                  config=_config(stage))
    ref.load_checkpoint(os.path.join(tmp, "actor"))
    ref_weights = ref.module_state_dict()
    out["from_actor"] = max(_diff(ref_weights[k], v) for k, v in actor_weights.items())
    out["ref_steps"] = ref.global_steps
    try:  # the reference's checkpoint has no optimizer state: the error says how to load it
        actor.load_checkpoint(os.path.join(tmp, "ckpt"))
        out["optimizer_states"] = "no error"
    except CheckpointError as error:
        out["optimizer_states"] = str(error)
    actor.load_checkpoint(os.path.join(tmp, "ckpt"), load_optimizer_states=False)
    back = actor.module_state_dict()
    out["actor_from_ref"] = max(_diff(back[k], v) for k, v in oracle.state_dict().items())
    return out


def _generate_stage3(dtype):
    """A reference model as DeepSpeed-Chat builds it (its eval config, CPU offload of the
    parameters): ``generate()`` through ``engine.module`` and the forward through the engine
    equal the plain model's."""
    plain = build("gpt2", tied=True, seed=4).eval()
    model = copy.deepcopy(plain)
    engine, *_ = shardkit.initialize(model=model, config=_chat_eval_config(3, dtype))
    engine.eval()
    rank = distributed.get_rank()
    prompt = torch.tensor([[5 + rank, 6, 7, 8]])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=SEQ - 4,
                  do_sample=False, pad_token_id=0)
    ctx = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16"
           else torch.autocast("cpu", enabled=False))
    with torch.no_grad(), ctx:
        want = plain.generate(prompt, **kwargs)
        through_module = engine.module.generate(prompt, **kwargs)
        logits_want = plain(want).logits
    with torch.no_grad():
        logits = engine(want).logits
    return {"module.generate": torch.equal(through_module, want),
            "logits": _diff(logits, logits_want), "vocab": logits.shape[-1] == VOCAB}


def _ema_moving_average(modifier_rank):
    """DeepSpeed-Chat step 3: ``moving_average(actor, ema_engine, zero_stage=3)`` after each
    actor step, the actor a training stage-3 engine, the EMA an optimizer-less stage-3 one.
    ``modifier_rank``: what the script passes to ``GatheredParameters`` (DeepSpeed-Chat:
    none)."""
    beta = 0.9
    rank = distributed.get_rank()
    actor_model = MLP(WIDTH, depth=3, out=5, seed=3)
    ema_model = copy.deepcopy(actor_model)
    reference = copy.deepcopy(actor_model)  # the one-process actor
    expected = copy.deepcopy(actor_model)  # the one-process EMA
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    actor, *_ = shardkit.initialize(model=actor_model, config=_config(
        3, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    ema, *_ = shardkit.initialize(model=ema_model, config=_config(3))

    def to_fetch(params):
        return [p for p in params if hasattr(p, "ds_id")
                and p.ds_status == shardkit.zero.ZeroParamStatus.NOT_AVAILABLE]

    def moving_average(model, model_ema, zero_stage=3):
        with torch.no_grad():
            for param, param_ema in zip(model.parameters(), model_ema.parameters()):
                fetch = to_fetch([param, param_ema]) if zero_stage == 3 else []
                with shardkit.zero.GatheredParameters(fetch, enabled=len(fetch) > 0,
                                                      **({} if modifier_rank is None else
                                                         {"modifier_rank": modifier_rank})):
                    param_ema.data.copy_(torch.lerp(param.data, param_ema.data, beta))

    diffs, moved = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(50 + step)
        xs = [torch.randn(2, WIDTH, generator=g) for _ in range(distributed.get_world_size())]
        actor.backward(actor(xs[rank]).pow(2).mean())
        actor.step()
        sum(reference(x).pow(2).mean() for x in xs).div(len(xs)).backward()
        opt.step()
        opt.zero_grad()
        before = ema.module_state_dict()
        moving_average(actor, ema)
        with torch.no_grad():
            for p, p_ema in zip(reference.parameters(), expected.parameters()):
                p_ema.copy_(torch.lerp(p, p_ema, beta))
        after = ema.module_state_dict()
        moved.append(max(_diff(after[k], before[k]) for k in after))
        diffs.append(max(_diff(after[k], v) for k, v in expected.state_dict().items()))
    return {"diffs": diffs, "moved": moved}


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"),
                                         (0, "bf16"), (3, "bf16")])
def test_forward_equals_the_plain_model(world2, stage, dtype):
    tol = TOL if dtype == "fp32" else 1e-2
    for r in world2.run(_forward_parity, stage, dtype):
        assert all(r["returned"]), r["returned"]
        assert max(r["diffs"].values()) < tol, r["diffs"]
        assert r["training_mode"] == [True, True] and r["eval_mode"] == [False, False]
        assert r.get("uneven_forwards", 2.0) == 2.0
        memory = r["memory"]
        assert memory["grads"] == 0 and memory["optimizer"] == 0, memory
        assert memory["params"] == r["expected_params"], (memory, r["expected_params"])
        # stages 0-2 cast the weights to bf16; stage 3 keeps fp32 shards (16-bit compute)
        bf16_weights = dtype == "bf16" and stage < 3
        assert r["weight_dtypes"] == ["torch.bfloat16" if bf16_weights else "torch.float32"], \
            r["weight_dtypes"]
        if stage == 3:  # 4Ψ/N, up to the padding of each parameter to N rows
            assert memory["params"] < r["psi_bytes"] * 0.6, (memory, r["psi_bytes"])


@pytest.mark.parametrize("stage", [0, 3])
def test_backward_step_and_a_scheduler_are_refused(world2, stage):
    for r in world2.run(_refusals, stage):
        for name in ("backward", "step"):
            assert f"engine.{name}" in r[name] and "has no optimizer" in r[name], r[name]
        assert r["after"] == 2.0 and r["steps"] == [0, 0]
        assert "compose(stage=1, optimizer=None): reduce_to_owners" in r["compose"], r
        assert "built without an optimizer" in r["training_setup"], r
        assert "'scheduler' section (type WarmupLR) was given without an optimizer" \
            in r["scheduler"], r["scheduler"]
        assert "lr_scheduler=<function> was given without an optimizer" in r["lr_scheduler"], \
            r["lr_scheduler"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_weights_round_trip(world2, stage, tmp_path):
    for r in world2.run(_checkpoints, stage, str(tmp_path / f"s{stage}")):
        assert r["state_keys"] and r["state_dict"] < TOL and r["export"] < TOL, r
        assert r["path"] == "t0" and r["client"] == {"k": 1}, r
        assert r["reloaded"] < TOL, r
        assert r["from_actor"] < TOL and r["ref_steps"] == 1, r
        assert r["actor_from_ref"] < TOL, r
        message = r["optimizer_states"]
        assert "without an optimizer" in message and "load_optimizer_states=False" in message \
            and "use NoOptimizer" not in message, message


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hf_generate_through_a_stage3_engine(world2, dtype):
    for r in world2.run(_generate_stage3, dtype):
        assert r["module.generate"] and r["vocab"], r
        assert r["logits"] < (TOL * 10 if dtype == "fp32" else 5e-2), r


def test_ema_of_a_training_engine_into_an_optimizerless_stage3_engine(world2):
    for r in world2.run(_ema_moving_average, 0):
        assert min(r["moved"]) > 1e-4, r
        assert max(r["diffs"]) < TOL, r


def test_ema_as_deepspeed_chat_writes_it_moves_the_stage3_ema(world2):
    for r in world2.run(_ema_moving_average, None):
        assert min(r["moved"]) > 1e-4, r
        assert max(r["diffs"]) < TOL, r
