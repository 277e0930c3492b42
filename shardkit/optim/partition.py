"""ParameterPartition: which rank owns which whole parameter, shared by OSS and ShardedDDP.

Whole-parameter ownership keeps every torch optimizer correct (LAMB, Adafactor need a whole
tensor). The partition is computed identically on every rank from the parameters' sizes alone
(a greedy "largest first onto the lightest rank", stable on ties), and is immutable: OSS builds
one, ShardedDDP reads the same object instead of reaching into OSS's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["ParameterPartition"]


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
        (at most one parameter's worth apart).
        """
        if world_size < 1:
            raise ValueError(f"ParameterPartition: world_size={world_size}; must be >= 1")
        flat = [(g, i, p) for g, params in enumerate(param_groups) for i, p in enumerate(params)]
        seen = set()
        for g, i, p in flat:
            if id(p) in seen:
                raise ValueError(f"ParameterPartition: a parameter appears twice (group {g}, "
                                 f"index {i}); each parameter may be in one param group only")
            seen.add(id(p))
        order = sorted(range(len(flat)), key=lambda k: (-flat[k][2].numel(), k))
        load = [0] * world_size
        owner_of = {}
        for k in order:
            rank = min(range(world_size), key=lambda r: (load[r], r))
            owner_of[k] = rank
            load[rank] += flat[k][2].numel()
        owners, k = [], 0
        for params in param_groups:
            owners.append(tuple(owner_of[k + i] for i in range(len(params))))
            k += len(params)
        groups = tuple(tuple(params) for params in param_groups)
        index = {id(p): owners[g][i] for g, params in enumerate(groups)
                 for i, p in enumerate(params)}
        return cls(world_size, groups, tuple(owners), index)

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
        """Per param group, the parameters ``rank`` owns (FairScale's ``partition_parameters()[rank]``)."""
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
