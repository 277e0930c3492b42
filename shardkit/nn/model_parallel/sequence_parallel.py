"""Gradients of parameters that live in sequence-parallel regions.

With sequence parallelism, LayerNorms, dropout and the bias of a :class:`RowParallelLinear` run
on ``1/n`` of the sequence on each tensor-parallel rank. Their parameters are replicated, but
each rank's gradient only covers its part of the sequence: the true gradient is the sum over the
tensor-parallel group. Such parameters carry ``param.sequence_parallel = True``
(:func:`mark_sequence_parallel` sets it; the layers set it on their own bias), and
:func:`reduce_sequence_parallel_grads` sums all their gradients in one all-reduce after backward
and before the optimizer step.

Costs one all-reduce over the tensor-parallel group of the marked parameters' gradients
(``2(n-1)/n`` of their bytes), packed into one flat buffer (its size, transiently).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import groups_of

# gradient -> its version counter right after reduce_sequence_parallel_grads summed it: a later
# accumulation into it (a backward) or a new gradient tensor makes it due again
_SUMMED_AT = WeakIdKeyDictionary()

__all__ = ["mark_sequence_parallel", "is_sequence_parallel", "sequence_parallel_parameters",
           "reduce_sequence_parallel_grads"]


def mark_sequence_parallel(module_or_param) -> None:
    """Mark a parameter, or every parameter of a module, as used in a sequence-parallel region."""
    params = ([module_or_param] if isinstance(module_or_param, torch.Tensor)
              else list(module_or_param.parameters()))
    for p in params:
        p.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """True when ``param`` was marked by :func:`mark_sequence_parallel`."""
    return bool(getattr(param, "sequence_parallel", False))


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The marked parameters of ``module`` (each once), in registration order."""
    return [p for p in module.parameters() if is_sequence_parallel(p)]


def reduce_sequence_parallel_grads(module: nn.Module, unless_summed: bool = False) -> int:
    """Sum the gradients of ``module``'s sequence-parallel parameters over the tensor-parallel
    group (the one ``module``'s tensor-parallel layers were built with, else the current one),
    in one all-reduce. Call on every tensor-parallel rank after backward.

    ``unless_summed``: do nothing when every one of those gradients is unchanged since this
    function last summed it (what ``shardkit.initialize``'s engine passes before its step, so
    that a script that calls this function itself is not summed twice). Local test, the same
    on every tensor-parallel rank of an SPMD script.

    Returns the number of gradient elements reduced (0: nothing marked, no collective).
    """
    grads = [p.grad for p in sequence_parallel_parameters(module) if p.grad is not None]
    if unless_summed and all(_SUMMED_AT.get(g) == g._version for g in grads):
        return 0
    group = groups_of(module.modules(), "reduce_sequence_parallel_grads").tensor
    if not grads or distributed.get_world_size(group) == 1:
        return sum(g.numel() for g in grads)
    distributed.all_reduce_as_one(grads, group)
    for g in grads:
        _SUMMED_AT[g] = g._version
    return sum(g.numel() for g in grads)
