"""Review of the peer watchdog's store lookup (commit 374d0ea).

Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=true``) every TCP store was taken
for the agent's, which outlives the ranks, even a ``TCPStore`` that rank 0 hosts and passes to
``init_process_group(store=...)``. When rank 0 then finished first, its store went with it and
every peer still at work (an eval, a save) was stopped with exit status 75 ("the job's
rendezvous is lost"); before that commit the watchdog used the agent's store and they finished.

Two spawned processes of their own: the test plays torchrun's agent (it serves MASTER_PORT).
"""

import multiprocessing as mp
import os
import time

import torch.distributed as dist

from shardkit.testing import free_port


def _spawned_results(target, args_per_process: list) -> list:
    """Run ``target(*args, results)`` in one spawned process per ``args_per_process`` entry
    and return what they put on ``results`` (one item each), sorted; the processes are
    joined, or killed after 30 s, whatever happens (the stores outlive them in the caller)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(*args, results)) for args in args_per_process]
    for p in processes:
        p.start()
    try:
        return sorted(results.get(timeout=90) for _ in processes)
    finally:
        for p in processes:
            p.join(30)
            if p.is_alive():
                p.kill()


def _rank_outlives_the_store_host(rank: int, agent_port: int, own_port: int, results) -> None:
    """A rank of a job under torchrun's variables: first a group met on the agent's store
    (env://), then one met on a TCPStore rank 0 hosts (store=); rank 0 finishes first in the
    second, rank 1 works on after it."""
    from shardkit.fault import stop_watching, watch_peers
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent_port), RANK=str(rank),
                      WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT="0")
    seen = []
    dist.init_process_group("gloo")
    hosts = [watch_peers(1.0, on_lost=lambda who, message: seen.append(who))._store_host_rank]
    stop_watching()
    dist.barrier()
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", own_port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    hosts.append(watch_peers(1.0, on_lost=lambda who, message: seen.append(who))._store_host_rank)
    dist.barrier()
    if rank == 0:
        stop_watching()  # its store ends with its process, as at the end of a script
        results.put((rank, hosts, seen))
        results.close()
        results.join_thread()
        os._exit(0)
    time.sleep(2.0)  # local work after rank 0 finished: many beats of a 1 s watchdog
    results.put((rank, hosts, seen))


def test_a_store_rank_0_hosts_is_not_taken_for_torchruns_agent_store():
    """Before: rank 1's watchdog took rank 0's vanished store for the lost rendezvous and
    stopped it (on_lost(None, ...)); the agent's own store stays host-less as before."""
    agent_port, own_port = free_port(), free_port()
    agent = dist.TCPStore("127.0.0.1", agent_port, 2, True, wait_for_workers=False)
    got = _spawned_results(_rank_outlives_the_store_host,
                           [(r, agent_port, own_port) for r in range(2)])
    del agent
    assert got == [(0, [None, 0], []), (1, [None, 0], [])], got


def _rank_of_one_of_two_jobs(job: int, rank: int, port: int, results) -> None:
    """Rank ``rank`` of job ``job``; both jobs meet on one TCP store server, each under its own
    PrefixStore (what PrefixStore is for). Rank 1 of job 0 stops on an error."""
    from shardkit.fault import watch_peers
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)
    server = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"job{job}", server), rank=rank,
                            world_size=2)
    seen = []
    watchdog = watch_peers(1.0, on_lost=lambda who, message: seen.append(who))
    dist.barrier()
    if (job, rank) == (0, 1):
        watchdog.fail(ValueError("stops here"))
    else:
        watchdog.wait_for_verdict(4.0)
    results.put((job, rank, seen))
    dist.barrier()


def test_jobs_sharing_a_store_under_prefixes_do_not_read_each_others_heartbeats():
    """Before: the watchdog dropped the group's PrefixStore and beat at the server's root, so
    the two jobs' ranks shared keys: job 1's healthy rank 0 took job 0's failed rank 1 for its
    own rank 1 and stopped (and job 1's beats would have hidden a death in job 0)."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 4, True, wait_for_workers=False)
    got = _spawned_results(_rank_of_one_of_two_jobs,
                           [(job, r, port) for job in range(2) for r in range(2)])
    del server
    assert got == [(0, 0, [1]), (0, 1, []), (1, 0, []), (1, 1, [])], got
