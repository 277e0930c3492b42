"""FSDP against the ZeRO-3 row of DESIGN.md: per-rank model-state bytes after a step, the
peak of gathered parameters during forward/backward (one or two units, never the model), and
communication per step (3Ψ(N-1)/N with reshard_after_forward, 2Ψ(N-1)/N without)."""

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit import plan
from shardkit.distributed import CommCounter
from shardkit.models import MLP
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
from shardkit.shm_transport import SharedMemoryTransport
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes
from tests.nn.fsdp_common import build_gpt, make_optimizer, train_step, wrap_gpt

WIDTH, DEPTH = 48, 16


world2 = world_fixture(2)


def _mlp_16_units(**kwargs) -> FSDP:
    """The 16-block model: every Linear is a unit, the root owns nothing."""
    return FSDP(auto_wrap(MLP(WIDTH, DEPTH, seed=1), transformer_auto_wrap_policy({nn.Linear}),
                          **kwargs), **kwargs)


def _mlp_step(model, optim, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def _memory_checks():
    n = skdist.get_world_size()
    model = _mlp_16_units()
    units = model.sharded_units()[1:]
    psi = sum(u.unit_numel for u in units)
    padded = sum(u.padded_numel for u in units)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH)
    counter = model.gathered_param_bytes()
    peaks = []
    for step in range(3):
        counter.reset_peak()
        prefetched = counter.prefetched
        out = model(x)
        forward_peak, forward_prefetched = counter.peak, counter.prefetched - prefetched
        counter.reset_peak()
        out.pow(2).mean().backward()
        backward_peak = counter.peak
        backward_prefetched = counter.prefetched - prefetched - forward_prefetched
        live_after_backward = counter.live
        optim.step()
        optim.zero_grad(set_to_none=False)  # keep grads so they are counted
        peaks.append((forward_peak, backward_peak, live_after_backward, forward_prefetched,
                      backward_prefetched))
    state = model_state_bytes(model, optim)
    unit_bytes = max(u.padded_numel for u in units) * 4
    step_tensors = 4 * len(list(model.parameters()))
    return {"psi": psi, "padded": padded, "n": n, "state": state.as_dict(),
            "peaks": peaks, "unit_bytes": unit_bytes, "step_tensors": step_tensors}


def test_memory_follows_zero3(world2):
    for r in world2.run(_memory_checks):
        n, psi = r["n"], r["psi"]
        state = r["state"]
        assert state["params"] == state["grads"] == r["padded"] // n * 4, r
        low = plan.zero_model_state_bytes(psi, n, 3, plan.FP32_ADAMW)  # 16Ψ/N
        high = plan.zero_model_state_bytes(r["padded"], n, 3, plan.FP32_ADAMW)
        assert low <= state["total"] <= high + r["step_tensors"], r
        model_bytes = psi * 4
        for step, (fwd, bwd, live, fwd_prefetched, bwd_prefetched) in enumerate(r["peaks"]):
            # the unit being computed plus the all-gather of the next one (prefetch, or the
            # scratch buffer of its own gather while it is unpacked)
            assert fwd <= 2 * r["unit_bytes"] and bwd <= 2 * r["unit_bytes"], (step, r)
            assert fwd < model_bytes / 4, (step, r)
            assert live == 0, (step, r)
            # the first step records the order; later ones prefetch every unit (the root, which
            # owns no parameter here, issues the first one's gather)
            expected = 0 if step == 0 else DEPTH
            assert fwd_prefetched == bwd_prefetched == expected, (step, r)


def _comm_per_step(reshard: bool, shm: bool):
    n = skdist.get_world_size()
    comm = SharedMemoryTransport(part_bytes=1 << 16) if shm else None
    model = _mlp_16_units(reshard_after_forward=reshard, comm=comm)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, WIDTH)
    _mlp_step(model, optim, x)  # first step records the order
    with CommCounter() as comm_counter:
        _mlp_step(model, optim, x)
    units = model.sharded_units()
    padded = sum(u.padded_numel for u in units)
    psi = sum(u.unit_numel for u in units)
    gpt = wrap_gpt(build_gpt(), reshard_after_forward=reshard, comm=comm)
    gpt_optim = make_optimizer(gpt)
    train_step(gpt, gpt_optim, 0)
    with CommCounter() as gpt_comm:
        train_step(gpt, gpt_optim, 1)
    gpt_units = gpt.sharded_units()
    return {"n": n, "psi": psi, "padded": padded, "elements": comm_counter.elements,
            # each reduce-scatter also carries one use count per parameter, a non-finite flag
            # and the unit's tag (FlatParamShard.start_reduce)
            "counts": n * sum(len(u.params) + 2 for u in units if u.params),
            "by_op": comm_counter.by_op, "calls": comm_counter.calls_by_op,
            "units": len(units) - 1,
            "gpt_bytes": gpt_comm.by_op, "gpt_root": gpt_units[0].padded_numel,
            "gpt_inner": sum(u.padded_numel for u in gpt_units[1:]),
            "gpt_counts": n * sum(len(u.params) + 2 for u in gpt_units if u.params),
            "gpt_root_local": gpt_units[0].local_numel,
            "gpt_inner_local": sum(u.local_numel for u in gpt_units[1:]),
            "describe": gpt.comm.describe()}


@pytest.mark.parametrize("reshard,passes", [(True, 3), (False, 2)])
def test_communication_per_step_over_gloo(world2, reshard, passes):
    """The default transport: one all-gather per unit and pass, one reduce-scatter per unit,
    with the bytes gloo really moves (the gather is sends straight into the peers' parameters,
    so unpadded rows; the reduce-scatter an all_to_all of the padded buffer)."""
    for r in world2.run(_comm_per_step, reshard, False):
        n, frac = r["n"], (r["n"] - 1) / r["n"]
        gathers = passes - 1
        assert r["describe"] == "process group (gloo)"
        assert r["calls"] == {"all_gather": gathers * r["units"],
                              "reduce_scatter": r["units"]}, r
        assert r["by_op"]["all_gather"] == pytest.approx(gathers * r["padded"] * frac * 4)
        assert r["by_op"]["reduce_scatter"] == pytest.approx(
            (r["padded"] + r["counts"]) * frac * 4)
        assert r["elements"] == pytest.approx(passes * r["psi"] * frac, rel=0.02), r
        # GPT: the root (embeddings, head) stays gathered from forward into backward; each rank
        # sends its unpadded rows (the position embedding's shards are padded)
        gpt_gathered = (r["gpt_root_local"] + gathers * r["gpt_inner_local"]) * (n - 1) * 4
        assert r["gpt_bytes"]["all_gather"] == pytest.approx(gpt_gathered), r
        assert r["gpt_bytes"]["reduce_scatter"] == pytest.approx(
            (r["gpt_root"] + r["gpt_inner"] + r["gpt_counts"]) * frac * 4), r


@pytest.mark.parametrize("reshard,passes", [(True, 3), (False, 2)])
def test_communication_per_step_through_shared_memory(world2, reshard, passes):
    """Opted in: the same operations, counted with what each rank writes into the slots (its
    shard once for a gather, its N-1 peers' parts for a reduce-scatter)."""
    for r in world2.run(_comm_per_step, reshard, True):
        n, frac = r["n"], (r["n"] - 1) / r["n"]
        gathers = passes - 1
        assert r["describe"] == "shared memory"
        assert r["calls"] == {"all_gather": gathers * r["units"],
                              "reduce_scatter": r["units"]}, r
        assert r["by_op"]["all_gather"] == pytest.approx(gathers * r["padded"] / n * 4)
        assert r["by_op"]["reduce_scatter"] == pytest.approx(
            (r["padded"] + r["counts"]) * frac * 4)
        assert r["gpt_bytes"]["all_gather"] == pytest.approx(
            (r["gpt_root"] + gathers * r["gpt_inner"]) / n * 4), r
        assert r["gpt_bytes"]["reduce_scatter"] == pytest.approx(
            (r["gpt_root"] + r["gpt_inner"] + r["gpt_counts"]) * frac * 4), r
