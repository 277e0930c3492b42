"""Which node each rank runs on, and the groups that follow the nodes: the node layout gathered
over the default group (:func:`discover_node_layout`), the questions asked of it
(:func:`node_of`, :func:`ranks_per_node`, :func:`spans_nodes`) and the intra-/inter-node groups
built from it (:func:`node_groups`, :func:`groups_of_nodes`). Collective only where a function
says so (a small object all-gather, not counted by ``CommCounter``, or group creation).
Re-exported by :mod:`shardkit.distributed`."""

from __future__ import annotations

import atexit
import gc
import os
from typing import Optional, Sequence

import torch.distributed as dist

from shardkit.broken_links import (_this_process, forget_processes, remember_processes,
                                   reporting_broken_links)
from shardkit.process_groups import (_GROUP_CACHES, _SINGLE_RANK_GROUPS, GroupCache, _check_call,
                                     get_rank, get_world_size, group_ranks, is_initialized,
                                     new_group)

# Which ranks share a node comes from the launcher: LOCAL_WORLD_SIZE ranks per node, and each
# rank's node is its GROUP_RANK (torchrun's node rank). Launchers need not number ranks node by
# node (srun's cyclic distribution puts rank 1 on the second node), so the node of every rank is
# gathered once (init_distributed, or the first node_groups()) instead of being computed as
# rank // LOCAL_WORLD_SIZE. Without GROUP_RANK the host name tells the nodes apart; on one host
# without it, ranks are cut node by node into LOCAL_WORLD_SIZE. Without LOCAL_WORLD_SIZE every
# rank counts as being on one node.

_layout: Optional[tuple] = None  # (the default group it was gathered in, node index per rank)


def _forget_topology() -> None:
    """Drop the gathered layout, the groups cached for topology, the single-rank groups
    (:func:`~shardkit.distributed.single_rank_group`) and every :class:`GroupCache`. They hold the
    default group and its node groups: a group still referenced outlives ``destroy_process_group``
    with its gloo connections open, and is torn down at interpreter exit instead, when the
    ranks no longer wait for each other (gloo then aborted a rank now and then: "terminate
    called without an active exception")."""
    global _node_groups, _layout
    _node_groups = _layout = None
    forget_processes()
    _spanning.clear()
    _SINGLE_RANK_GROUPS.clear()  # they hold the default group too (single_rank_group)
    for cache in _GROUP_CACHES:
        cache.forget()


def _forget_torn_down_worlds() -> None:
    """At interpreter exit, drop what :func:`_forget_topology` drops where torch's own
    ``destroy_process_group()`` (not :func:`~shardkit.distributed.destroy`) tore the default
    group down; a default group still up is left as torch leaves it.

    Note: held here, the torn-down groups lived on into the interpreter's finalization with
    their gloo worker threads running; a worker that let go of a finished collective's tensors
    after the finalization began needed the GIL, was stopped, and took the process down
    (SIGABRT, "terminate called without an active exception"; 1 run in 20-55 of FairScale's
    ShardedDDP test_step, which ends with a plain ``destroy_process_group()``). Dropped here,
    before the finalization, each group's destructor joins its threads (a collection first
    lets go of wrappers left in reference cycles, which hold their groups too)."""
    if not is_initialized():
        _forget_topology()
        gc.collect()


atexit.register(_forget_torn_down_worlds)


def _node_identity() -> tuple:
    """What this rank knows of its node: ``(GROUP_RANK or None, host name)``."""
    import socket
    group_rank = os.environ.get("GROUP_RANK")
    return (int(group_rank) if group_rank not in (None, "") else None, socket.gethostname())


def layout_from_identities(identities: Sequence[tuple], per_node: int,
                           ranks: Optional[Sequence[int]] = None) -> list[int]:
    """The node index of every rank from each rank's ``(GROUP_RANK or None, host name)``:
    nodes are the distinct GROUP_RANKs (when every rank has one), else the distinct host names
    (when there are several), else consecutive blocks of ``per_node`` global ranks. Nodes are
    numbered by GROUP_RANK, or by their lowest rank. ``ranks``: the global ranks the
    identities belong to (ascending; default: all ranks, ``0..len-1``). Local; no
    communication."""
    ranks = range(len(identities)) if ranks is None else ranks
    if all(group_rank is not None for group_rank, _ in identities):
        keys = [group_rank for group_rank, _ in identities]
        order = sorted(set(keys))
    elif len({host for _, host in identities}) > 1:
        keys = [host for _, host in identities]
        order = list(dict.fromkeys(keys))
    else:
        return [rank // per_node for rank in ranks]
    return [order.index(key) for key in keys]


def _ranks_per_node_hint() -> int:
    """``LOCAL_WORLD_SIZE`` (at least 1), or the world size where it is unset or not a number
    (:func:`ranks_per_node` names a bad value where topology is used). Local."""
    size = get_world_size()
    try:
        return max(int(os.environ.get("LOCAL_WORLD_SIZE", size)), 1)
    except ValueError:
        return size


def discover_node_layout() -> list[int]:
    """Gather every rank's node (see the notes above) over the default group and keep it for
    :func:`node_of`, :func:`spans_nodes` and :func:`node_groups`; returns the node index of
    every rank. Collective over the default group (one small object all-gather, not counted
    by :class:`~shardkit.distributed.CommCounter`); a no-op for a world of one."""
    global _layout
    world = dist.group.WORLD
    if _layout is not None and _layout[0] is world:
        return _layout[1]
    size = get_world_size()
    mine = (_node_identity(), _this_process())
    gathered = [mine] * size
    if size > 1:
        dist.all_gather_object(gathered, mine)
    identities = [identity for identity, _ in gathered]
    remember_processes(world, [process for _, process in gathered])
    _layout = (world, layout_from_identities(identities, _ranks_per_node_hint()))
    _spanning.clear()  # answers cached before the layout was known
    return _layout[1]


def _known_layout() -> Optional[list]:
    """The gathered node of every rank for the current default group, or ``None``."""
    if _layout is not None and is_initialized() and _layout[0] is dist.group.WORLD:
        return _layout[1]
    return None


def node_layout_known() -> bool:
    """Whether the node of every rank was gathered for the current default group (by
    :func:`~shardkit.distributed.init_distributed` or a first :func:`node_groups`), so that
    :func:`ranks_by_node` costs no communication."""
    return _known_layout() is not None


def ranks_per_node() -> int:
    """Ranks on each node: torchrun's ``LOCAL_WORLD_SIZE`` (without it: as many as the gathered
    layout puts on each node, or the world size).

    Raises RuntimeError when the world is not a whole number of equal nodes, or when the ranks'
    GROUP_RANKs (or host names) put a number of ranks other than ``LOCAL_WORLD_SIZE`` on some
    node (the same error on every rank once the layout is gathered)."""
    world = get_world_size()
    layout = _known_layout()
    members = None if layout is None else _node_members(layout)
    if members is not None and len({len(ranks) for ranks in members}) > 1:
        raise RuntimeError(f"the ranks' nodes are {_describe_nodes(members)}: shardkit needs the "
                           f"same number of ranks on every node")
    default = world if members is None else len(members[0])
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        per_node = int(raw) if raw else default
    except ValueError:
        raise RuntimeError(f"LOCAL_WORLD_SIZE={raw!r} is not an integer; it must be the number "
                           f"of ranks on each node (torchrun's --nproc_per_node)") from None
    if per_node < 1 or world % per_node:
        raise RuntimeError(f"LOCAL_WORLD_SIZE={per_node} does not divide the world size {world}; "
                           f"shardkit needs the same number of ranks on every node")
    if members is not None and per_node != len(members[0]):
        raise RuntimeError(f"the ranks' nodes are {_describe_nodes(members)}, but "
                           f"LOCAL_WORLD_SIZE={per_node}")
    return per_node


class NodeNumberingUnknown(RuntimeError):
    """The node of the ranks asked about was not gathered, and ``GROUP_RANK`` is set by a
    launcher other than torchrun: it placed the ranks, perhaps not node by node (srun's
    cyclic distribution), and one rank cannot tell from its own ``GROUP_RANK`` where the
    others run, so no rank guesses.
    Raised on every rank alike where a rank's node is asked for (:func:`node_of`,
    :func:`spans_nodes`); never from inside a collective."""


def _refuse_to_guess(what: str) -> None:
    """Raise :class:`NodeNumberingUnknown` (naming ``what``) where ``GROUP_RANK`` is set by a
    launcher other than torchrun: the blocks ``rank // LOCAL_WORLD_SIZE`` hold for torchrun's
    numbering (its agents hand out consecutive global ranks node by node), and with another
    launcher's round-robin placement they were wrong on the ranks whose own ``GROUP_RANK``
    happened to match them. Every rank of a launch has ``GROUP_RANK`` (and torchrun's
    ``TORCHELASTIC_RUN_ID``) or none has, so the ranks raise alike. Local."""
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank not in (None, "") and not _launched_by_torchrun():
        raise NodeNumberingUnknown(
            f"the node of {what} is unknown: GROUP_RANK={group_rank} says a launcher placed the "
            f"ranks, perhaps not node by node, and the node of every rank was not gathered; "
            f"call shardkit.distributed.node_groups() (or init_distributed()) on every rank "
            f"first")


def _launched_by_torchrun() -> bool:
    """Whether torchrun (torch.distributed.elastic) started this process: its agent sets
    ``TORCHELASTIC_RUN_ID`` in every worker it starts. Local."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def _describe_nodes(members: Sequence[Sequence[int]]) -> str:
    text = ", ".join(f"node {node}: ranks {list(ranks)}" for node, ranks in enumerate(members))
    return f"{text} (from GROUP_RANK, or the host name)"


def _node_members(layout: Sequence[int]) -> list[list[int]]:
    """The global ranks of each node, in rank order, nodes in index order."""
    members: list[list[int]] = [[] for _ in range(max(layout) + 1)]
    for rank, node in enumerate(layout):
        members[node].append(rank)
    return [ranks for ranks in members if ranks]


def node_of(rank: int) -> int:
    """The node (torchrun's group rank) that global rank ``rank`` runs on, from the gathered
    layout; without one (a process group made by torch itself), consecutive blocks of
    :func:`ranks_per_node` ranks where no ``GROUP_RANK`` is set or torchrun set it, else
    :class:`NodeNumberingUnknown` on every rank."""
    per_node = ranks_per_node()
    layout = _known_layout()
    if layout is not None:
        return layout[rank]
    _refuse_to_guess(f"rank {rank}")
    return rank // per_node


_spanning: dict = {}  # id(group object) -> (the object, whether its ranks span nodes)


def spans_nodes(group=None) -> bool:
    """Whether the ranks of ``group`` (``None``: the default group) sit on more than one node.
    Cached per group; costs no communication. Every rank of ``group`` gives the same answer:
    from the gathered layout; else from the nodes of the group's ranks gathered over a group
    holding them all (:func:`group_ranks_by_node`, which hpZ, qgZ and
    ``quantized_comm.node_groups`` call); else ``True`` where the group holds more ranks than
    a node (``LOCAL_WORLD_SIZE``) does; else as :func:`node_of` (raising
    :class:`NodeNumberingUnknown` where a launcher other than torchrun set ``GROUP_RANK``)."""
    resolved = group if group is not None else (dist.group.WORLD if is_initialized() else None)
    entry = _spanning.get(id(resolved))
    if entry is None or entry[0] is not resolved:
        ranks = group_ranks(group) if is_initialized() else [0]
        entry = (resolved, _ranks_span_nodes(ranks))
        _spanning[id(resolved)] = entry
    return entry[1]


def _ranks_span_nodes(ranks: Sequence[int]) -> bool:
    """:func:`spans_nodes` for the global ``ranks``, uncached. Local."""
    layout = _known_layout()
    if layout is not None:
        return len({layout[rank] for rank in ranks}) > 1
    identities = _GATHERED_IDENTITIES.current()
    if all(rank in identities for rank in ranks):
        ranks = sorted(ranks)
        return len(_nodes_of_identities(ranks, [identities[rank] for rank in ranks])) > 1
    if not os.environ.get("LOCAL_WORLD_SIZE"):
        return False  # nothing gathered and no node size: one node (see the notes above)
    if len(ranks) > ranks_per_node():
        return True  # more ranks than fit on one node, wherever each runs
    return len({node_of(rank) for rank in ranks}) > 1


def spans_nodes_if_known(group=None) -> Optional[bool]:
    """:func:`spans_nodes`, or ``None`` where the ranks cannot know it (see
    :class:`NodeNumberingUnknown`). For the collectives' own records: raising there, before
    the op is issued, would leave the other ranks waiting in it. Local."""
    try:
        return spans_nodes(group)
    except NodeNumberingUnknown:
        return None


_node_groups: Optional[tuple] = None  # (the default group they were made in, (intra, inter))


def node_groups() -> tuple:
    """``(intra_node, inter_node)``: the group of the ranks on this rank's node, and the group of
    the ranks with this rank's local index on every node (the data-parallel replicas of hybrid
    sharding). Nodes are where the ranks really run (their GROUP_RANK or host), whatever order
    the launcher numbered them in. Collective the first time (gathers the layout if
    :func:`~shardkit.distributed.init_distributed` did not, then creates one group per node and one
    per local index, on every rank alike), cached after. Costs no tensor traffic."""
    global _node_groups
    world = dist.group.WORLD
    if _node_groups is None or _node_groups[0] is not world:  # none yet, or a new default group
        layout = discover_node_layout()
        ranks_per_node()  # every rank holds the same layout: raises on all ranks or on none
        _node_groups = (world, _groups_of_node_members(_node_members(layout)))
    return _node_groups[1]


def _groups_of_node_members(members: Sequence[Sequence[int]]) -> tuple:
    """This rank's ``(intra, inter)`` groups for nodes holding the global ranks ``members``
    (equal sizes): one group per node, one per local index across nodes (every rank creates
    all of them in one order, as ``new_group`` requires; ``None`` where this rank is not a
    member). Each group's ranks are passed ascending, so a group's rank order is its global
    rank order whatever the node order. Collective; costs no tensor traffic."""
    me = get_rank()
    intra = inter = None
    for ranks in members:
        ranks = sorted(ranks)
        created = new_group(ranks)
        intra = created if me in ranks else intra
    for local in range(len(members[0])):
        ranks = sorted(node[local] for node in members)
        created = new_group(ranks)
        inter = created if me in ranks else inter
    return intra, inter


def ranks_by_node(ranks: Sequence[int]) -> list[list[int]]:
    """The global ``ranks`` grouped by the node each runs on: the gathered layout (see the notes
    above), whatever order the launcher numbered the ranks in. Nodes come in the order of their
    lowest rank, ranks ascending inside each, so torchrun's node-by-node numbering gives
    consecutive blocks. Collective over the default group only the first time, when
    :func:`~shardkit.distributed.init_distributed` did not gather the layout (one small object
    all-gather); no tensor traffic after."""
    layout = discover_node_layout()  # the cached one when already gathered
    by_node: dict = {}
    for rank in sorted(ranks):
        by_node.setdefault(layout[rank], []).append(rank)
    return list(by_node.values())


# the global ranks of a sub-group -> its ranks by node, gathered over the sub-group
_SUB_GROUP_NODES = GroupCache()
# global rank -> its node identity (GROUP_RANK or None, host name), as gathered over the
# sub-groups above: spans_nodes() answers from them for the groups made of those ranks
_GATHERED_IDENTITIES = GroupCache()


def group_ranks_by_node(ranks: Sequence[int], group=None, gather: bool = True
                        ) -> Optional[list[list[int]]]:
    """:func:`ranks_by_node` for the global ``ranks`` of ``group`` (``None``:
    the world), gathering only over ``group`` when the world's layout is not known yet.

    With a world set up by torch's own ``init_process_group`` nobody gathered the node of
    every rank; ``ranks_by_node`` would gather it over the whole world, so a data-parallel
    sub-group building hpZ / qgZ waited for the ranks of every other sub-group, and hung
    unless they all built at that moment. Here the members gather their own nodes (GROUP_RANK,
    or the host name; else consecutive blocks of ``LOCAL_WORLD_SIZE`` global ranks), which
    gives the grouping the world's layout would (except without GROUP_RANK, with every member
    on one host and ``LOCAL_WORLD_SIZE`` blocks that do not match the hosts). Collective over
    ``group`` the first time for a sub-group (one small object all-gather), cached after; no
    communication when the layout is known; for the whole world it is ``ranks_by_node``.
    ``gather=False``: ``None`` instead of gathering (local, for the steps after set-up)."""
    ranks = sorted(ranks)
    if node_layout_known():
        return ranks_by_node(ranks)
    cached = _SUB_GROUP_NODES.current()
    key = tuple(ranks)
    if key not in cached:
        if not gather:
            return None
        if len(ranks) == get_world_size():
            return ranks_by_node(ranks)  # gathers the world's layout, known after
        identities = _gather_node_identities(group)
        of_rank = dict(zip(group_ranks(group), identities))  # in the group's order
        cached[key] = _nodes_of_identities(ranks, [of_rank[rank] for rank in ranks])
        _GATHERED_IDENTITIES.current().update(of_rank)
        _spanning.clear()  # answers given before these nodes were known
    return [list(node) for node in cached[key]]


def _gather_node_identities(group) -> list[tuple]:
    """Every rank's :func:`_node_identity`, in ``group``'s rank order: one object all-gather
    over ``group``, not counted by ``CommCounter`` (as ``shardkit.distributed``'s
    ``all_gather_object(counted=False)``, which builds on this module); a broken link is a
    ``CollectiveError`` naming "node layout"."""
    _check_call("all_gather_object", group)
    identities = [None] * get_world_size(group)
    with reporting_broken_links("node layout", group):
        dist.all_gather_object(identities, _node_identity(), group=group)
    return identities


def _nodes_of_identities(ranks: list[int], identities: Sequence[tuple]) -> list[list[int]]:
    """The global ``ranks`` (ascending; ``identities`` in the same order) grouped by node with
    :func:`layout_from_identities`'s rule, nodes in the order of their lowest rank. Local."""
    by_node: dict = {}
    layout = layout_from_identities(identities, _ranks_per_node_hint(), ranks)
    for rank, node in zip(ranks, layout):
        by_node.setdefault(node, []).append(rank)
    return list(by_node.values())


def check_equal_nodes(members: Sequence[Sequence[int]], what: str) -> None:
    """Raise ValueError, naming ``what``, unless every node of ``members`` (from
    :func:`ranks_by_node`) holds the same number of ranks. Every rank holds the same layout,
    so it raises on every rank or on none. Local; no communication."""
    if len({len(ranks) for ranks in members}) > 1:
        layout = _known_layout() or []
        nodes = ", ".join(f"ranks {list(ranks)} on node "
                          f"{layout[ranks[0]] if ranks[0] < len(layout) else '?'}"
                          for ranks in members)
        raise ValueError(f"{what}: the ranks sit on nodes of unequal sizes ({nodes}; nodes from "
                         f"GROUP_RANK, or the host name); it needs the same number of ranks on "
                         f"every node")


def groups_of_nodes(ranks: Sequence[int], per_node: Optional[int] = None) -> tuple:
    """This rank's ``(intra, inter)`` groups for the global ``ranks``: one group per node, one
    per local index across nodes (every rank creates all of them, as ``new_group`` requires;
    ``None`` where this rank is not a member). ``per_node=None``: the nodes the ranks really
    run on (:func:`ranks_by_node`; ValueError on every rank when they hold unequal numbers of
    ``ranks``); ``per_node=m``: ``ranks`` cut into consecutive blocks of ``m`` (node-major
    numbering taken as given). Collective (and gathers the layout the first time, see
    :func:`ranks_by_node`); costs no tensor traffic."""
    if per_node is None:
        members = ranks_by_node(ranks)
        check_equal_nodes(members, "groups_of_nodes")
    else:
        members = [list(ranks[start:start + per_node])
                   for start in range(0, len(ranks), per_node)]
    return _groups_of_node_members(members)
