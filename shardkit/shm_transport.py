"""An opt-in transport through host shared memory, for ranks that run on one host.

gloo moves bytes between processes of one host through TCP loopback: the kernel copies every
byte and the protocol work competes with training for the same cores. A
:class:`SharedMemoryTransport` instead moves each collective through a small ring of
fixed-size *slots* in memory that every rank of the group maps::

    model = FullyShardedDataParallel(model, comm=SharedMemoryTransport())
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, comm=SharedMemoryTransport())

It is never chosen for you: the default is the process group's own collectives
(:mod:`shardkit.transport`). Parameters are never shared between processes: the slots hold
copies in flight only.

How it works. The memory is anonymous (``memfd_create``) and passed between processes through
``/proc/<pid>/fd``, so nothing is ever created in ``/dev/shm`` and the kernel frees it when the
last rank exits, however it exits. A collective runs as *rounds*, one per slot-sized piece; in
a round each rank writes its piece and a header (op, total bytes, dtype, sequence number; a
broadcast's source, an all-reduce's reduction, an unequal segment layout or a chunked
operation's chunk layout too) into its part of the next slot, publishes the sequence number
with an atomic store, waits until every rank has published, checks that every header matches
its own (ranks that issued different collectives get an error naming both, never wrong data),
reads what it needs, and marks the slot done. A slot is reused only when every rank has marked
it done. The counters are sequentially consistent atomics from the ``atomics`` library, which
also order the plain data writes before them. Operations run in issue order on one background
thread per group, so they overlap with compute like the process group's asynchronous
collectives.

Failures: a rank waiting on a peer notices within half a second that the peer's process has
exited and raises naming it; otherwise ``timeout_s`` bounds every wait. Ranks that issued
different collectives raise :class:`DivergedCollectivesError` (a
:class:`~shardkit.collective_check.CollectiveMismatchError`). A call whose arguments are wrong
on one rank (an output of another dtype or size than the input asks for, a source outside the
group) raises its ValueError there before anything is written, and publishes the refusal in
its next round, so that every peer raises a :class:`DivergedCollectivesError` naming that rank
and the error at once, instead of waiting ``timeout_s`` for it; nothing is exchanged. After an
error the transport is broken and every later operation raises the same error.

Memory: ``3 x N x part_bytes`` (default 2 MiB per part: 12 MiB at world 2) plus a page of
control per group, for the life of the process, whatever the model's size; reported by
:meth:`~shardkit.shm_transport.SharedMemoryTransport.footprint_tensors` and counted by
``model_state_bytes`` under ``"transport"``.
Communication: none on the network; ``CommCounter`` records each op with the bytes the ranks
read from their peers' slots, i.e. what a network transport would deliver to them, under the
process group's convention (DESIGN.md), so that the two transports record the same bytes for
every op that moves the same bytes: an all-gather (equal or unequal segments) ``(N-1)/N`` of
the output, a reduce-scatter or all-to-all ``(N-1)/N`` of the input, and the rooted ops
averaged over the ranks, as the process group counts them: a broadcast ``(N-1)/N`` of the
tensor (the ``N-1`` ranks but the source read it all), a reduce-to-owners ``(N-1)/N`` of all
the segments (each owner reads ``N-1`` peers' copies of its own), and an all-reduce the
convention's ``2(N-1)/N`` of the tensor, as the process group's all-reduce of that size, so
that a wrapper's count does not depend on the transport. (What this algorithm really reads is
more from world 3 on: each rank reads its ``N-1`` peers' copies of the tensor, ``(N-1)·S``; at
world 2 the two agree.) What a rank writes is less: one copy of its own part, which every
peer reads.

When it cannot be used (ranks on different hosts or pid namespaces, no ``memfd_create``, a
world of one), :meth:`~shardkit.shm_transport.SharedMemoryTransport.prepare` warns once and the
group's operations use the process group.
"""

from __future__ import annotations

import atexit
import mmap
import os
import queue
import secrets
import threading
import time
import weakref
import zlib
from typing import Callable, Optional

import torch

from shardkit import comm_counter
from shardkit import distributed as skdist
from shardkit.collective_check import CollectiveMismatchError
from shardkit.kernels import pack_rank_major, unpack_rank_major
from shardkit.kernels.packing import _check_chunks
from shardkit.transport import (CommHandle, ProcessGroupTransport, Transport, segment_views,
                                warn_once)

__all__ = ["SharedMemoryTransport", "TransportError", "DivergedCollectivesError", "NUM_SLOTS"]

NUM_SLOTS = 3
_CONTROL_BYTES = 4096  # token page
_HEADER_FIELDS = 5  # generation, op code, total bytes, dtype code, detail (see _Ring.submit)
# the header's op codes are indices here (plus one): new ops go at the end
_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "reduce",
        "all_gather_chunks", "reduce_scatter_chunks")
# the header's dtype codes are indices here: new dtypes go at the end
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int8, torch.uint8, torch.bool, torch.int16, torch.complex64,
           torch.complex128)
_DATA_ALIGN = 64  # the slots start on a cache line, so any dtype (complex128: 16) views them
_LIVENESS_PERIOD_S = 0.25
_REDUCE_OPS = ("SUM", "MAX")  # the all-reduces it runs, coded in the header's detail
_REFUSED = -1  # a header's byte count: the rank refused its call; its part holds why


class TransportError(RuntimeError):
    """A shared-memory collective failed: a peer exited, timed out, or issued another op."""


class DivergedCollectivesError(TransportError, CollectiveMismatchError):
    """The ranks of a group issued different shared-memory collectives (op, bytes, dtype,
    source or layout). Every rank that reads the headers raises it, naming both ops, as the
    collective debug mode's :class:`~shardkit.collective_check.CollectiveMismatchError` (which
    it is): a bug in the program, not a lost peer, so :mod:`shardkit.fault` reports it at once
    instead of first waiting for a peer to be declared lost."""


class SharedMemoryTransport(Transport):
    """Collectives through a ring of shared-memory slots (see the module docstring).

    Args:
        part_bytes: bytes each rank writes per round (the slot is ``N`` parts); a collective of
            ``B`` bytes per rank takes ``ceil(B / part_bytes)`` rounds.
        timeout_s: longest wait for a peer before raising (a dead peer is noticed sooner).

    Memory: ``NUM_SLOTS x N x part_bytes`` per group, fixed, plus one worker thread per group;
    both are released by :meth:`close`, or when the transport is garbage-collected.
    Communication: none on the wire.
    """

    name = "shared_memory"

    def __init__(self, part_bytes: int = 2 << 20, timeout_s: float = 300.0):
        if not isinstance(part_bytes, int) or part_bytes < 4096 or part_bytes % 64:
            raise ValueError(f"SharedMemoryTransport(part_bytes={part_bytes!r}): must be an int "
                             f">= 4096 and a multiple of 64")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise ValueError(f"SharedMemoryTransport(timeout_s={timeout_s!r}): must be a "
                             f"number of seconds > 0")
        self.part_bytes = part_bytes
        self.timeout_s = float(timeout_s)
        self._rings: dict = {}  # id(group object) -> (group object, _Ring or None)
        self._fallback = ProcessGroupTransport()
        self._closed = False  # close() was called and prepare() not since: errors say so
        # a transport dropped without close() still stops its workers and unmaps its memory
        weakref.finalize(self, _stop_rings, self._rings)

    # ------------------------------------------------------------------ set-up

    def prepare(self, group) -> None:
        """Map the ring for ``group`` (collective: three small object collectives), or decide
        on every rank alike to fall back to the process group, warning once per process and
        reason."""
        skdist.require_initialized("SharedMemoryTransport.prepare")
        resolved = skdist.resolved_group(group)
        self._closed = False
        if id(resolved) in self._rings:
            return
        ring, why = _Ring.open(group, self.part_bytes, self.timeout_s)
        self._rings[id(resolved)] = (resolved, ring)
        if ring is None:
            warn_once(f"shared-memory fallback: {why}", f"SharedMemoryTransport: {why}; these "
                      f"collectives use the process group's own backend instead", stacklevel=4)

    def _ring(self, group) -> Optional["_Ring"]:
        resolved = skdist.resolved_group(group)
        entry = self._rings.get(id(resolved))
        if entry is None and self._closed:
            raise RuntimeError("SharedMemoryTransport: used after close(), which released its "
                               "shared memory; call transport.prepare(group) again on every "
                               "rank (collective) to use it again")
        if entry is None:
            raise RuntimeError("SharedMemoryTransport: used on a process group it was not "
                               "prepared for; the wrapper must call transport.prepare(group) "
                               "on every rank at construction")
        return entry[1]

    def describe(self, group=None) -> str:
        """``"shared memory"``, or the process group's backend where ``group`` fell back to
        it. Local."""
        resolved = skdist.resolved_group(group)
        entry = self._rings.get(id(resolved))
        if entry is not None and entry[1] is None:
            return f"process group ({skdist.backend_of(group)}; shared memory unavailable)"
        return "shared memory"

    def footprint_tensors(self) -> list[torch.Tensor]:
        """The mapped memory of each prepared group's ring (its slots and control). Local."""
        return [ring.memory for _g, ring in self._rings.values() if ring is not None]

    def close(self) -> None:
        """Finish queued operations, stop the workers and unmap the slots (idempotent); a later
        operation raises until :meth:`prepare` is called again."""
        _stop_rings(self._rings)
        self._closed = True

    # ------------------------------------------------------------------ operations

    def all_gather(self, output, input, group):
        """Round by round, each rank writes the next part of its ``input`` once and copies the
        peers' parts into ``output`` (a non-contiguous ``output`` through a contiguous copy)."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.all_gather(output, input, group)
        return _gather(ring, output, input)

    def all_gather_chunks(self, fulls, chunks, group):
        """One all-gather of this rank's chunks packed back to back, unpacked into ``fulls``
        on the worker (so they land even if the handle is dropped). The header carries the
        chunk layout, so that ranks that cut the same bytes otherwise raise. Memory: one
        scratch buffer of ``N x sum(chunks)`` elements until the operation is done."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.all_gather_chunks(fulls, chunks, group)
        n = ring.world_size
        shard = torch.cat([c.reshape(-1) for c in chunks]) if len(chunks) != 1 else \
            chunks[0].reshape(-1)
        scratch = torch.empty(n * shard.numel(), dtype=shard.dtype, device=shard.device)
        numels = [c.numel() for c in chunks]
        try:  # checked here: the unpacking on the worker must not fail on one rank only
            _check_chunks([full.numel() for full in fulls], numels, n)
        except ValueError as error:
            ring.refuse("all_gather_chunks", error)
        layout = [(full.numel(), c) for full, c in zip(fulls, numels)]
        inner = _gather(ring, scratch, shard, op="all_gather_chunks",
                        detail=_layout_code(layout),
                        then=lambda: unpack_rank_major(scratch, n, list(fulls),
                                                       chunk_numels=numels))

        def finish():
            inner.wait()
        return CommHandle((), finish)

    def all_gather_segments(self, output, sizes, group):
        """Round by round, each rank writes the next part of its own segment (nothing once it
        has run out) and reads the peers' parts of theirs."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.all_gather_segments(output, sizes, group)
        n, rank = ring.world_size, ring.rank
        try:
            views = segment_views(output, sizes, n)
        except ValueError as error:
            ring.refuse("all_gather", error)
        own = views[rank]

        def write(part, lo, hi):
            hi = min(hi, own.numel())
            if hi > lo:
                part[:hi - lo].copy_(own[lo:hi])

        def read(parts, lo, hi):
            for r, view in enumerate(views):
                end = min(hi, view.numel())
                if r != rank and end > lo:
                    view[lo:end].copy_(parts[r][:end - lo])
        # every rank reads the output but its own segment: (N-1)/N of it, averaged over ranks
        _record(ring, "all_gather", _nbytes(output), output.dtype)
        return ring.submit("all_gather", output.dtype, max(sizes), ring.chunk(output.dtype),
                           write, read, result=lambda: output, total=output.numel(),
                           detail=_layout_code(sizes))

    def reduce_scatter(self, input, group):
        """Round by round, each rank writes the next piece of every rank's part of ``input``
        and sums every rank's piece of its own part straight into the result (no scratch)."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.reduce_scatter(input, group)
        return _reduce_scatter(ring, input)

    def reduce_scatter_chunks(self, tensors, chunk_numels, group, *, scale=1.0, dtype=None):
        """The interface's packed reduce-scatter (see :meth:`Transport.reduce_scatter_chunks`),
        with the chunk layout in the header, so that ranks that cut the same bytes otherwise
        raise. Memory: the packed ``N x sum(chunk_numels)`` elements until it is done."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.reduce_scatter_chunks(tensors, chunk_numels, group,
                                                        scale=scale, dtype=dtype)
        packed = pack_rank_major(list(tensors), ring.world_size, scale=scale, dtype=dtype,
                                 chunk_numels=chunk_numels)
        layout = [(t.numel(), c) for t, c in zip(tensors, chunk_numels)]
        return _reduce_scatter(ring, packed, op="reduce_scatter_chunks",
                               detail=_layout_code(layout))

    def all_reduce(self, tensor, group, op=skdist.ReduceOp.SUM):
        """``SUM`` and ``MAX`` only. Round by round, each rank writes the next part of
        ``tensor`` and reduces every rank's copy of it in place (a part-sized temporary; a
        non-contiguous ``tensor`` through a contiguous copy): it reads ``(N-1)`` copies of the
        tensor, more than the count records from world 3 on (see the module docstring)."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.all_reduce(tensor, group, op)
        if op != skdist.ReduceOp.SUM and op != skdist.ReduceOp.MAX:
            ring.refuse("all_reduce", ValueError(
                f"SharedMemoryTransport.all_reduce(op={op}): SUM and MAX only"))
        if op == skdist.ReduceOp.MAX and tensor.is_complex():
            ring.refuse("all_reduce", ValueError(
                f"SharedMemoryTransport.all_reduce(op=MAX): a {tensor.dtype} tensor has no "
                f"order; use SUM or a real dtype"))
        n = ring.world_size
        landing, land = _landing(tensor)
        flat = landing.view(-1)

        def write(part, lo, hi):
            part[:hi - lo].copy_(flat[lo:hi])

        def read(parts, lo, hi):
            acc = parts[0][:hi - lo].clone()
            for r in range(1, n):
                if op == skdist.ReduceOp.SUM:
                    acc.add_(parts[r][:hi - lo])
                else:
                    torch.maximum(acc, parts[r][:hi - lo], out=acc)
            flat[lo:hi].copy_(acc)
        _record(ring, "all_reduce", _nbytes(tensor), tensor.dtype)
        return ring.submit("all_reduce", tensor.dtype, flat.numel(), ring.chunk(tensor.dtype),
                           write, read, result=lambda: tensor, land=land,
                           detail=_REDUCE_OPS.index(_reduce_op_name(op)) + 1)

    def broadcast(self, tensor, src, group):
        """The source writes each part of ``tensor`` once; every other rank copies it in place
        (a non-contiguous ``tensor`` through a contiguous copy)."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.broadcast(tensor, src, group)
        members = [skdist.get_global_rank(group, r) for r in range(ring.world_size)]
        if src not in members:
            ring.refuse("broadcast", ValueError(
                f"broadcast(src={src}): not a member of the group {members}"))
        root = members.index(src)
        landing, land = _landing(tensor)
        flat = landing.view(-1)

        def write(part, lo, hi):
            if ring.rank == root:
                part[:hi - lo].copy_(flat[lo:hi])

        def read(parts, lo, hi):
            if ring.rank != root:
                flat[lo:hi].copy_(parts[root][:hi - lo])
        # the N-1 ranks but the source read it all: (N-1)/N of it, averaged over the ranks
        _record(ring, "broadcast", _nbytes(tensor), tensor.dtype)
        return ring.submit("broadcast", tensor.dtype, flat.numel(), ring.chunk(tensor.dtype),
                           write, read, result=lambda: tensor, land=land, detail=root + 1)

    def reduce_to_owners(self, segments, group):
        """Every rank writes its segments back to back once (no padding); owner ``r`` sums the
        ``r``-th segment of every rank into a buffer of exactly its size."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.reduce_to_owners(segments, group)
        n, rank = ring.world_size, ring.rank
        sizes = [0 if s is None else s.numel() for s in segments]
        ref = next(s for s in segments if s is not None)
        flat = torch.cat([s.reshape(-1) for s in segments if s is not None])
        start = sum(sizes[:rank])
        mine = sizes[rank]
        out = torch.empty(mine, dtype=ref.dtype, device=ref.device) if mine else None

        def write(part, lo, hi):
            part[:hi - lo].copy_(flat[lo:hi])

        def read(parts, lo, hi):
            a, b = max(lo, start), min(hi, start + mine)
            if a >= b:
                return
            acc = out[a - start:b - start]
            acc.copy_(parts[0][a - lo:b - lo])
            for r in range(1, n):
                acc.add_(parts[r][a - lo:b - lo])
        # each owner reads N-1 peers' copies of its segment: (N-1)/N of all the segments,
        # averaged over the ranks
        _record(ring, "reduce", _nbytes(flat), flat.dtype)
        return ring.submit("reduce", flat.dtype, flat.numel(), ring.chunk(flat.dtype), write,
                           read, result=lambda: out, detail=_layout_code(sizes))

    def all_to_all(self, output, input, group):
        """Round by round, each rank writes the next piece of all ``N`` chunks of ``input``
        and copies the peers' pieces meant for it into ``output`` (a non-contiguous ``output``
        through a contiguous copy)."""
        ring = self._ring(group)
        if ring is None:
            return self._fallback.all_to_all(output, input, group)
        n, rank = ring.world_size, ring.rank
        _refuse_unless_fit(ring, "all_to_all", output, input, input.numel(), "the input's")
        if input.numel() % n:
            ring.refuse("all_to_all", ValueError(
                f"all_to_all: input has {input.numel()} elements; they must be divisible by "
                f"world size {n}"))
        seg = input.numel() // n
        landing, land = _landing(output)
        rows_in, rows_out = input.reshape(n, seg), landing.view(n, seg)
        step = max(1, ring.chunk(input.dtype) // n)

        def write(part, lo, hi):
            part[:n * (hi - lo)].view(n, hi - lo).copy_(rows_in[:, lo:hi])

        def read(parts, lo, hi):
            k = hi - lo
            for r in range(n):
                rows_out[r, lo:hi].copy_(parts[r][rank * k:(rank + 1) * k])
        _record(ring, "all_to_all", _nbytes(input), input.dtype)
        return ring.submit("all_to_all", input.dtype, seg, step, write, read,
                           result=lambda: output, land=land, total=input.numel())


def _gather(ring: "_Ring", output, input, op: str = "all_gather", detail: int = 0,
            then: Optional[Callable] = None) -> CommHandle:
    """Every rank's flat ``input`` into ``output``, rank-major, issued as ``op`` with the
    header's ``detail``; ``then`` runs on the worker once ``output`` is filled."""
    n, rank = ring.world_size, ring.rank
    _refuse_unless_fit(ring, op, output, input, n * input.numel(),
                       f"world size {n} x input's {input.numel()}")
    numel = input.numel()
    landing, land = _landing(output)
    src, dst = input.reshape(-1), landing.view(n, -1)

    def write(part, lo, hi):
        part[:hi - lo].copy_(src[lo:hi])

    def read(parts, lo, hi):
        for r in range(n):
            if r != rank:
                dst[r, lo:hi].copy_(parts[r][:hi - lo])

    def start():
        if dst[rank].data_ptr() != src.data_ptr():
            dst[rank].copy_(src)

    def finish():
        if land is not None:
            land()
        if then is not None:
            then()
    _record(ring, "all_gather", _nbytes(output), input.dtype)
    return ring.submit(op, input.dtype, numel, ring.chunk(input.dtype), write, read,
                       result=lambda: output, start=start, detail=detail,
                       land=finish if land is not None or then is not None else None)


def _reduce_scatter(ring: "_Ring", input, op: str = "reduce_scatter",
                    detail: int = 0) -> CommHandle:
    """The sum over ranks of this rank's part of the flat ``input``, issued as ``op`` with the
    header's ``detail``; ``wait`` returns it (a tensor of its own)."""
    n, rank = ring.world_size, ring.rank
    if input.numel() % n:
        ring.refuse(op, ValueError(
            f"{op}: input has {input.numel()} elements, not divisible by world size {n}"))
    seg = input.numel() // n
    rows = input.reshape(n, seg)
    out = torch.empty(seg, dtype=input.dtype, device=input.device)
    step = max(1, ring.chunk(input.dtype) // n)

    def write(part, lo, hi):
        part[:n * (hi - lo)].view(n, hi - lo).copy_(rows[:, lo:hi])

    def read(parts, lo, hi):
        k = hi - lo
        acc = out[lo:hi]
        acc.copy_(parts[0][rank * k:(rank + 1) * k])
        for r in range(1, n):
            acc.add_(parts[r][rank * k:(rank + 1) * k])
    _record(ring, "reduce_scatter", _nbytes(input), input.dtype)
    return ring.submit(op, input.dtype, seg, step, write, read, result=lambda: out,
                       total=input.numel(), detail=detail)


def _refuse_unless_fit(ring: "_Ring", op: str, output: torch.Tensor, input: torch.Tensor,
                       numel: int, what: str) -> None:
    """Refuse ``op`` (see :meth:`_Ring.refuse`) unless ``output`` has ``input``'s dtype (torch's
    collectives raise; a copy between the two would cast silently) and ``numel`` elements
    (``what`` says how that number is made)."""
    if output.dtype != input.dtype:
        ring.refuse(op, ValueError(
            f"{op}: output is {output.dtype} and input {input.dtype}; they must have one dtype "
            f"(cast one of them first)"))
    if output.numel() != numel:
        ring.refuse(op, ValueError(
            f"{op}: output has {output.numel()} elements and input {input.numel()}; the output "
            f"must have {numel} ({what})"))


def _landing(tensor: torch.Tensor) -> tuple:
    """``(buffer, land)``: ``tensor`` itself and ``None`` when contiguous, else a contiguous copy
    that the operation reads and writes and ``land()``, which copies it back into ``tensor``.
    The ring's worker runs ``land`` as the operation's last step, so the result lands whether
    or not its handle is waited for (as the process group's does, and as a contiguous tensor's
    does here)."""
    if tensor.is_contiguous():
        return tensor, None
    buffer = tensor.contiguous()
    return buffer, lambda: tensor.copy_(buffer)


def _record(ring: "_Ring", op: str, nbytes: int, dtype: torch.dtype) -> None:
    """Record ``op`` of a tensor whose full logical size is ``nbytes`` in every active
    ``CommCounter``, as the process group's collective of that size is recorded (see the
    module docstring)."""
    if comm_counter.counting():
        comm_counter.add_collective(op, nbytes, dtype, ring.world_size,
                                    skdist.spans_nodes_if_known(ring.group))


class _Ring:
    """One group's slots, counters and worker thread."""

    def __init__(self, group, mapping: mmap.mmap, part_bytes: int, peers: dict,
                 timeout_s: float):
        import atomics  # a dependency of shardkit; imported here to keep start-up light

        self.group = group
        self.rank = skdist.get_rank(group)
        self.world_size = n = skdist.get_world_size(group)
        self.part_bytes = part_bytes
        self._mapping = mapping
        self._view = memoryview(mapping)
        self.memory = memory = torch.frombuffer(mapping, dtype=torch.uint8)
        self.timeout_s = timeout_s
        self._peers = peers
        counters_at, headers_at, data_at = _offsets(n)
        self._atomics = atomics
        self._contexts: list = []
        self._arrived = [[self._counter(counters_at + ((0 * NUM_SLOTS + s) * n + r) * 8)
                          for r in range(n)] for s in range(NUM_SLOTS)]
        self._done = [[self._counter(counters_at + ((1 * NUM_SLOTS + s) * n + r) * 8)
                       for r in range(n)] for s in range(NUM_SLOTS)]
        self._headers = memory[headers_at:headers_at + NUM_SLOTS * n * _HEADER_FIELDS * 8].view(
            torch.int64).view(NUM_SLOTS, n, _HEADER_FIELDS)
        self._data = memory[data_at:].view(NUM_SLOTS, n, part_bytes)
        self._next_gen = 1
        self._queue: "queue.Queue" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._busy = False
        self._thread = threading.Thread(target=self._serve, daemon=True,
                                        name=f"shardkit-shm-rank{self.rank}")
        self._thread.start()
        atexit.register(self._release_at_exit)

    def _counter(self, offset: int):
        context = self._atomics.atomicview(buffer=self._view[offset:offset + 8],
                                           atype=self._atomics.INT)
        self._contexts.append(context)  # it must outlive the atomic it hands out
        return context.__enter__()

    @staticmethod
    def total_bytes(n: int, part_bytes: int) -> int:
        return _offsets(n)[2] + NUM_SLOTS * n * part_bytes

    @classmethod
    def open(cls, group, part_bytes: int, timeout_s: float):
        """``(ring, None)``, or ``(None, why)`` on every rank alike. Collective."""
        n = skdist.get_world_size(group)
        if n == 1:
            skdist.all_gather_object(None, group=group)
            return None, "a group of one rank has nothing to exchange"
        namespace = _host_and_pid_namespace()
        everyone = skdist.all_gather_object((namespace, os.getpid()), group=group)
        size = cls.total_bytes(n, part_bytes)
        offer, fd, mapping, why = None, None, None, None
        if skdist.get_rank(group) == 0:
            if namespace is None or any(ns != namespace for ns, _ in everyone):
                why = "the ranks are not all in one pid namespace on one host"
            elif not hasattr(os, "memfd_create"):
                why = "this platform has no os.memfd_create"
            else:
                fd, mapping, offer = _create(size)
                if offer is None:
                    why = f"rank 0 could not create {size} bytes of anonymous shared memory"
        leader = skdist.get_global_rank(group, 0)
        try:
            offer, why = skdist.broadcast_object((offer, why), src=leader, group=group)
            if offer is not None and skdist.get_rank(group) != 0:
                mapping = _attach(offer, size)
            ok = skdist.all_gather_object(mapping is not None, group=group)
        except BaseException:  # a peer died during the set-up: keep neither fd nor mapping
            if mapping is not None:
                mapping.close()
            raise
        finally:
            if fd is not None:  # every rank has its mapping (or gave up): it keeps the memory
                os.close(fd)
        if offer is None or not all(ok):
            if mapping is not None:
                mapping.close()
            return None, why or (f"rank(s) {[r for r, good in enumerate(ok) if not good]} "
                                 f"could not map rank 0's shared memory")
        peers = {r: pid for r, (_ns, pid) in enumerate(everyone)}
        return cls(group, mapping, part_bytes, peers, timeout_s), None

    # ------------------------------------------------------------------ issuing

    def chunk(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` in one part."""
        return self.part_bytes // torch.empty((), dtype=dtype).element_size()

    def submit(self, op: str, dtype: torch.dtype, numel: int, step: int,
               write: Callable, read: Callable, result: Optional[Callable] = None,
               start: Optional[Callable] = None, total: Optional[int] = None,
               detail: int = 0, land: Optional[Callable] = None) -> CommHandle:
        """Queue an operation of ``ceil(numel / step)`` rounds (at least one, so that a
        mismatch of ops is always caught); returns its handle. ``detail`` goes into the header
        with the op, so that ranks that agree on the op but not on its shape also fail: a
        broadcast's source (rank + 1), an all-reduce's reduction, or a code of an unequal
        segment layout or of a chunk layout. ``land``, if given, runs on the worker after the
        last round (see :func:`_landing`)."""
        if self._error is not None:
            raise _again(self._error)
        if dtype not in _DTYPES:
            self.refuse(op, TypeError(f"SharedMemoryTransport: dtype {dtype} is not supported; "
                                      f"valid dtypes are {[str(d) for d in _DTYPES]}"))
        done = threading.Event()
        box: dict = {}
        total_bytes = (total if total is not None else numel) * \
            torch.empty((), dtype=dtype).element_size()
        header = (_OPS.index(op) + 1, total_bytes, _DTYPES.index(dtype), detail)
        self._queue.put((header, op, dtype, numel, step, write, read, start, land, done, box))

        def finish():
            done.wait()
            if "error" in box:
                raise box["error"]
            return result() if result is not None else None
        return CommHandle((), finish)

    def refuse(self, op: str, error: Exception) -> None:
        """Raise ``error``, this rank's reason to refuse its call of ``op``, after queueing a
        round that publishes it: each peer then raises a :class:`DivergedCollectivesError`
        naming this rank and ``error`` in that round, before it reads anything, instead of
        waiting ``timeout_s`` for a round this rank would never run. The transport is broken
        afterwards, on every rank, as after any error."""
        if self._error is not None:
            raise _again(self._error)
        self._queue.put(_Refusal(op, f"{type(error).__name__}: {error}"))
        raise error

    def _release_at_exit(self) -> None:
        # the atomics' views must be closed before they are collected (else each prints an
        # error); only when the worker is idle, since it may still be using them
        if not self._busy:
            for context in self._contexts:
                context.__exit__(None, None, None)
            self._contexts = []

    def stop(self) -> None:
        """Finish what is queued, stop the worker, release the counters' views and drop the
        memory, which is unmapped once no tensor of it is left (e.g. one from
        ``footprint_tensors``)."""
        self._queue.put(None)
        if threading.current_thread() is self._thread:
            return  # dropped from inside the worker: it stops at the queued None
        self._thread.join(timeout=self.timeout_s)
        if self._thread.is_alive():
            return
        atexit.unregister(self._release_at_exit)
        self._release_at_exit()
        if self._error is not None:  # its frames hold views of the slots: keep only the error
            self._error = self._error.with_traceback(None)
        # Note: no mmap.close(): tensors made by torch.frombuffer hold no buffer export, so
        # closing would leave any tensor still viewing the slots dangling. Each holds a
        # reference to the mapping instead: it is unmapped when the last of them goes.
        try:
            self._view.release()
        except BufferError:  # a counter's view is still exported: released with it
            pass
        self.memory = self._headers = self._data = self._view = self._mapping = None

    # ------------------------------------------------------------------ worker

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _Refusal):
                self._publish_refusal(item)
                continue
            header, op, dtype, numel, step, write, read, start, land, done, box = item
            self._busy = True
            try:
                if self._error is not None:
                    raise _again(self._error)
                if start is not None:
                    start()
                offsets = range(0, max(numel, 1), step)
                for lo in offsets:
                    self._round(header, op, dtype, lo, min(lo + step, numel), write, read)
                if land is not None:
                    land()
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                if self._error is None:
                    self._error = err if isinstance(err, TransportError) else TransportError(
                        f"shared-memory {op} failed on rank {self.rank}: {err!r}")
                box["error"] = self._error
            finally:
                self._busy = False
                done.set()

    def _round(self, header, op, dtype, lo, hi, write, read) -> None:
        gen = self._next_gen
        self._next_gen += 1
        s = gen % NUM_SLOTS
        if gen > NUM_SLOTS:
            self._wait_all(self._done[s], gen - NUM_SLOTS, "release a slot")
        parts = [self._data[s, r].view(dtype) for r in range(self.world_size)]
        write(parts[self.rank], lo, hi)
        self._headers[s, self.rank].copy_(torch.tensor((gen, *header), dtype=torch.int64))
        self._arrived[s][self.rank].store(gen)
        self._wait_all(self._arrived[s], gen, "arrive")
        self._check_headers(s, gen, header)
        read(parts, lo, hi)
        self._done[s][self.rank].store(gen)

    def _publish_refusal(self, refusal: "_Refusal") -> None:
        """One round whose header says "refused" and whose part holds why (see
        :meth:`refuse`); this rank reads nothing and is broken afterwards."""
        if self._error is not None:
            return
        error = DivergedCollectivesError(
            f"shared-memory collectives stopped: rank {self.rank} refused its {refusal.op} "
            f"({refusal.why})")
        try:
            gen = self._next_gen
            self._next_gen += 1
            s = gen % NUM_SLOTS
            if gen > NUM_SLOTS:  # the peers may still read the slot's previous round
                self._wait_all(self._done[s], gen - NUM_SLOTS, "release a slot")
            why = refusal.why.encode(errors="replace")[:self.part_bytes]
            self._data[s, self.rank][:len(why)].copy_(torch.tensor(list(why), dtype=torch.uint8))
            header = (gen, _OPS.index(refusal.op) + 1, _REFUSED, 0, len(why))
            self._headers[s, self.rank].copy_(torch.tensor(header, dtype=torch.int64))
            self._arrived[s][self.rank].store(gen)
        except TransportError as failed:  # a peer died first: that is the error to report
            error = failed
        self._error = error

    def _check_headers(self, s: int, gen: int, mine) -> None:
        rows = self._headers[s].tolist()
        for r, (their_gen, code, nbytes, _dtype, length) in enumerate(rows):
            if their_gen == gen and nbytes == _REFUSED:
                why = bytes(self._data[s, r][:length].tolist()).decode(errors="replace")
                theirs = _OPS[code - 1] if 1 <= code <= len(_OPS) else f"op #{code}"
                raise DivergedCollectivesError(
                    f"shared-memory {_describe(mine)} on rank {self.rank}: rank {r} refused its "
                    f"{theirs} ({why}); nothing was exchanged")
        for r, (their_gen, *theirs) in enumerate(rows):
            if their_gen != gen or tuple(theirs) != tuple(mine):
                raise DivergedCollectivesError(
                    f"shared-memory collectives diverged at round {gen}: rank {self.rank} issued "
                    f"{_describe(mine)}, rank {r} issued {_describe(theirs)}; every rank must "
                    f"issue the same collectives in the same order")

    def _wait_all(self, counters, gen: int, what: str) -> None:
        start = time.monotonic()
        checked = start
        spins = 0
        while True:
            late = [r for r, c in enumerate(counters) if c.load() < gen]
            if not late:
                return
            spins += 1
            time.sleep(0 if spins < 200 else 5e-5 if spins < 2000 else 5e-4)
            now = time.monotonic()
            if now - checked > _LIVENESS_PERIOD_S:
                checked = now
                dead = [r for r in late if not _alive(self._peers.get(r))]
                if dead:
                    raise TransportError(
                        f"shared-memory collective on rank {self.rank}: rank(s) {dead} (pid "
                        f"{[self._peers[r] for r in dead]}) exited before they could {what}")
            if now - start > self.timeout_s:
                raise TransportError(
                    f"shared-memory collective on rank {self.rank}: rank(s) {late} did not "
                    f"{what} within {self.timeout_s:.0f} s (timeout_s sets the limit)")


class _Refusal:
    """A rank's refused call, queued for its worker to publish (see :meth:`_Ring.refuse`)."""

    def __init__(self, op: str, why: str):
        self.op, self.why = op, why


def _offsets(n: int) -> tuple[int, int, int]:
    """Where a ring of ``n`` ranks keeps its counters, its headers and its slots: byte offsets
    into the mapping, whose first page holds the token."""
    counters_at = _CONTROL_BYTES
    headers_at = counters_at + 2 * NUM_SLOTS * n * 8
    data_at = headers_at + NUM_SLOTS * n * _HEADER_FIELDS * 8
    return counters_at, headers_at, -(-data_at // _DATA_ALIGN) * _DATA_ALIGN


def _again(error: TransportError) -> TransportError:
    """A fresh error of ``error``'s class and words, for an operation issued after the transport
    broke (the first error's traceback holds views of the slots)."""
    return type(error)(str(error))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _describe(header) -> str:
    code, nbytes, dtype, detail = header
    op = _OPS[code - 1] if 1 <= code <= len(_OPS) else f"op #{code}"
    kind = _DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else f"dtype #{dtype}"
    if detail and op == "broadcast":
        op = f"broadcast from group rank {detail - 1}"
    elif detail and op == "all_reduce":
        op = f"all_reduce ({_REDUCE_OPS[detail - 1] if detail <= len(_REDUCE_OPS) else detail})"
    elif detail and op.endswith("_chunks"):
        op = f"{op} (chunk layout #{detail:x})"
    elif detail:
        op = f"{op} (segment layout #{detail:x})"
    return f"{op} of {nbytes} bytes of {kind}"


def _reduce_op_name(op) -> str:
    """``"SUM"`` or ``"MAX"`` for a ``ReduceOp`` (the all-reduce's header detail)."""
    return "SUM" if op == skdist.ReduceOp.SUM else "MAX"


def _layout_code(sizes) -> int:
    """A code of a list of sizes (segments, or chunk layouts), the same on every rank (for the
    header check)."""
    return zlib.crc32(repr(list(sizes)).encode()) + 1


def _create(size: int):
    """On the group's rank 0: an anonymous shared mapping and the offer the peers need to map
    it (pid, fd, token); ``(None, None, None)`` if it cannot."""
    try:
        fd = os.memfd_create("shardkit-transport", os.MFD_CLOEXEC)
    except OSError:
        return None, None, None
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        os.close(fd)
        return None, None, None
    token = secrets.token_bytes(32)
    mapping[:32] = token
    return fd, mapping, (os.getpid(), fd, token)


def _attach(offer, size: int):
    """On the other ranks: map rank 0's memory through ``/proc``, if its token is there."""
    pid, fd, token = offer
    try:
        local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    except OSError:
        return None
    try:
        mapping = mmap.mmap(local, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(local)
    if mapping[:32] != token:
        mapping.close()
        return None
    return mapping


def _host_and_pid_namespace() -> Optional[tuple[str, str]]:
    """This process's kernel (its boot id) and pid namespace, or ``None`` where ``/proc`` does
    not say. Ranks share memory through ``/proc/<pid>/fd`` only where both are equal: the
    namespace alone is not enough, since every host's first pid namespace has the same
    number."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return boot, os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _alive(pid: Optional[int]) -> bool:
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _stop_rings(rings: dict) -> None:
    """Stop every ring of a transport's ``{group id: (group, ring or None)}`` and forget them."""
    for _group, ring in list(rings.values()):
        if ring is not None:
            ring.stop()
    rings.clear()
