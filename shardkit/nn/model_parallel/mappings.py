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
``gather_from_sequence_parallel_region``          all-gather            reduce-scatter (1)
``reduce_scatter_to_sequence_parallel_region``    reduce-scatter        all-gather
================================================  ====================  ====================

(1) keep own slice, no communication, with ``tensor_parallel_output_grad=False`` (Megatron-LM's
flag, for a gathered activation that feeds a computation replicated on every rank).

``stride`` (scatter/gather of the last dimension only) matches a strided weight split (see
:func:`~shardkit.nn.model_parallel.utils.shard_of`): rank ``r`` keeps blocks ``r, r + n, ...``
of ``stride * n``; the communication is the same as with ``stride=1``.

All-gather and reduce-scatter each put ``(n-1)/n·S`` on the wire, so the sequence-parallel
pair costs what one all-reduce does, while the activations between them are ``1/n`` the size.
The sequence dimension defaults to 1 (batch-first ``[batch, seq, hidden]``, shardkit's GPT).
Every collective goes through :mod:`shardkit.distributed` on the tensor-parallel group: the
``group`` argument (the layers pass the group they were built with, so they keep working after
:func:`~shardkit.nn.model_parallel.initialize.destroy_model_parallel`), else the current one.

Before its forward communicates or slices, each function but ``copy_to_model_parallel_region``
(an identity forward, which can refuse nothing) makes the tensor-parallel ranks agree on the
activation's shape and dtype and on ``dim`` / ``stride``
(:func:`~shardkit.nn.model_parallel.agreement.agree_on_input`), so that an activation of
another shape on one rank (another batch or sequence length), or a bad argument there, is a
``ValueError`` (or that rank's own error) on every rank, where gloo aborted the process, hung or
summed misaligned elements; this runs in the collective debug mode only
(``SHARDKIT_DEBUG_COLLECTIVES=1``). Cost there: one all-gather of 16 int64s per rank per call,
a control message that ``CommCounter`` does not count (a host synchronisation under NCCL); none
at size 1, none with the mode off, and none in backward (a gradient has its forward
activation's shape). The layers make that agreement (in the same mode) once per forward, on
their input, and then call these mappings' unchecked forms.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from shardkit import distributed
from shardkit.nn.model_parallel.agreement import agree_on_input, local_problem
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


def _alone(group) -> bool:
    """Whether the tensor-parallel group is this rank alone. Every mapping but the reduce (which
    returns a copy) is then the identity both ways and hands back ``x`` itself, outside any
    autograd function: in-place ops on the output work as at larger sizes (torch refuses them on
    an input that a custom function returned as it was). No communication."""
    return distributed.get_world_size(_group(group)) == 1


def _agree(what: str, x, problem: Optional[BaseException], group, **arguments) -> None:
    """Before a public mapping's forward communicates or slices: the ranks of ``group`` agree
    on ``x``'s shape and dtype and on ``arguments`` (``dim``, ``stride``), and each rank's local
    ``problem`` is raised on every rank (see
    :func:`~shardkit.nn.model_parallel.agreement.agree_on_input`: in the collective debug mode,
    one all-gather of 16 int64s per rank, not counted by ``CommCounter``). At size 1 it
    raises ``problem`` alone."""
    group = _group(group)
    agree_on_input(what, {**activation_facts(x), **arguments}, problem, group,
                   distributed.get_world_size(group))


def activation_facts(x) -> dict:
    """What the tensor-parallel ranks compare of an activation ``x`` before a collective: its
    shape and dtype (the type of anything but a tensor). Local."""
    if not isinstance(x, torch.Tensor):
        return {"input type": type(x).__name__}
    return {"input shape": tuple(x.shape), "input dtype": x.dtype}


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
    # [n, ...]: chunk r goes to rank r (one copy at most; none along a leading dimension)
    rank_major = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(rank_major.shape[1:], dtype=x.dtype, device=x.device)
    distributed.reduce_scatter_tensor(out.view(-1), rank_major.view(-1), group=group)
    return out


def _last(x: torch.Tensor) -> int:
    return x.dim() - 1


def _check_dim(what: str, x: torch.Tensor, dim) -> None:
    """Raise before any collective unless ``dim`` is an int dimension of ``x`` (a bool, such as
    Megatron-LM's positional ``tensor_parallel_output_grad``, or a process group passed in
    its place, is refused). No communication."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        keywords = "group= and tensor_parallel_output_grad=" if what.startswith("gather") \
            else "group="
        raise TypeError(f"{what}: dim={dim!r} ({type(dim).__name__}); it must be an int, the "
                        f"sequence dimension (pass {keywords} by keyword)")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim={dim} is not a dimension of the activation of shape "
                         f"{tuple(x.shape)}")


def _check_stride(what: str, stride) -> None:
    """Raise before any collective unless ``stride`` is an int >= 1 (``TypeError`` for a
    process group passed in its place). No communication."""
    if isinstance(stride, bool) or not isinstance(stride, numbers.Integral):
        raise TypeError(f"{what}: stride={stride!r} ({type(stride).__name__}); it must be an "
                        f"int >= 1 (pass group= by keyword)")
    if stride < 1:
        raise ValueError(f"{what}: stride={stride}; it must be an int >= 1")


# ----------------------------------------------------------------------------- tensor regions

# Note: each backward applies its conjugate function (copy <-> reduce, scatter <-> gather,
# sequence scatter <-> gather without the partial-sum flag, reduce-scatter <-> gather with it)
# rather than calling the collective directly. Under ``create_graph=True`` (double backward:
# gradient penalties, Hessian-vector products) the gradient is then itself differentiable, with
# the right communication in the second backward; a plain backward runs the same collectives.


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_private):
        ctx.group, ctx.grad_is_private = group, grad_is_private
        return x

    @staticmethod
    def backward(ctx, grad):
        # The incoming gradient may be shared: an add's backward hands the same tensor to both
        # of its inputs, so an all-reduce in place would change the other input's gradient too.
        # Only a layer whose own F.linear consumed the output (a fresh gradient) skips the copy.
        return _ReduceFromRegion.apply(grad, ctx.group, ctx.grad_is_private), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, x_is_private):
        ctx.group = group
        if x_is_private and x.is_contiguous():
            # a layer's own partial result, which nothing else reads: summed where it lies
            ctx.mark_dirty(x)
            return _all_reduce(x, group)
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return _CopyToRegion.apply(grad, ctx.group, False), None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stride, group):
        ctx.stride, ctx.group = stride, group
        return _keep_own_slice(x, _last(x), stride, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherFromRegion.apply(grad, ctx.stride, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stride, group):
        ctx.stride, ctx.group = stride, group
        return _all_gather(x, _last(x), stride, group)

    @staticmethod
    def backward(ctx, grad):
        return _ScatterToRegion.apply(grad, ctx.stride, ctx.group), None, None


def copy_to_model_parallel_region(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, all-reduce of the gradient backward
    (of a copy of it: the gradient that reaches the output may also be another tensor's)."""
    if _alone(group):
        return x
    return _CopyToRegion.apply(x, group, False)


def _copy_to_region_of_own_linear(x: torch.Tensor, group) -> torch.Tensor:
    """:func:`copy_to_model_parallel_region` for a layer that feeds the output only to its own
    ``F.linear``, whose input gradient is a fresh tensor: all-reduced in place, no copy."""
    if _alone(group):
        return x
    return _CopyToRegion.apply(x, group, True)


def reduce_from_model_parallel_region(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward (on a copy;
    ``x`` is untouched), identity backward. Before it, the ranks agree on ``x``'s shape and
    dtype (see the module docstring)."""
    _agree("reduce_from_model_parallel_region", x, None, group)
    return _ReduceFromRegion.apply(x, group, False)


def _reduce_from_region(x: torch.Tensor, group) -> torch.Tensor:
    """:func:`reduce_from_model_parallel_region` without the agreement, for a caller whose
    ranks already agreed on ``x``'s shape (a backward, whose shapes are its forward's)."""
    return _ReduceFromRegion.apply(x, group, False)


def _reduce_from_region_of_own_output(x: torch.Tensor, group) -> torch.Tensor:
    """:func:`reduce_from_model_parallel_region` for a layer's own partial result ``x`` (the
    output of its ``F.linear`` or ``F.embedding``, which their backward does not read and no
    one else holds): all-reduced in place and returned, no copy of the activation."""
    return _ReduceFromRegion.apply(x, group, True)


def scatter_to_model_parallel_region(x: torch.Tensor, stride: int = 1, *,
                                     group=None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension (its ``stride`` blocks, as ``shard_of``);
    backward all-gathers the gradient."""
    problem = local_problem(_check_stride, "scatter_to_model_parallel_region", stride)
    _agree("scatter_to_model_parallel_region", x, problem, group, stride=stride)
    return _scatter_to_region(x, stride, group)


def _scatter_to_region(x: torch.Tensor, stride: int, group) -> torch.Tensor:
    """:func:`scatter_to_model_parallel_region` for a layer that checked ``stride`` and whose
    ranks agreed on ``x``: no agreement here."""
    if _alone(group):
        return x
    return _ScatterToRegion.apply(x, stride, group)


def gather_from_model_parallel_region(x: torch.Tensor, stride: int = 1, *,
                                      group=None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dimension (interleaving ``stride`` blocks
    per rank, the inverse of ``shard_of``); backward keeps own slice."""
    problem = local_problem(_check_stride, "gather_from_model_parallel_region", stride)
    _agree("gather_from_model_parallel_region", x, problem, group, stride=stride)
    return _gather_from_region(x, stride, group)


def _gather_from_region(x: torch.Tensor, stride: int, group) -> torch.Tensor:
    """:func:`gather_from_model_parallel_region` for a layer that checked ``stride`` and whose
    ranks agreed on ``x``'s shape (its input's, or its own parameter's): no agreement here."""
    if _alone(group):
        return x
    return _GatherFromRegion.apply(x, stride, group)


# ----------------------------------------------------------------------------- sequence regions


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _keep_own_slice(x, dim, 1, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherFromSequence.apply(grad, ctx.dim, ctx.group, False), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, tensor_parallel_output_grad):
        ctx.dim, ctx.group = dim, group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _all_gather(x, dim, 1, group)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.tensor_parallel_output_grad:
            # the gathered activation fed a computation replicated on every rank: each rank
            # already holds the whole gradient, so it keeps its own slice
            return _ScatterToSequence.apply(grad, ctx.dim, ctx.group), None, None, None
        # The gathered activation feeds a column-parallel layer, whose input gradient is a
        # partial sum on each rank: summing and re-splitting is one reduce-scatter.
        return _ReduceScatterToSequence.apply(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _GatherFromSequence.apply(grad, ctx.dim, ctx.group, True), None, None


def scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int = SEQUENCE_DIM, *,
                                        group=None) -> torch.Tensor:
    """Keep this rank's slice of the sequence dimension; backward all-gathers the gradient."""
    what = "scatter_to_sequence_parallel_region"
    _agree(what, x, local_problem(_check_dim, what, x, dim), group, dim=dim)
    if _alone(group):
        return x
    return _ScatterToSequence.apply(x, dim, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, dim: int = SEQUENCE_DIM, *,
                                         group=None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence shards (forward); reduce-scatter the gradient (backward).

    ``tensor_parallel_output_grad`` (Megatron-LM's flag): ``True`` when the gathered activation
    feeds a tensor-parallel computation (a column-parallel layer), so each rank's gradient is a
    partial sum; ``False`` when it feeds one replicated on every rank (each rank's gradient is
    already whole): backward then keeps this rank's slice, with no communication."""
    what = "gather_from_sequence_parallel_region"
    problem = local_problem(_check_dim, what, x, dim) or local_problem(
        _check_output_grad_flag, tensor_parallel_output_grad)
    _agree(what, x, problem, group, dim=dim,
           tensor_parallel_output_grad=tensor_parallel_output_grad)
    return _gather_from_sequence_region(x, dim, group, tensor_parallel_output_grad)


def _check_output_grad_flag(tensor_parallel_output_grad) -> None:
    if not isinstance(tensor_parallel_output_grad, bool):
        raise TypeError(f"gather_from_sequence_parallel_region: tensor_parallel_output_grad="
                        f"{tensor_parallel_output_grad!r}; it must be a bool, True or False")


def _gather_from_sequence_region(x: torch.Tensor, dim: int, group,
                                 tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """:func:`gather_from_sequence_parallel_region` for a layer that checked ``dim`` and whose
    ranks agreed on ``x``: no agreement here."""
    if _alone(group):
        return x
    return _GatherFromSequence.apply(x, dim, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, dim: int = SEQUENCE_DIM, *,
                                               group=None) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence slice (reduce-scatter); backward
    all-gathers the gradient."""
    what = "reduce_scatter_to_sequence_parallel_region"
    _agree(what, x, local_problem(_check_dim, what, x, dim), group, dim=dim)
    return _reduce_scatter_to_sequence_region(x, dim, group)


def _reduce_scatter_to_sequence_region(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """:func:`reduce_scatter_to_sequence_parallel_region` for a layer that checked ``dim`` and
    whose ranks agreed on ``x``'s shape: no agreement here."""
    if _alone(group):
        return x
    return _ReduceScatterToSequence.apply(x, dim, group)
