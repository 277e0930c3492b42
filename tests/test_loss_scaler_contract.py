"""DESIGN.md's promises for ``DynamicLossScaler``, checked as a DeepSpeed user writes them.

- ``raise_error_at_min_scale=False`` (the default): an overflow at ``min_scale`` *warns* (a
  Python warning that ``pytest.warns`` / ``warnings.catch_warnings`` see, not only a log line)
  and keeps skipping, the scale staying at its floor.
- DeepSpeed's scaler calls ``scale_loss``, ``backward`` and ``has_overflow_serial`` exist and
  do what DeepSpeed's do, on the dynamic and the static scaler.
"""

import logging
import time
import warnings

import pytest
import torch

from shardkit.optim import DynamicLossScaler, loss_scaler
from shardkit.optim.loss_scaler import LossScaleAtMinimumError, StaticLossScaler


def _at_floor() -> DynamicLossScaler:
    """A scaler one overflow above its floor, with the documented default for raising."""
    return DynamicLossScaler(init_scale=2, hysteresis=1, min_scale=1)


@pytest.mark.parametrize("category", [UserWarning, RuntimeWarning, "LossScaleAtMinimumWarning"])
def test_overflow_at_min_scale_warns_and_keeps_skipping(category):
    if isinstance(category, str):  # the specific class, for filters that name it
        category = getattr(loss_scaler, category)
    scaler = _at_floor()
    scaler.update_scale(True)  # 2 -> 1: no warning yet
    assert scaler.loss_scale == 1
    for _ in range(3):
        with pytest.warns(category, match=r"minimum loss scale 1\b.*skipping step"):
            scaler.update_scale(True)
        assert scaler.loss_scale == 1
    scaler.update_scale(False)  # training goes on: a clean step is counted as usual
    assert scaler.cur_iter == 5 and scaler.loss_scale == 1


def test_overflow_at_min_scale_still_logs(caplog):
    scaler = _at_floor()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            scaler.update_scale(True)
            scaler.update_scale(True)
    assert "minimum loss scale" in caplog.text


def test_raise_error_at_min_scale_raises_instead_of_warning():
    scaler = DynamicLossScaler(init_scale=1, hysteresis=1, min_scale=1,
                               raise_error_at_min_scale=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning here would be an error too
        with pytest.raises(LossScaleAtMinimumError, match="min_scale=1"):
            scaler.update_scale(True)


def test_no_warning_above_the_floor():
    scaler = DynamicLossScaler(init_scale=8, hysteresis=2, min_scale=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):  # hysteresis, then 8 -> 4 -> 2 -> 1: never at the floor yet
            scaler.update_scale(True)
    assert scaler.loss_scale == 1


@pytest.mark.parametrize("scaler", [DynamicLossScaler(init_scale=8), StaticLossScaler(8)],
                         ids=["dynamic", "static"])
def test_deepspeed_scaler_calls(scaler):
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    reference = torch.nn.Linear(3, 2)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(4, 3)

    loss = layer(x).pow(2).sum()
    assert torch.equal(scaler.scale_loss(loss), loss * 8)
    scaler.backward(loss)
    reference(x).pow(2).sum().backward()
    for p, q in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad * 8)

    assert not scaler.has_overflow_serial(layer.parameters())
    assert not scaler.has_overflow_serial([torch.nn.Parameter(torch.ones(2))])  # no grad
    layer.bias.grad[0] = float("nan")
    assert scaler.has_overflow_serial(layer.parameters())
    layer.bias.grad[0] = float("-inf")
    assert scaler.has_overflow_serial(layer.parameters())


def test_backward_keeps_the_graph_when_asked():
    scaler = DynamicLossScaler(init_scale=2)
    w = torch.ones(2, requires_grad=True)
    loss = (w * w).sum()
    scaler.backward(loss, retain_graph=True)
    scaler.backward(loss)  # the graph survived the first backward
    torch.testing.assert_close(w.grad, torch.full((2,), 8.0))  # 2 x (2 x d(w^2)/dw)


def test_world_run_refuses_a_function_it_cannot_send_at_once():
    # the queues' feeder thread printed the pickling error and every rank waited out the
    # world's timeout (200-240 s), reported as hung
    from shardkit.testing import World
    started = time.monotonic()
    with pytest.raises(TypeError, match=r"World.run\(.*cannot be sent to the ranks"):
        World(2).run(lambda: 1)
    assert time.monotonic() - started < 5
