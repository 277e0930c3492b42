"""Pipeline schedules driven as ``torch.distributed.pipelining`` users drive them (world 2):
a batch the number of micro-batches does not divide (split as ``torch.tensor_split`` splits
it, the loss weighted so that training matches one process on the whole batch), keyword
chunk specs with a negative dimension or nested as the keyword's value, and ``eval(x)``
without a target on a schedule that has a ``loss_fn`` (the outputs come back)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture
from tests.nn.test_torch_pipelining_suite import SCHEDULES

D = 6
world2 = world_fixture(2, timeout=240)


class _Keyed(nn.Module):
    """``tanh(lin(x)) * scale + shift.T + bias``, each keyword optional: ``shift`` a ``(D,
    rows)`` column per sample (split along its last dimension), ``extra`` a dict holding the
    per-sample ``scale`` ``(rows, 1)`` and, optionally, a ``bias`` ``(D,)`` shared by every
    sample."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, shift=None, extra=None):
        h = torch.tanh(self.lin(x))
        if extra is not None:
            h = h * extra["scale"] + extra.get("bias", 0.0)
        return h if shift is None else h + shift.t()


def _pipeline(schedule_name, chunks, **options):
    """This rank's stages of ``_Keyed`` layers placed as the schedule places them, its
    schedule (mse loss), and the reference layers (one process)."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    torch.manual_seed(0)
    ref = [_Keyed() for _ in range(n)]
    torch.manual_seed(0)
    modules = [_Keyed() for _ in range(n)]
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, F.mse_loss, **options)
    return schedule, mine, modules, ref


def _reference(ref, x, y, chunks, **kwargs):
    """One process on the whole batch: its loss (backpropagated) and each micro-batch's."""
    h = x
    for module in ref:
        h = module(h, **kwargs)
    whole = F.mse_loss(h, y)
    whole.backward()
    return whole.detach(), [F.mse_loss(a, b).detach() for a, b in
                            zip(h.tensor_split(chunks), y.tensor_split(chunks))]


def _worst_grad(mine, modules, ref):
    return max((a.grad - b.grad).abs().max().item() for s in mine
               for a, b in zip(modules[s].parameters(), ref[s].parameters()))


def _uneven_training(schedule_name, rows, chunks, keywords):
    """Two SGD steps on batches of ``rows`` rows in ``chunks`` micro-batches (``keywords``:
    with per-sample keyword tensors, split along their last dimension and inside a dict),
    beside one process on the whole batch: the worst gradient, returned-loss and
    per-micro-batch-loss differences, or the step's error."""
    options = {"kwargs_chunk_spec": {"shift": TensorChunkSpec(-1),
                                     "extra": {"scale": TensorChunkSpec(0),
                                               "bias": _Replicate()}}} if keywords else {}
    schedule, mine, modules, ref = _pipeline(schedule_name, chunks, **options)
    first, last = 0 in mine, len(ref) - 1 in mine
    opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.5)
    ref_opt = torch.optim.SGD([q for m in ref for q in m.parameters()], lr=0.5)
    worst = {"grad": 0.0, "loss": 0.0, "losses": 0.0}
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
        kwargs = {"shift": torch.randn(D, rows, generator=g),
                  "extra": {"scale": torch.rand(rows, 1, generator=g) + 0.5,
                            "bias": torch.randn(D, generator=g)}} if keywords else {}
        opt.zero_grad()
        ref_opt.zero_grad()
        losses = []
        try:
            loss = schedule.step(*((x,) if first else ()), target=y if last else None,
                                 losses=losses, **kwargs)
        except ValueError as error:
            return str(error)
        whole, parts = _reference(ref, x, y, chunks, **kwargs)
        worst["grad"] = max(worst["grad"], _worst_grad(mine, modules, ref))
        if last:
            worst["loss"] = max(worst["loss"], (loss - whole).abs().item())
            worst["losses"] = max([worst["losses"]] + [(a - b).abs().item()
                                                       for a, b in zip(losses, parts)])
        opt.step()
        ref_opt.step()
    return worst


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_batch_chunks_does_not_divide_trains_like_one_process(world2, schedule):
    """torch splits such a batch with ``tensor_split`` (10 rows in 4 micro-batches: 3, 3, 2,
    2); shardkit refused it. It now splits the same way, and weighs each micro-batch's mean
    loss by its share of the rows, so the gradients and the returned loss are one process's
    on the whole batch (torch's 1/chunks would weigh the short micro-batches' rows more); each
    micro-batch's own loss goes to ``losses``. Keyword tensors split the same way, along a
    negative dimension and inside a dict of specs (both refused before)."""
    cases = [(10, 4, False), (7, 3, True)] if schedule in ("GPipe", "ZBV") else [(10, 4, True)]
    for rows, chunks, keywords in cases:
        for rank, worst in enumerate(world2.run(_uneven_training, schedule, rows, chunks,
                                                keywords)):
            assert isinstance(worst, dict), (schedule, rows, chunks, rank, worst)
            assert max(worst.values()) < 1e-5, (schedule, rows, chunks, rank, worst)


def _bad_requests():
    """What each rank raises for: fewer rows than chunks, a target with fewer rows than
    chunks, a nested spec whose structure is not the keyword's value, and a target whose
    micro-batches do not fit the output's."""
    schedule, mine, modules, ref = _pipeline(
        "GPipe", 4, kwargs_chunk_spec={"extra": {"scale": TensorChunkSpec(0)}})
    first, last = 0 in mine, len(ref) - 1 in mine
    found = []
    extra = {"scale": torch.ones(8, 1), "bias": torch.zeros(D)}
    for x, y, kwargs in ((torch.randn(3, D), torch.randn(3, D), {}),
                         (torch.randn(8, D), torch.randn(3, D), {}),
                         (torch.randn(8, D), torch.randn(8, D), {"extra": extra}),
                         (torch.randn(8, D), torch.randn(10, D), {})):
        try:
            schedule.step(*((x,) if first else ()), target=y if last else None, **kwargs)
            found.append(None)
        except ValueError as error:
            found.append(str(error))
    # the pipeline goes on: an uneven batch with a matching nested spec trains
    extra = {"scale": torch.ones(9, 1)}
    found.append(schedule.step(*((torch.randn(9, D),) if first else ()),
                               target=torch.randn(9, D) if last else None, extra=extra))
    return found


def test_what_cannot_be_split_is_still_one_clear_error_on_every_rank(world2):
    """torch refuses fewer rows than micro-batches too; a nested spec that does not match the
    keyword's value is named rather than pairing specs with the wrong tensors; a target cut
    into micro-batches that do not fit the output's says how it was cut."""
    for rank, (small, target, nested, rows, after) in enumerate(world2.run(_bad_requests)):
        assert "chunks=4 is larger than the batch size 3" in small, small
        assert "target of shape (3, 6) cannot be split into chunks=4 micro-batches" in target, \
            target
        assert "extra=...): kwargs_chunk_spec gives it a structure of specs {'scale': 0}" \
            in nested and "{'scale': Tensor, 'bias': Tensor}" in nested, nested
        assert "micro-batch 0: loss_fn raised RuntimeError" in rows, rows
        assert "(its target has 3 rows, its output 2: the target's 10 rows are cut into " \
            "chunks=4 micro-batches along dim 0 with torch.tensor_split" in rows, rows
        assert (after is not None) == (rank == 1), after


def _eval_without_target(schedule_name):
    """``eval(x)`` (no target) on a schedule built with a ``loss_fn``, then a training step:
    the worst difference of the returned outputs from one process's, how many losses were
    recorded, and the training step's returned loss against one process's."""
    schedule, mine, modules, ref = _pipeline(schedule_name, 2)
    first, last = 0 in mine, len(ref) - 1 in mine
    x, y = torch.randn(4, D), torch.randn(4, D)
    losses = []
    try:
        out = schedule.eval(*((x,) if first else ()), losses=losses)
    except ValueError as error:
        return str(error)
    loss = schedule.step(*((x,) if first else ()), target=y if last else None)
    with torch.no_grad():
        h = x
        for module in ref:
            h = module(h)
    if not last:
        return out is None and loss is None
    return (out - h).abs().max().item(), len(losses), (loss - F.mse_loss(h, y)).abs().item()


@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_eval_without_a_target_returns_the_outputs(world2, schedule):
    """``eval(x)`` with a ``loss_fn`` but no target has no loss to compute: it raised 'the
    last stage needs the target' (torch's raises a TypeError); it now returns the last stage's
    merged outputs, as without a ``loss_fn``, and the next training step is unaffected."""
    last_rank = 0 if schedule == "ZBV" else 1  # ZBV's V puts the last stage on rank 0
    for rank, result in enumerate(world2.run(_eval_without_target, schedule)):
        if rank == last_rank:
            assert isinstance(result, tuple), result
            worst, recorded, loss_diff = result
            assert worst < 1e-6 and recorded == 0 and loss_diff < 1e-6, result
        else:
            assert result is True, result
