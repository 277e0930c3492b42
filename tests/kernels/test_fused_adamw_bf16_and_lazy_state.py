"""Regressions from a hunt through the kernels and the fused optimizers.

* bf16 subnormals (|x| < 1.2e-38: tiny gradients, and the second moments of small gradients)
  came out of the Triton kernels as other numbers or zero under the interpreter, which widens
  bf16 subnormals wrongly; the kernels now widen bf16 by its bits, exactly, as GPUs do.
* FusedAdamW (and DeepSpeed's FusedAdam on it) allocated optimizer state for every parameter of
  a group, frozen ones included: a frozen base model beside small adapters cost 8 bytes per
  frozen parameter, where torch.optim.AdamW costs nothing.
"""

import pytest
import torch

from shardkit.kernels import (adamw_step, adamw_step_many, dequantize_unpack, pack_rank_major,
                              quant_layout, quantize_pack, sgd_step, unpack_rank_major)
from shardkit.ops.adam import FusedAdam
from shardkit.optim import FusedAdamW

# bf16 subnormals of both signs, the smallest normal, a normal value and zeros
BF16_TINY = torch.tensor([1e-39, -2.5e-39, 9.2e-41, -1e-40, 5e-39, 1.1755e-38, 1.0, 0.0, -0.0],
                         dtype=torch.float32).to(torch.bfloat16)


def test_bf16_tiny_values_are_subnormal():
    tiny = torch.finfo(torch.bfloat16).tiny
    assert (BF16_TINY[:5].float().abs() < tiny).all() and (BF16_TINY[:5] != 0).all()


def laid_out(tensors, world_size, scale, dtype):
    """The rank-major layout by hand (fp32 arithmetic, one rounding to ``dtype``)."""
    chunks = [-(-t.numel() // world_size) for t in tensors]
    columns = []
    for t, c in zip(tensors, chunks):
        padded = torch.zeros(world_size * c)
        padded[:t.numel()] = t.float() * scale
        columns.append(padded.view(world_size, c))
    return torch.cat(columns, dim=1).reshape(-1).to(dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_bf16_subnormals_pack_and_unpack_exactly(backend, out_dtype, scale):
    tensors = [BF16_TINY, BF16_TINY[:4].clone(), BF16_TINY.flip(0).contiguous()]
    packed = pack_rank_major(tensors, 2, scale=scale, dtype=out_dtype)
    assert torch.equal(packed, laid_out(tensors, 2, scale, out_dtype))

    buffer = pack_rank_major(tensors, 2)  # bf16, exact
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        outs = [torch.full(t.shape, float("nan"), dtype=dtype) for t in tensors]
        unpack_rank_major(buffer, 2, outs)
        for t, out in zip(tensors, outs):
            assert torch.equal(out, t.to(dtype)), f"unpacked into {dtype}"


def run_steps(monkeypatch, backend):
    """AdamW (flat and many-tensor, amsgrad) and SGD steps on bf16 buffers whose moments and
    parameters are partly subnormal; returns every buffer after the steps."""
    monkeypatch.setenv("SHARDKIT_KERNELS", backend)
    gen = torch.Generator().manual_seed(0)
    n = 40
    param = torch.randn(n, generator=gen).to(torch.bfloat16)
    param[:BF16_TINY.numel()] = BF16_TINY
    grad = (torch.randn(n, generator=gen) * 1e-20).to(torch.bfloat16)  # g * g is subnormal
    exp_avg = (torch.randn(n, generator=gen) * 1e-39).to(torch.bfloat16)
    exp_avg_sq = (torch.rand(n, generator=gen) * 1e-39).to(torch.bfloat16)
    flat = [t.clone() for t in (param, grad, exp_avg, exp_avg_sq)]
    max_sq = exp_avg_sq.clone()
    adamw_step(*flat, step=2, lr=1e-3, weight_decay=0.0, amsgrad=True, max_exp_avg_sq=max_sq)
    many = [[t.clone()] for t in (param, grad, exp_avg, exp_avg_sq)]
    adamw_step_many(*many, steps=[3], lr=1e-3, weight_decay=0.1, decoupled=False)
    sgd = [param.clone(), grad.clone(), exp_avg.clone()]
    sgd_step(*sgd, lr=1e-3, momentum=0.9, weight_decay=0.01)
    return flat + [max_sq] + [t[0] for t in many] + sgd


def test_bf16_subnormal_optimizer_state_steps_as_torchs_fused_kernels(monkeypatch):
    """The Triton kernels give the bits of torch's fused CPU kernels (fp32 arithmetic, one
    rounding) on bf16 state holding subnormals."""
    expected = run_steps(monkeypatch, "torch")
    got = run_steps(monkeypatch, "triton")
    assert any((t.float().abs() < torch.finfo(torch.bfloat16).tiny).logical_and(t != 0).any()
               for t in expected), "the steps must keep subnormal values"
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"buffer {i}: {a[:8].tolist()} != {b[:8].tolist()}"


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_bf16_subnormal_values_quantize_alike_on_both_backends(monkeypatch, scale_dtype):
    values = [torch.cat([BF16_TINY[:5]] * 20), BF16_TINY[:3].clone()]
    layout = quant_layout([v.numel() for v in values], 2, block=8, scale_dtype=scale_dtype)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SHARDKIT_KERNELS", backend)
        buffer = quantize_pack(values, layout)
        outs = [torch.empty_like(v) for v in values]
        dequantize_unpack(buffer, layout, outs)
        results[backend] = (buffer, outs)
    assert torch.equal(results["triton"][0], results["torch"][0]), "codes and scales"
    for a, b in zip(results["triton"][1], results["torch"][1]):
        assert torch.equal(a, b)
    assert layout.scales(results["torch"][0]).float().gt(0).any(), "subnormal blocks kept"


def state_storage_bytes(opt):
    """Bytes of the distinct storages behind the optimizer's state tensors."""
    storages = {}
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def adapter_model(seed):
    """A frozen 'base' layer, a trainable adapter, and a head used only from step 3 on."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict(dict(base=torch.nn.Linear(64, 64), adapter=torch.nn.Linear(64, 2),
                                     late=torch.nn.Linear(64, 2)))
    model.base.requires_grad_(False)
    return model


def train_step(model, opt, step):
    opt.zero_grad()
    hidden = model.base(torch.randn(3, 64, generator=torch.Generator().manual_seed(step)))
    loss = model.adapter(hidden).pow(2).sum()
    if step >= 3:
        loss = loss + model.late(hidden).pow(2).sum()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("cls,kwargs", [(FusedAdamW, dict(amsgrad=True)),
                                        (FusedAdam, dict(weight_decay=0.01))])
def test_frozen_and_not_yet_used_parameters_cost_no_state(backend, cls, kwargs):
    """``FusedAdamW(model.parameters())`` over a frozen base model with adapters keeps state for
    the trained parameters only, as torch.optim.AdamW does, and a parameter whose first gradient
    comes later gets its state then; the training matches torch step by step."""
    ref_model, model = adapter_model(0), adapter_model(0)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, **kwargs)
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    for step in range(6):
        train_step(ref_model, ref, step)
        train_step(model, opt, step)
        assert state_storage_bytes(opt) == state_storage_bytes(ref), f"step {step}"
        for a, b in zip(ref_model.parameters(), model.parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert not any(p in opt.state for p in model.base.parameters())
    loaded = cls(model.parameters(), lr=1e-2, **kwargs)
    loaded.load_state_dict(opt.state_dict())
    assert state_storage_bytes(loaded) == state_storage_bytes(ref)
