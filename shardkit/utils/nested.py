"""Finding the tensors inside nested Python values (a forward's output, a batch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Iterator

import torch

__all__ = ["tensors_in"]


def tensors_in(value) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, however nested: mappings (dict subclasses too, such as an
    ``OrderedDict`` subclass or a transformers ``ModelOutput``), lists, tuples (namedtuples)
    and dataclasses. Each container is visited once (cycles end). Local; one walk, no copy."""
    seen: set = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
            continue
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
