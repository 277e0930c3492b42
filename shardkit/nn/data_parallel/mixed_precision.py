"""The mixed-precision policy of FullyShardedDataParallel, as data.

The policy is resolved once, from the FairScale-style constructor arguments, and passed down
unchanged to the sharding mechanism, which never guesses a dtype on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy", "resolve_mixed_precision"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes a sharded unit gathers, computes, reduces and keeps buffers in.

    The master shards the optimizer steps always stay in their original dtype (fp32).

    Args:
        param_dtype: dtype parameters are all-gathered and computed in (``None``: the master
            dtype, i.e. no mixed precision). bf16/fp16 halve all-gather bytes and the memory
            of the unit being computed.
        reduce_dtype: dtype gradients are reduce-scattered in (``None``: ``param_dtype``);
            fp32 doubles reduce-scatter bytes against bf16 but sums exactly.
        buffer_dtype: dtype floating-point buffers are kept in (``None``: ``param_dtype``).
        cast_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _COMPUTE_DTYPES:
                raise ValueError(f"MixedPrecisionPolicy({name}={value}): valid dtypes are "
                                 f"{[str(d) for d in _COMPUTE_DTYPES]} or None")

    @property
    def enabled(self) -> bool:
        """True when parameters are computed in a dtype other than the master's."""
        return self.param_dtype is not None

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.param_dtype or master

    def gradient_reduce_dtype(self, master: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or self.compute_dtype(master)

    def buffer_cast_dtype(self) -> Optional[torch.dtype]:
        return self.buffer_dtype or self.param_dtype


def resolve_mixed_precision(mixed_precision, compute_dtype: Optional[torch.dtype],
                            buffer_dtype: Optional[torch.dtype],
                            fp32_reduce_scatter: bool) -> MixedPrecisionPolicy:
    """Turn FairScale's arguments into a :class:`MixedPrecisionPolicy`.

    ``mixed_precision`` may be a bool or a ready policy. ``compute_dtype`` (default fp16 when
    ``mixed_precision=True``, as in FairScale) also switches mixed precision on by itself.
    """
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        if compute_dtype is not None or buffer_dtype is not None or fp32_reduce_scatter:
            raise ValueError("FullyShardedDataParallel: pass either mixed_precision="
                             "MixedPrecisionPolicy(...) or compute_dtype/buffer_dtype/"
                             "fp32_reduce_scatter, not both")
        return mixed_precision
    if not isinstance(mixed_precision, bool):
        raise ValueError(f"FullyShardedDataParallel(mixed_precision={mixed_precision!r}): "
                         f"valid values are True, False or a MixedPrecisionPolicy")
    if compute_dtype is not None and compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"FullyShardedDataParallel(compute_dtype={compute_dtype}): valid "
                         f"dtypes are {[str(d) for d in _COMPUTE_DTYPES]}")
    enabled = mixed_precision or compute_dtype in _LOW_PRECISION
    if not enabled:
        if fp32_reduce_scatter:
            raise ValueError("FullyShardedDataParallel(fp32_reduce_scatter=True) needs mixed "
                             "precision: set mixed_precision=True or compute_dtype=torch.bfloat16")
        return MixedPrecisionPolicy(buffer_dtype=buffer_dtype)
    param_dtype = compute_dtype or torch.float16
    return MixedPrecisionPolicy(param_dtype=param_dtype,
                                reduce_dtype=torch.float32 if fp32_reduce_scatter else None,
                                buffer_dtype=buffer_dtype)
