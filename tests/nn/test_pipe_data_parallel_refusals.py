"""Pipelines under data parallelism (2 pipelines x 2 stages): a step that one pipeline refuses
before running it (its first-step checks, or a later batch its first stage cannot split) is an
error on every rank of both pipelines, naming the replica that refused, instead of leaving the
other pipeline waiting in the stages' data-parallel all-reduce; the next step trains as one
process does.

Review of the replicas' refusals

Pipelines whose stages are ShardedDataParallel modules over their replicas (2 pipelines x 2
stages): eval steps share no refusal over those replicas, and the first training step after
eval steps still does (review of f9eb39d).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.comm_counter import CommCounter
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                              ScheduleZBV, ScheduleZeroBubble, split_sequential)
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

world4 = world_fixture(4, timeout=120)

WIDTH, ROWS, CHUNKS = 4, 8, 4
SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), "1F1B": (Schedule1F1B, 1, "loop"),
             "Interleaved": (ScheduleInterleaved1F1B, 2, "loop"),
             "ZB-H1": (ScheduleZeroBubble, 1, "loop"), "ZBV": (ScheduleZBV, 2, "v")}


def _layers(n):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n)])


def _build(name, torch_ddp):
    """The stage count, this rank's stages' modules and the schedule: pipelines {0, 1} and
    {2, 3}, replicas {0, 2} and {1, 3}, averaged by the stage (``data_parallel_group``) or by
    torch DDP."""
    cls, per_rank, placement = SCHEDULES[name]
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group, replica_group = pipelines[rank // 2], replicas[rank % 2]
    n = 2 * per_rank
    parts = split_sequential(_layers(n), [1] * n)
    mine = {s: parts[s] for s in range(n) if stage_rank(s, n, 2, placement) == rank % 2}
    ddp = nn.parallel.DistributedDataParallel
    stages = [PipelineStage(ddp(part, process_group=replica_group) if torch_ddp else part, s, n,
                            group=group, placement=placement,
                            data_parallel_group=None if torch_ddp else replica_group)
              for s, part in mine.items()]
    return n, mine, cls(stages[0] if per_rank == 1 else stages, CHUNKS, F.mse_loss)


def _outcome(schedule, x, target):
    try:
        schedule.step(x, target=target)
        return "ok"
    except ValueError as error:
        return str(error)


def _refusals_on_one_pipeline(name, torch_ddp):
    """Step 0: pipeline 1's target has fewer rows than ``chunks`` (refused by the first-step
    checks); step 1: pipeline 1's batch has (refused by its first stage); step 2: both fine.
    Per step: this rank's outcome, whether pipeline 1 kept its ``.grad`` through its refusals,
    and after step 2 the worst difference from one process's gradients."""
    n, mine, schedule = _build(name, torch_ddp)
    rank = dist.get_rank()
    refusing = rank >= 2
    x, t = torch.randn(2 * ROWS, WIDTH), torch.randn(2 * ROWS, WIDTH)
    half = slice(ROWS * (rank // 2), ROWS * (rank // 2 + 1))
    mx, mt = x[half], t[half]
    for part in mine.values():
        for p in part.parameters():
            p.grad = torch.full_like(p, 7.0)
    outcomes = [_outcome(schedule, mx, mt[:2] if refusing else mt),
                _outcome(schedule, mx[:2] if refusing else mx, mt)]
    kept = all(torch.equal(p.grad, torch.full_like(p, 7.0))
               for part in mine.values() for p in part.parameters())
    for part in mine.values():
        part.zero_grad()
    outcomes.append(_outcome(schedule, mx, mt))
    reference = _layers(n)
    F.mse_loss(reference(x), t).backward()
    worst = max((p.grad - r.grad).abs().max().item() for s, part in mine.items()
                for p, r in zip(part.parameters(), reference[s].parameters()))
    return outcomes, kept, worst


def test_a_step_one_pipeline_refuses_fails_on_every_rank_of_every_pipeline(world4):
    """Was: the refusing pipeline raised before its step while the other ran it and waited
    forever in the stages' data-parallel all-reduce (GPipe, 1F1B, interleaved, ZB-H1, ZBV;
    averaged by the stage or by torch DDP). Now the refusing ranks join that all-reduce saying
    so (their ``.grad`` left alone), every rank of the other pipeline raises naming the
    replica that refused and why, and the next step matches one process."""
    cases = [(name, False) for name in SCHEDULES] + [("GPipe", True)]
    for name, torch_ddp in cases:
        results = world4.run(_refusals_on_one_pipeline, name, torch_ddp)
        for rank, (outcomes, kept, worst) in enumerate(results):
            where = (name, torch_ddp, rank)
            refused, later, fine = outcomes
            assert fine == "ok" and worst < 1e-5, (where, fine, worst)
            if rank >= 2:
                assert "target of shape (2, 4) cannot be split into chunks=4" in refused, where
                assert "chunks=4 is larger than the batch size 2" in later, where
                assert kept, where
                continue
            for error, why in ((refused, "target of shape (2, 4)"),
                               (later, "chunks=4 is larger than the batch size 2")):
                assert "the step failed in another pipeline" in error, (where, error)
                assert f"replica at global rank {rank + 2}" in error, (where, error)
                assert "refused the step before running it" in error and why in error, where


def _first_step_refused_under_sharded_stages(kind, name):
    """Stages wrapped in ShardedDataParallel or FSDP over their replicas (no
    ``data_parallel_group``); pipeline 1's first target has fewer rows than ``chunks``. This
    rank's outcome of that step and of the next, fine, one."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    cls, _, _ = SCHEDULES[name]
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    part = split_sequential(_layers(2), [1, 1])[rank % 2]
    if kind == "fsdp":
        module = FullyShardedDataParallel(part, process_group=replicas)
    else:
        optimizer = OSS(part.parameters(), torch.optim.SGD, lr=0.1, group=replicas)
        module = ShardedDataParallel(part, optimizer, process_group=replicas)
    schedule = cls(PipelineStage(module, rank % 2, 2, group=pipelines[rank // 2]), CHUNKS,
                   F.mse_loss)
    x, t = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    return [_outcome(schedule, x, t[:2] if rank >= 2 else t), _outcome(schedule, x, t)]


def test_a_first_step_one_pipeline_refuses_under_sharded_stages_fails_everywhere(world4):
    """Was: with ShardedDataParallel / FSDP stage modules reducing over the replicas, the
    other pipeline ran the step and waited forever in their collectives. Now the replicas
    share their first-step refusals (one one-element all-reduce per group, at the first step
    only) and both pipelines raise, naming the replica; the next step runs."""
    for kind, name in (("sdp", "1F1B"), ("fsdp", "ZB-H1")):
        for rank, (refused, fine) in enumerate(world4.run(_first_step_refused_under_sharded_stages,
                                                          kind, name)):
            assert fine == "ok", (kind, rank, fine)
            assert "target of shape (2, 4) cannot be split into chunks=4" in refused, (kind, rank)
            if rank < 2:
                assert "data-parallel replica at global rank 3" in refused, (kind, rank, refused)


WIDTH, ROWS, CHUNKS = 4, 8, 4


def _sharded_stage_schedule():
    """Pipelines {0, 1} and {2, 3}; each stage a ShardedDataParallel over replicas {0, 2} or
    {1, 3}."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    torch.manual_seed(0)
    part = split_sequential(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)),
                            [1, 1])[rank % 2]
    optimizer = OSS(part.parameters(), torch.optim.SGD, lr=0.1, group=replicas)
    module = ShardedDataParallel(part, optimizer, process_group=replicas)
    return Schedule1F1B(PipelineStage(module, rank % 2, 2, group=pipelines[rank // 2]), CHUNKS,
                        F.mse_loss)


def _outcome_rev(call, x, target):
    """``"ok"`` and the all-reduces the call ran, or the ValueError's text."""
    try:
        with CommCounter() as comm:
            call(x, target=target)
        return "ok", comm.calls_by_op.get("all_reduce", 0)
    except ValueError as error:
        return str(error), None


def _eval_then_refused_training_step():
    """Eval on pipeline 0 only, then on both; then a first training step that pipeline 1
    refuses (its target has fewer rows than chunks); then a fine one."""
    schedule = _sharded_stage_schedule()
    rank = dist.get_rank()
    x, t = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    outcomes = [_outcome_rev(schedule.eval, x, t) if rank < 2 else ("ok", 0)]
    outcomes.append(_outcome_rev(schedule.eval, x, t))
    outcomes.append(_outcome_rev(schedule.step, x, t[:2] if rank >= 2 else t))
    outcomes.append(_outcome_rev(schedule.step, x, t))
    return outcomes


def test_eval_joins_no_replica_all_reduce_and_the_first_training_step_shares_refusals(world4):
    """Was: eval as a first step ran the replicas' refusal all-reduce (one pipeline evaluating
    alone hung there) and counted as the first step, so a training step refused by one
    pipeline afterwards left the other waiting in ShardedDataParallel's reduction. Now eval
    joins no all-reduce and the first training step shares the refusals: both pipelines
    raise, naming the replica, and the next step runs."""
    for rank, outcomes in enumerate(world4.run(_eval_then_refused_training_step)):
        (alone, alone_reduces), (both, both_reduces), (refused, _), (fine, _) = outcomes
        assert (alone, alone_reduces) == ("ok", 0) and (both, both_reduces) == ("ok", 0), \
            (rank, outcomes)
        assert "target of shape (2, 4) cannot be split into chunks=4" in refused, (rank, refused)
        if rank < 2:
            assert "data-parallel replica at global rank 3" in refused, (rank, refused)
        assert fine == "ok", (rank, fine)
