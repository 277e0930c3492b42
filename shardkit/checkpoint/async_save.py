"""Asynchronous checkpoint saves: copy this rank's shard to host memory, write it in a thread.

``engine.save_checkpoint(dir, async_save=True)`` blocks the training loop only while this rank's
fp32 parameters and optimizer state are copied into CPU tensors (the same copies a synchronous
save makes); a background thread then writes the rank file, checksums it and takes part in the
atomic commit of :func:`~shardkit.checkpoint.sharded.commit_checkpoint`. The next
``save_checkpoint``, ``load_checkpoint``, :meth:`AsyncSave.wait`, :func:`wait_for_pending_saves`
(which ``shardkit.distributed.destroy()`` calls first) or the end of the process waits for it
and raises its error, if any. A crash or failure during the background write
leaves ``latest`` naming the previous checkpoint, exactly as a synchronous save does.

Note: the commit's barriers and agreement all-reduces run on a separate gloo process group
(created once, at the first asynchronous save, on every rank), so they never interleave with the
collectives the training loop issues on the default group meanwhile.

Note: torch's ``torch.distributed.destroy_process_group()`` would shut the checkpoint group
down under a save still being committed. The first asynchronous save therefore makes torch's
function (``torch.distributed.destroy_process_group`` and its ``distributed_c10d`` original)
first wait for this process's pending saves, as ``shardkit.distributed.destroy()`` does, when
it destroys every group (no argument) or the checkpoint group; a failed save is raised there
once the groups are gone, so the script ends with an error rather than status 0. A name bound
by ``from torch.distributed import destroy_process_group`` before that first save keeps torch's
own function: call :func:`wait_for_pending_saves` before it.

Costs: memory, one CPU copy of this rank's share of the model and optimizer state until the
write ends; communication, that of a synchronous save, on the checkpoint group.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import sys
import threading
import weakref
from typing import Callable, Optional

from shardkit import distributed

__all__ = ["AsyncSave", "checkpoint_group", "wait_for_pending_saves"]

_groups = distributed.GroupCache()  # "world" -> the gloo group of this world's saves
_pending: "weakref.WeakSet[AsyncSave]" = weakref.WeakSet()
_started = itertools.count()  # orders the pending saves by their start


def checkpoint_group():
    """The gloo group over every rank that background saves commit on (created on first use;
    a collective: every rank must reach the first asynchronous save)."""
    cached = _groups.current()
    if "world" not in cached:
        cached["world"] = distributed.new_group(range(distributed.get_world_size()),
                                                backend="gloo")
        _make_torch_destroy_wait_for_saves()
    return cached["world"]


def _make_torch_destroy_wait_for_saves() -> None:
    """Replace torch's ``destroy_process_group`` (where the users' scripts and torch's own
    helpers look it up) by :func:`_waiting_destroy` of it, once per process."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    wrappers = {}  # one wrapper per original: both names stay one object, as torch's (pickle)
    for module in (distributed_c10d, dist):
        original = module.destroy_process_group
        if not getattr(original, "_waits_for_checkpoint_saves", False):
            if id(original) not in wrappers:
                wrappers[id(original)] = _waiting_destroy(original)
            module.destroy_process_group = wrappers[id(original)]


def _waiting_destroy(destroy_process_group):
    """torch's ``destroy_process_group(group=None)`` that first waits for the pending
    asynchronous saves when it is about to destroy the group their commits run on (every
    group: no argument or ``group.WORLD``, as torch reads it; or the checkpoint group itself),
    then destroys, then raises the first failed save's error (:func:`wait_for_pending_saves`).
    Other groups are destroyed at once."""
    @functools.wraps(destroy_process_group)
    def destroy(group=None):
        if not _destroys_checkpoint_group(group):
            return destroy_process_group(group)
        try:
            wait_for_pending_saves()
        finally:
            destroy_process_group(group)

    destroy._waits_for_checkpoint_saves = True
    return destroy


def _destroys_checkpoint_group(group) -> bool:
    """Whether torch's ``destroy_process_group(group)`` tears down the checkpoint group."""
    from torch.distributed import GroupMember
    return (group is None or group is GroupMember.WORLD
            or group is _groups.current().get("world"))


class AsyncSave:
    """A checkpoint being written by a background thread.

    Attributes:
        path: the checkpoint directory it will publish.
    """

    def __init__(self, path: str, write: Callable[[], str]):
        self.path = path
        self._error: Optional[BaseException] = None
        self._order = next(_started)
        self._thread = threading.Thread(target=self._run, args=(write,),
                                        name="shardkit-async-checkpoint", daemon=True)
        _pending.add(self)
        self._thread.start()

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as e:  # re-raised by wait() on the caller's thread
            self._error = e

    def done(self) -> bool:
        """True once the background write has ended (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the write ends; return the checkpoint directory or raise its error
        (:class:`~shardkit.checkpoint.CheckpointError` when the save failed on any rank)."""
        self._thread.join()
        _pending.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


def wait_for_pending_saves() -> list:
    """Wait for every asynchronous save of this process still under way, oldest first; return
    their checkpoint directories. Raises the first failed save's error once all have ended
    (:class:`~shardkit.checkpoint.CheckpointError` when a save failed on any rank).

    Call it on every rank while the process group still exists (each save's commit is a
    collective); ``shardkit.distributed.destroy()`` does."""
    first_error, paths = None, []
    for save in sorted(_pending, key=lambda save: save._order):
        try:
            paths.append(save.wait())
        except Exception as e:  # the later saves still finish before it is raised
            first_error = first_error or e
    if first_error is not None:
        raise first_error
    return paths


def _wait_all_at_exit() -> None:
    """A process that ends normally first finishes its background saves. A failure can only be
    reported here (the exit status is the script's own), on stderr."""
    for save in sorted(_pending, key=lambda save: save._order):
        try:
            save.wait()
        except Exception as e:
            hint = "" if distributed.is_initialized() else (
                " (the process group was destroyed while the save was being committed: end "
                "the script with shardkit.distributed.destroy() or torch.distributed."
                "destroy_process_group(), or call shardkit.checkpoint.async_save."
                "wait_for_pending_saves() before a destroy_process_group imported by name)")
            print(f"[shardkit] asynchronous checkpoint save to {save.path} failed: {e}{hint}",
                  file=sys.stderr, flush=True)


atexit.register(_wait_all_at_exit)
