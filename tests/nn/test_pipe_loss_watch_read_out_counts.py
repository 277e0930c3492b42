"""Review of the pipeline ``loss_fn`` watch (3525cef): masked means it did not see.

A ``loss_fn`` that does not declare what its mean divides by, on micro-batches counting
uneven numbers of tokens, was weighted ``1/chunks`` silently (gradients ~0.1 off, the loss
NaN) where it averaged by its target's count in a way the watch did not follow: the count
read out as a Python number (``.sum().item()``, ``int(...)``) or multiplied by its reciprocal
(``* (1 / mask.sum())``), a mask written in place (``m[y == -100] = 0``), the picked elements
converted before their mean (``ce[mask].float().mean()``, ``.mean(0)``), or a class-index
mean beside a class-probability term (distillation). Now such a step fails on every rank
naming ``loss_denominator=``, the pipeline's next step runs, and on even counts the gradients
and loss are one process's.

Cross-entropy heads added up each times a constant (``0.5 * (ce1 + ce2)``, ``ce1 + 0.1 *
ce2``, ``(ce1 + ce2) / 2``) were taken for "another term added" and refused on uneven counts,
though weighting them by the counted tokens gives one process's loss exactly. Now they do
(1F1B and ZBV), while a term that is no class-index mean (``ce + 0 * aux``) is still refused.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleZBV, split_sequential
from shardkit.nn.pipe.loss_count import LossCountWatch
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)

VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _per_token(out, y):
    return F.cross_entropy(out[..., :VOCAB].reshape(-1, VOCAB), y.reshape(-1).clamp(min=0),
                           reduction="none")


def _divided_by_item(out, y):
    return _per_token(out, y)[y.reshape(-1) != -100].sum() / max((y != -100).sum().item(), 1)


def _divided_by_int(out, y):
    return (_per_token(out, y) * (y.reshape(-1) != -100)).sum() / int((y != -100).sum())


def _times_reciprocal(out, y):
    return (_per_token(out, y) * (y.reshape(-1) != -100)).sum() * (1 / (y != -100).sum())


def _mask_written_in_place(out, y):
    mask = torch.ones(y.numel())
    mask[y.reshape(-1) == -100] = 0
    return (_per_token(out, y) * mask).sum() / mask.sum()


def _picked_then_converted(out, y):
    return _per_token(out.double(), y)[y.reshape(-1) != -100].float().mean()


def _picked_mean_over_dim(out, y):
    return _per_token(out, y)[y.reshape(-1) != -100].mean(0)


def _with_distillation(out, y):
    hard = F.cross_entropy(out[..., :VOCAB].reshape(-1, VOCAB), y.reshape(-1))
    teacher = out[..., :VOCAB].detach().reshape(-1, VOCAB).softmax(-1)
    return hard + 0.5 * F.cross_entropy(out[..., VOCAB:].reshape(-1, VOCAB), teacher)


def _heads(out, y):
    first = F.cross_entropy(out[..., :VOCAB].reshape(-1, VOCAB), y.reshape(-1))
    return first, F.cross_entropy(out[..., VOCAB:].reshape(-1, VOCAB), y.reshape(-1))


def _half_sum(out, y):
    first, second = _heads(out, y)
    return 0.5 * (first + second)


def _weighted_sum(out, y):
    first, second = _heads(out, y)
    return first + 0.1 * second


def _sum_halved(out, y):
    first, second = _heads(out, y)
    return (first + second) / 2


def _zero_times_aux(out, y):
    return _heads(out, y)[0] + 0 * out.pow(2).mean()


SCALED_HEADS = {"0.5 * (a + b)": _half_sum, "a + 0.1 * b": _weighted_sum,
                "(a + b) / 2": _sum_halved}

HIDDEN_MEANS = {"item": _divided_by_item, "int": _divided_by_int,
                "1 / count": _times_reciprocal,
                "in place": _mask_written_in_place, "converted": _picked_then_converted,
                "mean(0)": _picked_mean_over_dim, "distillation": _with_distillation}


def _targets(uneven: bool):
    torch.manual_seed(1)
    y = torch.randint(0, VOCAB, (ROWS, SEQ))
    if uneven:  # micro-batches counting 5, 4, 2 and 6 tokens
        y[0, 0] = -100
        y[2, :2] = -100
        y[4:6, 1:] = -100
    return y


def _watched(loss_fn, uneven: bool) -> list:
    """What the watch says of each micro-batch's call: "ok", "refused" or "unwatched"."""
    targets = list(torch.tensor_split(_targets(uneven), CHUNKS))
    watch, said = LossCountWatch(targets), []
    torch.manual_seed(2)
    for index, target in enumerate(targets):
        if not watch.watching:
            said.append("unwatched")
            continue
        loss, record = watch.call(loss_fn, torch.randn(*target.shape, 2 * VOCAB), target, {})
        said.append("refused" if watch.observe(index, record, loss) else "ok")
    return said


@pytest.mark.parametrize("name", sorted(HIDDEN_MEANS))
def test_the_watch_follows_a_count_it_did_not_see(name):
    """Was: the watch stopped at micro-batch 0 ("unwatched": 1/chunks weights). Now uneven
    counts are refused from micro-batch 1 on, even ones accepted."""
    assert _watched(HIDDEN_MEANS[name], uneven=True) == ["ok"] + ["refused"] * 3
    assert _watched(HIDDEN_MEANS[name], uneven=False) == ["ok"] * 4


@pytest.mark.parametrize("name", sorted(SCALED_HEADS))
def test_heads_times_constants_are_counted(name):
    """Was: refused from micro-batch 1 on (uneven counts). Now counted like one head."""
    assert _watched(SCALED_HEADS[name], uneven=True) == ["ok"] * 4


def test_a_term_that_is_no_class_index_mean_is_still_refused():
    assert _watched(_zero_times_aux, uneven=True) == ["ok"] + ["refused"] * 3


def _lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * VOCAB))


def _steps(names):
    """Per loss: the uneven step's ValueError text (or its silent gradient error), then the
    even step's worst gradient difference from one process and loss difference."""
    rank, results = dist.get_rank(), {}
    torch.manual_seed(3)
    x = torch.randn(ROWS, SEQ, WIDTH)
    for name in names:
        loss_fn = HIDDEN_MEANS[name]
        stage = PipelineStage(split_sequential(_lm(), [1, 1])[rank], rank, 2)
        schedule = Schedule1F1B(stage, CHUNKS, lambda out, y, f=loss_fn: f(out, y))
        try:
            schedule.step(x, target=_targets(uneven=True))
            refused = "not refused"
        except ValueError as error:
            refused = str(error)
        stage.module.zero_grad()
        loss = schedule.step(x, target=_targets(uneven=False))
        reference = _lm()
        expected = loss_fn(reference(x), _targets(uneven=False))
        expected.backward()
        worst = max((p.grad - r.grad).abs().max().item()
                    for p, r in zip(stage.module.parameters(), reference[rank].parameters()))
        results[name] = refused, worst, 0.0 if loss is None else abs(loss.item() - expected.item())
    return results


def test_uneven_hidden_means_are_refused_on_every_rank_and_the_next_step_matches(world2):
    """Was: the uneven step ran with 1/chunks weights (gradients off one process's, no
    error). Now it fails on both ranks naming loss_denominator=, and the next, even, step
    gives one process's gradients and loss."""
    for rank, results in enumerate(world2.run(_steps, ["item", "in place", "distillation"])):
        for name, (refused, worst, loss_off) in results.items():
            assert "loss_denominator=" in refused and "micro-batch 1" in refused, \
                (rank, name, refused)
            assert worst < 1e-5 and loss_off < 1e-5, (rank, name, worst, loss_off)


def _scaled_heads_parity(names):
    """Per schedule and loss, on uneven counts: (worst gradient difference from one process,
    returned loss minus one process's; 0 off the last stage), or the ValueError's text."""
    rank, results = dist.get_rank(), {}
    torch.manual_seed(3)
    x = torch.randn(ROWS, SEQ, WIDTH)
    y = _targets(uneven=True)
    for schedule_name, cls, stages_per_rank in (("1F1B", Schedule1F1B, 1), ("ZBV", ScheduleZBV, 2)):
        n = 2 * stages_per_rank
        for name in names:
            loss_fn = SCALED_HEADS[name]
            model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n - 1)],
                                  nn.Linear(WIDTH, 2 * VOCAB))
            reference = copy.deepcopy(model)
            parts = split_sequential(model, [1] * n)
            mine = [rank] if n == 2 else [rank, n - 1 - rank]
            stages = {s: PipelineStage(parts[s], s, n, **({"placement": "v"} if n > 2 else {}))
                      for s in mine}
            schedule = cls(list(stages.values()) if n > 2 else stages[rank], CHUNKS,
                           lambda out, target, f=loss_fn: f(out, target))
            try:
                loss = schedule.step(x, target=y)
            except ValueError as error:
                results[schedule_name, name] = str(error)
                continue
            expected = loss_fn(reference(x), y)
            expected.backward()
            worst = max((p.grad - r.grad).abs().max().item() for s, stage in stages.items()
                        for p, r in zip(stage.module.parameters(), reference[s].parameters()))
            results[schedule_name, name] = worst, 0.0 if loss is None else \
                abs(loss.item() - expected.item())
    return results


def test_heads_times_constants_give_one_process_gradients_and_loss(world2):
    """Was: a ValueError on every rank (uneven counts). Now one process's gradients and loss."""
    for rank, results in enumerate(world2.run(_scaled_heads_parity, sorted(SCALED_HEADS))):
        for where, outcome in results.items():
            assert isinstance(outcome, tuple), (rank, where, outcome)
            assert outcome[0] < 1e-5 and outcome[1] < 1e-5, (rank, where, outcome)
