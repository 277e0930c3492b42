"""``shardkit.ops.adam``: DeepSpeed's ``FusedAdam`` and ``DeepSpeedCPUAdam`` against torch.

``adam_w_mode`` / ``adamw_mode`` true steps exactly as ``torch.optim.AdamW``, false as
``torch.optim.Adam`` (weight decay as L2 on the gradient); ``bias_correction=False`` as the
uncorrected update written out below. Hypothesis chooses the hyper-parameters, shapes, the
param-group split and the steps; one process.
"""

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

from shardkit.ops.adam import DeepSpeedCPUAdam, FusedAdam

HYPER = dict(
    lr=st.floats(1e-4, 1e-1), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]), weight_decay=st.floats(0.0, 0.5),
    steps=st.integers(1, 4), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    seed=st.integers(0, 2 ** 16), cpu=st.booleans())


def _params(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for n in sizes]


def _run(make, values, grads):
    params = [torch.nn.Parameter(v.clone()) for v in values]
    # two groups when there are several tensors: the second without decay, another lr
    groups = [{"params": params[:1]}]
    if len(params) > 1:
        groups.append({"params": params[1:], "weight_decay": 0.0, "lr": 3e-3})
    opt = make(groups)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    return params, opt


def _grads(sizes, steps, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return [[torch.randn(n, generator=gen) for n in sizes] for _ in range(steps)]


def _ours(cpu, **kw):
    mode = kw.pop("decoupled")
    if cpu:
        return lambda groups: DeepSpeedCPUAdam(groups, adamw_mode=mode, **kw)
    return lambda groups: FusedAdam(groups, adam_w_mode=mode, **kw)


@settings(max_examples=40, deadline=None)
@given(decoupled=st.booleans(), **HYPER)
def test_matches_torch_adam_and_adamw(decoupled, lr, beta1, beta2, eps, weight_decay, steps,
                                      sizes, seed, cpu):
    values, grads = _params(sizes, seed), _grads(sizes, steps, seed)
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    ours, opt = _run(_ours(cpu, decoupled=decoupled, **kw), values, grads)
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    theirs, ref = _run(lambda groups: torch_cls(groups, **kw), values, grads)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # torch's state-dict format: it loads into torch's optimizer and back
    ref.load_state_dict(opt.state_dict())
    for p in ref.state:
        assert set(ref.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


def _uncorrected(values, grads, lr, beta1, beta2, eps, weight_decay, decoupled):
    """Adam without bias correction, written out (DeepSpeed's bias_correction=False)."""
    out = []
    for i, v in enumerate(values):
        p, m, s = v.clone().double(), torch.zeros_like(v).double(), torch.zeros_like(v).double()
        group_lr, decay = (lr, weight_decay) if i == 0 else (3e-3, 0.0)
        for step_grads in grads:
            g = step_grads[i].double()
            if decoupled:
                p = p * (1 - group_lr * decay)
            else:
                g = g + decay * p
            m = beta1 * m + (1 - beta1) * g
            s = beta2 * s + (1 - beta2) * g * g
            p = p - group_lr * m / (s.sqrt() + eps)
        out.append(p.float())
    return out


@settings(max_examples=25, deadline=None)
@given(decoupled=st.booleans(), **HYPER)
def test_without_bias_correction(decoupled, lr, beta1, beta2, eps, weight_decay, steps, sizes,
                                 seed, cpu):
    values, grads = _params(sizes, seed), _grads(sizes, steps, seed)
    kw = dict(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    ours, _ = _run(_ours(cpu, decoupled=decoupled, bias_correction=False, **kw), values, grads)
    expected = _uncorrected(values, grads, lr, beta1, beta2, eps, weight_decay, decoupled)
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a.detach(), b, rtol=1e-4, atol=1e-5)


def test_defaults_and_zero_grad():
    p = torch.nn.Parameter(torch.ones(3))
    opt = FusedAdam([p])
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == \
        (1e-3, (0.9, 0.999), 1e-8, 0.0)
    assert group["adam_w_mode"] and group["bias_correction"]
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert p.grad is None  # set_grad_none=True
    opt = FusedAdam([p], set_grad_none=False)
    p.grad = torch.ones(3)
    opt.zero_grad()
    assert p.grad is not None and not p.grad.any()
    cpu = DeepSpeedCPUAdam([p])
    assert cpu.param_groups[0]["adamw_mode"] and cpu.param_groups[0]["fp32_optimizer_states"]


@pytest.mark.parametrize("make, words", [
    (lambda p: FusedAdam(p, amsgrad=True), r"FusedAdam\(amsgrad=True\)"),
    (lambda p: DeepSpeedCPUAdam(p, amsgrad=True), r"DeepSpeedCPUAdam\(amsgrad=True\)"),
])
def test_amsgrad_refused(make, words):
    with pytest.raises(RuntimeError, match=words):
        make([torch.nn.Parameter(torch.ones(2))])


@pytest.mark.parametrize("kwargs, words", [
    (dict(lr=-1.0), r"lr=-1\.0"), (dict(betas=(0.9, 1.0)), r"betas=\(0\.9, 1\.0\)"),
    (dict(eps=0.0), r"eps=0\.0"), (dict(weight_decay=-0.1), r"weight_decay=-0\.1"),
    (dict(adam_w_mode=1), r"adam_w_mode=1"), (dict(bias_correction="no"), "bias_correction"),
])
def test_bad_hyper_parameters_name_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words):
        FusedAdam([torch.nn.Parameter(torch.ones(2))], **kwargs)
    p = torch.nn.Parameter(torch.ones(2))
    opt = FusedAdam([p])
    with pytest.raises(ValueError, match=words):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], **kwargs})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("fp32_states, moments",
                         [(True, torch.float32), (False, torch.bfloat16)])
def test_cpu_adam_moments_of_16_bit_parameters(fp32_states, moments):
    """fp32_optimizer_states=True (the default) keeps fp32 moments beside bf16 parameters, as
    DeepSpeed (it was a ValueError); False keeps them in bf16. The full comparison with torch
    is in test_cpu_adam_16bit.py."""
    half = [torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]
    opt = DeepSpeedCPUAdam(half, fp32_optimizer_states=fp32_states, lr=0.1)
    half[0].grad = torch.ones(2, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[half[0]]["exp_avg"].dtype == moments
    assert half[0].dtype == torch.bfloat16 and (half[0] < 1).all()


def _continue(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("source, target", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
     lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
     lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    (lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1),
     lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1)),
    (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
     lambda ps: DeepSpeedCPUAdam(ps, lr=1e-2, weight_decay=0.1, adamw_mode=False)),
], ids=["AdamW->FusedAdam", "Adam->FusedAdam(L2)", "CPUAdam->FusedAdam", "FusedAdam->CPUAdam"])
def test_state_dict_of_torch_adam_or_the_other_class_loads_and_trains_on(source, target):
    """A state dict whose groups lack this class's keys (torch's Adam/AdamW, or adamw_mode vs
    adam_w_mode) loads, and stepping on matches the source optimizer stepping on (was a
    KeyError 'adam_w_mode' at the first step after loading)."""
    values, grads = _params([5, 3], 7), _grads([5, 3], 4, 7)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    first = source(params)
    _continue(first, params, grads[:2])
    saved = copy.deepcopy(first.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    second = target(twins)
    second.load_state_dict(saved)
    expected = _continue(first, params, grads[2:])
    got = _continue(second, twins, grads[2:])
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [FusedAdam, lambda ps, **kw: DeepSpeedCPUAdam(
    ps, fp32_optimizer_states=False, **kw)], ids=["FusedAdam", "DeepSpeedCPUAdam"])
def test_no_bias_correction_over_fp16_parameters_computes_in_fp32(make):
    """bias_correction=False over fp16 parameters: eps=1e-8 is 0 in fp16, and an element with
    a zero gradient became 0/0 = NaN (and a tiny one inf); DeepSpeed's kernel computes in
    fp32. The first step equals the fp32 step rounded to fp16; later ones stay finite (the
    moments are kept in fp16, as DeepSpeed keeps them, so they drift from fp32's)."""
    start = torch.randn(64, generator=torch.Generator().manual_seed(0)).half()
    grads = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 1e-2
    grads[:, 0] = 0.0
    half = torch.nn.Parameter(start.clone())
    full = torch.nn.Parameter(start.float())
    opts = [make([half], lr=1e-3, bias_correction=False, weight_decay=0.1),
            make([full], lr=1e-3, bias_correction=False, weight_decay=0.1)]
    for step, g in enumerate(grads):
        half.grad, full.grad = g.half(), g.half().float()
        for opt in opts:
            opt.step()
        assert torch.isfinite(half).all(), f"step {step + 1}: {half}"
        if step == 0:
            assert torch.equal(half.detach(), full.detach().half())


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_amsgrad_state_dict_refused_before_anything_changes(cls):
    """A torch Adam(amsgrad=True) state dict: the step here would ignore max_exp_avg_sq and
    run plain Adam, so loading it is refused as the constructor refuses amsgrad."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    source = torch.optim.Adam([p], lr=0.1, amsgrad=True)
    source.step()
    opt = cls([p], lr=0.2)
    with pytest.raises(RuntimeError, match=r"amsgrad=True"):
        opt.load_state_dict(source.state_dict())
    assert opt.param_groups[0]["lr"] == 0.2 and not opt.state


@pytest.mark.parametrize("cls", [FusedAdam, DeepSpeedCPUAdam])
def test_state_key_check_covers_deepspeed_adam(cls):
    """OSS's and load_checkpoint's state-key check knows these classes' keys (it skipped
    them: their module is shardkit.ops)."""
    from shardkit.optim.oss_arguments import state_key_problem
    p = torch.nn.Parameter(torch.ones(2, 2))
    hyper = {k: v for k, v in cls([p]).defaults.items()}
    bad = {"momentum_buffer": torch.zeros(2, 2)}
    problem = state_key_problem("OSS.load_state_dict", cls, hyper, p, 0, bad, {})
    assert problem and "momentum_buffer" in problem and "exp_avg" in problem, problem
    good = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 2),
            "exp_avg_sq": torch.zeros(2, 2)}
    assert state_key_problem("OSS.load_state_dict", cls, hyper, p, 0, good, {}) is None


def test_deepspeeds_submodule_paths():
    # DeepSpeed scripts also import from deepspeed.ops.adam.cpu_adam / .fused_adam
    from shardkit.ops.adam.cpu_adam import DeepSpeedCPUAdam as from_cpu_adam
    from shardkit.ops.adam.fused_adam import FusedAdam as from_fused_adam
    assert from_cpu_adam is DeepSpeedCPUAdam and from_fused_adam is FusedAdam
