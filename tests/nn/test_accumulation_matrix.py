"""Gradient accumulation, no_sync and unused parameters across the wrappers: a seeded random
matrix at worlds 2 and 4.

Each case trains a small branchy model a few steps with one wrapper (torch DDP + OSS,
ShardedDataParallel + OSS, FSDP with nested units, ``shardkit.initialize`` stages 0-3) and a
random pattern per step: k micro-batches inside ``no_sync()`` then a synced one, or all of them
inside ``no_sync()`` then ``ShardedDataParallel.reduce()``; a branch (layer ``b`` or ``c``)
taken or skipped per micro-batch and per rank; ``requires_grad`` toggled between steps; two
forwards summed into one backward; ``zero_grad(set_to_none=...)`` before the first forward or
after the step; gradient clipping after accumulation; activation checkpointing inside a unit.
Every rank replays the same global computation in one process (the oracle) and compares every
parameter after every step.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.testing import world_fixture

WIDTH, OUT, LOCAL = 8, 3, 4
LR, MOMENTUM, CLIP = 0.05, 0.9, 0.05
STEPS = 3
TOL = 2e-6
MP_TOL = 5e-2   # mixed precision (bf16 compute) against the fp32 oracle

world2 = world_fixture(2, timeout=120)
world4 = world_fixture(4, timeout=120)


# ---------------------------------------------------------------------- the model


class Net(nn.Module):
    """``head(a(x) [+ b(.)] [+ c(.)])``: ``route`` bit 1 takes ``b``, bit 2 takes ``c``."""

    def __init__(self, ckpt: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.a = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.b = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.c = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
        self.head = nn.Linear(WIDTH, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.4)
        if ckpt:
            from shardkit.nn.checkpoint import checkpoint_wrapper
            self.b[0] = checkpoint_wrapper(self.b[0])

    def forward(self, x, route: int = 3):
        h = self.a(x)
        if route & 1:
            h = h + self.b(h)
        if route & 2:
            h = h + self.c(h)
        return self.head(h)


def _layer_params(net: Net, name: str) -> list:
    return list(getattr(net, name).parameters())


# ---------------------------------------------------------------------- random cases


def make_cases(seed: int, world: int, count: int) -> list[dict]:
    """``count`` cases over the wrappers, each with STEPS random step plans (identical on every
    rank: the parent draws them)."""
    rng = random.Random(seed)
    kinds = ["ddp_oss", "sdp", "sdp", "sdp", "fsdp", "fsdp", "fsdp", "engine"]
    cases = []
    for i in range(count):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        case = {"kind": kind, "world": world, "ckpt": rng.random() < 0.3}
        if kind == "sdp":
            case["reduce_buffer_size"] = rng.choice([0, 2 ** 23, 200])
            case["auto_refresh"] = rng.random() < 0.5
        if kind == "fsdp":
            case["reshard"] = rng.random() < 0.5
            case["flatten"] = rng.random() < 0.5
            case["mp"] = rng.random() < 0.2
            # "abc": a, b and c are units of their own, so every rank must take the same branch
            # (an FSDP unit's gather is collective); "a": b and c live in the root unit and may
            # go unused on some ranks only
            case["units"] = rng.choice(["abc", "a"])
        if kind == "engine":
            case["stage"] = rng.choice([0, 1, 2, 3])
            case["gas"] = rng.choice([1, 2, 3, 4])
        steps = []
        for _ in range(STEPS):
            micro = case["gas"] if kind == "engine" else rng.choice([1, 2, 3, 4])
            plan = {
                "micro": micro,
                # every micro-batch, every rank: a list of (rows, route) forwards summed
                "forwards": [_per_rank(rng, world, kind, case.get("units") == "abc")
                             for _ in range(micro)],
                "all_no_sync": kind == "sdp" and rng.random() < 0.3,
                "clip": rng.random() < 0.3,
                "zero_before": rng.random() < 0.5,
                "set_to_none": rng.random() < 0.5,
                "zero_on_model": rng.random() < 0.5,
                "frozen": (sorted(rng.sample(["b", "c"], rng.choice([0, 0, 1])))
                           if kind in ("sdp", "fsdp") else []),
            }
            steps.append(plan)
        case["steps"] = steps
        case["seed"] = seed * 1000 + i
        cases.append(case)
    return cases


def _per_rank(rng, world: int, kind: str, alike: bool) -> list:
    """Every rank's forwards of one micro-batch. torch DDP (and the engine's stages 0-1) takes
    one forward per backward; FSDP's units gather collectively, so every rank runs as many
    forwards, and with ``alike`` (branches that are units) the same routes."""
    two = kind in ("sdp", "fsdp") and rng.random() < 0.25
    cut = rng.randint(1, LOCAL - 1)
    ranks = []
    for _ in range(world):
        if not two or (kind == "sdp" and rng.random() < 0.5):
            ranks.append([(0, LOCAL, rng.choice([1, 2, 3, 3, 3, 0]))])
        else:  # two forwards, one backward on the sum
            ranks.append([(0, cut, rng.choice([0, 1, 2, 3])),
                          (cut, LOCAL, rng.choice([0, 1, 2, 3]))])
        if kind == "fsdp" and not two:
            ranks[-1] = [(0, LOCAL, ranks[-1][0][2])]
    if alike:
        ranks = [ranks[0]] * world
    return ranks


# ---------------------------------------------------------------------- rank side


def _data(seed: int, step: int, micro: int, rank: int):
    gen = torch.Generator().manual_seed(seed * 97 + step * 13 + micro * 5 + rank)
    return torch.randn(LOCAL, WIDTH, generator=gen), torch.randn(LOCAL, OUT, generator=gen)


def _micro_loss(model, x, y, forwards):
    """mse over this micro-batch as a sum over its forwards (each a row range and a route)."""
    loss = 0.0
    for lo, hi, route in forwards:
        out = model(x[lo:hi], route)
        loss = loss + F.mse_loss(out, y[lo:hi], reduction="sum")
    return loss / (LOCAL * OUT)


def _oracle_step(oracle, opt, case, step, plan):
    world = case["world"]
    for name in ("b", "c"):
        for p in _layer_params(oracle, name):
            p.requires_grad_(name not in plan["frozen"])
            if name in plan["frozen"]:
                p.grad = None
    divisor = case["gas"] if case["kind"] == "engine" else 1
    for m in range(plan["micro"]):
        total = 0.0
        for r in range(world):
            x, y = _data(case["seed"], step, m, r)
            total = total + _micro_loss(oracle, x, y, plan["forwards"][m][r])
        (total / world / divisor).backward()
    if plan["clip"] or (case["kind"] == "engine"):
        torch.nn.utils.clip_grad_norm_([p for p in oracle.parameters() if p.grad is not None],
                                       CLIP if plan["clip"] or case["kind"] == "engine" else 1e9)
    opt.step()
    # as the wrapper's zeroing (a zero gradient is stepped by momentum, None is not)
    following = case["steps"][step + 1:step + 2]
    opt.zero_grad(set_to_none=(following[0] if following and following[0]["zero_before"]
                               else plan)["set_to_none"])


def _sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _build(case, net):
    """(model to call, optimizer, no_sync context factory, clip fn, extra dict)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS
    kind = case["kind"]
    if kind == "ddp_oss":
        model = DDP(net, find_unused_parameters=True)
        opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        return model, opt, model.no_sync, lambda: opt.clip_grad_norm(CLIP)
    if kind == "sdp":
        opt = OSS(net.parameters(), optim=torch.optim.SGD, lr=LR, momentum=MOMENTUM)
        model = ShardedDataParallel(net, opt, reduce_buffer_size=case["reduce_buffer_size"],
                                    auto_refresh_trainable=case["auto_refresh"],
                                    warn_on_trainable_params_changed=False)
        return model, opt, model.no_sync, lambda: opt.clip_grad_norm(CLIP)
    if kind == "fsdp":
        kw = dict(reshard_after_forward=case["reshard"], flatten_parameters=case["flatten"],
                  mixed_precision=case["mp"])
        if case["mp"]:
            kw["compute_dtype"] = torch.bfloat16
        for name in ("a", "b", "c") if case["units"] == "abc" else ("a",):
            setattr(net, name, FSDP(getattr(net, name), **kw))
        model = FSDP(net, **kw)
        opt = _sgd(model.parameters())
        return model, opt, model.no_sync, lambda: model.clip_grad_norm_(CLIP)
    raise AssertionError(kind)


def _run_engine_case(case):
    import shardkit
    from shardkit import distributed as skdist
    rank = skdist.get_rank()
    net, oracle = Net(case["ckpt"]), Net(case["ckpt"])
    ref_opt = _sgd(oracle.parameters())
    config = {"train_micro_batch_size_per_gpu": LOCAL,
              "gradient_accumulation_steps": case["gas"], "gradient_clipping": CLIP,
              "steps_per_print": 10 ** 6, "zero_optimization": {"stage": case["stage"]}}
    engine, _, _, _ = shardkit.initialize(net, optimizer=_sgd, config=config)
    worst = 0.0
    for step, plan in enumerate(case["steps"]):
        _oracle_step(oracle, ref_opt, case, step, plan)
        for m in range(plan["micro"]):
            x, y = _data(case["seed"], step, m, rank)
            engine.backward(_micro_loss(engine, x, y, plan["forwards"][m][rank]))
            engine.step()
        worst = max(worst, _diff(engine.module_state_dict(), oracle))
    return worst


def _diff(state: dict, oracle: Net) -> float:
    ref = oracle.state_dict()
    assert set(state) == set(ref), (sorted(state), sorted(ref))
    return max((state[k].float() - ref[k]).abs().max().item() for k in ref)


def run_case(case):
    """Train the case; return the largest parameter difference against the oracle over every
    step, or ``("error", type, message)`` when the wrapper refused the pattern."""
    from shardkit import distributed as skdist
    torch.manual_seed(0)
    if case["kind"] == "engine":
        try:
            return _run_engine_case(case)
        except (ValueError, RuntimeError, TypeError) as e:
            return ("error", type(e).__name__, str(e))
    rank = skdist.get_rank()
    net, oracle = Net(case["ckpt"]), Net(case["ckpt"])
    ref_opt = _sgd(oracle.parameters())
    layers = {name: _layer_params(net, name) for name in ("b", "c")}
    model, opt, no_sync, clip = _build(case, net)
    worst = 0.0
    try:
        for step, plan in enumerate(case["steps"]):
            _oracle_step(oracle, ref_opt, case, step, plan)
            changed = False
            for name, params in layers.items():
                for p in params:
                    want = name not in plan["frozen"]
                    changed |= p.requires_grad != want
                    p.requires_grad_(want)
                    if not want:  # frozen: no gradient (as the oracle, zeroed to None)
                        p.grad = None
            if changed and case["kind"] == "sdp" and not case["auto_refresh"]:
                model.refresh_trainable()
            if plan["zero_before"]:
                _zero(model, opt, plan)
            for m in range(plan["micro"]):
                x, y = _data(case["seed"], step, m, rank)
                last = m == plan["micro"] - 1
                synced = last and not plan["all_no_sync"]
                ctx = no_sync() if not synced else _Null()
                with ctx:
                    _micro_loss(model, x, y, plan["forwards"][m][rank]).backward()
            if plan["all_no_sync"]:
                model.reduce()
            if plan["clip"]:
                clip()
            opt.step()
            following = case["steps"][step + 1:step + 2]
            if not following or not following[0]["zero_before"]:
                _zero(model, opt, plan)  # else the next step zeroes before its first forward
            if case["kind"] == "fsdp":
                state = model.state_dict()
            else:
                state = net.state_dict()
            d = _diff(state, oracle)
            worst = max(worst, d)
    except (ValueError, RuntimeError, TypeError) as e:
        return ("error", type(e).__name__, str(e))
    return worst


def _zero(model, opt, plan):
    if plan["zero_on_model"]:
        model.zero_grad(set_to_none=plan["set_to_none"])
    else:
        opt.zero_grad(set_to_none=plan["set_to_none"])


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_cases(cases):
    return [run_case(c) for c in cases]


# ---------------------------------------------------------------------- tests


def _check(results, cases):
    failures = []
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        tol = MP_TOL if case.get("mp") else TOL
        if isinstance(per_rank[0], tuple):
            failures.append((case, per_rank))
            continue
        if max(per_rank) > tol:
            failures.append((case, per_rank))
    assert not failures, "\n".join(f"{c}\n  -> {r}" for c, r in failures)


@pytest.mark.parametrize("world_name,seed,count", [("world2", 1, 24), ("world4", 2, 16)])
def test_accumulation_matrix(request, world_name, seed, count):
    world = request.getfixturevalue(world_name)
    cases = make_cases(seed, world.world_size, count)
    _check(world.run(run_cases, cases), cases)


def _clip_after_no_sync_only():
    """Every backward of the cycle inside no_sync(), then clip_grad_norm_: refused on every
    rank (it read a norm of 0.0, the accumulated gradients being held outside ``.grad``); after
    a synchronising backward the same clip matches the oracle's norm."""
    from shardkit import distributed as skdist
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    rank, world = skdist.get_rank(), skdist.get_world_size()
    net, oracle = Net(), Net()
    net.b = FSDP(net.b)
    model = FSDP(net)
    x, y = _data(11, 0, 0, rank)
    with model.no_sync():
        _micro_loss(model, x, y, [(0, LOCAL, 3)]).backward()
    try:
        model.clip_grad_norm_(CLIP)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    _micro_loss(model, x, y, [(0, LOCAL, 3)]).backward()    # synchronising: reduces both
    norm = float(model.clip_grad_norm_(CLIP))
    total = sum(_micro_loss(oracle, *_data(11, 0, 0, r), [(0, LOCAL, 3)]) for r in range(world))
    (2 * total / world).backward()
    ref = float(torch.nn.utils.clip_grad_norm_(oracle.parameters(), CLIP))
    return refused, abs(norm - ref)


def test_fsdp_clip_after_no_sync_only_is_refused(world2):
    for refused, norm_diff in world2.run(_clip_after_no_sync_only):
        assert refused is not None and "no_sync()" in refused and "clip_grad_norm_" in refused
        assert norm_diff < 1e-6
