"""The optimizer state under ``SHARDED_STATE_DICT``: keyed by parameter names, each
per-element tensor a ``Shard(0)`` DTensor of this rank's rows (for
torch.distributed.checkpoint), and back to ``optim.load_state_dict``'s dict; the state of an
optimizer that had none yet is marked, so that a load that never filled it is refused. Split
out of :mod:`shardkit.nn.data_parallel.fsdp_state_dict`.
"""

from __future__ import annotations

from collections import OrderedDict
from copy import deepcopy

import torch

from shardkit.checkpoint.dtensor_state import is_dtensor, rows_from_value
from shardkit.checkpoint.optimizer_state import ELEMENTWISE_STATE, per_element
from shardkit.nn.data_parallel.fsdp_optim_state_checks import (_optimizer_names,
                                                               _optimizer_names_agreed)
from shardkit.nn.data_parallel.fsdp_optim_state_keys import _keyed_by_ids
from shardkit.nn.data_parallel.fsdp_optim_state_rank_local import (_refused_in_dcp_as_rank_local,
                                                                   rank_local_state)
from shardkit.nn.data_parallel.fsdp_state_units import _as_shards


def _sharded_optim_state(model, optim: torch.optim.Optimizer) -> dict:
    """:meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.optim_state_dict` under
    ``SHARDED_STATE_DICT``: keyed by names, per-element state of sharded parameters as DTensors of
    this rank's rows (0-dim ones broadcast over their unit's group), the rest as given. No copy of a
    shard. The ranks first agree on the optimizer (one all-gather of one integer a rank, not
    counted): an optimizer refused on one rank only left the others waiting in the broadcast of a
    0-dim parameter's state, or, without one, returning a dict that ``dcp.save`` then hung on."""
    sharded = model._sharded_params("optim_state_dict")  # alike on every rank
    names = _optimizer_names_agreed(model, optim, "optim_state_dict")
    ordered = [p for g in optim.param_groups for p in g["params"]]
    offload = model._state_dict_settings.state_dict_config.offload_to_cpu
    osd = optim.state_dict()
    rank_local = {(index, key) for index, key, _, _ in rank_local_state(optim)}
    state = _StateOfAFreshOptimizer() if _has_no_state_yet(optim) else {}
    for index in sorted(osd["state"]):
        p = ordered[index]
        entry = sharded.get(id(p))
        values = {}
        for key, value in osd["state"][index].items():
            if (index, key) in rank_local:  # checked first: a (1, 1) shard's col_var
                value = _refused_in_dcp_as_rank_local(value, f"{names[index]}.{key}",
                                                      tuple(entry[0].shard_shape))
            elif entry is not None and per_element(key, value) and \
                    tuple(value.shape) == tuple(entry[0].shard_shape):
                value = _as_shards(value, entry[0], entry[1], offload)
            values[key] = value
        state[names[index]] = values
    groups, start = [], 0
    for g in osd["param_groups"]:
        groups.append(dict(g, params=names[start:start + len(g["params"])]))
        start += len(g["params"])
    return {"state": state, "param_groups": groups}


def _sharded_optim_state_to_load(model, optim: torch.optim.Optimizer, osd) -> dict:
    """The inverse of :func:`_sharded_optim_state`: ``optim.load_state_dict``'s dict with each
    per-element DTensor (or full-shape plain tensor) turned into this rank's padded rows (a
    plain tensor in this rank's padded shard shape is kept; any other shape is refused). The
    dict's parameter names must be the optimizer's, in its order. A ValueError naming the
    parameter and the state key otherwise (nothing is loaded). Local; memory: one copy of
    this rank's state."""
    names = _optimizer_names(model, optim, "optim_state_dict_to_load")
    ided = _keyed_by_ids(osd)
    given = ided.get("param_names", [])
    if given and list(given) != names:
        raise ValueError(f"FSDP.optim_state_dict_to_load (SHARDED_STATE_DICT): the dict's "
                         f"parameters {list(given)[:4]}... are not this optimizer's "
                         f"{names[:4]}... (same names in the same param-group order); pass "
                         f"FSDP.optim_state_dict(model, optim) of this model, e.g. filled by "
                         f"torch.distributed.checkpoint.load")
    sharded = model._sharded_params("optim_state_dict_to_load")
    ordered = [p for g in optim.param_groups for p in g["params"]]
    state = {}
    for index, entry in ided["state"].items():
        layout_unit = sharded.get(id(ordered[index])) if isinstance(index, int) and \
            0 <= index < len(ordered) else None
        values = {}
        for key, value in entry.items():
            if layout_unit is not None and torch.is_tensor(value) and per_element(key, value) \
                    and (is_dtensor(value) or tuple(value.shape) == tuple(layout_unit[0].shape)):
                value = rows_from_value(value, layout_unit[0], layout_unit[1].rank,
                                        f"FSDP.optim_state_dict_to_load: state {key!r} of "
                                        f"{names[index]}")
            elif is_dtensor(value):
                value = value.to_local()
            elif layout_unit is not None and torch.is_tensor(value) and key in ELEMENTWISE_STATE \
                    and value.dim() > 0 \
                    and tuple(value.shape) != tuple(layout_unit[0].shard_shape):
                # only the known per-element moments: other tensors (Adafactor's row_var
                # (rows, 1) / col_var (1, cols)) are rank-local state kept as saved
                raise ValueError(f"FSDP.optim_state_dict_to_load (SHARDED_STATE_DICT): state "
                                 f"{key!r} of {names[index]} has shape {tuple(value.shape)}; "
                                 f"expected a DTensor, the full shape "
                                 f"{tuple(layout_unit[0].shape)} or this rank's shard "
                                 f"{tuple(layout_unit[0].shard_shape)}")
            values[key] = value
        state[index] = values
    return {"state": state, "param_groups": ided["param_groups"]}


class _StateOfAFreshOptimizer(dict):
    """The ``"state"`` of :func:`_sharded_optim_state` for an optimizer that holds no state
    yet (before its first ``step()``): empty, and marked so that
    :func:`_refuse_state_never_received` can tell it reached ``optim_state_dict_to_load``
    still empty, e.g. after a ``dcp.load`` that had no tensor to load any state into."""

    def __reduce__(self):  # saved unmarked, as an OrderedDict: torch.load(weights_only=True)
        return OrderedDict, (), None, None, iter(self.items())  # takes it (not this class)

    # a copy (copy.copy, copy.deepcopy of the whole dict) is the same unfilled state: marked
    def __copy__(self):
        return _StateOfAFreshOptimizer(self)

    def __deepcopy__(self, memo):
        return _StateOfAFreshOptimizer(deepcopy(dict(self), memo))


def _has_no_state_yet(optim: torch.optim.Optimizer) -> bool:
    """Whether ``optim`` has trainable parameters but no state for any of them, and would
    have some after a step: torch's and shardkit's optimizers only (torch's SGD without
    momentum keeps no tensor: nothing to lose; a user's class may keep none either, and would
    otherwise be refused for good). Local."""
    groups = optim.param_groups
    if not type(optim).__module__.startswith(("torch.optim", "shardkit.")):
        return False
    if isinstance(optim, torch.optim.SGD) and all(not g.get("momentum") for g in groups):
        return False
    trainable = any(p.requires_grad for g in groups for p in g["params"])
    return trainable and not any(optim.state.get(p) for g in groups for p in g["params"])


def _refuse_state_never_received(osd) -> None:
    """A ValueError when ``osd`` is the dict :func:`_sharded_optim_state` gave for a fresh
    optimizer and its state is still empty. ``dcp.load`` fills only the tensors a dict holds:
    into a fresh optimizer's dict it loads the param groups and none of the checkpoint's
    state (``exp_avg``...), so loading it silently restarted the moments and step counts.
    torch FSDP1 loses them the same way; its ``get_state_dict`` and shardkit's (and
    :func:`~shardkit.checkpoint.dtensor_state.init_optimizer_state`) give the optimizer its
    state tensors first. Local; the caller's agreement raises it on every rank."""
    state = osd.get("state") if isinstance(osd, dict) else None
    if isinstance(state, _StateOfAFreshOptimizer) and not state:
        raise ValueError(
            "the dict is FSDP.optim_state_dict(model, optim) of an optimizer that had no state "
            "yet (before its first step), and it still holds no state: torch.distributed."
            "checkpoint.load fills only the tensors a dict holds, so none of the checkpoint's "
            "optimizer state (exp_avg, step...) was loaded. Call shardkit.checkpoint."
            "init_optimizer_state(optim) before FSDP.optim_state_dict(model, optim) on the "
            "loading side (or use shardkit.checkpoint.get_state_dict / set_state_dict, which "
            "do it); a checkpoint saved before the optimizer's first step holds no optimizer "
            "state: skip this load")
