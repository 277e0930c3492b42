"""Data-parallel wrappers: ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3)."""

import importlib

_EXPORTS = {
    "ShardedDataParallel": "shardkit.nn.data_parallel.sharded_ddp",
    "FullyShardedDataParallel": "shardkit.nn.data_parallel.fully_sharded",
    "FSDP": "shardkit.nn.data_parallel.fully_sharded",
    "MixedPrecisionPolicy": "shardkit.nn.data_parallel.fully_sharded",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardkit.nn.data_parallel' has no attribute {name!r}")
