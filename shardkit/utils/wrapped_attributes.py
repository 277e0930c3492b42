"""Attribute lookup that falls through a wrapper to the module it wraps (FairScale's and
DeepSpeed's wrappers behave so: ``ddp.config`` reads the model's ``config``)."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["attribute_through"]


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
