"""Resharding checkpoints: each rank writes whole fp32 parameters and their optimizer state by
name, committed atomically behind a ``latest`` file; they load at any world size and ZeRO stage
and consolidate into a plain ``state_dict`` (``python -m shardkit consolidate DIR OUT.pt``)."""

from shardkit._lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)
