"""DeepSpeed's own unit tests (tests/unit/runtime, tests/unit/checkpoint), re-expressed against
``shardkit.initialize``: what a script written for ``deepspeed.initialize`` sees when it
switches the import.

Covered (DeepSpeed file -> here): test_ds_config_dict (batch-size triple, gradient_allreduce_op,
the ``bfloat16`` name, ``--deepscale_config``), test_ds_initialize (client optimizer and
scheduler objects and callables, what ``initialize`` returns, bf16 zeroing the gradients),
test_lr_schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR and OneCycle values, stairs,
per-group lists, tensor lrs), half_precision/test_dynamic_loss_scale (overflow sequences),
test_data (dataloader_drop_last), test_multi_output_model (what ``backward`` returns),
checkpoint/test_lr_scheduler, test_latest_checkpoint, test_zero_optimizer, test_tag_validation
(save/load at stages 0-3, ``load_optimizer_states``, ``load_lr_scheduler_states``,
``client_state``, tags, ``latest``, empty ``save_dir``).

Single-process checks need no process group; engine checks run in one world of 1 rank and one
of 2 gloo ranks (started once for the module each).
"""

import argparse
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.optim.lr_scheduler import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

HIDDEN = 6

world1 = world_fixture(1)
world2 = world_fixture(2)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN))


def _adam_config(**extra):
    return {"train_batch_size": distributed.get_world_size() if distributed.is_initialized()
            else 1, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, **extra}


def _batch(step, rank=0, n=1):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, HIDDEN, generator=gen), torch.randint(0, HIDDEN, (n,), generator=gen)


def _train(engine, steps, rank=0):
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(steps * engine.gradient_accumulation_steps()):
        x, y = _batch(step, rank, micro)
        engine.backward(F.cross_entropy(engine(x).float(), y))
        engine.step()


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("batch, micro, gas, ok", [
    (32, 16, 1, True), (32, 8, 2, True), (33, 17, 2, False), (32, 18, 1, False)])
def test_batch_size_triple_at_two_ranks(batch, micro, gas, ok):
    """DeepSpeed's TestBatchConfig: any two of the three sizes give the third at 2 ranks;
    an inconsistent or indivisible set is an error naming the sizes."""
    given = [{"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": gas},
             {"train_batch_size": batch, "train_micro_batch_size_per_gpu": micro}]
    if ok:
        given += [{"train_batch_size": batch, "gradient_accumulation_steps": gas},
                  {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}]
        if gas == 1:
            given += [{"train_micro_batch_size_per_gpu": micro}, {"train_batch_size": batch}]
    else:
        given += [{"gradient_accumulation_steps": gas}]
        if gas != 1:  # gas does not divide the batch
            given += [{"train_batch_size": batch, "gradient_accumulation_steps": gas}]
    for sizes in given:
        if ok:
            cfg = load_config(sizes, 2)
            assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
                    cfg.gradient_accumulation_steps) == (batch, micro, gas), sizes
        else:
            with pytest.raises(ConfigError, match="train_batch_size|train_micro_batch_size"):
                load_config(sizes, 2)


def test_gradient_allreduce_op_is_read_as_deepspeed_reads_it():
    """DeepSpeed's gradient_allreduce_op: "mean" (default) or "sum", any case; another value
    and "sum" at stage 3 are errors naming the key."""
    assert load_config({"train_batch_size": 1}, 1).gradient_allreduce_op == "mean"
    for value, expected in (("mean", "mean"), ("SUM", "sum")):
        cfg = load_config({"train_batch_size": 1, "gradient_allreduce_op": value}, 1)
        assert cfg.gradient_allreduce_op == expected
    with pytest.raises(ConfigError, match=r"gradient_allreduce_op='max'.*\['mean', 'sum'\]"):
        load_config({"train_batch_size": 1, "gradient_allreduce_op": "max"}, 1)
    with pytest.raises(ConfigError, match="gradient_allreduce_op='sum'.*stage=3"):
        load_config({"train_batch_size": 1, "gradient_allreduce_op": "sum",
                     "zero_optimization": {"stage": 3}}, 1)


@pytest.mark.parametrize("key", ["bf16", "bfloat16"])
def test_bf16_section_under_either_name(key):
    assert load_config({"train_batch_size": 1, key: {"enabled": True}}, 1).precision.dtype \
        == "bf16"


def test_unknown_tag_validation_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="checkpoint.tag_validation='foo'"):
        load_config({"train_batch_size": 2, "checkpoint": {"tag_validation": "foo"}}, 2)


def test_scheduler_lists_and_bounds_in_the_config():
    """OneCycle's bounds may be one per param group, its second half may be empty (0), and
    WarmupCosineLR may end its schedule where the warm-up ends, as DeepSpeed accepts."""
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02],
        "cycle_min_mom": [0.8, 0.85], "cycle_second_step_size": 0,
        "cycle_first_stair_count": 2}}}, 1)
    assert cfg.scheduler.kwargs["cycle_min_lr"] == [0.001, 0.002]
    assert cfg.scheduler.kwargs["cycle_second_step_size"] == 0
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 10, "warmup_num_steps": 10}}}, 1)
    assert cfg.scheduler.kwargs["total_num_steps"] == 10
    with pytest.raises(ConfigError, match=r"cycle_max_mom=\[0.9, 1.0\] is out of range"):
        load_config({"train_batch_size": 1, "scheduler": {"type": "OneCycle", "params": {
            "cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_max_mom": [0.9, 1.0]}}}, 1)
    # fewer steps than the warm-up: accepted as DeepSpeed accepts it (the scheduler warns)
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 5, "warmup_num_steps": 10}}}, 1)
    assert cfg.scheduler.kwargs["total_num_steps"] == 5


# ----------------------------------------------------------------------------- schedulers


def _adam(lrs=(0.1,), betas=(0.9, 0.99)):
    return torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr}
                             for lr in lrs], betas=betas)


def _lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("warmup", [10, 15, 19, 33])
def test_warmup_and_decay_shapes(warmup_type, warmup):
    """DeepSpeed's TestLrSchedule: WarmupLR starts at warmup_min_lr, reaches warmup_max_lr at
    step warmup_num_steps and holds it; WarmupDecayLR then decreases to the end."""
    lrs = _lrs(WarmupLR(_adam(), warmup_min_lr=0.1, warmup_max_lr=0.2,
                        warmup_num_steps=warmup, warmup_type=warmup_type), warmup * 2)
    assert lrs[0] == 0.1 and lrs[warmup] == 0.2
    assert all(a < b for a, b in zip(lrs[:warmup - 1], lrs[1:warmup]))
    assert set(lrs[warmup:]) == {0.2}
    total = warmup * 2
    lrs = _lrs(WarmupDecayLR(_adam(), total_num_steps=total, warmup_min_lr=0.1,
                             warmup_max_lr=0.2, warmup_num_steps=warmup,
                             warmup_type=warmup_type), total)
    assert lrs[0] == 0.1 and lrs[warmup] == pytest.approx(0.2)
    assert all(a > b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))


@pytest.mark.parametrize("total, warmup, cos_min, warmup_min", [
    (100, 10, 0.1, 0.2), (200, 20, 0.1, 0.2), (500, 30, 0.0, 0.2), (600, 300, 0.1, 0.0),
    (600, 550, 0.0, 0.0)])
def test_warmup_cosine_start_peak_and_end(total, warmup, cos_min, warmup_min):
    """DeepSpeed's TestWarmupCosineLR: the lr of the first step is lr x warmup_min_ratio, of
    step warmup_num_steps-1 the lr, of step total_num_steps-1 lr x cos_min_ratio; rising,
    then falling."""
    lr = 0.0015
    lrs = _lrs(WarmupCosineLR(_adam([lr]), total_num_steps=total, warmup_min_ratio=warmup_min,
                              warmup_num_steps=warmup, cos_min_ratio=cos_min), total)
    assert abs(lrs[0] - lr * warmup_min) < 1e-7
    assert abs(lrs[warmup - 1] - lr) < 1e-7
    assert abs(lrs[total - 1] - lr * cos_min) < 1e-7
    assert all(a < b for a, b in zip(lrs[:warmup - 1], lrs[1:warmup]))
    assert all(a > b for a, b in zip(lrs[warmup - 1:total - 1], lrs[warmup:total]))


def test_warmup_cosine_with_no_decay_window_holds_the_floor():
    """total_num_steps == warmup_num_steps: accepted (DeepSpeed does); after the warm-up the
    ratio is cos_min_ratio at every step."""
    opt = _adam([0.01])
    s = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)
    for step in range(10, 15):
        s.step(step)
        assert s.ratio_at(step) == pytest.approx(0.1)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.001)


def test_warmup_schedulers_keep_each_group_lr_and_a_tensor_lr():
    """WarmupLR without warmup_max_lr warms each group up to its own lr; a tensor lr is
    filled in place (the caller's tensor keeps identity, shape and dtype)."""
    opt = _adam([0.1, 0.2])
    s = WarmupLR(opt, warmup_num_steps=10)
    s.step(10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])
    cases = [(lambda o: OneCycle(o, cycle_min_lr=0.01, cycle_max_lr=0.1,
                                 cycle_first_step_size=10, cycle_momentum=False),
              0.01, 0.01 + 0.09 * 2 / 10),
             (lambda o: WarmupLR(o, warmup_num_steps=10), 0.0, 0.1 * math.log(2) / math.log(10)),
             (lambda o: WarmupDecayLR(o, total_num_steps=100, warmup_num_steps=10,
                                      warmup_max_lr=0.1), 0.0, 0.1 * math.log(2) / math.log(10)),
             (lambda o: WarmupCosineLR(o, total_num_steps=100, warmup_num_steps=10),
              0.0, 0.1 * math.log(2) / math.log(10))]
    for build, first, second in cases:
        for shape in ((), (1,)):
            lr = torch.full(shape, 0.1, dtype=torch.float64)
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
            s = build(opt)
            assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(first)
            s.step(1)
            assert opt.param_groups[0]["lr"] is lr and lr.shape == shape
            assert lr.dtype == torch.float64 and lr.item() == pytest.approx(second)


def _one_cycle(first_stairs, steps=16, first=8, second=8, second_stairs=None):
    s = OneCycle(_adam([0.001]), cycle_min_lr=0.001, cycle_max_lr=0.01,
                 cycle_first_step_size=first, cycle_second_step_size=second,
                 cycle_first_stair_count=first_stairs, cycle_second_stair_count=second_stairs)
    return _lrs(s, steps)


def test_one_cycle_stair_counts_hold_the_lr_flat():
    """DeepSpeed's stair counts: k stairs per half hold the lr flat (0: continuous; k equal
    to the half's length: continuous again); each count applies to its own half only."""
    continuous = _one_cycle(0)
    assert len(set(continuous[:8])) == 8
    stairs = _one_cycle(2)
    assert stairs[0] == stairs[1] and len(set(stairs[:8])) < 8
    assert _one_cycle(8) == pytest.approx(continuous)
    continuous = _one_cycle(0, 31, 10, 21, 0)
    aligned = _one_cycle(10, 31, 10, 21, 21)
    assert aligned == pytest.approx(continuous) and aligned[9] == pytest.approx(0.01)
    first_only = _one_cycle(2, 31, 10, 21, 0)
    second_only = _one_cycle(0, 31, 10, 21, 3)
    assert first_only[:10] != pytest.approx(continuous[:10])
    assert first_only[10:] == pytest.approx(continuous[10:])
    assert second_only[:10] == pytest.approx(continuous[:10])
    assert second_only[10:30] != pytest.approx(continuous[10:30])


def test_one_cycle_per_group_bounds_and_empty_second_half():
    """Each group follows its own cycle_{min,max}_lr and cycle_{min,max}_mom; a zero second
    half is a rising-only cycle; bad sizes and lists of the wrong length are errors."""
    opt = _adam([0.1, 0.2])
    s = OneCycle(opt, cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.02],
                 cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95],
                 cycle_first_step_size=5, cycle_second_step_size=5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.001, 0.002])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.85])
    s.step(4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 0.02])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.8, 0.85])
    s.step(9)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.001, 0.002])
    assert [g["betas"][0] for g in opt.param_groups] == pytest.approx([0.9, 0.95])
    assert [g["betas"][1] for g in opt.param_groups] == [0.99, 0.99]
    s = OneCycle(_adam(), cycle_min_lr=0.001, cycle_max_lr=0.1, cycle_first_step_size=100,
                 cycle_second_step_size=0)
    assert s.get_last_lr() == [pytest.approx(0.001)]
    assert _lrs(s, 3)[-1] > 0.001
    for first, second in ((0, 0), (0, None), (-1, None), (0, 100), (100, -1)):
        with pytest.raises(ValueError, match="cycle_(first|second)_step_size"):
            OneCycle(_adam(), 0.001, 0.1, cycle_first_step_size=first,
                     cycle_second_step_size=second)
    for key, value in (("cycle_min_lr", [0.1] * 3), ("cycle_max_mom", [0.9, 0.95, 0.99])):
        kwargs = {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, key: value}
        with pytest.raises(ValueError, match=f"{key}=.*one value per param group"):
            OneCycle(_adam([0.1, 0.2]), **kwargs)


# ----------------------------------------------------------------------------- world of 1


def _initialize_variants():
    """DeepSpeed's TestClientOptimizer / TestConfigOptimizer / TestClientLrScheduler."""
    from torch.optim.lr_scheduler import LambdaLR
    out = {}
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    engine, returned, _, _ = shardkit.initialize(model=model, optimizer=opt,
                                                 config={"train_batch_size": 1})
    out["client"] = (returned is opt, engine.optimizer_name())
    engine, returned, _, _ = shardkit.initialize(
        model=_model(), optimizer=lambda params: torch.optim.AdamW(params),
        config={"train_batch_size": 1})
    out["callable"] = (type(returned).__name__, engine.optimizer_name())
    for params in (None, list(_model().parameters())):
        model = _model()
        engine, returned, _, _ = shardkit.initialize(
            model=model, model_parameters=None if params is None else list(model.parameters()),
            config={"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.001}}})
        out[f"config-{params is None}"] = (type(returned).__name__, engine.optimizer_name())
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = LambdaLR(opt, lambda epoch: epoch // 10)
    _, _, _, returned = shardkit.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                            config={"train_batch_size": 1})
    out["scheduler-object"] = returned is sched
    _, _, _, returned = shardkit.initialize(
        model=_model(), optimizer=lambda p: torch.optim.AdamW(p),
        lr_scheduler=lambda o: LambdaLR(o, lambda epoch: epoch // 10),
        config={"train_batch_size": 1})
    out["scheduler-callable"] = type(returned).__name__
    _, _, _, returned = shardkit.initialize(
        model=_model(), config={"train_batch_size": 1, "optimizer": {"type": "Adam"},
                                "scheduler": {"type": "WarmupLR", "params": {}}})
    out["scheduler-config"] = type(returned).__name__
    model = _model()
    other = LambdaLR(torch.optim.Adam(model.parameters()), lambda epoch: 1)
    try:  # a scheduler built on an optimizer the engine does not step
        shardkit.initialize(model=model, optimizer=lambda p: torch.optim.AdamW(p),
                            lr_scheduler=other, config={"train_batch_size": 1})
        out["foreign-scheduler"] = None
    except ConfigError as error:
        out["foreign-scheduler"] = str(error)
    return out


def _deepscale_config_and_save_dirs(tmp):
    """--deepscale_config (DeepSpeed's deprecated flag) is read; save_checkpoint refuses an
    empty or missing directory with a ValueError; load_checkpoint of a directory without
    ``latest`` is a no-op returning (None, None)."""
    path = os.path.join(tmp, "ds_config.json")
    with open(path, "w") as f:
        json.dump({"train_batch_size": 1, "optimizer": {"type": "Adam"}}, f)
    args = argparse.Namespace(deepscale_config=path, local_rank=0)
    engine, *_ = shardkit.initialize(model=_model(), args=args)
    _train(engine, 2)
    errors = []
    for save_dir in (None, ""):
        try:
            engine.save_checkpoint(save_dir)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    empty = os.path.join(tmp, "no_checkpoint_here")
    os.makedirs(empty, exist_ok=True)
    return {"steps": engine.global_steps, "errors": errors,
            "missing": engine.load_checkpoint(empty), "wrote": sorted(os.listdir(tmp))}


def _fp16_overflow_sequences():
    """DeepSpeed's dynamic loss scale tests: gradients set by hand, then engine.step(). With
    hysteresis 1 every overflow halves the scale down to min_loss_scale; with the default
    hysteresis 2 (DeepSpeed's ZeRO rule) the first overflow only spends it."""
    out = {}
    for hysteresis, floor in ((1, 1.0), (1, 2.0), (2, 1.0)):
        engine, *_ = shardkit.initialize(model=_model(), config=_adam_config(fp16={
            "enabled": True, "loss_scale": 0, "initial_scale_power": 4, "loss_scale_window": 2,
            "hysteresis": hysteresis, "min_loss_scale": floor}))
        scales = []
        for value in [float("inf"), float("-inf")] + [float("nan")] * 6:
            for p in engine.module.parameters():
                p.grad = torch.full_like(p, value)
            engine.step()
            scales.append(engine.loss_scale)
        out[(hysteresis, floor)] = (scales, engine.skipped_steps, engine.global_steps,
                                    engine.was_step_applied())
    return out


def _loss_scale_read_both_ways():
    """Megatron-DeepSpeed-style trainers log ``engine.loss_scale()`` (DeepSpeed's method);
    shardkit's scripts read ``engine.loss_scale`` as a number."""
    engine, *_ = shardkit.initialize(model=_model(), config=_adam_config(fp16={
        "enabled": True, "loss_scale": 0, "initial_scale_power": 4, "hysteresis": 1}))
    for p in engine.module.parameters():
        p.grad = torch.full_like(p, float("inf"))
    engine.step()  # an overflow halves the scale: the reading must follow it
    return (engine.loss_scale(), engine.loss_scale * 2, float(engine.optimizer.loss_scale),
            engine.optimizer.cur_scale())


class _HalvingSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A script's own scheduler class, built from the optimizer alone."""

    def __init__(self, optimizer):
        super().__init__(optimizer, lambda step: 0.5 ** step)


def _scheduler_class_as_the_callable():
    """DeepSpeed takes ``lr_scheduler=`` as a callable of the optimizer: a class is one (it was
    taken for a built scheduler and refused as "not attached to the optimizer")."""
    engine, _, _, scheduler = shardkit.initialize(model=_model(), config=_adam_config(),
                                                  lr_scheduler=_HalvingSchedule)
    for p in engine.module.parameters():
        p.grad = torch.zeros_like(p)
    engine.step()
    return type(scheduler).__name__, scheduler.optimizer is engine.optimizer, engine.get_lr()


def _multi_output_backward():
    """DeepSpeed's TestTwoOutputModel: a model returning a tuple of losses; backward of their
    sum returns the sum divided by the accumulation steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
    model.weight.data.fill_(0.1)
    engine, *_ = shardkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}})
    out = []
    for _ in range(4):
        losses = [F.cross_entropy(engine(torch.full((1, HIDDEN), x)), torch.tensor([y]))
                  for x, y in ((1.0, 1), (2.0, 2))]
        total = sum(losses)
        returned = engine.backward(total)
        engine.step()
        out.append((float(returned), float(total) / 2, [float(v) for v in losses]))
    return out, engine.global_steps


def _drop_last_and_bf16():
    """DeepSpeed's TestDataLoaderDropLast (50 samples) and TestBf16ZeRO0UnfusedOptimizer
    (after a step every gradient is None)."""
    data = torch.utils.data.TensorDataset(torch.randn(50, HIDDEN), torch.randint(0, HIDDEN, (50,)))
    out = {}
    for batch, drop in ((1, True), (4, True), (1, False), (4, False)):
        model = _model()
        engine, _, loader, _ = shardkit.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), training_data=data,
            config={"train_batch_size": batch, "dataloader_drop_last": drop})
        sizes = []
        for x, y in loader:
            engine.backward(F.cross_entropy(engine(x), y))
            engine.step()
            sizes.append(len(x))
        out[(batch, drop)] = (len(sizes), sizes[-1], engine.global_steps)
    model = _model()
    engine, *_ = shardkit.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
        config={"train_batch_size": 1, "bf16": {"enabled": True},
                "zero_optimization": {"stage": 0}})
    engine.backward(F.cross_entropy(engine(torch.randn(1, HIDDEN)).float(), torch.tensor([1])))
    had = any(p.grad is not None for p in engine.module.parameters())
    engine.step()
    out["bf16"] = (had, all(p.grad is None for p in engine.module.parameters()))
    return out


def test_initialize_returns_what_deepspeed_returns(world1):
    out = world1.run(_initialize_variants)[0]
    assert out["client"] == (True, "Adam")          # the same object; optimizer_name its class
    assert out["callable"] == ("AdamW", "AdamW")
    assert out["config-True"] == ("AdamW", "Adam") == out["config-False"]
    assert out["scheduler-object"] is True
    assert out["scheduler-callable"] == "LambdaLR"
    assert out["scheduler-config"] == "WarmupLR"
    assert "not attached to the optimizer" in out["foreign-scheduler"]


def _engine_attributes():
    """DeepSpeed engine attributes scripts read: ``get_data_types()``, ``param_names``,
    ``data_parallel_group``, ``is_compiled``, ``dump_state()`` and the dataset-kind tests."""
    import torch.distributed as dist
    out = {}
    for precision, stage in (("fp32", 0), ("bf16", 2), ("bf16", 3), ("fp16", 1)):
        cfg = {"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": stage}, "dump_state": stage == 2}
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        model = _model()
        names = [n for n, _ in model.named_parameters()]
        engine, *_ = shardkit.initialize(model=model, config=cfg)
        by_param = engine.param_names
        out[(precision, stage)] = (
            engine.get_data_types(), engine.dump_state(),
            sorted(by_param.values()) == sorted(names),
            all(by_param[p] == n for n, p in engine.module.named_parameters()),
            engine.data_parallel_group is dist.group.WORLD)
    engine, *_ = shardkit.initialize(model=_model(), config={"train_batch_size": 1})
    out["compiled"] = [engine.is_compiled]
    engine.compile()
    out["compiled"].append(engine.is_compiled)
    out["datasets"] = (engine.is_map_style_dataset([1, 2]), engine.is_map_style_dataset(iter([])),
                       engine.is_iterable_style_dataset(_Stream()),
                       engine.is_iterable_style_dataset([1]))
    return out


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_deepspeed_engine_attributes(world1):
    """They were missing (AttributeError through the engine's module forwarding)."""
    out = world1.run(_engine_attributes)[0]
    f32, f16, b16 = torch.float32, torch.float16, torch.bfloat16
    assert out[("fp32", 0)] == ((f32, f32), False, True, True, True), out
    assert out[("bf16", 2)] == ((b16, b16), True, True, True, True), out
    assert out[("bf16", 3)] == ((b16, f32), False, True, True, True), out  # fp32 shards
    assert out[("fp16", 1)] == ((f16, f16), False, True, True, True), out
    assert out["compiled"] == [False, True]
    assert out["datasets"] == (True, False, True, False)


def test_deepscale_config_and_checkpoint_dirs(world1, tmp_path):
    out = world1.run(_deepscale_config_and_save_dirs, str(tmp_path))[0]
    assert out["steps"] == 2
    assert all(e is not None and "save_dir=" in e and "non-empty directory" in e
               for e in out["errors"]), out["errors"]
    assert out["missing"] == (None, None)
    assert out["wrote"] == ["ds_config.json", "no_checkpoint_here"]


def test_fp16_overflow_sequences(world1):
    out = world1.run(_fp16_overflow_sequences)[0]
    assert out[(1, 1.0)] == ([8, 4, 2, 1, 1, 1, 1, 1], 8, 8, False)
    assert out[(1, 2.0)][0] == [8, 4, 2, 2, 2, 2, 2, 2]
    assert out[(2, 1.0)][0] == [16, 8, 4, 2, 1, 1, 1, 1]


def test_loss_scale_is_a_number_and_deepspeeds_method(world1):
    called, doubled, on_optimizer, optimizer_called = world1.run(_loss_scale_read_both_ways)[0]
    assert (called, doubled, on_optimizer, optimizer_called) == (8.0, 16.0, 8.0, 8.0)
    assert type(called) is float


def test_a_scheduler_class_is_taken_as_the_callable(world1):
    name, attached, lrs = world1.run(_scheduler_class_as_the_callable)[0]
    assert (name, attached) == ("_HalvingSchedule", True)
    assert lrs == [pytest.approx(0.00015 * 0.5)]


def test_multi_output_model_backward_returns_the_divided_loss(world1):
    out, steps = world1.run(_multi_output_backward)[0]
    assert steps == 2
    for returned, expected, losses in out:
        assert returned == pytest.approx(expected)
        assert all(math.isfinite(v) for v in losses)
    assert out[0][2] == pytest.approx([math.log(HIDDEN)] * 2, abs=1e-5)  # uniform logits


def test_dataloader_drop_last_and_bf16_zero_grad(world1):
    out = world1.run(_drop_last_and_bf16)[0]
    assert out[(1, True)] == (50, 1, 50) and out[(1, False)] == (50, 1, 50)
    assert out[(4, True)] == (12, 4, 12)
    assert out[(4, False)] == (13, 2, 13)
    assert out["bf16"] == (True, True)


# ----------------------------------------------------------------------------- world of 2


def _config_for(stage, **extra):
    return {"train_batch_size": 2, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.8, 0.999],
                                                     "eps": 1e-8, "weight_decay": 3e-7}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                         "warmup_max_lr": 0.001,
                                                         "warmup_num_steps": 1000}},
            "zero_optimization": {"stage": stage}, **extra}


def _state_of(engine):
    """Full model state, and the optimizer's per-parameter state summed over the ranks (every
    stage shards it differently; the totals are comparable)."""
    model = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    flat = []
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            state = engine.optimizer.state.get(p, {}) if hasattr(engine.optimizer, "state") \
                else {}
            flat.append(sum(float(t.double().abs().sum()) for t in state.values()
                            if torch.is_tensor(t) and t.dim() > 0))
    total = torch.tensor([sum(flat)], dtype=torch.float64)
    distributed.all_reduce(total)
    return model, float(total)


def _checkpoint_round_trips(tmp, stage):
    """DeepSpeed's checkpoint_correctness_verification: train, save (tag "1", and tag None ->
    global_step<N> + latest), load into an engine built from other weights with each
    combination of load_optimizer_states / load_lr_scheduler_states."""
    rank = distributed.get_rank()
    engine, *_ = shardkit.initialize(model=_model(0), config=_config_for(stage))
    _train(engine, 5, rank)
    trained_model, trained_optim = _state_of(engine)
    save_dir = os.path.join(tmp, f"stage{stage}")
    engine.save_checkpoint(save_dir, tag="1", client_state={"epoch": 3, "note": "x"})
    engine.save_checkpoint(save_dir)  # tag None: global_step5, and latest names it
    out = {"latest": open(os.path.join(save_dir, "latest")).read().strip(),
           "trained_sched": engine.lr_scheduler.last_batch_iteration}
    for tag in ("1", None):
        for opt_states, sched_states in ((True, True), (False, True), (False, False)):
            loaded, *_ = shardkit.initialize(model=_model(1), config=_config_for(stage))
            before = loaded.lr_scheduler.last_batch_iteration
            path, client = loaded.load_checkpoint(save_dir, tag=tag,
                                                  load_optimizer_states=opt_states,
                                                  load_lr_scheduler_states=sched_states)
            model, optim = _state_of(loaded)
            out[(tag, opt_states, sched_states)] = {
                "model": max_diff(trained_model, model),
                "optim": optim if not opt_states else abs(optim - trained_optim),
                "sched": loaded.lr_scheduler.last_batch_iteration, "sched_before": before,
                "client": client.get("epoch") if client else None,
                "path": os.path.basename(path), "steps": loaded.global_steps}
    return out


def _tag_validation(tmp):
    """DeepSpeed's TestCheckpointValidationTag: each rank passing its own tag fails with
    "Fail" on every rank (nothing written), and saves with "Warn" and "Ignore" (under rank
    0's tag, the one DeepSpeed's rank 0 writes the model into)."""
    rank = distributed.get_rank()
    out = {}
    for mode in ("FAIL", "WARN", "IGNORE"):
        engine, *_ = shardkit.initialize(model=_model(), config=_config_for(
            0, checkpoint={"tag_validation": mode}))
        save_dir = os.path.join(tmp, mode)
        try:
            engine.save_checkpoint(save_dir, tag=f"tag-{rank}")
            out[mode] = "saved"
        except Exception as error:
            out[mode] = f"{type(error).__name__}: {error}"
        out[mode + "-dir"] = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
        if out[mode] == "saved":
            path, _ = engine.load_checkpoint(save_dir)
            out[mode + "-loaded"] = os.path.basename(path)
    return out


def _allreduce_sum_parity(stage):
    """gradient_allreduce_op="sum" sums the ranks' gradients: with SGD one step at lr equals
    one step of the default mean at lr x ranks."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    finals = []
    for op, lr in (("sum", 0.05), ("mean", 0.05 * world)):
        engine, *_ = shardkit.initialize(model=_model(), config={
            "train_batch_size": 2 * world, "gradient_allreduce_op": op,
            "optimizer": {"type": "SGD", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage}})
        _train(engine, 2, rank)
        finals.append({k: v.clone() for k, v in engine.module_state_dict().items()})
    return max_diff(finals[0], finals[1])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_options_at_every_stage(world2, tmp_path, stage):
    out = world2.run(_checkpoint_round_trips, str(tmp_path), stage)
    for rank_out in out:
        assert rank_out["latest"] == "global_step5" and rank_out["trained_sched"] == 4
        for key, got in rank_out.items():
            if not isinstance(key, tuple):
                continue
            tag, opt_states, sched_states = key
            assert got["model"] == 0.0, key
            assert got["path"] == ("1" if tag == "1" else "global_step5"), key
            assert got["client"] == (3 if tag == "1" else None), key
            assert got["steps"] == 5, key
            if opt_states:
                assert got["optim"] < 1e-9, key        # the saved moments, exactly
            else:
                assert got["optim"] == 0.0, key        # a fresh optimizer: no state
            assert got["sched"] == (4 if sched_states else got["sched_before"]), key


def _consolidated_16bit_state(save_dir, stage):
    """HF-Accelerate-style stage-3 export: ``engine._zero3_consolidated_16bit_state_dict()``
    gives rank 0 what ``save_16bit_model`` writes; the stage-3 knobs read as configured."""
    engine, *_ = shardkit.initialize(model=_model(), config=_adam_config(
        bf16={"enabled": True}, zero_optimization={
            "stage": stage, "stage3_gather_16bit_weights_on_model_save": True,
            "max_live_parameters": 1234, "stage3_prefetch_bucket_size": 4321}))
    x, y = _batch(0, distributed.get_rank())
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    engine.step()
    state = engine._zero3_consolidated_16bit_state_dict()
    engine.save_16bit_model(save_dir)
    knobs = (engine.zero_gather_16bit_weights_on_model_save(), engine.zero_max_live_parameters(),
             engine.zero_prefetch_bucket_size(), engine.zero_param_persistence_threshold())
    if state is None:
        return None, knobs
    written = torch.load(os.path.join(save_dir, "pytorch_model.bin"))
    return {k: (v.dtype, torch.equal(v, written[k])) for k, v in state.items()}, knobs


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_16bit_state_dict_is_what_save_16bit_model_writes(world2, tmp_path, stage):
    (state, knobs), (other, other_knobs) = world2.run(_consolidated_16bit_state, str(tmp_path),
                                                      stage)
    assert other is None and knobs == other_knobs == (True, 1234, 4321, 100000)
    assert sorted(state) == sorted(_model().state_dict())
    assert all(v == (torch.bfloat16, True) for v in state.values())


def test_tag_validation_modes(world2, tmp_path):
    for out in world2.run(_tag_validation, str(tmp_path)):
        assert "Fail" in out["FAIL"] and "different tags" in out["FAIL"]
        assert out["FAIL-dir"] == []
        assert out["WARN"] == "saved" and out["IGNORE"] == "saved"
        # one loadable checkpoint, under rank 0's tag (not a share in each rank's directory)
        assert out["WARN-dir"] == ["latest", "tag-0", "zero_to_fp32.py"] == out["IGNORE-dir"]
        assert out["WARN-loaded"] == out["IGNORE-loaded"] == "tag-0"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_allreduce_sum_at_two_ranks(world2, stage):
    assert max(world2.run(_allreduce_sum_parity, stage)) < 1e-6


def _save_load_edge_cases(tmp, stage):
    """DeepSpeed's TestZeROSaveLoadEdgeCase in bf16: save right after initialize and load it;
    load into a fresh engine and save at once; save (and save_16bit_model) in the middle of
    an accumulation window, then finish the window."""
    rank = distributed.get_rank()
    config = {"train_batch_size": 4, "optimizer": {"type": "Adam"}, "bf16": {"enabled": True},
              "zero_optimization": {"stage": stage}}
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    first = os.path.join(tmp, f"immediate{stage}")
    engine.save_checkpoint(first)
    path, _ = engine.load_checkpoint(first, load_optimizer_states=False,
                                     load_lr_scheduler_states=False)
    _train(engine, 1, rank)
    trained = os.path.join(tmp, f"trained{stage}")
    engine.save_checkpoint(trained)
    fresh, *_ = shardkit.initialize(model=_model(1), config=config)
    fresh.load_checkpoint(trained, load_optimizer_states=False, load_lr_scheduler_states=False)
    fresh.save_checkpoint(trained)  # the loaded step again: global_step1, rewritten
    same = max_diff(engine.module_state_dict(), fresh.module_state_dict())
    accumulating, *_ = shardkit.initialize(model=_model(), config={
        **config, "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2})
    x, y = _batch(0, rank)
    accumulating.backward(F.cross_entropy(accumulating(x).float(), y))
    accumulating.step()
    middle = os.path.join(tmp, f"middle{stage}")
    accumulating.save_16bit_model(middle, "model.pt")
    accumulating.save_checkpoint(middle)
    x, y = _batch(1, rank)
    accumulating.backward(F.cross_entropy(accumulating(x).float(), y))
    accumulating.step()
    exported = torch.load(os.path.join(middle, "model.pt"), weights_only=True)
    return {"immediate": os.path.basename(path), "same": same,
            "latest": open(os.path.join(trained, "latest")).read().strip(),
            "steps": accumulating.global_steps,
            "export": sorted({str(v.dtype) for v in exported.values()}),
            "middle": sorted(os.listdir(middle))}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_save_load_edge_cases(world2, tmp_path, stage):
    for out in world2.run(_save_load_edge_cases, str(tmp_path), stage):
        assert out["immediate"] == "global_step0"
        assert out["same"] == 0.0 and out["latest"] == "global_step1"
        assert out["steps"] == 1 and out["export"] == ["torch.bfloat16"]
        assert out["middle"] == ["global_step0", "latest", "model.pt", "zero_to_fp32.py"]


def _one_cycle_groups_resume(tmp):
    """OneCycle with one momentum range per param group, resumed without the optimizer's
    state: each group's lr and beta1 are the saved position's, not group 0's."""
    def build(seed):
        model = _model(seed)
        groups = [{"params": list(model[0].parameters())},
                  {"params": list(model[2].parameters()), "lr": 0.002}]
        return shardkit.initialize(model=model, model_parameters=groups, config={
            "train_batch_size": 1, "optimizer": {"type": "Adam"},
            "scheduler": {"type": "OneCycle", "params": {
                "cycle_min_lr": [0.001, 0.002], "cycle_max_lr": [0.01, 0.02],
                "cycle_min_mom": [0.8, 0.85], "cycle_max_mom": [0.9, 0.95],
                "cycle_first_step_size": 4}}})[0]
    engine = build(0)
    _train(engine, 3)
    engine.save_checkpoint(tmp)
    fresh = build(1)
    fresh.load_checkpoint(tmp, load_optimizer_states=False)
    return [(g["lr"], g["betas"]) for g in engine.optimizer.param_groups], \
        [(g["lr"], g["betas"]) for g in fresh.optimizer.param_groups]


def test_one_cycle_group_momenta_survive_a_resume(world1, tmp_path):
    trained, resumed = world1.run(_one_cycle_groups_resume, str(tmp_path))[0]
    assert trained[0][1][0] != pytest.approx(trained[1][1][0])
    for (lr, betas), (lr2, betas2) in zip(trained, resumed):
        assert lr2 == pytest.approx(lr) and betas2 == pytest.approx(betas)


def _scheduler_and_engine_agree(stage):
    """DeepSpeed's TestSchedulerOptimizerParity: after every step the scheduler's get_lr()
    is what the engine's optimizer holds (engine.get_lr())."""
    schedules = {"WarmupLR": {"warmup_num_steps": 4}, "WarmupDecayLR": {
        "warmup_num_steps": 4, "total_num_steps": 8}, "WarmupCosineLR": {
        "warmup_num_steps": 4, "total_num_steps": 8}, "OneCycle": {
        "cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 3}}
    out = {}
    for kind, params in schedules.items():
        engine, _, _, scheduler = shardkit.initialize(model=_model(), config={
            **_adam_config(), "scheduler": {"type": kind, "params": params},
            "zero_optimization": {"stage": stage}})
        pairs = []
        for step in range(8):
            _train(engine, 1, step)
            pairs.append((scheduler.get_lr(), engine.get_lr()))
        out[kind] = pairs
    return out


@pytest.mark.parametrize("stage", [0, 1])
def test_scheduler_lr_is_the_engine_lr(world1, stage):
    for kind, pairs in world1.run(_scheduler_and_engine_agree, stage)[0].items():
        for scheduled, held in pairs:
            assert scheduled == pytest.approx(held), kind


# ----------------------------------------------------------------------------- script helpers


def test_add_config_arguments_gives_deepspeeds_options():
    parser = shardkit.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == \
        (True, "ds.json", False, None)
    assert parser.parse_args([]).deepspeed_config is None
    with pytest.raises(argparse.ArgumentError):  # the script already defines it: argparse's
        shardkit.add_config_arguments(parser)
    with pytest.raises(TypeError, match="ArgumentParser"):
        shardkit.add_config_arguments({"deepspeed_config": "ds.json"})


@pytest.mark.parametrize("kwargs, word", [
    ({"rank": 1}, "rank="), ({"world_size": 2}, "world_size="),
    ({"init_method": "tcp://x:1"}, "init_method="), ({"timeout": 30}, "timedelta")])
def test_init_distributed_refuses_what_torchrun_decides(kwargs, word):
    with pytest.raises(ValueError, match=word):
        shardkit.init_distributed(**kwargs)


def _deepspeed_script(tmp):
    """A DeepSpeed script's lines with ``import shardkit as deepspeed``: options, init,
    initialize(args=...) from the config file, a few steps; returns the final weights."""
    import datetime
    deepspeed = shardkit
    world, rank = distributed.get_world_size(), distributed.get_rank()
    path = os.path.join(tmp, "ds_config.json")
    if rank == 0:
        with open(path, "w") as f:
            json.dump(_adam_config(train_batch_size=2 * world), f)
    distributed.barrier()
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    deepspeed.init_distributed()  # idempotent, as DeepSpeed's
    out = {}
    try:
        deepspeed.init_distributed(dist_backend="nccl")
    except RuntimeError as error:
        out["other_backend"] = str(error)
    model = _model()
    engine, *_ = deepspeed.initialize(args=args, model=model,
                                      model_parameters=model.parameters())
    _train(engine, 2, rank)
    out["weights"] = {k: v.clone() for k, v in engine.module_state_dict().items()}
    out["moved"] = max_diff(out["weights"], _model().state_dict())
    return out


def test_a_deepspeed_script_runs_with_the_import_changed(world2, tmp_path):
    a, b = world2.run(_deepspeed_script, str(tmp_path))
    assert "already runs backend 'gloo'" in a["other_backend"]
    assert max_diff(a["weights"], b["weights"]) == 0.0  # ranks agree after training
    assert a["moved"] > 0.0
