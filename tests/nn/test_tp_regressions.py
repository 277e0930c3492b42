"""Tensor-parallel corner cases that once went wrong silently, in one world of 2 gloo ranks.

- ``copy_to_model_parallel_region`` all-reduces the gradient in backward. The gradient it is
  handed may be the very tensor that another input of the same op receives (an add's backward
  gives both inputs one tensor), so reducing it in place changed that other gradient too.
- ``RNGStatesTracker.fork()`` inside an open fork of the same stream (a layer that forks,
  called in a block that already forked) restarted the stream from where the outer fork began,
  drawing the same dropout mask twice; activation checkpointing inside such a fork must still
  replay the draws of the first forward.
- ``vocab_parallel_cross_entropy`` computed float64 logits in fp32: a 1e-7 error against
  ``F.cross_entropy`` and a failing ``torch.autograd.gradcheck``.
- ``gather_from_sequence_parallel_region`` had no ``tensor_parallel_output_grad`` (Megatron-LM's
  flag for a gathered activation that feeds a replicated computation), and Megatron's positional
  call ``(x, False)`` was taken as ``dim=0``: a reduce-scatter summed whole gradients ``n``
  times. A bool or a process group as ``dim`` / ``stride`` is now refused before any collective.
- ``model_parallel_manual_seed`` (and ``RNGStatesTracker.add``) refused a NumPy integer seed,
  which ``torch.manual_seed`` and FairScale's ``model_parallel_cuda_manual_seed`` take.
- A stream forked again inside another stream's fork (fork s > fork t > fork s) repeated its
  draws after the inner forks closed.
- ``get_states()`` gave objects of a private class: a checkpoint holding them (Megatron's
  ``rng_tracker_states``) failed under ``torch.load(weights_only=True)``; they are uint8
  tensors now.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.utils import shard_of
from shardkit.nn.model_parallel.random import RNGStatesTracker, checkpoint
from shardkit.testing import world_fixture

TP = 2

world2 = world_fixture(2)


def _setup(tp: int = TP) -> int:
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(tp)
    return mp.get_model_parallel_rank()


def _copy_to_region_beside_another_input() -> dict:
    """``z = copy_to(x) + y`` with ``y`` computed first (its backward runs after the copy's):
    ``y``'s gradient is the plain upstream one, ``x``'s the sum over the tensor-parallel ranks.
    Returns the largest error of each, and of the same pattern where ``y`` is a leaf."""
    rank = _setup()
    torch.manual_seed(0)
    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    leaf = torch.randn(3, 4, requires_grad=True)
    y = w * 2.0
    z = mp.copy_to_model_parallel_region(x) + y + leaf
    upstream = torch.full((3, 4), float(rank + 1))  # differs across the ranks, as in a region
    (z * upstream).sum().backward()
    summed = torch.full((3, 4), float(sum(range(1, TP + 1))))
    return {"w": (w.grad - 2.0 * upstream).abs().max().item(),
            "leaf": (leaf.grad - upstream).abs().max().item(),
            "x": (x.grad - summed).abs().max().item()}


def _nested_forks() -> dict:
    """Draws inside a nested fork of the model-parallel stream continue the outer fork's, as if
    unnested; a shardkit-checkpointed region that forks, inside a fork, replays its draws."""
    _setup()
    tracker = mp.get_model_parallel_rng_tracker()
    mp.model_parallel_manual_seed(3)
    default_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(8)
        with tracker.fork():
            b = torch.rand(8)
        c = torch.rand(8)
    default_untouched = torch.equal(torch.get_rng_state(), default_before)
    mp.model_parallel_manual_seed(3)
    with tracker.fork():
        unnested = torch.rand(24)

    def region(x):
        with tracker.fork():
            return F.dropout(x, 0.5)

    outs, grads = [], []
    for checkpointed in (False, True):
        mp.model_parallel_manual_seed(7)
        x = torch.ones(64, requires_grad=True)
        with tracker.fork():
            first = F.dropout(x, 0.5)
            second = checkpoint(region, x) if checkpointed else region(x)
        (first + second * torch.arange(64.0)).sum().backward()
        outs.append((first.detach() != 0, second.detach() != 0))
        grads.append(x.grad)
    return {"continues": torch.equal(torch.cat([a, b, c]), unnested),
            "default_untouched": default_untouched,
            "two_masks": not torch.equal(*outs[0]),
            "replayed": torch.equal(outs[0][1], outs[1][1]) and torch.equal(*grads)}


def _numpy_seeds() -> dict:
    """A NumPy integer seeds as the same Python int does; a float or a bool is refused."""
    _setup()
    tracker = mp.get_model_parallel_rng_tracker()
    draws = []
    for seed in (5, np.int64(5)):
        mp.model_parallel_manual_seed(seed)
        with tracker.fork():
            draws.append(torch.rand(4))
        draws.append(torch.rand(4))
    tracker.add("numpy-stream", np.int32(99))
    refused = []
    for bad in (5.0, True):
        with pytest.raises(TypeError, match=r"seed must be an int"):
            mp.model_parallel_manual_seed(bad)
        refused.append(True)
    return {"same": torch.equal(draws[0], draws[2]) and torch.equal(draws[1], draws[3]),
            "names": tracker.names(), "refused": refused}


def _float64_cross_entropy() -> dict:
    """float64 vocabulary-split logits (targets with ignore_index, label smoothing or not):
    loss and gradient as F.cross_entropy's in float64 at tensor-parallel size 2, and
    gradcheck at size 1 (every rank alone: gradcheck perturbs one element at a time, which
    ranks perturbing their own shards together would break)."""
    rank = _setup()
    vocab = 4 * TP
    full = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0),
                       dtype=torch.float64)
    target = torch.tensor([0, vocab - 1, -100])
    weight = torch.tensor([0.3, -1.2, 0.7], dtype=torch.float64)
    result = {}
    for smoothing in (0.0, 0.1):
        local = shard_of(full, rank, TP, -1).requires_grad_(True)
        loss = mp.vocab_parallel_cross_entropy(local, target, label_smoothing=smoothing)
        unsplit = full.clone().requires_grad_(True)
        ref = F.cross_entropy(unsplit, target, reduction="none", label_smoothing=smoothing)
        (loss * weight).sum().backward()
        (ref * weight).sum().backward()
        result[smoothing] = (loss.dtype, local.grad.dtype,
                             (loss - ref).abs().max().item() < 1e-13,
                             (local.grad - shard_of(unsplit.grad, rank, TP, -1)).abs().max().item()
                             < 1e-13)
    _setup(1)
    for smoothing in (0.0, 0.1):
        logits = full.clone().requires_grad_(True)
        result[f"gradcheck {smoothing}"] = torch.autograd.gradcheck(
            lambda z: mp.vocab_parallel_cross_entropy(z, target, label_smoothing=smoothing),
            (logits,), raise_exception=False)
    return result


def _gather_sequence_for_a_replicated_computation() -> dict:
    """A sequence-split activation gathered for a computation replicated on every rank (a
    loss on the whole sequence): with ``tensor_parallel_output_grad=False`` each rank's input
    gradient is its slice of the one-process gradient; misplaced arguments are refused."""
    rank = _setup()
    full = torch.randn(2, 4 * TP, 3, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(2, 4 * TP, 3, generator=torch.Generator().manual_seed(2))
    local = full.narrow(1, rank * 4, 4).clone().requires_grad_(True)
    gathered = mp.gather_from_sequence_parallel_region(local, 1,
                                                       tensor_parallel_output_grad=False)
    (gathered * weight).sum().backward()
    errors = {"value": (gathered - full).abs().max().item(),
              "grad": (local.grad - weight.narrow(1, rank * 4, 4)).abs().max().item()}
    group = mp.get_model_parallel_group()
    refused = []
    for call, error in (
            (lambda: mp.gather_from_sequence_parallel_region(local, False), TypeError),
            (lambda: mp.scatter_to_sequence_parallel_region(full, group), TypeError),
            (lambda: mp.reduce_scatter_to_sequence_parallel_region(full, 3), ValueError),
            (lambda: mp.gather_from_model_parallel_region(local, group), TypeError),
            (lambda: mp.scatter_to_model_parallel_region(full, 0), ValueError),
            (lambda: mp.gather_from_sequence_parallel_region(
                local, tensor_parallel_output_grad="no"), TypeError)):
        with pytest.raises(error, match=r"(dim|stride|tensor_parallel_output_grad)="):
            call()
        refused.append(True)
    return {"errors": errors, "refused": refused}


def test_copy_to_region_does_not_change_a_gradient_shared_with_another_input(world2):
    for errors in world2.run(_copy_to_region_beside_another_input):
        assert errors == {"w": 0.0, "leaf": 0.0, "x": 0.0}


def test_nested_fork_of_a_stream_continues_it_and_checkpoints_replay(world2):
    for result in world2.run(_nested_forks):
        assert result == {"continues": True, "default_untouched": True, "two_masks": True,
                          "replayed": True}


def test_numpy_integer_seeds_work_like_python_ints(world2):
    for result in world2.run(_numpy_seeds):
        assert result == {"same": True, "names": ["model-parallel-rng", "numpy-stream"],
                          "refused": [True, True]}


def test_float64_cross_entropy_is_computed_in_float64(world2):
    f64 = (torch.float64, torch.float64, True, True)
    for result in world2.run(_float64_cross_entropy):
        assert result == {0.0: f64, 0.1: f64, "gradcheck 0.0": True, "gradcheck 0.1": True}


def test_sequence_gather_for_a_replicated_computation_keeps_its_slice(world2):
    for result in world2.run(_gather_sequence_for_a_replicated_computation):
        assert result == {"errors": {"value": 0.0, "grad": 0.0}, "refused": [True] * 6}


def test_a_stream_forked_again_inside_another_streams_fork_goes_on():
    """fork(s) > fork(t) > fork(s): the draws after the innermost fork continue stream s (the
    outer fork's state to return to was captured before the inner one moved s on, and the
    third draw repeated the second); t and the default stream are left as they would be."""
    tracker = RNGStatesTracker()
    tracker.add("s", 1)
    tracker.add("t", 2)
    torch.manual_seed(0)
    with tracker.fork("s"):
        draws = [torch.rand(1)]
        with tracker.fork("t"):
            t_draw = torch.rand(1)
            with tracker.fork("s"):
                draws.append(torch.rand(1))
        draws.append(torch.rand(1))
    after = torch.rand(1)
    alone = RNGStatesTracker()
    alone.add("s", 1)
    alone.add("t", 2)
    with alone.fork("s"):
        want = torch.rand(3)
    with alone.fork("t"):
        want_t = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.cat(draws), want)
    assert torch.equal(t_draw, want_t)
    assert torch.equal(after, torch.rand(1))


def test_tracker_states_are_plain_tensors_a_weights_only_load_reads(tmp_path):
    """Megatron saves ``get_cuda_rng_tracker().get_states()`` in its checkpoints; they were
    objects of a private class, which ``torch.load``'s default ``weights_only=True`` refused."""
    tracker = RNGStatesTracker()
    tracker.add("s", 7)
    with tracker.fork("s"):
        torch.rand(3)
    states = tracker.get_states()
    assert all(v.dtype == torch.uint8 and v.dim() == 1 for v in states.values())
    torch.save({"rng_tracker_states": states}, tmp_path / "rng.pt")
    with tracker.fork("s"):
        want = torch.rand(4)
    tracker.set_states(torch.load(tmp_path / "rng.pt", weights_only=True)["rng_tracker_states"])
    with tracker.fork("s"):
        assert torch.equal(torch.rand(4), want)
    with pytest.raises(TypeError, match="stream 's' holds a torch.float32 tensor"):
        tracker.set_states({"s": torch.zeros(3)})
    with tracker.fork("s"):  # the refused call changed nothing: the stream goes on
        got = torch.rand(4)
    fresh = RNGStatesTracker()
    fresh.set_states(torch.load(tmp_path / "rng.pt", weights_only=True)["rng_tracker_states"])
    with fresh.fork("s"):
        assert torch.equal(torch.rand(8)[4:], got)


def _checkpointed_region_drawing_after_its_fork_inside_a_fork(kind: str) -> bool:
    """A checkpointed region that forks the model-parallel stream and then draws outside its
    fork, run inside a fork of that stream: the recomputation draws what the first forward drew
    (its draws after the inner fork go on with the outer fork's stream, then as in the first
    forward), so the gradients equal the uncheckpointed ones."""
    import shardkit.checkpointing as ds

    _setup()
    tracker = mp.get_model_parallel_rng_tracker()

    def region(x):
        with tracker.fork():
            h = F.dropout(x, 0.5)
        return F.dropout(h, 0.3)

    wrap = {"mp": checkpoint, "ds": ds.checkpoint, "ds-nr": ds.non_reentrant_checkpoint}[kind]
    grads = []
    for checkpointed in (False, True):
        mp.model_parallel_manual_seed(11)
        x = torch.ones(256, requires_grad=True)
        with tracker.fork():
            y = wrap(region, x) if checkpointed else region(x)
        (y * torch.arange(256.0)).sum().backward()
        grads.append(x.grad)
    return torch.equal(*grads)


@pytest.mark.parametrize("kind", ["mp", "ds", "ds-nr"])
def test_checkpointed_region_inside_a_fork_replays_draws_after_its_own_fork(world2, kind):
    assert world2.run(_checkpointed_region_drawing_after_its_fork_inside_a_fork, kind) == \
        [True, True]


def test_a_state_that_is_no_generator_state_is_refused_and_forks_stay_usable():
    """A uint8 tensor of the right size that torch cannot load (a corrupt checkpoint) is refused
    by set_states; a fork whose entry fails leaves no fork open behind it."""
    tracker = RNGStatesTracker()
    tracker.add("s", 1)
    with pytest.raises(ValueError, match="stream 's' holds no valid CPU generator state"):
        tracker.set_states({"s": torch.zeros(torch.get_rng_state().numel(), dtype=torch.uint8)})
    tracker._states["s"].cpu = torch.zeros_like(tracker._states["s"].cpu)  # past the check
    with pytest.raises(RuntimeError, match="mt19937"):
        with tracker.fork("s"):
            pass
    tracker.add("t", 2)
    alone = RNGStatesTracker()
    alone.add("t", 2)
    with alone.fork("t"):
        want = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("t"):  # draws stream t, not the default stream (no fork left open)
        got = torch.rand(3)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(got, want) and torch.equal(after, torch.rand(1))
