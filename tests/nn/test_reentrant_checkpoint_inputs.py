"""Tensor-parallel activation checkpointing found wrong by a DeepSpeed / Megatron user, in one
world of 2 gloo ranks (tensor-parallel size 2).

- ``shardkit.checkpointing.checkpoint`` (DeepSpeed's reentrant ``checkpointing.checkpoint``)
  around a block whose tensor arguments do not require grad (the first block fed the raw batch
  or a frozen embedding's output) returned outputs that did not require grad: the loss
  backward then skipped the region and the block's parameters got no gradient, silently (no
  error, no warning; torch's reentrant checkpoint at least warns). The outputs now require grad
  and the parameters get the gradients of the run without checkpointing, the dropout masks of
  the tensor-parallel RNG stream replayed, with ``partition_activations`` too.
- The same checkpoint given a tensor that requires grad inside a list, tuple or dict argument
  (``checkpoint(block, [hidden, residual])``, ``checkpoint(block, batch={"h": hidden})``)
  had no autograd edge to it: its gradient from the region was lost and the region's
  parameters got none, silently. Such tensors now get the plain call's gradients.

From a review:

The reentrant ``shardkit.checkpointing.checkpoint``: containers held twice, frozen regions.

- A list or dict holding a tensor that requires grad, given to the region in two places
  (``checkpoint(f, batch, batch)``, an argument and a keyword, one inner list under two keys,
  a list holding itself) was walked once: the recomputation read the caller's tensor through
  the second place and ran the graph before the region inside the checkpoint's backward, so
  the caller's backward failed ("Trying to backward through the graph a second time"). Every
  place now reads the recomputation's leaf, and the places still hold one object.
- A region fed tensors that require no grad got an "anchor" making its outputs require grad,
  also when nothing in it is trainable (a frozen backbone fed the raw batch): each such region
  kept its arguments until the backward and was recomputed there for no gradient, where the
  plain call keeps nothing. Such a region now keeps nothing and its outputs require no grad.
"""

import gc
import weakref
from collections import namedtuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit.checkpointing as ds_checkpointing
from shardkit.nn import model_parallel as mp
from shardkit.testing import world_fixture

TP = 2
WIDTH = 8

world2 = world_fixture(TP)


def _setup() -> None:
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)


class _TensorParallelBlock(nn.Module):
    """LayerNorm, column- then row-parallel linear, dropout on the split activation (the
    model-parallel stream) and on the replicated output (the default stream)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = mp.ColumnParallelLinear(WIDTH, 4 * WIDTH, gather_output=False)
        self.out = mp.RowParallelLinear(4 * WIDTH, WIDTH, input_is_parallel=True)

    def forward(self, x, scale=1.0):
        hidden = F.gelu(self.fc(self.norm(x)))
        with mp.get_model_parallel_rng_tracker().fork():
            hidden = F.dropout(hidden, 0.5)
        return F.dropout(self.out(hidden), 0.25) * scale


def _gradients_of_a_block_fed_the_raw_batch(checkpointed: bool, options: dict) -> dict:
    """One backward through two blocks, the first fed a batch that requires no grad and
    checkpointed when ``checkpointed``, the second plain (so the loss requires grad either
    way); the blocks' parameter gradients and whether the checkpointed output required grad."""
    _setup()
    torch.manual_seed(0)
    blocks = nn.ModuleList([_TensorParallelBlock() for _ in range(2)])
    ds_checkpointing.configure(None, **options)
    mp.model_parallel_manual_seed(5)
    torch.manual_seed(1)
    hidden = torch.randn(3, 4, WIDTH)  # the raw batch: requires no grad
    required = []
    if checkpointed:
        hidden = ds_checkpointing.checkpoint(blocks[0], hidden, scale=2.0)
        required.append(hidden.requires_grad)
    else:
        hidden = blocks[0](hidden, scale=2.0)
    blocks[1](hidden).square().sum().backward()
    ds_checkpointing.configure(None)
    return {"required": required,
            "grads": {name: None if p.grad is None else p.grad.clone()
                      for name, p in blocks.named_parameters()}}


def _compare_with_plain_run(options: dict) -> dict:
    plain = _gradients_of_a_block_fed_the_raw_batch(False, options)
    checkpointed = _gradients_of_a_block_fed_the_raw_batch(True, options)
    missing = sorted(name for name, grad in checkpointed["grads"].items() if grad is None)
    errors = {name: (grad - plain["grads"][name]).abs().max().item()
              for name, grad in checkpointed["grads"].items() if grad is not None}
    return {"required": checkpointed["required"], "missing": missing, "errors": errors}


@pytest.mark.parametrize("options", [{}, {"partition_activations": True},
                                     {"partition_activations": True, "checkpoint_in_cpu": True}],
                         ids=["plain", "partitioned", "partitioned-cpu"])
def test_reentrant_checkpoint_of_a_block_fed_tensors_without_grad_trains_its_parameters(
        world2, options):
    for result in world2.run(_compare_with_plain_run, options):
        assert result["required"] == [True]
        assert result["missing"] == []  # was: every parameter of the first block, silently
        assert max(result["errors"].values()) <= 1e-6, result["errors"]


def test_reentrant_checkpoint_without_grad_mode_or_trainable_parameters():
    """Without grad mode nothing requires grad; a frozen region's outputs require grad but
    its backward hands nothing to the frozen parameters (as without checkpointing)."""
    layer = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(2, WIDTH)
    with torch.no_grad():
        assert not ds_checkpointing.checkpoint(layer, x).requires_grad
    layer.requires_grad_(False)
    head = nn.Linear(WIDTH, 1)
    head(ds_checkpointing.checkpoint(layer, x)).sum().backward()
    assert layer.weight.grad is None and head.weight.grad is not None


Pair = namedtuple("Pair", "hidden residual")


def _region_reading_containers(layer: nn.Module):
    """A region whose tensors come inside a list, a named tuple and a dict keyword."""
    def region(items, pair, *, batch):
        return layer(items[0]) * batch["scale"] + pair.residual.tanh() + pair.hidden
    return region


def _nested_tensor_gradients(first: nn.Module, layer: nn.Module, checkpoint) -> list:
    for param in (*first.parameters(), *layer.parameters()):
        param.grad = None
    torch.manual_seed(2)
    x = torch.randn(3, 4, WIDTH)
    hidden = first(x)
    residual = hidden * 3.0
    scale = torch.randn(WIDTH, requires_grad=True)
    region = _region_reading_containers(layer)
    out = checkpoint(region, [hidden], Pair(hidden, residual), batch={"scale": scale})
    (out.square().sum() + hidden.sum()).backward()  # the tensors are used after the region too
    return [param.grad for param in (*first.parameters(), *layer.parameters())] + [scale.grad]


def _nested_tensors_get_their_gradients(options: dict) -> float:
    """Largest gradient error of the checkpointed region (tensor-parallel layers inside, its
    tensors passed inside containers) against the plain call."""
    _setup()
    torch.manual_seed(0)
    first = mp.ColumnParallelLinear(WIDTH, WIDTH, gather_output=True)
    layer = _TensorParallelBlock()
    ds_checkpointing.configure(None, **options)
    mp.model_parallel_manual_seed(5)
    checkpointed = _nested_tensor_gradients(first, layer, ds_checkpointing.checkpoint)
    ds_checkpointing.configure(None)
    mp.model_parallel_manual_seed(5)
    plain = _nested_tensor_gradients(first, layer, lambda fn, *a, **k: fn(*a, **k))
    assert all(grad is not None for grad in checkpointed)  # were None: the region's parameters
    return max((a - b).abs().max().item() for a, b in zip(checkpointed, plain))


@pytest.mark.parametrize("options", [{}, {"partition_activations": True}],
                         ids=["plain", "partitioned"])
def test_reentrant_checkpoint_sends_gradients_to_tensors_inside_containers(world2, options):
    assert max(world2.run(_nested_tensors_get_their_gradients, options)) <= 1e-6


REV_WIDTH = 6


def _plain(function, *args, **kwargs):
    return function(*args, **kwargs)


def _held_twice(hidden):
    """Argument lists giving the region one container in two places: ``(args, kwargs)``."""
    pair = [hidden, hidden.tanh()]
    looped = [hidden]
    looped.append(looped)
    return {
        "two positions": ((pair, pair), {}),
        "argument and keyword": ((pair,), {"again": pair}),
        "one inner list under two keys": (({"p": pair, "q": pair}, None), {}),
        "a list holding itself": ((looped, looped[1]), {}),
    }


def _region(layer, seen_same):
    def region(first, second=None, again=None):
        if isinstance(first, dict):
            first, second = first["p"], first["q"]
        second = again if again is not None else second
        seen_same.append(first is second)
        return layer(first[0]) * second[0]
    return region


def _gradients(checkpoint, case: str):
    torch.manual_seed(0)
    layer = nn.Linear(REV_WIDTH, REV_WIDTH)
    leaf = torch.randn(3, REV_WIDTH, requires_grad=True)
    hidden = leaf * 2.0  # history before the region, which the recomputation must not re-run
    args, kwargs = _held_twice(hidden)[case]
    seen_same = []
    out = checkpoint(_region(layer, seen_same), *args, **kwargs)
    (out.square().sum() + hidden.sum()).backward()
    return [leaf.grad, layer.weight.grad, layer.bias.grad], seen_same


def test_a_container_held_twice_gives_the_plain_gradients():
    for case in _held_twice(torch.zeros(1)):
        plain, _ = _gradients(_plain, case)
        checkpointed, seen_same = _gradients(ds_checkpointing.checkpoint, case)
        for got, want in zip(checkpointed, plain):
            torch.testing.assert_close(got, want, msg=case)
        # forward and recomputation both see one object in both places
        assert seen_same == [True, True], case


def _frozen_blocks(count: int):
    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Linear(REV_WIDTH, REV_WIDTH) for _ in range(count)])
    return blocks.requires_grad_(False)


def test_a_frozen_region_fed_the_raw_batch_keeps_nothing_and_is_not_recomputed():
    blocks, head = _frozen_blocks(3), nn.Linear(REV_WIDTH, 1)
    calls = []

    def block(index):
        def run(x):
            calls.append(index)
            return torch.relu(blocks[index](x))
        return run

    batch = torch.randn(4, REV_WIDTH)
    kept = weakref.ref(batch)
    hidden = batch
    for index in range(3):
        hidden = ds_checkpointing.checkpoint(block(index), hidden)
    assert not hidden.requires_grad  # as without checkpointing
    del batch
    gc.collect()
    assert kept() is None  # was: held by the first region until a backward
    head(hidden).sum().backward()
    assert calls == [0, 1, 2]  # was: each frozen block run again in the backward
    assert all(p.grad is None for p in blocks.parameters()) and head.weight.grad is not None


class _ScaleByKernel(torch.autograd.Function):
    """Reads its parameter only in a "kernel" (no torch function sees it in the forward)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad, (grad * x).sum(0)


class _KernelLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(REV_WIDTH))

    def forward(self, x):
        return _ScaleByKernel.apply(x, self.scale)


def test_regions_fed_the_raw_batch_that_read_something_trainable_still_train_it():
    batch = torch.randn(4, REV_WIDTH)
    frozen = _frozen_blocks(1)[0]
    closed_over = torch.randn(REV_WIDTH, requires_grad=True)
    kernel = _KernelLayer()
    for region, trainable in [(lambda x: frozen(x) * closed_over, closed_over),
                              (kernel, kernel.scale)]:
        out = ds_checkpointing.checkpoint(region, batch)
        assert out.requires_grad
        out.square().sum().backward()
        want = torch.autograd.grad(region(batch).square().sum(), trainable)[0]
        torch.testing.assert_close(trainable.grad, want)
