"""Which rank owns which whole parameter and its optimizer state (OSS, ShardedDDP, checkpoints).

Whole-parameter ownership keeps every torch optimizer correct (LAMB, Adafactor need a whole
tensor). One algorithm, :func:`plan_ownership`, chooses the owners (and, for OSS, the flat sync
bucket of every parameter) identically on every rank from the parameters' sizes alone; the
resulting :class:`ParameterPartition` is immutable: OSS builds one, ShardedDDP and the engine's
checkpoints read the same object instead of reaching into OSS's internals.
:func:`send_state_to_new_owners` moves optimizer state when the ownership changes.

Whole-parameter ownership makes per-rank segments of a sync bucket uneven, and padding is sent
on the wire. The plan therefore chooses ownership and buckets together: each bucket holds
consecutive parameters (so the first layers arrive first, and a forward overlapped with the sync
waits only for what it reaches), split evenly over the ranks, so padding stays within a few per
cent on real models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from shardkit import distributed

__all__ = ["ParameterPartition", "OwnershipPlan", "plan_ownership", "default_bucket_numel",
           "send_state_to_new_owners"]


@dataclass(frozen=True)
class ParameterPartition:
    """An immutable assignment of parameters to ``world_size`` ranks, balanced by size.

    Attributes:
        world_size: number of ranks.
        param_groups: per param group, the tuple of its parameters (the order every rank sees).
        owners: per param group, the owning rank of each parameter (same shape as param_groups).

    Costs no communication; memory is two small tuples.
    """

    world_size: int
    param_groups: tuple[tuple[torch.Tensor, ...], ...]
    owners: tuple[tuple[int, ...], ...]
    _index: dict = field(default=None, repr=False, compare=False)

    @classmethod
    def balanced(cls, param_groups: Sequence[Sequence[torch.Tensor]],
                 world_size: int) -> "ParameterPartition":
        """Assign each parameter to a rank, largest first onto the least loaded rank.

        Balancing is over all groups together, so ranks hold about the same number of elements
        (at most one parameter's worth apart). This is :func:`plan_ownership` with a single
        bucket (one ownership algorithm for the whole package).
        """
        total = sum(p.numel() for params in param_groups for p in params)
        return plan_ownership(param_groups, world_size, bucket_numel=max(1, total)).partition

    @classmethod
    def from_owners(cls, param_groups: Sequence[Sequence[torch.Tensor]],
                    owners: Sequence[Sequence[int]], world_size: int) -> "ParameterPartition":
        """A partition with explicit owners (e.g. chosen together with a sync-bucket layout).

        ``owners`` has the shape of ``param_groups``; every owner must be in ``[0, world_size)``
        and every parameter may appear once.
        """
        if world_size < 1:
            raise ValueError(f"ParameterPartition: world_size={world_size}; must be >= 1")
        groups = tuple(tuple(params) for params in param_groups)
        owners = tuple(tuple(int(r) for r in row) for row in owners)
        if [len(g) for g in groups] != [len(o) for o in owners]:
            raise ValueError(f"ParameterPartition.from_owners: owners has group lengths "
                             f"{[len(o) for o in owners]}, param_groups {[len(g) for g in groups]}")
        index = {}
        for g, (params, row) in enumerate(zip(groups, owners)):
            for i, (p, r) in enumerate(zip(params, row)):
                if not 0 <= r < world_size:
                    raise ValueError(f"ParameterPartition.from_owners: owner {r} of group {g} "
                                     f"index {i} is outside [0, {world_size})")
                if id(p) in index:
                    raise ValueError(f"ParameterPartition: a parameter appears twice (group {g}, "
                                     f"index {i}); each parameter may be in one param group only")
                index[id(p)] = r
        return cls(world_size, groups, owners, index)

    def owner(self, param: torch.Tensor) -> int:
        """Rank that owns ``param``; ``KeyError`` when it is not partitioned here."""
        return self._index[id(param)]

    def __contains__(self, param) -> bool:
        return id(param) in self._index

    @property
    def param_to_rank(self) -> dict:
        """``{param: rank}`` for every partitioned parameter."""
        return {p: r for params, owners in zip(self.param_groups, self.owners)
                for p, r in zip(params, owners)}

    def params_of(self, rank: int) -> list[list[torch.Tensor]]:
        """Per param group, the parameters ``rank`` owns (FairScale's
        ``partition_parameters()[rank]``)."""
        return [[p for p, r in zip(params, owners) if r == rank]
                for params, owners in zip(self.param_groups, self.owners)]

    def numel_per_rank(self) -> list[int]:
        """Elements owned by each rank."""
        load = [0] * self.world_size
        for params, owners in zip(self.param_groups, self.owners):
            for p, r in zip(params, owners):
                load[r] += p.numel()
        return load

    def all_params(self) -> list[torch.Tensor]:
        """Every partitioned parameter, in group order."""
        return [p for params in self.param_groups for p in params]


@dataclass(frozen=True)
class OwnershipPlan:
    """The partition of the trainable parameters and, per parameter, its sync-bucket index."""

    partition: ParameterPartition
    bucket_of: dict  # id(param) -> bucket index
    num_buckets: int

    def same_as(self, other: "OwnershipPlan") -> bool:
        """Whether both plans give the same parameters the same owners and buckets."""
        def ids(plan):
            return [[id(p) for p in ps] for ps in plan.partition.param_groups]
        return (ids(self) == ids(other) and self.partition.owners == other.partition.owners
                and self.bucket_of == other.bucket_of)


def plan_ownership(trainable_groups: Sequence[Sequence[torch.Tensor]], world_size: int,
                   bucket_numel: Optional[int] = None) -> OwnershipPlan:
    """Choose the owner and the bucket of every trainable parameter, deterministically.

    ``trainable_groups``: per param group, its trainable parameters (the order every rank sees).
    ``bucket_numel``: target elements per rank in one bucket (default
    :func:`default_bucket_numel`).

    Preferred layout: buckets of *consecutive* parameters, in the order given (for one param
    group, the model's registration order, which is usually its forward order), so bucket 0
    holds the first layers and, with :meth:`~shardkit.optim.OSS.overlap_sync_with`, the next forward
    starts as soon as it has arrived while the later buckets are still on the wire. A bucket closes
    once it holds ``world_size x bucket_numel`` elements that split evenly over the ranks (largest
    first, each to the least-filled segment; at most :data:`MAX_PADDING_FRACTION` padding) or
    has grown to four times that. Where those buckets would pad more than
    :data:`MAX_PADDING_FRACTION` of the total (a few huge parameters against many ranks, e.g. a
    GPT's embedding and head at 4 ranks), the buckets are instead filled largest parameters
    first, which pads least but mixes layers. Either way each bucket's fullest segment goes to
    the least-loaded rank. Costs no communication.
    """
    if world_size < 1:
        raise ValueError(f"ParameterPartition: world_size={world_size}; must be >= 1")
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
    """Indices of ``numels`` cut into runs of consecutive items, one run per bucket. A last run
    that would pad badly on its own joins the one before it (once: the first buckets stay
    small, for the overlap)."""
    target = world_size * bucket_numel
    windows: list[list[int]] = []
    window: list[int] = []
    total = 0
    for k, n in enumerate(numels):
        window.append(k)
        total += n
        if total >= target and (total >= 4 * target or _padding_fraction(
                [numels[i] for i in window], world_size) <= MAX_PADDING_FRACTION):
            windows.append(window)
            window, total = [], 0
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


def send_state_to_new_owners(new: ParameterPartition, held: dict, rank: int, group=None) -> dict:
    """Each rank in turn broadcasts the state it holds (``held``: ``{param: state}``) for
    parameters that ``new`` gives to another rank; returns ``{param: state}`` arriving here.

    Communication: ``N`` small object broadcasts (the moved state only), so call it only when
    the partition changed. Collective over ``group``.
    """
    params = new.all_params()
    arriving = {}
    for r in range(new.world_size):
        mine = None
        if r == rank:
            mine = {i: held[p] for i, p in enumerate(params) if new.owner(p) != r and p in held}
        got = distributed.broadcast_object(mine, src=distributed.get_global_rank(group, r),
                                           group=group)
        arriving.update({params[i]: st for i, st in got.items() if new.owner(params[i]) == rank})
    return arriving
