"""Export and load the unsplit state of a whole model built with tensor-parallel layers.

A model mixes :class:`~shardkit.nn.model_parallel.layers.TensorParallelModule` layers (sharded)
with ordinary ones (replicated on every tensor-parallel rank). Both functions go through the
model's own ``state_dict()`` / ``load_state_dict()``, so they work on the bare model and on the
model inside a wrapper (torch DDP, ShardedDataParallel, FullyShardedDataParallel over the
data-parallel group, whose state dict is already whole over that group): the keys are the
wrapper's own ``state_dict`` keys, the shapes the unsplit ones, so the result is what the same
model at tensor-parallel size 1 would hold. A module registered under several names (a shared
block) is found under each of them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.fsdp_state_dict import clean_name
from shardkit.nn.model_parallel.layers import TensorParallelModule

__all__ = ["full_model_state_dict", "load_full_model_state_dict", "split_specs"]


# torch's checkpoint_wrapper: in module names, not in state_dict keys (as FSDP's prefix)
_TORCH_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def _split_keys(model: nn.Module, keys) -> dict[str, tuple[TensorParallelModule, str]]:
    """``state_dict`` key -> (tensor-parallel layer, its parameter name) for every key of
    ``keys`` that is a split parameter. Module names are matched after removing the wrapper
    prefixes that state dicts drop (FSDP's, torch's checkpoint_wrapper's); no communication."""
    by_key = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, TensorParallelModule):
            continue
        prefix = clean_name(name + ".").replace(_TORCH_CHECKPOINT_PREFIX, "") if name else ""
        for pname, spec in module._shard_dims.items():
            if spec is not None and prefix + pname in keys:
                by_key[prefix + pname] = (module, pname)
    return by_key


def split_specs(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``state_dict`` key -> ``(dim, stride)`` of every split parameter of ``model`` (what
    :func:`shardkit.nn.model_parallel.utils.join_shards` needs to rebuild it from the
    tensor-parallel ranks' slices, e.g. offline from a checkpoint). Local, no communication."""
    keys = model.state_dict().keys()
    return {key: tuple(module._shard_dims[pname])
            for key, (module, pname) in _split_keys(model, keys).items()}


@torch.no_grad()
def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit state of ``model`` (parameters and buffers, keyed as ``model.state_dict()``).
    Call on every rank: collective over the tensor-parallel group (one all-gather per split
    parameter), plus whatever ``model.state_dict()`` itself costs (FSDP: an all-gather over the
    data-parallel group). The result costs the full model's size on every rank."""
    local = model.state_dict()
    split = _split_keys(model, local)
    out = {}
    for key, tensor in local.items():
        if key in split:
            module, pname = split[key]
            out[key] = module._join(pname, tensor)
        else:
            out[key] = tensor.detach().clone()
    return out


@torch.no_grad()
def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsplit state (as :func:`full_model_state_dict` returns) into ``model``: each rank
    keeps its slices and hands them to ``model.load_state_dict``. No tensor-parallel
    communication (FSDP's ``load_state_dict`` gathers over its data-parallel group). Raises
    ``KeyError`` naming missing or unexpected keys and ``ValueError`` naming a key whose shape is
    not the unsplit one, before loading anything."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_model_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}")
    split = _split_keys(model, own)
    local = {}
    for key, tensor in state_dict.items():
        expected = list(own[key].shape)
        module, pname = split.get(key, (None, None))
        if module is not None:
            expected[module._shard_dims[pname][0]] *= module.tp_size
        if list(tensor.shape) != expected:
            raise ValueError(f"load_full_model_state_dict: {key!r} has shape "
                             f"{tuple(tensor.shape)}; the unsplit model's is {tuple(expected)}")
        local[key] = tensor if module is None else module._split(tensor, pname)
    model.load_state_dict(local)
