"""DeepSpeed-style engine: the script's own ``engine.optimizer.step()`` under fp16 loss scaling,
bf16 and ``gradient_clipping`` trains as ``engine.step()`` does.

From a review: after ``engine.backward(loss)`` under ``"fp16": {"enabled": true}``, a direct
``engine.optimizer.step()`` stepped on gradients still multiplied by the loss scale (an SGD
update ``scale`` times too big), applied an overflowed step (every weight NaN on every rank)
where ``engine.step()`` skips it and backs the scale off, and never clipped. As DeepSpeed's
fp16, bf16 and ZeRO optimizers do in their ``step``, the direct step now agrees on overflow,
skips it everywhere, unscales and clips first: step by step the same weights, loss scale and
skipped steps as ``engine.step()``, with the same control exchanges (one all-gather).
The rest of ``engine.step()``'s boundary checks come with it: gradients of a backward inside
``engine.no_sync()`` are refused, those of a model called past the engine averaged (each rank
stepped on its own before); and a closure, which would recompute the gradients after their
unscaling, is refused before anything is applied.

One world of 1 and one of 2 gloo ranks for the module.
"""

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.testing import CountedControlGathers, world_fixture

world1 = world_fixture(1)
world2 = world_fixture(2, timeout=120)

_STEPS = 4
_OVERFLOW_STEP = 1  # the last rank's batch holds an inf at this step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _batch(step: int) -> torch.Tensor:
    rank = distributed.get_rank()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
    if step == _OVERFLOW_STEP and rank == distributed.get_world_size() - 1:
        x[0, 0] = float("inf")  # this rank alone overflows: the skip must be agreed
    return x


def _engine(stage: int, precision: str, clipping: float):
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              # plain SGD: an update off by the loss scale shows in the weights
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "gradient_clipping": clipping,
              precision: {"enabled": True}}
    if precision == "fp16":
        config["fp16"].update(initial_scale_power=8, hysteresis=1, loss_scale_window=2)
    return shardkit.initialize(model=_model(), config=config)[0]


def _train(stage: int, precision: str, clipping: float, direct: bool) -> dict:
    """``_STEPS`` steps of ``engine.backward(loss)`` then ``engine.step()``, or the script's own
    ``engine.optimizer.step()`` and ``zero_grad()`` (``direct``); after each: the weights, the
    loss scale, the skipped steps and the control gathers of the step."""
    engine = _engine(stage, precision, clipping)
    history = []
    for step in range(_STEPS):
        loss = engine(_batch(step)).float().pow(2).mean()
        engine.backward(loss)
        with CountedControlGathers() as counted:
            if direct:
                engine.optimizer.step()
                engine.optimizer.zero_grad()
            else:
                engine.step()
        weights = [v.clone() for v in engine.module_state_dict().values()]  # (full at stage 3)
        history.append({"weights": weights,
                        "scale": float(engine.loss_scale), "skipped": engine.skipped_steps,
                        "applied": engine.was_step_applied(), "gathers": counted.names})
    return history


_CASES = [(stage, precision, clipping) for stage in (0, 1, 2, 3)
          for precision, clipping in (("fp16", 0.0), ("fp16", 0.05), ("bf16", 0.05))]


def _direct_and_engine_steps() -> dict:
    return {case: (_train(*case, direct=True), _train(*case, direct=False)) for case in _CASES}


def _assert_direct_steps_as_engine_steps(outs: list) -> None:
    for out in outs:
        for case, (direct, engine) in out.items():
            for step, (mine, theirs) in enumerate(zip(direct, engine)):
                where = (case, step)
                assert all(torch.isfinite(w).all() for w in mine["weights"]), where
                for a, b in zip(mine["weights"], theirs["weights"]):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=str(where))
                assert mine["scale"] == theirs["scale"], where
                assert mine["skipped"] == theirs["skipped"], where
                assert mine["applied"] == theirs["applied"], where
                assert len(mine["gathers"]) == len(theirs["gathers"]), (where, mine["gathers"])
            assert direct[_OVERFLOW_STEP]["skipped"] == 1, case  # the inf step was skipped
            before, skipped = direct[_OVERFLOW_STEP - 1], direct[_OVERFLOW_STEP]
            assert all(torch.equal(a, b) for a, b in zip(before["weights"], skipped["weights"]))


def test_direct_step_trains_as_engine_step_in_world_of_2(world2):
    # was: NaN in every weight after the overflowed step on every rank, and fp16 updates
    # scaled by the loss scale before it
    outs = world2.run(_direct_and_engine_steps)
    _assert_direct_steps_as_engine_steps(outs)
    for case in _CASES:  # the ranks stepped alike
        for a, b in zip(outs[0][case][0][-1]["weights"], outs[1][case][0][-1]["weights"]):
            assert torch.equal(a, b), case


def test_direct_step_trains_as_engine_step_in_world_of_1(world1):
    _assert_direct_steps_as_engine_steps(world1.run(_direct_and_engine_steps))


def _closure_steps() -> tuple:
    """A direct step with a closure under fp16: refused before anything is applied."""
    engine = _engine(1, "fp16", 0.0)
    engine.backward(engine(_batch(0)).float().pow(2).mean())
    before = [p.detach().clone() for p in engine.module.parameters()]
    grads = [p.grad.clone() for p in engine.module.parameters()]
    try:
        engine.optimizer.step(lambda: None)
        message = None
    except RuntimeError as error:
        message = str(error)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters())) \
        and all(torch.equal(g, p.grad) for g, p in zip(grads, engine.module.parameters()))
    engine.step()  # the ranks go on together
    return message, unchanged, engine.global_steps


def test_direct_step_with_closure_under_fp16_is_refused(world2):
    for message, unchanged, steps in world2.run(_closure_steps):
        assert message is not None and "engine.step()" in message and "closure" in message
        assert unchanged  # neither weights nor gradients touched
        assert steps == 1


def _direct_steps_on_unreduced_gradients() -> dict:
    """At stage 0 (torch DDP), fp32: a direct step after a boundary backward inside
    ``engine.no_sync()``, and one after ``loss.backward()`` of the model called past the
    engine (``engine.module(x)``: DDP reduced nothing)."""
    out = {}
    engine = _engine(0, "fp16", 0.0)
    before = [v.clone() for v in engine.module_state_dict().values()]
    with engine.no_sync():
        engine.backward(engine(_batch(0)).float().pow(2).mean())
    try:
        engine.optimizer.step()
        out["no_sync"] = None
    except RuntimeError as error:
        out["no_sync"] = str(error)
    out["no_sync_unchanged"] = all(
        torch.equal(a, b) for a, b in zip(before, engine.module_state_dict().values()))
    engine = _engine(0, "bf16", 0.0)
    engine.module(_batch(0)).float().pow(2).mean().backward()
    engine.optimizer.step()
    out["raw_model_weights"] = [v.clone() for v in engine.module_state_dict().values()]
    return out


def test_direct_step_refuses_or_averages_unreduced_gradients(world2):
    # was: each rank stepped on its own gradients (the ranks' weights drifted apart)
    outs = world2.run(_direct_steps_on_unreduced_gradients)
    for out in outs:
        assert out["no_sync"] is not None and out["no_sync"].startswith(
            "engine.optimizer.step(): the accumulation boundary's engine.backward(loss) ran "
            "inside engine.no_sync()"), out["no_sync"]
        assert out["no_sync_unchanged"]
    for a, b in zip(outs[0]["raw_model_weights"], outs[1]["raw_model_weights"]):
        assert torch.equal(a, b)  # averaged as engine.step() does
