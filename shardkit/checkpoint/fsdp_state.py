"""FullyShardedDataParallel's checkpoint formats: local state dicts (their metadata, offline
consolidation, resharding for another world size, with the local optimizer state dicts saved
beside them) and full optimizer state dicts (gathered from the shards, cut back into them).

``FSDP.local_state_dict()`` holds each parameter's row block (see
:mod:`shardkit.checkpoint.resharding`); ``FSDP.local_metadata_dict()`` the facts needed to join
the blocks again. These functions take plain arguments (state dicts, metadata, this rank) and
never communicate, except :func:`gather_full_optimizer_state` (one all-gather, or one gather
to the recipient, per state tensor, through :mod:`shardkit.distributed`). Dicts written
before the metadata had its own method carry it inside, under :data:`LOCAL_META_KEY`, and still
load.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from shardkit import distributed
from shardkit.checkpoint.optimizer_state import (ELEMENTWISE_STATE, FACTORED_STATE,
                                                 per_element)
from shardkit.checkpoint.resharding import ParamLayout, shard_rows, unshard_rows

__all__ = ["LOCAL_META_KEY", "LOCAL_FORMAT", "LOCAL_FORMAT_VERSIONS", "check_local_format",
           "local_metadata", "param_cut",
           "consolidate_shard_weights",
           "reshard_local_state_dicts", "reshard_local_optim_state_dicts",
           "gather_full_optimizer_state",
           "shard_full_optimizer_state", "unshard_optimizer_state", "shard_optimizer_state",
           "copied_part"]

# Where local_state_dict() kept its metadata before local_metadata_dict() existed; such
# checkpoints still load.
LOCAL_META_KEY = "_shardkit_fsdp_meta"
# Version 2 added "cuts" (units cut otherwise than the root); version-1 dicts lack it and load
# as the root's cut. A newer version may mean something this code would misread: refused.
LOCAL_FORMAT_NAME = "shardkit-fsdp-local"
LOCAL_FORMAT_VERSIONS = (1, 2)
LOCAL_FORMAT = f"{LOCAL_FORMAT_NAME}/{LOCAL_FORMAT_VERSIONS[-1]}"


def local_metadata(world_size: int, rank: int, shapes: dict, buffer_names: Sequence[str],
                   replica: int = 0, own_group_params: Sequence[str] = (),
                   cuts: Optional[dict] = None) -> dict:
    """What :func:`consolidate_shard_weights` and resharding need besides the tensors of a
    ``local_state_dict()``: the world size, this rank, each sharded parameter's full shape (its
    rows are cut in ``world_size`` blocks of ``ceil(rows / world_size)``, the last zero padded)
    and the buffer keys. ``replica``: this rank's index among the ranks holding the same shard
    (hybrid sharding, NO_SHARD; 0 otherwise): loaders use replica 0's dicts.
    ``own_group_params``: the parameters of units sharded over a group other than the root's
    (experts): they cannot be consolidated or resharded (:func:`_check_pairs`). ``cuts``:
    ``{name: (shards, shard, replica)}`` of the parameters whose unit cuts them otherwise than
    the root (a NO_SHARD unit: ``(1, 0, its rank among the copies)``, a hybrid unit under a
    FULL_SHARD root), read by :func:`param_cut`. Plain Python values (picklable, JSON-able)."""
    return {"format": LOCAL_FORMAT, "world_size": int(world_size), "rank": int(rank),
            "replica": int(replica), "own_group_params": sorted(own_group_params),
            "shapes": {name: list(shape) for name, shape in shapes.items()},
            "buffer_names": list(buffer_names),
            "cuts": {name: [int(n) for n in cut] for name, cut in (cuts or {}).items()}}


def check_local_format(meta: dict, what: str, argument: str) -> None:
    """A ValueError naming ``argument`` (which of the caller's metadata dicts), the format it
    carries and the versions this code reads, unless ``meta`` is a local metadata dict of a
    known version (dicts of before the format field count as version 1). Local."""
    found = meta.get("format", f"{LOCAL_FORMAT_NAME}/1")
    name, _, version = found.rpartition("/") if isinstance(found, str) else ("", "", "")
    if name == LOCAL_FORMAT_NAME and version.isdigit() \
            and int(version) in LOCAL_FORMAT_VERSIONS:
        return
    known = ", ".join(f"{LOCAL_FORMAT_NAME}/{v}" for v in LOCAL_FORMAT_VERSIONS)
    newer = name == LOCAL_FORMAT_NAME and version.isdigit() \
        and int(version) > LOCAL_FORMAT_VERSIONS[-1]
    raise ValueError(f"{what}: {argument} (rank {meta.get('rank')}'s local_metadata_dict) has "
                     f"format {found!r}; this shardkit reads {known}"
                     + ("; it was written by a newer shardkit: load it with that version"
                        if newer else "; it is not a FullyShardedDataParallel local "
                        "metadata dict"))


def param_cut(meta: dict, name: str) -> tuple:
    """``(shards, shard, replica)`` of parameter ``name`` in the local dict ``meta``
    describes: into how many row blocks it is cut, which one that dict holds, and that dict's
    index among the ranks holding a copy of the same block (0: the copy loaders use)."""
    cut = meta.get("cuts", {}).get(name)
    if cut is None:
        return meta["world_size"], meta["rank"], meta.get("replica", 0)
    return tuple(cut)


def _check_pairs(shard_weights, shard_metadata, what: str) -> list[tuple[dict, dict]]:
    """Every rank's ``(weights, metadata)``, sorted by rank, checked to form one whole world."""
    for argument, given, method in (("shard_weights", shard_weights, "local_state_dict()"),
                                    ("shard_metadata", shard_metadata,
                                     "local_metadata_dict()")):
        if isinstance(given, (dict, str, bytes)) or not hasattr(given, "__iter__"):
            raise TypeError(f"{what}({argument}={type(given).__name__}): expected a list with "
                            f"every rank's {method} (one rank's dict is not enough)")
    weights, metas = list(shard_weights), list(shard_metadata)
    if not weights or len(weights) != len(metas):
        raise ValueError(f"{what}: got {len(weights)} state dicts and {len(metas)} "
                         f"metadata dicts; pass one of each per rank, in any order")
    bad = [i for i, m in enumerate(metas) if not isinstance(m, dict) or "shapes" not in m]
    if bad:
        raise ValueError(f"{what}: shard_metadata[{bad[0]}] is not a local_metadata_dict() "
                         f"(a dict with 'world_size', 'rank' and 'shapes')")
    for index, meta in enumerate(metas):
        check_local_format(meta, what, f"shard_metadata[{index}]")
    _refuse_own_group_params(metas, what)
    # the root's shards, from its replica 0 (the other replicas' copies are skipped)
    firsts = [m for m in metas if not m.get("replica", 0)]
    if not firsts:
        raise ValueError(f"{what}: every dict given is a replica's copy (replica > 0); "
                         f"include the dicts of the ranks with replica 0")
    world = firsts[0]["world_size"]
    ranks = sorted(m["rank"] for m in firsts)
    if ranks != list(range(world)) or any(m["world_size"] != world for m in firsts):
        raise ValueError(f"{what}: got the metadata of ranks {ranks} (world sizes "
                         f"{sorted({m['world_size'] for m in firsts})}); exactly one pair per "
                         f"rank of the saving world is needed")
    # replica 0's rank 0 first: its buffers and its state other than row blocks are used
    return sorted(zip(weights, metas), key=lambda pair: (pair[1].get("replica", 0),
                                                         pair[1]["rank"]))


def _block_holders(pairs: Sequence[tuple], key: str, what: str) -> tuple[list, int]:
    """``(the pairs holding parameter key's row blocks 0, 1, ... in order, their number)``:
    for each block, the dict of the first copy of it (:func:`param_cut`; units may cut their
    parameters otherwise than the root: NO_SHARD, hybrid). A ValueError names the blocks
    missing or given twice. Local."""
    holders: dict = {}
    counts = set()
    for weights, meta in pairs:
        shards, shard, replica = param_cut(meta, key)
        if replica:
            continue
        counts.add(shards)
        if shard in holders:
            raise ValueError(f"{what}: two dicts (ranks {holders[shard][1]['rank']} and "
                             f"{meta['rank']}) hold row block {shard} of {key!r}; the dicts "
                             f"are not of one checkpoint")
        holders[shard] = (weights, meta)
    if len(counts) != 1 or sorted(holders) != list(range(next(iter(counts)))):
        raise ValueError(f"{what}: {key!r} is cut into {sorted(counts)} row blocks, of which "
                         f"the dicts given hold {sorted(holders)}; pass every rank's dicts "
                         f"(each block once, with replica 0)")
    return [holders[shard] for shard in sorted(holders)], next(iter(counts))


def _joined_rows(pairs: Sequence[tuple], key: str, shape, what: str) -> torch.Tensor:
    """The full tensor ``key`` of full ``shape`` from its row blocks (:func:`_block_holders`),
    each block checked to have the shape its layout gives a rank's shard: a block of another
    shape (a dict of another model or world size under the same name) would otherwise be
    joined silently into a tensor with shifted rows. Local."""
    pairs, shards = _block_holders(pairs, key, what)
    layout = ParamLayout(torch.Size(shape), shards)
    expected = tuple(layout.shard_shape)
    for weights, meta in pairs:
        block = weights[key]
        if not torch.is_tensor(block) or tuple(block.shape) != expected:
            got = tuple(block.shape) if torch.is_tensor(block) else type(block).__name__
            raise ValueError(f"{what}: rank {meta['rank']}'s {key!r} has shape {got}; a rank "
                             f"of a world of {layout.world_size} holds {expected} of the full "
                             f"{tuple(layout.shape)} (is that dict from another model or "
                             f"world size?)")
    return unshard_rows([w[key] for w, _ in pairs], layout)


def _refuse_own_group_params(metas: Sequence[dict], what: str) -> None:
    """A ValueError where a unit was sharded over a group of its own (FairScale's experts):
    ranks of different groups hold different tensors under one name, so no single full
    tensor (or new world's shard) of it exists."""
    names = sorted({n for m in metas for n in m.get("own_group_params", ())})
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ValueError(f"{what}: parameter(s) {shown} belong to FSDP units sharded over their "
                         f"own process groups (e.g. experts), whose ranks hold different values "
                         f"under the same name, so they cannot be consolidated or resharded. "
                         f"At the same world size, load each rank's own dict "
                         f"(load_local_state_dict(own_dict)); or save state_dict() per group")


def consolidate_shard_weights(shard_weights, shard_metadata, with_module_buffers: bool = True,
                              strict: bool = True) -> OrderedDict:
    """The full (unsharded, unpadded) state dict from every rank's ``local_state_dict()`` and
    ``local_metadata_dict()``, offline: no process group, no FSDP wrapper needed.

    Args:
        shard_weights: every rank's ``local_state_dict()``, in any order.
        shard_metadata: the matching ``local_metadata_dict()`` of each.
        with_module_buffers: include the buffers (taken from rank 0).
        strict: every parameter named by the metadata must be in every rank's weights
            (``KeyError`` otherwise); with ``strict=False`` missing ones are left out.

    Memory: the full model once, plus one parameter's row blocks at a time.
    """
    pairs = _check_pairs(shard_weights, shard_metadata, "consolidate_shard_weights")
    out = OrderedDict()
    shapes = pairs[0][1]["shapes"]
    missing = [k for k in shapes if any(k not in w for w, _ in pairs)]
    for key, value in pairs[0][0].items():
        if key in shapes and key not in missing:
            out[key] = _joined_rows(pairs, key, shapes[key], "consolidate_shard_weights")
        elif key not in shapes and with_module_buffers:  # buffers: the same on every rank
            out[key] = value
    if isinstance(getattr(pairs[0][0], "_metadata", None), dict):  # module versions
        out._metadata = OrderedDict(pairs[0][0]._metadata)
    if missing and strict:
        raise KeyError(f"consolidate_shard_weights(strict=True): parameter(s) {missing} are in "
                       f"the metadata but missing from some rank's weights; pass strict=False "
                       f"to leave them out")
    return out


def reshard_local_state_dicts(state_dict, metadata, world_size: int, rank: int,
                              target: Optional[dict] = None) -> OrderedDict:
    """This rank's local state dict, from its own dict or from every old rank's dicts.

    ``metadata``: the ``local_metadata_dict()`` (or list of them) saved with the dicts, or
    ``None`` for this world's own dict. Dicts written before the metadata had its own method
    carry it under ``LOCAL_META_KEY`` and load too. Each parameter is cut into ``world_size``
    blocks and block ``rank`` kept, or as ``target`` (this rank's own
    ``local_metadata_dict()``) cuts it (:func:`param_cut`: units of other strategies).
    """
    dicts = [state_dict] if isinstance(state_dict, dict) else list(state_dict)
    if metadata is None:
        if all(isinstance(d, dict) and LOCAL_META_KEY in d for d in dicts):
            metas = [d[LOCAL_META_KEY] for d in dicts]
            dicts = [{k: v for k, v in d.items() if k != LOCAL_META_KEY} for d in dicts]
        elif len(dicts) == 1:
            return OrderedDict(dicts[0])  # this rank's own dict; a strict load checks shapes
        else:
            raise ValueError("load_local_state_dict: resharding a list of local state dicts "
                             "needs their metadata: pass metadata=[local_metadata_dict() of "
                             "each rank]")
    else:
        metas = [metadata] if isinstance(metadata, dict) else list(metadata)
    if len(dicts) == 1 and len(metas) == 1 and isinstance(metas[0], dict):
        meta = metas[0]
        check_local_format(meta, "load_local_state_dict", "metadata")
        if (meta.get("world_size"), meta.get("rank")) == (world_size, rank):
            return OrderedDict(dicts[0])
        if meta.get("world_size") != 1:  # the dict of a world of one is whole: resharded below
            raise ValueError(
                f"load_local_state_dict: this dict was saved by rank {meta.get('rank')} of a "
                f"world of {meta.get('world_size')}; this is rank {rank} of {world_size}. To "
                f"reshard, pass the list of all {meta.get('world_size')} ranks' local state "
                f"dicts and metadata")
    pairs = _check_pairs(dicts, metas, "load_local_state_dict")
    shapes = pairs[0][1]["shapes"]
    out = OrderedDict()
    for key, value in pairs[0][0].items():
        if key in shapes:
            full = _joined_rows(pairs, key, shapes[key], "load_local_state_dict")
            shards, shard = (world_size, rank) if target is None or key not in target.get(
                "shapes", {}) else param_cut(target, key)[:2]
            value = shard_rows(full, ParamLayout(torch.Size(shapes[key]), shards), shard)
        out[key] = value
    return out


def reshard_local_optim_state_dicts(optim_state_dicts, shard_metadata, module,
                                    optimizer: torch.optim.Optimizer) -> dict:
    """This rank's optimizer state dict, for ``optimizer.load_state_dict``, from every rank's
    ``optimizer.state_dict()`` saved beside its ``local_state_dict()``: the optimizer half of
    resuming a local checkpoint at another world size or sharding strategy.

    Args:
        optim_state_dicts: every saving rank's ``optimizer.state_dict()`` (row blocks).
        shard_metadata: the matching ``local_metadata_dict()`` of each, in the same order
            (replicas' copies, ``replica > 0``, are skipped as for the weights).
        module: the FullyShardedDataParallel root now wrapping the model.
        optimizer: the optimizer to load, built like the saved one (the same param groups over
            the same parameters, in the same order: saved state index ``i`` is its ``i``-th
            parameter, as torch's ``load_state_dict`` assumes too).

    Each state tensor of a parameter's row-block shape is joined to the full parameter shape and
    cut again for this rank; other values (Adam's ``step``) are taken from the first rank.
    No communication; memory: the full optimizer state once.
    """
    what = "reshard_local_optim_state_dicts"
    pairs = _check_pairs(optim_state_dicts, shard_metadata, what)
    saved = [osd for osd, _ in pairs]
    for r, osd in enumerate(saved):
        _check_same_groups(what, osd, optimizer, r)
    shapes = pairs[0][1]["shapes"]
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = [name_of.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for index in sorted({int(i) for osd in saved for i in osd["state"]}):
        name = names[index] if index < len(names) else None
        entries = [_state_entry(osd, index) for osd in saved]
        if name in shapes:
            holders, shards = _block_holders(pairs, name, what)
            state[index] = _joined_entry(what, name,
                                         [_state_entry(osd, index) for osd, _ in holders],
                                         ParamLayout(torch.Size(shapes[name]), shards))
        elif entries[0] is not None:
            state[index] = copy.deepcopy(entries[0])
    full = {"state": state, "param_groups": copy.deepcopy(saved[0]["param_groups"]),
            "param_names": names}
    return module.get_shard_from_optim_state_dict(full)


def _state_entry(osd: dict, index: int) -> Optional[dict]:
    """Parameter ``index``'s entry of a torch optimizer state dict (keyed by int or, after a
    round trip through JSON-like storage, by str), ``None`` when it has none."""
    return osd["state"].get(index, osd["state"].get(str(index)))


def _check_same_groups(what: str, osd, optimizer, rank: int) -> None:
    """A ValueError unless ``osd`` is a torch optimizer state dict with ``optimizer``'s
    number of param groups and of parameters in each."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ValueError(f"{what}: optim_state_dicts[{rank}] is not a torch optimizer state "
                         f"dict (with 'state' and 'param_groups'); pass each rank's "
                         f"optimizer.state_dict()")
    saved = [len(g["params"]) for g in osd["param_groups"]]
    mine = [len(g["params"]) for g in optimizer.param_groups]
    if saved != mine:
        raise ValueError(f"{what}: the saved optimizer has {saved} parameters per param group, "
                         f"this optimizer {mine}; build it with the same param groups, in the "
                         f"same order, as the one that saved the state")


def _joined_entry(what: str, name: str, entries: list, layout: ParamLayout) -> dict:
    """One parameter's optimizer state with every row-block tensor joined to the full shape."""
    if any(e is None for e in entries):
        ranks = [r for r, e in enumerate(entries) if e is None]
        raise ValueError(f"{what}: parameter {name} has optimizer state on some ranks but not "
                         f"on rank(s) {ranks} of the saving world; the dicts are not of one "
                         f"checkpoint")
    joined = {}
    for key, value in entries[0].items():
        values = [e.get(key) for e in entries]
        if isinstance(value, torch.Tensor) and tuple(value.shape) == layout.shard_shape \
                and key not in FACTORED_STATE:  # a (1, 1) shard's col_var is no row block
            joined[key] = unshard_rows(values, layout)
        elif isinstance(value, torch.Tensor) and not all(
                isinstance(v, torch.Tensor) and torch.equal(v, value) for v in values):
            # e.g. factored second moments (Adafactor's row_var) of each rank's rows
            raise ValueError(f"{what}: state {key!r} of parameter {name} (shape "
                             f"{tuple(value.shape)}) differs between the saving ranks and is "
                             f"not a row block of the parameter ({layout.shard_shape}), so it "
                             f"cannot be resharded")
        else:
            joined[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return joined


def unshard_optimizer_state(osd: dict, ordered: Sequence[torch.Tensor],
                            layouts: dict, names: Sequence[Optional[str]],
                            gather_rows: Callable[[torch.Tensor, torch.Tensor, ParamLayout],
                                                  torch.Tensor]) -> dict:
    """A torch optimizer state dict whose shard-shaped tensors are unsharded by
    ``gather_rows(tensor, param, layout)``; ``ordered`` are the optimizer's parameters in
    state-dict index order, ``layouts`` maps ``id(param)`` to its layout. Adds ``"param_names"``."""
    state = {}
    for index, p in enumerate(ordered):
        layout = layouts.get(id(p))
        entry = {}
        for key, value in osd["state"].get(index, {}).items():
            if layout is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
                value = gather_rows(value, p, layout)
            elif isinstance(value, torch.Tensor):  # e.g. Adam's step: not the live tensor
                value = value.clone()
            entry[key] = value
        if entry:
            state[index] = entry
    return {"state": state, "param_groups": copy.deepcopy(osd["param_groups"]),
            "param_names": list(names)}


def _send_rows_only(osd: dict, ordered: Sequence[torch.Tensor], layouts: dict,
                    send_rows: Callable[[torch.Tensor, torch.Tensor, ParamLayout], None]) -> None:
    """:func:`unshard_optimizer_state`'s walk on a rank that receives nothing: each
    shard-shaped tensor goes to ``send_rows``, in the same order; nothing is copied or kept."""
    for index, p in enumerate(ordered):
        layout = layouts.get(id(p))
        for value in osd["state"].get(index, {}).values():
            if layout is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
                send_rows(value, p, layout)


def copied_part(value, cut: Optional[tuple]):
    """A full optimizer state dict's ``value`` as a rank keeps it: ``cut`` ``(layout, rank)``:
    that rank's row block of it (a new tensor); ``None``: a copy of the whole tensor; other
    values as they are.

    Note: copies, never views of the argument: torch's load_state_dict keeps the tensors it is
    given, so an optimizer loaded from another one's live state dict would otherwise step the
    other's ``step`` counters and moments in place."""
    if not isinstance(value, torch.Tensor):
        return value
    return shard_rows(value, *cut) if cut is not None else value.clone()


def shard_optimizer_state(full_osd: dict, ordered: Sequence[Optional[torch.Tensor]],
                          layouts: dict, rank: int, param_ranks: Optional[dict] = None,
                          take: Callable = copied_part) -> dict:
    """This rank's part of a full optimizer state dict: every tensor of its parameter's full
    shape is cut to ``rank``'s rows (``param_ranks``: ``id(param)`` -> this rank's index in the
    group that parameter is sharded over, where that is not ``rank``); ``ordered[i]`` is the
    parameter of state index ``i``. Each value is kept as ``take(value, cut)`` gives it
    (default :func:`copied_part`; ``cut``: ``(layout, rank)`` or ``None``), so that a caller
    whose tensors are yet to arrive can plan the cuts on stand-ins of their shapes."""
    param_ranks = param_ranks or {}
    if not isinstance(full_osd, dict) or any(k not in full_osd
                                             for k in ("state", "param_groups")):
        raise ValueError("get_shard_from_optim_state_dict: expected a torch optimizer state "
                         "dict with 'state' and 'param_groups' (e.g. from "
                         "gather_full_optim_state_dict)")
    state = {}
    for index, entry in full_osd["state"].items():
        p = ordered[int(index)] if int(index) < len(ordered) else None
        layout = layouts.get(id(p)) if p is not None else None
        _check_full_shape(index, entry, layout)
        # a 0-dim parameter's full shape is also that of Adam's ``step``: only per-element
        # state is cut then (the shard is 1-D, the step must stay 0-dim)
        cut = (layout, param_ranks.get(id(p), rank)) if layout is not None else None
        state[index] = {k: take(v, cut if cut is not None and per_element(k, v)
                                and tuple(v.shape) == tuple(layout.shape) else None)
                        for k, v in entry.items()}
    return {"state": state, "param_groups": copy.deepcopy(full_osd["param_groups"])}


def _check_full_shape(index, entry: dict, layout: Optional[ParamLayout]) -> None:
    """A ValueError when a per-element state tensor (Adam's moments, SGD's momentum) of the
    parameter at ``index`` does not have that parameter's full shape: the dict is of another
    model, or already a shard; loaded, it would fail at the next ``step()`` or step wrong rows.
    Local, no copy."""
    if layout is None:
        return
    for key, value in entry.items():
        if key in ELEMENTWISE_STATE and isinstance(value, torch.Tensor) \
                and tuple(value.shape) != tuple(layout.shape):
            raise ValueError(
                f"get_shard_from_optim_state_dict: state {key!r} of parameter {index} has shape "
                f"{tuple(value.shape)}, the parameter's full shape is {tuple(layout.shape)}; "
                f"pass the full optimizer state dict of this model (from "
                f"gather_full_optim_state_dict, or a single-process optimizer over the "
                f"unwrapped model)")
        if layout.world_size > 1 and isinstance(value, torch.Tensor) and value.dim() > 0 \
                and tuple(value.shape) != tuple(layout.shape):
            # every rank would step its rows with the whole tensor: a size mismatch at the
            # next step(), or, where the shapes broadcast, wrong numbers
            raise ValueError(
                f"get_shard_from_optim_state_dict: state {key!r} of parameter {index} has shape "
                f"{tuple(value.shape)}, neither the parameter's full shape "
                f"{tuple(layout.shape)} (cut into rows) nor a scalar (e.g. Adafactor's factored "
                f"moments): it cannot be cut into the row shards of "
                f"{layout.world_size} ranks; load it into a model that is not sharded, or use "
                f"an optimizer with per-element state (Adam, SGD)")


def gather_full_optimizer_state(osd: dict, ordered: Sequence[torch.Tensor], layouts: dict,
                                names: Sequence[Optional[str]], group=None,
                                comm_device: Optional[torch.device] = None,
                                param_groups: Optional[dict] = None,
                                recipient: Optional[int] = None) -> Optional[dict]:
    """:func:`unshard_optimizer_state` with every shard-shaped tensor gathered over its
    parameter's group (``param_groups``: ``id(param)`` -> the group it is sharded over, e.g. an
    expert unit's own group; default ``group``), on ``comm_device`` (default the tensor's
    device): to every rank (``recipient=None``: one all-gather per state tensor), or to the
    global rank ``recipient`` alone (one gather per state tensor; ``None`` is returned on the
    other ranks, which keep nothing: a group without the recipient gathers nothing).
    Communication: ``Ψ·K/4`` elements in all. Memory: the full optimizer state where it is
    returned; elsewhere nothing beyond the shards. Collective: every rank of ``group`` calls
    it with the same parameters and ``recipient``."""
    param_groups = param_groups or {}
    receiving = recipient is None or distributed.get_rank() == recipient

    def gather_rows(shard: torch.Tensor, param: torch.Tensor,
                    layout: ParamLayout) -> Optional[torch.Tensor]:
        rows_group = param_groups.get(id(param), group)
        world_size = distributed.get_world_size(rows_group)
        device = comm_device or shard.device
        rows = shard.detach().reshape(-1).to(device)
        gathered = torch.empty(shard.numel() * world_size, dtype=shard.dtype,
                               device=device) if receiving else None
        if recipient is None:
            distributed.all_gather_into_tensor(gathered, rows, group=rows_group)
        elif recipient in distributed.group_ranks(rows_group):
            # every rank derives the sizes from the same layouts: no agreement per tensor
            distributed.gather(rows, list(gathered.chunk(world_size)) if receiving else None,
                               dst=recipient, group=rows_group, check_ranks=False)
        if gathered is None:
            return None
        return unshard_rows(list(gathered.to(shard.device).chunk(world_size)), layout)

    if not receiving:
        _send_rows_only(osd, ordered, layouts, gather_rows)
        return None
    return unshard_optimizer_state(osd, ordered, layouts, names, gather_rows)


def shard_full_optimizer_state(full_osd: dict, named_params: Sequence[tuple], layouts: dict,
                               rank: int, param_ranks: Optional[dict] = None,
                               take: Callable = copied_part) -> dict:
    """:func:`shard_optimizer_state` of a full dict whose state indices follow its
    ``"param_names"`` when it has them (matched against ``named_params``, ``(name, param)``
    pairs), else the order of ``named_params``, corrected by shape (see
    :func:`_matched_by_shape`); each value kept as ``take`` gives it (see
    :func:`shard_optimizer_state`). No communication."""
    names = full_osd.get("param_names") if isinstance(full_osd, dict) else None
    if names is None:
        params = _optimized_params(full_osd, [p for _, p in named_params])
        ordered = _matched_by_shape(full_osd, params, layouts)
    else:
        by_name = dict(named_params)
        _refuse_unknown_names(full_osd, names, by_name)
        ordered = [by_name.get(n) for n in names]
    return shard_optimizer_state(full_osd, ordered, layouts, rank, param_ranks, take)


def _refuse_unknown_names(full_osd: dict, names: Sequence[Optional[str]], by_name: dict) -> None:
    """A ValueError naming the parameters of a named dict that hold state but are not this
    model's: their state would otherwise be kept whole (uncut) and fail, or step wrong rows,
    at the next ``step()``. Local."""
    stateful = {int(i) for i in full_osd.get("state", {})}
    unknown = [n for i, n in enumerate(names) if n is not None and n not in by_name
               and i in stateful]
    if unknown:
        missing = [n for n in by_name if n not in set(names)]
        raise ValueError(
            f"get_shard_from_optim_state_dict: the dict holds state for {len(unknown)} "
            f"parameter(s) this model does not have, e.g. {unknown[:3]}; the model's "
            f"parameters absent from the dict are {missing[:3]}: pass the full optimizer "
            f"state dict of this model")


def _optimized_params(full_osd: dict, params: list) -> list:
    """The parameters a torch optimizer's dict (no names) most likely numbers, in model order:
    only the trainable ones when its param groups list exactly that many (the usual
    ``[p for p in model.parameters() if p.requires_grad]``), else all of them. Without this, a
    frozen parameter of the same full shape took a trainable one's index and its cut, which
    differs when their units shard over different groups (a NO_SHARD unit in a FULL_SHARD
    model): the optimizer then failed at its first step."""
    groups = full_osd.get("param_groups", ()) if isinstance(full_osd, dict) else ()
    listed = sum(len(g.get("params", ())) for g in groups if isinstance(g, dict))
    trainable = [p for p in params if p.requires_grad]
    return trainable if listed == len(trainable) != len(params) else params


def _matched_by_shape(full_osd: dict, params: list, layouts: dict) -> list:
    """For a dict without parameter names (a plain torch optimizer's), the parameter whose
    rows to cut for each state index: the model's ``i``-th when every index's state has the
    full shape of the parameter at its position (an optimizer over the parameters in model
    order); otherwise each index, in order, takes the next parameter of its state's full shape
    in model order.

    Note: torch numbers state in its param-group order, which differs from the model's as
    soon as groups regroup parameters (weight decay on matrices only). A rule that puts every
    parameter of one shape in one group (on ``p.dim()``, on names such as biases) keeps their
    model order, so each gets its own cut, also where parameters of one shape are cut
    differently (units of different sharding strategies). Matching the first parameter of a
    shape, or a parameter whose shape merely coincides at that position, gave a NO_SHARD
    unit's parameter a FULL_SHARD cut: the optimizer failed at its first step."""
    state = full_osd.get("state", {}) if isinstance(full_osd, dict) else {}
    wanted = {int(i): _state_shape(entry) for i, entry in state.items()}
    ordered = list(params) + [None] * max(0, max(wanted, default=-1) + 1 - len(params))

    def full_shape(p):
        layout = layouts.get(id(p)) if p is not None else None
        return None if layout is None else tuple(layout.shape)

    if all(shape is None or full_shape(ordered[i]) == shape for i, shape in wanted.items()):
        return ordered
    unused: dict = {}
    for p in sorted(params, key=lambda p: not p.requires_grad):  # frozen ones hold no state
        if full_shape(p) is not None:
            unused.setdefault(full_shape(p), []).append(p)
    for index in sorted(wanted):
        if unused.get(wanted[index]):
            ordered[index] = unused[wanted[index]].pop(0)
    return ordered


def _state_shape(entry: dict):
    """The full parameter shape a state entry's per-element tensors have (``None``: none)."""
    shapes = [tuple(v.shape) for k, v in entry.items() if per_element(k, v)]
    return shapes[0] if shapes else None
