"""Optimizers and loss scaling: OSS (ZeRO-1), FusedAdamW, MasterWeights (fp32 masters of 16-bit
weights), ShardedGradScaler, DynamicLossScaler,
warm-up learning-rate schedules, and the ParameterPartition that OSS and ShardedDDP share."""

from shardkit._lazy import lazy_exports

_EXPORTS = {
    "OSS": "shardkit.optim.oss",
    "ParameterPartition": "shardkit.optim.partition",
    "FusedAdamW": "shardkit.optim.fused",
    "MasterWeights": "shardkit.optim.master_weights",
    "ShardedGradScaler": "shardkit.optim.grad_scaler",
    "GradScaler": "shardkit.optim.grad_scaler",
    "DynamicLossScaler": "shardkit.optim.loss_scaler",
    "WarmupLR": "shardkit.optim.lr_scheduler",
    "WarmupDecayLR": "shardkit.optim.lr_scheduler",
    "WarmupCosineLR": "shardkit.optim.lr_scheduler",
    "OneCycle": "shardkit.optim.lr_scheduler",
    "LRRangeTest": "shardkit.optim.lr_scheduler",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
