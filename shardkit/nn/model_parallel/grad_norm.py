"""Gradient clipping by the global norm of a tensor- (and pipeline-) parallel model.

Each tensor-parallel rank holds a slice of every split weight (``param.tensor_model_parallel``,
set by the layers) and a full copy of every replicated one (LayerNorms, a
``RowParallelLinear``'s bias, the position embedding), with the same gradient on every
tensor-parallel rank. The norm of the unsplit model counts each split slice once and each
replicated parameter once, not ``n`` times: replicated gradients are measured on tensor-parallel
rank 0 only, the split ones everywhere, and the partial sums are added over the tensor-parallel
group and then over the pipeline group (each stage holds other layers). Every rank then scales
all of its gradients, replicated ones included, by the same coefficient, so the replicas stay
equal. ``torch.nn.utils.clip_grad_norm_`` on one rank measures only that rank's slices and
clips each tensor-parallel rank differently.
"""

from __future__ import annotations

from typing import Iterable

import torch

from shardkit.nn.model_parallel.initialize import (
    get_model_parallel_group, get_model_parallel_rank, get_pipeline_parallel_group,
    get_pipeline_parallel_world_size)
from shardkit.utils.grad_norm import check_clip_arguments, clip_grad_norm_across_ranks

__all__ = ["clip_grad_norm"]


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that the ``norm_type``-norm of the whole
    model's gradient (all tensor-parallel slices and pipeline stages) is at most ``max_norm``;
    return that norm (``torch.nn.utils.clip_grad_norm_`` semantics; ``max_norm=inf`` measures
    only). Call on every rank, after the gradients are averaged over the data-parallel group
    (torch DDP, or by hand), with this rank's parameters (its stage's, for a pipeline). Not for
    gradients that OSS, ShardedDataParallel or FSDP hold sharded over the data-parallel group:
    their own clipping reduces over that group only.

    Communication: one all-reduce of one element over the tensor-parallel group, and one over
    the pipeline group when there are several stages. Memory: one scalar per gradient.
    """
    max_norm, norm_type = check_clip_arguments("clip_grad_norm", max_norm, norm_type)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    # replicated gradients are equal on every tensor-parallel rank: count them on rank 0 only;
    # a pipeline's later copy of a tied weight (``shared``, as Megatron marks it) not at all
    measured = [p.grad for p in with_grad if not getattr(p, "shared", False) and (
        getattr(p, "tensor_model_parallel", False) or get_model_parallel_rank() == 0)]
    pipeline = [get_pipeline_parallel_group()] if get_pipeline_parallel_world_size() > 1 else []
    return clip_grad_norm_across_ranks([p.grad for p in with_grad], max_norm, norm_type,
                                       get_model_parallel_group(), measured=measured,
                                       also_over=pipeline)
