"""DeepSpeed's module path ``deepspeed.ops.adam.cpu_adam``: :class:`DeepSpeedCPUAdam` (defined in
:mod:`shardkit.ops.adam`), so ``from shardkit.ops.adam.cpu_adam import DeepSpeedCPUAdam`` works as
DeepSpeed scripts write it."""

from shardkit.ops.adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
