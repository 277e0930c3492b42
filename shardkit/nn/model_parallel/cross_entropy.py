"""Cross-entropy over logits split along the vocabulary, without gathering them.

Each tensor-parallel rank holds logits for ``V/n`` words (the output of a
``ColumnParallelLinear(d, V, gather_output=False)``). The loss needs, per token, the maximum
logit, the sum of exponentials and the target's logit; each is a reduction over the vocabulary,
so it is computed on the shard and combined across ranks:

- one all-reduce (max) of ``[tokens]`` floats,
- one all-reduce (sum) of ``[2, tokens]`` floats (sum of exponentials and target logit together).

Memory: the shard's softmax is kept for backward (``tokens * V/n`` floats, the size of the
logits shard); the full ``tokens * V`` logits never exist. Backward needs no communication:
``d loss / d logits = softmax - one_hot(target)``, restricted to the shard.
"""

from __future__ import annotations

import torch

from shardkit import distributed
from shardkit.nn.model_parallel.initialize import (
    get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size)
from shardkit.nn.model_parallel.utils import check_indices

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        group = get_model_parallel_group()
        ctx.logits_dtype = logits.dtype
        per_rank = logits.shape[-1]
        start = get_model_parallel_rank() * per_rank
        logits = logits.float()

        row_max = logits.max(dim=-1).values
        distributed.all_reduce(row_max, op=distributed.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)

        local_target = target - start
        ours = (local_target >= 0) & (local_target < per_rank)
        safe_target = local_target.masked_fill(~ours, 0)
        target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~ours, 0.0)

        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        distributed.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]

        ignored = target == ignore_index
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe_target, ours & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_target, subtract_one, ignored = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, safe_target.unsqueeze(-1),
                          -subtract_one.to(grad.dtype).unsqueeze(-1))
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy of vocabulary-split logits; same values and gradients as
    ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), reduction="none")``.

    Args:
        vocab_parallel_logits: ``[..., V/n]``, this rank's slice of the vocabulary (rank ``r``
            holds words ``[r*V/n, (r+1)*V/n)``, as :class:`ColumnParallelLinear` splits them).
        target: ``[...]`` word indices in ``[0, V)`` of any integer dtype (the same on every
            tensor-parallel rank); any other value but ``ignore_index`` raises ``IndexError``
            (on an accelerator, a device-side assert that does not synchronise with the host).
        ignore_index: target value whose loss and gradient are zero (as ``F.cross_entropy``).

    Returns the loss per token, shape ``[...]``, in fp32 (take ``.mean()`` yourself; with
    ignored tokens, divide by the number of kept ones). Communication: two all-reduces over
    the tensor-parallel group of ``3 * tokens`` floats in all; no gathering of logits.
    """
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must "
                         f"equal the logits' shape without the vocabulary dimension, "
                         f"{tuple(vocab_parallel_logits.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"vocab_parallel_cross_entropy: target dtype {target.dtype} must be an "
                        f"integer type (word indices)")
    target = target.long()  # any integer type (uint8, int16, int32 token ids); no-op for int64
    vocab = get_model_parallel_world_size() * vocab_parallel_logits.shape[-1]
    # before the collectives: a bad target would otherwise just match no rank's slice
    check_indices(target, vocab, "vocab_parallel_cross_entropy: target", "V", ignore_index)
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, ignore_index)
