"""Which ranks a FullyShardedDataParallel unit shards over and which it replicates over.

A strategy resolves to three groups (:class:`UnitGroups`):

- ``shard``: the parameters are cut into row blocks over it (gathered for compute,
  gradients reduce-scattered over it);
- ``replicate``: the shards are identical on its ranks; after the reduce-scatter each rank
  all-reduces its gradient shard over it (``None``: no replication);
- ``hpz``: DeepSpeed's hpZ secondary partition: after the forward gather each rank keeps the
  rows of its block in this (node-sized) group, and backward gathers inside it only
  (``None``: backward gathers over ``shard`` again).

Per step per rank, in elements, with M parameters, n ranks per node and k nodes (the groups of
:func:`shardkit.distributed.node_groups`), on groups that span nodes:

==========================  ===============================  ==========================
strategy                    groups                           on spanning groups
==========================  ===============================  ==========================
FULL_SHARD                  shard = all nk                   ``3M(nk-1)/nk``
SHARD_GRAD_OP               shard = all nk                   ``2M(nk-1)/nk``
FULL_SHARD + hpZ (n)        shard = all, hpz = node          ``2M(nk-1)/nk``
HYBRID_SHARD                shard = node, replicate = peers  ``2(M/n)(k-1)/k``
_HYBRID_SHARD_ZERO2         as HYBRID_SHARD, no reshard      ``2(M/n)(k-1)/k``
NO_SHARD                    shard = self, replicate = all    ``2M(nk-1)/nk``
==========================  ===============================  ==========================

Memory per rank (fp32 Adam): ``16Ψ/|shard|`` of model state plus the gathered units, so
``16Ψ/(nk)`` for FULL_SHARD / SHARD_GRAD_OP / hpZ, ``16Ψ/n`` for the hybrid strategies and
``16Ψ`` for NO_SHARD (whose "gather" is a local copy, kept from forward to backward: one more
``Ψ`` in the compute dtype). hpZ adds its secondary partitions, ``Ψ_u/h`` per resharded unit
in the compute dtype, from the unit's forward to its backward gather (``Ψ/h`` at the end of
forward).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import warnings

from shardkit import distributed as skdist

__all__ = ["ShardingStrategy", "UnitGroups", "resolve_sharding_strategy", "resolve_groups",
           "check_group_arguments",
           "groups_of_mesh", "check_quantization", "warn_quantization_without_effect"]


class ShardingStrategy(enum.Enum):
    """FairScale / torch FSDP1's sharding strategies (see the module docstring for costs)."""

    FULL_SHARD = "FULL_SHARD"            # ZeRO-3: params resharded after forward
    SHARD_GRAD_OP = "SHARD_GRAD_OP"      # ZeRO-2-like: params kept from forward to backward
    NO_SHARD = "NO_SHARD"                # DDP: replicas everywhere, gradients all-reduced
    HYBRID_SHARD = "HYBRID_SHARD"        # FULL_SHARD inside a node, replicated across nodes
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"  # SHARD_GRAD_OP inside a node, replicated

    @property
    def is_hybrid(self) -> bool:
        """Sharded inside a node and replicated across nodes."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)

    @property
    def reshards_after_forward(self) -> bool:
        """Frees each unit's gathered parameters after its forward (gathered again in
        backward): ZeRO-3 rather than ZeRO-2 memory."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


_VALID = ", ".join(s.name for s in ShardingStrategy)


def resolve_sharding_strategy(strategy, reshard_after_forward: Optional[bool]
                              ) -> tuple[ShardingStrategy, bool]:
    """``(strategy, reshard_after_forward)`` from the constructor's two arguments.

    ``strategy`` is a :class:`ShardingStrategy`, its name, a member of torch FSDP1's
    ``torch.distributed.fsdp.ShardingStrategy`` (read by name: torch's enum has the same five),
    or ``None`` (FULL_SHARD, or SHARD_GRAD_OP when ``reshard_after_forward=False``:
    FairScale's spelling). An explicit ``reshard_after_forward`` that contradicts the strategy
    is an error. Local, no communication."""
    if strategy is None:
        strategy = (ShardingStrategy.SHARD_GRAD_OP if reshard_after_forward is False
                    else ShardingStrategy.FULL_SHARD)
    elif isinstance(strategy, str) and strategy in ShardingStrategy.__members__:
        strategy = ShardingStrategy[strategy]
    elif isinstance(strategy, enum.Enum) and not isinstance(strategy, ShardingStrategy) \
            and strategy.name in ShardingStrategy.__members__:
        strategy = ShardingStrategy[strategy.name]  # torch.distributed.fsdp.ShardingStrategy
    elif not isinstance(strategy, ShardingStrategy):
        raise ValueError(f"FullyShardedDataParallel(sharding_strategy={strategy!r}): valid "
                         f"values are ShardingStrategy.{{{_VALID}}} (or their names)")
    implied = strategy.reshards_after_forward
    if strategy is ShardingStrategy.NO_SHARD:
        implied = False  # the "gather" is a local copy: keep it
    elif reshard_after_forward is not None and reshard_after_forward != implied:
        raise ValueError(f"FullyShardedDataParallel(sharding_strategy={strategy.name}, "
                         f"reshard_after_forward={reshard_after_forward}): {strategy.name} "
                         f"{'reshards' if implied else 'keeps parameters'} after forward; "
                         f"leave reshard_after_forward unset or pick the matching strategy")
    return strategy, implied


def check_quantization(strategy: ShardingStrategy, quantize_weights, quantize_gradients,
                       comm=None) -> None:
    """Refuse ZeRO++'s qwZ / qgZ on ``NO_SHARD``, which has nothing they apply to: its
    "gather" is a local copy and its gradients are all-reduced, never reduce-scattered, so the
    options (or a ``comm`` that is a quantizing :class:`~shardkit.quantized_transport.
    QuantizedTransport`) would silently send every byte in full precision. Local, before any
    collective."""
    if strategy is not ShardingStrategy.NO_SHARD:
        return
    asked = [f"{name}=True" for name, on in (("quantize_weights", quantize_weights),
                                             ("quantize_gradients", quantize_gradients))
             if on is True]
    if getattr(comm, "weights", False) or getattr(comm, "gradients", False):
        asked.append(f"comm={type(comm).__name__}(weights={comm.weights}, "
                     f"gradients={comm.gradients})")
    if asked:
        settings = ", ".join(asked)
        raise ValueError(f"FullyShardedDataParallel(sharding_strategy=NO_SHARD, {settings}): "
                         f"NO_SHARD has no weight all-gather (qwZ) nor gradient reduce-scatter "
                         f"(qgZ) to quantize; its gradient all-reduce stays exact. Use "
                         f"quantize_weights / quantize_gradients (or a quantizing comm) with "
                         f"FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD or _HYBRID_SHARD_ZERO2, or "
                         f"leave them off")


def warn_quantization_without_effect(strategy: ShardingStrategy, shard_group, transport,
                                     quantize_weights=False, quantize_gradients=False) -> None:
    """Warn (a RuntimeWarning, as often as the warning filters say: by default once per
    calling line) when a hybrid strategy's shard group has one rank (one rank per
    node, or a ``(k, 1)`` mesh) and qwZ / qgZ are on (the options, or a ``transport`` that
    quantizes): such a unit gathers nothing and reduce-scatters nothing, and its gradient
    all-reduce across the replicas stays exact, so they change no byte. A warning, not an
    error: the same script quantizes on nodes of several ranks. Local."""
    if not strategy.is_hybrid or skdist.get_world_size(shard_group) != 1:
        return
    weights, gradients = (getattr(transport, name, False) for name in ("weights", "gradients"))
    if not (weights or gradients):
        return
    if quantize_weights or quantize_gradients:
        asked = ", ".join(f"{name}=True" for name, on in (("quantize_weights", quantize_weights),
                                                          ("quantize_gradients",
                                                           quantize_gradients)) if on)
    else:
        asked = f"comm={type(transport).__name__}(weights={weights}, gradients={gradients})"
    warnings.warn(f"FullyShardedDataParallel(sharding_strategy={strategy.name}, {asked}): the "
                  f"shard group has one rank (one rank per node), so there is no weight "
                  f"all-gather (qwZ) nor gradient reduce-scatter (qgZ) to quantize; the gradient "
                  f"all-reduce across the replicas stays exact and every byte is sent in full "
                  f"precision. Shard over several ranks per node (a (replicate, shard) mesh with "
                  f"shard > 1), or use FULL_SHARD, whose qgZ reduces hierarchically across "
                  f"nodes", RuntimeWarning, stacklevel=3)


@dataclass(frozen=True)
class UnitGroups:
    """The groups one unit communicates over (module docstring)."""

    shard: object
    replicate: object = None
    hpz: object = None


# (ranks cut into blocks, block size) -> this rank's block's process group
_cached_groups = skdist.GroupCache()


def _group_of_blocks(ranks: list[int], block: int, mine: int, group=None):
    """The group of the ``block`` consecutive entries of ``ranks`` that holds global rank
    ``mine``; ``group`` is the process group of ``ranks`` (``None``: the world).

    Over the whole world every rank creates every block (as torch's ``new_group`` requires).
    Over a sub-group (FSDP on one of several data-parallel groups) only the ranks of ``ranks``
    call this, so each creates only its own block, among the block's members, after the
    group's members agreed on their count of registered groups (torch names such a group from
    its ranks and that count): creating every block of this rank's sub-group world-wide paired
    ``new_group`` calls for different ranks across the sub-groups, and every rank hung.
    Collective over ``group`` the first time (one small object all-gather for a sub-group),
    cached after (by ``ranks`` and ``block``, which every member passes alike)."""
    key = (tuple(ranks), block)
    cached = _cached_groups.current()
    if key in cached:
        return cached[key]
    blocks = [tuple(ranks[i:i + block]) for i in range(0, len(ranks), block)]
    own = next(b for b in blocks if mine in b)
    if len(ranks) == skdist.get_world_size():
        created = [skdist.new_group(b) for b in blocks]
        cached[key] = created[blocks.index(own)]
    else:
        cached[key], = skdist.new_groups_among_members([own], group)
    return cached[key]


def _self_group():
    """A group holding only this rank (NO_SHARD's shard group), created by this rank alone the
    first time, cached after. Local: no other rank joins, so NO_SHARD on one of several
    data-parallel groups needs only that group's ranks. (Creating every rank's group on every
    rank of the world advanced only the builders' count of world groups, which torch names
    groups by: the next group created over the whole world got different names on the ranks,
    and every rank hung.)"""
    key = ("self", skdist.get_rank())
    cached = _cached_groups.current()
    if key not in cached:
        cached[key] = skdist.new_group([skdist.get_rank()], members_only=True)
    return cached[key]


def _check_pair(pair) -> tuple:
    if not isinstance(pair, tuple) or len(pair) != 2:
        raise ValueError(f"FullyShardedDataParallel(process_group={pair!r}): hybrid sharding "
                         f"takes a pair (intra_node_group, inter_node_group) or None (the "
                         f"groups of shardkit.distributed.node_groups())")
    intra, inter = pair
    if isinstance(pair, MeshPair):  # checked against its mesh by groups_of_mesh
        return intra, inter
    _check_grid(intra, inter)
    return intra, inter


class MeshPair(tuple):
    """The (shard, replicate) pair of a 2-D DeviceMesh, checked against the mesh by
    :func:`groups_of_mesh` (locally), so it skips :func:`_check_grid`'s gathers."""


def _check_grid(intra_group, inter_group) -> None:
    """The ranks' pairs must form a grid of nodes x ranks per node: each rank in both of its
    groups and in no other rank of both, every member of a group naming the same group, the
    shard groups (and the replica groups) of the grid all one size, and a replica group
    joining the ranks that hold the same shard (the same place in their shard groups).
    Otherwise replicas would average different shards, or the ranks would wait on each
    other's collectives.

    Each rank gathers the pairs it sees over its own two groups, twice in turn (four small
    object all-gathers, in the order of the unit's argument check), which reaches every rank
    of its grid. So a mismatch, even on one rank, is a ValueError on every rank of the grid,
    and grids side by side (one per pipeline stage) are checked by their own ranks only,
    each whenever it builds a unit. Nothing is cached: a pair checked on some ranks but not
    on others (a second model over other groups on some ranks) left the ranks that skipped
    the check running while the others waited for them in it."""
    me = skdist.get_rank()
    seen = {me: (tuple(skdist.group_ranks(intra_group)), tuple(skdist.group_ranks(inter_group)))}
    for group in (intra_group, inter_group, intra_group, inter_group):
        for theirs in skdist.all_gather_object(seen, group=group):
            seen.update(theirs)
    problems = _grid_problems(seen)
    if problems:
        raise ValueError("FullyShardedDataParallel(process_group=(intra_node_group, "
                         "inter_node_group)): the ranks' pairs do not form one grid of nodes x "
                         "ranks per node:\n  " + "\n  ".join(problems[:6])
                         + "\nBuild the pairs from shardkit.distributed.node_groups() or a 2-D "
                         "torch DeviceMesh")


def _pair_problem(r: int, intra: tuple, inter: tuple) -> Optional[str]:
    if r not in intra or r not in inter:
        return f"rank {r} (intra {list(intra)}, inter {list(inter)}) must be in both groups"
    if set(intra) & set(inter) != {r}:
        return (f"rank {r} (intra {list(intra)}, inter {list(inter)}): the groups must share "
                f"only this rank; a shard group and its replica group are orthogonal")
    return None


def _grid_problems(pairs: dict) -> list[str]:
    """What keeps ``pairs`` (global rank r -> r's (intra ranks, inter ranks), for the ranks
    seen) from forming a grid; a member of a group whose pair was not seen counts as a
    problem (in a grid, every member of both groups of every rank seen is seen)."""
    ranks = sorted(pairs)
    problems = [p for r in ranks for p in [_pair_problem(r, *pairs[r])] if p]
    if problems:
        return problems
    unseen = sorted({m for r in ranks for group in pairs[r] for m in group} - set(pairs))
    if unseen:
        return [f"ranks {unseen} are in the groups of ranks {ranks} but build no unit over "
                f"them (or over other groups)"]
    for r in ranks:
        intra, inter = pairs[r]
        for kind, group in (("intra", 0), ("inter", 1)):
            members = pairs[r][group]
            others = [m for m in members if pairs[m][group] != members]
            if others:
                problems.append(f"rank {r}'s {kind}-node group is {list(members)}, but rank "
                                f"{others[0]}'s is {list(pairs[others[0]][group])}")
        place = intra.index(r)
        misplaced = [m for m in inter if pairs[m][0].index(m) != place]
        if misplaced:
            m = misplaced[0]
            problems.append(f"rank {r} (shard {place} of {list(intra)}) is a replica of rank {m} "
                            f"(shard {pairs[m][0].index(m)} of {list(pairs[m][0])})")
    sizes = ({len(pairs[r][0]) for r in ranks}, {len(pairs[r][1]) for r in ranks})
    if len(sizes[0]) > 1 or len(sizes[1]) > 1:
        problems.append(f"the groups differ in size (intra-node sizes {sorted(sizes[0])}, "
                        f"inter-node sizes {sorted(sizes[1])})")
    return problems


def groups_of_mesh(device_mesh, strategy: ShardingStrategy):
    """``process_group`` from a torch ``DeviceMesh`` (its groups already exist): a 2-D mesh
    ``(replicate, shard)`` for hybrid strategies gives ``(shard group, replicate group)``, as
    torch FSDP1 reads it; a 1-D mesh for the others gives its one group.

    A 2-D mesh's pair skips :func:`_check_grid`'s all-gathers (a mesh that covers part of the
    world, one pipeline stage's ``mesh["replicate", "shard"]``, needs only its own ranks, as
    under torch). Its groups must be its mesh tensor's row and column through this rank
    (``DeviceMesh.from_group`` takes any groups): checked here, locally; that the
    ranks hold the same mesh tensor is checked with the unit's arguments (over its own groups).
    Local, no communication."""
    ndim = getattr(device_mesh, "ndim", None)
    wanted = 2 if strategy.is_hybrid else 1
    if ndim != wanted:
        if ndim is None:
            hint = ("; it is not a DeviceMesh (process groups go in process_group=, a pair "
                    "(intra_node, inter_node) for the hybrid strategies)")
        elif ndim == 2:
            hint = ("; a 2-D (replicate, shard) mesh is for HYBRID_SHARD / _HYBRID_SHARD_ZERO2 "
                    "(torch fully_shard's HSDP)")
        elif wanted == 2 and ndim == 1:
            hint = ("; a 1-D mesh is for FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
        else:
            hint = ("; slice it to the dimensions it shards over, e.g. "
                    + ('mesh["replicate", "shard"]' if wanted == 2 else 'mesh["shard"]'))
        raise ValueError(f"FullyShardedDataParallel(device_mesh={device_mesh!r}, "
                         f"sharding_strategy={strategy.name}): expected a {wanted}-D "
                         f"torch DeviceMesh" + (" (replicate, shard)" if wanted == 2 else "")
                         + f", got ndim={ndim}" + hint)
    if wanted == 2:
        shard, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        _check_mesh_groups(device_mesh, shard, replicate, strategy)
        return MeshPair((shard, replicate))
    return device_mesh.get_group(0)


def _check_mesh_groups(device_mesh, shard, replicate, strategy: ShardingStrategy) -> None:
    """The mesh's shard group must be its row through this rank and its replicate group its
    column (a mesh from ``DeviceMesh.from_group`` may hold other groups: replicas would then
    average different shards, silently). Local."""
    grid, me = device_mesh.mesh.tolist(), skdist.get_rank()
    where = [(i, row.index(me)) for i, row in enumerate(grid) if me in row]
    have = (skdist.group_ranks(shard), skdist.group_ranks(replicate))
    want = (grid[where[0][0]], [row[where[0][1]] for row in grid]) if where else None
    if have != want:
        raise ValueError(f"FullyShardedDataParallel(device_mesh=..., sharding_strategy="
                         f"{strategy.name}): on global rank {me} the mesh {grid} has shard "
                         f"group {have[0]} and replicate group {have[1]}, but its row and column "
                         f"through this rank are {want and list(want)}; build the mesh with "
                         f"init_device_mesh or give DeviceMesh.from_group the groups of its "
                         f"mesh's columns (replicate) and rows (shard)")


def check_group_arguments(strategy: ShardingStrategy, process_group,
                          hpz_partition_size: int = 1) -> None:
    """The checks of :func:`resolve_groups` that need no communication: ``hpz_partition_size``
    (an int >= 1, FULL_SHARD only, dividing the group's size) and a pair of groups for the
    hybrid strategies only. Local."""
    if not isinstance(hpz_partition_size, int) or isinstance(hpz_partition_size, bool) \
            or hpz_partition_size < 1:
        raise ValueError(f"FullyShardedDataParallel(hpz_partition_size={hpz_partition_size!r}): "
                         f"must be an int >= 1 (1: no secondary partition)")
    if hpz_partition_size > 1 and strategy is not ShardingStrategy.FULL_SHARD:
        raise ValueError(f"FullyShardedDataParallel(hpz_partition_size={hpz_partition_size}, "
                         f"sharding_strategy={strategy.name}): hpZ keeps a secondary partition "
                         f"between a resharding forward and backward; use FULL_SHARD")
    if strategy.is_hybrid:
        return
    if isinstance(process_group, tuple):
        raise ValueError(f"FullyShardedDataParallel(process_group=<pair>, sharding_strategy="
                         f"{strategy.name}): a pair of groups is for HYBRID_SHARD / "
                         f"_HYBRID_SHARD_ZERO2; pass one group (or None) for {strategy.name}")
    size = skdist.get_world_size(process_group)
    if hpz_partition_size > 1 and size % hpz_partition_size:
        valid = ", ".join(str(d) for d in range(1, size + 1) if size % d == 0)
        raise ValueError(f"FullyShardedDataParallel(hpz_partition_size={hpz_partition_size}): "
                         f"must divide the process group's size {size} (valid values: {valid}; "
                         f"usually the ranks per node, {skdist.ranks_per_node()})")


def resolve_groups(strategy: ShardingStrategy, process_group,
                   hpz_partition_size: int = 1) -> UnitGroups:
    """The :class:`UnitGroups` of ``strategy`` over ``process_group`` (a group, ``None`` for the
    world, or for hybrid strategies a pair ``(intra_node, inter_node)``). Checks happen before
    any group is created (:func:`check_group_arguments`). Creating hpZ's or node_groups()'s
    groups is collective on the world the first time (hpZ's over a sub-group: on that
    sub-group), cached after; NO_SHARD's group of this rank alone is local; an explicit hybrid
    pair is checked over its own two groups (:func:`_check_grid`)."""
    check_group_arguments(strategy, process_group, hpz_partition_size)
    if strategy.is_hybrid:
        intra, inter = (skdist.node_groups() if process_group is None
                        else _check_pair(process_group))
        return UnitGroups(intra, inter if skdist.get_world_size(inter) > 1 else None)
    if strategy is ShardingStrategy.NO_SHARD:
        if skdist.get_world_size(process_group) == 1:
            return UnitGroups(_self_group())
        if process_group is None:  # None would read as "no replicas": name the world
            ranks = list(range(skdist.get_world_size()))
            process_group = _group_of_blocks(ranks, len(ranks), skdist.get_rank())
        return UnitGroups(_self_group(), process_group)
    if hpz_partition_size == 1:
        return UnitGroups(process_group)
    if process_group is None and hpz_partition_size == skdist.ranks_per_node():
        return UnitGroups(None, None, skdist.node_groups()[0])
    # (a block of the whole group is a named group too: None would read as "no hpZ")
    ranks = _node_by_node(skdist.group_ranks(process_group), hpz_partition_size, process_group)
    hpz = _group_of_blocks(ranks, hpz_partition_size, skdist.get_rank(), process_group)
    return UnitGroups(process_group, None, hpz)


def _node_by_node(ranks: list[int], block: int, group=None) -> list[int]:
    """``ranks`` (those of ``group``) node by node (the nodes they really run on, see
    :func:`shardkit.distributed.ranks_by_node`) when ``block`` divides the number of them on
    every node, so that each hpZ block of ``block`` consecutive entries stays inside one node
    whatever order the launcher numbered the ranks in; else ``ranks`` as given. Gathers the
    nodes of ``group``'s ranks over ``group`` the first time if
    :func:`shardkit.distributed.init_distributed` did not gather the layout (one small object
    all-gather, see :func:`shardkit.distributed.group_ranks_by_node`: over the world, the
    ranks of the other data-parallel groups were waited for); no tensor traffic."""
    nodes = skdist.group_ranks_by_node(ranks, group)
    if all(len(node) % block == 0 for node in nodes):
        return [rank for node in nodes for rank in node]
    return list(ranks)
