"""Pieces shared by the Triton kernels: the torch → Triton dtype table, an exact widening to fp32
and a rounding cast.

Imported only by the ``triton_*`` kernel modules (lazily, after ``TRITON_INTERPRET`` is set).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["TL_DTYPES", "cast_to", "widen", "interpreter_block", "host_table", "cached_table"]

TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
             torch.bfloat16: tl.bfloat16, torch.float64: tl.float64}


def interpreter_block(block: int) -> int:
    """``block`` on a GPU; 16x larger under ``TRITON_INTERPRET=1``, where each program costs
    milliseconds of Python whatever its size (the kernels are written for any block size)."""
    return block * 16 if os.environ.get("TRITON_INTERPRET") == "1" else block


class _PinnedSlot:
    """A pinned staging buffer and the event that marks its last copy to the device done."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.buffer = torch.empty(numel, dtype=dtype, pin_memory=True)
        self.done = torch.cuda.Event()
        self.done.record()


_PINNED_SLOTS: dict[tuple, list[_PinnedSlot]] = {}
_DEVICE_TABLES: dict[tuple, torch.Tensor] = {}
_MAX_SLOTS, _MAX_TABLES = 8, 256


def host_table(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small table of launch metadata (addresses, sizes) on ``device``.

    Note: on CUDA the values go through a reused pinned staging buffer and a
    ``non_blocking`` copy: a copy from pageable memory would make the host wait for the stream,
    and allocating pinned memory on every launch costs far more than the kernel. A slot is
    reused only once the event recorded after its previous copy has completed.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    ring = _PINNED_SLOTS.setdefault((len(values), dtype), [])
    slot = next((s for s in ring if s.done.query()), None)
    if slot is None:
        if len(ring) < _MAX_SLOTS:
            slot = _PinnedSlot(len(values), dtype)
            ring.append(slot)
        else:
            slot = ring[0]
            slot.done.synchronize()
    slot.buffer.copy_(torch.tensor(values, dtype=dtype))
    out = slot.buffer.to(device, non_blocking=True)
    slot.done.record()
    return out


def cached_table(key: tuple, build, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A launch table that depends only on ``key`` (sizes, not addresses), built once per
    device with ``build() -> list`` and kept (at most a few hundred tables)."""
    full_key = (key, dtype, str(device))
    table = _DEVICE_TABLES.get(full_key)
    if table is None:
        if len(_DEVICE_TABLES) >= _MAX_TABLES:
            _DEVICE_TABLES.pop(next(iter(_DEVICE_TABLES)))
        table = _DEVICE_TABLES[full_key] = host_table(build(), dtype, device)
    return table


@triton.jit
def widen(x):
    """``x`` as fp32, exactly.

    Note: a bf16 ``x`` is widened through its bits (they are the top half of the fp32 value):
    Triton's interpreter converts bf16 subnormals to fp32 wrongly (garbage or zero, not the
    value), while GPUs widen exactly; the shift gives the same bits on both, so the interpreter
    tests check what the GPU computes.
    """
    if x.dtype == tl.bfloat16:
        bits = (x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """``x`` cast to ``DTYPE``, rounding to nearest even like torch.

    Note: the bf16 cases are spelled out on the bits because Triton's interpreter truncates
    fp32 → bf16 while GPUs (and torch) round to nearest even, and mangles bf16 subnormals (see
    :func:`widen`); doing the rounding ourselves gives the same bits on both, so the
    interpreter tests check what the GPU computes. A bf16 ``x`` is kept bit for bit (NaN
    payloads too, as torch's copy).
    """
    if DTYPE == tl.bfloat16:
        if x.dtype == tl.bfloat16:
            return x
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        # torch's NaN for every NaN: the top half alone reads inf when the payload lies below
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif x.dtype == tl.bfloat16:
        return widen(x).to(DTYPE)
    else:
        return x.to(DTYPE)
