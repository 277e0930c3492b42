"""Combinations of FSDP's sharding strategies, hpZ, ZeRO++ quantization, mixed precision, offload,
gradient accumulation, clipping and state dicts on one world of 4 labelled as 2 nodes x 2 ranks.

Kept from a randomized matrix (several hundred drawn cases): parity with
single-process training on every rank at every step for the lossless paths; for qwZ / qgZ the
error bounds the int8 / int4 block scaling gives (gathered weights within the largest weight's
``absmax / 254``; reduced gradients within ``2 x sum over ranks of absmax / 14``, the
hierarchical bound); CommCounter's bytes per op and per link at the documented formulas; per-rank
model-state bytes at ``16Ψ/|shard group|``; and quantization on NO_SHARD refused before any
collective.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.distributed import CommCounter
from shardkit.kernels import QuantLayout
from shardkit.models import MLP, Block, CausalSelfAttention, GPT, GPTConfig, synthetic_batch
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.flat_param import shard_rows
from shardkit.nn.data_parallel.sharding_strategy import ShardingStrategy as S
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.quantized_transport import QuantizedTransport
from shardkit.testing import World
from shardkit.utils.memory import model_state_bytes

GPT_CFG = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=9, tie_weights=True)
BATCH, WIDTH, STEPS = 8, 40, 3


@pytest.fixture(scope="module")
def nodes2x2():
    with World(4, ranks_per_node=2) as w:
        yield w


class Branchy(nn.Module):
    """Three Linears; ``b`` runs only on even ranks when ``rank_dependent`` (its gradient on the
    odd ranks counts as zero, as the single-process oracle computes per slice)."""

    def __init__(self, rank_dependent: bool):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.rank_dependent = rank_dependent
        self.as_rank = None  # the oracle's slice

    def forward(self, x):
        h = torch.tanh(self.a(x))
        rank = skdist.get_rank() if self.as_rank is None else self.as_rank
        if not self.rank_dependent or rank % 2 == 0:
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def build(kind: str) -> nn.Module:
    if kind == "mlp":
        return MLP(WIDTH, 3, seed=2)
    if kind == "branchy":
        return Branchy(rank_dependent=True)
    model = GPT(GPT_CFG, seed=3)  # tied embedding and head
    if kind == "gpt_frozen":
        model.blocks[0].ln1.weight.requires_grad_(False)
        model.blocks[1].attn.qkv.bias.requires_grad_(False)
    return model


def batch(kind: str, step: int):
    if kind.startswith("gpt"):
        return synthetic_batch(GPT_CFG, BATCH, step)
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def loss_of(model, kind: str, x, y):
    return model.loss(x, y) if kind.startswith("gpt") else F.mse_loss(model(x), y)


def oracle_loss(model, kind: str, x, y):
    """The global batch's loss as the 4 ranks see it: the mean of the slices' losses."""
    per = BATCH // 4
    total = 0.0
    for r in range(4):
        if kind == "branchy":
            model.as_rank = r
        total = total + loss_of(model, kind, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per])
    return total / 4


POLICIES = {"linear": {nn.Linear}, "blocks": {Block}, "nested": {Block, CausalSelfAttention}}


def wrap(kind: str, wrapping: str, **kwargs) -> FSDP:
    module = build(kind)
    if wrapping == "root":
        return FSDP(module, **kwargs)
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        policy = transformer_auto_wrap_policy(POLICIES[wrapping])
        return FSDP(auto_wrap(module, policy), **kwargs)


def optimizer(kind: str, params):
    params = [p for p in params if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4, weight_decay=0.01)


def owner_rank(model: FSDP, p) -> int:
    """This rank's place in the shard group of the unit that owns ``p``."""
    return next(u.rank for u in model.sharded_units()
                if u._shard is not None and any(q is p for q in u._shard.params))


def rows_diff(model: FSDP, expected: dict, of_grads: bool = False) -> float:
    layouts = model._param_layouts()
    worst = 0.0
    for name, p in model.named_parameters():
        mine = p.grad if of_grads else p
        if mine is None:
            continue
        want = shard_rows(expected[name].detach(), layouts[id(p)], owner_rank(model, p))
        worst = max(worst, (mine.detach() - want).abs().max().item())
    return worst


# (name, model, wrapping, FSDP kwargs, optimizer, mode, clip, state-dict round trip)
# mode: "no_sync" (2 micro-batches, the first under no_sync), "accumulate" (2 backwards that
# each reduce), "double" (two forwards, one backward), "eval" (a no_grad forward, then as
# "accumulate")
LOSSLESS = [
    ("hybrid_frozen_nosync_clip", "gpt_frozen", "nested", {"sharding_strategy": S.HYBRID_SHARD},
     "adamw", "no_sync", 0.05, True),
    ("hybrid_zero2_branch_double", "branchy", "root",
     {"sharding_strategy": S._HYBRID_SHARD_ZERO2, "move_params_to_cpu": True}, "sgd", "double",
     None, True),
    ("hpz_eval_accumulate", "gpt", "blocks", {"hpz_partition_size": 2}, "adamw", "accumulate",
     0.05, True),
    ("hpz_whole_group_linear", "mlp", "linear", {"hpz_partition_size": 4}, "sgd", "eval", None,
     False),
    ("shard_grad_op_double", "gpt", "linear", {"sharding_strategy": S.SHARD_GRAD_OP}, "adamw",
     "double", None, True),
    ("no_shard_nested_clip", "gpt_frozen", "nested", {"sharding_strategy": S.NO_SHARD}, "sgd",
     "accumulate", 0.05, True),
    ("full_root_branch_nosync", "branchy", "root", {}, "adamw", "no_sync", 0.05, False),
]


def _local_step(model, kind, x, y, mode) -> float:
    r, per = skdist.get_rank(), BATCH // 4
    xs, ys = x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]
    if mode == "eval":
        with torch.no_grad():
            loss_of(model, kind, xs, ys)
    if mode == "double":
        half = per // 2
        loss = (loss_of(model, kind, xs[:half], ys[:half])
                + loss_of(model, kind, xs[half:], ys[half:])) / 2
        loss.backward()
        return loss.item()
    total = 0.0
    for i, (mx, my) in enumerate(zip(xs.chunk(2), ys.chunk(2))):
        quiet = mode == "no_sync" and i == 0
        with model.no_sync() if quiet else torch.enable_grad():
            loss = loss_of(model, kind, mx, my) / 2
            loss.backward()
        total += loss.item()
    return total


def _lossless_parity():
    out = {}
    for name, kind, wrapping, kwargs, optim_kind, mode, clip, round_trip in LOSSLESS:
        reference = build(kind)
        ref_optim = optimizer(optim_kind, reference.parameters())
        model = wrap(kind, wrapping, **kwargs)
        optim = optimizer(optim_kind, model.parameters())
        worst = {"shards": 0.0, "loss": 0.0, "norm": 0.0}
        for step in range(STEPS):
            x, y = batch(kind, step)
            ref_loss = oracle_loss(reference, kind, x, y)
            ref_loss.backward()
            ref_norm = clip and torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            ref_optim.step()
            ref_optim.zero_grad()
            loss = torch.tensor([_local_step(model, kind, x, y, mode)])
            norm = clip and model.clip_grad_norm_(clip)
            optim.step()
            optim.zero_grad()
            skdist.all_reduce(loss)
            worst["loss"] = max(worst["loss"], abs(loss.item() / 4 - ref_loss.item()))
            if clip:
                worst["norm"] = max(worst["norm"], abs(float(norm) - float(ref_norm)))
            worst["shards"] = max(worst["shards"],
                                  rows_diff(model, dict(reference.named_parameters())))
        if round_trip:
            full = model.state_dict()
            worst["state_dict"] = max((full[k] - v).abs().max().item()
                                      for k, v in reference.state_dict().items())
            fresh = wrap(kind, wrapping, **kwargs)
            fresh.load_state_dict(full)
            worst["reloaded"] = max((fresh.state_dict()[k] - v).abs().max().item()
                                    for k, v in full.items())
        out[name] = worst
    return out


def test_lossless_combinations_match_one_process_every_rank_every_step(nodes2x2):
    for rank, results in enumerate(nodes2x2.run(_lossless_parity)):
        for name, worst in results.items():
            assert max(worst.values()) <= 1e-5, (rank, name, worst)


QUANTIZED = [  # (name, model, wrapping, FSDP kwargs): one step's weights and gradients
    ("qw_hybrid_nested", "gpt", "nested",
     {"sharding_strategy": S.HYBRID_SHARD, "quantize_weights": True}),
    ("qw_hpz_root", "branchy", "root", {"hpz_partition_size": 2, "quantize_weights": True}),
    ("qg_full_hierarchical", "gpt_frozen", "blocks", {"quantize_gradients": True}),
    ("qg_hybrid_zero2_in_node", "branchy", "root",
     {"sharding_strategy": S._HYBRID_SHARD_ZERO2, "quantize_gradients": True}),
    ("qg_hpz_linear", "mlp", "linear", {"hpz_partition_size": 2, "quantize_gradients": True}),
]


def _gathered_weights(model: FSDP) -> dict:
    """Record, once per parameter, the values each submodule computes with (gathered)."""
    seen = {}
    for module_name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and not isinstance(module, FSDP):
            def record(m, args, out, prefix=module_name, names=own):
                for n in names:
                    seen.setdefault(f"{prefix}.{n}", getattr(m, n).detach().float().clone())
            module.register_forward_hook(record)
    return seen


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "_fsdp_wrapped_module")


def _quantized_within_bounds():
    out = {}
    r, per = skdist.get_rank(), BATCH // 4
    for name, kind, wrapping, kwargs in QUANTIZED:
        reference = build(kind)
        x, y = batch(kind, 0)
        slices = []  # each rank's share of the gradient (its loss / 4), as the oracle sees it
        for rank in range(4):
            reference.zero_grad(set_to_none=False)
            if kind == "branchy":
                reference.as_rank = rank
            (loss_of(reference, kind, x[rank * per:(rank + 1) * per],
                     y[rank * per:(rank + 1) * per]) / 4).backward()
            slices.append({n: p.grad.clone() for n, p in reference.named_parameters()
                           if p.grad is not None})
        grad = {n: sum(s[n] for s in slices) for n in slices[0]}
        weights = dict(reference.named_parameters(remove_duplicate=False))
        model = wrap(kind, wrapping, **kwargs)
        seen = _gathered_weights(model)
        loss_of(model, kind, x[r * per:(r + 1) * per], y[r * per:(r + 1) * per]).backward()
        weight_bound = max(p.abs().max().item() for p in reference.parameters()) / 254
        weight_err = max((v - weights[_clean(n)]).abs().max().item() for n, v in seen.items())
        grad_bound = 2 * sum(max(g.abs().max().item() for g in s.values()) for s in slices) / 14
        result = {"weight_ratio": weight_err / (weight_bound + 1e-6)}
        if not kwargs.get("quantize_weights"):  # gradients at the exact weights
            result["grad_ratio"] = rows_diff(model, grad, of_grads=True) / (grad_bound + 1e-7)
        out[name] = result
    return out


def test_quantized_paths_within_their_block_scaling_bounds(nodes2x2):
    for rank, results in enumerate(nodes2x2.run(_quantized_within_bounds)):
        for name, r in results.items():
            assert r["weight_ratio"] <= 1.0, (rank, name, r)
            assert r.get("grad_ratio", 0.0) <= 1.0, (rank, name, r)
            if "qw" in name:  # the gathers really were quantized
                assert r["weight_ratio"] > 0.01, (rank, name, r)
            else:
                assert r["weight_ratio"] < 1e-3 and r["grad_ratio"] > 1e-3, (rank, name, r)


W, DEPTH = 48, 4  # every Linear its own unit (2352 elements), the root owns nothing
COSTS = {
    "full": {}, "hybrid": {"sharding_strategy": S.HYBRID_SHARD},
    "hybrid_zero2_bf16": {"sharding_strategy": S._HYBRID_SHARD_ZERO2, "mixed_precision": True,
                          "compute_dtype": torch.bfloat16},
    "no_shard": {"sharding_strategy": S.NO_SHARD}, "hpz": {"hpz_partition_size": 2},
    "zeropp": {"hpz_partition_size": 2, "quantize_weights": True, "quantize_gradients": True},
    "hybrid_qg": {"sharding_strategy": S.HYBRID_SHARD, "quantize_gradients": True},
}


def _bytes_and_memory():
    out = {}
    x = torch.randn(4, W)
    for name, kwargs in COSTS.items():
        model = FSDP(auto_wrap(MLP(W, DEPTH, seed=1), transformer_auto_wrap_policy({nn.Linear}),
                               **kwargs), **kwargs)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # the second step: orders recorded
            with CommCounter() as comm:
                model(x).pow(2).mean().backward()
                optim.step()
                optim.zero_grad()
        split = {}
        for call in comm.calls:
            key = f"{call.op} {'inter' if call.spans_nodes else 'intra'} {call.dtype}"
            split[key] = split.get(key, 0.0) + call.bytes
        state = model_state_bytes(model, optim)
        out[name] = {"split": split, "params": state.params, "optimizer": state.optimizer}
    return out


def _expected_bytes(u: int, units: int = DEPTH):
    """Per step per rank, from DESIGN.md's ring convention, for ``units`` units of ``u``
    elements at 2 nodes x 2 ranks (side values: use counts, flag, tag: ``(P+2)(N-1)`` elements
    per unit in the reduce-scatter and in NO_SHARD's / the replicas' all-reduce)."""
    def seg(numel, bits):
        return QuantLayout(1, (numel,), bits).segment_bytes
    f32 = "torch.float32"
    side = 4  # P + 2, P = 2 tensors per Linear
    return {
        "full": {f"all_gather inter {f32}": units * 2 * 3 / 4 * u * 4,
                 f"reduce_scatter inter {f32}": units * (3 / 4 * u + 3 * side) * 4},
        "hybrid": {f"all_gather intra {f32}": units * 2 * 1 / 2 * u * 4,
                   f"reduce_scatter intra {f32}": units * (1 / 2 * u + side) * 4,
                   f"all_reduce inter {f32}": units * 2 * 1 / 2 * (u / 2 + side) * 4},
        "hybrid_zero2_bf16": {"all_gather intra torch.bfloat16": units * 1 / 2 * u * 2,
                              "reduce_scatter intra torch.bfloat16": units * (u / 2 + side) * 2,
                              "all_reduce inter torch.bfloat16": units * (u / 2 + side) * 2},
        "no_shard": {f"all_reduce inter {f32}": units * 2 * 3 / 4 * (u + side) * 4},
        "hpz": {f"all_gather inter {f32}": units * 3 / 4 * u * 4,
                f"all_gather intra {f32}": units * 1 / 2 * u * 4,
                f"reduce_scatter inter {f32}": units * (3 / 4 * u + 3 * side) * 4},
        # int8 forward gathers across the 4; the backward gather in the node stays lossless
        # (the forward's dequantized weights); int4 gradients in the node, then across nodes
        "zeropp": {"all_gather inter torch.uint8": units * 3 * seg(u // 4, 8),
                   f"all_gather intra {f32}": units * 1 / 2 * u * 4,
                   "reduce_scatter intra torch.uint8": units * 1 / 2 * 4 * seg(u // 4, 4),
                   "reduce_scatter inter torch.uint8": units * seg(u // 4, 4),
                   f"reduce_scatter inter {f32}": units * 3 * side * 4},
        "hybrid_qg": {f"all_gather intra {f32}": units * 2 * 1 / 2 * u * 4,
                      "reduce_scatter intra torch.uint8": units * seg(u // 2, 4),
                      f"reduce_scatter intra {f32}": units * side * 4,
                      f"all_reduce inter {f32}": units * (u / 2 + side) * 4},
    }


def test_bytes_per_op_and_link_and_model_state_at_the_formulas(nodes2x2):
    u = W * W + W
    psi = DEPTH * u
    expected = _expected_bytes(u)
    shard_sizes = {"full": 4, "hybrid": 2, "hybrid_zero2_bf16": 2, "no_shard": 1, "hpz": 4,
                   "zeropp": 4, "hybrid_qg": 2}
    for rank, results in enumerate(nodes2x2.run(_bytes_and_memory)):
        for name, r in results.items():
            measured = {k: v for k, v in r["split"].items() if v}
            assert measured.keys() == expected[name].keys(), (rank, name, measured)
            for key, want in expected[name].items():
                assert measured[key] == pytest.approx(want, rel=0.05), (rank, name, key)
            n = shard_sizes[name]  # fp32 Adam: 4Ψ/n weights, 8Ψ/n state (+ step counters)
            assert r["params"] == 4 * psi // n, (rank, name, r)
            assert r["optimizer"] == pytest.approx(8 * psi / n, rel=0.01), (rank, name, r)


def _quantizing_no_shard_is_refused():
    out = {}
    for options in ({"quantize_weights": True}, {"quantize_gradients": True},
                    {"quantize_weights": True, "quantize_gradients": True}):
        with CommCounter() as comm:
            try:
                FSDP(MLP(8, 1), sharding_strategy=S.NO_SHARD, **options)
                out[str(options)] = "no error"
            except ValueError as e:
                out[str(options)] = str(e)
        out[str(options) + " calls"] = len(comm.calls)
    with CommCounter() as comm:  # the same through a quantizing comm= of the user's own
        try:
            FSDP(MLP(8, 1), sharding_strategy=S.NO_SHARD,
                 comm=QuantizedTransport(weights=False, gradients=True))
            out["comm"] = "no error"
        except ValueError as e:
            out["comm"] = str(e)
    out["comm calls"] = len(comm.calls)
    return out


def test_quantization_on_no_shard_is_a_clear_error_before_any_collective(nodes2x2):
    # before: accepted and silently ignored (NO_SHARD's all-reduce moved 56,544 fp32 bytes per
    # step for the 4-Linear MLP either way)
    for results in nodes2x2.run(_quantizing_no_shard_is_refused):
        for options, message in results.items():
            if options.endswith("calls"):
                assert message == 0, results
                continue
            assert "sharding_strategy=NO_SHARD" in message, message
            if options == "comm":
                assert "comm=QuantizedTransport" in message, message
                continue
            for name in ("quantize_weights", "quantize_gradients"):
                assert (f"{name}=True" in message) == (name in options), message
            assert "FULL_SHARD" in message and "HYBRID_SHARD" in message, message


def _quantizing_hybrid_over_shard_groups_of_one():
    """HYBRID_SHARD over a (4, 1) mesh (one rank per shard group, like one rank per node)
    with qwZ + qgZ: nothing is quantized (its gradient all-reduce across the replicas is
    exact), which is now said once; over the (2, 2) mesh the options compress and nothing is
    said. Before: silence, and every byte in full precision."""
    import warnings
    from torch.distributed.device_mesh import init_device_mesh
    out = {}
    for shape in ((2, 2), (4, 1)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = FSDP(MLP(WIDTH, 1, seed=1), sharding_strategy=S.HYBRID_SHARD,
                         device_mesh=mesh, quantize_weights=True, quantize_gradients=True)
        with CommCounter() as comm:
            model(torch.randn(2, WIDTH)).pow(2).mean().backward()
        out[shape] = {"warnings": [str(w.message) for w in caught
                                   if "shard group has one rank" in str(w.message)],
                      "uint8": sum(c.bytes for c in comm.calls if c.dtype == torch.uint8)}
    return out


def test_quantizing_hybrid_over_shard_groups_of_one_rank_warns(nodes2x2):
    for r in nodes2x2.run(_quantizing_hybrid_over_shard_groups_of_one):
        assert r[(2, 2)]["warnings"] == [] and r[(2, 2)]["uint8"] > 0, r
        assert r[(4, 1)]["uint8"] == 0, r
        [message] = r[(4, 1)]["warnings"]
        assert "sharding_strategy=HYBRID_SHARD" in message, message
        assert "quantize_weights=True, quantize_gradients=True" in message, message
