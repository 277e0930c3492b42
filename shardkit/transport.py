"""How the wrappers' collectives travel: one small interface, the process group by default.

Every collective OSS, ShardedDataParallel and FullyShardedDataParallel issue for their data goes
through a :class:`Transport` (the wrapper's ``comm=`` argument). The interface has the handful
of operations the wrappers need, each asynchronous, returning a :class:`CommHandle` whose
:meth:`~CommHandle.wait` finishes the operation and returns its result:

=====================================  ====================================================
``all_gather(output, input, group)``   every rank's ``input`` into ``output`` (rank-major)
``all_gather_chunks(fulls, chunks)``   rank ``r``'s ``chunks[i]`` into rows ``r`` of ``fulls[i]``
``all_gather_segments(out, sizes, g)``  rank ``r``'s segment (``sizes[r]``, unequal) into ``out``
``reduce_scatter(input, group)``       sum of the ranks' rank-major ``input``, this rank's part
``reduce_scatter_chunks(ts, cs, g)``   the same for tensors ``ts`` cut into chunks ``cs``
``reduce_to_owners(segments, group)``  ``segments[r]`` summed over ranks, onto rank ``r``
``broadcast(tensor, src, group)``      rank ``src``'s tensor everywhere (in place)
``all_reduce(tensor, group, op)``      in place
``all_to_all(output, input, group)``   chunk ``j`` of ``input`` to rank ``j``
=====================================  ====================================================

:class:`ProcessGroupTransport` (the default, :func:`default_transport`) runs them as
``torch.distributed`` collectives on the group's own backend: NCCL on GPUs, gloo on CPU. The
transport, not the wrapper, picks the algorithm for the backend: on gloo, whose all-gather copies
its output through a temporary and whose reduce-scatter runs synchronously, an all-gather is one
batch of sends/receives straight into the destination and a reduce-scatter one ``all_to_all``
plus a local sum, and a reduce-scatter of chunked tensors sends each peer its chunks straight
from the tensors, with no packed copy (the ring algorithms' bytes in every case); on NCCL they
are the native collectives. :class:`~shardkit.shm_transport.SharedMemoryTransport` is an opt-in
plugin with the same interface for ranks on one host.

``CommCounter`` records each operation under the name of the operation asked for
(``all_gather``, ``reduce_scatter``, ...) with the bytes the transport really puts on the wire.

A connection that breaks under an operation of the process-group transport (a peer rank died,
or timed out) raises :class:`CollectiveError`, naming the operation, the group and this rank,
with the backend's own error as its cause (gloo's says only "Connection reset by peer"). Where
an operation built from sends and receives times out (ranks that issued different collectives
wait for each other's messages until the group's timeout), each rank posts its call on the
default store and the error names every rank's (see :func:`_calls_when_timed_out`).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import queue
import threading
import time
import warnings
import zlib
from dataclasses import replace
from typing import Callable, Optional, Sequence

import torch

from shardkit import collective_check
from shardkit import distributed as skdist
from shardkit.distributed import CollectiveError  # noqa: F401 - raised here, documented here
from shardkit.kernels import pack_rank_major, unpack_rank_major
from shardkit.kernels.packing import _check_chunks, chunk_of_rank

__all__ = ["CommHandle", "Transport", "ProcessGroupTransport", "default_transport",
           "resolve_transport", "operation_tag", "exchange_equal_chunks"]


class CommHandle:
    """An operation in flight: :meth:`wait` finishes it and returns its result (idempotent).

    ``completes_when_waited``: the works report completion only once waited for (gloo's
    point-to-point sends and receives); :meth:`watch` then lets a background thread wait, so
    that :meth:`is_completed` becomes a true poll. A handle dropped without :meth:`wait`
    still completes its operation (that thread waits for it), like an unwaited collective.
    """

    def __init__(self, works: Sequence = (), finish: Optional[Callable] = None,
                 completes_when_waited: bool = False):
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._result = None
        self._completes_when_waited = completes_when_waited
        self._arrived: Optional[threading.Event] = None
        self._watch_error: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None
        self.describe: Optional[Callable[[], str]] = None  # the operation, for errors
        # (group, name, dtype, shape, layout) of a collective built from sends and receives:
        # a timeout then names every rank's call (see _calls_when_timed_out)
        self.call: Optional[tuple] = None

    def watch(self) -> None:
        """Make :meth:`is_completed` a true poll for works that only complete by being waited
        for: one shared daemon thread waits for them (in the order watched). A no-op for works
        that report completion themselves (NCCL, gloo's collectives)."""
        if self._done or self._arrived is not None or not self._completes_when_waited:
            return
        self._arrived = threading.Event()
        _completion_watcher().put(self)

    def as_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` that completes with :meth:`wait`'s result once the
        operation has arrived (what a DDP comm hook returns); the handle must not be waited for
        directly afterwards. Works that complete only when waited for are finished on the
        watcher thread; others through their own futures."""
        if self._completes_when_waited and not self._done:
            self._future = torch.futures.Future()
            self.watch()
            return self._future
        if not self._works or self._done:
            future = torch.futures.Future()
            future.set_result(self.wait())
            return future
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(
            lambda _: self.wait())

    def is_completed(self) -> bool:
        """Whether the operation has arrived (a poll: never blocks; :meth:`wait` still takes
        the result). Works that complete only when waited for read ``False`` until
        :meth:`watch` has seen them arrive."""
        if self._done:
            return True
        if self._arrived is not None:
            return self._arrived.is_set()
        return all(w.is_completed() for w in self._works)

    def polls(self) -> bool:
        """Whether :meth:`is_completed` is a true poll: the handle is done, or still holds
        works of its own. One whose result comes from a closure that waits for something else
        (a shared-memory ring, a reduce-scatter behind padding) reads completed from the
        start."""
        return self._done or bool(self._works)

    def _wait_works(self) -> None:
        # Note: a gloo send/receive may be waited for only once (a second wait blocks forever),
        # so a watched handle leaves the waiting to the watcher thread.
        try:
            if self._arrived is not None:
                self._arrived.wait()
                if self._watch_error is not None:
                    raise self._watch_error
                return
            for work in self._works:
                work.wait()
        except Exception as error:
            if self.describe is None or not skdist.is_broken_link(error):
                raise
            failure = skdist.broken_link_error(self.describe(), error)
            words = str(error).lower()
            if self.call is not None and "timed out" in words:
                named = _calls_when_timed_out(*self.call)
                failure = CollectiveError(f"{failure}\n{named}") if named else failure
            elif self.call is not None and "closed by peer" in words:
                # the peer whose own wait timed out first closed the pair: it reads this call
                _post_call_when_closed(*self.call)
            raise failure from error

    def __del__(self):
        # Note: a gloo send or receive whose work object is destroyed before it completes is
        # lost, and the next exchange between the same ranks then waits forever. A handle
        # dropped unwaited (an abandoned prefetch, an exception between issue and wait) hands
        # its works to the watcher thread, which holds them until they arrive, as the process
        # group holds a collective's.
        try:
            if not self._done and self._works and self._completes_when_waited \
                    and self._arrived is None:
                CommHandle(self._works, completes_when_waited=True).watch()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to keep
            pass

    def wait(self):
        """Block until the operation has arrived and return its result (later calls return
        the same result at once)."""
        if not self._done:
            self._wait_works()
            self._works = []
            self.describe = self.call = None  # the operation's arguments: failures read them
            self._result = self._finish() if self._finish is not None else None
            self._finish = None  # its closure may hold the operation's inputs and scratch
            self._done = True
        return self._result


def _watch_forever(pending: "queue.SimpleQueue[CommHandle]") -> None:
    while True:
        handle = pending.get()
        try:
            for work in handle._works:
                work.wait()
        except BaseException as error:  # handed to the caller's wait()
            handle._watch_error = error
        finally:
            handle._arrived.set()
        if handle._future is not None:
            _complete(handle._future, handle)
        # drop the last handle and work (their buffers) before blocking for the next one
        handle = work = None


def _complete(future: torch.futures.Future, handle: CommHandle) -> None:
    try:
        result = handle.wait()
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(result)


_WATCHER: Optional["queue.SimpleQueue[CommHandle]"] = None
_WATCHER_LOCK = threading.Lock()


def _completion_watcher() -> "queue.SimpleQueue[CommHandle]":
    """The queue of the one daemon thread that waits for watched handles (started once)."""
    global _WATCHER
    with _WATCHER_LOCK:
        if _WATCHER is None:
            _WATCHER = queue.SimpleQueue()
            threading.Thread(target=_watch_forever, args=(_WATCHER,), daemon=True,
                             name="shardkit-comm-watcher").start()
        return _WATCHER


class Transport:
    """The collectives a wrapper needs (see the module docstring); subclass to plug in another
    way of moving the bytes. Every method is asynchronous and must be called by every rank of
    ``group`` in the same order with the same sizes and dtypes.

    :meth:`prepare` is called by each wrapper at construction, on every rank, for each group it
    will use: a transport that needs a collective set-up does it there, never inside a step.
    """

    name = "abstract"

    def prepare(self, group) -> None:
        """Collective set-up for ``group`` (nothing for the process-group transport)."""

    def describe(self, group=None) -> str:
        """What carries the bytes for ``group``, for logs and benchmark rows."""
        return self.name

    def footprint_tensors(self) -> list[torch.Tensor]:
        """Buffers the transport holds for the life of the process (counted by
        :func:`shardkit.utils.memory.model_state_bytes` under ``"transport"``)."""
        return []

    def lossless(self) -> "Transport":
        """The transport that moves values bit for bit: this one, or for a compressing
        transport the one it wraps. FSDP's hpZ backward gather uses it, so that backward
        computes with exactly the weights the forward used. Costs nothing (an accessor)."""
        return self

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group) -> CommHandle:
        """Every rank's flat ``input`` into the flat ``output`` of ``N x input.numel()``
        elements, rank-major. ``wait`` returns ``output``. Wire (ring): ``(N-1)/N`` of
        ``output``'s bytes sent per rank; memory: none beyond ``output``."""
        raise NotImplementedError

    def all_gather_chunks(self, fulls: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
                          group) -> CommHandle:
        """Fill each flat ``fulls[i]`` with every rank's rows: rank ``r``'s ``chunks[i]`` lands
        at elements ``[r*c, (r+1)*c)`` (``c = chunks[i].numel()``), cut at ``fulls[i]``'s end.
        Default: one rank-major :meth:`all_gather` into a scratch buffer, then unpacked."""
        n = skdist.get_world_size(group)
        shard = torch.cat([c.reshape(-1) for c in chunks]) if len(chunks) != 1 else \
            chunks[0].reshape(-1)
        scratch = torch.empty(n * shard.numel(), dtype=shard.dtype, device=shard.device)
        inner = self.all_gather(scratch, shard, group)
        numels = [c.numel() for c in chunks]

        def finish():
            inner.wait()
            unpack_rank_major(scratch, n, list(fulls), chunk_numels=numels)
        return CommHandle((), finish)

    def all_gather_segments(self, output: torch.Tensor, sizes: Sequence[int],
                            group) -> CommHandle:
        """Segments of unequal size: the flat ``output`` is cut into ``sizes`` (one per rank, in
        rank order, back to back); this rank's segment must already hold its values, and every
        other segment receives its rank's. ``wait`` returns ``output``. Wire: each rank's
        segment to each of its ``N-1`` peers (per rank: ``(N-1) x`` its own segment sent,
        ``output`` minus it received); no padding, no scratch. Default: one broadcast per
        non-empty segment (equal sizes: one :meth:`all_gather`)."""
        n, rank = skdist.get_world_size(group), skdist.get_rank(group)
        views = segment_views(output, sizes, n)
        if len(set(sizes)) == 1:
            return self.all_gather(output, views[rank], group)
        handles = [self.broadcast(view, skdist.get_global_rank(group, r), group)
                   for r, view in enumerate(views) if view.numel()]

        def finish():
            for handle in handles:
                handle.wait()
            return output
        return CommHandle((), finish)

    def reduce_scatter(self, input: torch.Tensor, group) -> CommHandle:
        """Sum the ranks' flat ``input`` (``N`` equal rank-major parts); ``wait`` returns this
        rank's part of the sum, a tensor of its own. ``input`` must stay unchanged until then.
        Wire (ring): ``(N-1)/N`` of ``input``'s bytes sent per rank."""
        raise NotImplementedError

    def reduce_scatter_chunks(self, tensors: Sequence[torch.Tensor],
                              chunk_numels: Sequence[int], group, *, scale: float = 1.0,
                              dtype: Optional[torch.dtype] = None) -> CommHandle:
        """Reduce-scatter ``tensors`` laid out as :func:`~shardkit.kernels.pack_rank_major`
        does: each (flattened) tensor ``i`` is cut into ``N`` chunks of ``chunk_numels[i]``
        elements, zero padded; rank ``r`` receives chunk ``r`` of every tensor, in order,
        summed over ranks, times ``scale``, in ``dtype`` (default: the first tensor's).
        ``wait`` returns this rank's ``sum(chunk_numels)`` elements (a tensor of its own). The
        tensors must stay unchanged until then.

        Wire: as :meth:`reduce_scatter` of the packed ``N x sum(chunk_numels)`` elements.
        Default: one :func:`~shardkit.kernels.pack_rank_major` into a buffer of that size (scale
        and cast fused into the copy), then :meth:`reduce_scatter`.
        """
        n = skdist.get_world_size(group)
        packed = pack_rank_major(list(tensors), n, scale=scale, dtype=dtype,
                                 chunk_numels=chunk_numels)
        return self.reduce_scatter(packed, group)

    def reduce_to_owners(self, segments: Sequence[Optional[torch.Tensor]], group) -> CommHandle:
        """Sum ``segments[r]`` over ranks onto rank ``r`` (segments may differ in size, and be
        ``None`` where rank ``r`` owns nothing; every rank passes the same sizes). ``wait``
        returns this rank's summed segment (``None`` if it has none). Default: pad to the
        largest segment and :meth:`reduce_scatter`."""
        n, rank = skdist.get_world_size(group), skdist.get_rank(group)
        sizes = [0 if s is None else s.numel() for s in segments]
        ref = next(s for s in segments if s is not None)
        width = max(sizes)
        packed = torch.zeros(n, width, dtype=ref.dtype, device=ref.device)
        for r, s in enumerate(segments):
            if s is not None:
                packed[r, :s.numel()].copy_(s.reshape(-1))
        inner = self.reduce_scatter(packed.view(-1), group)
        mine = sizes[rank]
        return CommHandle((), lambda: inner.wait()[:mine] if mine else None)

    def broadcast(self, tensor: torch.Tensor, src: int, group) -> CommHandle:
        """Rank ``src``'s ``tensor`` into ``tensor`` on every rank, in place (``src`` is the
        global rank); ``wait`` returns it. Wire: the tensor's bytes, once per receiving rank
        (by ``src``, or along the backend's tree or ring)."""
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor, group, op=skdist.ReduceOp.SUM) -> CommHandle:
        """Reduce ``tensor`` over the ranks with ``op``, in place; ``wait`` returns it. Wire
        (ring): ``2(N-1)/N`` of its bytes sent per rank."""
        raise NotImplementedError

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group) -> CommHandle:
        """Flat ``input`` cut into ``N`` equal chunks: chunk ``j`` goes to rank ``j``, and rank
        ``i``'s chunk for this rank lands in chunk ``i`` of ``output``; ``wait`` returns
        ``output``. Wire: ``(N-1)/N`` of ``input``'s bytes sent per rank."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the transport holds (idempotent)."""


def _reports_broken_links(method: Callable) -> Callable:
    """Make ``method`` (an operation of :class:`ProcessGroupTransport`) raise
    :class:`CollectiveError`, naming itself, where a broken connection makes it fail at launch
    or at ``wait``. Costs nothing until then (the words are formed only on failure)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        # the arguments are bound to find the group only on failure: this runs on every call
        describe = functools.partial(_words, signature, method.__name__, self, args, kwargs)
        try:
            handle = method(self, *args, **kwargs)
        except Exception as error:
            if not skdist.is_broken_link(error):
                raise
            raise skdist.broken_link_error(describe(), error) from error
        handle.describe = describe
        return handle
    return run


def _words(signature: inspect.Signature, name: str, transport: "Transport", args: tuple,
           kwargs: dict) -> str:
    group = signature.bind(transport, *args, **kwargs).arguments.get("group")
    return skdist.operation_words(name, group, transport.describe(group))


class ProcessGroupTransport(Transport):
    """The process group's own collectives (gloo on CPU, NCCL on GPU): the default.

    Memory: nothing held between operations; a reduce-scatter on gloo holds ``(N-1)/N`` of the
    input's size as scratch until it completes. Wire per rank: the ring algorithms' bytes
    (DESIGN.md): all-gather and reduce-scatter ``(N-1)/N`` of the full buffer, all-reduce twice
    that. On gloo, :meth:`prepare` opens two more process groups over each group's ranks (its
    lanes: each direction of a point-to-point exchange on its own connection; see the note
    above :data:`_LANES`), once per process and group; their connections and threads live as
    long as the process group.
    """

    name = "process_group"

    def prepare(self, group) -> None:
        """On gloo with several ranks, open ``group``'s lanes (see the note above
        :data:`_LANES`): collective over its ranks, once per process and group."""
        if _uses_point_to_point(group, _lanes_device()):
            _open_lanes(group)

    def describe(self, group=None) -> str:
        """``"process group (<backend>)"``, the backend of ``group``. Local."""
        return f"process group ({skdist.backend_of(group)})"

    @_reports_broken_links
    def all_gather(self, output, input, group):
        """NCCL: the native collective. gloo: this rank's ``input`` sent straight into every
        peer's ``output``, theirs received in place (no temporary). A non-contiguous ``output``
        goes through a contiguous copy (one temporary), waited for at once."""
        n, rank = skdist.get_world_size(group), skdist.get_rank(group)
        if output.numel() != n * input.numel():
            raise ValueError(f"all_gather: output has {output.numel()} elements; it must be "
                             f"world size {n} x input's {input.numel()}")
        if not output.is_contiguous():
            return _through_contiguous_copy(lambda copy: self.all_gather(copy, input, group),
                                            output, read=False)
        if not _uses_point_to_point(group, output.device):
            return CommHandle([skdist.all_gather_into_tensor(output, input, group=group,
                                                             async_op=True)], lambda: output)
        segments = output.view(n, -1)
        if segments[rank].data_ptr() != input.data_ptr():
            segments[rank].copy_(input)
        ops = _own_segment_to_every_peer(list(segments), rank, group)
        return _p2p_handle(ops, "all_gather", group, lambda: output, shape=(output.numel(),))

    @_reports_broken_links
    def all_gather_chunks(self, fulls, chunks, group):
        """gloo: each rank's chunks sent straight into the peers' ``fulls`` (no scratch, no
        unpacking copy, no padding sent). NCCL: the default (a scratch of ``N x`` the chunks)."""
        if not _uses_point_to_point(group, chunks[0].device if chunks else None):
            return super().all_gather_chunks(fulls, chunks, group)
        # Note: on gloo each rank sends the valid part of its chunk of every tensor straight
        # into the peers' full tensors: no scratch buffer, no unpacking copy, no padding sent.
        n, rank = skdist.get_world_size(group), skdist.get_rank(group)
        peers = [r for r in range(n) if r != rank]
        ops = []
        for full, chunk in zip(fulls, chunks):
            c = chunk.numel()
            for r in range(n):
                lo, hi = r * c, min((r + 1) * c, full.numel())
                if hi <= lo:
                    continue
                if r == rank:
                    full[lo:hi].copy_(chunk.reshape(-1)[:hi - lo])
                    ops.extend(_p2p("send", chunk.reshape(-1)[:hi - lo], rank, peer, group)
                               for peer in peers)
                else:
                    ops.append(_p2p("recv", full[lo:hi], rank, r, group))
        shape = (sum(full.numel() for full in fulls),)
        layout = tuple((full.numel(), chunk.numel()) for full, chunk in zip(fulls, chunks))
        return _p2p_handle(ops, "all_gather", group, None, shape=shape, layout=layout)

    @_reports_broken_links
    def all_gather_segments(self, output, sizes, group):
        """gloo with unequal sizes: one batch of sends and receives in place, exactly the
        unpadded bytes. Otherwise the default."""
        if not _uses_point_to_point(group, output.device) or len(set(sizes)) == 1:
            return super().all_gather_segments(output, sizes, group)
        # Note: on gloo each rank sends its segment straight into every peer's output and
        # receives theirs in place: exactly the unpadded bytes, one batch.
        n, rank = skdist.get_world_size(group), skdist.get_rank(group)
        ops = _own_segment_to_every_peer(segment_views(output, sizes, n), rank, group)
        # counted as (N-1)/N of the output on every rank, as the broadcasts elsewhere count
        nbytes = output.numel() * output.element_size()
        return _p2p_handle(ops, "all_gather", group, lambda: output, logical_bytes=nbytes,
                           shape=(output.numel(),), layout=tuple(map(int, sizes)))

    @_reports_broken_links
    def reduce_scatter(self, input, group):
        """NCCL: the native collective. gloo: part ``r`` sent straight to rank ``r``, which
        sums its own part and what it receives, in rank order (scratch: ``N-1`` parts, until it
        completes). A non-contiguous ``input`` is copied first."""
        return self._reduce_scatter(input, group)

    def _reduce_scatter(self, input, group, layout: Optional[tuple] = None) -> CommHandle:
        """:meth:`reduce_scatter`; on gloo its messages' tag carries ``layout`` too (a packed
        chunked reduce-scatter's, see :meth:`reduce_scatter_chunks`)."""
        n = skdist.get_world_size(group)
        if input.numel() % n:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, not divisible "
                             f"by world size {n}")
        segment = input.numel() // n
        if not input.is_contiguous():  # gloo sends and NCCL carry contiguous tensors only
            input = input.contiguous()
        if not _uses_point_to_point(group, input.device):
            out = torch.empty(segment, dtype=input.dtype, device=input.device)
            work = skdist.reduce_scatter_tensor(out, input, group=group, async_op=True)
            return CommHandle([work], lambda: out)
        # Note: on gloo each rank sends segment r straight to rank r and sums, in rank order,
        # its own segment and what it receives: (N-1)/N of the input on the wire, N-1
        # segments of scratch plus the result, and no copy of the rank's own segment.
        rank = skdist.get_rank(group)
        parts = input.view(n, segment)
        received = torch.empty(n - 1, segment, dtype=input.dtype, device=input.device)
        peers = [r for r in range(n) if r != rank]
        ops = []
        for buf, r in zip(received, peers):
            ops.append(_p2p("send", parts[r], rank, r, group))
            ops.append(_p2p("recv", buf, rank, r, group))

        def finish():
            ordered = [parts[rank] if r == rank else received[peers.index(r)] for r in range(n)]
            total = torch.add(ordered[0], ordered[1])  # its own storage: the caller keeps it
            for part in ordered[2:]:
                total.add_(part)
            return total
        return _p2p_handle(ops, "reduce_scatter", group, finish, shape=(input.numel(),),
                           layout=layout)

    @_reports_broken_links
    def reduce_scatter_chunks(self, tensors, chunk_numels, group, *, scale=1.0, dtype=None):
        """gloo, tensors all in a ``dtype`` of 4 bytes or more: chunks sent straight from the
        tensors (no packed copy), received into one ``sum(chunk_numels)`` buffer per peer.
        Otherwise the default's packed copy, then :meth:`reduce_scatter`."""
        dtype = dtype or (tensors[0].dtype if tensors else None)
        if not tensors or not _uses_point_to_point(group, tensors[0].device):
            return super().reduce_scatter_chunks(tensors, chunk_numels, group, scale=scale,
                                                 dtype=dtype)
        n = skdist.get_world_size(group)
        if dtype.itemsize < 4 or any(t.dtype != dtype for t in tensors):
            # packed (see the note below), its tag carrying the chunk layout as the unpacked
            # path's does, marked "packed" so that the two never match each other either
            packed = pack_rank_major(list(tensors), n, scale=scale, dtype=dtype,
                                     chunk_numels=chunk_numels)
            chunks = _check_chunks([t.numel() for t in tensors], chunk_numels, n)
            return self._reduce_scatter(packed, group, layout=("packed", *chunks))
        # Note: on gloo the packed copy is skipped. Each rank sends peer r chunk r of every
        # tensor straight from the tensor (one send per tensor; a chunk that runs into the
        # padding goes through a chunk-sized temporary, so the padded bytes travel as with
        # the packed buffer), receives its own chunks into one shard-sized buffer per peer,
        # adds its own chunks in place and scales once. Tensors of another dtype than the
        # reduction's take the packed path (its copy is also the cast), and so do 16-bit
        # reductions, whose sum before the scale could overflow where the pre-scaled one fits.
        # The choice depends only on what every rank shares (sizes, dtypes, device): a
        # non-contiguous tensor is copied here rather than sent down the packed path, whose
        # one message per peer the peers' per-tensor receives would not match (silent wrong
        # sums on one rank, gloo aborting the other).
        rank = skdist.get_rank(group)
        flats = [t.contiguous().view(-1) for t in tensors]
        chunks = _check_chunks([f.numel() for f in flats], chunk_numels, n)
        offsets = [sum(chunks[:i]) for i in range(len(chunks))]
        segment = sum(chunks)
        peers = [r for r in range(n) if r != rank]
        received = [torch.empty(segment, dtype=dtype, device=flats[0].device) for _ in peers]
        ops = []
        for buf, r in zip(received, peers):
            for flat, c, off in zip(flats, chunks, offsets):
                if c:
                    ops.append(_p2p("send", _padded_chunk(flat, r, c), rank, r, group))
                    ops.append(_p2p("recv", buf[off:off + c], rank, r, group))

        def finish():
            # one tensor's chunk at a time, so that it is still in cache when scaled
            total = received[0]  # a peer's chunks; its padding is zeros, like this rank's
            for flat, c, off in zip(flats, chunks, offsets):
                mine = total[off:off + c]
                own = chunk_of_rank(flat, rank, c)
                if own.numel():
                    mine[:own.numel()].add_(own)
                for other in received[1:]:
                    mine.add_(other[off:off + c])
                if scale != 1.0:
                    mine.mul_(scale)
            return total
        return _p2p_handle(ops, "reduce_scatter", group, finish, shape=(n * segment,),
                           layout=tuple(chunks))

    @_reports_broken_links
    def reduce_to_owners(self, segments, group):
        """NCCL: the default when padding costs at most 10%, else one ``reduce`` per
        non-empty segment. gloo: segment ``r`` sent straight to rank ``r`` (``(N-1)/N`` of
        the bucket per rank), received into ``N-1`` buffers of that segment's size. Except
        through the default, the sum is made in place in this rank's own segment."""
        # Note: on NCCL a balanced bucket is one reduce-scatter (padding it costs at most 10%).
        # On gloo each rank sends segment r straight to its owner r, which sums what it
        # receives: exactly (N-1)/N of the bucket per rank. gloo's own reduce moved about twice
        # that between two nodes (measured on the simulated cluster).
        sizes = [0 if s is None else s.numel() for s in segments]
        ref = next(s for s in segments if s is not None)
        if not _uses_point_to_point(group, ref.device):
            if max(sizes) * len(sizes) <= 1.1 * sum(sizes):
                return super().reduce_to_owners(segments, group)
            works = [skdist.reduce(s, dst=skdist.get_global_rank(group, r), group=group,
                                   async_op=True)
                     for r, s in enumerate(segments) if s is not None and s.numel()]
            mine = segments[skdist.get_rank(group)]
            return CommHandle(works, lambda: mine)
        n, rank = skdist.get_world_size(group), skdist.get_rank(group)
        mine = segments[rank]
        received = [torch.empty_like(mine) for _ in range(n - 1)] if sizes[rank] else []
        ops, peers = [], [r for r in range(n) if r != rank]
        for r in peers:
            if sizes[r]:
                ops.append(_p2p("send", segments[r], rank, r, group))
        for buf, r in zip(received, peers):
            ops.append(_p2p("recv", buf, rank, r, group))

        def finish():
            if not sizes[rank]:
                return None
            for buf in received:
                mine.add_(buf)
            return mine
        # a rooted op: counted as (N-1)/N of the whole bucket on every rank (DESIGN.md)
        nbytes = sum(sizes) * ref.element_size()
        return _p2p_handle(ops, "reduce", group, finish, logical_bytes=nbytes,
                           shape=(sum(sizes),), layout=tuple(sizes))

    @_reports_broken_links
    def broadcast(self, tensor, src, group):
        """The native collective. A non-contiguous ``tensor`` goes through a contiguous copy
        (one temporary), waited for at once."""
        if not tensor.is_contiguous():
            return _through_contiguous_copy(
                lambda copy: self.broadcast(copy, src, group), tensor)
        return CommHandle([skdist.broadcast(tensor, src=src, group=group, async_op=True)],
                          lambda: tensor)

    @_reports_broken_links
    def all_reduce(self, tensor, group, op=skdist.ReduceOp.SUM):
        """The native collective. A non-contiguous ``tensor`` goes through a contiguous copy
        (one temporary), waited for at once."""
        if not tensor.is_contiguous():
            return _through_contiguous_copy(
                lambda copy: self.all_reduce(copy, group, op), tensor)
        return CommHandle([skdist.all_reduce(tensor, op=op, group=group, async_op=True)],
                          lambda: tensor)

    @_reports_broken_links
    def all_to_all(self, output, input, group):
        """The native ``all_to_all_single``; the ranks' sizes are not checked against each
        other."""
        # the wrappers' sizes come from one partition on every rank: no argument agreement
        work = skdist.all_to_all_single(output, input, group=group, async_op=True,
                                        check_ranks=False)
        return CommHandle([work], lambda: output)


def segment_views(output: torch.Tensor, sizes: Sequence[int], n: int) -> list[torch.Tensor]:
    """``output`` cut into ``sizes`` (one per rank); a clear error where they do not fit.
    Views only: no copy, no communication."""
    sizes = list(sizes)
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != output.numel():
        raise ValueError(f"all_gather_segments: sizes={sizes} must be {n} non-negative sizes "
                         f"(one per rank) summing to output's {output.numel()} elements")
    return list(output.view(-1).split(sizes))


_WARNED: set = set()  # keys warn_once has warned about in this process


def warn_once(key: str, message: str, stacklevel: int = 3) -> None:
    """A RuntimeWarning the first time ``key`` comes up in this process, for a transport's
    fallback or degraded path that runs again and again. ``stacklevel`` as for
    ``warnings.warn``, counted from here: the default points at whoever called the function
    that calls this one. Holds one set of keys per process; no communication."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def _own_segment_to_every_peer(views: Sequence[torch.Tensor], rank: int,
                               group) -> list:
    """The sends and receives of an in-place all-gather over ``views`` (one per rank): this
    rank's view to every peer, every peer's into its view. Empty views move nothing."""
    ops = []
    for peer, view in enumerate(views):
        if peer == rank:
            continue
        if views[rank].numel():
            ops.append(_p2p("send", views[rank], rank, peer, group))
        if view.numel():
            ops.append(_p2p("recv", view, rank, peer, group))
    return ops


# Note: lanes. gloo runs a pair of ranks' messages over one connection whose state one lock
# guards; the process's gloo thread reads arriving messages under it, and a rank's own thread
# takes it to post a receive or to write a send whose receive the peer has announced. When a
# rank writes its part of an exchange while its peer's part is arriving on the same connection,
# the two contend (and gloo's thread, finding the lock taken, polls again at once). So on gloo
# the transport carries the data of a point-to-point exchange from a lower to a higher rank on
# one process group over the same ranks (lane "up") and back on another (lane "down"): each
# connection then carries data one way. Measured on the MLP 16x1024 at world 2 (FSDP, whose
# per-unit gathers and reduce-scatters are such exchanges): steps 4.7% and 6.6% faster than
# on one group, in 2 interleaved A/B runs of 40 rounds.
# id(group) -> (group, (up, down)); the group is held so the id stays its own
_LANES = skdist.GroupCache()


def _opened_lanes(group) -> Optional[tuple]:
    """``group``'s ``(up, down)`` lanes, or ``None`` where they were not opened."""
    resolved = skdist.resolved_group(group)
    entry = _LANES.current().get(id(resolved))
    return entry[1] if entry is not None and entry[0] is resolved else None


def _open_lanes(group) -> None:
    """Create ``group``'s two lanes, once per process and group (collective over its ranks: two
    process groups, with ``group``'s timeout). Costs two sets of gloo connections and threads;
    nothing per operation."""
    if _opened_lanes(group) is not None:
        return
    resolved = skdist.resolved_group(group)
    timeout = skdist.timeout_of(resolved)
    # gloo explicitly: a gloo group beside an NCCL default group keeps gloo lanes
    lanes = (skdist.group_of_same_ranks(resolved, timeout, backend="gloo"),
             skdist.group_of_same_ranks(resolved, timeout, backend="gloo"))
    _LANES[id(resolved)] = (resolved, lanes)


def _lane(group, upward: bool):
    """The process group that carries data from a lower to a higher rank (``upward``) or back:
    one of ``group``'s lanes once opened (by :meth:`ProcessGroupTransport.prepare`, on every
    rank alike), else ``group`` itself."""
    lanes = _opened_lanes(group)
    return group if lanes is None else lanes[0 if upward else 1]


def _p2p(op: str, tensor: torch.Tensor, rank: int, peer: int, group) -> skdist.P2POp:
    """A send of ``tensor`` to, or a receive into it from, group rank ``peer`` (this rank is
    ``rank``), on the lane of its direction."""
    src, dst = (rank, peer) if op == "send" else (peer, rank)
    return skdist.P2POp(op, tensor, skdist.get_global_rank(group, peer), _lane(group, src < dst))


def _issue(ops: list, counted_as: str, group, logical_bytes: Optional[int] = None,
           shape: Optional[tuple] = None, layout: Optional[tuple] = None) -> list:
    """Post ``ops`` (receives first), recorded as one ``counted_as`` on ``group``: of
    ``logical_bytes`` (the op's full size, counted by DESIGN.md's convention) when given, else
    of the bytes the sends move. ``shape``: the collective's logical shape, alike on every rank;
    ``layout``: how it is cut between ranks or tensors where that is not implied by ``shape``
    (an uneven all-gather's per-rank sizes, a chunked operation's chunk sizes), alike on every
    rank. The collective debug mode compares them and the ops' dtype.

    The ops carry a tag made from the operation, its dtype, shape and layout
    (:func:`operation_tag`): gloo pairs messages by peer and tag, so where ranks issue
    different collectives (an all-gather against a reduce-scatter, other sizes, dtypes, or the
    same total cut differently between ranks) no receive takes another operation's bytes (it
    took them as silent wrong values, or gloo aborted the process that received a longer
    message): the ranks wait until the group's timeout instead, and
    ``SHARDKIT_DEBUG_COLLECTIVES=1`` names each rank's call. Costs one CRC of a few numbers."""
    tag = operation_tag(counted_as, ops[0].tensor.dtype if ops else None, shape, layout)
    tagged = [replace(op, tag=tag) for op in ops]
    if layout is None or not collective_check.debug_collectives_enabled():
        return skdist.batch_isend_irecv(tagged, counted_as=counted_as, group=group,
                                        logical_bytes=logical_bytes, logical_shape=shape)
    with collective_check.checking_layout(layout):
        return skdist.batch_isend_irecv(tagged, counted_as=counted_as, group=group,
                                        logical_bytes=logical_bytes, logical_shape=shape)


def _p2p_handle(ops: list, counted_as: str, group, finish: Optional[Callable], *,
                shape: tuple, layout: Optional[tuple] = None,
                logical_bytes: Optional[int] = None) -> CommHandle:
    """The handle of a collective built from the point-to-point ``ops``, issued by
    :func:`_issue` (see it for the arguments); it remembers the call, so that a timeout can
    name every rank's (:func:`_calls_when_timed_out`)."""
    works = _issue(ops, counted_as, group, logical_bytes=logical_bytes, shape=shape,
                   layout=layout)
    handle = CommHandle(works, finish, completes_when_waited=True)
    handle.call = (group, counted_as, ops[0].tensor.dtype if ops else None, shape, layout)
    return handle


# Note: a point-to-point collective whose ranks disagree (see _issue) waits for the group's
# timeout. Only then, each rank posts its call on the default store and reads its peers':
# nothing is exchanged while the collectives agree, and the peers that timed out in the same
# mismatch post at about the same moment.
_PEER_CALL_WAIT_S = 5.0
_TIMEOUTS_NAMED: dict = {}  # store key prefix -> how many timeouts this process named there


def _call_words(name: str, dtype: Optional[torch.dtype], shape: Optional[tuple],
                layout: Optional[tuple]) -> str:
    words = f"{name}(shape={list(shape) if shape is not None else None}, dtype={dtype}"
    return words + (")" if layout is None else f", layout={list(layout)})")


def _calls_when_timed_out(group, name: str, dtype, shape, layout) -> str:
    """Words naming this rank's call and, as each peer of ``group`` posts it on the default
    store when its own wait times out (or its pair was closed by this rank's timeout), each
    peer's, read for up to :data:`_PEER_CALL_WAIT_S` seconds. Runs only on a timeout; ``""``
    if the store cannot be reached."""
    mine = _call_words(name, dtype, shape, layout)
    try:
        store, me, prefix, peers = _timed_out_slot(group)
    except Exception:  # noqa: BLE001 - the store is gone too: the backend's words stand
        return ""
    found: dict = {}
    # Note: a store whose host is hung (stopped, or its node unreachable) lets a set through
    # but never answers a wait, which then blocks far beyond its own timeout (measured: over
    # 3 minutes for a 5 s wait on torch 2.13): the store is read on a daemon thread, and the
    # error is raised when the wait is up whether or not that thread came back.
    reader = threading.Thread(target=_post_and_read_calls,
                              args=(store, prefix, me, mine, peers, found), daemon=True)
    reader.start()
    reader.join(_PEER_CALL_WAIT_S + 0.25)  # its own reads end at _PEER_CALL_WAIT_S
    if not found.get("posted"):
        return ""
    theirs = [f"global rank {peer}: {_peer_call(found, peer, reader.is_alive())}"
              for peer in peers]
    return (f"When the timeout fired, this rank (global rank {me}) waited in {mine}; "
            f"its peers' calls that timed out: " + "; ".join(theirs) + ".")


def _peer_call(found: dict, peer: int, store_stuck: bool) -> str:
    if peer in found:
        return found[peer]
    if store_stuck:
        return f"not read: the store did not answer within {_PEER_CALL_WAIT_S:g} s"
    return f"no timed-out call within {_PEER_CALL_WAIT_S:g} s (busy elsewhere, or dead)"


def _post_call_when_closed(group, name: str, dtype, shape, layout) -> None:
    """Post this rank's call for a peer whose wait timed out first (gloo closes the pair on
    a timeout, so this rank's own wait fails as "closed by peer", not timed out), without
    reading the peers'. Bounded as :func:`_calls_when_timed_out`; never raises."""
    try:
        store, me, prefix, _ = _timed_out_slot(group)
    except Exception:  # noqa: BLE001 - for an error message only
        return
    poster = threading.Thread(target=_post_and_read_calls,
                              args=(store, prefix, me, _call_words(name, dtype, shape, layout),
                                    [], {}), daemon=True)
    poster.start()
    poster.join(1.0)


def _timed_out_slot(group) -> tuple:
    """``(store, global rank, key prefix, peers' global ranks)`` of this rank's next timed-out
    call on ``group``: the n-th timeout on a group posts under its n-th prefix on every rank."""
    from torch.distributed.distributed_c10d import _get_default_store
    store, me = _get_default_store(), skdist.get_rank()
    resolved = skdist.resolved_group(group)
    key = f"shardkit/timed_out/{getattr(resolved, 'group_name', None) or id(resolved)}"
    peers = [peer for peer in skdist.group_ranks(group) if peer != me]
    count = _TIMEOUTS_NAMED[key] = _TIMEOUTS_NAMED.get(key, 0) + 1
    return store, me, f"{key}/{count}/", peers


def _post_and_read_calls(store, prefix: str, me: int, mine: str, peers: list,
                         found: dict) -> None:
    """Post ``mine`` under ``prefix``, then read each of ``peers``' within
    :data:`_PEER_CALL_WAIT_S` seconds into ``found`` (``found["posted"]`` once posted)."""
    try:
        store.set(prefix + str(me), mine)
    except Exception:  # noqa: BLE001 - the store is gone: nothing to name
        return
    found["posted"] = True
    deadline = time.monotonic() + _PEER_CALL_WAIT_S
    for peer in peers:
        try:
            left = max(deadline - time.monotonic(), 0.01)
            store.wait([prefix + str(peer)], datetime.timedelta(seconds=left))
            found[peer] = store.get(prefix + str(peer)).decode()
        except Exception:  # noqa: BLE001 - the store's timeout, whatever it is called
            continue


def operation_tag(name: str, dtype: Optional[torch.dtype], shape: Optional[tuple],
                  layout: Optional[tuple] = None) -> int:
    """The tag of one collective's point-to-point messages: alike on every rank that issues
    the same collective (``name``, ``dtype``, logical ``shape`` and ``layout``: plain values
    every rank derives alike), never 0 (the tag of sends without one). gloo's tags are
    non-negative 32-bit integers. Costs one CRC32 of the arguments' ``repr``."""
    key = (name, str(dtype), shape) if layout is None else (name, str(dtype), shape, layout)
    return 1 + zlib.crc32(repr(key).encode()) % (2 ** 31 - 2)


def exchange_equal_chunks(output: torch.Tensor, input: torch.Tensor, group, *,
                          counted_as: str, layout: Optional[tuple] = None) -> CommHandle:
    """An all-to-all for transports that build their collectives from it: the flat contiguous
    ``input`` cut into ``N`` equal chunks, chunk ``j`` to rank ``j``, rank ``i``'s chunk for
    this rank into chunk ``i`` of ``output``; recorded as one ``counted_as``. ``layout``: what
    the bytes stand for (e.g. a quantized layout), alike on every rank. ``wait`` returns
    ``output``.

    On gloo the chunks travel as sends and receives tagged with :func:`operation_tag`, so
    ranks that disagree on the sizes wait until the group's timeout (gloo's own all-to-all
    aborted the rank that received a longer message and handed its peer the uninitialised
    rest of a shorter one); elsewhere (NCCL) it is the native collective. Wire: ``(N-1)/N`` of
    ``input``'s bytes sent per rank, as the native one; memory: nothing beyond ``output``."""
    n = skdist.get_world_size(group)
    if not _uses_point_to_point(group, input.device):
        work = skdist.all_to_all_single(output, input, group=group, async_op=True,
                                        counted_as=counted_as, check_ranks=False)
        return CommHandle([work], lambda: output)
    if output.numel() != input.numel() or input.numel() % n or output.dtype != input.dtype \
            or not output.is_contiguous():
        raise ValueError(f"{counted_as}: output ({output.numel()} x {output.dtype}) and input "
                         f"({input.numel()} x {input.dtype}) must have the same size, divisible "
                         f"by world size {n}, and dtype, and output must be contiguous")
    rank = skdist.get_rank(group)
    sent, landed = input.reshape(n, -1), output.view(n, -1)
    landed[rank].copy_(sent[rank])
    ops = []
    for peer in range(n):
        if peer != rank and sent.shape[1]:
            ops.append(_p2p("send", sent[peer], rank, peer, group))
            ops.append(_p2p("recv", landed[peer], rank, peer, group))
    handle = _p2p_handle(ops, counted_as, group, lambda: output, shape=(input.numel(),),
                         layout=layout)
    handle.describe = functools.partial(skdist.operation_words, counted_as, group)
    return handle


def _through_contiguous_copy(run: Callable, tensor: torch.Tensor,
                             read: bool = True) -> CommHandle:
    """``run(copy)`` on a contiguous copy of the non-contiguous ``tensor`` (its values copied
    in where ``read``: an in-place all-reduce or broadcast; an empty one for an all-gather's
    output), waited for at once, then the copy written back into ``tensor``.

    Note: torch's collectives cannot fill a non-contiguous tensor in place, and gloo takes a
    strided view's first element and ``numel`` for its memory: a column of a matrix was
    reduced with its neighbours' elements, silently, and a channels-last tensor met a peer's
    contiguous one element by element in another order. Waited for at once, so that
    ``tensor`` holds the result even when the returned handle is dropped unwaited (which for
    other handles still completes the operation); this call does not overlap with compute.
    Costs one temporary of ``tensor``'s size."""
    landing = tensor.contiguous() if read else \
        torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    run(landing).wait()
    tensor.copy_(landing)
    return CommHandle((), lambda: tensor)


def _uses_point_to_point(group, device: Optional[torch.device] = None) -> bool:
    """Whether ``group``'s operations on tensors of ``device`` (default: the CPU) run as
    sends and receives: where gloo carries them (a ``"gloo"`` group, and torch's default and
    per-device groups, ``"undefined"`` or ``"cpu:gloo,cuda:nccl"``, for CPU tensors), with
    several ranks. gloo's all-gather copies its output through a temporary and its
    reduce-scatter runs synchronously in the caller (measured 2-4x slower than sends of the
    same bytes here), and its works report completion only when waited for."""
    return skdist.get_world_size(group) > 1 and skdist._gloo_carries(group, device)


def _lanes_device() -> torch.device:
    """The device whose tensors the wrappers of this process exchange, for choosing at
    :meth:`ProcessGroupTransport.prepare` whether lanes pay (CUDA where there is one)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _padded_chunk(flat: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """Chunk ``r`` (``c`` elements) of ``flat``: a view when it lies inside ``flat``, else a
    zero-padded copy of what does."""
    chunk = chunk_of_rank(flat, r, c)
    if chunk.numel() == c:
        return chunk
    padded = flat.new_zeros(c)
    padded[:chunk.numel()].copy_(chunk)
    return padded


_DEFAULT = ProcessGroupTransport()


def default_transport() -> ProcessGroupTransport:
    """The process-group transport every wrapper uses unless given ``comm=``."""
    return _DEFAULT


def resolve_transport(comm, what: str) -> Transport:
    """``comm`` checked: ``None`` (the default transport) or a :class:`Transport`."""
    if comm is None:
        return _DEFAULT
    if not isinstance(comm, Transport):
        raise TypeError(f"{what}(comm={comm!r}): expected None (the process group's own "
                        f"collectives) or a shardkit.transport.Transport such as "
                        f"ProcessGroupTransport() or SharedMemoryTransport()")
    return comm
