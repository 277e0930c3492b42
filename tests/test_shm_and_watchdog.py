"""Fault detection and the shared-memory transport, as a torch.distributed user meets them.

- ``SharedMemoryTransport.all_to_all`` and ``all_gather`` copied an input of one dtype into an
  output of another, casting silently (fp32 0.5 gathered into an int64 output read 0), where
  torch's collectives raise. A call that does not fit on one rank only (a dtype, a size, a
  source) raised there and left its peers waiting ``timeout_s`` (300 s) in a round it never
  ran. Now the rank raises its ValueError and publishes the refusal: every peer raises at once,
  naming it, and nothing is exchanged.
- ``CommCounter`` counted the shared-memory broadcast, reduce-to-owners and unequal all-gather
  per rank by what each rank reads (0 on a broadcast's source, the whole tensor elsewhere),
  where the process-group transport counts DESIGN.md's ``(N-1)/N`` on every rank for the same
  bytes: the two transports disagreed op by op. Now they record the same bytes.
- Shared memory refused (all-reduce) or failed on (broadcast: "view size is not compatible")
  a non-contiguous tensor that the process group carries; all-gather and all-to-all could not
  land in a non-contiguous output. Now they go through a contiguous copy, as there.
- The peer watchdog beat through a ``FileStore`` (``file://``), whose file grows with every
  write: about 50 bytes a beat a rank for as long as the job runs. Now it beats in small files
  rewritten in place beside it, and the last rank to finish removes them.
- The watchdog took rank 0 for the host of any TCP store. With ``store=`` served by another
  rank, that rank's normal finish took the store with it and the watchdog stopped rank 0, still
  at work, as "the job's rendezvous is lost"; a server outside the job that died was reported
  as "rank 0 is lost". Now the serving rank is found (its listening socket), and a store no
  rank serves is reported as the lost rendezvous.

Its review found:

Review of the file-store heartbeats and the shared-memory transport's contiguous copies.

- ``SharedMemoryTransport`` carried a non-contiguous tensor through a contiguous copy that was
  written back only inside ``wait()``: a handle dropped unwaited (which ``CommHandle`` says
  still completes its operation, as an unwaited process-group collective does) left the
  all-reduced, broadcast or gathered tensor as it was, while a contiguous one landed. Now the
  ring's worker writes the copy back as the operation's last step.
- The peer watchdog over a ``file://`` store beats in a folder beside the store's file, which
  the last rank to stop removes. A watchdog whose group was destroyed (``destroy_process_group``)
  retired without marking its rank done, and was not stopped again at exit: every
  init/destroy cycle in one process left its folder behind for good. Now a retiring watchdog
  marks its rank done, and the last rank to leave removes the folder.

One world of 2 gloo ranks for the transport checks; the watchdog checks start processes of
their own (they need process groups made without torchrun's variables).
"""

import glob
import multiprocessing as mp
import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist

from shardkit import distributed as skdist
from shardkit.comm_counter import CommCounter
from shardkit.testing import free_port, world_fixture

world2 = world_fixture(2, timeout=120, failure_grace_s=20)


# ---------------------------------------------------------------------- rank-side bodies


def _outcome(call) -> str:
    """``"ok <values>"`` or ``"<error type>: <message>"`` of ``call()``."""
    try:
        return f"ok {call().tolist()}"
    except Exception as error:  # noqa: BLE001 - compared by the test
        return f"{type(error).__name__}: {error}"


def _calls_that_do_not_fit() -> dict:
    """Each call that does not fit, made on every rank, then on the last rank only (a fresh
    transport each time: an error breaks one), with the seconds the peers took to raise."""
    from shardkit.shm_transport import SharedMemoryTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    cases = {
        "all_to_all dtype": lambda shm, bad: shm.all_to_all(
            torch.empty(2 * n, dtype=torch.float64 if bad else torch.float32),
            torch.arange(2.0 * n) + 0.5, None),
        "all_gather dtype": lambda shm, bad: shm.all_gather(
            torch.empty(2 * n, dtype=torch.int64 if bad else torch.float32),
            torch.arange(2.0) + 0.5, None),
        "all_gather size": lambda shm, bad: shm.all_gather(
            torch.empty(2 * n + bad), torch.ones(2), None),
        "broadcast source": lambda shm, bad: shm.broadcast(torch.ones(3), 7 if bad else 0,
                                                           None),
    }
    out = {}
    for name, call in cases.items():
        for everywhere in (True, False):
            shm = SharedMemoryTransport(part_bytes=4096, timeout_s=60)
            shm.prepare(None)
            shm.all_reduce(torch.ones(3000), None).wait()  # a few rounds already run
            bad = everywhere or rank == n - 1
            start = time.monotonic()
            first = _outcome(lambda: call(shm, bad).wait())
            after = _outcome(lambda: shm.all_reduce(torch.ones(2), None).wait())
            out[name, everywhere] = (first, after.split(":")[0], time.monotonic() - start)
            shm.close()
    return out


def _bytes_of_every_op(kind: str) -> dict:
    """What CommCounter records for each operation of one transport (unequal sizes where an
    op allows them), with its result."""
    from shardkit.shm_transport import SharedMemoryTransport
    from shardkit.transport import ProcessGroupTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    t = SharedMemoryTransport(part_bytes=4096) if kind == "shm" else ProcessGroupTransport()
    t.prepare(None)
    sizes = [3 + 2 * r for r in range(n)]
    segments = torch.zeros(sum(sizes))
    start = sum(sizes[:rank])
    segments[start:start + sizes[rank]] = rank + 1.0
    ops = {
        "all_gather": lambda: t.all_gather(torch.empty(6 * n), torch.full((6,), rank + 1.0),
                                           None),
        "all_gather_segments": lambda: t.all_gather_segments(segments, sizes, None),
        "reduce_scatter": lambda: t.reduce_scatter(torch.arange(6.0 * n) + rank, None),
        "all_to_all": lambda: t.all_to_all(torch.empty(6 * n), torch.arange(6.0 * n) + rank,
                                           None),
        "broadcast": lambda: t.broadcast(torch.full((1001,), rank + 1.0), n - 1, None),
        "reduce_to_owners": lambda: t.reduce_to_owners(
            [torch.full((5 + 3 * r,), rank + 1.0) for r in range(n)], None),
        "all_reduce": lambda: t.all_reduce(torch.full((7,), rank + 1.0), None),
    }
    out = {}
    for name, op in ops.items():
        with CommCounter() as counter:
            result = op().wait()
        out[name] = (counter.by_op, counter.calls_by_op, result.tolist())
    t.close()
    return out


def _non_contiguous_tensors(kind: str) -> dict:
    """Transposed tensors in and out of each operation that takes them."""
    from shardkit.shm_transport import SharedMemoryTransport
    from shardkit.transport import ProcessGroupTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    t = SharedMemoryTransport(part_bytes=4096) if kind == "shm" else ProcessGroupTransport()
    t.prepare(None)

    def transposed(rows, cols, offset):
        return (torch.arange(float(rows * cols)) + offset).view(rows, cols).t()
    calls = {
        "broadcast": lambda: t.broadcast(transposed(2, 3000, 10 * rank), 0, None),
        "all_reduce": lambda: t.all_reduce(transposed(2, 3000, 10 * rank), None),
        "all_gather output": lambda: t.all_gather(torch.zeros(n, 4).t(),
                                                  torch.arange(4.0) + 10 * rank, None),
        "all_to_all output": lambda: t.all_to_all(torch.zeros(2, n).t(),
                                                  torch.arange(2.0 * n) + 10 * rank, None),
    }
    out = {name: _outcome(lambda: call().wait()) for name, call in calls.items()}
    t.close()
    return out


def _store_file_beside_the_watchdog(rank: int, path: str, results) -> None:
    """A rank of a group met on ``file://path``, watched every 0.05 s: the store file's size
    after many beats; then rank 1 is SIGKILLed and rank 0 must name it."""
    from shardkit.fault import watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    seen = []
    watchdog = watch_peers(0.4, on_lost=lambda who, message: seen.append(who))
    dist.barrier()
    time.sleep(0.3)
    before = os.path.getsize(path)
    time.sleep(1.5)  # about 30 beats of each rank
    after = os.path.getsize(path)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    watchdog.wait_for_verdict(10)
    results.put((rank, before, after, seen))


def _rank_outlived_by_nothing(rank: int, port: int, host_rank: int, results) -> None:
    """A rank of a group met on a TCPStore that rank ``host_rank`` serves (-1: the test
    serves it). The host finishes first; the other ranks work on for many beats."""
    from shardkit.fault import stop_watching, watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == host_rank, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    seen = []
    watchdog = watch_peers(1.0, on_lost=lambda who, message: seen.append((who, message)))
    dist.barrier()
    time.sleep(0.6)  # a few beats: every rank has read the others' first beat
    host = watchdog._store_host_rank
    dist.barrier()
    if rank == host_rank:
        stop_watching()  # its store ends with its process, as at the end of a script
        results.put((rank, host, seen))
        results.close()
        results.join_thread()
        os._exit(0)
    results.put(("ready", rank))
    watchdog.wait_for_verdict(3.0)  # local work after the host finished (or the server died)
    results.put((rank, host, [(who, "rendezvous is lost" in message) for who, message in seen]))


def _spawn(target, args_of_rank, results, n=2) -> list:
    """Start ``n`` spawned processes running ``target(*args_of_rank(rank), results)``."""
    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=target, args=(*args_of_rank(r), results)) for r in range(n)]
    for p in ranks:
        p.start()
    return ranks


def _join(ranks) -> None:
    """Wait for the processes, killing any still alive after 30 s."""
    for p in ranks:
        p.join(30)
        if p.is_alive():
            p.kill()


# ---------------------------------------------------------------------- tests


def test_shared_memory_refuses_calls_that_do_not_fit_on_every_rank(world2):
    """Before: with every rank alike, the dtype cases cast silently ("ok"); with the last rank
    alone, rank 0 waited out timeout_s (60 s here) in a round rank 1 never ran."""
    for rank, r in enumerate(world2.run(_calls_that_do_not_fit)):
        for (name, everywhere), (first, after, seconds) in r.items():
            if everywhere or rank == 1:  # the rank whose call is wrong: its own ValueError
                assert first.startswith("ValueError: "), (name, everywhere, first)
                if "dtype" in name:
                    assert "must have one dtype" in first, first
            else:  # its peer raises at once, naming it and its error
                assert first.startswith("DivergedCollectivesError: ") and \
                    "rank 1 refused its" in first and "ValueError" in first, (name, first)
                assert seconds < 20, (name, seconds)
            assert after == "DivergedCollectivesError", (name, everywhere, after)
    assert "output is torch.int64 and input torch.float32" in r["all_gather dtype", True][0]


def test_shared_memory_counts_the_bytes_of_the_process_group_op_by_op(world2):
    """Before, at world 2: broadcast 0 on the source and 4004 bytes on the other rank (the
    process group: 2002 on both); reduce_to_owners 20 and 32 (26); unequal all-gather 20 and
    12 (16)."""
    shm = world2.run(_bytes_of_every_op, "shm")
    pg = world2.run(_bytes_of_every_op, "pg")
    for rank in range(2):
        for op in pg[rank]:
            assert shm[rank][op] == pg[rank][op], (rank, op, shm[rank][op], pg[rank][op])
    assert pg[0]["broadcast"][0] == {"broadcast": 1001 * 4 / 2}


def test_shared_memory_carries_non_contiguous_tensors_as_the_process_group(world2):
    """Before: broadcast raised "view size is not compatible", all_reduce refused the tensor,
    and the non-contiguous outputs could not be viewed."""
    shm = world2.run(_non_contiguous_tensors, "shm")
    pg = world2.run(_non_contiguous_tensors, "pg")
    for rank in range(2):
        assert shm[rank]["broadcast"] == pg[rank]["broadcast"], rank
        assert shm[rank]["all_to_all output"] == pg[rank]["all_to_all output"], rank
        assert shm[rank]["all_reduce"].startswith("ok"), shm[rank]["all_reduce"]
        expected = (torch.arange(6000.0).view(2, 3000).t() * 2 + 10).tolist()
        assert shm[rank]["all_reduce"] == f"ok {expected}"
        # rank-major in the output's own (logical) order, as all_to_all lands there
        gathered = [[0.0, 1.0], [2.0, 3.0], [10.0, 11.0], [12.0, 13.0]]
        assert shm[rank]["all_gather output"] == f"ok {gathered}"


def test_watchdog_keeps_a_file_store_bounded_and_still_names_a_killed_peer():
    """Before: the store file grew by about 50 bytes a beat a rank (over 3 KB here)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        ranks = _spawn(_store_file_beside_the_watchdog, lambda r: (r, path), results)
        try:
            rank, before, after, seen = results.get(timeout=90)
        finally:
            _join(ranks)
    assert rank == 0 and seen == [1], (rank, seen)
    assert after == before, (before, after)


def test_watchdog_finds_the_rank_that_serves_the_store():
    """Before: rank 1 served the store and finished first; rank 0 took the vanished store for
    the lost rendezvous and was stopped at work (seen [(None, True)]), its host taken for 0."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = _spawn(_rank_outlived_by_nothing, lambda r: (r, port, 1), results)
    try:
        got = sorted(x for x in (results.get(timeout=90) for _ in range(3)) if x[0] != "ready")
    finally:
        _join(ranks)
    assert got == [(0, 1, []), (1, 1, [])], got


def test_a_store_served_outside_the_job_is_the_lost_rendezvous_not_rank_0():
    """Before: when the test's server died, rank 1 was told "rank 0 ... is lost" ((0, False))
    and rank 0 "the job's rendezvous is lost", the host taken for rank 0 on both."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = _spawn(_rank_outlived_by_nothing, lambda r: (r, port, -1), results)
    try:
        assert sorted(results.get(timeout=90) for _ in range(2)) == [("ready", 0), ("ready", 1)]
        del server  # the server outside the job dies
        got = sorted(results.get(timeout=30) for _ in range(2))
    finally:
        _join(ranks)
    assert got == [(0, None, [(None, True)]), (1, None, [(None, True)])], got


# ---------------------------------------------------------------------- rank-side bodies


def _dropped_handles_of_non_contiguous_tensors() -> dict:
    """Each operation on a transposed tensor, its handle dropped unwaited; a later operation is
    waited for, so the dropped ones (queued before it) have run on every rank."""
    from shardkit.shm_transport import SharedMemoryTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    shm = SharedMemoryTransport(part_bytes=4096, timeout_s=60)
    shm.prepare(None)

    def transposed(rows, cols, offset):
        return (torch.arange(float(rows * cols)) + offset).view(rows, cols).t()
    tensors = {
        "all_reduce": transposed(2, 3000, 10 * rank),  # several rounds of 4 KiB parts
        "broadcast": transposed(2, 5, 10 * rank),
        "all_gather": torch.zeros(n, 4).t(),
        "all_to_all": torch.zeros(2, n).t(),
    }
    shm.all_reduce(tensors["all_reduce"], None)
    shm.broadcast(tensors["broadcast"], 0, None)
    shm.all_gather(tensors["all_gather"], torch.arange(4.0) + 10 * rank, None)
    shm.all_to_all(tensors["all_to_all"], torch.arange(2.0 * n) + 10 * rank, None)
    shm.all_reduce(torch.ones(3), None).wait()
    out = {name: t.tolist() for name, t in tensors.items()}
    shm.close()
    return out


def _init_destroy_cycles(rank: int, path: str, cycles: int, results) -> None:
    """``cycles`` times: a group met on ``file://path<cycle>``, watched, then destroyed; the
    heartbeat folders beside the store files while each group is up. A new store file per cycle:
    torch's FileStore wants a fresh file for each initialization, and one reused could still
    hold the last cycle's addresses when the faster rank met there again (gloo's
    ``connectFullMesh ... Connection refused``)."""
    from shardkit.fault import watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    folders = []
    for cycle in range(cycles):
        dist.init_process_group("gloo", init_method=f"file://{path}{cycle}", rank=rank,
                                world_size=2)
        watch_peers(0.4, on_lost=lambda who, message: None)
        dist.barrier()
        time.sleep(0.3)  # a few beats
        folders.append(len(glob.glob(f"{path}*.shardkit-heartbeat-*")))
        dist.barrier()
        dist.destroy_process_group()
        time.sleep(0.3)  # the watchdog sees its group gone at its next beat and retires
    results.put((rank, folders))
    # the process exits here: atexit stops a watchdog that is still running, not a retired one


# ---------------------------------------------------------------------- tests


def test_shared_memory_lands_non_contiguous_results_of_dropped_handles(world2):
    """Before: the dropped operations left the four tensors as they were (the all-reduced one
    still this rank's input, the gathered ones zeros)."""
    n = 2
    for rank, got in enumerate(world2.run(_dropped_handles_of_non_contiguous_tensors)):
        summed = sum((torch.arange(6000.0) + 10 * r).view(2, 3000).t() for r in range(n))
        assert got["all_reduce"] == summed.tolist(), rank
        assert got["broadcast"] == torch.arange(10.0).view(2, 5).t().tolist(), rank
        # rank-major in the output's own (logical) order, as the process group lands it
        gathered = torch.cat([torch.arange(4.0) + 10 * r for r in range(n)]).view(4, n)
        assert got["all_gather"] == gathered.tolist(), rank
        # chunk ``rank`` of rank r's input lands in chunk r of the output (logical order)
        chunks = torch.tensor([[2.0 * rank + i + 10 * r for i in range(2)] for r in range(n)])
        assert got["all_to_all"] == chunks.tolist(), rank


def test_watchdog_leaves_no_heartbeat_folder_after_init_destroy_cycles():
    """Before: one folder more per cycle while the process lived ([1, 2, 3] on each rank), all
    three left behind at exit."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        ranks = [ctx.Process(target=_init_destroy_cycles, args=(r, path, 3, results))
                 for r in range(2)]
        for p in ranks:
            p.start()
        try:
            got = sorted(results.get(timeout=90) for _ in ranks)
        finally:
            for p in ranks:
                p.join(30)
                if p.is_alive():
                    p.kill()
        left = glob.glob(f"{path}*.shardkit-heartbeat-*")
    assert got == [(0, [1, 1, 1]), (1, [1, 1, 1])], got
    assert left == [], left
    assert [p.exitcode for p in ranks] == [0, 0]
