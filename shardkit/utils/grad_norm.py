"""Clipping gradients by their global norm when each rank holds a different part of them.

One function serves OSS (each rank measures the gradients of the parameters it owns) and FSDP
(each rank measures its gradient shards): the local sums of ``|g|^p`` (or the local maximum for
the infinity norm) are combined by one all-reduce of one element, so the norm is the norm of
the whole model's gradient, as ``torch.nn.utils.clip_grad_norm_`` would compute it on one
process.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from shardkit import distributed

__all__ = ["check_clip_arguments", "clip_grad_norm_across_ranks"]


def check_clip_arguments(caller: str, max_norm, norm_type) -> tuple[float, float]:
    """``(max_norm, norm_type)`` as floats; a clear error naming ``caller`` when either is not a
    number, ``max_norm <= 0`` or ``norm_type <= 0``."""
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"{caller}(max_norm={max_norm!r}, norm_type={norm_type!r}): both must "
                        f"be numbers") from None
    if not max_norm > 0:
        raise ValueError(f"{caller}(max_norm={max_norm}): must be > 0")
    if not norm_type > 0:
        raise ValueError(f"{caller}(norm_type={norm_type}): must be > 0 or inf")
    return max_norm, norm_type


@torch.no_grad()
def clip_grad_norm_across_ranks(grads: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                                group=None, device: Optional[torch.device] = None,
                                comm_device: Optional[torch.device] = None,
                                measured: Optional[Sequence[torch.Tensor]] = None,
                                also_over: Sequence = ()) -> torch.Tensor:
    """Scale ``grads`` (this rank's part of the model's gradients; every element counted on
    exactly one rank) so that the global ``norm_type``-norm is at most ``max_norm``; return that
    global norm (a 0-d tensor on the gradients' device, or ``device`` when there are none).
    ``max_norm=inf`` only measures: the gradients are left untouched (not even multiplied by 1).

    ``measured``: the gradients this rank counts in the norm when not all of ``grads`` (a
    replica another rank counts is scaled here but not measured); ``also_over``: more groups
    the partial norm is reduced over after ``group`` (tensor- and pipeline-parallel groups).
    ``comm_device``: where the one-element all-reduce runs (default: the gradients' device; FSDP
    passes its communication device for CPU-offloaded gradients under NCCL). Call
    :func:`check_clip_arguments` first. Communication: one all-reduce of one element over
    ``group`` and each of ``also_over`` (collective: every rank calls it, with or without
    gradients). Memory: one scalar per gradient.
    """
    # a zero-element gradient adds nothing to any norm (and has no maximum: skipping it keeps
    # the infinity norm from failing on its owner alone, which would leave the others waiting)
    grads = [g.detach() for g in grads if g.numel()]
    counted = grads if measured is None else [g.detach() for g in measured if g.numel()]
    device = grads[0].device if grads else (device or torch.device("cpu"))
    if math.isinf(norm_type):
        local = (torch.stack([g.abs().max().float() for g in counted]).max()
                 if counted else torch.zeros((), device=device))
        op = distributed.ReduceOp.MAX
    else:
        local = (torch.stack([torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
                              for g in counted]).sum()
                 if counted else torch.zeros((), device=device))
        op = distributed.ReduceOp.SUM
    total = local.reshape(1).to(comm_device or device, copy=True)
    for over in (group, *also_over):
        distributed.all_reduce(total, op=op, group=over)
    total = total[0].to(device)
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if math.isinf(max_norm):  # measuring only: no pass over the gradients
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total
