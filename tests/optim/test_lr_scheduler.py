"""WarmupLR / WarmupDecayLR / WarmupCosineLR: DeepSpeed's formulas, step by step."""

import math

import pytest
import torch

from shardkit.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR


def _optimizer(lr=0.1, groups=1):
    params = [[torch.nn.Parameter(torch.zeros(2))] for _ in range(groups)]
    return torch.optim.SGD([{"params": p} for p in params], lr=lr)


def _lrs(scheduler, steps):
    """lr in effect for optimizer steps 1..steps (the scheduler steps after each)."""
    out = []
    for _ in range(steps):
        out.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_warmup_lr_log_matches_deepspeed_formula():
    lo, hi, n = 0.01, 0.1, 5
    s = WarmupLR(_optimizer(), warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=n)
    got = _lrs(s, 8)
    # Before the first scheduler step the optimizer holds warmup_min_lr; then iteration i
    # gives lo + (hi - lo) * log(i + 1) / log(n) while i < n.
    expected = [lo] + [lo + (hi - lo) * math.log(i + 1) / math.log(n) if i < n else hi
                       for i in range(7)]
    assert got == pytest.approx(expected)


def test_warmup_lr_linear_and_max_lr_from_optimizer():
    s = WarmupLR(_optimizer(lr=0.4), warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=4,
                 warmup_type="linear")
    assert _lrs(s, 7) == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.4])


def test_warmup_decay_returns_to_min_at_total():
    s = WarmupDecayLR(_optimizer(), total_num_steps=8, warmup_min_lr=0.0, warmup_max_lr=0.8,
                      warmup_num_steps=4, warmup_type="linear")
    got = _lrs(s, 11)
    assert got == pytest.approx([0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0])


def test_warmup_cosine_ratio():
    opt = _optimizer(lr=1.0)
    s = WarmupCosineLR(opt, total_num_steps=10, warmup_min_ratio=0.1, warmup_num_steps=2,
                       cos_min_ratio=0.0, warmup_type="linear")
    got = _lrs(s, 12)
    assert got[0] == 0.0  # DeepSpeed: lr 0 before the schedule starts
    assert got[1:3] == pytest.approx([0.1, 0.55])
    for i in range(2, 11):
        t, span = i - 2 + 1, 10 - 2
        progress = min(1.0, t / span)  # DeepSpeed holds the floor past total_num_steps
        assert got[i + 1] == pytest.approx(max(0.0, (1 + math.cos(math.pi * progress)) / 2))


def test_warmup_cosine_stays_at_the_floor_after_total_num_steps():
    # Training past total_num_steps (more epochs than planned): DeepSpeed clamps the cosine,
    # the lr stays at cos_min_ratio instead of swinging back up to the peak.
    s = WarmupCosineLR(_optimizer(lr=1.0), total_num_steps=10, warmup_num_steps=2,
                       cos_min_ratio=0.01, warmup_type="linear")
    got = _lrs(s, 30)
    assert got[10] == pytest.approx(0.01)  # iteration 9: end of the decay
    assert got[11:] == pytest.approx([0.01] * 19)


def test_warmup_lr_default_max_lr_is_each_groups_own_lr():
    # DeepSpeed's WarmupLR(warmup_max_lr=None), its default: every param group warms up to
    # the lr it was built with (a decay group and a no-decay group with their own rates).
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    opt = torch.optim.SGD([{"params": [params[0]], "lr": 0.1},
                           {"params": [params[1]], "lr": 0.01}], lr=0.5)
    s = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    for _ in range(4):
        opt.step()
        s.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.01])


def test_per_group_bounds_and_state_dict_round_trip():
    opt = _optimizer(groups=2)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=10)
    _lrs(s, 4)
    saved = s.state_dict()
    opt2 = _optimizer(groups=2)
    s2 = WarmupLR(opt2, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 0.2], warmup_num_steps=10)
    s2.load_state_dict(saved)
    assert s2.last_batch_iteration == s.last_batch_iteration == 3
    s.step(), s2.step()
    assert s.get_last_lr() == s2.get_last_lr()
    assert [g["lr"] for g in opt2.param_groups] == s2.get_last_lr()


def test_is_a_torch_lr_scheduler():
    assert isinstance(WarmupLR(_optimizer()), torch.optim.lr_scheduler.LRScheduler)


@pytest.mark.parametrize("factory, needle", [
    (lambda o: WarmupLR(o, warmup_type="cubic"), "warmup_type='cubic'"),
    (lambda o: WarmupDecayLR(o, total_num_steps=0), "total_num_steps=0"),
    (lambda o: WarmupLR(o, warmup_min_lr=[0.1, 0.2]), "one value per param group"),
])
def test_bad_arguments_are_named(factory, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        factory(_optimizer())


def test_load_state_dict_takes_the_position_and_keeps_the_new_schedule():
    # DeepSpeed saves only last_batch_iteration: a run resumed with a longer total_num_steps
    # follows the longer schedule from the saved iteration (not the saved schedule's decay).
    s = WarmupDecayLR(_optimizer(), total_num_steps=10, warmup_max_lr=0.1, warmup_num_steps=2,
                      warmup_type="linear")
    _lrs(s, 6)
    saved = s.state_dict()
    assert saved["last_batch_iteration"] == 5
    longer = WarmupDecayLR(_optimizer(), total_num_steps=20, warmup_max_lr=0.1,
                           warmup_num_steps=2, warmup_type="linear")
    longer.load_state_dict(saved)
    assert longer.last_batch_iteration == 5 and longer.total_num_steps == 20
    assert _lrs(longer, 4)[1:] == pytest.approx([0.1 * (20 - i) / 18 for i in (6, 7, 8)])
    from_deepspeed = WarmupLR(_optimizer(lr=0.4), warmup_num_steps=4, warmup_type="linear")
    from_deepspeed.load_state_dict({"last_batch_iteration": 1})  # DeepSpeed's own format
    from_deepspeed.step()
    assert from_deepspeed.optimizer.param_groups[0]["lr"] == pytest.approx(0.2)


def _one_cycle_reference(iteration, lo, hi, first, second, decay_rate, decay_size, mom_lo,
                         mom_hi, mom_rate):
    """DeepSpeed's OneCycle (deepspeed.runtime.lr_schedules) restated: (lr, beta1) at an
    iteration, written from its documented triangle and decay."""
    if iteration < 0:
        return lo, mom_lo
    total = first + second
    if iteration < total:
        n = iteration + 1
        cycle = math.floor(1 + n / total)
        x = 1.0 + n / total - cycle
        ratio = first / total
        scale = x / ratio if x <= ratio else (x - 1) / (ratio - 1)
        return lo + (hi - lo) * scale, mom_hi - (mom_hi - mom_lo) * scale
    k = iteration - total + 1
    lr = lo if not (decay_size and decay_rate) else lo / (1 + decay_rate * k / decay_size)
    mom = mom_hi if not (decay_size and mom_rate) else mom_hi * (1 + mom_rate * k / decay_size)
    return lr, mom


@pytest.mark.parametrize("first, second, decay_rate, decay_size, mom_rate", [
    (4, None, 0.0, 0, 0.0), (3, 5, 0.5, 2, 0.01), (1, 1, 1.0, 1, 0.0)])
def test_one_cycle_matches_deepspeed_formula_at_every_step(first, second, decay_rate,
                                                           decay_size, mom_rate):
    from shardkit.optim.lr_scheduler import OneCycle
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = torch.optim.AdamW(params, lr=0.5, betas=(0.9, 0.95))
    s = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=decay_rate,
                 cycle_first_step_size=first, cycle_second_step_size=second,
                 decay_step_size=decay_size, cycle_min_mom=0.85, cycle_max_mom=0.95,
                 decay_mom_rate=mom_rate)
    for iteration in range(-1, 20):
        lr, beta1 = _one_cycle_reference(iteration, 0.01, 0.1, first, second or first,
                                         decay_rate, decay_size, 0.85, 0.95, mom_rate)
        group = opt.param_groups[0]
        assert group["lr"] == pytest.approx(lr), iteration
        assert group["betas"] == pytest.approx((beta1, 0.95)), iteration
        opt.step()
        s.step()


def test_one_cycle_resumes_and_leaves_sgd_momentum_alone(caplog):
    from shardkit.optim.lr_scheduler import OneCycle
    s = OneCycle(_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4)
    _lrs(s, 3)
    resumed = OneCycle(_optimizer(), cycle_min_lr=0.0, cycle_max_lr=1.0,
                       cycle_first_step_size=4)
    resumed.load_state_dict(s.state_dict())
    assert _lrs(resumed, 4)[1:] == pytest.approx([1.0, 0.75, 0.5])  # iterations 3-5
    assert "cycle_momentum is off because SGD has no betas" in caplog.text
    resumed.step(batch_iteration=0)  # DeepSpeed's keyword (engine.step(lr_kwargs=...))
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="cycle_first_step_size=0"):
        OneCycle(_optimizer(), 0.0, 1.0, cycle_first_step_size=0)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_matches_deepspeed_formula_and_builds_from_a_config(staircase):
    # DeepSpeed's scheduler.type "LRRangeTest" was refused as "not a valid choice"
    from shardkit.config import load_config
    from shardkit.engine import _build_scheduler
    from shardkit.optim.lr_scheduler import LRRangeTest
    config = load_config({"train_batch_size": 1, "scheduler": {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": [0.01, 0.02], "lr_range_test_step_size": 3,
        "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": staircase}}}, 1)
    s = _build_scheduler(config, None, _optimizer(groups=2))
    assert isinstance(s, LRRangeTest)
    # min_lr * (1 + rate * (i + 1) / size), floored intervals in the staircase; min_lr at first
    ks = [0] + [math.floor((i + 1) / 3) if staircase else (i + 1) / 3 for i in range(7)]
    assert _lrs(s, 8) == pytest.approx([0.01 * (1 + 2.0 * k) for k in ks])
    k = 2 if staircase else 8 / 3  # iteration 7 after 8 steps
    assert s.optimizer.param_groups[1]["lr"] == pytest.approx(0.02 * (1 + 2.0 * k))
    resumed = LRRangeTest(_optimizer(groups=2), [0.01, 0.02], 3, 2.0, staircase)
    resumed.load_state_dict(s.state_dict())
    s.step()
    resumed.step()
    assert resumed.get_last_lr() == pytest.approx(s.get_last_lr())
    with pytest.raises(ValueError, match="lr_range_test_step_size=0"):
        LRRangeTest(_optimizer(), lr_range_test_step_size=0)
    resumed.step(batch_iteration=10)  # DeepSpeed's keyword for LRRangeTest.step
    k = 11 // 3 if staircase else 11 / 3
    assert resumed.get_last_lr() == pytest.approx([0.01 * (1 + 2.0 * k), 0.02 * (1 + 2.0 * k)])


def test_a_schedule_built_at_an_iteration_leaves_the_lr_until_its_first_step():
    # DeepSpeed's schedules set the optimizer's lr at construction only when
    # last_batch_iteration is -1: resumed at k, the first step runs at the optimizer's own lr
    # and the scheduler's first step() sets iteration k + 1's
    from shardkit.optim.lr_scheduler import OneCycle
    s = WarmupLR(_optimizer(lr=0.01), warmup_min_lr=0.0, warmup_max_lr=0.05,
                 warmup_num_steps=10, warmup_type="linear", last_batch_iteration=4)
    assert s.last_batch_iteration == 4
    assert _lrs(s, 3) == pytest.approx([0.01, 0.025, 0.03])
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=0.3, betas=(0.5, 0.9))
    cycle = OneCycle(adam, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4,
                     last_batch_iteration=2)
    assert adam.param_groups[0]["lr"] == 0.3 and adam.param_groups[0]["betas"] == (0.5, 0.9)
    cycle.step()
    assert adam.param_groups[0]["lr"] == pytest.approx(1.0)  # iteration 3: the peak
    tensor_lr = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.05))
    resumed = WarmupLR(tensor_lr, warmup_max_lr=0.1, warmup_num_steps=10, last_batch_iteration=5)
    assert float(tensor_lr.param_groups[0]["lr"]) == pytest.approx(0.05)  # was filled with 0
    assert resumed.get_last_lr() == pytest.approx([0.05])
    with pytest.raises(ValueError, match=r"warmup_num_steps=0\): must be an integer >= 1"):
        WarmupLR(_optimizer(), warmup_num_steps=0)
