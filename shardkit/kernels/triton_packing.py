"""Triton kernels for the rank-major packing used around reduce-scatter and all-gather.

Imported lazily by :mod:`shardkit.kernels.packing` (after ``TRITON_INTERPRET`` is set); callers
validate the layout, these launchers trust it.

One launch covers every tensor of one dtype: an int64 table holds, per tensor, its address, its
element count ``n``, its chunk ``c`` and its column offset ``o`` inside a segment of ``S``
elements; a second table maps each program to ``(tensor, first padded element)``. Element ``k``
of tensor ``i`` (``k < world_size * c``, zero beyond ``n``) lives at ``(k // c) * S + o + k % c``
of the packed buffer. Each element is read once and written once (pack: scaled and cast on the
way), so packing costs ``numel * (in + out bytes)`` of memory traffic and no extra memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from shardkit.kernels.triton_common import TL_DTYPES, cast_to, host_table, interpreter_block

__all__ = ["pack", "unpack", "BLOCK"]

BLOCK = interpreter_block(1024)


@triton.jit
def _locate(table, block_tensor, block_start, seg_numel, world_size, BLOCK: tl.constexpr):
    """This program's tensor row, its padded element indices, their packed positions."""
    pid = tl.program_id(0)
    row = table + 4 * tl.load(block_tensor + pid).to(tl.int64)
    numel = tl.load(row + 1)
    chunk = tl.load(row + 2)
    offset = tl.load(row + 3)
    k = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    rank = k // chunk
    packed = rank * seg_numel + offset + (k - rank * chunk)
    return row, numel, k, k < world_size * chunk, packed


@triton.jit
def _pack_kernel(table, block_tensor, block_start, out_ptr, seg_numel, world_size, scale,
                 SRC_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row, numel, k, live, packed = _locate(table, block_tensor, block_start, seg_numel,
                                          world_size, BLOCK)
    src = tl.load(row).to(tl.pointer_type(SRC_DTYPE))
    x = tl.load(src + k, mask=live & (k < numel), other=0.0)
    if HAS_SCALE:
        x = x.to(tl.float32) * scale
    tl.store(out_ptr + packed, cast_to(x, out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _unpack_kernel(table, block_tensor, block_start, buf_ptr, seg_numel, world_size,
                   DST_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row, numel, k, live, packed = _locate(table, block_tensor, block_start, seg_numel,
                                          world_size, BLOCK)
    dst = tl.load(row).to(tl.pointer_type(DST_DTYPE))
    mask = live & (k < numel)
    x = tl.load(buf_ptr + packed, mask=mask, other=0.0)
    tl.store(dst + k, cast_to(x, DST_DTYPE), mask=mask)


def _tables(tensors: Sequence[torch.Tensor], chunks: Sequence[int], offsets: Sequence[int],
            world_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    rows, block_tensor, block_start = [], [], []
    for t, c, o in zip(tensors, chunks, offsets):
        count = triton.cdiv(world_size * c, BLOCK)
        block_tensor.extend([len(rows) // 4] * count)
        block_start.extend(range(0, count * BLOCK, BLOCK))
        rows.extend([t.data_ptr(), t.numel(), c, o])
    return (host_table(rows, torch.int64, device), host_table(block_tensor, torch.int32, device),
            host_table(block_start, torch.int64, device))


def _groups_by_dtype(tensors, chunks):
    """``{dtype: (tensors, chunks, column offsets)}`` for tensors with a nonzero chunk."""
    groups: dict[torch.dtype, tuple[list, list, list]] = {}
    offset = 0
    for t, c in zip(tensors, chunks):
        if c:
            ts, cs, os_ = groups.setdefault(t.dtype, ([], [], []))
            ts.append(t)
            cs.append(c)
            os_.append(offset)
        offset += c
    return groups


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, chunks: Sequence[int],
         world_size: int, scale: float) -> None:
    """Write ``tensors`` (times ``scale``, cast to ``out.dtype``) rank-major into ``out``,
    zero padded; one launch per source dtype."""
    seg = sum(chunks)
    sources = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    for dtype, (ts, cs, offsets) in _groups_by_dtype(sources, chunks).items():
        table, block_tensor, block_start = _tables(ts, cs, offsets, world_size, out.device)
        _pack_kernel[(block_tensor.numel(),)](
            table, block_tensor, block_start, out, seg, world_size, float(scale),
            SRC_DTYPE=TL_DTYPES[dtype], HAS_SCALE=scale != 1.0, BLOCK=BLOCK)


def unpack(buffer: torch.Tensor, outs: Sequence[torch.Tensor], chunks: Sequence[int],
           world_size: int) -> None:
    """Copy a full rank-major ``buffer`` back into the contiguous tensors ``outs`` (cast to
    their dtypes), dropping the padding; one launch per destination dtype."""
    seg = sum(chunks)
    for dtype, (ts, cs, offsets) in _groups_by_dtype(outs, chunks).items():
        table, block_tensor, block_start = _tables(ts, cs, offsets, world_size, buffer.device)
        _unpack_kernel[(block_tensor.numel(),)](
            table, block_tensor, block_start, buffer, seg, world_size,
            DST_DTYPE=TL_DTYPES[dtype], BLOCK=BLOCK)
