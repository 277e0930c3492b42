"""Ownership plan and bucketed parameter re-synchronisation for OSS (ZeRO-1).

After each rank has stepped the parameters it owns, every rank needs every updated parameter.
Instead of one broadcast per parameter, the owned parameters are laid out in *flat buckets*:
bucket ``k`` is one buffer of ``world_size`` equal segments, segment ``r`` holding (contiguous,
zero padded at the end) the parameters rank ``r`` owns in that bucket. The parameters are views
into these buffers, so one in-place ``all_gather_into_tensor`` per bucket re-synchronises them,
with no packing or unpacking copy (on CPU, where gloo's all-gather is slow, each rank instead
broadcasts its segment in place: see :func:`default_sync_op`).

On CPU, when every rank of the group runs on this machine, the buffers move into host shared
memory at the first step (:func:`move_to_shared`, :mod:`shardkit.shared_memory`): each rank writes
its freshly stepped segment into one buffer that every rank maps, and from then on an owner's
step writes its segment in place and, after a barrier, every rank reads it: the all-gather
copies nothing. Before the first step each rank keeps its own values, as with a collective.

Whole-parameter ownership makes per-rank segments uneven, and padding is sent on the wire. The
plan therefore chooses ownership and buckets together (:func:`plan_ownership`): buckets are
filled largest parameters first, each rank's segment of a bucket about equally full, so padding
stays around one per cent on real models.

Memory: the buffers replace the parameters' own storage (``Ψ`` plus the padding); with
``broadcast_fp16`` a transient half-precision copy of each bucket in flight (``2Ψ`` bytes at
most) lives during the sync; a shared-memory buffer exists once per machine. Communication per
step per rank: ``(N-1)/N · (Ψ + padding)`` elements in the parameters' dtype (fp16 with
``broadcast_fp16``), one all-gather per bucket (``N`` broadcasts per bucket with
``"broadcast"``; with ``"shared_memory"`` nothing is copied, CommCounter records the same figure
as one all-gather per bucket, and the caller's two barriers are the only collectives).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shardkit import distributed, shared_memory
from shardkit.optim.partition import ParameterPartition

__all__ = ["OwnershipPlan", "plan_ownership", "default_bucket_numel", "default_sync_op",
           "SYNC_OPS", "FlatParamBucket", "build_buckets", "allocate_shared",
           "move_to_shared", "in_shared_memory"]


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


SYNC_OPS = ("all_gather", "broadcast", "shared_memory")


def default_sync_op(device: torch.device) -> str:
    """How a bucket is re-synchronised on ``device``: ``"all_gather"`` (one
    ``all_gather_into_tensor`` per bucket, NCCL's native path) on accelerators; on CPU
    ``"broadcast"`` (each rank broadcasts its segment in place: gloo's all-gather copies its
    whole output through a fresh buffer and measured 1.2-4x slower on 16-32 MiB buckets).
    The bytes on the wire are the same either way: ``(N-1)/N`` of the bucket."""
    return "broadcast" if device.type == "cpu" else "all_gather"


class FlatParamBucket:
    """One flat buffer of ``world_size`` equal segments; the parameters are views into it.

    Args:
        params_per_rank: for each rank, the parameters it owns in this bucket (one device and
            dtype for the whole bucket).
        rank, world_size, group: this rank's place in the process group.
        broadcast_fp16: send fp32 parameters as fp16 (the owner keeps its exact fp32 values).
        sync_op: ``"all_gather"`` or ``"broadcast"`` (one per rank segment); ``None``:
            :func:`default_sync_op` for the bucket's device. (``"shared_memory"`` is reached
            through :meth:`publish_to` and :meth:`switch_to`, see :func:`move_to_shared`.)

    Memory: ``world_size x segment_numel`` elements (the parameters' storage). Communication
    per :meth:`start_gather`: ``(N-1)/N`` of the buffer's bytes (half of them with
    ``broadcast_fp16``), in one all-gather or ``N`` broadcasts; none in shared memory.
    """

    def __init__(self, params_per_rank: Sequence[Sequence[torch.Tensor]], rank: int,
                 world_size: int, group=None, broadcast_fp16: bool = False,
                 sync_op: Optional[str] = None):
        every = [p for params in params_per_rank for p in params]
        self.dtype = every[0].dtype
        self.device = every[0].device
        self.rank, self.world_size, self.group = rank, world_size, group
        self.params_per_rank = tuple(tuple(params) for params in params_per_rank)
        self.segment_numel = max(sum(p.numel() for p in params) for params in params_per_rank)
        self.send_fp16 = broadcast_fp16 and self.dtype == torch.float32
        self.sync_op = sync_op or default_sync_op(self.device)
        self.buffer = torch.zeros(world_size * self.segment_numel, dtype=self.dtype,
                                  device=self.device)
        self._slots = []  # (param, offset in buffer)
        for r, params in enumerate(self.params_per_rank):
            offset = r * self.segment_numel
            for p in params:
                self._slots.append((p, offset))
                offset += p.numel()
        self.bind()
        self._works: list = []
        self._half: Optional[torch.Tensor] = None
        self._next_buffer: Optional[torch.Tensor] = None

    @property
    def owned_params(self) -> tuple:
        """The parameters this rank owns (and steps) in this bucket."""
        return self.params_per_rank[self.rank]

    @property
    def collectives_per_sync(self) -> int:
        return {"all_gather": 1, "broadcast": self.world_size, "shared_memory": 0}[self.sync_op]

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

    def publish_to(self, shared: torch.Tensor) -> None:
        """First half of the move into shared memory: write this rank's segment into ``shared``
        (a buffer of the same size mapped by every rank)."""
        self._segment(shared, self.rank).copy_(self._segment(self.buffer, self.rank))
        self._next_buffer = shared

    def switch_to(self) -> None:
        """Second half, after a barrier (every owner has published): the parameters become views
        of the shared buffer, which from now on is this bucket's storage; the private buffer
        is released."""
        self.buffer, self._next_buffer = self._next_buffer, None
        self.sync_op = "shared_memory"
        with torch.no_grad():
            for p, offset in self._slots:
                p.data = self.buffer[offset:offset + p.numel()].view(p.shape)

    def readopt(self) -> None:
        """In shared memory: give back to the buffer every parameter whose storage was replaced
        (``model.to(...)``, ``p.data = ...``), copying its current value in place.

        Raises:
            RuntimeError: the replacement changed a parameter's dtype or device (a shared buffer
                cannot follow; build OSS after moving the model, or use broadcasts).
        """
        base, size = self.buffer.data_ptr(), self.buffer.element_size()
        with torch.no_grad():
            for p, offset in self._slots:
                if p.data_ptr() == base + offset * size and p.dtype == self.dtype:
                    continue
                if p.dtype != self.dtype or p.device != self.device:
                    raise RuntimeError(
                        f"OSS: a parameter of shape {tuple(p.shape)} moved to {p.dtype} on "
                        f"{p.device} after OSS was built, but its shared-memory buffer holds "
                        f"{self.dtype} on {self.device}. Build OSS after model.to(...), or pass "
                        f"sync_op='broadcast'")
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
                   for p, offset in self._slots)

    def _segment(self, buffer: torch.Tensor, r: int) -> torch.Tensor:
        return buffer[r * self.segment_numel:(r + 1) * self.segment_numel]

    def start_gather(self) -> None:
        """Launch the collectives that bring every rank's segment here (asynchronous; in shared
        memory nothing is sent, the exchange is only counted, as one all-gather)."""
        if self.sync_op == "shared_memory":
            distributed.shared_memory_exchange(self.buffer, group=self.group)
            return
        wire = self.buffer
        if self.send_fp16:
            wire = self._half = torch.empty(self.buffer.numel(), dtype=torch.float16,
                                            device=self.device)
            self._segment(wire, self.rank).copy_(self._segment(self.buffer, self.rank))
        if self.sync_op == "all_gather":
            self._works = [distributed.all_gather_into_tensor(
                wire, self._segment(wire, self.rank), group=self.group, async_op=True)]
        else:
            self._works = [distributed.broadcast(
                self._segment(wire, r), src=distributed.get_global_rank(self.group, r),
                group=self.group, async_op=True) for r in range(self.world_size)]

    def finish_gather(self) -> None:
        """Wait for :meth:`start_gather`; with fp16, widen the other ranks' segments into place."""
        for work in self._works:
            work.wait()
        self._works = []
        if self._half is not None:
            for r in range(self.world_size):
                if r != self.rank:
                    self._segment(self.buffer, r).copy_(self._segment(self._half, r))
            self._half = None


def build_buckets(plan: OwnershipPlan, rank: int, group=None, broadcast_fp16: bool = False,
                  sync_op: Optional[str] = None) -> list[list[FlatParamBucket]]:
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
    return [[FlatParamBucket(rows, rank, world_size, group, broadcast_fp16, sync_op)
             for rows in per_kind.values()]
            for per_kind in grouped if per_kind]


def allocate_shared(buckets: Sequence[Sequence[FlatParamBucket]], group=None) -> Optional[list]:
    """Shared-memory buffers for the CPU buckets of ``buckets`` (in their order), if every rank
    of ``group`` can map this machine's ``/dev/shm``; ``None`` (on every rank alike) if not, or
    if there is no CPU bucket. Collective: three small object collectives per dtype. Memory:
    each CPU bucket's size once per machine."""
    cpu = _shareable(buckets)
    if not cpu:
        return None
    shared: dict = {}
    for dtype in sorted({b.dtype for b in cpu}, key=str):
        of_dtype = [b for b in cpu if b.dtype == dtype]
        tensors = shared_memory.open_shared_buffers([b.buffer.numel() for b in of_dtype], dtype,
                                                    group)
        if tensors is None:
            return None
        shared.update(zip(map(id, of_dtype), tensors))
    return [shared[id(b)] for b in cpu]


def move_to_shared(buckets: Sequence[Sequence[FlatParamBucket]], shared: list,
                   group=None) -> None:
    """Move the CPU buckets into the buffers of :func:`allocate_shared` (same bucket layout).

    Call it right after a step has written each rank's segment: every rank publishes its
    segment, and after a barrier (the one collective here) the parameters become views of the
    shared buffers, which every rank then sees alike.
    """
    cpu = _shareable(buckets)
    for b, buffer in zip(cpu, shared):
        b.publish_to(buffer)
    distributed.barrier(group)  # every owner has published its segment
    for b in cpu:
        b.switch_to()


def in_shared_memory(buckets: Sequence[Sequence[FlatParamBucket]]) -> bool:
    """Whether the buckets live in shared memory (the step then needs its two barriers)."""
    return any(b.sync_op == "shared_memory" for row in buckets for b in row)


def _shareable(buckets) -> list:
    return [b for row in buckets for b in row if b.device.type == "cpu" and not b.send_fp16]
