"""The one road by which shardkit talks to other ranks.

Every collective shardkit issues goes through a function of this module, so that
:class:`CommCounter` can count the bytes each rank puts on the wire and tests can assert
communication volume as a number. Nothing outside this layer (this module and the modules
it re-exports from, below) calls ``torch.distributed`` collectives directly.

Byte convention (see DESIGN.md), for a tensor whose full logical size is ``S`` bytes
(all-reduce input, all-gather output, reduce-scatter input) in a group of ``n`` ranks:
all_reduce ``2(n-1)/n*S``; all_gather, reduce_scatter, broadcast, reduce ``(n-1)/n*S``;
send ``S``; recv ``0``. These are the bytes a rank sends under ring algorithms, rooted ops
averaged over the ranks.

The rest of the layer lives beside it, one module per concept, and every name is re-exported
here (import them from this module): :mod:`shardkit.process_groups` (ranks, groups, argument
checks), :mod:`shardkit.broken_links` (errors for a connection that broke),
:mod:`shardkit.topology` (which ranks share a node) and :mod:`shardkit.dist_setup` (start-up
and teardown).
"""

from __future__ import annotations

import datetime
import pickle
import sys
import types
import weakref
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from shardkit import broken_links, collective_check, comm_counter, topology
from shardkit.collective_check import set_debug_collectives  # re-exported: the documented switch
from shardkit.comm_counter import CommCounter, CommRecord  # re-exported: counting lives there
# re-exported: the sections of this layer that live in modules of their own (see above)
from shardkit.process_groups import (  # noqa: F401
    _GROUP_CACHES, _SINGLE_RANK_GROUPS, GroupCache, _check_call, _check_peer, _not_a_member,
    _require_process_group, backend_of, check_group, check_member, get_global_rank, get_rank,
    get_world_size, group_ranks, is_initialized, new_group, require_initialized, resolved_group,
    single_rank_group, timeout_of)
from shardkit.broken_links import (  # noqa: F401
    _BROKEN_LINK_WORDS, CollectiveError, _known_processes, _members_if_known, _process_exited,
    _raise_as_broken_link, _this_process, broken_link_error, exited_peers_on_this_host,
    is_broken_link, operation_words, reporting_broken_links)
from shardkit.topology import (  # noqa: F401
    _GATHERED_IDENTITIES, _SUB_GROUP_NODES, NodeNumberingUnknown, _describe_nodes,
    _forget_topology, _groups_of_node_members, _known_layout, _launched_by_torchrun,
    _node_identity, _node_members, _nodes_of_identities, _ranks_per_node_hint,
    _ranks_span_nodes, _refuse_to_guess, _spanning, check_equal_nodes, discover_node_layout,
    group_ranks_by_node, groups_of_nodes, layout_from_identities, node_groups,
    node_layout_known, node_of, ranks_by_node, ranks_per_node, spans_nodes, spans_nodes_if_known)
from shardkit.dist_setup import (  # noqa: F401
    _EXIT_BARRIER_TIMEOUT_S, _INIT_GENERATION, _TORCHRUN_VARS, _VALID_BACKENDS, RendezvousError,
    _default_group_prefix, _destroy_at_exit, _every_rank_at_exit, _int_env, _meet_every_rank,
    _publish_verdict, _rendezvous_store, _store_answering, _wait_for_pending_saves, destroy,
    init_distributed, init_single_process, per_attempt_store_key)

__all__ = [
    "init_distributed", "init_single_process", "is_initialized", "require_initialized",
    "get_rank", "get_world_size",
    "get_global_rank", "new_group", "new_groups_among_members", "resolved_group", "timeout_of",
    "all_reduce",
    "all_reduce_as_one", "reduce_scatter_tensor",
    "all_gather_into_tensor", "all_gather", "all_to_all_single", "broadcast", "reduce", "send",
    "recv", "isend",
    "irecv", "batch_isend_irecv", "P2POp", "barrier", "backend_of", "record_transfer",
    "collectives_issued", "oldest_collective_unfinished", "gather_control_rows",
    "spans_nodes_if_known", "NodeNumberingUnknown", "exited_peers_on_this_host",
    "monitored_barrier", "gather", "scatter", "all_reduce_coalesced", "all_gather_coalesced",
    "reduce_scatter",
    "broadcast_object", "all_gather_object", "first_disagreement", "first_difference",
    "raise_on_disagreement",
    "broadcast_tensors_from_rank0", "any_rank",
    "CommCounter", "CommRecord", "ReduceOp", "destroy", "set_debug_collectives", "GroupCache",
    "ranks_per_node", "node_of", "spans_nodes", "node_groups", "groups_of_nodes",
    "ranks_by_node", "group_ranks_by_node", "check_equal_nodes", "node_layout_known",
    "CollectiveError", "reporting_broken_links",
]

ReduceOp = dist.ReduceOp
# torch 2.13 renamed the tensor forms (the old names warn); use the new ones where they exist.
_all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


# Note: the gathered layout, the node groups and the gathered process ids are rebound by their
# own modules (a new default group, a teardown), so a name imported here once would go stale;
# they are served from their modules instead, for reading and for assigning (the way to reset
# the node layout before the split): bound here, an assignment reached no code and hid the
# module's own value from every later read.


def _kept_in(owner: types.ModuleType, name: str) -> property:
    """``name`` of module ``owner``, read and assigned there."""
    return property(lambda _module: getattr(owner, name),
                    lambda _module, value: setattr(owner, name, value),
                    doc=f"``{owner.__name__}.{name}`` (see the note above)")


class _StateForwardingModule(types.ModuleType):
    """The type of this module: the state below is read and assigned in the module that keeps
    it (``shardkit.distributed._layout = None`` and ``monkeypatch.setattr`` included); every
    other name lives here as usual."""

    _layout = _kept_in(topology, "_layout")
    _node_groups = _kept_in(topology, "_node_groups")
    _processes = _kept_in(broken_links, "_processes")


sys.modules[__name__].__class__ = _StateForwardingModule

# The public errors moved out of this module keep its name in tracebacks and ``repr`` (as the
# README names them, ``shardkit.distributed.CollectiveError``); they pickle through it too.
for _error in (CollectiveError, NodeNumberingUnknown, RendezvousError):
    _error.__module__ = __name__
del _error


# -------------------------------------------------------------- groups built by their members


def group_of_same_ranks(group, timeout_s: Optional[float] = None,
                        backend: Optional[str] = None):
    """A new process group over ``group``'s ranks (its collectives then need to match in
    order only among themselves), with ``timeout_s`` (default: torch's default for the
    backend) and ``backend`` (default: the default group's). With the whole world every rank
    must call it together; with a sub-group only its members call it (collective over them:
    one small object all-gather on ``group`` first, see :func:`_align_group_counts`)."""
    ranks = group_ranks(group)
    members_only = len(ranks) < get_world_size()
    if members_only:
        _align_group_counts(group)
    # a member that died leaves the others waiting on the store until the timeout; the error
    # then names the call rather than only the store keys
    with reporting_broken_links(f"new_group(ranks={ranks})", group):
        return new_group(ranks, timeout_s=timeout_s, backend=backend, members_only=members_only)


def new_groups_among_members(rank_lists: Sequence[Sequence[int]], group) -> list:
    """Create the process groups over each of ``rank_lists`` (global ranks, every list holding
    this rank) among their members only, for ranks that build groups inside a sub-group
    ``group`` of the world (only ``group``'s members call this; the other ranks need not
    know). Returns the groups in the order of ``rank_lists``.

    The members of ``group`` first agree on their count of registered process groups (see
    :func:`_align_group_counts`), as torch names a group created by its members from its ranks
    and that count. Collective over ``group``: one small object all-gather, then the groups'
    own set-up among their members."""
    _align_group_counts(group)
    return [new_group(ranks, members_only=True) for ranks in rank_lists]


def _registered_group_count() -> Optional[int]:
    """How many process groups this process has registered with torch (``None`` where torch
    does not expose the registry)."""
    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
    return None if names is None else len(names)


def _align_group_counts(group) -> None:
    """Make every member of ``group`` hold as many registered process groups as the member
    holding most, so that a group the members then create by themselves gets one name on all
    of them.

    Note: torch names a group created by its members only from its ranks and the number of
    groups this process has registered. That number differs between ranks as soon as some
    ranks created groups the others did not (e.g. a wrapper on a sub-group of theirs), and the
    members would then wait forever for each other under different names. The members behind
    pad with groups of themselves alone (no connection, no traffic). Collective over
    ``group``: one small object all-gather."""
    mine = _registered_group_count()
    counts = all_gather_object(mine, group=group)
    if mine is None or None in counts:
        return
    for _ in range(max(counts) - mine):
        new_group([get_rank()], members_only=True)


# ----------------------------------------------------------------------------- counting


# collectives this rank has issued on the default group, (a weak reference to) that group, and
# the numbers of those issued asynchronously that have not completed (see
# oldest_collective_unfinished)
_ISSUED_ON_WORLD = {"group": lambda: None, "count": 0, "in_flight": set()}


def collectives_issued() -> int:
    """How many collectives (not sends or receives) this rank has issued on the current default
    group through this module, for the peer watchdog to tell which ranks did not reach a
    collective that timed out (see :mod:`shardkit.fault`). A new default group (after
    ``destroy_process_group``) counts from 0: the ranks' counts of an earlier group differ
    after a failed collective. Costs nothing on the wire."""
    world = dist.group.WORLD
    return _ISSUED_ON_WORLD["count"] if world is not None and \
        _ISSUED_ON_WORLD["group"]() is world else 0


def oldest_collective_unfinished() -> int:
    """The number, in :func:`collectives_issued`'s count, of the oldest collective on the
    current default group that this rank issued and has not seen complete: its oldest
    asynchronous one still in flight (a prefetch, a bucket's reduction) or one that failed,
    else its last one (0: none issued). A collective that fails on this rank is that one or
    a later one, so a peer that had issued fewer collectives had not reached the failed one
    (a peer that had issued more than this one may have). An asynchronous work whose
    completion torch does not report (no future) is not seen: it counts as complete. On NCCL
    a work's future completes once the operation is queued on its stream (torch's
    ``Work.get_future``), so there the in-flight set holds only works that failed and the
    hint can name a peer that did reach the failed collective. Local."""
    issued = collectives_issued()
    if not issued:
        return 0
    in_flight = [n for n in list(_ISSUED_ON_WORLD["in_flight"]) if n <= issued]
    return min(in_flight, default=issued)


def _count_issued_on_world() -> None:
    world = dist.group.WORLD
    if world is None:
        return
    if _ISSUED_ON_WORLD["group"]() is not world:
        _ISSUED_ON_WORLD.update(group=weakref.ref(world), count=0, in_flight=set())
    _ISSUED_ON_WORLD["count"] += 1


def _tracked(work, group):
    """``work``, returned unchanged. When it is the asynchronous work of the collective just
    issued (and counted) on the default group, its number stays in flight (see
    :func:`oldest_collective_unfinished`) until the work completes successfully: one that
    fails stays, as the collective that may have failed. Local."""
    if work is None or not (group is None or group is dist.group.WORLD) \
            or _ISSUED_ON_WORLD["group"]() is not dist.group.WORLD:
        return work
    number, in_flight = _ISSUED_ON_WORLD["count"], _ISSUED_ON_WORLD["in_flight"]
    try:
        future = work.get_future()
    except Exception:  # noqa: BLE001 - a work without a future: its completion is not seen
        return work
    in_flight.add(number)

    def settle(done) -> None:
        try:
            done.value()
        except Exception:  # noqa: BLE001 - failed: it stays in flight
            return
        in_flight.discard(number)

    future.add_done_callback(settle)
    return work


def _record(op: str, full: torch.Tensor | int, group, dtype: Optional[torch.dtype] = None,
            kind: Optional[str] = None, counted: bool = True, checked: bool = True,
            checked_shape: Optional[tuple] = None, detail: Optional[str] = None,
            reduce_op=None) -> None:
    """Every collective wrapper calls this just before issuing its op: the collective debug
    mode (:mod:`shardkit.collective_check`, off by default) checks that every rank is about to
    issue the same op (with ``full``'s shape and dtype; for a byte count, ``checked_shape``
    and ``dtype`` when given; and the op's reduction, ``reduce_op``, and ``detail``, e.g.
    its root, ``"src=0"``), then each active :class:`CommCounter` records it. A rank outside
    ``group`` records nothing: torch skips the op there, so nothing is sent."""
    if _not_a_member(group):
        return
    # checked=False marks the second record of an op already recorded (its count after it ran)
    if checked and op not in ("send", "recv") and (group is None or group is dist.group.WORLD):
        _count_issued_on_world()
    if checked and collective_check._enabled:
        if isinstance(full, torch.Tensor):
            shape, checked_dtype = tuple(full.shape), full.dtype
        else:
            shape = None if checked_shape is None else tuple(checked_shape)
            checked_dtype = None if checked_shape is None else dtype
        if reduce_op is not None:  # named here only: naming it costs ~20 us a call
            detail = _reduction(reduce_op) + ("" if detail is None else f", {detail}")
        collective_check.check_collective(op, shape, checked_dtype, group, detail=detail)
    if not (counted and comm_counter.counting()):
        return
    n = get_world_size(group)
    spanning = spans_nodes_if_known(group)
    if isinstance(full, torch.Tensor):
        numel, dtype, nbytes = full.numel(), full.dtype, full.numel() * full.element_size()
    elif dtype is not None:  # a byte count of tensors of ``dtype``
        numel, nbytes = full // comm_counter.element_size(dtype), full
    else:  # a byte count (object collectives)
        numel, dtype, nbytes = full, torch.uint8, full
    record = CommRecord(op=op, numel=numel, dtype=dtype,
                        bytes=comm_counter.WIRE_FACTOR[kind or op](n) * nbytes, group_size=n,
                        spans_nodes=spanning)
    comm_counter.add_record(record)


# ----------------------------------------------------------------------------- collectives


def _issued(name: str, group, collective, *args, **kwargs):
    """``collective(*args, group=group, **kwargs)`` (torch's), :func:`_tracked`; a connection
    that breaks while it is issued (all of a synchronous op) raises :class:`CollectiveError`
    naming ``name``, the group and the ranks of this host that exited, instead of gloo's
    "Connection reset by peer". A plain ``try`` rather than :func:`reporting_broken_links`:
    this is every collective's path, and a generator context costs about 2 us a call."""
    try:
        return _tracked(collective(*args, group=group, **kwargs), group)
    except Exception as error:
        if not is_broken_link(error):
            raise
        _raise_as_broken_link(name, group, error)


def _reduction(op) -> str:
    """``op`` (a ``ReduceOp``) as the debug mode's detail, alike on every rank: ``"op=SUM"``."""
    name = next((kind.name for kind in ReduceOp.RedOpType.__members__.values() if op == kind),
                "?")
    return f"op={name}"


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """In-place all-reduce of ``tensor``. Wire: ``2(n-1)/n`` of its bytes."""
    _check_call("all_reduce", group, tensor, reduce_op=op)
    _record("all_reduce", tensor, group, reduce_op=op)
    return _issued("all_reduce", group, dist.all_reduce, tensor, op=op, async_op=async_op)


def all_reduce_as_one(tensors: Sequence[torch.Tensor], group=None, divide_by: int = 1) -> None:
    """All-reduce (sum) ``tensors`` in place as one flat buffer, each divided by ``divide_by``
    first (e.g. the world size, for an average, as torch DDP's reducer divides each gradient
    before the sum: a sum of fp16 values overflows where their average does not): one
    collective instead of one per tensor. Memory: a temporary of their total size (dtypes
    promoted as ``torch.cat`` does). Wire: one :func:`all_reduce` of their total bytes.
    Nothing is sent for an empty list."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if divide_by != 1:
        flat.div_(divide_by)
    all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    """Reduce ``input`` (``n`` equal rank-major chunks: the outputs concatenated or stacked
    along dim 0, as torch's) and leave chunk ``rank`` in ``output``.

    Wire: ``(n-1)/n`` of the input's bytes. Raises ``ValueError`` when the sizes disagree.
    A rank outside ``group`` takes no part (torch skips the op there; ``None`` comes back).
    """
    _check_call("reduce_scatter_tensor", group, output, input, reduce_op=op)
    n = get_world_size(group)
    if input.numel() != output.numel() * n and not _not_a_member(group):
        raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements; it must be "
                         f"world size {n} x output's {output.numel()} = {output.numel() * n}")
    _record("reduce_scatter", input, group, reduce_op=op)
    output, input = _flat_when_contiguous(output, input, gathering=False)
    return _issued("reduce_scatter_tensor", group, _reduce_scatter_tensor, output, input, op=op,
                   async_op=async_op)


def _flat_when_contiguous(output: torch.Tensor, input: torch.Tensor,
                          gathering: bool) -> tuple:
    """torch's stacked form (the full tensor ``n x`` the shard's shape, which gloo refuses:
    "invalid tensor size", "Check failed: outputShape[0] * worldSize") as flat views when both
    tensors are contiguous (rank-major chunks are then the same elements). Any other pair,
    the concatenated form included, goes to torch unchanged, so existing callers' tensors,
    work handles and futures are exactly what they were."""
    full, shard = (output, input) if gathering else (input, output)
    if full.dim() == shard.dim() + 1 and output.is_contiguous() and input.is_contiguous():
        return output.view(-1), input.view(-1)
    return output, input


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                           async_op: bool = False):
    """Gather every rank's ``input`` into ``output`` (rank-major: the inputs concatenated or
    stacked along dim 0, as torch's). Wire: ``(n-1)/n`` of output. A rank outside ``group``
    takes no part (torch skips the op there; ``None`` comes back)."""
    _check_call("all_gather_into_tensor", group, output, input)
    n = get_world_size(group)
    if output.numel() != input.numel() * n and not _not_a_member(group):
        raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements; it must "
                         f"be world size {n} x input's {input.numel()} = {input.numel() * n}")
    _record("all_gather", output, group)
    output, input = _flat_when_contiguous(output, input, gathering=True)
    return _issued("all_gather_into_tensor", group, _all_gather_tensor, output, input,
                   async_op=async_op)


def all_gather(tensors: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False):
    """List form of all-gather, as torch's: ``tensors[j]`` (one tensor per rank of the group)
    receives group rank ``j``'s ``tensor`` (its elements and dtype; on gloo also its shape,
    as gloo requires; sizes may differ between calls, and between ranks only where the
    backend allows it). Returns a work handle with ``async_op`` (``None`` on a rank outside
    ``group``, which takes no part).

    Before it, one all-gather of four int64s a rank (``32n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's list (length, and that each
    ``tensors[j]`` fits group rank ``j``'s tensor) on every rank, so that a bad list on one
    rank raises a ValueError on every rank, naming the rank, and none is left waiting.
    Wire: ``(n-1)/n`` of the gathered bytes, counted as ``all_gather``."""
    _check_call("all_gather", group)
    if _not_a_member(group):
        _check_call("all_gather", group, tensor)
        return None
    what = "shardkit.distributed.all_gather"
    n = get_world_size(group)
    count = len(tensors) if isinstance(tensors, (list, tuple)) else None
    problem, slots = None, -1
    if not isinstance(tensor, torch.Tensor):  # raised after the agreement, so no rank waits
        problem = TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    elif count != n or not all(isinstance(t, torch.Tensor) for t in tensors):
        got = type(tensors).__name__ if count is None else f"{count}" + (
            "" if count != n else " items, not all tensors")
        problem = (f"{what}(tensors=...): expected a list of {n} tensors (one per rank of the "
                   f"group) on every rank, got {got}")
    else:
        slots = _signature((t.numel(), _dtype_code(t.dtype)) for t in tensors)
        if _gloo_carries(group, tensor.device):
            for j, t in enumerate(tensors):
                if t.shape != tensor.shape or t.dtype != tensor.dtype:
                    problem = (f"{what}(tensors[{j}]=...): {tuple(t.shape)} {t.dtype}; gloo "
                               f"needs every item of the shape and dtype of the tensor, "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
                    break
    facts = [-1, -1, -1] if problem is not None else \
        [tensor.numel(), _dtype_code(tensor.dtype), slots]
    rows = _agree_on_call(what, problem, facts, group, _control_device(group, tensor))
    expected = _signature((numel, code) for numel, code, _ in rows)
    misfit = [r for r, (*_, sig) in enumerate(rows) if sig != expected]
    if misfit:
        sizes = [(numel, _dtype_name(code)) for numel, code, _ in rows]
        raise ValueError(f"{what}(tensors=...): on group rank(s) {misfit}, tensors[j] does not "
                         f"hold group rank j's tensor (elements and dtype per group rank: "
                         f"{sizes}); every rank's tensors[j] must; nothing was sent")
    _record("all_gather", tensor.numel() * tensor.element_size() * n, group)
    # a tuple too (torch takes lists only): its tensors are filled in place all the same
    return _issued("all_gather", group, dist.all_gather, list(tensors), tensor,
                   async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False, counted_as: str = "all_to_all",
                      check_ranks: bool = True):
    """Split ``input`` into ``n`` equal rank-major chunks, send chunk ``j`` to rank ``j`` and
    receive every rank's chunk for this rank into ``output`` (rank-major). Wire: ``(n-1)/n`` of
    the input's bytes, recorded under ``counted_as`` (a transport that builds a reduce-scatter
    from it records ``"reduce_scatter"``: the same bytes, the op the caller asked for). A
    non-contiguous ``input`` is sent as a contiguous copy, and a non-contiguous ``output``
    receives through a contiguous temporary (with ``async_op``, the handle's ``wait()``
    copies it in).

    Before it (``check_ranks``, the default), one all-gather of ``2n + 2`` int64s a rank
    (``8n(2n + 2)`` bytes, not counted by :class:`CommCounter`) compares every rank's call
    on every rank: on one rank a tensor that is not one, an output whose dtype is not the
    input's or sizes that do not fit (a TypeError or ValueError there), tensors whose elements
    or dtype differ between ranks, or ranks that passed split sizes to
    ``shardkit.comm.all_to_all_single`` while this one passed none (that call's own agreement
    meets this one) raise a ValueError on every rank before any data moves, where gloo hung
    or aborted. ``check_ranks=False``: for a caller whose sizes every rank derives alike (a
    transport), no agreement. A rank outside ``group`` takes no part (torch skips the op
    there; ``None`` comes back)."""
    _check_call("all_to_all_single", group)
    if _not_a_member(group):
        _check_call("all_to_all_single", group, output, input)
        return dist.all_to_all_single(output, input, group=group, async_op=async_op)
    problem = _all_to_all_problem(output, input, get_world_size(group))
    if check_ranks:
        _agree_on_equal_chunks(problem, input, group)
    elif problem is not None:
        raise problem
    _record(counted_as, input, group, kind="all_to_all")
    # Note: gloo receives into a non-contiguous output's storage as if it were contiguous
    # (a transposed output got other elements, silently), and refuses a non-contiguous
    # input ("Tensors must be contiguous"): both go through contiguous copies
    landing = output if output.is_contiguous() else output.contiguous()
    work = _issued("all_to_all_single", group, dist.all_to_all_single, landing,
                   input.contiguous(), async_op=async_op)
    return _landed(work, landing, output, async_op)


def _all_to_all_problem(output, input, n: int) -> Optional[Exception]:
    """What makes :func:`all_to_all_single`'s tensors unfit on this rank, for a world of
    ``n`` (``None``: nothing), as the error to raise once the ranks have agreed. Local."""
    what = "shardkit.distributed.all_to_all_single"
    for name, tensor in (("output", output), ("input", input)):
        if not isinstance(tensor, torch.Tensor):
            return TypeError(f"{what}({name}=...): expected a torch.Tensor, got "
                             f"{type(tensor).__name__}")
    if output.dtype != input.dtype:
        return ValueError(f"all_to_all_single: output is {output.dtype} and input "
                          f"{input.dtype}; they must have one dtype")
    if input.numel() != output.numel() or input.numel() % n:
        return ValueError(f"all_to_all_single: input has {input.numel()} elements and "
                          f"output {output.numel()}; they must be equal and divisible by "
                          f"world size {n}")
    return None


# Note: an all-to-all with split sizes (shardkit.comm's) agrees first on rows of
# ``[ok, input_split_sizes (n), output_split_sizes (n), dtype]``; a plain all-to-all sends a
# row of that width too, so that where some ranks pass split sizes and others none, the two
# agreements meet (instead of an agreement meeting the data exchange: a hang). A plain row
# reads ``ok = 0`` to the split form (whose ranks then raise, naming the plain ranks) and
# carries ``_EQUAL_CHUNKS`` where the split form carries its first split size.
_EQUAL_CHUNKS = -2


def _agree_on_equal_chunks(problem: Optional[Exception], input: torch.Tensor, group) -> None:
    """:func:`all_to_all_single`'s agreement (see the note above): raise ``problem`` here,
    and a ValueError on every other rank, where any rank's call does not fit the others'."""
    what = "all_to_all_single"
    n = get_world_size(group)
    facts = [_EQUAL_CHUNKS, input.numel(), _dtype_code(input.dtype)] if problem is None \
        else [-1, -1, -1]
    row = [0, *facts] + [_EQUAL_CHUNKS if problem is None else -1] * (2 * n - 2)
    rows = _gather_rows(what, row, group, _control_device(group, input))
    if problem is not None:
        raise problem
    plain = [r for r, (ok, kind, *_) in enumerate(rows) if not ok and kind == _EQUAL_CHUNKS]
    failed = [r for r, (ok, *_) in enumerate(rows) if not ok and r not in plain]
    split = [r for r, (ok, *_) in enumerate(rows) if ok]
    if failed:
        raise ValueError(f"{what}: group rank(s) {failed} were given arguments that do not "
                         f"fit (their error says which); nothing was exchanged")
    if split:
        raise ValueError(f"{what}: group rank(s) {split} passed split sizes "
                         f"(output_split_sizes / input_split_sizes) and group rank(s) {plain} "
                         f"passed none; every rank of the group must pass split sizes, or "
                         f"none; nothing was exchanged")
    sizes = [(numel, code) for _, _, numel, code, *_ in rows]
    if len(set(sizes)) > 1:
        described = [(numel, _dtype_name(code)) for numel, code in sizes]
        raise ValueError(f"{what}: the ranks' tensors differ ((elements, dtype) per group "
                         f"rank: {described}); every rank must exchange as many elements of "
                         f"one dtype; nothing was exchanged")


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Broadcast ``tensor`` from global rank ``src``. Wire: ``(n-1)/n`` of its bytes."""
    _check_call("broadcast", group, tensor, src=src)
    _record("broadcast", tensor, group, detail=f"src={src}")
    return _issued("broadcast", group, dist.broadcast, tensor, src=src, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    """Reduce ``tensor`` onto global rank ``dst``. Wire: ``(n-1)/n`` of its bytes."""
    _check_call("reduce", group, tensor, reduce_op=op, dst=dst)
    _record("reduce", tensor, group, reduce_op=op, detail=f"dst={dst}")
    return _issued("reduce", group, dist.reduce, tensor, dst=dst, op=op, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """Blocking send to global rank ``dst`` (a non-contiguous tensor as a contiguous copy,
    where torch refuses it: "input tensor has to be contiguous"). Wire: the tensor's
    bytes."""
    _check_call("send", group, tensor, dst=dst)
    _record("send", tensor, group)
    dist.send(tensor.contiguous(), dst=dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0) -> int:
    """Blocking receive from global rank ``src`` (``None``: from whichever rank of ``group``
    sends first, as torch's). Returns the sender's global rank (-1 on a rank outside
    ``group``, where nothing is received). A non-contiguous ``tensor`` receives through a
    contiguous temporary. Wire: 0 (the sender counts it)."""
    _check_call("recv", group, tensor, **({} if src is None else {"src": src}))
    _record("recv", tensor, group)
    if tensor.is_contiguous():
        return dist.recv(tensor, src=src, group=group, tag=tag)
    landing = tensor.contiguous()
    sender = dist.recv(landing, src=src, group=group, tag=tag)
    tensor.copy_(landing)
    return sender


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """Asynchronous send to global rank ``dst`` (a non-contiguous tensor as a contiguous
    copy, taken now); returns a work handle. Wire: its bytes."""
    _check_call("isend", group, tensor, dst=dst)
    _record("send", tensor, group)
    return dist.isend(tensor.contiguous(), dst=dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0):
    """Asynchronous receive from global rank ``src`` (``None``: from any rank of ``group``;
    the handle's ``_source_rank()`` then names the sender's group rank, as torch's); returns
    a work handle (for a non-contiguous ``tensor``, one whose ``wait()`` copies the message
    in from a contiguous temporary). Wire: 0."""
    _check_call("irecv", group, tensor, **({} if src is None else {"src": src}))
    _record("recv", tensor, group)
    if tensor.is_contiguous():
        return dist.irecv(tensor, src=src, group=group, tag=tag)
    landing = tensor.contiguous()
    return _ThenCopy([dist.irecv(landing, src=src, group=group, tag=tag)],
                     lambda: tensor.copy_(landing))


@dataclass
class P2POp:
    """One point-to-point op for :func:`batch_isend_irecv`: ``op`` is ``"send"`` or ``"recv"``."""

    op: str
    tensor: torch.Tensor
    peer: int
    group: object = None
    tag: int = 0


_FIRST_OPS_GROUP = object()  # batch_isend_irecv's default: record on the first op's group


def batch_isend_irecv(ops: Sequence[P2POp], counted_as: Optional[str] = None,
                      group=_FIRST_OPS_GROUP, logical_bytes: Optional[int] = None,
                      logical_shape: Optional[tuple] = None) -> list:
    """Issue several sends/receives together (avoids ordering deadlocks); returns work handles.
    Each tensor travels as one message, and every receive is posted before the first send (see
    the notes below). The ops may use different process groups (a transport's lanes).

    ``counted_as``: record the batch as one collective of that name (e.g. ``"all_gather"`` for
    a gather built from sends), with the bytes its sends really move, instead of one record per
    send and receive; on ``group`` (``None``: the default group; by default the first op's).

    ``logical_bytes`` (with ``counted_as``): the collective's full logical size ``S`` (all-gather
    output, reduce input), recorded under ``counted_as``'s own convention, the same on every
    rank, instead of what this rank's sends move (which differs between ranks when the
    segments are uneven).

    ``logical_shape`` (with ``counted_as``): the shape of the collective's logical tensor, the
    same on every rank (e.g. the all-gather's output); the collective debug mode
    (:mod:`shardkit.collective_check`) then compares it and the first op's dtype across the
    ranks before anything is sent, as it does for torch's own collectives. Without it only the
    op name is compared: a batch's own sizes legitimately differ between ranks."""
    for p in ops:  # all of them before the first is recorded or issued
        if p.op not in ("send", "recv"):
            raise ValueError(f"P2POp.op={p.op!r}; valid values are 'send' and 'recv'")
        peer = {"dst" if p.op == "send" else "src": p.peer}
        _check_call(f"batch_isend_irecv({p.op})", p.group, p.tensor, **peer)
    torch_ops = []
    sent = 0
    for p in ops:
        if counted_as is None:
            _record(p.op, p.tensor, p.group)
        elif p.op == "send":
            sent += p.tensor.numel() * p.tensor.element_size()
        fn = dist.isend if p.op == "send" else dist.irecv
        torch_ops.append(dist.P2POp(fn, p.tensor, p.peer, p.group, p.tag))
    if counted_as is not None and ops:
        record_group = ops[0].group if group is _FIRST_OPS_GROUP else group
        dtype = ops[0].tensor.dtype
        if logical_bytes is not None:
            _record(counted_as, int(logical_bytes), record_group, dtype=dtype,
                    checked_shape=logical_shape)
        else:
            _record(counted_as, sent, record_group, kind="send", dtype=dtype,
                    checked_shape=logical_shape)
    if not torch_ops:
        return []
    # Note: gloo moves a message only once the receiver has announced the matching receive
    # (a notification each way, handled by each process's gloo thread). When both ends of a
    # pair post their sends first, each waits for the other's announcement, and exchanges in
    # both directions at once slow down: measured on the simulated cluster (1 Gbit/s, 8 MiB
    # each way in 1 MiB pieces), sends first 123-141 ms, receives first 70 ms (the rate alone:
    # 67 ms); on one host no difference. Only the order between sends and receives changes:
    # sends to one peer, and receives from one peer, keep their order, which matching relies on.
    # Note: tensors are not cut into smaller messages, since each message costs its own round of
    # notifications and wake-ups, which on one host with 2 shared cores is what FSDP's per-unit
    # gathers spend much of their time on: 1 MiB pieces made the MLP 16x1024's FSDP step about
    # 3% slower than whole tensors (world 2, interleaved A/B runs). On the simulated cluster
    # (1 Gbit/s), with receives posted first, pieces and whole tensors take the same time (MLP
    # FSDP 889-907 ms against 890-891 ms a step; 8 MiB each way: 70 ms either way).
    torch_ops.sort(key=lambda o: o.op is not dist.irecv)
    if len({id(o.group) for o in torch_ops}) == 1:
        return dist.batch_isend_irecv(torch_ops)
    # several groups: torch batches one group at a time, and gloo issues each op on its own
    # anyway (it has no coalescing), so they are issued one by one, receives first
    return [o.op(o.tensor, o.peer, o.group, o.tag) for o in torch_ops]


def record_transfer(op: str, nbytes: int, dtype: torch.dtype, group=None) -> None:
    """Record ``nbytes`` of ``dtype`` that a transport moved for this rank outside the process
    group (e.g. written into shared memory for its peers), under the collective ``op`` it
    implements. Nothing is sent here."""
    _record(op, int(nbytes), group, dtype=dtype, kind="send", checked=False)


def barrier(group=None) -> None:
    """Block until every rank of ``group`` reaches this point. Wire: 0 counted bytes."""
    _check_call("barrier", group)
    _record("barrier", 0, group)
    with reporting_broken_links("barrier", group):
        dist.barrier(group=group)


def monitored_barrier(group=None, timeout: Optional[datetime.timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    """torch's ``monitored_barrier``: a barrier (on gloo) that names the ranks that did not
    reach it within ``timeout`` (a positive ``timedelta``; ``None``: the group's own timeout,
    where torch's would wait its 30-minute default), all of them with ``wait_all_ranks``, else
    the first. Any group whose CPU tensors gloo carries takes it: a ``"gloo"`` group, and
    torch's default and per-device groups (``init_process_group()`` without a backend reads
    ``"undefined"``; ``"cpu:gloo,cuda:nccl"``), which torch's function refuses by their name
    although their process group runs it (on the CPU, as torch's does). Wire: 0 counted
    bytes.

    Raises:
        ValueError: a ``timeout`` that is not a positive ``timedelta``, or a group whose CPU
            tensors gloo does not carry (torch implements it for gloo only); on every rank
            alike, before anything is sent.
    """
    what = "shardkit.distributed.monitored_barrier"
    _check_call("monitored_barrier", group)
    if timeout is not None and (not isinstance(timeout, datetime.timedelta)
                                or timeout.total_seconds() <= 0):
        raise ValueError(f"{what}(timeout={timeout!r}): expected a positive datetime.timedelta "
                         f"or None (the group's timeout)")
    if _not_a_member(group):
        return
    if not _gloo_carries(group):
        raise ValueError(f"{what}(group=...): the group's backend is {backend_of(group)!r}; "
                         f"torch implements monitored_barrier for gloo only (use barrier, or a "
                         f"gloo group from new_group(ranks, backend='gloo'))")
    if timeout is None:
        seconds = timeout_of(group)
        timeout = dist.default_pg_timeout if seconds is None else \
            datetime.timedelta(seconds=seconds)
    # not checked by the collective debug mode: its all-gather would meet an absent rank
    # first, and time out without naming it, where this barrier is there to name it
    _record("barrier", 0, group, checked=False)
    resolved_group(group).monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


class _Finished:
    """The handle of work that finished before it was returned: ``wait()`` returns at once."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ThenCopy:
    """The handle of torch works ``works`` whose result lands in a temporary: ``wait()`` (or
    an ``is_completed()`` that finds them all done) waits for them, then runs ``finish`` (which
    copies the result into the caller's tensors) once; later calls return at once (a gloo
    receive waited for twice blocks forever). ``watched``: the works report completion only
    when waited for (gloo's reduce-scatter: its ``is_completed()`` reads ``False`` even after
    ``wait()``), so a background thread waits for them and ``is_completed()`` polls that."""

    def __init__(self, works, finish, watched: bool = False):
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._done = False
        self._watcher = None
        if watched and self._works:
            from shardkit.transport import CommHandle  # it builds on this module
            self._watcher = CommHandle(self._works, completes_when_waited=True)
            self._watcher.watch()

    def wait(self, timeout=None) -> bool:
        if not self._done:
            # the works themselves, not the watcher: its one thread waits for every watched
            # handle in turn, and one stuck ahead of these (a dropped receive never sent)
            # would hold this wait too (a collective's work may be waited for twice)
            for work in self._works:
                work.wait()
            if self._finish is not None:
                finish, self._finish = self._finish, None
                finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        if not self._done:
            arrived = self._watcher.is_completed() if self._watcher is not None else \
                all(w.is_completed() for w in self._works)
            if arrived:
                self.wait()
        return self._done

    def _source_rank(self) -> int:
        """The sender's group rank, for an any-source receive (one work), as torch's."""
        return self._works[-1]._source_rank()


def _gloo_carries(group, device=None) -> bool:
    """Whether gloo carries ``group``'s collectives of tensors on ``device`` (default: the
    CPU): a ``"gloo"`` group, and torch's default and per-device ones for the devices gloo
    serves there (``init_process_group()`` with no backend reads ``"undefined"``;
    ``"cpu:gloo,cuda:nccl"``). Local."""
    name = backend_of(group)
    if name == "gloo":
        return True
    if name == "none" or _not_a_member(group):
        return False
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        kind = torch.device(device).type if device is not None else "cpu"
        return "Gloo" in type(pg._get_backend(torch.device(kind))).__name__
    except Exception:  # noqa: BLE001 - no backend for that device: not gloo
        return False


def _completes_when_waited(group, device=None) -> bool:
    """Whether ``group``'s reduce-scatter works (of tensors on ``device``) report completion
    only when waited for (gloo's)."""
    return _gloo_carries(group, device)


def _handle(works, finish, async_op: bool, watched: bool = False):
    """``works`` (with ``finish`` after them) as one handle when ``async_op`` (``watched``:
    see :class:`_ThenCopy`), else waited."""
    handle = _ThenCopy(works, finish, watched=watched and async_op)
    if async_op:
        return handle
    handle.wait()
    return None


def _dtype_code(dtype: torch.dtype) -> int:
    """A number naming ``dtype`` alike on every rank (for the argument agreements)."""
    return zlib.crc32(str(dtype).encode())


def _dtype_name(code: int) -> str:
    """The dtype :func:`_dtype_code` gave ``code`` (for error messages)."""
    for value in vars(torch).values():
        if isinstance(value, torch.dtype) and _dtype_code(value) == code:
            return str(value)
    return f"dtype #{code}"


def _op_name(code: int) -> str:
    """The ReduceOp an argument agreement carried as ``code`` (``-1``: one built at run
    time), for error messages."""
    return str(ReduceOp.RedOpType(code)).rsplit(".", 1)[-1] if code >= 0 else "?"


def _signature(pairs) -> int:
    """A number naming a list of ``(elements, dtype code)`` alike on every rank."""
    return zlib.crc32(repr([(int(k), int(c)) for k, c in pairs]).encode())


def _control_device(group, *tensors) -> torch.device:
    """Where a control message of ``group`` lives: the first tensor's device, else this
    process's CUDA device for an NCCL group (NCCL carries CUDA tensors only), else the CPU
    (a mixed group such as ``"cpu:gloo,cuda:nccl"`` carries CPU tensors on gloo). Local."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) \
        if backend_of(group) == "nccl" else torch.device("cpu")


def _agree_on_call(what: str, problem, facts: Sequence[int], group, device,
                   outcome: str = "nothing was sent") -> list:
    """Before a collective whose arguments one rank alone may get wrong: one all-gather of
    ``[ok, *facts]`` from every rank of ``group`` (``1 + len(facts)`` int64s a rank, on
    ``device``; a control message that :class:`CommCounter` does not count). ``problem`` (a
    message or an exception; ``None``: nothing wrong here) is raised on this rank, and every
    other rank raises a ValueError naming the group ranks that had one (``outcome`` tells
    them what happened), so no rank goes on alone. Returns every rank's ``facts`` (group-rank
    order), for checks the caller makes alike on every rank."""
    row = [1, *(int(f) for f in facts)] if problem is None else [0] + [-1] * len(facts)
    rows = _gather_rows(what, row, group, device)
    if problem is not None:
        raise problem if isinstance(problem, BaseException) else ValueError(problem)
    failed = [r for r, (ok, *_) in enumerate(rows) if not ok]
    if failed:
        raise ValueError(f"{what}: group rank(s) {failed} were given arguments that do not "
                         f"fit (their error says which); {outcome}")
    return [facts_of_rank for _, *facts_of_rank in rows]


def _gather_raw_rows(what: str, row: Sequence[int], group, device) -> list:
    """Every rank's ``row`` (int64s, of one length on every rank) in group-rank order: one
    all-gather on ``device``, a control message that :class:`CommCounter` does not count."""
    _require_process_group(what)
    n = get_world_size(group)
    mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    every = torch.empty(len(row) * n, dtype=torch.int64, device=device)
    _record("all_gather", every, group, counted=False)
    with reporting_broken_links(f"{what.rsplit('.', 1)[-1]} (argument check)", group):
        _all_gather_tensor(every, mine, group=group)
    return every.view(n, len(row)).tolist()


# Every control row travels as CONTROL_ROW_INTS int64s: [kind code, length, row, zeros], so
# that two different control agreements that meet (a rank that skipped a step sits in the
# next forward's agreement while its peer is in the step's) exchange rows of one size and can
# tell each other apart, instead of gloo aborting on a size mismatch or a row read as another.
CONTROL_ROW_INTS = 16
_CONTROL_KINDS: dict = {}  # kind code -> the kind's name, for the mismatch message


def control_kind(name: str) -> str:
    """``name``, registered as a kind of :func:`gather_control_rows` agreement, so that a rank
    that has not made one yet can name it when its peers are in it. Local."""
    _kind_code(name)
    return name


def _kind_code(name: str) -> int:
    """The code a control row carries for the kind ``name`` (registered for the mismatch
    message). Local."""
    code = zlib.crc32(name.encode()) & 0x7FFFFFFF
    _CONTROL_KINDS[code] = name
    return code


def gather_control_rows(what: str, row: Sequence[int], group=None,
                        kind: Optional[str] = None) -> list:
    """Every rank's ``row`` of ints, in group-rank order: the small agreement a wrapper makes
    before a collective step (which ranks offloaded, which call each rank is in). ``kind``
    (default ``what``; the same on every rank) names the agreement: ranks of the group in
    agreements of different kinds, or with rows of different lengths, raise a RuntimeError
    on every rank naming where each group rank is, before anything else is sent. ``what``
    names the call in errors.

    Communication: one all-gather of :data:`CONTROL_ROW_INTS` int64s a rank (128 bytes) on
    the group's control device (CUDA for NCCL, else the CPU: a host sync on an accelerator);
    a row longer than ``CONTROL_ROW_INTS - 2`` takes a second all-gather of its own length.
    Control messages: :class:`CommCounter` does not count them."""
    return _gather_rows(what, row, group, _control_device(group), kind)


def _gather_rows(what: str, row: Sequence[int], group, device,
                 kind: Optional[str] = None) -> list:
    """:func:`gather_control_rows` on ``device``: every control exchange of shardkit (the
    wrappers' agreements and the argument agreements of :mod:`shardkit.distributed`'s own
    collectives) goes through it, so any two of them that meet are told apart."""
    code = _kind_code(what if kind is None else kind)
    row = [int(x) for x in row]
    fits = len(row) <= CONTROL_ROW_INTS - 2
    payload = row if fits else []
    padded = [code, len(row), *payload] + [0] * (CONTROL_ROW_INTS - 2 - len(payload))
    rows = _gather_raw_rows(what, padded, group, device)
    _refuse_different_control_calls(what, rows)
    if fits:
        return [r[2:2 + len(row)] for r in rows]
    return _gather_raw_rows(what, row, group, device)


def _refuse_different_control_calls(what: str, rows: list) -> None:
    """Raise on every rank (each holds every rank's header) unless every group rank's row
    names one kind of agreement and one length. Local."""
    if all(r[:2] == rows[0][:2] for r in rows):
        return
    names = [_CONTROL_KINDS.get(code, f"another shardkit agreement (#{code:x})")
             for code, *_ in rows]
    if len(set(names)) == 1:  # one kind, rows of different lengths (ranks of other versions)
        names = [f"{name} with a row of {length} ints" for name, (_, length, *_) in
                 zip(names, rows)]
    where: dict = {}
    for rank, name in enumerate(names):
        where.setdefault(name, []).append(rank)
    listed = "; ".join(f"group rank(s) {ranks} in {name}" for name, ranks in where.items())
    raise RuntimeError(
        f"{what}: the ranks of the group are not in the same collective call ({listed}): a "
        f"rank skipped or added a call that the others made (an optimizer step, a clip, a "
        f"forward or backward taken on some ranks only, e.g. after a loss checked on one "
        f"rank); make the same collective calls on every rank, in the same order. Nothing "
        f"else was sent")


def _agree_on_root(what: str, root_name: str, root, problem: Optional[str], group,
                   device, outcome: str = "nothing was sent",
                   tensor: Optional[torch.Tensor] = None) -> None:
    """Around a rooted collective whose arguments only some ranks can check (the root's list,
    before a gather; the lengths, after an object broadcast): one all-gather of ``[ok, root,
    numel, dtype]`` from every rank of ``group`` (four int64s a rank, on ``device``; a control
    message that :class:`CommCounter` does not count, see :func:`_agree_on_call`), after which
    every rank raises a ValueError when any rank found ``problem`` (that rank's own text;
    ``outcome`` tells the others what happened), the ranks name different roots, or (given
    ``tensor``) their tensors differ in size or dtype, so no rank goes on alone (gloo aborts
    the root's process on a gather of another size, and a scatter into a larger tensor leaves
    its tail stale, silently)."""
    numel, dtype_code = (-1, -1) if tensor is None else \
        (tensor.numel(), _dtype_code(tensor.dtype))
    rows = _agree_on_call(what, problem, [root if problem is None else -1, numel, dtype_code],
                          group, device, outcome)
    roots = [r for r, *_ in rows]
    if len(set(roots)) > 1:
        raise ValueError(f"{what}({root_name}=...): the ranks of the group name different "
                         f"roots, {root_name} per group rank: {roots}; every rank must pass "
                         f"the same {root_name}")
    if tensor is not None and len({tuple(row[1:]) for row in rows}) > 1:
        raise ValueError(f"{what}(tensor=...): the ranks' tensors differ in size or dtype "
                         f"(elements per group rank: {[row[1] for row in rows]}); every rank's "
                         f"tensor must match the {root_name}'s list items; {outcome}")


def _rooted_problem(what: str, root_name: str, root, list_name: str, items, tensor, at_root,
                    group) -> Optional[str]:
    """What is wrong with a gather's or scatter's ``root`` and list on this rank (``None``:
    nothing). The root takes a list of one tensor per rank of the group, each of
    ``tensor``'s shape and dtype; the other ranks take ``None`` (or an empty list), as
    torch's."""
    try:
        _check_peer(what, root_name, root, group)
    except ValueError as error:
        return str(error)
    n = get_world_size(group)
    if not at_root(root):
        if items is None or (isinstance(items, (list, tuple)) and not items):
            return None
        return (f"{what}({list_name}=...): given on global rank {get_rank()}, which is not the "
                f"{root_name} ({root}); pass {list_name}=None on every rank but "
                f"{root_name}, as torch requires")
    want = f"a list of {n} tensors (one per rank of the group) of shape " \
           f"{tuple(tensor.shape)} and dtype {tensor.dtype}, like the tensor's"
    if not isinstance(items, (list, tuple)) or len(items) != n:
        got = type(items).__name__ if not isinstance(items, (list, tuple)) else \
            f"{len(items)} items"
        return f"{what}({list_name}=...): on the {root_name} ({root}) expected {want}; got {got}"
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor) or item.shape != tensor.shape \
                or item.dtype != tensor.dtype:
            got = type(item).__name__ if not isinstance(item, torch.Tensor) else \
                f"{tuple(item.shape)} {item.dtype}"
            return f"{what}({list_name}[{i}]=...): expected {want}; got {got}"
    return None


def gather(tensor: torch.Tensor, gather_list: Optional[list] = None, dst: int = 0, group=None,
           async_op: bool = False, check_ranks: bool = True):
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (there a
    list of one tensor per rank of the group, in group-rank order, each of ``tensor``'s shape
    and dtype; ``None`` on the other ranks), as torch's ``gather``. Returns a work handle
    with ``async_op`` (``None`` on a rank outside ``group``, which takes no part).

    Before it, one all-gather of four ints per rank (not counted) checks ``dst``, the list
    and every rank's tensor size and dtype on every rank, so that a bad argument on any rank
    raises a ValueError on every rank and none is left waiting. Wire: each other rank sends
    its tensor to ``dst``; counted as ``gather``, ``(n-1)/n`` of the tensor's bytes on every
    rank (rooted ops averaged over the ranks). ``check_ranks=False``: for a caller whose
    arguments every rank derives alike (one gather per optimizer-state tensor), no
    agreement."""
    _check_call("gather", group, tensor)
    if _not_a_member(group):
        return None
    if check_ranks:
        what = "shardkit.distributed.gather"
        problem = _rooted_problem(what, "dst", dst, "gather_list", gather_list, tensor,
                                  lambda root: get_rank() == root, group)
        _agree_on_root(what, "dst", dst, problem, group, tensor.device, tensor=tensor)
    _record("gather", tensor, group, kind="reduce")
    with reporting_broken_links("gather", group):
        return _tracked(dist.gather(tensor, list(gather_list) if get_rank() == dst else None,
                                    dst=dst, group=group, async_op=async_op), group)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list] = None, src: int = 0,
            group=None, async_op: bool = False):
    """Scatter ``scatter_list`` from global rank ``src`` (there a list of one tensor per rank
    of the group, in group-rank order, each of ``tensor``'s shape and dtype; ``None`` on the
    other ranks): every rank receives its item into ``tensor``, as torch's ``scatter``.
    Returns a work handle with ``async_op`` (``None`` on a rank outside ``group``).

    Before it, one all-gather of four ints per rank (not counted) checks ``src``, the list
    and every rank's tensor size and dtype on every rank, as :func:`gather` does. Wire:
    ``src`` sends each other rank its item; counted as ``scatter``, ``(n-1)/n`` of the
    tensor's bytes on every rank (rooted ops averaged over the ranks)."""
    _check_call("scatter", group, tensor)
    if _not_a_member(group):
        return None
    what = "shardkit.distributed.scatter"
    problem = _rooted_problem(what, "src", src, "scatter_list", scatter_list, tensor,
                              lambda root: get_rank() == root, group)
    _agree_on_root(what, "src", src, problem, group, tensor.device, tensor=tensor)
    _record("scatter", tensor, group, kind="broadcast")
    # Note: gloo scatters a non-contiguous item's storage as if it were contiguous (the
    # columns of a matrix arrived as the wrong elements, silently), hence the copies
    # (and receives into the storage of a non-contiguous output as if it were contiguous)
    items = [t.contiguous() for t in scatter_list] if get_rank() == src else None
    landing = tensor if tensor.is_contiguous() else tensor.contiguous()
    with reporting_broken_links("scatter", group):
        work = dist.scatter(landing, items, src=src, group=group, async_op=async_op)
    return _landed(_tracked(work, group), landing, tensor, async_op)


def _landed(work, landing: torch.Tensor, target: torch.Tensor, async_op: bool):
    """The result of a collective ``work`` that received into ``landing``: ``target`` itself
    (the work's handle, or ``None``), or a contiguous stand-in for a non-contiguous ``target``
    (copied into it now, or by the returned handle's ``wait()`` with ``async_op``)."""
    if landing is target:
        return work
    if not async_op:
        target.copy_(landing)
        return None
    return _ThenCopy([work], lambda: target.copy_(landing))


def _tensor_list(what: str, argument: str, items) -> list:
    """``items`` as a list of tensors, or a clear TypeError naming ``argument``."""
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, torch.Tensor)
                                                       for t in items):
        raise TypeError(f"{what}({argument}=...): expected a list of torch.Tensors, got "
                        f"{type(items).__name__}"
                        + (" holding other objects" if isinstance(items, (list, tuple)) else ""))
    return list(items)


def _by_dtype(indices_and_tensors) -> list:
    """``[(i, tensor)]`` in lists of one device and dtype, in order of first appearance."""
    buckets: dict = {}
    for i, t in indices_and_tensors:
        buckets.setdefault((t.device, t.dtype), []).append((i, t))
    return list(buckets.values())


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], op=ReduceOp.SUM, group=None,
                         async_op: bool = False):
    """All-reduce every tensor of ``tensors`` in place with ``op``, as torch's (and
    DeepSpeed's) ``all_reduce_coalesced``: the tensors of one device and dtype travel as one
    flat buffer, so one :func:`all_reduce` per dtype (any shapes, any mix of dtypes). Memory:
    a flat temporary per dtype. With ``async_op`` a handle whose ``wait()`` copies the sums
    back. Wire: ``2(n-1)/n`` of the tensors' bytes, counted as ``all_reduce``.

    Before it, one all-gather of four int64s a rank (``32n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's list on every rank: a bad list on
    one rank, or lists whose number of tensors, elements or dtypes (in order), or ops, differ
    between ranks (gloo aborts on flat buffers of different sizes; buffers of one size are
    summed across the wrong tensors, silently), raise a ValueError on every rank, naming the
    ranks, before anything is sent.

    Raises:
        TypeError: ``tensors`` not a list of tensors, or ``op`` not a ReduceOp (on that rank;
            a ValueError on the others).
        ValueError: lists or ops that differ between ranks.
    """
    what = "shardkit.distributed.all_reduce_coalesced"
    _check_call("all_reduce_coalesced", group)
    if _not_a_member(group):
        _check_call("all_reduce_coalesced", group, *_tensor_list(what, "tensors", tensors),
                    reduce_op=op)
        return _Finished() if async_op else None
    problem = None
    try:
        tensors = _tensor_list(what, "tensors", tensors)
        _check_call("all_reduce_coalesced", group, *tensors, reduce_op=op)
    except (TypeError, ValueError) as error:
        problem, tensors = error, []
    # an op torch builds at run time (premul_sum) has no name that every rank shares
    op_code = int(op) if isinstance(op, ReduceOp.RedOpType) else -1
    sizes = [(t.numel(), _dtype_code(t.dtype)) for t in tensors]
    rows = _agree_on_call(what, problem, [len(tensors), _signature(sizes), op_code], group,
                          _control_device(group, *tensors))
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise ValueError(
            f"{what}(tensors=...): group rank(s) {differ} pass other tensors or another op than "
            f"group rank 0 (number of tensors per group rank: {[k for k, *_ in rows]}; ops: "
            f"{[_op_name(o) for *_, o in rows]}; elements or dtypes differ where those agree); "
            f"every rank must pass as many tensors, of the same elements and dtypes in the same "
            f"order, and the same op; nothing was sent")
    works, copies = [], []
    for bucket in _by_dtype(enumerate(tensors)):
        flat = torch.cat([t.reshape(-1) for _, t in bucket])
        works.append(all_reduce(flat, op=op, group=group, async_op=True))
        copies.append((flat, [t for _, t in bucket]))

    def finish():
        for flat, targets in copies:
            offset = 0
            for t in targets:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
    return _handle(works, finish, async_op)


def all_gather_coalesced(output_tensors: Sequence[torch.Tensor],
                         input_tensors: Sequence[torch.Tensor], group=None,
                         async_op: bool = False):
    """DeepSpeed's ``all_gather_coalesced(output_tensors, input_tensors, group=None,
    async_op=False)``: for each ``i``, every rank's ``input_tensors[i]`` gathered rank-major
    into ``output_tensors[i]`` (``n`` times its elements), as :func:`all_gather_into_tensor`
    per pair; the inputs of one device and dtype travel as one flat buffer, so one all-gather
    per dtype. Memory: flat temporaries of the inputs and outputs. With ``async_op`` a handle
    whose ``wait()`` copies the gathered values out. Wire: ``(n-1)/n`` of the outputs' bytes,
    counted as ``all_gather``.

    Before it, one all-gather of three int64s a rank (``24n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's lists on every rank: a bad list on
    one rank, or inputs whose number, elements or dtypes differ between ranks (gloo aborts
    on a flat buffer of another size; one of the same size is gathered into the wrong
    outputs, silently), raise a ValueError on every rank, naming the rank.

    Raises:
        TypeError: a list that is not a list of tensors (on that rank; a ValueError on the
            others).
        ValueError: lists of different lengths, or an output that is not ``n`` times its
            input (naming the index), or lists that differ between ranks, before anything is
            sent.
    """
    what = "shardkit.distributed.all_gather_coalesced"
    _check_call("all_gather_coalesced", group)
    if _not_a_member(group):
        return _Finished() if async_op else None
    n = get_world_size(group)
    problem, outputs, inputs = None, [], []
    try:
        outputs = _tensor_list(what, "output_tensors", output_tensors)
        inputs = _tensor_list(what, "input_tensors", input_tensors)
        _check_call("all_gather_coalesced", group, *outputs, *inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"{what}: {len(outputs)} output_tensors and {len(inputs)} "
                             f"input_tensors; expected one output per input")
        for i, (out, inp) in enumerate(zip(outputs, inputs)):
            if out.numel() != n * inp.numel() or out.dtype != inp.dtype:
                raise ValueError(f"{what}(output_tensors[{i}]=...): {out.numel()} elements "
                                 f"of {out.dtype}; expected world size {n} x "
                                 f"input_tensors[{i}]'s {inp.numel()} = {n * inp.numel()} "
                                 f"elements of {inp.dtype}")
    except (TypeError, ValueError) as error:
        problem = error
    device = _control_device(group, *inputs)
    sizes = [(t.numel(), _dtype_code(t.dtype)) for t in inputs]
    rows = _agree_on_call(what, problem, [len(inputs), _signature(sizes)], group, device)
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    if differ:
        raise ValueError(f"{what}(input_tensors=...): group rank(s) {differ} pass other inputs "
                         f"than group rank 0 (number of inputs per group rank: "
                         f"{[k for k, _ in rows]}; elements or dtypes differ where those "
                         f"agree); every rank must pass as many inputs, of the same elements "
                         f"and dtypes in the same order; nothing was sent")
    works, copies = [], []
    for bucket in _by_dtype(enumerate(inputs)):
        flat_in = torch.cat([t.reshape(-1) for _, t in bucket])
        flat_out = flat_in.new_empty(n * flat_in.numel())
        works.append(all_gather_into_tensor(flat_out, flat_in, group=group, async_op=True))
        copies.append((flat_out.view(n, -1), [i for i, _ in bucket]))

    def finish():
        for gathered, indices in copies:
            offset = 0
            for i in indices:
                size = inputs[i].numel()
                outputs[i].copy_(gathered[:, offset:offset + size].reshape(outputs[i].shape))
                offset += size
    return _handle(works, finish, async_op)


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor], op=ReduceOp.SUM,
                   group=None, async_op: bool = False):
    """List form of reduce-scatter, as torch's: ``input_list`` holds one tensor per rank of
    the group (each of ``output``'s elements and dtype); ``output`` receives the reduction
    (``op``) of every rank's ``input_list[rank]``. Runs as one :func:`reduce_scatter_tensor`
    over the list packed into a flat temporary. Wire: ``(n-1)/n`` of the list's bytes,
    counted as ``reduce_scatter``.

    Before it, one all-gather of four int64s a rank (``32n`` bytes for ``n`` ranks, not
    counted by :class:`CommCounter`) checks every rank's arguments on every rank: a bad list
    on one rank, or outputs of other elements or dtype, or another ``op``, on some ranks
    (gloo aborts on the first, and reduces with each rank's own op, silently, on the last),
    raise a ValueError on every rank, naming the rank.

    Raises:
        TypeError: ``input_list`` not a list of tensors (on that rank; a ValueError on the
            others).
        ValueError: a list whose length is not the group's size, an item that does not
            match ``output`` (naming it), or arguments that differ between ranks, before
            anything is sent.
    """
    what = "shardkit.distributed.reduce_scatter"
    _check_call("reduce_scatter", group)
    if _not_a_member(group):
        _check_call("reduce_scatter", group, output, reduce_op=op)
        return _Finished() if async_op else None
    n = get_world_size(group)
    problem, inputs = None, []
    try:
        _check_call("reduce_scatter", group, output, reduce_op=op)
        inputs = _tensor_list(what, "input_list", input_list)
        _check_call("reduce_scatter", group, output, *inputs, reduce_op=op)
        if len(inputs) != n:
            raise ValueError(f"{what}(input_list=...): expected a list of {n} tensors (one per "
                             f"rank of the group), got {len(inputs)}")
        for i, t in enumerate(inputs):
            if t.numel() != output.numel() or t.dtype != output.dtype:
                raise ValueError(f"{what}(input_list[{i}]=...): {t.numel()} elements of "
                                 f"{t.dtype}; expected the output's {output.numel()} elements "
                                 f"of {output.dtype}")
    except (TypeError, ValueError) as error:
        problem = error
    # an op torch builds at run time (premul_sum) has no name that every rank shares
    op_code = int(op) if isinstance(op, ReduceOp.RedOpType) else -1
    facts = [-1, -1, -1] if problem is not None else \
        [output.numel(), _dtype_code(output.dtype), op_code]
    rows = _agree_on_call(what, problem, facts, group, _control_device(group, output))
    if len({tuple(row) for row in rows}) > 1:
        described = [(k, _dtype_name(code), str(ReduceOp.RedOpType(o)) if o >= 0 else "?")
                     for k, code, o in rows]
        raise ValueError(f"{what}: the ranks' outputs or ops differ ((elements, dtype, op) per "
                         f"group rank: {described}); every rank must pass an output of the same "
                         f"elements and dtype, and the same op; nothing was sent")
    flat = torch.cat([t.reshape(-1) for t in inputs])
    result = output if output.is_contiguous() else \
        torch.empty_like(output, memory_format=torch.contiguous_format)
    # flat, whatever the output's shape (gloo refuses an output of more dims than one beside
    # the flat input: "Check failed: outputShape[0] * worldSize == inputShape[0]")
    work = reduce_scatter_tensor(result.view(-1), flat, op=op, group=group, async_op=True)
    finish = None if result is output else (lambda: output.copy_(result))
    return _handle([work], finish, async_op,
                   watched=_completes_when_waited(group, output.device))


def any_rank(flag: bool, group=None, device=None) -> bool:
    """Whether ``flag`` is true on any rank of ``group``: a decision every rank then takes
    alike (skip a step, abort a save, re-gather). One all-reduce of one element (on ``device``,
    the compute device: NCCL needs CUDA)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(value, op=ReduceOp.MAX, group=group)
    return bool(value.item() > 0)


def broadcast_tensors_from_rank0(tensors: Sequence[torch.Tensor], group=None,
                                 chunk_bytes: int = 1 << 24, transport=None) -> None:
    """Overwrite ``tensors`` (parameters, buffers) on every rank of ``group`` with group rank
    0's values, packed into flat chunks of about ``chunk_bytes`` per device and dtype, each
    broadcast by ``transport`` (a :class:`shardkit.transport.Transport`: the wrapper's
    ``comm``) or, with ``None``, by the process group.

    Memory: one chunk at a time. Wire: ``(N-1)/N`` of the tensors' bytes, counted as
    broadcasts. Collective over ``group``."""
    if get_world_size(group) < 2:
        return
    src = get_global_rank(group, 0)
    mine = get_rank(group) == 0
    for chunk in _chunks_by_dtype(tensors, chunk_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        if transport is None:
            broadcast(flat, src=src, group=group)
        else:
            transport.broadcast(flat, src, group).wait()
        if not mine:
            offset = 0
            with torch.no_grad():
                for t in chunk:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()


def _chunks_by_dtype(tensors: Sequence[torch.Tensor], chunk_bytes: int):
    """``tensors`` in lists of one device and dtype, each about ``chunk_bytes`` at most (a
    larger tensor alone)."""
    by_key: dict = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for same in by_key.values():
        chunk, size = [], 0
        for t in same:
            nbytes = t.numel() * t.element_size()
            if chunk and size + nbytes > chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += nbytes
        if chunk:
            yield chunk


def broadcast_object(obj, src: int = 0, group=None):
    """Broadcast a picklable object from global rank ``src``; returns it on every rank.
    Counted by :class:`CommCounter` on every rank as a broadcast of the pickled object's
    bytes, as a tensor broadcast is."""
    _check_call("broadcast_object", group, src=src)
    box = [obj]
    _record("broadcast", 0, group, counted=False,  # the debug mode's check, before the op
            detail=f"src={src}")
    with reporting_broken_links("broadcast_object", group):
        dist.broadcast_object_list(box, src=src, group=group)
    if comm_counter.counting():  # every rank counts the payload, as for a tensor broadcast
        _record("broadcast", len(pickle.dumps(box[0])), group, checked=False)
    return box[0]


def first_disagreement(mine: dict, group=None) -> Optional[tuple]:
    """Whether the ranks of ``group`` hold the same ``mine`` (``{name: text}``): ``None`` when
    they do, else ``(name, rank 0's text, rank, that rank's text)`` for the first name (in rank
    0's order, then the others' sorted) on which the first rank differing from rank 0
    differs, the same tuple on every rank (a missing name reads ``"(absent)"``), so that every
    rank raises the same error.
    Communication: one object all-gather of ``mine``."""
    return first_difference(all_gather_object(mine, group=group))


def raise_on_disagreement(mine: dict, group, who: str, rule: str) -> None:
    """Raise, on every rank and with the same text, ``ValueError("{who}: {name} is {rank 0's}
    on rank 0 of the group and {theirs} on rank {r}; {rule}")`` unless every rank of ``group``
    holds the same ``mine`` (see :func:`first_disagreement`). Communication: one object
    all-gather of ``mine``."""
    found = first_disagreement(mine, group)
    if found is not None:
        name, first, r, theirs = found
        raise ValueError(f"{who}: {name} is {first} on rank 0 of the group and {theirs} on rank "
                         f"{r}; {rule}")


def first_difference(every: list) -> Optional[tuple]:
    """:func:`first_disagreement` on dicts already gathered (``every[r]``: rank ``r``'s), for a
    caller whose own all-gather carried them. Local."""
    for r, theirs in enumerate(every[1:], start=1):
        for name in [*every[0], *sorted(set(theirs) - set(every[0]))]:
            if theirs.get(name) != every[0].get(name):
                return (name, every[0].get(name, "(absent)"), r, theirs.get(name, "(absent)"))
    return None


def all_gather_object(obj, group=None, counted: bool = True,
                      operation: str = "all_gather_object") -> list:
    """Gather one picklable object from every rank of ``group``; returns the list.
    ``counted=False``: a control message beside the wrappers' traffic (the ranks' start-up
    agreement), which ``CommCounter`` does not count; ``operation`` names it in a broken-link
    error. Counted as ``n`` times the largest pickled object on every rank alike (torch pads
    every rank's bytes to the largest)."""
    _check_call("all_gather_object", group)
    out = [None] * get_world_size(group)
    if counted:
        _record("all_gather", 0, group, counted=False)  # the debug mode's check, before the op
    with reporting_broken_links(operation, group):
        dist.all_gather_object(out, obj, group=group)
    if counted and comm_counter.counting():
        _record("all_gather", max(len(pickle.dumps(o)) for o in out) * len(out), group,
                checked=False)
    return out
