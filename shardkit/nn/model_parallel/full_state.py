"""Export and load the unsplit state of a whole model built with tensor-parallel layers.

A model mixes :class:`~shardkit.nn.model_parallel.layers.TensorParallelModule` layers (sharded)
with ordinary ones (replicated on every tensor-parallel rank). These two functions walk it once:
sharded layers export/load through their own ``full_state_dict`` / ``load_full_state_dict``,
everything else is copied as is. The keys are the model's own ``state_dict`` keys; the shapes
are the unsplit ones, so the result is what the same model at tensor-parallel size 1 would hold.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardkit.nn.model_parallel.layers import TensorParallelModule

__all__ = ["full_model_state_dict", "load_full_model_state_dict"]


def _tensor_parallel_prefixes(model: nn.Module) -> dict[str, TensorParallelModule]:
    return {(name + "." if name else ""): m for name, m in model.named_modules()
            if isinstance(m, TensorParallelModule)}


def _owner(key: str, prefixes: dict[str, TensorParallelModule]):
    for prefix, module in prefixes.items():
        if key.startswith(prefix) and "." not in key[len(prefix):]:
            return prefix, module
    return None, None


@torch.no_grad()
def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsplit state of ``model`` (parameters and buffers). Collective over the
    tensor-parallel group (one all-gather per sharded parameter); the result costs the full
    model's size on every rank."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in _tensor_parallel_prefixes(model).items():
        for name, tensor in module.full_state_dict().items():
            out[prefix + name] = tensor
    for key, tensor in model.state_dict().items():
        if key not in out:
            out[key] = tensor.detach().clone()
    return out


@torch.no_grad()
def load_full_model_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load an unsplit state (as :func:`full_model_state_dict` returns) into ``model``, each rank
    keeping its slices. No communication. Raises ``KeyError`` naming missing or unexpected keys."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise KeyError(f"load_full_model_state_dict: missing keys {missing}, unexpected keys "
                       f"{unexpected}")
    prefixes = _tensor_parallel_prefixes(model)
    per_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state_dict.items():
        prefix, module = _owner(key, prefixes)
        if module is not None and key[len(prefix):] in dict(module.named_parameters(recurse=False)):
            per_module.setdefault(prefix, {})[key[len(prefix):]] = tensor
        else:
            if tuple(own[key].shape) != tuple(tensor.shape):
                raise ValueError(f"load_full_model_state_dict: {key!r} has shape "
                                 f"{tuple(tensor.shape)}; the model's is {tuple(own[key].shape)}")
            own[key].copy_(tensor)
    for prefix, tensors in per_module.items():
        prefixes[prefix].load_full_state_dict(tensors)
