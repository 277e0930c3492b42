"""The kernels' results do not depend on torch's default dtype (``torch.set_default_dtype``:
fp64 science code, models built in bf16), on both backends.

Regressions (torch backend):

* FusedAdamW (and ``shardkit.ops``' FusedAdam / DeepSpeedCPUAdam, which share its step) handed
  torch's fused kernel a step count built in the default dtype: under bf16 it is exact only up
  to 256, so the bias correction drifted (3e-5 from torch's AdamW after 600 steps, 2e-7 under
  fp32); torch keeps its step counts in fp32 whatever the default.
* ZeRO++'s dequantization decoded into a temporary of the default dtype, not fp32: under bf16
  decoded values moved by up to a third of a quantization step, and ``dequantize_sum`` with
  fp32 asked returned a bf16 (or fp64) tensor where no padding was dropped.
"""

import contextlib

import pytest
import torch

from shardkit.kernels import dequantize_sum, dequantize_unpack, quant_layout, quantize_pack
from shardkit.optim import FusedAdamW

DEFAULTS = (torch.float64, torch.bfloat16)


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _adamw_after(steps, make, dtype):
    """An fp32 parameter after ``steps`` steps of ``make`` with torch's default dtype
    ``dtype`` (fp32 parameters and gradients throughout)."""
    with default_dtype(dtype):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, dtype=torch.float32))
        opt = make([p])
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            p.grad = torch.randn(64, generator=g, dtype=torch.float32)
            opt.step()
        return p.detach().clone()


@pytest.mark.parametrize("dtype", DEFAULTS)
def test_fused_adamw_steps_as_torch_past_256_steps_whatever_the_default_dtype(backend, dtype):
    hyper = dict(lr=1e-2, weight_decay=0.01)
    got = _adamw_after(300, lambda ps: FusedAdamW(ps, **hyper), dtype)
    want = _adamw_after(300, lambda ps: torch.optim.AdamW(ps, **hyper), torch.float32)
    assert (got - want).abs().max().item() <= 1e-6


def _encoded(world, numel, bits, block):
    torch.manual_seed(3)
    layout = quant_layout([numel], world, bits=bits, block=block)
    return quantize_pack([torch.randn(numel, dtype=torch.float32)], layout), layout


def _decoded(buffer, layout, numel):
    out = torch.empty(numel, dtype=torch.float32)
    dequantize_unpack(buffer, layout, [out])
    return out


@pytest.mark.parametrize("dtype", DEFAULTS)
@pytest.mark.parametrize("bits", (8, 4))
def test_dequantization_is_fp32_whatever_the_default_dtype(backend, dtype, bits):
    world, block, numel = 2, 32, 2 * 64  # no padding: dequantize_sum's shortcut
    buffer, layout = _encoded(world, numel, bits, block)
    want_unpacked = _decoded(buffer, layout, numel)
    want_sum = dequantize_sum(buffer, layout, sources=world)
    with default_dtype(dtype):
        unpacked = _decoded(buffer, layout, numel)
        total = dequantize_sum(buffer, layout, sources=world)
    assert total.dtype == want_sum.dtype == torch.float32
    assert torch.equal(total, want_sum)
    assert torch.equal(unpacked, want_unpacked)
