"""The mixed-precision policy of FullyShardedDataParallel, as data.

The policy is resolved once, from the FairScale-style constructor arguments, and passed down
unchanged to the sharding mechanism, which never guesses a dtype on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["MixedPrecisionPolicy", "resolve_mixed_precision", "from_torch_mixed_precision",
           "torch_full_precision_classes"]

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
        keep_buffer_dtypes: leave every buffer in the dtype the module gave it (torch FSDP1's
            ``MixedPrecision(buffer_dtype=None)``); only with ``buffer_dtype=None``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_inputs: bool = True
    keep_buffer_dtypes: bool = False

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _COMPUTE_DTYPES:
                raise ValueError(f"MixedPrecisionPolicy({name}={value}): valid dtypes are "
                                 f"{[str(d) for d in _COMPUTE_DTYPES]} or None")
        if self.keep_buffer_dtypes and self.buffer_dtype is not None:
            raise ValueError(f"MixedPrecisionPolicy(buffer_dtype={self.buffer_dtype}, "
                             f"keep_buffer_dtypes=True): the buffers either keep their own "
                             f"dtypes or are cast to buffer_dtype; pass one of the two")

    @property
    def enabled(self) -> bool:
        """True when parameters are computed in a dtype other than the master's."""
        return self.param_dtype is not None

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype a unit computes in, given its master parameters' dtype."""
        return self.param_dtype or master

    def gradient_reduce_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduce-scattered in (sets the bytes on the wire)."""
        return self.reduce_dtype or self.compute_dtype(master)

    def buffer_cast_dtype(self) -> Optional[torch.dtype]:
        """The dtype floating buffers are cast to; ``None``: they keep their own."""
        if self.keep_buffer_dtypes:
            return None
        return self.buffer_dtype or self.param_dtype


def resolve_mixed_precision(mixed_precision, compute_dtype: Optional[torch.dtype],
                            buffer_dtype: Optional[torch.dtype],
                            fp32_reduce_scatter: bool) -> MixedPrecisionPolicy:
    """Turn FairScale's arguments into a :class:`MixedPrecisionPolicy`.

    ``mixed_precision`` may be a bool, ``None`` (torch's default: off), a ready policy or
    torch FSDP1's ``torch.distributed.fsdp.MixedPrecision`` (see
    :func:`from_torch_mixed_precision`).
    ``compute_dtype`` (default fp16 when ``mixed_precision=True``, as in FairScale) also
    switches mixed precision on by itself, unless it is fp32 (then the parameters compute in
    their own dtype): ``torch.float64`` gathers and computes an fp32 model in fp64.
    """
    if mixed_precision is None:  # torch FSDP1's default: no mixed precision
        mixed_precision = False
    mixed_precision = from_torch_mixed_precision(mixed_precision)
    if isinstance(mixed_precision, MixedPrecisionPolicy):
        if compute_dtype is not None or buffer_dtype is not None or fp32_reduce_scatter:
            raise ValueError("FullyShardedDataParallel: pass either mixed_precision="
                             "MixedPrecisionPolicy(...) or compute_dtype/buffer_dtype/"
                             "fp32_reduce_scatter, not both")
        return mixed_precision
    if not isinstance(mixed_precision, bool):
        raise ValueError(f"FullyShardedDataParallel(mixed_precision={mixed_precision!r}): "
                         f"valid values are True, False, None, a MixedPrecisionPolicy or "
                         f"torch.distributed.fsdp.MixedPrecision")
    for name, value in (("compute_dtype", compute_dtype), ("buffer_dtype", buffer_dtype)):
        if value is not None and value not in _COMPUTE_DTYPES:
            raise ValueError(f"FullyShardedDataParallel({name}={value}): valid dtypes are "
                             f"{[str(d) for d in _COMPUTE_DTYPES]} or None")
    enabled = mixed_precision or (compute_dtype is not None and compute_dtype != torch.float32)
    if not enabled:
        if fp32_reduce_scatter:
            raise ValueError("FullyShardedDataParallel(fp32_reduce_scatter=True) needs mixed "
                             "precision: set mixed_precision=True or compute_dtype=torch.bfloat16")
        return MixedPrecisionPolicy(buffer_dtype=buffer_dtype)
    param_dtype = compute_dtype or torch.float16
    return MixedPrecisionPolicy(param_dtype=param_dtype,
                                reduce_dtype=torch.float32 if fp32_reduce_scatter else None,
                                buffer_dtype=buffer_dtype)


def from_torch_mixed_precision(policy):
    """torch FSDP1's ``MixedPrecision`` object (``from torch.distributed.fsdp import
    MixedPrecision``, as pytorch/examples' FSDP recipe builds its ``bfSixteen`` policies) as a
    :class:`MixedPrecisionPolicy`; anything else is returned unchanged. Read by fields:

    - ``param_dtype`` / ``reduce_dtype`` / ``buffer_dtype`` as they are (``param_dtype=None``:
      computed in the parameters' own dtype, as torch); ``buffer_dtype=None`` leaves every
      buffer in its own dtype, as torch (``keep_buffer_dtypes=True``: an fp32 model's buffers
      stay fp32, a bf16 model's stay bf16; shardkit's own ``None`` means ``param_dtype``).
    - ``cast_forward_inputs`` or ``cast_root_forward_inputs`` (torch's default): inputs are
      cast, at every unit (shardkit's rule).
    - ``keep_low_precision_grads=True`` with a ``param_dtype`` other than fp32 is a ValueError
      (see :func:`_refuse_low_precision_grads`); without one, or with ``torch.float32`` (an
      fp32 model computed in fp32: nothing lower to keep), it changes nothing, as in torch (the
      gradient shards are in the parameters' dtype already).
    - ``_module_classes_to_ignore`` (torch's default: BatchNorm) is read by the constructor's
      ``auto_wrap_policy`` (see :func:`torch_full_precision_classes`), as in torch.

    Local, no communication."""
    if not _is_torch_mixed_precision(policy):
        return policy
    if getattr(policy, "keep_low_precision_grads", False) \
            and policy.param_dtype not in (None, torch.float32):
        _refuse_low_precision_grads(policy)
    param, reduce, buffer = policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype
    cast = bool(getattr(policy, "cast_forward_inputs", False)
                or getattr(policy, "cast_root_forward_inputs", True))
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, buffer_dtype=buffer,
                                cast_inputs=cast, keep_buffer_dtypes=buffer is None)


def _refuse_low_precision_grads(policy) -> None:
    """A ValueError for torch FSDP1's ``MixedPrecision(keep_low_precision_grads=True)``, saying
    why and what to use instead.

    Note: torch FSDP1 then leaves each fp32 shard's ``.grad`` in ``param_dtype`` (set through
    ``.grad.data``, side-stepping torch's check that a gradient has its parameter's dtype), for
    "a custom optimizer that supports running in low precision": torch's own ``Adam`` /
    ``AdamW`` (for-loop, foreach and fused) fail at ``step()`` on an fp32 parameter with a bf16
    gradient ("expected dtype float for `end` but got dtype c10::BFloat16"), only ``SGD``
    steps it. Gradient shards are ``1/N`` of the model, so the memory it saves is small; the
    shards' gradients stay in their parameters' dtype here."""
    low = policy.param_dtype
    raise ValueError(
        f"FullyShardedDataParallel(mixed_precision=MixedPrecision(param_dtype={low}, "
        f"keep_low_precision_grads=True)): not supported: torch FSDP1 would leave each fp32 "
        f"parameter shard's .grad in {low}, which torch's Adam and AdamW refuse at step() "
        f"(only SGD or a custom low-precision optimizer steps it). Leave "
        f"keep_low_precision_grads=False (the gradient shards, 1/N of the model, are kept in "
        f"the parameters' dtype for the step; reduce_dtype={low} still cuts the "
        f"reduce-scatter bytes), or cast the model to {low} before wrapping to keep its "
        f"parameters, gradients and optimizer state all in {low}")


def torch_full_precision_classes(policy) -> tuple:
    """The module classes that torch FSDP1 gives units of their own in full precision when its
    ``MixedPrecision`` comes with an ``auto_wrap_policy`` (``_module_classes_to_ignore``,
    BatchNorm by default): their inputs are cast to fp32 and their outputs back. ``()`` for
    anything but torch's ``MixedPrecision``. Local, no communication."""
    if not _is_torch_mixed_precision(policy):
        return ()
    return tuple(getattr(policy, "_module_classes_to_ignore", ()) or ())


def _is_torch_mixed_precision(policy) -> bool:
    """Whether ``policy`` is torch FSDP1's ``MixedPrecision`` (told by name and module, so
    that torch's FSDP is not imported to check)."""
    cls = type(policy)
    return cls.__name__ == "MixedPrecision" and cls.__module__.startswith("torch.distributed")
