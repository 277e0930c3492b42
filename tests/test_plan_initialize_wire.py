"""``plan``'s stage-1 line for ``shardkit.initialize`` (``reduce_to_owners_hook``, DeepSpeed's
default ``reduce_scatter: true``) against what such an engine's ``CommCounter`` measures, in fp32
and in bf16 (16-bit weights and gradients at stages 0-2, fp32 masters in the optimizer)."""

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed, plan
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _stage1_wire(dtype_key):
    """(Ψ, bytes this rank sent in the second step) of an ``initialize`` stage-1 engine."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    config = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}}
    if dtype_key:
        config[dtype_key] = {"enabled": True}
    engine, *_ = shardkit.initialize(model=model, config=config)
    dtype = next(engine.module.parameters()).dtype
    x = torch.randn(2, 64, dtype=dtype)
    for _ in range(2):  # the second step is counted: the first may build buckets
        with distributed.CommCounter() as comm:
            engine.backward(engine(x).float().pow(2).mean())
            engine.step()
    return sum(p.numel() for p in model.parameters()), comm.bytes


@pytest.mark.parametrize("dtype_key", [None, "bf16"])
def test_plan_stage1_owners_line_matches_initialize(world2, dtype_key):
    precision = plan.precision_for("adamw", mixed_precision=dtype_key is not None)
    for psi, measured in world2.run(_stage1_wire, dtype_key):
        planned = plan.stage1_owners_traffic(psi, 2, precision)
        # OSS's sync buckets pad at most 3%; one small all-reduce (the step's agreement) rides
        assert planned <= measured <= planned * 1.03 + 64, (dtype_key, planned, measured)
