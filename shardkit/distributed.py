"""The one road by which shardkit talks to other ranks.

Every collective shardkit issues goes through a function of this module, so that
:class:`CommCounter` can count the bytes each rank puts on the wire and tests can assert
communication volume as a number. Nothing else in shardkit calls ``torch.distributed``
collectives directly.

Byte convention (see DESIGN.md), for a tensor whose full logical size is ``S`` bytes
(all-reduce input, all-gather output, reduce-scatter input) in a group of ``n`` ranks:
all_reduce ``2(n-1)/n*S``; all_gather, reduce_scatter, broadcast, reduce ``(n-1)/n*S``;
send ``S``; recv ``0``. These are the bytes a rank sends under ring algorithms, rooted ops
averaged over the ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import numbers
import os
import sys
import pickle
import weakref
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit import collective_check, comm_counter
from shardkit.collective_check import set_debug_collectives  # re-exported: the documented switch
from shardkit.comm_counter import CommCounter, CommRecord  # re-exported: counting lives there

__all__ = [
    "init_distributed", "init_single_process", "is_initialized", "require_initialized",
    "get_rank", "get_world_size",
    "get_global_rank", "new_group", "new_groups_among_members", "resolved_group", "timeout_of",
    "all_reduce",
    "all_reduce_as_one", "reduce_scatter_tensor",
    "all_gather_into_tensor", "all_gather", "all_to_all_single", "broadcast", "reduce", "send",
    "recv", "isend",
    "irecv", "batch_isend_irecv", "P2POp", "barrier", "backend_of", "record_transfer",
    "collectives_issued", "oldest_collective_unfinished", "gather_control_rows",
    "spans_nodes_if_known", "NodeNumberingUnknown", "exited_peers_on_this_host",
    "monitored_barrier", "gather", "scatter", "all_reduce_coalesced", "all_gather_coalesced",
    "reduce_scatter",
    "broadcast_object", "all_gather_object", "first_disagreement", "first_difference",
    "raise_on_disagreement",
    "broadcast_tensors_from_rank0", "any_rank",
    "CommCounter", "CommRecord", "ReduceOp", "destroy", "set_debug_collectives", "GroupCache",
    "ranks_per_node", "node_of", "spans_nodes", "node_groups", "groups_of_nodes",
    "ranks_by_node", "group_ranks_by_node", "check_equal_nodes", "node_layout_known",
    "CollectiveError", "reporting_broken_links",
]

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the tensor forms (the old names warn); use the new ones where they exist.
_all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_VALID_BACKENDS = ("gloo", "nccl", "mpi")


# ----------------------------------------------------------------------------- broken links


class CollectiveError(RuntimeError):
    """A collective failed because its connection to a peer broke or timed out: most often a
    peer rank died. The message names the operation, the group and this rank; ``__cause__``
    is the backend's own error (gloo's says only "Connection reset by peer").
    (:func:`shardkit.fault.watch_peers` names the lost rank itself.)"""


_BROKEN_LINK_WORDS = ("connection", "reset by peer", "closed by peer", "broken pipe",
                      "timed out", "timeout")


def is_broken_link(error: BaseException) -> bool:
    """Whether ``error`` says a connection broke or timed out (gloo's "Connection reset by
    peer", a socket timeout, torch's ``DistNetworkError``), not that the call was wrong."""
    if isinstance(error, getattr(dist, "DistNetworkError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, (RuntimeError, OSError)) and \
        any(word in text for word in _BROKEN_LINK_WORDS)


def broken_link_error(operation: str, error: BaseException, group=None) -> CollectiveError:
    """The :class:`CollectiveError` for ``operation`` (words such as "all_gather over process
    group (gloo), on rank 0 of 2,") over ``group`` (``None``: the default group) failing with
    the backend's ``error``; it names the ranks of ``group`` on this host that have exited
    (:func:`exited_peers_on_this_host`): a rank outside the group did not break its links."""
    exited = exited_peers_on_this_host(settle_s=0.5, ranks=_members_if_known(group))
    who = (" (its own log says why; shardkit.fault.watch_peers() names the lost rank"
           if not exited else f": global rank(s) {[rank for rank, _ in exited]} (pid(s) "
           f"{[pid for _, pid in exited]}, on this host) exited (their own logs say why")
    return CollectiveError(
        f"{operation} failed: the connection to a peer broke or timed out, most likely "
        f"because a peer rank died or stopped{who}; a peer "
        f"that aborted on a size mismatch means the ranks issued different collectives, e.g. "
        f"a module run on some ranks only: SHARDKIT_DEBUG_COLLECTIVES=1 names each rank's op "
        f"and call site). The backend said: {error}")


def _members_if_known(group) -> Optional[list[int]]:
    """The global ranks of ``group``; ``None`` for the default group, or where the group no
    longer says (destroyed while its error was being reported). Local."""
    if group is None or group is dist.group.WORLD:
        return None
    try:
        return group_ranks(group)
    except Exception:  # noqa: BLE001 - for an error message only: then every rank of the world
        return None


def _this_process() -> tuple:
    """``(kernel boot id, pid namespace, pid)`` of this process; the first two ``None`` where
    ``/proc`` does not say. Two processes whose first two agree see each other's pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.readlink("/proc/self/ns/pid"), os.getpid()
    except OSError:
        return None, None, os.getpid()


def _process_exited(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace is gone (or a zombie nobody reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def exited_peers_on_this_host(settle_s: float = 0.0, ranks: Optional[Sequence[int]] = None
                              ) -> list[tuple[int, int]]:
    """``(global rank, pid)`` of each rank of the default group (or of its global ``ranks``)
    that runs on this host (same kernel and pid namespace, as gathered with the node layout by
    :func:`init_distributed`) and whose process has exited; empty where nothing was gathered
    or ``/proc`` does not say.
    For error messages after a broken connection: ``settle_s`` is how long to look again
    while none has exited yet (a dying process closes its sockets a moment before ``/proc``
    shows it exited). Local; reads ``/proc`` only."""
    import time
    processes, me = _known_processes(), _this_process()
    if processes is None or me[0] is None:
        return []
    considered = range(len(processes)) if ranks is None else sorted(set(ranks))
    peers = [(rank, processes[rank][2]) for rank in considered
             if processes[rank][:2] == me[:2] and processes[rank][2] != me[2]]
    deadline = time.monotonic() + settle_s
    while True:
        exited = [(rank, pid) for rank, pid in peers if _process_exited(pid)]
        if exited or time.monotonic() >= deadline:
            return exited
        time.sleep(0.05)


def operation_words(name: str, group=None, carrier: Optional[str] = None) -> str:
    """``"<name> over <carrier>, on rank r of n (global rank g),"`` for error messages
    (``carrier``: by default the group's backend)."""
    try:
        carrier = carrier or f"process group ({backend_of(group)})"
        where = f"rank {get_rank(group)} of {get_world_size(group)} (global rank {get_rank()})"
    except Exception:  # noqa: BLE001 - the process group itself may be gone
        carrier, where = carrier or "the process group", "this rank"
    return f"{name} over {carrier}, on {where},"


@contextlib.contextmanager
def reporting_broken_links(name: str, group=None):
    """Inside, an error from a broken or timed-out connection becomes a
    :class:`CollectiveError` naming ``name`` and ``group``; other errors pass unchanged.
    Costs nothing unless something fails."""
    try:
        yield
    except Exception as error:
        if not is_broken_link(error):
            raise
        _raise_as_broken_link(name, group, error)


def _raise_as_broken_link(name: str, group, error: Exception) -> None:
    """Raise the :class:`CollectiveError` for the broken link ``error`` of ``name``."""
    cause = error
    if isinstance(error, CollectiveError) and error.__cause__ is not None:
        cause = error.__cause__  # an inner op's: named here as the outer operation
    raise broken_link_error(operation_words(name, group), cause, group) from cause


def _issued(name: str, group, collective, *args, **kwargs):
    """``collective(*args, group=group, **kwargs)`` (torch's), :func:`_tracked`; a connection
    that breaks while it is issued (all of a synchronous op) raises :class:`CollectiveError`
    naming ``name``, the group and the ranks of this host that exited, instead of gloo's
    "Connection reset by peer". A plain ``try`` rather than :func:`reporting_broken_links`:
    this is every collective's path, and a generator context costs about 2 us a call."""
    try:
        return _tracked(collective(*args, group=group, **kwargs), group)
    except Exception as error:
        if not is_broken_link(error):
            raise
        _raise_as_broken_link(name, group, error)


# ----------------------------------------------------------------------------- set-up


def init_distributed(backend: Optional[str] = None, timeout_s: float = 300.0) -> None:
    """Initialise the default process group from torchrun's environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (``LOCAL_RANK`` picks the
    CUDA device). ``backend=None`` picks ``nccl`` when CUDA is available, else ``gloo``.
    Idempotent: a second call with the group already up returns at once (and checks that the
    backend agrees). Before the backend connects the ranks, they meet on the rendezvous store,
    so that a rank that never comes, or ranks started with different ``WORLD_SIZE`` values,
    are one clear error on every waiting rank. Costs one TCP rendezvous and one small object
    all-gather (every rank's node, for :func:`node_groups`, and process id, for naming a rank
    of this host that died under a collective); no tensor traffic.

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


def is_initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def require_initialized(what: str) -> None:
    """Raise a clear error naming ``what`` when no process group exists yet."""
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed to be initialised first: call "
            f"shardkit.distributed.init_distributed() (under torchrun) or "
            f"torch.distributed.init_process_group(...) before creating it")


def check_group(group, what: str, argument: str = "group", pair_ok: bool = False) -> None:
    """Raise a clear TypeError naming ``what(argument=...)`` unless ``group`` is ``None`` (the
    default group) or a process group (with ``pair_ok``, also a tuple of them, for hybrid
    sharding). torch's marker for a group this rank is not in passes, so that the caller's
    membership check can say so. Local: no collective."""
    if group is None or isinstance(group, dist.ProcessGroup) or _not_a_member(group):
        return
    if pair_ok and isinstance(group, tuple) and all(
            isinstance(g, dist.ProcessGroup) or _not_a_member(g) for g in group):
        return
    pair = " or a pair (intra_node_group, inter_node_group)" if pair_ok else ""
    raise TypeError(f"{what}({argument}={group!r}): must be a torch.distributed ProcessGroup "
                    f"(e.g. from new_group){pair}, or None for the default group")


def check_member(group, what: str, argument: str = "group") -> None:
    """Raise a clear ValueError naming ``what(argument=...)`` when this rank is not a member of
    ``group`` (or of one group of a pair), where torch would only say "Invalid process group
    specified". A wrapper over a sub-group is built on that sub-group's ranks only. Local; no
    communication."""
    groups = group if isinstance(group, tuple) else (group,)
    if any(_not_a_member(g) for g in groups):
        raise ValueError(f"{what}({argument}=...): global rank {get_rank()} is not a member of "
                         f"the given process group; build it on the group's ranks only")


def _not_a_member(group) -> bool:
    """Whether ``group`` is what ``new_group`` returns on a rank outside it (an int marker)."""
    marker = dist.GroupMember.NON_GROUP_MEMBER
    return type(group) is type(marker) and group == marker


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


def get_rank(group=None) -> int:
    """This process's rank inside ``group`` (``None``: the default group); 0 without a group."""
    if not is_initialized():
        return 0
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    """Number of ranks in ``group`` (``None``: the default group); 1 without a group."""
    if not is_initialized():
        return 1
    return dist.get_world_size(group)


def get_global_rank(group, group_rank: int) -> int:
    """Global rank of ``group_rank`` within ``group`` (identity for the default group)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def group_ranks(group) -> list[int]:
    """The global ranks that make up ``group``, in group-rank order."""
    return [get_global_rank(group, r) for r in range(get_world_size(group))]


def new_group(ranks: Sequence[int], timeout_s: Optional[float] = None,
              backend: Optional[str] = None, members_only: bool = False):
    """Create a process group over ``ranks`` (global ranks); ``backend`` defaults to the default
    group's (``"gloo"`` gives a CPU group beside an NCCL one). Must be called on every rank, or,
    with ``members_only``, on the members of ``ranks`` only."""
    _check_call("new_group", None)
    kwargs = {"use_local_synchronization": True} if members_only else {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend is not None:
        kwargs["backend"] = backend
    return dist.new_group(ranks=list(ranks), **kwargs)


def group_of_same_ranks(group, timeout_s: Optional[float] = None,
                        backend: Optional[str] = None):
    """A new process group over ``group``'s ranks (its collectives then need to match in
    order only among themselves), with ``timeout_s`` (default: torch's default for the
    backend) and ``backend`` (default: the default group's). With the whole world every rank
    must call it together; with a sub-group only its members call it (collective over them:
    one small object all-gather on ``group`` first, see :func:`_align_group_counts`)."""
    ranks = group_ranks(group)
    members_only = len(ranks) < get_world_size()
    if members_only:
        _align_group_counts(group)
    # a member that died leaves the others waiting on the store until the timeout; the error
    # then names the call rather than only the store keys
    with reporting_broken_links(f"new_group(ranks={ranks})", group):
        return new_group(ranks, timeout_s=timeout_s, backend=backend, members_only=members_only)


def new_groups_among_members(rank_lists: Sequence[Sequence[int]], group) -> list:
    """Create the process groups over each of ``rank_lists`` (global ranks, every list holding
    this rank) among their members only, for ranks that build groups inside a sub-group
    ``group`` of the world (only ``group``'s members call this; the other ranks need not
    know). Returns the groups in the order of ``rank_lists``.

    The members of ``group`` first agree on their count of registered process groups (see
    :func:`_align_group_counts`), as torch names a group created by its members from its ranks
    and that count. Collective over ``group``: one small object all-gather, then the groups'
    own set-up among their members."""
    _align_group_counts(group)
    return [new_group(ranks, members_only=True) for ranks in rank_lists]


def _registered_group_count() -> Optional[int]:
    """How many process groups this process has registered with torch (``None`` where torch
    does not expose the registry)."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    return None if names is None else len(names)


def _align_group_counts(group) -> None:
    """Make every member of ``group`` hold as many registered process groups as the member
    holding most, so that a group the members then create by themselves gets one name on all
    of them.

    Note: torch names a group created by its members only from its ranks and the number of
    groups this process has registered. That number differs between ranks as soon as some
    ranks created groups the others did not (e.g. a wrapper on a sub-group of theirs), and the
    members would then wait forever for each other under different names. The members behind
    pad with groups of themselves alone (no connection, no traffic). Collective over
    ``group``: one small object all-gather."""
    mine = _registered_group_count()
    counts = all_gather_object(mine, group=group)
    if mine is None or None in counts:
        return
    for _ in range(max(counts) - mine):
        new_group([get_rank()], members_only=True)


# id(default group) -> (the default group, this rank's one-member group); the default group is
# held so that its id stays its own after a destroy_process_group and a new init
_SINGLE_RANK_GROUPS: dict = {}
_GROUP_CACHES: list = []  # every GroupCache, emptied by destroy()


class GroupCache(dict):
    """A dict in which a module keeps process groups (or what holds them) that it built for
    the current world, keyed as it likes (e.g. by ranks). Read it through :meth:`current`: the
    cache is emptied whenever the default group is no longer the one it was filled under
    (torch's ``destroy_process_group`` and a new init in the same process), and by
    :func:`destroy`, so a group of a torn-down world is never handed out again. Local."""

    def __init__(self):
        super().__init__()
        self._world = None
        _GROUP_CACHES.append(self)

    def current(self) -> "GroupCache":
        """This cache, emptied first if the world it was filled in is gone."""
        world = dist.group.WORLD if is_initialized() else None
        if world is not self._world:
            self.clear()
            self._world = world
        return self

    def forget(self) -> None:
        """Empty the cache and the world it was filled in (what :func:`destroy` does)."""
        self.clear()
        self._world = None


def single_rank_group():
    """A process group of this rank alone (FairScale's ``single_rank_pg``: nothing sharded or
    reduced over it), created by this rank alone on the first call (no other rank takes part,
    so some ranks may call it and others not), the same group after. Costs one gloo/NCCL
    group.

    Note: made world-wide (every rank creating every rank's group), it advanced the count
    torch names world groups by on the ranks that called it only, and the next group created
    over the whole world got other names on other ranks: every rank hung."""
    world = dist.group.WORLD
    entry = _SINGLE_RANK_GROUPS.get(id(world))
    if entry is None or entry[0] is not world:
        entry = _SINGLE_RANK_GROUPS[id(world)] = (world, new_group([get_rank()],
                                                                   members_only=True))
    return entry[1]


def resolved_group(group=None):
    """``group`` itself, or for ``None`` the default group's object (one key for either way of
    naming it). Local; no communication."""
    return group if group is not None else dist.group.WORLD


def timeout_of(group=None) -> Optional[float]:
    """Seconds after which ``group``'s operations time out, as its backend was created with, or
    ``None`` where the backend does not say. Local; no communication."""
    try:
        return resolved_group(group)._get_backend(
            torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


# ----------------------------------------------------------------------------- topology
# Which ranks share a node comes from the launcher: LOCAL_WORLD_SIZE ranks per node, and each
# rank's node is its GROUP_RANK (torchrun's node rank). Launchers need not number ranks node by
# node (srun's cyclic distribution puts rank 1 on the second node), so the node of every rank is
# gathered once (init_distributed, or the first node_groups()) instead of being computed as
# rank // LOCAL_WORLD_SIZE. Without GROUP_RANK the host name tells the nodes apart; on one host
# without it, ranks are cut node by node into LOCAL_WORLD_SIZE. Without LOCAL_WORLD_SIZE every
# rank counts as being on one node.

_layout: Optional[tuple] = None  # (the default group it was gathered in, node index per rank)
# (the default group, every rank's _this_process()), gathered with the layout
_processes: Optional[tuple] = None


def _forget_topology() -> None:
    """Drop the gathered layout, the groups cached for topology, the single-rank groups
    (:func:`single_rank_group`) and every :class:`GroupCache`. They hold the default
    group and its node groups: a group still referenced outlives ``destroy_process_group``
    with its gloo connections open, and is torn down at interpreter exit instead, when the
    ranks no longer wait for each other (gloo then aborted a rank now and then: "terminate
    called without an active exception")."""
    global _node_groups, _layout, _processes
    _node_groups = _layout = _processes = None
    _spanning.clear()
    _SINGLE_RANK_GROUPS.clear()  # they hold the default group too (single_rank_group)
    for cache in _GROUP_CACHES:
        cache.forget()


def _node_identity() -> tuple:
    """What this rank knows of its node: ``(GROUP_RANK or None, host name)``."""
    import socket
    group_rank = os.environ.get("GROUP_RANK")
    return (int(group_rank) if group_rank not in (None, "") else None, socket.gethostname())


def layout_from_identities(identities: Sequence[tuple], per_node: int,
                           ranks: Optional[Sequence[int]] = None) -> list[int]:
    """The node index of every rank from each rank's ``(GROUP_RANK or None, host name)``:
    nodes are the distinct GROUP_RANKs (when every rank has one), else the distinct host names
    (when there are several), else consecutive blocks of ``per_node`` global ranks. Nodes are
    numbered by GROUP_RANK, or by their lowest rank. ``ranks``: the global ranks the
    identities belong to (ascending; default: all ranks, ``0..len-1``). Local; no
    communication."""
    ranks = range(len(identities)) if ranks is None else ranks
    if all(group_rank is not None for group_rank, _ in identities):
        keys = [group_rank for group_rank, _ in identities]
        order = sorted(set(keys))
    elif len({host for _, host in identities}) > 1:
        keys = [host for _, host in identities]
        order = list(dict.fromkeys(keys))
    else:
        return [rank // per_node for rank in ranks]
    return [order.index(key) for key in keys]


def _ranks_per_node_hint() -> int:
    """``LOCAL_WORLD_SIZE`` (at least 1), or the world size where it is unset or not a number
    (:func:`ranks_per_node` names a bad value where topology is used). Local."""
    size = get_world_size()
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", size)), 1)
    except ValueError:
        return size


def discover_node_layout() -> list[int]:
    """Gather every rank's node (see the notes above) over the default group and keep it for
    :func:`node_of`, :func:`spans_nodes` and :func:`node_groups`; returns the node index of
    every rank. Collective over the default group (one small object all-gather, not counted
    by :class:`CommCounter`); a no-op for a world of one."""
    global _layout, _processes
    world = dist.group.WORLD
    if _layout is not None and _layout[0] is world:
        return _layout[1]
    size = get_world_size()
    mine = (_node_identity(), _this_process())
    gathered = [mine] * size
    if size > 1:
        dist.all_gather_object(gathered, mine)
    identities = [identity for identity, _ in gathered]
    _processes = (world, [process for _, process in gathered])
    _layout = (world, layout_from_identities(identities, _ranks_per_node_hint()))
    _spanning.clear()  # answers cached before the layout was known
    return _layout[1]


def _known_layout() -> Optional[list]:
    """The gathered node of every rank for the current default group, or ``None``."""
    if _layout is not None and is_initialized() and _layout[0] is dist.group.WORLD:
        return _layout[1]
    return None


def _known_processes() -> Optional[list]:
    """Every rank's ``(boot id, pid namespace, pid)`` for the current default group, or
    ``None`` where they were not gathered."""
    if _processes is not None and is_initialized() and _processes[0] is dist.group.WORLD:
        return _processes[1]
    return None


def node_layout_known() -> bool:
    """Whether the node of every rank was gathered for the current default group (by
    :func:`init_distributed` or a first :func:`node_groups`), so that :func:`ranks_by_node`
    costs no communication."""
    return _known_layout() is not None


def ranks_per_node() -> int:
    """Ranks on each node: torchrun's ``LOCAL_WORLD_SIZE`` (without it: as many as the gathered
    layout puts on each node, or the world size).

    Raises RuntimeError when the world is not a whole number of equal nodes, or when the ranks'
    GROUP_RANKs (or host names) put a number of ranks other than ``LOCAL_WORLD_SIZE`` on some
    node (the same error on every rank once the layout is gathered)."""
    world = get_world_size()
    layout = _known_layout()
    members = None if layout is None else _node_members(layout)
    if members is not None and len({len(ranks) for ranks in members}) > 1:
        raise RuntimeError(f"the ranks' nodes are {_describe_nodes(members)}: shardkit needs the "
                           f"same number of ranks on every node")
    default = world if members is None else len(members[0])
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        per_node = int(raw) if raw else default
    except ValueError:
        raise RuntimeError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer; it must be the number "
                           f"of ranks on each node (torchrun's --nproc_per_node)") from None
    if per_node < 1 or world % per_node:
        raise RuntimeError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}; "
                           f"shardkit needs the same number of ranks on every node")
    if members is not None and per_node != len(members[0]):
        raise RuntimeError(f"the ranks' nodes are {_describe_nodes(members)}, but "
                           f"LOCAL_WORLD_SIZE={per_node}")
    return per_node


class NodeNumberingUnknown(RuntimeError):
    """The node of the ranks asked about was not gathered, and ``GROUP_RANK`` is set by a
    launcher other than torchrun: it placed the ranks, perhaps not node by node (srun's
    cyclic distribution), and one rank cannot tell from its own ``GROUP_RANK`` where the
    others run, so no rank guesses.
    Raised on every rank alike where a rank's node is asked for (:func:`node_of`,
    :func:`spans_nodes`); never from inside a collective."""


def _refuse_to_guess(what: str) -> None:
    """Raise :class:`NodeNumberingUnknown` (naming ``what``) where ``GROUP_RANK`` is set by a
    launcher other than torchrun: the blocks ``rank // LOCAL_WORLD_SIZE`` hold for torchrun's
    numbering (its agents hand out consecutive global ranks node by node), and with another
    launcher's round-robin placement they were wrong on the ranks whose own ``GROUP_RANK``
    happened to match them. Every rank of a launch has ``GROUP_RANK`` (and torchrun's
    ``TORCHELASTIC_RUN_ID``) or none has, so the ranks raise alike. Local."""
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank not in (None, "") and not _launched_by_torchrun():
        raise NodeNumberingUnknown(
            f"the node of {what} is unknown: GROUP_RANK={group_rank} says a launcher placed the "
            f"ranks, perhaps not node by node, and the node of every rank was not gathered; "
            f"call shardkit.distributed.node_groups() (or init_distributed()) on every rank "
            f"first")


def _launched_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process: its agent sets
    ``TORCHELASTIC_RUN_ID`` in every worker it starts. Local."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def _describe_nodes(members: Sequence[Sequence[int]]) -> str:
    text = ", ".join(f"node {node}: ranks {list(ranks)}" for node, ranks in enumerate(members))
    return f"{text} (from GROUP_RANK, or the host name)"


def _node_members(layout: Sequence[int]) -> list[list[int]]:
    """The global ranks of each node, in rank order, nodes in index order."""
    members: list[list[int]] = [[] for _ in range(max(layout) + 1)]
    for rank, node in enumerate(layout):
        members[node].append(rank)
    return [ranks for ranks in members if ranks]


def node_of(rank: int) -> int:
    """The node (torchrun's group rank) that global rank ``rank`` runs on, from the gathered
    layout; without one (a process group made by torch itself), consecutive blocks of
    :func:`ranks_per_node` ranks where no ``GROUP_RANK`` is set or torchrun set it, else
    :class:`NodeNumberingUnknown` on every rank."""
    per_node = ranks_per_node()
    layout = _known_layout()
    if layout is not None:
        return layout[rank]
    _refuse_to_guess(f"rank {rank}")
    return rank // per_node


_spanning: dict = {}  # id(group object) -> (the object, whether its ranks span nodes)


def spans_nodes(group=None) -> bool:
    """Whether the ranks of ``group`` (``None``: the default group) sit on more than one node.
    Cached per group; costs no communication. Every rank of ``group`` gives the same answer:
    from the gathered layout; else from the nodes of the group's ranks gathered over a group
    holding them all (:func:`group_ranks_by_node`, which hpZ, qgZ and
    ``quantized_comm.node_groups`` call); else ``True`` where the group holds more ranks than
    a node (``LOCAL_WORLD_SIZE``) does; else as :func:`node_of` (raising
    :class:`NodeNumberingUnknown` where a launcher other than torchrun set ``GROUP_RANK``)."""
    resolved = group if group is not None else (dist.group.WORLD if is_initialized() else None)
    entry = _spanning.get(id(resolved))
    if entry is None or entry[0] is not resolved:
        ranks = group_ranks(group) if is_initialized() else [0]
        entry = (resolved, _ranks_span_nodes(ranks))
        _spanning[id(resolved)] = entry
    return entry[1]


def _ranks_span_nodes(ranks: Sequence[int]) -> bool:
    """:func:`spans_nodes` for the global ``ranks``, uncached. Local."""
    layout = _known_layout()
    if layout is not None:
        return len({layout[rank] for rank in ranks}) > 1
    identities = _GATHERED_IDENTITIES.current()
    if all(rank in identities for rank in ranks):
        ranks = sorted(ranks)
        return len(_nodes_of_identities(ranks, [identities[rank] for rank in ranks])) > 1
    if not os.environ.get("LOCAL_WORLD_SIZE"):
        return False  # nothing gathered and no node size: one node (see the notes above)
    if len(ranks) > ranks_per_node():
        return True  # more ranks than fit on one node, wherever each runs
    return len({node_of(rank) for rank in ranks}) > 1


def spans_nodes_if_known(group=None) -> Optional[bool]:
    """:func:`spans_nodes`, or ``None`` where the ranks cannot know it (see
    :class:`NodeNumberingUnknown`). For the collectives' own records: raising there, before
    the op is issued, would leave the other ranks waiting in it. Local."""
    try:
        return spans_nodes(group)
    except NodeNumberingUnknown:
        return None


_node_groups: Optional[tuple] = None  # (the default group they were made in, (intra, inter))


def node_groups() -> tuple:
    """``(intra_node, inter_node)``: the group of the ranks on this rank's node, and the group of
    the ranks with this rank's local index on every node (the data-parallel replicas of hybrid
    sharding). Nodes are where the ranks really run (their GROUP_RANK or host), whatever order
    the launcher numbered them in. Collective the first time (gathers the layout if
    :func:`init_distributed` did not, then creates one group per node and one per local index,
    on every rank alike), cached after. Costs no tensor traffic."""
    global _node_groups
    world = dist.group.WORLD
    if _node_groups is None or _node_groups[0] is not world:  # none yet, or a new default group
        layout = discover_node_layout()
        ranks_per_node()  # every rank holds the same layout: raises on all ranks or on none
        _node_groups = (world, _groups_of_node_members(_node_members(layout)))
    return _node_groups[1]


def _groups_of_node_members(members: Sequence[Sequence[int]]) -> tuple:
    """This rank's ``(intra, inter)`` groups for nodes holding the global ranks ``members``
    (equal sizes): one group per node, one per local index across nodes (every rank creates
    all of them in one order, as ``new_group`` requires; ``None`` where this rank is not a
    member). Each group's ranks are passed ascending, so a group's rank order is its global
    rank order whatever the node order. Collective; costs no tensor traffic."""
    me = get_rank()
    intra = inter = None
    for ranks in members:
        ranks = sorted(ranks)
        created = new_group(ranks)
        intra = created if me in ranks else intra
    for local in range(len(members[0])):
        ranks = sorted(node[local] for node in members)
        created = new_group(ranks)
        inter = created if me in ranks else inter
    return intra, inter


def ranks_by_node(ranks: Sequence[int]) -> list[list[int]]:
    """The global ``ranks`` grouped by the node each runs on: the gathered layout (see the notes
    above), whatever order the launcher numbered the ranks in. Nodes come in the order of their
    lowest rank, ranks ascending inside each, so torchrun's node-by-node numbering gives
    consecutive blocks. Collective over the default group only the first time, when
    :func:`init_distributed` did not gather the layout (one small object all-gather); no
    tensor traffic after."""
    layout = discover_node_layout()  # the cached one when already gathered
    by_node: dict = {}
    for rank in sorted(ranks):
        by_node.setdefault(layout[rank], []).append(rank)
    return list(by_node.values())


# the global ranks of a sub-group -> its ranks by node, gathered over the sub-group
_SUB_GROUP_NODES = GroupCache()
# global rank -> its node identity (GROUP_RANK or None, host name), as gathered over the
# sub-groups above: spans_nodes() answers from them for the groups made of those ranks
_GATHERED_IDENTITIES = GroupCache()


def group_ranks_by_node(ranks: Sequence[int], group=None, gather: bool = True
                        ) -> Optional[list[list[int]]]:
    """:func:`ranks_by_node` for the global ``ranks`` of ``group`` (``None``:
    the world), gathering only over ``group`` when the world's layout is not known yet.

    With a world set up by torch's own ``init_process_group`` nobody gathered the node of
    every rank; ``ranks_by_node`` would gather it over the whole world, so a data-parallel
    sub-group building hpZ / qgZ waited for the ranks of every other sub-group, and hung
    unless they all built at that moment. Here the members gather their own nodes (GROUP_RANK,
    or the host name; else consecutive blocks of ``LOCAL_WORLD_SIZE`` global ranks), which
    gives the grouping the world's layout would (except without GROUP_RANK, with every member
    on one host and ``LOCAL_WORLD_SIZE`` blocks that do not match the hosts). Collective over
    ``group`` the first time for a sub-group (one small object all-gather), cached after; no
    communication when the layout is known; for the whole world it is ``ranks_by_node``.
    ``gather=False``: ``None`` instead of gathering (local, for the steps after set-up)."""
    ranks = sorted(ranks)
    if node_layout_known():
        return ranks_by_node(ranks)
    cached = _SUB_GROUP_NODES.current()
    key = tuple(ranks)
    if key not in cached:
        if not gather:
            return None
        if len(ranks) == get_world_size():
            return ranks_by_node(ranks)  # gathers the world's layout, known after
        identities = all_gather_object(_node_identity(), group=group, counted=False,
                                       operation="node layout")
        of_rank = dict(zip(group_ranks(group), identities))  # in the group's order
        cached[key] = _nodes_of_identities(ranks, [of_rank[rank] for rank in ranks])
        _GATHERED_IDENTITIES.current().update(of_rank)
        _spanning.clear()  # answers given before these nodes were known
    return [list(node) for node in cached[key]]


def _nodes_of_identities(ranks: list[int], identities: Sequence[tuple]) -> list[list[int]]:
    """The global ``ranks`` (ascending; ``identities`` in the same order) grouped by node with
    :func:`layout_from_identities`'s rule, nodes in the order of their lowest rank. Local."""
    by_node: dict = {}
    layout = layout_from_identities(identities, _ranks_per_node_hint(), ranks)
    for rank, node in zip(ranks, layout):
        by_node.setdefault(node, []).append(rank)
    return list(by_node.values())


def check_equal_nodes(members: Sequence[Sequence[int]], what: str) -> None:
    """Raise ValueError, naming ``what``, unless every node of ``members`` (from
    :func:`ranks_by_node`) holds the same number of ranks. Every rank holds the same layout,
    so it raises on every rank or on none. Local; no communication."""
    if len({len(ranks) for ranks in members}) > 1:
        layout = _known_layout() or []
        nodes = ", ".join(f"ranks {list(ranks)} on node "
                          f"{layout[ranks[0]] if ranks[0] < len(layout) else '?'}"
                          for ranks in members)
        raise ValueError(f"{what}: the ranks sit on nodes of unequal sizes ({nodes}; nodes from "
                         f"GROUP_RANK, or the host name); it needs the same number of ranks on "
                         f"every node")


def groups_of_nodes(ranks: Sequence[int], per_node: Optional[int] = None) -> tuple:
    """This rank's ``(intra, inter)`` groups for the global ``ranks``: one group per node, one
    per local index across nodes (every rank creates all of them, as ``new_group`` requires;
    ``None`` where this rank is not a member). ``per_node=None``: the nodes the ranks really
    run on (:func:`ranks_by_node`; ValueError on every rank when they hold unequal numbers of
    ``ranks``); ``per_node=m``: ``ranks`` cut into consecutive blocks of ``m`` (node-major
    numbering taken as given). Collective (and gathers the layout the first time, see
    :func:`ranks_by_node`); costs no tensor traffic."""
    if per_node is None:
        members = ranks_by_node(ranks)
        check_equal_nodes(members, "groups_of_nodes")
    else:
        members = [list(ranks[start:start + per_node])
                   for start in range(0, len(ranks), per_node)]
    return _groups_of_node_members(members)


# ----------------------------------------------------------------------------- counting


# collectives this rank has issued on the default group, (a weak reference to) that group, and
# the numbers of those issued asynchronously that have not completed (see
# oldest_collective_unfinished)
_ISSUED_ON_WORLD = {"group": lambda: None, "count": 0, "in_flight": set()}


def collectives_issued() -> int:
    """How many collectives (not sends or receives) this rank has issued on the current default
    group through this module, for the peer watchdog to tell which ranks did not reach a
    collective that timed out (see :mod:`shardkit.fault`). A new default group (after
    ``destroy_process_group``) counts from 0: the ranks' counts of an earlier group differ
    after a failed collective. Costs nothing on the wire."""
    world = dist.group.WORLD
    return _ISSUED_ON_WORLD["count"] if world is not None and \
        _ISSUED_ON_WORLD["group"]() is world else 0


def oldest_collective_unfinished() -> int:
    """The number, in :func:`collectives_issued`'s count, of the oldest collective on the
    current default group that this rank issued and has not seen complete: its oldest
    asynchronous one still in flight (a prefetch, a bucket's reduction) or one that failed,
    else its last one (0: none issued). A collective that fails on this rank is that one or
    a later one, so a peer that had issued fewer collectives had not reached the failed one
    (a peer that had issued more than this one may have). An asynchronous work whose
    completion torch does not report (no future) is not seen: it counts as complete. On NCCL
    a work's future completes once the operation is queued on its stream (torch's
    ``Work.get_future``), so there the in-flight set holds only works that failed and the
    hint can name a peer that did reach the failed collective. Local."""
    issued = collectives_issued()
    if not issued:
        return 0
    in_flight = [n for n in list(_ISSUED_ON_WORLD["in_flight"]) if n <= issued]
    return min(in_flight, default=issued)


def _count_issued_on_world() -> None:
    world = dist.group.WORLD
    if world is None:
        return
    if _ISSUED_ON_WORLD["group"]() is not world:
        _ISSUED_ON_WORLD.update(group=weakref.ref(world), count=0, in_flight=set())
    _ISSUED_ON_WORLD["count"] += 1


def _tracked(work, group):
    """``work``, returned unchanged. When it is the asynchronous work of the collective just
    issued (and counted) on the default group, its number stays in flight (see
    :func:`oldest_collective_unfinished`) until the work completes successfully: one that
    fails stays, as the collective that may have failed. Local."""
    if work is None or not (group is None or group is dist.group.WORLD) \
            or _ISSUED_ON_WORLD["group"]() is not dist.group.WORLD:
        return work
    number, in_flight = _ISSUED_ON_WORLD["count"], _ISSUED_ON_WORLD["in_flight"]
    try:
        future = work.get_future()
    except Exception:  # noqa: BLE001 - a work without a future: its completion is not seen
        return work
    in_flight.add(number)

    def settle(done) -> None:
        try:
            done.value()
        except Exception:  # noqa: BLE001 - failed: it stays in flight
            return
        in_flight.discard(number)

    future.add_done_callback(settle)
    return work


def _record(op: str, full: torch.Tensor | int, group, dtype: Optional[torch.dtype] = None,
            kind: Optional[str] = None, counted: bool = True, checked: bool = True,
            checked_shape: Optional[tuple] = None) -> None:
    """Every collective wrapper calls this just before issuing its op: the collective debug
    mode (:mod:`shardkit.collective_check`, off by default) checks that every rank is about to
    issue the same op (with ``full``'s shape and dtype; for a byte count, ``checked_shape``
    and ``dtype`` when given), then each active :class:`CommCounter` records it. A rank
    outside ``group`` records nothing: torch skips the op there, so nothing is sent."""
    if _not_a_member(group):
        return
    # checked=False marks the second record of an op already recorded (its count after it ran)
    if checked and op not in ("send", "recv") and (group is None or group is dist.group.WORLD):
        _count_issued_on_world()
    if checked and collective_check._enabled:
        if isinstance(full, torch.Tensor):
            shape, checked_dtype = tuple(full.shape), full.dtype
        else:
            shape = None if checked_shape is None else tuple(checked_shape)
            checked_dtype = None if checked_shape is None else dtype
        collective_check.check_collective(op, shape, checked_dtype, group)
    if not (counted and comm_counter.counting()):
        return
    n = get_world_size(group)
    spanning = spans_nodes_if_known(group)
    if isinstance(full, torch.Tensor):
        numel, dtype, nbytes = full.numel(), full.dtype, full.numel() * full.element_size()
    elif dtype is not None:  # a byte count of tensors of ``dtype``
        numel, nbytes = full // comm_counter.element_size(dtype), full
    else:  # a byte count (object collectives)
        numel, dtype, nbytes = full, torch.uint8, full
    record = CommRecord(op=op, numel=numel, dtype=dtype,
                        bytes=comm_counter.WIRE_FACTOR[kind or op](n) * nbytes, group_size=n,
                        spans_nodes=spanning)
    comm_counter.add_record(record)


# ----------------------------------------------------------------------------- argument checks


def _check_call(name: str, group, *tensors, reduce_op=None, **peers) -> None:
    """Raise a clear error for a bad call of the collective ``name``, on this rank, before
    anything is recorded or sent: no process group yet, a ``group`` that is not one, one of
    ``tensors`` that is not a tensor, a ``reduce_op`` that is not a ReduceOp, a peer (``src=``,
    ``dst=``: global ranks) outside ``group``. gloo crashes the whole process on a send to a
    rank out of range, so peers are checked here. A rank outside ``group`` is not checked
    further: torch skips the op there. Local; no communication."""
    what = f"shardkit.distributed.{name}"
    _require_process_group(what)
    check_group(group, what)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if reduce_op is not None and not isinstance(reduce_op, (ReduceOp, ReduceOp.RedOpType)):
        raise TypeError(f"{what}(op={reduce_op!r}): must be a shardkit.distributed.ReduceOp "
                        f"(e.g. ReduceOp.SUM, ReduceOp.MAX)")
    if _not_a_member(group):
        return
    for argument, peer in peers.items():
        _check_peer(what, argument, peer, group)


def _require_process_group(what: str) -> None:
    """Raise a RuntimeError naming the collective ``what`` when no process group exists."""
    if not is_initialized():
        raise RuntimeError(f"{what} needs a process group: call "
                           f"shardkit.distributed.init_distributed() (under torchrun) or "
                           f"torch.distributed.init_process_group(...) first")


def _check_peer(what: str, argument: str, peer, group) -> None:
    """Raise ValueError unless ``peer`` is the global rank of a member of ``group``."""
    if group is None or group is dist.group.WORLD:
        ranks, valid = range(get_world_size()), f"an int in [0, {get_world_size()})"
    else:
        ranks = dist.get_process_group_ranks(group)
        valid = f"one of the group's global ranks {ranks}"
    if isinstance(peer, bool) or not isinstance(peer, numbers.Integral) or peer not in ranks:
        raise ValueError(f"{what}({argument}={peer!r}): must be a global rank of the group, "
                         f"{valid}")


# ----------------------------------------------------------------------------- collectives


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In-place all-reduce of ``tensor``. Wire: ``2(n-1)/n`` of its bytes."""
    _check_call("all_reduce", group, tensor, reduce_op=op)
    _record("all_reduce", tensor, group)
    return _issued("all_reduce", group, dist.all_reduce, tensor, op=op, async_op=async_op)


def all_reduce_as_one(tensors: Sequence[torch.Tensor], group=None, divide_by: int = 1) -> None:
    """All-reduce (sum) ``tensors`` in place as one flat buffer, then divide by ``divide_by``
    (e.g. the world size, for an average): one collective instead of one per tensor. Memory: a
    temporary of their total size (dtypes promoted as ``torch.cat`` does). Wire: one
    :func:`all_reduce` of their total bytes. Nothing is sent for an empty list."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    all_reduce(flat, group=group)
    if divide_by != 1:
        flat.div_(divide_by)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    """Reduce ``input`` (``n`` equal rank-major chunks: the outputs concatenated or stacked
    along dim 0, as torch's) and leave chunk ``rank`` in ``output``.

    Wire: ``(n-1)/n`` of the input's bytes. Raises ``ValueError`` when the sizes disagree.
    A rank outside ``group`` takes no part (torch skips the op there; ``None`` comes back).
    """
    _check_call("reduce_scatter_tensor", group, output, input, reduce_op=op)
    n = get_world_size(group)
    if input.numel() != output.numel() * n and not _not_a_member(group):
        raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements; it must be "
                         f"world size {n} x output's {output.numel()} = {output.numel() * n}")
    _record("reduce_scatter", input, group)
    output, input = _flat_when_contiguous(output, input, gathering=False)
    return _issued("reduce_scatter_tensor", group, _reduce_scatter_tensor, output, input, op=op,
                   async_op=async_op)


def _flat_when_contiguous(output: torch.Tensor, input: torch.Tensor,
                          gathering: bool) -> tuple:
    """torch's stacked form (the full tensor ``n x`` the shard's shape, which gloo refuses:
    "invalid tensor size", "Check failed: outputShape[0] * worldSize") as flat views when both
    tensors are contiguous (rank-major chunks are then the same elements). Any other pair,
    the concatenated form included, goes to torch unchanged, so existing callers' tensors,
    work handles and futures are exactly what they were."""
    full, shard = (output, input) if gathering else (input, output)
    if full.dim() == shard.dim() + 1 and output.is_contiguous() and input.is_contiguous():
        return output.view(-1), input.view(-1)
    return output, input


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False):
    """Gather every rank's ``input`` into ``output`` (rank-major: the inputs concatenated or
    stacked along dim 0, as torch's). Wire: ``(n-1)/n`` of output. A rank outside ``group``
    takes no part (torch skips the op there; ``None`` comes back)."""
    _check_call("all_gather_into_tensor", group, output, input)
    n = get_world_size(group)
    if output.numel() != input.numel() * n and not _not_a_member(group):
        raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements; it must "
                         f"be world size {n} x input's {input.numel()} = {input.numel() * n}")
    _record("all_gather", output, group)
    output, input = _flat_when_contiguous(output, input, gathering=True)
    return _issued("all_gather_into_tensor", group, _all_gather_tensor, output, input,
                   async_op=async_op)


def all_gather(tensors: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    """List form of all-gather, as torch's: ``tensors[j]`` (one tensor per rank of the group)
    receives group rank ``j``'s ``tensor`` (its elements and dtype; on gloo also its shape,
    as gloo requires; sizes may differ between calls, and between ranks only where the
    backend allows it). Returns a work handle with ``async_op`` (``None`` on a rank outside
    ``group``, which takes no part).

    Before it, one all-gather of four int64s a rank (``32n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's list (length, and that each
    ``tensors[j]`` fits group rank ``j``'s tensor) on every rank, so that a bad list on one
    rank raises a ValueError on every rank, naming the rank, and none is left waiting.
    Wire: ``(n-1)/n`` of the gathered bytes, counted as ``all_gather``."""
    _check_call("all_gather", group)
    if _not_a_member(group):
        _check_call("all_gather", group, tensor)
        return None
    what = "shardkit.distributed.all_gather"
    n = get_world_size(group)
    count = len(tensors) if isinstance(tensors, (list, tuple)) else None
    problem, slots = None, -1
    if not isinstance(tensor, torch.Tensor):  # raised after the agreement, so no rank waits
        problem = TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    elif count != n or not all(isinstance(t, torch.Tensor) for t in tensors):
        got = type(tensors).__name__ if count is None else f"{count}" + (
            "" if count != n else " items, not all tensors")
        problem = (f"{what}(tensors=...): expected a list of {n} tensors (one per rank of the "
                   f"group) on every rank, got {got}")
    else:
        slots = _signature((t.numel(), _dtype_code(t.dtype)) for t in tensors)
        if _gloo_carries(group, tensor.device):
            for j, t in enumerate(tensors):
                if t.shape != tensor.shape or t.dtype != tensor.dtype:
                    problem = (f"{what}(tensors[{j}]=...): {tuple(t.shape)} {t.dtype}; gloo "
                               f"needs every item of the shape and dtype of the tensor, "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
                    break
    facts = [-1, -1, -1] if problem is not None else \
        [tensor.numel(), _dtype_code(tensor.dtype), slots]
    rows = _agree_on_call(what, problem, facts, group, _control_device(group, tensor))
    expected = _signature((numel, code) for numel, code, _ in rows)
    misfit = [r for r, (*_, sig) in enumerate(rows) if sig != expected]
    if misfit:
        sizes = [(numel, _dtype_name(code)) for numel, code, _ in rows]
        raise ValueError(f"{what}(tensors=...): on group rank(s) {misfit}, tensors[j] does not "
                         f"hold group rank j's tensor (elements and dtype per group rank: "
                         f"{sizes}); every rank's tensors[j] must; nothing was sent")
    _record("all_gather", tensor.numel() * tensor.element_size() * n, group)
    # a tuple too (torch takes lists only): its tensors are filled in place all the same
    return _issued("all_gather", group, dist.all_gather, list(tensors), tensor,
                   async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False, counted_as: str = "all_to_all",
                      check_ranks: bool = True):
    """Split ``input`` into ``n`` equal rank-major chunks, send chunk ``j`` to rank ``j`` and
    receive every rank's chunk for this rank into ``output`` (rank-major). Wire: ``(n-1)/n`` of
    the input's bytes, recorded under ``counted_as`` (a transport that builds a reduce-scatter
    from it records ``"reduce_scatter"``: the same bytes, the op the caller asked for). A
    non-contiguous ``input`` is sent as a contiguous copy, and a non-contiguous ``output``
    receives through a contiguous temporary (with ``async_op``, the handle's ``wait()``
    copies it in).

    Before it (``check_ranks``, the default), one all-gather of ``2n + 2`` int64s a rank
    (``8n(2n + 2)`` bytes, not counted by :class:`CommCounter`) compares every rank's call
    on every rank: on one rank a tensor that is not one, an output whose dtype is not the
    input's or sizes that do not fit (a TypeError or ValueError there), tensors whose elements
    or dtype differ between ranks, or ranks that passed split sizes to
    ``shardkit.comm.all_to_all_single`` while this one passed none (that call's own agreement
    meets this one) raise a ValueError on every rank before any data moves, where gloo hung
    or aborted. ``check_ranks=False``: for a caller whose sizes every rank derives alike (a
    transport), no agreement. A rank outside ``group`` takes no part (torch skips the op
    there; ``None`` comes back)."""
    _check_call("all_to_all_single", group)
    if _not_a_member(group):
        _check_call("all_to_all_single", group, output, input)
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)
    problem = _all_to_all_problem(output, input, get_world_size(group))
    if check_ranks:
        _agree_on_equal_chunks(problem, input, group)
    elif problem is not None:
        raise problem
    _record(counted_as, input, group, kind="all_to_all")
    # Note: gloo receives into a non-contiguous output's storage as if it were contiguous
    # (a transposed output got other elements, silently), and refuses a non-contiguous
    # input ("Tensors must be contiguous"): both go through contiguous copies
    landing = output if output.is_contiguous() else output.contiguous()
    work = _issued("all_to_all_single", group, dist.all_to_all_single, landing,
                   input.contiguous(), async_op=async_op)
    return _landed(work, landing, output, async_op)


def _all_to_all_problem(output, input, n: int) -> Optional[Exception]:
    """What makes :func:`all_to_all_single`'s tensors unfit on this rank, for a world of
    ``n`` (``None``: nothing), as the error to raise once the ranks have agreed. Local."""
    what = "shardkit.distributed.all_to_all_single"
    for name, tensor in (("output", output), ("input", input)):
        if not isinstance(tensor, torch.Tensor):
            return TypeError(f"{what}({name}=...): expected a torch.Tensor, got "
                             f"{type(tensor).__name__}")
    if output.dtype != input.dtype:
        return ValueError(f"all_to_all_single: output is {output.dtype} and input "
                          f"{input.dtype}; they must have one dtype")
    if input.numel() != output.numel() or input.numel() % n:
        return ValueError(f"all_to_all_single: input has {input.numel()} elements and "
                          f"output {output.numel()}; they must be equal and divisible by "
                          f"world size {n}")
    return None


# Note: an all-to-all with split sizes (shardkit.comm's) agrees first on rows of
# ``[ok, input_split_sizes (n), output_split_sizes (n), dtype]``; a plain all-to-all sends a
# row of that width too, so that where some ranks pass split sizes and others none, the two
# agreements meet (instead of an agreement meeting the data exchange: a hang). A plain row
# reads ``ok = 0`` to the split form (whose ranks then raise, naming the plain ranks) and
# carries ``_EQUAL_CHUNKS`` where the split form carries its first split size.
_EQUAL_CHUNKS = -2


def _agree_on_equal_chunks(problem: Optional[Exception], input: torch.Tensor, group) -> None:
    """:func:`all_to_all_single`'s agreement (see the note above): raise ``problem`` here,
    and a ValueError on every other rank, where any rank's call does not fit the others'."""
    what = "all_to_all_single"
    n = get_world_size(group)
    facts = [_EQUAL_CHUNKS, input.numel(), _dtype_code(input.dtype)] if problem is None \
        else [-1, -1, -1]
    row = [0, *facts] + [_EQUAL_CHUNKS if problem is None else -1] * (2 * n - 2)
    rows = _gather_rows(what, row, group, _control_device(group, input))
    if problem is not None:
        raise problem
    plain = [r for r, (ok, kind, *_) in enumerate(rows) if not ok and kind == _EQUAL_CHUNKS]
    failed = [r for r, (ok, *_) in enumerate(rows) if not ok and r not in plain]
    split = [r for r, (ok, *_) in enumerate(rows) if ok]
    if failed:
        raise ValueError(f"{what}: group rank(s) {failed} were given arguments that do not "
                         f"fit (their error says which); nothing was exchanged")
    if split:
        raise ValueError(f"{what}: group rank(s) {split} passed split sizes "
                         f"(output_split_sizes / input_split_sizes) and group rank(s) {plain} "
                         f"passed none; every rank of the group must pass split sizes, or "
                         f"none; nothing was exchanged")
    sizes = [(numel, code) for _, _, numel, code, *_ in rows]
    if len(set(sizes)) > 1:
        described = [(numel, _dtype_name(code)) for numel, code in sizes]
        raise ValueError(f"{what}: the ranks' tensors differ ((elements, dtype) per group "
                         f"rank: {described}); every rank must exchange as many elements of "
                         f"one dtype; nothing was exchanged")


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src``. Wire: ``(n-1)/n`` of its bytes."""
    _check_call("broadcast", group, tensor, src=src)
    _record("broadcast", tensor, group)
    return _issued("broadcast", group, dist.broadcast, tensor, src=src, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` onto global rank ``dst``. Wire: ``(n-1)/n`` of its bytes."""
    _check_call("reduce", group, tensor, reduce_op=op, dst=dst)
    _record("reduce", tensor, group)
    return _issued("reduce", group, dist.reduce, tensor, dst=dst, op=op, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Blocking send to global rank ``dst`` (a non-contiguous tensor as a contiguous copy,
    where torch refuses it: "input tensor has to be contiguous"). Wire: the tensor's
    bytes."""
    _check_call("send", group, tensor, dst=dst)
    _record("send", tensor, group)
    dist.send(tensor.contiguous(), dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0) -> int:
    """Blocking receive from global rank ``src`` (``None``: from whichever rank of ``group``
    sends first, as torch's). Returns the sender's global rank (-1 on a rank outside
    ``group``, where nothing is received). A non-contiguous ``tensor`` receives through a
    contiguous temporary. Wire: 0 (the sender counts it)."""
    _check_call("recv", group, tensor, **({} if src is None else {"src": src}))
    _record("recv", tensor, group)
    if tensor.is_contiguous():
        return dist.recv(tensor, src=src, group=group, tag=tag)
    landing = tensor.contiguous()
    sender = dist.recv(landing, src=src, group=group, tag=tag)
    tensor.copy_(landing)
    return sender


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """Asynchronous send to global rank ``dst`` (a non-contiguous tensor as a contiguous
    copy, taken now); returns a work handle. Wire: its bytes."""
    _check_call("isend", group, tensor, dst=dst)
    _record("send", tensor, group)
    return dist.isend(tensor.contiguous(), dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0):
    """Asynchronous receive from global rank ``src`` (``None``: from any rank of ``group``;
    the handle's ``_source_rank()`` then names the sender's group rank, as torch's); returns
    a work handle (for a non-contiguous ``tensor``, one whose ``wait()`` copies the message
    in from a contiguous temporary). Wire: 0."""
    _check_call("irecv", group, tensor, **({} if src is None else {"src": src}))
    _record("recv", tensor, group)
    if tensor.is_contiguous():
        return dist.irecv(tensor, src=src, group=group, tag=tag)
    landing = tensor.contiguous()
    return _ThenCopy([dist.irecv(landing, src=src, group=group, tag=tag)],
                     lambda: tensor.copy_(landing))


@dataclass
class P2POp:
    """One point-to-point op for :func:`batch_isend_irecv`: ``op`` is ``"send"`` or ``"recv"``."""

    op: str
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0


_FIRST_OPS_GROUP = object()  # batch_isend_irecv's default: record on the first op's group


def batch_isend_irecv(ops: Sequence[P2POp], counted_as: Optional[str] = None,
                      group=_FIRST_OPS_GROUP, logical_bytes: Optional[int] = None,
                      logical_shape: Optional[tuple] = None) -> list:
    """Issue several sends/receives together (avoids ordering deadlocks); returns work handles.
    Each tensor travels as one message, and every receive is posted before the first send (see
    the notes below). The ops may use different process groups (a transport's lanes).

    ``counted_as``: record the batch as one collective of that name (e.g. ``"all_gather"`` for
    a gather built from sends), with the bytes its sends really move, instead of one record per
    send and receive; on ``group`` (``None``: the default group; by default the first op's).

    ``logical_bytes`` (with ``counted_as``): the collective's full logical size ``S`` (all-gather
    output, reduce input), recorded under ``counted_as``'s own convention, the same on every
    rank, instead of what this rank's sends move (which differs between ranks when the
    segments are uneven).

    ``logical_shape`` (with ``counted_as``): the shape of the collective's logical tensor, the
    same on every rank (e.g. the all-gather's output); the collective debug mode
    (:mod:`shardkit.collective_check`) then compares it and the first op's dtype across the
    ranks before anything is sent, as it does for torch's own collectives. Without it only the
    op name is compared: a batch's own sizes legitimately differ between ranks."""
    for p in ops:  # all of them before the first is recorded or issued
        if p.op not in ("send", "recv"):
            raise ValueError(f"P2POp.op={p.op!r}; valid values are 'send' and 'recv'")
        peer = {"dst" if p.op == "send" else "src": p.peer}
        _check_call(f"batch_isend_irecv({p.op})", p.group, p.tensor, **peer)
    torch_ops = []
    sent = 0
    for p in ops:
        if counted_as is None:
            _record(p.op, p.tensor, p.group)
        elif p.op == "send":
            sent += p.tensor.numel() * p.tensor.element_size()
        fn = dist.isend if p.op == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, p.tensor, p.peer, p.group, p.tag))
    if counted_as is not None and ops:
        record_group = ops[0].group if group is _FIRST_OPS_GROUP else group
        dtype = ops[0].tensor.dtype
        if logical_bytes is not None:
            _record(counted_as, int(logical_bytes), record_group, dtype=dtype,
                    checked_shape=logical_shape)
        else:
            _record(counted_as, sent, record_group, kind="send", dtype=dtype,
                    checked_shape=logical_shape)
    if not torch_ops:
        return []
    # Note: gloo moves a message only once the receiver has announced the matching receive
    # (a notification each way, handled by each process's gloo thread). When both ends of a
    # pair post their sends first, each waits for the other's announcement, and exchanges in
    # both directions at once slow down: measured on the simulated cluster (1 Gbit/s, 8 MiB
    # each way in 1 MiB pieces), sends first 123-141 ms, receives first 70 ms (the rate alone:
    # 67 ms); on one host no difference. Only the order between sends and receives changes:
    # sends to one peer, and receives from one peer, keep their order, which matching relies on.
    # Note: tensors are not cut into smaller messages, since each message costs its own round of
    # notifications and wake-ups, which on one host with 2 shared cores is what FSDP's per-unit
    # gathers spend much of their time on: 1 MiB pieces made the MLP 16x1024's FSDP step about
    # 3% slower than whole tensors (world 2, interleaved A/B runs). On the simulated cluster
    # (1 Gbit/s), with receives posted first, pieces and whole tensors take the same time (MLP
    # FSDP 889-907 ms against 890-891 ms a step; 8 MiB each way: 70 ms either way).
    torch_ops.sort(key=lambda o: o.op is not dist.irecv)
    if len({id(o.group) for o in torch_ops}) == 1:
        return dist.batch_isend_irecv(torch_ops)
    # several groups: torch batches one group at a time, and gloo issues each op on its own
    # anyway (it has no coalescing), so they are issued one by one, receives first
    return [o.op(o.tensor, o.peer, o.group, o.tag) for o in torch_ops]


def record_transfer(op: str, nbytes: int, dtype: torch.dtype, group=None) -> None:
    """Record ``nbytes`` of ``dtype`` that a transport moved for this rank outside the process
    group (e.g. written into shared memory for its peers), under the collective ``op`` it
    implements. Nothing is sent here."""
    _record(op, int(nbytes), group, dtype=dtype, kind="send", checked=False)


def backend_of(group=None) -> str:
    """The backend name of ``group`` (``"gloo"``, ``"nccl"``, ...); ``"none"`` without a group.
    Transports read it to choose an algorithm; wrappers never do."""
    if not is_initialized():
        return "none"
    return str(dist.get_backend(group))


def barrier(group=None) -> None:
    """Block until every rank of ``group`` reaches this point. Wire: 0 counted bytes."""
    _check_call("barrier", group)
    _record("barrier", 0, group)
    with reporting_broken_links("barrier", group):
        dist.barrier(group=group)


def monitored_barrier(group=None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    """torch's ``monitored_barrier``: a barrier (on gloo) that names the ranks that did not
    reach it within ``timeout`` (a positive ``timedelta``; ``None``: the group's own timeout,
    where torch's would wait its 30-minute default), all of them with ``wait_all_ranks``, else
    the first. Any group whose CPU tensors gloo carries takes it: a ``"gloo"`` group, and
    torch's default and per-device groups (``init_process_group()`` without a backend reads
    ``"undefined"``; ``"cpu:gloo,cuda:nccl"``), which torch's function refuses by their name
    although their process group runs it (on the CPU, as torch's does). Wire: 0 counted
    bytes.

    Raises:
        ValueError: a ``timeout`` that is not a positive ``timedelta``, or a group whose CPU
            tensors gloo does not carry (torch implements it for gloo only); on every rank
            alike, before anything is sent.
    """
    what = "shardkit.distributed.monitored_barrier"
    _check_call("monitored_barrier", group)
    if timeout is not None and (not isinstance(timeout, datetime.timedelta)
                                or timeout.total_seconds() <= 0):
        raise ValueError(f"{what}(timeout={timeout!r}): expected a positive datetime.timedelta "
                         f"or None (the group's timeout)")
    if _not_a_member(group):
        return
    if not _gloo_carries(group):
        raise ValueError(f"{what}(group=...): the group's backend is {backend_of(group)!r}; "
                         f"torch implements monitored_barrier for gloo only (use barrier, or a "
                         f"gloo group from new_group(ranks, backend='gloo'))")
    if timeout is None:
        seconds = timeout_of(group)
        timeout = dist.default_pg_timeout if seconds is None else \
            datetime.timedelta(seconds=seconds)
    # not checked by the collective debug mode: its all-gather would meet an absent rank
    # first, and time out without naming it, where this barrier is there to name it
    _record("barrier", 0, group, checked=False)
    resolved_group(group).monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


class _Finished:
    """The handle of work that finished before it was returned: ``wait()`` returns at once."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ThenCopy:
    """The handle of torch works ``works`` whose result lands in a temporary: ``wait()`` (or
    an ``is_completed()`` that finds them all done) waits for them, then runs ``finish`` (which
    copies the result into the caller's tensors) once; later calls return at once (a gloo
    receive waited for twice blocks forever). ``watched``: the works report completion only
    when waited for (gloo's reduce-scatter: its ``is_completed()`` reads ``False`` even after
    ``wait()``), so a background thread waits for them and ``is_completed()`` polls that."""

    def __init__(self, works, finish, watched: bool = False):
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._watcher = None
        if watched and self._works:
            from shardkit.transport import CommHandle  # it builds on this module
            self._watcher = CommHandle(self._works, completes_when_waited=True)
            self._watcher.watch()

    def wait(self, timeout=None) -> bool:
        if not self._done:
            # the works themselves, not the watcher: its one thread waits for every watched
            # handle in turn, and one stuck ahead of these (a dropped receive never sent)
            # would hold this wait too (a collective's work may be waited for twice)
            for work in self._works:
                work.wait()
            if self._finish is not None:
                finish, self._finish = self._finish, None
                finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        if not self._done:
            arrived = self._watcher.is_completed() if self._watcher is not None else \
                all(w.is_completed() for w in self._works)
            if arrived:
                self.wait()
        return self._done

    def _source_rank(self) -> int:
        """The sender's group rank, for an any-source receive (one work), as torch's."""
        return self._works[-1]._source_rank()


def _gloo_carries(group, device=None) -> bool:
    """Whether gloo carries ``group``'s collectives of tensors on ``device`` (default: the
    CPU): a ``"gloo"`` group, and torch's default and per-device ones for the devices gloo
    serves there (``init_process_group()`` with no backend reads ``"undefined"``;
    ``"cpu:gloo,cuda:nccl"``). Local."""
    name = backend_of(group)
    if name == "gloo":
        return True
    if name == "none" or _not_a_member(group):
        return False
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        kind = torch.device(device).type if device is not None else "cpu"
        return "Gloo" in type(pg._get_backend(torch.device(kind))).__name__
    except Exception:  # noqa: BLE001 - no backend for that device: not gloo
        return False


def _completes_when_waited(group, device=None) -> bool:
    """Whether ``group``'s reduce-scatter works (of tensors on ``device``) report completion
    only when waited for (gloo's)."""
    return _gloo_carries(group, device)


def _handle(works, finish, async_op: bool, watched: bool = False):
    """``works`` (with ``finish`` after them) as one handle when ``async_op`` (``watched``:
    see :class:`_ThenCopy`), else waited."""
    handle = _ThenCopy(works, finish, watched=watched and async_op)
    if async_op:
        return handle
    handle.wait()
    return None


def _dtype_code(dtype: torch.dtype) -> int:
    """A number naming ``dtype`` alike on every rank (for the argument agreements)."""
    return zlib.crc32(str(dtype).encode())


def _dtype_name(code: int) -> str:
    """The dtype :func:`_dtype_code` gave ``code`` (for error messages)."""
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and _dtype_code(value) == code:
            return str(value)
    return f"dtype #{code}"


def _op_name(code: int) -> str:
    """The ReduceOp an argument agreement carried as ``code`` (``-1``: one built at run
    time), for error messages."""
    return str(ReduceOp.RedOpType(code)).rsplit(".", 1)[-1] if code >= 0 else "?"


def _signature(pairs) -> int:
    """A number naming a list of ``(elements, dtype code)`` alike on every rank."""
    return zlib.crc32(repr([(int(k), int(c)) for k, c in pairs]).encode())


def _control_device(group, *tensors) -> torch.device:
    """Where a control message of ``group`` lives: the first tensor's device, else this
    process's CUDA device for an NCCL group (NCCL carries CUDA tensors only), else the CPU
    (a mixed group such as ``"cpu:gloo,cuda:nccl"`` carries CPU tensors on gloo). Local."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) \
        if backend_of(group) == "nccl" else torch.device("cpu")


def _agree_on_call(what: str, problem, facts: Sequence[int], group, device,
                   outcome: str = "nothing was sent") -> list:
    """Before a collective whose arguments one rank alone may get wrong: one all-gather of
    ``[ok, *facts]`` from every rank of ``group`` (``1 + len(facts)`` int64s a rank, on
    ``device``; a control message that :class:`CommCounter` does not count). ``problem`` (a
    message or an exception; ``None``: nothing wrong here) is raised on this rank, and every
    other rank raises a ValueError naming the group ranks that had one (``outcome`` tells
    them what happened), so no rank goes on alone. Returns every rank's ``facts`` (group-rank
    order), for checks the caller makes alike on every rank."""
    row = [1, *(int(f) for f in facts)] if problem is None else [0] + [-1] * len(facts)
    rows = _gather_rows(what, row, group, device)
    if problem is not None:
        raise problem if isinstance(problem, BaseException) else ValueError(problem)
    failed = [r for r, (ok, *_) in enumerate(rows) if not ok]
    if failed:
        raise ValueError(f"{what}: group rank(s) {failed} were given arguments that do not "
                         f"fit (their error says which); {outcome}")
    return [facts_of_rank for _, *facts_of_rank in rows]


def _gather_rows(what: str, row: Sequence[int], group, device) -> list:
    """Every rank's ``row`` (int64s, of one length on every rank) in group-rank order: one
    all-gather on ``device``, a control message that :class:`CommCounter` does not count."""
    _require_process_group(what)
    n = get_world_size(group)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    every = torch.empty(len(row) * n, dtype=torch.int64, device=device)
    _record("all_gather", every, group, counted=False)
    with reporting_broken_links(f"{what.rsplit('.', 1)[-1]} (argument check)", group):
        _all_gather_tensor(every, mine, group=group)
    return every.view(n, len(row)).tolist()


def gather_control_rows(what: str, row: Sequence[int], group=None) -> list:
    """Every rank's ``row`` of ints (one length on every rank), in group-rank order: the small
    agreement a wrapper makes before a collective step (which ranks offloaded, which call each
    rank is in). One all-gather of ``len(row)`` int64s a rank on the group's control device
    (CUDA for NCCL, else the CPU: a host sync on an accelerator); a control message that
    :class:`CommCounter` does not count. ``what`` names the call in a broken-link error."""
    return _gather_rows(what, row, group, _control_device(group))


def _agree_on_root(what: str, root_name: str, root, problem: Optional[str], group,
                   device, outcome: str = "nothing was sent",
                   tensor: Optional[torch.Tensor] = None) -> None:
    """Around a rooted collective whose arguments only some ranks can check (the root's list,
    before a gather; the lengths, after an object broadcast): one all-gather of ``[ok, root,
    numel, dtype]`` from every rank of ``group`` (four int64s a rank, on ``device``; a control
    message that :class:`CommCounter` does not count, see :func:`_agree_on_call`), after which
    every rank raises a ValueError when any rank found ``problem`` (that rank's own text;
    ``outcome`` tells the others what happened), the ranks name different roots, or (given
    ``tensor``) their tensors differ in size or dtype, so no rank goes on alone (gloo aborts
    the root's process on a gather of another size, and a scatter into a larger tensor leaves
    its tail stale, silently)."""
    numel, dtype_code = (-1, -1) if tensor is None else \
        (tensor.numel(), _dtype_code(tensor.dtype))
    rows = _agree_on_call(what, problem, [root if problem is None else -1, numel, dtype_code],
                          group, device, outcome)
    roots = [r for r, *_ in rows]
    if len(set(roots)) > 1:
        raise ValueError(f"{what}({root_name}=...): the ranks of the group name different "
                         f"roots, {root_name} per group rank: {roots}; every rank must pass "
                         f"the same {root_name}")
    if tensor is not None and len({tuple(row[1:]) for row in rows}) > 1:
        raise ValueError(f"{what}(tensor=...): the ranks' tensors differ in size or dtype "
                         f"(elements per group rank: {[row[1] for row in rows]}); every rank's "
                         f"tensor must match the {root_name}'s list items; {outcome}")


def _rooted_problem(what: str, root_name: str, root, list_name: str, items, tensor, at_root,
                    group) -> Optional[str]:
    """What is wrong with a gather's or scatter's ``root`` and list on this rank (``None``:
    nothing). The root takes a list of one tensor per rank of the group, each of
    ``tensor``'s shape and dtype; the other ranks take ``None`` (or an empty list), as
    torch's."""
    try:
        _check_peer(what, root_name, root, group)
    except ValueError as error:
        return str(error)
    n = get_world_size(group)
    if not at_root(root):
        if items is None or (isinstance(items, (list, tuple)) and not items):
            return None
        return (f"{what}({list_name}=...): given on global rank {get_rank()}, which is not the "
                f"{root_name} ({root}); pass {list_name}=None on every rank but "
                f"{root_name}, as torch requires")
    want = f"a list of {n} tensors (one per rank of the group) of shape " \
           f"{tuple(tensor.shape)} and dtype {tensor.dtype}, like the tensor's"
    if not isinstance(items, (list, tuple)) or len(items) != n:
        got = type(items).__name__ if not isinstance(items, (list, tuple)) else \
            f"{len(items)} items"
        return f"{what}({list_name}=...): on the {root_name} ({root}) expected {want}; got {got}"
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor) or item.shape != tensor.shape \
                or item.dtype != tensor.dtype:
            got = type(item).__name__ if not isinstance(item, torch.Tensor) else \
                f"{tuple(item.shape)} {item.dtype}"
            return f"{what}({list_name}[{i}]=...): expected {want}; got {got}"
    return None


def gather(tensor: torch.Tensor, gather_list: Optional[list] = None, dst: int = 0, group=None,
           async_op: bool = False, check_ranks: bool = True):
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (there a
    list of one tensor per rank of the group, in group-rank order, each of ``tensor``'s shape
    and dtype; ``None`` on the other ranks), as torch's ``gather``. Returns a work handle
    with ``async_op`` (``None`` on a rank outside ``group``, which takes no part).

    Before it, one all-gather of four ints per rank (not counted) checks ``dst``, the list
    and every rank's tensor size and dtype on every rank, so that a bad argument on any rank
    raises a ValueError on every rank and none is left waiting. Wire: each other rank sends
    its tensor to ``dst``; counted as ``gather``, ``(n-1)/n`` of the tensor's bytes on every
    rank (rooted ops averaged over the ranks). ``check_ranks=False``: for a caller whose
    arguments every rank derives alike (one gather per optimizer-state tensor), no
    agreement."""
    _check_call("gather", group, tensor)
    if _not_a_member(group):
        return None
    if check_ranks:
        what = "shardkit.distributed.gather"
        problem = _rooted_problem(what, "dst", dst, "gather_list", gather_list, tensor,
                                  lambda root: get_rank() == root, group)
        _agree_on_root(what, "dst", dst, problem, group, tensor.device, tensor=tensor)
    _record("gather", tensor, group, kind="reduce")
    with reporting_broken_links("gather", group):
        return _tracked(dist.gather(tensor, list(gather_list) if get_rank() == dst else None,
                                    dst=dst, group=group, async_op=async_op), group)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list] = None, src: int = 0,
            group=None, async_op: bool = False):
    """Scatter ``scatter_list`` from global rank ``src`` (there a list of one tensor per rank
    of the group, in group-rank order, each of ``tensor``'s shape and dtype; ``None`` on the
    other ranks): every rank receives its item into ``tensor``, as torch's ``scatter``.
    Returns a work handle with ``async_op`` (``None`` on a rank outside ``group``).

    Before it, one all-gather of four ints per rank (not counted) checks ``src``, the list
    and every rank's tensor size and dtype on every rank, as :func:`gather` does. Wire:
    ``src`` sends each other rank its item; counted as ``scatter``, ``(n-1)/n`` of the
    tensor's bytes on every rank (rooted ops averaged over the ranks)."""
    _check_call("scatter", group, tensor)
    if _not_a_member(group):
        return None
    what = "shardkit.distributed.scatter"
    problem = _rooted_problem(what, "src", src, "scatter_list", scatter_list, tensor,
                              lambda root: get_rank() == root, group)
    _agree_on_root(what, "src", src, problem, group, tensor.device, tensor=tensor)
    _record("scatter", tensor, group, kind="broadcast")
    # Note: gloo scatters a non-contiguous item's storage as if it were contiguous (the
    # columns of a matrix arrived as the wrong elements, silently), hence the copies
    # (and receives into the storage of a non-contiguous output as if it were contiguous)
    items = [t.contiguous() for t in scatter_list] if get_rank() == src else None
    landing = tensor if tensor.is_contiguous() else tensor.contiguous()
    with reporting_broken_links("scatter", group):
        work = dist.scatter(landing, items, src=src, group=group, async_op=async_op)
    return _landed(_tracked(work, group), landing, tensor, async_op)


def _landed(work, landing: torch.Tensor, target: torch.Tensor, async_op: bool):
    """The result of a collective ``work`` that received into ``landing``: ``target`` itself
    (the work's handle, or ``None``), or a contiguous stand-in for a non-contiguous ``target``
    (copied into it now, or by the returned handle's ``wait()`` with ``async_op``)."""
    if landing is target:
        return work
    if not async_op:
        target.copy_(landing)
        return None
    return _ThenCopy([work], lambda: target.copy_(landing))


def _tensor_list(what: str, argument: str, items) -> list:
    """``items`` as a list of tensors, or a clear TypeError naming ``argument``."""
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, torch.Tensor)
                                                       for t in items):
        raise TypeError(f"{what}({argument}=...): expected a list of torch.Tensors, got "
                        f"{type(items).__name__}"
                        + (" holding other objects" if isinstance(items, (list, tuple)) else ""))
    return list(items)


def _by_dtype(indices_and_tensors) -> list:
    """``[(i, tensor)]`` in lists of one device and dtype, in order of first appearance."""
    buckets: dict = {}
    for i, t in indices_and_tensors:
        buckets.setdefault((t.device, t.dtype), []).append((i, t))
    return list(buckets.values())


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                         async_op: bool = False):
    """All-reduce every tensor of ``tensors`` in place with ``op``, as torch's (and
    DeepSpeed's) ``all_reduce_coalesced``: the tensors of one device and dtype travel as one
    flat buffer, so one :func:`all_reduce` per dtype (any shapes, any mix of dtypes). Memory:
    a flat temporary per dtype. With ``async_op`` a handle whose ``wait()`` copies the sums
    back. Wire: ``2(n-1)/n`` of the tensors' bytes, counted as ``all_reduce``.

    Before it, one all-gather of four int64s a rank (``32n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's list on every rank: a bad list on
    one rank, or lists whose number of tensors, elements or dtypes (in order), or ops, differ
    between ranks (gloo aborts on flat buffers of different sizes; buffers of one size are
    summed across the wrong tensors, silently), raise a ValueError on every rank, naming the
    ranks, before anything is sent.

    Raises:
        TypeError: ``tensors`` not a list of tensors, or ``op`` not a ReduceOp (on that rank;
            a ValueError on the others).
        ValueError: lists or ops that differ between ranks.
    """
    what = "shardkit.distributed.all_reduce_coalesced"
    _check_call("all_reduce_coalesced", group)
    if _not_a_member(group):
        _check_call("all_reduce_coalesced", group, *_tensor_list(what, "tensors", tensors),
                    reduce_op=op)
        return _Finished() if async_op else None
    problem = None
    try:
        tensors = _tensor_list(what, "tensors", tensors)
        _check_call("all_reduce_coalesced", group, *tensors, reduce_op=op)
    except (TypeError, ValueError) as error:
        problem, tensors = error, []
    # an op torch builds at run time (premul_sum) has no name that every rank shares
    op_code = int(op) if isinstance(op, ReduceOp.RedOpType) else -1
    sizes = [(t.numel(), _dtype_code(t.dtype)) for t in tensors]
    rows = _agree_on_call(what, problem, [len(tensors), _signature(sizes), op_code], group,
                          _control_device(group, *tensors))
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise ValueError(
            f"{what}(tensors=...): group rank(s) {differ} pass other tensors or another op than "
            f"group rank 0 (number of tensors per group rank: {[k for k, *_ in rows]}; ops: "
            f"{[_op_name(o) for *_, o in rows]}; elements or dtypes differ where those agree); "
            f"every rank must pass as many tensors, of the same elements and dtypes in the same "
            f"order, and the same op; nothing was sent")
    works, copies = [], []
    for bucket in _by_dtype(enumerate(tensors)):
        flat = torch.cat([t.reshape(-1) for _, t in bucket])
        works.append(all_reduce(flat, op=op, group=group, async_op=True))
        copies.append((flat, [t for _, t in bucket]))

    def finish():
        for flat, targets in copies:
            offset = 0
            for t in targets:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return _handle(works, finish, async_op)


def all_gather_coalesced(output_tensors: Sequence[torch.Tensor],
                         input_tensors: Sequence[torch.Tensor], group=None,
                         async_op: bool = False):
    """DeepSpeed's ``all_gather_coalesced(output_tensors, input_tensors, group=None,
    async_op=False)``: for each ``i``, every rank's ``input_tensors[i]`` gathered rank-major
    into ``output_tensors[i]`` (``n`` times its elements), as :func:`all_gather_into_tensor`
    per pair; the inputs of one device and dtype travel as one flat buffer, so one all-gather
    per dtype. Memory: flat temporaries of the inputs and outputs. With ``async_op`` a handle
    whose ``wait()`` copies the gathered values out. Wire: ``(n-1)/n`` of the outputs' bytes,
    counted as ``all_gather``.

    Before it, one all-gather of three int64s a rank (``24n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's lists on every rank: a bad list on
    one rank, or inputs whose number, elements or dtypes differ between ranks (gloo aborts
    on a flat buffer of another size; one of the same size is gathered into the wrong
    outputs, silently), raise a ValueError on every rank, naming the rank.

    Raises:
        TypeError: a list that is not a list of tensors (on that rank; a ValueError on the
            others).
        ValueError: lists of different lengths, or an output that is not ``n`` times its
            input (naming the index), or lists that differ between ranks, before anything is
            sent.
    """
    what = "shardkit.distributed.all_gather_coalesced"
    _check_call("all_gather_coalesced", group)
    if _not_a_member(group):
        return _Finished() if async_op else None
    n = get_world_size(group)
    problem, outputs, inputs = None, [], []
    try:
        outputs = _tensor_list(what, "output_tensors", output_tensors)
        inputs = _tensor_list(what, "input_tensors", input_tensors)
        _check_call("all_gather_coalesced", group, *outputs, *inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} output_tensors and {len(inputs)} "
                             f"input_tensors; expected one output per input")
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            if out.numel() != n * inp.numel() or out.dtype != inp.dtype:
                raise ValueError(f"{what}(output_tensors[{i}]=...): {out.numel()} elements "
                                 f"of {out.dtype}; expected world size {n} x "
                                 f"input_tensors[{i}]'s {inp.numel()} = {n * inp.numel()} "
                                 f"elements of {inp.dtype}")
    except (TypeError, ValueError) as error:
        problem = error
    device = _control_device(group, *inputs)
    sizes = [(t.numel(), _dtype_code(t.dtype)) for t in inputs]
    rows = _agree_on_call(what, problem, [len(inputs), _signature(sizes)], group, device)
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise ValueError(f"{what}(input_tensors=...): group rank(s) {differ} pass other inputs "
                         f"than group rank 0 (number of inputs per group rank: "
                         f"{[k for k, _ in rows]}; elements or dtypes differ where those "
                         f"agree); every rank must pass as many inputs, of the same elements "
                         f"and dtypes in the same order; nothing was sent")
    works, copies = [], []
    for bucket in _by_dtype(enumerate(inputs)):
        flat_in = torch.cat([t.reshape(-1) for _, t in bucket])
        flat_out = flat_in.new_empty(n * flat_in.numel())
        works.append(all_gather_into_tensor(flat_out, flat_in, group=group, async_op=True))
        copies.append((flat_out.view(n, -1), [i for i, _ in bucket]))

    def finish():
        for gathered, indices in copies:
            offset = 0
            for i in indices:
                size = inputs[i].numel()
                outputs[i].copy_(gathered[:, offset:offset + size].reshape(outputs[i].shape))
                offset += size
    return _handle(works, finish, async_op)


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor], op=ReduceOp.SUM,
                   group=None, async_op: bool = False):
    """List form of reduce-scatter, as torch's: ``input_list`` holds one tensor per rank of
    the group (each of ``output``'s elements and dtype); ``output`` receives the reduction
    (``op``) of every rank's ``input_list[rank]``. Runs as one :func:`reduce_scatter_tensor`
    over the list packed into a flat temporary. Wire: ``(n-1)/n`` of the list's bytes,
    counted as ``reduce_scatter``.

    Before it, one all-gather of four int64s a rank (``32n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's arguments on every rank: a bad list
    on one rank, or outputs of other elements or dtype, or another ``op``, on some ranks
    (gloo aborts on the first, and reduces with each rank's own op, silently, on the last),
    raise a ValueError on every rank, naming the rank.

    Raises:
        TypeError: ``input_list`` not a list of tensors (on that rank; a ValueError on the
            others).
        ValueError: a list whose length is not the group's size, an item that does not
            match ``output`` (naming it), or arguments that differ between ranks, before
            anything is sent.
    """
    what = "shardkit.distributed.reduce_scatter"
    _check_call("reduce_scatter", group)
    if _not_a_member(group):
        _check_call("reduce_scatter", group, output, reduce_op=op)
        return _Finished() if async_op else None
    n = get_world_size(group)
    problem, inputs = None, []
    try:
        _check_call("reduce_scatter", group, output, reduce_op=op)
        inputs = _tensor_list(what, "input_list", input_list)
        _check_call("reduce_scatter", group, output, *inputs, reduce_op=op)
        if len(inputs) != n:
            raise ValueError(f"{what}(input_list=...): expected a list of {n} tensors (one per "
                             f"rank of the group), got {len(inputs)}")
        for i, t in enumerate(inputs):
            if t.numel() != output.numel() or t.dtype != output.dtype:
                raise ValueError(f"{what}(input_list[{i}]=...): {t.numel()} elements of "
                                 f"{t.dtype}; expected the output's {output.numel()} elements "
                                 f"of {output.dtype}")
    except (TypeError, ValueError) as error:
        problem = error
    # an op torch builds at run time (premul_sum) has no name that every rank shares
    op_code = int(op) if isinstance(op, ReduceOp.RedOpType) else -1
    facts = [-1, -1, -1] if problem is not None else \
        [output.numel(), _dtype_code(output.dtype), op_code]
    rows = _agree_on_call(what, problem, facts, group, _control_device(group, output))
    if len({tuple(row) for row in rows}) > 1:
        described = [(k, _dtype_name(code), str(ReduceOp.RedOpType(o)) if o >= 0 else "?")
                     for k, code, o in rows]
        raise ValueError(f"{what}: the ranks' outputs or ops differ ((elements, dtype, op) per "
                         f"group rank: {described}); every rank must pass an output of the same "
                         f"elements and dtype, and the same op; nothing was sent")
    flat = torch.cat([t.reshape(-1) for t in inputs])
    result = output if output.is_contiguous() else \
        torch.empty_like(output, memory_format=torch.contiguous_format)
    # flat, whatever the output's shape (gloo refuses an output of more dims than one beside
    # the flat input: "Check failed: outputShape[0] * worldSize == inputShape[0]")
    work = reduce_scatter_tensor(result.view(-1), flat, op=op, group=group, async_op=True)
    finish = None if result is output else (lambda: output.copy_(result))
    return _handle([work], finish, async_op,
                   watched=_completes_when_waited(group, output.device))


def any_rank(flag: bool, group=None, device=None) -> bool:
    """Whether ``flag`` is true on any rank of ``group``: a decision every rank then takes
    alike (skip a step, abort a save, re-gather). One all-reduce of one element (on ``device``,
    the compute device: NCCL needs CUDA)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(value, op=ReduceOp.MAX, group=group)
    return bool(value.item() > 0)


def broadcast_tensors_from_rank0(tensors: Sequence[torch.Tensor], group=None,
                                 chunk_bytes: int = 1 << 24, transport=None) -> None:
    """Overwrite ``tensors`` (parameters, buffers) on every rank of ``group`` with group rank
    0's values, packed into flat chunks of about ``chunk_bytes`` per device and dtype, each
    broadcast by ``transport`` (a :class:`shardkit.transport.Transport`: the wrapper's
    ``comm``) or, with ``None``, by the process group.

    Memory: one chunk at a time. Wire: ``(N-1)/N`` of the tensors' bytes, counted as
    broadcasts. Collective over ``group``."""
    if get_world_size(group) < 2:
        return
    src = get_global_rank(group, 0)
    mine = get_rank(group) == 0
    for chunk in _chunks_by_dtype(tensors, chunk_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        if transport is None:
            broadcast(flat, src=src, group=group)
        else:
            transport.broadcast(flat, src, group).wait()
        if not mine:
            offset = 0
            with torch.no_grad():
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()


def _chunks_by_dtype(tensors: Sequence[torch.Tensor], chunk_bytes: int):
    """``tensors`` in lists of one device and dtype, each about ``chunk_bytes`` at most (a
    larger tensor alone)."""
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for same in by_key.values():
        chunk, size = [], 0
        for t in same:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        if chunk:
            yield chunk


def broadcast_object(obj, src: int = 0, group=None):
    """Broadcast a picklable object from global rank ``src``; returns it on every rank.
    Counted by :class:`CommCounter` on every rank as a broadcast of the pickled object's
    bytes, as a tensor broadcast is."""
    _check_call("broadcast_object", group, src=src)
    box = [obj]
    _record("broadcast", 0, group, counted=False)  # the debug mode's check, before the op
    with reporting_broken_links("broadcast_object", group):
        dist.broadcast_object_list(box, src=src, group=group)
    if comm_counter.counting():  # every rank counts the payload, as for a tensor broadcast
        _record("broadcast", len(pickle.dumps(box[0])), group, checked=False)
    return box[0]


def first_disagreement(mine: dict, group=None) -> Optional[tuple]:
    """Whether the ranks of ``group`` hold the same ``mine`` (``{name: text}``): ``None`` when
    they do, else ``(name, rank 0's text, rank, that rank's text)`` for the first name (in rank
    0's order, then the others' sorted) on which the first rank differing from rank 0
    differs, the same tuple on every rank (a missing name reads ``"(absent)"``), so that every
    rank raises the same error.
    Communication: one object all-gather of ``mine``."""
    return first_difference(all_gather_object(mine, group=group))


def raise_on_disagreement(mine: dict, group, who: str, rule: str) -> None:
    """Raise, on every rank and with the same text, ``ValueError("{who}: {name} is {rank 0's}
    on rank 0 of the group and {theirs} on rank {r}; {rule}")`` unless every rank of ``group``
    holds the same ``mine`` (see :func:`first_disagreement`). Communication: one object
    all-gather of ``mine``."""
    found = first_disagreement(mine, group)
    if found is not None:
        name, first, r, theirs = found
        raise ValueError(f"{who}: {name} is {first} on rank 0 of the group and {theirs} on rank "
                         f"{r}; {rule}")


def first_difference(every: list) -> Optional[tuple]:
    """:func:`first_disagreement` on dicts already gathered (``every[r]``: rank ``r``'s), for a
    caller whose own all-gather carried them. Local."""
    for r, theirs in enumerate(every[1:], start=1):
        for name in [*every[0], *sorted(set(theirs) - set(every[0]))]:
            if theirs.get(name) != every[0].get(name):
                return (name, every[0].get(name, "(absent)"), r, theirs.get(name, "(absent)"))
    return None


def all_gather_object(obj, group=None, counted: bool = True,
                      operation: str = "all_gather_object") -> list:
    """Gather one picklable object from every rank of ``group``; returns the list.
    ``counted=False``: a control message beside the wrappers' traffic (the ranks' start-up
    agreement), which ``CommCounter`` does not count; ``operation`` names it in a broken-link
    error. Counted as ``n`` times the largest pickled object on every rank alike (torch pads
    every rank's bytes to the largest)."""
    _check_call("all_gather_object", group)
    out = [None] * get_world_size(group)
    if counted:
        _record("all_gather", 0, group, counted=False)  # the debug mode's check, before the op
    with reporting_broken_links(operation, group):
        dist.all_gather_object(out, obj, group=group)
    if counted and comm_counter.counting():
        _record("all_gather", max(len(pickle.dumps(o)) for o in out) * len(out), group,
                checked=False)
    return out
