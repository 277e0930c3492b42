"""Proposing a ``balance`` for :class:`~shardkit.nn.Pipe` from a per-layer cost (FairScale's
``fairscale.nn.pipe.balance``).

Each helper measures one cost per layer of the Sequential, on copies of the layers (the model
is not touched), then cuts the list into ``partitions`` consecutive non-empty blocks so that the
most expensive block is as cheap as possible.

Usage::

    from shardkit.nn import Pipe
    from shardkit.nn.pipe.balance import balance_by_time

    balance = balance_by_time(2, model, torch.randn(64, 1024), device="cpu")
    pipe = Pipe(model, balance, chunks=8)
"""

from __future__ import annotations

import copy
import math
import time
from typing import Optional, Sequence, Union

import torch
import torch.nn as nn

from shardkit.nn.pipe.microbatch import as_tuple, batch_size
from shardkit.nn.pipe.skip import SkipTracker, use_skip_tracker

__all__ = ["balance_by_time", "balance_by_size", "balance_cost"]

Device = Union[torch.device, str, int]


def balance_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Cut ``costs`` into ``partitions`` consecutive non-empty blocks minimising the largest
    block's sum; return the block lengths (a ``balance``). Exact, O(partitions · len(costs)²).
    """
    n = len(costs)
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= n:
        raise ValueError(f"partitions={partitions!r}: expected an int between 1 and the number "
                         f"of layers ({n})")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest largest-block cost of the first i layers in k blocks.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(partitions, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def _layer_copies(module: nn.Sequential, device: torch.device):
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module={type(module).__name__}: expected a torch.nn.Sequential")
    for layer in module:
        yield copy.deepcopy(layer).to(device).train()


class _LayerwiseSkips(SkipTracker):
    """The skip table of one profiling pass: a popped tensor reaches its layer detached (keeping
    ``requires_grad``), as each layer's input does, so a layer's backward and graph stay its own
    and never reach the stashing layer's (already freed) graph; private to the pass, so a pass
    that fails leaves nothing behind for the caller's next forward."""

    def load(self, key):
        tensor = super().load(key)
        if isinstance(tensor, torch.Tensor):
            return tensor.detach().requires_grad_(tensor.requires_grad)
        return tensor


def _detached(inputs: tuple, device: torch.device) -> tuple:
    return tuple(t.detach().to(device).requires_grad_(t.is_floating_point()) for t in inputs)


def _call(layer: nn.Module, inputs: tuple, packed: bool):
    out = layer(inputs if packed else inputs[0])
    return as_tuple(out), not isinstance(out, torch.Tensor)


def _sample_device(sample, device: Optional[Device]) -> torch.device:
    return torch.device(device) if device is not None else as_tuple(sample)[0].device


def balance_by_time(partitions: int, module: nn.Sequential, sample, *, timeout: float = 1.0,
                    device: Optional[Device] = None) -> list[int]:
    """A ``balance`` from the forward + backward time of each layer on ``sample``.

    Every layer is timed on a copy, fed the previous layer's (detached) output and skip
    tensors (:mod:`~shardkit.nn.pipe.skip`, detached as well); the sample's
    tensors keep their own ``requires_grad`` (as in FairScale: a sample that needs no gradient
    times no gradient with respect to the input). One untimed pass first absorbs one-time
    costs (autograd's first backward, lazy initialisation), then the timed loop repeats until
    ``timeout`` seconds have passed (at least once). ``device``: where to profile (default:
    the sample's device; FairScale's default is CUDA). Timing on a busy machine is noisy; pass
    the result to ``Pipe(balance=...)``. A parameter that already has a gradient is a
    ValueError (the timed backward passes would add to it).

    Memory: one copy of one layer at a time plus its activations on ``sample``. No
    communication.
    """
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("balance_by_time(module=...): some parameter already has gradient "
                         "(the timed backward passes would add to a parameter that already has a "
                         "gradient); "
                         "call module.zero_grad(set_to_none=True) first")
    device = _sample_device(sample, device)
    _time_layers(module, sample, device)  # warm-up, not counted
    times = [0.0] * len(module)
    begun = time.perf_counter()
    while True:
        for i, elapsed in enumerate(_time_layers(module, sample, device)):
            times[i] += elapsed
        if time.perf_counter() - begun >= timeout:
            return balance_cost(times, partitions)


def _time_layers(module: nn.Sequential, sample, device: torch.device) -> list[float]:
    """Seconds of forward + backward of each layer (a copy on ``device``) in one pass."""
    inputs = tuple(t.detach().to(device).requires_grad_(t.requires_grad)
                   for t in as_tuple(sample))
    packed = not isinstance(sample, torch.Tensor)
    times = []
    with use_skip_tracker(_LayerwiseSkips()):
        for layer in _layer_copies(module, device):
            inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in inputs)
            _synchronize(device)
            tick = time.perf_counter()
            outputs, packed = _call(layer, inputs, packed)
            grads = [t for t in outputs if t.requires_grad]
            if grads:
                torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
            _synchronize(device)
            times.append(time.perf_counter() - tick)
            inputs = outputs
    return times


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graph_leaves(outputs: tuple) -> list:
    """The leaf tensors the autograd graph of ``outputs`` keeps alive (one per
    ``AccumulateGrad`` node): the layer's parameters and inputs, and any tensor the forward
    created with ``requires_grad=True``, which lives as long as the graph does."""
    leaves, seen = [], set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _saved_bytes(layer: nn.Module, inputs: tuple, packed: bool):
    """Run ``layer`` once; return its outputs and the bytes of the tensors autograd saved for
    backward, the outputs and the leaves the graph keeps alive (as FairScale's allocator
    reading sees them), each storage counted once and neither the layer's parameters nor its
    inputs (the previous layer's outputs, counted there)."""
    storages: dict[int, int] = {}

    def count(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
        outputs, packed = _call(layer, inputs, packed)
    for t in (*outputs, *_graph_leaves(outputs)):
        count(t)
    owned = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *inputs)}
    return outputs, packed, sum(n for ptr, n in storages.items() if ptr not in owned)


def balance_by_size(partitions: int, module: nn.Sequential, input, *, chunks: int = 1,
                    param_scale: float = 2.0, device: Optional[Device] = None) -> list[int]:
    """A ``balance`` from each layer's training memory: activations of one micro-batch plus
    ``param_scale`` copies of its parameters (2 for SGD: weights and grads; about 4 for Adam).

    Each layer (a copy in training mode: the model's buffers, e.g. BatchNorm's running
    statistics, are untouched) runs once on the first micro-batch of ``input`` as ``Pipe``
    would cut it with ``chunks``, but at least 2 rows (BatchNorm cannot train on one); its
    activation bytes (the tensors autograd saves for backward, plus the outputs) are scaled to
    ``batch / chunks`` rows. Unlike FairScale's, which reads the CUDA allocator and profiles one
    sample, this works on any device (default: the input's).

    Memory: one copy of one layer at a time plus its activations on one micro-batch. No
    communication.
    """
    device = _sample_device(input, device)
    inputs = as_tuple(input)
    batch = batch_size(inputs, "balance_by_size(input=...)")
    per_chunk = batch / max(int(chunks), 1)
    rows = min(batch, max(2, math.ceil(per_chunk)))
    scale = per_chunk / rows
    inputs, packed = _detached(tuple(t[:rows] for t in inputs), device), \
        not isinstance(input, torch.Tensor)
    sizes = []
    with use_skip_tracker(_LayerwiseSkips()):
        for layer in _layer_copies(module, device):
            inputs, packed, activation = _saved_bytes(layer, _detached(inputs, device), packed)
            weights = sum(p.numel() * p.element_size() for p in layer.parameters())
            sizes.append(activation * scale + weights * param_scale)
    return balance_cost(sizes, partitions)
