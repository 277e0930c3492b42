"""Fail fast, naming the rank, when a peer process dies.

A rank that is SIGKILLed (OOM killer, node reboot) leaves its peers either inside a collective
(gloo then fails at once with "Connection closed by peer", which does not say which rank) or
waiting for a collective the dead rank will never issue (which, by default, would block until
the process-group timeout). :func:`watch_peers` starts a heartbeat watchdog that turns both into
one clear failure: every survivor prints
``shardkit: rank R of N is lost: no heartbeat for T s ...`` and exits with status
:data:`PEER_LOST_EXIT_CODE` within about ``timeout_s`` of the death.

How it works (Note: a watchdog thread, not a short process-group timeout, so that a slow but
healthy collective — a large all-gather on a loaded machine — is never mistaken for a death):

- Each rank runs a daemon thread that, every ``timeout_s / 8`` seconds, increments a counter
  under ``shardkit/heartbeat/<attempt>/<rank>`` in the rendezvous store of the default
  process group, under the group's key prefixes (its own client connection to that TCP store,
  whether ``env://``, torchrun, ``tcp://host:port`` or ``store=`` made it; any other store
  but a file store is used as it is, shared with the group;
  ``<attempt>`` is torchrun's restart count, so a restarted job never reads its predecessor's
  beats) and reads every peer's counter.
- A ``FileStore`` (``file://``) appends every write to its file and never compacts it, so
  beats there would grow the file without bound (about 50 bytes a beat a rank). Over a file
  store each rank beats instead in a file of its own, rewritten in place, in a folder beside
  the store's file (``<store file>.shardkit-heartbeat-<token>``, the token agreed once through
  the store under the group's prefixes): ``N + 1`` small files whatever the run's length. The
  last rank to finish removes the folder (a rank that was killed leaves it, as it leaves the
  store's own file).
- A peer whose counter has not moved for ``timeout_s`` (measured on this rank's own clock; no
  clock agreement needed) is lost. The rank whose process serves a TCP store (found in
  ``/proc``: it holds the server's end of the watchdog's own new connection, which a process
  forked from the server, holding only its listening socket, does not; rank 0 under
  ``env://``, whichever rank ``store=`` made the server, none for torchrun's agent store or a
  server outside the job) says so in the store, so that when the store stops answering,
  that rank is lost (a store no rank serves: the rendezvous is lost). Until every peer's
  first beat has been read (and where ``/proc`` does not say), rank 0 is taken for the host
  outside torchrun's agent store.
- On a loss the thread prints the message and calls ``os._exit(PEER_LOST_EXIT_CODE)``: the main
  thread may be blocked inside a C++ collective where no Python exception can reach it. An
  uncaught exception in the main thread (``sys.excepthook``) first waits up to ``timeout_s`` for
  the watchdog's verdict when it looks like a communication failure, so the gloo error is
  reported as the lost rank; any other exception is reported at once, as usual. When that
  failure is the backend's own (gloo/NCCL/c10d, or shardkit's ``CollectiveError``) and every
  other peer finished (marked itself done) within ``timeout_s`` before it, the finished peers
  are named at once: the ranks ran different numbers of steps or collectives. With no verdict
  at all (a peer stalled past the process-group timeout: it still beats), the rank says so,
  naming the peers that had not reached the collective (each beat carries how many
  collectives its rank has issued on the default group; a peer still watched whose count is
  below the number of this rank's oldest unfinished collective (its last, or an earlier
  asynchronous one still in flight) is the stalled one), and leaves a "gave up" mark, not a
  failure: a peer still working (a long save with no collectives) is not stopped, and names
  this rank when its own next collective fails.
- A rank that finishes marks itself done (at exit, or :meth:`PeerWatchdog.stop`); peers stop
  watching it. The store's host (rank 0 outside torchrun's agent store) then waits, at most two
  beats, for its peers to read that before its process (and the store) ends; a peer whose store
  host finished stops watching quietly instead of taking the vanished store for a death. A
  rank stopping on an uncaught exception that is not a communication error marks itself
  failed, with the exception's type and message, and its peers declare it lost at their next
  beat (within ``timeout_s / 8``).

Cost: one thread per rank; per beat, one small write and ``N - 1`` reads on the store (about
``8N`` store requests per rank per ``timeout_s``; rank 0 or torchrun's agent serves them). No
collective, no tensor traffic.

Default timeout: ``SHARDKIT_PEER_TIMEOUT`` seconds when set, else :data:`DEFAULT_TIMEOUT_S`
(60 s), far below torch's 30-minute process-group default. ``shardkit.initialize`` starts the
watchdog (``peer_timeout_s``; 0 turns it off); wrapper users call :func:`watch_peers` once after
``init_distributed``.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import secrets
import shutil
import sys
import threading
import time
import urllib.parse
from typing import Callable, NamedTuple, Optional

import torch.distributed as dist

from shardkit.distributed import (collectives_issued, oldest_collective_unfinished,
                                  per_attempt_store_key)

__all__ = ["watch_peers", "stop_watching", "PeerWatchdog", "PEER_LOST_EXIT_CODE",
           "DEFAULT_TIMEOUT_S", "current_watchdog"]

PEER_LOST_EXIT_CODE = 75  # EX_TEMPFAIL: the job may succeed when restarted
DEFAULT_TIMEOUT_S = 60.0
_DONE = b"done"
_FAILED = b"failed|"  # followed by the exception's type and message
# a rank whose collective failed with no peer lost: peers note it (no verdict: they may be busy
# with legitimate local work) and name it when their own next collective fails
_GAVE_UP = b"gave-up|"
_BACKEND_WORDS = ("gloo", "nccl", "c10d", "processgroup")
_COMM_ERROR_WORDS = ("connection", "gloo", "nccl", "closed", "reset", "timed out", "timeout",
                     "broken pipe", "peer", "socket", "store", "exited before", "shared-memory")

_watchdog: Optional["PeerWatchdog"] = None
_lock = threading.Lock()


def _default_timeout() -> float:
    value = os.environ.get("SHARDKIT_PEER_TIMEOUT")
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"SHARDKIT_PEER_TIMEOUT={value!r}: expected a finite number of seconds "
                         f">= 0 (0 turns the watchdog off)")
    return seconds


class PeerWatchdog:
    """The heartbeat thread of this rank (see the module docstring). Build it with
    :func:`watch_peers`.

    Attributes:
        timeout_s: seconds without a peer heartbeat before the peer is declared lost.
        lost: ``(rank, message)`` once a peer is lost, else ``None``.
    """

    def __init__(self, timeout_s: float, on_lost: Optional[Callable[[int, str], None]] = None):
        self.timeout_s = timeout_s
        self.interval_s = max(timeout_s / 8.0, 0.05)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.lost: Optional[tuple] = None
        # peers that marked themselves done -> when this thread read it (time.monotonic())
        self.finished: dict = {}
        # peers whose collective failed with no peer lost -> their error (see explain_...)
        self.gave_up: dict = {}
        self._gave_up_read_at: dict = {}  # the same peers -> when this thread read it
        # peer -> collectives it had issued on the default group at its last beat read
        self.peer_collectives: dict = {}
        self._on_lost = on_lost or _exit_naming_the_rank
        self._verdict = threading.Event()
        self._stopped = threading.Event()
        self._world = dist.group.WORLD  # the default group it watches for
        self._prefix = per_attempt_store_key("shardkit/heartbeat") + "/"
        self._store, host = _connect_to_rendezvous(timeout_s, self._prefix)
        # Note: the host's claim is written before its first beat, so a peer that has read
        # every rank's first beat knows whether a rank claimed the store (see _learn_host)
        self._store_host_rank = host.guess
        self._host_known = host.serves is True or host is _NO_HOST
        if host.serves:
            self._store_host_rank = self.rank
            self._store.set(self._host_key, str(self.rank))
        elif host.serves is False and host.guess == self.rank:
            self._store_host_rank = None  # this process serves no store
        self._can_learn_host = host.serves is not None
        self._beat = 0
        self._store.set(self._key(self.rank), self._beat_value())
        self._thread = threading.Thread(target=self._run, name="shardkit-peer-watchdog",
                                        daemon=True)
        self._thread.start()

    def _beat_value(self) -> str:
        """A beat: its number, then how many collectives this rank has issued on the default
        group (what lets a peer whose collective timed out name the ranks that did not
        reach it)."""
        return f"{self._beat} {collectives_issued()}"

    def _key(self, rank: int) -> str:
        return f"{self._prefix}{rank}"

    @property
    def _verdict_key(self) -> str:
        return f"{self._prefix}lost"

    @property
    def _host_key(self) -> str:
        return f"{self._prefix}host"

    def _learn_host(self, seen: dict) -> None:
        """Once every peer's first beat has been read: the rank that claimed the store
        (see the module docstring), or none."""
        if self._store.check([self._host_key]):
            self._store_host_rank = int(self._store.get(self._host_key))
            self._host_known = True
        elif self._can_learn_host and all(value is not None for value, _ in seen.values()):
            # (a peer no longer in ``seen`` finished, after its claim, if any, was written)
            self._store_host_rank = None  # a server outside the job: it outlives the ranks
            self._host_known = True

    # -- the thread
    def _run(self) -> None:
        started = time.monotonic()
        seen = {r: (None, started) for r in range(self.world_size) if r != self.rank}
        while not self._stopped.wait(self.interval_s):
            if self.group_gone():
                self._retire()
                return
            try:
                self._beat += 1
                self._store.set(self._key(self.rank), self._beat_value())
                if self._store.check([self._verdict_key]):  # another rank saw it first
                    rank, _, why = self._store.get(self._verdict_key).decode().partition("|")
                    self._declare(int(rank), why, publish=False)
                    return
                now = time.monotonic()
                silent = []
                for r in list(seen):
                    value = self._store.get(self._key(r)) if self._store.check([self._key(r)]) \
                        else None
                    if value == _DONE:
                        del seen[r]
                        self.finished[r] = now
                    elif value is not None and value.startswith(_GAVE_UP):
                        del seen[r]  # it is leaving; not a verdict (see explain_...)
                        # (its time first: explain_... reads these two from another thread)
                        self._gave_up_read_at[r] = now
                        self.gave_up[r] = value[len(_GAVE_UP):].decode(errors="replace")
                    elif value is not None and value.startswith(_FAILED):
                        self._declare(r, f"it stopped on an uncaught "
                                         f"{value[len(_FAILED):].decode(errors='replace')}")
                        return
                    elif value != seen[r][0]:
                        seen[r] = (value, now)
                        self._note_collectives(r, value)
                    elif now - seen[r][1] > self.timeout_s:
                        silent.append(r)
                if silent:
                    self._declare_silent(silent, seen, now)
                    return
                if not self._host_known:
                    self._learn_host(seen)
            except Exception as e:  # the store itself is gone
                if self._stopped.wait(self.interval_s) or self.group_gone():
                    self._retire()
                    return  # a clean shutdown, or a destroy_process_group, raced with this beat
                who = self._store_host_rank
                if who is not None and who != self.rank and who not in seen:
                    # Note: the host finished (it marked itself done, and waited for this rank
                    # to read that, see _linger_as_host); its store ends with its process.
                    # Nothing is left to watch, and this rank may still have local work to do.
                    self._retire()
                    return
                if who is None or who == self.rank:
                    self._declare(None, f"the rendezvous store stopped answering ({e})")
                else:
                    self._declare(who, f"the rendezvous store it hosts stopped answering "
                                       f"({type(e).__name__})")
                return

    def _note_collectives(self, rank: int, beat: Optional[bytes]) -> None:
        fields = beat.split() if beat is not None else []
        if len(fields) == 2 and fields[1].isdigit():
            self.peer_collectives[rank] = int(fields[1])

    def _ranks_behind(self) -> list:
        """The peers still watched (not finished, not gone) that, at their last beat read, had
        issued fewer collectives on the default group than the number of this rank's oldest
        unfinished one: they had not reached the collective that failed here, which is that
        one or a later one (an asynchronous prefetch issued after it is no evidence)."""
        oldest = oldest_collective_unfinished()
        gone = set(self.finished) | set(self.gave_up)
        return sorted(r for r, issued in list(self.peer_collectives.items())
                      if issued < oldest and r not in gone)

    @staticmethod
    def _own_count() -> str:
        """This rank's count of collectives on the default group, with the number of its
        oldest unfinished one where that is an earlier one (asynchronous work in flight)."""
        issued, oldest = collectives_issued(), oldest_collective_unfinished()
        return str(issued) if oldest == issued else \
            f"{issued}, the oldest still unfinished here being number {oldest}"

    def _declare_silent(self, silent: list, seen: dict, now: float) -> None:
        # Note: when a node goes, its launcher stops that node's other ranks too, and they all
        # fall silent within one beat; the one silent longest is named and the others listed,
        # since beats (timeout_s / 8 apart) cannot order deaths closer than that.
        first = min(silent, key=lambda r: seen[r][1])
        others = [r for r in silent if r != first]
        also = f"; also silent: rank(s) {others}" if others else ""
        self._declare(first, f"no heartbeat for {now - seen[first][1]:.1f} s "
                             f"(timeout {self.timeout_s:g} s){also}")

    def group_gone(self) -> bool:
        """Whether the default process group it was started in has been destroyed (and
        perhaps replaced by a new one): its store, and the peers' heartbeats, are gone."""
        return self._world is None or dist.group.WORLD is not self._world

    def _retire(self) -> None:
        # Note: the peers' heartbeats lived in the destroyed group's store; watching on would
        # take its end for a lost rank and stop a healthy job. watch_peers() after a new
        # init_distributed() starts a watchdog for the new group.
        destroyed = self._world is not None and dist.group.WORLD is not self._world
        self._stopped.set()
        self._world = None
        if destroyed and isinstance(self._store, _HeartbeatFiles):
            # Note: the files outlive the group's store, and a stopped watchdog is not
            # stopped again at exit: mark this rank done now, so that the last rank to leave
            # removes the folder (else every init/destroy cycle in one process left one)
            self._leave_heartbeat_files()

    def _declare(self, rank: Optional[int], why: str, publish: bool = True) -> None:
        # Note: the first verdict is published in the store so that every survivor names the
        # same rank; the store's host waits two beats before leaving, otherwise the others
        # would see the store vanish and blame the host instead of the rank that died.
        if publish and rank is not None:
            try:
                self._store.compare_set(self._verdict_key, "", f"{rank}|{why}")
            except Exception:
                pass
        if self._store_host_rank == self.rank:
            time.sleep(2 * self.interval_s)
        subject = f"rank {rank} of {self.world_size} is lost" if rank is not None \
            else "the job's rendezvous is lost"
        message = (f"shardkit: {subject}: {why}; rank {self.rank} stops (exit status "
                   f"{PEER_LOST_EXIT_CODE}). Restart the job (torchrun --max-restarts) and "
                   f"resume from the latest checkpoint.")
        self.lost = (rank, message)
        self._verdict.set()
        self._on_lost(rank, message)

    # -- API
    def wait_for_verdict(self, timeout_s: Optional[float] = None) -> Optional[tuple]:
        """Block until a peer is declared lost or ``timeout_s`` passes; return :attr:`lost`.

        The default covers the worst case after a death: the timeout, one beat before the
        last change is read, one beat of the loop, and a margin for a loaded machine."""
        wait = self.timeout_s + 4 * self.interval_s + 1.0 if timeout_s is None else timeout_s
        if self._thread.is_alive() or self._verdict.is_set():
            self._verdict.wait(wait)
        return self.lost

    def explain_communication_error(self, error: BaseException) -> None:
        """What the uncaught-exception hook does with a communication ``error`` of this rank.

        Waits (as :meth:`wait_for_verdict`) for a lost peer to be named, which ends the process.
        A peer that finished instead (it marked itself done, e.g. its script ended after fewer
        steps than this rank's) cannot be lost; it is named at once, since this rank was still
        in a collective with it. With neither, no peer died: a peer is stalled past the
        process-group timeout, or the ranks issued different collectives. Either way this rank
        then marks itself failed with ``error`` (its peers stop within a beat, naming it,
        instead of taking it for finished or waiting in their next collective) and returns; the
        caller reports ``error`` as usual."""
        start = time.monotonic()
        deadline = start + self.timeout_s + 4 * self.interval_s + 1.0

        def just_finished():
            # Note: a peer that finished long before (a rank outside the sub-group whose
            # collective broke) is not the cause; one that finished within the timeout is.
            return sorted(r for r, t in list(self.finished.items())
                          if t >= start - self.timeout_s)

        def gave_up_first():
            # Note: a peer that gave up before this rank's collective failed left this rank
            # behind (it was busy past the timeout). One read well after that failed in the
            # same wait: both timed out at about the same time, and neither is the cause.
            # A give-up that ended this rank's collective is read within a beat of it; one
            # from the same wait comes about a whole wait (timeout + beats) later.
            late = start + (deadline - start) / 2
            return sorted((r, why) for r, why in list(self.gave_up.items())
                          if self._gave_up_read_at.get(r, math.inf) <= late)

        def answered():
            # Note: a finished peer is named at once only when no peer that could still die
            # is left; else a peer that finished normally (outside the failed sub-group) would
            # be blamed for a death the watchdog is about to name.
            if gave_up_first():
                return True
            done = set(self.finished)
            return bool(just_finished()) and len(done) == self.world_size - 1

        while not self._verdict.is_set() and not answered() \
                and time.monotonic() < deadline and self._thread.is_alive():
            self._verdict.wait(min(0.05, self.interval_s))
        if self._verdict.is_set():
            return  # the default on_lost already ended the process; a custom one was run
        finished = just_finished()
        behind = [] if finished else self._ranks_behind()
        causes = gave_up_first()
        if causes:
            r, why = causes[0]
            note = (f"shardkit: rank {r} of {self.world_size} stopped after its own collective "
                    f"failed with no peer lost ({why}): this rank was still working (a long "
                    f"save, eval, or a stall) past the process-group timeout.")
            _say(note)
            return
        if not finished and time.monotonic() < deadline:
            return  # not watching (stopped, or its group destroyed): nothing is known
        if finished:
            names = ", ".join(map(str, finished))
            note = (f"shardkit: rank(s) {names} of {self.world_size} finished (marked done: "
                    f"the script ended or called stop_watching()) while rank {self.rank} was "
                    f"still in a collective with them: the ranks ran different numbers of steps "
                    f"or collectives (a loop that ends early on some ranks?). "
                    f"SHARDKIT_DEBUG_COLLECTIVES=1 names each rank's collectives.")
        elif behind:
            note = (f"shardkit: rank {self.rank} of {self.world_size}: a collective failed and no "
                    f"peer was lost within {self.timeout_s:g} s; rank(s) "
                    f"{', '.join(map(str, behind))} still beat but had not reached it (they had "
                    f"issued {[self.peer_collectives[r] for r in behind]} collectives on "
                    f"the default group, this rank {self._own_count()}): stalled longer than "
                    f"the process-group timeout (init_distributed(timeout_s=...)), or skipping "
                    f"a collective the others issue (SHARDKIT_DEBUG_COLLECTIVES=1 names each "
                    f"rank's collectives). Rank {self.rank} stops; its peers are told when they "
                    f"next communicate.")
        elif self.gave_up:
            names = ", ".join(map(str, sorted(self.gave_up)))
            note = (f"shardkit: rank {self.rank} of {self.world_size}: a collective failed and no "
                    f"peer was lost within {self.timeout_s:g} s; rank(s) {names} gave up on "
                    f"their own failed collective at about the same time: the ranks waited in "
                    f"collectives that do not match (SHARDKIT_DEBUG_COLLECTIVES=1 names each "
                    f"rank's collectives), or a rank outside them is stalled longer than the "
                    f"process-group timeout (init_distributed(timeout_s=...)). Rank {self.rank} "
                    f"stops; its peers are told when they next communicate.")
        else:
            note = (f"shardkit: rank {self.rank} of {self.world_size}: a collective failed and no "
                    f"peer was lost within {self.timeout_s:g} s (every peer still beats): a peer "
                    f"is stalled longer than the process-group timeout (init_distributed("
                    f"timeout_s=...)), or the ranks issued different collectives "
                    f"(SHARDKIT_DEBUG_COLLECTIVES=1 names each rank's collectives). "
                    f"Rank {self.rank} stops; its peers are told when they next communicate.")
        _say(note)
        if finished:
            self.fail(error)
        else:
            # Note: not fail(): a peer may be doing legitimate local work (a rank-0 save) longer
            # than this rank's process-group timeout; a verdict would os._exit it mid-write.
            text = f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
            self._stop_with(_GAVE_UP.decode() + text)

    def stop(self) -> None:
        """Stop beating and tell the peers this rank finished (it is no longer watched)."""
        self._stop_with(_DONE.decode())

    def fail(self, error: BaseException) -> None:
        """Stop beating and tell the peers this rank is stopping on ``error`` (an uncaught
        exception): they declare it lost at their next beat instead of waiting for a timeout
        or taking it for finished."""
        text = f"{type(error).__name__}: {error}".replace("\n", " ")[:300]
        self._stop_with(_FAILED.decode() + text)

    def _stop_with(self, value: str) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=5 * self.interval_s + 1)
        try:
            self._store.set(self._key(self.rank), value)
            if self._store_host_rank == self.rank:
                self._linger_as_host()
            if isinstance(self._store, _HeartbeatFiles):
                self._store.remove_once_all_stopped(self._peer_keys())
        except Exception:
            pass

    def _peer_keys(self) -> list:
        return [self._key(r) for r in range(self.world_size) if r != self.rank]

    def _leave_heartbeat_files(self) -> None:
        """Mark this rank done in its heartbeat file, then remove the folder if every peer
        has stopped too. Never raises: the folder may already be gone."""
        try:
            self._store.set(self._key(self.rank), _DONE.decode())
            self._store.remove_once_all_stopped(self._peer_keys())
        except Exception:
            pass

    def _linger_as_host(self) -> None:
        """The rank hosting the store (outside torchrun's agent store: rank 0) stays until every
        peer has read its last word or stopped too, at most two beats: its store ends with its
        process, and a peer that had not yet read "done" (or "failed") would take the vanished
        store for this rank's death and stop a healthy job. Costs: nothing when the peers stop
        together with it; else up to two beats (``timeout_s / 4``) at exit."""
        deadline = time.monotonic() + 2 * self.interval_s + 0.5
        peers = [self._key(r) for r in range(self.world_size) if r != self.rank]
        while time.monotonic() < deadline:
            if self._store.check([self._verdict_key]):
                return  # a peer already judged; it is stopping
            values = [self._store.get(k) if self._store.check([k]) else None for k in peers]
            if all(v is not None and (v == _DONE or v.startswith((_FAILED, _GAVE_UP)))
                   for v in values):
                return
            time.sleep(min(0.05, self.interval_s))


class _StoreHost(NamedTuple):
    """Who serves the watchdog's store, as far as this rank can tell at start-up."""

    serves: Optional[bool]  # this process serves it (None: /proc does not say)
    guess: Optional[int]  # the host rank assumed until the peers' claims are read


_NO_HOST = _StoreHost(serves=False, guess=None)  # not a TCP store: no rank serves it


def _connect_to_rendezvous(timeout_s: float, prefix: str) -> tuple:
    """``(store, _StoreHost)``: the watchdog's own client of the TCP store the default group
    met on, wherever its address came from (``env://``, torchrun, ``tcp://host:port``, a
    TCPStore passed as ``store=``), under the same key prefixes as the group, and whether this
    process serves it. A file store gets heartbeat files beside its file (see the module
    docstring; ``prefix`` names the agreement on their folder). Any other store (a HashStore
    passed to ``init_process_group``) is used as it is, shared with the group; no rank hosts
    either."""
    timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
    store = _default_store()
    inner = store
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        host, port = inner.host, inner.port
        if hasattr(store, "clone"):
            # Note: a clone is a connection of its own (a blocking wait of the group's never
            # stalls a beat) under the group's key prefixes: jobs that share one server under
            # PrefixStores must not read each other's heartbeats
            client, serves = _connect_finding_server(port, store.clone)
            client.set_timeout(timeout)
            return client, _store_host(host, port, serves)
    elif isinstance(inner, dist.FileStore):
        return _HeartbeatFiles.beside(inner.path, store, prefix, dist.get_rank()), _NO_HOST
    elif store is not None:
        return store, _NO_HOST
    else:  # no default store to read (a torch without the accessor): torchrun's variables
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if host is None or port is None:
            raise RuntimeError("watch_peers: cannot find the rendezvous store of the default "
                               "process group (set MASTER_ADDR and MASTER_PORT)")
        port = int(port)
    client, serves = _connect_finding_server(port, lambda: dist.TCPStore(
        host, port, is_master=False, timeout=timeout, wait_for_workers=False))
    return client, _store_host(host, port, serves)


def _store_host(host: str, port: int, serves: Optional[bool]) -> _StoreHost:
    """Who serves the TCP store at ``host:port``: this process or not (``serves``), and the
    host rank assumed until the peers' claims are read: none for torchrun's agent store, else
    rank 0."""
    return _StoreHost(serves=serves, guess=None if _served_by_torchrun_agent(host, port) else 0)


class _TcpSocket(NamedTuple):
    """One row of ``/proc/net/tcp{,6}``."""

    local_port: int
    remote_port: int
    established: bool
    inode: str


def _connect_finding_server(port: int, connect: Callable) -> tuple:
    """``(client, serves)``: ``connect()``'s new client of the TCP store on ``port``, and
    whether this process serves that store (``None`` where ``/proc`` does not say).

    Note: holding the store's listening socket is not enough: a process forked from the
    server (a launcher that made the store, then forked the ranks) inherits that socket, but
    not the server's thread, and would claim to host a store that outlives it. The server end
    of a connection made now, after any fork, lives only in the process that accepts it: this
    process serves the store when it holds both ends of its new client's connection."""
    before = _own_client_ports(port)
    client = connect()
    client.check(["shardkit/heartbeat/ping"])  # a round trip: the server has accepted it
    after = _own_client_ports(port)
    if before is None or after is None:
        return client, None
    new_ports = after - before
    if not new_ports:
        return client, None  # the connection is not in this process's tables (a proxy?)
    sockets = _own_tcp_sockets()
    serves = any(s.established and s.local_port == port and s.remote_port in new_ports
                 for s in sockets or ())
    return client, serves if sockets is not None else None


def _own_client_ports(port: int) -> Optional[set]:
    """The local ports of this process's connections to TCP ``port``."""
    sockets = _own_tcp_sockets()
    if sockets is None:
        return None
    return {s.local_port for s in sockets if s.established and s.remote_port == port}


def _own_tcp_sockets() -> Optional[list]:
    """This process's TCP sockets (``/proc/net/tcp{,6}`` rows whose inode is one of its file
    descriptors); ``None`` where ``/proc`` does not say (another OS)."""
    try:
        descriptors = os.listdir("/proc/self/fd")
    except OSError:
        return None
    inodes = set()
    for fd in descriptors:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listed
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    rows, tables = [], 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for line in lines:
            fields = line.split()
            # "HEX_IP:HEX_PORT" local then remote, state 01 is ESTABLISHED, the inode is field 9
            if len(fields) > 9 and fields[9] in inodes:
                rows.append(_TcpSocket(int(fields[1].rsplit(":", 1)[1], 16),
                                       int(fields[2].rsplit(":", 1)[1], 16),
                                       fields[3] == "01", fields[9]))
    return rows if tables else None


class _HeartbeatFiles:
    """The few store calls the watchdog makes (``set``, ``get``, ``check``, ``compare_set``),
    each key a small file in one folder, rewritten whole (a write to a temporary file, then a
    rename), so that its size stays bounded however many beats a run takes; for a file store,
    whose own file grows with every write (see the module docstring)."""

    def __init__(self, folder: str):
        self.folder = folder
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as err:
            raise PermissionError(
                f"watch_peers: cannot create the heartbeat folder {folder!r} beside the "
                f"file store's file ({type(err).__name__}: {err.strerror or err}); the watchdog "
                f"of a file:// process group keeps its beats there. Put the store's file in a "
                f"folder every rank can write to, or turn the watchdog off (watch_peers(0), "
                f"SHARDKIT_PEER_TIMEOUT=0 or peer_timeout_s=0).") from err

    @classmethod
    def beside(cls, path: str, store, prefix: str,
               rank: Optional[int] = None) -> "_HeartbeatFiles":
        """The folder of the group's heartbeats next to the file store at ``path``: its token
        is agreed once through ``store`` (one write to the store's file per group and
        attempt), under the group's prefixes, so that jobs sharing a file under PrefixStores
        keep apart. ``rank``: this rank of the default group (its beat key is
        ``{prefix}{rank}``).

        Note: a job killed mid-run leaves its store's file behind, and a new job started on
        the same path reads the old job's token. A token is an earlier job's when its folder
        already holds this rank's beat (only this rank writes it, and it has not beaten yet)
        or a published verdict; it is then replaced, so that the new job beats in a folder
        of its own and never reads the dead job's verdict, "done" or "failed" marks (a folder
        this process beat in before, a watchdog restarted after ``stop_watching()``, is kept:
        its peers still beat there). No clock is compared: a rank that starts late (a lazily
        connected process group) or on a host whose clock runs ahead (a store on a shared
        file system) still joins the folder its peers beat in."""
        key = f"{prefix}files"
        token = store.compare_set(key, "", _new_token()).decode()
        for _ in range(8):  # a rank of this job replaces it once; the others read that
            folder = f"{path}.shardkit-heartbeat-{token}"
            if folder in _FOLDERS_BEATEN_HERE or \
                    not _left_by_an_earlier_job(folder, prefix, rank):
                break
            token = store.compare_set(key, token, _new_token()).decode()
        folder = f"{path}.shardkit-heartbeat-{token}"
        _FOLDERS_BEATEN_HERE.add(folder)
        return cls(folder)

    def _path(self, key: str) -> str:
        return _key_file(self.folder, key)

    def set(self, key: str, value: str) -> None:
        temporary = self._path(key) + f".{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            f.write(value.encode() if isinstance(value, str) else value)
        os.replace(temporary, self._path(key))

    def get(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def check(self, keys: list) -> bool:
        return all(os.path.exists(self._path(key)) for key in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Write ``desired`` unless the key exists (``expected`` must be ``""``: the only use);
        return the key's value. A hard link is created atomically or not at all."""
        temporary = self._path(key) + f".{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            f.write(desired.encode())
        try:
            os.link(temporary, self._path(key))
        except FileExistsError:
            pass
        finally:
            os.remove(temporary)
        return self.get(key)

    def remove_once_all_stopped(self, peer_keys: list) -> None:
        """Remove the folder when every peer has stopped too (it marked itself done, failed or
        gave up, after its watchdog thread ended): this rank finished last."""
        for key in peer_keys:
            value = self.get(key) if self.check([key]) else None
            if value is None or not (value == _DONE or value.startswith((_FAILED, _GAVE_UP))):
                return
        shutil.rmtree(self.folder, ignore_errors=True)


_FOLDERS_BEATEN_HERE: set = set()  # heartbeat folders this process's watchdogs chose


def _new_token() -> str:
    """A heartbeat folder's token: when it was made (wall clock, for a person reading the
    folder's name) and random bytes."""
    return f"{time.time():.3f}-{secrets.token_hex(6)}"


def _left_by_an_earlier_job(folder: str, prefix: str, rank: Optional[int]) -> bool:
    """Whether the heartbeat ``folder`` already holds this ``rank``'s beat or the group's
    published verdict (``{prefix}lost``): an earlier process beat there, so a job that
    was killed or stopped (see :meth:`_HeartbeatFiles.beside`)."""
    keys = [f"{prefix}lost"] + ([] if rank is None else [f"{prefix}{rank}"])
    return any(os.path.exists(_key_file(folder, k)) for k in keys)


def _key_file(folder: str, key: str) -> str:
    """The file of the heartbeat store's ``key`` in ``folder``."""
    return os.path.join(folder, urllib.parse.quote(key, safe=""))


def _served_by_torchrun_agent(host: str, port: int) -> bool:
    """Whether the TCP store at ``host:port`` is torchrun's agent store (which outlives every
    rank), not one a rank hosts: under ``TORCHELASTIC_USE_AGENT_STORE`` the agent serves
    ``MASTER_ADDR:MASTER_PORT`` only; a store passed to ``init_process_group(store=...)`` at
    another address is hosted by rank 0 as anywhere else."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return False
    try:
        agent = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except (KeyError, ValueError):
        return False
    return (host, int(port)) == agent


def _default_store():
    """The store the default process group was made with, or ``None`` where torch does not
    say (a private accessor of torch's)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return _get_default_store()
    except Exception:  # noqa: BLE001 - missing or renamed in this torch: fall back to env
        return None


def _say(note: str) -> None:
    """Write ``note`` to stderr, never raising (stderr may be closed at exit)."""
    try:
        sys.stderr.write(note + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def _exit_naming_the_rank(rank: Optional[int], message: str) -> None:
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(PEER_LOST_EXIT_CODE)


def looks_like_communication_error(error: BaseException) -> bool:
    """True for the errors a dead peer causes (gloo/NCCL connection errors, timeouts).

    Never for :class:`~shardkit.collective_check.CollectiveMismatchError`: every rank raises it
    at once, with its own explanation, and its call sites (user paths such as
    ``/data/store/train.py``) must not read as a connection failure."""
    from shardkit.collective_check import CollectiveMismatchError
    if isinstance(error, CollectiveMismatchError):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return isinstance(error, (RuntimeError, OSError, ConnectionError)) and \
        any(word in text for word in _COMM_ERROR_WORDS)


def _excepthook(previous):
    def hook(exc_type, exc, tb):
        watchdog = _watchdog
        if watchdog is not None and exc is not None \
                and not getattr(exc, "_shardkit_explained", False):
            try:
                exc._shardkit_explained = True  # a hook wrapped twice explains once
            except Exception:
                pass
            if _chain_has_comm_error(exc, strict=True):
                # exits the process if a peer is lost; else names a finished peer, or says
                # that none died, and tells the peers this rank stops
                watchdog.explain_communication_error(exc)
            elif _chain_has_comm_error(exc):  # only its words look like one: no diagnosis
                watchdog.wait_for_verdict()  # exits the process if a peer is lost
                watchdog.fail(exc)
            else:  # this rank's own failure: the peers name it at once
                watchdog.fail(exc)
        previous(exc_type, exc, tb)
    return hook


def _is_backend_error(error: BaseException) -> bool:
    """A collective's own failure (torch's DistError, shardkit's CollectiveError, a gloo/NCCL
    RuntimeError), not a user error whose text happens to hold "store" or "peer"."""
    from shardkit.distributed import CollectiveError
    if isinstance(error, (CollectiveError, getattr(dist, "DistError", ()))):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in _BACKEND_WORDS)


def _chain_has_comm_error(exc: BaseException, strict: bool = False) -> bool:
    from shardkit.collective_check import CollectiveMismatchError
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, CollectiveMismatchError):
            return False  # explained on every rank; raised from the check's own mismatch
        if _is_backend_error(exc) if strict else looks_like_communication_error(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def watch_peers(timeout_s: Optional[float] = None,
                on_lost: Optional[Callable[[int, str], None]] = None) -> Optional[PeerWatchdog]:
    """Start this rank's peer watchdog (idempotent: a running one is returned as is).

    Args:
        timeout_s: seconds without a peer's heartbeat before it is declared lost (default
            ``SHARDKIT_PEER_TIMEOUT`` or 60); ``0`` starts nothing and returns ``None``.
        on_lost: ``callable(rank, message)`` run on the watchdog thread instead of the default
            (print the message, ``os._exit(PEER_LOST_EXIT_CODE)``); ``rank`` is ``None`` when the
            store itself is lost and no rank can be named.

    Call it on every rank after the process group exists (no collective is issued, so ranks
    may call it at different times). The watchdog belongs to that default process group: once
    the group is destroyed it stops quietly at its next beat, and a call after a new
    ``init_distributed`` starts one for the new group. Costs: see the module docstring.
    """
    global _watchdog
    if isinstance(timeout_s, bool):  # float(True) would be a 1 s timeout
        raise TypeError(f"watch_peers(timeout_s={timeout_s!r}): expected a number of seconds")
    timeout_s = _default_timeout() if timeout_s is None else float(timeout_s)
    if not (timeout_s >= 0 and math.isfinite(timeout_s)):  # nan, inf: no clock could fire
        raise ValueError(f"watch_peers(timeout_s={timeout_s}): must be >= 0 and finite, in "
                         f"seconds (0 turns it off)")
    if timeout_s == 0:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("watch_peers: the process group is not initialised; call "
                           "shardkit.distributed.init_distributed() first")
    with _lock:
        if _watchdog is not None and not _watchdog._stopped.is_set() \
                and not _watchdog.group_gone():
            return _watchdog
        if dist.get_world_size() == 1:
            return None
        _watchdog = PeerWatchdog(timeout_s, on_lost)
        if not getattr(sys.excepthook, "_shardkit", False):
            sys.excepthook = _excepthook(sys.excepthook)
            sys.excepthook._shardkit = True
        atexit.register(stop_watching)
        return _watchdog


def current_watchdog() -> Optional[PeerWatchdog]:
    """The running watchdog of this process, or ``None``."""
    return _watchdog


def stop_watching() -> None:
    """Stop this rank's watchdog, if any, and mark the rank done for its peers."""
    global _watchdog
    with _lock:
        watchdog, _watchdog = _watchdog, None
    if watchdog is not None:
        watchdog.stop()
