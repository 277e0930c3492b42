"""FSDP's sharding strategies and hpZ on a world of 4 labelled as 2 nodes x 2 ranks: parity with
single-process training on every rank at every step, inter-node elements per step at the
formulas of shardkit.nn.data_parallel.sharding_strategy, state dicts across strategies, and
clear errors. tests/cluster/two_node_checks.py runs the hybrid and hpZ checks on real nodes."""

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.distributed import CommCounter
from shardkit.models import GPT, MLP
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.sharding_strategy import ShardingStrategy
from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
from shardkit.testing import World
from tests.nn.fsdp_common import (TINY, build_gpt, make_optimizer, max_diff, shard_diff,
                                  train_step, wrap_gpt)

S = ShardingStrategy
STEPS = 4
WIDTH, DEPTH = 48, 8


@pytest.fixture(scope="module")
def nodes2x2():
    with World(4, ranks_per_node=2) as w:
        yield w


CONFIGS = [  # (name, FSDP kwargs, micro_batches with no_sync, clip)
    ("hybrid", {"sharding_strategy": S.HYBRID_SHARD}, 1, None),
    ("hybrid_pair_clip_no_sync", {"sharding_strategy": "HYBRID_SHARD", "pair": True}, 2, 0.05),
    ("hybrid_zero2", {"sharding_strategy": S._HYBRID_SHARD_ZERO2}, 1, 0.05),
    ("hybrid_2d_mesh", {"sharding_strategy": S.HYBRID_SHARD, "mesh": True}, 1, None),
    ("shard_grad_op", {"sharding_strategy": S.SHARD_GRAD_OP}, 1, None),
    ("no_shard", {"sharding_strategy": S.NO_SHARD}, 2, 0.05),
    ("hpz", {"hpz_partition_size": 2}, 1, 0.05),
    # blocks recomputed in backward: the recomputation gathers again, backward still works
    ("hpz_checkpointed", {"hpz_partition_size": 2, "checkpointed": True}, 1, None),
    ("hybrid_checkpointed", {"sharding_strategy": S.HYBRID_SHARD, "checkpointed": True}, 1,
     None),
]


_MESH = []


def _mesh_2x2():
    """torch's 2-D mesh (replicate across the 2 nodes, shard inside each), made once."""
    if not _MESH:
        from torch.distributed.device_mesh import init_device_mesh
        _MESH.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return _MESH[0]


def _parity(names=None):
    """Every configuration of CONFIGS (or those named): worst differences against the
    single-process reference over all steps."""
    out = {}
    for name, kwargs, micro, clip in CONFIGS:
        if names is not None and name not in names:
            continue
        kwargs = dict(kwargs)
        if kwargs.pop("pair", False):
            kwargs["process_group"] = skdist.node_groups()
        if kwargs.pop("mesh", False):
            kwargs["device_mesh"] = _mesh_2x2()
        reference = build_gpt()
        ref_optim = make_optimizer(reference)
        module = build_gpt()
        if kwargs.pop("checkpointed", False):
            for block in module.blocks:
                checkpoint_wrapper(block)
        model = wrap_gpt(module, **kwargs)
        optim = make_optimizer(model)
        worst = {"shards": 0.0, "loss": 0.0, "norm": 0.0}
        for step in range(STEPS):
            ref_loss, ref_norm = train_step(reference, ref_optim, step, micro_batches=micro,
                                            clip=clip, local=False)
            loss, norm = train_step(model, optim, step, micro_batches=micro, clip=clip,
                                    sync=model.no_sync)
            mean = torch.tensor([loss.item()])
            skdist.all_reduce(mean)
            worst["loss"] = max(worst["loss"], abs(mean.item() / 4 - ref_loss.item()))
            if clip is not None:
                worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()))
            worst["shards"] = max(worst["shards"], shard_diff(model, reference))
        worst["state_dict"] = max_diff(model.state_dict(), reference.state_dict())
        worst["world_size"] = model.world_size
        out[name] = worst
    return out


def test_parity_every_strategy_every_rank_every_step(nodes2x2):
    for rank, results in enumerate(nodes2x2.run(_parity)):
        for name, r in results.items():
            assert r["shards"] <= 1e-5 and r["state_dict"] <= 1e-5, (rank, name, r)
            assert r["loss"] <= 1e-5 and r["norm"] <= 1e-5, (rank, name, r)
        assert results["hybrid"]["world_size"] == 2, results  # sharded inside the node
        assert results["hybrid_2d_mesh"]["world_size"] == 2
        assert results["no_shard"]["world_size"] == 1
        assert results["hpz"]["world_size"] == 4


def _mlp(**kwargs) -> FSDP:
    """Every Linear a unit, the root owns nothing (so every unit reshards after forward)."""
    return FSDP(auto_wrap(MLP(WIDTH, DEPTH, seed=1), transformer_auto_wrap_policy({nn.Linear}),
                          **kwargs), **kwargs)


COST_CONFIGS = {
    "full_shard": {},
    "shard_grad_op": {"sharding_strategy": S.SHARD_GRAD_OP},
    "hybrid": {"sharding_strategy": S.HYBRID_SHARD},
    "hybrid_zero2": {"sharding_strategy": S._HYBRID_SHARD_ZERO2},
    "no_shard": {"sharding_strategy": S.NO_SHARD},
    "hpz": {"hpz_partition_size": 2},
    # ZeRO++ all together: int8 weight gathers, the backward gather inside the node, int4
    # gradients reduced inside the node first
    "zeropp": {"hpz_partition_size": 2, "quantize_weights": True, "quantize_gradients": True},
}


def _inter_node_per_step(names=None):
    """Per COST_CONFIGS entry (or those named): the second step's CommCounter split."""
    x = torch.randn(4, WIDTH)
    out = {}
    for name, kwargs in COST_CONFIGS.items():
        if names is not None and name not in names:
            continue
        model = _mlp(**kwargs)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(2):  # the first step records the order
            with CommCounter() as comm:
                model(x).pow(2).mean().backward()
                optim.step()
                optim.zero_grad()
        psi = sum(u.unit_numel for u in model.sharded_units())
        out[name] = {"inter": comm.inter_node_elements, "inter_bytes": comm.inter_node_bytes,
                     "intra_bytes": comm.intra_node_bytes, "psi": psi,
                     "by_op": comm.by_op}
    return out


def inter_node_formulas(m: float, n: int, k: int) -> dict:
    """Elements per step per rank on groups spanning nodes (issue 14's contract)."""
    nk = n * k
    return {"full_shard": 3 * m * (nk - 1) / nk, "shard_grad_op": 2 * m * (nk - 1) / nk,
            "hybrid": 2 * (m / n) * (k - 1) / k, "hybrid_zero2": 2 * (m / n) * (k - 1) / k,
            "no_shard": 2 * m * (nk - 1) / nk, "hpz": 2 * m * (nk - 1) / nk}


def test_inter_node_elements_at_the_formulas(nodes2x2):
    for rank, r in enumerate(nodes2x2.run(_inter_node_per_step)):
        expected = inter_node_formulas(r["full_shard"]["psi"], 2, 2)
        for name, formula in expected.items():
            assert r[name]["inter"] == pytest.approx(formula, rel=0.05), (rank, name, r[name])
        # issue 14: at 2 nodes x 2 ranks HYBRID puts <= 0.25x FULL_SHARD's bytes on spanning
        # groups (formula: 2/3 x 1/4 / (3/4) = 0.22x)
        assert r["hybrid"]["inter_bytes"] <= 0.25 * r["full_shard"]["inter_bytes"], r
        # hpZ moves the backward gather inside the node: intra-node bytes appear
        assert r["hpz"]["intra_bytes"] > 0 and r["full_shard"]["intra_bytes"] == 0, r
        # issue 15: qwZ + hpZ + qgZ <= 0.3x FULL_SHARD fp32's bytes on spanning groups (ZeRO++'s
        # formula: 0.25x; int8 forward gathers 0.25 x 3/4, no spanning backward gather, int4
        # gradients across nodes only after the in-node reduction: about 0.1x here)
        ratio = r["zeropp"]["inter_bytes"] / r["full_shard"]["inter_bytes"]
        assert 0.05 <= ratio <= 0.3, (rank, ratio, r["zeropp"])


def _local(model):
    return model.local_state_dict(), model.local_metadata_dict()


def _fresh() -> GPT:
    """Another initialisation than build_gpt()'s, so a load that did nothing would show."""
    model = GPT(TINY, seed=11)
    model.get_parameter("blocks.0.ln1.weight").requires_grad_(False)
    return model


def _checkpoints_across_strategies():
    reference = build_gpt()
    ref_optim = make_optimizer(reference)
    hybrid = wrap_gpt(build_gpt(), sharding_strategy=S.HYBRID_SHARD)
    optim = make_optimizer(hybrid)
    for step in range(2):
        train_step(reference, ref_optim, step, local=False)
        train_step(hybrid, optim, step)
    expected = reference.state_dict()
    out = {"hybrid_full": max_diff(hybrid.state_dict(), expected)}
    # every rank's local dicts (replicas' copies included) reshard into FULL_SHARD and back
    dicts, metas = zip(*skdist.all_gather_object(_local(hybrid)))
    out["replicas"] = sorted(m["replica"] for m in metas)
    full = wrap_gpt(_fresh(), sharding_strategy=S.FULL_SHARD)
    out["fresh_differs"] = max_diff(full.state_dict(), expected)
    full.load_local_state_dict(list(dicts), metadata=list(metas))
    out["hybrid_to_full"] = max_diff(full.state_dict(), expected)
    dicts, metas = zip(*skdist.all_gather_object(_local(full)))
    back = wrap_gpt(_fresh(), sharding_strategy=S.HYBRID_SHARD)
    back.load_local_state_dict(list(dicts), metadata=list(metas))
    out["full_to_hybrid"] = max_diff(back.state_dict(), expected)
    no_shard = wrap_gpt(_fresh(), sharding_strategy=S.NO_SHARD)
    no_shard.load_local_state_dict(list(dicts), metadata=list(metas))
    out["full_to_no_shard"] = max_diff(no_shard.state_dict(), expected)
    hpz = wrap_gpt(_fresh(), hpz_partition_size=2)
    hpz.load_state_dict(no_shard.state_dict())
    out["no_shard_full_dict_into_hpz"] = max_diff(hpz.state_dict(), expected)
    # a hybrid model's own local dict loads back without resharding
    back.load_local_state_dict(*_local(back))
    out["own_local"] = max_diff(back.state_dict(), expected)
    # the loaded FULL_SHARD model trains on in step with the hybrid one (the full optimizer
    # state is gathered inside each node, every rank its own recipient)
    full_optim = make_optimizer(full)
    full_optim.load_state_dict(full.get_shard_from_optim_state_dict(
        hybrid.gather_full_optim_state_dict(optim, recipient_rank=hybrid.rank)))
    train_step(hybrid, optim, 2)
    train_step(full, full_optim, 2)
    out["trained_on"] = max_diff(full.state_dict(), hybrid.state_dict())
    return out


def test_state_dicts_across_strategies(nodes2x2):
    for rank, r in enumerate(nodes2x2.run(_checkpoints_across_strategies)):
        assert r["fresh_differs"] > 1e-3, r
        assert r["replicas"] == [0, 0, 1, 1], r
        for key in ("hybrid_full", "hybrid_to_full", "full_to_hybrid", "full_to_no_shard",
                    "no_shard_full_dict_into_hpz", "own_local", "trained_on"):
            assert r[key] <= 1e-6, (rank, key, r)


def _errors():
    intra, inter = skdist.node_groups()
    cases = {
        "bad_name": dict(sharding_strategy="ZERO3"),
        "bad_type": dict(sharding_strategy=3),
        "conflict": dict(sharding_strategy=S.FULL_SHARD, reshard_after_forward=False),
        "pair_for_full": dict(sharding_strategy=S.FULL_SHARD, process_group=(intra, inter)),
        "hybrid_one_group": dict(sharding_strategy=S.HYBRID_SHARD, process_group=intra),
        "hybrid_same_group": dict(sharding_strategy=S.HYBRID_SHARD,
                                  process_group=(intra, intra)),
        "hpz_with_hybrid": dict(sharding_strategy=S.HYBRID_SHARD, hpz_partition_size=2),
        "hpz_not_dividing": dict(hpz_partition_size=3),
        "hpz_zero": dict(hpz_partition_size=0),
        "mesh_1d_for_hybrid": dict(sharding_strategy=S.HYBRID_SHARD,
                                   device_mesh=_mesh_2x2()["shard"]),
        "mesh_and_group": dict(sharding_strategy=S.HYBRID_SHARD, device_mesh=_mesh_2x2(),
                               process_group=(intra, inter)),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            FSDP(nn.Linear(4, 4), **kwargs)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def test_clear_errors_before_any_collective(nodes2x2):
    for r in nodes2x2.run(_errors):
        assert "sharding_strategy='ZERO3'" in r["bad_name"] and "HYBRID_SHARD" in r["bad_name"]
        assert "sharding_strategy=3" in r["bad_type"]
        assert "reshard_after_forward=False" in r["conflict"]
        assert "HYBRID_SHARD" in r["pair_for_full"]
        assert "pair" in r["hybrid_one_group"]
        assert "share only this rank" in r["hybrid_same_group"]
        assert "use FULL_SHARD" in r["hpz_with_hybrid"]
        assert "must divide" in r["hpz_not_dividing"]
        assert "(valid values: 1, 2, 4;" in r["hpz_not_dividing"], r  # before: none named
        assert "hpz_partition_size=0" in r["hpz_zero"]
        assert "expected a 2-D torch DeviceMesh (replicate, shard), got ndim=1; a 1-D mesh is " \
            "for FULL_SHARD" in r["mesh_1d_for_hybrid"]
        assert "not both" in r["mesh_and_group"]


def _pairs_that_form_no_grid():
    """Pairs each fine on its own rank that do not form one grid: shard groups of 3 and 1
    (every rank hung in FSDP's set-up), and replica groups joining different shards (replicas
    would average different shards)."""
    me = skdist.get_rank()

    def mine(blocks):
        groups = [skdist.new_group(list(b)) for b in blocks]  # on every rank, in one order
        return next(g for g, b in zip(groups, blocks) if me in b)

    cases = {"uneven": (mine([(0, 1, 2), (3,)]), mine([(0, 3), (1,), (2,)])),
             "crossed": (mine([(0, 1), (2, 3)]), mine([(0, 3), (1, 2)]))}
    out = {}
    for name, pair in cases.items():
        try:
            FSDP(nn.Linear(4, 4), sharding_strategy=S.HYBRID_SHARD, process_group=pair)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def test_pairs_that_form_no_grid_are_one_error_on_every_rank(nodes2x2):
    for r in nodes2x2.run(_pairs_that_form_no_grid):
        assert "do not form one grid" in r["uneven"], r
        assert "intra-node sizes [1, 3]" in r["uneven"], r
        assert "rank 0 (shard 0 of [0, 1]) is a replica of rank 3 (shard 1 of [2, 3])" \
            in r["crossed"], r


def _clip_with_mixed_strategies():
    """Units of another strategy than the root's (NO_SHARD or hybrid units under a FULL_SHARD
    root, FULL_SHARD units under a hybrid or NO_SHARD root): clip_grad_norm_ returns the
    single-process norm on every rank (each gradient element counted once)."""
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
    mine = x[2 * skdist.get_rank():2 * skdist.get_rank() + 2]
    reference = MLP(WIDTH, DEPTH, seed=1)
    reference(x).pow(2).mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    out = {}
    for root, inner in ((S.FULL_SHARD, S.NO_SHARD), (S.FULL_SHARD, S.HYBRID_SHARD),
                        (S.HYBRID_SHARD, S.FULL_SHARD), (S.NO_SHARD, S.FULL_SHARD)):
        model = FSDP(auto_wrap(MLP(WIDTH, DEPTH, seed=1),
                               transformer_auto_wrap_policy({nn.Linear}),
                               sharding_strategy=inner), sharding_strategy=root)
        model(mine).pow(2).mean().backward()
        out[(root.name, inner.name)] = abs(model.clip_grad_norm_(1e9).item() / expected - 1)
    out["experts"] = _experts_under_a_hybrid_root(mine)
    return out


def _experts_under_a_hybrid_root(x) -> float:
    """A hybrid root around one expert per rank (a unit over a group of one): the norm counts
    the root's gradient once and every rank's expert; before, each node counted its own experts
    only, and the replicas clipped the same gradient differently. Relative error."""
    expert_group = [skdist.new_group([r]) for r in range(4)][skdist.get_rank()]
    torch.manual_seed(skdist.get_rank())
    model = FSDP(nn.Sequential(nn.Linear(WIDTH, WIDTH),
                               FSDP(nn.Linear(WIDTH, 4), process_group=expert_group)),
                 sharding_strategy=S.HYBRID_SHARD)
    model(x).pow(2).mean().backward()
    squares = {}
    for name, unit, group in (("root", model, model.process_group),
                              ("expert", model.module[1], None)):
        total = torch.tensor([sum(p.grad.pow(2).sum().item() for p in unit.params)])
        skdist.all_reduce(total, group=group)  # root: its rows; experts: every rank's own
        squares[name] = total.item()
    expected = (squares["root"] + squares["expert"]) ** 0.5
    return abs(model.clip_grad_norm_(1e9).item() / expected - 1)


def test_clip_grad_norm_with_units_of_mixed_strategies(nodes2x2):
    for r in nodes2x2.run(_clip_with_mixed_strategies):
        assert max(r.values()) <= 1e-4, r  # relative error (before the fix: 0.2 to 1.0)


def _torch_strategy_enum():
    """torch FSDP1 users pass torch's own ShardingStrategy members: each resolves by name to
    shardkit's strategy, with its groups (shard inside the node, replicate across nodes)."""
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    out = {}
    for name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP", "NO_SHARD"):
        unit = FSDP(nn.Linear(4, 4), sharding_strategy=TorchStrategy[name])
        replicas = None if unit.replicate_group is None else \
            skdist.get_world_size(unit.replicate_group)
        out[name] = (unit.sharding_strategy.name, unit.world_size, replicas,
                     unit.reshard_after_forward)
    return out


def test_torch_sharding_strategy_members_are_accepted(nodes2x2):
    for r in nodes2x2.run(_torch_strategy_enum):
        assert r["HYBRID_SHARD"] == ("HYBRID_SHARD", 2, 2, True), r
        assert r["_HYBRID_SHARD_ZERO2"] == ("_HYBRID_SHARD_ZERO2", 2, 2, False), r
        assert r["SHARD_GRAD_OP"] == ("SHARD_GRAD_OP", 4, None, False), r
        assert r["NO_SHARD"] == ("NO_SHARD", 1, 4, False), r


def _initialize_with_hpz():
    """``zero_optimization.zero_hpz_partition_size=2`` at stage 3 against the same config
    without it: the same parameters every step, fewer elements on spanning groups."""
    import shardkit
    from shardkit.models import synthetic_batch

    def config(**zero):
        return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-4}},
                "zero_optimization": {"stage": 3, **zero}}

    engines = [shardkit.initialize(model=GPT(TINY, seed=0), config=config(**zero))[0]
               for zero in ({}, {"zero_hpz_partition_size": 2})]
    worst, inter = 0.0, []
    for step in range(3):
        idx, target = synthetic_batch(TINY, 8, step)
        mine = slice(2 * skdist.get_rank(), 2 * skdist.get_rank() + 2)
        for engine in engines:
            with CommCounter() as comm:
                engine.backward(engine.module.loss(idx[mine], target[mine]))
                engine.step()
            inter.append(comm.inter_node_elements)
        plain, hpz = (e.wrapped for e in engines)
        worst = max(worst, max((a - b).abs().max().item() for a, b in
                               zip(plain.parameters(), hpz.parameters())))
    hpz_units = {u.hpz_partition_size for u in engines[1].wrapped.sharded_units()}
    return {"worst": worst, "plain_inter": inter[-2], "hpz_inter": inter[-1],
            "hpz_units": hpz_units}


def test_initialize_zero_hpz_partition_size(nodes2x2):
    for r in nodes2x2.run(_initialize_with_hpz):
        assert r["hpz_units"] == {2}, r
        assert r["worst"] <= 1e-6, r
        assert r["hpz_inter"] < 0.8 * r["plain_inter"], r


def _hpz_secondary_lifetime():
    """hpZ keeps Ψ_u/2 per resharded unit from forward to backward, nothing else."""
    model = _mlp(hpz_partition_size=2)
    units = [u for u in model.sharded_units() if u._shard is not None]
    x = torch.randn(4, WIDTH)

    def kept():
        return sum(u._shard._secondary.numel() for u in units
                   if u._shard._secondary is not None)

    with torch.no_grad():
        model(x)
    after_no_grad = kept()
    out = model(x)
    after_forward = kept()
    extra = sum(t.numel() for u in units for cat, t in u.model_state_tensors()
                if cat == "params" and t is u._shard._secondary)
    out.pow(2).mean().backward()
    return {"no_grad": after_no_grad, "forward": after_forward, "counted": extra,
            "backward": kept(), "expected": sum(u.unit_numel for u in units) // 2}


def test_hpz_secondary_partition_lives_from_forward_to_backward(nodes2x2):
    for r in nodes2x2.run(_hpz_secondary_lifetime):
        assert r["no_grad"] == 0 and r["backward"] == 0, r
        assert r["forward"] == r["counted"] == r["expected"], r


def _quantized_hpz_backward_weights():
    """qwZ + hpZ: the weights autograd saved in forward and the ones backward gathers from the
    secondary partition are the same bits (a second quantization, in other blocks, would move
    them by up to half a block scale); the backward gather inside the node moves fp32."""
    torch.manual_seed(0)
    inner = nn.Linear(300, 300, bias=False)
    with torch.no_grad():  # magnitudes that vary across rows and columns: blocks matter
        inner.weight.mul_(torch.logspace(-2, 1, 300).view(300, 1) * torch.logspace(0, 1, 300))
    options = {"quantize_weights": True, "hpz_partition_size": 2}
    model = FSDP(nn.Sequential(FSDP(inner, **options)), **options)
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(skdist.get_rank()))
    diffs = []

    def pack(t):
        return t, (t.detach().clone() if t.shape == (300, 300) else None)

    def unpack(packed):
        t, saved = packed
        if saved is not None:
            diffs.append((t - saved).abs().max().item())
        return t

    with CommCounter() as comm:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = model(x.requires_grad_())
        out.pow(2).sum().backward()
    gathers = [(str(c.dtype), c.group_size) for c in comm.calls if c.op == "all_gather"]
    return {"diffs": diffs, "gathers": gathers}


def test_quantized_hpz_backward_uses_the_forward_weights(nodes2x2):
    for r in nodes2x2.run(_quantized_hpz_backward_weights):
        assert r["diffs"] and max(r["diffs"]) == 0.0, r
        # forward: int8 blocks over all 4 ranks; backward: exact fp32 inside the node
        assert r["gathers"] == [("torch.uint8", 4), ("torch.float32", 2)], r


def _hpz_over_the_whole_group():
    """hpz_partition_size = world size: the secondary partition is the whole gather (backward
    gathers over the world again from it): still on, and still in step."""
    reference = build_gpt()
    ref_optim = make_optimizer(reference)
    model = wrap_gpt(build_gpt(), hpz_partition_size=4)
    optim = make_optimizer(model)
    for step in range(2):
        train_step(reference, ref_optim, step, local=False)
        train_step(model, optim, step)
    groups = {skdist.group_ranks(u._shard.hpz_group) == [0, 1, 2, 3]
              for u in model.sharded_units() if u._shard is not None}
    return {"diff": shard_diff(model, reference), "hpz_on": groups}


def test_hpz_partition_of_the_whole_group(nodes2x2):
    for r in nodes2x2.run(_hpz_over_the_whole_group):
        assert r["hpz_on"] == {True} and r["diff"] <= 1e-5, r


def _hybrid_over_one_stage_of_a_mesh():
    """Pipeline x HSDP: a 3-D mesh (pp, replicate, shard); stage 0 (ranks 0, 1) wraps its part
    with HYBRID_SHARD over its ``mesh["replicate", "shard"]``, stage 1 (ranks 2, 3) with
    FULL_SHARD over its ``mesh["shard"]``. Each stage trains in step with one process on the
    stage's global batch. Before: stage 0 waited forever in a grid check over the whole world
    that stage 1 never joined (torch's HSDP needs only the mesh's ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard"))
    stage, local = divmod(skdist.get_rank(), 2)
    reference = MLP(WIDTH, 2, seed=stage)
    kwargs = ({"sharding_strategy": S.HYBRID_SHARD, "device_mesh": mesh["replicate", "shard"]}
              if stage == 0 else {"device_mesh": mesh["replicate"]})
    model = FSDP(MLP(WIDTH, 2, seed=stage), **kwargs)
    ref_optim, optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model))
    worst = 0.0
    for step in range(2):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * stage + step))
        reference(x).pow(2).mean().backward()
        model(x[2 * local:2 * local + 2]).pow(2).mean().backward()
        for m, o in ((reference, ref_optim), (model, optim)):
            o.step()
            o.zero_grad()
        full = model.state_dict()
        worst = max(worst, max((full[k] - v).abs().max().item()
                               for k, v in reference.state_dict().items()))
    return {"worst": worst, "strategy": model.sharding_strategy.name}


def test_hybrid_over_a_sub_mesh_needs_only_its_ranks(nodes2x2):
    results = nodes2x2.run(_hybrid_over_one_stage_of_a_mesh)
    assert [r["strategy"] for r in results] == ["HYBRID_SHARD"] * 2 + ["FULL_SHARD"] * 2
    for r in results:
        assert r["worst"] <= 1e-6, results


def _mesh_from_groups_that_are_not_its_grid():
    """DeviceMesh.from_group takes any groups: here the replicate groups (0, 3), (1, 2) join
    ranks that hold different shards of (0, 1), (2, 3). Refused on every rank (it trained
    silently wrong, 0.04 off, while the same pair in process_group= was refused)."""
    from torch.distributed.device_mesh import DeviceMesh
    r = skdist.get_rank()
    made = {t: skdist.new_group(list(t)) for t in [(0, 1), (2, 3), (0, 3), (1, 2)]}
    intra, inter = made[(0, 1) if r < 2 else (2, 3)], made[(0, 3) if r in (0, 3) else (1, 2)]
    mesh = DeviceMesh.from_group([inter, intra], "cpu", mesh=[[0, 1], [2, 3]],
                                 mesh_dim_names=("replicate", "shard"))
    with pytest.raises(ValueError) as info:
        FSDP(MLP(WIDTH, 1, seed=0), sharding_strategy=S.HYBRID_SHARD, device_mesh=mesh)
    return str(info.value)


def test_mesh_whose_groups_are_not_its_grid_is_refused(nodes2x2):
    for message in nodes2x2.run(_mesh_from_groups_that_are_not_its_grid):
        assert "row and column through this rank" in message, message


def _explicit_pair_after_a_stage_mesh():
    """Stage 0 wraps over its sub-mesh, stage 1 with FULL_SHARD; then every rank wraps over an
    explicit pair of its stage's groups, together. Before: stage 0 had recorded its pair as
    checked and skipped the world-wide check that stage 1 waited in (a hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "replicate", "shard"))
    sub = mesh["replicate", "shard"]
    if skdist.get_rank() < 2:
        FSDP(MLP(WIDTH, 1, seed=0), sharding_strategy=S.HYBRID_SHARD, device_mesh=sub)
    else:
        FSDP(MLP(WIDTH, 1, seed=0), device_mesh=mesh["replicate"])
    model = FSDP(MLP(WIDTH, 1, seed=0), sharding_strategy=S.HYBRID_SHARD,
                 process_group=(sub.get_group(1), sub.get_group(0)))
    return skdist.group_ranks(model.replicate_group)


def test_explicit_pair_after_a_stage_mesh(nodes2x2):
    assert nodes2x2.run(_explicit_pair_after_a_stage_mesh) == [[0, 1]] * 2 + [[2, 3]] * 2


def _full_optim_state_under_a_replicated_root(root: str):
    """A FULL_SHARD unit (over the world) under a NO_SHARD or hybrid root: the root's replicas
    skipped the gather while the inner unit's rows needed them, and under NO_SHARD each rank
    named itself the recipient: rank 0 waited in the gather until the timeout."""
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), FSDP(nn.Linear(8, 4))),
                 sharding_strategy=S[root])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4) + skdist.get_rank()).sum().backward()
    optimizer.step()
    everywhere = FSDP.full_optim_state_dict(model, optimizer, rank0_only=False)
    rank0_only = FSDP.full_optim_state_dict(model, optimizer)
    fairscale = model.gather_full_optim_state_dict(optimizer)

    def same(full):
        return full is not None and all(
            torch.equal(full["state"][k][name], v)
            for k, entry in everywhere["state"].items() for name, v in entry.items())
    # recipients that differ inside one replica only (ranks 2 and 3 name 0 and 1): every
    # replica must then gather to every rank (one replica gathering to one rank hung)
    try:
        mixed = model.gather_full_optim_state_dict(
            optimizer, recipient_rank=1 if skdist.get_rank() == 3 else 0)
    except ValueError as error:  # NO_SHARD: a group of one rank has no rank 1
        mixed = str(error)
    return {"rank0_only": same(rank0_only) if rank0_only else rank0_only,
            "fairscale": same(fairscale) if fairscale is not None else None,
            "mixed": same(mixed) if isinstance(mixed, dict) else mixed,
            "states": len(everywhere["state"])}


def test_full_optimizer_state_of_a_sharded_unit_under_a_replicated_root(nodes2x2):
    for root in ("NO_SHARD", "HYBRID_SHARD"):
        results = nodes2x2.run(_full_optim_state_under_a_replicated_root, root)
        assert {k: v for k, v in results[0].items() if k != "mixed"} == \
            {"rank0_only": True, "fairscale": True, "states": 4}, root
        for r in results[1:]:
            assert r["rank0_only"] == {} and r["fairscale"] is None, (root, r)
            assert r["states"] == 4, (root, r)
        mixed = [r["mixed"] for r in results]
        if root == "HYBRID_SHARD":  # each rank whose group rank is its recipient holds it
            assert mixed == [True, None, True, True], mixed
        else:  # rank 3's recipient_rank=1 does not exist: refused on every rank, no hang
            assert "valid ranks are 0..0" in mixed[3], mixed
            assert all("ranks [3] (other replicas) were given arguments" in m
                       for m in mixed[:3]), mixed
