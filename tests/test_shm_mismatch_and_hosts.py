"""Transport and failure-handling corners a torch.distributed / DeepSpeed user meets.

- Ranks that issue different collectives over ``SharedMemoryTransport`` raised a plain
  TransportError whose words ("shared-memory") read as a lost peer, so with the peer watchdog
  on, every rank's uncaught-exception hook first waited out the heartbeat timeout (60 s by
  default) before printing it. Now it is a CollectiveMismatchError, reported at once.
- ``SharedMemoryTransport`` refused complex and int16 tensors (TypeError) that the process
  group's collectives carry; its slots did not start aligned for complex128 at odd worlds.
- ``shardkit.fault.watch_peers`` (and so ``shardkit.initialize``) raised KeyError('MASTER_ADDR')
  when the process group was made with torch's ``tcp://`` or ``file://`` init method.
- ``SharedMemoryTransport`` took ranks on two machines for one host (it compared only the pid
  namespace's number, the same on every host), and a rank whose peer died during its set-up
  kept the descriptor of the memory it had created.

One world of 2 gloo ranks for the collectives; the watchdog check starts two processes of its
own (it needs process groups made without torchrun's variables).
"""

import multiprocessing as mp
import os
import signal
import tempfile

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.testing import World, free_port, world_fixture

world2 = world_fixture(2, timeout=90, failure_grace_s=20)


# ---------------------------------------------------------------------- rank-side bodies


def _diverged_collectives() -> dict:
    from shardkit.collective_check import CollectiveMismatchError
    from shardkit.fault import looks_like_communication_error
    from shardkit.shm_transport import SharedMemoryTransport, TransportError
    transport = SharedMemoryTransport(part_bytes=4096, timeout_s=30)
    transport.prepare(None)
    rank = skdist.get_rank()
    try:
        try:
            if rank == 0:
                transport.all_gather(torch.empty(8), torch.ones(4), None).wait()
            else:
                transport.reduce_scatter(torch.ones(8), None).wait()
        except TransportError as error:
            first = error
        try:  # the transport is broken: the next op raises the same kind of error at once
            transport.all_reduce(torch.ones(2), None).wait()
        except TransportError as error:
            again = error
    finally:
        transport.close()
    return {"mismatch": [isinstance(e, CollectiveMismatchError) for e in (first, again)],
            "names both": "all_gather of 16 bytes" in str(first)
            and "reduce_scatter of 32 bytes" in str(first),
            "looks like a lost peer": looks_like_communication_error(first)}


def _values(r: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rank ``r``'s ``k`` values of ``dtype`` (complex: imaginary parts too)."""
    x = torch.arange(k, dtype=torch.float64) % 7 + 10 * r + seed
    return torch.complex(x, -2 * x).to(dtype) if dtype.is_complex else x.to(dtype)


def _complex_and_int16_over_shared_memory() -> list:
    """Each operation over shared memory against the exact result, for the dtypes the process
    group carries that shared memory refused; 1 element and sizes over several rounds."""
    from shardkit.shm_transport import SharedMemoryTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    shm = SharedMemoryTransport(part_bytes=4096, timeout_s=30)
    shm.prepare(None)
    wrong = []
    for dtype in (torch.complex64, torch.complex128, torch.int16):
        for k in (1, 3000):
            mine = slice(rank * k, (rank + 1) * k)
            got = {
                "all_gather": shm.all_gather(torch.empty(n * k, dtype=dtype),
                                             _values(rank, k, dtype), None),
                "reduce_scatter": shm.reduce_scatter(_values(rank, n * k, dtype), None),
                "all_to_all": shm.all_to_all(torch.empty(n * k, dtype=dtype),
                                             _values(rank, n * k, dtype), None),
                "reduce_to_owners": shm.reduce_to_owners(
                    [_values(rank, k + r, dtype, seed=r) for r in range(n)], None),
                "broadcast": shm.broadcast(_values(rank, k, dtype), 1, None),
                "all_reduce": shm.all_reduce(_values(rank, k, dtype), None),
            }
            exact = {
                "all_gather": torch.cat([_values(r, k, dtype) for r in range(n)]),
                "reduce_scatter": sum(_values(r, n * k, dtype)[mine] for r in range(n)),
                "all_to_all": torch.cat([_values(r, n * k, dtype)[mine] for r in range(n)]),
                "reduce_to_owners": sum(_values(r, k + rank, dtype, seed=rank)
                                        for r in range(n)),
                "broadcast": _values(1, k, dtype),
                "all_reduce": sum(_values(r, k, dtype) for r in range(n)),
            }
            wrong += [(str(dtype), k, op) for op, handle in got.items()
                      if not torch.equal(handle.wait(), exact[op])]
    try:
        shm.all_reduce(_values(rank, 3, torch.complex64), None, op=skdist.ReduceOp.MAX)
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    shm.close()
    return [wrong, refused]


def _rank_on_another_host_with_the_same_pid_namespace() -> list:
    """Rank 1 reports another kernel (boot id) and the same pid namespace number, as a rank on
    another machine does (every host's first pid namespace has the same number)."""
    import warnings

    from shardkit import shm_transport
    real = shm_transport._host_and_pid_namespace
    if skdist.get_rank() == 1:
        shm_transport._host_and_pid_namespace = lambda: ("another-boot-id", real()[1])
    transport = shm_transport.SharedMemoryTransport(part_bytes=4096)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            transport.prepare(None)
        summed = transport.all_reduce(torch.ones(3), None).wait().tolist()
        return [transport.describe(None), [str(w.message) for w in caught], summed]
    finally:
        shm_transport._host_and_pid_namespace = real
        transport.close()


def _shared_memory_kept_by_this_process() -> list:
    """This process's open descriptors and mappings of the transport's anonymous memory."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed while listed (the listing's own descriptor)
            pass
    maps = open("/proc/self/maps").read().splitlines()
    return [x for x in fds + maps if "shardkit-transport" in x]


def _peer_killed_while_memory_is_mapped() -> str:
    """Rank 1 SIGKILLs itself instead of mapping rank 0's memory; rank 0 must raise and keep
    nothing of the memory it created."""
    from shardkit import shm_transport
    if skdist.get_rank() == 1:
        shm_transport._attach = lambda offer, size: os.kill(os.getpid(), signal.SIGKILL)
    try:
        shm_transport.SharedMemoryTransport(part_bytes=4096).prepare(None)
    except Exception as error:  # noqa: BLE001 - what the survivor sees
        raised = type(error).__name__
    else:
        raised = "no error"
    return f"raised {raised}, kept {_shared_memory_kept_by_this_process()}"


def _watch_from_init_methods(rank: int, methods: list, results) -> None:
    """A rank of groups made one after the other by torch's ``init_process_group(init_method=
    ...)``, without torchrun's variables: each group's watchdog must run and see the peer
    fail."""
    import torch.distributed as dist

    from shardkit.fault import watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    for method in methods:
        dist.init_process_group("gloo", init_method=method, rank=rank, world_size=2)
        seen = []
        try:
            watchdog = watch_peers(2.0, on_lost=lambda who, message: seen.append(who))
            dist.barrier()
            if rank == 1:
                watchdog.fail(ValueError("stops here"))
            else:
                watchdog.wait_for_verdict(20)
            results.put((method.split(":")[0], rank, seen))
        except Exception as error:  # noqa: BLE001 - reported to the test
            results.put((method.split(":")[0], rank, f"{type(error).__name__}: {error}"))
        dist.barrier()
        dist.destroy_process_group()


# ---------------------------------------------------------------------- tests


def test_diverged_shared_memory_collectives_are_a_mismatch_not_a_lost_peer(world2):
    """Before: a TransportError that fault.py took for a dead peer, so an uncaught one waited
    out the watchdog's timeout (measured: 35 s with timeout_s=20) before it was printed."""
    assert world2.run(_diverged_collectives) == [
        {"mismatch": [True, True], "names both": True, "looks like a lost peer": False}] * 2


def test_shared_memory_carries_complex_and_int16_as_the_process_group(world2):
    """Before: TypeError "dtype torch.complex64 is not supported" for every operation."""
    for mismatched, refused in world2.run(_complex_and_int16_over_shared_memory):
        assert mismatched == []
        assert "op=MAX" in refused and "complex64" in refused


def test_shared_memory_slots_start_aligned_for_every_dtype():
    """complex128 views need 16-byte alignment: the slots used to start at 4096 + 168 N."""
    from shardkit import shm_transport
    for n in range(1, 10):
        assert shm_transport._offsets(n)[2] % 16 == 0
        assert shm_transport._Ring.total_bytes(n, 4096) == \
            shm_transport._offsets(n)[2] + shm_transport.NUM_SLOTS * n * 4096


def test_watch_peers_runs_on_groups_made_with_an_init_method():
    """Before: KeyError('MASTER_ADDR') from watch_peers (and shardkit.initialize, which starts
    it) on every rank of a group made with init_method="tcp://..." or "file://..."."""
    with tempfile.TemporaryDirectory() as tmp:
        methods = [f"tcp://127.0.0.1:{free_port()}",
                   f"file://{os.path.join(tmp, 'rendezvous')}"]
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        ranks = [ctx.Process(target=_watch_from_init_methods, args=(r, methods, results))
                 for r in range(2)]
        for p in ranks:
            p.start()
        seen = {(scheme, rank): what for scheme, rank, what in
                (results.get(timeout=90) for _ in range(2 * len(methods)))}
        for p in ranks:
            p.join(30)
    assert seen == {("tcp", 0): [1], ("tcp", 1): [], ("file", 0): [1], ("file", 1): []}, seen


def test_ranks_on_two_hosts_fall_back_naming_why(world2):
    """Before: only the pid namespace was compared, and every host's first one has the same
    number, so ranks on two machines went on to map rank 0's memory through /proc/<pid>/fd of
    unrelated local processes before falling back for a reason that named no host."""
    expected = "SharedMemoryTransport: the ranks are not all in one pid namespace on one host"
    for described, warned, summed in world2.run(_rank_on_another_host_with_the_same_pid_namespace):
        assert described == "process group (gloo; shared memory unavailable)"
        assert len(warned) == 1 and warned[0].startswith(expected), warned
        assert summed == [2.0] * 3


def test_a_peer_killed_during_set_up_leaves_no_shared_memory_on_its_peer():
    """Before: rank 0 kept the descriptor of the memory it created open for the rest of its
    life (an in-process restart leaked one per failed set-up)."""
    with World(2, timeout=120) as world:
        with pytest.raises(Exception) as info:
            world.run(_peer_killed_while_memory_is_mapped)
    report = str(info.value)
    assert "rank 1 exited with code -9" in report, report
    assert "raised CollectiveError, kept []" in report, report
