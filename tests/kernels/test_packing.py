"""Rank-major packing for reduce-scatter (Triton kernels under the interpreter, and the CPU path)
against a reference layout built with plain torch ops."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.kernels import (chunk_numels_for, pack_rank_major, shard_views, unpack_rank_major,
                              unpack_shard)

SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference_pack(tensors, world_size, chunks, scale, dtype):
    """Pad each tensor to world_size * chunk, lay the chunks side by side, rank by rank."""
    columns = []
    for t, c in zip(tensors, chunks):
        padded = torch.zeros(world_size * c, dtype=torch.float32)
        padded[:t.numel()] = t.reshape(-1).float() * scale
        columns.append(padded.view(world_size, c))
    return torch.cat(columns, dim=1).reshape(-1).to(dtype)


def padding_mask(numels, world_size, chunks):
    """True where the packed buffer holds padding."""
    columns = [torch.arange(world_size * c).view(world_size, c) >= n
               for n, c in zip(numels, chunks)]
    return torch.cat(columns, dim=1).reshape(-1)


tensor_specs = st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(DTYPES)),
                        min_size=1, max_size=5)


@SETTINGS
@given(specs=tensor_specs, world_size=st.integers(1, 5), extra=st.integers(0, 3),
       scale=st.sampled_from([1.0, 0.25, 1 / 3]), out_dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_pack_matches_reference_and_round_trips(backend, specs, world_size, extra, scale,
                                                out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen).to(dt) for n, dt in specs]
    numels = [t.numel() for t in tensors]
    chunks = [c + extra for c in chunk_numels_for(numels, world_size)]  # wider than needed too
    packed = pack_rank_major(tensors, world_size, scale=scale, dtype=out_dtype,
                             chunk_numels=chunks)
    assert packed.shape == (world_size * sum(chunks),) and packed.dtype == out_dtype
    expected = reference_pack(tensors, world_size, chunks, scale, out_dtype)
    torch.testing.assert_close(packed, expected, rtol=0, atol=0)
    assert not packed[padding_mask(numels, world_size, chunks)].any(), "padding must be zeros"

    exact = pack_rank_major(tensors, world_size, chunk_numels=chunks,
                            out=torch.full_like(packed, float("nan"), dtype=tensors[0].dtype))
    outs = [torch.full_like(t, float("nan")) for t in tensors]
    unpack_rank_major(exact, world_size, outs, chunk_numels=chunks)
    for t, back in zip(tensors, outs):
        back_cast = back.to(t.dtype)
        assert torch.equal(back_cast, t.to(tensors[0].dtype).to(t.dtype)), "round trip"


@SETTINGS
@given(sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=4),
       world_size=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_each_rank_segment_holds_its_shard(backend, sizes, world_size, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(n, generator=gen) for n in sizes]
    chunks = chunk_numels_for(sizes, world_size)
    packed = pack_rank_major(tensors, world_size)
    for rank, segment in enumerate(packed.view(world_size, -1)):
        for t, view, c in zip(tensors, shard_views(segment, chunks), chunks):
            expected = t[rank * c:(rank + 1) * c]
            assert torch.equal(view[:expected.numel()], expected)
            assert not view[expected.numel():].any()
        outs = [torch.empty(min(c, max(0, t.numel() - rank * c))) for t, c in zip(tensors, chunks)]
        unpack_shard(segment, outs, chunks)
        unpack_shard(segment, outs, chunks, accumulate=True)
        for t, out, c in zip(tensors, outs, chunks):
            assert torch.equal(out, 2 * t[rank * c:rank * c + out.numel()])


def test_pack_into_given_out_and_multidim_tensors(backend):
    tensors = [torch.arange(12.0).view(3, 4), torch.arange(5.0)]
    out = torch.empty(2 * (6 + 3))
    assert pack_rank_major(tensors, 2, out=out) is out
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7, 8, 9, 10, 11, 3, 4, 0]
    back = [torch.empty(3, 4), torch.empty(5)]
    unpack_rank_major(out, 2, back)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


def test_non_contiguous_sources_and_outs(backend):
    t = torch.arange(20.0).view(4, 5).t()  # non-contiguous
    packed = pack_rank_major([t], 3)
    assert torch.equal(packed[:20], t.reshape(-1)) and not packed[20:].any()
    out = torch.empty(4, 5).t()
    unpack_rank_major(packed, 3, [out])
    assert torch.equal(out, t)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool,
                                   torch.float8_e4m3fn])
def test_non_float_dtypes_round_trip_on_every_backend(backend, dtype):
    """Integer, bool and fp8 tensors (which the Triton kernels are not built for) are packed
    and unpacked exactly; the Triton road raised a bare KeyError for them."""
    tensors = [torch.arange(1, 8).to(dtype), torch.arange(1, 4).to(dtype).view(1, 3)]
    packed = pack_rank_major(tensors, 2)
    as_bytes = [t.view(torch.uint8) if dtype == torch.float8_e4m3fn else t for t in tensors]
    expected = reference_pack([t.to(torch.float32) for t in tensors], 2,
                              chunk_numels_for([7, 3], 2), 1.0, torch.float32).to(dtype)
    assert packed.dtype == dtype and torch.equal(packed.to(torch.float32),
                                                 expected.to(torch.float32))
    back = [torch.zeros_like(t) for t in tensors]
    unpack_rank_major(packed, 2, back)
    for t, b in zip(as_bytes, back):
        b = b.view(torch.uint8) if dtype == torch.float8_e4m3fn else b
        assert torch.equal(b, t)


def test_pack_float64_and_widening_scale_in_the_wider_dtype(backend):
    """Regression: the Triton kernels scaled float64 sources in fp32 (and narrowed them to bf16
    through fp32, rounding twice); the CPU path scaled fp32 sources for an fp64 buffer in fp32."""
    gen = torch.Generator().manual_seed(11)
    src64 = torch.randn(2049, generator=gen, dtype=torch.float64)
    for out_dtype in (torch.float64, torch.float32, torch.bfloat16):
        packed = pack_rank_major([src64], 3, scale=1 / 3, dtype=out_dtype)
        assert torch.equal(packed[:2049], (src64 * (1 / 3)).to(out_dtype)), out_dtype
    src32 = torch.randn(1000, generator=gen)
    packed = pack_rank_major([src32], 2, scale=1 / 3, dtype=torch.float64)
    assert torch.equal(packed, src32.double() * (1 / 3))


@pytest.mark.parametrize("src, dst, scale", [(torch.int64, torch.float64, 0.5),
                                             (torch.int64, torch.int32, 2),
                                             (torch.int32, torch.int16, 3),
                                             (torch.int32, torch.float32, 0.25),
                                             (torch.int32, torch.float16, 0.5),
                                             (torch.int32, torch.bfloat16, 0.3),
                                             (torch.bool, torch.bool, 2)])
def test_scaled_integer_data_packs_exactly_and_rounds_once(src, dst, scale):
    # before: every dtype pair but the 16-bit floats' went through an fp32 temporary: int64 to
    # fp64 lost its low bits (2**24 + 1 scaled by 0.5 gave 8388608.0) and integer outputs
    # raised ("result type Float can't be cast to the desired output type Int"); a first fix
    # multiplied int32 -> fp16 in fp16 (100000 overflowed to inf, others rounded twice)
    x = torch.tensor([2 ** 24 + 1, 100000, 70001, 3, 7, 5], dtype=torch.int64).to(src)
    got = pack_rank_major([x], 2, scale=scale, dtype=dst)
    if dst.is_floating_point:
        expected = (x.to(torch.float64) * scale).to(dst)
    else:
        expected = (x.to(torch.promote_types(src, dst)) * scale).to(dst)
    assert torch.equal(got, expected)
