"""Review of commit 883200d (peer watchdog, transports): cases next to the ones it fixed.

- The ``file://`` heartbeat folder's token was replaced by any rank whose process started
  after the token was made (its wall-clock time), taken for a killed job's. A rank of the
  same job that starts late (a lazily connected process group: NCCL, or gloo under
  ``TORCH_GLOO_LAZY_INIT``; ranks launched one after the other) or on a host whose clock runs
  ahead (a store on a shared file system) replaced its peers' token: the ranks beat in two
  folders and each declared the other lost, stopping a healthy job. A token is now an
  earlier job's only when its folder already holds this rank's beat or a verdict: no clock.
- ``collectives_issued()`` kept counting across ``destroy_process_group`` and a new default
  group. After a failed collective the ranks' counts differ (the failing rank counted it), so
  in the next group a timed-out collective named a peer that was at the same point as
  "had not reached it". A new default group now counts from 0.

- ``ProcessGroupTransport.all_reduce`` and ``broadcast`` of a non-contiguous tensor on gloo
  (a column of a matrix, as the commit's all-gather fix carried) reduced and overwrote the
  wrong memory silently: gloo reads ``numel`` elements from the view's first one. A
  channels-last tensor on some ranks met the others' contiguous ones in another order. Now
  they go through a contiguous copy, as the all-gather does.

The watchdog tests start processes of their own (process groups made without torchrun's
variables); the transport test runs in one world of 2 gloo ranks.
"""

import datetime
import multiprocessing as mp
import os
import tempfile
import time

import torch
import torch.distributed as dist

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _clear_launcher_env() -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(name, None)


def _late_rank_on_file_store(rank: int, path: str, results) -> None:
    """A rank of a lazily connected gloo job met on ``file://path``; rank 1's process is
    started after rank 0's watchdog made the heartbeat folder's token. Rank 1 then restarts
    its watchdog (its own beat is in the folder already: the folder is still its job's)."""
    from shardkit.fault import stop_watching, watch_peers
    _clear_launcher_env()
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    seen = []
    watchdog = watch_peers(3.0, on_lost=lambda who, message: seen.append(who))
    if rank == 0:
        results.put(("watching", rank, None))
    dist.barrier()  # the ranks connect here
    if rank == 1:
        stop_watching()
        watchdog = watch_peers(3.0, on_lost=lambda who, message: seen.append(who))
    time.sleep(4.0)  # more than one timeout
    dist.barrier()
    results.put(("done", rank, (seen, watchdog._store.folder)))
    results.close()
    results.join_thread()
    os._exit(0)


def test_a_rank_that_starts_late_beats_in_its_peers_folder():
    """Before: rank 1 (started after rank 0's token) replaced the token; each rank declared
    the other lost (seen [1] on rank 0, [0] on rank 1) in a healthy job."""
    # forked, not spawned: rank 1 must join within a timeout of rank 0's watchdog even on a
    # loaded machine (a peer that never beats is lost after the timeout, rightly)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        ranks = [ctx.Process(target=_late_rank_on_file_store, args=(r, path, results))
                 for r in range(2)]
        ranks[0].start()
        try:
            assert results.get(timeout=120)[0] == "watching"
            time.sleep(0.5)
            ranks[1].start()
            done = sorted(results.get(timeout=120) for _ in range(2))
        finally:
            for p in ranks:
                if p.pid is not None:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
    (_, _, (seen0, folder0)), (_, _, (seen1, folder1)) = done
    assert (seen0, seen1) == ([], []), done
    assert folder0 == folder1, done


def _deadlock_after_an_earlier_group_failed(rank: int, ports: tuple, results,
                                            lag_s: float = 0.0) -> None:
    """A first group where rank 0's all-reduce times out (rank 1 skips it); then a new group
    where both ranks wait to receive from each other (no rank is behind in collectives): rank 0
    reports what the watchdog says of its timed-out receive, ``lag_s`` after it failed."""
    import contextlib
    import io
    from shardkit.fault import stop_watching, watch_peers
    _clear_launcher_env()
    timeout = datetime.timedelta(seconds=2)

    def join(port):  # a store that waits for the slower rank; collectives time out in 2 s
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    join(ports[0])
    skdist.barrier()
    if rank == 0:
        try:
            skdist.all_reduce(torch.ones(2))
        except Exception:  # noqa: BLE001 - the timeout this group ends with
            pass
    else:
        time.sleep(3.0)
    dist.destroy_process_group()
    join(ports[1])
    watchdog = watch_peers(1.0, on_lost=lambda who, message: None)
    skdist.barrier()
    time.sleep(0.5)  # a few beats: the peer's count is read
    issued = skdist.collectives_issued()
    note = "no error"
    try:
        skdist.recv(torch.empty(2), src=1 - rank)
    except Exception as error:  # noqa: BLE001 - explained as the uncaught-exception hook does
        if rank == 0:
            time.sleep(lag_s)
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            watchdog.explain_communication_error(error)
        note = said.getvalue()
    stop_watching()
    results.put((rank, issued, note))
    results.close()
    results.join_thread()
    os._exit(0)


def _run_the_deadlock(lag_s: float) -> list:
    """``(rank, collectives issued, watchdog's note)`` of each rank, by rank."""
    from shardkit.testing import free_port, process_context
    ports = (free_port(), free_port())
    ctx = process_context()  # forked from the fork server: no torch import per rank
    results = ctx.Queue()
    ranks = [ctx.Process(target=_deadlock_after_an_earlier_group_failed,
                         args=(r, ports, results, lag_s)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        reports = sorted(results.get(timeout=120) for _ in range(2))
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()
    return reports


def test_a_new_default_group_counts_its_collectives_from_zero():
    """Before: rank 0 counted the first group's failed all-reduce too (3 against rank 1's 2)
    and said rank 1 "still beat but had not reached it", though both ranks were waiting at
    the same point."""
    reports = _run_the_deadlock(lag_s=0.0)
    assert [issued for _, issued, _ in reports] == [1, 1], reports
    note = reports[0][2]
    assert "a collective failed and no peer was lost" in note, note
    assert "had not reached it" not in note, note


def test_a_peer_that_timed_out_in_the_same_wait_is_not_blamed():
    """Rank 0 explains its failed receive 0.6 s after rank 1 does (a loaded machine: CI saw
    it). Before: rank 1 gave up first and rank 0 said rank 1 "stopped after its own collective
    failed ...: this rank was still working ... past the process-group timeout", though rank 0
    had been waiting in the receive as long as rank 1."""
    reports = _run_the_deadlock(lag_s=0.6)
    note = reports[0][2]
    assert "a collective failed and no peer was lost" in note, note
    assert "rank(s) 1 gave up on their own failed collective at about the same time" in note, \
        note
    assert "still working" not in note and "had not reached it" not in note, note


def _explained_while_a_give_up_is_half_read(read_after_s: float) -> str:
    """The watchdog thread caught between its two records of a peer's give-up: it has set
    ``gave_up`` and sets the time it read it ``read_after_s`` after this rank's collective
    failed. What ``explain_communication_error`` then says (no process group: a watchdog built
    without ``__init__``, its thread a stand-in that only sets that time)."""
    import contextlib
    import io
    import threading
    from shardkit.fault import PeerWatchdog
    watchdog = PeerWatchdog.__new__(PeerWatchdog)
    watchdog.timeout_s, watchdog.interval_s, watchdog.rank, watchdog.world_size = 0.4, 0.05, 0, 2
    watchdog.lost, watchdog.finished, watchdog.peer_collectives = None, {}, {}
    watchdog.gave_up, watchdog._gave_up_read_at = {1: "RuntimeError: Timed out"}, {}
    watchdog._verdict, watchdog._stopped = threading.Event(), threading.Event()
    watchdog._stop_with = lambda value: None

    def finish_the_read():  # then beats on (alive) until the explanation is given
        time.sleep(read_after_s)
        watchdog._gave_up_read_at[1] = time.monotonic()
        watchdog._stopped.wait(10)
    watchdog._thread = threading.Thread(target=finish_the_read, daemon=True)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        watchdog._thread.start()
        try:
            watchdog.explain_communication_error(RuntimeError("Timed out"))
        finally:
            watchdog._stopped.set()
    return said.getvalue()


def test_a_give_up_being_read_is_judged_by_when_it_was_read():
    """Before: a give-up whose read time was not yet recorded (the watchdog thread set
    ``gave_up`` first) counted as read when this rank's error came, and a peer that gave up in
    the same wait was named as the cause, what the rule added today avoids. Here the window
    is 1.6 s, and the read lands 1.0 s in (after its first half)."""
    note = _explained_while_a_give_up_is_half_read(1.0)
    assert "rank(s) 1 gave up on their own failed collective at about the same time" in note, \
        note
    assert "still working" not in note, note
    assert "rank 1 of 2 stopped after its own collective failed" in \
        _explained_while_a_give_up_is_half_read(0.2)


def _in_place_ops_on_views() -> dict:
    """An all-reduce and a broadcast of a matrix's column, and an all-reduce of a 4-d tensor
    held channels-last on rank 0 and contiguous on rank 1, on the process-group transport."""
    from shardkit.transport import ProcessGroupTransport
    t = ProcessGroupTransport()
    t.prepare(None)
    rank, n = skdist.get_rank(), skdist.get_world_size()
    reduced = torch.full((6, 4), -1.0)
    reduced[:, 1] = torch.arange(6.0) + rank
    t.all_reduce(reduced[:, 1], None).wait()
    sent = torch.full((6, 4), -1.0)
    sent[:, 2] = torch.arange(6.0) * (rank + 1)
    t.broadcast(sent[:, 2], n - 1, None).wait()
    image = torch.arange(24.0).view(1, 2, 3, 4) * (rank + 1)
    if rank == 0:
        image = image.to(memory_format=torch.channels_last)
    t.all_reduce(image, None).wait()
    return {"reduced": reduced, "sent": sent, "image": image.contiguous()}


def test_process_group_all_reduce_and_broadcast_of_a_view_on_gloo(world2):
    """Before: the column's all-reduce summed the matrix's first six elements in row-major
    order (the other columns changed, the column did not get its sum), the broadcast wrote
    the source's first six elements; the mixed-format all-reduce mixed elements."""
    for r in world2.run(_in_place_ops_on_views):
        expected = torch.full((6, 4), -1.0)
        expected[:, 1] = 2 * torch.arange(6.0) + 1
        assert torch.equal(r["reduced"], expected), r["reduced"]
        expected = torch.full((6, 4), -1.0)
        expected[:, 2] = torch.arange(6.0) * 2
        assert torch.equal(r["sent"], expected), r["sent"]
        assert torch.equal(r["image"], torch.arange(24.0).view(1, 2, 3, 4) * 3), r["image"]
