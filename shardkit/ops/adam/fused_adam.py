"""DeepSpeed's module path ``deepspeed.ops.adam.fused_adam``: :class:`FusedAdam` (defined in
:mod:`shardkit.ops.adam`), so ``from shardkit.ops.adam.fused_adam import FusedAdam`` works as
DeepSpeed scripts write it."""

from shardkit.ops.adam import FusedAdam

__all__ = ["FusedAdam"]
