"""Starting and ending the default process group: :func:`init_distributed` from torchrun's
environment (the ranks meet on the rendezvous store first, so that a missing rank or differing
``WORLD_SIZE`` is one clear error on every rank), :func:`init_single_process`, the teardown at
the end of a script that never called :func:`destroy`, and :func:`destroy`. Re-exported by
:mod:`shardkit.distributed`."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist

from shardkit.process_groups import is_initialized
from shardkit.topology import _forget_topology, discover_node_layout

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_VALID_BACKENDS = ("gloo", "nccl", "mpi")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from torchrun's environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``LOCAL_RANK`` picks the
    CUDA device). ``backend=None`` picks ``nccl`` when CUDA is available, else ``gloo``.
    Idempotent: a second call with the group already up returns at once (and checks that the
    backend agrees). Before the backend connects the ranks, they meet on the rendezvous store,
    so that a rank that never comes, or ranks started with different ``WORLD_SIZE`` values,
    are one clear error on every waiting rank. Costs one TCP rendezvous and one small object
    all-gather (every rank's node, for :func:`~shardkit.distributed.node_groups`, and process id,
    for naming a rank of this host that died under a collective); no tensor traffic.

    Raises:
        RuntimeError: a torchrun variable is missing or malformed, naming which; the
            rendezvous cannot be hosted or reached (naming ``MASTER_ADDR``/``MASTER_PORT``);
            ranks missing after ``timeout_s`` (naming them); ``WORLD_SIZE`` differing between
            ranks, or one ``RANK`` given to two processes.
        ValueError: an unknown backend, a ``timeout_s`` that is not a number of seconds > 0,
            or a world size below 1.
    """
    if backend is not None and backend not in _VALID_BACKENDS:
        raise ValueError(f"init_distributed(backend={backend!r}): unknown backend; "
                         f"valid backends are {list(_VALID_BACKENDS)} or None (auto)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not 0 < timeout_s < float("inf"):
        raise ValueError(f"init_distributed(timeout_s={timeout_s!r}): must be a finite number "
                         f"of seconds > 0")
    if dist.is_available() and dist.is_initialized():
        current = dist.get_backend()
        if backend is not None and current != backend:
            raise RuntimeError(f"init_distributed(backend={backend!r}): the default process group "
                               f"already runs backend {current!r}")
        return
    missing = [name for name in _TORCHRUN_VARS if not os.environ.get(name)]
    if missing:
        raise RuntimeError(
            f"init_distributed: environment variable(s) {', '.join(missing)} not set. Launch with "
            f"`torchrun --nproc_per_node N script.py`, or set RANK, WORLD_SIZE, MASTER_ADDR and "
            f"MASTER_PORT yourself")
    rank = _int_env("RANK")
    world_size = _int_env("WORLD_SIZE")
    if world_size < 1:
        raise ValueError(f"init_distributed: WORLD_SIZE={world_size}; it must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_distributed: RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("init_distributed(backend='nccl'): CUDA is not available; use 'gloo'")
        torch.cuda.set_device(_int_env("LOCAL_RANK", default=rank) % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _rendezvous_store(rank, world_size, timeout)
    _meet_every_rank(store, rank, world_size, timeout_s)
    store = dist.PrefixStore(_default_group_prefix(), store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    atexit.register(_destroy_at_exit)
    discover_node_layout()


def _default_group_prefix() -> str:
    """Where the default group keeps its keys in the store: torch's ``"default_pg"``, and for
    a restarted torchrun attempt (whose agent keeps the store) a name of its own.

    Note: with torch's own name, a restarted attempt found the dead attempt's gloo addresses
    still in the agent's store and connected to them ("connectFullMesh failed ... Connection
    refused"): 3 restarts in 4 failed so on one host."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return "default_pg" if attempt in ("", "0") else f"default_pg/attempt{attempt}"


def _rendezvous_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The TCP store at ``MASTER_ADDR:MASTER_PORT`` that ``env://`` would make (hosted by rank 0,
    or by torchrun's agent when ``TORCHELASTIC_USE_AGENT_STORE`` says so), but not waiting for
    the other ranks to connect (:func:`_meet_every_rank` does, naming the missing ones), and
    with errors that name the address."""
    host, port = os.environ["MASTER_ADDR"], _int_env("MASTER_PORT")
    if not 0 < port < 2 ** 16:
        raise ValueError(f"init_distributed: MASTER_PORT={port} is not a TCP port (1-65535)")
    hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    try:
        return dist.TCPStore(host, port, world_size, is_master=hosting, timeout=timeout,
                             wait_for_workers=False, multi_tenant=hosting)
    except (RuntimeError, OSError) as err:
        if hosting:
            raise RuntimeError(
                f"init_distributed: rank 0 could not host the rendezvous at MASTER_ADDR={host} "
                f"MASTER_PORT={port} (a port another job or an earlier run still holds, or an "
                f"address that is not this machine's): choose a free MASTER_PORT. The store "
                f"said: {err}") from err
        raise RuntimeError(
            f"init_distributed: rank {rank} could not reach the rendezvous at MASTER_ADDR={host} "
            f"MASTER_PORT={port} within {timeout.total_seconds():g} s: is rank 0 running, and "
            f"is MASTER_ADDR its address as seen from this machine? The store said: {err}"
        ) from err


_INIT_GENERATION = [0]  # how many times this process met its peers (keys of a re-init differ)


def _meet_every_rank(store, rank: int, world_size: int, timeout_s: float) -> None:
    """Wait on ``store`` until all ``world_size`` ranks have arrived, before the backend starts
    connecting them, so that a missing rank or a ``WORLD_SIZE`` that differs between ranks is
    one clear error on every waiting rank instead of a backend timeout naming store keys.

    The first rank to see a problem publishes it in the store and every waiting rank raises it:
    RuntimeError naming the missing ranks after ``timeout_s``, or the differing world sizes.
    Store traffic only: a few requests per rank, then one poll every 50-500 ms."""
    import socket
    import time
    _INIT_GENERATION[0] += 1
    key = per_attempt_store_key(f"shardkit/init/{_INIT_GENERATION[0]}")
    hosting = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    with _store_answering(rank):
        me = f"{socket.gethostname()}:{os.getpid()}"
        holder = store.compare_set(f"{key}/rank/{rank}", "", me).decode()
        if holder != me:
            _publish_verdict(store, key, f"RANK={rank} was given to two processes ({holder} "
                                         f"and {me})")
        first = store.compare_set(f"{key}/world_size", "", str(world_size)).decode()
        if first != str(world_size):
            _publish_verdict(store, key, f"WORLD_SIZE differs between ranks: rank {rank} has "
                                         f"WORLD_SIZE={world_size}, ranks that arrived before "
                                         f"it have WORLD_SIZE={first}")
        arrived = store.add(f"{key}/arrived", 1)
        deadline, pause = time.monotonic() + timeout_s, 0.05
        while True:
            if store.check([f"{key}/verdict"]):
                if hosting:  # let the others read it before the store goes away with this rank
                    time.sleep(1.0)
                verdict = store.get(f"{key}/verdict").decode()
                raise RendezvousError(f"init_distributed (rank {rank}): {verdict}")
            if arrived > world_size:
                _publish_verdict(store, key, f"more ranks ({arrived}) than WORLD_SIZE="
                                             f"{world_size} arrived (a RANK given twice?)")
            elif arrived == world_size:
                return
            elif time.monotonic() > deadline:
                missing = [r for r in range(world_size) if not store.check([f"{key}/rank/{r}"])]
                _publish_verdict(
                    store, key, f"rank(s) {missing} of WORLD_SIZE={world_size} did not arrive at "
                    f"the rendezvous MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT="
                    f"{os.environ['MASTER_PORT']} within timeout_s={timeout_s:g} s (not started, "
                    f"failed before init_distributed, or given another MASTER_ADDR/MASTER_PORT)")
            else:
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
                arrived = store.add(f"{key}/arrived", 0)


class RendezvousError(RuntimeError):
    """:func:`init_distributed`'s ranks met on the rendezvous store and found a problem: a rank
    missing after the timeout, ``WORLD_SIZE`` differing between ranks, or a ``RANK`` given
    twice. The message is the same on every rank that waited."""


def _publish_verdict(store, key: str, verdict: str) -> None:
    """Record why the rendezvous failed; the first verdict stays, so every rank raises it."""
    store.compare_set(f"{key}/verdict", "", verdict)


@contextlib.contextmanager
def _store_answering(rank: int):
    """Inside, a store that stops answering (its host, rank 0, ended) is a clear error."""
    try:
        yield
    except RendezvousError:
        raise
    except (RuntimeError, OSError) as err:
        raise RuntimeError(
            f"init_distributed (rank {rank}): the rendezvous store at MASTER_ADDR="
            f"{os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']} stopped "
            f"answering while this rank waited for the others: rank 0, which hosts it, ended "
            f"(its own error says why). The store said: {err}") from err


def init_single_process(backend: Optional[str] = None) -> None:
    """Start a default process group of one rank (rank 0) over an in-memory store: no
    environment variables are read or written and no port is opened. For running
    shardkit's wrappers in a plain ``python script.py``. Idempotent like
    :func:`init_distributed`. Costs nothing on the wire."""
    if backend is not None and backend not in _VALID_BACKENDS:
        raise ValueError(f"init_single_process(backend={backend!r}): unknown backend; "
                         f"valid backends are {list(_VALID_BACKENDS)} or None (auto)")
    if is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    atexit.register(_destroy_at_exit)


_EXIT_BARRIER_TIMEOUT_S = 30.0


def _destroy_at_exit() -> None:
    """Tear down the group shardkit created when the script ends without calling :func:`destroy`.

    Without it, a rank that leaves first closes gloo's connections while a peer is still inside
    its last collective, and gloo aborts that peer (SIGABRT, "terminate called without an active
    exception"). After an uncaught exception (``sys.last_value`` is set) it does nothing: the
    peers may never reach a barrier, and waiting for them would turn the crash into a hang.

    Note: the ranks meet on the rendezvous store, not in a collective, and wait at most 30 s.
    A peer still inside another collective (it runs one step more: uneven data) never comes;
    a collective barrier would then stay pending and hold this process until the group's
    whole timeout (minutes), delaying that peer's clear "connection closed" error. Here this
    rank leaves after 30 s without destroying the group."""
    if getattr(sys, "last_value", None) is not None or not is_initialized():
        return
    if not _every_rank_at_exit(_EXIT_BARRIER_TIMEOUT_S):
        print(f"[shardkit] rank {dist.get_rank()}: the other ranks did not all reach the end of "
              f"the script within {_EXIT_BARRIER_TIMEOUT_S:.0f} s (one still in a collective, "
              f"or gone): leaving without tearing the process group down", file=sys.stderr)
        return
    try:
        _forget_topology()  # else the default group outlives this teardown (see there)
        dist.destroy_process_group()
    except Exception as err:
        print(f"[shardkit] process-group teardown at exit failed: {err}", file=sys.stderr)


def _every_rank_at_exit(timeout_s: float) -> bool:
    """Count this rank in on the default group's store and wait until every rank has been
    counted (``False`` after ``timeout_s``, or when the store is gone). No collective."""
    import time
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        key = per_attempt_store_key("shardkit/ranks_at_exit")
        arrived = store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while arrived < world:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
            arrived = store.add(key, 0)
        return True
    except Exception:  # the store's host (rank 0 or the launcher) has gone
        return False


def per_attempt_store_key(name: str) -> str:
    """``name`` scoped to this torchrun run and restart attempt (a restarted job may keep the
    rendezvous store, so keys of an earlier attempt must not be read as this one's)."""
    return (f"{name}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def _int_env(name: str, default: Optional[int] = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"init_distributed: environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"init_distributed: {name}={value!r} is not an integer") from None


def destroy() -> None:
    """Finish this process's asynchronous checkpoint saves, wait for every rank (a barrier),
    then destroy the default process group if it exists. Raises the first failed save's error,
    after the group is gone. Each pending save is waited for at most the checkpoint group's
    timeout (plus a margin) after the one before it, as torch's ``destroy_process_group()``
    waits under :mod:`shardkit.checkpoint.async_save`: a save stuck in its writer (a hung
    filesystem) is given up and named, not waited for forever.

    Note: without the barrier, a rank that finishes first can tear down gloo's connections while
    a peer is still completing the last collective, and gloo then aborts the process
    ("terminate called without an active exception"). Once an asynchronous save has started,
    torch's ``destroy_process_group()`` waits for the saves too
    (:mod:`shardkit.checkpoint.async_save` wraps it), but without the barrier."""
    try:
        _wait_for_pending_saves()
    finally:
        _forget_topology()
        if is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _wait_for_pending_saves() -> None:
    """The pending asynchronous saves, each waited for within its bound (the wait of torch's
    wrapped ``destroy_process_group()``), where that module is loaded (no asynchronous save
    can be under way otherwise)."""
    saves = sys.modules.get("shardkit.checkpoint.async_save")
    if saves is not None:
        saves._wait_before_destroy()
