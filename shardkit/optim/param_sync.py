"""Ownership plan and bucketed parameter re-synchronisation for OSS (ZeRO-1).

After each rank has stepped the parameters it owns, every rank needs every updated parameter.
Instead of one broadcast per parameter, the owned parameters are laid out in *flat buckets*:
bucket ``k`` is one buffer of ``world_size`` equal segments, segment ``r`` holding (contiguous,
zero padded at the end) the parameters rank ``r`` owns in that bucket. The parameters are views
into these buffers (each process's own memory), so one in-place all-gather per bucket, by the
optimizer's transport (:mod:`shardkit.transport`), re-synchronises them with no packing or
unpacking copy.

Whole-parameter ownership makes per-rank segments uneven, and padding is sent on the wire. The
plan therefore chooses ownership and buckets together (:func:`plan_ownership`): buckets are
filled largest parameters first, each rank's segment of a bucket about equally full, so padding
stays around one per cent on real models.

Memory: the buffers replace the parameters' own storage (``Ψ`` plus the padding); with
``broadcast_fp16`` a transient 16-bit copy of each bucket in flight (``2Ψ`` bytes at most)
lives during the sync. Communication per step per rank: ``(N-1)/N · (Ψ + padding)`` elements
in the parameters' dtype (fp16 with ``broadcast_fp16=True``, bf16 with
``broadcast_fp16=torch.bfloat16``: half the bytes of fp32), one all-gather per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from shardkit.transport import Transport, default_transport
from shardkit.optim.partition import ParameterPartition

__all__ = ["OwnershipPlan", "plan_ownership", "default_bucket_numel", "FlatParamBucket",
           "build_buckets", "broadcast_wire_dtype"]

_WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    :func:`default_bucket_numel`). Buckets are filled one after the other, largest parameters
    first: a bucket's per-rank segment is the target or the largest parameter left, whichever
    is larger, and each parameter goes to the least-filled rank segment it still fits in, so
    the segments of a bucket end up about equally full (little padding) and the ranks about
    equally loaded. Costs no communication.
    """
    if bucket_numel is None:
        bucket_numel = default_bucket_numel(world_size)
    flat = [p for params in trainable_groups for p in params]
    numels = [p.numel() for p in flat]
    remaining = sorted(range(len(flat)), key=lambda k: (-numels[k], k))
    rank_load = [0] * world_size
    placed: dict = {}  # item -> (bucket, rank)
    bucket = 0
    while remaining:
        level = max(bucket_numel, numels[remaining[0]])
        segment = [0] * world_size
        left = []
        for k in remaining:
            r = min(range(world_size), key=lambda r: (segment[r], r))
            if segment[r] + numels[k] <= level:
                segment[r] += numels[k]
                placed[k] = (bucket, r)
            else:
                left.append(k)
        # the fullest segment of this bucket goes to the least loaded rank
        by_fill = sorted(range(world_size), key=lambda r: (-segment[r], r))
        by_load = sorted(range(world_size), key=lambda r: (rank_load[r], r))
        to_rank = dict(zip(by_fill, by_load))
        for k in remaining:
            if k in placed and placed[k][0] == bucket:
                placed[k] = (bucket, to_rank[placed[k][1]])
        for r in range(world_size):
            rank_load[to_rank[r]] += segment[r]
        remaining, bucket = left, bucket + 1
    owners, bucket_of, k = [], {}, 0
    for params in trainable_groups:
        row = []
        for p in params:
            row.append(placed[k][1])
            bucket_of[id(p)] = placed[k][0]
            k += 1
        owners.append(row)
    partition = ParameterPartition.from_owners(trainable_groups, owners, world_size)
    return OwnershipPlan(partition, bucket_of, max(1, bucket))


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
        broadcast_fp16: send fp32 parameters as fp16 (``True``) or as the 16-bit dtype given
            (``torch.bfloat16``); the owner keeps its exact fp32 values
            (:func:`broadcast_wire_dtype`).
        transport: what carries the all-gather (default: the process group's collectives).

    Memory: ``world_size x segment_numel`` elements (the parameters' storage). Communication
    per :meth:`start_gather`: ``(N-1)/N`` of the buffer's bytes (half of them with a 16-bit
    ``broadcast_fp16``), one all-gather; memory in flight: one 16-bit copy of the buffer.
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
        self.segment_numel = max(sum(p.numel() for p in params) for params in params_per_rank)
        wire = broadcast_wire_dtype(broadcast_fp16)
        # only fp32 buckets are narrowed: a bf16/fp16 model already sends 2 bytes per element
        self.wire_dtype = wire if wire is not None and self.dtype == torch.float32 else None
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
        if self.wire_dtype is not None:
            wire = self._half = torch.empty(self.buffer.numel(), dtype=self.wire_dtype,
                                            device=self.device)
            self._segment(wire, self.rank).copy_(self._segment(self.buffer, self.rank))
        self._handle = self.transport.all_gather(wire, self._segment(wire, self.rank),
                                                 self.group)

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
