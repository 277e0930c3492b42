"""Review of 9c82084: ``is_recomputing()`` is True for torch's checkpoint recomputations only.

9c82084 made ``is_recomputing()`` True for every forward that runs during an autograd backward
pass, so that ``DeferredBatchNorm`` inside ``torch.utils.checkpoint`` tracks the first forward
only. A forward that runs in a backward without being a recomputation (a model called in a
gradient hook, or in a custom function's backward, as implicit-gradient models do) then counted
as a recomputation too: ``DeferredBatchNorm`` skipped it where torch's BatchNorm tracks it.
Local checks, no world.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardkit.nn.checkpoint import is_recomputing
from shardkit.nn.pipe.batchnorm import DeferredBatchNorm

FEATURES = 3


def _batch_norms() -> tuple:
    """torch's BatchNorm and a DeferredBatchNorm committing every forward: same statistics."""
    return nn.BatchNorm1d(FEATURES), DeferredBatchNorm(FEATURES, chunks=1)


def _assert_same_running_stats(torch_bn: nn.Module, deferred: nn.Module) -> None:
    assert deferred.num_batches_tracked.item() == torch_bn.num_batches_tracked.item() == 1
    torch.testing.assert_close(deferred.running_mean, torch_bn.running_mean)
    torch.testing.assert_close(deferred.running_var, torch_bn.running_var)


def _forward_in_a_gradient_hook(model: nn.Module, batch: torch.Tensor) -> list:
    """Backward through a leaf whose gradient hook runs ``model`` on ``batch``; the values of
    ``is_recomputing()`` seen in the hook."""
    seen = []

    def hook(grad):
        seen.append(is_recomputing())
        model(batch)
        return grad

    x = torch.randn(4, FEATURES, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    return seen


def test_forward_in_a_gradient_hook_is_not_a_recomputation():
    torch_bn, deferred = _batch_norms()
    batch = torch.randn(4, FEATURES) + 5
    assert _forward_in_a_gradient_hook(torch_bn, batch) == [False]
    assert _forward_in_a_gradient_hook(deferred, batch) == [False]
    _assert_same_running_stats(torch_bn, deferred)


class _GradientThroughModel(torch.autograd.Function):
    """Identity forward; the backward returns the gradient of ``model(grad).sum()``, a model
    run in a backward as implicit-gradient (DEQ-style) layers do."""

    @staticmethod
    def forward(ctx, x, model):
        ctx.model = model
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            z = grad.detach().requires_grad_()
            (dz,) = torch.autograd.grad(ctx.model(z + 3).square().sum(), z)
        return dz, None


def test_forward_in_a_custom_functions_backward_updates_running_stats_as_torch():
    torch_bn, deferred = _batch_norms()
    grads = []
    for model in (torch_bn, deferred):
        torch.manual_seed(0)
        x = torch.randn(4, FEATURES, requires_grad=True)
        (_GradientThroughModel.apply(x, model) * torch.randn(4, FEATURES)).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0])
    _assert_same_running_stats(torch_bn, deferred)


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_recomputation_is_still_one(reentrant):
    seen = []

    def region(x):
        seen.append(is_recomputing())
        return x.sin() * 2

    x = torch.randn(3, requires_grad=True)
    torch_checkpoint(region, x, use_reentrant=reentrant).sum().backward()
    assert seen == [False, True]
