"""Multi-process pipeline schedules (world 2) on a batch ``chunks`` does not divide, where only
a later stage sees the argument to split: a keyword tensor given to a later stage's rank and
the last stage's target (a flattened one, a dict of tensors) are checked against the batch's
rows, which the first stage's rank sends with its shape headers; a ``loss_fn`` that says
nothing about its reduction keeps torch's ``1/chunks``.

Its review found:

A later stage's keyword tensor, or a target, cut at other rows than the batch (8 rows in 4
micro-batches beside a 6-row keyword tensor: 2, 2, 1, 1 against 2, 2, 2, 2) broadcast
silently, since only the first stage's rank knew the batch; a dict target went whole to every
micro-batch; a plain summing ``loss_fn`` on an uneven split weighed each micro-batch's sum by
its share of the rows (neither one process's sum nor torch's sum over ``chunks``).

review

Review of the pipelines' frozen-unit check (world 4: 2 pipelines x 2 FSDP replicas per
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
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

from tests.nn.test_torch_pipelining_suite import SCHEDULES

D = 5
world2 = world_fixture(2, timeout=240)


class _Scaled(nn.Module):
    """``tanh(lin(x))``, times a per-sample ``scale`` ``(rows, 1)`` when one is given."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, scale=None):
        h = torch.tanh(self.lin(x))
        return h if scale is None else h * scale


def _pipeline(schedule_name, chunks, loss_fn):
    """This rank's stage indices, the stage modules, the schedule, and the reference layers."""
    cls, per_rank, placement = SCHEDULES[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    torch.manual_seed(0)
    ref = [_Scaled() for _ in range(n)]
    torch.manual_seed(0)
    modules = [_Scaled() for _ in range(n)]
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, loss_fn)
    return mine, modules, schedule, ref


def _worst_grad(mine, modules, ref):
    return max((a.grad - b.grad).abs().max().item() for s in mine
               for a, b in zip(modules[s].parameters(), ref[s].parameters()))


def _step(schedule, mine, last_stage, x, target, **kwargs):
    """One step: what it returned (``"loss"`` or ``None``) or raised (the ValueError's text)."""
    try:
        loss = schedule.step(*((x,) if 0 in mine else ()),
                             target=target if last_stage in mine else None, **kwargs)
    except ValueError as error:
        return str(error)
    return "loss" if loss is not None else None


def _later_rank_arguments(schedule_name):
    """Steps whose keyword tensor only rank 1 gets (``scale`` of 6 rows beside a batch of 8)
    or whose target does not fit the batch (4 rows beside 5; a flattened ``(8 * 2,)`` target
    beside 8 rows in 3 micro-batches), each between good steps."""
    loss_fn = lambda out, t: ((out - t) ** 2).mean()  # noqa: E731 (broadcasts: no error)
    mine, modules, schedule, ref = _pipeline(schedule_name, 4, loss_fn)
    last = len(ref) - 1
    later = dist.get_rank() == 1
    found = []
    for rows, scale_rows, target_rows in ((8, 8, 8), (8, 6, 8), (8, 8, 8), (5, 5, 4),
                                          (10, 10, 10)):
        x, y = torch.randn(rows, D), torch.randn(target_rows, D)
        kwargs = {"scale": torch.rand(scale_rows, 1) + 0.5} if later else {}
        found.append(_step(schedule, mine, last, x, y, **kwargs))
    flat_loss = lambda out, t: ((out.reshape(-1) - t) ** 2).mean()  # noqa: E731
    mine, modules, schedule, ref = _pipeline(schedule_name, 3, flat_loss)
    x = torch.randn(8, D)
    found.append(_step(schedule, mine, last, x, torch.randn(8 * D)))
    return found


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBV"])
def test_a_later_stages_argument_cut_at_other_rows_than_the_batch_is_refused_everywhere(
        world2, schedule):
    """A keyword tensor given to rank 1 (6 rows beside the batch's 8 in 4 micro-batches) and a
    target of 4 rows beside a batch of 5 (cut 1, 1, 1, 1 against 2, 1, 1, 1) broadcast
    silently against the batch's micro-batches; a target flattened over the batch's rows on
    an uneven split (8 * 5 elements in 3 micro-batches: 14, 13, 13 against 3 * 5, 3 * 5,
    2 * 5) reached ``loss_fn`` cut at other samples. Each now fails the step on every rank
    with an error naming the argument and both cuts, and the pipeline goes on."""
    last_rank = 0 if schedule == "ZBV" else 1
    for rank, found in enumerate(world2.run(_later_rank_arguments, schedule)):
        good, keyword, again, target, after, flat = found
        expect = "loss" if rank == last_rank else None
        assert good == again == after == expect, (rank, found)
        assert "could not finish this step" in keyword and \
            "step(scale=...): a tensor passed by keyword is split along dim 0 into chunks=4 " \
            "micro-batches of [2, 2, 1, 1] rows, but the batch's 8 rows into [2, 2, 2, 2]" \
            in keyword, keyword
        assert "target of shape (4, 5) is cut along dim 0 into chunks=4 micro-batches of " \
            "[1, 1, 1, 1] rows, but the batch's 5 rows into [2, 1, 1, 1]" in target, target
        assert "target of shape (40,) is cut along dim 0 into chunks=3 micro-batches of " \
            "[14, 13, 13] rows, but the batch's 8 rows into [3, 3, 2]" in flat, flat


def _dict_target_training(schedule_name):
    """Two SGD steps with a dict target ``{"y", "weight"}`` (per-sample) on 7 rows in 3
    micro-batches, beside one process on the whole batch: the worst gradient difference."""
    def loss_fn(out, target):
        return (target["weight"] * (out - target["y"]) ** 2).mean()

    loss_fn.reduction = "mean"  # declared: the batch mean, as one process
    mine, modules, schedule, ref = _pipeline(schedule_name, 3, loss_fn)
    opt = torch.optim.SGD([q for s in mine for q in modules[s].parameters()], lr=0.5)
    ref_opt = torch.optim.SGD([q for m in ref for q in m.parameters()], lr=0.5)
    worst = 0.0
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(7, D, generator=g)
        target = {"y": torch.randn(7, D, generator=g), "weight": torch.rand(7, 1, generator=g)}
        opt.zero_grad()
        ref_opt.zero_grad()
        result = _step(schedule, mine, len(ref) - 1, x, target)
        if result not in ("loss", None):
            return result
        h = x
        for module in ref:
            h = module(h)
        loss_fn(h, target).backward()
        worst = max(worst, _worst_grad(mine, modules, ref))
        opt.step()
        ref_opt.step()
    return worst


@pytest.mark.parametrize("schedule", ["GPipe", "ZBV"])
def test_a_dict_target_is_split_with_the_batch(world2, schedule):
    """A target holding per-sample tensors in a dict went whole to every micro-batch's
    ``loss_fn`` (a shape error, or a silent broadcast); its tensors are now split along
    dim 0 with the batch, as keyword arguments are, and training matches one process."""
    for rank, worst in enumerate(world2.run(_dict_target_training, schedule)):
        assert isinstance(worst, float) and worst < 1e-5, (schedule, rank, worst)


def _plain_sum(out, target):
    return ((out - target) ** 2).sum()


def _sum_over_chunks(out, target):
    return _plain_sum(out, target) / 4


# loss_fn given to the schedule, and what one process backpropagates on the whole batch
_UNDECLARED = {"plain sum": (_plain_sum, _sum_over_chunks), "F.mse_loss": (F.mse_loss, F.mse_loss)}


def _undeclared_loss_step(schedule_name, case):
    """One step on 10 rows in 4 micro-batches: the worst gradient difference from one process
    backpropagating the case's expected loss over the whole batch."""
    loss_fn, expected_fn = _UNDECLARED[case]
    mine, modules, schedule, ref = _pipeline(schedule_name, 4, loss_fn)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(10, D, generator=g), torch.randn(10, D, generator=g)
    _step(schedule, mine, len(ref) - 1, x, y)
    h = x
    for module in ref:
        h = module(h)
    expected_fn(h, y).backward()
    return _worst_grad(mine, modules, ref)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_a_plain_summing_loss_keeps_torchs_one_over_chunks_with_an_uneven_split(
        world2, schedule):
    """torch divides every micro-batch's loss by ``chunks``. A plain function that sums gave
    on 10 rows in 4 micro-batches each micro-batch's sum weighed by its share of the rows
    (3/10, 3/10, 2/10, 2/10): neither the batch's sum over ``chunks`` (torch) nor its sum.
    A function that says nothing about its reduction now keeps torch's ``1/chunks``; one whose
    ``reduction`` parameter defaults to ``"mean"`` (``F.mse_loss``) still trains on the batch
    mean, as one process."""
    for case in _UNDECLARED:
        for rank, worst in enumerate(world2.run(_undeclared_loss_step, schedule, case)):
            assert worst < 1e-5, (schedule, case, rank, worst)


world4 = world_fixture(4, timeout=240)


class _Ahead(nn.Module):
    """The first stage: ``tanh(a(x))``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x, use):
        return torch.tanh(self.a(x))


class _FrozenOnTheInput(nn.Module):
    """The last stage: ``lin(tanh(f(x)))`` with ``f`` frozen (its own FSDP unit), on zeros in
    place of the input where ``use`` is 0 (the input ignored)."""

    def __init__(self):
        super().__init__()
        self.f, self.lin = nn.Linear(D, D), nn.Linear(D, D)
        self.f.requires_grad_(False)

    def forward(self, x, use):
        if int(use[0]) == 0:
            x = torch.zeros_like(x)
        return self.lin(torch.tanh(self.f(x)))


def _input_ignored_on_some_replicas(schedule_name, last_stage, step_uses):
    """2 pipelines x 2 FSDP replicas per stage, ``last_stage`` the last stage's module class;
    ``step_uses``: per step, whether each pipeline's last stage uses its input. What each step
    returned (the loss's difference from one process on this pipeline's half, on the last
    stage's rank; ``None`` on the first stage's) or raised (the ValueError's text)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, pipe_rank = rank // 2, rank % 2
    torch.manual_seed(0)
    ref = [_Ahead(), last_stage()]
    module = [_Ahead(), last_stage()][pipe_rank]
    module.load_state_dict(ref[pipe_rank].state_dict())
    if pipe_rank == 1:
        module.f = FullyShardedDataParallel(module.f, process_group=replicas[1])
    module = FullyShardedDataParallel(module, process_group=replicas[pipe_rank])
    cls = SCHEDULES[schedule_name][0]
    schedule = cls(PipelineStage(module, pipe_rank, 2, group=pipelines[pipeline]), 2,
                   F.mse_loss)
    found = []
    for step, uses in enumerate(step_uses):
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


@pytest.mark.parametrize("schedule", ["1F1B", "ZB-H1"])
def test_a_frozen_unit_on_an_input_ignored_by_some_replicas_is_refused_everywhere(
        world4, schedule):
    """A frozen FSDP unit on the last stage's input path, the input ignored by one replica and
    used by the other: the backward gathered the unit on one replica only, and gloo aborted
    every process. The replicas now share which inputs each backward reaches (where a stage
    holds frozen units) and, where they differ, skip that backward alike and raise one error
    naming the unit on every rank; the pipelines go on."""
    # steps: both pipelines use the input, one ignores it, both ignore it, both use it again
    for rank, found in enumerate(world4.run(_input_ignored_on_some_replicas, schedule,
                                            _FrozenOnTheInput,
                                            ([1, 1], [0, 1], [0, 0], [1, 1]))):
        used, mixed, ignored, again = found
        assert isinstance(mixed, str) and "stage 1 (the last), micro-batch 0: its replicas " \
            "(FSDP's data-parallel ranks) disagree on whether its backward reaches its input " \
            "[0]" in mixed and "all frozen (f), which a backward gathers only where it " \
            "reaches them" in mixed, (rank, mixed)
        for result in (used, ignored, again):
            assert result is None if rank % 2 == 0 else result < 1e-6, (rank, found)


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


@pytest.mark.parametrize("schedule", ["1F1B"])
def test_a_frozen_unit_after_a_trainable_layer_trains_when_some_replicas_ignore_the_input(
        world4, schedule):
    """One replica of the last stage ignores its input, the other uses it; the frozen unit
    sits after a trainable layer, so both backwards run through it (its gathers pair, as
    before the frozen-unit check): the step goes through on every rank with one process's
    loss, where it was refused."""
    # steps: both pipelines use the input, one ignores it, both use it again
    for rank, found in enumerate(world4.run(_input_ignored_on_some_replicas, schedule,
                                            _FrozenAfterATrainableLayer,
                                            ([1, 1], [0, 1], [1, 1]))):
        for result in found:
            assert result is None if rank % 2 == 0 else \
                isinstance(result, float) and result < 1e-5, (rank, found)
