"""What a ``torch.distributed.pipelining`` user passes to and gets from shardkit's multi-process
schedules, beside one process on the same batch (world 2): keyword arguments holding tuples,
lists and dicts of tensors (split like the batch, as torch does), a keyword argument of the first
stage's rank whose value (an int, a 0-dim tensor) changes the stage's output shapes from step to
step under schedules with several stages per rank, ``return_outputs=True`` on a last stage that
returns a dict, and torch's ``PipelineStage(module, stage_index, num_stages, device)``."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV)
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

D = 6
world2 = world_fixture(2, timeout=240)

# name -> (schedule class, stages per rank, placement)
SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), "1F1B": (Schedule1F1B, 1, "loop"),
             "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"),
             "ZBV": (ScheduleZBV, 2, "v")}


class _Layer(nn.Module):
    """A stage taking keyword arguments: ``extra`` (nested tensors, one row per sample) and
    ``keep`` (how many features to keep, an int or a 0-dim tensor: it decides the output's
    shape); pads a narrower input back to ``D``; returns a dict when ``last``."""

    def __init__(self, last=False):
        super().__init__()
        self.lin, self.last = nn.Linear(D, D), last

    def forward(self, x, extra=None, keep=None):
        if x.shape[1] < D:
            x = F.pad(x, (0, D - x.shape[1]))
        h = torch.tanh(self.lin(x))
        if extra is not None:
            h = h * extra["scale"] + extra["shift"][0]
        if self.last:
            return {"out": h, "pair": (h.sum(1, keepdim=True), x)}
        return h if keep is None else h[:, :int(keep)]


def _loss(output, target):
    return F.mse_loss(output["out"], target)


def _pipeline(name: str, modules: list):
    cls, per_rank, placement = SCHEDULES[name]
    n, rank = len(modules), dist.get_rank()
    mine = [s for s in range(n) if stage_rank(s, n, 2, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    return cls(stages[0] if per_rank == 1 else stages, 2, _loss), mine


def _one_process(modules: list, x, **kwargs):
    for m in modules:
        x = m(x, **kwargs)
    return x


def _steps_with_keywords(name: str, nested: bool) -> list:
    """Training steps given nested tensors (``extra``) or a ``keep`` that changes value (None,
    4, 3, a 0-dim 2, a 0-dim 3): |loss - one process's loss| and the worst |weight - one
    process's weight| after each step, on every rank ("error" for a step that raised)."""
    n = 2 * SCHEDULES[name][1]
    torch.manual_seed(0)
    modules = [_Layer(last=s == n - 1) for s in range(n)]
    torch.manual_seed(0)
    reference = [_Layer(last=s == n - 1) for s in range(n)]
    schedule, mine = _pipeline(name, modules)
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.1)
    found = []
    keeps = (None,) * 3 if nested else (None, 4, 3, torch.tensor(2), torch.tensor(3))
    for step, keep in enumerate(keeps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
        extra = {"scale": torch.rand(4, 1, generator=g), "shift": [torch.randn(4, D, generator=g)]}
        extra = extra if nested else None
        opt.zero_grad()
        ref_opt.zero_grad()
        halves = [_loss(_one_process(reference, x[rows], extra=extra and {
            "scale": extra["scale"][rows], "shift": [extra["shift"][0][rows]]}, keep=keep),
            y[rows]) for rows in (slice(0, 2), slice(2, 4))]
        ref_loss = sum(halves) / 2
        ref_loss.backward()
        ref_opt.step()
        try:
            loss = schedule.step(*((x,) if 0 in mine else ()), target=y if n - 1 in mine else None,
                                 extra=extra, keep=keep)
        except ValueError:
            found.append("error")
            continue
        opt.step()
        weights = max((p - q).abs().max().item() for s in mine for p, q in
                      zip(modules[s].parameters(), reference[s].parameters()))
        found.append((0.0 if loss is None else abs(loss.item() - ref_loss.item()), weights))
    return found


def _assert_like_one_process(world2, names, nested):
    for name in names:
        for rank, steps in enumerate(world2.run(_steps_with_keywords, name, nested)):
            assert "error" not in steps, (name, rank, steps)
            for loss, weights in steps:
                assert loss < 1e-6 and weights < 1e-6, (name, rank, steps)


def test_nested_keyword_arguments_are_split_like_the_batch(world2):
    """Before: a tuple, list or dict keyword argument reached every micro-batch whole (torch
    splits the tensors inside), so the stage's forward raised on a shape mismatch (or
    broadcast it)."""
    _assert_like_one_process(world2, SCHEDULES, nested=True)


def test_a_keyword_value_that_changes_output_shapes_runs_with_several_stages_per_rank(world2):
    """Before: with several stages per rank a step whose ``keep`` (an int, a 0-dim tensor)
    differed from the last step's only in value reused the last step's shape headers and
    failed on every rank ("expected an output of float32 (2, 4)")."""
    _assert_like_one_process(world2, ("Interleaved1F1B", "ZBV"), nested=False)


def _merged_dict_outputs(name: str):
    """``step`` and ``eval`` with ``return_outputs=True`` on a last stage returning a dict
    holding a tuple: the worst |merged - one process's output| on the last stage's rank."""
    n = 2 * SCHEDULES[name][1]
    torch.manual_seed(0)
    modules = [_Layer(last=s == n - 1) for s in range(n)]
    schedule, mine = _pipeline(name, modules)
    x, y = torch.randn(4, D), torch.randn(4, D)
    worst = 0.0
    for run in (lambda: schedule.step(*((x,) if 0 in mine else ()),
                                      target=y if n - 1 in mine else None,
                                      return_outputs=True),
                lambda: schedule.eval(*((x,) if 0 in mine else ()), return_outputs=True)):
        merged = run()
        if n - 1 not in mine:
            assert merged is None
            continue
        with torch.no_grad():
            expected = _one_process(modules, x)
        assert sorted(merged) == ["out", "pair"] and isinstance(merged["pair"], tuple)
        for got, want in ((merged["out"], expected["out"]), *zip(merged["pair"],
                                                                 expected["pair"])):
            assert got.shape == want.shape and not got.requires_grad
            worst = max(worst, (got - want).abs().max().item())
    return worst


def test_return_outputs_merges_a_dict_output_as_torch_does(world2):
    """Before: a last stage returning a dict (a Hugging Face style output) failed
    ``step(return_outputs=True)`` on every rank ("it returned ['dict']"); torch's
    ``merge_chunks`` concatenates each tensor in the output's structure."""
    for name in ("GPipe", "ZBV"):
        assert max(world2.run(_merged_dict_outputs, name)) < 1e-6, name
