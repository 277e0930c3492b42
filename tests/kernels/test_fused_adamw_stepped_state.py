"""Regressions from the review of 41ae7e1 (FusedAdamW state for stepped parameters only; bf16
widened by its bits in the Triton kernels).

* FusedAdamW gave every batch of parameters first stepped after their group's first step flat
  buffers of their own, for good: an MoE whose experts got their first tokens on different
  steps stepped with one launch per expert from then on (64 experts: 64 launches a step, 4-12x
  slower on CPU, where one launch did it before).
* The Triton kernels narrowed a NaN to bf16 by keeping its top half, which reads inf when the
  payload lies in the low bits (fp32 NaN 0x7F800001, fp16 NaN 0x7C01): packing such a gradient
  into a bf16 buffer, or unpacking into bf16 tensors, turned NaN into inf where torch gives NaN.
"""

import pytest
import torch

from shardkit.kernels import pack_rank_major, unpack_rank_major
from shardkit.ops.adam import FusedAdam
from shardkit.optim import FusedAdamW


def fp32_from_bits(*bits):
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)


def fp16_from_bits(*bits):
    return torch.tensor([b - (1 << 16) if b >= 1 << 15 else b for b in bits],
                        dtype=torch.int32).to(torch.int16).view(torch.float16)


# NaNs whose top 16 bits (fp32) or widened top bits (fp16) alone read as inf, then a quiet NaN
FP32_LOW_NANS = fp32_from_bits(0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FC00000, 0x3F800000)
FP16_LOW_NANS = fp16_from_bits(0x7C01, 0xFC07, 0x7E00, 0x3C00)


@pytest.mark.parametrize("source", [FP32_LOW_NANS, FP16_LOW_NANS], ids=["fp32", "fp16"])
def test_nans_stay_nan_when_packed_or_unpacked_into_bf16(backend, source):
    expected = source.to(torch.bfloat16)  # torch: NaN for every NaN
    assert expected[:-1].isnan().all()
    packed = pack_rank_major([source], 1, dtype=torch.bfloat16)
    assert packed.isnan().tolist() == expected.isnan().tolist(), packed.tolist()
    assert torch.equal(packed[-1:], expected[-1:])

    out = torch.zeros(source.shape, dtype=torch.bfloat16)
    unpack_rank_major(pack_rank_major([source], 1), 1, [out])
    assert out.isnan().tolist() == expected.isnan().tolist(), out.tolist()


def test_bf16_nan_payloads_are_copied_bit_for_bit(backend):
    """bf16 into bf16 is a copy, as torch's: signalling and negative NaNs keep their bits."""
    values = torch.tensor([0x7F81, 0xFFC1 - (1 << 16), 0x7FC0, 0x0001], dtype=torch.int16)
    packed = pack_rank_major([values.view(torch.bfloat16)], 1)
    assert torch.equal(packed.view(torch.int16), values)


def counting_launches(opt):
    """Count the optimizer's fused updates (one kernel launch each) in ``opt.launches``."""
    opt.launches = 0
    update = opt._update

    def counted(*args, **kwargs):
        opt.launches += 1
        return update(*args, **kwargs)

    opt._update = counted
    return opt


def state_bytes(opt):
    """Bytes of the distinct storages behind the moments (step scalars left out)."""
    storages = {}
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step":
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def expert_params(seed):
    """24 'experts' of mixed sizes (and two float64 ones), as a model's parameter list."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [(8, 8), (3,), (16,), (4, 4), (1,), (8,)] * 4
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in sizes]
    params[5].data = params[5].data.double()
    params[17].data = params[17].data.double()
    return params


@pytest.mark.parametrize("cls,kwargs", [(FusedAdamW, dict(amsgrad=True, weight_decay=0.1)),
                                        (FusedAdam, dict(weight_decay=0.01))])
def test_parameters_first_stepped_one_at_a_time_keep_a_few_launches(cls, kwargs):
    """Expert ``k`` gets its first gradient at step ``k`` and is routed to on every other
    step after that: the training matches torch.optim.AdamW step by step with as many state
    bytes, and a step costs a few launches however many experts arrived."""
    ref_params, params = expert_params(0), expert_params(0)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, **kwargs)
    opt = counting_launches(cls(params, lr=1e-2, **kwargs))
    gen = torch.Generator().manual_seed(1)
    steps = len(params) + 4
    for step in range(steps):
        routed = [k for k in range(min(step + 1, len(params))) if (step - k) % 2 == 0]
        for k, (a, b) in enumerate(zip(ref_params, params)):
            a.grad = b.grad = None
            if k in routed:
                a.grad = torch.randn(a.shape, generator=gen, dtype=a.dtype)
                b.grad = a.grad.clone()
        opt.launches = 0
        ref.step()
        opt.step()
        for a, b in zip(ref_params, params):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
        assert state_bytes(opt) == state_bytes(ref), f"step {step}"
        # one launch per dtype when all arrived together; a few buffers per dtype here
        assert opt.launches <= 6, f"step {step}: {opt.launches} launches"
