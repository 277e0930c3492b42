"""Multi-process pipelines (world 4) on two complaints from review.

A ``loss_fn`` that does not declare its reduction (a lambda around ``F.cross_entropy`` with
its default ``ignore_index``), with ignored tokens spread unevenly over the micro-batches:
one 4-stage pipeline (GPipe, 1F1B, ZB-H1, ZBV) against one process, and two 2-stage
pipelines averaging over their replicas against DDP (each replica's mean over its own
counted tokens, averaged). A lambda whose target is cut (shifted labels) with uneven counts
is refused on every rank, naming ``loss_denominator``.

Before: the lambda's micro-batch means were weighted alike (``1/chunks``): gradients off one
process's by about 0.03, and the returned loss NaN where a micro-batch held only ignored
tokens.

Pipelines whose stages are ShardedDataParallel or FSDP modules over their replicas (2
pipelines x 2 stages): a batch one pipeline refuses at a later step (not the first), in
training or in FSDP eval, and an FSDP eval one pipeline runs while the other trains.

Before: the other pipeline waited forever in the stage modules' collectives (the refusals
were shared before the first step only).

From a review:

Review of the watched ``loss_fn`` and the sharded pipelines' per-step refusals (world 4).

A lambda adding a term to its cross-entropy (an auxiliary loss, a distillation term): the
watch weighted the whole micro-batch loss by its counted tokens, so the added term's
gradients were off one process's (about 0.01 here), silently. Now, as for a cut target, the
micro-batches must count alike, else the step fails on every rank naming
``loss_denominator=``; with even counts the gradients are one process's.

Pipelines whose first stage is an FSDP or ShardedDataParallel module over its replicas and
whose second stage is a plain module averaging through ``data_parallel_group``: the ranks of
the sharded stage waited at every step after the first in an all-reduce over the pipeline
group that the plain stage's rank never joined (the first step ran; every later one hung).

From a second review:

Second review of the watched ``loss_fn`` (world 2).

A lambda around ``F.cross_entropy`` that guards a micro-batch whose targets are all ignored
(returning ``out.sum() * 0`` instead of the NaN mean, as many training loops do) was refused
since the watch: the guarded micro-batch computes no class-index mean, so it was taken for
"a loss that is no longer one class-index mean" and the step failed on every rank asking for
``loss_denominator=``. That micro-batch counts nothing (its predicted count is 0), so its
loss adds no gradient and is left out of the step's loss whatever ``loss_fn`` returns: the
step now runs with one process's gradients and loss, on GPipe, 1F1B and ZBV, training and
eval.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZBV,
                              ScheduleZeroBubble, split_sequential)
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

world4 = world_fixture(4, timeout=120)

VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _lm(n):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *[nn.Linear(WIDTH, WIDTH) for _ in range(n - 2)],
                         nn.Linear(WIDTH, VOCAB))


def _flat_cross_entropy(out, y):
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _shifted_cross_entropy(out, y):  # the count is not the micro-batch target's
    return F.cross_entropy(out[:, :-1].reshape(-1, VOCAB), y[:, 1:].reshape(-1))


def _tokens(seed, rows=ROWS):
    """A batch and targets whose ignored tokens (-100) fill the first micro-batch: its mean
    is NaN, and the others count 1, 3 and 3 tokens."""
    torch.manual_seed(seed)
    x, y = torch.randn(rows, SEQ, WIDTH), torch.randint(0, VOCAB, (rows, SEQ))
    y[:2] = -100
    y[2, :2] = -100
    return x, y


def _stages(module, n, group, placement="loop", replicas=None):
    size = dist.get_world_size(group)
    parts = split_sequential(module, [1] * n)
    me = dist.get_rank(group)
    return {s: PipelineStage(parts[s], s, n, group=group, placement=placement,
                             data_parallel_group=replicas)
            for s in range(n) if stage_rank(s, n, size, placement) == me}


def _grads_off(stages, reference):
    return max((p.grad - r.grad).abs().max().item() for s, stage in stages.items()
               for p, r in zip(stage.module.parameters(), reference[s].parameters()))


def _says_only_mean(out, y):
    return _flat_cross_entropy(out, y)


_says_only_mean.reduction = "mean"  # as the docs advised for uneven splits; not over what


def _one_pipeline_lambda_parity():
    """One 4-stage pipeline per schedule (ZBV: 8 stages), the loss a lambda (1F1B also a
    ``def`` that declares only ``reduction="mean"``): (worst gradient difference from one
    process, returned loss, one process's loss)."""
    results = {}
    flat = lambda out, y: _flat_cross_entropy(out, y)  # noqa: E731
    for name, cls, n, placement, loss_fn in (
            ("GPipe", ScheduleGPipe, 4, "loop", flat), ("1F1B", Schedule1F1B, 4, "loop", flat),
            ("1F1B, says mean", Schedule1F1B, 4, "loop", _says_only_mean),
            ("ZB-H1", ScheduleZeroBubble, 4, "loop", flat), ("ZBV", ScheduleZBV, 8, "v", flat)):
        stages = _stages(_lm(n), n, None, placement)
        schedule = cls(list(stages.values()) if n > 4 else next(iter(stages.values())),
                       CHUNKS, loss_fn)
        x, y = _tokens(1)
        loss = schedule.step(x, target=y)
        reference = _lm(n)
        expected = _flat_cross_entropy(reference(x), y)
        expected.backward()
        results[name] = (_grads_off(stages, reference),
                         None if loss is None else loss.item(), expected.item())
    return results


def _two_pipelines_lambda_against_ddp():
    """Pipelines {0, 1} and {2, 3}, replicas {0, 2} and {1, 3}; each pipeline its half of the
    batch (uneven ignored tokens). The worst gradient difference from DDP over one process
    per replica: the average of each replica's mean over its own counted tokens."""
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    stages = _stages(_lm(2), 2, pipelines[rank // 2], replicas=replicas[rank % 2])
    schedule = Schedule1F1B(next(iter(stages.values())), CHUNKS,
                            lambda out, y: _flat_cross_entropy(out, y))
    x, y = _tokens(2, 2 * ROWS)
    y[ROWS:ROWS + 5] = -100  # the second replica counts far fewer tokens than the first
    half = slice(ROWS * (rank // 2), ROWS * (rank // 2 + 1))
    schedule.step(x[half], target=y[half])
    reference = _lm(2)
    for part in (slice(0, ROWS), slice(ROWS, 2 * ROWS)):  # DDP: each replica's mean, averaged
        (_flat_cross_entropy(reference(x[part]), y[part]) / 2).backward()
    return _grads_off(stages, reference)


def _shifted_labels_outcomes():
    """A lambda averaging over shifted labels: uneven counts (refused), then even ones (the
    same gradients as one process)."""
    stages = _stages(_lm(4), 4, None)
    schedule = Schedule1F1B(next(iter(stages.values())), CHUNKS,
                            lambda out, y: _shifted_cross_entropy(out, y))
    x, y = _tokens(3)
    try:
        schedule.step(x, target=y)
        refused = "ok"
    except ValueError as error:
        refused = str(error)
    for stage in stages.values():
        stage.module.zero_grad()
    y = torch.randint(0, VOCAB, (ROWS, SEQ))
    schedule.step(x, target=y)
    reference = _lm(4)
    _shifted_cross_entropy(reference(x), y).backward()
    return refused, _grads_off(stages, reference)


def test_a_lambda_around_cross_entropy_is_weighted_by_its_counted_tokens(world4):
    """Was: 1/chunks per micro-batch mean (gradients about 0.03 off, the loss NaN); now one
    process's gradients and loss, on every schedule; under data parallelism, DDP's."""
    for rank, per_schedule in enumerate(world4.run(_one_pipeline_lambda_parity)):
        for name, (worst, loss, expected) in per_schedule.items():
            assert worst < 1e-5, (name, rank, worst)
            last = 0 if name == "ZBV" else 3
            if rank == last:
                assert abs(loss - expected) < 1e-5, (name, loss, expected)
    for rank, worst in enumerate(world4.run(_two_pipelines_lambda_against_ddp)):
        assert worst < 1e-5, (rank, worst)


def test_a_lambda_whose_counts_cannot_be_known_is_refused_on_uneven_counts(world4):
    """A lambda over shifted labels: micro-batches counting different numbers of tokens fail
    the step on every rank, naming loss_denominator; even counts match one process."""
    for rank, (refused, worst) in enumerate(world4.run(_shifted_labels_outcomes)):
        assert "loss_denominator=" in refused and "micro-batch" in refused, (rank, refused)
        assert worst < 1e-5, (rank, worst)


def _outcome(call, x, target):
    try:
        call(x, target=target)
        return "ok"
    except ValueError as error:
        return str(error)


def _sharded_pipelines(kind):
    """Pipelines {0, 1} and {2, 3}; each stage a ShardedDataParallel or FSDP module over its
    replicas {0, 2} or {1, 3}; 1F1B."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch.manual_seed(0)
    part = split_sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1])[rank % 2]
    if kind == "fsdp":
        module = FullyShardedDataParallel(part, process_group=replicas)
    else:
        optimizer = OSS(part.parameters(), torch.optim.SGD, lr=0.1, group=replicas)
        module = ShardedDataParallel(part, optimizer, process_group=replicas)
    return Schedule1F1B(PipelineStage(module, rank % 2, 2, group=pipelines[rank // 2]), 4,
                        F.mse_loss)


def _later_refusals(kind):
    """A fine step; a training step pipeline 1 refuses (a 2-row batch, chunks=4); a fine one;
    under FSDP, an eval step pipeline 1 refuses, eval on pipeline 0 while pipeline 1 trains,
    and a fine eval. This rank's outcomes."""
    schedule = _sharded_pipelines(kind)
    refusing = dist.get_rank() >= 2
    x, t = torch.randn(8, 4), torch.randn(8, 4)
    outcomes = [_outcome(schedule.step, x, t),
                _outcome(schedule.step, x[:2] if refusing else x, t),
                _outcome(schedule.step, x, t)]
    if kind == "fsdp":
        outcomes += [_outcome(schedule.eval, x[:2] if refusing else x, t),
                     _outcome(schedule.step if refusing else schedule.eval, x, t),
                     _outcome(schedule.eval, x, t)]
        fresh = _sharded_pipelines(kind)  # the mix as a first step
        outcomes.append(_outcome(fresh.step if refusing else fresh.eval, x, t))
    return outcomes


def test_a_later_step_one_pipeline_refuses_under_sharded_stages_fails_everywhere(world4):
    """Was: the other pipeline hung in ShardedDataParallel's / FSDP's collectives. Now every
    rank of both pipelines raises, naming the replica (or the eval / training mix), and the
    next step runs."""
    for kind in ("sdp", "fsdp"):
        for rank, outcomes in enumerate(world4.run(_later_refusals, kind)):
            where = (kind, rank)
            assert outcomes[0] == outcomes[2] == "ok", (where, outcomes)
            refusals = [outcomes[1]] + ([outcomes[3]] if kind == "fsdp" else [])
            for refused in refusals:
                assert "chunks=4 is larger than the batch size 2" in refused, (where, refused)
                if rank < 2:
                    assert "replica at global rank 2" in refused, (where, refused)
            if kind == "fsdp":
                mixed, fine, mixed_first = outcomes[4:]
                for error in (mixed, mixed_first):
                    assert "runs the other kind" in error and "eval" in error, (where, error)
                assert fine == "ok", (where, fine)


VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _lm_rev():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)], nn.Linear(WIDTH, VOCAB))


def _with_aux_term(out, y):
    """Cross-entropy over the counted tokens plus a mean over every output (not counted)."""
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1)) + 0.5 * out.pow(2).mean()


def _aux_term_outcomes():
    """Per schedule: the uneven step's outcome, then an even step's worst gradient difference
    from one process."""
    rank, results = dist.get_rank(), {}
    for cls in (ScheduleGPipe, Schedule1F1B):
        stage = PipelineStage(split_sequential(_lm_rev(), [1] * 4)[rank], rank, 4)
        schedule = cls(stage, CHUNKS, lambda out, y: _with_aux_term(out, y))
        torch.manual_seed(1)
        x, y = torch.randn(ROWS, SEQ, WIDTH), torch.randint(0, VOCAB, (ROWS, SEQ))
        uneven = y.clone()
        uneven[2:4, :2] = -100  # micro-batch 1 counts 2 tokens, the others 6
        try:
            schedule.step(x, target=uneven)
            refused = "ok"
        except ValueError as error:
            refused = str(error)
        stage.module.zero_grad()
        schedule.step(x, target=y)
        reference = _lm_rev()
        _with_aux_term(reference(x), y).backward()
        worst = max((p.grad - r.grad).abs().max().item() for p, r in
                    zip(stage.module.parameters(), reference[rank].parameters()))
        results[cls.__name__] = refused, worst
    return results


def test_a_lambda_adding_a_term_to_cross_entropy_is_not_weighted_by_counts(world4):
    """Was: weighted by each micro-batch's counted tokens, the added term too (gradients off
    one process's, silently). Now uneven counts fail on every rank naming loss_denominator;
    even counts give one process's gradients."""
    for rank, per_schedule in enumerate(world4.run(_aux_term_outcomes)):
        for name, (refused, worst) in per_schedule.items():
            assert "loss_denominator=" in refused and "returns more than that mean" in refused, \
                (name, rank, refused)
            assert worst < 1e-5, (name, rank, worst)


def _mixed_pipelines(kind):
    """Pipelines {0, 1} and {2, 3}: stage 0 an FSDP or ShardedDataParallel module over the
    replicas {0, 2}, stage 1 a plain module averaged over {1, 3} (``data_parallel_group``)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch.manual_seed(0)
    part = split_sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1])[rank % 2]
    averaged_over = None
    if rank % 2 == 1:
        module, averaged_over = part, replicas
    elif kind == "fsdp":
        module = FullyShardedDataParallel(part, process_group=replicas)
    else:
        optimizer = OSS(part.parameters(), torch.optim.SGD, lr=0.1, group=replicas)
        module = ShardedDataParallel(part, optimizer, process_group=replicas)
    stage = PipelineStage(module, rank % 2, 2, group=pipelines[rank // 2],
                          data_parallel_group=averaged_over)
    return Schedule1F1B(stage, CHUNKS, F.mse_loss)


def _mixed_steps(kind):
    """Two training steps, two eval steps, a training step pipeline 1 refuses (a 2-row
    batch, chunks=4), a fine one: this rank's outcomes."""
    schedule = _mixed_pipelines(kind)
    x, t = torch.randn(8, 4), torch.randn(8, 4)
    refusing = dist.get_rank() >= 2
    return [_outcome(schedule.step, x, t), _outcome(schedule.step, x, t),
            _outcome(schedule.eval, x, t), _outcome(schedule.eval, x, t),
            _outcome(schedule.step, x[:2] if refusing else x, t), _outcome(schedule.step, x, t)]


def test_a_sharded_first_stage_before_a_plain_stage_runs_later_steps(world4):
    """Was: every step after the first hung (the sharded stage's rank waited for the plain
    stage's in an all-reduce over the pipeline). Now they run, and a later batch one pipeline
    refuses fails on every rank."""
    for kind in ("fsdp", "sdp"):
        for rank, outcomes in enumerate(world4.run(_mixed_steps, kind)):
            assert outcomes[:4] == ["ok"] * 4 and outcomes[5] == "ok", (kind, rank, outcomes)
            refused = outcomes[4]
            assert "chunks=4 is larger than the batch size 2" in refused, (kind, rank, refused)


world2 = world_fixture(2, timeout=120)

VOCAB, WIDTH, ROWS, SEQ, CHUNKS = 5, 6, 8, 3, 4


def _lm_second(n):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n - 1)],
                         nn.Linear(WIDTH, VOCAB))


def _guarded_cross_entropy(out, y):
    """Cross-entropy over the tokens, a zero (not NaN) where every token is ignored."""
    if (y == -100).all():
        return out.sum() * 0
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def _tokens_rev():
    """Micro-batches 1 and 2 (of 4) hold only ignored tokens."""
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, SEQ, WIDTH), torch.randint(0, VOCAB, (ROWS, SEQ))
    y[2:6] = -100
    return x, y


def _guarded_lambda_outcomes():
    """Per schedule and step kind: (worst gradient difference from one process, returned
    loss, one process's loss), or the error the step raised."""
    results = {}
    for name, cls, placement in (("GPipe", ScheduleGPipe, "loop"),
                                 ("1F1B", Schedule1F1B, "loop"), ("ZBV", ScheduleZBV, "v")):
        n = 4 if placement == "v" else 2
        parts = split_sequential(_lm_second(n), [1] * n)
        stages = {s: PipelineStage(parts[s], s, n, placement=placement) for s in range(n)
                  if stage_rank(s, n, 2, placement) == dist.get_rank()}
        schedule = cls(list(stages.values()) if n > 2 else next(iter(stages.values())),
                       CHUNKS, lambda out, y: _guarded_cross_entropy(out, y))
        x, y = _tokens_rev()
        reference = _lm_second(n)
        expected = _guarded_cross_entropy(reference(x), y)
        expected.backward()
        for kind in ("step", "eval"):
            try:
                loss = getattr(schedule, kind)(x, target=y)
            except ValueError as error:
                results[name, kind] = str(error)
                continue
            worst = max((p.grad - r.grad).abs().max().item() for s, stage in stages.items()
                        for p, r in zip(stage.module.parameters(), reference[s].parameters()))
            results[name, kind] = (worst, None if loss is None else loss.item(),
                                   expected.item())
    return results


def test_a_guarded_micro_batch_counting_nothing_is_not_refused(world2):
    """Was: refused on every rank naming loss_denominator=; now one process's gradients and
    loss (the guarded micro-batches add nothing)."""
    for rank, per_schedule in enumerate(world2.run(_guarded_lambda_outcomes)):
        for (name, kind), outcome in per_schedule.items():
            assert isinstance(outcome, tuple), (name, kind, rank, outcome)
            worst, loss, expected = outcome
            assert worst < 1e-5, (name, kind, rank, worst)
            if loss is not None:
                assert abs(loss - expected) < 1e-5, (name, kind, loss, expected)
