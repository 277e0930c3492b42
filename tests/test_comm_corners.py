"""shardkit.comm / shardkit.distributed corners a torch.distributed or DeepSpeed user meets.

Lists that differ between ranks in ``all_reduce_coalesced`` (summed across the wrong tensors
silently, or gloo aborted a process), ``all_to_all_single`` with split sizes on some ranks only
(a hang), ranks outside a sub-group (a nonsense size error, ops counted that were never sent),
torch's default-style groups (``"cpu:gloo"``: ``monitored_barrier`` refused, the transport's
reduce-scatter handle never read completed), and ``monitored_barrier``'s default timeout (torch's
30 minutes, not the group's), and ``all_to_all_single`` with an argument that does not fit on
one rank only (a tensor that is not one, an output of another dtype: raised there only, the
others hung) or on a rank outside its group. One world of 2 gloo ranks; each body returns what
every rank saw.
"""

import datetime
import time

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90, failure_grace_s=20)


def _raised(fn) -> str:
    """``"no error"``, or what this rank raised (type and the text before the first "(")."""
    try:
        fn()
    except Exception as error:  # compared across ranks by the test
        return f"{type(error).__name__}: {str(error).split('(')[0]}"
    return "no error"


# ---------------------------------------------------------------------- rank-side bodies


def _coalesced_lists_that_differ() -> list:
    import shardkit.comm as dist
    rank = dist.get_rank()
    by_rank = {  # rank 0's list, rank 1's list
        "shapes swapped": ([torch.ones(3), torch.ones(2)], [torch.ones(2), torch.ones(3)]),
        "one tensor more": ([torch.ones(3), torch.ones(2)], [torch.ones(3)]),
        "another dtype": ([torch.ones(3), torch.ones(2)],
                          [torch.ones(3), torch.ones(2, dtype=torch.float64)]),
        "empty on one rank": ([torch.ones(3)], []),
    }
    seen = {name: _raised(lambda lists=lists: dist.all_reduce_coalesced(lists[rank]))
            for name, lists in by_rank.items()}
    op = dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM
    seen["another op"] = _raised(lambda: dist.all_reduce_coalesced([torch.ones(2)], op=op))
    seen["not tensors on one rank"] = _raised(
        lambda: dist.all_reduce_coalesced([torch.ones(2)] if rank else [1.0, 2.0]))
    # the world still works, and matching lists of mixed shapes and dtypes sum as one process
    a, b = torch.full((2, 3), rank + 1.0), torch.arange(4) * (rank + 1)
    dist.all_reduce_coalesced([a, b])
    seen["sums"] = (a.tolist(), b.tolist())
    return sorted(seen.items())


def _all_to_all_splits_on_some_ranks() -> list:
    import shardkit.comm as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = torch.arange(4.0) + 10 * rank
    got = torch.zeros(4)
    seen = [
        _raised(lambda: dist.all_to_all_single(got, rows, output_split_sizes=[2] * n,
                                               input_split_sizes=[2] * n)
                if rank == 0 else dist.all_to_all_single(got, rows)),
        _raised(lambda: dist.all_to_all_single(got, rows) if rank == 0 else
                dist.all_to_all_single(got, rows, [1, 3], [1, 3])),
        # the plain form, with as many elements on each rank as the other expects none of
        _raised(lambda: dist.all_to_all_single(torch.zeros(2 + 2 * rank),
                                               torch.ones(2 + 2 * rank))),
        # a size that does not fit on one rank only
        _raised(lambda: dist.all_to_all_single(torch.zeros(3 if rank else 4), rows)),
    ]
    dist.all_to_all_single(got, rows)  # the world still works, and exchanges as torch's
    return seen + [got.tolist()]


def _outside_a_sub_group() -> dict:
    from shardkit.distributed import CommCounter
    group = skdist.new_group([0])  # rank 1 is outside it
    t = torch.ones(4)
    with CommCounter() as counted:
        returned = [
            skdist.all_gather_into_tensor(torch.zeros(4), t, group=group),
            skdist.reduce_scatter_tensor(torch.zeros(4), t, group=group),
        ]
        skdist.all_reduce(t, group=group)
        skdist.broadcast(t, src=0, group=group)
        skdist.all_to_all_single(torch.zeros(4), t, group=group)
        skdist.barrier(group)
    return {"returned": [r is None for r in returned], "counted": counted.calls_by_op}


def _monitored_barrier_on_a_default_style_group() -> list:
    group = skdist.new_group([0, 1], backend="cpu:gloo")
    skdist.monitored_barrier(group, timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    skdist.monitored_barrier(group)
    return [skdist.backend_of(group), "passed"]


def _transport_on_a_default_style_group() -> list:
    from shardkit.transport import ProcessGroupTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    group = skdist.new_group([0, 1], backend="cpu:gloo")
    transport = ProcessGroupTransport()
    transport.prepare(group)
    handle = transport.reduce_scatter(torch.arange(4.0) * (rank + 1), group)
    handle.watch()
    deadline = time.monotonic() + 20
    while not handle.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    polled = handle.is_completed()
    part = handle.wait()
    total = sum(r + 1 for r in range(n))
    return [polled, part.tolist() == (torch.arange(4.0) * total)[2 * rank:2 * rank + 2].tolist()]


def _monitored_barrier_waits_the_groups_timeout() -> list:
    group = skdist.new_group([0, 1], timeout_s=2)
    if skdist.get_rank() == 1:  # never reaches the barrier
        return ["stayed away"]
    start = time.monotonic()
    try:
        skdist.monitored_barrier(group)
    except RuntimeError as error:
        return ["Rank 1" in str(error), time.monotonic() - start < 30]
    return ["passed without rank 1"]


# ---------------------------------------------------------------------- tests


def test_all_reduce_coalesced_lists_that_differ_raise_on_every_rank(world2):
    """Before: shapes swapped between ranks summed across the wrong tensors with no error;
    a tensor more, another dtype or an empty list made gloo abort a process; another op
    reduced with each rank's own. Now one ValueError on every rank, nothing sent."""
    rank0, rank1 = world2.run(_coalesced_lists_that_differ)
    wrong = "ValueError: shardkit.distributed.all_reduce_coalesced"
    for name in ("shapes swapped", "one tensor more", "another dtype", "empty on one rank",
                 "another op"):
        assert dict(rank0)[name] == dict(rank1)[name] == wrong, name
    assert dict(rank0)["not tensors on one rank"].startswith("TypeError")
    assert dict(rank1)["not tensors on one rank"] == \
        "ValueError: shardkit.distributed.all_reduce_coalesced: group rank"
    assert dict(rank0)["sums"] == dict(rank1)["sums"] == ([[3.0] * 3] * 2, [0, 3, 6, 9])


def test_all_to_all_single_split_sizes_on_some_ranks_raise_on_every_rank(world2):
    """Before: the ranks with split sizes waited in their agreement, the others in the
    exchange: a hang (and the plain form of other sizes on each rank, or of a bad size on one,
    hung or aborted). Now a ValueError on every rank before any data moves."""
    rank0, rank1 = world2.run(_all_to_all_splits_on_some_ranks)
    assert rank0[0] == rank1[1] == "ValueError: all_to_all_single: group rank"
    assert "passed split sizes" in world2.run(_split_sizes_message)[1]
    assert rank0[2] == rank1[2] == "ValueError: all_to_all_single: the ranks' tensors differ "
    assert rank1[3].startswith("ValueError: all_to_all_single: input has 4 elements")
    assert rank0[3] == "ValueError: all_to_all_single: group rank"
    assert rank0[4] == [0.0, 1.0, 10.0, 11.0] and rank1[4] == [2.0, 3.0, 12.0, 13.0]


def _split_sizes_message() -> str:
    import shardkit.comm as dist
    try:
        if dist.get_rank() == 0:
            dist.all_to_all_single(torch.zeros(4), torch.ones(4), [2, 2], [2, 2])
        else:
            dist.all_to_all_single(torch.zeros(4), torch.ones(4))
    except ValueError as error:
        return str(error)
    return "no error"


def test_ranks_outside_a_sub_group_send_and_count_nothing(world2):
    """Before, on the rank outside: all_gather_into_tensor / reduce_scatter_tensor raised
    "world size -1 x input's 4", and CommCounter recorded ops torch never sent."""
    inside, outside = world2.run(_outside_a_sub_group)
    assert outside == {"returned": [True, True], "counted": {}}
    assert inside["counted"] == {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1,
                                 "broadcast": 1, "all_to_all": 1, "barrier": 1}


def test_monitored_barrier_runs_on_a_default_style_group(world2):
    """A group whose backend reads "cpu:gloo" (torch's per-device spelling; "undefined" for
    init_process_group() without a backend) is carried by gloo, and its process group runs
    the monitored barrier. Before: refused by the backend's name."""
    assert world2.run(_monitored_barrier_on_a_default_style_group) == [["cpu:gloo",
                                                                       "passed"]] * 2


def test_transport_sends_point_to_point_on_a_default_style_group(world2):
    """Before: the transport took the collective path there, whose reduce-scatter handle
    never read completed (gloo's work), so a caller polling it waited forever."""
    assert world2.run(_transport_on_a_default_style_group) == [[True, True]] * 2


def test_monitored_barrier_defaults_to_the_groups_timeout(world2):
    """Before: timeout=None waited torch's 30-minute default, not the group's 2 s (the world
    timed out). Now rank 0 hears within the group's timeout that rank 1 did not arrive."""
    assert world2.run(_monitored_barrier_waits_the_groups_timeout) == [[True, True],
                                                                       ["stayed away"]]


def test_split_all_to_all_before_init_names_the_call():
    """Before: torch's "Default process group has not been initialized" from inside the
    argument agreement. Now the call and what to do."""
    if skdist.is_initialized():
        pytest.skip("a process group exists in this process")
    import shardkit.comm as dist
    with pytest.raises(RuntimeError, match="all_to_all_single needs a process group"):
        dist.all_to_all_single(torch.zeros(4), torch.ones(4), [4], [4])


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


def _all_to_all_outside_a_sub_group() -> list:
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
    inside, outside = world2.run(_all_to_all_outside_a_sub_group)
    assert inside == [0.0, 1.0, 2.0, 3.0]
    assert outside == [None, None]
