"""Review of the kern60 FusedAdamW changes (decoupled_weight_decay, parameters listed twice,
torch AdamW's group keys), against torch.optim.AdamW / Adam's default loop (``foreach=False``).

* parity step by step over hypothesis-chosen sizes, dtypes (16-bit parameters against fp32
  arithmetic rounded once per step, as the kernels compute), hyper-parameters and groups
  listing a parameter several times, with and without gradients;
* a parameter listed twice under a GradScaler whose step is skipped for inf;
* state dicts FusedAdamW -> torch AdamW -> FusedAdamW with duplicates and mixed groups.
"""

import copy
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardkit.optim import FusedAdamW, GradScaler

SETTINGS = settings(max_examples=20, deadline=None,
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


@SETTINGS
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
