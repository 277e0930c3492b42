"""Bucketed parameter re-synchronisation for OSS (ZeRO-1): :class:`ParamSync`.

After each rank has stepped the parameters it owns, every rank needs every updated parameter.
Instead of one broadcast per parameter, the owned parameters are laid out in *flat buckets*:
bucket ``k`` is one buffer of ``world_size`` segments, segment ``r`` holding (contiguous) the
parameters rank ``r`` owns in that bucket. The parameters are views into these buffers (each
process's own memory), so one in-place all-gather per bucket, by the optimizer's transport
(:mod:`shardkit.transport`), re-synchronises them with no packing or unpacking copy.

Note: segments are padded to one size (one plain all-gather: NCCL's fastest) where that pads at
most :data:`~shardkit.optim.partition.MAX_PADDING_FRACTION` of the bucket; where one owner's
share is much larger (a parameter bigger than ``Ψ/N``, e.g. GPT-2's 38.6M-element tied
embedding at 4 ranks, which would pad the buffer by 24%, or 2.5x at 8 ranks), the segments keep
their own sizes and the bucket moves with :meth:`~shardkit.transport.Transport.all_gather_segments`
(no padding in memory or on the wire).

Which rank owns which parameter, and which bucket each parameter is in, is decided by
:func:`shardkit.optim.partition.plan_ownership`; this module only lays the buckets out and moves
them, either all at once after a whole step or bucket by bucket while the next bucket is being
stepped, and (with :meth:`ParamSync.overlap_with`) lets the last all-gathers finish during the
next forward.

Memory: the buffers replace the parameters' own storage (``Ψ`` plus at most 3% of padding);
with ``broadcast_fp16`` a transient 16-bit copy of each bucket in flight, at most
:data:`WIRE_COPIES_IN_FLIGHT` buckets at a time (the oldest is finished before another starts),
lives during the sync. Communication per step per rank: ``(N-1)/N · (Ψ + padding)`` elements
in the parameters' dtype (fp16 with ``broadcast_fp16=True``, bf16 with
``broadcast_fp16=torch.bfloat16``: half the bytes of fp32), one all-gather per bucket; in an
unpadded bucket each rank sends its own segment to its ``N-1`` peers, ``(N-1)/N`` of the
bucket on average over the ranks.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence, Union

import torch

from shardkit.transport import Transport, default_transport
from shardkit.optim.partition import MAX_PADDING_FRACTION, OwnershipPlan

__all__ = ["ParamSync", "FlatParamBucket", "build_buckets", "broadcast_wire_dtype"]

_WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Buckets whose all-gather may be in flight at once with a 16-bit copy of their own (with
# ``broadcast_fp16``): enough to overlap one bucket's all-gather with the next one's step, few
# enough that the copies cost two buckets, not the model (before: every bucket's, ``2Ψ`` bytes)
WIRE_COPIES_IN_FLIGHT = 2


def broadcast_wire_dtype(broadcast_fp16: Union[bool, torch.dtype]) -> Optional[torch.dtype]:
    """The dtype OSS's parameter sync sends fp32 parameters in, from its ``broadcast_fp16``
    argument: ``False`` -> ``None`` (the parameters' own dtype), ``True`` -> fp16 (FairScale's
    meaning), or a dtype among fp16 / bf16 / fp32. Anything else is a ValueError naming the
    value. Costs nothing."""
    if broadcast_fp16 is False:
        return None
    if broadcast_fp16 is True:
        return torch.float16
    if isinstance(broadcast_fp16, torch.dtype) and broadcast_fp16 in _WIRE_DTYPES:
        return None if broadcast_fp16 == torch.float32 else broadcast_fp16
    raise ValueError(f"OSS(broadcast_fp16={broadcast_fp16!r}): must be True or False (True: "
                     f"fp16), or torch.float16, torch.bfloat16 or torch.float32")


class FlatParamBucket:
    """One flat buffer of ``world_size`` segments (equal, or unpadded: see the module's note);
    the parameters are views into it.

    Args:
        params_per_rank: for each rank, the parameters it owns in this bucket (one device and
            dtype for the whole bucket).
        rank, world_size, group: this rank's place in the process group.
        broadcast_fp16: send fp32 parameters as fp16 (``True``) or as the 16-bit dtype given
            (``torch.bfloat16``); the owner keeps its exact fp32 values
            (:func:`broadcast_wire_dtype`).
        transport: what carries the all-gather (default: the process group's collectives).

    Memory: ``sum(segment_numels)`` elements (the parameters' storage). Communication per
    :meth:`start_gather`: ``(N-1)/N`` of the buffer's bytes (half of them with
    ``broadcast_fp16``; unpadded: this rank's segment to each peer), one all-gather; memory in
    flight: one 16-bit copy of the buffer.
    """

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]], rank: int,
                 world_size: int, group=None,
                 broadcast_fp16: Union[bool, torch.dtype] = False,
                 transport: Optional[Transport] = None):
        every = [p for params in params_per_rank for p in params]
        self.dtype = every[0].dtype
        self.device = every[0].device
        self.rank, self.world_size, self.group = rank, world_size, group
        self.transport = transport or default_transport()
        self.params_per_rank = tuple(tuple(params) for params in params_per_rank)
        self.segment_numels = _segment_numels(
            [sum(p.numel() for p in params) for params in params_per_rank])
        self._offsets = [sum(self.segment_numels[:r]) for r in range(world_size)]
        self.set_wire(broadcast_fp16)
        self.buffer = torch.zeros(sum(self.segment_numels), dtype=self.dtype,
                                  device=self.device)
        self._slots = []  # (param, offset in buffer)
        for r, params in enumerate(self.params_per_rank):
            offset = self._offsets[r]
            for p in params:
                self._slots.append((p, offset))
                offset += p.numel()
        self.bind()
        self._handle = None
        self._half: Optional[torch.Tensor] = None

    def set_wire(self, broadcast_fp16: Union[bool, torch.dtype]) -> None:
        """Send the next gathers in the dtype ``broadcast_fp16`` names
        (:func:`broadcast_wire_dtype`); only fp32 buckets are narrowed (a bf16/fp16 model
        already sends 2 bytes per element). Call with no gather in flight."""
        wire = broadcast_wire_dtype(broadcast_fp16)
        self.wire_dtype = wire if wire is not None and self.dtype == torch.float32 else None

    @property
    def owned_params(self) -> tuple:
        """The parameters this rank owns (and steps) in this bucket."""
        return self.params_per_rank[self.rank]

    @property
    def slots(self) -> list:
        """``(param, offset in buffer)`` for every parameter of the bucket."""
        return self._slots

    @property
    def padding_numel(self) -> int:
        """Elements of the buffer that hold no parameter (segments padded to equal size)."""
        return self.buffer.numel() - sum(p.numel() for p, _ in self._slots)

    def bind(self) -> None:
        """Copy the parameters' current values into the buffer and make them views of it."""
        with torch.no_grad():
            for p, offset in self._slots:
                view = _view_in_layout_of(self.buffer[offset:offset + p.numel()], p)
                view.copy_(p.detach())
                p.data = view

    def unbind(self) -> None:
        """Give every parameter its own storage again (a copy), releasing the buffer."""
        with torch.no_grad():
            for p, _ in self._slots:
                p.data = p.detach().clone()

    def is_bound(self) -> bool:
        """False once something replaced a parameter's storage (``model.to(...)``,
        ``p.data = ...``)."""
        base, size = self.buffer.data_ptr(), self.buffer.element_size()
        return all(p.data_ptr() == base + offset * size and p.dtype == self.dtype
                   and p.device == self.device for p, offset in self._slots)

    def _segment(self, buffer: torch.Tensor, r: int) -> torch.Tensor:
        return buffer[self._offsets[r]:self._offsets[r] + self.segment_numels[r]]

    def start_gather(self) -> None:
        """Launch the all-gather that brings every rank's segment here (asynchronous)."""
        wire = self.buffer
        if self.wire_dtype is not None:
            wire = self._half = torch.empty(self.buffer.numel(), dtype=self.wire_dtype,
                                            device=self.device)
            self._segment(wire, self.rank).copy_(self._segment(self.buffer, self.rank))
        self._handle = self.transport.all_gather_segments(wire, self.segment_numels,
                                                          self.group)

    @property
    def has_wire_copy(self) -> bool:
        """Whether a 16-bit copy of the buffer is in flight (started, not finished)."""
        return self._half is not None

    def finish_gather(self) -> None:
        """Wait for :meth:`start_gather`; with a 16-bit wire, widen the other ranks' segments
        into place."""
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._half is not None:
            for r in range(self.world_size):
                if r != self.rank:
                    self._segment(self.buffer, r).copy_(self._segment(self._half, r))
            self._half = None


def _room_for_the_wire_copy_of(bucket: FlatParamBucket, in_flight: list) -> list:
    """``in_flight`` (buckets whose all-gather was started, oldest first) less the oldest
    buckets holding a 16-bit wire copy, which are finished (waited for, widened into place,
    their copy freed), so that ``bucket``'s gather, started next, keeps the copies in flight
    within :data:`WIRE_COPIES_IN_FLIGHT`. Local."""
    if bucket.wire_dtype is None:
        return list(in_flight)
    copies = [b for b in in_flight if b.has_wire_copy]
    finished = copies[:max(0, len(copies) + 1 - WIRE_COPIES_IN_FLIGHT)]
    for b in finished:
        b.finish_gather()
    return [b for b in in_flight if not any(b is f for f in finished)]


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``t.numel()`` consecutive slots in some order of its
    dimensions (contiguous, transposed or permuted; not expanded or sliced)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _view_in_layout_of(flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A view of ``flat`` (``p.numel()`` elements) with ``p``'s shape and, where ``p`` is dense,
    ``p``'s strides too.

    Note: a transposed parameter (``nn.Parameter(w.t())``) must keep its strides. torch's
    DistributedDataParallel, built before OSS in the usual order, laid its gradient buckets out
    with the parameter's strides; a parameter that turned contiguous under it gets gradients
    laid out differently from those buckets, and the reduced gradient comes back wrong
    (a 0.3 error in the weights after one SGD step)."""
    if _is_dense(p):
        return flat.as_strided(p.shape, p.stride())
    return flat.view(p.shape)


def _segment_numels(loads: Sequence[int]) -> tuple:
    """Per rank, its segment's size: all the widest where that pads at most
    MAX_PADDING_FRACTION of the bucket, else each rank's own load (no padding)."""
    padded = len(loads) * max(loads)
    if padded - sum(loads) <= MAX_PADDING_FRACTION * padded:
        return (max(loads),) * len(loads)
    return tuple(loads)


def build_buckets(plan: OwnershipPlan, rank: int, group=None,
                  broadcast_fp16: Union[bool, torch.dtype] = False,
                  transport: Optional[Transport] = None) -> list[list[FlatParamBucket]]:
    """The flat buckets of ``plan``: per bucket index, one :class:`FlatParamBucket` per
    (device, dtype) found in it. Empty for a world of one (nothing to synchronise)."""
    partition = plan.partition
    world_size = partition.world_size
    if world_size == 1:
        return []
    grouped: list[dict] = [dict() for _ in range(plan.num_buckets)]
    for p in partition.all_params():
        per_kind = grouped[plan.bucket_of[id(p)]]
        rows = per_kind.setdefault((p.device, p.dtype), [[] for _ in range(world_size)])
        rows[partition.owner(p)].append(p)
    return [[FlatParamBucket(rows, rank, world_size, group, broadcast_fp16, transport)
             for rows in per_kind.values()]
            for per_kind in grouped if per_kind]


class ParamSync:
    """The flat buckets of an :class:`~shardkit.optim.partition.OwnershipPlan` and the
    re-synchronisation of the parameters through them, for the life of one optimizer.

    Args:
        plan: who owns each parameter and which bucket holds it.
        rank, group: this rank's place in the data-parallel process group.
        broadcast_fp16: send fp32 parameters as fp16 (``True``) or in the 16-bit dtype given
            (the owner keeps its exact values; :func:`broadcast_wire_dtype`).
        transport: the :class:`~shardkit.transport.Transport` that carries the all-gathers.

    Memory: the buckets are the parameters' own storage (``Ψ`` plus padding). Communication per
    :meth:`sync_all` or :meth:`step_and_sync`: ``(N-1)/N · (Ψ + padding)`` elements, one
    all-gather per bucket. Everything else is local.
    """

    def __init__(self, plan: OwnershipPlan, rank: int, group=None,
                 broadcast_fp16: Union[bool, torch.dtype] = False,
                 transport: Optional[Transport] = None):
        self.rank, self.group = rank, group
        self.broadcast_fp16, self.transport = broadcast_fp16, transport
        self._plan = plan
        self.layout_version = 0  # counts the layouts: one more each time the buckets are built
        self._buckets = self._build()
        self._pending: list[FlatParamBucket] = []  # all-gathers a later forward waits for
        self._defer = False  # whether step_and_sync leaves its all-gathers to the next forward

    @property
    def buckets(self) -> list[list[FlatParamBucket]]:
        """Per bucket index, one :class:`FlatParamBucket` per (device, dtype) in it."""
        return self._buckets

    @property
    def num_buckets(self) -> int:
        """How many all-gathers one sync issues."""
        return sum(len(buckets) for buckets in self._buckets)

    @property
    def in_flight(self) -> int:
        """How many bucket all-gathers are still running (only with :meth:`overlap_with`)."""
        return len(self._pending)

    def all_fp32(self) -> bool:
        """Whether every bucket (so every parameter of the plan) is fp32. Local, one look per
        bucket."""
        return all(b.dtype == torch.float32 for buckets in self._buckets for b in buckets)

    def _build(self) -> list[list[FlatParamBucket]]:
        self.layout_version += 1
        buckets = build_buckets(self._plan, self.rank, self.group, self.broadcast_fp16,
                                self.transport)
        # which bucket holds each parameter: a forward pre-hook looks its own up in O(its
        # parameters), not by scanning every pending bucket's slots (O(modules x params))
        self._bucket_of = {id(p): b for per_kind in buckets for b in per_kind
                           for p, _ in b.slots}
        return buckets

    def relayout(self, plan: OwnershipPlan) -> None:
        """Give every parameter its own storage back, then lay the buckets of ``plan`` out
        (after waiting for anything still in flight). Local: every rank sees the same layout."""
        self._finish_every_gather()  # nothing may still be writing into the old buffers
        for buckets in self._buckets:
            for b in buckets:
                b.unbind()
        self._plan = plan
        self._buckets = self._build()

    def set_wire(self, broadcast_fp16: Union[bool, torch.dtype]) -> None:
        """Send the following syncs in the dtype ``broadcast_fp16`` names (after waiting for
        anything in flight, which keeps the dtype it was sent in). Local."""
        self._finish_every_gather()
        self.broadcast_fp16 = broadcast_fp16
        for buckets in self._buckets:
            for b in buckets:
                b.set_wire(broadcast_fp16)

    def rebind_if_moved(self) -> None:
        """Rebuild the buckets from the parameters' current values, dtype and device when
        something replaced a parameter's storage (``model.to(...)``, ``p.data = ...``). Local."""
        if any(not b.is_bound() for buckets in self._buckets for b in buckets):
            self._buckets = self._build()

    def sync_all(self) -> None:
        """All-gather every bucket and wait (after a step that updated all owned parameters)."""
        in_flight: list[FlatParamBucket] = []
        for b in (b for buckets in self._buckets for b in buckets):
            in_flight = _room_for_the_wire_copy_of(b, in_flight)
            b.start_gather()
            in_flight.append(b)
        for b in in_flight:
            b.finish_gather()

    def step_and_sync(self, step_only: Callable[[list], None]) -> None:
        """Call ``step_only(params)`` on this rank's parameters of each bucket in turn, starting
        that bucket's all-gather right after, so it runs while the next bucket is stepped.

        ``step_only`` must update exactly the given parameters. With :meth:`overlap_with` the
        last all-gathers are left running; the next forward (or :meth:`wait`) finishes them.
        """
        in_flight: list[FlatParamBucket] = []
        for buckets in self._buckets:
            step_only([p for b in buckets for p in b.owned_params])
            for b in buckets:
                in_flight = _room_for_the_wire_copy_of(b, in_flight)
                b.start_gather()
                in_flight.append(b)
        if self._defer:
            self._pending = in_flight
            return
        for b in in_flight:
            b.finish_gather()

    def params_of_bucket(self, index: int) -> list[torch.Tensor]:
        """Every parameter (all ranks' segments) that bucket ``index`` re-syncs."""
        return [p for b in self._buckets[index] for p, _ in b.slots]

    def step_bucket(self, index: int, step_only: Callable[[list], None]) -> None:
        """Call ``step_only(params)`` on this rank's parameters of bucket ``index`` alone and
        start that bucket's all-gather, left in flight for the next forward (with
        :meth:`overlap_with`) or :meth:`wait`. An all-gather of this bucket still in flight is
        finished first. Used to step buckets during backward, as soon as their gradients are
        reduced (``ShardedDataParallel(step_in_backward=True)``)."""
        buckets = self._buckets[index]
        still_running = [b for b in self._pending if b in buckets]
        for b in still_running:
            b.finish_gather()
        self._pending = [b for b in self._pending if b not in still_running]
        step_only([p for b in buckets for p in b.owned_params])
        for b in buckets:
            self._pending = _room_for_the_wire_copy_of(b, self._pending)
            b.start_gather()
            self._pending.append(b)
        if not self._defer:
            self.wait()

    def use_group(self, group) -> None:
        """Carry the all-gathers on ``group`` (the same ranks as before, e.g. a group of their
        own so that their order needs to match only among themselves); rebuilds the buckets
        from the parameters' current values. Local."""
        self._finish_every_gather()
        self.group = group
        self._buckets = self._build()

    def _finish_every_gather(self) -> None:
        self.wait()
        for buckets in self._buckets:
            for b in buckets:
                b.finish_gather()

    def wait(self) -> None:
        """Finish every all-gather still in flight (a no-op unless :meth:`overlap_with` is on)."""
        pending, self._pending = self._pending, []
        for b in pending:
            b.finish_gather()

    def overlap_with(self, module: torch.nn.Module) -> None:
        """From now on leave the all-gathers of :meth:`step_and_sync` running: each submodule of
        ``module`` waits, in a forward pre-hook, only for the buckets holding its own
        parameters; ``state_dict()`` and ``load_state_dict()`` of ``module`` or of any of its
        submodules (``ddp.module.state_dict()``) wait for all."""
        # Note: every submodule with parameters gets its hook, frozen or not yet optimized
        # ones too, and the buckets are looked up when it runs: a layer unfrozen
        # (refresh_trainable) or added (add_param_group) later re-lays the buckets out, and
        # a hook chosen from the partition of the moment read its stale values.
        hooked = self.__dict__.setdefault("_hooked", weakref.WeakSet())
        for sub in module.modules():
            if sub in hooked:  # a second call on the same module adds no second set of hooks
                continue
            hooked.add(sub)
            own = list(sub.parameters(recurse=False))
            if own:
                sub.register_forward_pre_hook(_SyncWaiter(self, own))
            sub.register_state_dict_pre_hook(_SyncWaiter(self))
            sub.register_load_state_dict_pre_hook(_SyncWaiter(self))
        self._defer = True

    def wait_for_params(self, param_ids) -> None:
        """Finish the all-gathers in flight of the buckets holding the parameters whose
        ``id`` is in ``param_ids`` (the others keep running). Local."""
        if not self._pending:
            return
        mine = {self._bucket_of.get(i) for i in param_ids}
        mine.discard(None)
        if not mine:
            return
        keep = []
        for b in self._pending:
            if b in mine:
                b.finish_gather()
            else:
                keep.append(b)
        self._pending = keep


class _SyncWaiter:
    """The hook :meth:`ParamSync.overlap_with` puts on a module: waits for the buckets holding
    ``params`` (a forward pre-hook) or for every bucket (``params=None``: state_dict and
    load_state_dict pre-hooks). Holds the ParamSync weakly, so that a model outliving its
    optimizer does not keep the old buckets' buffers alive; pickles as a hook that does nothing
    (``torch.save(module)`` of a hooked module), and ``copy.deepcopy`` keeps it as it is."""

    def __init__(self, sync: Optional[ParamSync], params: Optional[list] = None):
        self._sync = weakref.ref(sync) if sync is not None else (lambda: None)
        self._wanted = None if params is None else frozenset(id(p) for p in params)

    def __call__(self, *args, **kwargs) -> None:
        sync = self._sync()
        if sync is None or not sync._pending:
            return None
        if self._wanted is None:
            sync.wait()
        else:
            sync.wait_for_params(self._wanted)
        return None

    def __deepcopy__(self, memo) -> "_SyncWaiter":
        return self

    def __reduce__(self):
        return (_SyncWaiter, (None,))
