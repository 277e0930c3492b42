"""How a full optimizer state dict is keyed: by parameter ids (``optim.state_dict()``) or by
parameter names (torch FSDP1's ``optim_state_dict``), the conversions between the two and the
renumbering that matches a name-keyed dict to an optimizer's param-group order. Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`; local.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.nn.data_parallel.fsdp_state_names import _state_dict_keys, state_dict_key


def _in_optimizer_order(model, optim: Optional[torch.optim.Optimizer], ided: dict) -> dict:
    """``ided`` (:func:`_keyed_by_ids` of a dict keyed by names) renumbered so that each param
    group lists its parameters in ``optim``'s order for that group, as ``optim.load_state_dict``
    matches them by position: a dict keyed by names may list a group's names in any order
    (torch's ``rekey_optim_state_dict`` sorts them), and torch FSDP1 matches them by name.
    Unchanged without ``optim`` or ``"param_names"``, or where a group's names are not
    exactly those of the optimizer's group (then the usual checks judge it). Local."""
    names = ided.get("param_names") if isinstance(ided, dict) else None
    if optim is None or names is None or len(ided["param_groups"]) != len(optim.param_groups):
        return ided
    known = _state_dict_keys(model)
    every = [known.get(id(p)) for own in optim.param_groups for p in own["params"]]
    same_names = None not in every and sorted(map(str, names)) == sorted(every)
    renumbered, start = {}, 0
    for index, (group, own) in enumerate(zip(ided["param_groups"], optim.param_groups)):
        mine = [known.get(id(p)) for p in own["params"]]
        theirs = [names[i] for i in group["params"]]
        if None in mine or len(set(mine)) != len(mine) or sorted(map(str, theirs)) != \
                sorted(mine):
            if same_names and len(set(every)) == len(every):  # same parameters, other groups
                raise ValueError(f"the dict's param group {index} lists "
                                 f"{sorted(map(str, theirs))[:5]}, the optimizer's "
                                 f"{sorted(mine)[:5]}: its parameters are in other param "
                                 f"groups than when it was saved; build the optimizer's param "
                                 f"groups as then")
            return ided
        position = {n: start + j for j, n in enumerate(mine)}
        renumbered.update((i, position[names[i]]) for i in group["params"])
        start += len(mine)
    if all(i == j for i, j in renumbered.items()):
        return ided
    ordered = list(names)
    for i, j in renumbered.items():
        ordered[j] = names[i]
    return dict(ided, state={renumbered[i]: v for i, v in ided["state"].items()},
                param_groups=[dict(g, params=sorted(renumbered[i] for i in g["params"]))
                              for g in ided["param_groups"]],
                param_names=ordered)


def _keyed_by_names(full: dict) -> dict:
    """An id-keyed full optimizer state dict with ``"param_names"`` as torch FSDP1's
    ``optim_state_dict`` keys it: state and param groups by parameter name."""
    names = full["param_names"]
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in full["param_groups"]]
    return {"state": {names[i]: entry for i, entry in full["state"].items()},
            "param_groups": groups}


def _keyed_by_ids(osd: dict, caller: str = "optim_state_dict_to_load") -> dict:
    """The inverse of :func:`_keyed_by_names` (a dict keyed by ids passes unchanged)."""
    if not isinstance(osd, dict) or "param_groups" not in osd or "state" not in osd:
        raise ValueError(f"FSDP.{caller}(...): expected a full optimizer state dict (a dict "
                         f"with 'state' and 'param_groups': from gather_full_optim_state_dict, "
                         f"FSDP.optim_state_dict or a torch optimizer), e.g. loaded from the "
                         f"saved checkpoint")
    flat = [n for g in osd["param_groups"] for n in g["params"]]
    if not all(isinstance(n, str) for n in flat):
        named = [n for n in flat if isinstance(n, str)]
        if named:
            others = [n for n in flat if not isinstance(n, str)]
            raise ValueError(f"FSDP.{caller}(...): the dict's param groups mix parameter "
                             f"names and other keys ({others[:3]} beside {named[:3]}); expected "
                             f"all names (FSDP.optim_state_dict) or all ids (optim.state_dict())")
        return osd
    index = {n: i for i, n in enumerate(flat)}
    unlisted = sorted(str(n) for n in osd["state"] if n not in index)
    if unlisted:
        raise ValueError(f"FSDP.{caller}(...): the state of {unlisted[:5]} is in no param "
                         f"group of the dict (its param groups list {flat[:5]}...); pass the "
                         f"dict FSDP.optim_state_dict returned, unchanged")
    groups, start = [], 0
    for g in osd["param_groups"]:
        groups.append(dict(g, params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    return {"state": {index[n]: entry for n, entry in osd["state"].items()},
            "param_groups": groups, "param_names": [state_dict_key(n) for n in flat]}
