"""Review of the pipelines' frozen-unit check (world 4: 2 pipelines x 2 FSDP replicas per
stage): where a stage holds a frozen FSDP unit after a trainable layer, every replica's
backward runs through the unit (to reach the layer's parameters) whether or not it uses its
input, so the units' gathers pair and the step is one process's.

Its review found: the check compared which of the stage's inputs each replica's backward
reaches and refused any difference, so such a stage, which trained before, failed every step
where one replica ignored its input.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage
from shardkit.testing import world_fixture

from tests.nn.test_torch_pipelining_suite import SCHEDULES

D = 5
world4 = world_fixture(4, timeout=240)


class _Ahead(nn.Module):
    """The first stage: ``tanh(a(x))``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x, use):
        return torch.tanh(self.a(x))


class _FrozenAfterATrainableLayer(nn.Module):
    """The last stage: ``f(tanh(lin(x)))`` with ``f`` frozen (its own FSDP unit), on zeros in
    place of the input where ``use`` is 0 (the input ignored; ``lin`` still trains)."""

    def __init__(self):
        super().__init__()
        self.lin, self.f = nn.Linear(D, D), nn.Linear(D, D)
        self.f.requires_grad_(False)

    def forward(self, x, use):
        if int(use[0]) == 0:
            x = torch.zeros_like(x)
        return self.f(torch.tanh(self.lin(x)))


def _input_ignored_before_a_trainable_layer(schedule_name):
    """Three steps, the last stage's input used by both pipelines, by one, by both: per step
    the loss's difference from one process on this pipeline's half (on the last stage's
    rank), or the ValueError's text."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, pipe_rank = rank // 2, rank % 2
    torch.manual_seed(0)
    ref = [_Ahead(), _FrozenAfterATrainableLayer()]
    module = [_Ahead(), _FrozenAfterATrainableLayer()][pipe_rank]
    module.load_state_dict(ref[pipe_rank].state_dict())
    if pipe_rank == 1:
        module.f = FullyShardedDataParallel(module.f, process_group=replicas[1])
    module = FullyShardedDataParallel(module, process_group=replicas[pipe_rank])
    cls = SCHEDULES[schedule_name][0]
    schedule = cls(PipelineStage(module, pipe_rank, 2, group=pipelines[pipeline]), 2,
                   F.mse_loss)
    found = []
    for step, uses in enumerate(([1, 1], [0, 1], [1, 1])):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, D, generator=g), torch.randn(8, D, generator=g)
        half = slice(4 * pipeline, 4 * pipeline + 4)
        use = torch.full((4,), uses[pipeline])
        module.zero_grad()
        try:
            loss = schedule.step(*((x[half],) if pipe_rank == 0 else ()),
                                 target=y[half] if pipe_rank == 1 else None, use=use)
        except ValueError as error:
            found.append(str(error))
            continue
        if pipe_rank == 0:
            found.append(None)
            continue
        with torch.no_grad():
            expected = F.mse_loss(ref[1](ref[0](x[half], use), use), y[half])
        found.append((loss - expected).abs().item())
    return found


@pytest.mark.parametrize("schedule", ["1F1B"])
def test_a_frozen_unit_after_a_trainable_layer_trains_when_some_replicas_ignore_the_input(
        world4, schedule):
    """One replica of the last stage ignores its input, the other uses it; the frozen unit
    sits after a trainable layer, so both backwards run through it (its gathers pair, as
    before the frozen-unit check): the step goes through on every rank with one process's
    loss, where it was refused."""
    for rank, found in enumerate(world4.run(_input_ignored_before_a_trainable_layer,
                                            schedule)):
        for result in found:
            assert result is None if rank % 2 == 0 else \
                isinstance(result, float) and result < 1e-5, (rank, found)
