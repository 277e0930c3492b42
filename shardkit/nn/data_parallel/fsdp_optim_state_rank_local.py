"""Rank-local optimizer state: tensors in the state of a parameter sharded over several ranks
that each rank computes from its own rows and that no full tensor nor row-sharded DTensor
describes (Adafactor's factored ``row_var`` / ``col_var``). Found here
(:func:`rank_local_state`), refused in full dicts, and marked so that
torch.distributed.checkpoint refuses them instead of saving one rank's copy for all. Split out
of :mod:`shardkit.nn.data_parallel.fsdp_state_dict`; local.
"""

from __future__ import annotations

import torch

from shardkit.checkpoint.dtensor_state import refuse_in_dcp
from shardkit.checkpoint.optimizer_state import FACTORED_STATE, per_element
from shardkit.nn.data_parallel.fsdp_state_names import _state_dict_keys


def shard_shapes(params) -> dict:
    """``{id(param): padded shard shape}`` for the parameters among ``params`` that an FSDP unit
    shards over several ranks (and the other parameters of those units): their optimizer
    state holds this rank's rows only. Local; one pass per unit met."""
    from shardkit.nn.data_parallel.fully_sharded import unit_holding
    shapes: dict = {}
    seen: set = set()
    for param in params:
        if id(param) in shapes or id(param) in seen:
            continue
        seen.add(id(param))
        shard = getattr(unit_holding(param), "_shard", None)
        if shard is not None and shard.world_size > 1:
            shapes.update((id(q), tuple(lay.shard_shape))
                          for q, lay in zip(shard.params, shard.layouts))
    return shapes


def rank_local_state(optim: torch.optim.Optimizer) -> list[tuple]:
    """``(index, key, shape, shard shape)`` of each tensor of one dimension or more in the
    optimizer's state of a parameter sharded over several ranks that is not shaped as its shard
    or is one of :data:`FACTORED_STATE` (``index``: the parameter's position in param-group
    order), such as Adafactor's factored ``row_var`` (rows, 1) and ``col_var`` (1, cols):
    computed from this rank's rows only, so neither a full tensor nor a row-sharded DTensor
    describes it, and it has the same shape and key on every rank. Local, no copy."""
    ordered = [p for g in optim.param_groups for p in g["params"]]
    shapes = shard_shapes(ordered)
    found = []
    for index, param in enumerate(ordered):
        shape = shapes.get(id(param))
        state = optim.state.get(param, {}) if shape is not None else {}
        found.extend((index, key, tuple(value.shape), shape) for key, value in state.items()
                     if torch.is_tensor(value) and value.dim() > 0
                     and (tuple(value.shape) != shape or key in FACTORED_STATE))
    return found


def rank_local_shape(shape: tuple, shard: tuple) -> str:
    """How the shape of a :func:`rank_local_state` tensor tells it from per-element state, for
    a message: ``shape`` is not the shard's, or it is (a (1, 1) shard) and only its key (one
    of :data:`FACTORED_STATE`) does."""
    if shape != shard:
        return f"shape {shape}, neither the parameter's nor its shard's"
    return (f"shape {shape}, its shard's, but it is a factored moment "
            f"({'/'.join(sorted(FACTORED_STATE))}) over this rank's rows")


def mark_rank_local_state(optim: torch.optim.Optimizer, osd: dict, source: str,
                          shard_shaped_only: bool) -> dict:
    """``osd`` (``optim.state_dict()``) with each per-element state tensor of a parameter
    sharded over several ranks (this rank's padded rows, under the same key on every rank)
    replaced by an alias (``detach``: no copy) marked by
    :func:`~shardkit.checkpoint.dtensor_state.refuse_in_dcp` (its message naming ``source``),
    so that torch.distributed.checkpoint refuses it on every rank instead of saving one rank's
    rows as if replicated; with ``shard_shaped_only``, only tensors shaped like the shard.
    ``torch.save`` and ``optim.load_state_dict`` take it as before; the optimizer's own tensors
    are not marked. Local."""
    ordered = [p for g in optim.param_groups for p in g["params"]]
    shapes = shard_shapes(ordered)
    state = osd.get("state", {})
    for index, entry in list(state.items()):
        param = ordered[index] if isinstance(index, int) and 0 <= index < len(ordered) else None
        shape = shapes.get(id(param)) if param is not None else None
        if shape is None:
            continue
        state[index] = {  # a new dict: optim.state_dict() gives the live ones
            key: refuse_in_dcp(value.detach(), f"state {key!r} of parameter {index}", source)
            if per_element(key, value) and (not shard_shaped_only
                                            or tuple(value.shape) == shape) else value
            for key, value in entry.items()}
    return osd


def _refuse_rank_local_state(model, optim, call: str) -> None:
    """A ValueError (the same on every rank: shard shapes are padded alike) when the optimizer
    holds :func:`rank_local_state`: a full optimizer state dict would carry the receiving
    rank's copy alone, which every rank then loads (wrong numbers at any world size, a size
    mismatch at the next ``step()`` at another one). Local."""
    found = rank_local_state(optim)
    if not found:
        return
    names = _state_dict_keys(model)
    ordered = [p for g in optim.param_groups for p in g["params"]]
    listed = [f"{names.get(id(ordered[index]), index)} {key!r} {shape} (shard {shard})"
              for index, key, shape, shard in found[:3]]
    raise ValueError(
        f"{call}: the optimizer's state of {len(found)} tensor(s) of parameters sharded by "
        f"FullyShardedDataParallel is shaped neither as the parameter nor as its shard (or is "
        f"a factored moment, {'/'.join(sorted(FACTORED_STATE))}), e.g. "
        f"{listed} (Adafactor's factored moments): each rank computes it from its own rows, so "
        f"a full optimizer state dict cannot hold it. Save each rank's state with "
        f"StateDictType.LOCAL_STATE_DICT (it loads at this world size only), or use an "
        f"optimizer with per-element state (Adam, SGD) or OSS, which steps whole parameters")


def _refused_in_dcp_as_rank_local(value: torch.Tensor, name: str, shard: tuple) -> torch.Tensor:
    """An alias of ``value`` (a :func:`rank_local_state` tensor, e.g. Adafactor's ``row_var``
    of this rank's rows; ``shard``: its parameter's shard shape) that
    torch.distributed.checkpoint refuses on every rank before anything is written or loaded:
    as a plain tensor under the same key on every rank, dcp would take it for a replicated one,
    write one rank's copy and load it on every rank. ``torch.save`` and
    ``optim_state_dict_to_load`` take it as before. Local, no copy."""
    return refuse_in_dcp(
        value.detach(), name, "FSDP.optim_state_dict under SHARDED_STATE_DICT",
        reason=f"it has {rank_local_shape(tuple(value.shape), shard)} (e.g. Adafactor's "
               f"factored moments): each rank computes it from its own rows, "
               f"so no DTensor describes it and dcp would save one rank's copy for all. Save "
               f"each rank's state with StateDictType.LOCAL_STATE_DICT and torch.save (it "
               f"loads at this world size only), or use an optimizer with per-element state "
               f"(Adam, SGD)")
