"""DynamicLossScaler against an independent model of DeepSpeed's rules (hypothesis-driven)."""

import logging

import pytest
from hypothesis import given, settings, strategies as st

from shardkit.optim import DynamicLossScaler
from shardkit.optim.loss_scaler import LossScaleAtMinimumError, StaticLossScaler


class ReferenceRules:
    """DeepSpeed's rules restated in terms of a clean-step streak.

    - overflow: the streak restarts; with hysteresis budget left (> 1) the budget shrinks and
      the scale stays, otherwise the scale halves (not below the floor);
    - clean step: growth happens on the clean step that completes a whole number of windows
      of clean steps; growing refills the budget (with consecutive hysteresis every clean step
      refills it).
    """

    def __init__(self, scale, window, hysteresis, floor, consecutive):
        self.scale, self.window, self.hysteresis = scale, window, hysteresis
        self.floor, self.consecutive = floor, consecutive
        self.budget = hysteresis
        self.streak = 0  # clean steps since the last overflow (or the start)

    def update(self, overflow):
        if overflow:
            self.streak = 0
            if self.budget > 1:
                self.budget -= 1
            else:
                self.scale = max(self.scale / 2, self.floor)
            return
        if self.consecutive:
            self.budget = self.hysteresis
        self.streak += 1
        if self.streak % self.window == 0:
            self.scale *= 2
            self.budget = self.hysteresis


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.booleans(), max_size=120),
       power=st.integers(0, 40), window=st.integers(1, 8), hysteresis=st.integers(1, 4),
       floor_power=st.integers(0, 3), consecutive=st.booleans())
def test_scaler_follows_deepspeed_rules(steps, power, window, hysteresis, floor_power,
                                        consecutive):
    floor = 2.0 ** floor_power
    init = max(2.0 ** power, floor)
    scaler = DynamicLossScaler(init_scale=init, scale_window=window, hysteresis=hysteresis,
                               min_scale=floor, consecutive_hysteresis=consecutive)
    ref = ReferenceRules(init, window, hysteresis, floor, consecutive)
    for i, overflow in enumerate(steps):
        scaler.update_scale(overflow)
        ref.update(overflow)
        assert scaler.loss_scale == ref.scale, f"step {i} of {steps}"
        assert scaler.cur_hysteresis == ref.budget, f"step {i} of {steps}"


@settings(max_examples=50, deadline=None)
@given(steps=st.lists(st.booleans(), max_size=60), split=st.integers(0, 60))
def test_state_dict_resumes_exactly(steps, split):
    a = DynamicLossScaler(init_scale=2 ** 10, scale_window=3, hysteresis=2)
    for overflow in steps[:split]:
        a.update_scale(overflow)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    for overflow in steps[split:]:
        a.update_scale(overflow)
        b.update_scale(overflow)
        assert a.state_dict() == b.state_dict()


def test_hysteresis_delays_the_first_halving():
    s = DynamicLossScaler(init_scale=2 ** 32, hysteresis=2)
    s.update_scale(True)
    assert s.loss_scale == 2 ** 32 and s.cur_hysteresis == 1
    s.update_scale(True)
    assert s.loss_scale == 2 ** 31
    s.update_scale(True)
    assert s.loss_scale == 2 ** 30  # the budget is not refilled by overflows


def test_growth_after_window_of_clean_steps():
    s = DynamicLossScaler(init_scale=8, scale_window=3, hysteresis=1)
    s.update_scale(True)  # 4
    scales = []
    for _ in range(8):
        s.update_scale(False)
        scales.append(s.loss_scale)
    assert scales == [4, 4, 8, 8, 8, 16, 16, 16]


@pytest.mark.parametrize("window", [1, 2, 3])
def test_scale_sequence_matches_torch_grad_scaler(window):
    """hysteresis=1 is torch's GradScaler(growth_interval=window): the same scale after every
    step, overflows included (DeepSpeed grows on the step that completes a window too)."""
    import torch
    pattern = [False, True, False, False, True] + [False] * 7 + [True, False, False]
    scale, tracker = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
    ours = DynamicLossScaler(init_scale=8, scale_window=window, hysteresis=1)
    for i, overflow in enumerate(pattern):
        torch._amp_update_scale_(scale, tracker, torch.full((), float(overflow)), 2.0, 0.5,
                                 window)
        ours.update_scale(overflow)
        assert ours.loss_scale == float(scale), f"step {i} of {pattern}"


def test_min_scale_warns_and_keeps_skipping(caplog):
    s = DynamicLossScaler(init_scale=2, hysteresis=1, min_scale=1)
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        for _ in range(3):
            s.update_scale(True)
    assert s.loss_scale == 1
    assert "minimum loss scale" in caplog.text


def test_min_scale_raises_when_asked():
    s = DynamicLossScaler(init_scale=1, hysteresis=1, min_scale=1, raise_error_at_min_scale=True)
    with pytest.raises(LossScaleAtMinimumError, match="min_scale=1"):
        s.update_scale(True)


def test_static_scaler_never_changes():
    s = StaticLossScaler(128.0)
    for overflow in (True, False, True):
        s.update_scale(overflow)
    assert s.loss_scale == 128.0 and not s.dynamic


@pytest.mark.parametrize("kwargs, needle", [
    ({"init_scale": 0}, "init_scale=0"),
    ({"scale_window": 0}, "scale_window=0"),
    ({"hysteresis": 1.5}, "hysteresis=1.5"),
    ({"min_scale": -1}, "min_scale=-1"),
])
def test_bad_arguments_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DynamicLossScaler(**kwargs)
