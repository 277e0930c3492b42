"""OSS's parameter sync through host shared memory (the CPU default when every rank is on this
machine): the same training as the broadcast sync, bit for bit; ranks keep their own values
until the first step; nothing is left in /dev/shm; clear errors where it cannot apply."""

import glob
import os

import pytest
import torch
import torch.nn.functional as F

from shardkit import distributed
from shardkit.models import MLP
from shardkit.optim import OSS
from shardkit.shared_memory import SHM_DIR
from shardkit.testing import world_fixture

world2 = world_fixture(2)
world4 = world_fixture(4)


def _leftovers() -> list:
    return sorted(glob.glob(os.path.join(SHM_DIR, "shardkit-*")))


def _train(sync_op, seed_per_rank: bool, steps: int = 4) -> dict:
    """Train an MLP with OSS(AdamW) on a per-rank batch (no gradient averaging: each rank's own
    gradients drive the parameters it owns, which makes any mix-up of segments visible)."""
    rank = distributed.get_rank()
    model = MLP(32, 8, out=4, seed=rank if seed_per_rank else 0)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
              bucket_numel=100, sync_op=sync_op)
    before = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "before": before,
            "transport": opt.sync_transport, "buckets": opt.num_buckets}


def _compare_transports():
    shared = _train(None, seed_per_rank=True)
    broadcast = _train("broadcast", seed_per_rank=True)
    untouched = _train(None, seed_per_rank=True, steps=0)
    distributed.barrier()  # rank 0 unlinks the files once every rank has mapped them
    leftovers = _leftovers()
    everyone = distributed.all_gather_object(shared["params"])
    return {"shared": shared, "broadcast": broadcast, "untouched": untouched,
            "leftovers": leftovers, "everyone": everyone, "rank": distributed.get_rank()}


@pytest.fixture(scope="module")
def compared(world2, world4):
    return {2: world2.run(_compare_transports), 4: world4.run(_compare_transports)}


@pytest.mark.parametrize("n", [2, 4])
def test_shared_memory_is_the_cpu_default_and_trains_like_broadcast(compared, n):
    for r in compared[n]:
        assert r["shared"]["transport"] == "shared_memory"
        assert r["broadcast"]["transport"] == "broadcast"
        assert r["shared"]["buckets"] > 1
        for a, b in zip(r["shared"]["params"], r["broadcast"]["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_sees_the_same_parameters_after_a_step(compared, n):
    for r in compared[n]:
        for peer in r["everyone"]:
            for a, b in zip(peer, r["shared"]["params"]):
                assert torch.equal(a, b)


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_keep_their_own_values_until_the_first_step(compared, n):
    # seeds differ per rank: without a step nothing is shared or overwritten
    for r in compared[n]:
        for a, b in zip(r["untouched"]["params"], r["untouched"]["before"]):
            assert torch.equal(a, b)
        assert r["untouched"]["transport"] == "shared_memory"  # allocated, not yet switched


@pytest.mark.parametrize("n", [2, 4])
def test_nothing_is_left_in_dev_shm(compared, n):
    for r in compared[n]:
        assert r["leftovers"] == []


def _dtype_change_error():
    model = MLP(16, 2, out=4, seed=0)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    model.double()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


def test_a_dtype_change_after_the_switch_is_a_clear_error(world2):
    for message in world2.run(_dtype_change_error):
        assert message is not None
        assert "torch.float64" in message and "sync_op='broadcast'" in message


def _explicit_shared_with_fp16():
    model = MLP(16, 2, out=4, seed=0)
    with pytest.raises(ValueError, match="broadcast_fp16"):
        OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, sync_op="shared_memory",
            broadcast_fp16=True)
    return True


def test_shared_memory_with_broadcast_fp16_is_rejected(world2):
    assert all(world2.run(_explicit_shared_with_fp16))


def _without_dev_shm():
    """A machine whose /dev/shm is missing: OSS and FSDP fall back to gloo on every rank."""
    from shardkit import shared_memory, shm_ring
    shared_memory.SHM_DIR = "/nonexistent-shm-dir"
    shm_ring.forget_rings()
    try:
        model = MLP(16, 2, out=4, seed=0)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        ring = shm_ring.ring_for(None, 1024)
        try:
            OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, sync_op="shared_memory")
            explicit = None
        except RuntimeError as err:
            explicit = str(err)
        return opt.sync_transport, ring, explicit
    finally:
        shared_memory.SHM_DIR = "/dev/shm"
        shm_ring.forget_rings()


def test_without_dev_shm_everything_falls_back_to_gloo(world2):
    for transport, ring, explicit in world2.run(_without_dev_shm):
        assert transport == "broadcast" and ring is None
        assert explicit is not None and "sync_op='broadcast'" in explicit
