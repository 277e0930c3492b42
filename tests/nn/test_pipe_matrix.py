"""A fixed sample of the pipeline parity matrix: every multi-process schedule against one process
on the same batches, step by step (loss on the last stage, every parameter and buffer after each
optimizer step, on every rank), over models (MLP, tiny GPT, tied embedding/head, tuple
activations, a stage without parameters, frozen stages, dropout, BatchNorm), losses (mean/sum,
int64 class labels), gradient accumulation, evaluation under ``torch.no_grad()``, changing batch
sizes and 2 pipelines x 2 replicas; the batch's own gradient when it requires grad; and the
single-process ``Pipe`` for every checkpoint mode against the plain ``nn.Sequential``."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.models import GPT, GPTConfig
from shardkit.nn.pipe import (Pipe, PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble,
                              split_sequential)
from shardkit.nn.pipe.stage import stage_rank
from shardkit.recipes import gpt_as_sequential
from shardkit.testing import world_fixture

WIDTH = 8
world2 = world_fixture(2, timeout=120)
world4 = world_fixture(4, timeout=120)

# name -> (schedule class, stages per pipeline rank, placement)
SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), "1F1B": (Schedule1F1B, 1, "loop"),
             "ZB-H1": (ScheduleZeroBubble, 1, "loop"),
             "Interleaved": (ScheduleInterleaved1F1B, 2, "loop"),
             "Interleaved3": (ScheduleInterleaved1F1B, 3, "loop"), "ZBV": (ScheduleZBV, 2, "v")}


class _Fork(nn.Module):
    """A tuple across the boundary: two float tensors and an int64 one without grad."""

    def forward(self, x):
        return x, torch.sin(x), (x > 0).long().sum(dim=1)


class _PassTuple(nn.Module):
    def forward(self, parts):
        a, b, count = parts
        return a * 0.9 + 0.1, b * 1.1, count


class _Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, parts):
        a, b, count = parts
        return torch.tanh(self.lin(a * b) + 0.01 * count.unsqueeze(1).float())


def _segments(model, n):
    """``n`` lists of layers, one per stage."""
    if model == "tuple":
        segs = [[nn.Linear(WIDTH, WIDTH), nn.Tanh(), _Fork()]]
        segs += [[_PassTuple()] for _ in range(n - 2)] + [[_Join(), nn.Linear(WIDTH, 4)]]
        return segs
    segs = [[nn.Linear(WIDTH, WIDTH), *_extra(model), nn.Tanh()] for _ in range(n)]
    if model == "noparam":
        segs[1] = [nn.Tanh()]
    segs[-1].append(nn.Linear(WIDTH, 5 if model == "classes" else 4))
    return segs


def _extra(model):
    return {"dropout": [nn.Dropout(0.3)], "bn": [nn.BatchNorm1d(WIDTH)]}.get(model, [])


def _layers(model, n):
    """The model as an ``nn.Sequential`` and its balance over ``n`` stages (same seed, same
    weights)."""
    torch.manual_seed(0)
    if model in ("gpt", "gpt_tied"):
        cfg = GPTConfig(vocab_size=32, n_layer=max(2, n - 2), n_head=2, d_model=8, seq_len=6,
                        tie_weights=model == "gpt_tied")
        layers = gpt_as_sequential(GPT(cfg, seed=0))
        return layers, [len(layers) // n + (k < len(layers) % n) for k in range(n)]
    segs = _segments(model, n)
    layers = nn.Sequential(*[layer for seg in segs for layer in seg])
    if model == "frozen":  # the first stage frozen: its output needs no gradient
        for p in layers[0].parameters():
            p.requires_grad_(False)
    return layers, [len(seg) for seg in segs]


def _batch(model, seed, rows):
    g = torch.Generator().manual_seed(100 + seed)
    if model.startswith("gpt"):
        idx = torch.randint(0, 32, (rows, 7), generator=g)
        return idx[:, :-1], idx[:, 1:]
    x = torch.randn(rows, WIDTH, generator=g)
    if model == "classes":
        return x, torch.randint(0, 5, (rows,), generator=g)
    return x, torch.randn(rows, 4, generator=g)


def _loss_fn(model, reduction):
    if model.startswith("gpt") or model == "classes":
        return lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1),
                                              reduction=reduction)
    return lambda out, t: F.mse_loss(out, t, reduction=reduction)


def _optimizer(params, case):
    params = [p for p in params if p.requires_grad]
    if not params:
        return None
    if case.get("adam"):
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-3 if case["reduction"] == "sum" else 0.05, momentum=0.9)


def _steps(case):
    """``[(kind, [(x, target), ...])]``: "train" one batch, "accum" two batches before one
    optimizer step, "eval" one batch under no_grad; ``rows`` scaled per step by ``vary``."""
    out = []
    for k, kind in enumerate(case["steps"]):
        rows = case["rows"] * case.get("vary", [1] * 8)[k]
        batches = [_batch(case["model"], 10 * k + j, rows) for j in range(1 + (kind == "accum"))]
        out.append((kind, batches))
    return out


def _reference(case, parts, steps, chunks):
    """One process, micro-batch by micro-batch (so BatchNorm sees what the stages see), each
    stage's dropout drawing from its own generator seeded as that stage's rank is: the mean
    micro-batch loss per batch (or eval loss), and parameters and buffers after each step."""
    loss_fn = _loss_fn(case["model"], case["reduction"])
    opt = _optimizer({id(p): p for part in parts for p in part.parameters()}.values(), case)
    rngs = [None] * len(parts)
    if case["model"] == "dropout":
        for s in range(len(parts)):
            rngs[s] = torch.Generator().manual_seed(1000 + s).get_state()
    losses, states = [], []
    for kind, batches in steps:
        if kind == "eval":
            for part in parts:
                part.eval()
            with torch.no_grad():
                values = [loss_fn(_through(parts, x, rngs), t) for x, t in zip(
                    torch.tensor_split(batches[0][0], case["chunks"]),
                    torch.tensor_split(batches[0][1], case["chunks"]))]
            for part in parts:
                part.train()
            losses.append([torch.stack(values).mean().item()])
            states.append(None)
            continue
        if opt is not None:
            opt.zero_grad()
        step_losses = []
        for x, t in batches:
            values = [loss_fn(_through(parts, xi, rngs), ti) for xi, ti in zip(
                torch.tensor_split(x, chunks), torch.tensor_split(t, chunks))]
            (sum(values) / chunks).backward()
            step_losses.append(torch.stack(values).mean().item())
        if opt is not None:
            opt.step()
        losses.append(step_losses)
        states.append([[v.detach().clone() for v in part.state_dict().values()]
                       for part in parts])
    return losses, states


def _through(parts, x, rngs):
    for s, part in enumerate(parts):
        if rngs[s] is not None:
            with torch.random.fork_rng():
                torch.set_rng_state(rngs[s])
                x = part(x)
                rngs[s] = torch.get_rng_state()
        else:
            x = part(x)
    return x


def _pipeline_groups(dp):
    """(pipeline group, this rank's place in it, pipeline index, replica group)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp == 1:
        return None, rank, 0, None
    pp = world // dp
    pipelines = [dist.new_group(list(range(k * pp, (k + 1) * pp))) for k in range(dp)]
    replicas = [dist.new_group(list(range(r, world, pp))) for r in range(pp)]
    return pipelines[rank // pp], rank % pp, rank // pp, replicas[rank % pp]


def _run_case(case):
    """Train ``case`` through its schedule and in one process; the worst relative loss
    difference, parameter difference and buffer difference on this rank."""
    cls, per_rank, placement = SCHEDULES[case["schedule"]]
    dp = case.get("dp", 1)
    group, pipe_rank, pipe_index, replicas = _pipeline_groups(dp)
    pp = dist.get_world_size() // dp
    n, chunks = pp * per_rank, case["chunks"]
    layers, balance = _layers(case["model"], n)
    parts = split_sequential(layers, balance)
    mine = [s for s in range(n) if stage_rank(s, n, pp, placement) == pipe_rank]
    modules = {s: nn.parallel.DistributedDataParallel(parts[s], process_group=replicas)
               if case.get("ddp") else parts[s] for s in mine}
    stages = [PipelineStage(modules[s], s, n, group=group, placement=placement,
                            data_parallel_group=None if case.get("ddp") else replicas)
              for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks,
                   _loss_fn(case["model"], case["reduction"]))
    opt = _optimizer({id(p): p for s in mine for p in parts[s].parameters()}.values(), case)
    ref_parts = split_sequential(_layers(case["model"], n)[0], balance)
    steps = _steps(case)
    ref_losses, ref_states = _reference(case, ref_parts, steps, chunks * dp)
    torch.manual_seed(1000 + pipe_rank)  # this rank's dropout generator, as in the reference
    worst = {"loss": 0.0, "param": 0.0}
    for k, (kind, batches) in enumerate(steps):
        if kind == "eval":
            for m in modules.values():
                m.eval()
            with torch.no_grad():
                losses = [schedule.step(batches[0][0], target=batches[0][1])]
            for m in modules.values():
                m.train()
        else:
            if opt is not None:
                opt.zero_grad()
            losses = []
            for x, t in batches:
                rows = slice(pipe_index * len(x) // dp, (pipe_index + 1) * len(x) // dp)
                losses.append(schedule.step(x[rows], target=t[rows]))
            if opt is not None:
                opt.step()
        assert all((loss is None) == (n - 1 not in mine) for loss in losses), (k, losses)
        if dp == 1 and n - 1 in mine:
            worst["loss"] = max([worst["loss"]] + [abs(a.item() - b) / max(1.0, abs(b))
                                                   for a, b in zip(losses, ref_losses[k])])
        if kind != "eval":
            for s in mine:
                for a, b in zip(parts[s].state_dict().values(), ref_states[k][s]):
                    worst["param"] = max(worst["param"],
                                         (a.double() - b.double()).abs().max().item())
    return worst


def _run_cases(cases):
    return [_run_case(case) for case in cases]


def _case(schedule, model, chunks, rows, steps, reduction="mean", **options):
    return dict(schedule=schedule, model=model, chunks=chunks, rows=rows, steps=steps,
                reduction=reduction, **options)


# every schedule, model, chunk count, reduction and step kind at least once
PARITY_WORLD2 = [
    _case("GPipe", "mlp", 4, 8, ["train", "eval", "accum"], adam=True),
    _case("1F1B", "classes", 3, 12, ["train", "train"], reduction="sum"),
    _case("ZB-H1", "gpt_tied", 2, 8, ["train", "accum", "eval"]),
    _case("Interleaved", "tuple", 2, 8, ["train", "train", "eval"], vary=[1, 2, 3]),
    _case("Interleaved3", "gpt", 4, 8, ["accum", "train"], reduction="sum"),
    _case("ZBV", "noparam", 8, 16, ["train", "eval", "train", "train"], vary=[1, 2, 1, 3]),
    _case("1F1B", "dropout", 4, 16, ["train", "train"]),
    _case("GPipe", "bn", 2, 8, ["train", "accum", "eval"]),
    _case("ZB-H1", "frozen", 1, 8, ["train", "train"]),
]
PARITY_WORLD4 = [
    _case("1F1B", "gpt", 4, 8, ["train", "eval", "train"]),
    _case("ZBV", "gpt_tied", 8, 8, ["train", "train", "train"]),  # re-planned after two
    _case("Interleaved", "mlp", 4, 8, ["accum", "train"], vary=[1, 3]),
    # 2 pipelines x 2 replicas: the stage's all-reduce, then torch DDP
    _case("ZB-H1", "classes", 2, 16, ["train", "accum", "eval"], dp=2),
    _case("GPipe", "mlp", 2, 16, ["train", "accum"], dp=2, ddp=True),
    _case("ZBV", "gpt_tied", 2, 8, ["train", "train"], dp=2),
]


@pytest.mark.parametrize("world_name, cases", [("world2", PARITY_WORLD2),
                                               ("world4", PARITY_WORLD4)])
def test_schedules_match_one_process_over_a_sample_of_the_matrix(world_name, cases, request):
    results = request.getfixturevalue(world_name).run(_run_cases, cases)
    for rank, per_case in enumerate(results):
        for case, worst in zip(cases, per_case):
            assert worst["loss"] <= 1e-5 and worst["param"] <= 1e-5, (rank, case, worst)


class _Scaled(nn.Module):
    """What builds the batch before the pipeline: ``x * scale`` (a non-leaf batch)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return x * self.scale


def _batch_gradients():
    """For every schedule: the worst difference between the gradient one process gives a batch
    that requires grad (a leaf, and a non-leaf built by a weight before the pipeline) and what
    the pipeline leaves in ``.grad``, on the rank running stage 0 (``None`` elsewhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (cls, per_rank, placement) in SCHEDULES.items():
        n = world * per_rank
        layers, balance = _layers("mlp", n)
        ref_layers = _layers("mlp", n)[0]
        parts = split_sequential(layers, balance)
        mine = [s for s in range(n) if stage_rank(s, n, world, placement) == rank]
        stages = [PipelineStage(parts[s], s, n, placement=placement) for s in mine]
        schedule = cls(stages[0] if per_rank == 1 else stages, 2 * world, F.mse_loss)
        worst = 0.0
        for step in range(2):
            x, t = _batch("mlp", step, 4 * world)
            leaf, ref_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
            scaled, ref_scaled = _Scaled(), _Scaled()
            F.mse_loss(ref_layers(ref_scaled(ref_leaf)), t).backward()
            schedule.step(scaled(leaf), target=t)
            if 0 in mine:
                got = [leaf.grad, scaled.scale.grad]
                worst = max([worst] + [float("inf") if g is None else (g - r).abs().max().item()
                                       for g, r in zip(got, [ref_leaf.grad,
                                                             ref_scaled.scale.grad])])
        out[name] = worst if 0 in mine else None
    return out


def test_a_batch_that_requires_grad_gets_its_gradient_as_in_one_process(world2):
    """Was: every schedule left ``.grad`` of such a batch (and of weights that built it) None,
    where one process gives the input gradient (input-gradient attacks, saliency, a learned
    transform before the pipeline)."""
    first, other = world2.run(_batch_gradients)
    assert all(worst is not None and worst <= 1e-6 for worst in first.values()), first
    assert all(worst is None for worst in other.values()), other


def _pipe_parity(model, chunks, checkpoint, rows):
    """Pipe (every checkpoint mode) against the plain Sequential: outputs, the input's and the
    parameters' gradients and the parameters after two SGD steps, and eval outputs."""
    layers, _ = _layers(model, 3)
    reference, _ = _layers(model, 3)
    balance = [2, 1, len(layers) - 3]
    pipe = Pipe(layers, balance=balance, chunks=chunks, checkpoint=checkpoint)
    if model == "dropout":  # the same masks in the same (clock) order: Pipe without recompute
        reference = Pipe(reference, balance=balance, chunks=chunks, checkpoint="never")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, pipe)]
    worst = 0.0
    for step in range(2):
        x, t = _batch(model, step, rows)
        inputs = [x.clone().requires_grad_(x.is_floating_point()) for _ in range(2)]
        outputs = []
        for m, inp, opt in zip((reference, pipe), inputs, opts):
            torch.manual_seed(step)
            opt.zero_grad()
            outputs.append(m(inp))
            _loss_fn(model, "mean")(outputs[-1], t).backward()
        worst = max(worst, (outputs[0] - outputs[1]).abs().max().item())
        if x.is_floating_point():
            worst = max(worst, (inputs[0].grad - inputs[1].grad).abs().max().item())
        worst = max([worst] + [(a.grad - b.grad).abs().max().item() for a, b in
                               zip(reference.parameters(), pipe.parameters())])
        for opt in opts:
            opt.step()
    reference.eval(), pipe.eval()
    with torch.no_grad():
        x, _ = _batch(model, 9, rows)
        worst = max(worst, (reference(x) - pipe(x)).abs().max().item())
    return worst


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_pipe_matches_the_plain_sequential_in_every_checkpoint_mode(checkpoint):
    for model, chunks, rows in [("mlp", 4, 8), ("tuple", 3, 6), ("gpt_tied", 2, 4),
                                ("dropout", 4, 8), ("noparam", 8, 3)]:
        assert _pipe_parity(model, chunks, checkpoint, rows) <= 1e-5, (model, chunks)


def _fewer_rows_than_chunks():
    """(A batch chunks does not divide is split as torch splits it:
    tests/nn/test_pipe_uneven_chunks.py.)"""
    rank = dist.get_rank()
    parts = split_sequential(_layers("mlp", 2)[0], [2, 3])
    schedule = Schedule1F1B(PipelineStage(parts[rank], rank, 2), 3, F.mse_loss)
    x, t = _batch("mlp", 0, 2)
    with pytest.raises(ValueError) as error:
        schedule.step(x, target=t)
    return str(error.value)


def test_fewer_rows_than_chunks_is_one_clear_error(world2):
    for message in world2.run(_fewer_rows_than_chunks):
        assert "chunks=3 is larger than the batch size 2" in message, message
