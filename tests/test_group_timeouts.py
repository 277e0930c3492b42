"""Process groups shardkit creates inherit the job's timeout: torch's ``new_group`` takes its
backend's 30-minute default, so before, a rank that died in a subgroup's collective (an FSDP
hybrid block, a node group of the hierarchical reductions, a tensor-parallel group built
without ``timeout_s``) left its peers waiting half an hour instead of the timeout the job set
in ``init_distributed`` / ``init_process_group``."""

import datetime

import torch.distributed as dist

from shardkit import distributed
from shardkit.testing import world_fixture

world4 = world_fixture(4)


def _timeouts() -> dict:
    world = distributed.timeout_of(None)
    plain = distributed.new_group([0, 1, 2, 3])
    pair = None
    for ranks in ([0, 1], [2, 3]):  # every rank creates both, as new_group requires
        created = distributed.new_group(ranks)
        pair = created if distributed.get_rank() in ranks else pair
    explicit = distributed.new_group([0, 1, 2, 3], timeout_s=7.0)
    torch_own = dist.new_group([0, 1, 2, 3], timeout=datetime.timedelta(seconds=9))
    return {"world": world, "plain": distributed.timeout_of(plain),
            "pair": distributed.timeout_of(pair), "explicit": distributed.timeout_of(explicit),
            "torch_own": distributed.timeout_of(torch_own)}


def test_new_groups_take_the_default_groups_timeout(world4):
    for r in world4.run(_timeouts):
        assert r["world"] is not None and r["world"] < 30 * 60, r
        assert r["plain"] == r["world"] and r["pair"] == r["world"], r
        assert r["explicit"] == 7.0 and r["torch_own"] == 9.0, r
