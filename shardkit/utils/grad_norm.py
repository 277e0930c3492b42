"""Clipping gradients by their global norm when each rank holds a different part of them.

One function serves OSS (each rank measures the gradients of the parameters it owns) and FSDP
(each rank measures its gradient shards): the local sums of ``|g|^p`` (or the local maximum for
the infinity norm) are combined by one all-reduce of one element, so the norm is the norm of
the whole model's gradient, as ``torch.nn.utils.clip_grad_norm_`` would compute it on one
process.

Under tensor parallelism (2D/3D parallelism: the wrappers run over the data-parallel group of a
model built from ``shardkit.nn.model_parallel`` layers) each tensor-parallel rank holds a slice
of every split weight (``param.tensor_model_parallel``) and a copy of every replicated one.
:func:`counted_on_tensor_rank` is the one rule that decides which gradients a rank counts then
(split ones everywhere, replicated ones on tensor-parallel rank 0 only), used by
:func:`shardkit.nn.model_parallel.clip_grad_norm` and, through
:func:`count_once_over_tensor_parallel` (which also adds the tensor-parallel group to the groups
the partial norm is summed over), by OSS's and FSDP's clipping.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

from shardkit import distributed

__all__ = ["check_clip_arguments", "clip_grad_norm_across_ranks", "count_once_over_tensor_parallel",
           "counted_on_tensor_rank", "tensor_parallel_groups"]


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


def counted_on_tensor_rank(params: Iterable[torch.Tensor], tensor_rank: int) -> list:
    """The parameters of ``params`` whose gradients tensor-parallel rank ``tensor_rank`` counts
    in the model's norm: the split ones (``tensor_model_parallel``; each rank holds other
    elements) on every rank, the replicated ones (the same gradient on every tensor-parallel
    rank) on rank 0 only. Local, no communication."""
    return [p for p in params if getattr(p, "tensor_model_parallel", False) or tensor_rank == 0]


def tensor_parallel_groups(params: Iterable[torch.Tensor], what: str):
    """The model-parallel groups the tensor-parallel layers of ``params`` were built with (their
    ``model_parallel_groups`` mark) when those layers split weights over more than one rank;
    ``None`` for a model without such layers. Local, no communication.

    Raises:
        ValueError: the parameters come from layers built under different layouts.
    """
    marked = [p for p in params if getattr(p, "model_parallel_groups", None) is not None]
    if not marked:
        return None
    # imported here: shardkit.nn.model_parallel imports this module
    from shardkit.nn.model_parallel.initialize import groups_of
    groups = groups_of(marked, what)
    return groups if len(groups.tensor_ranks) > 1 else None


def count_once_over_tensor_parallel(params: Iterable[torch.Tensor], counted: Sequence, what: str,
                                    data_groups: Sequence = ()) -> tuple[list, tuple]:
    """``(counted, also_over)`` for a data-parallel wrapper's clipping under tensor parallelism.

    ``params``: all of the wrapper's parameters on this rank (read for the layers' marks, so
    that every rank of the wrapper decides alike); ``counted``: those whose gradients this rank
    would count without tensor parallelism (its owned ones, its shards). Without split
    tensor-parallel parameters, ``(counted, ())``: nothing changes. With them, the ones this
    tensor-parallel rank counts (:func:`counted_on_tensor_rank`) and ``(tensor_group,)``: the
    partial norm is then also summed over the tensor-parallel group, one more all-reduce of one
    element, so that every rank gets the whole model's norm and clips by the same factor (the
    replicated weights stay equal). Pipeline stages are not summed: each stage's wrapper
    measures its stage (:func:`shardkit.nn.model_parallel.clip_grad_norm` sums them).

    ``data_groups``: the wrapper's process groups (``None``: the world); a group holding two
    ranks of one tensor-parallel group (a wrapper over the world instead of the data-parallel
    group) raises ``ValueError``. Local, no communication.
    """
    params = list(params)
    groups = tensor_parallel_groups(params, what)
    if groups is None:
        return list(counted), ()
    tensor_ranks = set(groups.tensor_ranks)
    for group in data_groups:
        ranks = (range(distributed.get_world_size()) if group is None
                 else distributed.group_ranks(group))
        shared = sorted(tensor_ranks.intersection(ranks))
        if len(shared) > 1:
            raise ValueError(
                f"{what}: the model has tensor-parallel layers, and the wrapper's process group "
                f"(ranks {list(ranks)}) holds ranks {shared} of one tensor-parallel group "
                f"{list(groups.tensor_ranks)}, which hold different slices of the weights; build "
                f"the wrapper over shardkit.nn.model_parallel.get_data_parallel_group()")
    return counted_on_tensor_rank(counted, groups.tensor_rank), (groups.tensor,)


@torch.no_grad()
def clip_grad_norm_across_ranks(grads: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                                group=None, device: Optional[torch.device] = None,
                                comm_device: Optional[torch.device] = None,
                                measured: Optional[Sequence[torch.Tensor]] = None,
                                also_over: Sequence = (),
                                local_only: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """Scale ``grads`` (this rank's part of the model's gradients; every element counted on
    exactly one rank) so that the global ``norm_type``-norm is at most ``max_norm``; return that
    global norm (a 0-d tensor on the gradients' device, or ``device`` when there are none).
    ``max_norm=inf`` only measures: the gradients are left untouched (not even multiplied by 1).

    ``measured``: the gradients this rank counts in the norm when not all of ``grads`` (a
    replica another rank counts is scaled here but not measured); ``also_over``: more groups
    the partial norm is reduced over after ``group`` (tensor- and pipeline-parallel groups);
    ``local_only``: gradients whose norm this rank adds after the reductions, not summed over
    the ranks, and that are scaled too (torch FSDP1's count of parameters no unit shards).
    ``comm_device``: where the one-element all-reduce runs (default: the gradients' device; FSDP
    passes its communication device for CPU-offloaded gradients under NCCL). Call
    :func:`check_clip_arguments` first. Communication: one all-reduce of one element over
    ``group`` and each of ``also_over`` (collective: every rank calls it, with or without
    gradients). Memory: one scalar per gradient.

    Sparse gradients (``nn.Embedding(sparse=True)``), which torch's norms cannot read, count by
    their coalesced values (repeated rows summed, as they are added to the weight) and are
    scaled in place themselves (one host sync for the coefficient).
    """
    # a zero-element gradient adds nothing to any norm (and has no maximum: skipping it keeps
    # the infinity norm from failing on its owner alone, which would leave the others waiting);
    # a sparse gradient is kept as it is: an in-place multiply of a detached copy would not
    # reach it
    grads = [g if g.is_sparse else g.detach() for g in grads if g.numel()]
    local_only = [g if g.is_sparse else g.detach() for g in local_only if g.numel()]
    counted = grads if measured is None else list(measured)
    device = grads[0].device if grads else (device or torch.device("cpu"))
    total = _norm_term(counted, norm_type, device).reshape(1).to(comm_device or device, copy=True)
    op = distributed.ReduceOp.MAX if math.isinf(norm_type) else distributed.ReduceOp.SUM
    for over in (group, *also_over):
        distributed.all_reduce(total, op=op, group=over)
    total = total[0].to(device)
    if local_only:
        own = _norm_term(local_only, norm_type, device)
        total = torch.maximum(total, own) if math.isinf(norm_type) else total + own
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if math.isinf(max_norm):  # measuring only: no pass over the gradients
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads + local_only:
        g.mul_(coef.item() if g.is_sparse else coef.to(g.device, g.dtype))
    return total


def _norm_term(grads: Sequence[torch.Tensor], norm_type: float,
               device: torch.device) -> torch.Tensor:
    """This rank's part of the ``norm_type``-norm of ``grads`` before the root: the sum of
    ``|g|^p`` (the largest ``|g|`` for the infinity norm), in fp32 on ``device``; sparse
    gradients by their coalesced values. Local."""
    values = [g.coalesce().values() if g.is_sparse else g.detach() for g in grads]
    values = [v for v in values if v.numel()]
    if not values:
        return torch.zeros((), dtype=torch.float32, device=device)  # not the default dtype
    if math.isinf(norm_type):
        return torch.stack([v.abs().max().float() for v in values]).max().to(device)
    return torch.stack([torch.linalg.vector_norm(v.float(), norm_type) ** norm_type
                        for v in values]).sum().to(device)
