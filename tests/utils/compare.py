"""The comparisons the parity tests share: one definition of "how far apart are these".

``max_diff(a, b)`` takes two ``nn.Module`` (their parameters, in order), two dicts of tensors
(state dicts: the same keys), or two sequences of tensors (the same length), and returns the
largest absolute element-wise difference, computed in fp32. Shapes must match exactly (no
broadcasting) and there must be something to compare, so a mismatch fails loudly instead of
comparing less than the test names.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["max_diff", "pairs"]


def pairs(a, b) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, x, y)`` for every pair of tensors ``max_diff`` compares."""
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):
        a, b = list(a.parameters()), list(b.parameters())
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (sorted(set(a) - set(b)), sorted(set(b) - set(a)))
        return [(str(k), a[k], b[k]) for k in a]
    a, b = list(a), list(b)
    assert len(a) == len(b), f"{len(a)} tensors against {len(b)}"
    return [(str(i), x, y) for i, (x, y) in enumerate(zip(a, b))]


def max_diff(a, b) -> float:
    """Largest ``|a - b|`` over every element of every compared tensor (module docstring)."""
    found = pairs(a, b)
    assert found, "max_diff: nothing to compare"
    worst = 0.0
    for name, x, y in found:
        assert x.shape == y.shape, f"{name}: shape {tuple(x.shape)} against {tuple(y.shape)}"
        if x.numel():
            worst = max(worst, float((x.detach().float() - y.detach().float()).abs().max()))
    return worst
