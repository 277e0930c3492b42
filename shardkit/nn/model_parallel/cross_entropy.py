"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each tensor-parallel rank holds logits for ``V/n`` words (the output of a
``ColumnParallelLinear(d, V, gather_output=False)``). The loss needs, per token, the maximum
logit, the sum of exponentials and the target's logit; each is a reduction over the vocabulary,
so it is computed on the shard and combined across ranks:

- one all-reduce (max) of ``[tokens]`` floats,
- one all-reduce (sum) of ``[2, tokens]`` floats (sum of exponentials and target logit together).

Memory: forward allocates one fp32 buffer of the logits shard's size (``tokens * V/n``
floats; fp64 for fp64 logits), which becomes the softmax kept for backward; backward adds one
more for the gradient (and its fp16/bf16 copy for such logits). The full ``tokens * V`` logits
never exist. Backward needs no communication:
``d loss / d logits = softmax - one_hot(target)``, restricted to the shard.

Under ``create_graph=True`` (Hessian-vector products, gradient penalties) that gradient is
itself differentiable, as ``F.cross_entropy``'s: a second backward through it costs one
all-reduce of one float per token (the softmax's Jacobian needs a sum over the vocabulary)
and a few more buffers of the shard's size.
"""

from __future__ import annotations

import numbers

import torch

from shardkit import distributed
from shardkit.nn.model_parallel.agreement import agree_on_input
from shardkit.nn.model_parallel.initialize import get_model_parallel_group
from shardkit.nn.model_parallel.mappings import _reduce_from_region, copy_to_model_parallel_region
from shardkit.nn.model_parallel.utils import check_indices

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Returns ``(loss, softmax)``. The softmax (this rank's slice) is the buffer backward needs
    anyway; as an output it anchors the gradient's graph under ``create_graph=True``: the
    gradient is written in terms of it, so a second backward comes back here through it."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, group):
        ctx.set_materialize_grads(False)  # None, not zeros, for an output that got no gradient
        ctx.logits_dtype, ctx.group = logits.dtype, group
        per_rank = logits.shape[-1]
        vocab = per_rank * distributed.get_world_size(group)
        start = distributed.get_rank(group) * per_rank
        # One working buffer of the shard's size, in fp32 (fp16/bf16 promoted; float64 stays
        # float64, as F.cross_entropy and gradcheck need), that becomes the shifted logits, then
        # their exponentials, then the softmax saved for backward: the caller's logits are left
        # untouched and no second shard-sized buffer is made.
        work = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)

        row_max = work.max(dim=-1).values
        distributed.all_reduce(row_max, op=distributed.ReduceOp.MAX, group=group)
        shifted = work.sub_(row_max.unsqueeze(-1))

        local_target = target - start
        ours = (local_target >= 0) & (local_target < per_rank)
        safe_target = local_target.masked_fill(~ours, 0)
        target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~ours, 0.0)
        # the smoothed term needs the sum of the log-probabilities too (before exp_ below)
        shifted_sum = shifted.sum(dim=-1) if label_smoothing else None

        exp = shifted.exp_()
        parts = [exp.sum(dim=-1), target_logit]
        if label_smoothing:
            parts.append(shifted_sum)
        sums = torch.stack(parts)
        distributed.all_reduce(sums, group=group)
        log_sum_exp = sums[0].log()
        loss = log_sum_exp - sums[1]
        if label_smoothing:
            mean_nll = log_sum_exp - sums[2] / vocab  # -mean over the vocabulary of log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_nll
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.label_smoothing, ctx.vocab = label_smoothing, vocab
        ctx.save_for_backward(softmax, safe_target, ours & ~ignored, ignored)
        return loss, softmax

    @staticmethod
    def backward(ctx, grad_loss, grad_softmax):
        softmax, safe_target, subtract_one, ignored = ctx.saved_tensors
        if grad_loss is None and grad_softmax is None:  # neither output reached the loss
            return None, None, None, None, None
        if torch.is_grad_enabled() or grad_softmax is not None:
            grad = _differentiable_logits_grad(ctx, softmax, safe_target, subtract_one, ignored,
                                               grad_loss, grad_softmax)
        else:
            grad = _logits_grad(ctx, softmax, safe_target, subtract_one, ignored, grad_loss)
        return grad.to(ctx.logits_dtype), None, None, None, None


def _logits_grad(ctx, softmax, safe_target, subtract_one, ignored, grad_loss):
    """The gradient of the logits slice from the loss's, in place on one new buffer (a plain
    backward). No communication."""
    smoothing = ctx.label_smoothing
    # d loss / d logit_j = p_j - (1 - s) [j = target] - s / V
    grad = softmax - smoothing / ctx.vocab if smoothing else softmax.clone()
    grad.scatter_add_(-1, safe_target.unsqueeze(-1),
                      -(1.0 - smoothing) * subtract_one.to(grad.dtype).unsqueeze(-1))
    grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
    grad.mul_(grad_loss.unsqueeze(-1))
    return grad


def _differentiable_logits_grad(ctx, softmax, safe_target, subtract_one, ignored, grad_loss,
                                grad_softmax):
    """The gradient of the logits slice under ``create_graph=True`` (double backward: Hessian-
    vector products, gradient penalties), out of place so that it is itself differentiable, and
    in a second backward (``grad_softmax``: what reached the softmax output) the softmax's own
    Jacobian: ``p_k (u_k - sum_j u_j p_j)`` over the whole vocabulary, one all-reduce of one
    float per token over the tensor-parallel group (differentiable too, through the mappings).
    Memory: a few buffers of the slice's size."""
    grad = None
    if grad_loss is not None:
        # grad_loss is the same on every rank (the loss is); used by this rank's slice only
        grad_loss = copy_to_model_parallel_region(grad_loss, group=ctx.group)
        smoothing = ctx.label_smoothing
        # _logits_grad's arithmetic in its order (the same bits as a plain backward), out of
        # place where the graph needs it: two buffers of the slice's size at a time
        d_loss = (softmax - smoothing / ctx.vocab if smoothing else softmax).scatter_add(
            -1, safe_target.unsqueeze(-1),
            -(1.0 - smoothing) * subtract_one.to(softmax.dtype).unsqueeze(-1))
        d_loss.masked_fill_(ignored.unsqueeze(-1), 0.0)  # its backward reads only the mask
        grad = d_loss * grad_loss.unsqueeze(-1)
    if grad_softmax is not None:
        local = (grad_softmax * softmax).sum(dim=-1)
        whole = _reduce_from_region(local, ctx.group)  # the forward's ranks agreed on shapes
        whole = copy_to_model_parallel_region(whole, group=ctx.group)
        through_softmax = softmax * (grad_softmax - whole.unsqueeze(-1))
        grad = through_softmax if grad is None else grad + through_softmax
    return grad


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 ignore_index: int = -100, *, label_smoothing: float = 0.0,
                                 group=None) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-split logits; same values and gradients as
    ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), reduction="none",
    ignore_index=ignore_index, label_smoothing=label_smoothing)``, second derivatives
    (``create_graph=True``) included.

    Args:
        vocab_parallel_logits: ``[..., V/n]``, this rank's slice of the vocabulary (rank ``r``
            holds words ``[r*V/n, (r+1)*V/n)``, as
            :class:`~shardkit.nn.model_parallel.ColumnParallelLinear` splits them).
        target: ``[...]`` word indices in ``[0, V)`` of any integer dtype (the same on every
            tensor-parallel rank); any other value but ``ignore_index`` raises ``IndexError``
            (on an accelerator, a device-side assert that does not synchronise with the host).
        ignore_index: target value (an int) whose loss and gradient are zero.
        label_smoothing: in ``[0, 1]``, as ``F.cross_entropy`` (Megatron-core's third argument;
            keyword-only here).
        group: the tensor-parallel group the logits are split over: the producing layer's
            ``tp_group`` (default: the current :func:`get_model_parallel_group`; pass the
            layer's when a model of another tensor-parallel size was set up since).

    Returns the loss per token, shape ``[...]``, in fp32, or float64 for float64 logits (the
    dtype it is computed in; take ``.mean()`` yourself; with ignored tokens, divide by the
    number of kept ones). Communication: two all-reduces over
    the tensor-parallel group of ``3 * tokens`` floats in all (``4 * tokens`` with label
    smoothing); no gathering of logits. Before them, the tensor-parallel ranks agree on the
    logits' and the target's shapes, the logits' dtype, ``ignore_index`` and
    ``label_smoothing`` in the collective debug mode (``SHARDKIT_DEBUG_COLLECTIVES=1``: one
    all-gather of 16 int64s per rank, not counted by ``CommCounter``; a host synchronisation
    under NCCL): logits or targets of another shape on one rank (another batch, another slice
    of the vocabulary), or an argument refused on one rank, raise a ``ValueError`` (or that
    rank's own error) on every rank, where gloo hung. With the mode off, a local refusal is
    this rank's alone and nothing more is exchanged.
    """
    group = get_model_parallel_group() if group is None else group
    if distributed.get_rank(group) < 0:
        raise ValueError(f"vocab_parallel_cross_entropy(group=...): global rank "
                         f"{distributed.get_rank()} is not in the group; pass the "
                         f"tensor-parallel group of the layer that made the logits (its "
                         f"tp_group)")
    problem = None
    try:
        _check_arguments(vocab_parallel_logits, target, ignore_index, label_smoothing)
        vocab = distributed.get_world_size(group) * vocab_parallel_logits.shape[-1]
        # any integer type (uint8, int16, int32 token ids); no-op for int64
        words = target.long()
        # before the collectives: a bad target would otherwise just match no rank's slice
        check_indices(words, vocab, "vocab_parallel_cross_entropy: target", "V", ignore_index)
    except Exception as error:  # noqa: BLE001 - raised on every rank, after the agreement
        problem = error
    agree_on_input("vocab_parallel_cross_entropy", _facts(vocab_parallel_logits, target,
                                                          ignore_index, label_smoothing),
                   problem, group, distributed.get_world_size(group))
    target = words
    loss, _ = _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, int(ignore_index),
                                               float(label_smoothing), group)
    return loss


def _facts(logits, target, ignore_index, label_smoothing) -> dict:
    """What the tensor-parallel ranks compare before the loss's all-reduces. Local."""
    def shape(t):
        return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
    return {"vocab_parallel_logits shape": shape(logits), "target shape": shape(target),
            "logits dtype": getattr(logits, "dtype", None), "ignore_index": ignore_index,
            "label_smoothing": label_smoothing}


def _check_arguments(logits, target, ignore_index, label_smoothing) -> None:
    """Clear errors for arguments of the wrong shape or type; no communication."""
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must "
                         f"equal the logits' shape without the vocabulary dimension, "
                         f"{tuple(logits.shape[:-1])}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"vocab_parallel_cross_entropy: logits dtype {logits.dtype} must be a "
                        f"floating-point type (float32, bfloat16, float16)")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"vocab_parallel_cross_entropy: target dtype {target.dtype} must be an "
                        f"integer type (word indices)")
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"vocab_parallel_cross_entropy(ignore_index={ignore_index!r}): must be an "
                        f"int (a word index); label smoothing is the keyword argument "
                        f"label_smoothing=")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) or \
            not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy(label_smoothing={label_smoothing!r}): "
                         f"must be a number in [0, 1]")
