"""A second world in the same process: after the default group is torn down (shardkit's
``distributed.destroy`` or torch's ``destroy_process_group``) and initialised again, nothing
shardkit cached for the first world (NO_SHARD's groups, the transport's lanes, the async
checkpoint group) is handed out again: each would raise "Group ... is not registered"."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from shardkit import distributed as skdist
from shardkit.checkpoint.async_save import checkpoint_group
from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardingStrategy
from shardkit.testing import World
from shardkit.transport import default_transport


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout=120) as world:
        yield world


def _use_cached_groups() -> list:
    """A NO_SHARD unit's step, an all-gather on the transport's lanes and a barrier on the
    async checkpoint group; what each rank ends up with."""
    torch.manual_seed(0)
    unit = FullyShardedDataParallel(torch.nn.Linear(4, 4),
                                    sharding_strategy=ShardingStrategy.NO_SHARD)
    unit(torch.full((2, 4), float(skdist.get_rank() + 1))).sum().backward()
    transport = default_transport()
    transport.prepare(None)
    gathered = torch.zeros(4)
    transport.all_gather(gathered, torch.full((2,), float(skdist.get_rank())), None).wait()
    dist.barrier(group=checkpoint_group())
    return [unit.module.weight.grad.sum().item(), gathered.tolist()]


def _restart(path: str, how: str) -> list:
    first = _use_cached_groups()
    rank, size = skdist.get_rank(), skdist.get_world_size()
    if how == "shardkit":
        skdist.destroy()
    else:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=size)
    return [first, _use_cached_groups()]


@pytest.mark.parametrize("how", ["shardkit", "torch"])
def test_a_second_world_in_the_process_gets_groups_of_its_own(world2, how):
    path = os.path.join(tempfile.mkdtemp(), "store")
    for first, second in world2.run(_restart, path, how):
        assert second == first
        assert first[1] == [0.0, 0.0, 1.0, 1.0]


def _tensor_parallel_restart(path: str, how: str) -> list:
    """initialize_model_parallel in the first world; in the second, its groups are gone (they
    survived and every tensor-parallel layer failed at forward with "Process group ... is not
    initialized in the world group map", and initialize_model_parallel refused to run again)."""
    from shardkit.nn import model_parallel as mp
    mp.initialize_model_parallel(2)
    rank, size = skdist.get_rank(), skdist.get_world_size()
    skdist.destroy() if how == "shardkit" else dist.destroy_process_group()
    dist.init_process_group("gloo", init_method="file://" + path, rank=rank, world_size=size)
    seen = [mp.model_parallel_is_initialized()]
    try:
        mp.get_model_parallel_group()
    except RuntimeError as error:
        seen.append(str(error))
    mp.initialize_model_parallel(2)
    torch.manual_seed(0)
    layer = mp.ColumnParallelLinear(4, 4, gather_output=True)
    seen.append(tuple(layer(torch.ones(2, 4)).shape))
    mp.destroy_model_parallel()
    return seen


@pytest.mark.parametrize("how", ["shardkit", "torch"])
def test_tensor_parallel_groups_of_a_torn_down_world_are_forgotten(world2, how):
    path = os.path.join(tempfile.mkdtemp(), "store")
    for initialized, error, shape in world2.run(_tensor_parallel_restart, path, how):
        assert initialized is False
        assert "needs the model-parallel groups" in error
        assert shape == (2, 4)
