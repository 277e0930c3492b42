"""Code written for ``torch.distributed.pipelining``, run on shardkit's schedules (world 2):
torch's ``PipelineStage(submodule, stage_index, num_stages, device, input_args=...)`` forms,
a schedule's ``n_microbatches=`` keyword, and ``kwargs_chunk_spec`` / ``args_chunk_spec``
(``TensorChunkSpec(dim)``, ``_Replicate()``), each training like one process step by step, and
the torch options shardkit does not run refused by name on every rank."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

D = 6
world2 = world_fixture(2, timeout=240)


class _Shifted(nn.Module):
    """``tanh(lin(x)) + shift``: ``shift`` is a ``(D,)`` row shared by every sample (to be
    passed whole: split along dim 0 it would not fit) or a ``(D, batch)`` column per sample
    (split along dim 1)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, shift=None):
        h = torch.tanh(self.lin(x))
        if shift is None:
            return h
        return h + (shift if shift.dim() == 1 else shift.t())


def _torch_style_stage(module, index, count, form, placement):
    """A stage built the ways torch's examples build one."""
    cpu = torch.device("cpu")
    if form == "positional device":
        return PipelineStage(module, index, count, cpu, placement=placement)
    if form == "device and group":  # torchtitan's form
        return PipelineStage(module, index, count, cpu, group=torch.distributed.group.WORLD,
                             placement=placement)
    return PipelineStage(module, index, count, cpu, input_args=torch.zeros(2, D),
                         output_args=(torch.zeros(2, D),), placement=placement)


def _train_torch_style(schedule_name: str, form: str, spec: str) -> float:
    """Three steps of a pipeline built and driven as torch's examples do, beside one process
    on the same batches: the worst difference of a gradient, a loss or the returned loss."""
    cls, per_rank, placement = {"GPipe": (ScheduleGPipe, 1, "loop"),
                                "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop")
                                }[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n, m = p * per_rank, 2 * p
    torch.manual_seed(0)
    blocks = [_Shifted() for _ in range(n)]
    reference = copy.deepcopy(blocks)
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [_torch_style_stage(blocks[s], s, n, form, placement) for s in mine]
    chunk_spec = {"shift": _Replicate() if spec == "replicate" else TensorChunkSpec(1)}
    schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=m, loss_fn=F.mse_loss,
                   args_chunk_spec=(TensorChunkSpec(0),), kwargs_chunk_spec=chunk_spec)
    worst = 0.0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2 * m, D, generator=g), torch.randn(2 * m, D, generator=g)
        shift = torch.randn(D, generator=g) if spec == "replicate" else \
            torch.randn(D, 2 * m, generator=g)
        for module in blocks + reference:
            module.zero_grad()
        losses = []
        batch = (x,) if 0 in mine else ()
        last = {"target": y, "losses": losses} if n - 1 in mine else {}
        returned = schedule.step(*batch, shift=shift, **last)
        expected = []
        for i, (xi, yi) in enumerate(zip(x.chunk(m), y.chunk(m))):
            h = xi
            shift_i = shift if spec == "replicate" else shift.chunk(m, dim=1)[i]
            for block in reference:
                h = block(h, shift=shift_i)
            expected.append(F.mse_loss(h, yi))
        torch.stack(expected).mean().backward()
        for s in mine:
            for a, b in zip(blocks[s].parameters(), reference[s].parameters()):
                worst = max(worst, (a.grad - b.grad).abs().max().item())
        if n - 1 in mine:
            assert len(losses) == m, losses
            worst = max([worst, abs(returned.item() - torch.stack(expected).mean().item())]
                        + [abs(a.item() - b.item()) for a, b in zip(losses, expected)])
        else:
            assert returned is None and losses == []
        with torch.no_grad():
            for module in [blocks[s] for s in mine] + reference:
                for q in module.parameters():
                    q -= 0.1 * q.grad
    return worst


@pytest.mark.parametrize("schedule,form,spec", [
    ("GPipe", "positional device", "replicate"),
    ("Interleaved1F1B", "device and group", "dim 1"),
    ("GPipe", "example tensors", "dim 1"),
])
def test_torch_written_pipeline_trains_like_one_process(world2, schedule, form, spec):
    """Before: ``PipelineStage(module, i, n, device)`` was a TypeError ("drop the device"),
    ``(..., device, group=g)`` "multiple values for argument 'group'", ``input_args=`` an
    unexpected keyword, ``n_microbatches=`` a
    missing ``chunks``, and any ``kwargs_chunk_spec`` or ``args_chunk_spec`` a ValueError."""
    assert max(world2.run(_train_torch_style, schedule, form, spec)) < 1e-5


def _construction_errors():
    """What each constructor call raises on this rank: ``(type, message)`` or ``None``."""
    rank = dist.get_rank()

    def outcome(build):
        try:
            build()
        except (TypeError, ValueError) as error:
            return type(error).__name__, str(error)
        return None

    stage = PipelineStage(nn.Linear(D, D), rank, 2)
    return [
        # rank 1's module is not where its device says: both ranks raise
        outcome(lambda: PipelineStage(nn.Linear(D, D), rank, 2, "meta" if rank else "cpu")),
        outcome(lambda: PipelineStage(nn.Linear(D, D), rank, 2, "cpu",
                                      dw_builder=(lambda: None) if rank == 0 else None)),
        outcome(lambda: ScheduleGPipe(stage, 2, F.mse_loss, n_microbatches=2)),
        outcome(lambda: ScheduleGPipe(stage, 2, F.mse_loss, args_chunk_spec=(TensorChunkSpec(1),))),
        outcome(lambda: ScheduleGPipe(stage, 2, F.mse_loss, kwargs_chunk_spec={"mask": 1})),
    ]


def test_torch_options_shardkit_does_not_run_are_named_on_every_rank(world2):
    """A device the module is not on, a ``dw_builder`` (never called: the schedules compute W
    themselves), the micro-batch count given twice, and chunk specs shardkit cannot follow."""
    results = world2.run(_construction_errors)
    for outcomes in results:
        device, builder, twice, args_spec, kwargs_spec = outcomes
        assert device[0] == "ValueError" and "group rank 1: device='meta'" in device[1], device
        assert "move the module there first" in device[1], device
        assert builder[0] == "ValueError" and "group rank 0: dw_builder=" in builder[1], builder
        assert twice[0] == "TypeError" and "given twice" in twice[1], twice
        assert args_spec[0] == "ValueError" and "args_chunk_spec=(" in args_spec[1], args_spec
        assert "along dim 0" in args_spec[1], args_spec
        # TensorChunkSpec(-1) is taken since cd8d748 (a dim from the end, as torch's)
        assert kwargs_spec[0] == "ValueError" and "is not a chunk spec" in kwargs_spec[1]


def _step_lacking_a_named_keyword():
    """``kwargs_chunk_spec`` names ``mask``; the step passes ``shift`` only: every rank
    raises, and the next step (without the spec's mismatch) runs."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = PipelineStage(_Shifted(), rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss,
                             kwargs_chunk_spec={"mask": _Replicate()})
    x, y, shift = torch.randn(4, D), torch.randn(4, D), torch.randn(4, D)
    batch = {"target": y} if rank == 1 else {}
    try:
        schedule.step(x, shift=shift, **batch)
        first = None
    except ValueError as error:
        first = str(error)
    schedule.step(x, **batch)  # no keyword arguments: nothing to match
    return first


def test_a_step_lacking_a_keyword_the_chunk_spec_names_fails_on_every_rank(world2):
    for message in world2.run(_step_lacking_a_named_keyword):
        assert message is not None and "kwargs_chunk_spec names ['mask']" in message, message


def _ranks_splitting_a_keyword_differently():
    """Rank 0 splits ``shift`` along dim 1, rank 1 passes it whole: a square ``shift`` fits
    both, so each stage computed its micro-batches from other rows, silently. Now every rank
    raises, naming both splits."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = PipelineStage(_Shifted(), rank, 2, "cpu")
    spec = {"shift": TensorChunkSpec(1) if rank == 0 else _Replicate()}
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss, kwargs_chunk_spec=spec)
    x, y, shift = torch.randn(4, D), torch.randn(4, D), torch.randn(D, D)
    try:
        schedule.step(x, shift=shift, **({"target": y} if rank == 1 else {}))
        return None
    except ValueError as error:
        return str(error)


def test_ranks_that_split_a_keyword_differently_fail_on_every_rank(world2):
    for message in world2.run(_ranks_splitting_a_keyword_differently):
        assert message is not None and "disagree on the schedule" in message, message
        assert "{'shift': 1}" in message and "{'shift': None}" in message, message


class _Fork(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return self.lin(x), x


class _TorchStyleJoin(nn.Module):
    """A stage written for torch's schedules, which unpack a tuple input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, a, b):
        return self.lin(a) + b


def _torch_style_two_input_stage():
    rank = dist.get_rank()
    stage = PipelineStage(_Fork() if rank == 0 else _TorchStyleJoin(), rank, 2, "cpu")
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=F.mse_loss)
    try:
        schedule.step(torch.randn(4, D)) if rank == 0 else schedule.step(target=torch.randn(4, D))
    except ValueError as error:
        return str(error)
    return None


def test_a_stage_taking_a_tuple_as_torch_does_is_told_how_to_take_it(world2):
    """Before: only "Join.forward() missing 1 required positional argument: 'b'"; the error
    now says the tuple comes as one argument (torch unpacks it) on every rank."""
    for message in world2.run(_torch_style_two_input_stage):
        assert message is not None and "missing 1 required positional argument" in message
        assert "tuple of 2 tensors, passed as one argument" in message, message


def _inference_without_loss_fn(schedule_name: str) -> list:
    """``schedule.eval(x)`` on a schedule built without ``loss_fn`` (torch's inference idiom),
    twice: the worst difference of the returned outputs from one process's on the rank running
    the last stage, ``None`` returned elsewhere."""
    cls, per_rank, placement = {"GPipe": (ScheduleGPipe, 1, "loop"),
                                "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop")
                                }[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    torch.manual_seed(0)
    blocks = [_Shifted() for _ in range(n)]
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(blocks[s], s, n, "cpu", placement=placement) for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, n_microbatches=2)
    found = []
    for rows in (4, 6):
        x = torch.randn(rows, D)
        returned = schedule.eval(*((x,) if 0 in mine else ()))
        if n - 1 not in mine:
            found.append(returned)
            continue
        with torch.no_grad():
            expected = x
            for block in blocks:
                expected = block(expected)
        found.append((returned - expected).abs().max().item())
    return found


@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B"])
def test_eval_without_loss_fn_returns_the_outputs_as_torch(world2, schedule):
    """Before: every rank raised "the last stage needs ...(loss_fn=...)" and "needs the
    target" (only ``eval(x, return_outputs=True)`` ran); torch's ``eval(x)`` returns the merged
    outputs on the last stage."""
    first, last = world2.run(_inference_without_loss_fn, schedule)
    assert first == [None, None] and all(d < 1e-6 for d in last), (first, last)
