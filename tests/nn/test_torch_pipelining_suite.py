"""What a user of ``torch.distributed.pipelining`` relies on, asked of shardkit's schedules.

Re-expresses the behaviours torch's own pipelining tests check (test_schedule_multiproc.py,
test_schedule.py, test_stage.py, test_microbatch.py, test_backward.py, model_registry.py) where
shardkit has the equivalent: every schedule (GPipe, 1F1B, ZB-H1, interleaved 1F1B, ZBV) trains
like one process, step by step, at world 2 and 4 with ``m = p, 2p, 4p`` micro-batches, on
model_registry-like stages (a multi-layer MLP, tuples of several tensors across boundaries, a
stage taking keyword arguments, embedding / layer norm / convolution layers, frozen parameters
and buffers); torch's calling conventions (``step(x)`` on the first rank, ``step()`` in the
middle, ``step(target=y, losses=losses)`` on the last; ``eval``; keyword arguments per rank);
gradient accumulation over several ``step`` calls; clear errors on every rank for neighbouring
stages that disagree on shape or dtype, an uneven batch, a bad ``losses`` or keyword argument,
and a schedule given the wrong number of stages per rank; the action lists' dry run (no
deadlock, the bubble of DESIGN.md's formulas); and split backward (B, then W) against one plain
backward on modules with LayerNorm, Embedding, tied and frozen weights.

Where shardkit differs on purpose: ``step`` returns the mean micro-batch loss on the last stage
(torch: the merged output), a stage module gets a tuple activation as one argument (as in
``nn.Sequential``; torch unpacks it), the batch must split into equal micro-batches, 1F1B runs
with fewer micro-batches than stages, and a forward-only step may also be ``step`` under
``torch.no_grad()`` (torch requires ``eval``).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble)
from shardkit.nn.pipe.plan import (gpipe_plan, interleaved_1f1b_plan, one_f_one_b_plan,
                                   zb_h1_plan, zbv_plan)
from shardkit.nn.pipe.split_backward import backward_input
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

D = 8
VOCAB = 11
world2 = world_fixture(2, timeout=240)
world4 = world_fixture(4, timeout=240)

# name -> (schedule class, stages per rank, placement)
SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), "1F1B": (Schedule1F1B, 1, "loop"),
             "ZB-H1": (ScheduleZeroBubble, 1, "loop"),
             "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
             "ZBV": (ScheduleZBV, 2, "v")}


# ---------------------------------------------------------------------- model_registry-like stages
class _Fork(nn.Module):
    """First stage of "multi_io": one input, a tuple of two outputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = self.lin(x)
        return h, torch.tanh(h)


class _Mix(nn.Module):
    """A stage with several inputs and several outputs (a tuple in, a tuple out)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, parts):
        x, skip = parts
        return torch.relu(self.a(x)) + skip, self.b(skip)


class _Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, parts):
        x, skip = parts
        return self.lin(x * skip)


class _WithKwargs(nn.Module):
    """torch's ModelWithKwargs: a tensor and a plain value by keyword beside the input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, mask=None, scale=1.0):
        h = self.lin(x) * scale
        return torch.relu(h) if mask is None else torch.relu(h) * mask


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(VOCAB, D), nn.LayerNorm(D)

    def forward(self, idx):
        return self.norm(self.emb(idx))


class _Conv(nn.Module):
    """Non-Linear layers: a 1-d convolution over the sequence and a GELU."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)

    def forward(self, h):
        return F.gelu(self.conv(h.transpose(1, 2)).transpose(1, 2)) + h


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(D), nn.Linear(D, 5)

    def forward(self, h):
        return self.lin(self.norm(h).mean(dim=1))


class _Buffered(nn.Module):
    """Frozen parameters and a buffer beside trainable ones."""

    def __init__(self, frozen_first: bool):
        super().__init__()
        self.first, self.second = nn.Linear(D, D), nn.Linear(D, D)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, D))
        frozen = self.first if frozen_first else self.second
        for p in frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x) + self.offset))


def _stages(model: str, n: int) -> list:
    """``n`` stage modules of ``model``, the same weights on every call."""
    torch.manual_seed(0)
    if model == "mlp":
        return [nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))
                for _ in range(n)]
    if model == "multi_io":
        return [_Fork()] + [_Mix() for _ in range(n - 2)] + [_Join()]
    if model == "kwargs":
        return [_WithKwargs() for _ in range(n)]
    if model == "nonlinear":
        return [_Embed()] + [_Conv() for _ in range(n - 2)] + [_Head()]
    if model == "frozen":
        return [_Buffered(frozen_first=s % 2 == 0) for s in range(n)]
    raise ValueError(model)


def _loss_fn(model: str):
    if model == "nonlinear":
        return F.cross_entropy
    return F.mse_loss


def _batch(model: str, seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    if model == "nonlinear":
        return (torch.randint(0, VOCAB, (rows, 3), generator=g),
                torch.randint(0, 5, (rows,), generator=g))
    return torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)


def _kwargs(model: str, seed: int, rows: int) -> dict:
    if model != "kwargs":
        return {}
    g = torch.Generator().manual_seed(seed + 7)
    return {"mask": (torch.rand(rows, D, generator=g) > 0.3).float(), "scale": 0.7}


# ---------------------------------------------------------------------- parity, rank side
def _oracle_losses(modules, loss_fn, x, y, kwargs, chunks, backward: bool) -> list:
    """One process, micro-batch by micro-batch: the losses, and (``backward``) the gradients
    of the mean loss accumulated into ``.grad``."""
    pieces = {k: torch.tensor_split(v, chunks) if isinstance(v, torch.Tensor) else [v] * chunks
              for k, v in kwargs.items()}
    losses = []
    for i, (xi, yi) in enumerate(zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks))):
        h = xi
        for module in modules:
            h = module(h, **{k: v[i] for k, v in pieces.items()})
        losses.append(loss_fn(h, yi))
    if backward:
        (sum(losses) / chunks).backward()
    return [loss.detach() for loss in losses]


def _run_parity(case) -> dict:
    """Train ``case`` through its schedule, called as torch's users call theirs, beside one
    process; the worst loss / gradient / parameter difference on this rank and what else the
    step returned."""
    cls, per_rank, placement = SCHEDULES[case["schedule"]]
    p = dist.get_world_size()
    rank, n, m, model = dist.get_rank(), p * per_rank, case["chunks"], case["model"]
    rows = 2 * m
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    modules = _stages(model, n)
    ref = _stages(model, n)
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    loss_fn = _loss_fn(model)
    schedule = cls(stages[0] if per_rank == 1 else stages, m, loss_fn)
    schedule.plan.dry_run()  # the plan it runs has no deadlock
    params = [q for s in mine for q in modules[s].parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([q for mod in ref for q in mod.parameters() if q.requires_grad],
                              lr=0.1, momentum=0.9)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    returned, untouched = [], True
    first, last = 0 in mine, n - 1 in mine

    def call(seed, evaluating=False):
        x, y = _batch(model, seed, rows)
        kwargs = _kwargs(model, seed, rows)
        losses = []
        args = (x,) if first else ()
        run = schedule.eval if evaluating else schedule.step
        if last:
            out = run(*args, target=y, losses=losses, **kwargs)
        else:
            out = run(*args, **kwargs)
        expected = _oracle_losses(ref, loss_fn, x, y, kwargs, m, backward=not evaluating)
        returned.append(out is not None)
        if last:
            assert len(losses) == m, losses
            mean = torch.stack(expected).mean().item()
            worst["loss"] = max([worst["loss"], abs(out.item() - mean)]
                                + [abs(a.item() - b.item()) for a, b in zip(losses, expected)])
        return out

    # steps: train; accumulate two batches before one optimizer step; eval; train again
    for kind, seeds in (("train", [1]), ("accum", [2, 3]), ("eval", [4]), ("train", [5])):
        if kind == "eval":
            before = [q.grad.clone() for q in params]
            call(seeds[0], evaluating=True)
            untouched &= all(torch.equal(a, q.grad) for a, q in zip(before, params))
            continue
        opt.zero_grad()
        ref_opt.zero_grad()
        for seed in seeds:
            call(seed)
        for s in mine:
            for a, b in zip(modules[s].parameters(), ref[s].parameters()):
                if a.requires_grad:
                    worst["grad"] = max(worst["grad"], (a.grad - b.grad).abs().max().item())
                else:
                    assert a.grad is None
        opt.step()
        ref_opt.step()
        for s in mine:
            for a, b in zip(modules[s].state_dict().values(), ref[s].state_dict().values()):
                worst["param"] = max(worst["param"], (a - b).abs().max().item())
    return {"worst": worst, "returned": returned, "eval_left_grads": untouched, "last": last}


def _run_parity_cases(cases):
    return [_run_parity(case) for case in cases]


def _parity_cases(p):
    """Every schedule on the MLP at m = p, 2p, 4p; on the other models at m = 2p (world 2) or
    m = p (world 4, whose 8-stage pipelines dominate the module's time)."""
    cases = [dict(schedule=s, model="mlp", chunks=m) for s in SCHEDULES
             for m in (p, 2 * p, 4 * p)]
    cases += [dict(schedule=s, model=model, chunks=2 * p if p == 2 else p) for s in SCHEDULES
              for model in ("multi_io", "kwargs", "nonlinear", "frozen")]
    return cases


def _check_parity(world, p):
    cases = _parity_cases(p)
    results = world.run(_run_parity_cases, cases)
    for k, case in enumerate(cases):
        per_rank = [r[k] for r in results]
        for rank, r in enumerate(per_rank):
            for what, value in r["worst"].items():
                assert value < 2e-5, (case, rank, what, value)
            # the loss comes back on the rank running the last stage only, eval included
            assert r["returned"] == [r["last"]] * 5, (case, rank, r["returned"])
            assert r["eval_left_grads"], (case, rank)
        assert sum(r["last"] for r in per_rank) == 1


def test_every_schedule_trains_like_one_process_world2(world2):
    _check_parity(world2, 2)


def test_every_schedule_trains_like_one_process_world4(world4):
    _check_parity(world4, 4)


# ---------------------------------------------------------------------- errors, rank side
def _error_of(fn):
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the test reads the type and message
        return type(error).__name__, str(error)
    return None


def _pipeline(modules, chunks=2, cls=ScheduleGPipe):
    rank, p = dist.get_rank(), dist.get_world_size()
    return cls(PipelineStage(modules[rank], rank, p), chunks, F.mse_loss)


def _mismatch(kind: str):
    """Stage 1 gets what stage 0 was not built to give (a width or a dtype), then a good
    batch on a good pipeline: every rank raises the same error, then goes on."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    modules = [nn.Linear(D, D) for _ in range(p)]
    if kind == "shape":
        modules[0] = nn.Linear(D, 6)
    else:
        modules[0] = nn.Linear(D, D).double()
    x, y = torch.randn(4, D), torch.randn(4, D)
    if kind == "dtype":
        x = x.double()
    schedule = _pipeline(modules)
    found = _error_of(lambda: schedule.step(*(x,) if rank == 0 else (),
                                            target=y if rank == p - 1 else None))
    good = _pipeline([nn.Linear(D, D) for _ in range(p)])
    loss = good.step(*(torch.randn(4, D),) if rank == 0 else (),
                     target=torch.randn(4, D) if rank == p - 1 else None)
    return found, loss is not None


def _output_changes(schedule_name: str):
    """torch's test_stage: after a good step, a forward hook flattens the first stage's output,
    then another turns it to bfloat16; each step fails with the same error on every rank, and
    the pipeline trains again once the hook is gone."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    rank, p = dist.get_rank(), dist.get_world_size()
    n = p * per_rank
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    torch.manual_seed(0)
    modules = {s: nn.Linear(D, D) for s in mine}
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, 2, F.mse_loss)
    x, y = torch.randn(4, D), torch.randn(4, D)

    def step():
        return _error_of(lambda: schedule.step(*(x,) if 0 in mine else (),
                                               target=y if n - 1 in mine else None))

    found = [step()]
    for hook in (lambda mod, args, out: out.flatten(), lambda mod, args, out: out.bfloat16()):
        handle = modules[0].register_forward_hook(hook) if 0 in mine else None
        found.append(step())
        if handle is not None:
            handle.remove()
    found.append(step())
    return found


def _bad_step(what: str):
    """A step that one rank's arguments make unusable: the same clear error on every rank."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    schedule = _pipeline([_WithKwargs() for _ in range(p)], chunks=2)
    x, y = torch.randn(4, D), torch.randn(4, D)
    args = (x,) if rank == 0 else ()
    kwargs = {"target": y} if rank == p - 1 else {}
    if what == "too_few_rows":  # (rows chunks only fails to divide are split, as in torch)
        args = (torch.randn(1, D),) if rank == 0 else ()
    elif what == "losses" and rank == p - 1:
        kwargs["losses"] = ()
    elif what == "kwarg_rows" and rank == p - 1:
        kwargs["mask"] = torch.ones(1, D)
    elif what == "kwarg_grad" and rank == 0:
        kwargs["mask"] = torch.ones(4, D, requires_grad=True)
    found = [_error_of(lambda: schedule.step(*args, **kwargs))]
    # a second, good step; then the same mistake on a later step (no first-step check)
    found.append(_error_of(lambda: schedule.step(*((x,) if rank == 0 else ()),
                                                 **({"target": y} if rank == p - 1 else {}))))
    found.append(_error_of(lambda: schedule.step(*args, **kwargs)))
    return found


def _wrong_stage_count():
    rank, p = dist.get_rank(), dist.get_world_size()
    one = PipelineStage(nn.Linear(D, D), rank, p)
    two = [PipelineStage(nn.Linear(D, D), s, 2 * p) for s in (rank, rank + p)]
    vee = [PipelineStage(nn.Linear(D, D), s, 2 * p, placement="v")
           for s in (rank, 2 * p - 1 - rank)]
    return {
        "1F1B given a list": _error_of(lambda: Schedule1F1B([one], 2, F.mse_loss)),
        "GPipe given 2 stages per rank": _error_of(lambda: ScheduleGPipe(two[0], 2, F.mse_loss)),
        "ZB-H1 given 2 stages per rank": _error_of(
            lambda: ScheduleZeroBubble(two[0], 2, F.mse_loss)),
        "ZBV given one stage per rank": _error_of(lambda: ScheduleZBV([one], 2, F.mse_loss)),
        # found when built, raised by the first step on every rank (before any work)
        "ZBV given loop placement": _error_of(lambda: _first_step(ScheduleZBV(two, 2,
                                                                              F.mse_loss))),
        "Interleaved given only one of its stages": _error_of(
            lambda: _first_step(ScheduleInterleaved1F1B(vee[:1], 2, F.mse_loss))),
        # torch runs a schedule without loss_fn forward only and returns the output; shardkit's
        # step returns the loss, so it asks for one (on every rank, before any work)
        "GPipe without loss_fn": _error_of(lambda: _first_step(ScheduleGPipe(one, 2))),
    }


def _first_step(schedule):
    rank = dist.get_rank()
    return schedule.step(*(torch.randn(4, D),) if rank == 0 else (), target=torch.randn(4, D))


def test_neighbouring_stages_that_disagree_fail_clearly_on_every_rank(world2):
    for kind, words in (("shape", "shapes cannot be multiplied"), ("dtype", "dtype")):
        results = world2.run(_mismatch, kind)
        errors = {r[0] for r in results}
        assert len(errors) == 1, results  # the same error on every rank
        name, message = errors.pop()
        assert name == "ValueError" and "stage 1 (the last), micro-batch 0" in message, message
        assert words in message, message
        assert [r[1] for r in results] == [False, True]  # and the pipeline goes on


@pytest.mark.parametrize("schedule,words", [
    ("1F1B", ["shapes cannot be multiplied", "must have the same dtype"]),
    # several stages per rank: the changed output is caught before it is sent; after a
    # failed step the shapes are announced again, so the bfloat16 one reaches stage 1
    ("Interleaved1F1B", ["expected an output of float32 (2, 8) requiring grad",
                         "must have the same dtype"]),
])
def test_a_stage_output_that_changes_shape_or_dtype_fails_clearly(world2, schedule, words):
    results = world2.run(_output_changes, schedule)
    assert all(r[0] is None and r[3] is None for r in results), results  # good steps run
    for k, expected in zip((1, 2), words):
        errors = {r[k] for r in results}
        assert len(errors) == 1, results  # the same error on every rank
        name, message = errors.pop()
        assert name == "ValueError" and "stage " in message and expected in message, message


@pytest.mark.parametrize("what,words", [
    ("too_few_rows", "chunks=2 is larger than the batch size 1"),
    ("losses", "losses=tuple: expected a list"),
    ("kwarg_rows", "step(mask=...)"),
    ("kwarg_grad", "must not require grad"),
])
def test_bad_step_arguments_fail_clearly_on_every_rank(world2, what, words):
    results = world2.run(_bad_step, what)
    for k in (0, 2):  # the first step, and the same mistake after a good step
        errors = {r[k] for r in results}
        assert len(errors) == 1, results
        name, message = errors.pop()
        assert name == "ValueError" and words in message, message
    assert all(r[1] is None for r in results), results  # the good step between ran


def test_schedules_refuse_the_wrong_number_of_stages_per_rank(world2):
    results = world2.run(_wrong_stage_count)
    assert results[0] == results[1]
    expected = {
        "1F1B given a list": ("TypeError", "ScheduleInterleaved1F1B and ScheduleZBV take a list"),
        "GPipe given 2 stages per rank": ("ValueError", "4 stages on 2 ranks"),
        "ZB-H1 given 2 stages per rank": ("ValueError", "4 stages on 2 ranks"),
        "ZBV given one stage per rank": ("ValueError", "runs two stages per rank"),
        "ZBV given loop placement": ("ValueError", "must pass stages"),
        "Interleaved given only one of its stages": ("ValueError", "must pass stages"),
        "GPipe without loss_fn": ("ValueError", "the last stage needs ScheduleGPipe(..., "
                                                "loss_fn=...)"),
    }
    for key, (name, words) in expected.items():
        found = results[0][key]
        assert found is not None and found[0] == name and words in found[1], (key, found)


# ---------------------------------------------------------------------- the dry run, no world
@pytest.mark.parametrize("p", [2, 4])
def test_action_lists_have_no_deadlock_and_the_design_bubble(p):
    for m in (p, 2 * p, 4 * p):
        plans = {"GPipe": gpipe_plan(p, m), "1F1B": one_f_one_b_plan(p, m),
                 "ZB-H1": zb_h1_plan(p, m), "Interleaved1F1B": interleaved_1f1b_plan(p, m, 2),
                 "ZBV": zbv_plan(p, m)}
        runs = {}
        for name, plan in plans.items():
            assert plan.problems() == [], (name, plan.problems())
            runs[name] = plan.dry_run()  # raises PipelineDeadlock if any rank waits forever
            # every rank sends what its neighbour receives: same count both ways per boundary
            sends = sum(a.startswith("send_") for r in range(p) for a in plan.lowered(r))
            recvs = sum(a.startswith("recv_") for r in range(p) for a in plan.lowered(r))
            assert sends == recvs, name
        for name in ("GPipe", "1F1B"):
            assert runs[name].idle_fraction == pytest.approx((p - 1) / (m + p - 1))
        v = 2  # interleaved: a bubble of (p-1)/(v*m) of the work
        work = runs["Interleaved1F1B"].busy[0]
        assert all(busy == work for busy in runs["Interleaved1F1B"].busy)
        bubble = runs["Interleaved1F1B"].makespan - work
        assert bubble / work == pytest.approx((p - 1) / (v * m))
        # ZB-H1: a bubble of (p-1)(F+B-W), a third of 1F1B's (p-1)(F+B+W) with F=B=W
        assert runs["ZB-H1"].makespan - 3 * m == pytest.approx(p - 1)
        assert runs["1F1B"].makespan - 3 * m == pytest.approx(3 * (p - 1))
        assert runs["ZBV"].idle_fraction < runs["ZB-H1"].idle_fraction
        # activation memory: GPipe m, 1F1B p - r, ZB-H1 at most p, ZBV at most 2p half stages
        assert runs["GPipe"].peak_live == [m] * p
        assert runs["1F1B"].peak_live == [min(p - r, m) for r in range(p)]
        assert max(runs["ZB-H1"].peak_live) <= p and max(runs["ZBV"].peak_live) <= 2 * p


# ---------------------------------------------------------------------- split backward, no world
class _TiedNormModel(nn.Module):
    """Embedding, LayerNorm, a head tied to the embedding, a frozen layer between."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.mid = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D)
        self.frozen.weight.requires_grad_(False)

    def forward(self, idx, h=None):
        x = self.emb(idx)
        if h is not None:
            x = x + h
        x = self.frozen(torch.tanh(self.mid(self.norm(x))))
        return x @ self.emb.weight.t()  # tied head


@pytest.mark.parametrize("input_grad", [False, True])
def test_split_backward_equals_one_backward_on_tied_norm_embedding_frozen(input_grad):
    torch.manual_seed(0)
    model = _TiedNormModel()
    idx = torch.randint(0, VOCAB, (4, 3))
    h0 = torch.randn(4, 3, D)
    g = torch.randn(4, 3, VOCAB)
    h = h0.clone().requires_grad_(input_grad)
    model(idx, h).backward(g)
    ref = {name: q.grad.clone() for name, q in model.named_parameters() if q.requires_grad}
    ref_input = h.grad
    model.zero_grad(set_to_none=True)
    h = h0.clone().requires_grad_(input_grad)
    out = model(idx, h)
    input_grads, weight_pass = backward_input([out], [g], [h], list(model.parameters()))
    assert all(q.grad is None for q in model.parameters())  # B: input gradient only
    if input_grad:
        torch.testing.assert_close(input_grads[0], ref_input, rtol=1e-6, atol=1e-6)
    else:
        assert input_grads == [None]
    weight_pass.run(into_grad=True)  # W, later
    for name, q in model.named_parameters():
        if q.requires_grad:
            torch.testing.assert_close(q.grad, ref[name], rtol=1e-5, atol=1e-6)
        else:
            assert q.grad is None, name


# ------------------------------------------------- torch's scale_grads, return_outputs, loss_kwargs
def _sum_mse(output, target):
    return F.mse_loss(output, target, reduction="sum")


def _run_scaling(case) -> dict:
    """Two training steps of ``case`` (schedule, scale_grads, reduction) beside one process
    that computes each micro-batch's loss and backpropagates their mean (``scale_grads``) or
    their sum, as torch's schedules do; the worst relative differences on this rank."""
    cls, per_rank, placement = SCHEDULES[case["schedule"]]
    p = dist.get_world_size()
    rank, n, m = dist.get_rank(), p * per_rank, case["chunks"]
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    modules, ref = _stages("mlp", n), _stages("mlp", n)
    loss_fn = F.mse_loss if case["reduction"] == "mean" else _sum_mse
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, m, loss_fn,
                   scale_grads=case["scale_grads"])
    opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.01)
    ref_opt = torch.optim.SGD([q for mod in ref for q in mod.parameters()], lr=0.01)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}

    def rel(a, b):
        return ((a - b).abs().max() / (1 + b.abs().max())).item()

    for seed in (1, 2):
        x, y = _batch("mlp", seed, 2 * m)
        opt.zero_grad()
        ref_opt.zero_grad()
        out = schedule.step(*(x,) if 0 in mine else (), target=y if n - 1 in mine else None)
        h_losses = []  # one process, micro-batch by micro-batch
        for xi, yi in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
            h = xi
            for module in ref:
                h = module(h)
            h_losses.append(loss_fn(h, yi))
        total = torch.stack(h_losses)
        expected = total.mean() if case["scale_grads"] else total.sum()
        expected.backward()
        if n - 1 in mine:
            worst["loss"] = max(worst["loss"], rel(out, expected.detach()))
        else:
            assert out is None
        for s in mine:
            for a, b in zip(modules[s].parameters(), ref[s].parameters()):
                worst["grad"] = max(worst["grad"], rel(a.grad, b.grad))
        opt.step()
        ref_opt.step()
        for s in mine:
            for a, b in zip(modules[s].parameters(), ref[s].parameters()):
                worst["param"] = max(worst["param"], rel(a, b))
    return worst


def _run_scaling_cases(cases):
    return [_run_scaling(case) for case in cases]


def _check_scaling(world, p):
    cases = [dict(schedule=s, scale_grads=scale, reduction=reduction, chunks=2 * p)
             for s in SCHEDULES for scale in (True, False) for reduction in ("mean", "sum")]
    results = world.run(_run_scaling_cases, cases)
    for k, case in enumerate(cases):
        for rank, r in enumerate(res[k] for res in results):
            for what, value in r.items():
                assert value < 2e-6, (case, rank, what, value)


def test_scale_grads_trains_like_torch_meaning_world2(world2):
    _check_scaling(world2, 2)


def test_scale_grads_trains_like_torch_meaning_world4(world4):
    _check_scaling(world4, 4)


def _weighted_loss(output, target, weight=1.0, reduction="mean"):
    return weight * F.mse_loss(output[0], target, reduction=reduction)


def _run_return_outputs(schedule_name: str) -> dict:
    """torch's ``step(..., return_outputs=..., loss_kwargs=...)``: the last stage's merged
    outputs (or ``None``), and ``loss_fn`` called with ``loss_kwargs``, beside one process."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p = dist.get_world_size()
    rank, n, m = dist.get_rank(), p * per_rank, 4
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    torch.manual_seed(0)
    modules = [nn.Linear(D, D) for _ in range(n - 1)] + [_Fork()]  # a tuple: merged item by item
    torch.manual_seed(0)
    ref = [nn.Linear(D, D) for _ in range(n - 1)] + [_Fork()]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, m, _weighted_loss)
    x, y = _batch("mlp", 3, 2 * m)
    loss_kwargs = {"weight": 0.5, "reduction": "sum"}
    first, last = 0 in mine, n - 1 in mine
    found = {}
    for key, value in (("merged", True), ("none", False), ("default", None)):
        for module in modules:
            module.zero_grad()
        losses = []
        out = schedule.step(*(x,) if first else (), target=y if last else None, losses=losses,
                            return_outputs=value, loss_kwargs=loss_kwargs)
        found[key] = out
        found[key + "_losses"] = losses
        found[key + "_grads"] = [q.grad.clone() for s in mine for q in modules[s].parameters()]
    h = x
    for module in ref:
        h = module(h)
    chunk_losses = [_weighted_loss((a,), b, **loss_kwargs)
                    for a, b in zip(torch.tensor_split(h[0], m), torch.tensor_split(y, m))]
    (sum(chunk_losses) / m).backward()
    expected_grads = [q.grad for s in mine for q in ref[s].parameters()]
    result = {"last": last, "types": {k: type(found[k]).__name__ for k in
                                      ("merged", "none", "default")}}
    result["grads"] = all(torch.allclose(a, b, atol=1e-5) for key in ("merged", "none", "default")
                          for a, b in zip(found[key + "_grads"], expected_grads))
    if last:
        merged = found["merged"]
        result["outputs"] = isinstance(merged, tuple) and len(merged) == 2 and all(
            torch.allclose(a, b.detach(), atol=1e-6) and not a.requires_grad
            for a, b in zip(merged, h))
        stacked = torch.stack(chunk_losses).detach()
        result["losses"] = all(torch.allclose(torch.stack(found[k + "_losses"]), stacked,
                                              atol=1e-5) for k in ("merged", "none", "default"))
        result["loss"] = torch.allclose(found["default"], stacked.mean(), atol=1e-5)
    return result


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBV"])
def test_step_return_outputs_and_loss_kwargs_as_torch(world2, schedule):
    results = world2.run(_run_return_outputs, schedule)
    assert sum(r["last"] for r in results) == 1
    for r in results:
        assert r["grads"], r
        if r["last"]:
            assert r["types"] == {"merged": "tuple", "none": "NoneType", "default": "Tensor"}, r
            assert r["outputs"] and r["losses"] and r["loss"], r
        else:
            assert r["types"] == {"merged": "NoneType", "none": "NoneType",
                                  "default": "NoneType"}, r


def _bad_option(what: str):
    """A torch-style option with a value shardkit cannot use, on one rank: the same clear error
    on every rank, on the first step and on a later one; and a bad scale_grads at construction."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if what == "scale_grads":
        return [_error_of(lambda: Schedule1F1B(PipelineStage(nn.Linear(D, D), rank, p), 2,
                                               F.mse_loss, scale_grads=1))]
    schedule = _pipeline([nn.Linear(D, D) for _ in range(p)], chunks=2, cls=Schedule1F1B)
    x, y = torch.randn(4, D), torch.randn(4, D)
    args = (x,) if rank == 0 else ()
    good = {"target": y} if rank == p - 1 else {}
    bad = dict(good)
    if what == "return_outputs" and rank == 0:
        bad["return_outputs"] = "yes"
    elif what == "loss_kwargs" and rank == p - 1:
        bad["loss_kwargs"] = [("reduction", "sum")]
    elif what == "scalar_output":
        schedule = _pipeline([nn.Linear(D, D) for _ in range(p - 1)] + [_Scalar()], chunks=2,
                             cls=Schedule1F1B)
        bad["return_outputs"] = True
    found = [_error_of(lambda: schedule.step(*args, **bad))]
    if what != "scalar_output":
        found.append(_error_of(lambda: schedule.step(*args, **good)))
        found.append(_error_of(lambda: schedule.step(*args, **bad)))
    return found


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 1)

    def forward(self, x):
        return self.lin(x).sum()


@pytest.mark.parametrize("what,name,words", [
    ("return_outputs", "ValueError", "step(return_outputs='yes'): expected True"),
    ("loss_kwargs", "ValueError", "step(loss_kwargs=list): expected a dict"),
    ("scalar_output", "ValueError", "step(return_outputs=True) concatenates"),
    ("scale_grads", "TypeError", "Schedule1F1B(scale_grads=1): expected True"),
])
def test_bad_torch_style_options_fail_clearly_on_every_rank(world2, what, name, words):
    results = world2.run(_bad_option, what)
    for k in range(len(results[0])):
        errors = {r[k] for r in results}
        assert len(errors) == 1, results
        error = errors.pop()
        if k == 1:
            assert error is None  # the good step between ran
            continue
        assert error[0] == name and words in error[1], error


def _run_inplace_first_layer(schedule_name: str) -> float:
    """A first stage starting with ``nn.ReLU(inplace=True)`` on a batch needing no gradient
    (several micro-batches, views of one batch before), beside one process: the worst gradient
    difference on this rank."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p = dist.get_world_size()
    rank, n, m = dist.get_rank(), p * per_rank, 4
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]

    def build():
        torch.manual_seed(0)
        return [nn.Sequential(nn.ReLU(inplace=True), nn.Linear(D, D))] + \
            [nn.Linear(D, D) for _ in range(n - 1)]

    modules, ref = build(), build()
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, m, F.mse_loss)
    x, y = _batch("mlp", 4, 2 * m)
    schedule.step(*(x.clone(),) if 0 in mine else (), target=y if n - 1 in mine else None)
    h = x.clone()  # one process, the whole batch (equal micro-batches: the same mean loss)
    for module in ref:
        h = module(h)
    F.mse_loss(h, y).backward()
    return max((a.grad - b.grad).abs().max().item() for s in mine
               for a, b in zip(modules[s].parameters(), ref[s].parameters()))


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "ZB-H1", "Interleaved1F1B"])
def test_an_inplace_first_layer_on_the_batch_trains_like_one_process(world2, schedule):
    # was: "its backward raised RuntimeError: one of the variables needed for gradient
    # computation has been modified by an inplace operation" (micro-batch views of one batch
    # share its version counter)
    assert max(world2.run(_run_inplace_first_layer, schedule)) < 2e-6


class _ReentrantBlock(nn.Linear):
    """A stage whose forward is a DeepSpeed-style (reentrant) activation checkpoint."""

    def forward(self, x):
        from shardkit import checkpointing

        return checkpointing.checkpoint(super().forward, x)


def _reentrant_checkpoint_in_a_stage(block_cls):
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    modules = [nn.Linear(D, D)] + [block_cls(D, D) for _ in range(p - 1)]
    schedule = _pipeline(modules, chunks=2, cls=Schedule1F1B)
    x, y = torch.randn(4, D), torch.randn(4, D)
    return _error_of(lambda: schedule.step(*(x,) if rank == 0 else (),
                                           **({"target": y} if rank == p - 1 else {})))


def test_reentrant_activation_checkpoint_in_a_stage_names_the_way_out(world2):
    # the schedules split each backward (torch.autograd.grad): the reentrant checkpoint's
    # error must say so and name non_reentrant_checkpoint (it said "use .backward()")
    for name, message in world2.run(_reentrant_checkpoint_in_a_stage, _ReentrantBlock):
        assert name == "ValueError", message
        assert "pipeline schedules" in message and "non_reentrant_checkpoint" in message, message


class _TorchReentrantBlock(nn.Linear):
    """A stage checkpointed as torch's (and Hugging Face's default) reentrant checkpoint."""

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=True)


def test_torch_reentrant_checkpoint_in_a_stage_names_the_way_out(world2):
    # torch's own message only said "call .backward() without passing the `inputs` argument",
    # which a stage's author cannot do: the schedules run the stage's backward
    for name, message in world2.run(_reentrant_checkpoint_in_a_stage, _TorchReentrantBlock):
        assert name == "ValueError", message
        assert "pipeline schedules split each stage's backward" in message, message
        assert "use_reentrant=False" in message and "non_reentrant_checkpoint" in message, \
            message


def _torch_constructor_options():
    """torch's constructor options at their defaults are accepted by every schedule; another
    value is a ValueError naming the option, an unknown name a TypeError."""
    p, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, (cls, per_rank, placement) in SCHEDULES.items():
        n = p * per_rank
        mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]

        def build(**options):
            stages = [PipelineStage(nn.Linear(D, D), s, n, placement=placement) for s in mine]
            return cls(stages[0] if per_rank == 1 else stages, 2 * p, F.mse_loss, **options)

        build(args_chunk_spec=None, kwargs_chunk_spec=None, output_merge_spec=None,
              scale_grads=True)
        outcomes = []
        for options in ({"args_chunk_spec": (0,)}, {"output_merge_spec": {"x": 1}},
                        {"backward_requires_autograd": False}, {"chunk_spec": None}):
            try:
                build(**options)
                outcomes.append(None)
            except (TypeError, ValueError) as error:
                outcomes.append((type(error).__name__, str(error)))
        out[name] = outcomes
    return out


def test_torch_constructor_options_at_defaults_accepted_others_named(world2):
    for out in world2.run(_torch_constructor_options):
        for name, (spec, merge, autograd, unknown) in out.items():
            assert spec[0] == "ValueError" and "args_chunk_spec=(0,)" in spec[1], spec
            assert "split every tensor argument along dim 0" in spec[1], spec
            assert merge[0] == "ValueError" and "output_merge_spec" in merge[1], merge
            assert autograd[0] == "ValueError" and "backward_requires_autograd" in autograd[1]
            assert unknown == ("TypeError", f"{SCHEDULES[name][0].__name__}.__init__() got an "
                                            f"unexpected keyword argument 'chunk_spec'"), unknown


def _torch_positional_spec():
    """torch's 4th positional argument (args_chunk_spec) reached track_activation_memory and
    was silently taken as True: the batch split along dim 0, not the dim the spec named."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec
    p, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, (cls, per_rank, placement) in SCHEDULES.items():
        n = p * per_rank
        mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
        stages = [PipelineStage(nn.Linear(D, D), s, n, placement=placement) for s in mine]
        try:
            cls(stages[0] if per_rank == 1 else stages, 2 * p, F.mse_loss, (TensorChunkSpec(1),))
            out[name] = None
        except (TypeError, ValueError) as error:
            out[name] = (type(error).__name__, str(error))
    return out


def test_torch_chunk_spec_passed_by_position_is_refused(world2):
    for out in world2.run(_torch_positional_spec):
        for name, outcome in out.items():
            assert outcome is not None, f"{name} accepted args_chunk_spec by position"
            kind, message = outcome
            assert kind == "TypeError" and "track_activation_memory" in message, outcome
            assert "args_chunk_spec" in message and "by keyword" in message, outcome
