"""What may change between two steps of one multi-process schedule, in one world of 2 ranks:
an evaluation step under ``torch.no_grad()`` between training steps (same losses as one process,
training goes on unchanged), a new batch size (the shapes are announced again), and a batch
that cannot be split (the same clear error on every rank, no rank left waiting)."""

import torch
import torch.nn as nn

from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
from shardkit.nn.pipe.balance import balance_by_size
from shardkit.testing import world_fixture
from tests.nn.test_pipe_schedules import WIDTH, _batch, _max_param_diff, _model

world2 = world_fixture(2)


def _train_eval_resize_and_refuse(schedule_cls):
    from shardkit import distributed as dist
    rank = dist.get_rank()
    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    stage = PipelineStage(split_sequential(_model(), [5, 4])[rank], rank, 2)
    schedule = schedule_cls(stage, 2, nn.functional.mse_loss)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    worst_loss = 0.0
    # train, evaluate, train, train on 8 rows instead of 16, evaluate
    for step, (train, rows) in enumerate([(True, 16), (False, 16), (True, 16), (True, 8),
                                          (False, 8)]):
        x, y = _batch(step, rows)
        with torch.set_grad_enabled(train):
            ref_loss = nn.functional.mse_loss(reference(x), y)
            if train:
                ref_opt.zero_grad()
                opt.zero_grad()
            loss = schedule.step(x, target=y)
        if train:
            ref_loss.backward()
            ref_opt.step()
            opt.step()
        if loss is not None:
            worst_loss = max(worst_loss, abs(loss.item() - ref_loss.item()))
    ref_stage = split_sequential(reference, [5, 4])[rank]
    param_diff = _max_param_diff(stage, ref_stage)
    x, y = _batch(9, 7)  # 7 rows, chunks=2
    try:
        schedule.step(x, target=y)
        error = ""
    except ValueError as e:
        error = str(e)
    return worst_loss, param_diff, error


def _both_schedules():
    return {cls.__name__: _train_eval_resize_and_refuse(cls)
            for cls in (ScheduleGPipe, Schedule1F1B)}


def test_eval_steps_new_batch_sizes_and_a_bad_batch_between_training_steps(world2):
    for rank, results in enumerate(world2.run(_both_schedules)):
        for name, (worst_loss, param_diff, error) in results.items():
            assert worst_loss <= 1e-5 and param_diff <= 1e-5, (rank, name, worst_loss,
                                                                param_diff)
            assert "batch size 7 is not divisible by chunks=2" in error, (rank, name, error)


def test_balance_by_size_with_batchnorm_leaves_running_stats_alone():
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    balance = balance_by_size(2, model, torch.randn(8, WIDTH), chunks=2)
    assert sum(balance) == len(model) and len(balance) == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
