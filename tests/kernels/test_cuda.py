"""The compiled Triton kernels on a GPU against the torch path on the same data.

Skipped without CUDA, and under ``TRITON_INTERPRET=1`` (which tests/kernels/conftest.py sets by
default); on a GPU machine run ``TRITON_INTERPRET=0 python -m pytest tests/kernels/test_cuda.py``.
The interpreter tests cover the same kernel code on CPU.
"""

import os

import pytest
import torch

from shardkit.kernels import adamw_step, adamw_step_many, pack_rank_major, unpack_rank_major
from shardkit.kernels.dispatch import triton_available

if os.environ.get("TRITON_INTERPRET") == "1":
    pytestmark = pytest.mark.skip("TRITON_INTERPRET=1: the compiled kernels are not used")
elif not (torch.cuda.is_available() and triton_available()):
    pytestmark = pytest.mark.skip("needs CUDA and triton")


def run_both(monkeypatch, fn, *tensors):
    """``fn`` on copies of ``tensors`` with the Triton kernels and with the torch path."""
    results = []
    for backend in ("triton", "torch"):
        monkeypatch.setenv("SHARDKIT_KERNELS", backend)
        copies = [t.clone() for t in tensors]
        fn(*copies)
        torch.cuda.synchronize()
        results.append(copies)
    return results


@pytest.mark.parametrize("n", [1, 1023, 1025, 1 << 20])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_triton_matches_torch_on_cuda(monkeypatch, n, grad_dtype):
    gen = torch.Generator(device="cuda").manual_seed(n)
    p = torch.randn(n, device="cuda", generator=gen)
    g = torch.randn(n, device="cuda", generator=gen).to(grad_dtype)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    lp = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    found = torch.zeros((), device="cuda")

    def step(p, g, m, v, lp):
        for s in (1, 2, 3):
            adamw_step(p, g, m, v, step=s, lr=1e-2, weight_decay=0.1, found_inf=found,
                       low_precision_out=lp)

    (tp, _, tm, tv, tlp), (rp, _, rm, rv, _) = run_both(monkeypatch, step, p, g, m, v, lp)
    for a, b in ((tp, rp), (tm, rm), (tv, rv)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(tlp, tp.to(torch.bfloat16))


def test_adamw_many_and_packing_on_cuda(monkeypatch):
    sizes = [5, 4096, 1, 70_000]
    params = [torch.randn(s, device="cuda") for s in sizes]
    grads = [torch.randn(s, device="cuda") for s in sizes]

    def many(*ts):
        ps, gs = ts[:4], ts[4:]
        ms = [torch.zeros_like(p) for p in ps]
        vs = [torch.zeros_like(p) for p in ps]
        adamw_step_many(list(ps), list(gs), ms, vs, steps=[1, 2, 3, 4], lr=1e-2)

    (triton_out, torch_out) = run_both(monkeypatch, many, *params, *grads)
    for a, b in zip(triton_out[:4], torch_out[:4]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    for backend in ("triton", "torch"):
        monkeypatch.setenv("SHARDKIT_KERNELS", backend)
        packed = pack_rank_major(grads, 8, scale=0.125, dtype=torch.bfloat16)
        back = [torch.empty_like(g) for g in grads]
        unpack_rank_major(pack_rank_major(grads, 8), 8, back)
        assert all(torch.equal(a, b) for a, b in zip(grads, back))
        if backend == "triton":
            triton_packed = packed
    assert torch.equal(triton_packed, packed)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantize_triton_matches_torch_on_cuda(monkeypatch, bits, scale_dtype):
    from shardkit.kernels import dequantize_sum, dequantize_unpack, quant_layout, quantize_pack

    gen = torch.Generator(device="cuda").manual_seed(bits)
    sizes = [5, 4096, 0, 70_001, 1]
    grads = [torch.randn(s, device="cuda", generator=gen).to(torch.bfloat16) for s in sizes]
    layout = quant_layout(sizes, 8, bits=bits, block=256, scale_dtype=scale_dtype)
    results = {}
    for backend in ("triton", "torch"):
        monkeypatch.setenv("SHARDKIT_KERNELS", backend)
        buf = quantize_pack(grads, layout, node_size=2)
        outs = [torch.empty(s, device="cuda") for s in sizes]
        dequantize_unpack(quantize_pack(grads, layout), layout, outs)
        summed = dequantize_sum(buf, layout, sources=4, multiplier=0.25)
        torch.cuda.synchronize()
        results[backend] = (buf, outs, summed)
    (tb, to, ts), (rb, ro, rs) = results["triton"], results["torch"]
    assert torch.equal(tb, rb), "codes and scales: correctly rounded division on both paths"
    assert all(torch.equal(a, b) for a, b in zip(to, ro))
    torch.testing.assert_close(ts, rs, rtol=1e-6, atol=1e-6)  # the GPU may fuse mul+add
