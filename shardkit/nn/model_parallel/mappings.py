"""Autograd functions that move activations in and out of tensor-parallel regions.

Each forward has a conjugate backward, so that gradients come out right without the model
knowing about communication (``n`` = tensor-parallel size, ``S`` = bytes of the full
activation):

================================================  ====================  ====================
function                                          forward               backward
================================================  ====================  ====================
``copy_to_model_parallel_region``                 identity              all-reduce (2(n-1)/n·S)
``reduce_from_model_parallel_region``             all-reduce            identity
``scatter_to_model_parallel_region`` (last dim)   keep own slice        all-gather
``gather_from_model_parallel_region`` (last dim)  all-gather            keep own slice
``scatter_to_sequence_parallel_region``           keep own slice        all-gather
``gather_from_sequence_parallel_region``          all-gather            reduce-scatter
``reduce_scatter_to_sequence_parallel_region``    reduce-scatter        all-gather
================================================  ====================  ====================

``stride`` (scatter/gather of the last dimension only) matches a strided weight split (see
:func:`~shardkit.nn.model_parallel.utils.shard_of`): rank ``r`` keeps blocks ``r, r + n, ...``
of ``stride * n``; the communication is the same as with ``stride=1``.

All-gather and reduce-scatter each put ``(n-1)/n·S`` on the wire, so the sequence-parallel
pair costs what one all-reduce does, while the activations between them are ``1/n`` the size.
The sequence dimension defaults to 1 (batch-first ``[batch, seq, hidden]``, shardkit's GPT).
Every collective goes through :mod:`shardkit.distributed` on the tensor-parallel group: the
``group`` argument (the layers pass the group they were built with, so they keep working after
:func:`~shardkit.nn.model_parallel.initialize.destroy_model_parallel`), else the current one.
"""

from __future__ import annotations

import torch

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import get_model_parallel_group
from shardkit.nn.model_parallel.utils import divide, join_shards, shard_of

__all__ = [
    "SEQUENCE_DIM",
    "copy_to_model_parallel_region", "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region", "gather_from_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]

SEQUENCE_DIM = 1


# ----------------------------------------------------------------------------- primitives


def _group(group):
    return get_model_parallel_group() if group is None else group


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    group = _group(group)
    if distributed.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    distributed.all_reduce(x, group=group)
    return x


def _keep_own_slice(x: torch.Tensor, dim: int, stride: int, group) -> torch.Tensor:
    group = _group(group)
    n = distributed.get_world_size(group)
    if n == 1:
        return x
    parts = f"{n} tensor-parallel ranks" + (f" × stride {stride}" if stride > 1 else "")
    divide(x.shape[dim], n * stride, f"dimension {dim} of the activation {tuple(x.shape)} "
                                     f"split over {parts}")
    return shard_of(x, distributed.get_rank(group), n, dim, stride)


def _all_gather(x: torch.Tensor, dim: int, stride: int, group) -> torch.Tensor:
    group = _group(group)
    n = distributed.get_world_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    # Flat buffers: gloo wants the output's first dimension to be n times the input's.
    out = torch.empty(n * x.numel(), dtype=x.dtype, device=x.device)
    distributed.all_gather_into_tensor(out, x.view(-1), group=group)
    return join_shards(list(out.view((n,) + tuple(x.shape)).unbind(0)), dim=dim, stride=stride)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    group = _group(group)
    n = distributed.get_world_size(group)
    if n == 1:
        return x
    divide(x.shape[dim], n, f"dimension {dim} of the activation {tuple(x.shape)} "
                            f"reduce-scattered over {n} tensor-parallel ranks")
    rank_major = torch.stack(x.chunk(n, dim=dim))  # [n, ...]: chunk r goes to rank r
    out = torch.empty(rank_major.shape[1:], dtype=x.dtype, device=x.device)
    distributed.reduce_scatter_tensor(out.view(-1), rank_major.view(-1), group=group)
    return out


def _last(x: torch.Tensor) -> int:
    return x.dim() - 1


# ----------------------------------------------------------------------------- tensor regions


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stride, group):
        ctx.stride, ctx.group = stride, group
        return _keep_own_slice(x, _last(x), stride, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, _last(grad), ctx.stride, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stride, group):
        ctx.stride, ctx.group = stride, group
        return _all_gather(x, _last(x), stride, group)

    @staticmethod
    def backward(ctx, grad):
        return _keep_own_slice(grad, _last(grad), ctx.stride, ctx.group), None, None


def copy_to_model_parallel_region(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_model_parallel_region(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward (on a copy;
    ``x`` is untouched), identity backward."""
    return _ReduceFromRegion.apply(x, group)


def scatter_to_model_parallel_region(x: torch.Tensor, stride: int = 1, *,
                                     group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension (its ``stride`` blocks, as ``shard_of``);
    backward all-gathers the gradient."""
    return _ScatterToRegion.apply(x, stride, group)


def gather_from_model_parallel_region(x: torch.Tensor, stride: int = 1, *,
                                      group=None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension (interleaving ``stride`` blocks
    per rank, the inverse of ``shard_of``); backward keeps own slice."""
    return _GatherFromRegion.apply(x, stride, group)


# ----------------------------------------------------------------------------- sequence regions


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _keep_own_slice(x, dim, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, 1, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, 1, group)

    @staticmethod
    def backward(ctx, grad):
        # The gathered activation feeds a column-parallel layer, whose input gradient is a
        # partial sum on each rank: summing and re-splitting is one reduce-scatter.
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, 1, ctx.group), None, None


def scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int = SEQUENCE_DIM, *,
                                        group=None) -> torch.Tensor:
    """Keep this rank's slice of the sequence dimension; backward all-gathers the gradient."""
    return _ScatterToSequence.apply(x, dim, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, dim: int = SEQUENCE_DIM, *,
                                         group=None) -> torch.Tensor:
    """All-gather the sequence shards (forward); reduce-scatter the gradient (backward)."""
    return _GatherFromSequence.apply(x, dim, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int = SEQUENCE_DIM, *,
                                               group=None) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence slice (reduce-scatter); backward
    all-gathers the gradient."""
    return _ReduceScatterToSequence.apply(x, dim, group)
