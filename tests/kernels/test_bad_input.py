"""Bad input to the kernels gets a clear error naming the argument and what would be valid,
before anything is written; and the dispatch honours SHARDKIT_KERNELS."""

import re
import subprocess
import sys

import pytest
import torch

from shardkit.kernels import (adamw_step, adamw_step_many, backend_for, pack_rank_major,
                              sgd_step, unpack_rank_major, unpack_shard)


def buffers(n=8, **overrides):
    b = dict(param=torch.randn(n), grad=torch.randn(n), exp_avg=torch.zeros(n),
             exp_avg_sq=torch.zeros(n))
    b.update(overrides)
    return b


def call_adamw(b, **kw):
    adamw_step(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], **{"step": 1, "lr": 0.1,
                                                                        **kw})


ADAMW_CASES = [
    (dict(grad=torch.randn(9)), {}, "grad has shape"),
    (dict(exp_avg=torch.zeros(4, 2)), {}, "exp_avg has shape"),
    (dict(exp_avg_sq=torch.zeros(8, dtype=torch.float64)), {}, "exp_avg_sq is torch.float64"),
    (dict(grad=torch.zeros(8, device="meta")), {}, "grad is on meta"),
    (dict(param=torch.randn(16)[::2]), {}, "param (shape (8,), stride (2,)) is not contiguous"),
    (dict(grad=torch.randn(16)[::2]), {}, "grad (shape (8,), stride (2,)) is not contiguous"),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), {}, "grad is torch.int32"),
    ({}, dict(amsgrad=True), "amsgrad=True needs max_exp_avg_sq"),
    ({}, dict(step=0), "step=0; it counts from 1"),
    ({}, dict(step=float("nan")), "step=nan; valid values are numbers >= 1"),
    ({}, dict(step=torch.tensor([1.0, 2.0])), "step is a torch.float32 tensor of 2 elements"),
    ({}, dict(lr=-1.0), "lr=-1.0"),
    ({}, dict(beta2=1.0), "beta2=1.0; valid range is [0, 1)"),
    ({}, dict(grad_scale=torch.ones(2)), "grad_scale must be a one-element tensor"),
    ({}, dict(low_precision_out=torch.empty(7, dtype=torch.bfloat16)),
     "low_precision_out has shape"),
]


@pytest.mark.parametrize("overrides,kwargs,message", ADAMW_CASES)
def test_adamw_step_rejects_bad_buffers(backend, overrides, kwargs, message):
    b = buffers(**overrides)
    before = {k: v.clone() for k, v in b.items() if v.device.type == "cpu"}
    with pytest.raises(ValueError, match=_escaped(message)):
        call_adamw(b, **kwargs)
    assert all(torch.equal(b[k], v) for k, v in before.items()), "nothing may be written"


def test_adamw_step_many_rejects_mismatched_lists(backend):
    p = [torch.randn(4), torch.randn(5)]
    with pytest.raises(ValueError, match="grads has 1 entries for 2 params"):
        adamw_step_many(p, [torch.randn(4)], [torch.zeros(4)] * 2, [torch.zeros(4)] * 2,
                        steps=[1, 1], lr=0.1)
    with pytest.raises(ValueError, match=r"tensor 1\): exp_avg has shape \(4,\), param has "
                                         r"\(5,\)"):
        adamw_step_many(p, [torch.randn(4), torch.randn(5)], [torch.zeros(4)] * 2,
                        [torch.zeros(4), torch.zeros(5)], steps=[1, 1], lr=0.1)
    with pytest.raises(ValueError, match=r"steps\[1\]=0"):
        adamw_step_many(p, [torch.randn(4), torch.randn(5)], [torch.zeros(4), torch.zeros(5)],
                        [torch.zeros(4), torch.zeros(5)], steps=[1, 0], lr=0.1)


def test_sgd_step_rejects_bad_input(backend):
    p = torch.randn(8)
    with pytest.raises(ValueError, match="momentum=0.9 needs momentum_buffer"):
        sgd_step(p, torch.randn(8), None, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum_buffer has shape"):
        sgd_step(p, torch.randn(8), torch.zeros(3), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0 and dampening == 0"):
        sgd_step(p, torch.randn(8), torch.zeros(8), lr=0.1, momentum=0.9, dampening=0.1,
                 nesterov=True)
    with pytest.raises(ValueError, match="grad .* is not contiguous"):
        sgd_step(p, torch.randn(16)[::2], None, lr=0.1)


def test_packing_rejects_bad_layouts(backend):
    t = [torch.randn(10), torch.randn(3)]
    with pytest.raises(ValueError, match=r"chunk_numels\[0\]=4 x world_size 2 < numel 10: .* "
                                         r"use at least ceil\(10 / 2\) = 5"):
        pack_rank_major(t, 2, chunk_numels=[4, 2])
    with pytest.raises(ValueError, match="chunk_numels has 1 entries for 2 tensors"):
        pack_rank_major(t, 2, chunk_numels=[5])
    with pytest.raises(ValueError, match="world_size=0; it must be an int >= 1"):
        pack_rank_major(t, 0)
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        pack_rank_major([torch.randn(3), torch.randn(3, device="meta")], 2)
    with pytest.raises(ValueError, match="out has 7 torch.float32 elements on cpu; expected 14"):
        pack_rank_major(t, 2, out=torch.empty(7))
    with pytest.raises(ValueError, match="out has 14 torch.float16 elements"):
        pack_rank_major(t, 2, out=torch.empty(14, dtype=torch.float16))
    with pytest.raises(ValueError, match="out .* must be contiguous"):
        pack_rank_major(t, 2, out=torch.empty(28)[::2])
    with pytest.raises(ValueError, match=r"buffer has 15 elements; the layout needs world_size "
                                         r"2 x 7 = 14"):
        unpack_rank_major(torch.empty(15), 2, t)
    with pytest.raises(ValueError, match=r"chunk_numels\[0\]=2 is smaller than outs\[0\]"):
        unpack_shard(torch.empty(4), [torch.empty(3), torch.empty(1)], [2, 2])
    ints = [torch.arange(5), torch.arange(3)]
    out = torch.full((10,), -1)
    with pytest.raises(ValueError, match=r"scale=0.5 with the packed dtype torch.int64; a scale "
                                         r"needs a floating dtype"):
        pack_rank_major(ints, 2, scale=0.5, out=out)
    assert (out == -1).all()  # refused before anything was written
    assert pack_rank_major(ints, 2, scale=2).tolist() == [0, 2, 4, 0, 2, 6, 8, 0, 4, 0]
    assert pack_rank_major(ints, 2, scale=0.5, dtype=torch.float32).tolist() == [
        0.0, 0.5, 1.0, 0.0, 0.5, 1.5, 2.0, 0.0, 1.0, 0.0]


def _escaped(message):
    return re.escape(message)


def test_backend_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("SHARDKIT_KERNELS", "torch")
    assert backend_for(cpu) == "torch"
    monkeypatch.setenv("SHARDKIT_KERNELS", "auto")
    assert backend_for(cpu) == "torch"  # Triton runs on CUDA tensors only, unless forced
    monkeypatch.setenv("SHARDKIT_KERNELS", "triton")
    assert backend_for(cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        backend_for(cpu)
    monkeypatch.setenv("SHARDKIT_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"SHARDKIT_KERNELS='cuda'; valid values are"):
        backend_for(cpu)


def test_cpu_path_works_without_triton_installed():
    """Triton is optional at install time: with it unimportable, the CPU paths still work."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from shardkit.kernels import adamw_step, pack_rank_major, triton_available\n"
        "assert not triton_available()\n"
        "p, g, m, v = torch.ones(5), torch.ones(5), torch.zeros(5), torch.zeros(5)\n"
        "adamw_step(p, g, m, v, step=1, lr=0.1)\n"
        "assert pack_rank_major([p], 2).numel() == 6\n"
        "print('ok')\n")
    env = {"SHARDKIT_KERNELS": "auto", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
