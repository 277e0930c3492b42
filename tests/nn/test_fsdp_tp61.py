"""FSDP over ranks of one tensor-parallel group (review of hunt 61).

A user who wraps a model of Megatron-style layers in FSDP over the default group (the whole
world, tensor-parallel ranks included) got FSDP shards mixing the tensor-parallel ranks'
different slices of each layer: wrong weights, with no error (the full state dict was 1.1 off).
Now every rank of the group refuses it, before any collective of the unit, naming the ranks and
the data-parallel group to pass instead; over the data-parallel group it trains as before.
"""

import torch
import torch.nn as nn

from shardkit.nn import model_parallel as mp
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture

world4 = world_fixture(4)


def _tp_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(mp.ColumnParallelLinear(8, 16, gather_output=False), nn.GELU(),
                         mp.RowParallelLinear(16, 8, input_is_parallel=True))


def _wrap_over_world_then_over_data_parallel_group() -> tuple:
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(2)
    try:
        try:
            FSDP(_tp_model())
            refused = None
        except ValueError as error:
            refused = str(error)
        plain = FSDP(nn.Linear(8, 8))  # no tensor-parallel parameters: the world is fine
        dp = FSDP(_tp_model(), process_group=mp.get_data_parallel_group())
        dp(torch.randn(4, 8)).sum().backward()
        grads = sum(p.grad is not None for p in dp.parameters())
        return refused, plain is not None, grads
    finally:
        mp.destroy_model_parallel()


def test_fsdp_over_ranks_of_one_tensor_parallel_group_is_refused_on_every_rank(world4):
    for rank, (refused, plain, grads) in enumerate(world4.run(
            _wrap_over_world_then_over_data_parallel_group)):
        mates = [0, 1] if rank < 2 else [2, 3]
        assert refused is not None and f"holds ranks {mates} of one tensor-parallel group" \
            in refused, (rank, refused)
        assert "process_group=shardkit.nn.model_parallel.get_data_parallel_group()" in refused
        assert plain and grads > 0, (rank, plain, grads)
