"""Tensor-parallel and activation-checkpointing corners a Megatron / DeepSpeed user met.

Local checks and one world of 2 gloo ranks:

- DeepSpeed's reentrant ``checkpointing.checkpoint`` around a function returning a tensor it
  did not make, also used outside the region (a tensor the function closes over, also in the
  loss; or the caller's tensor passed in and closed over as well) failed in backward: the
  region's backward ran the graph before the region once more ("Trying to backward through
  the graph a second time"). Such outputs now get the plain call's gradients.
- ``VocabParallelEmbedding(scale_grad_by_freq=True, sparse=True)`` (and ``ParallelEmbedding``)
  failed in the first backward (torch's embedding backward refuses the pair, for
  ``nn.Embedding`` too); it is now a ``ValueError`` at construction naming both, and a
  non-bool ``sparse`` a ``TypeError``.
- ``partition_activations=True`` rebuilt a rank-specific checkpoint argument (sequence-parallel
  activations) from the ranks' slices of different tensors: silently wrong gradients. It is
  now a ``RuntimeError`` on every rank before the recomputation; replicated arguments (with
  ``contiguous_memory_optimization`` and ``cpu_checkpointing`` too) keep the plain gradients.
"""

import pytest
import torch
import torch.nn as nn

import shardkit.checkpointing as ds_checkpointing
from shardkit.nn import model_parallel as mp
from shardkit.testing import world_fixture

TP, WIDTH = 2, 8

world2 = world_fixture(2)


def _grads(params) -> list:
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return grads


# ------------------------------------------- reentrant checkpoint: outputs it did not make


def _closed_over_tensor_also_in_the_loss(checkpoint):
    """A region returning its own output and a tensor it closes over; the caller uses both."""
    torch.manual_seed(0)
    before, inside = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    hidden = before(x)

    def region(y):
        return inside(y), hidden

    out, same = checkpoint(region, torch.tanh(x))
    (out.sum() + (same * same).sum() + (hidden * 3).sum()).backward()
    return _grads([*before.parameters(), *inside.parameters(), x])


def _argument_also_closed_over(checkpoint):
    """The caller's tensor passed to the region and closed over by it, handed back."""
    torch.manual_seed(0)
    before, inside = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    hidden = before(x)

    def region(y):
        return inside(y), hidden

    out, same = checkpoint(region, hidden)
    (out.sum() + (same * same).sum()).backward()
    return _grads([*before.parameters(), *inside.parameters(), x])


@pytest.mark.parametrize("case", [_closed_over_tensor_also_in_the_loss,
                                  _argument_also_closed_over])
def test_reentrant_checkpoint_output_used_outside_gets_the_plain_gradients(case):
    want = case(lambda fn, *args: fn(*args))
    got = case(ds_checkpointing.checkpoint)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ------------------------------------------------------------------- world of 2 ranks


def _in_model_parallel(fn, *args, **kwargs):
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)
    try:
        return fn(*args, **kwargs)
    finally:
        ds_checkpointing.configure(None)
        mp.destroy_model_parallel()


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test compares type and message
        return f"{type(error).__name__}: {error}"
    return "ok"


def _embedding_flags() -> dict:
    def build(**flags):
        return lambda: mp.VocabParallelEmbedding(16, WIDTH, **flags)

    return {"sparse_and_scaled": _outcome(build(scale_grad_by_freq=True, sparse=True)),
            "sparse_string": _outcome(build(sparse="yes")),
            "sparse_alone": _outcome(build(sparse=True)),
            "scaled_alone": _outcome(build(scale_grad_by_freq=True)),
            "column_split": _outcome(lambda: mp.ParallelEmbedding(16, WIDTH, sparse=True,
                                                                  scale_grad_by_freq=True))}


def test_vocab_parallel_embedding_refuses_sparse_scaled_grads_at_construction(world2):
    for result in world2.run(_in_model_parallel, _embedding_flags):
        assert result["sparse_and_scaled"].startswith("ValueError: VocabParallelEmbedding: "
                                                      "scale_grad_by_freq=True with sparse=True")
        assert result["sparse_string"].startswith("TypeError: VocabParallelEmbedding: "
                                                  "sparse='yes'")
        assert result["sparse_alone"] == result["scaled_alone"] == "ok"
        assert result["column_split"].startswith("ValueError: ParallelEmbedding: "
                                                 "scale_grad_by_freq=True with sparse=True")


def _partitioned_step(rank_specific: bool, **options) -> dict:
    """One checkpointed layer whose argument is, or is not, the same on both ranks: the
    gradients of a partitioned checkpoint against the plain call's, or the error."""
    ds_checkpointing.configure(None, partition_activations=True, **options)
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(4, WIDTH, requires_grad=True)
    shift = float(mp.get_model_parallel_rank()) if rank_specific else 0.0

    def loss(checkpoint):
        hidden = torch.tanh(x) + shift  # sequence-parallel activations differ per rank
        return checkpoint(layer, hidden).pow(2).sum()

    loss(lambda fn, *args: fn(*args)).backward()
    want = _grads([*layer.parameters(), x])
    outcome = _outcome(lambda: loss(ds_checkpointing.checkpoint).backward())
    if outcome != "ok":
        return {"error": outcome}
    got = _grads([*layer.parameters(), x])
    return {"max_diff": max((g - w).abs().max().item() for g, w in zip(got, want))}


def test_partition_activations_refuses_a_rank_specific_argument(world2):
    for result in world2.run(_in_model_parallel, _partitioned_step, True):
        assert result["error"].startswith("RuntimeError: shardkit.checkpointing.checkpoint("
                                          "Linear): tensor argument #0 differs across the "
                                          "tensor-parallel ranks"), result


@pytest.mark.parametrize("options", [{}, dict(contiguous_checkpointing=True, num_checkpoints=1,
                                              checkpoint_in_cpu=True)])
def test_partition_activations_keeps_replicated_arguments_exact(world2, options):
    for result in world2.run(_in_model_parallel, _partitioned_step, False, **options):
        assert result == {"max_diff": 0.0}
