"""Cutting an ``nn.Sequential`` into consecutive stages by a ``balance`` list."""

from __future__ import annotations

import operator
from collections import OrderedDict
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["split_sequential", "check_balance", "check_unique_layers", "shared_parameters"]


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


def _as_int(value):
    """``value`` as a Python int when it is an integer (numpy and 0-dim torch integers too, as
    FairScale takes them), else None; bools are not integers here (nor bool tensors)."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_balance(module: nn.Sequential, balance: Sequence[int], what: str,
                  hint: str = "") -> list[int]:
    """Return ``balance`` as a list after checking it cuts ``module`` into non-empty stages.
    ``hint`` (e.g. where to find a balance helper) ends every message about ``balance``.

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
    hint = f" ({hint})" if hint else ""
    try:
        parts = list(balance)
    except TypeError:
        raise TypeError(f"{what}(balance={balance!r}): expected a list of positive ints, one per "
                        f"stage{hint}") from None
    given, parts = parts, [_as_int(b) for b in parts]
    if not parts or any(b is None or b < 1 for b in parts):
        raise ValueError(f"{what}(balance={given!r}): expected a non-empty list of positive "
                         f"ints, one per stage{hint}")
    if sum(parts) != len(module):
        raise ValueError(f"{what}(balance={parts!r}): the parts sum to {sum(parts)} but the "
                         f"Sequential has {len(module)} layers; they must be equal{hint}")
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
    _mark_shared_parameters(stages)
    return stages


SHARED_ATTR = "_pipe_shared_parameters"


def _mark_shared_parameters(stages: list[nn.Sequential]) -> None:
    """Record on each stage which of its parameters are the same tensor as a parameter of
    another stage (tied weights: an embedding and the output head), as ``{name: (parameter,
    [(stage, name there), ...])}`` in ``SHARED_ATTR``, so that
    :class:`~shardkit.nn.pipe.PipelineStage` can refuse a trainable tie between stages run by
    different processes (each would train its own copy). Costs one pass over the parameters; nothing
    is recorded on stages without such ties."""
    owners: dict[int, list] = {}
    for j, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            owners.setdefault(id(p), []).append((j, name))
    for j, stage in enumerate(stages):
        ties = {name: (p, [(k, other) for k, other in owners[id(p)] if k != j])
                for name, p in stage.named_parameters()}
        ties = {name: tie for name, tie in ties.items() if tie[1]}
        if ties:
            setattr(stage, SHARED_ATTR, (len(stages), ties))


def shared_parameters(module: nn.Module) -> tuple[int, dict]:
    """``(number of stages, {name: (parameter, [(stage, name there), ...])})`` that
    :func:`split_sequential` recorded on ``module`` or on a module inside it (a stage wrapped
    by a data-parallel wrapper); ``(0, {})`` when none."""
    for m in module.modules():
        found = getattr(m, SHARED_ATTR, None)
        if found is not None:
            return found
    return 0, {}
