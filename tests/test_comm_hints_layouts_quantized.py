"""Transports, the peer watchdog, node layouts and quantized collectives.

- A collective that timed out with no peer lost named, as the ranks "that had not reached it",
  every peer whose count of collectives on the default group was below this rank's: an
  asynchronous prefetch this rank issued after the collective that failed raised its count,
  so a peer that had reached the failed collective was named; and a peer that had finished
  (marked done) well before was named as one that "still beats". Now the reference is this
  rank's oldest unfinished collective, and peers no longer watched are left out.

- With a process group made by hand (``torch.distributed.init_process_group``) and a launcher
  that places ranks round-robin (``GROUP_RANK`` = rank % 2: ranks 0 and 2 on node 0), a
  collective counted by ``CommCounter`` raised "GROUP_RANK=1 but rank 1 // LOCAL_WORLD_SIZE=2
  is 0" on ranks 1 and 2 before they issued it, while ranks 0 and 3 waited in it until the
  process-group timeout; ``ranks_per_node()`` raised the same on those ranks only (FSDP's hpZ
  asks it before creating its groups: the others hung there). Now the count of ranks per
  node is answered everywhere, the op is recorded on every rank, and only the per-node split
  of the count says, on the ranks that can tell, that it is unknown.

- ``quantized_reduce_scatter`` / ``quantized_all_gather`` called with sizes (or bits) that
  differ between ranks: gloo aborted one process ("terminate called after throwing an instance
  of gloo::EnforceNotMet") and the other returned sums of the wrong bytes, silently. Now one
  small agreement before the exchange raises a ValueError on every rank, naming each rank's
  call, and nothing is sent.

The quantized checks run in one world of 2 gloo ranks. The watchdog and round-robin checks
start processes of their own (process groups made without
torchrun's variables, with a short timeout).

Review of the quantized agreement

Quantized collectives' agreement on the call (review of the transports commit).

- ``quantized_reduce_scatter`` / ``quantized_all_gather`` agreed on the sum and the count of
  the chunk sizes only: two ranks passing the same tensors in another order (chunks 500 + 12
  on one, 12 + 500 on the other) agreed, and each read the other's bytes at the wrong
  offsets, silently. Now the sizes of the chunks are agreed on too, and every rank raises a
  ValueError saying so before anything is sent.
"""

import contextlib
import datetime
import io
import os
import time

import torch
import torch.distributed as dist

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


# ---------------------------------------------------------------------- rank-side bodies


def _timed_out_behind_a_prefetch(rank: int, port: int, results) -> None:
    """World 4, 3 s process-group timeout. After a barrier: rank 3 finishes (marks itself
    done, stays alive); rank 2 stalls, beating; rank 1 issues the all-reduce X (it times out
    there); rank 0 issues X and then a prefetch Y, both asynchronous, and waits for X. Rank 0
    reports what its watchdog says of X."""
    from shardkit.fault import watch_peers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=datetime.timedelta(seconds=3))
    watchdog = watch_peers(1.0, on_lost=lambda who, message: None)
    skdist.barrier()
    if rank == 3:
        time.sleep(0.4)  # a few beats: its count is read before it finishes
        watchdog.stop()
    if rank in (2, 3):
        time.sleep(14)
        os._exit(0)
    time.sleep(0.5)  # a few beats: the peers' counts are read
    if rank == 1:
        with contextlib.suppress(Exception):
            skdist.all_reduce(torch.ones(4))
        time.sleep(10)  # still beating, with X counted
        os._exit(0)
    x = skdist.all_reduce(torch.ones(4), async_op=True)
    skdist.all_reduce(torch.ones(4), async_op=True)  # the prefetch: issued after X
    try:
        x.wait()
        note = "no error"
    except Exception as error:  # noqa: BLE001 - explained as the uncaught-exception hook does
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            watchdog.explain_communication_error(error)
        note = said.getvalue()
    results.put(note)
    results.close()
    results.join_thread()
    os._exit(0)


def _round_robin_placement_by_hand(rank: int, port: int, results) -> None:
    """World 4 made by torch's ``init_process_group`` (5 s timeout), ranks labelled
    round-robin on 2 nodes; every rank reports what a counted all-reduce and
    ``ranks_per_node()`` give it."""
    os.environ.update(GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2")
    from shardkit.comm_counter import CommCounter
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4, timeout=datetime.timedelta(seconds=5))
    out = {}
    try:
        out["per_node"] = skdist.ranks_per_node()
        with CommCounter() as counter:
            total = torch.ones(4)
            skdist.all_reduce(total)
        out["sum"], out["bytes"] = total.tolist(), counter.bytes
        try:
            out["inter"] = counter.inter_node_bytes
        except RuntimeError as error:
            out["inter"] = str(error)
        skdist.barrier()
    except Exception as error:  # noqa: BLE001 - compared by the test
        out["error"] = f"{type(error).__name__}: {error}"
    results.put((rank, out))
    results.close()
    results.join_thread()
    os._exit(0)


def _quantized_calls_that_differ_between_ranks() -> dict:
    """Each quantized collective with rank-dependent arguments, then one that agrees: what
    each raises (or returns)."""
    from shardkit import quantized_comm as qc
    rank = skdist.get_rank()
    size = 512 + 256 * rank
    calls = {
        "reduce_scatter sizes": lambda: qc.quantized_reduce_scatter(torch.ones(2 * size)),
        "reduce_scatter bits": lambda: qc.quantized_reduce_scatter(torch.ones(1024),
                                                                   bits=4 + 4 * rank),
        "reduce_scatter op": lambda: qc.quantized_reduce_scatter(
            torch.ones(1024), op=("sum", "mean")[rank]),
        "all_gather sizes": lambda: qc.quantized_all_gather(torch.empty(2 * size),
                                                            torch.ones(size)),
        "reduce_scatter bad on one rank": lambda: qc.quantized_reduce_scatter(
            torch.ones(1024), block=256 if rank == 0 else 100),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    out["agreeing"] = qc.quantized_reduce_scatter(torch.ones(1024) * (rank + 1)).tolist()[:2]
    return out


def _run_ranks(target, world_size: int, timeout_s: float = 120, answers: int = 1):
    """Run ``target(rank, port, results)`` in ``world_size`` processes (forked from the fork
    server of :func:`shardkit.testing.process_context`: no torch import per rank); return the
    first result put (the first ``answers`` results, as a list, when ``answers > 1``). Ranks
    still running once the answers are in only keep their watchdogs beating for the rank that
    answered (they sleep longer than it needs, for a loaded machine): they are stopped then."""
    from shardkit.testing import free_port, process_context
    port = free_port()
    ctx = process_context()
    results = ctx.Queue()
    ranks = [ctx.Process(target=target, args=(r, port, results)) for r in range(world_size)]
    for p in ranks:
        p.start()
    answered = False
    try:
        got = [results.get(timeout=timeout_s) for _ in range(answers)]
        answered = True
        return got[0] if answers == 1 else got
    finally:
        for p in ranks:
            p.join(0 if answered else 30)
            if p.is_alive():
                p.kill()
                p.join()


# ---------------------------------------------------------------------- tests


def test_a_timed_out_collective_names_only_the_peer_that_had_not_reached_it():
    """Before: "rank(s) 1, 2, 3 still beat but had not reached it": rank 1 had issued X (its
    count was below rank 0's only because of rank 0's prefetch) and rank 3 had finished."""
    note = _run_ranks(_timed_out_behind_a_prefetch, 4)
    assert "rank(s) 2 still beat but had not reached it" in note, note
    assert "rank(s) 3" not in note and "rank(s) 1" not in note, note
    assert "issued [1] collectives on the default group, this rank 3, the oldest still " \
           "unfinished here being number 2" in note, note


def test_a_counted_collective_on_a_round_robin_world_made_by_hand_runs_on_every_rank():
    """Before: ranks 1 and 2 raised "GROUP_RANK=1 but rank 1 // LOCAL_WORLD_SIZE=2 is 0"
    from ranks_per_node() and ranks 0 and 3 timed out in the all-reduce. Every rank counts the
    world's all-reduce as spanning nodes: the world holds more ranks than a node."""
    answers = dict(_run_ranks(_round_robin_placement_by_hand, 4, answers=4))
    for rank, out in sorted(answers.items()):
        assert "error" not in out, (rank, out)
        assert out["per_node"] == 2 and out["sum"] == [4.0] * 4 and out["bytes"] == 24.0
        assert out["inter"] == 24.0, (rank, out)


def test_quantized_collectives_whose_calls_differ_raise_on_every_rank(world2):
    """Before: rank 0 aborted inside gloo and rank 1 returned wrong sums (or waited)."""
    for rank, out in enumerate(world2.run(_quantized_calls_that_differ_between_ranks)):
        for name in ("reduce_scatter sizes", "all_gather sizes"):
            assert "the ranks' calls differ" in out[name], (rank, name, out[name])
            assert "rank 0: bits=" in out[name] and "512 elements per rank" in out[name]
            assert "768 elements per rank" in out[name] and "nothing was sent" in out[name]
        assert "rank 0: bits=4" in out["reduce_scatter bits"], out
        assert "rank 1: bits=8" in out["reduce_scatter bits"], out
        assert "op='mean'" in out["reduce_scatter op"], out
        bad = out["reduce_scatter bad on one rank"]
        assert ("block=100" in bad) if rank == 1 else ("rank(s) [1]" in bad), (rank, bad)
        assert out["agreeing"] == [3.0, 3.0]  # the group still works


def _chunks_that_differ_between_ranks() -> dict:
    """Quantized collectives whose chunks have the same sum and count on both ranks but other
    sizes: what each rank raises."""
    from shardkit import quantized_comm as qc
    rank = skdist.get_rank()
    long, short = torch.arange(1000.), torch.arange(24.)
    calls = {
        "reduce_scatter": lambda: qc.quantized_reduce_scatter(
            [long, short] if rank == 0 else [short, long]),
        "all_gather": lambda: qc.quantized_all_gather(
            [torch.empty(600), torch.empty(200)] if rank == 0 else
            [torch.empty(200), torch.empty(600)], torch.ones(400),
            chunk_numels=[300, 100] if rank == 0 else [100, 300]),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as error:
            out[name] = str(error)
    same = [long, short]  # the same call on both ranks still runs, and sums right
    out["agreeing"] = qc.quantized_reduce_scatter(same, bits=8).tolist()
    return out


def test_quantized_calls_whose_chunk_sizes_differ_raise_on_every_rank(world2):
    """Before: both calls returned, each rank's chunks read at the other's offsets."""
    for rank, out in enumerate(world2.run(_chunks_that_differ_between_ranks)):
        for name in ("reduce_scatter", "all_gather"):
            assert "the sizes of the chunks differ between ranks" in out[name], (rank, out)
            assert "nothing was sent" in out[name], (rank, out)
        own_chunks = "[500, 12]" if rank == 0 else "[12, 500]"
        assert own_chunks in out["reduce_scatter"], (rank, out)
        # the same call on both ranks: each rank's exact half plus the other's int8 copy
        expected = torch.cat([torch.arange(1000.).chunk(2)[rank],
                              torch.arange(24.).chunk(2)[rank]]) * 2
        assert torch.allclose(torch.tensor(out["agreeing"]), expected, atol=8.0), (rank, out)
