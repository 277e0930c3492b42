"""DeepSpeed's ``deepspeed.ops`` names for ``import shardkit as deepspeed`` scripts.

:mod:`shardkit.ops.adam` holds ``FusedAdam`` and ``DeepSpeedCPUAdam`` (DeepSpeed's constructor
arguments, shardkit's fused Adam step underneath), so ``from deepspeed.ops.adam import
FusedAdam`` becomes ``from shardkit.ops.adam import FusedAdam``.
"""

# `deepspeed.ops.adam` after `import shardkit as deepspeed`
from shardkit.ops import adam  # noqa: F401

__all__ = ["adam"]
