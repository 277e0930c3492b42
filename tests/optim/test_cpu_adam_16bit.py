"""``DeepSpeedCPUAdam`` over fp16/bf16 parameters with ``fp32_optimizer_states=True`` (the
default), as DeepSpeed's: fp32 moments, the update computed in fp32 from the 16-bit parameter
and gradient, the parameter rounded back to its dtype at every step (it was a ValueError).

The reference is torch's AdamW / Adam (or the uncorrected update written out) over fp32
copies of the parameters, rounded to the 16-bit dtype after each step. Also: the moments stay
fp32 through ``state_dict`` / ``torch.save`` / ``load_state_dict`` and through OSS at world 2;
8 bytes of state per parameter; ``fp32_optimizer_states=False`` steps as before.

From a review:

Review of 4820bab (``DeepSpeedCPUAdam`` fp32 moments over fp16/bf16 parameters): the fp32
copies of a tile do not outlive it, so a step's widened temporaries stay at one tile's
parameter and gradient copies (the documented bound), not one tile more.
"""

import copy
import io
import weakref

import pytest
import torch
import torch.distributed as dist

import shardkit.ops.adam as ops_adam
from shardkit.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardkit.optim import OSS
from shardkit.testing import world_fixture

SIZES = (7, 300, 33)
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS = 5

world2 = world_fixture(2)


def _values():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) for n in SIZES]


def _grads(steps=STEPS):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(n, generator=gen) * 0.1 for n in SIZES] for _ in range(steps)]


def _groups(params):
    """Two groups: the second without weight decay, with another lr."""
    return [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0, "lr": 3e-3}]


def _train(opt, params, grads, dtype):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        opt.step()


def _reference(dtype, adamw_mode, bias_correction, grads):
    """fp32 copies stepped by torch (or the uncorrected rule), rounded to ``dtype`` after
    each step: the parameters and the fp32 moments after the last step."""
    params = [torch.nn.Parameter(v.to(dtype).float()) for v in _values()]
    groups = _groups(params)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls(groups, **HYPER) if bias_correction else None
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype).float()
        if opt is not None:
            opt.step()
        else:
            _uncorrected_step(groups, moments, adamw_mode)
        with torch.no_grad():
            for p in params:
                p.copy_(p.to(dtype))
    if opt is not None:
        moments = [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in params]
    return [p.detach().to(dtype) for p in params], moments


@torch.no_grad()
def _uncorrected_step(groups, moments, adamw_mode):
    """Adam without bias correction (DeepSpeed's bias_correction=False), in fp32."""
    beta1, beta2 = HYPER["betas"]
    params = [p for group in groups for p in group["params"]]
    settings = [(group.get("lr", HYPER["lr"]), group.get("weight_decay", HYPER["weight_decay"]))
                for group in groups for _ in group["params"]]
    for p, (m, v), (lr, decay) in zip(params, moments, settings):
        g = p.grad
        if adamw_mode:
            p.mul_(1 - lr * decay)
        else:
            g = g + decay * p
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.addcdiv_(m, v.sqrt() + HYPER["eps"], value=-lr)


def _ulp_close(actual, expected, dtype):
    """Equal up to one unit in the last place of ``dtype`` (fp32 arithmetic in another order
    may round the other way)."""
    torch.testing.assert_close(actual.float(), expected.float(), atol=1e-6,
                               rtol=torch.finfo(dtype).eps)


@pytest.mark.parametrize("bias_correction", [True, False], ids=["corrected", "uncorrected"])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_parameters_step_as_fp32_then_rounded(dtype, adamw_mode, bias_correction):
    grads = _grads()
    params = [torch.nn.Parameter(v.to(dtype)) for v in _values()]
    opt = DeepSpeedCPUAdam(_groups(params), adamw_mode=adamw_mode,
                           bias_correction=bias_correction, **HYPER)
    _train(opt, params, grads, dtype)
    expected, moments = _reference(dtype, adamw_mode, bias_correction, grads)
    for p, want, (m, v) in zip(params, expected, moments):
        assert p.dtype == dtype
        _ulp_close(p.detach(), want, dtype)
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        torch.testing.assert_close(state["exp_avg"], m, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(state["exp_avg_sq"], v, rtol=1e-5, atol=1e-9)
        assert float(state["step"]) == STEPS


def test_state_is_8_bytes_per_parameter_and_its_buffers_are_kept():
    """Two fp32 moments per bf16 parameter (4 bytes with fp32_optimizer_states=False); the
    buffers are not rebuilt at every step (their dtype is not the parameters')."""
    for flag, per_element in ((True, 8), (False, 4)):
        params = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
        opt = DeepSpeedCPUAdam(params, fp32_optimizer_states=flag)
        _train(opt, params, _grads(1), torch.bfloat16)
        where = {id(p): opt.state[p]["exp_avg"].data_ptr() for p in params}
        _train(opt, params, _grads(2), torch.bfloat16)
        assert where == {id(p): opt.state[p]["exp_avg"].data_ptr() for p in params}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for p in params for key, t in opt.state[p].items() if key != "step"}
        assert sum(storages.values()) == per_element * sum(p.numel() for p in params)


def test_fp32_optimizer_states_false_steps_as_fused_adam():
    """fp32_optimizer_states=False keeps the moments in the parameters' dtype, as before (and
    as FusedAdam does)."""
    grads = _grads()
    ours = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
    theirs = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
    opt = DeepSpeedCPUAdam(_groups(ours), fp32_optimizer_states=False, **HYPER)
    _train(opt, ours, grads, torch.bfloat16)
    _train(FusedAdam(_groups(theirs), **HYPER), theirs, grads, torch.bfloat16)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert opt.state[a]["exp_avg"].dtype == torch.bfloat16


def test_large_parameters_are_widened_a_tile_at_a_time(monkeypatch):
    """Parameters split over several tiles and small ones packed into one step exactly as
    one tile does."""
    grads = _grads()
    whole = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
    _train(DeepSpeedCPUAdam(_groups(whole), **HYPER), whole, grads, torch.bfloat16)
    monkeypatch.setattr(ops_adam, "_WIDEN_TILE", 16)
    tiled = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
    _train(DeepSpeedCPUAdam(_groups(tiled), **HYPER), tiled, grads, torch.bfloat16)
    for a, b in zip(tiled, whole):
        assert torch.equal(a, b)


@pytest.mark.parametrize("through", ["torch.save", "deepcopy"])
def test_fp32_moments_survive_state_dict_round_trip(through):
    """torch's load_state_dict casts each moment to its parameter's dtype: loaded, the fp32
    moments must not be rounded to bf16, or training on differs from the uninterrupted run."""
    grads = _grads(6)
    params = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
    opt = DeepSpeedCPUAdam(_groups(params), **HYPER)
    _train(opt, params, grads[:3], torch.bfloat16)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    if through == "deepcopy":  # of the optimizer: pickling keeps each state tensor's dtype
        saved = copy.deepcopy(opt).state_dict()
    else:
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        saved = torch.load(buffer)
    resumed = DeepSpeedCPUAdam(_groups(twins), lr=0.5)
    resumed.load_state_dict(saved)
    for p, twin in zip(params, twins):
        for key in ("exp_avg", "exp_avg_sq"):
            assert resumed.state[twin][key].dtype == torch.float32
            assert torch.equal(resumed.state[twin][key], opt.state[p][key])
    _train(opt, params, grads[3:], torch.bfloat16)
    _train(resumed, twins, grads[3:], torch.bfloat16)
    for a, b in zip(twins, params):
        assert torch.equal(a, b)


def test_fp32_optimizer_states_switched_after_a_step_recasts_the_moments():
    params = [torch.nn.Parameter(v.bfloat16()) for v in _values()]
    opt = DeepSpeedCPUAdam(params)
    _train(opt, params, _grads(1), torch.bfloat16)
    wide = opt.state[params[1]]["exp_avg"].clone()
    opt.param_groups[0]["fp32_optimizer_states"] = False
    _train(opt, params, _grads(1), torch.bfloat16)
    assert opt.state[params[1]]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(opt.state[params[1]]["exp_avg"].float(), wide)


def test_fp32_optimizer_states_must_be_a_bool():
    with pytest.raises(ValueError, match=r"fp32_optimizer_states=1\b"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))], fp32_optimizer_states=1)
    opt = DeepSpeedCPUAdam([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match=r"fp32_optimizer_states='yes'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))],
                             "fp32_optimizer_states": "yes"})
    assert len(opt.param_groups) == 1


def _bf16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)).bfloat16()


def _oss_step(model, opt, step):
    """One data-parallel step of the rank's half of a batch (gradients averaged by hand)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
    half = slice(rank * 8 // world, (rank + 1) * 8 // world)
    opt.zero_grad()
    ((model(x[half].bfloat16()).float() - y[half]) ** 2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()


def _oss_resume():
    model = _bf16_model()
    opt = OSS(model.parameters(), optim=DeepSpeedCPUAdam, lr=1e-2, weight_decay=0.1)
    for step in range(2):
        _oss_step(model, opt, step)
    opt.consolidate_state_dict(0)
    box = [opt.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    twin = copy.deepcopy(model)
    resumed = OSS(twin.parameters(), optim=DeepSpeedCPUAdam, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(box[0])
    dtypes = {t.dtype for s in resumed.optim.state.values() for k, t in s.items() if k != "step"}
    dtypes |= {t.dtype for s in box[0]["state"].values() for k, t in s.items() if k != "step"}
    for step in range(2, 4):
        _oss_step(model, opt, step)
        _oss_step(twin, resumed, step)
    return dtypes, all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_oss_over_bf16_parameters_resumes_with_fp32_moments(world2):
    for dtypes, same in world2.run(_oss_resume):
        assert dtypes == {torch.float32}
        assert same


TILE = 64


def _live_widened_at_each_update(monkeypatch, dtype):
    """Steps one ``dtype`` parameter of 3.5 tiles; returns, at each tile's update, how many
    fp32 copies made by ``Tensor.float`` from 16-bit tensors are still alive."""
    monkeypatch.setattr(ops_adam, "_WIDEN_TILE", TILE)
    made = []
    widen = torch.Tensor.float

    def recording_float(self, *args, **kwargs):
        out = widen(self, *args, **kwargs)
        if self.dtype in (torch.float16, torch.bfloat16):
            made.append(weakref.ref(out))
        return out

    counts = []
    update = DeepSpeedCPUAdam._update_alike

    def counting_update(self, *args, **kwargs):
        counts.append(sum(ref() is not None for ref in made))
        return update(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", recording_float)
    monkeypatch.setattr(DeepSpeedCPUAdam, "_update_alike", counting_update)
    p = torch.nn.Parameter(torch.randn(TILE * 7 // 2).to(dtype))
    p.grad = torch.randn_like(p)
    DeepSpeedCPUAdam([p], lr=1e-2).step()
    return counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_tiles_fp32_copies_are_freed_before_the_next_tile(monkeypatch, dtype):
    counts = _live_widened_at_each_update(monkeypatch, dtype)
    assert len(counts) == 4  # 3.5 tiles
    assert counts == [2] * 4  # this tile's parameter and gradient copies only
