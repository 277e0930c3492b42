"""``shardkit.initialize`` at ZeRO stage 3 with ``bf16``/``fp16``: what goes on the wire.

DeepSpeed's ZeRO-3 gathers 16-bit parameters and reduce-scatters 16-bit gradients (or
``communication_data_type``'s dtype) while the optimizer steps fp32 master partitions. The
engine used to cast the model to fp32 and compute under autocast, so FSDP moved fp32: twice
DeepSpeed's bytes. Now FSDP's mixed-precision policy gathers the 16-bit dtype from fp32 shards
(the masters). Checked in one world of 2 gloo ranks: bytes per step against
``python -m shardkit plan --mixed-precision``'s stage-3 figure, the reduction dtype
``communication_data_type`` names, parity with one process, fp16's overflow skip, checkpoints of
fp32 masters and the model-state memory formula.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed, plan
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes
from tests.utils.master_weights import fp32_weights, master_dtype

WIDTH = 32
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
LR = 1e-3

world2 = world_fixture(2)


class Block(nn.Module):
    """A residual block: one FSDP unit under the engine's default wrap policy."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc(torch.relu(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _model():
    torch.manual_seed(0)
    return Net()


ADAMW = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
# linear in the gradients: a rounding shows as its own size (AdamW turns a near-zero gradient
# whose sign a rounding flips into a whole step of lr either way)
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}


def _config(precision, optimizer=ADAMW, **extra):
    cfg = {"train_batch_size": 2 * distributed.get_world_size(), "steps_per_print": 1000,
           "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "optimizer": optimizer}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if precision == "fp16":  # a scale the first steps do not overflow
        cfg["fp16"]["initial_scale_power"] = 8
    return {**cfg, **extra}


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, 16, generator=gen), torch.randint(0, 8, (2,), generator=gen)


def _train_step(engine, step):
    x, y = _batch(step, distributed.get_rank())
    engine.backward(F.cross_entropy(engine(x).float(), y))
    engine.step()


def _plan_bytes(width: int, reduce_width: int) -> float:
    """The plan's stage-3 bytes per step (``plan --mixed-precision`` when both widths are 2):
    two gathers of every unit but the root's one, one reduce-scatter."""
    model, world = _model(), distributed.get_world_size()
    psi = sum(p.numel() for p in model.parameters())
    root = sum(p.numel() for m in (model.inp, model.head) for p in m.parameters())
    gathers = plan.zero_comm_elements_per_step(psi, world, 3, root_params=root, trainable=0,
                                               grad_unit_params=0)
    reduced = plan.zero_comm_elements_per_step(psi, world, 3, root_params=root) - gathers
    return gathers * width + reduced * reduce_width


def _step_bytes(precision, comm_dtype, width, reduce_width):
    """The bytes one rank moves by op during its second step (the first builds state), the
    plan's gathers and its whole step."""
    extra = {} if comm_dtype is None else {"communication_data_type": comm_dtype}
    engine, *_ = shardkit.initialize(model=_model(), config=_config(precision, **extra))
    _train_step(engine, 0)
    with distributed.CommCounter() as counter:
        _train_step(engine, 1)
    return dict(counter.by_op), _plan_bytes(width, 0), _plan_bytes(width, reduce_width)


@pytest.mark.parametrize("precision, comm_dtype, width, reduce_width",
                         [("bf16", None, 2, 2), ("fp16", None, 2, 2), ("fp32", None, 4, 4),
                          ("bf16", "fp32", 2, 4), ("fp16", "fp16", 2, 2)])
def test_stage3_moves_the_16bit_dtype(world2, precision, comm_dtype, width, reduce_width):
    """Gathers in the 16-bit dtype and the reduce-scatter in it too (or in
    ``communication_data_type``), the plan's figure within 5%; fp32 training unchanged. It
    used to move fp32 (twice the bytes) whatever the precision."""
    for by_op, gathered, expected in world2.run(_step_bytes, precision, comm_dtype, width,
                                                reduce_width):
        assert gathered > 0 and expected > gathered
        assert by_op["all_gather"] == pytest.approx(gathered, rel=0.05), by_op
        assert by_op["reduce_scatter"] == pytest.approx(expected - gathered, rel=0.05), by_op
        assert sum(by_op.values()) == pytest.approx(expected, rel=0.05), by_op


def _reference_step(masters, oracle, x, y, half):
    """One process, DeepSpeed's ZeRO-3 numerics on the whole batch: a 16-bit copy of the fp32
    masters computes (autocast as the engine's), its gradients widened onto the masters,
    clipped, stepped by the fp32 optimizer."""
    low = copy.deepcopy(masters).to(half)
    with torch.autocast("cpu", dtype=half):
        loss = F.cross_entropy(low(x.to(half)).float(), y)
    loss.backward()
    for master, p in zip(masters.parameters(), low.parameters()):
        master.grad = p.grad.float()
    torch.nn.utils.clip_grad_norm_(masters.parameters(), 1.0)
    oracle.step()
    oracle.zero_grad()


def _parity(precision, steps=3):
    """``steps`` steps against one process (:func:`_reference_step`): the largest weight
    difference, and the largest distance a weight of the reference moved."""
    half, world = HALF[precision], distributed.get_world_size()
    engine, *_ = shardkit.initialize(model=_model(), config=_config(precision, SGD))
    reference = _model()
    oracle = torch.optim.SGD(reference.parameters(), **SGD["params"])
    for step in range(steps):
        _train_step(engine, step)
        parts = [_batch(step, r) for r in range(world)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        _reference_step(reference, oracle, x, y, half)
    weights = fp32_weights(engine)
    diff = max((weights[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    start = _model().state_dict()
    moved = max((start[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    dtypes = sorted({str(w.dtype) for w in weights.values()})
    return diff, moved, dtypes, str(master_dtype(engine)), engine.global_steps


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_stage3_16bit_training_matches_one_process(world2, precision):
    """Three SGD steps (lr 0.1) against one process computing in the 16-bit dtype from
    fp32 masters: what is left is the 16-bit sum of the two ranks' gradients (the reference
    sums inside its backward), about one 16-bit rounding of the weights' movement (measured:
    0.4% of it under bf16, 0.06% under fp16)."""
    eps = torch.finfo(HALF[precision]).eps
    for diff, moved, dtypes, master, steps in world2.run(_parity, precision):
        assert diff < 2 * eps * moved, (diff, moved)
        assert dtypes == ["torch.float32"] and master == "torch.float32"
        assert steps == 3


def _overflow_on_one_rank():
    """fp16: rank 1's input overflows fp16 on its way in; every rank skips the step."""
    engine, *_ = shardkit.initialize(model=_model(), config=_config("fp16"))
    _train_step(engine, 0)
    before = {k: v.clone() for k, v in fp32_weights(engine).items()}
    x, y = _batch(1, distributed.get_rank())
    if distributed.get_rank() == 1:
        x = x * 1e6  # beyond fp16's 65504 once cast to the gathered dtype
    engine.backward(F.cross_entropy(engine(x).float(), y))
    engine.step()
    after = fp32_weights(engine)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return unchanged, engine.skipped_steps


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(world2):
    for unchanged, skipped in world2.run(_overflow_on_one_rank):
        assert unchanged and skipped == 1


def _round_trip(precision, path):
    """Two steps, save, load into an engine built from other weights: the fp32 masters come
    back exactly, and the next step matches the saving engine's."""
    engine, *_ = shardkit.initialize(model=_model(), config=_config(precision))
    for step in range(2):
        _train_step(engine, step)
    engine.save_checkpoint(path, tag="t")
    saved = {k: v.clone() for k, v in fp32_weights(engine).items()}
    torch.manual_seed(7)
    fresh, *_ = shardkit.initialize(model=Net(), config=_config(precision))
    fresh.load_checkpoint(path, tag="t")
    loaded = fp32_weights(fresh)
    exact = all(torch.equal(saved[k], loaded[k]) for k in saved)
    _train_step(engine, 2)
    _train_step(fresh, 2)
    same_next = all(torch.equal(a, b) for a, b in
                    zip(fp32_weights(engine).values(), fp32_weights(fresh).values()))
    return exact, same_next, str(master_dtype(fresh))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_checkpoint_round_trip_keeps_fp32_masters(world2, tmp_path, precision):
    for exact, same_next, master in world2.run(_round_trip, precision, str(tmp_path)):
        assert exact and same_next and master == "torch.float32"


def _memory(precision):
    """Model-state bytes after a step (gradients held): fp32 shards, gradient shards and
    AdamW's state, 16Ψ/N with Ψ padded per unit, plus AdamW's 4-byte step per shard."""
    engine, *_ = shardkit.initialize(model=_model(), config=_config(precision))
    x, y = _batch(0, distributed.get_rank())
    engine.backward(F.cross_entropy(engine(x).float(), y))
    engine.step()
    engine.backward(F.cross_entropy(engine(x).float(), y))
    shards = [p for g in engine.optimizer.param_groups for p in g["params"]]
    padded = sum(p.numel() for p in shards) * distributed.get_world_size()
    formula = plan.zero_model_state_bytes(padded, distributed.get_world_size(), 3,
                                          plan.precision_for("adamw", mixed_precision=True))
    return model_state_bytes(engine).total, formula + 4 * len(shards)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_model_state_memory_is_the_formula(world2, precision):
    for measured, formula in world2.run(_memory, precision):
        assert measured == pytest.approx(formula, rel=0.01)


class NormNet(nn.Module):
    """A BatchNorm (running statistics) and a plain fp32 buffer scaling the activations."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
                                     for _ in range(2)])
        self.head = nn.Linear(16, 8)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.scale)


def _buffers(precision, path):
    """Two steps of a model with BatchNorm statistics and an fp32 buffer, then a checkpoint
    round trip: the dtypes the buffers are held in and whether the fp32 one came back exact."""
    torch.manual_seed(0)
    model = NormNet()
    scale = model.scale.clone()
    engine, *_ = shardkit.initialize(model=model, config=_config(precision))
    for step in range(2):
        _train_step(engine, step)
    engine.save_checkpoint(path, tag="t")
    torch.manual_seed(3)
    fresh, *_ = shardkit.initialize(model=NormNet(), config=_config(precision))
    fresh.load_checkpoint(path, tag="t")
    stats = model.blocks[0][1].running_mean
    return (str(stats.dtype), str(model.scale.dtype), torch.equal(model.scale, scale),
            torch.equal(fresh.module.scale, scale), bool(stats.abs().sum() > 0))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_buffers_keep_their_dtype_but_batchnorm_statistics_follow_the_weights(
        world2, tmp_path, precision):
    """As DeepSpeed: buffers keep their dtype (an fp32 buffer stays exact, checkpoints too),
    while BatchNorm's statistics are cast with the 16-bit weights FSDP gathers (torch's
    batch_norm refuses 16-bit weights beside fp32 statistics)."""
    for stats, scale, kept, loaded, updated in world2.run(_buffers, precision, str(tmp_path)):
        assert stats == str(HALF[precision]) and scale == "torch.float32"
        assert kept and loaded and updated
