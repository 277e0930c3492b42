"""Regressions from a hunt through the kernels and the fused optimizers.

* ``pack_rank_major(tensors, out=...)`` and ``unpack_rank_major`` with an ``out`` (or outs)
  sharing memory with the other side (packing a flat gradient buffer's views into itself)
  returned a silently scrambled layout (values overwritten before they were read);
  ``quantize_pack`` / ``dequantize_unpack`` / ``dequantize_sum`` did the same under Triton
  (in parallel, a race on CUDA). Each is now a ValueError naming the tensor, before anything
  is written, on both backends.
"""

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
