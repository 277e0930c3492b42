"""FSDP against one process over a matrix of models, wrappings and options.

Every case trains a small model under FullyShardedDataParallel on each rank's slice of the
global batch, and the same model in one process on every slice (loss / (N x micro-batches)
summed, as data parallelism computes it), step by step; it compares the loss, every parameter
(``summon_full_params``) and the clipped norm at every step, and at the end the optimizer
state (``gather_full_optim_state_dict``) and that no unit is left gathered. Half-way through,
a case may move training into a freshly wrapped model: by ``state_dict`` and the gathered
optimizer state, by ``local_state_dict``, or from the single-process model and its optimizer's
own state dict.

fp32 cases match within 1e-5. Mixed-precision cases (bf16 compute, fp32 master) are compared
with a single-process oracle that computes in a bf16 copy of the model and steps fp32 masters:
the two differ only in the order bf16 gradients are summed (reduce-scatter vs. one process's
accumulation), so their distance must stay within a few times the distance between that oracle
and fp32 training, measured in the same run (``_MP_NOISE_FACTOR``).

SAMPLE covers every model, wrapping, option and round trip at least once; the focused tests
below it are regressions of bugs the randomized matrix found. One world of 2 and one of 4
(two simulated nodes, for HYBRID_SHARD) serve the whole module.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.models import GPT, MLP, Block, GPTConfig, synthetic_batch
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import (auto_wrap, default_auto_wrap_policy, enable_wrap,
                              transformer_auto_wrap_policy)
from shardkit.optim import FusedAdamW
from shardkit.testing import World, world_fixture

GLOBAL_BATCH = 12  # slices of 6 (world 2) and 3 (world 4); micro-batches of 1, 2 or 3 rows
WIDTH = 7
STEPS = 4
FP32_TOL = 1e-5
_MP_NOISE_FACTOR = 4.0
_MP_FLOOR = 1e-3


# ---------------------------------------------------------------------------- models


class OddSizes(nn.Module):
    """Parameters of sizes not divisible by N, a 1-element one and a 0-dim one."""

    def __init__(self):
        super().__init__()
        self.scalar = nn.Parameter(torch.tensor(1.3))
        self.one = nn.Parameter(torch.tensor([0.7]))
        self.a = nn.Linear(WIDTH, 5)
        self.b = nn.Linear(5, 3)
        self.c = nn.Linear(3, 1)

    def forward(self, x):
        h = self.b(torch.tanh(self.a(x)) * self.scalar) + self.one
        return self.c(torch.tanh(h))


class UsedTwice(nn.Module):
    """One block called twice in each forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(WIDTH, 6)
        self.shared = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.out = nn.Linear(6, 1)

    def forward(self, x):
        h = self.shared(self.inp(x))
        return self.out(self.shared(h) + h)


class PartlyFrozen(nn.Module):
    """Frozen and trainable parameters in one unit (l1, l2), and whole frozen layers (first,
    which backward never reaches, and mid, which it passes through)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(WIDTH, 6)
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 6)
        self.l3 = nn.Linear(6, 1)
        for p in (self.l1.bias, self.l2.weight, *self.first.parameters(),
                  *self.mid.parameters()):
            p.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.l1(torch.tanh(self.first(x))))
        return self.l3(torch.tanh(self.mid(torch.tanh(self.l2(h)))))


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(WIDTH, 6, bias=False)  # a bias before BatchNorm gets no gradient
        self.bn = nn.BatchNorm1d(6)
        self.l2 = nn.Linear(6, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


class TiedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


GPT_CFG = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=8, seq_len=5)
_SMALL = {"odd": OddSizes, "twice": UsedTwice, "frozen": PartlyFrozen, "bn": WithBatchNorm,
          "tied": TiedEmbedding}
_BLOCKS = {"mlp": {nn.Linear}, "gpt": {Block}, "gpt_tied": {Block}, "tied": {nn.Linear},
           "twice": {nn.Sequential}, "frozen": {nn.Linear}, "bn": {nn.BatchNorm1d},
           "odd": {nn.Linear}}
_BY_HAND = {"mlp": ("0", "2"), "tied": ("mid",), "twice": ("shared",),
            "frozen": ("l2", "mid"), "bn": ("bn", "l1"), "odd": ("b",)}


def build(kind: str) -> nn.Module:
    if kind == "mlp":
        return MLP(width=WIDTH, depth=3, out=1, seed=1)
    if kind in ("gpt", "gpt_tied"):
        return GPT(GPTConfig(**{**GPT_CFG.__dict__, "tie_weights": kind == "gpt_tied"}), seed=2)
    model = _SMALL[kind]()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def wrap(kind: str, model: nn.Module, wrapping: str, kw: dict, inner_kw: dict) -> FSDP:
    """``root``: one unit; ``hand``: the submodules of _BY_HAND (GPT: each block and its
    attention) as units with ``inner_kw``; ``default`` / ``transformer``: auto_wrap."""
    if wrapping == "hand" and kind in ("gpt", "gpt_tied"):
        for i, block in enumerate(model.blocks):
            block.attn = FSDP(block.attn, **inner_kw)
            model.blocks[i] = FSDP(block, **inner_kw)
    elif wrapping == "hand":
        for name in _BY_HAND[kind]:
            setattr(model, name, FSDP(getattr(model, name), **inner_kw))
    elif wrapping in ("default", "transformer"):
        policy = functools.partial(default_auto_wrap_policy, min_num_params=20) \
            if wrapping == "default" else transformer_auto_wrap_policy(_BLOCKS[kind])
        with enable_wrap(wrapper_cls=FSDP, **kw):
            model = auto_wrap(model, policy)
    return model if isinstance(model, FSDP) else FSDP(model, **kw)


# ---------------------------------------------------------------------------- one case


def make_optim(name: str, params, groups: bool = False):
    params = [p for p in params if p.requires_grad]
    if groups:  # weight decay on matrices only (torch numbers the state in group order)
        params = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    cls = torch.optim.AdamW if name == "adamw" else FusedAdamW
    return cls(params, lr=1e-2, eps=1e-4, weight_decay=0.01)


def batch(kind: str, step: int):
    if kind in ("gpt", "gpt_tied"):
        return synthetic_batch(GPT_CFG, GLOBAL_BATCH, step)
    gen = torch.Generator().manual_seed(100 + step)
    if kind == "tied":
        return (torch.randint(0, 11, (GLOBAL_BATCH, 3), generator=gen),
                torch.randint(0, 11, (GLOBAL_BATCH, 3), generator=gen))
    return (torch.randn(GLOBAL_BATCH, WIDTH, generator=gen),
            torch.randn(GLOBAL_BATCH, 1, generator=gen))


def loss_of(kind: str, model, x, y) -> torch.Tensor:
    out = model(x).float()
    if kind in ("gpt", "gpt_tied", "tied"):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def rank_slice(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


def reference_step(case, model, optim, step: int, n: int):
    """One process: every rank's micro-batches, each loss / (N x micro); under mixed precision
    the forward/backward run in a bf16 copy, whose gradients step the fp32 model."""
    x, y = batch(case["model"], step)
    compute = copy.deepcopy(model).to(torch.bfloat16) if case.get("mp") else model
    total = 0.0
    for r in range(n):
        for xm, ym in zip(rank_slice(x, n, r).chunk(case["micro"]),
                          rank_slice(y, n, r).chunk(case["micro"])):
            if case.get("mp") and xm.is_floating_point():
                xm = xm.to(torch.bfloat16)
            loss = loss_of(case["model"], compute, xm, ym) / (n * case["micro"])
            loss.backward()
            total += loss.item()
    if compute is not model:
        for p, c in zip(model.parameters(), compute.parameters()):
            p.grad = None if c.grad is None else c.grad.float()
    norm = None
    if case.get("clip"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), *case["clip"]).item()
    optim.step()
    optim.zero_grad()
    return total, norm


def fsdp_step(case, model, optim, step: int):
    """This rank's slice; micro-batches accumulate inside ``no_sync()`` (or plainly, with
    ``accumulate="plain"``); returns the mean loss over ranks and the clipped norm."""
    n, r = skdist.get_world_size(), skdist.get_rank()
    x, y = batch(case["model"], step)
    chunks = list(zip(rank_slice(x, n, r).chunk(case["micro"]),
                      rank_slice(y, n, r).chunk(case["micro"])))
    total = 0.0
    for i, (xm, ym) in enumerate(chunks):
        last = i == len(chunks) - 1
        with model.no_sync() if not last and case.get("accumulate") != "plain" else _nothing():
            loss = loss_of(case["model"], model, xm, ym) / case["micro"]
            loss.backward()
        total += loss.item()
    mean = torch.tensor([total])
    skdist.all_reduce(mean)
    norm = model.clip_grad_norm_(*case["clip"]).item() if case.get("clip") else None
    optim.step()
    optim.zero_grad()
    return mean.item() / n, norm


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fsdp_kwargs(case) -> tuple[dict, dict]:
    """(root and auto-wrapped units' kwargs, hand-nested units' kwargs)."""
    kw = dict(case.get("fsdp", {}))
    if case.get("mp"):
        kw.update(mixed_precision=True, compute_dtype=torch.bfloat16)
    inner = dict(kw)
    if case.get("inner_no_shard"):
        inner.pop("reshard_after_forward", None)
        inner["sharding_strategy"] = "NO_SHARD"
    return kw, inner


def resume_in_fresh_model(case, model, optim, ref, ref_optim):
    """Continue training in a newly wrapped model, loaded as ``case["state"]`` says."""
    kind, how = case["model"], case["state"]
    kw, inner = fsdp_kwargs(case)
    fresh = wrap(kind, build(kind), case["wrapping"], kw, inner)
    if how == "local":
        fresh.load_local_state_dict(model.local_state_dict())
        osd = optim.state_dict()
    elif how == "full":
        fresh.load_state_dict(model.state_dict())
        box = [model.gather_full_optim_state_dict(optim)]  # rank 0's, as a checkpoint holds it
        dist.broadcast_object_list(box, src=0)
        osd = fresh.get_shard_from_optim_state_dict(box[0])
    else:  # "from_ref": the single-process model and its optimizer's own state dict
        fresh.load_state_dict(ref.state_dict())
        osd = fresh.get_shard_from_optim_state_dict(ref_optim.state_dict())
    fresh_optim = make_optim(case["optim"], fresh.parameters(), case.get("groups", False))
    fresh_optim.load_state_dict(osd)
    return fresh, fresh_optim


def optimizer_state_diff(model, optim, ref, ref_optim) -> float:
    """Largest difference between the gathered optimizer state and the single process's, by
    parameter name (on the recipient, rank 0; 0 elsewhere); shapes must agree."""
    full = model.gather_full_optim_state_dict(optim)
    if full is None:
        return 0.0
    name_of = {id(p): n for n, p in ref.named_parameters()}
    ref_names = [name_of[id(p)] for g in ref_optim.param_groups for p in g["params"]]
    expected = {ref_names[i]: s for i, s in ref_optim.state_dict()["state"].items()}
    got = {full["param_names"][i]: s for i, s in full["state"].items()}
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    worst = 0.0
    for name, state in expected.items():
        for key, value in state.items():
            assert tuple(got[name][key].shape) == tuple(value.shape), (name, key)
            worst = max(worst, (got[name][key].float() - value.float()).abs().max().item())
    return worst


def run_case(case) -> dict:
    """Worst differences over the steps (this rank): loss, parameters, norm, optimizer state,
    evaluation output; for mixed precision also ``bf16_noise`` (bf16 oracle vs fp32 run)."""
    n = skdist.get_world_size()
    kind = case["model"]
    ref = build(kind)
    ref_optim = make_optim(case["optim"], ref.parameters(), case.get("groups", False))
    fp32 = build(kind) if case.get("mp") else None
    fp32_optim = make_optim(case["optim"], fp32.parameters(), case.get("groups", False)) \
        if fp32 is not None else None
    kw, inner = fsdp_kwargs(case)
    model = wrap(kind, build(kind), case["wrapping"], kw, inner)
    optim = make_optim(case["optim"], model.parameters(), case.get("groups", False))
    worst = dict.fromkeys(("loss", "param", "norm", "bf16_noise"), 0.0)
    for step in range(STEPS):
        if case.get("state") and step == STEPS // 2:
            model, optim = resume_in_fresh_model(case, model, optim, ref, ref_optim)
        ref_loss, ref_norm = reference_step(case, ref, ref_optim, step, n)
        if fp32 is not None:
            reference_step({**case, "mp": False}, fp32, fp32_optim, step, n)
        loss, norm = fsdp_step(case, model, optim, step)
        worst["loss"] = max(worst["loss"], abs(loss - ref_loss))
        if norm is not None:
            worst["norm"] = max(worst["norm"], abs(norm - ref_norm) / max(ref_norm, 1.0))
        with model.summon_full_params():
            mine = {k: v.detach().clone() for k, v in model.named_parameters()}
        for name, p in ref.named_parameters():
            worst["param"] = max(worst["param"], (mine[name] - p.detach()).abs().max().item())
            if fp32 is not None:
                noise = (p.detach() - dict(fp32.named_parameters())[name]).abs().max().item()
                worst["bf16_noise"] = max(worst["bf16_noise"], noise)
    worst["optim"] = optimizer_state_diff(model, optim, ref, ref_optim)
    worst["gathered_after_steps"] = sum(u._shard.gathered for u in model.sharded_units()
                                        if u._shard is not None)
    return worst


def run_cases(cases) -> list[dict]:
    return [run_case(case) for case in cases]


def check(case, every_rank: list[dict]) -> None:
    worst = {k: max(r[k] for r in every_rank) for k in every_rank[0]}
    assert worst["gathered_after_steps"] == 0, (case, worst)
    if case.get("mp"):
        bound = max(_MP_NOISE_FACTOR * worst["bf16_noise"], _MP_FLOOR)
        assert worst["param"] <= bound, (case, worst)
        assert worst["optim"] <= 10 * bound, (case, worst)  # moments: squares of gradients
        return
    for key in ("loss", "param", "norm", "optim"):
        assert worst[key] <= FP32_TOL, (key, case, worst)


def run_and_check(world, cases) -> None:
    results = world.run(run_cases, cases)
    for i, case in enumerate(cases):
        check(case, [results[r][i] for r in range(world.world_size)])


# ---------------------------------------------------------------------------- the sample

FULL, GRAD_OP = "FULL_SHARD", "SHARD_GRAD_OP"
# every model, wrapping and option at least once (fsdp = constructor kwargs)
SAMPLE_2 = [
    dict(model="mlp", wrapping="root", fsdp={}, micro=1, optim="sgd"),
    dict(model="gpt", wrapping="transformer", fsdp={"reshard_after_forward": True}, micro=2,
         clip=(0.1, 2.0), optim="adamw", state="full"),
    dict(model="gpt_tied", wrapping="default", fsdp={"sharding_strategy": GRAD_OP}, micro=1,
         clip=(0.1, float("inf")), optim="fused", state="local"),
    dict(model="tied", wrapping="hand", fsdp={"reshard_after_forward": False}, micro=3,
         optim="fused", state="from_ref"),
    dict(model="twice", wrapping="hand", fsdp={"sharding_strategy": "NO_SHARD"}, micro=2,
         accumulate="plain", optim="sgd", state="full"),
    dict(model="bn", wrapping="transformer", fsdp={"move_params_to_cpu": True}, micro=1,
         clip=(0.1, 1.0), optim="adamw", state="local"),
    dict(model="frozen", wrapping="hand", fsdp={"reshard_after_forward": False}, micro=1,
         optim="adamw", state="full"),
    dict(model="gpt", wrapping="hand", fsdp={}, mp=True, micro=1, clip=(0.1, 2.0),
         optim="sgd", state="full"),
    dict(model="mlp", wrapping="default", fsdp={"fp32_reduce_scatter": True}, mp=True,
         micro=2, optim="adamw"),
    dict(model="odd", wrapping="root", fsdp={"sharding_strategy": FULL}, micro=1,
         optim="fused", state="full"),
]
SAMPLE_4 = [
    dict(model="gpt", wrapping="transformer", fsdp={"sharding_strategy": "HYBRID_SHARD"},
         micro=1, clip=(0.1, 2.0), optim="adamw", state="full"),
    dict(model="odd", wrapping="hand", fsdp={"sharding_strategy": "HYBRID_SHARD"}, micro=3,
         optim="fused", state="local"),
    dict(model="frozen", wrapping="hand", fsdp={}, inner_no_shard=True, micro=1, optim="sgd",
         state="from_ref"),
]

world2 = world_fixture(2)


@pytest.fixture(scope="module")
def world4():
    with World(4, ranks_per_node=2) as w:  # two simulated nodes: HYBRID_SHARD replicates
        yield w


def test_sample_matches_one_process_world2(world2):
    run_and_check(world2, SAMPLE_2)


def test_sample_matches_one_process_world4(world4):
    run_and_check(world4, SAMPLE_4)


# ---------------------------------------------------------------------------- regressions


def _zero_dim_step_stays_0dim():
    """The optimizer state of a 0-dim parameter cut for this rank keeps Adam's ``step``
    0-dim (it was cut like the parameter, to shape (1,)), so FusedAdamW loads it."""
    model = FSDP(OddSizes())
    optim = FusedAdamW(model.parameters(), lr=1e-2)
    loss_of("odd", model, *(t[:2] for t in batch("odd", 0))).backward()
    optim.step()
    box = [model.gather_full_optim_state_dict(optim)]
    dist.broadcast_object_list(box, src=0)
    index = [n for n, _ in model.named_parameters()].index("scalar")
    cut = model.get_shard_from_optim_state_dict(box[0])["state"][index]
    fresh = FusedAdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(model.get_shard_from_optim_state_dict(box[0]))
    loss_of("odd", model, *(t[:2] for t in batch("odd", 1))).backward()
    fresh.step()  # raised "output with shape [] doesn't match the broadcast shape [1]"
    return {"step": tuple(cut["step"].shape), "exp_avg": tuple(cut["exp_avg"].shape)}


def test_zero_dim_parameter_optimizer_state_round_trip(world2):
    for shapes in world2.run(_zero_dim_step_stays_0dim):
        assert shapes == {"step": (), "exp_avg": (1,)}
    # and training continues identically after the round trip, under FusedAdamW
    run_and_check(world2, [dict(model="odd", wrapping="hand", fsdp={}, micro=2,
                                optim="fused", state="full")])


def test_single_process_optimizer_state_by_shape(world2, world4):
    """A torch optimizer's own state dict (no names) is cut by matching indices to
    parameters: before the fix a frozen parameter of the same shape took a trainable one's
    index (wrong cut when their units shard differently: the first step raised "size of tensor
    a (3) must match ... (6)"), and a 0-dim parameter's state was not matched by shape (with
    param groups: "state 'exp_avg' of parameter 4 has shape ()"), and param groups that
    regroup parameters matched each state to the first parameter of its shape."""
    frozen = dict(model="frozen", wrapping="hand", fsdp={}, inner_no_shard=True, micro=1,
                  optim="sgd", state="from_ref")
    groups = dict(model="odd", wrapping="default", fsdp={}, micro=1, optim="adamw",
                  groups=True, state="from_ref")
    # weight decay on matrices only: blocks' fc.weight (a NO_SHARD unit) has the shape of the
    # root's embedding and head, and took one of their cuts ("(16) must match ... (32)")
    regrouped = dict(model="gpt", wrapping="hand", fsdp={}, inner_no_shard=True, micro=1,
                     optim="sgd", groups=True, state="from_ref")
    run_and_check(world2, [frozen, {**frozen, "optim": "adamw"}, groups, regrouped])
    run_and_check(world4, [{**groups, "optim": "fused"}])
