"""Uneven micro-batches (a batch ``chunks`` does not divide) under the multi-process schedules,
world 2: a ``loss_fn`` that declares ``reduction="sum"`` keeps torch's ``1/chunks`` scaling
(the batch's summed loss over ``chunks``, every row weighted alike), and a keyword tensor the
first stage would cut at other rows than the batch is refused on every rank."""

import functools

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

D = 5
world2 = world_fixture(2, timeout=240)


class _Scaled(nn.Module):
    """``tanh(lin(x))``, times a per-sample ``scale`` ``(rows, 1)`` when one is given, plus
    ``extra["scale"] * extra["bias"]`` when ``extra`` is given."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, scale=None, extra=None):
        h = torch.tanh(self.lin(x))
        if extra is not None:
            h = h + extra["scale"] * extra["bias"]
        return h if scale is None else h * scale


def _pipeline(schedule_name, chunks, loss_fn, **options):
    """This rank's stage indices, the stage modules, the schedule, and the reference layers."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    torch.manual_seed(0)
    ref = [_Scaled() for _ in range(n)]
    torch.manual_seed(0)
    modules = [_Scaled() for _ in range(n)]
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, loss_fn, **options)
    return mine, modules, schedule, ref


_SUMMING = {"partial": (functools.partial(F.mse_loss, reduction="sum"), None),
            "module": (nn.MSELoss(reduction="sum"), None),
            "loss_kwargs": (F.mse_loss, {"reduction": "sum"})}


def _summed_loss_step(schedule_name, how, rows, chunks):
    """One training step with a ``loss_fn`` declaring ``reduction="sum"`` (``how``): the
    worst gradient difference from one process's summed loss over ``chunks``, and (on the
    last stage's rank) the returned loss's difference from that loss."""
    loss_fn, loss_kwargs = _SUMMING[how]
    mine, modules, schedule, ref = _pipeline(schedule_name, chunks, loss_fn)
    first, last = 0 in mine, len(ref) - 1 in mine
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
    loss = schedule.step(*((x,) if first else ()), target=y if last else None,
                         loss_kwargs=loss_kwargs)
    h = x
    for module in ref:
        h = module(h)
    expected = F.mse_loss(h, y, reduction="sum") / chunks
    expected.backward()
    worst = max((a.grad - b.grad).abs().max().item() for s in mine
                for a, b in zip(modules[s].parameters(), ref[s].parameters()))
    return worst, (loss - expected).abs().item() if last else 0.0


@pytest.mark.parametrize("schedule", ["GPipe", "ZBV"])
def test_a_loss_declaring_sum_keeps_torchs_one_over_chunks_with_an_uneven_split(
        world2, schedule):
    """10 rows in 4 micro-batches (3, 3, 2, 2) with ``reduction="sum"`` and the default
    ``scale_grads=True``: torch divides every micro-batch's summed loss by ``chunks`` (the
    batch's sum over ``chunks``, as with an even split). The row-share weighting meant for a
    mean weighted the rows of the longer micro-batches more: gradients neither one process's
    sum nor that sum over ``chunks`` (0.37 off). Declared through a ``functools.partial``, a
    ``torch.nn`` loss module or ``loss_kwargs``, the sum now keeps ``1/chunks``."""
    for how in _SUMMING:
        for rank, (grad, loss) in enumerate(world2.run(_summed_loss_step, schedule, how,
                                                       10, 4)):
            assert grad < 1e-5 and loss < 1e-4, (schedule, how, rank, grad, loss)


def _keyword_rows_steps(schedule_name):
    """A step with a per-sample ``scale`` of the batch's rows, then steps whose ``scale`` the
    first stage would cut at other rows than the batch (``(batch rows, scale rows)``: 8 and 6,
    cut 2, 2, 1, 1 against 2, 2, 2, 2, which broadcast silently; 10 and 9), then a good step
    again: what each step returned or raised (a ValueError's text)."""
    mine, modules, schedule, ref = _pipeline(schedule_name, 4, F.mse_loss)
    first, last = 0 in mine, len(ref) - 1 in mine
    found = []
    for rows, scale_rows in ((8, 8), (8, 6), (10, 9), (10, 10)):
        x, y = torch.randn(rows, D), torch.randn(rows, D)
        kwargs = {"scale": torch.rand(scale_rows, 1) + 0.5} if first else {}
        try:
            loss = schedule.step(*((x,) if first else ()), target=y if last else None,
                                 **kwargs)
            found.append("loss" if loss is not None else None)
        except ValueError as error:
            found.append(str(error))
    return found


@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_a_keyword_tensor_cut_at_other_rows_than_the_batch_is_refused_everywhere(
        world2, schedule):
    """A keyword tensor with 6 rows beside a batch of 8 in 4 micro-batches was refused
    (6 % 4); since uneven splits it was cut 2, 2, 1, 1 and broadcast against the batch's
    micro-batches of 2, silently. The first stage's rank, which knows the batch, now refuses
    a keyword tensor whose micro-batches would not hold the batch's rows, through the step
    state it already sends (no collective more): one error on every rank, before any
    micro-batch runs, and the pipeline goes on."""
    last_rank = 0 if schedule == "ZBV" else 1
    for rank, (good, six, nine, again) in enumerate(world2.run(_keyword_rows_steps,
                                                               schedule)):
        expect = "loss" if rank == last_rank else None
        assert good == expect and again == expect, (rank, good, again)
        assert "step(scale=...): a tensor passed by keyword is split along dim 0 into " \
            "chunks=4 micro-batches of [2, 2, 1, 1] rows, but the batch's 8 rows into " \
            "[2, 2, 2, 2]" in six and "cannot run this step" in six, six
        assert "micro-batches of [3, 2, 2, 2] rows, but the batch's 10 rows into " \
            "[3, 3, 2, 2]" in nine and "give it 10 there" in nine, nine


def _spec_keys_in_another_order():
    """Rank 0 writes the nested spec of ``extra`` as ``{scale, bias}``, rank 1 as ``{bias,
    scale}`` (one split): the step's loss against one process's, or the error."""
    entries = [("scale", TensorChunkSpec(0)), ("bias", _Replicate())]
    nested = dict(entries if dist.get_rank() == 0 else entries[::-1])
    mine, modules, schedule, ref = _pipeline("1F1B", 3, F.mse_loss,
                                             kwargs_chunk_spec={"extra": nested})
    x, y = torch.randn(7, D), torch.randn(7, D)
    extra = {"scale": torch.rand(7, 1), "bias": torch.randn(D)}
    try:
        loss = schedule.step(*((x,) if 0 in mine else ()), target=y if 1 in mine else None,
                             extra=extra)
    except ValueError as error:
        return str(error)
    h = x
    for module in ref:
        h = module(h, extra=extra)
    return None if loss is None else (loss - F.mse_loss(h, y)).abs().item()


def test_nested_specs_whose_keys_are_written_in_another_order_agree(world2):
    """A nested spec pairs with a keyword's dict by key, so ranks that wrote its keys in
    another order split alike; the ranks' agreement compared the specs' repr and refused
    such ranks as disagreeing on the schedule."""
    first, last = world2.run(_spec_keys_in_another_order)
    assert first is None and isinstance(last, float) and last < 1e-6, (first, last)
