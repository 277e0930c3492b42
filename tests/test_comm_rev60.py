"""Review of the file-store heartbeats and the shared-memory transport's contiguous copies.

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

One world of 2 gloo ranks for the transport check; the watchdog check starts two processes of
its own (it makes and destroys its process groups).
"""

import glob
import multiprocessing as mp
import os
import tempfile
import time

import torch
import torch.distributed as dist

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120, failure_grace_s=20)


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
    """``cycles`` times: a group met on ``file://path``, watched, then destroyed; the heartbeat
    folders beside the store file while each group is up."""
    from shardkit.fault import watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    folders = []
    for _ in range(cycles):
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
        watch_peers(0.4, on_lost=lambda who, message: None)
        dist.barrier()
        time.sleep(0.3)  # a few beats
        folders.append(len(glob.glob(f"{path}.shardkit-heartbeat-*")))
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
        left = glob.glob(f"{path}.shardkit-heartbeat-*")
    assert got == [(0, [1, 1, 1]), (1, [1, 1, 1])], got
    assert left == [], left
    assert [p.exitcode for p in ranks] == [0, 0]
