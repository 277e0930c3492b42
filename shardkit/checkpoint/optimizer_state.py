"""Full torch-format optimizer state dicts for a sharded optimizer (OSS): consolidate and load.

A sharded optimizer holds, on each rank, the state of the parameters that rank owns.
:func:`consolidate_optimizer_state` brings every rank's part to one rank (or to all) as a plain
``torch.optim.Optimizer.state_dict()``: global parameter indices in param-group order, CPU
tensors, loadable into a single-process optimizer of the same type or into a sharded one at any
world size. :func:`state_by_param` reads such a dict back against the current param groups, and
:func:`load_into_optimizer` gives a local optimizer its part through its own ``load_state_dict``.
"""

from __future__ import annotations

import pickle
from typing import Optional

import torch

from shardkit import distributed

__all__ = ["consolidate_optimizer_state", "check_full_state_dict", "state_by_param",
           "checked_elementwise_state", "load_into_optimizer", "per_element"]

# torch optimizers' state that holds one value per parameter element (Adam/AdamW, NAdam, RAdam,
# Adamax, SGD, Adagrad, RMSprop, Adadelta, ASGD, Rprop); factored state (Adafactor's
# row_var / col_var) has other shapes and is left to the optimizer.
ELEMENTWISE_STATE = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf",
                               "momentum_buffer", "sum", "square_avg", "acc_delta", "grad_avg",
                               "ax", "prev", "step_size"})

# torch Adafactor's factored second moments of a matrix: (rows, 1) and (1, cols) means. Over a
# parameter cut into row shards they are means over one rank's rows; where the shard is (1, 1)
# (an (n, 1) parameter over n ranks or more) both have the shard's shape, so only their keys tell
# them from per-element state.
FACTORED_STATE = frozenset({"row_var", "col_var"})


def per_element(key: str, value) -> bool:
    """Whether optimizer state ``value`` holds one value per element of its parameter (and so is
    cut into rows with it): a tensor of one dimension or more, or a 0-dim one only under a
    per-element key (a 0-dim parameter's moments; Adam's 0-dim ``step`` is not). Local."""
    return isinstance(value, torch.Tensor) and (value.dim() > 0 or key in ELEMENTWISE_STATE)


def consolidate_optimizer_state(local: dict, param_groups: list[dict], rank: int,
                                world_size: int, group=None,
                                recipient_rank: int = 0) -> Optional[dict]:
    """The full state dict on ``recipient_rank`` (``-1``: on every rank), ``None`` elsewhere.

    ``local``: this rank's state as ``{global parameter index: {key: value}}``.
    ``param_groups``: the param groups to record (hyper-parameters, ``params`` as global
    indices). Each rank's part travels once, one shard at a time, as one flat tensor per
    (dtype, device type) after a small metadata broadcast: ``KΨ/N`` bytes per rank (to every
    rank with ``-1``, by broadcast; else point-to-point). Memory: the full state on the
    recipient, on CPU. Collective over ``group``.
    """
    state: dict = {}
    for r in range(world_size):
        shard = _shard_from(r, local, rank, group, recipient_rank)
        if shard is not None:
            state.update(shard)
    if recipient_rank not in (-1, rank):
        return None
    return {"state": {i: state[i] for i in sorted(state)}, "param_groups": param_groups}


def check_full_state_dict(caller: str, state_dict, param_groups: list[dict]) -> list[dict]:
    """The saved param groups of a full torch-format ``state_dict``, after checking that it has
    the shape of ``param_groups`` (same number of groups and of parameters in each)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise ValueError(f"{caller}: expected a full torch optimizer state dict with 'state' and "
                         f"'param_groups' (from OSS.state_dict() after consolidate_state_dict, "
                         f"or a plain torch optimizer's state_dict())")
    saved = state_dict["param_groups"]
    if len(saved) != len(param_groups):
        raise ValueError(f"{caller}: the state dict has {len(saved)} param groups, this "
                         f"optimizer {len(param_groups)}")
    for g, (s, mine) in enumerate(zip(saved, param_groups)):
        if len(s["params"]) != len(mine["params"]):
            raise ValueError(f"{caller}: param group {g} of the state dict has "
                             f"{len(s['params'])} parameters, this optimizer's has "
                             f"{len(mine['params'])}; the model or its param groups differ")
    return saved


def state_by_param(state_dict: dict, param_groups: list[dict]) -> dict:
    """``{parameter: (saved index, state)}`` for every parameter of ``param_groups`` that has
    state in the (checked) full ``state_dict``. No copy, no communication."""
    id_to_param = {}
    for group, saved in zip(param_groups, state_dict["param_groups"]):
        id_to_param.update(zip(saved["params"], group["params"]))
    return {p: (key, value) for key, value in state_dict["state"].items()
            if (p := id_to_param.get(key)) is not None}


def checked_elementwise_state(caller: str, param: torch.Tensor, index, state: dict) -> dict:
    """``state`` (of the parameter saved at ``index``) with each per-element tensor
    (:data:`ELEMENTWISE_STATE`) in ``param``'s shape: the same elements saved in another shape
    (a flattened copy) are viewed in it; a different number of elements, which a fused kernel
    would read past its end, is a ValueError naming the parameter and the key. No copy."""
    checked = dict(state)
    for key, value in state.items():
        if key not in ELEMENTWISE_STATE or not torch.is_tensor(value) \
                or value.shape == param.shape:
            continue
        if value.numel() != param.numel():
            raise ValueError(f"{caller}: the saved state {key!r} of parameter {index} has shape "
                             f"{tuple(value.shape)}, the parameter has shape "
                             f"{tuple(param.shape)}; the state dict is from another model")
        checked[key] = value.reshape(param.shape)
    return checked


def load_into_optimizer(optimizer: torch.optim.Optimizer, state: dict,
                        hyper_per_group: list[dict]) -> None:
    """Give ``optimizer`` the state ``{its param: state}`` and the hyper-parameters of each of
    its groups, through its own ``load_state_dict`` (which casts to each parameter's device and
    dtype, and lets flat-state optimizers rebuild their buffers). Local."""
    local_index = {id(p): i for i, p in
                   enumerate(p for g in optimizer.param_groups for p in g["params"])}
    groups = [{**hyper, "params": [local_index[id(p)] for p in g["params"]]}
              for hyper, g in zip(hyper_per_group, optimizer.param_groups)]
    optimizer.load_state_dict({"state": {local_index[id(p)]: s for p, s in state.items()},
                               "param_groups": groups})


def _shard_from(r: int, local: dict, rank: int, group, recipient: int) -> Optional[dict]:
    """Bring rank ``r``'s state ``{global index: {key: value}}`` to the recipient (or to all
    with ``recipient == -1``), as CPU tensors; ``None`` elsewhere."""
    src = distributed.get_global_rank(group, r)
    tensors, meta = [], None
    if r == rank:
        meta = []
        for i, s in local.items():
            for key, value in s.items():
                if torch.is_tensor(value):
                    meta.append((i, key, tuple(value.shape), value.dtype, value.device.type))
                    tensors.append(value)
                else:
                    meta.append((i, key, None, value, None))
        meta = _picklable_or_refusal(meta, r)
    meta = distributed.broadcast_object(meta, src=src, group=group)
    if isinstance(meta, str):  # the sender's state cannot travel: every rank raises
        raise ValueError(meta)
    wanted = recipient in (-1, rank)
    flats = _flat_by_kind(meta, tensors if r == rank else None)
    for (dtype, device_type), (flat, numel) in flats.items():
        if flat is None:
            device = "cuda" if device_type == "cuda" else "cpu"
            flat = torch.empty(numel, dtype=dtype, device=device) if wanted else None
        flats[(dtype, device_type)] = (flat, numel)
        if recipient == -1:
            distributed.broadcast(flat, src=src, group=group)
        elif r != recipient:
            dst = distributed.get_global_rank(group, recipient)
            if rank == r:
                distributed.send(flat, dst=dst, group=group)
            elif rank == recipient:
                distributed.recv(flat, src=src, group=group)
    if not wanted:
        return None
    return _unflatten_state(meta, {k: v[0] for k, v in flats.items()})


def _picklable_or_refusal(meta: list, rank: int):
    """``meta`` when it pickles, else the message every rank raises (sent in its place, so
    that no rank waits for a shard its sender could not send). Local; one trial pickle of the
    metadata (shapes and the non-tensor state values)."""
    try:
        pickle.dumps(meta)
        return meta
    except Exception:  # find the first value that does not pickle, to name it
        for i, key, shape, value, _ in meta:
            try:
                pickle.dumps(value)
            except Exception as error:
                return (f"OSS.consolidate_state_dict: the optimizer state {key!r} of parameter "
                        f"{i} on rank {rank} is a {type(value).__name__}, which cannot be "
                        f"pickled ({type(error).__name__}: {error}); optimizer state must be "
                        f"tensors, numbers, strings and plain containers of them")
        return f"OSS.consolidate_state_dict: the optimizer state on rank {rank} cannot be pickled"


def _numel(shape) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def _flat_by_kind(meta: list, tensors: Optional[list]) -> dict:
    """Per (dtype, device type): one flat tensor of the shard's state (``None`` where this
    rank is not the sender) and its element count."""
    out: dict = {}
    it = iter(tensors) if tensors is not None else None
    parts: dict = {}
    for _, _, shape, dtype, device_type in meta:
        if shape is None:
            continue
        key = (dtype, device_type)
        out[key] = (None, out.get(key, (None, 0))[1] + _numel(shape))
        if it is not None:
            parts.setdefault(key, []).append(next(it).detach().reshape(-1))
    if tensors is not None:
        out = {k: (torch.cat(parts[k]) if parts.get(k) else
                   torch.empty(0, dtype=k[0]), n) for k, (_, n) in out.items()}
    return out


def _unflatten_state(meta: list, flats: dict) -> dict:
    offsets = dict.fromkeys(flats, 0)
    state: dict = {}
    for i, key, shape, dtype_or_value, device_type in meta:
        if shape is None:
            state.setdefault(i, {})[key] = dtype_or_value
            continue
        kind = (dtype_or_value, device_type)
        start = offsets[kind]
        offsets[kind] = start + _numel(shape)
        state.setdefault(i, {})[key] = flats[kind][start:offsets[kind]].view(shape).to(
            "cpu", copy=True)
    return state
