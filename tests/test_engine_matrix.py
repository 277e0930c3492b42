"""shardkit.initialize against a hand-written reference of DeepSpeed's engine semantics.

A fixed sample of configs (every ZeRO stage and its knobs, fp16 dynamic and static loss
scaling with injected overflows, bf16, gradient accumulation with every batch-size form,
clipping, Adam/AdamW/SGD sections, the four DeepSpeed schedules, client optimizers and
schedulers, eval(), no_sync(), frozen parameters, param groups) trains for a few steps in
worlds of 1, 2 and 4 gloo ranks; after every ``engine.step()`` each rank compares the loss,
parameters, lr, momentum, skipped steps, loss scale and gradient norm with a single-process
reference stepping on the global batch. One world per size for the module.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, resolve_batch_sizes
from shardkit.testing import world_fixture

world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)

D_IN, D_H, D_OUT = 6, 12, 3
# Adam's eps: large enough that an element whose gradient is rounding noise does not turn
# the noise into +-lr steps (the reduction order differs between ranks and the reference)
EPS = 1e-4


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class _Net(nn.Module):
    """Repeated blocks, so stage 3 wraps several FSDP units."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D_H)
        self.blocks = nn.Sequential(_Block(D_H), _Block(D_H))
        self.out = nn.Linear(D_H, D_OUT)

    def forward(self, x):
        return self.out(self.blocks(torch.tanh(self.inp(x))))


# ----------------------------------------------------------------------------- the sample

def _case(stage, batch, steps=4, precision="fp32", zero=None, fp16=None, overflow=None,
          clip=0.0, optimizer=("AdamW", {}), scheduler=None, client=None, **flags):
    """One config of the sample. ``batch``: (keys given: t/m/g, micro, gas); ``overflow``:
    {step: (rank or "all", micro-batch)} where the loss becomes inf; ``client``: "optimizer",
    "optimizer_fn", "scheduler", "scheduler_fn" (objects passed instead of config sections)."""
    return dict(stage=stage, batch=batch, steps=steps, precision=precision, zero=zero or {},
                fp16=fp16, overflow=overflow or {}, clip=clip, optimizer=optimizer,
                scheduler=scheduler, client=client or (), **flags)


SAMPLE = [
    _case(0, ("mg", 2, 2), optimizer=("Adam", {"adam_w_mode": False, "weight_decay": 0.1}),
          scheduler=("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                  "warmup_num_steps": 3}), no_sync=True, eval_at=1),
    _case(1, ("tmg", 1, 3), zero={"reduce_scatter": True, "overlap_comm": True},
          clip=0.05, optimizer=("Adam", {"weight_decay": 0.01, "betas": [0.8, 0.99]}),
          scheduler=("WarmupDecayLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                       "warmup_num_steps": 2, "total_num_steps": 3,
                                       "warmup_type": "linear"})),
    _case(1, ("tm", 2, 2), zero={"reduce_scatter": False, "contiguous_gradients": False},
          optimizer=("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
          scheduler=("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                  "cycle_first_step_size": 1, "cycle_second_step_size": 2,
                                  "decay_lr_rate": 0.5, "decay_step_size": 1}),
          no_sync=True, frozen=True),
    _case(2, ("tg", 2, 4), zero={"overlap_comm": True, "contiguous_gradients": True},
          clip=0.1, optimizer=("AdamW", {"torch_adam": True}),
          scheduler=("WarmupCosineLR", {"warmup_num_steps": 2, "total_num_steps": 4,
                                        "warmup_min_ratio": 0.1, "cos_min_ratio": 0.2}),
          groups=True),
    _case(2, ("m", 3, 1), zero={"offload_optimizer": {"device": "cpu"}},
          client=("optimizer", "scheduler"), eval_at=2),
    _case(3, ("t", 2, 1), zero={"offload_optimizer": {"device": "cpu"}, "reduce_scatter": True},
          clip=1.0, optimizer=("SGD", {"momentum": 0.9}),
          scheduler=("WarmupLR", {"warmup_max_lr": 1e-2, "warmup_num_steps": 2,
                                  "warmup_type": "linear"}), frozen=True, no_sync=True),
    _case(3, ("mg", 1, 2), zero={"overlap_comm": True, "contiguous_gradients": False},
          optimizer=("Adam", {"adam_w_mode": True, "weight_decay": 0.1}),
          scheduler=("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                  "cycle_first_step_size": 2}), eval_at=0, groups=True),
    _case(0, ("tmg", 1, 2), client=("optimizer_fn", "scheduler_fn"), clip=0.05, no_sync=True),
    # fp16: dynamic scaling, hysteresis 2, window 2, overflow on one rank mid-window
    _case(1, ("mg", 1, 3), precision="fp16", steps=6,
          fp16={"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2},
          overflow={1: ("last", 0), 2: ("all", 2), 4: (0, 1)}, clip=1.0,
          scheduler=("WarmupLR", {"warmup_max_lr": 1e-2, "warmup_num_steps": 3})),
    _case(2, ("tm", 2, 2), precision="fp16", steps=5,
          fp16={"initial_scale_power": 6, "loss_scale_window": 1, "hysteresis": 1,
                "consecutive_hysteresis": True, "min_loss_scale": 32},
          overflow={0: ("all", 0), 1: ("last", 1), 3: (0, 0)}, client=("scheduler_fn",)),
    _case(3, ("mg", 2, 2), precision="fp16", steps=5, fp16={"loss_scale": 128.0},
          overflow={1: (0, 1)}, optimizer=("SGD", {"momentum": 0.9})),
    _case(0, ("mg", 1, 2), precision="fp16", steps=5,
          fp16={"initial_scale_power": 4, "loss_scale_window": 3, "hysteresis": 3},
          overflow={0: ("all", 1), 1: ("last", 0), 2: (0, 1)}, no_sync=True),
    _case(2, ("mg", 2, 2), precision="bf16", overflow={2: ("last", 1)}, clip=0.1,
          client=("optimizer",)),
    _case(3, ("tmg", 1, 2), precision="bf16", overflow={1: ("all", 0)},
          scheduler=("WarmupDecayLR", {"warmup_max_lr": 1e-2, "warmup_num_steps": 2,
                                       "total_num_steps": 4})),
]


# ----------------------------------------------------------------------------- reference

def _reference_optimizer(kind, params, groups):
    """DeepSpeed's basic optimizers: "Adam" is AdamW unless adam_w_mode is false; torch's
    AdamW (torch_adam) defaults weight_decay to 0.01, FusedAdam to 0."""
    p = dict(params)
    lr = p.get("lr", 1e-2)
    if kind == "SGD":
        return torch.optim.SGD(groups, lr=lr, momentum=p.get("momentum", 0.0),
                               weight_decay=p.get("weight_decay", 0.0),
                               nesterov=p.get("nesterov", False))
    decoupled = kind == "AdamW" or p.get("adam_w_mode", True)
    decay = p.get("weight_decay", 0.01 if p.get("torch_adam") and decoupled else 0.0)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(groups, lr=lr, betas=tuple(p.get("betas", (0.9, 0.999))), eps=EPS,
               weight_decay=decay)


class _ReferenceSchedule:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR / OneCycle, written from its
    formulas (iteration -1 before the first step; the optimizer starts at iteration -1's lr)."""

    def __init__(self, kind, params, optimizer):
        self.kind, self.p, self.opt, self.it = kind, dict(params), optimizer, -1
        self.peak = [g["lr"] for g in optimizer.param_groups]
        self.warm = max(2, self.p.get("warmup_num_steps", 1000))
        self._apply()

    def _rise(self):
        if self.p.get("warmup_type", "log") == "log":
            return math.log(self.it + 1) / math.log(self.warm)
        return self.it / self.warm

    def _cycle_fraction(self):
        first = float(self.p.get("cycle_first_step_size", 2000))
        total = first + float(self.p.get("cycle_second_step_size") or first)
        x = 1.0 + (self.it + 1) / total - math.floor(1 + (self.it + 1) / total)
        ratio = first / total
        return (x / ratio if x <= ratio else (x - 1) / (ratio - 1)), total

    def _lr_factor_and_base(self):
        p = self.p
        if self.kind in ("WarmupLR", "WarmupDecayLR"):
            lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", 0.001)
            if self.it < 0:
                return [lo for _ in self.peak]
            if self.it < self.warm:
                gamma = self._rise()
            elif self.kind == "WarmupLR":
                gamma = 1.0
            else:
                total = p["total_num_steps"]
                gamma = max(0.0, (total - self.it) / max(1.0, total - self.warm))
            return [lo + (hi - lo) * gamma for _ in self.peak]
        if self.kind == "WarmupCosineLR":
            if self.it < 0:
                ratio = 0.0
            elif self.it < self.warm:
                low = p.get("warmup_min_ratio", 0.0)
                ratio = low + self._rise() * (1 - low)
            else:
                span = p["total_num_steps"] - self.warm
                done = min(self.it - self.warm + 1, span)
                floor = p.get("cos_min_ratio", 1e-4)
                ratio = floor + (1 - floor) * (1 + math.cos(math.pi * done / span)) / 2
            return [lr * ratio for lr in self.peak]
        lo, hi = p["cycle_min_lr"], p["cycle_max_lr"]
        fraction, total = self._cycle_fraction()
        if self.it < total:
            return [lo + (hi - lo) * fraction for _ in self.peak]
        if not p.get("decay_step_size") or not p.get("decay_lr_rate"):
            return [lo for _ in self.peak]
        intervals = (self.it - total + 1) / p["decay_step_size"]
        return [lo / (1 + p["decay_lr_rate"] * intervals) for _ in self.peak]

    def _beta1(self):
        lo, hi = self.p.get("cycle_min_mom", 0.8), self.p.get("cycle_max_mom", 0.9)
        fraction, total = self._cycle_fraction()
        if self.it < 0:
            return lo
        return hi - (hi - lo) * fraction if self.it < total else hi

    def _apply(self):
        for group, lr in zip(self.opt.param_groups, self._lr_factor_and_base()):
            group["lr"] = lr
        if self.kind == "OneCycle" and self.p.get("cycle_momentum", True) \
                and "betas" in self.opt.defaults:
            for group in self.opt.param_groups:  # shardkit keeps each group's beta2
                group["betas"] = (self._beta1(), group["betas"][1])

    def step(self):
        self.it += 1
        self._apply()


class _ReferenceScaler:
    """DeepSpeed's loss scaler: hysteresis (delayed shift), window growth, floor."""

    def __init__(self, fp16):
        self.static = fp16.get("loss_scale", 0) > 0
        self.scale = fp16["loss_scale"] if self.static \
            else 2.0 ** fp16.get("initial_scale_power", 16)
        self.window, self.hysteresis = fp16.get("loss_scale_window", 1000), \
            fp16.get("hysteresis", 2)
        self.left, self.consecutive = self.hysteresis, fp16.get("consecutive_hysteresis", False)
        self.floor, self.it, self.last_overflow = fp16.get("min_loss_scale", 1.0), 0, -1

    def update(self, overflow):
        if self.static:
            return
        if overflow:
            if self.left == 1:
                self.scale = max(self.scale / 2, self.floor)
            else:
                self.left -= 1
            self.last_overflow = self.it
        else:
            if self.consecutive:
                self.left = self.hysteresis
            if (self.it - self.last_overflow) % self.window == 0:
                self.left = self.hysteresis
                self.scale *= 2
        self.it += 1


def _client_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _global_batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, D_IN, generator=g), torch.randn(rows, D_OUT, generator=g)


def _groups(model, split):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not split:
        return [p for _, p in trainable]
    return [{"params": [p for n, p in trainable if n.endswith("weight")]},
            {"params": [p for n, p in trainable if not n.endswith("weight")],
             "weight_decay": 0.0}]


def _config(case, world):
    keys, micro, gas = case["batch"]
    config = {"zero_optimization": {"stage": case["stage"], **case["zero"]},
              "steps_per_print": 10 ** 6, "gradient_clipping": case["clip"]}
    given = {"t": ("train_batch_size", micro * gas * world),
             "m": ("train_micro_batch_size_per_gpu", micro),
             "g": ("gradient_accumulation_steps", gas)}
    config.update(given[k] for k in keys)
    if case["precision"] == "fp16":
        config["fp16"] = {"enabled": True, **case["fp16"]}
    if case["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    kind, params = case["optimizer"]
    params = {"lr": 1e-2, **params, **({} if kind == "SGD" else {"eps": EPS})}
    if not {"optimizer", "optimizer_fn"} & set(case["client"]):
        config["optimizer"] = {"type": kind, "params": params}
    if case["scheduler"] is not None:
        config["scheduler"] = {"type": case["scheduler"][0], "params": case["scheduler"][1]}
    return config, params


# ----------------------------------------------------------------------------- one case

def _train_beside_reference(case):
    """Train ``case`` with shardkit.initialize and the reference; the mismatches seen."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    _, micro, gas = case["batch"]
    config, opt_params = _config(case, world)
    kind = case["optimizer"][0]
    tol = {"fp32": 1e-5, "fp16": 3e-2, "bf16": 8e-2}[case["precision"]]
    autocast = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(case["precision"])
    torch.manual_seed(0)
    model = _Net()
    if case.get("frozen"):
        model.blocks[0].lin.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    ref_opt = _reference_optimizer(kind, opt_params, _groups(ref, case.get("groups")))
    ref_sched = _ReferenceSchedule(*case["scheduler"], ref_opt) if case["scheduler"] else None
    client = set(case["client"])
    if client & {"scheduler", "scheduler_fn"}:
        ref_sched = _client_schedule(ref_opt)
    scaler = _ReferenceScaler(config["fp16"]) if case["precision"] == "fp16" else None
    kwargs = {}
    if "optimizer" in client:
        kwargs["optimizer"] = _reference_optimizer(kind, opt_params, _groups(model, False))
    elif "optimizer_fn" in client:
        kwargs["optimizer"] = lambda ps: _reference_optimizer(kind, opt_params, ps)
    else:
        kwargs["model_parameters"] = _groups(model, case.get("groups"))
    if "scheduler" in client:
        kwargs["lr_scheduler"] = _client_schedule(kwargs["optimizer"])
    elif "scheduler_fn" in client:
        kwargs["lr_scheduler"] = _client_schedule
    engine, _, _, _ = shardkit.initialize(model=model, config=config, **kwargs)
    problems = []
    if engine.get_batch_info() != (micro * gas * world, micro, gas):
        problems.append(f"batch info {engine.get_batch_info()}")
    skipped = 0
    for step in range(case["steps"]):
        X, Y = _global_batch(step, micro * gas * world)
        who, at_micro = case["overflow"].get(step, (None, None))
        who = world - 1 if who == "last" else who
        for m in range(gas):
            lo = (rank * gas + m) * micro
            x, y = X[lo:lo + micro], Y[lo:lo + micro]
            with torch.no_grad(), torch.autocast("cpu", autocast, enabled=autocast is not None):
                ref_loss = F.mse_loss(ref(x).float(), y).item()
            if case.get("eval_at") == step and m == 0:
                engine.eval()
                with torch.no_grad():
                    seen = F.mse_loss(engine(x).float(), y).item()
                if any(module.training for module in engine.module.modules()) \
                        or abs(seen - ref_loss) > tol * max(1, abs(ref_loss)):
                    problems.append(f"step {step}: eval() forward")
                engine.train()
            loss = F.mse_loss(engine(x).float(), y)
            if abs(loss.item() - ref_loss) > tol * max(1, abs(ref_loss)):
                problems.append(f"step {step} micro {m}: loss {loss.item()} != {ref_loss}")
            if engine.is_gradient_accumulation_boundary() != (m == gas - 1):
                problems.append(f"step {step} micro {m}: is_gradient_accumulation_boundary")
            if m == at_micro and who in ("all", rank):
                loss = loss * math.inf
            sync = engine.no_sync() if case.get("no_sync") and m < gas - 1 else None
            if sync is not None:
                with sync:
                    engine.backward(loss)
            else:
                engine.backward(loss)
            engine.step()
        ref_opt.zero_grad()
        with torch.autocast("cpu", autocast, enabled=autocast is not None):
            ref_full = F.mse_loss(ref(X).float(), Y)
        (ref_full * (scaler.scale if scaler else 1.0)).backward()
        overflow = who is not None
        if overflow:
            skipped += 1
        else:
            grads = [p.grad for p in ref.parameters() if p.grad is not None]
            if scaler:
                torch._foreach_div_(grads, scaler.scale)
            ref_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.grad is not None], case["clip"] or math.inf)
            ref_opt.step()
            if ref_sched is not None:
                ref_sched.step()
        if scaler:
            scaler.update(overflow)
        problems += _compare(engine, ref, ref_opt, step, skipped, overflow, scaler,
                             None if overflow else ref_norm.item(), tol)
    return problems


def _compare(engine, ref, ref_opt, step, skipped, overflow, scaler, ref_norm, tol):
    """What differs between the engine and the reference after ``step``."""
    problems = []
    counters = (engine.global_steps, engine.skipped_steps, engine.was_step_applied())
    if counters != (step + 1, skipped, not overflow):
        problems.append(f"step {step}: (global_steps, skipped_steps, was_step_applied) "
                        f"{counters} != {(step + 1, skipped, not overflow)}")
    if scaler is not None and engine.loss_scale != scaler.scale:
        problems.append(f"step {step}: loss scale {engine.loss_scale} != {scaler.scale}")
    want = [g["lr"] for g in ref_opt.param_groups]
    if len(engine.get_lr()) != len(want) or any(
            abs(a - b) > 1e-9 for a, b in zip(engine.get_lr(), want)):
        problems.append(f"step {step}: lr {engine.get_lr()} != {want}")
    if "betas" in ref_opt.defaults and [tuple(b) for b in engine.get_mom()] != \
            [tuple(g["betas"]) for g in ref_opt.param_groups]:
        problems.append(f"step {step}: betas {engine.get_mom()}")
    norm = engine.get_global_grad_norm()
    if norm is not None and (overflow or abs(norm - ref_norm) > 10 * tol * max(1, ref_norm)):
        problems.append(f"step {step}: grad norm {norm} != {ref_norm}")
    state = engine.module_state_dict()
    worst = max((state[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
    if worst > tol:
        problems.append(f"step {step}: parameters differ by {worst:.3g}")
    return problems


def _run_sample(indices):
    return [_train_beside_reference(SAMPLE[i]) for i in indices]


@pytest.mark.parametrize("world_name", ["world1", "world2", "world4"])
def test_sample_matches_deepspeed_reference(world_name, request):
    world = request.getfixturevalue(world_name)
    results = world.run(_run_sample, list(range(len(SAMPLE))))
    failures = {(rank, i): problems[:3] for rank, per_rank in enumerate(results)
                for i, problems in enumerate(per_rank) if problems}
    assert not failures, failures


# ----------------------------------------------------------------------------- no_sync + step

def _step_inside_no_sync(stage):
    """DeepSpeed refuses ``engine.step()`` inside ``engine.no_sync()``; so must shardkit, or
    the step applies each rank's own gradients (stage 0: replicas drift apart). Returns the
    errors raised and how far the ranks' weights drifted."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 2,
              "steps_per_print": 10 ** 6, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = shardkit.initialize(model=_Net(), config=config)
    X, Y = _global_batch(0, 2 * world)
    x, y = X[2 * rank:2 * rank + 2], Y[2 * rank:2 * rank + 2]
    errors = []
    for step_inside in (True, False):
        try:
            with engine.no_sync():
                engine.backward(F.mse_loss(engine(x), y))
                if step_inside:
                    engine.step()
            if not step_inside:
                engine.step()
        except RuntimeError as error:
            errors.append(str(error))
        engine.zero_grad()
    engine.backward(F.mse_loss(engine(x), y))  # the right way still trains
    engine.step()
    flat = torch.cat([v.flatten() for v in engine.module_state_dict().values()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    torch.distributed.all_gather(gathered, flat)
    return errors, max((g - flat).abs().max().item() for g in gathered), engine.global_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_after_an_unreduced_boundary_backward_is_refused(world2, stage):
    for errors, drift, steps in world2.run(_step_inside_no_sync, stage):
        assert len(errors) == 2, errors
        assert "engine.step() was called inside engine.no_sync()" in errors[0]
        assert "ran inside engine.no_sync()" in errors[1]
        assert drift == 0.0 and steps == 1


# ----------------------------------------------------------------------------- batch sizes

@pytest.mark.parametrize("train, micro, gas, world", [
    (8, 3, None, 1), (12, 2, None, 4), (6, None, 4, 1), (10, None, None, 4), (16, 2, 2, 2)])
def test_inconsistent_batch_sizes_are_refused_as_deepspeed_does(train, micro, gas, world):
    with pytest.raises(ConfigError, match="inconsistent batch sizes: train_batch_size"):
        resolve_batch_sizes(train, micro, gas, world)
