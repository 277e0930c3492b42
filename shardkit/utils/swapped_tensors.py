"""Gradient hooks that follow a parameter through ``torch.utils.swap_tensors``.

``swap_tensors(p, q)`` (what ``load_state_dict`` and ``.to()`` do under
``torch.__future__.set_swap_module_params_on_conversion(True)``) gives the Parameter object
``p`` the tensor and the ``__dict__`` of ``q`` but leaves ``p`` its hook dicts, which stay
attached to the tensor ``p`` no longer holds: autograd runs no hook registered on ``p`` before
the swap, nor one registered into those dicts after it. A wrapper that reduces gradients from
such hooks would silently stop reducing. :func:`tensor_mark` puts a token in the parameter's
``__dict__`` (which the swap exchanges), :func:`swapped_since` compares it, and
:func:`reattach_hook_dicts` attaches the parameter's hook dicts to the tensor it holds now.
The mark also recognises a tensor later (a gradient already widened, a parameter already looked
up) without a weak reference to it, which ``swap_tensors`` refuses.
Costs one ``__dict__`` entry per marked tensor; local.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["tensor_mark", "swapped_since", "reattach_hook_dicts"]

_MARK = "_shardkit_tensor_mark"
_TOKENS = itertools.count(1)
_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def tensor_mark(p: torch.Tensor) -> int:
    """The token in ``p``'s ``__dict__``, set at the first call: it stays while ``p`` keeps its
    tensor (``p.data = ...`` included) and is gone after a swap."""
    mark = getattr(p, _MARK, None)
    if mark is None:
        mark = next(_TOKENS)
        setattr(p, _MARK, mark)
    return mark


def swapped_since(p: torch.Tensor, mark: int) -> bool:
    """Whether ``p`` was given another tensor by ``swap_tensors`` since :func:`tensor_mark`
    returned ``mark``."""
    return getattr(p, _MARK, None) != mark


def reattach_hook_dicts(p: torch.Tensor) -> None:
    """Before registering gradient hooks on ``p``: make sure they will run. ``p``'s non-empty
    hook dicts are attached (again) to the tensor it holds now, so the hooks in them (the
    user's, registered before or after a swap) run as they would have had ``p`` kept its
    tensor, once each: torch's setter replaces the one dict hook the tensor carries. Done
    whether or not a swap is known: one before the first registration, or one after the
    wrapper holding the token it compares with released its hooks, is seen by no token. An
    empty dict, which may be one left on a swapped tensor, is dropped (the next registration
    starts a new one where autograd looks). Local."""
    for name in _HOOK_DICTS:
        hooks = getattr(p, name)
        if hooks is not None and not hooks:
            setattr(p, name, None)
        elif hooks is not None:
            setattr(p, name, hooks)  # torch's setter attaches the dict to p's tensor
