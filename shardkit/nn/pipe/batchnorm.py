"""Deferred batch norm: running statistics updated once per mini-batch, as if it were unsplit.

Inside a :class:`~shardkit.nn.Pipe` each micro-batch is normalised with its own statistics (as
GPipe does), but the running mean and variance must not move once per micro-batch. A
:class:`DeferredBatchNorm` adds up the sums and squared sums of every micro-batch's first forward
(recomputations are skipped) and :meth:`DeferredBatchNorm.commit` folds them into the running
statistics once, with the batch's mean and unbiased variance, so they equal what an unsplit
``BatchNorm`` would hold. Memory: two fp64 vectors of ``num_features``. Communication: none.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from shardkit.nn.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm", "commit_deferred_batch_norms",
           "discard_deferred_batch_norms"]


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm (any dimensionality) whose running statistics move once per :meth:`commit`.

    ``chunks`` (FairScale's argument): when given, :meth:`commit` also runs by itself once
    ``chunks`` micro-batches have been tracked, so the layer works outside a
    :class:`~shardkit.nn.pipe.Pipe` (feed it a batch's ``chunks`` micro-batches in turn). ``None``:
    only explicit commits (what ``Pipe`` does after each mini-batch, however many micro-batches it
    ran).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 chunks: Optional[int] = None):
        if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool)
                                   or chunks < 1):
            raise ValueError(f"DeferredBatchNorm(chunks={chunks!r}): must be a positive int "
                             f"(micro-batches per mini-batch) or None (commit explicitly)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        self.register_buffer("sum", torch.zeros(num_features, dtype=torch.float64),
                             persistent=False)
        self.register_buffer("sum_squares", torch.zeros(num_features, dtype=torch.float64),
                             persistent=False)
        self.count = 0  # samples (times spatial positions) tracked since the last commit
        self.tracked_chunks = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm: expected an input with at least 2 dims "
                             f"(batch, channels, ...), got shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _track(self, input: torch.Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.detach().to(torch.float64)
        self.sum += x.sum(dims)
        self.sum_squares += x.square().sum(dims)
        self.count += input.numel() // input.shape[1]
        self.tracked_chunks += 1
        if self.chunks is not None and self.tracked_chunks >= self.chunks:
            self.commit()

    @torch.no_grad()
    def commit(self) -> None:
        """Fold the tracked micro-batches into the running statistics and start afresh. A
        mini-batch of empty micro-batches only counts in ``num_batches_tracked``, as torch's
        BatchNorm does with an empty batch."""
        if self.tracked_chunks == 0:
            return
        if self.count == 0:
            self.num_batches_tracked += 1
            self.discard()
            return
        mean = self.sum / self.count
        var = (self.sum_squares / self.count - mean.square()).clamp_min(0)
        unbiased = var * (self.count / max(self.count - 1, 1))
        self.num_batches_tracked += 1
        factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                  else self.momentum)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        self.discard()

    @torch.no_grad()
    def discard(self) -> None:
        """Forget the micro-batches tracked since the last commit (a mini-batch whose forward
        failed part-way must not leak into the next one's statistics)."""
        self.sum.zero_()
        self.sum_squares.zero_()
        self.count = 0
        self.tracked_chunks = 0

    @classmethod
    def from_batch_norm(cls, bn: _BatchNorm, chunks: Optional[int] = None) -> "DeferredBatchNorm":
        """A deferred batch norm in place of ``bn``, holding ``bn``'s own parameters and
        running statistics (the same tensors, as FairScale's conversion does): their dtype,
        device and ``requires_grad`` (a frozen BatchNorm stays frozen) are kept, and an
        optimizer built over the model before the conversion still updates them. A BatchNorm
        without running statistics, an uninitialised lazy one, or a subclass with parameters,
        buffers or submodules of its own (they would be dropped) is a ``ValueError``."""
        name = type(bn).__name__
        if not bn.track_running_stats or bn.running_mean is None:
            raise ValueError(f"DeferredBatchNorm.from_batch_norm({name}): it has no running "
                             f"statistics (track_running_stats=False); there is nothing to defer")
        if isinstance(bn, nn.modules.lazy.LazyModuleMixin) and bn.has_uninitialized_params():
            raise ValueError(f"DeferredBatchNorm.from_batch_norm({name}): its parameters are "
                             f"not initialised yet; run one forward before converting")
        own = {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"} | (
            {"sum", "sum_squares"} if isinstance(bn, DeferredBatchNorm) else set())
        extra = sorted((set(bn._parameters) | set(bn._buffers)) - own) + sorted(bn._modules)
        if extra:
            raise ValueError(f"DeferredBatchNorm.from_batch_norm({name}): it holds {extra} "
                             f"besides a BatchNorm's parameters and buffers, which a "
                             f"DeferredBatchNorm would drop; convert it yourself or leave "
                             f"deferred_batch_norm off")
        deferred = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, chunks)
        if bn.affine:
            deferred.weight, deferred.bias = bn.weight, bn.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(deferred, name, getattr(bn, name))
        device = bn.running_mean.device
        deferred.sum, deferred.sum_squares = deferred.sum.to(device), \
            deferred.sum_squares.to(device)
        return deferred.train(bn.training)

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """FairScale's spelling of :func:`convert_deferred_batch_norm`, with its default
        ``chunks=1`` (every call is a whole mini-batch)."""
        return convert_deferred_batch_norm(module, chunks)


def convert_deferred_batch_norm(module: nn.Module, chunks: Optional[int] = None) -> nn.Module:
    """Replace, in place, every BatchNorm with running statistics under ``module`` by a
    :class:`DeferredBatchNorm` committing every ``chunks`` micro-batches (``None``: explicitly);
    returns ``module`` (or the replacement if it is one itself). A deferred batch norm with
    another ``chunks`` is replaced too; one with the same is kept."""
    if isinstance(module, _BatchNorm) and module.track_running_stats and not (
            isinstance(module, DeferredBatchNorm) and module.chunks == chunks):
        return DeferredBatchNorm.from_batch_norm(module, chunks)
    for name, child in list(module.named_children()):
        converted = convert_deferred_batch_norm(child, chunks)
        if converted is not child:
            setattr(module, name, converted)
    return module


def commit_deferred_batch_norms(module: nn.Module) -> None:
    """Call :meth:`DeferredBatchNorm.commit` on every deferred batch norm under ``module``."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit()


def discard_deferred_batch_norms(module: nn.Module) -> None:
    """Call :meth:`DeferredBatchNorm.discard` on every deferred batch norm under ``module``."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.discard()
