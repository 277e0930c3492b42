"""all_to_all_single with an argument that does not fit on one rank only, and on a rank outside
its group (review of the ranks' agreement before an all-to-all).

Before: a tensor that is not one, or an output of another dtype than the input, on one rank
raised there only (torch's error, or an AttributeError under shardkit.comm's split sizes), and
the other ranks waited in the agreement or the exchange: a hang. A rank outside the group was
refused with "divisible by world size -1". One world of 2 gloo ranks; each body returns what
every rank saw.
"""

import torch

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=60, failure_grace_s=10)


def _raised(fn) -> str:
    """``"no error"``, or what this rank raised (type and the text before the first "(")."""
    try:
        fn()
    except Exception as error:  # compared across ranks by the test
        return f"{type(error).__name__}: {str(error).split('(')[0]}"
    return "no error"


def _unfit_on_the_last_rank() -> dict:
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    bad = rank == n - 1
    rows, got, split = torch.arange(2.0 * n), torch.zeros(2 * n), [2] * n
    calls = {
        "output of another dtype": lambda: dist.all_to_all_single(
            got.double() if bad else got, rows),
        "output not a tensor": lambda: dist.all_to_all_single(
            got.tolist() if bad else got, rows),
        "input not a tensor": lambda: dist.all_to_all_single(got, "rows" if bad else rows),
        "split: output not a tensor": lambda: dist.all_to_all_single(
            got.tolist() if bad else got, rows, split, split),
        "split: sizes not a list": lambda: dist.all_to_all_single(
            got, rows, 2 * n if bad else split, split),
    }
    seen = {name: _raised(call) for name, call in calls.items()}
    dist.all_to_all_single(got, rows)  # the world still works, and exchanges as torch's
    seen["exchanged"] = got.tolist()
    return seen


def _outside_a_sub_group() -> list:
    group = skdist.new_group([0])  # rank 1 is outside it
    if skdist.get_rank() == 0:
        got = torch.zeros(4)
        skdist.all_to_all_single(got, torch.arange(4.0), group=group)
        return got.tolist()
    # torch skips the op on a non-member, whatever the sizes: nothing to refuse
    return [skdist.all_to_all_single(torch.zeros(3), torch.ones(4), group=group),
            skdist.all_to_all_single(torch.zeros(3), torch.ones(4), group=group, async_op=True)]


def test_all_to_all_single_unfit_on_one_rank_raises_on_every_rank(world2):
    rank0, rank1 = world2.run(_unfit_on_the_last_rank)
    others = "ValueError: all_to_all_single: group rank"
    expected_on_rank1 = {
        "output of another dtype": "ValueError: all_to_all_single: output is torch.float64 and "
                                   "input torch.float32; they must have one dtype",
        "output not a tensor": "TypeError: shardkit.distributed.all_to_all_single",
        "input not a tensor": "TypeError: shardkit.distributed.all_to_all_single",
        "split: output not a tensor": "TypeError: all_to_all_single",
        "split: sizes not a list": "ValueError: all_to_all_single",
    }
    for name, error in expected_on_rank1.items():
        assert rank0[name] == others, (name, rank0[name])
        assert rank1[name] == error, (name, rank1[name])
    assert rank0["exchanged"] == [0.0, 1.0, 0.0, 1.0]
    assert rank1["exchanged"] == [2.0, 3.0, 2.0, 3.0]


def test_all_to_all_single_outside_its_group_takes_no_part(world2):
    inside, outside = world2.run(_outside_a_sub_group)
    assert inside == [0.0, 1.0, 2.0, 3.0]
    assert outside == [None, None]
