"""Regressions from a hunt through FusedAdamW and its kernels (kern60), torch.optim.AdamW's
default loop (``foreach=False``) as the reference.

* AMSGrad after a NaN/inf gradient: the Triton kernel and torch's fused CPU kernel kept the
  stale finite ``max_exp_avg_sq`` where torch.optim.AdamW's (``torch.maximum``) holds NaN.
* FusedAdamW's param groups lacked torch AdamW's ``foreach``, ``fused``, ``capturable``,
  ``differentiable`` and ``decoupled_weight_decay`` keys; a group added with
  ``decoupled_weight_decay=False`` was stepped as AdamW where torch steps it as Adam (L2).
* A parameter listed twice in a group was stepped once (torch steps it twice, one state).
* A sparse gradient was refused only after the groups before it had been stepped.
"""

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.kernels import adamw_step, adamw_step_many
from shardkit.optim import FusedAdamW

SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def torch_adamw_run(values, grads, **hyper):
    """torch.optim.AdamW's default loop over one parameter: (param, state) after ``grads``."""
    p = torch.nn.Parameter(values.clone())
    opt = torch.optim.AdamW([p], foreach=False, **hyper)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]


def assert_same(actual, expected, what):
    """Equal up to rounding (torch's fused kernel and its default loop differ in the last bit),
    NaN where the reference is NaN."""
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN math
@SETTINGS
@given(n=st.integers(1, 40), bad_step=st.integers(0, 2), bad=st.sampled_from(
    [float("nan"), float("inf"), float("-inf")]), hyper=st.fixed_dictionaries(dict(
        lr=st.floats(1e-3, 0.1), weight_decay=st.floats(0.0, 0.2), maximize=st.booleans())),
    seed=st.integers(0, 2**16))
def test_amsgrad_max_after_a_nonfinite_gradient_is_torchs(backend, n, bad_step, bad, hyper,
                                                          seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(4)]
    grads[bad_step][torch.randperm(n, generator=gen)[:max(1, n // 3)]] = bad
    ref_p, ref_state = torch_adamw_run(values, grads, amsgrad=True, **hyper)

    # the flat step and the list step
    for many in (False, True):
        p, m, v, vmax = values.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
        kw = dict(lr=hyper["lr"], weight_decay=hyper["weight_decay"],
                  maximize=hyper["maximize"], amsgrad=True)
        for step, g in enumerate(grads, 1):
            if many:
                adamw_step_many([p], [g.clone()], [m], [v], steps=[step],
                                max_exp_avg_sqs=[vmax], **kw)
            else:
                adamw_step(p, g.clone(), m, v, step=step, max_exp_avg_sq=vmax, **kw)
        assert_same(p, ref_p, f"param (many={many})")
        for key, got in zip(STATE_KEYS, (m, v, vmax)):
            assert_same(got, ref_state[key], f"{key} (many={many})")

    # FusedAdamW
    q = torch.nn.Parameter(values.clone())
    opt = FusedAdamW([q], amsgrad=True, **hyper)
    for g in grads:
        q.grad = g.clone()
        opt.step()
    assert_same(q.detach(), ref_p, "FusedAdamW param")
    for key in STATE_KEYS:
        assert_same(opt.state[q][key], ref_state[key], f"FusedAdamW {key}")


def group_options(group):
    return {k: v for k, v in group.items() if k != "params"}


def test_param_groups_carry_torch_adamws_keys_both_ways():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    for kwargs in (dict(), dict(foreach=True, weight_decay=0.3), dict(fused=True)):
        ours = FusedAdamW([a], **kwargs)
        ref = torch.optim.AdamW([b], **kwargs)
        assert group_options(ours.param_groups[0]) == group_options(ref.param_groups[0])
        assert ours.param_groups[0]["foreach"] == kwargs.get("foreach")
        a.grad, b.grad = torch.ones(3), torch.ones(2)
        ours.step()
        ref.step()
        # each state dict loads into the other with torch's group keys
        ref.load_state_dict(ours.state_dict())
        ours.load_state_dict(ref.state_dict())
        assert group_options(ours.param_groups[0]) == group_options(ref.param_groups[0])

    # a state dict without the keys (an older FusedAdamW, DeepSpeed) gets torch's values; a
    # saved capturable=True (a CUDA-graph torch AdamW) resumes uncaptured, as this step runs
    saved = FusedAdamW([a]).state_dict()
    for key in ("foreach", "fused", "differentiable", "decoupled_weight_decay"):
        del saved["param_groups"][0][key]
    saved["param_groups"][0]["capturable"] = True
    opt = FusedAdamW([a])
    opt.load_state_dict(saved)
    assert group_options(opt.param_groups[0]) == group_options(
        torch.optim.AdamW([b]).param_groups[0])

    for bad in (dict(capturable=True), dict(differentiable=True),
                dict(fused=True, foreach=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            FusedAdamW([a], **bad)
        with pytest.raises(ValueError, match=next(iter(bad))):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))], **bad})
        assert len(opt.param_groups) == 1


def train_both(groups_of, steps=3, **kwargs):
    """FusedAdamW and torch.optim.AdamW(foreach=False) over equal parameters and gradients
    (``groups_of(params)`` builds the param groups); returns both (params, optimizer)."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    grads = [[torch.randn(v.shape, generator=gen) for v in values] for _ in range(steps)]
    runs = []
    for cls, extra in ((FusedAdamW, {}), (torch.optim.AdamW, dict(foreach=False))):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "duplicate parameters" warning
            opt = cls(groups_of(params), **kwargs, **extra)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt))
    return runs


def assert_runs_match(runs):
    (ours, opt), (ref, ref_opt) = runs
    for p, q in zip(ours, ref):
        assert_same(p.detach(), q.detach(), "param")
        for key, value in ref_opt.state[q].items():
            assert_same(opt.state[p][key], value, key)


def test_decoupled_weight_decay_false_group_steps_as_torch_adam(backend):
    runs = train_both(lambda ps: [{"params": ps[:1], "decoupled_weight_decay": False},
                                  {"params": ps[1:]}], weight_decay=0.5)
    assert_runs_match(runs)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_parameter_listed_twice_in_a_group_steps_twice_as_torch(backend, amsgrad):
    runs = train_both(lambda ps: [{"params": [ps[0], ps[1], ps[0]]}], amsgrad=amsgrad,
                      weight_decay=0.1)
    assert_runs_match(runs)
    (ours, opt), _ = runs
    assert opt.state[ours[0]]["step"].item() == 6 and opt.state[ours[1]]["step"].item() == 3
    with pytest.warns(UserWarning, match="duplicate parameters"):
        FusedAdamW([ours[0], ours[0]])
    with pytest.raises(ValueError, match="more than one parameter group"):
        FusedAdamW([{"params": [ours[0]]}, {"params": [ours[0], ours[1]]}])


def test_sparse_gradient_refused_before_any_group_is_stepped():
    dense, embedding = torch.nn.Linear(3, 1), torch.nn.Embedding(10, 3, sparse=True)
    opt = FusedAdamW([{"params": dense.parameters()}, {"params": embedding.parameters()}])
    dense(embedding(torch.tensor([1, 2]))).sum().backward()
    before = dense.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"shape \(10, 3\) has a sparse gradient"):
        opt.step()
    assert torch.equal(dense.weight, before)
    assert not opt.state


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                    reason="the compiled kernel: needs CUDA and TRITON_INTERPRET unset")
def test_compiled_amsgrad_kernel_propagates_nan_as_torch(monkeypatch):
    # the GPU's default max ignores NaN (as the interpreter's fmax did): check the compiled one
    monkeypatch.setenv("SHARDKIT_KERNELS", "triton")
    values = torch.randn(5000, device="cuda")
    grads = [torch.randn(5000, device="cuda") for _ in range(3)]
    grads[1][::7] = float("nan")
    grads[1][3::7] = float("inf")
    ref_p, ref_state = torch_adamw_run(values, grads, amsgrad=True, lr=0.01)
    p, m, v, vmax = values.clone(), *(torch.zeros_like(values) for _ in range(3))
    for step, g in enumerate(grads, 1):
        adamw_step_many([p], [g.clone()], [m], [v], steps=[step], lr=0.01, amsgrad=True,
                        max_exp_avg_sqs=[vmax])
    assert_same(p, ref_p, "param")
    for key, got in zip(STATE_KEYS, (m, v, vmax)):
        assert_same(got, ref_state[key], key)
