"""Packing of many gradients into one flat, rank-major buffer for reduce-scatter.

Layout: tensor ``i`` (``numel_i`` elements) is cut into ``world_size`` chunks of
``chunk_i = chunk_numels[i]`` elements (default ``ceil(numel_i / world_size)``; zero padding at
the end). The packed buffer holds ``world_size`` segments of ``S = sum(chunk_i)`` elements;
segment ``r`` is ``chunk r of tensor 0, chunk r of tensor 1, ...``. After a reduce-scatter,
rank ``r`` holds segment ``r``: its shard of every tensor, contiguous.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardkit.kernels.dispatch import backend_for

__all__ = ["chunk_numels_for", "chunk_of_rank", "pack_rank_major", "unpack_rank_major",
           "unpack_shard", "shard_views"]


def chunk_numels_for(numels: Sequence[int], world_size: int) -> list[int]:
    """Default per-rank chunk sizes: ``ceil(numel / world_size)`` for each tensor (so padding is
    below ``world_size`` elements per tensor)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; it must be at least 1")
    return [-(-n // world_size) for n in numels]


def chunk_of_rank(flat: torch.Tensor, rank: int, chunk_numel: int) -> torch.Tensor:
    """Chunk ``rank`` of the flat tensor ``flat`` cut into chunks of ``chunk_numel`` elements:
    a view, shorter than ``chunk_numel`` (or empty) where ``flat`` ends inside or before it
    (the padding is not materialised). No copy."""
    end = flat.numel()
    return flat[min(rank * chunk_numel, end):min((rank + 1) * chunk_numel, end)]


def _check_chunks(numels, chunk_numels, world_size):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; it must be an int >= 1")
    if any(n < 0 for n in numels):
        raise ValueError(f"numels={list(numels)} holds a negative size; tensors have >= 0 "
                         f"elements")
    if chunk_numels is None:
        return chunk_numels_for(numels, world_size)
    chunk_numels = [int(c) for c in chunk_numels]
    if len(chunk_numels) != len(numels):
        raise ValueError(f"chunk_numels has {len(chunk_numels)} entries for {len(numels)} tensors")
    for i, (n, c) in enumerate(zip(numels, chunk_numels)):
        if c < 0 or c * world_size < n:
            raise ValueError(f"chunk_numels[{i}]={c} x world_size {world_size} < numel {n}: "
                             f"the chunks would not cover tensor {i}; use at least "
                             f"ceil({n} / {world_size}) = {-(-n // world_size)}")
    return chunk_numels


# the element types the Triton packing kernels are built for; other dtypes (integers, bool,
# fp8, complex) are plain copies and take the torch path on every device. float64 takes it too:
# the kernels scale in fp32 and widen through fp32, which would round fp64 values twice.
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _triton_packs(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels should move ``tensors`` (see :func:`backend_for`)."""
    return (backend_for(*tensors) == "triton"
            and all(t.dtype in _TRITON_DTYPES for t in tensors))


def _check_same_device(name, tensors, device):
    for i, t in enumerate(tensors):
        if t.device != device:
            raise ValueError(f"{name}: tensors[{i}] is on {t.device}, the first on {device}; "
                             f"all must share a device")


def _moving_dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """``(size, byte stride)`` of the dimensions of ``t`` along which its address changes
    (size above 1, stride above 0), widest stride first."""
    es = t.element_size()
    dims = [(n, s * es) for n, s in zip(t.shape, t.stride()) if n > 1 and s > 0]
    return sorted(dims, key=lambda d: -d[1])


def _tiles_its_range(dims: list[tuple[int, int]], element_size: int) -> bool:
    """Whether a layout (``_moving_dims``) covers every byte of its range: a contiguous tensor
    or a permutation of one."""
    expected = element_size
    for n, s in reversed(dims):
        if s != expected:
            return False
        expected *= n
    return True


# how many blocks _touches looks at before it gives up and answers "shares" (only a tensor whose
# own dimensions overlap, e.g. from unfold or as_strided, across the other's range gets there)
_TOUCH_BUDGET = 4096


def _touches(base: int, dims: list[tuple[int, int]], element_size: int, lo: int, hi: int,
             budget: list[int]) -> bool:
    """Whether an element of the strided layout at address ``base`` (``dims`` from
    :func:`_moving_dims`) has a byte in ``[lo, hi)``. Walks only the blocks that cross an end
    of the range: a block wholly inside it has an element there, one wholly outside has none.
    Answers True (shares) once ``budget[0]`` blocks were looked at."""
    if not dims:
        return base < hi and base + element_size > lo
    (n, s), rest = dims[0], dims[1:]
    block = element_size + sum((m - 1) * r for m, r in rest)  # bytes from a block's start to end
    first = max(0, (lo - base - block) // s + 1)  # blocks [base + i*s, + block) meeting [lo, hi)
    last = min(n - 1, -((base - hi) // s) - 1)
    for i in range(first, last + 1):
        budget[0] -= 1
        if budget[0] < 0:
            return True
        start = base + i * s
        if (lo <= start and start + block <= hi) or _touches(start, rest, element_size, lo, hi,
                                                             budget):
            return True
    return False


def _shares_memory(t: torch.Tensor, buffer: torch.Tensor, buffer_range: tuple[int, int]) -> bool:
    """Whether an element of ``t`` has a byte in the contiguous ``buffer``'s address range
    ``buffer_range``. Exact: a view interleaved with ``buffer`` that shares no element does not
    count (only a ``t`` whose own dimensions overlap, with over ``_TOUCH_BUDGET`` blocks crossing
    the range, counts as sharing without proof). Meta tensors have no memory to share."""
    if t.device != buffer.device or t.device.type == "meta":
        return False
    lo, hi = buffer_range
    base = t.data_ptr()
    if base >= hi:
        return False  # strides are >= 0: every element of t starts at or after base
    dims = _moving_dims(t)
    es = t.element_size()
    end = base + es + sum((n - 1) * s for n, s in dims)
    if end <= lo:
        return False
    return _tiles_its_range(dims, es) or _touches(base, dims, es, lo, hi, [_TOUCH_BUDGET])


def _refuse_aliasing(name: str, buffer_label: str, buffer: torch.Tensor, tensors_label: str,
                     tensors: Sequence[torch.Tensor], indexed: bool = True) -> None:
    """A ValueError, before anything is written, for a tensor that shares memory with the
    packed, contiguous ``buffer``: the copy reads one while it writes the other (in parallel,
    on Triton), so values were overwritten before they were read. ``indexed``: name the tensors
    ``tensors_label[i]`` (else ``tensors_label``). Cost: an address comparison per tensor (a
    walk over the blocks at the ends of ``buffer`` for a strided tensor whose range crosses
    it)."""
    if buffer.numel() == 0 or buffer.device.type == "meta":
        return
    lo = buffer.data_ptr()
    buffer_range = (lo, lo + buffer.numel() * buffer.element_size())
    for i, t in enumerate(tensors):
        if t.numel() and _shares_memory(t, buffer, buffer_range):
            label = f"{tensors_label}[{i}]" if indexed else tensors_label
            raise ValueError(
                f"{name}: {label} (shape {tuple(t.shape)}) shares memory with "
                f"{buffer_label}; the copy between them would overwrite values before reading "
                f"them. Give each of them memory of its own")


def pack_rank_major(tensors: Sequence[torch.Tensor], world_size: int, *, scale: float = 1.0,
                    dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
                    chunk_numels: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Copy ``tensors`` into one flat rank-major buffer, multiplied by ``scale`` and cast to
    ``dtype`` (default: the first tensor's) in the same pass. Padding is zeros. With an
    integer or bool ``dtype``, ``scale`` must be 1 (or a Python int, for integer data): a
    ValueError before anything is written, as is an ``out`` that shares memory with one of
    ``tensors``.

    Memory: one buffer of ``world_size * sum(chunk_numels)`` elements (or ``out``). Traffic:
    each element read once and written once (Triton: one launch per source dtype; CPU: one
    strided copy per tensor, scale and cast fused into it). No communication.
    """
    if not tensors:
        raise ValueError("pack_rank_major: tensors is empty")
    device = tensors[0].device
    _check_same_device("pack_rank_major", tensors, device)
    numels = [t.numel() for t in tensors]
    chunks = _check_chunks(numels, chunk_numels, world_size)
    seg = sum(chunks)
    dtype = dtype or tensors[0].dtype
    if scale != 1.0 and not (dtype.is_floating_point or dtype.is_complex) and not (
            type(scale) is int and not any(t.is_floating_point() or t.is_complex()
                                           for t in tensors)):
        # an int scale of int data is exact (it was taken before); anything else is not
        raise ValueError(f"pack_rank_major: scale={scale!r} with the packed dtype {dtype}; a "
                         f"scale needs a floating dtype (pass dtype=torch.float32, or scale=1.0 "
                         f"to copy {dtype} values as they are)")
    if out is None:
        out = torch.empty(world_size * seg, dtype=dtype, device=device)
    else:
        _check_out(out, world_size * seg, dtype, device)
        _refuse_aliasing("pack_rank_major", "out", out, "tensors", tensors)
    if _triton_packs(out, *tensors):
        from shardkit.kernels import triton_packing
        triton_packing.pack(tensors, out, chunks, world_size, scale)
        return out
    view = out.view(world_size, seg)
    offset = 0
    for t, n, c in zip(tensors, numels, chunks):
        _write_columns(view[:, offset:offset + c], t.reshape(-1), n, c, scale)
        offset += c
    return out


_HALVES = (torch.float16, torch.bfloat16)


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = src * scale`` in one pass, computed in the wider of the two dtypes."""
    if scale == 1.0:
        dst.copy_(src)
    elif not (src.is_floating_point() and dst.is_floating_point()):
        if dst.is_floating_point():  # integers into floats: exact in fp64, rounded once
            dst.copy_(src.to(torch.float64).mul_(scale))
        else:  # integers (or bool) multiplied as integers in the wider of the two, then cast
            dst.copy_(torch.mul(src.to(torch.promote_types(src.dtype, dst.dtype)), scale))
    elif src.dtype == dst.dtype:
        torch.mul(src, scale, out=dst)
    elif dst.dtype.itemsize > src.dtype.itemsize:
        # the widening copy is exact; then one product in dst's dtype (torch.mul(src, out=dst)
        # would multiply in src's dtype first)
        dst.copy_(src).mul_(scale)
    elif src.dtype not in _HALVES:  # fp32 / fp64 into a narrower float: one rounding
        torch.mul(src, scale, out=dst)
    # Below, torch.mul would round the product to src's 16-bit dtype before the cast to dst's
    # dtype rounds again; round once, like the Triton kernel.
    else:  # fp16 <-> bf16: through an fp32 temporary
        torch.mul(src.float(), scale, out=dst)


def _write_columns(cols: torch.Tensor, src: torch.Tensor, n: int, c: int, scale: float) -> None:
    """Write ``src * scale`` (n elements) row by row into the (world_size, c) view ``cols``;
    zero the rest."""
    if c == 0:
        return
    rows = n // c
    _scaled_copy(cols[:rows], src[:rows * c].view(rows, c), scale)
    if rows < cols.shape[0]:
        rest = n - rows * c
        _scaled_copy(cols[rows, :rest], src[rows * c:], scale)
        cols[rows, rest:].zero_()
        cols[rows + 1:].zero_()


def _read_columns(dst: torch.Tensor, cols: torch.Tensor, n: int, c: int) -> None:
    """Inverse of :func:`_write_columns` without scale: the first ``n`` elements of the
    (world_size, c) view ``cols``, row by row, into the flat ``dst``."""
    if c == 0:
        return
    rows = n // c
    dst[:rows * c].view(rows, c).copy_(cols[:rows])
    if rows * c < n:
        dst[rows * c:].copy_(cols[rows, :n - rows * c])


def _check_out(out, numel, dtype, device):
    if out.numel() != numel or out.dtype != dtype or out.device != device:
        raise ValueError(f"out has {out.numel()} {out.dtype} elements on {out.device}; expected "
                         f"{numel} {dtype} on {device}")
    if not out.is_contiguous():
        raise ValueError(f"out (stride {out.stride()}) must be contiguous")


def unpack_rank_major(buffer: torch.Tensor, world_size: int, outs: Sequence[torch.Tensor],
                      chunk_numels: Optional[Sequence[int]] = None) -> None:
    """Inverse of :func:`pack_rank_major`: copy a full rank-major buffer (e.g. an all-gather
    output) back into the tensors ``outs`` (casting to their dtype), dropping the padding.
    An out that shares memory with ``buffer`` is a ValueError, before anything is written.

    Traffic: each kept element read once and written once; no extra memory, no communication.
    """
    numels = [t.numel() for t in outs]
    chunks = _check_chunks(numels, chunk_numels, world_size)
    seg = sum(chunks)
    if buffer.numel() != world_size * seg:
        raise ValueError(f"unpack_rank_major: buffer has {buffer.numel()} elements; the layout "
                         f"needs world_size {world_size} x {seg} = {world_size * seg}")
    if not buffer.is_contiguous():
        raise ValueError(f"unpack_rank_major: buffer (stride {buffer.stride()}) must be "
                         f"contiguous")
    _check_same_device("unpack_rank_major", outs, buffer.device)
    _refuse_aliasing("unpack_rank_major", "buffer", buffer, "outs", outs)
    if _triton_packs(buffer, *outs) and all(t.is_contiguous() for t in outs):
        from shardkit.kernels import triton_packing
        triton_packing.unpack(buffer, outs, chunks, world_size)
        return
    view = buffer.view(world_size, seg)
    offset = 0
    for t, n, c in zip(outs, numels, chunks):
        cols = view[:, offset:offset + c]
        if t.is_contiguous():
            _read_columns(t.view(-1), cols, n, c)
        else:
            t.copy_(cols.reshape(-1)[:n].view(t.shape))
        offset += c


def shard_views(shard: torch.Tensor, chunk_numels: Sequence[int]) -> list[torch.Tensor]:
    """Views of one rank's segment, one per packed tensor, of ``chunk_numels[i]`` elements
    (no copy, no extra memory)."""
    if shard.numel() != sum(chunk_numels):
        raise ValueError(f"shard_views: shard has {shard.numel()} elements; chunks sum to "
                         f"{sum(chunk_numels)}")
    return list(shard.split(list(chunk_numels)))


def unpack_shard(shard: torch.Tensor, outs: Sequence[torch.Tensor],
                 chunk_numels: Optional[Sequence[int]] = None, accumulate: bool = False) -> None:
    """Copy (or add, with ``accumulate``) one rank's segment into per-parameter tensors
    ``outs``; ``chunk_numels`` default to the outs' sizes. One read and one write (two reads with
    ``accumulate``) per element of ``outs``; no extra memory, no communication."""
    chunks = list(chunk_numels) if chunk_numels is not None else [t.numel() for t in outs]
    if len(chunks) != len(outs):
        raise ValueError(f"unpack_shard: chunk_numels has {len(chunks)} entries for "
                         f"{len(outs)} outs")
    for i, (c, t) in enumerate(zip(chunks, outs)):
        if c < t.numel():
            raise ValueError(f"unpack_shard: chunk_numels[{i}]={c} is smaller than outs[{i}] "
                             f"({t.numel()} elements); the shard cannot fill it")
    for src, t in zip(shard_views(shard, chunks), outs):
        src = src[:t.numel()].view(t.shape)
        t.add_(src) if accumulate else t.copy_(src)
