"""What a collective's error says when its connection to a peer broke or timed out: a
:class:`CollectiveError` naming the operation, the group, this rank and the ranks of this host
whose processes exited (their process ids are gathered with the node layout, see
:mod:`shardkit.topology`). Local: reads ``/proc`` only. Re-exported by
:mod:`shardkit.distributed`."""

from __future__ import annotations

import contextlib
import os
from typing import Optional, Sequence

import torch.distributed as dist

from shardkit.process_groups import (backend_of, get_rank, get_world_size, group_ranks,
                                     is_initialized)


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


# (the default group, every rank's _this_process()), gathered with the node layout
_processes: Optional[tuple] = None


def remember_processes(world, processes: Sequence[tuple]) -> None:
    """Keep every rank's ``(boot id, pid namespace, pid)`` (``processes``, gathered with the
    node layout over the default group ``world``) for :func:`exited_peers_on_this_host`."""
    global _processes
    _processes = (world, processes)


def forget_processes() -> None:
    """Drop what :func:`remember_processes` kept (the default group is being torn down)."""
    global _processes
    _processes = None


def _known_processes() -> Optional[list]:
    """Every rank's ``(boot id, pid namespace, pid)`` for the current default group, or
    ``None`` where they were not gathered."""
    if _processes is not None and is_initialized() and _processes[0] is dist.group.WORLD:
        return _processes[1]
    return None


def exited_peers_on_this_host(settle_s: float = 0.0, ranks: Optional[Sequence[int]] = None
                              ) -> list[tuple[int, int]]:
    """``(global rank, pid)`` of each rank of the default group (or of its global ``ranks``)
    that runs on this host (same kernel and pid namespace, as gathered with the node layout by
    :func:`~shardkit.distributed.init_distributed`) and whose process has exited; empty where
    nothing was gathered or ``/proc`` does not say.
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
