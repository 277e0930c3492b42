"""All-gather and reduce-scatter through host shared memory, for the ranks of one machine on CPU.

gloo moves bytes between processes of one machine through TCP loopback; on a CPU-bound training
run the kernel's copies and protocol work compete with the computation for the same cores
(FSDP's gathers measured ~1.5 ms per 4 MiB unit at world 2 here, against ~0.15 ms for copying
the same bytes in memory). A :class:`ShmRing` is a few *slots* of one ``/dev/shm`` buffer that
every rank of the group maps, with a control block of per-slot, per-rank generation counters:

- each collective takes the next generation ``g`` and slot ``g % S`` (every rank issues the
  collectives of a group in the same order, as it must for any collective);
- a rank writes its part into the slot and publishes ``arrived[slot][rank] = g``;
- waiting for the result spins (yielding the CPU) until every rank has arrived, reads what it
  needs out of the slot, and marks ``done[slot][rank] = g``;
- before the slot is reused for ``g + S``, every rank's ``done`` must have reached ``g``; a rank
  first completes its own older collectives, so no rank can wait on itself.

Used by FSDP's unit collectives on CPU (:mod:`shardkit.nn.data_parallel.unit_collectives`);
CommCounter records each as the all-gather / reduce-scatter it replaces. Waits time out with an
error naming the ranks that never arrived (a dead rank does not hang the others forever).
Only on x86-64, whose stores become visible in program order (the data before the counter).

Memory: ``S x slot_bytes`` once per machine (the slot is the largest collective seen, so the
ring grows at most a few times, collectively, in the first iteration).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Callable, Optional, Sequence

import torch

from shardkit import distributed, shared_memory
from shardkit.kernels import unpack_rank_major

__all__ = ["ShmRing", "ring_for", "forget_rings", "NUM_SLOTS"]

NUM_SLOTS = 3
_TIMEOUT_S = float(os.environ.get("SHARDKIT_SHM_TIMEOUT", "1800"))  # torch's default too
_LIVENESS_PERIOD_S = 0.5
_rings: dict = {}  # id(process group object) -> (that object, ShmRing or None)


def ring_for(group, nbytes: int) -> Optional["ShmRing"]:
    """The ring of ``group`` with slots of at least ``nbytes``, or ``None`` where shared memory
    cannot be used (another machine, not x86-64, ``SHARDKIT_SHM_COLLECTIVES=0``, a world of
    one). Collective the first time, and whenever the ring has to grow: every rank of ``group``
    asks with the same sizes in the same order (true of any sequence of collectives)."""
    resolved = group if group is not None else torch.distributed.group.WORLD
    key = id(resolved)  # the object is kept in the entry, so its id is not reused
    entry = _rings.get(key)
    ring = entry[1] if entry is not None else None
    if entry is not None and (ring is None or ring.slot_bytes >= nbytes):
        return ring
    if entry is None and not _allowed(group):
        _rings[key] = (resolved, None)
        return None
    if ring is not None:
        ring.complete_all()  # nothing may still be in flight in the old slots
    grown = ShmRing.create(group, max(nbytes, ring.slot_bytes if ring else 0))
    _rings[key] = (resolved, grown)
    return grown


def forget_rings() -> None:
    """Complete what is in flight and drop every ring, so that the next collective decides
    afresh (e.g. after changing ``SHARDKIT_SHM_COLLECTIVES``). Call it on every rank alike."""
    for _group, ring in _rings.values():
        if ring is not None:
            ring.complete_all()
    _rings.clear()


def _allowed(group) -> bool:
    return (os.environ.get("SHARDKIT_SHM_COLLECTIVES", "1") != "0"
            and platform.machine().lower() in ("x86_64", "amd64")
            and distributed.get_world_size(group) > 1)


class ShmRing:
    """``NUM_SLOTS`` shared slots of ``slot_bytes`` and their counters (see the module doc)."""

    def __init__(self, group, slot_bytes: int, buffer: torch.Tensor, peers: dict):
        self.group = group
        self._peers = peers  # rank -> pid, where every rank shares one pid namespace
        self.rank = distributed.get_rank(group)
        self.world_size = n = distributed.get_world_size(group)
        self.slot_bytes = slot_bytes
        control = 2 * NUM_SLOTS * n
        counters = buffer[:control * 8].view(torch.int64).view(2, NUM_SLOTS, n)
        self._arrived, self._done = counters[0], counters[1]
        self._slots = buffer[control * 8:].view(NUM_SLOTS, slot_bytes)
        self._next = 1
        self._pending: dict = {}  # generation -> op issued here and not yet completed

    @classmethod
    def create(cls, group, slot_bytes: int) -> Optional["ShmRing"]:
        slot_bytes = -(-slot_bytes // 64) * 64
        n = distributed.get_world_size(group)
        total = 2 * NUM_SLOTS * n * 8 + NUM_SLOTS * slot_bytes
        buffers = shared_memory.open_shared_buffers([total], torch.uint8, group)
        if buffers is None:
            return None
        return cls(group, slot_bytes, buffers[0], _peer_pids(group))

    # ------------------------------------------------------------------ collectives

    def all_gather(self, shard: torch.Tensor, outs: Sequence[torch.Tensor],
                   chunk_numels: Sequence[int]) -> "ShmOp":
        """Every rank's ``shard`` (its chunks of every tensor, concatenated) into ``outs``
        (:func:`~shardkit.kernels.unpack_rank_major` layout); the result is in ``outs`` once
        :meth:`ShmOp.wait` returns."""
        n, numel = self.world_size, shard.numel()
        gen, slot = self._acquire(n * numel * shard.element_size())
        view = slot.view(shard.dtype)
        view[self.rank * numel:(self.rank + 1) * numel].copy_(shard)
        distributed.shared_memory_exchange(view, self.group, op="all_gather")
        return self._publish(gen, lambda: unpack_rank_major(view, n, outs, chunk_numels))

    def reduce_scatter(self, packed: torch.Tensor) -> "ShmOp":
        """Sum of every rank's rank-major ``packed`` buffer, this rank's segment (returned by
        :meth:`ShmOp.wait`)."""
        n, numel = self.world_size, packed.numel()
        gen, slot = self._acquire(n * numel * packed.element_size())
        rows = slot.view(packed.dtype).view(n, numel)
        rows[self.rank].copy_(packed)
        distributed.shared_memory_exchange(packed, self.group, op="reduce_scatter")
        segment = numel // n
        return self._publish(
            gen, lambda: rows.view(n, n, segment)[:, self.rank].sum(0))

    def complete_all(self) -> None:
        """Complete every collective issued here (they need every rank to have arrived)."""
        for gen in sorted(self._pending):
            self._pending[gen].wait()

    # ------------------------------------------------------------------ protocol

    def _acquire(self, nbytes: int) -> tuple[int, torch.Tensor]:
        gen, self._next = self._next, self._next + 1
        s = gen % NUM_SLOTS
        previous = gen - NUM_SLOTS
        if previous >= 1:
            if previous in self._pending:  # our own older use of this slot: finish it first
                self._pending[previous].wait()
            done = self._done[s]
            self._spin(lambda: bool((done >= previous).all()), done, previous, "release slot")
        return gen, self._slots[s][:nbytes]

    def _publish(self, gen: int, finish: Callable) -> "ShmOp":
        self._arrived[gen % NUM_SLOTS][self.rank] = gen
        op = ShmOp(self, gen, finish)
        self._pending[gen] = op
        return op

    def _complete(self, gen: int, finish: Callable):
        arrived = self._arrived[gen % NUM_SLOTS]
        self._spin(lambda: bool((arrived >= gen).all()), arrived, gen, "arrive")
        result = finish()
        self._done[gen % NUM_SLOTS][self.rank] = gen
        del self._pending[gen]
        return result

    def _spin(self, ready: Callable[[], bool], counters: torch.Tensor, gen: int,
              what: str) -> None:
        spins, start, checked = 0, None, 0.0
        while not ready():
            spins += 1
            if spins < 64:
                continue
            time.sleep(0 if spins < 4096 else 1e-4)
            now = time.monotonic()
            if start is None:
                start = checked = now
                continue
            late = None
            if now - checked > _LIVENESS_PERIOD_S:
                checked = now
                late = [r for r in range(self.world_size) if int(counters[r]) < gen]
                dead = [r for r in late if not _alive(self._peers.get(r))]
                if dead:
                    raise RuntimeError(
                        f"shared-memory collective {gen} on rank {self.rank}: rank(s) {dead} "
                        f"exited before they could {what}")
            if now - start > _TIMEOUT_S:
                late = late or [r for r in range(self.world_size) if int(counters[r]) < gen]
                raise RuntimeError(
                    f"shared-memory collective {gen} on rank {self.rank}: rank(s) {late} did "
                    f"not {what} within {_TIMEOUT_S:.0f} s (ranks issue different collectives, "
                    f"or one is stuck); SHARDKIT_SHM_TIMEOUT sets the limit, "
                    f"SHARDKIT_SHM_COLLECTIVES=0 uses gloo instead")


def _peer_pids(group) -> dict:
    """``{rank: pid}`` of the group's processes when they all share this pid namespace (so a
    dead peer can be noticed while waiting); ``{}`` otherwise."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = None
    everyone = distributed.all_gather_object((namespace, os.getpid()), group=group)
    if namespace is None or any(ns != namespace for ns, _pid in everyone):
        return {}
    return {r: pid for r, (_ns, pid) in enumerate(everyone)}


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return True  # unknown: only the timeout can tell
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # an exited process not yet reaped is a zombie


class ShmOp:
    """One collective in flight on a :class:`ShmRing`; :meth:`wait` finishes it (idempotent)."""

    def __init__(self, ring: ShmRing, gen: int, finish: Callable):
        self._ring, self._gen, self._finish = ring, gen, finish
        self._done, self._result = False, None

    def wait(self):
        if not self._done:
            self._result = self._ring._complete(self._gen, self._finish)
            self._done = True
        return self._result
