"""What autograd keeps for backward: the activation-memory probe the checkpointing tests share."""

from __future__ import annotations

import torch

__all__ = ["saved_bytes"]


def saved_bytes(fn):
    """``(bytes of every tensor autograd saved for backward while running fn(), fn's result)``
    (each saved tensor counted once per save, views included at their own size)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out
