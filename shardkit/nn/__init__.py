"""Module wrappers: data parallel (ShardedDataParallel, FullyShardedDataParallel), Pipe,
model (tensor) parallel layers, activation checkpointing and auto-wrapping."""

import importlib

_EXPORTS = {
    "Pipe": "shardkit.nn.pipe",
    "ShardedDataParallel": "shardkit.nn.data_parallel.sharded_ddp",
    "FullyShardedDataParallel": "shardkit.nn.data_parallel.fully_sharded",
    "FSDP": "shardkit.nn.data_parallel.fully_sharded",
    "checkpoint_wrapper": "shardkit.nn.checkpoint",
    "auto_wrap": "shardkit.nn.wrap",
    "enable_wrap": "shardkit.nn.wrap",
    "wrap": "shardkit.nn.wrap",
    "default_auto_wrap_policy": "shardkit.nn.wrap",
    "transformer_auto_wrap_policy": "shardkit.nn.wrap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardkit.nn' has no attribute {name!r}")
