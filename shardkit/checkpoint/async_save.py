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

Note: that wait gives each pending save its own bound: the checkpoint group's timeout (the
default group's, as ``init_process_group(timeout=...)`` set it; the longest the commit's own
collectives may block) plus a margin of 10% (at least 2 s), counted from when the save before
it ended (the saves commit one after the other, so one deadline shared by all would leave the
later ones nothing). The saves still running when it begins are named on stderr; those still
running at its end (a rank stuck writing its file, and the saves queued behind it, which can
then never start) are each named, with their tags, in the
:class:`~shardkit.checkpoint.CheckpointError` raised once the groups are destroyed, and the
process can then exit (the writers are daemon threads, no longer waited for).

Costs: memory, one CPU copy of this rank's share of the model and optimizer state until the
write ends; communication, that of a synchronous save, on the checkpoint group.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import sys
import threading
import time
import weakref
from typing import Callable, Optional

from shardkit import distributed

__all__ = ["AsyncSave", "checkpoint_group", "wait_for_pending_saves"]

_groups = distributed.GroupCache()  # "world" -> the gloo group of this world's saves
_pending: "weakref.WeakSet[AsyncSave]" = weakref.WeakSet()
_started = itertools.count()  # orders the pending saves by their start
# The writer thread of the save started last. Each save's thread first waits for the one
# started before it: their commits share one process group, and collectives issued from two
# threads at once would pair up in a different order on each rank (a mismatch or a hang).
_last_writer: Optional[threading.Thread] = None


def checkpoint_group():
    """The gloo group over every rank that background saves commit on (created on first use;
    a collective: every rank must reach the first asynchronous save)."""
    cached = _groups.current()
    if "world" not in cached:
        cached["world"] = distributed.new_group(range(distributed.get_world_size()),
                                                timeout_s=distributed.timeout_of(None),
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
            _wait_before_destroy()
        finally:
            destroy_process_group(group)

    destroy._waits_for_checkpoint_saves = True
    return destroy


# The wait of a destroy when the checkpoint group's timeout cannot be read (torch's default).
_DEFAULT_WAIT_S = 1800.0
_QUIET_WAIT_S = 3.0  # how long a destroy waits before it names the saves it waits for


def _wait_before_destroy() -> None:
    """:func:`wait_for_pending_saves` bounded by the checkpoint group's timeout, saying on
    stderr which saves it waits for (so a long wait is never silent). The bound has a margin
    over the timeout: a save waiting in one of the commit's collectives then ends with the
    group's timeout error first (destroying a group under a collective aborts the process);
    only a save stuck outside them (in its writer) is given up."""
    bound = _wait_bound()
    first_deadline = time.monotonic() + bound
    quiet_until = time.monotonic() + min(_QUIET_WAIT_S, bound)
    waited = [save for save in _in_start_order() if not save._given_up]
    for save in waited:  # a save about to end needs no word on stderr
        save._thread.join(max(0.0, quiet_until - time.monotonic()))
    running = [save for save in waited if not save.done()]
    if running:
        each = f", {bound:g} s for each after the one before it" if len(running) > 1 else ""
        print(f"[shardkit] destroy_process_group: waiting (at most {bound * len(running):g} s "
              f"in all{each}) for {'; '.join(save.describe() for save in running)} to finish "
              f"(their commits run on the checkpoint process group this call destroys)",
              file=sys.stderr, flush=True)
    _wait_each_bounded(_in_start_order(), bound, first_deadline)


def _wait_bound() -> float:
    """Seconds a destroy or the end of the process waits for the pending saves: the
    checkpoint group's timeout plus a margin (see :func:`_wait_before_destroy`)."""
    group = _groups.current().get("world")
    timeout = (distributed.timeout_of(group) if group is not None else None) or _DEFAULT_WAIT_S
    return timeout + max(2.0, 0.1 * timeout)


def _destroys_checkpoint_group(group) -> bool:
    """Whether torch's ``destroy_process_group(group)`` tears down the checkpoint group."""
    from torch.distributed import GroupMember
    return (group is None or group is GroupMember.WORLD
            or group is _groups.current().get("world"))


class AsyncSave:
    """A checkpoint being written by a background thread. The saves of one process (of two
    engines, say) are written and committed one after the other, in the order they started.

    Attributes:
        path: the checkpoint directory it will publish.
        tag: its tag (the last component of ``path``).
    """

    def __init__(self, path: str, write: Callable[[], str]):
        self.path = path
        self.tag = os.path.basename(os.path.normpath(path))
        self._error: Optional[BaseException] = None
        self._order = next(_started)
        self._started_at = time.monotonic()
        self._given_up = False  # a bounded wait ended before it did: no longer waited for
        global _last_writer
        self._thread = threading.Thread(target=self._run, args=(write, _last_writer),
                                        name="shardkit-async-checkpoint", daemon=True)
        _last_writer = self._thread
        _pending.add(self)
        self._thread.start()

    def _run(self, write, previous: Optional[threading.Thread]) -> None:
        if previous is not None:  # commits in start order, the same on every rank
            previous.join()
        try:
            write()
        except BaseException as e:  # re-raised by wait() on the caller's thread
            self._error = e

    def done(self) -> bool:
        """True once the background write has ended (successfully or not)."""
        return not self._thread.is_alive()

    def describe(self) -> str:
        """Which save this is, for messages: tag, directory, this rank, age."""
        rank = distributed.get_rank() if distributed.is_initialized() else "?"
        return (f"the asynchronous checkpoint save of tag {self.tag!r} into "
                f"{os.path.dirname(os.path.normpath(self.path))} (rank {rank}, started "
                f"{time.monotonic() - self._started_at:.0f} s ago)")

    def wait(self, timeout_s: Optional[float] = None) -> str:
        """Block until the write ends; return the checkpoint directory or raise its error
        (:class:`~shardkit.checkpoint.CheckpointError` when the save failed on any rank).
        With ``timeout_s``, a save still running after that many seconds raises a
        :class:`~shardkit.checkpoint.CheckpointError` naming it, and is no longer waited for
        at the end of the process."""
        return self._wait_until(None if timeout_s is None else time.monotonic() + timeout_s,
                                timeout_s)

    def _wait_until(self, deadline: Optional[float], bound: Optional[float]) -> str:
        """:meth:`wait` until the ``time.monotonic()`` ``deadline`` of a wait of ``bound``
        seconds (for its message)."""
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            from shardkit.checkpoint.sharded import CheckpointError
            self._given_up = True
            raise CheckpointError(
                f"{self.describe()} did not finish within a wait of {bound:g} s on this rank (a "
                f"rank stuck writing its file, or waiting for one that is); the process no "
                f"longer waits for it, not even at exit")
        _pending.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


def _in_start_order() -> list:
    return sorted(_pending, key=lambda save: save._order)


def wait_for_pending_saves(timeout_s: Optional[float] = None) -> list:
    """Wait for every asynchronous save of this process still under way, oldest first; return
    their checkpoint directories. Raises the first failed save's error once all have ended
    (:class:`~shardkit.checkpoint.CheckpointError` when a save failed on any rank).
    ``timeout_s`` bounds the whole wait: a save still running then is such an error, naming
    its tag and directory.

    Call it on every rank while the process group still exists (each save's commit is a
    collective); ``shardkit.distributed.destroy()`` does."""
    return _wait_for_saves_until(None if timeout_s is None else time.monotonic() + timeout_s,
                                 timeout_s)


def _wait_for_saves_until(deadline: Optional[float], bound: Optional[float]) -> list:
    """:func:`wait_for_pending_saves` until the ``time.monotonic()`` ``deadline`` of a wait
    of ``bound`` seconds (for the messages)."""
    outcome = _Outcome()
    for save in _in_start_order():
        outcome.wait_for(save, deadline, bound)
    return outcome.paths_or_raise("no bound" if bound is None else f"a wait of {bound:g} s in all")


def _wait_each_bounded(saves: list, bound: float, first_deadline: float) -> list:
    """Wait for ``saves`` (in start order), each for at most ``bound`` seconds after the one
    before it ended (the first until ``first_deadline``); a save queued behind one given up
    cannot start, and is given up at once. A save an earlier wait gave up is not waited for
    again (a destroy after a bounded wait that gave up: ``shardkit.distributed.destroy()``
    then torch's wrapped ``destroy_process_group()``). Raises as :class:`_Outcome` does."""
    outcome = _Outcome()
    behind_one_given_up_before = False
    for save in saves:
        if save._given_up:  # reported by the wait that gave it up; not waited for again
            behind_one_given_up_before = behind_one_given_up_before or not save.done()
            continue
        if outcome.given_up or behind_one_given_up_before:  # its writer waits for that one
            deadline = time.monotonic()
        elif not outcome.paths and outcome.first_error is None:
            deadline = first_deadline
        else:
            deadline = time.monotonic() + bound
        outcome.wait_for(save, deadline, bound)
    return outcome.paths_or_raise(f"{bound:g} s for each after the one before it ended")


class _Outcome:
    """What waiting for several saves came to: their directories, the saves given up (still
    running), the first failed save's error."""

    def __init__(self):
        self.paths: list = []
        self.given_up: list = []
        self.first_error: Optional[BaseException] = None

    def wait_for(self, save: "AsyncSave", deadline: Optional[float],
                 bound: Optional[float]) -> None:
        try:
            self.paths.append(save._wait_until(deadline, bound))
        except Exception as e:  # the later saves still finish before it is raised
            if save._given_up:
                self.given_up.append(save)
            else:
                self.first_error = self.first_error or e

    def paths_or_raise(self, how_long: str) -> list:
        """The directories; or a :class:`~shardkit.checkpoint.CheckpointError` naming every
        save given up, with its tag (after the first failed save's error, which it chains);
        or that error."""
        if self.given_up:
            from shardkit.checkpoint.sharded import CheckpointError
            failed = "" if self.first_error is None else (
                f"; an earlier save failed: {type(self.first_error).__name__}: "
                f"{self.first_error}")
            raise CheckpointError(
                f"{len(self.given_up)} asynchronous checkpoint save(s) did not finish within "
                f"the wait ({how_long}) on this rank (a rank stuck writing its file, or "
                f"waiting for one that is; a save queued behind it cannot start): "
                f"{'; '.join(save.describe() for save in self.given_up)}. The process no "
                f"longer waits for them, not even at exit{failed}") from self.first_error
        if self.first_error is not None:
            raise self.first_error
        return self.paths


def _wait_all_at_exit() -> None:
    """A process that ends normally first finishes its background saves. A failure can only be
    reported here (the exit status is the script's own), on stderr. Each save's wait is
    bounded as a destroy's is (:func:`_wait_each_bounded`): a writer stuck for good does not
    keep the process."""
    if all(save._given_up for save in _pending):  # given up: reported then
        return
    bound = _wait_bound()
    stuck = False
    for save in _in_start_order():
        if save._given_up:  # one given up by an earlier wait may still hold up the later ones
            stuck = stuck or not save.done()
            continue
        try:  # once one is stuck, those queued behind it cannot start
            save._wait_until(time.monotonic() + (0.0 if stuck else bound), bound)
        except Exception as e:
            stuck = stuck or save._given_up
            hint = "" if distributed.is_initialized() else (
                " (the process group was destroyed while the save was being committed: end "
                "the script with shardkit.distributed.destroy() or torch.distributed."
                "destroy_process_group(), or call shardkit.checkpoint.async_save."
                "wait_for_pending_saves() before a destroy_process_group imported by name)")
            print(f"[shardkit] asynchronous checkpoint save to {save.path} failed: {e}{hint}",
                  file=sys.stderr, flush=True)


atexit.register(_wait_all_at_exit)
