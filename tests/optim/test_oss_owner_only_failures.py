"""OSS where only the owner of a parameter would fail its step (one world of 2 ranks).

Regression: a sparse gradient (``nn.Embedding(sparse=True)``) reaching an optimizer that refuses
them (Adam, AdamW, RMSprop, shardkit's FusedAdamW...) raised torch's error in the owner's local
step only; the other rank stepped its own shard and waited in the parameter sync (until the
collective timed out, 240 s here) or, if the owner stepped again, paired its all-gather with
the owner's next one and trained on. Every rank that holds the gradient (under DDP, every rank)
now raises the same RuntimeError, naming the parameter and the optimizer, before any collective
and with no parameter changed; optimizers that take sparse gradients (SGD, Adagrad) still step.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.optim import OSS
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _embedding_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(40, 8, sparse=True), nn.Linear(8, 3))


def _backward(model):
    ids = torch.arange(8)
    F.mse_loss(model(ids), torch.zeros(8, 3)).backward()


def _step_with_sparse_gradient(optim_cls, named: bool):
    """Step an OSS whose embedding holds a sparse gradient (every rank holds it, as under DDP).
    Returns (the error's message or None, whether every parameter is unchanged, whether a
    step with the embedding's gradient dropped then changes the Linear on every rank)."""
    model = _embedding_model()
    params = model.named_parameters() if named else model.parameters()
    opt = OSS(params, optim=optim_cls, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(model)
    try:
        opt.step()
        message = None
    except RuntimeError as error:
        message = str(error)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    # nothing is left waiting in a collective: without the sparse gradient the ranks step
    # together again
    model[0].weight.grad = None
    opt.step()
    linear_moved = not torch.equal(before[1], model[1].weight)
    return message, unchanged, linear_moved


def _sparse_refusals():
    from shardkit.optim import FusedAdamW
    return {name: _step_with_sparse_gradient(cls, named)
            for name, cls, named in (("adamw", torch.optim.AdamW, False),
                                     ("adam_named", torch.optim.Adam, True),
                                     ("rmsprop", torch.optim.RMSprop, False),
                                     ("fused_adamw", FusedAdamW, False))}


def _sparse_parity(optim_cls, hyper):
    """Three steps of an OSS and of the plain optimizer over the same sparse embedding (every
    rank takes the whole batch); the largest parameter difference."""
    oracle = _embedding_model()
    model = copy.deepcopy(oracle)
    ref = optim_cls(oracle.parameters(), **hyper)
    opt = OSS(model.parameters(), optim=optim_cls, **hyper)
    for _ in range(3):
        for m, o in ((oracle, ref), (model, opt)):
            o.zero_grad()
            _backward(m)
            o.step()
    return max(float((a - b).abs().max()) for a, b in zip(model.parameters(),
                                                          oracle.parameters()))


def _sparse_takers():
    return {"sgd_nesterov": _sparse_parity(torch.optim.SGD,
                                           dict(lr=0.1, momentum=0.9, nesterov=True)),
            "adagrad": _sparse_parity(torch.optim.Adagrad, dict(lr=0.1))}


def test_sparse_gradient_refused_on_every_rank_before_the_sync(world2):
    results = world2.run(_sparse_refusals)
    for name, optimizer in (("adamw", "AdamW"), ("adam_named", "Adam"),
                            ("rmsprop", "RMSprop"), ("fused_adamw", "FusedAdamW")):
        for rank, result in enumerate(results):
            message, unchanged, linear_moved = result[name]
            assert message is not None and message.startswith("OSS.step: parameter 0"), \
                (name, rank, message)
            assert f"which {optimizer} with these settings does not step" in message, message
            assert "sparse=False" in message, message
            assert unchanged, f"{name}: rank {rank} changed parameters before raising"
            assert linear_moved, f"{name}: rank {rank} did not step afterwards"
    assert "('0.weight')" in results[0]["adam_named"][0]


def test_optimizers_that_take_sparse_gradients_still_step(world2):
    for result in world2.run(_sparse_takers):
        assert result["sgd_nesterov"] <= 1e-6
        assert result["adagrad"] <= 1e-6
