"""Compressed DDP comm hooks under torch DDP + OSS, in one world of 2 gloo ranks: gradients and
trained weights against fp32 DDP, and the bytes CommCounter sees against fp32's."""

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.comm_hooks import (QuantizedHookState, bf16_allreduce_hook,
                                 counted_allreduce_hook, fp16_allreduce_hook,
                                 quantized_allreduce_hook)
from shardkit.optim import OSS
from shardkit.quantized_comm import wire_bytes
from shardkit.testing import world_fixture

world2 = world_fixture(2)
HOOKS = {"fp32": (None, counted_allreduce_hook), "bf16": (None, bf16_allreduce_hook),
         "fp16": (None, fp16_allreduce_hook),
         "int8": (QuantizedHookState(bits=8), quantized_allreduce_hook),
         "int4": (QuantizedHookState(bits=4, block=64), quantized_allreduce_hook)}


def _train(hook: str, steps: int = 3):
    """A small MLP under torch DDP with ``hook``, stepped by OSS(SGD); per step: the averaged
    gradients, the bytes and (op, dtype) of the collectives backward issued."""
    from torch.nn.parallel import DistributedDataParallel

    rank = skdist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = DistributedDataParallel(model)
    state, fn = HOOKS[hook]
    ddp.register_comm_hook(state, fn)
    optimizer = OSS(ddp.parameters(), optim=torch.optim.SGD, lr=0.1)
    records = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        with skdist.CommCounter() as comm:
            ddp(x).pow(2).mean().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        records.append((grads, comm.bytes, sorted({(c.op, c.dtype) for c in comm.calls})))
        optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return records, weights


def _run_all():
    return {name: _train(name) for name in HOOKS}


@pytest.fixture(scope="module")
def runs(world2):
    return world2.run(_run_all)


RELATIVE_ERROR = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10, "int8": 3 / 127, "int4": 3 / 7}
WIRE = {"int8": 8 / 32 + 1 / 256, "int4": 4 / 32 + 1 / 64}  # x fp32, before padding


@pytest.mark.parametrize("hook", ["bf16", "fp16", "int8", "int4"])
def test_compressed_hook_matches_fp32_ddp_within_its_precision(runs, hook):
    for rank_runs in runs:
        (reference, ref_weights), (records, weights) = rank_runs["fp32"], rank_runs[hook]
        grads, ref_grads = records[0][0], reference[0][0]  # step 0: the same weights
        scale = ref_grads.abs().max()
        err = (grads - ref_grads).abs().max()
        assert err <= RELATIVE_ERROR[hook] * scale, (hook, float(err / scale))
        assert err > 0, "the gradients really travelled compressed"
        assert torch.allclose(weights, ref_weights, atol=0.05 * float(ref_weights.abs().max()))
    assert torch.equal(runs[0][hook][1], runs[1][hook][1]), "ranks stay in sync"


@pytest.mark.parametrize("hook", ["bf16", "fp16", "int8", "int4"])
def test_compressed_hook_bytes(runs, hook):
    for rank_runs in runs:
        fp32_bytes = rank_runs["fp32"][0][0][1]
        records = rank_runs[hook][0]
        for _, nbytes, ops in records:
            if hook in ("bf16", "fp16"):
                dtype = torch.bfloat16 if hook == "bf16" else torch.float16
                assert ops == [("all_reduce", dtype)]
                assert nbytes == fp32_bytes / 2
            else:
                assert ops == [("all_gather", torch.uint8), ("all_to_all", torch.uint8)]
                state = HOOKS[hook][0]
                psi = int(fp32_bytes / 4)  # one bucket of all the gradients, N = 2
                per_op = wire_bytes(-(-psi // 2), 2, bits=state.bits, block=state.block)
                assert nbytes == 2 * per_op, "a quantized reduce-scatter and all-gather"
                assert nbytes <= WIRE[hook] * fp32_bytes * (1 + state.block / (psi / 2))
