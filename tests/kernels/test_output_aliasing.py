"""Regressions from a hunt through the kernels and the fused optimizers.

* ``pack_rank_major(tensors, out=...)`` and ``unpack_rank_major`` with an ``out`` (or outs)
  sharing memory with the other side (packing a flat gradient buffer's views into itself)
  returned a silently scrambled layout (values overwritten before they were read);
  ``quantize_pack`` / ``dequantize_unpack`` / ``dequantize_sum`` did the same under Triton
  (in parallel, a race on CUDA). Each is now a ValueError naming the tensor, before anything
  is written, on both backends.

From a review:

Review of the output-aliasing refusal (8d32d91): the check compared address ranges, so a
strided tensor whose range crossed the other tensor's without sharing an element (a column
block of a matrix and the free row part next to it, a column of a matrix and a row) was refused
with "shares memory", though the copy was exact before. The check is now exact: only an
element that really shares a byte is refused.
"""

import itertools
import random

import pytest
import torch

from shardkit.kernels import (dequantize_sum, dequantize_unpack, pack_rank_major, quant_layout,
                              quantize_pack, unpack_rank_major)


def test_packing_into_memory_it_reads_is_refused_before_writing(backend):
    flat = torch.arange(20.0)
    views = [flat[:10], flat[10:]]
    with pytest.raises(ValueError, match=r"pack_rank_major: tensors\[0\] \(shape \(10,\)\) "
                                         r"shares memory with out"):
        pack_rank_major(views, 2, out=flat)
    assert torch.equal(flat, torch.arange(20.0))  # nothing written

    packed = pack_rank_major([v.clone() for v in views], 2)
    with pytest.raises(ValueError, match=r"unpack_rank_major: outs\[1\] .* shares memory with "
                                         r"buffer"):
        unpack_rank_major(packed, 2, [torch.empty(10), packed[10:]])
    assert torch.equal(packed, pack_rank_major([v.clone() for v in views], 2))

    # one storage, disjoint parts: packed as before
    storage = torch.zeros(40)
    storage[:20] = torch.arange(20.0)
    out = pack_rank_major([storage[:10], storage[10:20]], 2, out=storage[20:])
    assert out.tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 5, 6, 7, 8, 9, 15, 16, 17, 18, 19]
    fulls = [storage[:10], storage[10:20]]
    unpack_rank_major(out * 2, 2, fulls)
    assert storage[:20].tolist() == [2.0 * i for i in range(20)]


def test_quantizing_into_memory_it_reads_is_refused_before_writing(backend):
    layout = quant_layout([64, 8], 2, block=8)
    values = torch.randn(64, generator=torch.Generator().manual_seed(0))
    store = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    inside = store[:32].view(torch.float32)  # 8 floats in the first bytes of the codes
    inside.copy_(torch.linspace(-1, 1, 8))
    before = store.clone()
    with pytest.raises(ValueError, match=r"quantize_pack: tensors\[1\] \(shape \(8,\)\) shares "
                                         r"memory with out"):
        quantize_pack([values, inside], layout, out=store, check_finite=False)
    assert torch.equal(store, before)

    buffer = quantize_pack([values, inside.clone()], layout)
    kept = buffer.clone()
    with pytest.raises(ValueError, match=r"dequantize_unpack: outs\[1\] .* shares memory with "
                                         r"buffer"):
        dequantize_unpack(buffer, layout, [torch.empty(64), buffer[:32].view(torch.float32)])
    assert torch.equal(buffer, kept)

    whole = quant_layout([64], 2, block=8)
    buffer = quantize_pack([values], whole)
    kept = buffer.clone()
    with pytest.raises(ValueError, match=r"dequantize_sum: out \(shape \(32,\)\) shares memory "
                                         r"with buffer"):
        dequantize_sum(buffer, whole, sources=2, out=buffer[:64].view(torch.bfloat16))
    assert torch.equal(buffer, kept)
    # the same call into memory of its own decodes as before
    expected = torch.empty(64)
    dequantize_unpack(buffer, whole, [expected])
    summed = dequantize_sum(buffer, whole, sources=2, out=torch.empty(32))
    assert torch.equal(summed, expected[:32] + expected[32:])


def test_interleaved_views_that_share_no_element_pack_as_before(backend):
    store = torch.zeros(2, 32)
    source = store[:, :8]  # elements 0..7 and 32..39: its range crosses 16..31
    source.copy_(torch.arange(16.0).view(2, 8))
    out = store[0, 16:32]
    expected = pack_rank_major([source.clone()], 2)
    assert torch.equal(pack_rank_major([source], 2, out=out), expected)
    assert torch.equal(store[:, :8], torch.arange(16.0).view(2, 8))  # the source is intact

    grid = torch.zeros(4, 5)
    buffer = grid[1, 1:5]  # elements 6..9; the column below is 0, 5, 10, 15
    buffer.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    unpack_rank_major(buffer, 2, [grid[:, 0]])
    assert grid[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert grid[1, 1:].tolist() == [1.0, 2.0, 3.0, 4.0]

    flat = torch.arange(20.0)
    with pytest.raises(ValueError, match=r"tensors\[0\] \(shape \(5, 4\)\) shares memory"):
        pack_rank_major([flat.view(4, 5).t()], 1, out=flat)  # a transpose of out itself
    assert torch.equal(flat, torch.arange(20.0))


def test_quantized_codes_between_the_rows_of_their_source(backend):
    layout = quant_layout([32], 2, block=8)
    row = 8 + layout.total_bytes // 4  # floats per row: 8 values, then room for the codes
    store = torch.zeros(4 * row)
    source = store.view(4, row)[:, :8]
    source.copy_(torch.linspace(-1, 1, 32).view(4, 8))
    codes = store[8:8 + layout.total_bytes // 4].view(torch.uint8)  # between rows 0 and 1
    assert codes.numel() == layout.total_bytes
    packed = quantize_pack([source], layout, out=codes, check_finite=False)
    assert torch.equal(packed, quantize_pack([source.clone()], layout, check_finite=False))

    expected = torch.empty(32)
    dequantize_unpack(packed.clone(), layout, [expected])
    source.zero_()
    dequantize_unpack(codes, layout, [source])  # into the rows around the codes
    assert torch.equal(source.reshape(-1), expected)


def _byte_set(t):
    """The bytes (relative to the storage) that ``t``'s elements occupy."""
    start, size = t.storage_offset(), t.element_size()
    taken = set()
    for index in itertools.product(*(range(n) for n in t.shape)):
        first = (start + sum(i * s for i, s in zip(index, t.stride()))) * size
        taken.update(range(first, first + size))
    return taken


def test_refused_exactly_when_an_element_shares_a_byte():
    """Random strided sources (stride 0, overlapping and interleaved layouts, other element
    sizes) against a contiguous ``out`` in the same storage: refused (nothing written) exactly
    when one of their bytes is the same, else packed as from a copy."""
    rng = random.Random(63)
    storage = torch.zeros(4096, dtype=torch.uint8)
    refused = packed = 0
    for _ in range(300):
        storage.copy_(torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(rng.randrange(99))))
        dtype = rng.choice([torch.float16, torch.float32])
        typed = storage.view(dtype)
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        stride = [rng.choice([0, 1, 2, 3, 7, 12, 40]) for _ in shape]
        source = typed.as_strided(shape, stride, rng.randint(0, 60))
        out_start = rng.randint(0, 200)
        out = typed[out_start:out_start + source.numel()]
        out_bytes = set(range(out_start * out.element_size(),
                              (out_start + out.numel()) * out.element_size()))
        expected = pack_rank_major([source.clone()], 1)
        before = storage.clone()
        if _byte_set(source) & out_bytes:
            with pytest.raises(ValueError, match="shares memory with out"):
                pack_rank_major([source], 1, out=out)
            assert torch.equal(storage, before)
            refused += 1
        else:
            result = pack_rank_major([source], 1, out=out)
            assert torch.equal(result.view(torch.uint8), expected.view(torch.uint8))
            packed += 1
    assert refused > 30 and packed > 30
