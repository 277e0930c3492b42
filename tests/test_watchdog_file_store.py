"""Transports and the peer watchdog, as a torch.distributed user meets them.

- A job started on the path of a killed job's ``file://`` store read the dead job's heartbeat
  folder token from the store's leftover file, and with it the dead job's verdict: its
  watchdog stopped the new, healthy job at its first beat ("rank 1 of 2 is lost"). Now a token
  made before this process started is taken for an earlier job's and replaced.
- No write access beside the store's file raised a bare ``PermissionError`` from
  ``os.makedirs``; now the error names the folder, why it is needed and how to do without it.
- ``CommCounter`` recorded the shared-memory all-reduce as ``(N-1)·S`` (what its algorithm
  reads), where the process group's all-reduce of the same tensor is ``2(N-1)/N·S``
  (DESIGN.md's convention): a wrapper's count depended on the transport from world 3 on
  (checked at worlds 2 and 4 by tests/test_transport.py's shared-memory counts).
- ``ProcessGroupTransport.all_gather`` into a non-contiguous output, and ``reduce_scatter`` of a
  non-contiguous input, failed on gloo with "input tensor has to be contiguous" (naming neither
  the argument nor the op); now they go through a contiguous copy, as shared memory does.

One world of 4 gloo ranks for the transport checks; the watchdog checks start processes of
their own (they need process groups made without torchrun's variables).
"""

import multiprocessing as mp
import os
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world4 = world_fixture(4, timeout=180, failure_grace_s=20)


# ---------------------------------------------------------------------- rank-side bodies


def _non_contiguous_process_group_ops() -> dict:
    """An all-gather into a transposed output and a reduce-scatter of a strided input, on the
    process-group transport (gloo)."""
    from shardkit.transport import ProcessGroupTransport
    t = ProcessGroupTransport()
    rank, n = skdist.get_rank(), skdist.get_world_size()
    out = {}
    base = torch.zeros(3, n)
    try:
        result = t.all_gather(base.t(), torch.arange(3.0) + 10 * rank, None).wait()
        out["all_gather"] = (base.tolist(), result.data_ptr() == base.data_ptr())
    except Exception as error:  # noqa: BLE001 - compared by the test
        out["all_gather"] = f"{type(error).__name__}: {error}"
    strided = (torch.arange(4.0 * n) + rank).repeat_interleave(2)[::2]
    try:
        out["reduce_scatter"] = t.reduce_scatter(strided, None).wait().tolist()
    except Exception as error:  # noqa: BLE001 - compared by the test
        out["reduce_scatter"] = f"{type(error).__name__}: {error}"
    return out


def _job_on_file_store(rank: int, path: str, killed: bool, results) -> None:
    """A rank of a job met on ``file://path``, watched every 0.05 s. ``killed``: rank 1 is
    SIGKILLed after the first barrier and rank 0 (which must name it) leaves without cleaning
    up, as the default ``on_lost`` does; else the job runs for several timeouts."""
    from shardkit.fault import watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT"):
        os.environ.pop(name, None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    seen = []
    watchdog = watch_peers(0.4, on_lost=lambda who, message: seen.append(who))
    dist.barrier()
    if killed:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        watchdog.wait_for_verdict(10)
        results.put(("killed job", rank, seen))
        results.close()
        results.join_thread()
        os._exit(0)
    time.sleep(1.5)  # about 4 timeouts
    dist.barrier()
    results.put(("new job", rank, seen))


def _run_job(path: str, killed: bool) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_job_on_file_store, args=(r, path, killed, results))
             for r in range(2)]
    for p in ranks:
        p.start()
    try:
        return sorted(results.get(timeout=120) for _ in range(1 if killed else 2))
    finally:
        for p in ranks:
            p.join(30)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------- tests


def test_process_group_transport_carries_non_contiguous_tensors_on_gloo(world4):
    """Before: both raised "RuntimeError: input tensor has to be contiguous"."""
    for rank, r in enumerate(world4.run(_non_contiguous_process_group_ops)):
        assert not isinstance(r["all_gather"], str), r["all_gather"]
        gathered, same_storage = r["all_gather"]
        assert gathered == [[float(i + 10 * q) for q in range(4)] for i in range(3)], gathered
        assert same_storage, "wait() returns the caller's output"
        # rank q's input is 0..15 + q; rank r receives the sum of its 4 elements from each
        expected = [sum(4.0 * rank + i + q for q in range(4)) for i in range(4)]
        assert r["reduce_scatter"] == expected, (rank, r["reduce_scatter"])


def test_a_job_on_a_killed_jobs_file_store_does_not_inherit_its_verdict():
    """Before: the new job's ranks read the dead job's verdict at their first beat and were
    told "rank 1 of 2 is lost" (seen [1] on both), though every rank of the new job was well."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rendezvous")
        assert _run_job(path, killed=True) == [("killed job", 0, [1])]
        # Note: gloo's own rendezvous reads the dead job's addresses too unless every rank
        # has written its own first (a race torch itself may lose); clear them, as a won race
        # would, so that the new job's process group starts and the watchdog alone is tested
        leftover = dist.FileStore(path, 1)
        for rank in range(2):
            leftover.delete_key(f"default_pg/0//cpu//0/{rank}")
        del leftover
        assert _run_job(path, killed=False) == [("new job", 0, []), ("new job", 1, [])]


def test_no_write_access_beside_a_file_store_names_the_folder_and_the_way_out(monkeypatch):
    """Before: ``PermissionError: [Errno 13] Permission denied: '<folder>'`` from os.makedirs,
    with nothing about the watchdog or how to run without it."""
    from shardkit import fault

    def refuse(folder, exist_ok=False):
        raise PermissionError(13, "Permission denied", folder)
    monkeypatch.setattr(fault.os, "makedirs", refuse)
    store = dist.HashStore()
    with pytest.raises(PermissionError) as caught:
        fault._HeartbeatFiles.beside("/data/jobs/rendezvous", store, "shardkit/heartbeat//0/")
    message = str(caught.value)
    assert "watch_peers" in message and "/data/jobs/rendezvous.shardkit-heartbeat-" in message
    assert "SHARDKIT_PEER_TIMEOUT=0" in message and "Permission denied" in message, message


def _host_seen_by_a_forked_rank(port: int, own_store: bool) -> tuple:
    """In a child forked from this process (which serves the store at ``port``, as a launcher
    that made the store and forked its ranks would): what the watchdog's connection finds out
    about who serves the store of a world of 1 met on it (``own_store``: on a store the child
    serves itself, the control)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's clean-up
        try:
            from shardkit import fault
            if own_store:
                store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
            else:
                store = dist.TCPStore("127.0.0.1", port, 1, False, wait_for_workers=False)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            _, host = fault._connect_to_rendezvous(5.0, "shardkit/heartbeat//0/")
            answer = repr((host.serves, host.guess))
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            answer = repr((type(error).__name__, str(error)[:200]))
        os.write(writer, answer.encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return eval(answer)  # a repr of booleans, ints, None and strings, written above


def test_a_rank_forked_from_the_store_server_does_not_claim_to_host_it():
    """Before: the forked rank found the inherited listening socket among its own and claimed
    the store ((True, 0)), which ends with the launcher, not with it."""
    from shardkit.testing import free_port
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    try:
        assert _host_seen_by_a_forked_rank(port, own_store=False) == (False, 0)
        assert _host_seen_by_a_forked_rank(port, own_store=True) == (True, 0)
    finally:
        del server


def _collective_with_a_stalled_peer(rank: int, port: int, results) -> None:
    """Rank 1 stalls (alive, beating, no collective) while rank 0 all-reduces under a 3 s
    process-group timeout; rank 0 reports what the watchdog says of its timed-out collective."""
    import contextlib
    import datetime
    import io
    from shardkit.fault import watch_peers
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=3))
    watchdog = watch_peers(1.0, on_lost=lambda who, message: None)
    skdist.barrier()
    if rank == 1:
        time.sleep(8)  # stalled: its watchdog still beats
        os._exit(0)
    time.sleep(0.5)  # a few beats: rank 1's count of collectives is read
    try:
        skdist.all_reduce(torch.ones(4))
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


def test_a_timed_out_collective_names_the_stalled_peer():
    """Before: "a collective failed and no peer was lost ...: a peer is stalled", naming none."""
    from shardkit.testing import free_port, process_context
    port = free_port()
    ctx = process_context()  # forked from the fork server: no torch import per rank
    results = ctx.Queue()
    ranks = [ctx.Process(target=_collective_with_a_stalled_peer, args=(r, port, results))
             for r in range(2)]
    for p in ranks:
        p.start()
    note = None
    try:
        note = results.get(timeout=120)
    finally:
        for p in ranks:  # once rank 0 answered, the stalled rank's sleep is of no more use
            p.join(0 if note is not None else 30)
            if p.is_alive():
                p.kill()
                p.join()
    assert "rank(s) 1 still beat but had not reached it" in note, note
    assert "issued [1] collectives on the default group, this rank 2" in note, note
