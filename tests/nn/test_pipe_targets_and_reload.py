"""Multi-process pipeline schedules (world 2) against one process, on targets that are not
simply per-sample rows: a target holding a tensor that is not per-sample (a class-weight
tensor whose length happens to equal the batch's rows), and a loss whose mean divides by a
count the target decides (cross-entropy with ``ignore_index``, class weights, label
smoothing), on even and uneven splits and with a micro-batch whose targets are all ignored.

Before:

Every tensor of a dict target was cut along dim 0 with the batch, a class-weight tensor too:
with as many classes as rows, each micro-batch's loss saw half the weights, silently. Each
micro-batch's cross-entropy with ignored tokens was divided by ``chunks`` (or by its share of
the rows), a mean of micro-batch means, not the mean over the batch's counted tokens: the
gradients differed from one process's by up to 0.3 on an even split. A one-process ``Pipe``'s
state dict (keys ``partitions.<j>.<layer>``) did not load into a Pipe of another ``balance``,
nor did the plain Sequential's, so a checkpoint could not move to another stage count.

Review of the masked-mean weighting

Multi-process pipeline schedules (world 2) on counted-mean losses, against one process: a
subclass of ``nn.CrossEntropyLoss`` that only sets defaults, and ``loss_denominator``
returning a NumPy count or an infinite one.

Before:

A subclass of ``nn.CrossEntropyLoss`` (``class TokenLoss(nn.CrossEntropyLoss)`` setting
``ignore_index``, its ``forward`` the module's) was not counted: its micro-batch means were
averaged (gradients up to 0.25 off one process), and a micro-batch whose targets were all
ignored made the returned loss NaN. ``loss_denominator`` returning a NumPy integer
(``np.count_nonzero``) failed the step ("it returned np.int64(4)"), while one returning
``inf`` was taken: every weight NaN, the loss and the gradients NaN, silently.
"""

import functools

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from shardkit import distributed as dist
from shardkit.nn.pipe import Pipe, PipelineStage
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

from tests.nn.test_torch_pipelining_suite import SCHEDULES

D, CLASSES = 5, 8
world2 = world_fixture(2, timeout=240)


def _layers(count: int) -> list:
    torch.manual_seed(0)
    return [nn.Linear(D, D) for _ in range(count - 1)] + [nn.Linear(D, CLASSES)]


def _pipeline(schedule_name, chunks, loss_fn, **options):
    """This rank's stage indices, the stage modules, the schedule, and the reference layers."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    ref, modules = _layers(n), _layers(n)
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, loss_fn, **options)
    return mine, modules, schedule, ref


def _class_weight_loss(out, target):
    return F.cross_entropy(out, target["labels"], weight=target["class_weight"])


def _weighted_count(target):
    labels = target["labels"]
    return target["class_weight"][labels[labels != -100]].sum()


_IGNORED = 3  # the ignore_index of the losses that set one

# loss_fn, schedule options, and whether the target is {"labels", "class_weight"}
_CASES = {
    "nn.CrossEntropyLoss": (nn.CrossEntropyLoss(), {}, False),
    "weighted, smoothed": (nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES),
                                               label_smoothing=0.1, ignore_index=_IGNORED),
                           {}, False),
    "partial(F.cross_entropy)": (functools.partial(F.cross_entropy, ignore_index=_IGNORED),
                                 {}, False),
    "class weight replicated": (
        _class_weight_loss, {"target_chunk_spec": {"labels": TensorChunkSpec(0),
                                                   "class_weight": _Replicate()},
                             "loss_denominator": _weighted_count}, True),
    "loss_denominator": (lambda out, t: F.cross_entropy(out, t),
                         {"loss_denominator": lambda t: (t != -100).sum()}, False),
}


def _target(case, rows, chunks, generator):
    """Labels with about 40% ignored (all of micro-batch 0's where ``chunks`` is 3), and the
    class weights beside them for the dict case (as many as the batch's rows)."""
    ignored = _IGNORED if case in ("weighted, smoothed", "partial(F.cross_entropy)") else -100
    labels = torch.randint(0, CLASSES, (rows,), generator=generator)
    labels[torch.rand(rows, generator=generator) < 0.4] = ignored
    if chunks == 3:
        labels[:-(-rows // chunks)] = ignored
    if not _CASES[case][2]:
        return labels
    return {"labels": labels, "class_weight": torch.rand(CLASSES, generator=generator) + 0.5}


def _training(schedule_name, case, rows, chunks):
    """Two SGD steps beside one process on the whole batch: the worst difference of the
    gradients and of the returned loss."""
    loss_fn, options, _ = _CASES[case]
    mine, modules, schedule, ref = _pipeline(schedule_name, chunks, loss_fn, **options)
    last = len(ref) - 1
    opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.5)
    ref_opt = torch.optim.SGD([q for m in ref for q in m.parameters()], lr=0.5)
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, target = torch.randn(rows, D, generator=g), _target(case, rows, chunks, g)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = schedule.step(*((x,) if 0 in mine else ()),
                             target=target if last in mine else None)
        h = x
        for module in ref:
            h = module(h)
        expected = loss_fn(h, target)
        expected.backward()
        worst = max([worst] + [(a.grad - b.grad).abs().max().item() for s in mine
                               for a, b in zip(modules[s].parameters(), ref[s].parameters())])
        if loss is not None:
            worst = max(worst, abs(loss.item() - expected.item()))
        opt.step()
        ref_opt.step()
    return worst


@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_a_target_counted_by_its_loss_and_a_whole_class_weight_train_as_one_process(
        world2, schedule):
    """Each case on 8 rows in 2 micro-batches (even) and 9 in 3 (uneven, micro-batch 0's
    targets all ignored): the gradients and the returned loss are one process's. Before, a
    class-weight tensor of 8 beside 8 rows was cut in halves (a CrossEntropy error here; a
    silent broadcast in a loss that multiplies), ``target_chunk_spec`` and
    ``loss_denominator`` were unknown options, and the masked means were averaged per
    micro-batch (gradients off by 0.1 to 0.3)."""
    for case in _CASES:
        for rows, chunks in ((8, 2), (9, 3)):
            found = world2.run(_training, schedule, case, rows, chunks)
            assert all(worst < 1e-5 for worst in found), (schedule, case, rows, chunks, found)


def _construction_error(**options) -> str:
    try:
        _pipeline("1F1B", 2, _class_weight_loss, **options)
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "built"


def _bad_target_options():
    """What constructing a schedule with a bad ``target_chunk_spec`` or ``loss_denominator``
    raises; what a step whose target's structure is not its spec's raises, then what the next
    good step returns; what a ``loss_denominator`` returning a negative count raises."""
    found = [_construction_error(target_chunk_spec={"labels": 0}),
             _construction_error(loss_denominator="tokens")]
    spec = {"labels": TensorChunkSpec(0), "class_weight": _Replicate()}
    mine, _, schedule, ref = _pipeline("1F1B", 2, _class_weight_loss, target_chunk_spec=spec)
    last, x = len(ref) - 1, torch.randn(6, D)
    labels, weights = torch.randint(0, CLASSES, (6,)), torch.ones(CLASSES)
    for target in ({"labels": labels, "weights": weights},
                   {"labels": labels, "class_weight": weights}):
        try:
            loss = schedule.step(*((x,) if 0 in mine else ()),
                                 target=target if last in mine else None)
            found.append("loss" if loss is not None else None)
        except ValueError as error:
            found.append(str(error))
    mine, _, schedule, ref = _pipeline("1F1B", 2, lambda o, t: F.cross_entropy(o, t),
                                       loss_denominator=lambda t: -1)
    try:
        schedule.step(*((x,) if 0 in mine else ()), target=labels if last in mine else None)
        found.append(None)
    except ValueError as error:
        found.append(str(error))
    return found


def test_bad_target_options_are_refused_by_name(world2):
    """A ``target_chunk_spec`` or ``loss_denominator`` that is not one is refused at
    construction naming it, before any collective; a spec whose structure is not the
    target's (refused before the first step), and a count that is not one (found during the
    step), fail the step on every rank naming them, and the pipeline goes on."""
    for rank, found in enumerate(world2.run(_bad_target_options)):
        bad_spec, bad_count, mismatch, after, negative = found
        assert bad_spec.startswith("ValueError: Schedule1F1B(target_chunk_spec={'labels': 0})"
                                   ": 0 is not a chunk spec"), (rank, bad_spec)
        assert bad_count.startswith("TypeError: Schedule1F1B(loss_denominator='tokens'): "
                                    "expected a callable"), (rank, bad_count)
        assert "cannot run this step:\n  stage 1: target_chunk_spec gives the target a " \
            "structure of specs" in mismatch, (rank, mismatch)
        assert after == ("loss" if rank == 1 else None), (rank, after)
        assert "stage 1 (the last), micro-batch 0: loss_denominator raised ValueError: it " \
            "returned -1" in negative, (rank, negative)


def _sequential():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                         nn.Tanh(), nn.Linear(6, 3))


def test_a_pipe_state_dict_loads_into_another_balance_and_from_the_sequential():
    """A Pipe trained one step (balance [2, 4], deferred batch norm) saves its state; a Pipe of
    balance [1, 1, 4] loads it (strict: every key matched), and so does one loading the
    trained plain Sequential's state dict; both then compute what the trained Pipe does,
    running statistics included. Before, each load raised missing and unexpected keys."""
    saved = Pipe(_sequential(), balance=[2, 4], chunks=3, deferred_batch_norm=True)
    x = torch.randn(9, 4)
    opt = torch.optim.SGD(saved.parameters(), lr=0.5)
    saved(x).pow(2).mean().backward()
    opt.step()
    plain = _sequential()
    plain.load_state_dict({key.split(".", 2)[2]: v for key, v in saved.state_dict().items()})
    for state in (saved.state_dict(), plain.state_dict()):
        moved = Pipe(_sequential(), balance=[1, 1, 4], chunks=2, deferred_batch_norm=True)
        result = moved.load_state_dict(state)
        assert not result.missing_keys and not result.unexpected_keys, result
        assert torch.equal(moved.eval()(x), saved.eval()(x))
        assert torch.equal(moved[1].running_mean, saved[1].running_mean)
        saved.train()


D_REV, CLASSES_REV, IGNORED_REV = 5, 6, 2


class _TokenLoss(nn.CrossEntropyLoss):
    """A subclass that only sets defaults: it averages as ``nn.CrossEntropyLoss`` does."""

    def __init__(self):
        super().__init__(ignore_index=IGNORED_REV, label_smoothing=0.1)


def _layers_rev(count: int) -> list:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D_REV, D_REV), nn.Tanh()) for _ in range(count - 1)] + \
        [nn.Linear(D_REV, CLASSES_REV)]


def _masked_cross_entropy(out, target):
    return F.cross_entropy(out, target, ignore_index=IGNORED_REV)


def _numpy_count(target):
    return np.count_nonzero((target != IGNORED_REV).numpy())


def _labels(rows: int, chunks: int, generator) -> torch.Tensor:
    """Labels with about 40% ignored, all of micro-batch 0's."""
    labels = torch.randint(0, CLASSES_REV, (rows,), generator=generator)
    labels[torch.rand(rows, generator=generator) < 0.4] = IGNORED_REV
    labels[:-(-rows // chunks)] = IGNORED_REV
    return labels


def _step_beside_one_process(schedule_name, loss_fn, rows, chunks, **options):
    """One step beside one process on the whole batch: the worst gradient difference, and
    the returned loss beside one process's (``None`` off the last stage's rank)."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    modules, ref = _layers_rev(n), _layers_rev(n)
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, loss_fn, **options)
    g = torch.Generator().manual_seed(rows)
    x, labels = torch.randn(rows, D_REV, generator=g), _labels(rows, chunks, g)
    loss = schedule.step(*((x,) if 0 in mine else ()), target=labels if n - 1 in mine else None)
    h = x
    for module in ref:
        h = module(h)
    expected = loss_fn(h, labels)
    expected.backward()
    worst = max((a.grad - b.grad).abs().max().item() for s in mine
                for a, b in zip(modules[s].parameters(), ref[s].parameters()))
    return worst, None if loss is None else (loss.item(), expected.item())


def _counted_losses():
    """The subclass and the NumPy count under 1F1B and ZBV, even and uneven splits; then the
    error an infinite count gives."""
    found = []
    for schedule in ("1F1B", "ZBV"):
        for rows, chunks in ((8, 2), (9, 3)):
            found.append(_step_beside_one_process(schedule, _TokenLoss(), rows, chunks))
            found.append(_step_beside_one_process(schedule, _masked_cross_entropy, rows, chunks,
                                                  loss_denominator=_numpy_count))
    try:
        _step_beside_one_process("1F1B", _masked_cross_entropy, 8, 2,
                                 loss_denominator=lambda t: float("inf"))
        found.append("no error")
    except ValueError as error:
        found.append(str(error))
    return found


def test_a_defaults_only_subclass_and_a_numpy_count_train_as_one_process(world2):
    """Gradients and the returned loss are one process's (no NaN from the all-ignored
    micro-batch 0); an infinite count fails the step on every rank, naming it."""
    for rank, found in enumerate(world2.run(_counted_losses)):
        *cases, infinite = found
        for k, (worst, losses) in enumerate(cases):
            assert worst < 1e-5, (rank, k, worst)
            if losses is not None:
                assert abs(losses[0] - losses[1]) < 1e-5, (rank, k, losses)
        assert "loss_denominator raised ValueError: it returned inf; expected the count (a " \
            "finite number >= 0)" in infinite, (rank, infinite)
