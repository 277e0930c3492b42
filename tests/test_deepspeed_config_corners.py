"""DeepSpeed config corners a script hits after ``import shardkit as deepspeed``.

- ``optimizer.type``: DeepSpeed's Adagrad (torch.optim.Adagrad with its parameter names) and
  its fallback to other ``torch.optim`` classes are built, and every type trains like the same
  torch optimizer on one process at ZeRO stages 0-3 (worlds 1 and 2); DeepSpeed's optimizers
  that torch does not provide (Lamb, the 1-bit ones, Lion, mup's, Muon) are refused by name,
  saying what to do instead.
- ``offload_*.device: "nvme"``: refused naming NVMe (CPU offload is provided).
- sparse embedding gradients at stage 0: fp16/bf16's overflow check and ``gradient_clipping``
  (the norm includes the sparse values, as ``clip_grad_norm_`` of the dense gradient would),
  with gradient accumulation.
- sections DeepSpeed reads that have no effect here (``aio``, ``data_efficiency``,
  ``curriculum_learning``, ``compression_training``, ``elasticity``): accepted while off,
  refused by name when switched on.

One world of 1 rank and one of 2 gloo ranks, each started once.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff
from tests.utils.master_weights import fp32_weights

world1 = world_fixture(1)
world2 = world_fixture(2)

WIDTH = 6
LOCAL = 3
STEPS = 3

# (config optimizer section, the torch optimizer it must match on one process)
OPTIMIZERS = [
    ({"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.1}},
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
    ({"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
     lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    ({"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},  # torch's AdamW, wd 0.01
     lambda p: torch.optim.AdamW(p, lr=0.01)),
    ({"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    ({"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.1,
                                    "initial_accumulator_value": 0.1}},
     lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, weight_decay=0.1,
                                   initial_accumulator_value=0.1)),
    ({"type": "adagrad"}, lambda p: torch.optim.Adagrad(p)),  # DeepSpeed's defaults = torch's
    ({"type": "RMSprop", "params": {"lr": 0.01, "momentum": 0.5, "centered": True}},
     lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True)),
    ({"type": "Adamax", "params": {"lr": 0.01}}, lambda p: torch.optim.Adamax(p, lr=0.01)),
    ({"type": "NAdam", "params": {"lr": 0.01, "betas": [0.8, 0.9]}},
     lambda p: torch.optim.NAdam(p, lr=0.01, betas=(0.8, 0.9))),
    ({"type": "RAdam", "params": {"lr": 0.01}}, lambda p: torch.optim.RAdam(p, lr=0.01)),
    ({"type": "Adadelta", "params": {"lr": 0.5}}, lambda p: torch.optim.Adadelta(p, lr=0.5)),
    ({"type": "ASGD", "params": {"lr": 0.05, "t0": 1}},
     lambda p: torch.optim.ASGD(p, lr=0.05, t0=1)),
    ({"type": "Rprop", "params": {"lr": 0.01}}, lambda p: torch.optim.Rprop(p, lr=0.01)),
    ({"type": "Adafactor", "params": {"lr": 0.01}}, lambda p: torch.optim.Adafactor(p, lr=0.01)),
]


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, 8), nn.Tanh(), nn.Linear(8, 4))


def _global_batch(step, world):
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(LOCAL * world, WIDTH, generator=gen), \
        torch.randn(LOCAL * world, 4, generator=gen)


def _optimizer_parity(index, stage):
    """Largest parameter difference after STEPS steps of the config's optimizer at ``stage``
    against its torch optimizer on one process over the global batch."""
    section, build = OPTIMIZERS[index]
    world, rank = distributed.get_world_size(), distributed.get_rank()
    reference = _net()
    engine, *_ = shardkit.initialize(model=_net(), config={
        "train_micro_batch_size_per_gpu": LOCAL, "optimizer": copy.deepcopy(section),
        "zero_optimization": {"stage": stage}})
    torch_optimizer = build(reference.parameters())
    for step in range(STEPS):
        x, y = _global_batch(step, world)
        local = slice(rank * LOCAL, (rank + 1) * LOCAL)
        engine.backward(F.mse_loss(engine(x[local]), y[local]))
        engine.step()
        F.mse_loss(reference(x), y).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    return max_diff(engine.module_state_dict(), reference.state_dict())


def _all_optimizer_parities():
    out = {}
    for index, (section, _) in enumerate(OPTIMIZERS):
        for stage in range(4):
            if section["type"] == "Adafactor" and stage == 3:
                continue  # refused (test_adafactor_refused_at_stage_3)
            out[(section["type"], index, stage)] = _optimizer_parity(index, stage)
    return out


@pytest.mark.parametrize("world", ["world1", "world2"])
def test_every_optimizer_type_trains_like_torch_at_every_stage(world, request):
    results = request.getfixturevalue(world).run(_all_optimizer_parities)
    bad = {key: diff for per_rank in results for key, diff in per_rank.items() if diff > 2e-5}
    assert not bad, f"config optimizers that drift from their torch optimizer: {bad}"
    assert len(results[0]) == 4 * len(OPTIMIZERS) - 1


# ------------------------------------------------------------------- optimizer names refused


@pytest.mark.parametrize("name", ["Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Lion",
                                  "MuAdam", "MuAdamW", "MuSGD", "Muon", "lamb", "LBFGS"])
def test_optimizers_not_provided_are_refused_by_name(name):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "optimizer": {"type": name}}, 1)
    message = str(info.value)
    assert f"optimizer.type={name!r}" in message and "is not provided by shardkit" in message
    assert "initialize(optimizer=" in message and "did you mean" not in message
    assert "'Adam', 'AdamW', 'SGD', 'Adagrad'" in message  # what the config can build


def test_a_misspelt_type_still_gets_a_suggestion():
    with pytest.raises(ConfigError, match=r"optimizer.type='Adagard'.*did you mean 'Adagrad'"):
        load_config({"train_batch_size": 1, "optimizer": {"type": "Adagard"}}, 1)


def test_adagrad_params_are_torch_names_with_torch_defaults():
    spec = load_config({"train_batch_size": 1, "optimizer": {"type": "Adagrad"}}, 1).optimizer
    assert spec.torch_class == "Adagrad"
    assert spec.kwargs == {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0,
                           "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False}
    with pytest.raises(ConfigError, match=r"optimizer.params.eps=-1 is out of range"):
        load_config({"train_batch_size": 1,
                     "optimizer": {"type": "Adagrad", "params": {"eps": -1}}}, 1)
    with pytest.raises(ConfigError, match=r"unknown config key 'optimizer.params.betas'"):
        load_config({"train_batch_size": 1,
                     "optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}}, 1)


def test_torch_optimizer_params_checked_against_the_constructor():
    def cfg(params):
        return {"train_batch_size": 1, "optimizer": {"type": "RMSprop", "params": params}}
    with pytest.raises(ConfigError, match=r"'optimizer.params.momentun'.*did you mean "
                                          r"'optimizer.params.momentum'.*torch.optim.RMSprop"):
        load_config(cfg({"momentun": 0.9}), 1)
    with pytest.raises(ConfigError, match=r"torch.optim.RMSprop refuses them: Invalid learning"):
        load_config(cfg({"lr": -1.0}), 1)
    with pytest.raises(ConfigError, match=r"max_grad_norm.*gradient_clipping"):
        load_config(cfg({"max_grad_norm": 1.0}), 1)


def test_adafactor_refused_at_stage_3():
    base = {"train_batch_size": 1, "optimizer": {"type": "Adafactor"}}
    assert load_config({**base, "zero_optimization": {"stage": 2}}, 1).optimizer.torch_class \
        == "Adafactor"
    with pytest.raises(ConfigError, match=r"Adafactor.*stage 0-2.*whole rows and columns"):
        load_config({**base, "zero_optimization": {"stage": 3}}, 1)


# ---------------------------------------------------------------------------------- nvme


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_nvme_offload_is_refused_naming_nvme(section):
    zero = {"stage": 3, section: {"device": "nvme", "nvme_path": "/local_nvme"}}
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "zero_optimization": zero}, 1)
    message = str(info.value)
    assert f"zero_optimization.{section}.device='nvme'" in message
    assert "NVMe" in message and "not provided" in message and "device='cpu'" in message


def test_nvme_path_beside_cpu_offload_is_accepted():
    cfg = load_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/local_nvme"},
        "offload_optimizer": {"device": "cpu", "nvme_path": None}}}, 1)
    assert cfg.zero.offload_param_device == "cpu" and cfg.zero.offload_optimizer_device == "cpu"


# -------------------------------------------------------------------- other DeepSpeed sections


def test_sections_without_effect_accepted_while_off():
    cfg = load_config({
        "train_batch_size": 1,
        "optimizer": {"type": "AdamW", "legacy_fusion": False},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True, "use_gds": False},
        "data_efficiency": {"enabled": False, "seed": 1,
                            "data_sampling": {"enabled": True, "num_epochs": 1}},
        "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"},
        "compression_training": {"weight_quantization": {
            "shared_parameters": {"enabled": False}}},
        "elasticity": {"enabled": False, "max_train_batch_size": 64,
                       "micro_batch_sizes": [1, 2], "min_gpus": 1, "max_gpus": 8},
        "checkpoint": {"tag_validation": "Fail", "load_universal": False,
                       "use_node_local_storage": False,
                       "parallel_write": {"pipeline_stage": False}},
        "autotuning": {"enabled": False, "fast": True, "metric": "throughput",
                       "arg_mappings": {"train_micro_batch_size_per_gpu": "--mbs"}},
    }, 1)
    assert cfg.warnings == ()
    noted = load_config({"train_batch_size": 1, "compression_training": {
        "sparse_pruning": {"shared_parameters": {"enabled": True}}}}, 1)
    assert any("compression_training has no effect" in n and "init_compression" in n
               for n in noted.warnings)


@pytest.mark.parametrize("section,words", [
    ("data_efficiency", "random-LTD"), ("curriculum_learning", "curriculum"),
    ("elasticity", "GPU count")])
def test_sections_switched_on_are_refused(section, words):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, section: {"enabled": True}}, 1)
    message = str(info.value)
    assert f"{section}.enabled=True is not supported" in message and words in message


@pytest.mark.parametrize("checkpoint,key,words", [
    ({"load_universal": True}, "load_universal", "any world size without conversion"),
    ({"use_node_local_storage": True}, "use_node_local_storage", "every rank can read"),
    ({"parallel_write": {"pipeline_stage": True}}, "parallel_write.pipeline_stage",
     "its own shard files")])
def test_checkpoint_switches_deepspeed_has_are_refused_when_on(checkpoint, key, words):
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 1, "checkpoint": checkpoint}, 1)
    message = str(info.value)
    assert f"checkpoint.{key}=True is not supported" in message and words in message


def test_autotuning_is_refused_when_on_and_its_keys_are_still_checked():
    with pytest.raises(ConfigError, match="autotuning.enabled=True is not supported"):
        load_config({"train_batch_size": 1, "autotuning": {"enabled": True}}, 1)
    with pytest.raises(ConfigError, match="unknown config key 'autotuning.tuner_typ'"):
        load_config({"train_batch_size": 1, "autotuning": {"tuner_typ": "gridsearch"}}, 1)


# ------------------------------------------------------------- sparse gradients at stage 0


class _Sparse(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(4)
        self.emb = nn.Embedding(16, WIDTH, sparse=sparse)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def _ids(step, world):
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randint(0, 16, (LOCAL * world, 5), generator=gen), \
        torch.randn(LOCAL * world, 2, generator=gen)


def _sparse_clip_parity(precision, gas):
    """A sparse embedding at stage 0 with gradient_clipping (the clip binds), ``gas`` micro
    batches a step and ``precision`` ("fp32", or "fp16"/"bf16" under autocast) against a dense
    one on one process, clipped by torch's clip_grad_norm_. Returns the largest difference of
    the engine's fp32 weights (under fp16/bf16 the optimizer's masters of the 16-bit weights;
    the reference starts from the same rounded values), the largest difference of the reported
    norm, and the smallest norm (above 0.05: the clip binds at every step)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": LOCAL, "gradient_accumulation_steps": gas,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "sparse_gradients": True,
              "gradient_clipping": 0.05}
    dtype = None
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
        dtype = torch.float16
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
        dtype = torch.bfloat16
    engine, *_ = shardkit.initialize(model=_Sparse(True), config=config)
    reference = _Sparse(False)
    held = dict(engine.module.named_parameters())
    with torch.no_grad():  # initialize cast the weights to 16 bits; the masters start there
        for name, p in reference.named_parameters():
            p.copy_(p.to(held[name].dtype).float())
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    worst_norm, least_norm = 0.0, float("inf")
    for step in range(STEPS):
        for micro in range(gas):
            ids, y = _ids(step * gas + micro, world)
            local = slice(rank * LOCAL, (rank + 1) * LOCAL)
            engine.backward(F.mse_loss(engine(ids[local]).float(), y[local]))
            engine.step()
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                out = reference(ids)
            (F.mse_loss(out.float(), y) / gas).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        torch_optimizer.step()
        torch_optimizer.zero_grad()
        worst_norm = max(worst_norm, abs(float(engine.get_global_grad_norm()) - float(norm)))
        least_norm = min(least_norm, float(norm))
    return max_diff(fp32_weights(engine), reference.state_dict()), worst_norm, least_norm


def _sparse_overflow_skipped(precision):
    """An inf in one rank's sparse embedding gradient: every rank skips the step (weights
    unchanged), and fp16 halves its loss scale (hysteresis 1)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    config = {"train_micro_batch_size_per_gpu": LOCAL, "sparse_gradients": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
              precision: {"enabled": True}}
    if precision == "fp16":
        config["fp16"].update(initial_scale_power=4, hysteresis=1)
    engine, *_ = shardkit.initialize(model=_Sparse(True), config=config)
    before = copy.deepcopy(engine.module_state_dict())
    ids, y = _ids(0, world)
    local = slice(rank * LOCAL, (rank + 1) * LOCAL)
    engine.backward(F.mse_loss(engine(ids[local]).float(), y[local]))
    weight = engine.module.emb.weight
    assert weight.grad.is_sparse
    if rank == world - 1:
        weight.grad = torch.sparse_coo_tensor(weight.grad._indices(),
                                              torch.full_like(weight.grad._values(), float("inf")),
                                              weight.grad.shape)
    engine.step()
    return (engine.skipped_steps, engine.was_step_applied(), engine.loss_scale,
            max_diff(engine.module_state_dict(), before))


def _sparse_by_hand(torch_backward):
    """A script that calls the model itself (``engine.module(x)``, GAN-style) with a sparse
    embedding: the engine averages the gradients by hand, sparse ones included, and trains as
    one process does (``torch_backward``: ``loss.backward()`` then ``engine.step()``)."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    engine, *_ = shardkit.initialize(model=_Sparse(True), config={
        "train_micro_batch_size_per_gpu": LOCAL, "sparse_gradients": True,
        "optimizer": {"type": "Adagrad", "params": {"lr": 0.1}}})
    reference = _Sparse(False)
    torch_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        ids, y = _ids(step, world)
        local = slice(rank * LOCAL, (rank + 1) * LOCAL)
        loss = F.mse_loss(engine.module(ids[local]), y[local])
        loss.backward() if torch_backward else engine.backward(loss)
        engine.step()
        F.mse_loss(reference(ids), y).backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    return max_diff(engine.module_state_dict(), reference.state_dict())


def _all_sparse_checks():
    return {"clip": [_sparse_clip_parity(p, gas) for p, gas in
                     (("fp32", 1), ("fp32", 2), ("fp16", 2), ("bf16", 1))],
            "overflow": [_sparse_overflow_skipped(p) for p in ("fp16", "bf16")],
            "by_hand": [_sparse_by_hand(torch_backward) for torch_backward in (False, True)]}


@pytest.mark.parametrize("world", ["world1", "world2"])
def test_sparse_gradients_clip_scale_and_overflow_at_stage_0(world, request):
    for out in request.getfixturevalue(world).run(_all_sparse_checks):
        (fp32, fp32_gas, fp16_gas, bf16) = out["clip"]
        assert fp32[0] < 1e-6 and fp32[1] < 1e-6, fp32
        assert fp32_gas[0] < 1e-6 and fp32_gas[1] < 1e-6, fp32_gas
        assert fp16_gas[0] < 1e-4 and fp16_gas[1] < 5e-4, fp16_gas  # 16-bit matmuls
        assert bf16[0] < 1e-3 and bf16[1] < 5e-3, bf16
        assert min(check[2] for check in out["clip"]) > 0.05  # the clip binds
        fp16_skip, bf16_skip = out["overflow"]
        assert fp16_skip == (1, False, 8.0, 0.0), fp16_skip
        assert bf16_skip == (1, False, 1.0, 0.0), bf16_skip
        assert max(out["by_hand"]) < 1e-6, out["by_hand"]
