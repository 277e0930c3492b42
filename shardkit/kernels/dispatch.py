"""Choose between the Triton kernels and the torch CPU paths.

Policy: ``SHARDKIT_KERNELS`` (``auto`` | ``triton`` | ``torch``), read at every call so tests can
switch it. Mechanism: each kernel entry point asks :func:`backend_for` and imports the
``triton_*`` module only when it gets ``"triton"``, so Triton stays optional at install time.
"""

from __future__ import annotations

import functools
import os

import torch

_VALID = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``import triton`` works."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def backend_for(*tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for work on ``tensors``.

    ``SHARDKIT_KERNELS`` may be ``auto`` (default: Triton on CUDA when importable), ``triton``
    (force the Triton code, e.g. with ``TRITON_INTERPRET=1`` on CPU) or ``torch``.
    """
    choice = os.environ.get("SHARDKIT_KERNELS", "auto").lower()
    if choice == "auto":  # the hot path: called once per optimizer step or packing
        for t in tensors:
            if not t.is_cuda:
                return "torch"
        return "triton" if tensors and triton_available() else "torch"
    if choice not in _VALID:
        raise ValueError(f"SHARDKIT_KERNELS={choice!r}; valid values are {list(_VALID)}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("SHARDKIT_KERNELS=triton but triton does not import; "
                               "`pip install triton` or unset SHARDKIT_KERNELS")
        on_cpu = any(t.device.type == "cpu" for t in tensors)
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("SHARDKIT_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1")
        return "triton"
    return "torch"
