"""Pieces shared by the Triton kernels: the torch → Triton dtype table and a rounding cast.

Imported only by the ``triton_*`` kernel modules (lazily, after ``TRITON_INTERPRET`` is set).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["TL_DTYPES", "cast_to", "interpreter_block", "host_table"]

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
             torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}


def interpreter_block(block: int) -> int:
    """``block`` on a GPU; 16x larger under ``TRITON_INTERPRET=1``, where each program costs
    milliseconds of Python whatever its size (the kernels are written for any block size)."""
    return block * 16 if os.environ.get("TRITON_INTERPRET") == "1" else block


def host_table(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table of launch metadata on ``device``.

    Note: on CUDA it is staged in pinned memory and copied with ``non_blocking=True``; a copy
    from pageable memory would make the host wait for the stream on every launch.
    """
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """``x`` cast to ``DTYPE``, rounding to nearest even like torch.

    Note: the bf16 case is spelled out on the bits because Triton's interpreter truncates
    fp32 → bf16 while GPUs (and torch) round to nearest even; doing the rounding ourselves
    gives the same bits on both, so the interpreter tests check what the GPU computes.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, bits >> 16, rounded)  # keep NaNs NaN
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
