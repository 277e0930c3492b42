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

from typing import Callable, Iterable

import torch

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import groups_of
from shardkit.utils.grad_norm import (check_clip_arguments, clip_grad_norm_across_ranks,
                                      counted_on_tensor_rank)

__all__ = ["clip_grad_norm"]


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                   norm_type: float = 2.0, *, data_parallel_group=None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that the ``norm_type``-norm of the whole
    model's gradient (all tensor-parallel slices and pipeline stages) is at most ``max_norm``;
    return that norm (``torch.nn.utils.clip_grad_norm_`` semantics; ``max_norm=inf`` measures
    only). Call on every rank, after the gradients are averaged over the data-parallel group,
    with this rank's parameters (its stage's, for a pipeline).

    ``data_parallel_group``: pass the group when ShardedDataParallel or FSDP run over it and
    hold each gradient on one replica only (reduced to its owner, or sharded): the partial
    norms are then summed over that group too. Leave ``None`` when every replica holds the
    whole averaged gradients (torch DDP, OSS with gradients averaged by hand). The wrappers'
    own clipping (``OSS.clip_grad_norm``, ``FullyShardedDataParallel.clip_grad_norm_``)
    gives the same norm when they run over the data-parallel group (it reads the same marks,
    :func:`shardkit.utils.grad_norm.count_once_over_tensor_parallel`), except under pipeline
    parallelism, where it measures its own stage only: use this function there.

    The groups are the ones the tensor-parallel layers of ``parameters`` were built with (so a
    model keeps clipping right after :func:`~shardkit.nn.model_parallel.destroy_model_parallel` and
    a new :func:`~shardkit.nn.model_parallel.initialize_model_parallel` for another model), else the
    current ones; parameters of layers built under different layouts raise ``ValueError`` before any
    collective.

    Communication: one all-reduce of one element over the tensor-parallel group, one over
    the pipeline group when there are several stages, one over ``data_parallel_group`` when
    given. Memory: one scalar per gradient.
    """
    return clip_grads_of(parameters, lambda p: p.grad, max_norm, norm_type,
                         data_parallel_group=data_parallel_group)


def clip_grads_of(parameters: Iterable[torch.Tensor], grad_of: Callable, max_norm: float,
                  norm_type: float = 2.0, *, data_parallel_group=None) -> torch.Tensor:
    """:func:`clip_grad_norm` over the gradients ``grad_of(p)`` stands for (``None``: none),
    read in place of ``p.grad``: the fp32 gradients of 16-bit parameters' master weights
    (:class:`shardkit.optim.MasterWeights`), which the step reads. Same communication."""
    max_norm, norm_type = check_clip_arguments("clip_grad_norm", max_norm, norm_type)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    groups = groups_of(params, "clip_grad_norm")
    with_grad = [p for p in params if grad_of(p) is not None]
    # a pipeline's later copy of a tied weight (``shared``, as Megatron marks it) counts not
    # at all: the earlier stage counts it
    measured = [grad_of(p) for p in counted_on_tensor_rank(with_grad, groups.tensor_rank)
                if not getattr(p, "shared", False)]
    also_over = [groups.pipeline] if len(groups.pipeline_ranks) > 1 else []
    if data_parallel_group is not None:
        if distributed.get_rank(data_parallel_group) < 0:
            raise ValueError(f"clip_grad_norm(data_parallel_group=...): global rank "
                             f"{distributed.get_rank()} is not in the group; pass the group "
                             f"ShardedDataParallel / FSDP run over on this rank")
        also_over.append(data_parallel_group)
    return clip_grad_norm_across_ranks([grad_of(p) for p in with_grad], max_norm, norm_type,
                                       groups.tensor, measured=measured, also_over=also_over)
