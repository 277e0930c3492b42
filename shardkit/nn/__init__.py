"""Module wrappers: data parallel (ShardedDataParallel, FullyShardedDataParallel), Pipe,
model (tensor) parallel layers, activation checkpointing and auto-wrapping."""

from shardkit._lazy import lazy_exports

_EXPORTS = {
    "Pipe": "shardkit.nn.pipe",
    "ShardedDataParallel": "shardkit.nn.data_parallel.sharded_ddp",
    "FullyShardedDataParallel": "shardkit.nn.data_parallel.fully_sharded",
    "FSDP": "shardkit.nn.data_parallel.fully_sharded",
    "ShardingStrategy": "shardkit.nn.data_parallel.sharding_strategy",
    "checkpoint_wrapper": "shardkit.nn.checkpoint",
    "apply_activation_checkpointing": "shardkit.nn.checkpoint",
    "no_split_modules_policy": "shardkit.nn.wrap",
    "auto_wrap": "shardkit.nn.wrap",
    "enable_wrap": "shardkit.nn.wrap",
    "wrap": "shardkit.nn.wrap",
    "default_auto_wrap_policy": "shardkit.nn.wrap",
    "config_auto_wrap_policy": "shardkit.nn.wrap",
    "transformer_auto_wrap_policy": "shardkit.nn.wrap",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
