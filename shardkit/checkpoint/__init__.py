"""Every checkpoint path of shardkit, in one package.

- :mod:`~shardkit.checkpoint.sharded`: the one on-disk format (each rank writes whole fp32
  parameters and their optimizer state by name, or its row blocks at stage 3, committed
  atomically behind a ``latest`` file); :mod:`~shardkit.checkpoint.engine_state` maps an
  ``initialize`` engine of any stage onto it, :mod:`~shardkit.checkpoint.async_save` writes it
  in the background, :mod:`~shardkit.checkpoint.consolidate` turns it into a plain
  ``state_dict`` (``python -m shardkit consolidate DIR OUT.pt``);
  :mod:`~shardkit.checkpoint.file_writes` writes their files so that a full disk is an
  ``OSError`` saying so.
- :mod:`~shardkit.checkpoint.resharding`: the one row-block cut and join, used by FSDP's shards,
  its local state dicts and optimizer state, and the on-disk row blocks.
- :mod:`~shardkit.checkpoint.fsdp_state`: FSDP's local state dicts (metadata, offline
  consolidation, resharding, also of the local optimizer state dicts saved beside them) and its
  full optimizer state dicts (gather, cut);
  :mod:`~shardkit.checkpoint.optimizer_state`: OSS's full torch-format optimizer state dict
  (consolidate, load).
- :mod:`~shardkit.checkpoint.dtensor_state`: FSDP's row blocks as ``Shard(0)`` DTensors for
  ``torch.distributed.checkpoint`` (``SHARDED_STATE_DICT``), and ``init_optimizer_state`` for a
  fresh optimizer that ``dcp.load`` fills.
- :mod:`~shardkit.checkpoint.torch_state_dict` (also as ``shardkit.checkpoint.state_dict``):
  torch's ``get_state_dict`` / ``set_state_dict`` family and ``StateDictOptions`` over
  shardkit's FSDP (DTensors for dcp, or full tensors), and ``mark_sharded_state_for_dcp``.
"""

from shardkit._lazy import lazy_exports

_EXPORTS = {
    "CheckpointError": "shardkit.checkpoint.sharded",
    "commit_checkpoint": "shardkit.checkpoint.sharded",
    "read_checkpoint": "shardkit.checkpoint.sharded",
    "read_latest_tag": "shardkit.checkpoint.sharded",
    "consolidate_checkpoint": "shardkit.checkpoint.consolidate",
    "save_engine_checkpoint": "shardkit.checkpoint.engine_state",
    "load_engine_checkpoint": "shardkit.checkpoint.engine_state",
    "init_optimizer_state": "shardkit.checkpoint.dtensor_state",
    "ParamLayout": "shardkit.checkpoint.resharding",
    "shard_rows": "shardkit.checkpoint.resharding",
    "unshard_rows": "shardkit.checkpoint.resharding",
    "consolidate_shard_weights": "shardkit.checkpoint.fsdp_state",
    "reshard_local_state_dicts": "shardkit.checkpoint.fsdp_state",
    "reshard_local_optim_state_dicts": "shardkit.checkpoint.fsdp_state",
    "consolidate_optimizer_state": "shardkit.checkpoint.optimizer_state",
    "StateDictOptions": "shardkit.checkpoint.torch_state_dict",
    "get_model_state_dict": "shardkit.checkpoint.torch_state_dict",
    "get_optimizer_state_dict": "shardkit.checkpoint.torch_state_dict",
    "get_state_dict": "shardkit.checkpoint.torch_state_dict",
    "set_model_state_dict": "shardkit.checkpoint.torch_state_dict",
    "set_optimizer_state_dict": "shardkit.checkpoint.torch_state_dict",
    "set_state_dict": "shardkit.checkpoint.torch_state_dict",
    "mark_sharded_state_for_dcp": "shardkit.checkpoint.torch_state_dict",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
