"""MasterWeights: fp32 master weights of 16-bit parameters, alone and as OSS's local optimizer.

One process (no world):

- ``MasterWeights.over(torch.optim.AdamW)`` on a bf16 and an fp16 model steps bit for bit as a
  hand-written reference (an fp32 copy stepped by torch's AdamW from the 16-bit gradients
  widened to fp32, written back rounded); updates below a 16-bit unit accumulate in the master
  (plain bf16 AdamW never moves a weight of 1.0 at lr 1e-4); fp32 parameters are stepped in
  place, with no copy;
- state dicts round trip, a plain AdamW state dict loads (the masters come from the
  parameters), ``add_param_group``, an LR scheduler, outside writes, ``zero_grad`` and
  ``prepare_master_grads`` (unscaling in fp32) behave as on a plain optimizer; bad input
  errors, naming what is valid.

Worlds of 2 and 4 gloo ranks, ``OSS(params, optim=MasterWeights.over(AdamW))``:

- stage 1 (torch DDP) and stage 2 (ShardedDataParallel), bf16 and fp16: every rank's weights
  equal after each step, and equal bit for bit (weights and owned masters) to one process's
  MasterWeights stepped from the gradients averaged as the wrapper averaged them. Those
  averaged gradients are one process's whole-batch average bit for bit at 2 ranks (each
  rank's 16-bit gradient divided by 2, then one 16-bit addition: one rounding in any order).
  At 4 ranks they differ in a few elements: gloo's ring all-reduce adds the four pre-divided
  16-bit terms one at a time in 16 bits (chunk ``c`` of the flat bucket in the rank order
  c+3, c+2, c+1, c, as measured), rounding after each addition, where the one-process
  average adds them in fp32 and rounds once; the difference stays within two 16-bit units at
  the sum of the terms' magnitudes (which bounds every partial sum). So the one process is
  given the wrapper's averaged gradients (the stage-2 owners' broadcast to every rank; at 2
  ranks they are its own);
- ``OSS.clip_grad_norm`` returns the fp32 norm of the widened gradients and scales those (the
  16-bit ones are left as they are);
- memory per rank (``model_state_bytes``) is DESIGN.md's mixed-precision row with the owned
  elements of OSS's partition (``zero_model_state_bytes(..., largest_owned=owned)``); the
  parameter sync moves 16-bit bytes, half of an fp32 model's;
- a checkpoint consolidated at 2 ranks holds an fp32 ``"master_weight"`` per parameter and
  resumes bit for bit in one process and in OSS at 4 ranks.

Found bugs (the last tests): OSS refused a plain AdamW state dict that MasterWeights takes;
``p.data = ...`` was not adopted (the version counter does not move); a refused
``add_param_group`` left a master behind that broke ``state_dict()``; a GradScaler's step
unscaled the 16-bit gradients (in 16 bits) instead of the fp32 ones.
"""

import copy
import io

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed, plan
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.optim.master_weights import MASTER_WEIGHT_KEY, MasterWeights
from shardkit.plan_model import rank_layout
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes

MWAdamW = MasterWeights.over(torch.optim.AdamW)
HYPER = {"lr": 1e-2, "weight_decay": 0.01}
WIDTH, OUT, LOCAL = 12, 4, 2
STEPS, CLIP_AT, MORE = 4, 2, 3
MAX_NORM = 1e-2  # below the gradients' norm: clipping scales them
ADAM_STEP_BYTES = 4  # torch keeps AdamW's step count of each tensor as a 0-dim fp32 tensor
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
DTYPES = ["bfloat16", "float16"]


world2 = world_fixture(2)


world4 = world_fixture(4)


# ---------------------------------------------------------------------- helpers (both sides)


def _model(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                                torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                                torch.nn.Linear(WIDTH, OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.to(dtype)


def _batch(step, size):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, WIDTH, generator=gen), torch.randn(size, OUT, generator=gen)


def _loss(model, x, y):
    dtype = next(model.parameters()).dtype
    return (model(x.to(dtype)).float() - y).pow(2).mean()


def _backward(model, step, size=8):
    model.zero_grad(set_to_none=True)
    _loss(model, *_batch(step, size)).backward()


def _hand_reference(model, **hyper):
    """The reference MasterWeights is checked against: an fp32 copy of each parameter and
    torch's AdamW over the copies."""
    masters = [p.detach().to(torch.float32, copy=True) for p in model.parameters()]
    return masters, torch.optim.AdamW(masters, **(hyper or HYPER))


@torch.no_grad()
def _hand_step(model, masters, optimizer, scale=None):
    for p, master in zip(model.parameters(), masters):
        master.grad = p.grad.float() if scale is None else p.grad.float() / scale
    optimizer.step()
    for p, master in zip(model.parameters(), masters):
        p.copy_(master)


def _same(a_model, b_model):
    return all(torch.equal(p, q) for p, q in zip(a_model.parameters(), b_model.parameters()))


def _ulps(a: torch.Tensor, b: torch.Tensor, at: torch.Tensor) -> float:
    """The largest difference of two 16-bit tensors in units of their dtype's spacing at the
    magnitudes ``at`` (fp32, elementwise)."""
    big = at.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
    _, exponent = torch.frexp(big)  # big = m * 2**exponent, 0.5 <= m < 1
    spacing = torch.ldexp(torch.ones_like(big), exponent - 1 - MANTISSA_BITS[a.dtype])
    return ((a.float() - b.float()).abs() / spacing).max().item()


def _averaged_grads(model, x, y, n, magnitudes=None):
    """The whole batch's gradients averaged over ``n`` ranks' shards as DDP and
    ShardedDataParallel average them: each shard's 16-bit gradient divided by ``n``, then
    summed (two terms: one rounding, in any order, as gloo's sum; more: in fp32, rounded once,
    see the module's docstring). ``magnitudes``: a list to receive, per parameter, the sum of
    the terms' magnitudes (fp32), which bounds every partial sum."""
    per = x.shape[0] // n
    shards = []
    for r in range(n):
        model.zero_grad(set_to_none=True)
        _loss(model, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]).backward()
        shards.append([p.grad / n for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    if magnitudes is not None:
        magnitudes.extend(torch.stack([s[i].float().abs() for s in shards]).sum(0)
                          for i in range(len(shards[0])))
    if n == 2:
        return [a + b for a, b in zip(*shards)]
    return [torch.stack([s[i].float() for s in shards]).sum(0).to(shards[0][i].dtype)
            for i in range(len(shards[0]))]


def _set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


# ---------------------------------------------------------------------- one process


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_steps_as_a_hand_written_fp32_master_reference(dtype):
    model = _model(dtype)
    ref_model = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt = MWAdamW(model.parameters(), **HYPER)
    masters, ref = _hand_reference(ref_model)
    for step in range(5):
        for m in (model, ref_model):
            _backward(m, step)
        opt.step()
        _hand_step(ref_model, masters, ref)
        assert _same(model, ref_model), step
        for p, master in zip(model.parameters(), masters):
            assert p.dtype == dtype
            assert torch.equal(opt.master_weight_of(p), master), step
            assert opt.master_grad_of(p) is None  # the fp32 gradients live until the step ends
    assert not any(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    p, master = next(iter(zip(model.parameters(), masters)))
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", MASTER_WEIGHT_KEY}
    assert state[MASTER_WEIGHT_KEY].dtype == state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], ref.state[master]["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], ref.state[master]["exp_avg_sq"])
    # the master holds more than the 16-bit weight: the updates below one 16-bit unit
    assert any(not torch.equal(opt.master_weight_of(q), q.float()) for q in model.parameters())


def test_small_updates_accumulate_in_the_master():
    """bf16 below 1.0 is spaced 2**-8: a plain bf16 AdamW step of 1e-4 rounds back to 1.0 every
    time; the master gets below the midpoint 1 - 2**-9 after 20 steps and the weight moves."""
    weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    plain_weight = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = MWAdamW([weight], lr=1e-4, weight_decay=0.0)
    plain = torch.optim.AdamW([plain_weight], lr=1e-4, weight_decay=0.0)
    moved_at = None
    for step in range(1, 41):
        for p in (weight, plain_weight):
            p.grad = torch.ones_like(p)
        opt.step()
        plain.step()
        assert torch.equal(plain_weight, torch.ones_like(plain_weight)), step
        assert torch.equal(weight, opt.master_weight_of(weight).to(torch.bfloat16))
        if moved_at is None and not torch.equal(weight, torch.ones_like(weight)):
            moved_at = step
    assert moved_at == 20
    assert torch.equal(weight, torch.full_like(weight, 1 - 2 ** -8))
    assert torch.allclose(opt.master_weight_of(weight), torch.full((8,), 1 - 40e-4), atol=1e-6)


def test_fp32_parameters_are_stepped_in_place():
    gen = torch.Generator().manual_seed(3)
    half = torch.nn.Parameter(torch.randn(6, 5, generator=gen).to(torch.bfloat16))
    full = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    full_ref = torch.nn.Parameter(full.detach().clone())
    opt = MWAdamW([half, full], **HYPER)
    ref = torch.optim.AdamW([full_ref], **HYPER)
    assert opt.master_weight_of(full) is full
    assert opt.master_weight_of(half) is not half
    assert opt.master_weight_of(half).dtype == torch.float32
    for step in range(3):
        g = torch.randn(6, 5, generator=gen)
        half.grad, full.grad, full_ref.grad = g.to(torch.bfloat16), g.clone(), g.clone()
        opt.step()
        ref.step()
        assert torch.equal(full, full_ref), step
    assert opt.master_weight_of(full) is full
    assert MASTER_WEIGHT_KEY not in opt.state[full]
    assert opt.state[full]["exp_avg"] is opt.inner.state[full]["exp_avg"]
    assert MASTER_WEIGHT_KEY in opt.state[half]


def test_model_state_bytes_counts_the_masters_and_moments():
    """12 bytes per 16-bit element (fp32 master and moments), 8 per fp32 one (moments, no
    copy), 4 per tensor for Adam's step, 2 or 4 per element of the weights and gradients."""
    gen = torch.Generator().manual_seed(3)
    half = torch.nn.Parameter(torch.randn(6, 5, generator=gen).to(torch.bfloat16))
    full = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    opt = MWAdamW([half, full], **HYPER)
    half.grad, full.grad = torch.ones_like(half), torch.ones_like(full)
    opt.step()
    mem = model_state_bytes(None, opt)
    assert mem.params == mem.grads == 2 * half.numel() + 4 * full.numel()
    assert mem.optimizer == 12 * half.numel() + 8 * full.numel() + 2 * ADAM_STEP_BYTES


def test_state_dict_round_trip_continues_identically():
    model = _model(torch.bfloat16)
    opt = MWAdamW(model.parameters(), **HYPER)
    for step in range(3):
        _backward(model, step)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    for i, p in enumerate(model.parameters()):
        entry = saved["state"][i]
        assert entry[MASTER_WEIGHT_KEY].dtype == torch.float32
        assert entry[MASTER_WEIGHT_KEY].shape == p.shape
        assert entry["exp_avg"].dtype == torch.float32
    copied = copy.deepcopy(model)
    loaded = MWAdamW(copied.parameters(), **HYPER)
    loaded.load_state_dict(saved)
    for p, q in zip(model.parameters(), copied.parameters()):
        assert torch.equal(loaded.master_weight_of(q), opt.master_weight_of(p))
        assert loaded.inner.state[loaded.master_weight_of(q)]["exp_avg"].dtype == torch.float32
    # the masters were loaded, not taken from the rounded weights
    assert any(not torch.equal(loaded.master_weight_of(q), q.float())
               for q in copied.parameters())
    for step in range(3, 6):
        for m, o in ((model, opt), (copied, loaded)):
            _backward(m, step)
            o.step()
        assert _same(model, copied), step
        assert all(torch.equal(opt.master_weight_of(p), loaded.master_weight_of(q))
                   for p, q in zip(model.parameters(), copied.parameters()))


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_a_plain_adamw_state_dict_loads_with_masters_from_the_parameters(source_dtype):
    """State saved by a plain AdamW (fp32 training, or bf16 training without masters) has no
    master: each comes from its parameter; the moments are kept in fp32."""
    source = _model(source_dtype)
    plain = torch.optim.AdamW(source.parameters(), **HYPER)
    for step in range(2):
        _backward(source, step)
        plain.step()
    saved = copy.deepcopy(plain.state_dict())
    model = copy.deepcopy(source).to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = MWAdamW(model.parameters(), **HYPER)
    opt.load_state_dict(copy.deepcopy(saved))  # (torch's load keeps the saved step tensors)
    masters, ref = _hand_reference(ref_model)
    ref.load_state_dict(copy.deepcopy(saved))
    for i, p in enumerate(model.parameters()):
        master = opt.master_weight_of(p)
        assert torch.equal(master, p.float())
        inner = opt.inner.state[master]
        assert inner["exp_avg"].dtype == torch.float32
        assert torch.equal(inner["exp_avg"], saved["state"][i]["exp_avg"].float())
        assert float(inner["step"]) == 2.0
    for step in range(2, 5):
        for m in (model, ref_model):
            _backward(m, step)
        opt.step()
        _hand_step(ref_model, masters, ref)
        assert _same(model, ref_model), step


def test_add_param_group():
    model = _model(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = MWAdamW(model[0].parameters(), **HYPER)
    later = list(model[2].parameters()) + list(model[4].parameters())
    opt.add_param_group({"params": later, "lr": 5e-3})
    assert len(opt.param_groups) == len(opt.inner.param_groups) == 2
    added, inner = opt.param_groups[1], opt.inner.param_groups[1]
    assert added["lr"] == inner["lr"] == 5e-3
    assert added["betas"] == inner["betas"] == (0.9, 0.999)  # defaults filled in
    assert added["weight_decay"] == 0.01
    assert all(p is q for p, q in zip(added["params"], later))
    assert all(m is opt.master_weight_of(p) and m.dtype == torch.float32
               for m, p in zip(inner["params"], later))
    masters = [p.detach().float() for p in ref_model.parameters()]
    ref = torch.optim.AdamW([{"params": masters[:2]}, {"params": masters[2:], "lr": 5e-3}],
                            **HYPER)
    for step in range(3):
        for m in (model, ref_model):
            _backward(m, step)
        opt.step()
        _hand_step(ref_model, masters, ref)
        assert _same(model, ref_model), step


def test_an_lr_scheduler_drives_the_inner_step():
    model = _model(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = MWAdamW(model.parameters(), **HYPER)
    masters, ref = _hand_reference(ref_model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    unscheduled = copy.deepcopy(model)
    plain = MWAdamW(unscheduled.parameters(), **HYPER)
    for step in range(4):
        for m in (model, ref_model, unscheduled):
            _backward(m, step)
        opt.step()
        plain.step()
        _hand_step(ref_model, masters, ref)
        assert opt.inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** step)
        assert _same(model, ref_model), step
        scheduler.step()
        ref_scheduler.step()
    assert not _same(model, unscheduled)


def test_outside_writes_are_adopted_at_the_next_step():
    model = _model(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = MWAdamW(model.parameters(), **HYPER)
    masters, ref = _hand_reference(ref_model)

    def both_step(step):
        for m in (model, ref_model):
            _backward(m, step)
        opt.step()
        _hand_step(ref_model, masters, ref)
        assert _same(model, ref_model), step

    both_step(0)
    both_step(1)
    with torch.no_grad():  # an in-place write: the reference's master follows the parameter
        model[0].weight.mul_(0.5)
        ref_model[0].weight.mul_(0.5)
        masters[0].copy_(ref_model[0].weight)
    both_step(2)
    other = _model(torch.bfloat16, seed=7)
    model.load_state_dict(other.state_dict())  # a loaded checkpoint of the weights
    ref_model.load_state_dict(other.state_dict())
    with torch.no_grad():
        for p, master in zip(ref_model.parameters(), masters):
            master.copy_(p)
    both_step(3)
    # a write of the values the parameter already holds keeps the master's extra bits
    before = [opt.master_weight_of(p).clone() for p in model.parameters()]
    assert any(not torch.equal(b, p.float()) for b, p in zip(before, model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.clone())
    assert all(torch.equal(opt.master_weight_of(p), b)
               for p, b in zip(model.parameters(), before))
    both_step(4)


def test_new_gradients_replace_the_fp32_ones_made_before():
    for case in ("zero_grad", "zero_grad_keep", "zeroed_outside", "accumulated"):
        model = _model(torch.bfloat16)
        ref_model = copy.deepcopy(model)
        opt = MWAdamW(model.parameters(), **HYPER)
        masters, ref = _hand_reference(ref_model)
        _loss(model, *_batch(0, 8)).backward()
        widened = opt.prepare_master_grads()
        assert [g.dtype for g in widened] == [torch.float32] * len(masters)
        if case == "zero_grad":
            opt.zero_grad()
            assert all(opt.master_grad_of(p) is None for p in model.parameters())
        elif case == "zero_grad_keep":
            opt.zero_grad(set_to_none=False)
        elif case == "zeroed_outside":
            for p in model.parameters():
                p.grad.zero_()
        _loss(model, *_batch(1, 8)).backward()  # accumulates into the gradients there are
        if case == "accumulated":
            _loss(ref_model, *_batch(0, 8)).backward()
        _loss(ref_model, *_batch(1, 8)).backward()
        opt.step()
        _hand_step(ref_model, masters, ref)
        assert _same(model, ref_model), case


def test_gradients_unscaled_in_fp32_after_prepare_master_grads():
    """A loss scale of 2**16 on fp16: the 16-bit gradients divided by it in 16 bits would be
    rounded (their small elements fall among fp16's subnormals); prepared as fp32 first, the
    unscaling is exact and the step reads it."""
    scale = 2.0 ** 16
    model = _model(torch.float16)
    ref_model = copy.deepcopy(model)
    opt = MWAdamW(model.parameters(), **HYPER)
    masters, ref = _hand_reference(ref_model)
    inexact = 0
    for step in range(3):
        for m in (model, ref_model):
            m.zero_grad(set_to_none=True)
            (_loss(m, *_batch(step, 8)) * 2 ** -10 * scale).backward()  # a small loss
        grads = opt.prepare_master_grads()
        assert [g is opt.master_grad_of(p) for g, p in zip(grads, model.parameters())] == \
            [True] * len(grads)
        inexact += sum(int(((p.grad / scale).float() != p.grad.float() / scale).sum())
                       for p in model.parameters())
        for g in grads:
            g.div_(scale)
        assert opt.prepare_master_grads()[0] is grads[0]  # not widened again: still unscaled
        opt.step()
        _hand_step(ref_model, masters, ref, scale=scale)
        assert _same(model, ref_model), step
    assert inexact > 0  # elements that unscaling the fp16 gradients in 16 bits would round


def test_bad_input_is_an_error_naming_what_is_valid():
    model = _model(torch.bfloat16)
    with pytest.raises(TypeError, match=r"MasterWeights\.over\(torch\.optim\.AdamW\)"):
        MasterWeights(model.parameters(), lr=1e-3)
    for bad in (int, torch.optim.AdamW(model.parameters()), "AdamW", None):
        with pytest.raises(TypeError, match="expected a torch.optim.Optimizer subclass"):
            MasterWeights.over(bad)
    assert MasterWeights.over(torch.optim.AdamW) is MWAdamW
    assert MasterWeights.over(MWAdamW) is MWAdamW
    assert MWAdamW.__name__ == "MasterWeightsAdamW" and MWAdamW.inner_class is torch.optim.AdamW
    with pytest.raises(TypeError, match="not a tensor"):
        MWAdamW(model[0].weight, lr=1e-3)
    with pytest.raises(ValueError, match="empty parameter list"):
        MWAdamW([], lr=1e-3)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        MWAdamW(model.parameters(), lr=-1.0)
    opt = MWAdamW(model.parameters(), **HYPER)
    with pytest.raises(ValueError, match="param groups' sizes"):
        opt.load_state_dict({"state": {}, "param_groups": [{**HYPER, "params": [0]}]})


# ---------------------------------------------------------------------- worlds: rank side


def _owned(opt, model, rank):
    return [p for p in model.parameters() if opt.param_to_rank[p] == rank]


def _memory(model, opt, rank, n):
    mem = model_state_bytes(model, opt)
    owned = _owned(opt, model, rank)
    layout = rank_layout(model, n)
    return {"measured": mem.as_dict(), "psi": sum(p.numel() for p in model.parameters()),
            "owned": sum(p.numel() for p in owned), "owned_tensors": len(owned),
            "planned_owned": layout.oss_numel_per_rank[rank],
            "padding": layout.oss_sync_padding}


def _reduced_grads(model, opt, from_owners: bool):
    """Every parameter's gradient as the wrapper averaged it: the one this rank holds (DDP),
    or, ``from_owners`` (ShardedDataParallel keeps the owners' only), its owner's, broadcast
    from there."""
    grads = []
    for p in model.parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.empty_like(p)
        if from_owners:
            distributed.broadcast(g, src=opt.param_to_rank[p])
        grads.append(g)
    return grads


def _train_with_wrapper(dtype_name: str, stage: int):
    """DDP (stage 1) or ShardedDataParallel (stage 2) over OSS(MasterWeights AdamW), beside
    one process's MasterWeights on the whole batch; what each rank saw."""
    dtype = getattr(torch, dtype_name)
    rank, n = distributed.get_rank(), distributed.get_world_size()
    model, ref_model = _model(dtype), _model(dtype)
    opt = OSS(model.parameters(), optim=MWAdamW, **HYPER)
    wrapped = DDP(model) if stage == 1 else ShardedDataParallel(model, opt)
    ref = MWAdamW(ref_model.parameters(), **HYPER)
    out = {"params": [], "bitwise": [], "masters": [], "grads_equal": [], "grad_ulps": [],
           "local_optimizer": type(opt.optim).__name__}
    for step in range(STEPS):
        x, y = _batch(step, LOCAL * n)
        opt.zero_grad()
        _loss(wrapped, x[rank * LOCAL:(rank + 1) * LOCAL],
              y[rank * LOCAL:(rank + 1) * LOCAL]).backward()
        reduced = _reduced_grads(model, opt, from_owners=stage == 2)
        magnitudes = []
        one_process = _averaged_grads(ref_model, x, y, n, magnitudes)
        out["grads_equal"].append(all(torch.equal(a, b) for a, b in zip(reduced, one_process)))
        out["grad_ulps"].append(max(_ulps(a, b, m)
                                    for a, b, m in zip(reduced, one_process, magnitudes)))
        _set_grads(ref_model, reduced)  # averaged as the wrapper averaged them
        if step == CLIP_AT:
            before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            norm = opt.clip_grad_norm(MAX_NORM)
            ref_grads = ref.prepare_master_grads()
            ref_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in ref_grads]))
            coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
            for g in ref_grads:  # the reference clips by the same factor
                g.mul_(coef)
            owned = _owned(opt, model, rank)
            out["clip"] = {
                "norm": norm.item(), "norm_dtype": norm.dtype, "ref_norm": ref_norm.item(),
                "ref_dtypes": {g.dtype for g in ref_grads},
                "16_bit_untouched": all(
                    (b is None and p.grad is None) or torch.equal(p.grad, b)
                    for p, b in zip(model.parameters(), before)),
                "owned_fp32_scaled": all(
                    opt.optim.master_grad_of(p).dtype == torch.float32
                    and torch.equal(opt.optim.master_grad_of(p), p.grad.float() * coef)
                    for p in owned)}
        opt.step()
        ref.step()
        out["params"].append([p.detach().clone() for p in model.parameters()])
        out["bitwise"].append(_same(model, ref_model))
        out["masters"].append(all(
            torch.equal(opt.optim.master_weight_of(p), ref.master_weight_of(q))
            for p, q in zip(model.parameters(), ref_model.parameters())
            if opt.param_to_rank[p] == rank))
    out["memory"] = _memory(model, opt, rank, n)  # after a step, before zero_grad
    if stage == 1:
        out.update(_sync_bytes(model, opt))
    return out


def _sync_bytes(model, opt):
    """Bytes and dtypes of one step's parameter sync, for this model and for its fp32 copy."""
    counted = {}
    fp32 = _model(torch.float32)
    fp32_opt = OSS(fp32.parameters(), optim=torch.optim.AdamW, **HYPER)
    for name, (m, o) in {"16": (model, opt), "32": (fp32, fp32_opt)}.items():
        for p in m.parameters():
            p.grad = torch.full_like(p, 1e-3)
        with distributed.CommCounter() as comm:
            o.step()
        counted[name] = {"bytes": comm.bytes, "calls": dict(comm.calls_by_op),
                         "dtypes": sorted({str(r.dtype) for r in comm.calls})}
    return {"sync": counted}


def _save_at_2_and_resume(dtype_name: str):
    """World 2: train, consolidate a checkpoint, keep training; one process loads the
    checkpoint and continues from the same gradients. Returns what the test compares, and the
    checkpoint for the world of 4."""
    dtype = getattr(torch, dtype_name)
    rank, n = distributed.get_rank(), distributed.get_world_size()
    model = _model(dtype)
    opt = OSS(model.parameters(), optim=MWAdamW, **HYPER)
    ddp = DDP(model)
    for step in range(STEPS):
        x, y = _batch(step, LOCAL * n)
        opt.zero_grad()
        _loss(ddp, x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]) \
            .backward()
        opt.step()
    opt.consolidate_state_dict(recipient_rank=-1)
    saved = opt.state_dict()
    saved_weights = [p.detach().clone() for p in model.parameters()]
    owned_masters = {i: opt.optim.master_weight_of(p).clone()
                     for i, p in enumerate(model.parameters()) if opt.param_to_rank[p] == rank}
    entries = {i: {k: (v.dtype, tuple(v.shape)) if torch.is_tensor(v) else v
                   for k, v in e.items()} for i, e in saved["state"].items()}
    uninterrupted = []
    for step in range(STEPS, STEPS + MORE):
        x, y = _batch(step, LOCAL * n)
        opt.zero_grad()
        _loss(ddp, x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]) \
            .backward()
        opt.step()
        uninterrupted.append([p.detach().clone() for p in model.parameters()])
    resumed = _resume_one_process(dtype, saved, saved_weights, n)
    return {"entries": entries, "shapes": [tuple(p.shape) for p in model.parameters()],
            "owned_masters_saved": all(torch.equal(m, saved["state"][i][MASTER_WEIGHT_KEY])
                                       for i, m in owned_masters.items()),
            "resumed_equal": [all(torch.equal(a, b) for a, b in zip(u, r))
                              for u, r in zip(uninterrupted, resumed)],
            "saved": saved, "saved_weights": saved_weights, "uninterrupted": uninterrupted}


def _resume_one_process(dtype, saved, saved_weights, n):
    model = _model(dtype)
    with torch.no_grad():
        for p, w in zip(model.parameters(), saved_weights):
            p.copy_(w)
    opt = MWAdamW(model.parameters(), **HYPER)
    opt.load_state_dict(copy.deepcopy(saved))
    out = []
    for step in range(STEPS, STEPS + MORE):
        x, y = _batch(step, LOCAL * n)
        _set_grads(model, _averaged_grads(model, x, y, n))
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _resume_at_world(dtype_name: str, saved, saved_weights, saved_at: int):
    """Load a checkpoint taken at ``saved_at`` ranks into OSS at this world's size and step it
    with the gradients the saving world averaged (set on every rank alike, no wrapper)."""
    dtype = getattr(torch, dtype_name)
    rank = distributed.get_rank()
    model = _model(dtype)
    with torch.no_grad():
        for p, w in zip(model.parameters(), saved_weights):
            p.copy_(w)
    opt = OSS(model.parameters(), optim=MWAdamW, **HYPER)
    opt.load_state_dict(saved)
    loaded = all(torch.equal(opt.optim.master_weight_of(p), saved["state"][i][MASTER_WEIGHT_KEY])
                 for i, p in enumerate(model.parameters()) if opt.param_to_rank[p] == rank)
    grad_model = copy.deepcopy(model)
    out = []
    for step in range(STEPS, STEPS + MORE):
        x, y = _batch(step, LOCAL * saved_at)
        with torch.no_grad():
            for p, q in zip(grad_model.parameters(), model.parameters()):
                p.copy_(q)
        _set_grads(model, _averaged_grads(grad_model, x, y, saved_at))
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return {"loaded": loaded, "params": out}


def _load_plain_adamw_state():
    """OSS over MasterWeights given a plain AdamW state dict (no master weights), as
    MasterWeights alone takes it: the masters come from the parameters."""
    model = _model(torch.bfloat16)
    source = copy.deepcopy(model)
    plain = torch.optim.AdamW(source.parameters(), **HYPER)
    _backward(source, 0)
    plain.step()
    with torch.no_grad():
        for p, q in zip(model.parameters(), source.parameters()):
            p.copy_(q)
    opt = OSS(model.parameters(), optim=MWAdamW, **HYPER)
    try:
        opt.load_state_dict(plain.state_dict())
    except ValueError as error:
        return f"ValueError: {error}"
    rank = distributed.get_rank()
    return all(torch.equal(opt.optim.master_weight_of(p), p.float())
               for p in model.parameters() if opt.param_to_rank[p] == rank)


# ---------------------------------------------------------------------- worlds: checks


@pytest.fixture(scope="module")
def trained(world2, world4):
    """Every (world size, stage, dtype) run once, shared by the checks below."""
    out = {}
    for n, world in ((2, world2), (4, world4)):
        for stage in (1, 2):
            for dtype in DTYPES:
                if stage == 2 and dtype == "float16":
                    continue  # the stage-2 reduction is dtype-agnostic: bf16 stands for both
                out[n, stage, dtype] = world.run(_train_with_wrapper, dtype, stage)
    return out


RUNS = [(n, stage, dtype) for n in (2, 4) for stage in (1, 2) for dtype in DTYPES
        if not (stage == 2 and dtype == "float16")]


@pytest.mark.parametrize("n,stage,dtype", RUNS)
def test_wrapped_oss_matches_one_process(trained, n, stage, dtype):
    per_rank = trained[n, stage, dtype]
    first = per_rank[0]
    assert first["local_optimizer"] == "MasterWeightsAdamW"
    for r in per_rank[1:]:  # every rank's 16-bit weights are the same after each step
        for step, (a, b) in enumerate(zip(first["params"], r["params"])):
            assert all(torch.equal(p, q) for p, q in zip(a, b)), step
    for rank, r in enumerate(per_rank):
        assert all(p.dtype == getattr(torch, dtype) for p in r["params"][-1])
        assert all(r["bitwise"]), (rank, r["bitwise"])
        assert all(r["masters"]), (rank, r["masters"])
        if n == 2:  # a/2 + b/2: one rounding, whatever the order: one process's average
            assert all(r["grads_equal"]), (rank, r["grads_equal"], r["grad_ulps"])
        else:  # gloo sums four 16-bit terms one at a time (see the module's docstring):
            # three roundings there, one in the reference, each at most half a unit of a
            # partial sum, which is at most the sum of the terms' magnitudes
            assert max(r["grad_ulps"]) <= 2.0, (rank, r["grad_ulps"])


@pytest.mark.parametrize("n,stage,dtype", RUNS)
def test_clip_grad_norm_measures_and_scales_the_fp32_gradients(trained, n, stage, dtype):
    per_rank = trained[n, stage, dtype]
    norms = {r["clip"]["norm"] for r in per_rank}
    assert len(norms) == 1, norms
    for r in per_rank:
        clip = r["clip"]
        assert clip["norm"] > MAX_NORM  # it clipped
        assert clip["norm_dtype"] == torch.float32
        assert clip["ref_dtypes"] == {torch.float32}
        # the same fp32 gradients, summed in another order (per rank, then over the ranks)
        assert clip["norm"] == pytest.approx(clip["ref_norm"], rel=1e-6)
        assert clip["owned_fp32_scaled"]
        assert clip["16_bit_untouched"]


@pytest.mark.parametrize("n", [2, 4])
def test_stage_1_memory_is_the_mixed_precision_row(trained, n):
    """DDP + OSS(MasterWeights AdamW), after a step with the gradients still held: 2 bytes per
    weight (plus OSS's sync padding), 2 per gradient, 12 per owned element (fp32 master and
    moments) and Adam's 4-byte step per owned tensor: DESIGN.md's ``4Ψ + KΨ/N`` with K = 12
    and the owned elements of OSS's partition."""
    precision = plan.precision_for("adamw", mixed_precision=True)
    assert (precision.weights, precision.grads, precision.optimizer) == (2, 2, 12)
    for dtype in DTYPES:
        for rank, r in enumerate(trained[n, 1, dtype]):
            mem, m = r["memory"]["measured"], r["memory"]
            where = (dtype, rank, m)
            assert m["owned"] == m["planned_owned"], where
            assert mem["params"] == 2 * (m["psi"] + m["padding"]), where
            assert mem["grads"] == 2 * m["psi"], where
            assert mem["optimizer"] == 12 * m["owned"] + ADAM_STEP_BYTES * m["owned_tensors"], \
                where
            formula = plan.zero_model_state_bytes(m["psi"], n, 1, precision,
                                                  largest_owned=m["owned"])
            assert mem["total"] == formula + 2 * m["padding"] + \
                ADAM_STEP_BYTES * m["owned_tensors"], where


@pytest.mark.parametrize("n", [2, 4])
def test_stage_2_memory_is_the_mixed_precision_row(trained, n):
    """ShardedDataParallel + OSS(MasterWeights AdamW), after a step with the gradients still
    held: as stage 1, but gradients of the owned parameters only, each beside its presence
    flag (one 16-bit element, in the storage it arrived in): ``2Ψ + (2 + 12)·owned`` plus the
    padding, the flags and Adam's steps."""
    precision = plan.precision_for("adamw", mixed_precision=True)
    for rank, r in enumerate(trained[n, 2, "bfloat16"]):
        mem, m = r["memory"]["measured"], r["memory"]
        where = (rank, m)
        assert m["owned"] == m["planned_owned"], where
        assert mem["params"] == 2 * (m["psi"] + m["padding"]), where
        assert mem["grads"] == 2 * (m["owned"] + m["owned_tensors"]), where
        assert mem["optimizer"] == 12 * m["owned"] + ADAM_STEP_BYTES * m["owned_tensors"], where
        formula = plan.zero_model_state_bytes(m["psi"], n, 2, precision,
                                              largest_owned=m["owned"])
        assert mem["total"] == formula + 2 * m["padding"] + \
            (2 + ADAM_STEP_BYTES) * m["owned_tensors"], where


@pytest.mark.parametrize("n", [2, 4])
def test_parameter_sync_moves_16_bit_bytes(trained, n):
    for dtype in DTYPES:
        for r in trained[n, 1, dtype]:
            half, full = r["sync"]["16"], r["sync"]["32"]
            psi, padding = r["memory"]["psi"], r["memory"]["padding"]
            assert half["dtypes"] == [f"torch.{dtype}"], half
            assert full["dtypes"] == ["torch.float32"], full
            assert half["bytes"] == 2 * (psi + padding) * (n - 1) / n, half
            assert 2 * half["bytes"] == full["bytes"], (half, full)
            assert set(half["calls"]) == {"all_gather"}, half


@pytest.fixture(scope="module")
def checkpoint(world2):
    return {dtype: world2.run(_save_at_2_and_resume, dtype) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_holds_fp32_masters_and_resumes_in_one_process(checkpoint, dtype):
    for rank, r in enumerate(checkpoint[dtype]):
        assert sorted(r["entries"]) == list(range(len(r["shapes"])))
        for i, shape in enumerate(r["shapes"]):
            entry = r["entries"][i]
            assert set(entry) == {"step", "exp_avg", "exp_avg_sq", MASTER_WEIGHT_KEY}, entry
            assert entry[MASTER_WEIGHT_KEY] == (torch.float32, shape), entry
            assert entry["exp_avg"] == (torch.float32, shape), entry
        assert r["owned_masters_saved"], rank
        assert r["resumed_equal"] == [True] * MORE, (rank, r["resumed_equal"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_checkpoint_from_world_2_resumes_in_oss_at_world_4(checkpoint, world4, dtype):
    saved = checkpoint[dtype][0]
    per_rank = world4.run(_resume_at_world, dtype, saved["saved"], saved["saved_weights"], 2)
    for rank, r in enumerate(per_rank):
        assert r["loaded"], rank
        for step, (a, b) in enumerate(zip(saved["uninterrupted"], r["params"])):
            assert all(torch.equal(p, q) for p, q in zip(a, b)), (rank, step)


# ---------------------------------------------------------------------- found bugs


def test_oss_loads_a_plain_adamw_state_dict_as_master_weights_does(world2):
    """MasterWeights takes a state dict saved without masters (a plain AdamW's) and takes each
    master from its parameter; under OSS, the state-key check refused it."""
    assert world2.run(_load_plain_adamw_state) == [True, True]


def test_outside_write_through_p_data_is_adopted():
    """``p.data = ...`` (named in the module's docstring beside ``p.mul_``) replaces the
    storage without moving the version counter: the master must still follow it."""
    model = _model(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    opt = MWAdamW(model.parameters(), **HYPER)
    masters, ref = _hand_reference(ref_model)
    for step in range(2):
        for m in (model, ref_model):
            _backward(m, step)
        opt.step()
        _hand_step(ref_model, masters, ref)
    new = torch.full_like(model[0].weight, 0.5)
    model[0].weight.data = new.clone()
    ref_model[0].weight.data = new.clone()
    masters[0].copy_(new)
    for m in (model, ref_model):
        _backward(m, 2)
    opt.step()
    _hand_step(ref_model, masters, ref)
    assert _same(model, ref_model)


def test_a_failed_add_param_group_changes_nothing():
    """torch's ``add_param_group`` checks before it changes anything; a group MasterWeights'
    inner optimizer refuses (a parameter already held) left a master behind for its other
    parameters, which ``state_dict()`` then could not index (KeyError) from then on."""
    model = _model(torch.bfloat16)
    opt = MWAdamW(model[0].parameters(), **HYPER)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[2].weight, model[0].weight]})
    assert len(opt.param_groups) == 1
    assert model[2].weight not in opt.state
    saved = opt.state_dict()
    assert len(saved["param_groups"]) == 1


def _loss_scaled_fp16_steps():
    """DDP + OSS(MasterWeights AdamW) on fp16 stepped by torch's GradScaler (scale 2**16), beside
    one process's MasterWeights stepped from the same averaged gradients unscaled in fp32."""
    scale = 2.0 ** 16
    rank, n = distributed.get_rank(), distributed.get_world_size()
    model, ref_model = _model(torch.float16), _model(torch.float16)
    opt = OSS(model.parameters(), optim=MWAdamW, **HYPER)
    ddp = DDP(model)
    ref = MWAdamW(ref_model.parameters(), **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=1000)
    same = []
    for step in range(3):
        x, y = _batch(step, LOCAL * n)
        opt.zero_grad()
        loss = _loss(ddp, x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL])
        scaler.scale(loss * 2 ** -10).backward()  # a small loss: unscaled fp16 gradients round
        _set_grads(ref_model, _reduced_grads(model, opt, from_owners=False))
        for g in ref.prepare_master_grads():
            g.div_(scale)
        scaler.step(opt)
        scaler.update()
        ref.step()
        same.append(_same(model, ref_model))
    return same


def test_loss_scaled_16_bit_gradients_are_unscaled_in_fp32(world2):
    """A GradScaler's step hands OSS the scale; OSS unscaled the 16-bit gradients in place
    (fp16 rounds the small ones among its subnormals) before MasterWeights widened them."""
    assert world2.run(_loss_scaled_fp16_steps) == [[True] * 3] * 2


def _add_param_group_under_oss():
    """OSS(MasterWeights AdamW) given a new param group after two steps (a re-partition that
    hands state to new owners), beside one process's MasterWeights given the same group;
    every rank sets the same gradients (no wrapper)."""
    model, ref_model = _model(torch.bfloat16), _model(torch.bfloat16)
    first = list(model[0].parameters()) + list(model[2].parameters())
    opt = OSS(first, optim=MWAdamW, **HYPER)
    ref = MWAdamW(list(ref_model[0].parameters()) + list(ref_model[2].parameters()), **HYPER)
    same = []
    for step in range(5):
        if step == 2:
            opt.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3})
            ref.add_param_group({"params": list(ref_model[4].parameters()), "lr": 5e-3})
        grads = _averaged_grads(ref_model, *_batch(step, 8), 1)
        _set_grads(model, grads)
        _set_grads(ref_model, grads)
        if step < 2:
            for m in (model, ref_model):
                for p in m[4].parameters():
                    p.grad = None
        opt.step()
        ref.step()
        same.append(_same(model, ref_model))
    opt.consolidate_state_dict(recipient_rank=-1)
    keys = {i: sorted(s) for i, s in opt.state_dict()["state"].items()}
    return same, keys


def test_add_param_group_under_oss_hands_masters_to_new_owners(world2):
    """The re-partition sends each moved parameter's state (a pickled ``{param: state}``); a
    16-bit parameter's state entry did not unpickle (AttributeError in its ``__setitem__``) on
    the receiving rank, and the sender waited in the next collective."""
    keys = {i: ["exp_avg", "exp_avg_sq", MASTER_WEIGHT_KEY, "step"] for i in range(6)}
    assert world2.run(_add_param_group_under_oss) == [([True] * 5, keys)] * 2
