"""Triton kernels for the rank-major packing used around reduce-scatter and all-gather.

Imported lazily by :mod:`shardkit.kernels.packing` (after ``TRITON_INTERPRET`` is set); callers
validate the layout, these launchers trust it.

One launch covers every tensor of one dtype: an int64 table holds, per tensor, its address, its
element count ``n``, its chunk ``c`` and its column offset ``o`` inside a segment of ``S``
elements; a cached block map gives each program ``(tensor i, rank r, first element j0 of its
block within chunk r)``. Element ``j`` of chunk ``r`` is element ``r * c + j`` of the tensor
(zero beyond ``n``) and lives at ``r * S + o + j`` of the packed buffer, so no program divides.
Each element is read once and written once (pack: scaled and cast on the way), so packing
costs ``numel * (in + out bytes)`` of memory traffic and no extra memory.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from shardkit.kernels.triton_common import (TL_DTYPES, cached_table, cast_to, host_table,
                                            interpreter_block, widen)

__all__ = ["pack", "unpack", "BLOCK"]

BLOCK = interpreter_block(1024)


@triton.jit
def _locate(table, block_tensor, block_rank, block_start, seg_numel, BLOCK: tl.constexpr):
    """This program's tensor row, its element indices in the tensor, which are live (inside
    the chunk), and their positions in the packed buffer."""
    pid = tl.program_id(0)
    row = table + 4 * tl.load(block_tensor + pid).to(tl.int64)
    numel = tl.load(row + 1)
    chunk = tl.load(row + 2)
    offset = tl.load(row + 3)
    rank = tl.load(block_rank + pid).to(tl.int64)
    j = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    return row, numel, rank * chunk + j, j < chunk, rank * seg_numel + offset + j


@triton.jit
def _pack_kernel(table, block_tensor, block_rank, block_start, out_ptr, seg_numel, scale,
                 SRC_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row, numel, k, live, packed = _locate(table, block_tensor, block_rank, block_start,
                                          seg_numel, BLOCK)
    src = tl.load(row).to(tl.pointer_type(SRC_DTYPE))
    x = tl.load(src + k, mask=live & (k < numel), other=0.0)
    if HAS_SCALE:
        x = widen(x) * scale
    tl.store(out_ptr + packed, cast_to(x, out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _unpack_kernel(table, block_tensor, block_rank, block_start, buf_ptr, seg_numel,
                   DST_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    row, numel, k, live, packed = _locate(table, block_tensor, block_rank, block_start,
                                          seg_numel, BLOCK)
    dst = tl.load(row).to(tl.pointer_type(DST_DTYPE))
    mask = live & (k < numel)
    x = tl.load(buf_ptr + packed, mask=mask, other=0.0)
    tl.store(dst + k, cast_to(x, DST_DTYPE), mask=mask)


def _tables(tensors: Sequence[torch.Tensor], chunks: Sequence[int], offsets: Sequence[int],
            world_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The per-call row table (addresses) and the cached block map (sizes only)."""
    rows = [v for t, c, o in zip(tensors, chunks, offsets) for v in (t.data_ptr(), t.numel(), c, o)]
    key = ("pack_blocks", tuple(chunks), world_size, BLOCK)

    def column(index):
        return lambda: [b[index] for b in _block_map(tuple(chunks), world_size)]

    return (host_table(rows, torch.int64, device),
            cached_table(key + ("tensor",), column(0), torch.int32, device),
            cached_table(key + ("rank",), column(1), torch.int32, device),
            cached_table(key + ("start",), column(2), torch.int64, device))


def _block_map(chunks: tuple, world_size: int) -> list[tuple[int, int, int]]:
    """``(tensor, rank, first element in the chunk)`` for every program of a launch."""
    return [(i, r, s) for i, c in enumerate(chunks) for r in range(world_size)
            for s in range(0, c, BLOCK)]


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
        table, block_tensor, block_rank, block_start = _tables(ts, cs, offsets, world_size,
                                                               out.device)
        _pack_kernel[(block_tensor.numel(),)](
            table, block_tensor, block_rank, block_start, out, seg, float(scale),
            SRC_DTYPE=TL_DTYPES[dtype], HAS_SCALE=scale != 1.0, BLOCK=BLOCK)


def unpack(buffer: torch.Tensor, outs: Sequence[torch.Tensor], chunks: Sequence[int],
           world_size: int) -> None:
    """Copy a full rank-major ``buffer`` back into the contiguous tensors ``outs`` (cast to
    their dtypes), dropping the padding; one launch per destination dtype."""
    seg = sum(chunks)
    for dtype, (ts, cs, offsets) in _groups_by_dtype(outs, chunks).items():
        table, block_tensor, block_rank, block_start = _tables(ts, cs, offsets, world_size,
                                                               buffer.device)
        _unpack_kernel[(block_tensor.numel(),)](
            table, block_tensor, block_rank, block_start, buffer, seg,
            DST_DTYPE=TL_DTYPES[dtype], BLOCK=BLOCK)
