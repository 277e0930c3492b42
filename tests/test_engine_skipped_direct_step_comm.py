"""DeepSpeed-style engine: a skipped direct ``engine.optimizer.step()`` at ZeRO stages 1-2.

From a review: under fp16, a script's own ``engine.optimizer.step()`` whose gradients
overflowed is skipped on every rank (the engine clears the gradients, so OSS steps nothing),
but OSS still re-synced every parameter from its owner: an all-gather of ``Ψ(N-1)/N``
elements that moved nothing new, where ``engine.step()`` makes none. The skipped direct step
now costs what the skipped ``engine.step()`` costs, and leaves the weights as they were.

From a review:

DeepSpeed-style engine: a skipped direct ``engine.optimizer.step()`` at ZeRO stages 1-2
stepped by the script's own GradScaler.

From a review of the hand-off that makes OSS skip its parameter sync on a skipped direct
step (the engine sets OSS's ``found_inf``, as ``ShardedGradScaler`` does, and its step
post-hook deletes it): a script that steps the engine's optimizer through a GradScaler
(``scaler.step(engine.optimizer)``, torch's or ``ShardedGradScaler``) already hands OSS the
scaler's own ``found_inf``, which the scaler deletes after the step. On an overflowed step
the engine overwrote it and its post-hook deleted it, so the scaler's ``del
optimizer.found_inf`` raised AttributeError on every rank, and the scaler, never updated,
refused every later step. After a direct step that raised (the hand-off left behind), the
next step's GradScaler ``found_inf`` was deleted before OSS read it: OSS stepped gradients
still multiplied by the scaler's scale (an SGD update ``scale`` times too big), then the
scaler raised. The engine now leaves a scaler's ``found_inf`` alone.

One world of 2 gloo ranks for the module.
"""

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.distributed import CommCounter
from shardkit.optim import ShardedGradScaler
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


_OVERFLOW_STEP = 1


def _batch(step: int) -> torch.Tensor:
    rank = distributed.get_rank()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
    if step == _OVERFLOW_STEP and rank == distributed.get_world_size() - 1:
        x[0, 0] = float("inf")  # one rank overflows: every rank skips
    return x


def _scaler(kind: str):
    if kind == "torch":
        return torch.amp.GradScaler("cpu", init_scale=4.0)
    return ShardedGradScaler(init_scale=4.0, device="cpu") if kind == "sharded" else None


def _weights(engine) -> list:
    return [p.detach().clone() for p in engine.module.parameters()]


def _backward_and_step(engine, scaler, loss) -> None:
    """The script's backward and its own ``engine.optimizer.step()``: plain (``scaler`` None)
    or through ``scaler`` (scale, step, update)."""
    if scaler is None:
        engine.backward(loss)
        engine.optimizer.step()
    else:
        engine.backward(scaler.scale(loss))
        scaler.step(engine.optimizer)
        scaler.update()


def _train_through(stage: int, kind: str) -> dict:
    """Three steps (the second overflows) stepped by a GradScaler of ``kind`` (None: the
    script's plain ``engine.optimizer.step()``): the weights after each, the scaler's scale."""
    engine, scaler = _engine(stage), _scaler(kind)
    weights = []
    for step in range(3):
        _backward_and_step(engine, scaler, engine(_batch(step)).float().pow(2).mean())
        engine.optimizer.zero_grad()
        weights.append(_weights(engine))
    return {"weights": weights, "left": "found_inf" in engine.optimizer.__dict__,
            "scaler_scale": None if scaler is None else float(scaler.get_scale()),
            "loss_scale": float(engine.loss_scale), "skipped": engine.skipped_steps}


class _RaisedOnce(Exception):
    pass


def _step_after_one_that_raised(stage: int, kind: str) -> list:
    """An overflowed direct step that raises (a step pre-hook of the script's, after the
    engine's), then a step by a GradScaler of ``kind`` (None: a plain direct step): the
    weights that step left."""
    engine, scaler = _engine(stage), _scaler(kind)
    calls = []

    def raise_once(*_):
        calls.append(1)
        if len(calls) == 1:
            raise _RaisedOnce()
    engine.optimizer.register_step_pre_hook(raise_once)
    engine.backward(engine(_batch(_OVERFLOW_STEP)).float().pow(2).mean())
    try:
        engine.optimizer.step()
    except _RaisedOnce:
        pass
    engine.optimizer.zero_grad()
    _backward_and_step(engine, scaler, engine(_batch(0)).float().pow(2).mean())
    return _weights(engine)


def _trained() -> dict:
    return {(stage, kind): _train_through(stage, kind)
            for stage in (1, 2) for kind in (None, "torch", "sharded")}


def _stepped_after_raise() -> dict:
    return {(stage, kind): _step_after_one_that_raised(stage, kind)
            for stage in (1, 2) for kind in (None, "torch")}


def _assert_same_weights(got: list, expected: list, what) -> None:
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def test_gradscaler_stepping_the_engines_optimizer_skips_and_trains(world2):
    # was: AttributeError ('OSS' object has no attribute 'found_inf') on the skipped step
    # and "step() has already been called since the last update()" on every later one
    for out in world2.run(_trained):
        for stage in (1, 2):
            plain = out[(stage, None)]
            for kind in ("torch", "sharded"):
                scaled = out[(stage, kind)]
                assert not scaled["left"], (stage, kind)
                assert scaled["scaler_scale"] == 2.0, (stage, kind)  # backed off once
                assert scaled["loss_scale"] == plain["loss_scale"] == 2.0 ** 7, (stage, kind)
                assert scaled["skipped"] == plain["skipped"] == 1, (stage, kind)
                for got, expected in zip(scaled["weights"], plain["weights"]):
                    _assert_same_weights(got, expected, (stage, kind))
                _assert_same_weights(scaled["weights"][1], scaled["weights"][0], "skipped")


def test_gradscaler_step_after_a_direct_step_that_raised_unscales(world2):
    # was: the stale hand-off's take-back deleted the scaler's found_inf, so OSS stepped the
    # gradients scaled by 4 (and the scaler then raised AttributeError)
    for out in world2.run(_stepped_after_raise):
        for stage in (1, 2):
            _assert_same_weights(out[(stage, "torch")], out[(stage, None)], stage)
