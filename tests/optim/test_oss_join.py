"""OSS under ``torch.distributed.algorithms.join.Join`` (uneven numbers of batches per rank), as
torch's ``ZeroRedundancyOptimizer``: the ranks that run out of batches shadow the others'
steps, and every rank ends with the parameters ZeroRedundancyOptimizer gives in the same
script (plain DDP all-reduce and shardkit's ``reduce_to_owners_hook``); with
``throw_on_early_termination=True`` every rank stops at the shortest rank's end, alike.

One world of 2 gloo ranks for the module.
"""

import torch
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.comm_hooks import reduce_to_owners_hook
from shardkit.optim import OSS
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _build(variant: str):
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    if variant == "zero":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                            lr=0.01)
    opt = OSS(ddp.parameters(), optim=torch.optim.Adam, lr=0.01)
    if variant == "oss_owners_hook":
        ddp.register_comm_hook(opt, reduce_to_owners_hook)
    return ddp, opt


def _train_uneven(variant: str, throw: bool):
    """Rank r runs 3 + 2r batches inside ``Join([ddp, optimizer])``; returns the parameters
    and how many steps this rank ran."""
    rank = distributed.get_rank()
    ddp, opt = _build(variant)
    g = torch.Generator().manual_seed(rank)
    steps = 0
    try:
        with Join([ddp, opt], throw_on_early_termination=throw):
            for _ in range(3 + 2 * rank):
                opt.zero_grad()
                ddp(torch.randn(4, 4, generator=g)).sum().backward()
                opt.step()
                steps += 1
    except RuntimeError as error:  # throw_on_early_termination: every rank, alike
        if "exhausted" not in str(error):
            raise
    if hasattr(opt, "wait_for_sync"):
        opt.wait_for_sync()
    return [p.detach().clone() for p in ddp.parameters()], steps


def _compare_with_zero():
    out = {}
    for throw in (False, True):
        zero, zero_steps = _train_uneven("zero", throw)
        for variant in ("oss", "oss_owners_hook"):
            params, steps = _train_uneven(variant, throw)
            out[(variant, throw)] = (max(float((a - b).abs().max())
                                         for a, b in zip(params, zero)), steps, zero_steps)
    return out


def test_uneven_batches_under_join_end_as_zero_redundancy_optimizer(world2):
    for rank, out in enumerate(world2.run(_compare_with_zero)):
        for (variant, throw), (diff, steps, zero_steps) in out.items():
            # OSS picks torch's fused Adam for its shard: rounding apart
            assert diff <= 1e-6, (rank, variant, throw, diff)
            assert steps == zero_steps == (3 if throw else 3 + 2 * rank), (rank, variant, steps)
