"""Block-wise int8/int4 quantization fused with the rank-major packing (Triton kernels under
the interpreter, and the CPU path) against a plain-torch reference: exact codes, scales and byte
layout, the error bound the block scale implies, dequantize-and-sum, and the edge cases (empty
tensors, sizes not divisible by the block, all-zero blocks, inf/nan)."""

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.kernels import (dequantize_sum, dequantize_unpack, quant_layout, quantize_pack)

SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
QMAX = {8: 127, 4: 7}


def reference_segments(tensors, world_size, chunks, block):
    """fp32 (world_size, padded S): chunk r of every tensor side by side, zero padded."""
    columns = []
    for t, c in zip(tensors, chunks):
        padded = torch.zeros(world_size * c)
        padded[:t.numel()] = t.reshape(-1).float()
        columns.append(padded.view(world_size, c))
    segments = torch.cat(columns, dim=1)
    seg = segments.shape[1]
    return torch.nn.functional.pad(segments, (0, -(-seg // block) * block - seg))


def next_bf16_up(x):
    """The smallest bf16 value >= x (x >= 0, finite), as fp32."""
    near = x.to(torch.bfloat16)
    up = torch.nextafter(near, torch.full_like(near, math.inf))
    bumped = torch.where(near.float() < x, up, near)
    return bumped.float()


def reference_quantize(segments, bits, block, scale_dtype):
    """(codes as ints (W, padded S), scales as fp32 (W, blocks)) by the documented formulas."""
    blocks = segments.view(segments.shape[0], -1, block)
    scales = blocks.abs().amax(-1) / QMAX[bits]
    if scale_dtype == torch.bfloat16:
        scales = next_bf16_up(scales)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    codes = torch.floor(blocks / safe + 0.5).clamp(-QMAX[bits], QMAX[bits])
    return codes.view(segments.shape[0], -1).long(), scales


def decode_buffer(buffer, world_size, padded, bits, scale_dtype):
    """Read codes and scales back from the documented byte layout, by hand."""
    if padded == 0:
        return torch.zeros(world_size, 0, dtype=torch.long), torch.zeros(world_size, 0)
    nblocks_bytes = buffer.numel() // world_size
    code_bytes = padded * bits // 8
    rows = buffer.view(world_size, nblocks_bytes)
    raw = rows[:, :code_bytes]
    if bits == 8:
        codes = raw.view(torch.int8).long()
    else:
        low, high = (raw & 15).long() - 8, (raw >> 4).long() - 8
        codes = torch.stack([low, high], dim=-1).view(world_size, -1)
    scales = rows[:, code_bytes:].contiguous().view(scale_dtype).float()
    return codes, scales


def make_tensors(specs, dtype, seed, zero_from):
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for n, exponent in specs:
        t = torch.randn(n, generator=gen) * 10.0 ** exponent
        t[zero_from * n // 4:] = 0  # all-zero blocks at the end of some tensors
        tensors.append(t.to(dtype))
    return tensors


tensor_specs = st.lists(st.tuples(st.integers(0, 2500), st.integers(-3, 3)), min_size=1,
                        max_size=5)


@SETTINGS
@given(specs=tensor_specs, world_size=st.integers(1, 4), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([8, 32, 256]), dtype=st.sampled_from([torch.float32,
                                                                   torch.bfloat16]),
       scale_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       zero_from=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_quantize_matches_reference_and_round_trip_is_within_half_a_scale(
        backend, specs, world_size, bits, block, dtype, scale_dtype, zero_from, seed):
    tensors = make_tensors(specs, dtype, seed, zero_from)
    layout = quant_layout([t.numel() for t in tensors], world_size, bits=bits, block=block,
                          scale_dtype=scale_dtype)
    buffer = quantize_pack(tensors, layout)
    assert buffer.dtype == torch.uint8 and buffer.numel() == layout.total_bytes

    segments = reference_segments(tensors, world_size, layout.chunk_numels, block)
    codes, scales = reference_quantize(segments, bits, block, scale_dtype)
    got_codes, got_scales = decode_buffer(buffer, world_size, segments.shape[1], bits,
                                          scale_dtype)
    assert torch.equal(got_scales, scales), "one scale per block: absmax / qmax"
    assert torch.equal(got_codes, codes), "codes and their byte layout"

    outs = [torch.full(t.shape, math.nan) for t in tensors]  # fp32 outs: the bound, unrounded
    dequantize_unpack(buffer, layout, outs)
    expected = (codes.float().view(world_size, -1, block) * scales.unsqueeze(-1))
    expected = expected.view(world_size, -1)
    offset = 0
    for t, out, c in zip(tensors, outs, layout.chunk_numels):
        assert torch.equal(out.reshape(-1), expected[:, offset:offset + c].reshape(-1)[:t.numel()])
        element_scale = scales.repeat_interleave(block, dim=1)[:, offset:offset + c]
        bound = element_scale.reshape(-1)[:t.numel()] * (0.5 + 1e-5)
        assert ((out.reshape(-1) - t.float().reshape(-1)).abs() <= bound).all(), \
            "|x - dequantize(quantize(x))| <= scale / 2"
        offset += c

    low = [torch.empty(t.shape, dtype=dtype) for t in tensors]  # decoding into the input dtype
    dequantize_unpack(buffer, layout, low)
    assert all(torch.equal(a, b.to(dtype)) for a, b in zip(low, outs))


@pytest.mark.parametrize("magnitude", [1e-40, 1e-36, 1.0, 3e38])
@pytest.mark.parametrize("bits,scale_dtype", [(8, torch.float32), (4, torch.float32),
                                              (8, torch.bfloat16)])
def test_codes_stay_within_qmax_at_extreme_magnitudes(backend, magnitude, bits, scale_dtype):
    """Subnormal scales (where x / scale can overshoot qmax and the clamp matters), the largest
    finite values and each block's absmax itself all give the reference codes."""
    gen = torch.Generator().manual_seed(7)
    values = (torch.rand(4 * 64, generator=gen) * 2 - 1) * magnitude
    values[::64] = magnitude  # every block holds its absmax exactly, both signs below
    values[1::64] = -magnitude
    layout = quant_layout([values.numel()], 2, bits=bits, block=64, scale_dtype=scale_dtype)
    buffer = quantize_pack([values], layout)
    segments = reference_segments([values], 2, layout.chunk_numels, 64)
    codes, scales = reference_quantize(segments, bits, 64, scale_dtype)
    got_codes, got_scales = decode_buffer(buffer, 2, segments.shape[1], bits, scale_dtype)
    assert torch.equal(got_scales, scales) and torch.equal(got_codes, codes)
    assert got_codes.abs().max() <= QMAX[bits]
    out = torch.empty_like(values)
    dequantize_unpack(buffer, layout, [out])
    expected = (codes.float().view(2, -1, 64) * scales.unsqueeze(-1)).reshape(-1)
    assert torch.equal(out, expected[:values.numel()]), "decoded with the stored scales"


@SETTINGS
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
       world_size=st.integers(1, 4), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([8, 64, 512]), out_dtype=st.sampled_from([torch.float32,
                                                                       torch.bfloat16]),
       multiplier=st.sampled_from([1.0, 0.25, 1 / 3]), seed=st.integers(0, 2**16))
def test_dequantize_sum_over_ranks_matches_reference(backend, sizes, world_size, bits, block,
                                                     out_dtype, multiplier, seed):
    """The reduce side: ``world_size`` ranks' buffers, segment r of each, summed in fp32."""
    gen = torch.Generator().manual_seed(seed)
    ranks = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(world_size)]
    layout = quant_layout(sizes, world_size, bits=bits, block=block)
    buffers = [quantize_pack(ts, layout).view(world_size, -1) for ts in ranks]
    for r in range(world_size):
        received = torch.cat([b[r] for b in buffers])  # what an all-to-all hands rank r
        got = dequantize_sum(received, layout, sources=world_size, multiplier=multiplier,
                             dtype=out_dtype)
        total, exact, bound = 0.0, 0.0, 0.0
        for ts in ranks:
            seg = reference_segments(ts, world_size, layout.chunk_numels, block)[r:r + 1]
            codes, scales = reference_quantize(seg, bits, block, torch.float32)
            total = total + (codes.float().view(1, -1, block) * scales.unsqueeze(-1)).view(-1)
            exact = exact + seg.view(-1)
            bound = bound + scales.view(-1).repeat_interleave(block) * (0.5 + 1e-5)
        if multiplier != 1.0:
            total *= multiplier
        keep = layout.segment_numel
        assert torch.equal(got, total[:keep].to(out_dtype)), "fp32 sum in rank order"
        err = (got.float() - multiplier * exact[:keep]).abs()
        rounding = got.float().abs() * (2.0 ** -8 if out_dtype == torch.bfloat16 else 1e-6)
        assert (err <= multiplier * bound[:keep] + rounding + 1e-6).all(), \
            "error of the sum <= the sum of the half scales"


def test_known_bytes_int4_and_int8(backend):
    """A hand-worked block: absmax 7 -> scale 1, codes are the rounded values."""
    x = torch.tensor([7.0, -7.0, 0.5, -0.5, 1.49, 2.5, 0.0, 3.0])
    layout4 = quant_layout([8], 1, bits=4, block=8)
    buf = quantize_pack([x], layout4)
    # codes 7,-7,1,0,1,3,0,3 (floor(x + 0.5)); nibble = code + 8, even element low
    assert buf[:4].tolist() == [15 | (1 << 4), 9 | (8 << 4), 9 | (11 << 4), 8 | (11 << 4)]
    assert buf[4:].view(torch.float32).tolist() == [1.0]
    layout8 = quant_layout([8], 1, bits=8, block=8)
    buf = quantize_pack([x * (127 / 7)], layout8)
    assert buf[:8].view(torch.int8).tolist() == [127, -127, 9, -9, 27, 45, 0, 54]


def test_empty_all_zero_and_uneven_sizes(backend):
    tensors = [torch.zeros(0), torch.zeros(13), torch.randn(3)]
    layout = quant_layout([0, 13, 3], 2, bits=4, block=8)
    buf = quantize_pack(tensors, layout)
    scales = layout.scales(buf).float()
    assert torch.isfinite(scales).all() and (scales[:, 0] > 0).all()
    outs = [torch.full((n,), math.nan) for n in (0, 13, 3)]
    dequantize_unpack(buf, layout, outs)
    assert torch.equal(outs[1], torch.zeros(13)), "all-zero blocks come back as zeros"
    assert not outs[2].isnan().any()

    zeros = quant_layout([40], 3, block=16)
    zbuf = quantize_pack([torch.zeros(40)], zeros)
    assert (zeros.scales(zbuf) == 0).all(), "scale 0 for an all-zero block, never nan"
    assert not zeros.scales(zbuf).signbit().any(), "+0.0, the same bits on every backend"
    assert torch.equal(dequantize_sum(zbuf, zeros, sources=3), torch.zeros(14))

    nothing = quant_layout([0, 0], 4)
    assert nothing.total_bytes == 0
    assert quantize_pack([torch.zeros(0), torch.zeros(0)], nothing).numel() == 0
    assert nothing.scales(torch.empty(0, dtype=torch.uint8)).shape == (4, 0)
    assert dequantize_sum(torch.empty(0, dtype=torch.uint8), nothing, sources=4).numel() == 0


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, inf - inf
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_nonfinite_input_raises_or_dequantizes_to_nan(backend, bad):
    x = torch.randn(64)
    x[37] = bad
    layout = quant_layout([64], 2, bits=8, block=8)  # element 37: rank 1, elements [0, 8)
    with pytest.raises(ValueError, match=r"rank 1's segment, elements \[0, 8\), hold inf or nan"):
        quantize_pack([x], layout)
    buf = quantize_pack([x], layout, check_finite=False)
    scales = layout.scales(buf)
    assert not scales.isnan().any(), "never a nan scale"
    assert scales[1, 0] == math.inf and torch.isfinite(scales[0]).all()
    assert torch.isfinite(scales[1, 1:]).all()
    out = torch.empty(64)
    dequantize_unpack(buf, layout, [out])
    assert out[32:40].isnan().all(), "the block holding inf/nan dequantizes to nan"
    assert not out[:32].isnan().any() and not out[40:].isnan().any()


def test_node_order_puts_each_local_rank_column_together(backend):
    x = torch.randn(4 * 50)
    layout = quant_layout([x.numel()], 4, block=16)
    plain = quantize_pack([x], layout).view(4, -1)
    nodes = quantize_pack([x], layout, node_size=2).view(4, -1)
    # ranks (node, local): 0=(0,0) 1=(0,1) 2=(1,0) 3=(1,1); slots local-major: 0, 2, 1, 3
    for rank, slot in enumerate([0, 2, 1, 3]):
        assert torch.equal(nodes[slot], plain[rank])


BAD = [
    (lambda: quant_layout([8], 2, bits=3), "bits=3; valid values are [4, 8]"),
    (lambda: quant_layout([8], 2, block=12), "block=12; it must be a power of two from 8"),
    (lambda: quant_layout([8], 2, block=4), "block=4"),
    (lambda: quant_layout([8], 2, scale_dtype=torch.float16), "scale_dtype=torch.float16"),
    (lambda: quant_layout([8], 0), "world_size=0"),
    (lambda: quant_layout([9], 2, chunk_numels=[4]), "chunk_numels[0]=4 x world_size 2"),
    (lambda: quantize_pack([torch.randn(4), torch.randn(4).double()], quant_layout([4, 4], 1)),
     "tensors[1] is torch.float64"),
    (lambda: quantize_pack([torch.arange(4)], quant_layout([4], 1)), "tensors[0] is torch.int64"),
    (lambda: quantize_pack([torch.randn(9)], quant_layout([8], 1)),
     "tensors of [9] elements do not fit"),
    (lambda: quantize_pack([torch.randn(8)], quant_layout([8], 1),
                           out=torch.empty(36, dtype=torch.int8)), "out is a (36,) torch.int8"),
    (lambda: quantize_pack([torch.randn(8)], quant_layout([8], 2), node_size=3),
     "node_size=3; it must be a positive divisor"),
    (lambda: dequantize_sum(torch.empty(0, dtype=torch.uint8), quant_layout([8], 4), sources=3),
     "sources=3"),
    (lambda: dequantize_unpack(torch.empty(3, dtype=torch.uint8), quant_layout([8], 1),
                               [torch.empty(8)]), "buffer is a (3,) torch.uint8"),
    (lambda: quant_layout([-1], 2), "numels=[-1] holds a negative size"),
]


@pytest.mark.parametrize("call,message", BAD)
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_non_contiguous_sources_and_outs(backend):
    t = torch.randn(20, 30).t()  # non-contiguous
    layout = quant_layout([600], 3, block=64)
    buf = quantize_pack([t], layout)
    assert torch.equal(buf, quantize_pack([t.contiguous()], layout))
    out = torch.empty(20, 30).t()
    dequantize_unpack(buf, layout, [out])
    flat = torch.empty(600)
    dequantize_unpack(buf, layout, [flat])
    assert torch.equal(out, flat.view(30, 20))


@SETTINGS
@given(blocks=st.lists(st.integers(0, 6), min_size=1, max_size=4), world_size=st.integers(1, 4),
       cut=st.integers(0, 300), block=st.sampled_from([8, 64, 256]),
       scale_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       out_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2 ** 16))
def test_cpu_int8_direct_dequantize_gives_the_bits_of_the_general_path(
        blocks, world_size, cut, block, scale_dtype, out_dtype, seed):
    """int8 layouts whose chunks are whole blocks decode straight into the outputs (qwZ's
    case); the result must be the general path's bit for bit, the last rank's chunk cut short
    included."""
    from shardkit.kernels import quantize as q
    chunks = [b * block for b in blocks]
    numels = [max(0, c * world_size - (cut % c if c else 0)) for c in chunks]
    layout = quant_layout(numels, world_size, block=block, scale_dtype=scale_dtype,
                          chunk_numels=chunks)
    assert q._whole_block_int8(layout)
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen) * 3 for n in numels]
    if layout.segment_numel == 0:
        return
    buf = quantize_pack(tensors, layout)
    direct = [torch.full((n,), 7.0, dtype=out_dtype) for n in numels]
    general = [torch.full((n,), 7.0, dtype=out_dtype) for n in numels]
    q._dequantize_unpack_direct(buf, layout, direct)
    q._dequantize_unpack_via_rows(buf, layout, general)
    for a, b in zip(direct, general):
        assert torch.equal(a, b)


@SETTINGS
@given(blocks=st.integers(1, 40), world_size=st.integers(1, 4), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([8, 64, 256]), node_size=st.sampled_from([None, 1, 2]),
       seed=st.integers(0, 2 ** 16))
def test_cpu_quantize_of_an_already_packed_flat_buffer(blocks, world_size, bits, block,
                                                       node_size, seed):
    """A flat fp32 buffer of whole-block segments (qgZ's reduce-scatter input) is read in place:
    the same bytes as through the packing copy, and the input is left untouched."""
    if node_size is not None and world_size % node_size:
        node_size = None
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(world_size * blocks * block, generator=gen) * 4
    kept = flat.clone()
    layout = quant_layout([flat.numel()], world_size, bits=bits, block=block)
    strided = torch.stack([flat, flat], 1)[:, 0]  # same values, not contiguous: copied first
    direct = quantize_pack([flat], layout, node_size=node_size)
    assert torch.equal(direct, quantize_pack([strided], layout, node_size=node_size))
    assert torch.equal(flat, kept)


@SETTINGS
@given(blocks=st.lists(st.integers(0, 6), min_size=2, max_size=5), bits=st.sampled_from([4, 8]),
       block=st.sampled_from([8, 64, 256]), seed=st.integers(0, 2 ** 16))
def test_cpu_quantize_of_chunks_back_to_back_in_one_shard(blocks, bits, block, seed):
    """qwZ quantizes a flat shard split into its parameters' chunks: when they lie back to
    back in one storage they are read in place, with the bytes of separate copies; a gap or
    a reordering between them falls back to the copying path, with the same bytes again."""
    from shardkit.kernels import quantize as q
    chunks = [b * block for b in blocks]
    if sum(chunks) == 0:
        return
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(sum(chunks) + block, generator=gen) * 5
    kept = flat.clone()
    views = list(flat[:sum(chunks)].split(chunks))
    layout = quant_layout(chunks, 1, bits=bits, block=block, chunk_numels=chunks)
    assert q._already_packed(views, layout) is not None
    copies = [v.clone() for v in views]
    assert q._already_packed(copies, layout) is None or len(copies) == 1
    expected = quantize_pack(copies, layout)
    assert torch.equal(quantize_pack(views, layout), expected)
    assert torch.equal(flat, kept)
    gapped = [flat[:chunks[0]], flat[chunks[0] + block:chunks[0] + block + chunks[1]]]
    gap_layout = quant_layout(chunks[:2], 1, bits=bits, block=block, chunk_numels=chunks[:2])
    if chunks[0] and chunks[1]:
        assert q._already_packed(gapped, gap_layout) is None
    assert torch.equal(quantize_pack(gapped, gap_layout),
                       quantize_pack([g.clone() for g in gapped], gap_layout))
    swapped = [views[1], views[0]]
    swap_layout = quant_layout(chunks[1::-1], 1, bits=bits, block=block,
                               chunk_numels=chunks[1::-1])
    if chunks[0] and chunks[1]:
        assert q._already_packed(swapped, swap_layout) is None
    assert torch.equal(quantize_pack(swapped, swap_layout),
                       quantize_pack([v.clone() for v in swapped], swap_layout))
