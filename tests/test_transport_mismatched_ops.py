"""Ranks that issue different collectives through the process-group transport (an all-gather
on one rank, a reduce-scatter on another; or the same one with other sizes or dtypes), at world
2 on gloo, without the collective debug mode.

Regression: the transport's collectives are built from sends and receives, all with tag 0, so
one rank's receive took the other operation's bytes: both ranks returned silent wrong values
(an all-gather against a reduce-scatter of the same bytes), or gloo aborted the process that
received a longer message than it posted (other sizes) while its peer went on with garbage.
Each operation's messages now carry a tag made from the operation, its dtype and shape: no
receive takes another operation's bytes, and the ranks fail at the group's timeout instead
(``SHARDKIT_DEBUG_COLLECTIVES=1`` names each rank's call before anything is sent).

From a review:

Matched reduce-scatters whose inputs differ between ranks only in memory layout, through the
process-group transport at world 2 on gloo.

Regression: ``ProcessGroupTransport.reduce_scatter_chunks`` chose between its per-tensor sends
and the packed path (one message per peer) by whether this rank's tensors were contiguous, so a
rank whose input was a transposed view (same values) sent one message where its peer waited for
one per tensor: the operation tags of 5fd60c8 are alike on both paths, so the contiguous rank
returned a silent wrong sum and gloo aborted the other. The path now depends only on what every
rank shares (sizes, dtypes, device); a non-contiguous tensor is copied.
"""

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)

_TIMEOUT_S = 3


def _mismatched(case: str):
    """Rank 0's and rank 1's calls of ``case`` over a fresh group with a short timeout: what
    each got (``("returned", values)``) or that it raised; then a matched all-gather over
    another fresh group, exact."""
    from shardkit.transport import ProcessGroupTransport

    transport, rank = ProcessGroupTransport(), skdist.get_rank()
    group = skdist.new_group([0, 1], timeout_s=_TIMEOUT_S)
    try:
        if case == "gather_vs_scatter":
            if rank == 0:
                out = torch.zeros(8)
                transport.all_gather(out, torch.ones(4), group).wait()
                got = out
            else:
                got = transport.reduce_scatter(torch.arange(8.0), group).wait()
        elif case == "sizes":
            numel = 4 if rank == 0 else 6
            out = torch.zeros(2 * numel)
            transport.all_gather(out, torch.full((numel,), 1.0 + rank), group).wait()
            got = out
        else:  # dtypes
            dtype = torch.float32 if rank == 0 else torch.int32
            out = torch.zeros(8, dtype=dtype)
            transport.all_gather(out, torch.ones(4, dtype=dtype), group).wait()
            got = out
        outcome = ("returned", got.tolist())
    except Exception:  # noqa: BLE001 - the group's timeout, whatever the backend calls it
        outcome = ("raised",)
    fresh = skdist.new_group([0, 1])
    out = torch.zeros(4)
    transport.all_gather(out, torch.full((2,), float(rank)), fresh).wait()
    return outcome, out.tolist()


def test_mismatched_collectives_exchange_nothing(world2):
    for case in ("gather_vs_scatter", "sizes", "dtypes"):
        for rank, (outcome, after) in enumerate(world2.run(_mismatched, case)):
            # was: ("returned", <another operation's bytes>) on both ranks, or rank 0 aborted
            assert outcome == ("raised",), (case, rank, outcome)
            assert after == [0.0, 0.0, 1.0, 1.0], (case, rank, after)


def _layout_differs(strided_rank: int, scale: float):
    """``reduce_scatter_chunks`` of a 3x4 matrix and a 6-vector, the matrix a non-contiguous
    view of the same values on ``strided_rank`` only; what this rank got."""
    from shardkit.transport import ProcessGroupTransport

    rank = skdist.get_rank()
    group = skdist.new_group([0, 1], timeout_s=20)
    matrix = torch.arange(12.0).reshape(3, 4) + rank
    if rank == strided_rank:
        matrix = matrix.t().contiguous().t()  # same values, column-major
        assert not matrix.is_contiguous()
    vector = torch.full((6,), 1.0 + rank)
    got = ProcessGroupTransport().reduce_scatter_chunks([matrix, vector], [6, 3], group,
                                                        scale=scale).wait()
    return got.tolist()


@pytest.mark.parametrize("strided_rank", [0, 1])
def test_reduce_scatter_chunks_with_layouts_that_differ_between_ranks(world2, strided_rank):
    scale = 0.5
    matrix_sum = (torch.arange(12.0) * 2 + 1) * scale
    vector_sum = torch.full((6,), 3.0) * scale
    expected = [torch.cat([matrix_sum[:6], vector_sum[:3]]).tolist(),
                torch.cat([matrix_sum[6:], vector_sum[3:]]).tolist()]
    # was: the contiguous rank returned wrong sums, the other rank aborted inside gloo
    assert world2.run(_layout_differs, strided_rank, scale) == expected
