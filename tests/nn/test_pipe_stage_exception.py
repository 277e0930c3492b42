"""A stage module or ``loss_fn`` raising on one rank in the middle of a pipeline step: every rank
raises one clear ValueError naming the stage, the micro-batch and the original exception (chained
on the rank that raised it), no rank hangs, and the next step trains as one process does.

One pipeline of four stages (GPipe, 1F1B), and two pipelines of two stages whose stage modules
are ShardedDataParallel / FSDP over their replicas in the other pipeline (whose collectives run
inside forward and backward). Was: there, the pipeline whose stage raised stopped its work on
that stage, and its replica in the other pipeline waited forever in the module's next collective;
a replica whose stage module was in ``eval()`` mode while the other trained hung the same way
under ShardedDataParallel (whose training forward communicates, its eval forward not), and went
unnoticed under FSDP. Also: one pipeline's stage modules in different modes (a stage in
``eval()`` on one rank only) went unnoticed; now every rank warns at the first step.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble,
                              split_sequential)
from shardkit.testing import world_fixture

world4 = world_fixture(4, timeout=90)  # a hung step fails its test in a minute and a half

WIDTH, ROWS, CHUNKS = 8, 8, 4
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "ZB-H1": ScheduleZeroBubble}


class Refusing(nn.Module):
    """A linear layer whose forward raises ``ValueError`` on micro-batch ``armed`` of the
    step (counted from the step's first forward) while armed."""

    def __init__(self, stage):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.stage, self.armed, self.calls = stage, None, 0

    def forward(self, x):
        call, self.calls = self.calls, self.calls + 1
        if call == self.armed:
            raise ValueError(f"stage {self.stage} refuses micro-batch {call}")
        return torch.tanh(self.linear(x))


def _model(stages):
    torch.manual_seed(0)
    return nn.Sequential(*[Refusing(s) for s in range(stages)], nn.Linear(WIDTH, 4))


def _batch(step, part=0):
    g = torch.Generator().manual_seed(100 * step + part)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, 4, generator=g)


class _ArmedLoss:
    """``F.mse_loss``, raising ``KeyError`` on micro-batch ``armed`` while armed."""

    def __init__(self):
        self.armed, self.calls = None, 0

    def __call__(self, output, target):
        call, self.calls = self.calls, self.calls + 1
        if call == self.armed:
            raise KeyError(f"loss_fn refuses micro-batch {call}")
        return F.mse_loss(output, target)


def _outcome(call, *args, **kwargs):
    """``(None, loss or None)`` for a step that went through; ``(its error, the type name of
    the exception chained to it)`` for one that raised a ValueError."""
    try:
        loss = call(*args, **kwargs)
        return None, None if loss is None else loss.item()
    except ValueError as error:
        return str(error), type(error.__cause__).__name__


# (what, stage or rank, micro-batch): a step where a stage's forward raises, loss_fn raises,
# or ("eval", ...) an evaluation step whose stage raises; None: a good training step
ONE_PIPELINE = (None, ("forward", 0, 2), None, ("forward", 3, 1), None, ("loss", 3, 2), None,
                ("eval", 1, 0), None, ("forward", 2, 3), None)


def _one_pipeline(name):
    """Four stages on four ranks; what each step of ``ONE_PIPELINE`` gave on this rank."""
    rank = dist.get_rank()
    module = split_sequential(_model(4), [1, 1, 1, 2])[rank]
    loss_fn = _ArmedLoss()
    schedule = SCHEDULES[name](PipelineStage(module, rank, 4), CHUNKS, loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    outcomes = []
    for step, fault in enumerate(ONE_PIPELINE):
        module[0].calls = loss_fn.calls = 0
        kind, where, micro = fault or (None, None, None)
        module[0].armed = micro if kind in ("forward", "eval") and where == rank else None
        loss_fn.armed = micro if kind == "loss" and where == rank else None
        x, y = _batch(step)
        opt.zero_grad()
        if kind == "eval":
            outcomes.append(_outcome(schedule.eval, x, target=y))
            continue
        outcomes.append(_outcome(schedule.step, x, target=y))
        if outcomes[-1][0] is None:
            opt.step()
    return outcomes, [p.detach().clone() for p in module.parameters()]


def _reference(stages, steps, parts=1):
    """One process over the good training steps of ``steps`` (each batch the ``parts``
    pipelines' batches together): the loss of each step (per part) and the final parameters."""
    model = _model(stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, fault in enumerate(steps):
        batches = [_batch(step, part) for part in range(parts)]
        if fault is not None:
            losses.append(None)
            continue
        with torch.no_grad():
            losses.append([F.mse_loss(model(x), y).item() for x, y in batches])
        opt.zero_grad()
        x, y = (torch.cat(t) for t in zip(*batches))
        F.mse_loss(model(x), y).backward()
        opt.step()
    return losses, model


def _expected_error(fault, schedule):
    kind, where, micro = fault
    last = " (the last)" if where == 3 else ""
    head = f"{schedule}.step: the pipeline could not finish this step:\n  rank {where}: stage " \
        f"{where}{last}, micro-batch {micro}: "
    if kind == "loss":
        return head + f"loss_fn raised KeyError: 'loss_fn refuses micro-batch {micro}'", \
            "KeyError"
    return head + f"its forward raised ValueError: stage {where} refuses micro-batch {micro}", \
        "ValueError"


def test_a_stage_or_loss_fn_raising_mid_step_is_one_error_on_every_rank(world4):
    """A forward raising on the first, a middle and the last stage, in a training and an
    evaluation step, and ``loss_fn`` raising on the last: every rank raises the same
    ValueError naming the stage, the micro-batch and the exception; only the raising rank
    chains it; the step after each trains as one process over the steps that went through."""
    ref_losses, reference = _reference(4, ONE_PIPELINE)
    ref_params = [list(part.parameters()) for part in split_sequential(reference, [1, 1, 1, 2])]
    for name in ("GPipe", "1F1B"):
        results = world4.run(_one_pipeline, name)
        for step, fault in enumerate(ONE_PIPELINE):
            errors = {outcomes[step][0] for outcomes, _ in results}
            assert len(errors) == 1, (name, step, errors)  # the same outcome on every rank
            error = errors.pop()
            if fault is None:
                assert error is None, (name, step, error)
                loss = results[3][0][step][1]
                assert abs(loss - ref_losses[step][0]) < 1e-5, (name, step, loss)
                continue
            want, cause = _expected_error(fault, SCHEDULES[name].__name__)
            assert want in error and "so the pipeline can go on" in error, (name, step, error)
            causes = [outcomes[step][1] for outcomes, _ in results]
            assert causes == [cause if r == fault[1] else "NoneType" for r in range(4)], \
                (name, step, causes)
        for rank, (_, params) in enumerate(results):
            for got, want in zip(params, ref_params[rank]):
                assert torch.allclose(got, want.detach(), atol=1e-5), (name, rank)


# two pipelines {0, 1} and {2, 3}; what each step does: a forward raising on one global rank,
# loss_fn raising on one; None: a good step
REPLICATED = (None, ("forward", 3, 2), None, ("forward", 0, 1), None, ("loss", 1, 2), None)
# one stage module in eval() mode on one global rank, its replica in train()
REPLICATED_MODES = (None, ("mode", 2, None), None, ("mode", 1, None), None)


def _replicated_schedule(kind, name):
    """Two pipelines of two stages, each stage module a ShardedDataParallel (``"sdp"``) or
    FSDP over its replica in the other pipeline: this rank's layers, stage module, optimizer,
    ``loss_fn`` and schedule."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    part = split_sequential(_model(2), [1, 2])[rank % 2]
    if kind == "fsdp":
        module = FullyShardedDataParallel(part, process_group=replicas)
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
    else:
        opt = OSS(part.parameters(), torch.optim.SGD, lr=0.1, group=replicas)
        module = ShardedDataParallel(part, opt, process_group=replicas)
    loss_fn = _ArmedLoss()
    schedule = SCHEDULES[name](PipelineStage(module, rank % 2, 2, group=pipelines[rank // 2]),
                               CHUNKS, loss_fn)
    return part, module, opt, loss_fn, schedule


def _replicated(kind, name, steps):
    """Pipeline ``p`` of :func:`_replicated_schedule` gets part ``p`` of each step's batch:
    what each of ``steps`` (``REPLICATED``'s form) gave on this rank."""
    rank = dist.get_rank()
    part, module, opt, loss_fn, schedule = _replicated_schedule(kind, name)
    outcomes = []
    for step, fault in enumerate(steps):
        part[0].calls = loss_fn.calls = 0
        what, where, micro = fault or (None, None, None)
        part[0].armed = micro if what == "forward" and where == rank else None
        loss_fn.armed = micro if what == "loss" and where == rank else None
        module.train(not (what == "mode" and where == rank))
        x, y = _batch(step, rank // 2)
        opt.zero_grad()
        outcomes.append(_outcome(schedule.step, x, target=y))
        if outcomes[-1][0] is None:
            opt.step()
    module.train()
    return outcomes


def _replicated_error(fault, rank):
    """What a step of ``REPLICATED`` that ``fault`` breaks says on ``rank``, and the
    exception chained there."""
    what, where, micro = fault
    stage = where % 2
    last = " (the last)" if stage == 1 else ""
    ours = rank // 2 == where // 2  # the pipeline of the rank that raised
    if what == "mode":
        replica = where - 2 if where >= 2 else where + 2
        return [f"stage {stage}{last}, micro-batch 0: its module is in train() mode on global "
                f"rank(s) [{replica}] and in eval() mode on global rank(s) [{where}]",
                "call .train() or .eval() alike"], "NoneType"
    found = (f"stage {stage}{last}, micro-batch {micro}: loss_fn raised KeyError"
             if what == "loss" else
             f"stage {stage}{last}, micro-batch {micro}: its forward raised ValueError: stage "
             f"{stage} refuses micro-batch {micro}")
    if ours:
        wants = [f"rank {where % 2}: {found}"]
    else:  # the other pipeline names the replica's rank and its problem
        wants = ["the step failed in a data-parallel replica's pipeline",
                 f"global rank {where}: {found}"]
    cause = "NoneType" if rank != where else ("KeyError" if what == "loss" else "ValueError")
    return wants, cause


def _check_replicated(world, steps, cases):
    ref_losses, _ = _reference(2, steps, parts=2)
    for kind, name in cases:
        results = world.run(_replicated, kind, name, steps)
        for step, fault in enumerate(steps):
            for rank, outcomes in enumerate(results):
                error, detail = outcomes[step]
                where = (kind, name, step, rank)
                if fault is None:
                    assert error is None, (where, error)
                    if rank % 2:  # the last stage: its pipeline's part of the batch
                        want = ref_losses[step][rank // 2]
                        assert abs(detail - want) < 1e-5, (where, detail, want)
                    continue
                assert error is not None and "could not finish this step" in error, where
                wants, cause = _replicated_error(fault, rank)
                for want in wants:
                    assert want in error, (where, want, error)
                assert detail == cause, (where, detail, cause)


def test_a_stage_raising_mid_step_under_sharded_replicas_fails_every_pipeline(world4):
    """Was: every rank of both pipelines waited forever (in the ShardedDataParallel / FSDP
    collectives of the stage's replica, then in the messages of its neighbours). Now the
    replicas of each such stage agree before each of its actions whether a pipeline's step
    failed, stop their collectives at the same action, and every rank raises one ValueError
    naming the replica and its problem (chained on the raising rank); the next step trains
    as one process does on both pipelines' batches."""
    _check_replicated(world4, REPLICATED, (("sdp", "1F1B"), ("sdp", "GPipe"), ("fsdp", "1F1B"),
                                           ("fsdp", "GPipe"), ("fsdp", "ZB-H1")))


def test_sharded_replicas_in_different_modes_fail_the_step_on_every_pipeline(world4):
    """Was: a ShardedDataParallel stage module in eval() on one pipeline while its replica
    trained hung both (its training forward communicates, its eval forward does not); under
    FSDP it went unnoticed. Now every rank of both pipelines raises, naming the ranks in each
    mode, and the step after (modes alike again) trains as one process does."""
    _check_replicated(world4, REPLICATED_MODES, (("sdp", "1F1B"), ("fsdp", "GPipe")))


def _agreement_cost(kind, name):
    """The all-reduce calls and bytes of a good training step, and of one without the
    replicas' agreement before each action (the schedule's ``_replicas_go_on`` bypassed)."""
    from shardkit.comm_counter import CommCounter

    rank = dist.get_rank()
    _, _, opt, _, schedule = _replicated_schedule(kind, name)
    counts = []
    for step in range(3):
        if step == 2:
            schedule._replicas_go_on = lambda s, i: True
        x, y = _batch(step, rank // 2)
        opt.zero_grad()
        with CommCounter() as comm:
            schedule.step(x, target=y)
        opt.step()
        counts.append((comm.calls_by_op.get("all_reduce", 0), comm.by_op.get("all_reduce", 0)))
    return counts[1:]


def test_the_replicas_agreement_costs_one_two_element_all_reduce_per_action(world4):
    """What the docstrings state: per action (F, BW; F, B, W under ZB-H1) of a
    ShardedDataParallel / FSDP stage with one replica, one all-reduce of two float32
    elements, ``2 * 4 * 2(d-1)/d`` bytes with ``d = 2``."""
    for kind, name, actions in (("sdp", "1F1B", 2), ("fsdp", "GPipe", 2), ("fsdp", "ZB-H1", 3)):
        for rank, (agreed, bypassed) in enumerate(world4.run(_agreement_cost, kind, name)):
            calls, nbytes = agreed[0] - bypassed[0], agreed[1] - bypassed[1]
            assert calls == actions * CHUNKS, (kind, name, rank, agreed, bypassed)
            assert nbytes == actions * CHUNKS * 2 * 4 * 2 * (2 - 1) / 2, \
                (kind, name, rank, agreed, bypassed)


def _mixed_modes():
    """Four stages; stage 1 in eval() on its rank only, for two steps; then every stage in
    eval(), after a new schedule. The warnings about modes each step gave on this rank."""
    import warnings

    rank = dist.get_rank()
    module = split_sequential(_model(4), [1, 1, 1, 2])[rank]
    module.train(rank != 1)
    caught = []
    for build, modes in ((True, None), (False, None), (True, False)):
        if build:
            schedule = Schedule1F1B(PipelineStage(module, rank, 4), CHUNKS, F.mse_loss)
        if modes is not None:
            module.train(modes)
        x, y = _batch(0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            schedule.step(x, target=y)
        caught.append([str(w.message) for w in seen if "same mode" in str(w.message)])
    return caught


def test_stage_modules_in_different_modes_are_noticed_on_every_rank(world4):
    """Was: one rank's stage in eval() while the others trained went unnoticed. Now the
    first step's agreement (no message of its own) warns on every rank, once per schedule,
    naming this rank's stages' modes; stages all in one mode give no warning."""
    for rank, (first, second, alike) in enumerate(world4.run(_mixed_modes)):
        assert len(first) == 1, (rank, first)
        mode = "eval" if rank == 1 else "train"
        assert f"(on this rank: stage {rank} in {mode}())" in first[0], (rank, first)
        assert second == [] and alike == [], (rank, second, alike)
