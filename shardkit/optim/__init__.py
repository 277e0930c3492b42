"""Optimizers and loss scaling: OSS (ZeRO-1), FusedAdamW, ShardedGradScaler, DynamicLossScaler,
warm-up learning-rate schedules, and the ParameterPartition that OSS and ShardedDDP share."""

import importlib

_EXPORTS = {
    "OSS": "shardkit.optim.oss",
    "ParameterPartition": "shardkit.optim.partition",
    "FusedAdamW": "shardkit.optim.fused",
    "ShardedGradScaler": "shardkit.optim.grad_scaler",
    "DynamicLossScaler": "shardkit.optim.loss_scaler",
    "WarmupLR": "shardkit.optim.lr_scheduler",
    "WarmupDecayLR": "shardkit.optim.lr_scheduler",
    "WarmupCosineLR": "shardkit.optim.lr_scheduler",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardkit.optim' has no attribute {name!r}")
