"""Resuming an engine whose optimizer groups its parameters differently from the saving one.

``load_checkpoint`` gives each of this engine's param groups the hyper-parameters of the saved
group that held its first parameter. Where one group of this engine draws its parameters from
saved groups with different hyper-parameters (saved: weights at lr 1e-2 and biases at lr 1e-3;
now one group of all parameters), the biases went on silently at the weights' lr; torch's
``Optimizer.load_state_dict`` and DeepSpeed refuse a different grouping. Now such a load is a
``CheckpointError`` on every rank before anything is loaded, naming the group, the parameters
and the hyper-parameters that differ, and ``load_optimizer_states=False``. A regrouping whose
saved groups agree on every hyper-parameter still loads (the hyper-parameters are then one
set, and each parameter's state is keyed by its name).

One world of 2 gloo ranks for the module.
"""

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.checkpoint.sharded import CheckpointError
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _groups(model, bias_lr):
    """Weights and biases in two groups (``bias_lr``), or one group when ``bias_lr`` is None."""
    if bias_lr is None:
        return [{"params": list(model.parameters()), "lr": 0.01}]
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "lr": 0.01}, {"params": biases, "lr": bias_lr}]


def _engine(stage, bias_lr):
    model = _model()
    optimizer = torch.optim.Adam(_groups(model, bias_lr))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine, *_ = shardkit.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _train(engine, steps=2):
    gen = torch.Generator().manual_seed(distributed.get_rank())
    for _ in range(steps):
        engine.backward(engine(torch.randn(2, 4, generator=gen)).float().pow(2).mean())
        engine.step()


def _weights(engine):
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


def _save_then_load(stage, saved_bias_lr, loaded_bias_lr, save_dir):
    saver = _engine(stage, saved_bias_lr)
    _train(saver)
    saver.save_checkpoint(save_dir, tag="t")
    loader = _engine(stage, loaded_bias_lr)
    before = _weights(loader)
    try:
        loader.load_checkpoint(save_dir, tag="t")
    except CheckpointError as error:
        unchanged = all(torch.equal(before[k], v) for k, v in _weights(loader).items())
        return "refused", str(error), unchanged
    lrs = [g["lr"] for g in loader.optimizer.param_groups]
    after = _weights(loader)
    same = all(torch.equal(after[k], v) for k, v in _weights(saver).items())
    _train(saver, 1)
    _train(loader, 1)
    trains_alike = max((_weights(saver)[k] - v).abs().max().item()
                       for k, v in _weights(loader).items())
    return "loaded", lrs, (same, trains_alike)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_one_group_over_saved_groups_of_other_lrs_is_refused(world2, tmp_path, stage):
    for outcome, message, unchanged in world2.run(_save_then_load, stage, 0.001, None,
                                                  str(tmp_path)):
        assert outcome == "refused", message
        assert unchanged
        for words in ("param group 0", "'lr'", "0.01", "0.001", "load_optimizer_states=False",
                      "nothing was loaded"):
            assert words in message, (words, message)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_regrouping_of_saved_groups_that_agree_still_loads(world2, tmp_path, stage):
    # saved: two groups at the same lr; now one group: one set of hyper-parameters, no change
    for outcome, lrs, (same, trains_alike) in world2.run(_save_then_load, stage, 0.01, None,
                                                         str(tmp_path)):
        assert outcome == "loaded" and lrs == [0.01]
        assert same and trains_alike < 1e-6
