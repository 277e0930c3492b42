"""Ownership plan and bucketed parameter re-synchronisation for OSS (ZeRO-1).

After each rank has stepped the parameters it owns, every rank needs every updated parameter.
Instead of one broadcast per parameter, the owned parameters are laid out in *flat buckets*:
bucket ``k`` is one buffer of ``world_size`` equal segments, segment ``r`` holding (contiguous,
zero padded at the end) the parameters rank ``r`` owns in that bucket. The parameters are views
into these buffers (each process's own memory), so one in-place all-gather per bucket, by the
optimizer's transport (:mod:`shardkit.transport`), re-synchronises them with no packing or
unpacking copy.

Whole-parameter ownership makes per-rank segments uneven, and padding is sent on the wire. The
plan therefore chooses ownership and buckets together (:func:`plan_ownership`): each bucket holds
consecutive parameters (so the first layers arrive first, and a forward overlapped with the sync
waits only for what it reaches), split evenly over the ranks, so padding stays within a few per
cent on real models.

Memory: the buffers replace the parameters' own storage (``Ψ`` plus the padding); with
``broadcast_fp16`` a transient half-precision copy of each bucket in flight (``2Ψ`` bytes at
most) lives during the sync. Communication per step per rank: ``(N-1)/N · (Ψ + padding)``
elements in the parameters' dtype (fp16 with ``broadcast_fp16``), one all-gather per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shardkit.transport import Transport, default_transport
from shardkit.optim.partition import ParameterPartition

__all__ = ["OwnershipPlan", "plan_ownership", "default_bucket_numel", "FlatParamBucket",
           "build_buckets"]


@dataclass(frozen=True)
class OwnershipPlan:
    """The partition of the trainable parameters and, per parameter, its bucket index."""

    partition: ParameterPartition
    bucket_of: dict  # id(param) -> bucket index
    num_buckets: int


def plan_ownership(trainable_groups: Sequence[Sequence[torch.Tensor]], world_size: int,
                   bucket_numel: Optional[int] = None) -> OwnershipPlan:
    """Choose the owner and the bucket of every trainable parameter, deterministically.

    ``trainable_groups``: per param group, its trainable parameters (the order every rank sees).
    ``bucket_numel``: target elements per rank in one bucket (default
    :func:`default_bucket_numel`).

    Preferred layout: buckets of *consecutive* parameters, in the order given (for one param
    group, the model's registration order, which is usually its forward order), so bucket 0
    holds the first layers and, with :meth:`OSS.overlap_sync_with`, the next forward starts as
    soon as it has arrived while the later buckets are still on the wire. A bucket closes once
    it holds ``world_size x bucket_numel`` elements that split evenly over the ranks (largest
    first, each to the least-filled segment; at most :data:`MAX_PADDING_FRACTION` padding) or
    has grown to four times that. Where those buckets would pad more than
    :data:`MAX_PADDING_FRACTION` of the total (a few huge parameters against many ranks, e.g. a
    GPT's embedding and head at 4 ranks), the buckets are instead filled largest parameters
    first, which pads least but mixes layers. Either way each bucket's fullest segment goes to
    the least-loaded rank. Costs no communication.
    """
    if bucket_numel is None:
        bucket_numel = default_bucket_numel(world_size)
    flat = [p for params in trainable_groups for p in params]
    numels = [p.numel() for p in flat]
    windows = _consecutive_windows(numels, world_size, bucket_numel)
    if _padding_fraction_of(windows, numels, world_size) > MAX_PADDING_FRACTION:
        windows = _largest_first_windows(numels, world_size, bucket_numel)
    placed = _assign_ranks(windows, numels, world_size)
    owners, bucket_of, k = [], {}, 0
    for params in trainable_groups:
        row = []
        for p in params:
            row.append(placed[k][1])
            bucket_of[id(p)] = placed[k][0]
            k += 1
        owners.append(row)
    partition = ParameterPartition.from_owners(trainable_groups, owners, world_size)
    return OwnershipPlan(partition, bucket_of, max(1, len(windows)))


def _assign_ranks(windows: list[list[int]], numels: Sequence[int], world_size: int) -> dict:
    """Per item, ``(bucket, rank)``: each window split evenly, its fullest segment to the
    least-loaded rank so far."""
    placed: dict = {}
    rank_load = [0] * world_size
    for bucket, members in enumerate(windows):
        segments = _balanced_segments([numels[k] for k in members], world_size)
        fills = [sum(numels[members[i]] for i in seg) for seg in segments]
        by_fill = sorted(range(world_size), key=lambda r: (-fills[r], r))
        by_load = sorted(range(world_size), key=lambda r: (rank_load[r], r))
        for seg_index, rank in zip(by_fill, by_load):
            rank_load[rank] += fills[seg_index]
            for i in segments[seg_index]:
                placed[members[i]] = (bucket, rank)
    return placed


def _largest_first_windows(numels: Sequence[int], world_size: int,
                           bucket_numel: int) -> list[list[int]]:
    """Buckets filled largest items first: a bucket's per-rank level is the target or the
    largest item left, whichever is larger, and each item goes to the least-filled segment it
    still fits in."""
    remaining = sorted(range(len(numels)), key=lambda k: (-numels[k], k))
    windows = []
    while remaining:
        level = max(bucket_numel, numels[remaining[0]])
        segment = [0] * world_size
        members, left = [], []
        for k in remaining:
            r = min(range(world_size), key=lambda r: (segment[r], r))
            if segment[r] + numels[k] <= level:
                segment[r] += numels[k]
                members.append(k)
            else:
                left.append(k)
        windows.append(sorted(members))
        remaining = left
    return windows


# A bucket keeps taking the next parameters while its even split would pad more than this.
MAX_PADDING_FRACTION = 0.03


def _consecutive_windows(numels: Sequence[int], world_size: int,
                         bucket_numel: int) -> list[list[int]]:
    """Indices of ``flat`` cut into runs of consecutive parameters, one run per bucket. A last
    run that would pad badly on its own joins the one before it (once: the first buckets stay
    small, for the overlap)."""
    target = world_size * bucket_numel
    windows: list[list[int]] = []
    window: list[int] = []
    for k, n in enumerate(numels):
        window.append(k)
        total = sum(numels[i] for i in window)
        if total >= target and (total >= 4 * target or _padding_fraction(
                [numels[i] for i in window], world_size) <= MAX_PADDING_FRACTION):
            windows.append(window)
            window = []
    if window:
        windows.append(window)
    if len(windows) > 1 and _padding_fraction([numels[i] for i in windows[-1]],
                                                 world_size) > MAX_PADDING_FRACTION:
        last = windows.pop()
        windows[-1] = windows[-1] + last
    return windows


def _balanced_segments(numels: Sequence[int], world_size: int) -> list[list[int]]:
    """Split item indices over ``world_size`` segments: largest first, each to the
    least-filled segment (ties to the lower index). Deterministic."""
    segments: list[list[int]] = [[] for _ in range(world_size)]
    fill = [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world_size), key=lambda r: (fill[r], r))
        segments[r].append(i)
        fill[r] += numels[i]
    return segments


def _padding_fraction_of(windows: list[list[int]], numels: Sequence[int],
                         world_size: int) -> float:
    total = sum(numels)
    padded = sum(world_size * _widest_segment([numels[k] for k in w], world_size)
                 for w in windows)
    return 0.0 if padded == 0 else (padded - total) / padded


def _widest_segment(numels: Sequence[int], world_size: int) -> int:
    return max(sum(numels[i] for i in seg) for seg in _balanced_segments(numels, world_size))


def _padding_fraction(numels: Sequence[int], world_size: int) -> float:
    total = sum(numels)
    if total == 0:
        return 0.0
    widest = _widest_segment(numels, world_size)
    return (widest * world_size - total) / (widest * world_size)


def default_bucket_numel(world_size: int) -> int:
    """Elements per rank such that a whole bucket holds 2**22 elements (16 MiB of fp32): large
    enough for full bandwidth, small enough that several buckets overlap with the step (and,
    on gloo, that an all-gather's output stays under glibc's 32 MiB mmap threshold, so it is
    not faulted in afresh on every call: 5-8x slower when it is, measured on CPU)."""
    return max(1, 2 ** 22 // max(1, world_size))


class FlatParamBucket:
    """One flat buffer of ``world_size`` equal segments; the parameters are views into it.

    Args:
        params_per_rank: for each rank, the parameters it owns in this bucket (one device and
            dtype for the whole bucket).
        rank, world_size, group: this rank's place in the process group.
        broadcast_fp16: send fp32 parameters as fp16 (the owner keeps its exact fp32 values).
        transport: what carries the all-gather (default: the process group's collectives).

    Memory: ``world_size x segment_numel`` elements (the parameters' storage). Communication
    per :meth:`start_gather`: ``(N-1)/N`` of the buffer's bytes (half of them with
    ``broadcast_fp16``), one all-gather.
    """

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]], rank: int,
                 world_size: int, group=None, broadcast_fp16: bool = False,
                 transport: Optional[Transport] = None):
        every = [p for params in params_per_rank for p in params]
        self.dtype = every[0].dtype
        self.device = every[0].device
        self.rank, self.world_size, self.group = rank, world_size, group
        self.transport = transport or default_transport()
        self.params_per_rank = tuple(tuple(params) for params in params_per_rank)
        self.segment_numel = max(sum(p.numel() for p in params) for params in params_per_rank)
        self.send_fp16 = broadcast_fp16 and self.dtype == torch.float32
        self.buffer = torch.zeros(world_size * self.segment_numel, dtype=self.dtype,
                                  device=self.device)
        self._slots = []  # (param, offset in buffer)
        for r, params in enumerate(self.params_per_rank):
            offset = r * self.segment_numel
            for p in params:
                self._slots.append((p, offset))
                offset += p.numel()
        self.bind()
        self._handle = None
        self._half: Optional[torch.Tensor] = None

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
        return self.buffer.numel() - sum(p.numel() for p, _ in self._slots)

    def bind(self) -> None:
        """Copy the parameters' current values into the buffer and make them views of it."""
        with torch.no_grad():
            for p, offset in self._slots:
                view = self.buffer[offset:offset + p.numel()].view(p.shape)
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
        return buffer[r * self.segment_numel:(r + 1) * self.segment_numel]

    def start_gather(self) -> None:
        """Launch the all-gather that brings every rank's segment here (asynchronous)."""
        wire = self.buffer
        if self.send_fp16:
            wire = self._half = torch.empty(self.buffer.numel(), dtype=torch.float16,
                                            device=self.device)
            self._segment(wire, self.rank).copy_(self._segment(self.buffer, self.rank))
        self._handle = self.transport.all_gather(wire, self._segment(wire, self.rank),
                                                 self.group)

    def finish_gather(self) -> None:
        """Wait for :meth:`start_gather`; with fp16, widen the other ranks' segments into place."""
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._half is not None:
            for r in range(self.world_size):
                if r != self.rank:
                    self._segment(self.buffer, r).copy_(self._segment(self._half, r))
            self._half = None


def build_buckets(plan: OwnershipPlan, rank: int, group=None, broadcast_fp16: bool = False,
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
