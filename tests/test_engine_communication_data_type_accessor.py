"""``engine.communication_data_type``: DeepSpeed's engine property naming the dtype gradients
are reduced in (``deepspeed/runtime/engine.py``): the config's ``communication_data_type`` as a
torch dtype when set (``"fp32"`` included), else fp16 / bf16 under that precision, else fp32.
Scripts and DeepSpeed-style trainers read it (to log the wire, or to cast what they reduce by
hand); shardkit's engine had no such attribute, so reading it was an AttributeError."""

import pytest
import torch

import shardkit
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _reported(precision, comm, stage):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if precision is not None:
        config[precision] = {"enabled": True}
    if comm is not None:
        config["communication_data_type"] = comm
    engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config)
    return engine.communication_data_type


@pytest.mark.parametrize("precision, comm, expected", [
    (None, None, torch.float32), ("bf16", None, torch.bfloat16),
    ("fp16", None, torch.float16), ("bf16", "fp32", torch.float32),
    ("fp16", "float32", torch.float32), (None, "bf16", torch.bfloat16),
    ("bf16", "fp16", torch.float16)])
def test_communication_data_type_reports_deepspeeds_dtype(world2, precision, comm, expected):
    for stage in (0, 2):
        assert world2.run(_reported, precision, comm, stage) == [expected] * 2, stage


def _set_it():
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config)
    try:
        engine.communication_data_type = torch.float32
    except AttributeError as error:
        return str(error), engine.communication_data_type
    return None, engine.communication_data_type


def test_setting_it_says_where_the_dtype_is_chosen(world2):
    """DeepSpeed's setter changes the dtype of its later reductions; shardkit's wrappers are
    built at initialize, so the assignment is refused with the key to set, not ignored."""
    for message, dtype in world2.run(_set_it):
        assert "in the config given to initialize" in message and dtype == torch.bfloat16
