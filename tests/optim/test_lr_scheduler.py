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
    (lambda o: WarmupCosineLR(o, total_num_steps=5, warmup_num_steps=10), "total_num_steps=5"),
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
