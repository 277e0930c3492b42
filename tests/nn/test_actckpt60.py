"""Activation checkpointing corners found by the ckptwrap60 hunt (single process, fast)."""

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
