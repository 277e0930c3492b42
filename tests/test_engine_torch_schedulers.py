"""DeepSpeed configs whose ``scheduler.type`` names a ``torch.optim.lr_scheduler`` class
(DeepSpeed builds ``getattr(torch.optim.lr_scheduler, type)(optimizer, **params)``), and the
loss scale that DeepSpeed's optimizers carry as ``optimizer.loss_scale`` / ``cur_scale``.

One world of 2 gloo ranks for the module; the lrs are compared with torch's scheduler on a
plain optimizer, step by step.
"""

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.testing import world_fixture
from tests.utils.master_weights import masters_of

world2 = world_fixture(2)

STEPS = 6
TORCH_SCHEDULES = [("CosineAnnealingLR", {"T_max": 4, "eta_min": 0.001}),
                   ("OneCycleLR", {"max_lr": 0.05, "total_steps": 10}),
                   ("StepLR", {"step_size": 2, "gamma": 0.5})]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _config(stage: int, **sections) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, **sections}


def _train(engine, steps: int, overflow_at=()) -> list:
    """Each step's lrs and beta1s after ``engine.step()``; inf in rank 0's loss at
    ``overflow_at``."""
    seen = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(10 * step + distributed.get_rank())
        loss = engine(torch.randn(2, 4, generator=gen)).float().pow(2).mean()
        if step in overflow_at and distributed.get_rank() == 0:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        seen.append((engine.get_lr(), [betas[0] for betas in engine.get_mom()]))
    return seen


def _torch_schedule(name: str, params: dict) -> list:
    optimizer = torch.optim.Adam([nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler = getattr(torch.optim.lr_scheduler, name)(optimizer, **params)
    seen = []
    for _ in range(STEPS):
        optimizer.step()
        scheduler.step()
        seen.append(([g["lr"] for g in optimizer.param_groups],
                     [g["betas"][0] for g in optimizer.param_groups]))
    return seen


def _torch_schedulers_from_config(stage: int):
    out = []
    for name, params in TORCH_SCHEDULES:
        engine, _, _, scheduler = shardkit.initialize(
            model=_model(), config=_config(stage, scheduler={"type": name, "params": params}))
        out.append((name, type(scheduler).__name__, _train(engine, STEPS)))
    return out


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_config_scheduler_may_be_a_torch_scheduler(world2, stage):
    # it was a ConfigError "scheduler.type='CosineAnnealingLR' is not a valid choice", where
    # DeepSpeed builds torch.optim.lr_scheduler.CosineAnnealingLR from the config
    for name, built, seen in world2.run(_torch_schedulers_from_config, stage)[0]:
        assert built == name
        expected = _torch_schedule(name, dict(TORCH_SCHEDULES)[name])
        for (lrs, moms), (lrs_ref, moms_ref) in zip(seen, expected):
            assert lrs == pytest.approx(lrs_ref, rel=1e-12) and moms == pytest.approx(moms_ref)


def test_torch_scheduler_keys_are_checked_with_the_config():
    base = {"train_batch_size": 2}
    cfg = load_config({**base, "scheduler": {"type": "StepLR", "params": {"step_size": 3}}}, 1)
    assert (cfg.scheduler.type, dict(cfg.scheduler.kwargs)) == ("StepLR", {"step_size": 3})
    with pytest.raises(ConfigError, match=r"'scheduler.params.step_sise'.*did you mean "
                                          r"'scheduler.params.step_size'"):
        load_config({**base, "scheduler": {"type": "StepLR", "params": {"step_sise": 3}}}, 1)
    with pytest.raises(ConfigError, match=r"LambdaLR is built from a function.*"
                                          r"initialize\(lr_scheduler="):
        load_config({**base, "scheduler": {"type": "LambdaLR", "params": {}}}, 1)
    with pytest.raises(ConfigError, match="did you mean 'CosineAnnealingLR'"):
        load_config({**base, "scheduler": {"type": "CosineAnnealingLr"}}, 1)


def _bad_torch_scheduler_values():
    out = []
    for optimizer, name, params in (("Adam", "OneCycleLR", {"max_lr": 0.05}),
                                    ("Adagrad", "CyclicLR", {"base_lr": 0.001, "max_lr": 0.01}),
                                    ("Adam", "StepLR", {"step_size": 0})):
        config = _config(1, scheduler={"type": name, "params": params})
        config["optimizer"]["type"] = optimizer
        try:
            shardkit.initialize(model=_model(), config=config)
            out.append("built")
        except ConfigError as error:
            out.append(str(error))
    return out


def test_torch_scheduler_values_are_refused_before_training(world2):
    # values torch checks only over an optimizer (or in step) fail in initialize, every rank
    one_cycle, cyclic, step_lr = world2.run(_bad_torch_scheduler_values)[1]
    assert "scheduler.type='OneCycleLR'" in one_cycle and "total_steps" in one_cycle
    assert "(Adagrad, 1 param group(s))" in cyclic and "momentum" in cyclic
    assert "scheduler.type='StepLR'" in step_lr and "step_size': 0" in step_lr


def _optimizer_loss_scale(stage: int):
    config = _config(stage, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, optimizer, _, _ = shardkit.initialize(model=_model(), config=config)
    seen = [(optimizer.loss_scale, optimizer.cur_scale)]
    _train(engine, 2, overflow_at=(1,))
    seen.append((optimizer.loss_scale, optimizer.cur_scale, engine.loss_scale))
    plain, plain_optimizer, _, _ = shardkit.initialize(model=_model(), config=_config(stage))
    seen.append(plain_optimizer.loss_scale)
    return seen


@pytest.mark.parametrize("stage", [0, 2])
def test_optimizer_carries_the_loss_scale_as_deepspeeds_does(world2, stage):
    # DeiT/BEiT's get_loss_scale_for_deepspeed(model) reads model.optimizer.loss_scale (else
    # cur_scale): an AttributeError here
    start, after_overflow, plain = world2.run(_optimizer_loss_scale, stage)[0]
    assert start == (256.0, 256.0)
    assert after_overflow == (128.0, 128.0, 128.0)
    assert plain == 1.0


def test_torch_scheduler_value_types_are_checked_with_the_config():
    # torch uses most values only at some later step: gamma "0.5" raised a TypeError at step 2
    # (after the optimizer had stepped), milestones ["2"] / total_iters "2" silently never
    # decayed or restored the lr, three_phase "false" ran three phases
    base = {"train_batch_size": 2}
    refused = [("StepLR", {"step_size": 2, "gamma": "0.5"}, "gamma"),
               ("MultiStepLR", {"milestones": ["2"]}, "milestones"),
               ("ConstantLR", {"factor": 0.5, "total_iters": "2"}, "total_iters"),
               ("ReduceLROnPlateau", {"cooldown": "1"}, "cooldown"),
               ("OneCycleLR", {"max_lr": 0.05, "three_phase": "false"}, "three_phase"),
               ("StepLR", {"step_size": True}, "step_size")]
    for kind, params, key in refused:
        with pytest.raises(ConfigError, match=rf"scheduler.params.{key}=.* is not valid for "
                                              rf"scheduler.type='{kind}'"):
            load_config({**base, "scheduler": {"type": kind, "params": params}}, 1)
    with pytest.raises(ConfigError, match=r"scheduler.params.scale_fn='x'.*takes a function"):
        load_config({**base, "scheduler": {"type": "CyclicLR", "params": {
            "base_lr": 0.001, "max_lr": 0.01, "scale_fn": "x"}}}, 1)
    accepted = [("CosineAnnealingLR", {"T_max": 4.0}), ("MultiStepLR", {"milestones": [2, 4]}),
                ("ReduceLROnPlateau", {"mode": "max", "min_lr": [0.0, 1e-6]}),
                ("CyclicLR", {"base_lr": [0.001], "max_lr": 0.01, "step_size_down": None,
                              "mode": "exp_range", "cycle_momentum": False}),
                ("OneCycleLR", {"max_lr": 0.05, "total_steps": 10, "three_phase": True})]
    for kind, params in accepted:
        cfg = load_config({**base, "scheduler": {"type": kind, "params": params}}, 1)
        assert dict(cfg.scheduler.kwargs) == params


class _AdamWithOwnLossScale(torch.optim.Adam):
    """An optimizer whose class defines ``loss_scale`` (read-only) and ``cur_scale`` (a method),
    as mixed-precision optimizers of other libraries do."""

    @property
    def loss_scale(self):
        return 42.0

    def cur_scale(self):
        return "own"


def _own_loss_scale_kept():
    config = {k: v for k, v in _config(0, fp16={"enabled": True, "initial_scale_power": 8})
              .items() if k != "optimizer"}
    seen = []
    for stage in (0, 3):
        model = _model()
        config["zero_optimization"] = {"stage": stage}
        engine, optimizer, _, _ = shardkit.initialize(
            model=model, optimizer=_AdamWithOwnLossScale(model.parameters(), lr=0.01),
            config=config)
        _train(engine, 1)
        # stage 0 steps the fp16 weights through fp32 masters: the optimizer returned is a
        # MasterWeights over the script's class (DeepSpeed's FP16_Optimizer wraps the script's
        # optimizer likewise) and carries the engine's loss scale; its inner optimizer, of the
        # script's class, keeps its own loss_scale and cur_scale()
        wrapper = masters_of(engine)
        own = wrapper.inner if wrapper is not None else optimizer
        published = None if wrapper is None else (optimizer is wrapper, optimizer.loss_scale,
                                                  optimizer.cur_scale)
        seen.append((type(own).__name__, own.loss_scale, own.cur_scale(), published,
                     engine.loss_scale))
    return seen


def test_optimizer_defining_its_own_loss_scale_keeps_it(world2):
    # setting optimizer.loss_scale raised "property 'loss_scale' ... has no setter" in
    # initialize at stages 0 and 3 (after the wrappers' collectives), and a float shadowed the
    # optimizer's cur_scale() method
    stage_0, stage_3 = world2.run(_own_loss_scale_kept)[0]
    assert stage_0 == ("_AdamWithOwnLossScale", 42.0, "own", (True, 256.0, 256.0), 256.0)
    assert stage_3 == ("_AdamWithOwnLossScale", 42.0, "own", None, 256.0)


def _momentum_after_scheduler_only_load(tmp: str, name: str, params: dict) -> tuple:
    """beta1 after 3 steps, 2 more steps, a save, and a load of the scheduler's state only
    (load_optimizer_states=False) into a fresh engine; and the uninterrupted run's."""
    config = _config(0, scheduler={"type": name, "params": params})
    engine, _, _, _ = shardkit.initialize(model=_model(), config=config)
    _train(engine, 3)
    engine.save_checkpoint(tmp, tag=name)
    kept = [g["betas"][0] for g in engine.optimizer.param_groups]
    fresh, _, _, _ = shardkit.initialize(model=_model(), config=config)
    fresh.load_checkpoint(tmp, tag=name, load_optimizer_states=False)
    return kept, [g["betas"][0] for g in fresh.optimizer.param_groups]


@pytest.mark.parametrize("name, params", [
    ("OneCycleLR", {"max_lr": 0.05, "total_steps": 10}),
    ("CyclicLR", {"base_lr": 0.001, "max_lr": 0.01, "step_size_up": 4})])
def test_torch_cycled_momentum_restored_without_optimizer_states(world2, tmp_path, name,
                                                                 params):
    # the lrs were set to the loaded position, beta1 kept the fresh schedule's (0.95 where
    # the uninterrupted run had 0.855)
    for kept, loaded in world2.run(_momentum_after_scheduler_only_load, str(tmp_path), name,
                                   params):
        assert loaded == pytest.approx(kept, rel=1e-12)
