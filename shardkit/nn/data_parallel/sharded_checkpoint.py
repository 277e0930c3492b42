"""Checkpoint formats of FullyShardedDataParallel that move between world sizes.

A parameter is sharded on dim 0 into ``N`` row blocks (:class:`.flat_param.ParamLayout`), so a
checkpoint saved by ``N`` ranks is resharded for ``M`` ranks by concatenating rows and cutting
again. These functions take plain arguments (state dicts, layouts, this rank) and never
communicate; the wrapper supplies the collectives.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from shardkit.nn.data_parallel.flat_param import ParamLayout, shard_rows, unshard_rows

__all__ = ["LOCAL_META_KEY", "reshard_local_state_dicts", "unshard_optimizer_state",
           "shard_optimizer_state"]

LOCAL_META_KEY = "_shardkit_fsdp_meta"


def unshard_optimizer_state(osd: dict, ordered: Sequence[torch.Tensor],
                            layouts: dict, names: Sequence[Optional[str]],
                            gather_rows: Callable[[torch.Tensor, ParamLayout], torch.Tensor]
                            ) -> dict:
    """A torch optimizer state dict whose shard-shaped tensors are unsharded by
    ``gather_rows(tensor, layout)``; ``ordered`` are the optimizer's parameters in state-dict
    index order, ``layouts`` maps ``id(param)`` to its layout. Adds ``"param_names"``."""
    state = {}
    for index, p in enumerate(ordered):
        layout = layouts.get(id(p))
        entry = {}
        for key, value in osd["state"].get(index, {}).items():
            if layout is not None and isinstance(value, torch.Tensor) and value.shape == p.shape:
                value = gather_rows(value, layout)
            entry[key] = value
        if entry:
            state[index] = entry
    return {"state": state, "param_groups": copy.deepcopy(osd["param_groups"]),
            "param_names": list(names)}


def shard_optimizer_state(full_osd: dict, ordered: Sequence[Optional[torch.Tensor]],
                          layouts: dict, rank: int) -> dict:
    """This rank's part of a full optimizer state dict: every tensor of its parameter's full
    shape is cut to ``rank``'s rows; ``ordered[i]`` is the parameter of state index ``i``."""
    if not isinstance(full_osd, dict) or any(k not in full_osd for k in ("state",
                                                                          "param_groups")):
        raise ValueError("get_shard_from_optim_state_dict: expected a torch optimizer state "
                         "dict with 'state' and 'param_groups' (e.g. from "
                         "gather_full_optim_state_dict)")
    state = {}
    for index, entry in full_osd["state"].items():
        p = ordered[int(index)] if int(index) < len(ordered) else None
        layout = layouts.get(id(p)) if p is not None else None
        state[index] = {k: (shard_rows(v, layout, rank)
                            if layout is not None and isinstance(v, torch.Tensor)
                            and tuple(v.shape) == tuple(layout.shape) else v)
                        for k, v in entry.items()}
    return {"state": state, "param_groups": copy.deepcopy(full_osd["param_groups"])}



def reshard_local_state_dicts(state_dict, world_size: int, rank: int) -> OrderedDict:
    """This rank's local state dict, from its own dict or from every old rank's dicts."""
    dicts = [state_dict] if isinstance(state_dict, dict) else list(state_dict)
    if not dicts or any(LOCAL_META_KEY not in d for d in dicts):
        raise ValueError("load_local_state_dict: expected the output of local_state_dict() "
                         "(a dict with '_shardkit_fsdp_meta'), or a list of every rank's")
    metas = [d[LOCAL_META_KEY] for d in dicts]
    old_world = metas[0]["world_size"]
    if len(dicts) == 1:
        if (old_world, metas[0]["rank"]) != (world_size, rank):
            raise ValueError(
                f"load_local_state_dict: this dict was saved by rank {metas[0]['rank']} of a "
                f"world of {old_world}; this is rank {rank} of {world_size}. To reshard, pass "
                f"the list of all {old_world} ranks' local state dicts")
        return OrderedDict((k, v) for k, v in dicts[0].items() if k != LOCAL_META_KEY)
    ranks = sorted(m["rank"] for m in metas)
    if ranks != list(range(old_world)) or any(m["world_size"] != old_world for m in metas):
        raise ValueError(f"load_local_state_dict: got dicts of ranks {ranks} (world sizes "
                         f"{sorted({m['world_size'] for m in metas})}); resharding needs exactly "
                         f"one dict per rank of the old world")
    dicts = sorted(dicts, key=lambda d: d[LOCAL_META_KEY]["rank"])
    shapes = metas[0]["shapes"]
    out = OrderedDict()
    for key, value in dicts[0].items():
        if key == LOCAL_META_KEY:
            continue
        if key in shapes:
            full = unshard_rows([d[key] for d in dicts], ParamLayout(torch.Size(shapes[key]),
                                                                     old_world))
            value = shard_rows(full, ParamLayout(torch.Size(shapes[key]), world_size), rank)
        out[key] = value
    return out
