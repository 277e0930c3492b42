"""Weights tied across pipeline ranks, frozen when the stages are built and unfrozen later."""

import torch

from shardkit.models import synthetic_batch
from shardkit.nn.pipe import PipelineStage, Schedule1F1B
from shardkit.recipes import token_cross_entropy
from shardkit.testing import world_fixture
from tests.nn.test_pipe_schedules import TIED_GPT, _tied_gpt_stages

world2 = world_fixture(2, timeout=120)  # a hung step fails its test in two minutes


def _unfrozen_copies_that_started_apart():
    """The tied weight frozen when the stages are built, the last stage's copy off by one
    (ranks that initialised the model differently); one step frozen, then unfrozen on both
    ranks for two: this rank's copy after each step."""
    parts, mine = _tied_gpt_stages(2, "loop")
    tied = parts[0][0].tok.weight
    tied.requires_grad_(False)
    if mine[0] == 1:
        with torch.no_grad():
            tied.add_(1.0)
    stage = PipelineStage(parts[mine[0]], mine[0], 2)
    schedule = Schedule1F1B(stage, 2, token_cross_entropy)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    copies = []
    for step in range(3):
        tied.requires_grad_(step > 0)
        opt.zero_grad()
        idx, target = synthetic_batch(TIED_GPT, 4, step)
        schedule.step(idx, target=target)
        opt.step()
        copies.append(tied.detach().clone())
    return copies


def test_a_tie_frozen_at_the_first_step_takes_the_earlier_copys_values_too(world2):
    """The first step gives the later copy of a tie the earlier one's values even while it is
    frozen (as DeepSpeed broadcasts every tied weight at construction), so once unfrozen the
    copies train as one weight. Before, only ties trainable at the first step were synced:
    copies that started apart (ranks that initialised the model differently) computed with
    two weights, and once unfrozen trained two weights silently, each with the whole
    gradient."""
    first, last = world2.run(_unfrozen_copies_that_started_apart)
    for step in range(3):
        assert torch.equal(first[step], last[step]), step


def _one_copy_frozen_after_the_first_step():
    """A good step, then rank 1 freezes its copy of the tied weight alone (the error each rank
    gets), then unfreezes it: the pipeline goes on (whether the third step ran)."""
    parts, mine = _tied_gpt_stages(2, "loop")
    tied = parts[0][0].tok.weight
    stage = PipelineStage(parts[mine[0]], mine[0], 2)
    schedule = Schedule1F1B(stage, 2, token_cross_entropy)
    error = None
    for step in range(3):
        tied.requires_grad_(not (step == 1 and mine[0] == 1))
        stage.module.zero_grad()
        idx, target = synthetic_batch(TIED_GPT, 4, step)
        try:
            schedule.step(idx, target=target)
        except ValueError as err:
            error = (step, str(err))
    return error, tied.grad is not None


def test_a_tie_frozen_on_one_rank_after_the_first_step_is_one_clear_error(world2):
    """The first step checks that both copies of a tie agree on ``requires_grad``; a copy
    frozen alone later fails that step on every rank with the same error (the next step,
    copies agreeing again, runs). Before, the trainable copy silently kept only its own
    stage's share of the gradient: two weights."""
    (error0, ran0), (error1, ran1) = world2.run(_one_copy_frozen_after_the_first_step)
    assert error0 is not None and error0[0] == 1 and error1 == error0, (error0, error1)
    assert "stage 0's '0.tok.weight' = stage 1's '4.weight') is frozen here and trainable " \
        "on global rank 0; freeze both copies or neither" in error0[1], error0[1]
    assert ran0 and ran1


def _interleaved_stages_frozen_and_unfrozen_and_autocast_toggled():
    """Interleaved 1F1B and ZBV (two stages per rank): a stage frozen for the first step,
    then unfrozen (on the rank holding stage 0, and, in another run, on the rank holding
    stage 1), then a step under bf16 autocast: each step runs, and the stages' parameters
    follow one process's SGD."""
    import torch.nn as nn
    import torch.nn.functional as F
    from shardkit import distributed as dist
    from shardkit.nn.pipe import ScheduleInterleaved1F1B, ScheduleZBV, split_sequential
    from shardkit.nn.pipe.stage import stage_rank
    rank, out = dist.get_rank(), {}
    for cls, placement in ((ScheduleInterleaved1F1B, "loop"), (ScheduleZBV, "v")):
        for unfrozen in (0, 1):
            torch.manual_seed(0)
            layers = [nn.Linear(8, 8) for _ in range(4)]
            ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
            ref.load_state_dict(nn.Sequential(*layers).state_dict())
            parts = split_sequential(nn.Sequential(*layers), [1, 1, 1, 1])
            mine = [s for s in range(4) if stage_rank(s, 4, 2, placement) == rank]
            schedule = cls([PipelineStage(parts[s], s, 4, placement=placement) for s in mine],
                           2, nn.MSELoss())
            opt = torch.optim.SGD([p for s in mine for p in parts[s].parameters()], lr=0.1)
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            worst = [0.0, 0.0]  # fp32 steps, then the bf16 autocast step
            for step in range(3):
                for module in (parts[unfrozen], ref[unfrozen]):
                    module.requires_grad_(step > 0)
                g = torch.Generator().manual_seed(step)
                x, t = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=step == 2):
                    opt.zero_grad()
                    schedule.step(x, target=t)
                    opt.step()
                    ref_opt.zero_grad()
                    F.mse_loss(ref(x).float(), t).backward()
                    ref_opt.step()
                worst[step == 2] = max(worst[step == 2], max(
                    (a - b).abs().max().item() for s in mine
                    for a, b in zip(parts[s].parameters(), ref[s].parameters())))
            out[cls.__name__, unfrozen] = worst
    return out


def test_interleaved_stages_may_be_unfrozen_and_autocast_toggled_between_steps(world2):
    # before: the step after a stage was unfrozen (or autocast switched on) failed on every
    # rank, "expected an output of float32 (2, 8) ... found float32 (2, 8) requiring grad"
    for worst in world2.run(_interleaved_stages_frozen_and_unfrozen_and_autocast_toggled):
        assert max(fp32 for fp32, _ in worst.values()) < 1e-6, worst
        assert max(bf16 for _, bf16 in worst.values()) < 1e-3, worst  # bf16 rounding
