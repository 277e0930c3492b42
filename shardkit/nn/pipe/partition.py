"""Cutting an ``nn.Sequential`` into consecutive stages by a ``balance`` list."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch.nn as nn

__all__ = ["split_sequential", "check_balance", "check_unique_layers"]


def check_unique_layers(module: nn.Sequential, what: str) -> None:
    """Raise ``ValueError`` when one layer object sits twice in ``module``.

    ``named_children()`` yields a repeated module once, so a stage built from it would run the
    layer once instead of twice and silently compute something else.
    """
    seen: dict[int, str] = {}
    for name, layer in module._modules.items():
        if layer is not None and id(layer) in seen:
            raise ValueError(f"{what}(module=...): module with duplicate children is not "
                             f"supported: layer {name!r} is the same module object as layer "
                             f"{seen[id(layer)]!r} (use copy.deepcopy for a second copy, or "
                             f"share only its parameters)")
        if layer is not None:
            seen[id(layer)] = name


def check_balance(module: nn.Sequential, balance: Sequence[int], what: str) -> list[int]:
    """Return ``balance`` as a list after checking it cuts ``module`` into non-empty stages.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: a part is not a positive int, the parts do not sum to ``len(module)``, or
            the same layer object appears twice in ``module`` (it would run only once).
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"{what}(module={type(module).__name__}): module must be "
                        f"nn.Sequential to be partitioned (its layers are cut into stages by "
                        f"`balance`)")
    check_unique_layers(module, what)
    try:
        parts = list(balance)
    except TypeError:
        raise TypeError(f"{what}(balance={balance!r}): expected a list of positive ints, one per "
                        f"stage") from None
    if not parts or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in parts):
        raise ValueError(f"{what}(balance={parts!r}): expected a non-empty list of positive "
                         f"ints, one per stage")
    if sum(parts) != len(module):
        raise ValueError(f"{what}(balance={parts!r}): the parts sum to {sum(parts)} but the "
                         f"Sequential has {len(module)} layers; they must be equal")
    return parts


def split_sequential(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Cut ``module`` into ``len(balance)`` consecutive ``nn.Sequential`` stages.

    Stage ``j`` holds the next ``balance[j]`` layers, the same layer objects under their
    original names (no copy: memory and parameters are shared with ``module``).
    """
    parts = check_balance(module, balance, "split_sequential")
    layers = list(module.named_children())
    stages, start = [], 0
    for size in parts:
        stages.append(nn.Sequential(OrderedDict(layers[start:start + size])))
        start += size
    return stages
