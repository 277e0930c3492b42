"""Tensor-parallel and activation-checkpointing corners a Megatron / DeepSpeed user met.

One world of 4 gloo ranks (tensor-parallel size 2 x data-parallel size 2) and a few local checks:

- ``full_model_state_dict(engine.module)`` of a ZeRO stage-3 engine raised IndexError (the
  module's ``state_dict()`` holds DeepSpeed's empty placeholders); it now gives the unsplit
  weights, and ``load_full_model_state_dict(engine.module, ...)`` loads them.
- ``VocabParallelEmbedding(scale_grad_by_freq=True)`` was refused; it now matches
  ``nn.Embedding(scale_grad_by_freq=True)`` (each token's count over the whole batch).
- A double backward (``autograd.grad(..., create_graph=True)`` then ``backward``) through the
  tensor-parallel mappings failed (scatter/gather) or ran collectives autograd could not see;
  each backward is now its conjugate mapping, so the second backward matches one process.
- A reentrant activation checkpoint (DeepSpeed's ``checkpointing.checkpoint``, torch's
  ``use_reentrant=True``) around a ``skip_bias_add=True`` layer, or any region returning a
  parameter, recursed in backward without end.
- ``DeferredBatchNorm`` inside torch's own ``torch.utils.checkpoint`` tracked the recomputation
  as a second micro-batch (running statistics and ``num_batches_tracked`` wrong).

review

Review of 9c82084: ``is_recomputing()`` is True for torch's checkpoint recomputations only.

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

import shardkit
import shardkit.checkpointing as ds_checkpointing
from shardkit.nn import model_parallel as mp
from shardkit.nn.checkpoint import is_recomputing
from shardkit.nn.model_parallel import mappings
from shardkit.nn.model_parallel.full_state import full_model_state_dict, load_full_model_state_dict
from shardkit.nn.pipe.batchnorm import DeferredBatchNorm
from shardkit.testing import world_fixture

TP, WIDTH = 2, 8

world4 = world_fixture(4)


def _in_model_parallel(fn):
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)
    try:
        return fn()
    finally:
        mp.destroy_model_parallel()


def _maxdiff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((got[k] - want[k]).abs().max().item() for k in want)


# ----------------------------------------------------------------------- ZeRO-3 full state


def _tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(mp.ColumnParallelLinear(WIDTH, 2 * WIDTH, gather_output=False),
                         nn.GELU(), mp.RowParallelLinear(2 * WIDTH, WIDTH, input_is_parallel=True),
                         nn.Linear(WIDTH, 4))


def _zero3_engine_module_state() -> dict:
    model = _tp_model()
    before = full_model_state_dict(model)
    engine, *_ = shardkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    result = {"read": _maxdiff(full_model_state_dict(engine.module), before)}
    other = {key: value * 2 + 1 for key, value in before.items()}
    load_full_model_state_dict(engine.module, other)
    result["loaded"] = _maxdiff(full_model_state_dict(engine.wrapped), other)
    return result


def test_full_model_state_dict_of_a_zero3_engine_module_is_the_unsplit_model(world4):
    for rank, result in enumerate(world4.run(_in_model_parallel, _zero3_engine_module_state)):
        assert result == {"read": 0.0, "loaded": 0.0}, (rank, result)


# ----------------------------------------------------------------------- embedding frequency


def _embedding_scaled_by_frequency() -> dict:
    vocab, dim = 8 * TP, 3
    torch.manual_seed(0)
    layer = mp.VocabParallelEmbedding(vocab, dim, padding_idx=1, scale_grad_by_freq=True)
    ref = nn.Embedding(vocab, dim, padding_idx=1, scale_grad_by_freq=True)
    ref.load_state_dict(layer.full_state_dict())
    # the first row of each rank's range (local row 0) repeated, the padding row, other ranks'
    ids = torch.tensor([[0, 0, 8, 8, 8, 1], [3, 9, 15, 0, 1, 8]])
    upstream = torch.randn(2, 6, dim, generator=torch.Generator().manual_seed(1))
    out, want = layer(ids), ref(ids)
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    rows = slice(layer.vocab_start_index, layer.vocab_end_index)
    return {"output": (out - want).abs().max().item(),
            "grad": (layer.weight.grad - ref.weight.grad[rows]).abs().max().item()}


def test_vocab_parallel_embedding_scales_grads_by_whole_batch_frequency(world4):
    for rank, result in enumerate(world4.run(_in_model_parallel, _embedding_scaled_by_frequency)):
        assert result["output"] == 0.0, (rank, result)
        assert result["grad"] < 1e-6, (rank, result)


# ----------------------------------------------------------------------- double backward


def _region_functions() -> dict:
    """name: (tensor-parallel function of a replicated x, the same function in one process)."""
    rank = mp.get_model_parallel_rank()

    def scatter(x, stride=1):
        y = mappings.scatter_to_model_parallel_region(x, stride)
        return mappings.reduce_from_model_parallel_region((y ** 3).sum(-1))

    def copy_reduce(x):  # each rank weighs its copy differently; the sum is 3 x^3
        y = mappings.copy_to_model_parallel_region(x)
        return mappings.reduce_from_model_parallel_region(y ** 3 * (1 + rank))

    def gather(x):
        return mappings.gather_from_model_parallel_region(
            mappings.scatter_to_model_parallel_region(x) ** 3)

    def sequence(x):
        y = mappings.scatter_to_sequence_parallel_region(x, 0) ** 3
        return mappings.gather_from_sequence_parallel_region(y, 0,
                                                             tensor_parallel_output_grad=False)

    def reduce_scatter(x):
        y = mappings.copy_to_model_parallel_region(x) ** 3 * (1 + rank)
        return mappings.gather_from_sequence_parallel_region(
            mappings.reduce_scatter_to_sequence_parallel_region(y, 0), 0,
            tensor_parallel_output_grad=False)

    def cube_sums(x):
        return (x ** 3).sum(-1)

    return {"scatter": (scatter, cube_sums),
            "scatter_stride_2": (lambda x: scatter(x, 2), cube_sums),
            "copy_reduce": (copy_reduce, lambda x: 3 * x ** 3),
            "gather": (gather, lambda x: x ** 3),
            "sequence": (sequence, lambda x: x ** 3),
            "reduce_scatter": (reduce_scatter, lambda x: 3 * x ** 3)}


def _second_order_grad(fn, x0: torch.Tensor) -> torch.Tensor:
    """d/dx of sum((d sum(fn(x)) / dx)^2): a gradient penalty's backward."""
    x = x0.clone().requires_grad_()
    (grad,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
    (grad ** 2).sum().backward()
    return x.grad


def _double_backward_through_mappings() -> dict:
    x0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    result = {}
    for name, (parallel, single) in _region_functions().items():
        try:
            got, want = _second_order_grad(parallel, x0), _second_order_grad(single, x0)
            result[name] = ((got - want).abs().max() / want.abs().max()).item()
        except RuntimeError as error:
            result[name] = str(error)[:200]
    return result


def test_double_backward_through_the_mappings_matches_one_process(world4):
    for rank, result in enumerate(world4.run(_in_model_parallel,
                                             _double_backward_through_mappings)):
        for name, error in result.items():
            assert isinstance(error, float) and error < 1e-6, (rank, name, error)


# ----------------------------------------------------------------------- reentrant checkpoints


def _skip_bias_layers_under_reentrant_checkpoints() -> dict:
    torch.manual_seed(0)
    layers = {"row": mp.RowParallelLinear(WIDTH, 4, skip_bias_add=True),
              "column": mp.ColumnParallelLinear(4, WIDTH, skip_bias_add=True,
                                                gather_output=False),
              "column_gathered": mp.ColumnParallelLinear(4, WIDTH, skip_bias_add=True,
                                                         gather_output=True)}
    checkpoints = {
        "deepspeed": ds_checkpointing.checkpoint,
        "torch_reentrant": lambda fn, x: torch_checkpoint(fn, x, use_reentrant=True)}
    result = {}
    for name, layer in layers.items():
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
        want = _skip_bias_grads(layer, x, lambda fn, inp: fn(inp))
        for how, checkpoint in checkpoints.items():
            got = _skip_bias_grads(layer, x, checkpoint)
            result[(name, how)] = max((g - w).abs().max().item() for g, w in zip(got, want))
    return result


def _skip_bias_grads(layer, x, checkpoint) -> list:
    layer.zero_grad()
    y, bias = checkpoint(layer, x.clone().requires_grad_())
    ((y + bias) ** 2).sum().backward()
    assert layer.bias.grad_fn is None  # the parameter stays a leaf
    return [p.grad.clone() for p in layer.parameters()]


def test_reentrant_checkpoints_around_skip_bias_add_layers_match_plain_grads(world4):
    for rank, result in enumerate(world4.run(_in_model_parallel,
                                             _skip_bias_layers_under_reentrant_checkpoints)):
        assert result and max(result.values()) < 1e-6, (rank, result)


def test_deepspeed_checkpoint_of_a_function_returning_a_parameter():
    torch.manual_seed(0)
    linear = nn.Linear(3, 3)
    scale = nn.Parameter(torch.tensor([2.0, 3.0, 4.0]))
    x = torch.randn(2, 3, requires_grad=True)

    def grads(run):
        linear.zero_grad()
        scale.grad = None
        y, s = run(lambda inp: (linear(inp), scale), x)
        (y * s).pow(2).sum().backward()
        return [p.grad.clone() for p in (*linear.parameters(), scale)]

    want = grads(lambda fn, inp: fn(inp))
    got = grads(ds_checkpointing.checkpoint)
    assert scale.grad_fn is None
    assert all(torch.allclose(g, w) for g, w in zip(got, want)), (got, want)


# ----------------------------------------------------------------------- deferred batch norm


@pytest.mark.parametrize("reentrant", [False, True])
def test_deferred_batch_norm_in_torch_checkpoint_tracks_the_first_forward_only(reentrant):
    torch.manual_seed(0)
    deferred, ref = DeferredBatchNorm(3, chunks=2), nn.BatchNorm1d(3)
    micro_batches = [torch.randn(4, 3, requires_grad=True) for _ in range(2)]
    for x in micro_batches:
        torch_checkpoint(deferred, x, use_reentrant=reentrant).sum().backward()
    ref(torch.cat([x.detach() for x in micro_batches]))
    assert deferred.num_batches_tracked.item() == 1
    assert torch.allclose(deferred.running_mean, ref.running_mean, atol=1e-6)
    assert torch.allclose(deferred.running_var, ref.running_var, atol=1e-6)


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
