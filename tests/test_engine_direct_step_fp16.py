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

From a review:

DeepSpeed-style engine: ``engine.optimizer.step(closure)`` called by the script.

From a review of the direct step's gradient work (the engine unscales, checks, clips and
sums the gradients before a script's own ``engine.optimizer.step()``): a closure computes the
gradients after that work, so the step refuses a closure where the work would change them.
It also refused one where the work only measures their norm (every ZeRO stage 1-3, and bf16
with ``check_grad_overflow`` false), so ``step(closure)`` of a plain fp32 run at stages 1-3,
which trained before, became a RuntimeError; and it let one through where the engine sums
sequence-parallel gradients, which it then summed before the closure recomputed them, so the
marked parameters stepped on this tensor-parallel rank's part of their gradient.

One world of 1 and one of 2 gloo ranks for the module.
"""

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.nn import model_parallel as mp
from shardkit.testing import CountedControlGathers, world_fixture
from tests.utils.master_weights import fp32_weights

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
    """At stage 0 (torch DDP): under fp16 a direct step after a boundary backward inside
    ``engine.no_sync()``, and under bf16 one after ``loss.backward()`` of the model called past
    the engine (``engine.module(x)``: DDP reduced nothing; the model's weights are bf16, so the
    script feeds it bf16 as it would a DeepSpeed engine's bf16 module)."""
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
    engine.module(_batch(0).to(torch.bfloat16)).float().pow(2).mean().backward()
    engine.optimizer.step()
    out["raw_model_weights"] = [v.clone() for v in engine.module_state_dict().values()]
    out["raw_model_masters"] = list(fp32_weights(engine).values())
    return out


def test_direct_step_refuses_or_averages_unreduced_gradients(world2):
    # was: each rank stepped on its own gradients (the ranks' weights drifted apart)
    outs = world2.run(_direct_steps_on_unreduced_gradients)
    for out in outs:
        assert out["no_sync"] is not None and out["no_sync"].startswith(
            "engine.optimizer.step(): the accumulation boundary's engine.backward(loss) ran "
            "inside engine.no_sync()"), out["no_sync"]
        assert out["no_sync_unchanged"]
    for key in ("raw_model_weights", "raw_model_masters"):  # bf16 weights, fp32 masters
        for a, b in zip(outs[0][key], outs[1][key]):
            assert torch.equal(a, b), key  # averaged as engine.step() does


_STEPS_rev = 2


def _batch_rev(step: int) -> torch.Tensor:
    seed = 10 * step + distributed.get_rank()
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))


def _engine_rev(stage: int, precision: str = "fp32", clipping: float = 0.0):
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
              "gradient_clipping": clipping}
    if precision == "bf16":
        config["bf16"] = {"enabled": True, "check_grad_overflow": False}
    return shardkit.initialize(model=_model(), config=config)[0]


def _weights(engine) -> list:
    return [v.detach().clone().float() for v in engine.module_state_dict().values()]


def _with_closure(stage: int, precision: str) -> dict:
    """``_STEPS_rev`` direct steps whose closure runs the engine's forward and backward."""
    engine = _engine_rev(stage, precision)
    for step in range(_STEPS_rev):
        def closure(step=step):
            engine.optimizer.zero_grad()
            loss = engine(_batch_rev(step)).float().pow(2).mean()
            engine.backward(loss)
            return loss
        engine.optimizer.step(closure)
    return {"weights": _weights(engine), "norm": engine.get_global_grad_norm()}


def _with_engine_step(stage: int, precision: str) -> list:
    engine = _engine_rev(stage, precision)
    for step in range(_STEPS_rev):
        engine.backward(engine(_batch_rev(step)).float().pow(2).mean())
        engine.step()
    return _weights(engine)


_PLAIN_CASES = [(1, "fp32"), (3, "fp32"), (0, "bf16")]


def _closures_where_nothing_changes_the_gradients() -> dict:
    return {case: (_with_closure(*case), _with_engine_step(*case)) for case in _PLAIN_CASES}


def test_a_closure_trains_where_the_engine_only_measures_the_gradients(world2):
    # was: "engine.optimizer.step(closure): the engine unscales, checks or clips the
    # gradients ..." on every rank, though it did neither
    outs = world2.run(_closures_where_nothing_changes_the_gradients)
    for out in outs:
        for case, (closure, engine_step) in out.items():
            for a, b in zip(closure["weights"], engine_step):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=str(case))
            assert closure["norm"] is None, case  # not the norm of the gradients replaced
    for case in _PLAIN_CASES:
        for a, b in zip(outs[0][case][0]["weights"], outs[1][case][0]["weights"]):
            assert torch.equal(a, b), case


def _refused_closure(engine, x) -> tuple:
    """The error of ``engine.optimizer.step(closure)``, and whether the weights stayed."""
    before = _weights(engine)

    def closure():
        engine.optimizer.zero_grad()
        loss = engine(x).float().pow(2).mean()
        loss.backward()
        return loss
    try:
        engine.optimizer.step(closure)
        message = None
    except RuntimeError as error:
        message = str(error)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    return message, unchanged


def _sequence_parallel_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        mp.ColumnParallelLinear(4, 8, gather_output=False, sequence_parallel=True), nn.GELU(),
        mp.RowParallelLinear(8, 4, input_is_parallel=True, sequence_parallel=True),
        nn.LayerNorm(4), nn.Linear(4, 2))
    mp.mark_sequence_parallel(model[3])
    mp.mark_sequence_parallel(model[4])
    return model


def _closures_where_the_engine_changes_the_gradients() -> dict:
    out = {"clipping": _refused_closure(_engine_rev(1, clipping=0.5), _batch_rev(0))}
    mp.initialize_model_parallel(2)
    try:
        engine = shardkit.initialize(
            model=_sequence_parallel_model(), mpu=mp.initialize,
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
                    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
        x = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))
        tp = mp.get_model_parallel_rank()
        out["sequence_parallel"] = _refused_closure(engine, x[:, 2 * tp:2 * tp + 2])
    finally:
        mp.destroy_model_parallel()
    return out


def test_a_closure_is_refused_where_the_engine_changes_the_gradients(world2):
    # was (sequence parallelism): no error; the engine summed the gradients there before
    # the step, the closure then recomputed them, and the marked parameters stepped on this
    # rank's part of their gradient (the tensor-parallel ranks' copies drifted apart)
    for out in world2.run(_closures_where_the_engine_changes_the_gradients):
        for case, reason in (("sequence_parallel", "sequence-parallel"),
                             ("clipping", "gradient_clipping=0.5")):
            message, unchanged = out[case]
            assert message is not None and message.startswith(
                "engine.optimizer.step(closure): before the step the engine"), (case, message)
            assert reason in message and "engine.step()" in message, (case, message)
            assert unchanged, case
