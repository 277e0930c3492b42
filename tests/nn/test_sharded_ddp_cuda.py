"""ShardedDataParallel + OSS and ShardedGradScaler with CUDA tensors (skipped without CUDA).

Two gloo ranks share the one GPU of a test machine (NCCL refuses two ranks on one device), so
these check the CUDA side of the wrapper: packing through shardkit.kernels on CUDA tensors
(Triton when it imports), casts for reduce_fp16, and the scaler's CUDA inf checks.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.optim.grad_scaler import ShardedGradScaler
from shardkit.testing import world_fixture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


world2 = world_fixture(2)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4)).cuda()


def _batch(step, rank):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=gen).cuda(), torch.randn(8, 4, generator=gen).cuda()


def _cuda_parity(balanced: bool, reduce_fp16: bool) -> float:
    torch.backends.cuda.matmul.allow_tf32 = False
    rank, n = skdist.get_rank(), skdist.get_world_size()
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = _net()
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    # small buckets give unbalanced owners (one reduce per owner), one large bucket a balanced
    # reduce-scatter: the NCCL transport picks per bucket
    wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=2 ** 23 if balanced
                                  else 4096, reduce_fp16=reduce_fp16)
    worst = 0.0
    for step in range(5):
        ref_opt.zero_grad()
        for r in range(n):
            x, y = _batch(step, r)
            (F.mse_loss(ref(x), y) / n).backward()
        ref_opt.step()
        optimizer.zero_grad()
        x, y = _batch(step, rank)
        F.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        worst = max(worst, max((a - b).abs().max().item()
                               for a, b in zip(ref.parameters(), model.parameters())))
    return worst


@pytest.mark.parametrize("balanced", [False, True])
def test_cuda_parity(world2, balanced):
    assert max(world2.run(_cuda_parity, balanced, False)) <= 1e-5


def test_cuda_parity_fp16_reduction(world2):
    assert max(world2.run(_cuda_parity, False, True)) <= 2e-3


def _cuda_scaler_skip() -> list:
    rank = skdist.get_rank()
    model = _net()
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    wrapped = ShardedDataParallel(model, optimizer)
    scaler = ShardedGradScaler("cuda", init_scale=2.0 ** 10)
    before = [p.detach().clone() for p in model.parameters()]
    out = []
    for poison in (True, False):
        optimizer.zero_grad()
        x, y = _batch(0, rank)
        if poison and rank == 1:
            x[0, 0] = float("inf")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(wrapped(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        out.append((all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
                    scaler.get_scale()))
    return out


def test_cuda_grad_scaler_skips_on_every_rank(world2):
    assert world2.run(_cuda_scaler_skip) == [[(True, 512.0), (False, 512.0)]] * 2
