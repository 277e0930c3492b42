"""Attribute lookup that falls through a wrapper to the module it wraps (FairScale's and
DeepSpeed's wrappers behave so: ``ddp.config`` reads the model's ``config``), and finding a
wrapper already inside a module."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

__all__ = ["attribute_through", "wrapper_inside"]


def attribute_through(wrapper: nn.Module, name: str, child: str):
    """``wrapper.name`` by ``nn.Module``'s rules, else the attribute of its registered
    submodule ``child``; ``AttributeError`` when neither has it (or ``child`` is not registered
    yet, as during ``__init__``). For a wrapper's ``__getattr__``. Costs nothing."""
    try:
        return nn.Module.__getattr__(wrapper, name)
    except AttributeError:
        wrapped = wrapper.__dict__.get("_modules", {}).get(child)
        if wrapped is None:
            raise
        return getattr(wrapped, name)


def wrapper_inside(module: nn.Module, kinds: tuple) -> Optional[tuple[str, nn.Module]]:
    """The first submodule of ``module`` (``module`` itself included) that is one of
    ``kinds``, as ``(where, submodule)`` with ``where`` "module" or "module.<name>";
    ``None`` when there is none. Local; one walk over the modules."""
    for name, sub in module.named_modules():
        if isinstance(sub, kinds):
            return ("module" if not name else f"module.{name}"), sub
    return None
