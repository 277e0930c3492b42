"""FairScale's module path for :class:`FullyShardedDataParallel` and :class:`TrainingState`
(``from fairscale.nn.data_parallel.fully_sharded_data_parallel import ...`` becomes
``from shardkit.nn.data_parallel.fully_sharded_data_parallel import ...``); the implementation
is :mod:`shardkit.nn.data_parallel.fully_sharded`."""

from shardkit.nn.data_parallel.fully_sharded import (FullyShardedDataParallel,
                                                     MixedPrecisionPolicy, get_fsdp_instances)
from shardkit.nn.data_parallel.sharding_strategy import ShardingStrategy
from shardkit.nn.data_parallel.training_state import TrainingState

__all__ = ["FullyShardedDataParallel", "MixedPrecisionPolicy", "ShardingStrategy",
           "TrainingState", "get_fsdp_instances"]
