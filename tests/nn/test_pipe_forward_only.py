"""Pipeline schedules in corners a demanding user reaches, on every schedule: a forward-only
step (``eval`` or ``torch.no_grad()``) whose stage output is a tensor requiring grad that no op
recorded (the batch passed on, a parameter returned as it is), between training steps; and a
stage output that the next stage ignores or detaches on some micro-batches (no gradient comes
back for it, so what only it depends on keeps ``.grad`` ``None``, as in one process)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture
from tests.nn.test_torch_pipelining_suite import SCHEDULES  # name -> (class, per rank, placement)

D = 6
world2 = world_fixture(2, timeout=90)


class _PassOn(nn.Module):
    """Returns its new hidden state and, beside it, its input as it is (a residual stream
    handed on; on the first stage, the batch itself)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        if isinstance(x, tuple):
            x = x[0] + x[1]
        return torch.tanh(self.lin(x)), x


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, parts):
        return self.lin(parts[0] * parts[1])


def _modules(n: int) -> list:
    torch.manual_seed(0)
    return [_PassOn() for _ in range(n - 1)] + [_Head()]


def _oracle(modules, x, y, chunks: int, backward: bool) -> list:
    losses = []
    for xi, yi in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
        h = xi
        for module in modules:
            h = module(h)
        losses.append(F.mse_loss(h, yi))
    if backward:
        (sum(losses) / chunks).backward()
    return [loss.detach() for loss in losses]


def _my_stages(schedule_name: str, build) -> tuple:
    """This rank's part of a pipeline of ``build(n)``'s modules placed as the schedule places
    them: (the schedule class, the stage argument it takes, this rank's stage indices, the
    modules, the number of stages)."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    modules = build(n)
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    return cls, stages[0] if per_rank == 1 else stages, mine, modules, n


def _train_eval_train(schedule_name: str) -> dict:
    """Train, evaluate (``eval``, then a step under ``torch.no_grad()``) with a batch that
    requires grad, train again; beside one process. The worst loss / gradient difference,
    and whether the forward-only steps left ``.grad`` as it was."""
    cls, staged, mine, modules, n = _my_stages(schedule_name, _modules)
    ref, chunks = _modules(n), 2
    schedule = cls(staged, chunks, F.mse_loss)
    first, last = 0 in mine, n - 1 in mine
    worst, untouched = 0.0, True
    for step, mode in enumerate(("train", "eval", "no_grad", "train")):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, D, generator=g).requires_grad_()
        y = torch.randn(4, D, generator=g)
        x_ref = x.detach().clone().requires_grad_()
        training = mode == "train"
        if training:
            for module in modules + ref:
                module.zero_grad()
        before = [q.grad.clone() for s in mine for q in modules[s].parameters()
                  if q.grad is not None]
        args, losses = ((x,) if first else ()), []
        with torch.set_grad_enabled(mode != "no_grad"):
            run = schedule.eval if mode == "eval" else schedule.step
            out = run(*args, target=y if last else None, losses=losses)
            expected = _oracle(ref, x_ref, y, chunks, backward=training)
        if last:
            worst = max([worst, abs(out.item() - torch.stack(expected).mean().item())]
                        + [abs(a.item() - b.item()) for a, b in zip(losses, expected)])
        if training:
            pairs = [(a.grad, b.grad) for s in mine
                     for a, b in zip(modules[s].parameters(), ref[s].parameters())]
            if first:
                pairs.append((x.grad, x_ref.grad))
            worst = max([worst] + [(a - b).abs().max().item() for a, b in pairs])
        else:
            after = [q.grad for s in mine for q in modules[s].parameters() if q.grad is not None]
            untouched &= len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after))
            untouched &= x.grad is None
    return {"worst": worst, "untouched": untouched}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_forward_only_step_with_a_leaf_output_requiring_grad(world2, schedule):
    """A forward-only step whose first stage hands on the batch itself, which requires grad:
    the step used to backpropagate into that leaf on the first rank after the other ranks had
    finished, fail there alone and hang in the error's all-gather. It must record nothing,
    leave ``.grad`` alone, and training must go on matching one process."""
    for result in world2.run(_train_eval_train, schedule):
        assert result["worst"] < 1e-5, result
        assert result["untouched"], result


def _inference(schedule_name: str) -> dict:
    """torch's inference with a schedule: built without ``loss_fn``, ``eval(x,
    return_outputs=True)`` with no target; then a schedule with a ``loss_fn``, evaluated
    without a target under ``torch.no_grad()``. The worst difference from one process's
    outputs, and what the last stage's ``losses`` received."""
    cls, staged, mine, modules, n = _my_stages(schedule_name, _modules)
    ref, chunks = _modules(n), 2
    first, last = 0 in mine, n - 1 in mine
    worst, received = 0.0, []
    for loss_fn in (None, F.mse_loss):
        schedule = cls(staged, chunks, loss_fn)
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(len(received)))
        losses = []
        with torch.no_grad():
            if loss_fn is None:
                out = schedule.eval(*((x,) if first else ()), losses=losses,
                                    return_outputs=True)
            else:
                out = schedule.step(*((x,) if first else ()), losses=losses,
                                    return_outputs=True)
            h = x
            for module in ref:
                h = module(h)
        if last:
            worst = max(worst, (out - h).abs().max().item())
        else:
            assert out is None
        received.append(len(losses))
    return {"worst": worst, "losses": received}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_inference_without_target_or_loss_fn_returns_the_outputs(world2, schedule):
    """``eval(x, return_outputs=True)`` on a schedule built without ``loss_fn`` (torch's
    inference), and a forward-only step without a target, return the last stage's outputs
    (they were refused: 'the last stage needs loss_fn / the target')."""
    for result in world2.run(_inference, schedule):
        assert result["worst"] < 1e-6, result
        assert result["losses"] == [0, 0], result


def _route(x, use):
    """What a stage computes from its input ``(h, g)`` on a micro-batch marked ``use``: 0 h
    only (g gets no gradient), 1 both, 2 g only (h gets none), 3 neither (the whole input gets
    none), 4 g detached."""
    if not isinstance(x, tuple):
        return x
    h, g = x
    return {0: lambda: h, 1: lambda: h + g, 2: lambda: g, 3: lambda: torch.zeros_like(h),
            4: lambda: h + g.detach()}[int(use[0])]()


class _Fork(nn.Module):
    """Two outputs from two layers, so each layer's gradient depends on one output only."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, use):
        h = _route(x, use)
        return torch.tanh(self.a(h)), self.b(h)


class _Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, use):
        return self.lin(_route(x, use))


def _fork_modules(n: int) -> list:
    torch.manual_seed(0)
    return [_Fork() for _ in range(n - 1)] + [_Join()]


# per step, each micro-batch's ``use``: an output unused on every micro-batch, on some, none
ROUTES = [[0, 0, 0, 0], [0, 1, 2, 3], [2, 2, 2, 2], [3, 3, 3, 3], [4, 0, 4, 4], [1, 1, 1, 1]]


def _unused_outputs(schedule_name: str) -> dict:
    """AdamW (weight decay) through steps whose stages ignore or detach some of the previous
    stage's outputs (``ROUTES``; the batch requires grad on odd steps), beside one process: the
    worst gradient / parameter / batch-gradient difference, and where ``.grad`` is ``None`` on
    one side only."""
    cls, staged, mine, modules, n = _my_stages(schedule_name, _fork_modules)
    ref, chunks = _fork_modules(n), 4
    schedule = cls(staged, chunks, F.mse_loss)
    opt = torch.optim.AdamW([q for s in mine for q in modules[s].parameters()], lr=0.1,
                            weight_decay=0.1)
    ref_opt = torch.optim.AdamW([q for m in ref for q in m.parameters()], lr=0.1,
                                weight_decay=0.1)
    first, last = 0 in mine, n - 1 in mine
    worst, one_sided = 0.0, []
    for step, route in enumerate(ROUTES):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        x.requires_grad_(step % 2 == 1)
        x_ref = x.detach().clone().requires_grad_(x.requires_grad)
        use = torch.tensor(route).repeat_interleave(2)
        opt.zero_grad()
        ref_opt.zero_grad()
        schedule.step(*((x,) if first else ()), target=y if last else None, use=use)
        loss = 0
        for xi, yi, ui in zip(x_ref.tensor_split(chunks), y.tensor_split(chunks),
                              use.tensor_split(chunks)):
            h = xi
            for module in ref:
                h = module(h, ui)
            loss = loss + F.mse_loss(h, yi) / chunks
        loss.backward()
        pairs = [(f"stage {s} {name}", a.grad, b.grad) for s in mine for (name, a), b in
                 zip(modules[s].named_parameters(), ref[s].parameters())]
        if first:
            pairs.append(("the batch", x.grad, x_ref.grad))
        for name, a, b in pairs:
            if (a is None) != (b is None):
                one_sided.append((step, name, "None" if a is None else "a gradient"))
            elif a is not None:
                worst = max(worst, (a - b).abs().max().item())
        opt.step()
        ref_opt.step()
        worst = max([worst] + [(a - b).abs().max().item() for s in mine for a, b in
                               zip(modules[s].parameters(), ref[s].parameters())])
    return {"worst": worst, "one_sided": one_sided}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_an_output_the_next_stage_does_not_use_gets_no_gradient(world2, schedule):
    """A stage returning ``(a(x), b(x))`` whose next stage uses only ``a``'s output (or
    detaches ``b``'s, or uses neither) on some micro-batches: ``b`` got a gradient of zeros
    (the next stage sent zeros for the gradient it did not have), so AdamW decayed and moved
    it where one process leaves it alone (``.grad`` ``None``). A presence flag per gradient
    tensor now leaves such outputs out of the backward, under every schedule, with the batch
    requiring grad or not."""
    for result in world2.run(_unused_outputs, schedule):
        assert result["one_sided"] == [], result
        assert result["worst"] < 1e-5, result


def _train_after_inference(schedule_name: str) -> list:
    """A schedule built without ``loss_fn`` runs inference, then is asked to train (with and
    without a target): the same clear error on every rank, naming ``loss_fn``."""
    cls, staged, mine, modules, n = _my_stages(schedule_name, _modules)
    schedule = cls(staged, 2)
    first, last = 0 in mine, n - 1 in mine
    x, y = torch.randn(4, D), torch.randn(4, D)
    args = (x,) if first else ()
    found = []
    for call in (lambda: schedule.eval(*args, return_outputs=True),
                 lambda: schedule.step(*args, target=y if last else None),
                 lambda: schedule.eval(*args, return_outputs=True),
                 lambda: schedule.eval(*args, target=y if last else None)):
        try:
            call()
            found.append(None)
        except ValueError as error:
            found.append(str(error))
    return found


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_step_needing_the_loss_after_inference_names_loss_fn(world2, schedule):
    results = world2.run(_train_after_inference, schedule)
    for found in results:
        assert found[0] is None and found[2] is None, found
        for message in (found[1], found[3]):
            assert message is not None and "loss_fn=...)" in message, found
            assert "not callable" not in message, found
