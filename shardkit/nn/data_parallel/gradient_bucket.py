"""Gradient buckets of ShardedDataParallel: which gradients travel together, and how a bucket
is reduced onto the ranks that own its parameters.

A :class:`BucketLayout` is data, fixed until the trainable set changes: the parameters of one
bucket in backward order, their owning ranks, and per owner the segment of the packed buffer
that holds its parameters' gradients followed by one presence flag per parameter. Every rank
computes the same layouts, so every rank packs the same shapes and issues the same collectives
in the same order.

A :class:`ReduceToOwners` packs the gradients of one bucket per owner with
:func:`shardkit.kernels.pack_rank_major`, hands the segments to the wrapper's transport
(:meth:`shardkit.transport.Transport.reduce_to_owners`, asynchronous) and, once waited, hands
each owned parameter its reduced gradient.

Note: presence flags. A parameter that took no part in a forward has no gradient on that rank.
Its slot is packed as zeros and its flag as 0; after the reduction the owner sees the flags of
all ranks summed, so it knows whether *any* rank produced a gradient. When none did, the owner
leaves ``p.grad = None`` exactly as single-process training would, and optimizers that skip
grad-less parameters (AdamW's weight decay, momentum) stay in step with the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from shardkit.kernels import pack_rank_major

__all__ = ["BucketLayout", "plan_buckets", "BucketReduction", "ReduceToOwners"]


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: parameters in backward order, their owners, and per-owner packing.

    Attributes:
        index: position in launch order (collectives are issued in this order on every rank).
        params: the bucket's parameters, in backward order.
        owners: group rank owning each parameter.
        by_owner: per group rank, the indices into ``params`` it owns (ascending).
        comm_dtype: dtype the gradients travel in.

    A segment (one per owner) is the owned gradients back to back, then one flag per owned
    parameter: ``segment_numels[r] = sum(numel of r's params) + len(by_owner[r])``.
    """

    index: int
    params: tuple
    owners: tuple
    by_owner: tuple
    comm_dtype: torch.dtype

    @property
    def world_size(self) -> int:
        """Number of segments: the group's ranks (one per owner)."""
        return len(self.by_owner)

    @property
    def segment_numels(self) -> tuple:
        """Elements of each owner's segment: its gradients plus one flag per owned parameter."""
        return tuple(sum(self.params[i].numel() for i in idx) + len(idx) for idx in self.by_owner)

    @property
    def numel(self) -> int:
        """Elements of all segments together (gradients plus flags), no padding."""
        return sum(self.segment_numels)

    def balance(self) -> float:
        """``world_size * largest segment / all segments``: 1.0 is perfectly balanced."""
        total = self.numel
        return self.world_size * max(self.segment_numels) / total if total else 1.0


def plan_buckets(params: Sequence[torch.Tensor], owner_of: Callable[[torch.Tensor], int],
                 world_size: int, bucket_bytes: int,
                 comm_dtype_of: Callable[[torch.Tensor], torch.dtype]) -> list[BucketLayout]:
    """Cut ``params`` (given in backward order) into buckets of at most ``bucket_bytes`` bytes
    in their communication dtype; a parameter larger than that gets a bucket of its own, and
    a change of device or communication dtype starts a new bucket. ``bucket_bytes=0``: one
    parameter per bucket. Pure function of its inputs: every rank plans the same buckets."""
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes = 0
    key = None
    for p in params:
        dtype = comm_dtype_of(p)
        nbytes = p.numel() * torch.empty((), dtype=dtype).element_size()
        new_key = (p.device, dtype)
        if current and (new_key != key or current_bytes + nbytes > bucket_bytes):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(p)
        current_bytes += nbytes
        key = new_key
    if current:
        groups.append(current)
    layouts = []
    for index, group in enumerate(groups):
        owners = tuple(owner_of(p) for p in group)
        by_owner = tuple(tuple(i for i, o in enumerate(owners) if o == r)
                         for r in range(world_size))
        layouts.append(BucketLayout(index, tuple(group), owners, by_owner, comm_dtype_of(group[0])))
    return layouts


class BucketReduction:
    """Reduce one bucket's gradients onto their owners, asynchronously.

    ``launch`` packs (gradients pre-divided by the world size, cast to the communication
    dtype), issues the collective(s) and returns at once; ``finish`` waits and returns, for
    the parameters this rank owns, ``(param, reduced gradient or None)``. Memory while in
    flight: the packed buffer (about the bucket's size) and the transport's scratch (on gloo
    ``N-1`` receive buffers of this rank's segment); after ``finish`` only this rank's
    segment stays alive, as the storage of its reduced gradients.
    """

    name = "abstract"

    def __init__(self, layout: BucketLayout, group, rank: int):
        self.layout = layout
        self.group = group
        self.rank = rank
        self._handles: list = []
        self._own_segment: Optional[torch.Tensor] = None
        self._in_flight: list[torch.Tensor] = []

    # -- packing
    def _pack_segment(self, owner: int, grads: Sequence[Optional[torch.Tensor]],
                      out: torch.Tensor) -> None:
        """Pack owner ``owner``'s gradients and presence flags into ``out`` (its segment)."""
        layout = self.layout
        idx = layout.by_owner[owner]
        if not idx:
            return
        device = out.device
        sources, present = [], []
        for i in idx:
            g = grads[i]
            present.append(g is not None)
            if g is None:  # no gradient on this rank: it contributes zeros
                g = torch.zeros(layout.params[i].numel(), dtype=out.dtype, device=device)
            elif g.layout != torch.strided:
                # nn.Embedding(sparse=True): reduced densely, the owner gets a dense gradient
                # (one dense copy of that parameter's gradient while it is packed)
                g = g.to_dense()
            sources.append(g)
        sources.append(torch.tensor(present, dtype=out.dtype, device=device))
        pack_rank_major(sources, 1, scale=1.0 / layout.world_size, dtype=out.dtype, out=out)

    def launch(self, grads: list) -> None:
        """Pack ``grads`` (a list, one per ``layout.params``, ``None``: no gradient on this
        rank) and issue the asynchronous reduction. The list's entries are set to ``None`` as
        they are packed, so that a gradient the caller no longer holds elsewhere is freed as
        soon as it is copied (the bucket's transient is then about one bucket plus one
        segment, not two buckets)."""
        raise NotImplementedError

    def tensors_in_flight(self) -> list[torch.Tensor]:
        """Buffers alive until :meth:`finish` (reported as gradient memory; the transport's
        receive buffers, ``N-1`` of this rank's segment on gloo, are not among them)."""
        return list(self._in_flight)

    def is_complete(self) -> bool:
        """Whether the reduction has arrived (a poll that never blocks; :meth:`finish` still
        takes the result). Call :meth:`watch` after :meth:`launch` for a true poll on gloo."""
        return all(handle.is_completed() for handle in self._handles)

    def has_arrived(self) -> bool:
        """Whether the reduction is known to have arrived, so that :meth:`finish` will not
        block: :meth:`is_complete`, but ``False`` for an operation whose handle cannot tell
        (one that finishes inside its closure, as a shared-memory ring or a reduce-scatter
        behind padding does: their ``is_completed()`` reads ``True`` from the start)."""
        return all(handle.polls() and handle.is_completed() for handle in self._handles)

    def watch(self) -> None:
        """Let :meth:`is_complete` see the arrival of operations that complete only when waited
        for (:meth:`shardkit.transport.CommHandle.watch`)."""
        for handle in self._handles:
            handle.watch()

    def finish(self) -> list[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """Wait; return ``(param, reduced gradient)`` for each owned parameter, ``None`` when no
        rank had a gradient for it. Gradients are views into this rank's segment (or casts
        of them to the parameter's dtype)."""
        for handle in self._handles:
            handle.wait()
        self._handles = []
        self._in_flight = []
        segment, self._own_segment = self._own_segment, None
        return self._split_own_segment(segment)

    def _split_own_segment(self, segment: Optional[torch.Tensor]):
        layout = self.layout
        idx = layout.by_owner[self.rank]
        if not idx:
            return []
        numels = [layout.params[i].numel() for i in idx]
        grads_numel = sum(numels)
        flags = segment[grads_numel:grads_numel + len(idx)]
        present = (flags != 0).tolist()
        out, offset = [], 0
        for i, n, has_grad in zip(idx, numels, present):
            p = layout.params[i]
            view = segment[offset:offset + n].view(p.shape)
            offset += n
            if not has_grad:
                out.append((p, None))
            else:
                grad = view if view.dtype == p.dtype else view.to(p.dtype)
                out.append((p, _in_layout_of(grad, p)))
        return out


def _in_layout_of(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``p``'s strides: itself for a contiguous parameter, a copy for a transposed
    or permuted one (one more gradient-sized buffer for that parameter only).

    Note: torch's fused optimizers (``AdamW(fused=True)``, which OSS picks for fp32 on its own)
    walk a parameter and its gradient as flat memory; a contiguous gradient of a transposed
    parameter would update the wrong elements."""
    if p.is_contiguous() or grad.stride() == p.stride():
        return grad
    return torch.empty_like(p, dtype=grad.dtype).copy_(grad)


class ReduceToOwners(BucketReduction):
    """The bucket's per-owner segments reduced onto their owners by the transport's
    :meth:`~shardkit.transport.Transport.reduce_to_owners` (the process-group transport sends
    one reduce per owner on gloo, a reduce-scatter of a balanced bucket on NCCL). Wire (DESIGN
    convention): ``(N-1)/N`` of the bucket (plus padding where a reduce-scatter pads)."""

    name = "reduce_to_owners"

    def __init__(self, layout: BucketLayout, group, rank: int, transport):
        super().__init__(layout, group, rank)
        self.transport = transport

    def launch(self, grads):
        layout = self.layout
        device = layout.params[0].device
        segments = []
        for r, numel in enumerate(layout.segment_numels):
            if numel == 0:
                segments.append(None)
                continue
            buf = torch.empty(numel, dtype=layout.comm_dtype, device=device)
            self._pack_segment(r, grads, buf)
            for i in layout.by_owner[r]:
                grads[i] = None  # packed: the copy in ``buf`` is what travels
            segments.append(buf)
        self._in_flight = [s for s in segments if s is not None]
        handle = self.transport.reduce_to_owners(segments, self.group)
        self._handles = [_OwnSegment(handle, self)]


class _OwnSegment:
    """Waits for the reduction and keeps this rank's summed segment for :meth:`finish`."""

    def __init__(self, handle, reduction: BucketReduction):
        self._handle, self._reduction = handle, reduction

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def polls(self) -> bool:
        """:meth:`shardkit.transport.CommHandle.polls`: trusting a handle that cannot poll
        would make every reduction synchronous."""
        return self._handle.polls()

    def watch(self) -> None:
        self._handle.watch()

    def wait(self) -> None:
        self._reduction._own_segment = self._handle.wait()
