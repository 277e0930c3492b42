"""torch FSDP1's documented way to load a ``SHARDED_STATE_DICT`` optimizer checkpoint.

torch's ``FSDP.optim_state_dict_to_load`` docstring and its ``fsdp_checkpoint_example`` load the
model with ``dcp.load`` and the optimizer state with
``torch.distributed.checkpoint.optimizer.load_sharded_optimizer_state_dict``, which fills
``ShardedTensor``s (torch.chunk's cut of dim 0 over the default group), not DTensors. That dict
goes to ``FSDP.optim_state_dict_to_load`` as is: it failed ("torch function 'reshape' ... not
supported for ShardedTensor!"). Checked here against one process trained on the global batch:
two steps, a save at world 2, a load into a fresh model (another seed) and two more steps.
Rows that do not divide 2 (padded shards). One World(2).
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

from shardkit import distributed as skd
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import StateDictType
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))


def _batch(step: int):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


def _step(model, optim, step: int, sharded: bool) -> None:
    x, y = _batch(step)
    if sharded:
        rank, world = skd.get_rank(), skd.get_world_size()
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    optim.zero_grad()
    F.mse_loss(model(x), y).backward()
    optim.step()


def _wrapped(seed: int):
    model = _net(seed)
    model[0] = FSDP(model[0])
    model = FSDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _torch_example_round_trip(folder: str) -> float:
    reference = _net(0)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model, optim = _wrapped(0)
    for step in range(2):
        _step(reference, ref_optim, step, sharded=False)
        _step(model, optim, step, sharded=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
                 checkpoint_id=folder)

    model, optim = _wrapped(5)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        optim_state = load_sharded_optimizer_state_dict(
            model_state_dict=state["model"], optimizer_key="optim",
            storage_reader=dcp.FileSystemReader(folder))
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, optim_state["optim"]))
    for step in range(2, 4):
        _step(reference, ref_optim, step, sharded=False)
        _step(model, optim, step, sharded=True)
    with FSDP.summon_full_params(model):
        full = copy.deepcopy(model.module.state_dict())
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def test_load_sharded_optimizer_state_dict_as_torch_documents(world2, tmp_path):
    worst = world2.run(_torch_example_round_trip, str(tmp_path))
    assert worst == [pytest.approx(0.0, abs=1e-6)] * 2
