"""DeepSpeed's ZeRO / half-precision / checkpoint / comm unit tests, re-expressed against
``shardkit.initialize``: what a script written for ``deepspeed.initialize`` sees at ZeRO stages
0-3 when it switches the import.

Covered (DeepSpeed file -> here): half_precision/test_fp16 and test_zero_optim_overflow (fp16 and
bf16 at every stage, with offload_optimizer, against one-process autocast training; overflow
skipping and loss-scale changes, bf16's check_grad_overflow), zero/test_zero_grad_clip (the
clipped step and the reported norm against torch's ``clip_grad_norm_`` on one process),
zero/test_ignore_unused_parameters and test_fp16's empty-gradient cases, zero/test_zero_config
(the keys DeepSpeed reads under two names, deprecated and null sections), zero/test_unwrap_model
(``engine.module`` is the user's model), checkpoint/test_other_optimizer (client optimizers and
DeepSpeed's optimizer names through save/load), test_shared_weights (tied weights), test_sparse
(sparse embedding gradients), comm/test_dist (``deepspeed.comm`` calls), and two engine gaps: the
by-hand gradient average (a script calling the model itself) in ``communication_data_type``, and
``save_checkpoint(exclude_frozen_parameters=True)``.

Engine checks run in one world of 1 rank and one of 2 gloo ranks (started once each).
"""

import copy
import glob

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff
from tests.utils.master_weights import masters_of

HIDDEN = 6
LR = 1e-3

world1 = world_fixture(1)
world2 = world_fixture(2)


class Net(nn.Module):
    """Two linear layers; ``unused`` is never called (DeepSpeed's empty-gradient models)."""

    def __init__(self, unused=False, tied=False, frozen=False):
        super().__init__()
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.second = nn.Linear(HIDDEN, HIDDEN)
        if tied:
            self.second.weight = self.first.weight
        if unused:
            self.unused = nn.Linear(HIDDEN, HIDDEN)
        if frozen:
            self.first.requires_grad_(False)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def _model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Net(**kwargs)


def _batch(step, rank, n=2):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, HIDDEN, generator=gen), torch.randint(0, HIDDEN, (n,), generator=gen)


def _global_batch(step, world, n=2):
    parts = [_batch(step, r, n) for r in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def _config(stage, **extra):
    world = distributed.get_world_size()
    cfg = {"train_batch_size": 2 * world, "steps_per_print": 1000,
           "zero_optimization": {"stage": stage}}
    if "offload" in extra:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": extra.pop("offload")}
    cfg.update(extra)
    if "optimizer" not in extra:
        cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR}}
    return cfg


def _engine(stage, model=None, client=None, **extra):
    model = _model() if model is None else model
    cfg = _config(stage, **extra)
    if client is not None:
        cfg.pop("optimizer")
    engine, *_ = shardkit.initialize(model=model, optimizer=client, config=cfg)
    return engine


def _train_step(engine, step):
    x, y = _batch(step, distributed.get_rank())
    loss = F.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return float(loss)


def _reference(steps, clip=0.0, autocast=None, model=None, optimizer=torch.optim.Adam,
               **opt_kwargs):
    """One process, the global batch, torch's optimizer (and clip_grad_norm_): the weights after
    each step and the norms torch's clip returned."""
    model = _model() if model is None else model
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(trainable, **(opt_kwargs or {"lr": LR}))
    world = distributed.get_world_size()
    weights, norms = [], []
    for step in range(steps):
        x, y = _global_batch(step, world)
        ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast(
            "cpu", enabled=False)
        with ctx:
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    return weights, norms


def _state(engine):
    return {k: v.detach().clone() for k, v in engine.module_state_dict().items()}


# ----------------------------------------------------------------------------- rank functions


def _clipping_parity(stage, offload, precision):
    """DeepSpeed's TestZeroGradClip: the clipped step against torch's clip_grad_norm_ on one
    process, and get_global_grad_norm() = the norm torch measured (before clipping)."""
    extra = {"gradient_clipping": 0.05}
    if offload:
        extra["offload"] = "cpu"
    if precision == "fp16":
        extra["fp16"] = {"enabled": True, "loss_scale": 1024}
    engine = _engine(stage, **extra)
    norms, worst = [], 0.0
    expected, ref_norms = _reference(3, clip=0.05)
    for step in range(3):
        _train_step(engine, step)
        norms.append(engine.get_global_grad_norm())
        worst = max(worst, max_diff(_state(engine), expected[step]))
    return worst, norms, ref_norms


def _half_precision(stage, dtype, offload):
    """DeepSpeed's TestAdamFP16ZeroOneCycleCompatibility / TestZeROFloat16 test_no_overflow:
    fp16 and bf16 at every stage (offload_optimizer too) follow one-process autocast training."""
    extra = {dtype: {"enabled": True}}
    if offload:
        extra["offload"] = "cpu"
    engine = _engine(stage, **extra)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    expected, _ = _reference(3, autocast=half)
    worst = 0.0
    for step in range(3):
        _train_step(engine, step)
        worst = max(worst, max_diff(_state(engine), expected[step]))
    return worst, engine.skipped_steps, engine.global_steps, engine.loss_scale


def _poison_one_gradient(engine):
    """Rank 1 only: one of the local gradients its step reads becomes inf (DeepSpeed's
    test_some_overflow). With 16-bit weights at stages 1-2 those are the gradients of the
    parameters it owns (its fp32 masters'), as DeepSpeed's ZeRO checks its own partition; at
    stage 1 its gradient of a parameter it does not own reads zero after the reduction to the
    owner and is never read."""
    if distributed.get_rank() != 1:
        return
    masters = masters_of(engine)
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and (masters is None or masters.holds(p)):
                p.grad.view(-1)[0] = float("inf")
                return
    raise AssertionError("rank 1 holds no gradient its step reads")


def _overflow(stage, dtype, check=True, offload=False):
    """An inf on one rank skips the step on every rank at every stage (weights unchanged, the
    fp16 scale halved with hysteresis 1), and the next clean step is applied; bf16 with
    check_grad_overflow false applies it (DeepSpeed's test_ignore_grad_overflow)."""
    section = {"enabled": True}
    if dtype == "fp16":
        section.update(initial_scale_power=8, hysteresis=1, loss_scale_window=1000)
    else:
        section.update(check_grad_overflow=check)
    extra = {dtype: section}
    if offload:
        extra["offload"] = "cpu"
    engine = _engine(stage, **extra)
    _train_step(engine, 0)
    out = {"first": (engine.was_step_applied(), engine.loss_scale)}
    before = _state(engine)
    x, y = _batch(1, distributed.get_rank())
    engine.backward(F.cross_entropy(engine(x).float(), y))
    _poison_one_gradient(engine)
    engine.step()
    after = _state(engine)
    out["poisoned"] = (engine.was_step_applied(), engine.loss_scale, engine.skipped_steps,
                       engine.global_steps, max_diff(before, after) == 0.0,
                       engine.get_global_grad_norm())
    _train_step(engine, 2)
    out["next"] = (engine.was_step_applied(), engine.skipped_steps, engine.global_steps)
    return out


def _unused_parameters(stage, ignore):
    """DeepSpeed's TestStage2IgnoreUnusedParameters and TestAdamFP32EmptyGrad: a parameter no
    forward uses; with ignore_unused_parameters training follows one process and the unused
    parameter is untouched."""
    cfg = {"zero_optimization": {"stage": stage, "ignore_unused_parameters": ignore}}
    try:
        engine = _engine(stage, model=_model(unused=True), **cfg)
        for step in range(2):
            _train_step(engine, step)
    except Exception as error:  # noqa: BLE001 - the refusal is what is reported
        return "error", f"{type(error).__name__}: {error}"
    expected, _ = _reference(2, model=_model(unused=True))
    return "ok", max_diff(_state(engine), expected[-1])


def _other_optimizer_round_trip(stage, kind, tmp):
    """DeepSpeed's TestOtherOptimizerCheckpoint: train, save, go on one step; a fresh engine
    (another initialisation) that loads the checkpoint takes the same step exactly."""
    clients = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
               "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
               "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01)}
    configs = {"AdamW": {"lr": LR, "weight_decay": 0.01}, "SGD": {"lr": 0.05, "momentum": 0.9}}

    def build(seed):
        model = _model(seed)
        if kind in clients:
            return _engine(stage, model=model, client=clients[kind])
        return _engine(stage, model=model,
                       optimizer={"type": kind, "params": configs[kind]})

    engine = build(0)
    for step in range(2):
        _train_step(engine, step)
    path = f"{tmp}/{kind}-{stage}"
    engine.save_checkpoint(path, tag="t")
    _train_step(engine, 2)
    continued = _state(engine)
    fresh = build(1)
    fresh.load_checkpoint(path, tag="t")
    _train_step(fresh, 2)
    return max_diff(continued, _state(fresh)), type(fresh.optimizer).__name__, \
        fresh.global_steps


def _shared_weights(stage, tmp):
    """DeepSpeed's TestCheckpointSharedWeights: tied weights train as one, save and load into a
    fresh model keeping the tie, and the loaded run continues exactly."""
    engine = _engine(stage, model=_model(tied=True))
    for step in range(2):
        _train_step(engine, step)
    path = f"{tmp}/tied-{stage}"
    engine.save_checkpoint(path)
    _train_step(engine, 2)
    continued = _state(engine)
    fresh = _engine(stage, model=_model(seed=3, tied=True))
    fresh.load_checkpoint(path)
    tied = fresh.module.first.weight is fresh.module.second.weight or stage == 3
    _train_step(fresh, 2)
    state = _state(fresh)
    expected, _ = _reference(3, model=_model(tied=True))
    return (max_diff(continued, state), tied,
            torch.equal(state["first.weight"], state["second.weight"]),
            max_diff(state, expected[-1]))


class SparseNet(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.embedding = nn.Embedding(10, HIDDEN, sparse=sparse)
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def _sparse_gradients(stage, tmp):
    """DeepSpeed's TestSparseCheckpoint (stage 0, ``sparse_gradients``): a model with a sparse
    embedding trains as on one process (SGD handles sparse gradients), saves and loads; stages
    1-3 refuse it at initialize, naming the embedding, before any collective."""
    torch.manual_seed(0)
    model = SparseNet(sparse=True)
    extra = {"sparse_gradients": True} if stage == 0 else {}
    try:
        engine = _engine(stage, model=model, client=lambda p: torch.optim.SGD(p, lr=0.1),
                         **extra)
        gen = torch.Generator().manual_seed(distributed.get_rank())
        tokens = torch.randint(0, 10, (2,), generator=gen)
        engine.backward(F.cross_entropy(engine(tokens), tokens % HIDDEN))
        engine.step()
        engine.save_checkpoint(f"{tmp}/sparse-{stage}")
        torch.manual_seed(5)
        fresh = _engine(stage, model=SparseNet(sparse=True),
                        client=lambda p: torch.optim.SGD(p, lr=0.1), **extra)
        fresh.load_checkpoint(f"{tmp}/sparse-{stage}")
        torch.manual_seed(0)
        reference = SparseNet(sparse=True)
        every = torch.cat([torch.randint(0, 10, (2,), generator=torch.Generator().manual_seed(r))
                           for r in range(distributed.get_world_size())])
        F.cross_entropy(reference(every), every % HIDDEN).backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        return "ok", (max_diff(_state(engine), _state(fresh)),
                      max_diff(_state(engine), reference.state_dict()),
                      engine.sparse_gradients_enabled())
    except Exception as error:  # noqa: BLE001 - the refusal is what is reported
        return "error", f"{type(error).__name__}: {error}"


def _by_hand_average_dtype(stage, comm_dtype):
    """Gap (a): a script that calls the model itself (not engine(x)) at stages 0-1 has its
    gradients averaged by the engine; with communication_data_type they travel in that dtype
    (half the bytes of fp32), and the result is the fp32 average rounded to it."""
    extra = {} if comm_dtype is None else {"communication_data_type": comm_dtype}
    engine = _engine(stage, **extra)
    x, y = _batch(0, distributed.get_rank())
    with distributed.CommCounter() as counter:
        engine.backward(F.cross_entropy(engine.module(x), y))
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()
             if p.grad is not None}
    reference = _model()
    gx, gy = _global_batch(0, distributed.get_world_size())
    F.cross_entropy(reference(gx), gy).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    numel = sum(p.numel() for p in reference.parameters())
    return dict(counter.by_op), numel, max_diff(grads, expected), sorted(grads)


def _engine_step_bytes(stage, reduce_scatter):
    """The bytes a CommCounter sees around one engine step (engine(x), backward, step), by op,
    and the parameter count."""
    engine = _engine(stage, zero_optimization={"stage": stage, "reduce_scatter": reduce_scatter})
    with distributed.CommCounter() as counter:
        _train_step(engine, 0)
    return dict(counter.by_op), sum(p.numel() for p in engine.module.parameters())


def _exclude_frozen(stage, tmp):
    """Gap (b): save_checkpoint(exclude_frozen_parameters=True) leaves the frozen parameters
    out; loading it restores the trained ones and keeps the loading model's frozen values."""
    engine = _engine(stage, model=_model(frozen=True))
    for step in range(2):
        _train_step(engine, step)
    path = f"{tmp}/frozen-{stage}"
    engine.save_checkpoint(path, tag="t", exclude_frozen_parameters=True)
    saved = _state(engine)
    fresh = _engine(stage, model=_model(seed=7, frozen=True))
    frozen_before = _state(fresh)
    fresh.load_checkpoint(path, tag="t")
    loaded = _state(fresh)
    names = set()
    for rank_file in glob.glob(f"{path}/t/*.pt"):
        blob = torch.load(rank_file, weights_only=True)
        if isinstance(blob, dict):
            for key in ("params", "row_blocks"):
                names |= set(blob.get(key, {}) or {})
    trained = {k: v for k, v in saved.items() if k.startswith("second.")}
    frozen = {k: v for k, v in frozen_before.items() if k.startswith("first.")}
    return (max_diff(trained, {k: loaded[k] for k in trained}),
            max_diff(frozen, {k: loaded[k] for k in frozen}),
            sorted(names), fresh.global_steps)


def _comm_calls():
    """DeepSpeed's tests/unit/comm/test_dist: deepspeed.comm's calls through shardkit.comm."""
    dist = shardkit.comm
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "world": world, "init": dist.is_initialized()}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.ones(3, dtype=dtype) * (rank + 1)
        dist.all_reduce(x)
        y = torch.ones(128, dtype=dtype) * (rank + 1)
        dist.inference_all_reduce(y)
        out[str(dtype)] = (float(x[0]), float(y[-1]))
    z = torch.tensor([float(rank)])
    dist.broadcast(z, src=0)
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    dist.barrier()
    out["broadcast"], out["gathered"] = float(z), [float(t) for t in gathered]
    return out


def _unwrap_model(stage):
    """DeepSpeed's TestUnwrapModel: engine.module is the user's module, and attributes the
    engine lacks reach it."""
    model = _model()
    model.note = "mine"
    engine = _engine(stage, model=model)
    return engine.module is model, engine.note, isinstance(engine.module, Net)


# ----------------------------------------------------------------------------- world of 2


STAGES = [0, 1, 2, 3]


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (3, False),
                                            (3, True), (2, True)])
def test_gradient_clipping_matches_torch_clip_on_one_process(world2, stage, offload):
    for worst, norms, ref_norms in world2.run(_clipping_parity, stage, offload, "fp32"):
        assert worst < 1e-5, worst
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert all(n > 0.05 for n in ref_norms)  # clipping was active


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_at_every_stage_follows_autocast_training(world2, dtype):
    for stage, offload in [(0, False), (1, False), (2, False), (2, True), (3, False),
                           (3, True)]:
        for worst, skipped, steps, scale in world2.run(_half_precision, stage, dtype, offload):
            assert worst < 5e-3, (stage, offload, worst)
            assert (skipped, steps) == (0, 3)
            assert scale == (2.0 ** 16 if dtype == "fp16" else 1.0)


@pytest.mark.parametrize("stage", STAGES)
def test_one_ranks_overflow_skips_the_step_everywhere(world2, stage):
    for out in world2.run(_overflow, stage, "fp16", offload=stage == 3):
        assert out["first"] == (True, 256.0)
        # skipped everywhere, scale halved, weights untouched, no norm reported
        assert out["poisoned"] == (False, 128.0, 1, 2, True, None)
        assert out["next"] == (True, 1, 3)
    for check in (True, False):
        for out in world2.run(_overflow, stage, "bf16", check):
            assert out["poisoned"][0] is (not check)
            assert out["poisoned"][2] == (1 if check else 0)


@pytest.mark.parametrize("stage", STAGES)
def test_unused_parameters(world2, stage):
    for outcome, value in world2.run(_unused_parameters, stage, True):
        assert outcome == "ok", value
        assert value < 1e-5
    for outcome, value in world2.run(_unused_parameters, stage, False):
        # stages 2-3 reduce whatever arrives (an unused parameter keeps no gradient); stages
        # 0-1 build torch DDP without find_unused_parameters, whose error names the key
        if outcome == "error":
            assert "ignore_unused_parameters" in value or "find_unused_parameters" in value, \
                value
        else:
            assert value < 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_other_optimizers_resume_exactly(world2, tmp_path, stage):
    for kind in ("sgd", "adagrad", "rmsprop", "AdamW", "SGD"):
        for diff, _, steps in world2.run(_other_optimizer_round_trip, stage, kind,
                                         str(tmp_path)):
            assert diff == 0.0, (kind, diff)
            assert steps == 3


@pytest.mark.parametrize("stage", STAGES)
def test_shared_weights_through_save_and_load(world2, tmp_path, stage):
    for diff, tied, equal, to_reference in world2.run(_shared_weights, stage, str(tmp_path)):
        assert diff == 0.0
        assert tied and equal
        assert to_reference < 1e-5


@pytest.mark.parametrize("stage", STAGES)
def test_sparse_embedding_gradients(world2, tmp_path, stage):
    for outcome, value in world2.run(_sparse_gradients, stage, str(tmp_path)):
        if stage == 0:
            assert outcome == "ok", value
            assert value[0] == 0.0 and value[1] < 1e-6 and value[2] is True
        else:
            assert outcome == "error"
            assert value.startswith("ConfigError") and "sparse=True" in value \
                and "['embedding']" in value, value


@pytest.mark.parametrize("stage, reduce_scatter", [(0, True), (1, False)])
def test_engine_step_counts_torch_ddps_all_reduce(world2, stage, reduce_scatter):
    """DESIGN.md: CommCounter shows each stage's bytes. Under initialize, torch DDP's
    all-reduce (stage 0, and stage 1 with reduce_scatter false) used to be uncounted (0 bytes
    at stage 0). fp32 gradients: 2(N-1)/N of 4 bytes per parameter; stage 1 adds OSS's
    one-element inf/nan flag to the all-reduce and its parameter all-gather."""
    for by_op, numel in world2.run(_engine_step_bytes, stage, reduce_scatter):
        extra = 0 if stage == 0 else 1
        assert by_op.get("all_reduce") == pytest.approx(2 * (2 - 1) / 2 * 4 * (numel + extra))
        assert by_op.get("all_gather", 0) == pytest.approx(0 if stage == 0 else 4 * numel / 2)


def _users_comm_hook(stage):
    """A script's own DDP hook registered on the engine's DDP after initialize (PowerSGD, fp16
    compression) replaces the engine's counting hook, as on a DDP built without it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    engine = _engine(stage, zero_optimization={"stage": stage, "reduce_scatter": False})
    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    engine.wrapped.register_comm_hook(None, hook)
    _train_step(engine, 0)
    return sum(seen), sum(p.numel() for p in engine.module.parameters() if p.requires_grad)


@pytest.mark.parametrize("stage", [0, 1])
def test_users_comm_hook_replaces_the_counting_one(world2, stage):
    for seen, numel in world2.run(_users_comm_hook, stage):
        assert seen == numel


@pytest.mark.parametrize("stage, comm_dtype", [(0, "bf16"), (1, "bf16"), (0, "fp16"),
                                               (1, None), (0, "fp32")])
def test_by_hand_average_travels_in_communication_data_type(world2, stage, comm_dtype):
    for by_op, numel, diff, names in world2.run(_by_hand_average_dtype, stage, comm_dtype):
        exact = comm_dtype in (None, "fp32")  # an fp32 model's gradients travel as they are
        width = 4 if exact else 2
        assert by_op.get("all_reduce") == pytest.approx(2 * (2 - 1) / 2 * numel * width), by_op
        assert diff < (1e-6 if exact else 1e-2)
        assert names == ["first.bias", "first.weight", "second.bias", "second.weight"]


@pytest.mark.parametrize("stage", STAGES)
def test_save_checkpoint_exclude_frozen_parameters(world2, tmp_path, stage):
    for trained, frozen, names, steps in world2.run(_exclude_frozen, stage, str(tmp_path)):
        assert trained == 0.0 and frozen == 0.0
        assert not any(n.startswith("first.") for n in names), names
        assert steps == 2


def test_comm_calls_a_script_makes(world2):
    for out in world2.run(_comm_calls):
        assert out["world"] == 2 and out["init"]
        for dtype in ("torch.float32", "torch.bfloat16", "torch.float16"):
            assert out[dtype] == (3.0, 3.0)
        assert out["broadcast"] == 0.0 and out["gathered"] == [0.0, 1.0]


# ----------------------------------------------------------------------------- world of 1


@pytest.mark.parametrize("precision, offload", [("fp32", True), ("fp16", True),
                                                ("fp16", False)])
def test_grad_clip_at_stage_3_on_one_rank(world1, precision, offload):
    """DeepSpeed's TestZeroGradClip runs at world 1, stage 3, fp16 with a static scale."""
    worst, norms, ref_norms = world1.run(_clipping_parity, 3, offload, precision)[0]
    if precision == "fp32":
        assert worst < 1e-5
        assert norms == pytest.approx(ref_norms, rel=1e-5)
    else:
        assert worst < 5e-3
        assert norms == pytest.approx(ref_norms, rel=5e-2)


def test_unwrap_model_at_every_stage(world1):
    for stage in STAGES:
        assert world1.run(_unwrap_model, stage)[0] == (True, "mine", True)


def test_comm_calls_at_one_rank(world1):
    out = world1.run(_comm_calls)[0]
    assert out["world"] == 1 and out["gathered"] == [0.0]
    assert out["torch.float16"] == (1.0, 1.0)


# ----------------------------------------------------------------------------- config


def _zero(section):
    return load_config({"train_batch_size": 1, "zero_optimization": section}, 1)


def test_zero_config_reads_both_names_of_a_key():
    """DeepSpeed's test_zero_config_aliasfields: its field names and the stage3_ aliases."""
    for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_reuse_distance",
                 "max_live_parameters", "model_persistence_threshold"):
        for key in (name, f"stage3_{name}"):
            cfg = _zero({"stage": 3, key: 12345})
            assert cfg.checked["zero_optimization"][f"stage3_{name}"] == 12345
        with pytest.raises(ConfigError, match=f"both '{name}' and 'stage3_{name}'"):
            _zero({name: 1, f"stage3_{name}": 2})
    for key in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        _zero({"stage": 3, key: True})


def test_zero_config_deprecated_and_null_sections():
    """DeepSpeed's test_zero_config_deprecatedfields / offload_configs / pipeline."""
    cfg = _zero({"stage": 3, "cpu_offload_param": True})
    assert cfg.zero.offload_param_device == "cpu"
    assert any("cpu_offload_param" in note for note in cfg.warnings)
    assert _zero({"stage": 2, "cpu_offload": True}).zero.offload_optimizer_device == "cpu"
    cfg = _zero({"stage": 3, "offload_param": None, "offload_optimizer": None})
    assert (cfg.zero.offload_param_device, cfg.zero.offload_optimizer_device) == ("none", "none")
    cfg = _zero({"offload_param": {}, "offload_optimizer": {}})
    assert cfg.zero.offload_optimizer_device == "none"
    cfg = _zero({"stage": 3, "offload_optimizer": {"device": "cpu", "pipeline_read": True,
                                                   "pipeline_write": False}})
    assert cfg.zero.offload_optimizer_device == "cpu"
    _zero({"stage": 1, "pipeline_loading_checkpoint": False})
    with pytest.raises(ConfigError, match="pipeline_loading_checkpoint=True is not supported"):
        _zero({"stage": 1, "pipeline_loading_checkpoint": True})


def test_sparse_gradients_key_at_stage_0_only():
    assert load_config({"train_batch_size": 1, "sparse_gradients": True}, 1).checked[
        "sparse_gradients"] is True
    with pytest.raises(ConfigError, match="sparse_gradients=true needs zero_optimization.stage=0"):
        load_config({"train_batch_size": 1, "sparse_gradients": True,
                     "zero_optimization": {"stage": 2}}, 1)


def test_deepspeed_optimizer_names_refused_clearly():
    """DeepSpeed's other optimizer names (Lamb, the 1-bit ones, ...) are refused naming the
    key and what is valid."""
    for name in ("Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"):
        with pytest.raises(ConfigError, match=f"optimizer.type='{name}'.*Adam.*AdamW.*SGD"):
            load_config({"train_batch_size": 1, "optimizer": {"type": name}}, 1)


def test_save_checkpoint_exclude_frozen_parameters_must_be_a_bool(world1, tmp_path):
    message = world1.run(_bad_exclude_argument, str(tmp_path))[0]
    assert "exclude_frozen_parameters='yes'" in message and "True or False" in message


def _bad_exclude_argument(tmp):
    engine = _engine(0)
    try:
        engine.save_checkpoint(tmp, exclude_frozen_parameters="yes")
    except ValueError as error:
        return str(error)
    return None


def test_copy_of_config_is_not_mutated():
    cfg = {"train_batch_size": 1, "zero_optimization": {"prefetch_bucket_size": 5}}
    before = copy.deepcopy(cfg)
    load_config(cfg, 1)
    assert cfg == before


def test_comm_imports_as_deepspeed_comm_does():
    """``import deepspeed.comm as dist`` becomes ``import shardkit.comm as dist`` (a fresh
    interpreter: the submodule import itself, not an attribute already loaded)."""
    import subprocess
    import sys
    code = ("import shardkit.comm as dist; import shardkit; "
            "print(dist is shardkit.comm, callable(dist.all_reduce), "
            "callable(dist.init_distributed))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["True", "True", "True"], out.stderr
