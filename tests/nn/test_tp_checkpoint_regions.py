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

Review of the checkpoint outputs and the partitioned-argument check

Review of the reentrant checkpoint's outputs and partitioned arguments (DeepSpeed's
``checkpointing.checkpoint``).

- ``partition_activations=True`` with an argument that differs across the tensor-parallel
  ranks only where some rank cannot see it (rank 1's tensor differs from rank 0's in rank 1's
  own slice: rank 1 rebuilds its tensor exactly, rank 0 does not): only rank 0 raised, rank 1
  went on into its next collective and waited there for rank 0. Every rank raises now.
- A region returning a tensor made before it that autograd does not reach (a buffer, a
  detached tensor it closes over) had that very tensor turned into the checkpoint's output:
  the caller's tensor came back requiring grad with the checkpoint's ``grad_fn``, and the
  backward, whose recomputation returned the same tensor, called itself without end.
- ``ParallelEmbedding(sparse="no")`` (any truthy non-bool flag) was taken as ``True``, as
  ``VocabParallelEmbedding`` does not: a ``TypeError`` naming the flag now.
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


# ------------------------------------------------ outputs made before the region, without grad


def _closed_over_tensor_without_grad_handed_back(checkpoint, made_before) -> list:
    """Two steps of a region returning its output and a tensor it closes over that does not
    require grad; the caller multiplies them."""
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(3, WIDTH, requires_grad=True)
    scale = made_before(layer, x)
    grads = []
    for _ in range(2):
        out, same = checkpoint(lambda y: (layer(y), scale), torch.tanh(x))
        # the caller's tensor left as it was (else the backward would never end)
        assert not scale.requires_grad and scale.grad_fn is None
        assert torch.equal(same, scale)
        (out * same).sum().backward()
        grads += _grads([*layer.parameters(), x])
    return grads


def test_reentrant_checkpoint_hands_back_a_tensor_without_grad_made_before_it():
    makers = {"buffer": lambda layer, x: torch.linspace(-1, 1, 3 * WIDTH).view(3, WIDTH),
              "detached": lambda layer, x: layer(x).detach()}
    for name, made_before in makers.items():
        want = _closed_over_tensor_without_grad_handed_back(lambda fn, *args: fn(*args),
                                                            made_before)
        got = _closed_over_tensor_without_grad_handed_back(ds_checkpointing.checkpoint,
                                                           made_before)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------- world of 2 ranks


def _parallel_embedding_flags() -> dict:
    def build(**flags):
        return lambda: mp.ParallelEmbedding(16, WIDTH, **flags)

    return {"sparse": _outcome(build(sparse="no")),
            "scaled": _outcome(build(scale_grad_by_freq="no")),
            "both_bools": _outcome(build(sparse=True, scale_grad_by_freq=False))}


def test_parallel_embedding_refuses_flags_that_are_not_bools(world2):
    for result in world2.run(_in_model_parallel, _parallel_embedding_flags):
        assert result["sparse"] == ("TypeError: ParallelEmbedding: sparse='no' (str); it must "
                                    "be a bool, True or False")
        assert result["scaled"].startswith("TypeError: ParallelEmbedding: "
                                           "scale_grad_by_freq='no' (str)")
        assert result["both_bools"] == "ok"


def _differs_only_in_one_ranks_slice(differing_rank: int, **options) -> str:
    """Both ranks checkpoint a layer whose argument is the same on both except in
    ``differing_rank``'s own slice, changed on that rank only: it rebuilds its argument
    exactly, the other rank does not."""
    ds_checkpointing.configure(None, partition_activations=True, **options)
    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(4, WIDTH, requires_grad=True)
    share = x.numel() // TP
    in_slice = torch.arange(x.numel()).view_as(x) // share == differing_rank
    shift = in_slice.float() * float(mp.get_model_parallel_rank() == differing_rank)
    hidden = torch.tanh(x) + shift
    return _outcome(lambda: ds_checkpointing.checkpoint(layer, hidden).sum().backward())


def _both_orders(**options) -> list:
    return [_differs_only_in_one_ranks_slice(rank, **options) for rank in range(TP)]


def test_partition_activations_raises_on_every_rank_when_some_rebuild_their_own(world2):
    for options in ({}, dict(contiguous_checkpointing=True, num_checkpoints=1)):
        for outcomes in world2.run(_in_model_parallel, _both_orders, **options):
            for outcome in outcomes:
                assert outcome.startswith("RuntimeError: shardkit.checkpointing.checkpoint("
                                          "Linear): tensor argument #0 differs across the "
                                          "tensor-parallel ranks (seen on 1 of 2)"), outcome
