"""Pipeline schedules driven as ``torch.distributed.pipelining`` users drive them (world 2):
a batch the number of micro-batches does not divide (split as ``torch.tensor_split`` splits
it, the loss weighted so that training matches one process on the whole batch), keyword
chunk specs with a negative dimension or nested as the keyword's value, and ``eval(x)``
without a target on a schedule that has a ``loss_fn`` (the outputs come back).

Its review found:

Uneven micro-batches (a batch ``chunks`` does not divide) under the multi-process schedules,
world 2: a ``loss_fn`` that declares ``reduction="sum"`` keeps torch's ``1/chunks`` scaling
(the batch's summed loss over ``chunks``, every row weighted alike), and a keyword tensor the
first stage would cut at other rows than the batch is refused on every rank.
"""

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
    at other rows than the batch is named with both cuts."""
    for rank, (small, target, nested, rows, after) in enumerate(world2.run(_bad_requests)):
        assert "chunks=4 is larger than the batch size 3" in small, small
        assert "target of shape (3, 6) cannot be split into chunks=4 micro-batches" in target, \
            target
        assert "extra=...): kwargs_chunk_spec gives it a structure of specs {'scale': 0}" \
            in nested and "{'scale': Tensor, 'bias': Tensor}" in nested, nested
        # the target is checked against the batch before any loss_fn runs
        assert "target of shape (10, 6) is cut along dim 0 into chunks=4 micro-batches of " \
            "[3, 3, 2, 2] rows, but the batch's 8 rows into [2, 2, 2, 2]" in rows, rows
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


D_rev = 5


class _Scaled(nn.Module):
    """``tanh(lin(x))``, times a per-sample ``scale`` ``(rows, 1)`` when one is given, plus
    ``extra["scale"] * extra["bias"]`` when ``extra`` is given."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D_rev, D_rev)

    def forward(self, x, scale=None, extra=None):
        h = torch.tanh(self.lin(x))
        if extra is not None:
            h = h + extra["scale"] * extra["bias"]
        return h if scale is None else h * scale


def _pipeline_rev(schedule_name, chunks, loss_fn, **options):
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
    mine, modules, schedule, ref = _pipeline_rev(schedule_name, chunks, loss_fn)
    first, last = 0 in mine, len(ref) - 1 in mine
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, D_rev, generator=g), torch.randn(rows, D_rev, generator=g)
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
    mine, modules, schedule, ref = _pipeline_rev(schedule_name, 4, F.mse_loss)
    first, last = 0 in mine, len(ref) - 1 in mine
    found = []
    for rows, scale_rows in ((8, 8), (8, 6), (10, 9), (10, 10)):
        x, y = torch.randn(rows, D_rev), torch.randn(rows, D_rev)
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
    mine, modules, schedule, ref = _pipeline_rev("1F1B", 3, F.mse_loss,
                                                 kwargs_chunk_spec={"extra": nested})
    x, y = torch.randn(7, D_rev), torch.randn(7, D_rev)
    extra = {"scale": torch.rand(7, 1), "bias": torch.randn(D_rev)}
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
