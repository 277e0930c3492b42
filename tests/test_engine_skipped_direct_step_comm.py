"""DeepSpeed-style engine: a skipped direct ``engine.optimizer.step()`` at ZeRO stages 1-2.

From a review: under fp16, a script's own ``engine.optimizer.step()`` whose gradients
overflowed is skipped on every rank (the engine clears the gradients, so OSS steps nothing),
but OSS still re-synced every parameter from its owner: an all-gather of ``Ψ(N-1)/N``
elements that moved nothing new, where ``engine.step()`` makes none. The skipped direct step
now costs what the skipped ``engine.step()`` costs, and leaves the weights as they were.

One world of 2 gloo ranks for the module.
"""

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.distributed import CommCounter
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _engine(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    return shardkit.initialize(model=model, config=config)[0]


def _overflowing_batch() -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(distributed.get_rank()))
    if distributed.get_rank() == distributed.get_world_size() - 1:
        x[0, 0] = float("inf")  # one rank overflows: every rank skips
    return x


def _skipped_step(stage: int, direct: bool) -> dict:
    """One overflowed step, by the script's ``engine.optimizer.step()`` or by
    ``engine.step()``: its bytes by op, whether the weights moved, the loss scale after."""
    engine = _engine(stage)
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(_overflowing_batch()).float().pow(2).mean())
    with CommCounter() as counted:
        if direct:
            engine.optimizer.step()
            engine.optimizer.zero_grad()
        else:
            engine.step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    # the next step, not skipped, trains on every rank alike
    engine.backward(engine(torch.ones(4, 6)).float().pow(2).mean())
    engine.optimizer.step() if direct else engine.step()
    return {"by_op": dict(counted.by_op), "unchanged": unchanged,
            "scale": float(engine.loss_scale), "skipped": engine.skipped_steps,
            "after": [p.detach().clone() for p in engine.module.parameters()]}


def _skipped_steps() -> dict:
    return {(stage, direct): _skipped_step(stage, direct)
            for stage in (1, 2) for direct in (True, False)}


def test_skipped_direct_step_moves_no_parameters_at_stages_1_and_2(world2):
    # was: the skipped direct step all-gathered every parameter (Ψ(N-1)/N elements)
    outs = world2.run(_skipped_steps)
    for out in outs:
        for stage in (1, 2):
            direct, engine_step = out[(stage, True)], out[(stage, False)]
            assert "all_gather" not in direct["by_op"], (stage, direct["by_op"])
            assert direct["by_op"] == engine_step["by_op"], stage
            assert direct["unchanged"] and engine_step["unchanged"], stage
            assert direct["scale"] == engine_step["scale"] == 2.0 ** 7, stage
            assert direct["skipped"] == engine_step["skipped"] == 1, stage
            for a, b in zip(direct["after"], engine_step["after"]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(outs[0][(1, True)]["after"], outs[1][(1, True)]["after"]):
        assert torch.equal(a, b)
