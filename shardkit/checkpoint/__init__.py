"""Resharding checkpoints: each rank writes whole fp32 parameters and their optimizer state by
name, committed atomically behind a ``latest`` file; they load at any world size and ZeRO stage
and consolidate into a plain ``state_dict`` (``python -m shardkit consolidate DIR OUT.pt``)."""

import importlib

_EXPORTS = {
    "CheckpointError": "shardkit.checkpoint.sharded",
    "commit_checkpoint": "shardkit.checkpoint.sharded",
    "read_checkpoint": "shardkit.checkpoint.sharded",
    "read_latest_tag": "shardkit.checkpoint.sharded",
    "consolidate_checkpoint": "shardkit.checkpoint.consolidate",
    "save_engine_checkpoint": "shardkit.checkpoint.engine_state",
    "load_engine_checkpoint": "shardkit.checkpoint.engine_state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardkit.checkpoint' has no attribute {name!r}")
