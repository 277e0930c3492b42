"""torch.compile with every wrapper, a seeded matrix: compile before wrapping, after wrapping
and per block (``block.compile()`` and ``torch.compile(block)``), under FSDP (nested units,
``reshard_after_forward=False``, ``flatten_parameters=False``, ``move_params_to_cpu``,
checkpoint_wrapper inside units), ShardedDataParallel + OSS, OSS + torch DDP, a 1F1B pipeline
and ``shardkit.initialize`` stage 3. Each configuration trains step by step against a
single-process eager oracle (fp32) on every rank, with input shapes that change between steps,
eval and no_grad forwards between steps, and a model + optimizer state round trip.

Dynamo's ``aot_eager`` backend keeps the module fast (Inductor's numerics are covered by
tests/nn/test_compile.py); graph breaks and graph counts come from ``torch._dynamo.utils``.
"""

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.models import GPT, Block, GPTConfig, synthetic_batch
from shardkit.testing import world_fixture

dynamo = pytest.importorskip("torch._dynamo")

WIDTH, STEPS, LR, EPS, WD, TOL = 8, 3, 1e-2, 1e-4, 0.01, 2e-5
CFG = GPTConfig(vocab_size=16, n_layer=2, n_head=2, d_model=8, seq_len=6, tie_weights=True)

world2 = world_fixture(2)


class MBlock(nn.Module):
    """Residual MLP block; with ``dropout`` a Dropout between the two Linears."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.fc2(self.drop(F.gelu(self.fc1(x))))


def _model(kind):
    torch.manual_seed(3)
    if kind == "tied":
        return GPT(CFG, seed=3)
    return nn.Sequential(MBlock(0.2 if kind == "dropout" else 0.0), MBlock(), nn.Linear(WIDTH, 3))


def _batch(kind, step, n, varshape):
    """The global batch of ``step``; with ``varshape`` its sequence length changes per step."""
    if kind == "tied":
        x, y = synthetic_batch(CFG, n, step)
        t = CFG.seq_len - step % 3 if varshape else CFG.seq_len
        return x[:, :t].contiguous(), y[:, :t].contiguous()
    gen = torch.Generator().manual_seed(100 + step)
    t = 1 + step % 3 if varshape else 2
    return torch.randn(n, t, WIDTH, generator=gen), torch.randn(n, t, 3, generator=gen)


def _loss(kind, out, y):
    if kind == "tied":
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.mse_loss(out, y)


def _clean(key):
    return key.replace("_orig_mod.", "")


def _compile_blocks(model, how, kw):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (MBlock, Block)):
                if how == "block_method":
                    child.compile(**kw)  # in place: keys unchanged
                else:  # torch.compile(block): an OptimizedModule, keys gain "_orig_mod."
                    parent.register_module(name, torch.compile(child, **kw))


def _checkpoint_blocks(model):
    from shardkit.nn.checkpoint import checkpoint_wrapper
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(getattr(child, "_orig_mod", child), (MBlock, Block)):
                parent.register_module(name, checkpoint_wrapper(child))


def _build(case, compiled):
    """(callable model, optimizer, full_state_dict, handles) for one configuration."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardkit.nn import FullyShardedDataParallel as FSDP, ShardedDataParallel
    from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
    from shardkit.optim import OSS
    how = case["compile"] if compiled else None
    kw = {"backend": "aot_eager", "dynamic": case.get("dynamic"),
          "fullgraph": case.get("fullgraph", False)}
    model = _model(case["model"])
    if how in ("block_method", "block_fn"):
        _compile_blocks(model, how, kw)
    if case.get("ckpt"):
        _checkpoint_blocks(model)
    if how == "before":
        model = torch.compile(model, **kw)
    wrapper, h = case["wrapper"], {"model": model}
    if wrapper == "fsdp":
        fkw = {k: case[k] for k in ("reshard_after_forward", "flatten_parameters",
                                    "move_params_to_cpu") if k in case}
        inner = auto_wrap(model, transformer_auto_wrap_policy({MBlock, Block}), **fkw)
        h["fsdp"] = wrapped = FSDP(inner, **fkw)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=LR, eps=EPS, weight_decay=WD)
        full = wrapped.state_dict
    elif wrapper == "init3":
        import shardkit
        config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
                  "optimizer": {"type": "AdamW",
                                "params": {"lr": LR, "eps": EPS, "weight_decay": WD}},
                  "zero_optimization": {"stage": 3}}
        h["engine"], opt, _, _ = shardkit.initialize(model=model, config=config)
        wrapped, full = h["engine"], h["engine"].wrapped.state_dict
    else:
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, eps=EPS, weight_decay=WD)
        wrapped = ShardedDataParallel(model, opt) if wrapper == "sdp" else DDP(model)
        full = model.state_dict
    h["wrapped"] = wrapped
    if how == "after":
        wrapped = torch.compile(wrapped, **kw)
    return wrapped, opt, full, h


def _round_trip(case, compiled, opt, h):
    """Save the full model and optimizer state, build the configuration afresh, load both."""
    import torch.distributed as td
    if case["wrapper"] == "fsdp":
        model_sd = h["fsdp"].state_dict()
        optim_sd = [h["fsdp"].gather_full_optim_state_dict(opt)]
    else:
        model_sd = h["model"].state_dict()
        opt.consolidate_state_dict(recipient_rank=0)
        optim_sd = [opt.state_dict() if distributed.get_rank() == 0 else None]
    td.broadcast_object_list(optim_sd, src=0)
    model_sd = {k: v.clone() for k, v in model_sd.items()}
    wrapped, opt, full, h = _build(case, compiled)
    if case["wrapper"] == "fsdp":
        h["fsdp"].load_state_dict(model_sd)
        opt.load_state_dict(h["fsdp"].get_shard_from_optim_state_dict(optim_sd[0]))
    else:
        h["model"].load_state_dict(model_sd)
        opt.load_state_dict(optim_sd[0])
    return wrapped, opt, full, h


def _train(case, compiled):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    wrapped, opt, full, h = _build(case, compiled)
    kind, params, evals, keys = case["model"], [], [], None
    for step in range(STEPS):
        per = 2 * (1 + step % 2 if case.get("varbatch") else 1)
        x, y = _batch(kind, step, per * world, case.get("varshape"))
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        torch.manual_seed(1000 * step + rank)  # the dropout masks: the same eager or compiled
        loss = _loss(kind, wrapped(x), y)
        if "engine" in h:
            h["engine"].backward(loss)
            h["engine"].step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        state = full()
        keys = keys or sorted(state)
        params.append({_clean(k): v.detach().clone() for k, v in state.items()})
        if case.get("eval_between"):
            wrapped.eval()
            with torch.no_grad():
                evals.append(wrapped(x).clone())
            wrapped.train()
        if case.get("no_grad_between"):
            with torch.no_grad():
                wrapped(x)
        if case.get("round_trip") and step == 1:
            wrapped, opt, full, h = _round_trip(case, compiled, opt, h)
    return params, evals, keys


def _oracle(case):
    model, kind = _model(case["model"]), case["model"]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    params, evals = [], []
    world = distributed.get_world_size()
    for step in range(STEPS):
        per = 2 * (1 + step % 2 if case.get("varbatch") else 1)
        x, y = _batch(kind, step, per * world, case.get("varshape"))
        _loss(kind, model(x), y).backward()
        opt.step()
        opt.zero_grad()
        params.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if case.get("eval_between"):
            model.eval()
            with torch.no_grad():
                rank = distributed.get_rank()
                evals.append(model(x[rank * per:(rank + 1) * per]))
            model.train()
    return params, evals


def _max_rel(got, ref):
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    return max(float((got[k] - ref[k]).abs().max()) / max(1.0, float(ref[k].abs().max()))
               for k in ref)


def _counters():
    c = dynamo.utils.counters
    return {"breaks": list(c["graph_break"]), "graphs": c["stats"]["unique_graphs"]}


def _run_case(case):
    """Eager and compiled runs of one configuration, compared with each other and (without
    dropout) with the single-process oracle after every step."""
    eager, eager_evals, eager_keys = _train(case, compiled=False)
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled, evals, keys = _train(case, compiled=True)
    out = {"vs_eager": [_max_rel(c, e) for c, e in zip(compiled, eager)],
           "evals": [float((a - b).abs().max()) for a, b in zip(evals, eager_evals)],
           "prefixed_keys": [k for k in keys if k not in eager_keys], **_counters()}
    if case["model"] != "dropout":
        oracle, oracle_evals = _oracle(case)
        out["vs_oracle"] = [_max_rel(c, o) for c, o in zip(compiled, oracle)]
        out["evals_vs_oracle"] = [float((a - b).abs().max()) for a, b in zip(evals, oracle_evals)]
    return out


def _run_pipeline(schedule_name, how):
    """A 2-stage pipeline (blocks on rank 0, the head on rank 1) with compiled blocks."""
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
    rank = distributed.get_rank()
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]

    def train(compiled):
        module = split_sequential(_model("mlp"), [2, 1])[rank]
        if compiled:
            _compile_blocks(module, how, {"backend": "aot_eager", "fullgraph": True})
        stage = PipelineStage(module, rank, 2)
        schedule = schedule_cls(stage, 2, F.mse_loss)
        opt = torch.optim.AdamW(stage.parameters(), lr=LR, eps=EPS, weight_decay=WD)
        history = []
        for step in range(STEPS):
            x, y = _batch("mlp", step, 4, varshape=True)
            schedule.step(x, target=y)
            opt.step()
            opt.zero_grad()
            history.append([p.detach().clone() for p in module.parameters()])
        return history

    eager = train(False)
    dynamo.reset()
    dynamo.utils.counters.clear()
    compiled = train(True)
    oracle_model = _model("mlp")
    opt = torch.optim.AdamW(oracle_model.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    mine = list(oracle_model[:2].parameters() if rank == 0 else oracle_model[2].parameters())
    diffs = []
    for step in range(STEPS):
        x, y = _batch("mlp", step, 4, varshape=True)
        loss = sum(F.mse_loss(oracle_model(a), b) for a, b in zip(x.chunk(2), y.chunk(2))) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        diffs.append(max(float((c - o).abs().max()) for c, o in zip(compiled[step], mine)))
    vs_eager = [max(float((c - e).abs().max()) for c, e in zip(cs, es))
                for cs, es in zip(compiled, eager)]
    return {"vs_oracle": diffs, "vs_eager": vs_eager, **_counters()}


def _whole_fsdp_model_fullgraph():
    """fullgraph=True on a model holding FSDP units: Dynamo's error says why and what to do."""
    from shardkit.nn import FullyShardedDataParallel as FSDP
    model = FSDP(_model("mlp"))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x, _ = _batch("mlp", 0, 2, False)
    dynamo.reset()
    try:
        compiled(x)
    except Exception as exc:  # torch._dynamo.exc.Unsupported
        return str(exc)
    return None


def _cases():
    """The seeded matrix: every compile placement and wrapper option drawn at least once."""
    rng = random.Random(21)
    cases = [
        dict(wrapper="fsdp", model="mlp", compile="block_fn", reshard_after_forward=False,
             ckpt=True, dynamic=True, varshape=True, round_trip=True),
        dict(wrapper="fsdp", model="tied", compile="after", flatten_parameters=False,
             move_params_to_cpu=True, eval_between=True, no_grad_between=True, round_trip=True),
        dict(wrapper="fsdp", model="dropout", compile="before", varbatch=True),
        dict(wrapper="sdp", model="mlp", compile="before", fullgraph=True, varbatch=True,
             eval_between=True, round_trip=True),
        dict(wrapper="oss_ddp", model="dropout", compile="block_method", fullgraph=True,
             no_grad_between=True, round_trip=True),
        dict(wrapper="init3", model="mlp", compile="block_method", varshape=True),
    ]
    for case in cases:  # the rest drawn from the seed
        case.setdefault("dynamic", rng.choice([None, False]))
    return cases


CASES = _cases()
IDS = [f"{c['wrapper']}-{c['model']}-{c['compile']}" for c in CASES]


class _CountedBlock(nn.Module):
    """A residual block that counts the calls it runs eagerly (the branch is dead while Dynamo
    traces, so the count adds no guard)."""

    eager_calls = 0

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        if not torch.compiler.is_compiling():
            _CountedBlock.eager_calls += 1
        return h + torch.tanh(self.fc(h))


def _frames_for_units(units: int) -> tuple:
    """(frames Dynamo compiled, block calls run eagerly) over 3 steps of a whole FSDP model of
    ``units`` nested units compiled at once."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    dynamo.reset()
    dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(*[FSDP(_CountedBlock()) for _ in range(units)]))
    compiled = torch.compile(model, backend="aot_eager")
    _CountedBlock.eager_calls = 0
    for _ in range(3):
        compiled(torch.randn(4, WIDTH)).sum().backward()
    frames = dynamo.utils.counters["frames"]["total"]
    dynamo.reset()
    return frames, _CountedBlock.eager_calls


def _all():
    out = {"frames_by_units": {n: _frames_for_units(n) for n in (3, 12)}}
    out["cases"] = [_run_case(case) for case in CASES]
    out["pipe"] = {"1f1b": _run_pipeline("1f1b", "block_fn")}
    out["fullgraph_error"] = _whole_fsdp_model_fullgraph()
    return out


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_all)


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_compiled_training_matches_one_process_eager_on_every_rank(results, index):
    case = CASES[index]
    for rank, r in enumerate(results):
        got = r["cases"][index]
        assert len(got["vs_eager"]) == STEPS
        assert max(got["vs_eager"]) <= TOL, (rank, case, got)
        if "vs_oracle" in got:
            assert max(got["vs_oracle"]) <= TOL, (rank, case, got)
        if case.get("eval_between"):
            assert len(got["evals"]) == STEPS and max(got["evals"]) <= TOL, (rank, got)
            if "evals_vs_oracle" in got:
                assert max(got["evals_vs_oracle"]) <= TOL, (rank, got)


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_graph_breaks_and_recompiles_stay_bounded(results, index):
    case = CASES[index]
    for r in results:
        got = r["cases"][index]
        if case["compile"].startswith("block") or case["wrapper"] in ("sdp", "oss_ddp") and \
                case["compile"] == "before" and case.get("fullgraph"):
            assert got["breaks"] == [], got["breaks"]
        if case["wrapper"] in ("fsdp", "init3") and case["compile"] in ("before", "after"):
            # the only breaks: FSDP's hooks, which run eagerly by design
            assert all("FullyShardedDataParallel" in b for b in got["breaks"]), got["breaks"]
        # shapes change at most 3 ways, modes 2 (train/eval), grad on/off: a bounded number of
        # graphs per compiled region, never one per step
        assert 1 <= got["graphs"] <= 12, got


def test_torch_compile_of_a_block_keeps_orig_mod_in_the_keys_only(results):
    for r in results:
        index = next(i for i, c in enumerate(CASES) if c["compile"] == "block_fn")
        keys = r["cases"][index]["prefixed_keys"]
        assert keys and all("._orig_mod." in k for k in keys), keys
        for i, case in enumerate(CASES):
            if case["compile"] == "block_method":
                assert r["cases"][i]["prefixed_keys"] == []


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_pipeline_with_compiled_stage_blocks_matches_one_process(results, schedule):
    for r in results:
        got = r["pipe"][schedule]
        assert max(got["vs_oracle"]) <= TOL and max(got["vs_eager"]) <= TOL, got
        assert got["breaks"] == [], got["breaks"]


def test_fullgraph_on_a_whole_fsdp_model_says_to_compile_the_blocks(results):
    for r in results:
        message = r["fullgraph_error"]
        assert message is not None
        assert "FullyShardedDataParallel" in message and "fullgraph" in message
        assert "block.compile(fullgraph=True)" in message, message


def test_whole_fsdp_model_compiles_each_unit_frame_once(results):
    """A unit's forward resumes after its eager pre-forward in one frame that serves every unit
    (it read the wrapped module through the unit's ``__getattr__``, whose look at the unit's
    state was guarded: one recompile per unit, 8 at 3 units, 13 at 12, up to Dynamo's limit)."""
    for r in results:
        (frames3, eager3), (frames12, eager12) = r["frames_by_units"][3], r["frames_by_units"][12]
        assert frames12 == frames3 and eager3 == eager12 == 0, r["frames_by_units"]
