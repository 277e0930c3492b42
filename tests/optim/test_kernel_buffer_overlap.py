"""The raw optimizer kernels refuse buffers that share memory where the step writes.

``shardkit.kernels.adamw_step_many`` (and ``adamw_step`` / ``sgd_step``) update every element
in place and in parallel: a tensor passed twice, or two overlapping views, raced on the Triton
path and was silently stepped twice with one entry's state on the CPU path. They are now a
ValueError naming both entries, raised before anything is written. Gradients, which are only
read, may still be shared (unless a ``grad_scale`` writes the unscaled gradient back).
Both backends: the Triton kernels (under ``TRITON_INTERPRET=1``) and torch's CPU path.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from shardkit.kernels import adamw_step, adamw_step_many, sgd_step  # noqa: E402


@pytest.fixture(params=("triton", "torch"))
def backend(request, monkeypatch):
    monkeypatch.setenv("SHARDKIT_KERNELS", request.param)
    return request.param


def _buffers(n: int = 10, count: int = 2):
    gen = torch.Generator().manual_seed(n)
    return ([torch.randn(n, generator=gen) for _ in range(count)],
            [torch.randn(n, generator=gen) for _ in range(count)],
            [torch.zeros(n) for _ in range(count)], [torch.zeros(n) for _ in range(count)])


def _refused(call, *names):
    """``call`` raises a ValueError that names each of ``names``."""
    with pytest.raises(ValueError, match="share memory") as info:
        call()
    for name in names:
        assert name in str(info.value)


def test_a_parameter_listed_twice_is_refused_before_any_write(backend):
    params, grads, exp_avgs, exp_avg_sqs = _buffers()
    shared = params[0]
    before = shared.clone()
    _refused(lambda: adamw_step_many([shared, shared], grads, exp_avgs, exp_avg_sqs,
                                     steps=[1, 1], lr=0.1), "params[0]", "params[1]")
    assert torch.equal(shared, before)
    assert all(not m.any() for m in exp_avgs)


def test_overlapping_views_and_shared_state_are_refused(backend):
    params, grads, exp_avgs, exp_avg_sqs = _buffers(count=1)
    whole = torch.randn(12)
    _refused(lambda: adamw_step_many([whole[:8], whole[4:]], [torch.randn(8)] * 2,
                                     [torch.zeros(8), torch.zeros(8)],
                                     [torch.zeros(8), torch.zeros(8)], steps=[1, 1], lr=0.1),
             "params[0]", "params[1]")
    state = torch.zeros(10)
    _refused(lambda: adamw_step_many(params + [torch.randn(10)], grads * 2, [state, state],
                                     exp_avg_sqs + [torch.zeros(10)], steps=[1, 1], lr=0.1),
             "exp_avgs[0]", "exp_avgs[1]")
    p = torch.randn(10)
    _refused(lambda: adamw_step(p, torch.randn(10), p, torch.zeros(10), step=1, lr=0.1),
             "param", "exp_avg")
    _refused(lambda: adamw_step(p, p, torch.zeros(10), torch.zeros(10), step=1, lr=0.1),
             "param", "grad")
    _refused(lambda: sgd_step(p, torch.randn(10), p, lr=0.1, momentum=0.9),
             "param", "momentum_buffer")


def test_shared_gradients_are_read_only_unless_unscaled_in_place(backend):
    params, _, exp_avgs, exp_avg_sqs = _buffers()
    grad = torch.randn(10)
    expected = [p.clone() for p in params]
    for p in expected:
        adamw_step(p, grad.clone(), torch.zeros(10), torch.zeros(10), step=1, lr=0.1)
    adamw_step_many(params, [grad, grad], exp_avgs, exp_avg_sqs, steps=[1, 1], lr=0.1)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-7)
    _refused(lambda: adamw_step_many(params, [grad, grad], exp_avgs, exp_avg_sqs, steps=[2, 2],
                                     lr=0.1, grad_scale=torch.tensor(2.0)),
             "grads[0]", "grads[1]")


def test_separate_tensors_still_step_as_one_at_a_time(backend):
    """Neighbouring views of one flat buffer (FusedAdamW's layout) are not overlaps."""
    flat = torch.randn(30)
    params = [flat[:10], flat[10:25], flat[25:]]
    expected = [p.clone() for p in params]
    grads = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(i))
             for i, p in enumerate(params)]
    states = torch.zeros(60)
    exp_avgs = [states[:10], states[10:25], states[25:30]]
    exp_avg_sqs = [states[30:40], states[40:55], states[55:60]]
    adamw_step_many(params, grads, exp_avgs, exp_avg_sqs, steps=[1, 1, 1], lr=0.1)
    for want, g in zip(expected, grads):
        adamw_step(want, g, torch.zeros_like(want), torch.zeros_like(want), step=1, lr=0.1)
    for p, want in zip(params, expected):
        torch.testing.assert_close(p, want, rtol=1e-6, atol=1e-7)
