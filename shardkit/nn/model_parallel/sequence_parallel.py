"""Gradients of parameters that live in sequence-parallel regions.

With sequence parallelism, LayerNorms, dropout and the bias of a
:class:`~shardkit.nn.model_parallel.RowParallelLinear` run on ``1/n`` of the sequence on each
tensor-parallel rank. Their parameters are replicated, but each rank's gradient only covers its part
of the sequence: the true gradient is the sum over the tensor-parallel group. Such parameters carry
``param.sequence_parallel = True`` (:func:`mark_sequence_parallel` sets it; the layers set it on
their own bias), and :func:`reduce_sequence_parallel_grads` sums all their gradients in one
all-reduce after backward and before the optimizer step.

Costs one all-reduce over the tensor-parallel group of the marked parameters' gradients
(``2(n-1)/n`` of their bytes), packed into one flat buffer (its size, transiently).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import groups_of

# gradient -> its version counter right after reduce_sequence_parallel_grads summed it: a new
# gradient tensor, or a backward's accumulation into it, makes it due again
_SUMMED_AT = WeakIdKeyDictionary()
# parameter -> the handle of its hook that sees each backward's accumulation into its gradient
_WATCHED = WeakIdKeyDictionary()
# watched parameter -> True once a backward accumulated into its gradient since it was summed
_ADDED_SINCE_SUM = WeakIdKeyDictionary()

__all__ = ["mark_sequence_parallel", "is_sequence_parallel", "sequence_parallel_parameters",
           "reduce_sequence_parallel_grads", "watch_sequence_parallel_grads"]


# on a module marked whole: the names of its own parameters that were marked, so that the mark
# outlives torch replacing the parameter objects (``to_empty`` of a meta-built model,
# ``copy.deepcopy``, which copy the module's attributes but not the parameters')
_MARKED_NAMES = "_sequence_parallel_parameter_names"


def mark_sequence_parallel(module_or_param) -> None:
    """Mark a parameter, or every parameter of a module, as used in a sequence-parallel region.

    A module's marks are also noted on each of its submodules by parameter name, so that
    :func:`sequence_parallel_parameters` (and :func:`reduce_sequence_parallel_grads`) still
    find its parameters after torch replaced them by new objects without the attribute
    (``module.to_empty(device=...)`` of a model built on ``meta``, ``copy.deepcopy``)."""
    if isinstance(module_or_param, torch.Tensor):
        module_or_param.sequence_parallel = True
        return
    for module in module_or_param.modules():
        names = [name for name, _ in module.named_parameters(recurse=False)]
        if names:
            setattr(module, _MARKED_NAMES,
                    tuple(dict.fromkeys([*getattr(module, _MARKED_NAMES, ()), *names])))
    for p in module_or_param.parameters():
        p.sequence_parallel = True


def is_sequence_parallel(param: torch.Tensor) -> bool:
    """True when ``param`` was marked by :func:`mark_sequence_parallel`."""
    return bool(getattr(param, "sequence_parallel", False))


def sequence_parallel_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The marked parameters of ``module`` (each once), in registration order; a parameter
    that replaced one of a module marked whole by :func:`mark_sequence_parallel` is marked
    again first. Local."""
    _mark_replaced_parameters(module)
    return [p for p in module.parameters() if is_sequence_parallel(p)]


def _mark_replaced_parameters(module: nn.Module) -> None:
    """Set ``sequence_parallel`` again on the current parameters under the names that
    :func:`mark_sequence_parallel` noted on ``module``'s submodules, where it is missing (a
    replacement lacks it); one set to ``False`` since, as Megatron sets it per parameter, stays
    unmarked. Local."""
    for sub in module.modules():
        for name in getattr(sub, _MARKED_NAMES, ()):
            param = sub._parameters.get(name)
            if param is not None and "sequence_parallel" not in param.__dict__:
                param.sequence_parallel = True


def watch_sequence_parallel_grads(module: nn.Module) -> None:
    """Let :func:`reduce_sequence_parallel_grads` with ``unless_summed=True`` tell a backward's
    accumulation into a summed gradient (due again) from an in-place change of it, such as
    clipping or unscaling (still summed): a hook on each of ``module``'s marked parameters that
    runs after each accumulation into its gradient. Call it before the backward whose gradients
    it should follow (``shardkit.initialize``'s engine does, when it is built). Idempotent;
    local, no communication."""
    for param in sequence_parallel_parameters(module):
        if param not in _WATCHED:
            _WATCHED[param] = param.register_post_accumulate_grad_hook(_note_accumulated)


def _note_accumulated(param: torch.Tensor) -> None:
    """A backward added this rank's part of the sequence to ``param.grad`` (which DDP may then
    copy into another tensor): due again."""
    _ADDED_SINCE_SUM[param] = True


def _already_summed(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is a gradient this module summed and no backward added to since.
    Without :func:`watch_sequence_parallel_grads`, any in-place change of it counts as such an
    addition (its version counter moved)."""
    grad = param.grad
    if grad not in _SUMMED_AT:
        return False
    if param in _WATCHED:
        return not _ADDED_SINCE_SUM.get(param, False)
    return _SUMMED_AT[grad] == grad._version


def reduce_sequence_parallel_grads(module: nn.Module, unless_summed: bool = False) -> int:
    """Sum the gradients of ``module``'s sequence-parallel parameters over the tensor-parallel
    group (the one ``module``'s tensor-parallel layers were built with, else the current one),
    in one all-reduce. Call on every tensor-parallel rank after backward.

    ``unless_summed``: leave out each gradient this function already summed and no backward
    added to since (what ``shardkit.initialize``'s engine passes before its step, so that a
    script that sums them itself, all or some, then perhaps clips them, is not summed twice);
    nothing left, no collective. With :func:`watch_sequence_parallel_grads` on ``module``,
    in-place changes such as clipping keep a gradient summed; without it any in-place change
    makes it due again. Local test, the same on every tensor-parallel rank of an SPMD script.

    Returns the number of gradient elements reduced (0: nothing marked or due, no collective).
    """
    params = [p for p in sequence_parallel_parameters(module) if p.grad is not None]
    if unless_summed:
        params = [p for p in params if not _already_summed(p)]
        if not params:
            return 0
    grads = [p.grad for p in params]
    group = groups_of(module.modules(), "reduce_sequence_parallel_grads").tensor
    if not grads or distributed.get_world_size(group) == 1:
        return sum(g.numel() for g in grads)
    distributed.all_reduce_as_one(grads, group)
    for param in params:
        _SUMMED_AT[param.grad] = param.grad._version
        _ADDED_SINCE_SUM.pop(param, None)
    return sum(g.numel() for g in grads)
