"""OSS.overlap_sync_with(model): the parameter sync of a step runs on into the next forward,
each module waiting only for its own buckets; evaluation, state_dict() and wait_for_sync() never
see stale weights. Parity with single-process training at every step, on every rank, under torch
DDP and ShardedDDP (stepping after backward, or inside it: ShardedDDP(step_in_backward=True),
comm_hooks.step_oss_in_ddp_backward), worlds 2 and 4."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import MLP, world_fixture

world2 = world_fixture(2)
world4 = world_fixture(4)
STEPS = 6


def _batch(step, world):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 32, generator=gen), torch.randn(4 * world, 32, generator=gen)


def _train(wrapper: str):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    oracle, model = MLP(32, 4, seed=0), MLP(32, 4, seed=0)
    ref = torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, bucket_numel=700)
    if wrapper == "ddp":
        wrapped = DDP(model)
    elif wrapper == "ddp_step_in_backward":  # torch DDP's comm hook steps OSS's buckets
        from shardkit.comm_hooks import step_oss_in_ddp_backward
        wrapped = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.01)
        step_oss_in_ddp_backward(wrapped, opt)
    else:  # "sharded", or "sharded_step_in_backward": the sync starts inside backward
        wrapped = ShardedDataParallel(model, opt, reduce_buffer_size=4096,
                                      step_in_backward=wrapper == "sharded_step_in_backward")
    if not wrapper.endswith("step_in_backward"):
        opt.overlap_sync_with(wrapped)
    worst = {"eval": 0.0, "state_dict": 0.0, "waited": 0.0}
    pending_seen = 0
    for step in range(STEPS):
        x, y = _batch(step, world)
        local = slice(rank * 4, (rank + 1) * 4)
        ref.zero_grad()
        F.mse_loss(oracle(x), y).backward()
        ref.step()
        opt.zero_grad()
        F.mse_loss(wrapped(x[local]), y[local]).backward()
        opt.step()
        pending_seen += int(opt.sync_in_flight > 0)
        probe = torch.randn(3, 32, generator=torch.Generator().manual_seed(100 + step))
        if step % 3 == 0:  # an evaluation right after the step: each module waits for its own
            with torch.no_grad():
                worst["eval"] = max(worst["eval"],
                                    (model(probe) - oracle(probe)).abs().max().item())
        elif step % 3 == 1:  # a checkpoint right after the step
            sd = wrapped.state_dict()
            ref_sd = oracle.state_dict()
            worst["state_dict"] = max(worst["state_dict"], max(
                (v - ref_sd[k.replace("module.", "", 1)]).abs().max().item()
                for k, v in sd.items()))
        opt.wait_for_sync()  # reading parameters directly: wait first
        worst["waited"] = max(worst["waited"], max(
            (p - q).abs().max().item() for p, q in zip(model.parameters(), oracle.parameters())))
    return worst, pending_seen


@pytest.mark.parametrize("wrapper", ["ddp", "sharded", "sharded_step_in_backward",
                                     "ddp_step_in_backward"])
@pytest.mark.parametrize("n", [2, 4])
def test_overlapped_sync_matches_single_process(world2, world4, wrapper, n):
    world = world2 if n == 2 else world4
    for worst, pending_seen in world.run(_train, wrapper):
        assert pending_seen == STEPS  # the sync really was left in flight after every step
        for what, diff in worst.items():
            assert diff <= 1e-5, (what, diff)


def _bad_module():
    opt = OSS(MLP(8, 2).parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="overlap_sync_with"):
        opt.overlap_sync_with("model")
    return True


def test_overlap_sync_with_needs_a_module(world2):
    assert all(world2.run(_bad_module))
