"""OSS and ShardedDataParallel against one process, over a fixed sample of an option matrix.

A randomized search (about 2,000 combinations at world 2 and 4 of model, optimizer, wrapper
and ShardedDDP options, events mid-run and state-dict round trips) found no fp32 mismatch; this
module keeps a small fixed sample of it, covering every option at least once, and compares
loss and every parameter on every rank with a single-process oracle at every step. The
oracle runs each rank's micro-batch in turn and averages, which is the global-batch loss
(BatchNorm included: its running statistics follow rank 0's batches, as ``broadcast_buffers``
makes every rank's).

It also checks what the search did find: ranks that disagree about the trainable parameters
when OSS re-partitions (``refresh_trainable``, ``add_param_group``, or at construction when
two layers of one shape are frozen on different ranks) used to hang, abort inside gloo, or
silently sync one parameter's values into another; they now get the same ValueError on
every rank, and training goes on once they agree.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.models import GPT, GPTConfig, MLP
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS, FusedAdamW, ShardedGradScaler
from shardkit.testing import world_fixture

STEPS = 6
LOCAL_BATCH = 3
WIDTH = 6
TOL = 1e-5          # fp32 against one process, every step, every rank
LOOSE_TOL = 5e-2    # bf16 autocast, 16-bit gradients or parameter sync
GPT_SHAPE = dict(vocab_size=24, n_layer=1, n_head=2, d_model=8, seq_len=6)

world2 = world_fixture(2)
world4 = world_fixture(4)


# ---------------------------------------------------------------------- models


class Net(nn.Module):
    """The matrix's models behind one ``forward(x, use_branch)``."""

    def __init__(self, kind: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.kind = kind
        if kind in ("gpt", "tied"):
            self.core = GPT(GPTConfig(**GPT_SHAPE, tie_weights=kind == "tied"), seed=seed)
            # the key bias's gradient is zero in exact arithmetic (softmax is shift invariant);
            # Adam-like optimizers would amplify its rounding noise into whole steps
            self.core.blocks[0].attn.qkv.bias.requires_grad_(False)
        elif kind == "tiny":  # two parameters: fewer than the ranks at world 4
            self.core = nn.Linear(WIDTH, 4)
        elif kind == "odd":
            self.core = nn.Sequential(nn.Linear(WIDTH, 7), nn.GELU(), nn.Linear(7, 5), nn.GELU(),
                                      nn.Linear(5, 4))
            self.scale = nn.Parameter(torch.full((1,), 0.9))
        elif kind == "bn":  # no bias before BatchNorm: its gradient is zero in exact arithmetic
            self.core = nn.Sequential(nn.Linear(WIDTH, 8, bias=False), nn.BatchNorm1d(8),
                                      nn.GELU(), nn.Linear(8, 4))
        elif kind == "reuse":  # one module applied twice per forward
            self.a = nn.Linear(WIDTH, WIDTH)
            self.b = nn.Linear(WIDTH, 4)
        else:  # mlp, frozen, unused_step, unused_rank
            self.core = MLP(WIDTH, depth=2, out=4, seed=seed)
        if kind in ("unused_step", "unused_rank"):
            self.branch = nn.Linear(WIDTH, 4)
        if kind == "frozen":
            self.core[0].requires_grad_(False)

    def forward(self, x, use_branch=False):
        if self.kind in ("gpt", "tied"):
            return self.core(x)
        if self.kind == "reuse":
            return self.b(F.gelu(self.a(F.gelu(self.a(x)))))
        out = self.core(x)
        if self.kind == "odd":
            out = out * self.scale
        if use_branch:
            out = out + self.branch(x)
        return out

    def layer_to_toggle(self) -> nn.Module:
        """Frozen, then trainable again, mid-run."""
        if self.kind in ("gpt", "tied"):
            return self.core.blocks[0].fc
        if self.kind == "reuse":
            return self.a
        return self.core[2] if self.kind == "frozen" else self.core[0]

    def layer_added_later(self) -> nn.Module:
        """Given to the optimizer by ``add_param_group`` mid-run."""
        if self.kind in ("gpt", "tied"):
            return self.core.ln_f
        return self.b if self.kind == "reuse" else self.core[-1]


def _uses_branch(kind: str, step: int, rank: int, micro: int) -> bool:
    if kind == "unused_step":  # unused in some steps and some micro-batches
        return (step + micro) % 2 == 0
    if kind == "unused_rank":  # used on rank 0 only, and not in every step
        return rank == 0 and step % 3 != 2
    return False


def _batch(kind: str, step: int, micro: int, world: int):
    gen = torch.Generator().manual_seed(1000 + 17 * step + micro)
    n = LOCAL_BATCH * world
    if kind in ("gpt", "tied"):
        shape = (n, GPT_SHAPE["seq_len"])
        return (torch.randint(0, GPT_SHAPE["vocab_size"], shape, generator=gen),
                torch.randint(0, GPT_SHAPE["vocab_size"], shape, generator=gen))
    return torch.randn(n, WIDTH, generator=gen), torch.randn(n, 4, generator=gen)


def _loss(kind: str, out, y):
    if kind in ("gpt", "tied"):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
    return F.mse_loss(out.float(), y)


# ---------------------------------------------------------------------- optimizers

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05)),
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True,
                                           weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.05)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.005, momentum=0.5)),
    "fused_adamw": (FusedAdamW, dict(lr=0.01, weight_decay=0.05)),
    # one closure call per step on every rank: each rank's LBFGS decides on its own shard
    # when to call it again, and the closure's collectives must line up (documented)
    "lbfgs": (torch.optim.LBFGS, dict(lr=0.5, max_iter=1, history_size=4)),
}


def _groups(net: Net, cfg: dict, exclude=()) -> list[dict]:
    """One group, or weights and the rest (half the learning rate, no weight decay)."""
    skip = {id(p) for p in exclude}
    named = [(n, p) for n, p in net.named_parameters() if id(p) not in skip]
    if not cfg.get("two_groups"):
        return [{"params": [p for _, p in named]}]
    hyper = OPTIMIZERS[cfg["opt"]][1]
    rest = {"params": [p for n, p in named if not n.endswith("weight")], "lr": hyper["lr"] / 2}
    if "weight_decay" in hyper:
        rest["weight_decay"] = 0.0
    return [{"params": [p for n, p in named if n.endswith("weight")]}, rest]


def _scheduler(kind, optimizer):
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return None


class _OSSPair:
    """Two OSS over the two param groups, driven as one (ShardedDDP takes the list)."""

    def __init__(self, parts):
        self.parts = parts

    @property
    def param_groups(self):
        return [g for o in self.parts for g in o.param_groups]

    def step(self):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)


def _build_oss(cfg: dict, net: Net, exclude: list):
    optim, hyper = OPTIMIZERS[cfg["opt"]]
    kwargs = dict(bucket_numel=cfg.get("bucket_numel"))
    if cfg.get("two_oss"):
        return _OSSPair([OSS([g], optim=optim, **kwargs, **hyper)
                         for g in _groups(net, cfg, exclude)])
    if cfg.get("late_takeover"):  # a plain optimizer first; OSS(it) takes over mid-run
        return optim(_groups(net, cfg, exclude), **hyper)
    if cfg.get("takeover"):
        opt = OSS(optim(_groups(net, cfg, exclude), **hyper), **kwargs)
        opt.broadcast_fp16 = cfg.get("broadcast_fp16", False)  # assignable, as in FairScale
        return opt
    return OSS(_groups(net, cfg, exclude), optim=optim,
               broadcast_fp16=cfg.get("broadcast_fp16", False), **kwargs, **hyper)


def _wrap(cfg: dict, net: Net, opt):
    if cfg["mode"] == "ddp":
        return DDP(net, find_unused_parameters=cfg.get("find_unused", False),
                   broadcast_buffers=cfg.get("broadcast_buffers", True))
    if cfg["mode"] == "sdp":
        return ShardedDataParallel(
            net, opt.parts if cfg.get("two_oss") else opt,
            reduce_buffer_size=cfg.get("reduce_buffer_size", 2 ** 23),
            reduce_fp16=cfg.get("reduce_fp16", False),
            broadcast_buffers=cfg.get("broadcast_buffers", True),
            auto_refresh_trainable=cfg.get("auto_refresh", True),
            step_in_backward=cfg.get("step_in_backward", False))
    return net  # OSS alone: gradients all-reduced by hand


# ---------------------------------------------------------------------- the two trainings


def _average_grads_by_hand(net: Net) -> None:
    """What DDP does, spelled out: a gradient no rank has stays None."""
    world = distributed.get_world_size()
    for p in net.parameters():
        if not p.requires_grad:
            continue
        present = torch.tensor([float(p.grad is not None)])
        distributed.all_reduce(present)
        if present.item():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            distributed.all_reduce(grad)
            p.grad = grad.div_(world)


def _set_trainable(nets, layer_of, flag: bool) -> None:
    for net in nets:
        for p in layer_of(net).parameters():
            p.requires_grad_(flag)
            if not flag:  # a torch optimizer would step a frozen parameter that kept a grad
                p.grad = None


def _round_trip(cfg: dict, opt, ref_opt, out: dict):
    """consolidate -> state_dict (compared with the oracle's) -> loaded back, through a plain
    torch optimizer, or into a new OSS."""
    recipient = cfg.get("recipient", 0)
    opt.consolidate_state_dict(recipient)
    sd = opt.state_dict() if recipient in (-1, distributed.get_rank()) else None
    if recipient != -1:
        sd = distributed.broadcast_object(sd, src=recipient)
    out["state_vs_oracle"] = _state_difference(sd, ref_opt.state_dict())
    optim, hyper = OPTIMIZERS[cfg["opt"]]
    groups = [{**g, "params": list(g["params"])} for g in opt.param_groups]
    if cfg["round_trip"] == "plain":
        plain = optim(groups)
        plain.load_state_dict(sd)
        sd = plain.state_dict()
    if cfg["round_trip"] == "new":
        opt = OSS(groups, optim=optim, broadcast_fp16=cfg.get("broadcast_fp16", False),
                  **hyper)
    opt.load_state_dict(sd)
    return opt


def _state_difference(sd: dict, ref: dict) -> float:
    """Largest relative difference of the optimizer state tensors, and the groups' lrs."""
    assert [g["lr"] for g in sd["param_groups"]] == [g["lr"] for g in ref["param_groups"]]
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in ref["param_groups"]]
    assert set(sd["state"]) <= set(ref["state"]), (sorted(sd["state"]), sorted(ref["state"]))
    worst = 0.0
    for key, state in sd["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value) and value.numel():
                want = ref["state"][key][name].float()
                worst = max(worst, float((value.float() - want).abs().max()
                                         / (1e-3 + want.abs().max())))
    return worst


def _max_diff(a, b) -> float:
    return max((float((x.detach().float() - y.detach().float()).abs().max())
                for x, y in zip(a, b) if x.numel()), default=0.0)


def _train_against_oracle(cfg: dict) -> dict:
    """Train ``cfg``'s wrapper and one process side by side; per step, the largest parameter
    and loss differences on this rank (and rank 0's buffers)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    kind, mode, micro = cfg["model"], cfg["mode"], cfg.get("micro", 1)
    optim, hyper = OPTIMIZERS[cfg["opt"]]
    oracle, net = Net(kind, cfg.get("seed", 0)), Net(kind, cfg.get("seed", 0))
    added_at = cfg.get("add_group_at")
    later_o = list(oracle.layer_added_later().parameters()) if added_at else []
    later_n = list(net.layer_added_later().parameters()) if added_at else []
    if added_at and mode != "ddp":  # frozen until added (DDP: trainable, not in the optimizer,
        _set_trainable([oracle, net], Net.layer_added_later, False)  # as it reduces those only)
    ref_opt = (torch.optim.AdamW if optim is FusedAdamW else optim)(
        _groups(oracle, cfg, later_o), **hyper)
    opt = _build_oss(cfg, net, later_n)
    wrapped = _wrap(cfg, net, opt)
    sched, ref_sched = _scheduler(cfg.get("sched"), opt), _scheduler(cfg.get("sched"), ref_opt)
    scaler = ref_scaler = None
    if cfg.get("scaler"):
        scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    set_to_none = cfg.get("set_to_none", True)
    out = {"params": [], "loss": [], "buffers": []}
    for step in range(STEPS):
        toggle = cfg.get("toggle_at")
        if toggle is not None and step in (toggle, toggle + 2):
            _set_trainable([oracle, net], Net.layer_to_toggle, step != toggle)
            if mode != "sdp":
                opt.refresh_trainable()
            elif not cfg.get("auto_refresh", True):
                wrapped.refresh_trainable()
        if step == added_at:
            _set_trainable([oracle, net], Net.layer_added_later, True)
            ref_opt.add_param_group({"params": later_o, "lr": hyper["lr"] * 2})
            opt.add_param_group({"params": later_n, "lr": hyper["lr"] * 2})
            if mode == "sdp" and not cfg.get("auto_refresh", True):
                wrapped.refresh_trainable()
        if cfg.get("late_takeover") and step == 2:
            opt = OSS(opt, bucket_numel=cfg.get("bucket_numel"))
        if step == cfg.get("round_trip_at"):
            opt = _round_trip(cfg, opt, ref_opt, out)
        overflow = scaler is not None and step == 2  # inf on the last rank only
        zero_now = not cfg.get("accumulate") or step % 2 == 1

        expected = _oracle_step(cfg, oracle, ref_opt, ref_scaler, step, overflow, zero_now)
        if ref_sched:
            ref_sched.step()

        local = 0.0

        def forward_backward():
            nonlocal local
            if cfg["opt"] == "lbfgs":
                net.zero_grad(set_to_none=True)
            for m in range(micro):
                x, y = _batch(kind, step, m, world)
                mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
                reduce_now = m == micro - 1 and not cfg.get("reduce_api")
                accumulate = wrapped.no_sync() if mode != "manual" and not reduce_now \
                    else _nothing()
                with accumulate:
                    with _autocast(cfg):
                        loss = _loss(kind, wrapped(x[mine], _uses_branch(kind, step, rank, m)),
                                     y[mine]) / micro
                    if overflow and rank == world - 1 and m == micro - 1:
                        loss = loss * math.inf
                    (scaler.scale(loss) if scaler else loss).backward()
                local += loss.item() if math.isfinite(loss.item()) else 0.0
            if mode == "manual":
                _average_grads_by_hand(net)
            if cfg.get("reduce_api"):  # FairScale's manual reduction after no_sync()
                wrapped.reduce()
            return torch.tensor(local)

        if cfg["opt"] == "lbfgs":
            opt.step(forward_backward)
        else:
            forward_backward()
            _clip_and_step(cfg, opt, scaler)
        if sched:
            sched.step()
        if zero_now:
            if mode == "sdp" and step % 3 == 0:
                wrapped.zero_grad(set_to_none=set_to_none)
            else:
                opt.zero_grad(set_to_none=set_to_none)
        if cfg.get("step_in_backward"):  # the sync is left in flight for the next forward
            opt.wait_for_sync()
        if cfg.get("eval_between"):
            with torch.no_grad():
                wrapped.eval()
                wrapped(_batch(kind, step, 9, world)[0][:LOCAL_BATCH])
                wrapped.train()
        total = torch.tensor([local])
        distributed.all_reduce(total)
        out["loss"].append(abs(total.item() / world - expected))
        out["params"].append(_max_diff(net.parameters(), oracle.parameters()))
        if rank == 0:
            out["buffers"].append(_max_diff(net.buffers(), oracle.buffers()))
    out["final"] = [p.detach().clone() for p in net.parameters()]
    out["lrs"] = ([g["lr"] for g in opt.param_groups], [g["lr"] for g in ref_opt.param_groups])
    if scaler:
        out["scales"] = (scaler.get_scale(), ref_scaler.get_scale())
    return out


def _oracle_step(cfg, oracle, ref_opt, ref_scaler, step, overflow, zero_now) -> float:
    """One process: every rank's micro-batches in turn, averaged; returns the loss."""
    kind, micro, world = cfg["model"], cfg.get("micro", 1), distributed.get_world_size()
    total = 0.0
    for m in range(micro):
        x, y = _batch(kind, step, m, world)
        after_rank0 = None
        for r in range(world):
            rows = slice(r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)
            with _autocast(cfg):
                loss = _loss(kind, oracle(x[rows], _uses_branch(kind, step, r, m)), y[rows])
            loss = loss / (micro * world)
            if overflow and r == world - 1 and m == micro - 1:
                loss = loss * math.inf
            (ref_scaler.scale(loss) if ref_scaler else loss).backward()
            total += loss.item() if math.isfinite(loss.item()) else 0.0
            if r == 0:
                after_rank0 = [b.clone() for b in oracle.buffers()]
        with torch.no_grad():  # the buffers every rank gets from rank 0 at the next forward
            for b, saved in zip(oracle.buffers(), after_rank0):
                b.copy_(saved)
    if cfg["opt"] == "lbfgs":
        return total  # LBFGS steps on each rank's shard alone (documented): no oracle step
    if ref_scaler and cfg.get("clip"):
        ref_scaler.unscale_(ref_opt)
    if cfg.get("clip"):
        torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]],
                                       *cfg["clip"])
    if ref_scaler:
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    else:
        ref_opt.step()
    if zero_now:
        ref_opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
    return total


def _clip_and_step(cfg: dict, opt, scaler) -> None:
    if scaler and cfg.get("clip"):
        scaler.unscale_(opt)
    if cfg.get("clip") and isinstance(opt, OSS):
        opt.clip_grad_norm(*cfg["clip"])
    elif cfg.get("clip"):  # the plain optimizer before OSS takes it over
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                       *cfg["clip"])
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def _autocast(cfg: dict):
    return torch.autocast("cpu", dtype=torch.bfloat16) if cfg.get("scaler") else _nothing()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------- the fixed sample

INF = float("inf")
SAMPLE = {
    "ddp_mlp_nesterov_schedule_clip_accumulate3": dict(
        mode="ddp", model="mlp", opt="sgd_nesterov", two_groups=True, sched="step",
        clip=(0.05, 2.0), micro=3),
    "ddp_unused_on_rank0_only_adamw_takeover_plain_round_trip": dict(
        mode="ddp", model="unused_rank", opt="adamw", find_unused=True, takeover=True,
        round_trip_at=3, round_trip="plain", recipient=-1, set_to_none=False),
    "ddp_batchnorm_adam_new_oss_round_trip": dict(
        mode="ddp", model="bn", opt="adam", round_trip_at=3, round_trip="new", recipient=1,
        bucket_numel=7),
    "ddp_tied_fused_adamw_late_takeover_clip_inf": dict(
        mode="ddp", model="tied", opt="fused_adamw", late_takeover=True, clip=(0.02, INF),
        eval_between=True),
    "sharded_gpt_adamw_no_buckets_freeze_unfreeze": dict(
        mode="sdp", model="gpt", opt="adamw", reduce_buffer_size=0, micro=3, toggle_at=1,
        clip=(0.02, INF), two_groups=True),
    "sharded_reuse_adagrad_explicit_refresh_add_group": dict(
        mode="sdp", model="reuse", opt="adagrad", reduce_buffer_size=64, auto_refresh=False,
        add_group_at=3, two_groups=True),
    "sharded_odd_rmsprop_manual_reduce_small_sync_buckets": dict(
        mode="sdp", model="odd", opt="rmsprop", reduce_api=True, micro=2, bucket_numel=7,
        set_to_none=False, round_trip_at=3, round_trip="inplace", recipient=0),
    "sharded_frozen_sgd_momentum_two_oss_freeze_unfreeze": dict(
        mode="sdp", model="frozen", opt="sgd_momentum", two_oss=True, two_groups=True,
        eval_between=True, toggle_at=2),
    "sharded_unused_steps_adam_step_in_backward_accumulate": dict(
        mode="sdp", model="unused_step", opt="adam", step_in_backward=True, bucket_numel=24,
        accumulate=True, micro=2),
    "sharded_batchnorm_sgd_no_buffer_broadcast_lambda_schedule": dict(
        mode="sdp", model="bn", opt="sgd", broadcast_buffers=False, sched="lambda",
        reduce_buffer_size=64, accumulate=True),
    "oss_tiny_adam_lambda_schedule_round_trip_everywhere": dict(
        mode="manual", model="tiny", opt="adam", sched="lambda", round_trip_at=3,
        round_trip="inplace", recipient=-1),
    "oss_gpt_sgd_momentum_add_group_new_round_trip": dict(
        mode="manual", model="gpt", opt="sgd_momentum", add_group_at=2, round_trip_at=3,
        round_trip="new", recipient=0, two_groups=True),
    "oss_mlp_lbfgs_closure": dict(mode="manual", model="mlp", opt="lbfgs"),
    # 16-bit paths: parity within LOOSE_TOL
    "sharded_mlp_adamw_bf16_autocast_sharded_scaler_clip": dict(
        mode="sdp", model="mlp", opt="adamw", scaler=True, clip=(0.05, 2.0), two_groups=True),
    "sharded_tied_sgd_fp16_reduce_and_broadcast": dict(
        mode="sdp", model="tied", opt="sgd", reduce_fp16=True, broadcast_fp16=True,
        reduce_buffer_size=1024),
}


def _check_sample(name: str, results: list) -> None:
    cfg = SAMPLE[name]
    sixteen_bit = cfg.get("scaler") or cfg.get("reduce_fp16") or cfg.get("broadcast_fp16")
    tol = LOOSE_TOL if sixteen_bit else TOL
    if cfg["opt"] != "lbfgs":  # LBFGS: every rank's curvature is its shard's (documented)
        for rank, out in enumerate(results):
            assert max(out["params"]) <= tol, (name, rank, out["params"])
            assert max(out["loss"]) <= 10 * tol, (name, rank, out["loss"])
            assert out["lrs"][0] == out["lrs"][1], (name, rank, out["lrs"])
            assert out.get("state_vs_oracle", 0.0) <= 10 * tol, (name, rank, out)
            if "scales" in out:
                assert out["scales"][0] == out["scales"][1], (name, rank, out["scales"])
        if cfg["model"] == "bn":
            assert max(results[0]["buffers"]) <= 1e-4, (name, results[0]["buffers"])
    if not cfg.get("broadcast_fp16"):  # every rank holds the same model
        for rank, out in enumerate(results[1:], start=1):
            assert _max_diff(out["final"], results[0]["final"]) == 0.0, (name, rank)


def _run_sample(names: list) -> dict:
    return {name: _train_against_oracle(SAMPLE[name]) for name in names}


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_fixed_sample_of_the_option_matrix_matches_one_process(world, request):
    results = request.getfixturevalue(world).run(_run_sample, sorted(SAMPLE))
    for name in sorted(SAMPLE):
        _check_sample(name, [per_rank[name] for per_rank in results])


# ---------------------------------------------------------------------- ranks that disagree


def _same_width_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))


def _error_of(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _ranks_disagreeing_on_trainable_parameters() -> dict:
    """Each case used to hang, abort in gloo, or mix parameters up silently."""
    rank = distributed.get_rank()
    out = {}

    # construction: one layer of the same width frozen on each rank (shapes alone agree)
    model = _same_width_layers()
    model[rank % 2].weight.requires_grad_(False)
    out["construction"] = _error_of(lambda: OSS(model.parameters(), lr=0.1))

    # refresh_trainable after freezing different same-shape layers (used to copy one layer's
    # values into another on the other ranks, silently)
    model = _same_width_layers()
    opt = OSS(model.parameters(), lr=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    model[rank % 2].weight.requires_grad_(False)
    out["refresh_same_shapes"] = _error_of(opt.refresh_trainable)

    # refresh_trainable where only rank 0 froze (used to hang in the state exchange)
    model[rank % 2].weight.requires_grad_(True)
    if rank == 0:
        model[2].bias.requires_grad_(False)
    out["refresh_rank0_only"] = _error_of(opt.refresh_trainable)
    model[2].bias.requires_grad_(True)

    # add_param_group with a differently shaped parameter on each rank (used to abort a rank
    # inside gloo while the other returned)
    extra = nn.Linear(3 + rank, 3)
    out["add_param_group"] = _error_of(lambda: opt.add_param_group({"params": extra.weight}))
    out["groups_after"] = len(opt.param_groups)

    # once every rank agrees again, OSS trains on, nothing having changed
    opt.refresh_trainable()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    out["moved"] = _max_diff(before, model.parameters())  # lr 0
    return out


def test_ranks_that_disagree_on_trainable_parameters_get_one_clear_error(world2):
    results = world2.run(_ranks_disagreeing_on_trainable_parameters)
    for rank, out in enumerate(results):
        assert "OSS: rank" in out["construction"] and \
            "item 0 of param group 0 is trainable on rank 1 and frozen on rank 0" in \
            out["construction"] and "same parameters frozen" in out["construction"], out
        assert out["refresh_same_shapes"].startswith("OSS.refresh_trainable: rank") and \
            "item 0 of param group 0 is trainable on rank 1 and frozen on rank 0" in \
            out["refresh_same_shapes"], out
        assert out["refresh_rank0_only"].startswith("OSS.refresh_trainable: rank") and \
            "item 5 of param group 0 is trainable on rank 1 and frozen" in \
            out["refresh_rank0_only"], out
        assert out["add_param_group"].startswith("OSS.add_param_group: rank") and \
            "trainable parameter 0 of param group 1 has shape" in out["add_param_group"] and \
            "(3, 3)" in out["add_param_group"] and "(3, 4)" in out["add_param_group"], out
        assert out["groups_after"] == 1, out  # nothing half-added
        assert out["moved"] == 0.0, out
