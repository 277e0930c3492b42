"""Parameter marks that survive torch replacing the parameters of a module.

The tensor-parallel layers tag their parameters (``tensor_model_parallel``,
``model_parallel_groups``, ``sequence_parallel``: Megatron's attributes, read by
:func:`~shardkit.nn.model_parallel.clip_grad_norm`, by
:func:`~shardkit.nn.model_parallel.reduce_sequence_parallel_grads` and by the data-parallel
wrappers' clipping). Such a tag is an attribute of the parameter object, and torch's
``Module._apply`` sometimes replaces that object by a new ``nn.Parameter`` without it:
``to_empty(device=...)`` of a model built under ``torch.device("meta")`` (torch's way of
materialising it), ``load_state_dict(sd, assign=True)`` (the other way), or any ``.to()`` /
``.cuda()`` under ``torch.__future__.set_swap_module_params_on_conversion(True)``. The model
then clipped by a wrong norm and summed no sequence-parallel gradient, silently.

:class:`KeepsParameterMarks` is the base that puts them back: around ``_apply`` and
``_load_from_state_dict`` it notes the marks of the parameters concerned by name and gives each
parameter found under that name afterwards the marks it lacks. Local, no communication;
memory: one small dict per call. Only marks travel: a tensor held as an attribute of the old
parameter (Megatron's ``main_grad``, a cached copy) is storage of that object, of its old device,
dtype or shape (``meta`` after ``to_empty``), so it is not handed to the replacement, which would
also keep it alive.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["KeepsParameterMarks", "parameter_marks", "restore_parameter_marks"]


def parameter_marks(module: nn.Module, recurse: bool = True) -> dict[str, dict]:
    """``{qualified name: the marks set on that parameter}`` for each parameter of ``module``
    (with ``recurse``, its submodules' too; shared ones under every name) that carries any: its
    attributes other than tensors (see the module docstring). Local."""
    marks = {}
    for name, param in module.named_parameters(recurse=recurse, remove_duplicate=False):
        own = {key: value for key, value in param.__dict__.items()
               if not isinstance(value, torch.Tensor)}
        if own:
            marks[name] = own
    return marks


def restore_parameter_marks(module: nn.Module, marks: dict[str, dict],
                            recurse: bool = True) -> None:
    """Give each parameter of ``module`` named in ``marks`` (from :func:`parameter_marks` with
    the same ``recurse``) the attributes it lacks; those it has are left alone. Local."""
    params = dict(module.named_parameters(recurse=recurse, remove_duplicate=False))
    for name, attributes in marks.items():
        param = params.get(name)
        if param is None:
            continue
        for key, value in attributes.items():
            param.__dict__.setdefault(key, value)


class KeepsParameterMarks(nn.Module):
    """An ``nn.Module`` whose parameters keep their marks where torch replaces the parameter
    objects (see the module docstring): its submodules' too through ``to_empty``, ``.to()``,
    ``.cuda()``, ``.half()`` and the rest of ``Module._apply``; its own through
    ``load_state_dict(..., assign=True)``."""

    def _apply(self, fn, recurse=True):
        marks = parameter_marks(self)
        module = super()._apply(fn, recurse)
        restore_parameter_marks(self, marks)
        return module

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        marks = parameter_marks(self, recurse=False)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        restore_parameter_marks(self, marks, recurse=False)
