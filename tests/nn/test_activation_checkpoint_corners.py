"""Activation checkpointing corners (single process, fast).

Its review found:

Review of the skip-connection replay in checkpointed regions (single process, fast):
tensors crossing the boundary of DeepSpeed's reentrant checkpoint through the skip table.
"""

import pytest
import torch
import torch.nn as nn

import shardkit.checkpointing as ck
import shardkit.nn.pipe.skip as skip_module
from shardkit.nn import Pipe
from shardkit.nn.checkpoint import checkpoint_wrapper, is_checkpointing, is_recomputing
from shardkit.nn.pipe.batchnorm import DeferredBatchNorm
from shardkit.nn.pipe.skip import pop, skippable, stash


class _FlagSpy(nn.Module):
    """Records (is_checkpointing(), is_recomputing()) at each call; a differentiable step
    after it keeps the recomputation running through it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        return x * 2


def test_deepspeed_checkpoint_sets_the_checkpointing_and_recomputing_flags():
    spy = _FlagSpy()
    block = nn.Sequential(nn.Linear(4, 4), spy, nn.Linear(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    ck.checkpoint(block, x).sum().backward()
    assert spy.seen == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)


def _deferred_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), DeferredBatchNorm(4), nn.Linear(4, 4))


def _train(model, batches, how):
    for x in batches:
        out = model(x) if how is None else how(model, x)
        model[1].commit()  # once per mini-batch, as Pipe does after its forward
        out.pow(2).sum().backward()
    return model[1]


def test_deferred_batch_norm_in_deepspeed_checkpoint_tracks_the_forward_only():
    # the reentrant recomputation used to be tracked as one more micro-batch: folded into
    # the next commit, it mixed the previous batch into the running statistics
    batches = [torch.randn(8, 4, requires_grad=True,
                           generator=torch.Generator().manual_seed(i)) for i in range(3)]
    plain = _train(_deferred_model(), batches, None)
    for how in (ck.checkpoint, ck.non_reentrant_checkpoint):
        got = _train(_deferred_model(), batches, how)
        assert got.tracked_chunks == 0, how.__name__
        assert torch.allclose(got.running_mean, plain.running_mean), how.__name__
        assert torch.allclose(got.running_var, plain.running_var), how.__name__
        assert int(got.num_batches_tracked) == int(plain.num_batches_tracked) == 3


@skippable(stash=["skip"])
class _Stash(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.dropout = nn.Linear(6, 6), nn.Dropout(0.5)

    def forward(self, x):
        y = self.dropout(self.linear(x))
        yield stash("skip", y)
        return y


@skippable(pop=["skip"])
class _Pop(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        skip = yield pop("skip")
        return self.linear(x) * skip


def _skip_model():
    torch.manual_seed(0)
    return nn.Sequential(_Stash(), nn.Linear(6, 6), _Pop())


def _grads(model, run, x):
    torch.manual_seed(3)
    out = run(model, x)
    out.pow(2).sum().backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


def _fresh_input():
    return torch.randn(4, 6, requires_grad=True, generator=torch.Generator().manual_seed(1))


def _wrapped_each(model):
    return nn.Sequential(*[checkpoint_wrapper(layer) for layer in model])


@pytest.mark.parametrize("how", ["wrapper", "wrapper_in_pipe", "nested", "deepspeed"])
def test_checkpointed_skippable_layers_replay_their_pops(how):
    # the recomputation of a popping layer used to pop again from the emptied table
    # ("popped before it was stashed" in backward) and a recomputed stash was left behind
    expected = _grads(_skip_model(), lambda m, x: m(x), _fresh_input())
    model = _skip_model()
    if how == "wrapper":
        model, run = _wrapped_each(model), lambda m, x: m(x)
    elif how == "wrapper_in_pipe":
        model = Pipe(_wrapped_each(model), balance=[1, 2], chunks=2, checkpoint="never")
        run = lambda m, x: m(x)  # noqa: E731
    elif how == "nested":
        model = checkpoint_wrapper(_wrapped_each(model))
        run = lambda m, x: m(x)  # noqa: E731
    else:
        run = lambda m, x: ck.checkpoint(m, x)  # noqa: E731
    got = _grads(model, run, _fresh_input())
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6), how
    assert skip_module._tracker.current.tensors == {}


_STASHED = {
    "product": lambda x, y: y * 2,  # a tensor of its own, made without grad in the forward
    "input_view": lambda x, y: x[:, :6],  # a view of the argument, taken without grad
}


def _stash_layer(kind):
    @skippable(stash=["skip"])
    class Stash(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(6, 6)

        def forward(self, x):
            y = self.linear(x)
            yield stash("skip", _STASHED[kind](x, y))
            return y

    return Stash()


def _model(kind="product"):
    torch.manual_seed(0)
    return nn.Sequential(_stash_layer(kind), nn.Linear(6, 6), _Pop())


def _grads_rev(model, run, backwards=1):
    leaf = torch.randn(4, 6, requires_grad=True, generator=torch.Generator().manual_seed(1))
    out = run(model, leaf * 1)  # a non-leaf argument, as between layers
    for k in range(backwards):
        out.pow(2).sum().backward(retain_graph=k + 1 < backwards)
    return [out.detach(), leaf.grad] + [p.grad for p in model.parameters()]


def _assert_same(got, expected):
    assert skip_module._tracker.current.tensors == {}
    for a, b in zip(got, expected):
        assert a is not None and torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("kind", sorted(_STASHED))
@pytest.mark.parametrize("backwards", [1, 2])
def test_reentrant_checkpoint_stash_popped_after_it_carries_its_gradient(kind, backwards):
    # the first forward runs without grad: the stashed tensor reached the popping layer
    # detached, so the gradient through the skip connection was silently dropped
    expected = _grads_rev(_model(kind), lambda m, x: m(x), backwards)
    got = _grads_rev(_model(kind), lambda m, x: m[2](m[1](ck.checkpoint(m[0], x))), backwards)
    _assert_same(got, expected)


def test_reentrant_checkpoint_refuses_to_pop_a_tensor_that_requires_grad_from_outside():
    # its recomputation ran a second backward through the stashing layer's graph: torch's
    # "Trying to backward through the graph a second time" in backward, after the forward
    model = _model()
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"popped the skip connection 'skip'.*requires grad.*"
                                           r"non_reentrant_checkpoint"):
        ck.checkpoint(nn.Sequential(model[1], model[2]), model[0](x))
    skip_module._tracker.current.tensors.clear()
    # what the message proposes gives the plain result
    expected = _grads_rev(_model(), lambda m, x: m(x))
    got = _grads_rev(_model(), lambda m, x: ck.non_reentrant_checkpoint(
        nn.Sequential(m[1], m[2]), m[0](x)))
    _assert_same(got, expected)
