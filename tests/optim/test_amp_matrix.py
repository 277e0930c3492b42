"""Mixed precision and loss scaling across the wrappers, step by step against one process.

A fixed sample of a randomized matrix (run outside the suite over several hundred cases per
world size): a small model (MLP, with BatchNorm, with a frozen layer, with a head that only
rank 0 uses) is trained for a few steps by torch DDP + OSS, ShardedDataParallel + OSS
(``reduce_fp16``, ``broadcast_fp16``) or FullyShardedDataParallel (``mixed_precision``,
``fp32_reduce_scatter``, nested units), in fp32, under fp16/bf16 autocast, in FSDP mixed
precision or as a pure 16-bit model, with ``torch.amp.GradScaler`` or ``ShardedGradScaler``,
SGD with momentum, Adam or AdamW, gradient accumulation, clipping after ``unscale_``, and
forced overflows: inf/nan in the loss or in the gradient of the first layer's output, on one
rank or on all, on any micro-batch. The reference trains the same model in the rank's own
process on every rank's batch with ``torch.amp.GradScaler`` and averages the gradients as data
parallelism does. After every step every rank checks: the step was skipped or applied as in the
reference, the same loss scale and growth tracker, optimizer step counts not advanced by a
skipped step, and the weights: fp32 within 1e-5 relative; with 16-bit compute or 16-bit
communication within 3% of the distance the weights travelled plus 2e-3 (the reference runs
the same per-rank computations in the same dtypes, so the two differ only in the summation
order of the reduction and in 16-bit rounding of what crosses the wire: a few 16-bit ulps of
each update), plus 4 ulps of a pure 16-bit weight.

Also here: the loss-scale state resumes across world sizes, DeepSpeed's loss-scale rules
restated against ``DynamicLossScaler``, and the bad inputs this matrix found.
"""

import contextlib
import copy
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
from shardkit.optim import OSS
from shardkit.optim.grad_scaler import ShardedGradScaler
from shardkit.optim.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
from shardkit.testing import world_fixture

world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)

INF, NAN = float("inf"), float("nan")
HALF = {"half_fp16": torch.float16, "half_bf16": torch.bfloat16}
AUTOCAST = {"autocast_fp16": torch.float16, "autocast_bf16": torch.bfloat16}
FSDP_MP = {"fsdp_fp16": dict(mixed_precision=True),
           "fsdp_bf16": dict(mixed_precision=True, compute_dtype=torch.bfloat16)}


class _Net(nn.Module):
    """8 -> 16 -> 16 -> 4; ``kind``: "mlp", "bn" (BatchNorm after the first layer), "frozen"
    (first layer frozen), "unused" (an extra head used on rank 0 only)."""

    def __init__(self, kind: str, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.bn = nn.BatchNorm1d(16) if kind == "bn" else None
        self.extra = nn.Linear(16, 4) if kind == "unused" else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        if kind == "frozen":
            self.l1.requires_grad_(False)

    def forward(self, x, use_extra=False):
        h = self.l1(x)
        h = self.l2(F.relu(self.bn(h) if self.bn is not None else h))
        out = self.l3(F.relu(h))
        if use_extra and self.extra is not None:
            out = out + self.extra(F.relu(h))
        return out

    def first_trainable(self) -> nn.Module:
        return self.l2 if self.kind == "frozen" else self.l1


def _case(wrapper, precision="fp32", model="mlp", optim="adam", accum=1, clip=None,
          scaler="sharded", overflows=None, steps=4, seed=0, **options):
    """``overflows``: {step: (kind, rank)}; kind "loss" / "act" (the first trainable layer's
    output gradient) on ``rank`` or on every rank when rank is None."""
    return dict(wrapper=wrapper, precision=precision, model=model, optim=optim, accum=accum,
                clip=clip, scaler=scaler, overflows=overflows or {}, steps=steps, seed=seed,
                init_scale=options.pop("init_scale", 256.0),
                growth_interval=options.pop("growth_interval", 2),
                inject_micro=options.pop("inject_micro", accum - 1), options=options)


def _batch(case, step, micro, shard, dtype):
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + step * 37 + micro * 7 + shard)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
    return x.to(dtype) if dtype is not None else x, y


def _optimizer(case):
    if case["optim"] == "sgd":
        return torch.optim.SGD, dict(lr=0.1, momentum=0.9)
    # eps well above gradient rounding noise, so that noise does not become +-lr steps
    cls = torch.optim.AdamW if case["optim"] == "adamw" else torch.optim.Adam
    return cls, dict(lr=0.01, eps=1e-2)


def _scaler_args(case):
    return dict(init_scale=case["init_scale"], growth_interval=case["growth_interval"])


class _ReferenceScaler(torch.amp.GradScaler):
    """torch's scaler, also unscaling 16-bit gradients (a pure 16-bit reference model)."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def _overflow_on(case, step, micro, rank):
    """The kind of overflow forced on ``rank``'s micro-batch ``micro`` of ``step``, or None."""
    forced = case["overflows"].get(step)
    if forced is None or micro != case["inject_micro"] or forced[1] not in (None, rank):
        return None
    return forced[0]


def _poison_activation_grad(module: nn.Module):
    """A forward hook making the first element of the output's gradient inf: an overflow in a
    few elements of one layer's gradient, as fp16 produces it."""
    def hook(_module, _inputs, out):
        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[0] = INF
            return grad
        out.register_hook(poison)
    return module.register_forward_hook(hook)


def _forward_backward(case, model, net, scaler, step, micro, rank, dtype):
    """Forward and scaled backward of ``rank``'s micro-batch, inputs in ``dtype`` (None: as
    the precision path feeds them), with the overflow forced there, if any."""
    x, y = _batch(case, step, micro, rank, dtype or HALF.get(case["precision"]))
    kind = _overflow_on(case, step, micro, rank)
    hook = _poison_activation_grad(net.first_trainable()) if kind == "act" else None
    autocast = AUTOCAST.get(case["precision"])
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss = F.mse_loss(model(x, rank == 0).float(), y)
    if kind == "loss":
        loss = loss * NAN
    scaler.scale(loss / case["accum"]).backward()
    if hook is not None:
        hook.remove()


def _reference_step(case, ref, compute, optimizer, scaler, step, world):
    """One step of the same model in this process: every rank's micro-batches, the gradients
    averaged over the ranks after backward (in ``compute``'s dtype under FSDP mixed precision,
    whose copy computes in 16 bits)."""
    for micro in range(case["accum"]):
        if compute is not ref:
            with torch.no_grad():
                for low, master in zip(compute.parameters(), ref.parameters()):
                    low.copy_(master)
        dtype = next(compute.parameters()).dtype
        for shard in range(world):
            _forward_backward(case, compute, compute, scaler, step, micro, shard, dtype)
            if case["options"].get("fp32_reduce_scatter"):  # the sum over ranks in fp32
                _move_gradients(compute, ref, world)
        if compute is not ref:
            _move_gradients(compute, ref, world)
    if compute is ref:
        for p in ref.parameters():
            if p.grad is not None:
                p.grad.div_(world)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    if case["clip"]:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(trainable, case["clip"])
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def _move_gradients(low, master, world):
    """Add ``low``'s 16-bit gradients, divided by ``world`` in 16 bits, to ``master``'s in
    fp32, and clear them."""
    for low_param, master_param in zip(low.parameters(), master.parameters()):
        if low_param.grad is not None:
            grad = low_param.grad.div_(world).float()
            master_param.grad = grad if master_param.grad is None else master_param.grad + grad
            low_param.grad = None


def _wrap(case, net):
    cls, hyper = _optimizer(case)
    options = case["options"]
    if case["wrapper"] == "ddp":
        model = nn.parallel.DistributedDataParallel(net, find_unused_parameters=(
            case["model"] == "unused"))
        return model, OSS(net.parameters(), optim=cls, **options, **hyper)
    if case["wrapper"] == "sdp":
        optimizer = OSS(net.parameters(), optim=cls,
                        broadcast_fp16=options.get("broadcast_fp16", False), **hyper)
        return ShardedDataParallel(net, optimizer,
                                   reduce_fp16=options.get("reduce_fp16", False)), optimizer
    fsdp = dict(FSDP_MP.get(case["precision"], {}))
    fsdp.update(options)
    if fsdp.pop("nested", False):
        net.l2 = FSDP(net.l2, **fsdp)
    model = FSDP(net, **fsdp)
    return model, cls([p for p in model.parameters() if p.requires_grad], **hyper)


def _weights(model) -> dict:
    if isinstance(model, FSDP):
        with model.summon_full_params():
            return {_plain_name(n): p.detach().float().clone()
                    for n, p in model.named_parameters()}
    return {_plain_name(n): p.detach().float().clone() for n, p in model.named_parameters()}


def _plain_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("module.", "")


def _step_counts(optimizer) -> set:
    inner = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    return {int(s["step"]) for s in inner.state.values() if "step" in s}


def _weight_problem(case, step, ours, ref, start) -> list:
    exact = case["precision"] == "fp32" and not case["options"].get("reduce_fp16") \
        and not case["options"].get("broadcast_fp16")
    for name, want in ref.items():
        top = want.abs().max().item()
        if exact:
            bound = 1e-5 * max(1.0, top)
        else:
            bound = 3e-2 * (want - start[name]).abs().max().item() + 2e-3 + 2e-3 * top
            if case["precision"] in HALF:
                bound += 4 * torch.finfo(HALF[case["precision"]]).eps * top
        diff = (ours[name] - want).abs().max().item()
        if not diff <= bound:
            return [f"step {step}: {name} differs by {diff:.3g} (bound {bound:.3g})"]
    return []


def _train_case(case) -> tuple:
    """Train ``case`` here and in the reference; return what differed (empty: nothing) and
    how many steps the reference skipped."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    net = _Net(case["model"], case["seed"])
    if case["precision"] in HALF:
        net = net.to(HALF[case["precision"]])
    ref = copy.deepcopy(net)
    compute = ref
    if case["precision"] in FSDP_MP:
        low = torch.bfloat16 if case["precision"] == "fsdp_bf16" else torch.float16
        compute = copy.deepcopy(ref).to(low)
    cls, hyper = _optimizer(case)
    ref_optimizer = cls([p for p in ref.parameters() if p.requires_grad], **hyper)
    ref_scaler = _ReferenceScaler("cpu", **_scaler_args(case))
    model, optimizer = _wrap(case, net)
    scaler_cls = torch.amp.GradScaler if case["scaler"] == "torch" else ShardedGradScaler
    scaler = scaler_cls("cpu", **_scaler_args(case))
    start, applied, problems = _weights(ref), 0, []
    for step in range(case["steps"]):
        before = _weights(model)
        for micro in range(case["accum"]):
            last = micro == case["accum"] - 1
            with contextlib.nullcontext() if last else model.no_sync():
                _forward_backward(case, model, net, scaler, step, micro, rank, None)
        if case["clip"]:
            scaler.unscale_(optimizer)
            if isinstance(model, FSDP):
                model.clip_grad_norm_(case["clip"])
            else:
                optimizer.clip_grad_norm(case["clip"])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        ref_before = _weights(ref)
        _reference_step(case, ref, compute, ref_optimizer, ref_scaler, step, world)
        ours, theirs = _weights(model), _weights(ref)
        ref_applied = any(not torch.equal(ref_before[n], theirs[n]) for n in theirs)
        applied += ref_applied
        ours_applied = any(not torch.equal(before[n], ours[n]) for n in ours)
        if ours_applied != ref_applied:
            problems.append(f"step {step}: applied={ours_applied}, reference {ref_applied}")
        if (scaler.get_scale(), scaler._get_growth_tracker()) != \
                (ref_scaler.get_scale(), ref_scaler._get_growth_tracker()):
            problems.append(f"step {step}: scale/tracker {scaler.get_scale()}/"
                            f"{scaler._get_growth_tracker()}, reference {ref_scaler.get_scale()}"
                            f"/{ref_scaler._get_growth_tracker()}")
        problems += _weight_problem(case, step, ours, theirs, start)
        counts = _step_counts(optimizer)
        if counts and counts != {applied}:
            problems.append(f"step {step}: optimizer step counts {counts}, expected {applied}")
        if problems:
            break
    return problems, case["steps"] - applied


def _train_cases(cases) -> list:
    return [_train_case(case) for case in cases]


def _check_sample(world, cases):
    results = world.run(_train_cases, cases)
    for index, case in enumerate(cases):
        for rank, per_rank in enumerate(results):
            problems, skipped = per_rank[index]
            assert problems == [], (rank, case, problems)
            assert skipped == len(case["overflows"]), (rank, case, skipped)  # and only those


SAMPLE_1 = [
    _case("ddp", "autocast_fp16", "bn", "sgd", accum=2, clip=0.5, overflows={1: ("loss", 0)}),
    _case("sdp", "half_fp16", "frozen", "adam", overflows={2: ("act", 0)}, seed=1),
    _case("fsdp", "fsdp_bf16", "mlp", "adamw", clip=5.0, overflows={0: ("act", 0)},
          fp32_reduce_scatter=True, nested=True, seed=2),
]

SAMPLE_2 = [
    _case("ddp", "fp32", "unused", "adamw", scaler="torch", overflows={1: ("act", 1)},
          growth_interval=1),
    _case("ddp", "autocast_bf16", "bn", "sgd", accum=2, overflows={0: ("loss", None),
                                                                   2: ("act", 0)},
          inject_micro=0, seed=3),
    _case("sdp", "fp32", "mlp", "adam", accum=2, clip=0.5, overflows={1: ("act", 1)},
          seed=4),
    _case("sdp", "autocast_fp16", "unused", "sgd", overflows={2: ("loss", 0)},
          reduce_fp16=True, broadcast_fp16=True, seed=5),
    _case("sdp", "half_bf16", "mlp", "adamw", overflows={1: ("act", None)}, seed=6),
    _case("fsdp", "fsdp_fp16", "frozen", "sgd", accum=2, clip=5.0, scaler="torch",
          overflows={1: ("act", 1)}, inject_micro=0, seed=7),
    _case("fsdp", "autocast_bf16", "bn", "adam", overflows={2: ("loss", 1)}, seed=8),
    _case("fsdp", "half_fp16", "unused", "adamw", overflows={0: ("act", 0)}, nested=True,
          seed=9),
]

SAMPLE_4 = [
    _case("ddp", "autocast_fp16", "mlp", "adam", clip=0.5, scaler="torch",
          overflows={1: ("act", 3)}, growth_interval=1, steps=5),
    _case("sdp", "autocast_bf16", "bn", "adamw", accum=2, overflows={0: ("act", 2)},
          seed=10),
    _case("sdp", "fp32", "frozen", "sgd", overflows={1: ("loss", 3), 2: ("act", 1)},
          growth_interval=1, seed=11),
    _case("fsdp", "fsdp_bf16", "unused", "adam", overflows={1: ("act", 3)}, seed=12),
    _case("fsdp", "fp32", "mlp", "sgd", accum=2, clip=0.5, scaler="torch",
          overflows={0: ("act", 2)}, inject_micro=0, nested=True, seed=13),
    _case("fsdp", "fsdp_fp16", "mlp", "adamw", overflows={2: ("loss", 0)},
          fp32_reduce_scatter=True, seed=14),
]


def test_matrix_sample_one_rank(world1):
    _check_sample(world1, SAMPLE_1)


def test_matrix_sample_two_ranks(world2):
    _check_sample(world2, SAMPLE_2)


def test_matrix_sample_four_ranks(world4):
    _check_sample(world4, SAMPLE_4)


# ------------------------------------------------------------ loss-scale state across worlds

def _scaled_steps(state, overflow_steps, steps):
    """ShardedGradScaler (loaded from ``state`` if given) through ``steps`` steps of a tiny
    model, inf on the last rank at ``overflow_steps``; returns its state and scale history."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=64.0, growth_interval=3)
    if state is not None:
        scaler.load_state_dict(state)
    history = []
    for step in range(steps):
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        if step in overflow_steps and rank == world - 1:
            model.weight.grad[0, 0] = INF
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        history.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return scaler.state_dict(), history


def _torch_history(state, overflow_steps, steps):
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=3)
    if state is not None:
        scaler.load_state_dict(state)
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    history = []
    for step in range(steps):
        scaler.scale(param.sum()).backward()
        if step in overflow_steps:
            param.grad[0] = INF
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        history.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return scaler.state_dict(), history


def test_scaler_state_resumes_across_world_sizes(world2, world4):
    """Saved mid-growth-window on 2 ranks, loaded on 4 (and back into torch's scaler): the
    scale and the growth tracker continue exactly as one uninterrupted torch scaler's."""
    first = world2.run(_scaled_steps, None, {1}, 5)
    state = first[0][0]
    assert all(r[0] == state for r in first)
    second = world4.run(_scaled_steps, state, {2}, 5)
    _, want = _torch_history(None, {1, 7}, 10)
    for r in first:
        assert r[1] == want[:5]
    for r in second:
        assert r[1] == want[5:]
    _, resumed = _torch_history(second[0][0], set(), 1)
    assert resumed == _torch_history(None, {1, 7}, 11)[1][10:]


# ------------------------------------------------------------ DeepSpeed's loss-scale rules

class _DeepSpeedRules:
    """DeepSpeed's dynamic loss-scale rules, restated independently of shardkit's class."""

    def __init__(self, init, factor, window, floor, shift, consecutive, raise_at_floor):
        self.scale, self.factor, self.window, self.floor = init, factor, window, floor
        self.shift, self.left, self.consecutive = shift, shift, consecutive
        self.raise_at_floor, self.iteration, self.last_overflow = raise_at_floor, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            if self.shift == 1 or self.left == 1:
                if self.scale == self.floor and self.raise_at_floor:
                    raise LossScaleAtMinimumError("at the floor")
                self.scale = max(self.scale / self.factor, self.floor)
            else:
                self.left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive:
                self.left = self.shift
            if (self.iteration - self.last_overflow) % self.window == 0:
                if not self.consecutive:
                    self.left = self.shift
                self.scale *= self.factor
        self.iteration += 1


def test_dynamic_loss_scaler_follows_deepspeed_rules():
    """300 random schedules (hysteresis, consecutive hysteresis, floors, raising at the floor),
    30 updates each, a state-dict round trip in the middle of each."""
    for seed in range(300):
        rng = random.Random(seed)
        args = dict(scale_factor=rng.choice([2.0, 4.0]), scale_window=rng.randint(1, 4),
                    min_scale=rng.choice([0.25, 1, 4]), hysteresis=rng.randint(1, 3),
                    consecutive_hysteresis=rng.random() < 0.5,
                    raise_error_at_min_scale=rng.random() < 0.5)
        args["init_scale"] = max(2.0 ** rng.randint(0, 8), args["min_scale"])
        rules = _DeepSpeedRules(args["init_scale"], args["scale_factor"], args["scale_window"],
                                args["min_scale"], args["hysteresis"],
                                args["consecutive_hysteresis"], args["raise_error_at_min_scale"])
        scaler = DynamicLossScaler(**args)
        odds = rng.random()
        for update in range(30):
            overflow = rng.random() < odds
            raised = []
            for target in (rules.update, scaler.update_scale):
                try:
                    target(overflow)
                    raised.append(False)
                except LossScaleAtMinimumError:
                    raised.append(True)
            assert raised[0] == raised[1], (seed, update)
            if raised[0]:
                break
            assert (scaler.cur_scale, scaler.cur_hysteresis) == (rules.scale, rules.left), \
                (seed, update, args)
            if update == 10:
                resumed = DynamicLossScaler()
                resumed.load_state_dict(scaler.state_dict())
                scaler = resumed


# ------------------------------------------------------------ bad input found by the matrix

@pytest.mark.parametrize("kwargs, match", [
    # torch's update() takes an int only: a float failed at the first update(), after the
    # collective of step()
    (dict(growth_interval=2.0), r"growth_interval=2.0\): must be an integer >= 1"),
    (dict(init_scale=INF), r"init_scale=inf\): must be a finite number"),
    (dict(growth_factor=INF), r"growth_factor=inf\): must be a finite number"),
    (dict(growth_factor="2"), r"growth_factor='2'\): must be a finite number"),
    (dict(backoff_factor=None), r"backoff_factor=None\): must be a finite number"),
    (dict(enabled="yes"), r"enabled='yes'\): expected True or False"),
])
def test_sharded_grad_scaler_refuses_bad_numbers(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ShardedGradScaler("cpu", **kwargs)


def test_dynamic_loss_scaler_bad_state_and_floor():
    with pytest.raises(ValueError, match=r"init_scale=1 is below min_scale=2"):
        DynamicLossScaler(init_scale=1, min_scale=2)
    scaler = DynamicLossScaler(init_scale=8)
    with pytest.raises(KeyError, match=r"unknown key 'scale'; valid keys are .*cur_scale"):
        scaler.load_state_dict({"scale": 4.0})
    assert scaler.loss_scale == 8  # nothing was loaded


def _fsdp_buffer_dtype_errors():
    """buffer_dtype without mixed precision: BatchNorm's fp32 weight beside bf16 statistics."""
    out = {}
    for name, kwargs in [("buffer_dtype", dict(buffer_dtype=torch.bfloat16)),
                         ("policy", dict(mixed_precision=MixedPrecisionPolicy(
                             buffer_dtype=torch.bfloat16)))]:
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        try:
            FSDP(model, **kwargs)
            out[name] = None
        except ValueError as error:
            out[name] = str(error)
    plain = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                 buffer_dtype=torch.bfloat16)
    plain(torch.randn(2, 4)).sum().backward()  # without a BatchNorm it trains
    return out


def test_fsdp_buffer_dtype_without_mixed_precision_refuses_batchnorm(world2):
    """Was a RuntimeError at the first forward ("expected scalar type Float but found
    BFloat16"); now a ValueError at construction, before any collective."""
    for r in world2.run(_fsdp_buffer_dtype_errors):
        for message in r.values():
            assert message is not None
            assert "buffer_dtype=torch.bfloat16" in message
            assert "BatchNorm1d" in message and "torch.float32" in message


def _fsdp_fp16_reduction_overflow(kind: str):
    """Every rank's gradient of W[0, 0] is 40000 (fp16: finite) or 1e6 (fp32); the fp16
    reduce-scatter makes an inf that only W[0, 0]'s owner (rank 0) receives: with
    ``gradient_predivide_factor=1`` the sum 80000 outgrows fp16, with an fp16 ``reduce_dtype``
    under fp32 compute the cast of 1e6 / 2 does."""
    layer = nn.Linear(2, 2, bias=False)
    nn.init.ones_(layer.weight)
    if kind == "predivide":
        model = FSDP(layer, mixed_precision=True, gradient_predivide_factor=1.0)
        x = torch.tensor([[40000.0, 1.0]])
    else:
        model = FSDP(layer, mixed_precision=MixedPrecisionPolicy(reduce_dtype=torch.float16))
        x = torch.tensor([[1e6, 1.0]])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with skdist.CommCounter() as comm:
        scaler.scale(model(x)[:, 0].sum()).backward()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    stepped = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return dict(scale=scaler.get_scale(), stepped=stepped,
                all_reduces=comm.calls_by_op.get("all_reduce", 0))


def test_fsdp_fp16_reduction_overflow_reaches_every_rank(world2):
    """Was: rank 0 skipped and backed its scale off to 0.5, rank 1 stepped and kept 1.0 (the
    loss scales, and with them the shards, drift apart silently). Now every rank sees the
    overflow, for the price of one all-reduce of one element per unit in those
    configurations."""
    for kind in ("predivide", "fp16_reduce_dtype"):
        results = world2.run(_fsdp_fp16_reduction_overflow, kind)
        assert [(r["scale"], r["stepped"]) for r in results] == [(0.5, False)] * 2, (kind,
                                                                                     results)
        assert [r["all_reduces"] for r in results] == [1, 1]
