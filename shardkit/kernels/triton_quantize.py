"""Triton kernels for block-wise quantization fused with the rank-major packing.

Imported lazily by :mod:`shardkit.kernels.quantize`, which validates the layout; these launchers
trust it. The arithmetic is the one documented there, spelled with correctly rounded division
(``tl.div_rn``) so GPU, interpreter and the torch path agree bit for bit.

A program handles ``GROUP`` consecutive quantization blocks of one segment, as a
``(GROUP, block / 2)`` tile of even positions and the matching tile of odd positions (an int4
byte holds one of each, so no reshape is needed). Packing: an int64 table holds, per tensor,
its address, element count ``n``, chunk ``c`` and column offset ``o`` in the segment; a cached
table gives each program's range of overlapping tensors, and the program loops over them with
masked loads (or stores). Position ``p`` of segment ``r`` is element ``r * c + p - o`` of the
tensor whose columns hold ``p``.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch
import triton
import triton.language as tl

from shardkit.kernels.quantize import QMAX
from shardkit.kernels.triton_common import (TL_DTYPES, cached_table, cast_to, host_table,
                                            interpreter_block, widen)

__all__ = ["quantize_pack", "dequantize_unpack", "dequantize_sum", "TILE"]

TILE = interpreter_block(4096)  # elements per program (at least one quantization block)


@triton.jit
def _positions(group, n_blocks, seg_numel, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Block indices (GROUP,), even positions (GROUP, BLOCK/2) and their live masks."""
    blk = group * GROUP + tl.arange(0, GROUP)
    even = blk[:, None] * BLOCK + 2 * tl.arange(0, BLOCK // 2)[None, :]
    live_blk = blk < n_blocks
    return blk, even, live_blk, live_blk[:, None] & (even < seg_numel), \
        live_blk[:, None] & (even + 1 < seg_numel)


@triton.jit
def _slot(table, t, rank, pos, live):
    """Tensor ``t`` of the table (row: pointer, numel, chunk, offset in the segment): the
    element index of segment positions ``pos`` of segment ``rank`` in it, and where that index
    is real (inside this tensor's chunk and its unpadded length)."""
    row = table + 4 * t
    chunk = tl.load(row + 2)
    j = pos - tl.load(row + 3)
    k = rank * chunk + j
    return row, k, live & (j >= 0) & (j < chunk) & (k < tl.load(row + 1))


@triton.jit
def _gather(table, t_first, t_last, rank, pos, live, DTYPE: tl.constexpr):
    """fp32 values at segment positions ``pos`` of segment ``rank`` (0 where not ``live``)."""
    x = tl.zeros(pos.shape, tl.float32)
    for t in range(t_first, t_last + 1):
        row, k, mask = _slot(table, t, rank, pos, live)
        src = tl.load(row).to(tl.pointer_type(DTYPE))
        x += widen(tl.load(src + k, mask=mask, other=0.0))
    return x


@triton.jit
def _scatter(table, t_first, t_last, rank, pos, live, x, DTYPE: tl.constexpr):
    """Store ``x`` at segment positions ``pos`` of segment ``rank`` into the tensors."""
    for t in range(t_first, t_last + 1):
        row, k, mask = _slot(table, t, rank, pos, live)
        dst = tl.load(row).to(tl.pointer_type(DTYPE))
        tl.store(dst + k, cast_to(x, DTYPE), mask=mask)


@triton.jit
def _codes(x, scale, usable, QMAX: tl.constexpr):
    safe = tl.where(usable, scale, 1.0)
    q = tl.floor(tl.div_rn(x, safe[:, None]) + 0.5)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return tl.where(usable[:, None], q, 0.0).to(tl.int32)


@triton.jit
def _store_scale(ptrs, scale, mask):
    """Store fp32 ``scale`` in the buffer's scale dtype. A bf16 scale is already a bf16 value
    (rounded up), so its top 16 bits are stored as they are: exact for subnormal scales too,
    which Triton's interpreter converts wrongly."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        top = (scale.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        tl.store(ptrs.to(tl.pointer_type(tl.int16)), top, mask=mask)
    else:
        tl.store(ptrs, scale.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _load_scale(ptrs, mask):
    """A stored scale as fp32; bf16 widened from its bits (see :func:`_store_scale`)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        top = tl.load(ptrs.to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32)
        return ((top & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quantize_pack_kernel(table, prog_first, prog_last, out_ptr, scale_ptr, seg_numel, n_blocks,
                          progs_per_seg, seg_bytes, scale_stride, node_size, nodes,
                          SRC_DTYPE: tl.constexpr, SCALE_BF16: tl.constexpr, BITS: tl.constexpr,
                          QMAX: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    rank = pid // progs_per_seg
    group = pid % progs_per_seg
    slot = ((rank % node_size) * nodes + rank // node_size).to(tl.int64)
    t_first = tl.load(prog_first + group)
    t_last = tl.load(prog_last + group)
    blk, even, live_blk, live_e, live_o = _positions(group, n_blocks, seg_numel, BLOCK, GROUP)
    xe = _gather(table, t_first, t_last, rank, even, live_e, SRC_DTYPE)
    xo = _gather(table, t_first, t_last, rank, even + 1, live_o, SRC_DTYPE)
    # x - x is 0 for finite x and nan for inf and nan; GPU max ignores nan, so test it apart
    bad = tl.max(((xe - xe) != 0).to(tl.int32), axis=1) | tl.max(((xo - xo) != 0).to(tl.int32),
                                                                 axis=1)
    absmax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
    scale = tl.div_rn(tl.where(bad != 0, 0.0, absmax), QMAX)
    if SCALE_BF16:  # round up to bf16, so x / scale stays within qmax
        scale = ((scale.to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(tl.float32,
                                                                          bitcast=True)
    usable = (scale > 0) & (bad == 0)
    scale = tl.where(bad != 0, float("inf"), scale)
    qe = _codes(xe, scale, usable, QMAX)
    qo = _codes(xo, scale, usable, QMAX)
    base = out_ptr + slot * seg_bytes
    store_mask = live_blk[:, None] & (even >= 0)
    if BITS == 8:
        tl.store(base + even, qe.to(tl.int8).to(tl.uint8, bitcast=True), mask=store_mask)
        tl.store(base + even + 1, qo.to(tl.int8).to(tl.uint8, bitcast=True), mask=store_mask)
    else:
        tl.store(base + even // 2, ((qe + 8) | ((qo + 8) << 4)).to(tl.uint8), mask=store_mask)
    _store_scale(scale_ptr + slot * scale_stride + blk, scale, live_blk)


@triton.jit
def _decode(buf_ptr, scale_ptr, slot, seg_bytes, scale_stride, blk, even, live_blk,
            BITS: tl.constexpr):
    """Dequantized (even, odd) tiles of blocks ``blk`` of buffer slot ``slot``, in fp32."""
    base = buf_ptr + slot * seg_bytes
    mask = live_blk[:, None] & (even >= 0)
    if BITS == 8:
        qe = tl.load(base + even, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        qo = tl.load(base + even + 1, mask=mask, other=0).to(tl.int8, bitcast=True).to(
            tl.float32)
    else:
        byte = tl.load(base + even // 2, mask=mask, other=0x88).to(tl.int32)
        qe = ((byte & 15) - 8).to(tl.float32)
        qo = ((byte >> 4) - 8).to(tl.float32)
    scale = _load_scale(scale_ptr + slot * scale_stride + blk, live_blk)
    return qe * scale[:, None], qo * scale[:, None]


@triton.jit
def _dequantize_unpack_kernel(table, prog_first, prog_last, buf_ptr, scale_ptr, seg_numel,
                              n_blocks, progs_per_seg, seg_bytes, scale_stride,
                              DST_DTYPE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                              GROUP: tl.constexpr):
    pid = tl.program_id(0)
    rank = pid // progs_per_seg
    group = pid % progs_per_seg
    t_first = tl.load(prog_first + group)
    t_last = tl.load(prog_last + group)
    blk, even, live_blk, live_e, live_o = _positions(group, n_blocks, seg_numel, BLOCK, GROUP)
    xe, xo = _decode(buf_ptr, scale_ptr, rank.to(tl.int64), seg_bytes, scale_stride, blk, even,
                     live_blk, BITS)
    _scatter(table, t_first, t_last, rank, even, live_e, xe, DST_DTYPE)
    _scatter(table, t_first, t_last, rank, even + 1, live_o, xo, DST_DTYPE)


@triton.jit
def _dequantize_sum_kernel(buf_ptr, scale_ptr, out_ptr, seg_numel, n_blocks, progs_per_seg,
                           seg_bytes, scale_stride, sources, outputs, multiplier,
                           HAS_MULTIPLIER: tl.constexpr, BITS: tl.constexpr,
                           BLOCK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    output = pid // progs_per_seg
    group = pid % progs_per_seg
    blk, even, live_blk, live_e, live_o = _positions(group, n_blocks, seg_numel, BLOCK, GROUP)
    acc_e = tl.zeros(even.shape, tl.float32)
    acc_o = tl.zeros(even.shape, tl.float32)
    for source in range(0, sources):
        slot = (source * outputs + output).to(tl.int64)
        xe, xo = _decode(buf_ptr, scale_ptr, slot, seg_bytes, scale_stride, blk, even, live_blk,
                         BITS)
        acc_e += xe
        acc_o += xo
    if HAS_MULTIPLIER:
        acc_e = acc_e * multiplier
        acc_o = acc_o * multiplier
    dst = out_ptr + output.to(tl.int64) * seg_numel
    tl.store(dst + even, cast_to(acc_e, out_ptr.dtype.element_ty), mask=live_e)
    tl.store(dst + even + 1, cast_to(acc_o, out_ptr.dtype.element_ty), mask=live_o)


# ----------------------------------------------------------------------------- launchers


def _group(layout) -> int:
    return max(1, TILE // layout.block)


def _tensor_tables(tensors: Sequence[torch.Tensor], layout, device: torch.device):
    """The per-call tensor table (addresses) and the cached per-program tensor ranges."""
    live = [i for i, c in enumerate(layout.chunk_numels) if c]
    rows = [v for i in live for v in (tensors[i].data_ptr(), tensors[i].numel(),
                                      layout.chunk_numels[i], layout.column_offsets[i])]
    span = _group(layout) * layout.block
    progs = -(-layout.blocks_per_segment // _group(layout))
    key = ("quant_ranges", layout.chunk_numels, span)

    def ranges(index):
        def build():
            starts = [layout.column_offsets[i] for i in live]
            ends = [layout.column_offsets[i] + layout.chunk_numels[i] for i in live]
            first = [bisect.bisect_right(ends, g * span) for g in range(progs)]
            last = [bisect.bisect_left(starts, (g + 1) * span) - 1 for g in range(progs)]
            return first if index == 0 else last
        return build

    return (host_table(rows, torch.int64, device),
            cached_table(key + ("first",), ranges(0), torch.int32, device),
            cached_table(key + ("last",), ranges(1), torch.int32, device), progs)


def quantize_pack(tensors, layout, out: torch.Tensor, node_size: int, dtype) -> None:
    """Quantize ``tensors`` into ``out`` (layout already checked); one launch."""
    sources = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    table, first, last, progs = _tensor_tables(sources, layout, out.device)
    scales = layout.scales(out)
    _quantize_pack_kernel[(progs * layout.world_size,)](
        table, first, last, out, scales, layout.segment_numel, layout.blocks_per_segment, progs,
        layout.segment_bytes, scales.stride(0), node_size, layout.world_size // node_size,
        SRC_DTYPE=TL_DTYPES[dtype], SCALE_BF16=layout.scale_dtype == torch.bfloat16,
        BITS=layout.bits, QMAX=float(QMAX[layout.bits]), BLOCK=layout.block,
        GROUP=_group(layout))


def dequantize_unpack(buffer: torch.Tensor, layout, outs, dtype) -> None:
    """Decode every segment of ``buffer`` into the contiguous tensors ``outs``; one launch."""
    table, first, last, progs = _tensor_tables(outs, layout, buffer.device)
    scales = layout.scales(buffer)
    _dequantize_unpack_kernel[(progs * layout.world_size,)](
        table, first, last, buffer, scales, layout.segment_numel, layout.blocks_per_segment,
        progs, layout.segment_bytes, scales.stride(0), DST_DTYPE=TL_DTYPES[dtype],
        BITS=layout.bits, BLOCK=layout.block, GROUP=_group(layout))


def dequantize_sum(buffer: torch.Tensor, layout, out: torch.Tensor, sources: int, outputs: int,
                   multiplier: float) -> None:
    """``out[o] = multiplier * sum_s decode(slot s * outputs + o)``; one launch."""
    progs = -(-layout.blocks_per_segment // _group(layout))
    scales = layout.scales(buffer)
    _dequantize_sum_kernel[(progs * outputs,)](
        buffer, scales, out, layout.segment_numel, layout.blocks_per_segment, progs,
        layout.segment_bytes, scales.stride(0), sources, outputs, multiplier,
        HAS_MULTIPLIER=multiplier != 1.0, BITS=layout.bits, BLOCK=layout.block,
        GROUP=_group(layout))
