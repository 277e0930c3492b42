"""The fused optimizer steps (Triton kernels under the interpreter, and the CPU path) against a
plain-torch reference written from the update rules of torch.optim.AdamW / torch.optim.SGD."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.kernels import adamw_step, adamw_step_many, sgd_step
from shardkit.kernels.triton_optim import BLOCK

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# sizes: mostly small, plus block boundaries and the top of the range
SIZES = st.one_of(st.integers(1, 3000),
                  st.sampled_from([1023, 1025, BLOCK - 1, BLOCK, BLOCK + 1, 100_000]))
GRAD_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


def reference_adamw(p, m, v, vmax, *, g, step, lr, beta1, beta2, eps, weight_decay, maximize,
                    amsgrad, decoupled):
    """One Adam(W) step in fp32, in plain torch ops; returns new (p, m, v, vmax).

    Note: fp32, like the kernels, not float64: with L2 decay (``decoupled=False``) the sum
    ``g + weight_decay * p`` can cancel, and a tiny ``eps`` then amplifies its fp32 rounding by
    up to ``lr / eps``; a float64 reference would flag that inherent fp32 error as a bug."""
    p, g, m, v = p.float(), g.float(), m.float(), v.float()
    if maximize:
        g = -g
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if amsgrad:
        vmax = torch.maximum(vmax.float(), v)
    second = vmax if amsgrad else v
    denom = second.sqrt() / math.sqrt(1 - beta2 ** step) + eps
    p = p - lr / (1 - beta1 ** step) * m / denom
    return p, m, v, vmax


def assert_close(actual, expected, what):
    torch.testing.assert_close(actual.double(), expected.double(), rtol=1e-6, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


ADAM_HYPER = st.fixed_dictionaries(dict(
    lr=st.floats(0.0, 0.1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.9, 0.9999),
    eps=st.floats(1e-8, 1e-3), weight_decay=st.floats(0.0, 0.2), maximize=st.booleans(),
    amsgrad=st.booleans(), decoupled=st.booleans()))


@SETTINGS
@given(n=SIZES, grad_dtype=GRAD_DTYPES, hyper=ADAM_HYPER, first_step=st.integers(1, 50),
       scaled=st.booleans(), low_precision=st.sampled_from([None, torch.bfloat16,
                                                            torch.float16]),
       seed=st.integers(0, 2**16))
def test_adamw_step_matches_reference(backend, n, grad_dtype, hyper, first_step, scaled,
                                      low_precision, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    vmax = v + torch.rand(n, generator=gen) * 0.01 if hyper["amsgrad"] else None
    lp = torch.empty(n, dtype=low_precision) if low_precision else None
    scale = torch.tensor(1024.0) if scaled else None
    ref = (p.clone(), m.clone(), v.clone(), vmax.clone() if vmax is not None else None)
    for step in range(first_step, first_step + 3):
        true_grad = torch.randn(n, generator=gen).to(grad_dtype)
        grad = true_grad * 1024 if scaled else true_grad.clone()
        adamw_step(p, grad, m, v, step=step, max_exp_avg_sq=vmax, grad_scale=scale,
                   found_inf=torch.tensor(0.0) if scaled else None, low_precision_out=lp,
                   **hyper)
        ref = reference_adamw(*ref, g=true_grad, step=step, **hyper)
        if scaled:
            assert torch.equal(grad, true_grad), "grad must hold the unscaled gradient"
    for actual, expected, what in zip((p, m, v, vmax), ref, ("param", "exp_avg", "exp_avg_sq",
                                                             "max_exp_avg_sq")):
        if actual is not None:
            assert_close(actual, expected, what)
    if lp is not None:
        assert torch.equal(lp, p.to(low_precision)), "low_precision_out must be the cast param"


@SETTINGS
@given(n=SIZES, dtypes=st.sampled_from([(torch.float16, torch.bfloat16),
                                        (torch.bfloat16, torch.float16),
                                        (torch.bfloat16, torch.bfloat16)]),
       seed=st.integers(0, 2**16))
def test_low_precision_out_of_a_16_bit_param_is_the_cast_of_the_stored_param(
        backend, n, dtypes, seed):
    # the Triton kernel cast the unrounded fp32 update into the copy: 241 of 4096 fp16
    # parameters' bf16 copies differed from the parameter it stored (the torch backend's agreed)
    param_dtype, out_dtype = dtypes
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(param_dtype)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    lp = torch.empty(n, dtype=out_dtype)
    for step in (1, 2):
        adamw_step(p, torch.randn(n, generator=gen).to(param_dtype), m, v, step=step, lr=0.01,
                   weight_decay=0.01, low_precision_out=lp)
        assert torch.equal(lp, p.to(out_dtype)), "low_precision_out must be the cast param"


@SETTINGS
@given(n=SIZES, amsgrad=st.booleans(), seed=st.integers(0, 2**16))
def test_found_inf_skips_everything(backend, n, amsgrad, seed):
    gen = torch.Generator().manual_seed(seed)
    bufs = [torch.randn(n, generator=gen).abs() for _ in range(5)]
    lp = torch.zeros(n, dtype=torch.bfloat16)
    before = [b.clone() for b in bufs] + [lp.clone()]
    p, g, m, v, vmax = bufs
    adamw_step(p, g, m, v, step=3, lr=0.1, amsgrad=amsgrad, max_exp_avg_sq=vmax,
               grad_scale=torch.tensor(8.0), found_inf=torch.tensor(1.0), low_precision_out=lp)
    for b, old in zip(bufs + [lp], before):
        assert torch.equal(b, old)


@SETTINGS
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=5), grad_dtype=GRAD_DTYPES,
       hyper=ADAM_HYPER, seed=st.integers(0, 2**16))
def test_adamw_step_many_matches_flat_reference(backend, sizes, grad_dtype, hyper, seed):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in sizes]
    exp_avgs = [torch.zeros(s) for s in sizes]
    exp_avg_sqs = [torch.zeros(s) for s in sizes]
    maxes = [torch.zeros(s) for s in sizes] if hyper["amsgrad"] else None
    refs = [(p.clone(), torch.zeros(s), torch.zeros(s), torch.zeros(s)) for p, s in
            zip(params, sizes)]
    for round_ in range(3):
        grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in sizes]
        steps = [round_ + 1 + i for i in range(len(sizes))]  # tensors may be at different steps
        adamw_step_many(params, grads, exp_avgs, exp_avg_sqs, steps=steps,
                        max_exp_avg_sqs=maxes, **hyper)
        refs = [reference_adamw(*r, g=g, step=s, **hyper) for r, g, s in zip(refs, grads, steps)]
    for i, (p, m, ref) in enumerate(zip(params, exp_avgs, refs)):
        assert_close(p, ref[0], f"param {i}")
        assert_close(m, ref[1], f"exp_avg {i}")


def reference_sgd(p, g, buf, *, lr, momentum, dampening, weight_decay, nesterov, maximize,
                  first_step):
    p, g = p.double(), g.double()
    g = -g if maximize else g
    g = g + weight_decay * p
    if momentum:
        buf = g.clone() if first_step else momentum * buf.double() + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


@SETTINGS
@given(n=SIZES, grad_dtype=GRAD_DTYPES, lr=st.floats(0.0, 0.5), momentum=st.floats(0.0, 0.99),
       dampening=st.floats(0.0, 0.5), weight_decay=st.floats(0.0, 0.1), nesterov=st.booleans(),
       maximize=st.booleans(), scaled=st.booleans(), seed=st.integers(0, 2**16))
def test_sgd_step_matches_reference(backend, n, grad_dtype, lr, momentum, dampening,
                                    weight_decay, nesterov, maximize, scaled, seed):
    if nesterov:
        momentum, dampening = max(momentum, 0.1), 0.0
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    buf = torch.empty(n) if momentum else None
    hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                 nesterov=nesterov, maximize=maximize)
    ref_p, ref_buf = p.clone(), None
    for i in range(3):
        true_grad = torch.randn(n, generator=gen).to(grad_dtype)
        grad = true_grad * 64 if scaled else true_grad.clone()
        sgd_step(p, grad, buf, first_step=i == 0, grad_scale=torch.tensor(64.0) if scaled
                 else None, **hyper)
        ref_p, ref_buf = reference_sgd(ref_p, true_grad, ref_buf, first_step=i == 0, **hyper)
    assert_close(p, ref_p, "param")
    if momentum:
        assert_close(buf, ref_buf, "momentum_buffer")


def test_sgd_found_inf_skips(backend):
    p, g, buf = torch.randn(2000), torch.randn(2000), torch.randn(2000)
    before = [p.clone(), g.clone(), buf.clone()]
    sgd_step(p, g, buf, lr=0.1, momentum=0.9, grad_scale=torch.tensor(4.0),
             found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip((p, g, buf), before))


def test_empty_buffers_are_a_no_op(backend):
    e = torch.empty(0)
    adamw_step(e, e.clone(), e.clone(), e.clone(), step=1, lr=0.1)
    sgd_step(e, e.clone(), e.clone(), lr=0.1, momentum=0.9)


def test_step_given_as_torchs_step_tensor_counts_as_its_value(backend):
    """``step=state["step"]`` (torch keeps it as a float32 or int64 scalar tensor) steps as
    the number it holds, on both backends (the Triton launch took the tensor for a pointer)."""
    gen = torch.Generator().manual_seed(3)
    start = [torch.randn(50, generator=gen) for _ in range(2)] + [
        torch.rand(50, generator=gen) for _ in range(2)]
    expected = [t.clone() for t in start]
    adamw_step(*expected, step=3, lr=0.1)
    import numpy as np
    for step in (torch.tensor(3.0), torch.tensor(3), np.int64(3), 3.0):
        one, many = [t.clone() for t in start], [[t.clone()] for t in start]
        adamw_step(*one, step=step, lr=0.1)
        adamw_step_many(*many, steps=[step], lr=0.1)
        for got in (one, [t[0] for t in many]):
            for actual, want in zip(got, expected):
                assert torch.equal(actual, want)


@pytest.mark.parametrize("skip", [False, True])
def test_adamw_step_many_unscales_and_skips(backend, skip):
    gen = torch.Generator().manual_seed(7)
    sizes = [3, 2000, 1]
    params = [torch.randn(s, generator=gen) for s in sizes]
    true_grads = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in sizes]
    grads = [g * 256 for g in true_grads]
    states = [[torch.zeros(s) for s in sizes] for _ in range(2)]
    before = [p.clone() for p in params]
    adamw_step_many(params, grads, *states, steps=[1, 1, 1], lr=0.1,
                    grad_scale=torch.tensor(256.0), found_inf=torch.tensor(float(skip)))
    for p, old, g, true in zip(params, before, grads, true_grads):
        assert torch.equal(p, old) == skip
        assert torch.equal(g, true * 256 if skip else true)
    if not skip:
        ref = [reference_adamw(old, torch.zeros_like(old), torch.zeros_like(old), None, g=true,
                               step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=0.01, maximize=False, amsgrad=False,
                               decoupled=True)[0] for old, true in zip(before, true_grads)]
        for p, expected in zip(params, ref):
            assert_close(p, expected, "param")


@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float16, torch.float32),
                                                    (torch.bfloat16, torch.float16),
                                                    (torch.float64, torch.float64)])
def test_adamw_step_param_and_grad_dtype_mixes(backend, param_dtype, grad_dtype):
    """Regression: the CPU path cast an fp32 gradient scaled by 65536 to the fp16 parameter's
    dtype (inf, then nan parameters); the Triton path updated float64 parameters in fp32."""
    gen = torch.Generator().manual_seed(3)
    n = 300
    compute = torch.float64 if param_dtype == torch.float64 else torch.float32
    p = torch.randn(n, generator=gen, dtype=torch.float64).to(param_dtype)
    m, v = torch.zeros(n, dtype=param_dtype), torch.zeros(n, dtype=param_dtype)
    true_grad = (torch.randn(n, generator=gen, dtype=torch.float64) / 3).to(grad_dtype)
    grad = (true_grad.to(compute) * 65536).to(grad_dtype)
    expected = reference_adamw(p, m, v, None, g=true_grad, step=1, lr=0.1, beta1=0.9,
                               beta2=0.999, eps=1e-8, weight_decay=0.01, maximize=False,
                               amsgrad=False, decoupled=True)
    if compute == torch.float64:  # float64 math: torch.optim.AdamW's own step
        ref_p = p.clone().requires_grad_()
        ref_p.grad = true_grad.clone()
        opt = torch.optim.AdamW([ref_p], lr=0.1, foreach=False)
        opt.step()
        state = opt.state[ref_p]
        expected = (ref_p.detach(), state["exp_avg"], state["exp_avg_sq"])
    adamw_step(p, grad, m, v, step=1, lr=0.1, grad_scale=torch.tensor(65536.0))
    assert torch.equal(grad, true_grad), "grad must hold the unscaled gradient"
    tol = 1e-12 if param_dtype == torch.float64 else 0
    for actual, ref in zip((p, m, v), expected):
        torch.testing.assert_close(actual, ref.to(param_dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_sgd_step_low_and_double_precision_params(backend, dtype):
    """Regression: torch's CPU fused SGD updated fp16/bf16 momentum buffers wrongly, and the
    Triton path updated float64 parameters in fp32."""
    gen = torch.Generator().manual_seed(5)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    p, g, buf = (torch.randn(300, generator=gen, dtype=torch.float64).to(dtype)
                 for _ in range(3))
    expected_p, expected_buf = reference_sgd(p, g, buf, lr=0.1, momentum=0.9, dampening=0.0,
                                             weight_decay=0.1, nesterov=False, maximize=False,
                                             first_step=False)
    if compute == torch.float32:  # the kernels' arithmetic: fp32, rounded once
        b32 = 0.9 * buf.float() + (g.float() + 0.1 * p.float())
        expected_p, expected_buf = p.float() - 0.1 * b32, b32
    sgd_step(p, g, buf, lr=0.1, momentum=0.9, weight_decay=0.1)
    tol = 1e-12 if dtype == torch.float64 else 0
    torch.testing.assert_close(buf, expected_buf.to(dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(p, expected_p.to(dtype), rtol=tol, atol=tol)


class _FloatArgumentsAsCompiled:
    """A Triton kernel whose Python-float arguments reach the interpreter as fp32 scalars, as a
    compiled kernel gets them (Triton types a Python float argument fp32); the interpreter
    otherwise keeps them as Python doubles."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        def as_fp32(x):
            return tl.tensor(TensorHandle(np.array([x], dtype=np.float32), tl.float32),
                             tl.float32) if type(x) is float else x
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*[as_fp32(x) for x in args], **kwargs)


@pytest.mark.parametrize("beta2", [0.999, 0.999999])
def test_adamw_kernels_take_one_minus_beta_from_the_host(monkeypatch, beta2):
    # before: 1.0 - beta2 was taken inside the kernel, in fp32 on a GPU: exp_avg_sq 1.3% off
    # torch's at beta2 = 0.999999 (the interpreter computed it in double and hid it)
    pytest.importorskip("triton.runtime.interpreter")
    from shardkit.kernels import triton_optim
    monkeypatch.setenv("SHARDKIT_KERNELS", "triton")
    for name in ("_adamw_flat_kernel", "_adamw_many_kernel"):
        monkeypatch.setattr(triton_optim, name,
                            _FloatArgumentsAsCompiled(getattr(triton_optim, name)))
    torch.manual_seed(0)
    g = torch.randn(4096)
    expected = (1 - beta2) * g.double() ** 2
    p, m, v = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    adamw_step(p, g, m, v, step=1, lr=1e-3, beta1=0.999, beta2=beta2, eps=1e-8,
               weight_decay=0.0)
    assert (v.double() / expected).sub(1).abs().max() < 1e-6
    assert (m.double() / (1e-3 * g.double())).sub(1).abs().max() < 1e-6  # 1 - beta1 too
    vs = [torch.zeros(4096)]
    adamw_step_many([torch.zeros(4096)], [g], [torch.zeros(4096)], vs, steps=[1], lr=1e-3,
                    beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0)
    assert (vs[0].double() / expected).sub(1).abs().max() < 1e-6
