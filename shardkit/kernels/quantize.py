"""Block-wise symmetric int8 / int4 quantization fused with the rank-major packing.

The fp32/bf16 values are laid out exactly as :mod:`shardkit.kernels.packing` lays them out
(``world_size`` segments of ``S = sum(chunk_numels)`` elements; segment ``r`` holds chunk ``r``
of every tensor), then each segment is cut into blocks of ``block`` elements (the last block of a
segment zero padded) and every block is sent as codes plus one scale:

    scale = absmax(block) / qmax          (qmax = 127 for 8 bits, 7 for 4 bits)
    code  = clamp(floor(x / scale + 0.5), -qmax, qmax)          (0 where scale is 0)
    x'    = code * scale                  so |x - x'| <= scale / 2 for every element

(up to fp32 rounding; a block whose absmax is below ``qmax`` times the smallest subnormal,
about 1e-43, gets scale 0 and comes back as zeros.)

The quantized buffer is one flat ``uint8`` tensor (one collective moves it) of ``world_size``
segments of :attr:`QuantLayout.segment_bytes` bytes each: first the codes (int8: one byte per
element, two's complement; int4: two per byte, element ``2i`` in the low nibble, each stored as
``code + 8``), then the scales (fp32, or bf16 rounded *up* so the bound still holds).

At the top of the range, ``code * scale`` can round past the largest finite value of the output
dtype and come back as ``±inf`` (e.g. fp16 values within 1% of 65504 with bf16 scales, which are
rounded up, or fp32 values near 3.4e38): values that close to overflow are outside the bound.

Non-finite input: a block holding inf or nan gets scale ``+inf`` and zero codes, so it
dequantizes to nan in every element (a loss-scaled step sees the overflow and skips); the
scale is never nan. With ``check_finite=True`` (the default of :func:`quantize_pack`) such input
raises ``ValueError`` instead, before anything leaves the rank.

Blocks never straddle two segments, so the segment a rank receives is decoded on its own.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from shardkit.kernels.dispatch import backend_for
from shardkit.kernels.packing import _check_chunks, _check_same_device, _read_columns, \
    _refuse_aliasing, _write_columns

__all__ = ["QuantLayout", "quant_layout", "quantize_pack", "dequantize_unpack", "dequantize_sum",
           "DEFAULT_BLOCK", "QMAX"]

# Chosen by measurement (benchmarks/results/quantize.md): on CPU the time is flat in the block
# size; 256 keeps the scale bytes within ~1% (int8) / ~2.5% (int4) of huge blocks' while the
# error stays well below theirs (rms 0.0070 vs 0.0083 at 2048 for int8 on Gaussian values).
DEFAULT_BLOCK = 256
QMAX = {8: 127, 4: 7}
_SCALE_DTYPES = (torch.float32, torch.bfloat16)
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class QuantLayout:
    """Where everything lives in a quantized rank-major buffer (sizes only, no tensors).

    Attributes:
        world_size: number of segments.
        chunk_numels: elements of each packed tensor per segment (see ``pack_rank_major``).
        bits: 8 or 4. block: elements per scale (a power of two, 8 to 8192).
        scale_dtype: ``torch.float32`` or ``torch.bfloat16``.
    """

    world_size: int
    chunk_numels: tuple
    bits: int = 8
    block: int = DEFAULT_BLOCK
    scale_dtype: torch.dtype = torch.float32
    column_offsets: tuple = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r}; it must be an int >= 1")
        if isinstance(self.bits, bool) or not isinstance(self.bits, numbers.Integral) \
                or self.bits not in QMAX:
            raise ValueError(f"bits={self.bits!r}; valid values are {sorted(QMAX)}")
        object.__setattr__(self, "bits", int(self.bits))  # a numpy integer as a Python int
        if (not isinstance(self.block, int) or self.block < 8 or self.block > 8192
                or self.block & (self.block - 1)):
            raise ValueError(f"block={self.block!r}; it must be a power of two from 8 to 8192")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype}; valid dtypes are "
                             f"{list(_SCALE_DTYPES)}")
        chunks = tuple(int(c) for c in self.chunk_numels)
        if any(c < 0 for c in chunks):
            raise ValueError(f"chunk_numels={list(chunks)} holds a negative size")
        object.__setattr__(self, "chunk_numels", chunks)
        offsets, total = [], 0
        for c in chunks:
            offsets.append(total)
            total += c
        object.__setattr__(self, "column_offsets", tuple(offsets))

    @property
    def segment_numel(self) -> int:
        """``S``: elements of one segment before padding."""
        return sum(self.chunk_numels)

    @property
    def blocks_per_segment(self) -> int:
        """Scale blocks per segment: ``ceil(segment_numel / block)``."""
        return -(-self.segment_numel // self.block)

    @property
    def code_bytes(self) -> int:
        """Bytes of codes per segment (a multiple of 4, so the scales after them are aligned)."""
        return self.blocks_per_segment * self.block * self.bits // 8

    @property
    def segment_bytes(self) -> int:
        """Bytes per segment: codes, then one scale per block."""
        return self.code_bytes + self.blocks_per_segment * self.scale_dtype.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole quantized buffer: ``world_size`` segments."""
        return self.world_size * self.segment_bytes

    def codes(self, buffer: torch.Tensor) -> torch.Tensor:
        """The ``(segments, code_bytes)`` uint8 view of ``buffer``'s codes."""
        return buffer.view(self.world_size, self.segment_bytes)[:, :self.code_bytes]

    def scales(self, buffer: torch.Tensor) -> torch.Tensor:
        """The ``(segments, blocks_per_segment)`` view of ``buffer``'s scales."""
        if self.blocks_per_segment == 0:  # nothing to view as scales
            return torch.empty(self.world_size, 0, dtype=self.scale_dtype, device=buffer.device)
        rows = buffer.view(self.world_size, self.segment_bytes)
        return rows[:, self.code_bytes:].view(self.scale_dtype)

    def ratio(self, value_dtype: torch.dtype = torch.float32) -> float:
        """Quantized bytes over the bytes of the unpadded values in ``value_dtype``."""
        plain = self.world_size * self.segment_numel * value_dtype.itemsize
        return self.total_bytes / plain if plain else 1.0


def quant_layout(numels: Sequence[int], world_size: int, *, bits: int = 8,
                 block: int = DEFAULT_BLOCK, scale_dtype: torch.dtype = torch.float32,
                 chunk_numels: Optional[Sequence[int]] = None) -> QuantLayout:
    """The :class:`QuantLayout` for tensors of ``numels`` elements (default chunks
    ``ceil(numel / world_size)``, like ``pack_rank_major``). Checks every argument."""
    chunks = _check_chunks(list(numels), chunk_numels, world_size)
    return QuantLayout(world_size, tuple(chunks), bits, block, scale_dtype)


def _check_buffer(name: str, buffer: torch.Tensor, numel: int, device=None) -> None:
    if buffer.dtype != torch.uint8 or buffer.numel() != numel or buffer.dim() != 1:
        raise ValueError(f"{name} is a {tuple(buffer.shape)} {buffer.dtype} tensor; the layout "
                         f"needs a flat torch.uint8 tensor of {numel} bytes")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} (stride {buffer.stride()}) must be contiguous")
    if device is not None and buffer.device != device:
        raise ValueError(f"{name} is on {buffer.device}; the tensors are on {device}")


def _check_values(name: str, tensors: Sequence[torch.Tensor]) -> torch.dtype:
    if not tensors:
        raise ValueError(f"{name} is empty")
    dtype = tensors[0].dtype
    for i, t in enumerate(tensors):
        if t.dtype != dtype or dtype not in _VALUE_DTYPES:
            raise ValueError(f"{name}[{i}] is {t.dtype}; all must share one of "
                             f"{list(_VALUE_DTYPES)} (tensors[0] is {dtype})")
    _check_same_device(name, tensors, tensors[0].device)
    return dtype


def _node_slots(world_size: int, node_size: Optional[int]) -> list[int]:
    """Buffer slot of each rank's segment: the identity, or node-local-rank-major order."""
    if node_size is None:
        return list(range(world_size))
    if not isinstance(node_size, int) or node_size < 1 or world_size % node_size:
        raise ValueError(f"node_size={node_size!r}; it must be a positive divisor of "
                         f"world_size {world_size}")
    nodes = world_size // node_size
    return [(r % node_size) * nodes + r // node_size for r in range(world_size)]


def quantize_pack(tensors: Sequence[torch.Tensor], layout: QuantLayout, *,
                  out: Optional[torch.Tensor] = None, node_size: Optional[int] = None,
                  check_finite: bool = True) -> torch.Tensor:
    """Pack ``tensors`` rank-major and quantize every block, in one pass over the values.

    Args:
        tensors: fp32, bf16 or fp16 tensors, all one dtype, on one device; ``layout`` must have
            been built for their sizes (``quant_layout([t.numel() for t in tensors], ...)``).
        layout: the :class:`QuantLayout` (world size, chunks, bits, block, scale dtype).
        out: a flat uint8 tensor of ``layout.total_bytes`` to write into (else allocated),
            sharing no memory with ``tensors`` (a ValueError otherwise).
        node_size: when given, the segment of rank ``node * node_size + local`` goes to slot
            ``local * (world_size / node_size) + node``, so an all-to-all over a node's ranks
            hands each peer the segments of every node for its local rank (hierarchical qgZ).
        check_finite: raise ``ValueError`` when a value is inf or nan (one device-to-host sync
            on the scales); ``False`` sends such blocks with scale inf (they dequantize to nan).

    Returns the quantized buffer. Memory: ``layout.total_bytes`` (about 1/4 (int8) or 1/8
    (int4) of fp32 values plus 4 bytes per block). Triton: each value read once, each byte
    written once, one launch; CPU: through one fp32 temporary of the padded packed size.
    No communication.
    """
    dtype = _check_values("quantize_pack: tensors", tensors)
    numels = [t.numel() for t in tensors]
    if len(numels) != len(layout.chunk_numels) or any(
            c * layout.world_size < n for n, c in zip(numels, layout.chunk_numels)):
        raise ValueError(f"quantize_pack: tensors of {numels} elements do not fit the layout's "
                         f"chunks {list(layout.chunk_numels)} x world_size {layout.world_size}")
    device = tensors[0].device
    slots = _node_slots(layout.world_size, node_size)
    if out is None:
        out = torch.empty(layout.total_bytes, dtype=torch.uint8, device=device)
    else:
        _check_buffer("quantize_pack: out", out, layout.total_bytes, device)
        _refuse_aliasing("quantize_pack", "out", out, "tensors", tensors)
    if layout.segment_numel == 0:
        return out
    if backend_for(out, *tensors) == "triton":
        from shardkit.kernels import triton_quantize
        triton_quantize.quantize_pack(tensors, layout, out, node_size or layout.world_size,
                                      dtype)
    else:
        _quantize_pack_torch(tensors, layout, out, slots)
    if check_finite:
        _raise_if_nonfinite(layout, out, slots)
    return out


def _raise_if_nonfinite(layout: QuantLayout, out: torch.Tensor, slots: list[int]) -> None:
    bad = torch.isinf(layout.scales(out))
    if bool(bad.any()):
        slot, block = (int(i) for i in bad.nonzero()[0])
        rank = slots.index(slot)
        raise ValueError(f"quantize_pack: the values of rank {rank}'s segment, elements "
                         f"[{block * layout.block}, {(block + 1) * layout.block}), hold inf or "
                         f"nan; pass check_finite=False to send them as a block that "
                         f"dequantizes to nan")


# ----------------------------------------------------------------------------- CPU path


def _ceil_to_bf16(scale: torch.Tensor) -> torch.Tensor:
    """Round non-negative finite fp32 values up to the next bf16 value (kept in fp32)."""
    bits = scale.view(torch.int32)
    return ((bits + 0xFFFF) & -65536).view(torch.float32)


def _quantize_blocks(values: torch.Tensor, layout: QuantLayout, codes_out: torch.Tensor,
                     scales_out: torch.Tensor, scratch: Optional[torch.Tensor] = None) -> None:
    """Quantize ``values`` (segments, blocks, block) fp32 into ``codes_out`` (uint8
    (segments, code_bytes)) and ``scales_out`` (segments, blocks), using ``scratch`` (same
    shape) as the working buffer, or ``values`` itself (overwritten) when it is ``None``."""
    qmax = QMAX[layout.bits]
    # amax and amin propagate nan and inf, and are far faster on CPU than abs().amax()
    absmax = torch.maximum(values.amax(-1), values.amin(-1).neg_())
    bad = ~torch.isfinite(absmax)
    # abs_: an all-zero block's max(0, -0.0) may be -0.0; its scale is +0.0, as on Triton
    scale = torch.where(bad, 0.0, absmax).abs_() / qmax
    if layout.scale_dtype == torch.bfloat16:
        scale = _ceil_to_bf16(scale)
    # x / scale + 0.5 as a division then an addition: the same bits as addcdiv(0.5, x, scale)
    # (its CPU kernel computes 0.5 + 1 * x / scale), about twice as fast on CPU, where
    # addcdiv's broadcast of the per-block scale is not vectorised well (measured)
    codes = torch.div(values, torch.where(scale > 0, scale, 1.0).unsqueeze(-1),
                      out=values if scratch is None else scratch)
    codes = codes.add_(0.5).floor_()
    if _scale_may_overshoot(scale):
        codes.clamp_(-qmax, qmax)
    if bool(bad.any()):
        codes[bad] = 0.0
    scales_out.copy_(torch.where(bad, math.inf, scale))
    codes = codes.view(values.shape[0], -1)
    if layout.bits == 8:
        codes_out.view(torch.int8).copy_(codes)
    else:  # low nibble: even element, high nibble: odd element, each stored as code + 8
        pairs = codes.view(values.shape[0], -1, 2)
        codes_out.copy_(torch.add(pairs[..., 0], pairs[..., 1], alpha=16).add_(136))


def _scale_may_overshoot(scale: torch.Tensor) -> bool:
    """Whether a code could leave ``[-qmax, qmax]``: only for subnormal scales. A normal scale
    is ``absmax / qmax`` within one rounding (or rounded up, for bf16 scales), so every
    ``x / scale`` is at most ``qmax`` plus a few ulps and rounds to at most ``qmax``; the clamp
    pass is then skipped (the same codes, one pass less on CPU)."""
    tiny = torch.finfo(torch.float32).tiny
    return bool(((scale > 0) & (scale < tiny)).any())


def _quantize_pack_torch(tensors, layout: QuantLayout, out: torch.Tensor, slots) -> None:
    seg, padded = layout.segment_numel, layout.blocks_per_segment * layout.block
    values = torch.empty(layout.world_size, padded, dtype=torch.float32, device=out.device)
    scratch = None
    packed = _already_packed(tensors, layout)
    if packed is not None:
        # the values lie in the packed layout already (qgZ's flat reduce-scatter input, qwZ's
        # consecutive chunks of a flat shard): read them in place, saving a copy pass;
        # ``values`` is only the working buffer then
        blocks = packed.view(layout.world_size, -1, layout.block)
        scratch = values.view(blocks.shape)
    else:
        values[:, seg:].zero_()
        for t, off, c in zip(tensors, layout.column_offsets, layout.chunk_numels):
            _write_columns(values[:, off:off + c], t.reshape(-1), t.numel(), c, 1.0)
        blocks = values.view(layout.world_size, -1, layout.block)
    if slots == sorted(slots):
        _quantize_blocks(blocks, layout, layout.codes(out), layout.scales(out), scratch)
        return
    codes = torch.empty(layout.world_size, layout.code_bytes, dtype=torch.uint8,
                        device=out.device)
    scales = torch.empty(layout.world_size, layout.blocks_per_segment,
                         dtype=layout.scale_dtype, device=out.device)
    _quantize_blocks(blocks, layout, codes, scales, scratch)
    index = torch.tensor(slots, device=out.device)
    layout.codes(out)[index] = codes
    layout.scales(out)[index] = scales


def _already_packed(tensors, layout: QuantLayout) -> Optional[torch.Tensor]:
    """A flat view of ``tensors`` when they already lie in the packed layout, else ``None``:
    fp32 segments of whole blocks, and either one contiguous tensor of exactly ``world_size``
    segments or, for one segment, tensors of exactly their chunk sizes lying back to back in
    one storage (a flat shard split into its parameters' chunks)."""
    if layout.segment_numel % layout.block or any(t.dtype != torch.float32 for t in tensors):
        return None
    if len(tensors) == 1:
        t = tensors[0]
        ok = t.is_contiguous() and t.numel() == layout.world_size * layout.segment_numel
        return t.reshape(-1) if ok else None
    if layout.world_size != 1 or [t.numel() for t in tensors] != list(layout.chunk_numels):
        return None
    return _back_to_back(tensors)


def _back_to_back(tensors) -> Optional[torch.Tensor]:
    """One flat view over ``tensors`` when they are contiguous and consecutive in one
    storage, else ``None``."""
    first = tensors[0]
    end = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.storage_offset() != end
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        end += t.numel()
    return first.as_strided((end - first.storage_offset(),), (1,))


def _dequantize_rows(buffer: torch.Tensor, layout: QuantLayout) -> torch.Tensor:
    """Every segment of ``buffer`` dequantized: fp32 (segments, padded segment numel)."""
    codes = layout.codes(buffer)
    rows = codes.shape[0]
    values = torch.empty(rows, layout.blocks_per_segment * layout.block, dtype=torch.float32,
                         device=buffer.device)
    if layout.bits == 8:
        values.copy_(codes.view(torch.int8))
    else:  # interleave the nibbles as int8 codes (1-byte passes), then one conversion
        nibbles = torch.stack((codes & 15, codes >> 4), dim=-1).view(torch.int8).sub_(8)
        values.view(-1).copy_(nibbles.view(-1))
    blocks = values.view(rows, -1, layout.block)
    blocks.mul_(layout.scales(buffer).unsqueeze(-1))
    return values


# ----------------------------------------------------------------------------- dequantize


def dequantize_unpack(buffer: torch.Tensor, layout: QuantLayout,
                      outs: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`quantize_pack` (rank order): decode a full quantized buffer (e.g. an
    all-gather of every rank's quantized segment) into the tensors ``outs`` (one dtype), dropping
    the padding. ``outs`` may not share memory with ``buffer`` (a ValueError).

    Memory: none beyond ``outs`` on Triton (CPU: one fp32 temporary of the padded packed size).
    Each byte read once, each kept element written once. No communication.
    """
    dtype = _check_values("dequantize_unpack: outs", outs)
    if len(outs) != len(layout.chunk_numels):
        raise ValueError(f"dequantize_unpack: {len(outs)} outs for a layout of "
                         f"{len(layout.chunk_numels)} tensors")
    for i, (t, c) in enumerate(zip(outs, layout.chunk_numels)):
        if c * layout.world_size < t.numel():
            raise ValueError(f"dequantize_unpack: outs[{i}] has {t.numel()} elements; the "
                             f"layout holds {c} x {layout.world_size}")
    _check_buffer("dequantize_unpack: buffer", buffer, layout.total_bytes, outs[0].device)
    _refuse_aliasing("dequantize_unpack", "buffer", buffer, "outs", outs)
    if layout.segment_numel == 0:
        return
    if backend_for(buffer, *outs) == "triton" and all(t.is_contiguous() for t in outs):
        from shardkit.kernels import triton_quantize
        triton_quantize.dequantize_unpack(buffer, layout, outs, dtype)
        return
    if _whole_block_int8(layout) and all(t.is_contiguous() for t in outs):
        _dequantize_unpack_direct(buffer, layout, outs)
        return
    _dequantize_unpack_via_rows(buffer, layout, outs)


def _whole_block_int8(layout: QuantLayout) -> bool:
    """int8 codes, every chunk a whole number of blocks (so are the offsets): each chunk of a
    segment can be decoded on its own, straight into its output."""
    return layout.bits == 8 and all(c % layout.block == 0 for c in layout.chunk_numels)


def _dequantize_unpack_via_rows(buffer: torch.Tensor, layout: QuantLayout,
                                outs: Sequence[torch.Tensor]) -> None:
    """Any layout: decode every segment into one fp32 temporary, then copy the columns out."""
    values = _dequantize_rows(buffer, layout)
    for t, off, c in zip(outs, layout.column_offsets, layout.chunk_numels):
        cols = values[:, off:off + c]
        if t.is_contiguous():
            _read_columns(t.view(-1), cols, t.numel(), c)
        else:
            t.copy_(cols.reshape(-1)[:t.numel()].view(t.shape))


def _dequantize_unpack_direct(buffer: torch.Tensor, layout: QuantLayout,
                              outs: Sequence[torch.Tensor]) -> None:
    """int8 whole-block chunks into contiguous ``outs``: each code is converted into its output
    element, which is then multiplied in place by its block's scale (the same bits as the
    fp32-temporary path), with no temporary of the whole buffer. (A single ``torch.mul(codes,
    scale, out=)`` would promote the int8 codes through a hidden fp32 temporary: 2.5x slower on
    CPU than the convert-then-scale pair, measured.)"""
    codes = layout.codes(buffer).view(torch.int8)
    scales = layout.scales(buffer).float().unsqueeze(-1)  # (segments, blocks, 1): fp32 math
    block = layout.block
    for t, off, c in zip(outs, layout.column_offsets, layout.chunk_numels):
        n = t.numel()
        if c == 0 or n == 0:
            continue
        flat, first, per = t.view(-1), off // block, c // block
        rows = n // c
        if rows:
            decoded = flat[:rows * c].view(rows, per, block)
            decoded.copy_(codes[:rows, off:off + c].view(rows, per, block))
            decoded.mul_(scales[:rows, first:first + per])
        if rows * c < n:  # the last rank's chunk is cut short: decode it whole, keep the start
            row = codes[rows, off:off + c].view(per, block).float().mul_(
                scales[rows, first:first + per])
            flat[rows * c:].copy_(row.view(-1)[:n - rows * c])


def dequantize_sum(buffer: torch.Tensor, layout: QuantLayout, *, sources: int,
                   multiplier: float = 1.0, out: Optional[torch.Tensor] = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``sources x outputs`` segments and sum over the sources in fp32:
    ``out[o] = multiplier * sum_s dequantize(segment s * outputs + o)``, ``outputs =
    layout.world_size / sources``.

    After an all-to-all of :func:`quantize_pack`'s buffer, rank ``r`` holds segment ``r`` of every
    rank (``sources = world_size``, one output): its reduce-scatter shard. Returns ``out``, a flat
    tensor of ``outputs x S`` elements (``S = layout.segment_numel``) in ``dtype`` (fp32, bf16 or
    fp16); a given ``out`` may not share memory with ``buffer`` (a ValueError). Sums run in
    source order, so every rank and both backends give the same bits.

    Memory: ``out`` only on Triton (CPU: fp32 temporaries of the decoded segments). Each byte
    read once. No communication.
    """
    if not isinstance(sources, int) or sources < 1 or layout.world_size % sources:
        raise ValueError(f"dequantize_sum: sources={sources!r}; it must be a positive divisor of "
                         f"the layout's {layout.world_size} segments")
    outputs = layout.world_size // sources
    numel = outputs * layout.segment_numel
    fresh_out = out is None
    if out is None:
        if dtype not in _VALUE_DTYPES:
            raise ValueError(f"dequantize_sum: dtype={dtype}; valid dtypes are "
                             f"{list(_VALUE_DTYPES)}")
        out = torch.empty(numel, dtype=dtype, device=buffer.device)
    elif (out.numel() != numel or out.dtype not in _VALUE_DTYPES or not out.is_contiguous()
          or out.device != buffer.device):
        raise ValueError(f"dequantize_sum: out is a {tuple(out.shape)} {out.dtype} tensor on "
                         f"{out.device}; expected {numel} contiguous elements of one of "
                         f"{list(_VALUE_DTYPES)} on {buffer.device}")
    _check_buffer("dequantize_sum: buffer", buffer, layout.total_bytes)
    if not fresh_out:
        _refuse_aliasing("dequantize_sum", "buffer", buffer, "out", [out], indexed=False)
    if numel == 0:
        return out
    if backend_for(buffer, out) == "triton":
        from shardkit.kernels import triton_quantize
        triton_quantize.dequantize_sum(buffer, layout, out, sources, outputs, float(multiplier))
        return out
    values = _dequantize_rows(buffer, layout).view(sources, outputs, -1)
    total = values[0]  # the decoded temporary is ours: sum into it in place
    for s in range(1, sources):
        total += values[s]
    if multiplier != 1.0:
        total *= multiplier
    if fresh_out and dtype == torch.float32 and total.shape[1] == layout.segment_numel:
        return total.view(-1)  # no padding to drop: the sum is the result
    out.view(outputs, -1).copy_(total[:, :layout.segment_numel])
    return out
