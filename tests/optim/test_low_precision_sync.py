"""16-bit communication for ZeRO stages 1-2, in one world of 2 gloo ranks: OSS's parameter sync
with ``broadcast_fp16`` (``True`` = fp16, or ``torch.bfloat16``) and ShardedDataParallel's
gradient reduction with ``reduce_fp16`` (``True`` = fp16, or ``torch.bfloat16``).

Checked: training stays within 16-bit tolerance of a single-process oracle at every step (and
really differs from fp32 communication, so the option took effect), ``CommCounter`` sees the
16-bit dtype on the wire and half the bytes of the fp32 run, and bad values raise a clear error
before any collective.
"""

import pytest
import torch
import torch.nn.functional as F

from shardkit import distributed
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import MLP, world_fixture

STEPS = 8
LOCAL_BATCH = 4
WIDTH = 32
LR = 1e-2
# One 16-bit rounding is within 2^-9 (bf16) or 2^-12 (fp16) relative, but AdamW moves a weight
# by about lr whatever its gradient's size, so where a gradient is near zero its rounding can
# change that step by up to ~lr. Measured worst over 8 steps at lr 1e-2: bf16 3e-3 (stage 1),
# 1.0e-2 (stage 2); fp16 3e-4 / 2e-4; fp32 1e-7.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2.5 * LR}
WIRE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

world2 = world_fixture(2)


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(50 + step)
    return (torch.randn(LOCAL_BATCH * world, WIDTH, generator=gen),
            torch.randn(LOCAL_BATCH * world, 6, generator=gen))


def _max_diff(a, b) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _flag(name: str):
    """The constructor value meaning ``name`` on the wire (``True`` keeps FairScale's fp16)."""
    return {"fp32": False, "fp16": True, "bf16": torch.bfloat16}[name]


def _train(stage: int, wire: str, assigned: bool = False) -> dict:
    """Stage 1 (DDP-style all-reduced gradients + OSS) or 2 (ShardedDDP + OSS) with ``wire``
    communication against a single-process AdamW; worst parameter difference over the steps,
    and what CommCounter saw per step in the op that the option narrows. ``assigned``: OSS is
    built with an fp32 sync and ``opt.broadcast_fp16`` is set afterwards (as Lightning does)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    oracle, model = MLP(WIDTH, depth=4, out=6, seed=3), MLP(WIDTH, depth=4, out=6, seed=3)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=LR)
    sync = _flag(wire) if stage == 1 else False
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR,
              broadcast_fp16=False if assigned else sync)
    if assigned:
        opt.broadcast_fp16 = sync
    net = model
    if stage == 2:
        net = ShardedDataParallel(model, opt, reduce_fp16=_flag(wire))
    narrowed = ("all_gather",) if stage == 1 else ("reduce", "reduce_scatter")
    worst, wire_bytes, dtypes = 0.0, 0.0, set()
    for step in range(STEPS):
        x, y = _batch(step, world)
        ref_opt.zero_grad()
        F.mse_loss(oracle(x), y).backward()
        ref_opt.step()
        local = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        with distributed.CommCounter() as comm:
            opt.zero_grad()
            F.mse_loss(net(x[local]), y[local]).backward()
            if stage == 1:  # what DDP does: average the full gradients everywhere
                for p in model.parameters():
                    distributed.all_reduce(p.grad)
                    p.grad /= world
            opt.step()
        calls = [c for c in comm.calls if c.op in narrowed]
        wire_bytes = sum(c.bytes for c in calls)
        dtypes |= {str(c.dtype) for c in calls}
        worst = max(worst, _max_diff(model, oracle))
    return {"worst": worst, "wire_bytes": wire_bytes, "dtypes": sorted(dtypes)}


def _all_runs() -> dict:
    runs = {(stage, wire): _train(stage, wire) for stage in (1, 2) for wire in WIRE}
    runs[(1, "fp16 assigned")] = _train(1, "fp16", assigned=True)
    return runs


@pytest.fixture(scope="module")
def runs(world2):
    return world2.run(_all_runs)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("wire", sorted(WIRE))
def test_parity_within_the_wire_dtype_tolerance(runs, stage, wire):
    for rank, r in enumerate(runs):
        worst = r[(stage, wire)]["worst"]
        assert worst <= TOL[WIRE[wire]], (rank, stage, wire, worst)
        if wire != "fp32":  # the 16-bit wire really rounded something
            assert worst > r[(stage, "fp32")]["worst"], (rank, stage, wire, r)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
def test_16_bit_wire_halves_the_counted_bytes(runs, stage, wire):
    for rank, r in enumerate(runs):
        fp32, narrow = r[(stage, "fp32")], r[(stage, wire)]
        assert fp32["dtypes"] == ["torch.float32"], (rank, fp32)
        assert narrow["dtypes"] == [str(WIRE[wire])], (rank, narrow)
        assert narrow["wire_bytes"] == pytest.approx(fp32["wire_bytes"] / 2, rel=1e-6), (
            rank, stage, wire, narrow["wire_bytes"], fp32["wire_bytes"])


def test_broadcast_fp16_assigned_after_construction_takes_effect(runs):
    """FairScale reads ``broadcast_fp16`` at each sync; Lightning sets it after building OSS."""
    for rank, r in enumerate(runs):
        assert r[(1, "fp16 assigned")] == r[(1, "fp16")], (rank, r[(1, "fp16 assigned")])


@pytest.mark.parametrize("bad", ["bf16", torch.int8, 2])
def test_bad_broadcast_dtype_is_a_clear_error(bad):
    """Checked before OSS needs a process group (this test process has none)."""
    params = list(torch.nn.Linear(4, 3).parameters())
    with pytest.raises(ValueError, match=r"OSS\(broadcast_fp16=.*must be True or False .*"
                                         r"torch.bfloat16"):
        OSS(params, optim=torch.optim.SGD, lr=0.1, broadcast_fp16=bad)
