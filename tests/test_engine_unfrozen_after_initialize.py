"""A parameter frozen at ``shardkit.initialize`` and made trainable later (a base layer unfrozen
for a second phase of fine-tuning): at stages 0-1 torch DDP built its reducer over the
parameters trainable then and never averages the new one's gradient, so the engine refuses it
on every rank, naming it, whatever ``ignore_unused_parameters`` says; at stage 2
ShardedDataParallel reduces it and training follows one process."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture
from tests.utils.master_weights import fp32_weights


world2 = world_fixture(2)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    return model


def _config(stage: int, precision: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


def _batch(step: int, world: int) -> tuple:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4 * world, 8, generator=gen), torch.randn(4 * world, 4, generator=gen)


def _unfreeze_after_a_step(stage: int, precision: str):
    """Two steps, the first layer unfrozen between them; returns the second backward's error
    message, or the weights and a one-process SGD run's when it trains."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model, reference = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = shardkit.initialize(model=model, optimizer=optimizer,
                                     config=_config(stage, precision))
    oracle = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        if step == 1:
            engine.module[0].requires_grad_(True)
            reference[0].requires_grad_(True)
        x, y = _batch(step, world)
        try:
            engine.backward(F.mse_loss(engine(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]))
        except RuntimeError as error:
            return str(error)
        engine.step()
        F.mse_loss(reference(x), y).backward()
        oracle.step()
        oracle.zero_grad()
    return fp32_weights(engine), dict(reference.named_parameters())


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_parameter_unfrozen_after_initialize_is_refused_under_torch_ddp(
        world2, stage, precision):
    """Each rank stepped it with its own gradient (stage 0: the replicas drifted apart; stage
    1: the owner's alone, even after ``optimizer.refresh_trainable()``)."""
    for message in world2.run(_unfreeze_after_a_step, stage, precision):
        assert isinstance(message, str), "trained without averaging the unfrozen gradients"
        assert "0.weight, 0.bias became trainable after shardkit.initialize" in message, message
        assert f"torch DDP (stage {stage})" in message and "requires_grad before" in message


def test_a_parameter_unfrozen_after_initialize_trains_at_stage_2(world2):
    for weights, reference in world2.run(_unfreeze_after_a_step, 2, "fp32"):
        for name, value in reference.items():
            assert torch.allclose(weights[name], value, atol=1e-6), name
