"""Multi-process pipelines (world 2) on a ``loss_fn`` that does not declare what its mean
divides by, with ignored tokens (-100) spread unevenly over the micro-batches.

From a review: the loss watch did not follow cross-entropy heads combined through
``torch.stack([ce1, ce2]).sum()`` (or ``.mean()``), ``torch.add(ce1, ce2, alpha=0.5)``,
``ce1.add(ce2, alpha=0.5)``, ``ce1 - 0.5 * ce2`` or ``-ce``: the step was refused although
one process's result is known (each head weighted by the micro-batch's counted tokens). Nor
did it see a masked mean's count passed as a keyword (``torch.div(s, other=mask.sum())``,
``torch.mul(s, other=mask.sum().reciprocal())``), taken as the length or element count of the
picked tokens (``ce[mask].sum() / len(ce[mask])``, ``/ ce[mask].numel()``), or hidden in a
``nanmean`` over a target-masked tensor: those micro-batch means were weighted ``1/chunks``,
silently off one process's gradients and loss. Now the heads match one process, and the
masked means fail the step on every rank naming ``loss_denominator=`` when the counts differ
(and match one process when they do not).

From a review:

Review of a8668db (the pipeline ``loss_fn`` watch): counts of the picked tokens it missed.

A ``loss_fn`` that does not declare what its mean divides by, on micro-batches counting
uneven numbers of tokens (-100 spread unevenly). The picked tokens' count scaling a head
(``ce * y[kept].numel()``, ``torch.add(ce1, ce2, alpha=len(y[kept]))``: a token sum, not a
mean) was taken for a constant factor, so every micro-batch was weighted by its counted tokens
(gradients ~2 off one process's, the loss 17 off, no error); the picked tokens' count read
through ``.shape[0]`` or ``.size()[0]`` (``ce[kept].sum() / ce[kept].shape[0]``) was not seen,
so the masked mean was weighted ``1/chunks`` (gradients ~0.06 off). Now such a step fails on
every rank naming ``loss_denominator=``, and the next (even) step gives one process's
gradients and loss.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)

VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _lm():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)],
                         nn.Linear(WIDTH, 2 * VOCAB))


def _ce(out, y):
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _heads(out):
    return out[..., :VOCAB], out[..., VOCAB:]


def _per_token(out, y):
    return F.cross_entropy(out[..., :VOCAB].reshape(-1, VOCAB), y.reshape(-1).clamp(min=0),
                           reduction="none")


def _kept(y):
    return (y != -100).reshape(-1)


HEAD_COMBINATIONS = {
    "stack sum": lambda o, y: torch.stack([_ce(h, y) for h in _heads(o)]).sum(),
    "stack mean": lambda o, y: torch.stack([_ce(h, y) for h in _heads(o)]).mean(),
    "torch.add alpha": lambda o, y: torch.add(*[_ce(h, y) for h in _heads(o)], alpha=0.5),
    "Tensor.add alpha": lambda o, y: _ce(_heads(o)[0], y).add(_ce(_heads(o)[1], y), alpha=0.5),
    "difference": lambda o, y: _ce(_heads(o)[0], y) - 0.5 * _ce(_heads(o)[1], y),
    "negated": lambda o, y: -_ce(_heads(o)[0], y),
}

HIDDEN_COUNTS = {
    "div other=": lambda o, y: torch.div((_per_token(o, y) * _kept(y)).sum(),
                                         other=_kept(y).sum()),
    "mul other=reciprocal": lambda o, y: torch.mul((_per_token(o, y) * _kept(y)).sum(),
                                                   other=_kept(y).sum().reciprocal()),
    "len of picked": lambda o, y: _per_token(o, y)[_kept(y)].sum()
    / len(_per_token(o, y)[_kept(y)]),
    "numel of picked": lambda o, y: _per_token(o, y)[_kept(y)].sum()
    / _per_token(o, y)[_kept(y)].numel(),
    "nanmean": lambda o, y: torch.where(_kept(y), _per_token(o, y), float("nan")).nanmean(),
}


def _tokens(uneven):
    """Micro-batches counting 2, 4, 4 and 6 tokens (uneven) or 3 each."""
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, SEQ, WIDTH), torch.randint(0, VOCAB, (ROWS, SEQ))
    if uneven:
        y[:2, 1:] = -100
        y[2, :2] = -100
        y[4:6, 1:] = -100
    else:
        y[::2, 0] = -100
    return x, y


def _run(cls, loss_fn, uneven):
    """One 2-stage pipeline's step: (worst gradient difference from one process, returned
    loss, one process's loss), or the ValueError's text."""
    rank = dist.get_rank()
    stage = PipelineStage(split_sequential(_lm(), [2, 2])[rank], rank, 2)
    schedule = cls(stage, CHUNKS, lambda out, y: loss_fn(out, y))
    x, y = _tokens(uneven)
    try:
        loss = schedule.step(x, target=y)
    except ValueError as error:
        return str(error)
    reference = _lm()
    expected = loss_fn(reference(x), y)
    expected.backward()
    mine = list(reference)[2 * rank:2 * rank + 2]
    worst = max((p.grad - r.grad).abs().max().item() for p, r in
                zip(stage.module.parameters(), nn.Sequential(*mine).parameters()))
    return worst, None if loss is None else loss.item(), expected.item()


def _outcomes():
    results = {}
    for cls in (ScheduleGPipe, Schedule1F1B):
        for name, loss_fn in HEAD_COMBINATIONS.items():
            results[cls.__name__, name, "uneven"] = _run(cls, loss_fn, True)
        for name, loss_fn in HIDDEN_COUNTS.items():
            for uneven in (True, False):
                results[cls.__name__, name, "uneven" if uneven else "even"] = \
                    _run(cls, loss_fn, uneven)
    return results


def _assert_one_process(where, outcome, rank):
    assert isinstance(outcome, tuple), (where, outcome)
    worst, loss, expected = outcome
    assert worst < 1e-5, (where, worst)
    if rank == 1:
        assert abs(loss - expected) < 1e-5, (where, loss, expected)


def test_combined_heads_match_one_process_and_hidden_counts_are_refused(world2):
    """Was: combined heads refused; masked means with a keyword, length, element-count or
    nanmean count weighted 1/chunks (gradients about 0.06 off one process's, silently). Now
    the heads give one process's gradients and loss, the masked means a ValueError on every
    rank naming loss_denominator= on uneven counts and one process's result on even ones."""
    for rank, outcomes in enumerate(world2.run(_outcomes)):
        for (schedule, name, split), outcome in outcomes.items():
            where = (schedule, name, split, rank)
            if name in HIDDEN_COUNTS and split == "uneven":
                assert isinstance(outcome, str) and "loss_denominator=" in outcome and \
                    "a count taken from its target" in outcome, (where, outcome)
                continue
            _assert_one_process(where, outcome, rank)


VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _lm_rev():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * VOCAB))


def _ce_rev(out, y, head=0):
    return F.cross_entropy(out[..., head * VOCAB:(head + 1) * VOCAB].reshape(-1, VOCAB),
                           y.reshape(-1))


def _kept_rev(y):
    return y.reshape(-1) != -100


# A token count scaling a mean is no mean (``ce * n`` is a token sum): after its refusal the
# next step runs a plain cross-entropy; a masked mean runs again, on even counts.
NEXT = {"times numel of picked": _ce_rev, "alpha=len of picked": _ce_rev}

COUNTS_OF_PICKED = {
    "times numel of picked": lambda o, y: _ce_rev(o, y) * y.reshape(-1)[_kept_rev(y)].numel(),
    "alpha=len of picked": lambda o, y: torch.add(_ce_rev(o, y), _ce_rev(o, y, 1),
                                                  alpha=len(y.reshape(-1)[_kept_rev(y)])),
    "shape[0] of picked": lambda o, y: _per_token(o, y)[_kept_rev(y)].sum()
    / _per_token(o, y)[_kept_rev(y)].shape[0],
    "size()[0] of picked": lambda o, y: _per_token(o, y)[_kept_rev(y)].sum()
    / _per_token(o, y)[_kept_rev(y)].size()[0],
}


def _targets(uneven):
    """Micro-batches counting 2, 4, 4 and 6 tokens (uneven) or 4 each."""
    torch.manual_seed(1)
    y = torch.randint(0, VOCAB, (ROWS, SEQ))
    if uneven:
        y[:2, 1:] = -100
        y[2, :2] = -100
        y[4:6, 1:] = -100
    else:
        y[::2, 0] = -100
    return y


def _uneven_then_even(names):
    """Per schedule and loss: the uneven step's ValueError text (or "not refused"), then the
    next (even) step's worst gradient and loss differences from one process."""
    rank, results = dist.get_rank(), {}
    torch.manual_seed(3)
    x = torch.randn(ROWS, SEQ, WIDTH)
    for cls in (ScheduleGPipe, Schedule1F1B):
        for name in names:
            current = {"loss_fn": COUNTS_OF_PICKED[name]}
            stage = PipelineStage(split_sequential(_lm_rev(), [1, 1])[rank], rank, 2)
            schedule = cls(stage, CHUNKS, lambda out, y: current["loss_fn"](out, y))
            try:
                schedule.step(x, target=_targets(uneven=True))
                refused = "not refused"
            except ValueError as error:
                refused = str(error)
            stage.module.zero_grad()
            current["loss_fn"] = NEXT.get(name, current["loss_fn"])
            loss = schedule.step(x, target=_targets(uneven=False))
            reference = _lm_rev()
            expected = current["loss_fn"](reference(x), _targets(uneven=False))
            expected.backward()
            worst = max((p.grad - r.grad).abs().max().item()
                        for p, r in zip(stage.module.parameters(), reference[rank].parameters()))
            results[cls.__name__, name] = refused, worst, \
                0.0 if loss is None else abs(loss.item() - expected.item())
    return results


def test_counts_of_picked_tokens_are_refused_on_uneven_counts_and_the_next_step_matches(world2):
    """Was: the uneven step ran, weighted by the counted tokens (a token count taken for a
    constant factor) or 1/chunks (``.shape[0]`` unseen), far off one process's gradients, no
    error. Now a ValueError on both ranks naming loss_denominator= and the count, and the
    next, even, step gives one process's gradients and loss."""
    for rank, results in enumerate(world2.run(_uneven_then_even, sorted(COUNTS_OF_PICKED))):
        for where, (refused, worst, loss_off) in results.items():
            assert "loss_denominator=" in refused and "micro-batch 1" in refused, \
                (rank, where, refused)
            assert worst < 1e-5 and loss_off < 1e-5, (rank, where, worst, loss_off)
