"""Multi-process pipelines (world 4) on two complaints from review.

A ``loss_fn`` that does not declare what its mean divides by, with ignored tokens (-100)
spread unevenly over the micro-batches, was weighted ``1/chunks`` per micro-batch (gradients
and loss off one process's, silently) in three shapes: two cross-entropy heads added up, a
masked mean divided by hand (``(ce * mask).sum() / mask.sum()``), and a guard returning zero
for a first micro-batch whose tokens are all ignored. Now the heads and the guard give one
process's gradients and loss (GPipe, 1F1B; eval too); the hand-made masked mean, whose count
cannot be predicted, fails the step on every rank naming ``loss_denominator=`` when the
counts differ, and matches one process when they do not.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
from shardkit.testing import world_fixture

world4 = world_fixture(4, timeout=120)

VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _lm():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)],
                         nn.Linear(WIDTH, 2 * VOCAB))


def _two_heads(out, y):
    first, second = out[..., :VOCAB], out[..., VOCAB:]
    return F.cross_entropy(first.reshape(-1, VOCAB), y.reshape(-1)) + \
        F.cross_entropy(second.reshape(-1, VOCAB), y.reshape(-1))


def _masked_mean(out, y):
    mask = (y != -100).float().reshape(-1)
    per_token = F.cross_entropy(out[..., :VOCAB].reshape(-1, VOCAB), y.reshape(-1).clamp(min=0),
                                reduction="none")
    return (per_token * mask).sum() / mask.sum()


def _guarded(out, y):
    if (y == -100).all():
        return out.sum() * 0
    return F.cross_entropy(out[..., :VOCAB].reshape(-1, VOCAB), y.reshape(-1))


def _tokens(uneven=True):
    """Micro-batch 0 all ignored, the others counting 4, 4 and 6 tokens (or all counted)."""
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, SEQ, WIDTH), torch.randint(0, VOCAB, (ROWS, SEQ))
    if uneven:
        y[:2] = -100
        y[2, :2] = -100
        y[4:6, 1:] = -100
    return x, y


def _run(cls, loss_fn, kind, uneven=True):
    """One 4-stage pipeline's ``kind`` step: (worst gradient difference from one process,
    returned loss, one process's loss), or the ValueError's text."""
    rank = dist.get_rank()
    stage = PipelineStage(split_sequential(_lm(), [1] * 4)[rank], rank, 4)
    schedule = cls(stage, CHUNKS, lambda out, y: loss_fn(out, y))
    x, y = _tokens(uneven)
    try:
        loss = getattr(schedule, kind)(x, target=y)
    except ValueError as error:
        return str(error)
    reference = _lm()
    expected = loss_fn(reference(x), y)
    expected.backward()
    worst = 0.0 if kind == "eval" else max(
        (p.grad - r.grad).abs().max().item()
        for p, r in zip(stage.module.parameters(), reference[rank].parameters()))
    return worst, None if loss is None else loss.item(), expected.item()


def _loss_outcomes():
    results = {}
    for cls in (ScheduleGPipe, Schedule1F1B):
        for name, loss_fn, kind, uneven in (
                ("two heads", _two_heads, "step", True), ("guarded", _guarded, "step", True),
                ("guarded", _guarded, "eval", True), ("masked", _masked_mean, "step", True),
                ("masked, even", _masked_mean, "step", False)):
            results[cls.__name__, name, kind] = _run(cls, loss_fn, kind, uneven)
    return results


def test_a_loss_fn_weighting_by_tokens_matches_one_process_or_is_refused(world4):
    """Was: 1/chunks weights for two heads, a guarded first micro-batch and a hand-made
    masked mean (gradients and loss off one process's). Now one process's, or, for the masked
    mean on uneven counts, a ValueError on every rank naming loss_denominator=."""
    for rank, outcomes in enumerate(world4.run(_loss_outcomes)):
        for (schedule, name, kind), outcome in outcomes.items():
            where = (schedule, name, kind, rank)
            if name == "masked":
                assert isinstance(outcome, str) and "loss_denominator=" in outcome and \
                    "micro-batch 1" in outcome and "a count taken from its target" in outcome, \
                    (where, outcome)
                continue
            assert isinstance(outcome, tuple), (where, outcome)
            worst, loss, expected = outcome
            assert worst < 1e-5, (where, worst)
            if rank == 3:
                assert abs(loss - expected) < 1e-5, (where, loss, expected)
