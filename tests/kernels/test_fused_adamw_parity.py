"""Regressions from a hunt through FusedAdamW and its kernels, torch.optim.AdamW's
default loop (``foreach=False``) as the reference.

* AMSGrad after a NaN/inf gradient: the Triton kernel and torch's fused CPU kernel kept the
  stale finite ``max_exp_avg_sq`` where torch.optim.AdamW's (``torch.maximum``) holds NaN.
* FusedAdamW's param groups lacked torch AdamW's ``foreach``, ``fused``, ``capturable``,
  ``differentiable`` and ``decoupled_weight_decay`` keys; a group added with
  ``decoupled_weight_decay=False`` was stepped as AdamW where torch steps it as Adam (L2).
* A parameter listed twice in a group was stepped once (torch steps it twice, one state).
* A sparse gradient was refused only after the groups before it had been stepped.

Its review found:

Review of the FusedAdamW changes (decoupled_weight_decay, parameters listed twice,
torch AdamW's group keys), against torch.optim.AdamW / Adam's default loop (``foreach=False``).

* parity step by step over hypothesis-chosen sizes, dtypes (16-bit parameters against fp32
  arithmetic rounded once per step, as the kernels compute), hyper-parameters and groups
  listing a parameter several times, with and without gradients;
* a parameter listed twice under a GradScaler whose step is skipped for inf;
* state dicts FusedAdamW -> torch AdamW -> FusedAdamW with duplicates and mixed groups.
"""

import copy
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from shardkit.kernels import adamw_step, adamw_step_many
from shardkit.optim import FusedAdamW, GradScaler

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


SETTINGS_rev = settings(max_examples=20, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])
LOW = (torch.bfloat16, torch.float16)


def quiet(build):
    """``build()`` without torch's "duplicate parameters" warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build()


def round_to(dtype, params, opt):
    """The reference's parameters and state rounded to ``dtype`` (16-bit storage)."""
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(dtype).float())
            for key, value in opt.state.get(p, {}).items():
                if key != "step":
                    value.copy_(value.to(dtype).float())


def assert_state_matches(ours, ref, opt, ref_opt, tolerance, what=""):
    for i, (p, q) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(p.detach().float(), q.detach(), **tolerance,
                                   msg=lambda m: f"{what}param {i}: {m}")
        state, ref_state = opt.state.get(p, {}), ref_opt.state.get(q, {})
        assert set(state) == set(ref_state), (i, set(state), set(ref_state))
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key].float(), value.float(), **tolerance,
                                       msg=lambda m: f"{what}{key} of param {i}: {m}")


@SETTINGS_rev
@given(dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       extra=st.lists(st.integers(0, 3), max_size=3),
       hyper=st.fixed_dictionaries(dict(
           lr=st.sampled_from([1e-2, 0.1]), weight_decay=st.sampled_from([0.0, 0.3]),
           amsgrad=st.booleans(), maximize=st.booleans(), eps=st.sampled_from([1e-8, 1e-3]),
           betas=st.sampled_from([(0.9, 0.999), (0.0, 0.9)]))),
       decoupled=st.booleans(), lr_tensor=st.booleans(), seed=st.integers(0, 2**16))
def test_groups_with_repeated_parameters_step_as_torch(backend, dtype, sizes, extra, hyper,
                                                       decoupled, lr_tensor, seed):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=gen) for n in sizes]
    # each parameter once, some again (extra[i] % len: any of them, possibly several times)
    order = list(range(len(sizes))) + [i % len(sizes) for i in extra]
    grads = [[None if torch.rand(1, generator=gen).item() < 0.2
              else torch.randn(n, generator=gen).to(dtype) for n in sizes] for _ in range(3)]
    options = dict(hyper, lr=torch.tensor(hyper["lr"]) if lr_tensor else hyper["lr"])

    ours = [torch.nn.Parameter(v.to(dtype, copy=True)) for v in values]  # no shared storage
    ref = [torch.nn.Parameter(v.to(dtype).to(torch.float32, copy=True)) for v in values]
    group = {"decoupled_weight_decay": decoupled}
    opt = quiet(lambda: FusedAdamW([dict(group, params=[ours[i] for i in order])], **options))
    ref_opt = quiet(lambda: torch.optim.AdamW([dict(group, params=[ref[i] for i in order])],
                                              foreach=False, **options))
    for step_grads in grads:
        for p, q, g in zip(ours, ref, step_grads):
            # fresh tensors: torch's .to/.float of an fp32 tensor would alias the input
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.to(torch.float32, copy=True)
        opt.step()
        ref_opt.step()
        if dtype in LOW:
            round_to(dtype, ref, ref_opt)
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else \
        dict(rtol=2e-2, atol=2e-2)
    assert_state_matches(ours, ref, opt, ref_opt, tolerance)


def scaled_training(optimizer_class, scaler_class, **extra):
    """Three steps of a Linear whose weight is listed twice, the second step's gradient inf
    (the scaler skips it): parameters, weight state, scale."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    weight, bias = model.weight, model.bias
    opt = quiet(lambda: optimizer_class([weight, bias, weight], lr=0.01, amsgrad=True,
                                        **extra))
    scaler = scaler_class(init_scale=2.0 ** 8, device="cpu")
    for step in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        scaler.scale(model(x).pow(2).sum()).backward()
        if step == 1:
            weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
    return [weight, bias], opt, scaler.get_scale()


@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, GradScaler])
def test_repeated_parameter_under_a_grad_scaler_steps_as_torch(backend, scaler_class):
    ours, opt, scale = scaled_training(FusedAdamW, scaler_class)
    ref, ref_opt, ref_scale = scaled_training(torch.optim.AdamW, scaler_class, foreach=False)
    assert scale == ref_scale == 128.0
    assert_state_matches(ours, ref, opt, ref_opt, dict(rtol=1e-5, atol=1e-6))
    assert opt.state[ours[0]]["step"].item() == 4  # two steps taken, the weight twice each


def mixed_groups(params):
    a, b, c, d = params
    return [{"params": [a, b, a], "amsgrad": True},
            {"params": [c, c], "weight_decay": 0.2},
            {"params": [d], "lr": 0.05, "maximize": True}]


def test_state_dict_round_trip_through_torch_with_repeated_parameters(backend):
    values = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 7, 3, 4)]

    def fresh():
        return [torch.nn.Parameter(v.clone()) for v in values]

    def train(params, opt, steps):
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    ref = fresh()
    ref_opt = quiet(lambda: torch.optim.AdamW(mixed_groups(ref), lr=0.01, foreach=False))
    train(ref, ref_opt, range(6))

    ours = fresh()
    opt = quiet(lambda: FusedAdamW(mixed_groups(ours), lr=0.01))
    train(ours, opt, range(2))
    via_torch = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_opt = quiet(lambda: torch.optim.AdamW(mixed_groups(via_torch), lr=0.01,
                                                foreach=False))
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(via_torch, torch_opt, range(2, 4))
    back = [torch.nn.Parameter(p.detach().clone()) for p in via_torch]
    resumed = quiet(lambda: FusedAdamW(mixed_groups(back), lr=0.01))
    resumed.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    train(back, resumed, range(4, 6))

    assert_state_matches(back, ref, resumed, ref_opt, dict(rtol=1e-5, atol=1e-6))
    saved, ref_saved = resumed.state_dict(), ref_opt.state_dict()
    assert [g["params"] for g in saved["param_groups"]] == \
        [g["params"] for g in ref_saved["param_groups"]]
    assert [sorted(g) for g in saved["param_groups"]] == \
        [sorted(g) for g in ref_saved["param_groups"]]
