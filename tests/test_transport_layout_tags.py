"""Ranks whose collectives agree on the operation, dtype and total size but not on how it is
cut (per-rank segment sizes, chunk sizes, a quantized layout), through the process-group and
quantized transports at world 2 on gloo.

Regression: the point-to-point collectives were tagged with the operation, dtype and total
size only, so two ranks that disagreed on the per-rank ``sizes`` of an uneven all-gather
(``[2, 4]`` against ``[4, 2]``) both returned silent wrong values (zeros where the peer's
segment belonged), other cuts of the same total made gloo abort both processes, and the
quantized reduce-scatter (qgZ, untagged) handed one rank the peer's shorter message plus
uninitialised bytes (values around 1e10) while gloo aborted the other; the debug mode
(``SHARDKIT_DEBUG_COLLECTIVES=1``) compared the same fields and let them through. The tags and
the debug mode's shape now carry the layout: the ranks fail at the group's timeout, and the
debug mode names both calls before anything is sent.

Also: the timeout's error named only this rank's operation; each rank now posts its call on
the store when its wait times out, and the error names every rank's.

From a review:

The process-group transport's timeout words (each rank posts its call on the default store
when a point-to-point collective times out, and names its peers') at world 2 on gloo.

Regressions:

- a store whose host is hung (rank 0 stopped, or its node unreachable) takes the post but
  never answers the read, whose 5 s timeout then did not fire: the rank whose collective
  timed out blocked in the store until the host came back (forever, for a host that does
  not), instead of raising at the group's timeout. Now the error comes within the group's
  timeout plus the 5 s read.
- gloo closes a pair when one end's wait times out, so the peer whose own timeout had not
  fired yet fails with "closed by peer" and never posted its call: the rank that timed out
  waited the 5 s and said its peer had "no timed-out call (busy elsewhere, or dead)". The
  peer now posts its call on such a failure, and the error names it.
"""

import os
import signal
import threading
import time

import torch

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)

_TIMEOUT_S = 2


def _disagreeing_call(case: str, transport, group, rank: int):
    """Rank 0's and rank 1's call of ``case``: the same op, dtype and total size, cut apart
    differently. Returns what the call gave back (as a list)."""
    if case in ("segments", "even_against_uneven"):
        sizes = {"segments": ([2, 4], [4, 2]),
                 "even_against_uneven": ([3, 3], [2, 4])}[case][rank]
        out = torch.zeros(6)
        out.split(sizes)[rank].fill_(1.0 + rank)
        return transport.all_gather_segments(out, sizes, group).wait().tolist()
    if case == "owners":
        sizes = [2, 4] if rank == 0 else [4, 2]
        segments = [torch.full((s,), 1.0 + rank) for s in sizes]
        return transport.reduce_to_owners(segments, group).wait().tolist()
    if case == "chunks":
        fulls = [torch.zeros(4), torch.zeros(8)] if rank == 0 else [torch.zeros(6)] * 2
        chunks = [torch.ones(2), torch.ones(4)] if rank == 0 else [torch.ones(3)] * 2
        transport.all_gather_chunks(fulls, chunks, group).wait()
        return [f.tolist() for f in fulls]
    if case == "chunks16":  # bf16: the chunks are packed before they travel
        sizes = [4, 4] if rank == 0 else [8]
        tensors = [torch.ones(2 * c, dtype=torch.bfloat16) for c in sizes]
        return transport.reduce_scatter_chunks(tensors, sizes, group).wait().tolist()
    if case == "quantized":
        numel = 2 * (32 if rank == 0 else 48)
        return transport.reduce_scatter(torch.randn(numel), group).wait().tolist()
    if case == "exchange":  # the hierarchical qgZ's all-to-all
        from shardkit.transport import exchange_equal_chunks
        send = torch.full((4 if rank == 0 else 6,), float(rank))
        return exchange_equal_chunks(torch.zeros_like(send), send, group,
                                     counted_as="reduce_scatter").wait().tolist()
    raise ValueError(case)


def _mismatched(cases: list, debug: bool = False):
    """Each of ``cases`` over a fresh group with a short timeout: what each rank got (or the
    error's class); then a matched all-gather over another fresh group, exact."""
    from shardkit.collective_check import set_debug_collectives
    from shardkit.quantized_transport import QuantizedTransport
    from shardkit.transport import ProcessGroupTransport

    rank, outcomes = skdist.get_rank(), {}
    set_debug_collectives(debug)
    try:
        for case in cases:
            group = skdist.new_group([0, 1], timeout_s=_TIMEOUT_S)
            transport = QuantizedTransport(block=8) if case == "quantized" else \
                ProcessGroupTransport()
            transport.prepare(group)
            try:
                outcomes[case] = ("returned", _disagreeing_call(case, transport, group, rank))
            except Exception as error:  # noqa: BLE001 - the timeout, whatever gloo calls it
                outcomes[case] = ("raised", type(error).__name__, str(error))
    finally:
        set_debug_collectives(False)
    out = torch.zeros(4)
    ProcessGroupTransport().all_gather(out, torch.full((2,), float(rank)),
                                       skdist.new_group([0, 1])).wait()
    return outcomes, out.tolist()


def _assert_all_raised(results, cases):
    for rank, (outcomes, after) in enumerate(results):
        for case in cases:
            # was: silent wrong values, or the world lost to gloo aborting a rank
            assert outcomes[case][0] == "raised", (case, rank, outcomes[case])
        assert after == [0.0, 0.0, 1.0, 1.0], (rank, after)


def test_other_cuts_of_the_same_total_exchange_nothing(world2):
    cases = ["segments", "even_against_uneven", "owners"]
    results = world2.run(_mismatched, cases)
    _assert_all_raised(results, cases)
    for rank, (outcomes, _) in enumerate(results):
        # the timeout names this rank's call and the peer's (each posts its own on timeout)
        words = outcomes["segments"][2]
        mine, theirs = ("[2, 4]", "[4, 2]") if rank == 0 else ("[4, 2]", "[2, 4]")
        assert f"waited in all_gather(shape=[6], dtype=torch.float32, layout={mine})" in words
        assert f"global rank {1 - rank}: all_gather(shape=[6], dtype=torch.float32, " \
               f"layout={theirs})" in words, words


def test_other_quantized_and_chunk_layouts_exchange_nothing(world2):
    cases = ["chunks", "quantized", "exchange"]
    _assert_all_raised(world2.run(_mismatched, cases), cases)


def test_packed_chunk_layouts_exchange_nothing(world2):
    """Before: a 16-bit reduce_scatter_chunks (packed, then sent as a plain reduce-scatter of
    the total) returned sums of the peer's chunks cut another way, silently; the fp32 one, sent
    tensor by tensor, was tagged with the chunk layout."""
    _assert_all_raised(world2.run(_mismatched, ["chunks16"]), ["chunks16"])


def test_debug_mode_names_both_cuts(world2):
    results = world2.run(_mismatched, ["segments"], debug=True)
    for rank, (outcomes, _) in enumerate(results):
        assert outcomes["segments"][0] == "raised", (rank, outcomes)  # was: silent wrong data
        kind, name, words = outcomes["segments"]
        assert name == "CollectiveMismatchError", (rank, outcomes)
        # each rank's per-rank sizes, in the message on every rank
        assert "layout=[2, 4]" in words and "layout=[4, 2]" in words, words
    _assert_all_raised(results, ["segments"])


def _exchange_matched():
    from shardkit.transport import exchange_equal_chunks

    rank, n = skdist.get_rank(), skdist.get_world_size()
    send = torch.arange(6.0) + 10 * rank
    with skdist.CommCounter() as counter:
        got = exchange_equal_chunks(torch.zeros(6), send, None,
                                    counted_as="reduce_scatter").wait()
    expected = torch.cat([(torch.arange(6.0) + 10 * r).view(n, -1)[rank] for r in range(n)])
    return torch.equal(got, expected), dict(counter.by_op)


def test_exchange_equal_chunks_moves_the_all_to_all_bytes(world2):
    for equal, by_op in world2.run(_exchange_matched):
        assert equal
        # (N-1)/N of the 24 input bytes, under the op it stands for
        assert by_op == {"reduce_scatter": 12.0}, by_op


_TIMEOUT_S_rev = 2
_HOST_RESUMED_AFTER_S = 20  # rank 1 resumes rank 0 then at the latest (the old code's hang)


def _uneven_all_gather(group, sizes):
    """An uneven all-gather over ``group``: ``("raised", seconds, message)`` or what it
    returned."""
    from shardkit.transport import ProcessGroupTransport

    out = torch.zeros(sum(sizes))
    start = time.monotonic()
    try:
        ProcessGroupTransport().all_gather_segments(out, sizes, group).wait()
        return ("returned", out.tolist())
    except Exception as error:  # noqa: BLE001 - the timeout, whatever gloo calls it
        return ("raised", time.monotonic() - start, type(error).__name__, str(error))


def _store_host_stopped():
    """Rank 0 (the store's host) stops itself; rank 1 waits in an all-gather with it."""
    group = skdist.new_group([0, 1], timeout_s=_TIMEOUT_S_rev)
    pids = [None, None]
    torch.distributed.all_gather_object(pids, os.getpid())
    if skdist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    resume = threading.Timer(_HOST_RESUMED_AFTER_S, os.kill, (pids[0], signal.SIGCONT))
    resume.start()
    try:
        return _uneven_all_gather(group, [3, 3])
    finally:
        resume.cancel()
        os.kill(pids[0], signal.SIGCONT)


def test_a_hung_store_host_delays_the_timeout_by_the_read_at_most(world2):
    _, outcome = world2.run(_store_host_stopped)
    assert outcome[0] == "raised" and outcome[2] == "CollectiveError", outcome
    # was: blocked until the host came back (here after 20 s; forever for a lost host)
    assert outcome[1] < _HOST_RESUMED_AFTER_S - 5, outcome  # the timeout + a 5 s read, slack
    assert "global rank 0: not read: the store did not answer" in outcome[3], outcome
    # the world still works once the host is back
    assert world2.run(skdist.get_rank) == [0, 1]


def _rank_0_late():
    """Rank 0 enters a mismatched all-gather 1 s after rank 1, whose timeout fires first."""
    group = skdist.new_group([0, 1], timeout_s=_TIMEOUT_S_rev)
    rank = skdist.get_rank()
    skdist.barrier()
    if rank == 0:
        time.sleep(1.0)
    return _uneven_all_gather(group, [2, 4] if rank == 0 else [4, 2])


def test_the_peer_whose_pair_was_closed_is_named(world2):
    late, first = world2.run(_rank_0_late)
    assert late[0] == "raised" and first[0] == "raised", (late, first)
    assert late[2] == first[2] == "CollectiveError", (late, first)
    # was: "global rank 0: no timed-out call within 5 s (busy elsewhere, or dead)"
    assert "global rank 0: all_gather(shape=[6], dtype=torch.float32, layout=[2, 4])" \
        in first[3], first
