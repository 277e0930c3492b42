"""Data-parallel wrappers: ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3)."""

from shardkit._lazy import lazy_exports

_EXPORTS = {
    "ShardedDataParallel": "shardkit.nn.data_parallel.sharded_ddp",
    "FullyShardedDataParallel": "shardkit.nn.data_parallel.fully_sharded",
    "FSDP": "shardkit.nn.data_parallel.fully_sharded",
    "MixedPrecisionPolicy": "shardkit.nn.data_parallel.fully_sharded",
    "ShardingStrategy": "shardkit.nn.data_parallel.sharding_strategy",
    "TrainingState": "shardkit.nn.data_parallel.training_state",
    "get_fsdp_instances": "shardkit.nn.data_parallel.fully_sharded",
    "auto_wrap_bn": "shardkit.nn.wrap",
    "StateDictType": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "StateDictConfig": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "FullStateDictConfig": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "LocalStateDictConfig": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "ShardedStateDictConfig": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "OptimStateDictConfig": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "FullOptimStateDictConfig": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "StateDictSettings": "shardkit.nn.data_parallel.fsdp_state_dict_type",
    "OptimStateKeyType": "shardkit.nn.data_parallel.fsdp_state_dict_type",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
