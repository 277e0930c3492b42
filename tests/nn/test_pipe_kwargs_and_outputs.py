"""Review of the pipelines' keyword arguments and merged outputs (world 2): a 0-dim tensor or
another object passed by keyword sends no shape headers again under schedules with one stage per
rank (which announce changed shapes themselves), ``return_outputs=True`` on outputs whose
micro-batches differ past dim 0 fails on every rank, a ``DeviceMesh`` given to ``PipelineStage``
as the group is named, and a forward-only step whose last micro-batch alone changed shape fails
on every rank instead of hanging the first stage's rank."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                              ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble)
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

D = 6
world2 = world_fixture(2, timeout=240)

# name -> (schedule class, stages per rank, placement)
SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), "1F1B": (Schedule1F1B, 1, "loop"),
             "ZB-H1": (ScheduleZeroBubble, 1, "loop"),
             "Interleaved1F1B": (ScheduleInterleaved1F1B, 2, "loop"), "ZBV": (ScheduleZBV, 2, "v")}


class _Layer(nn.Module):
    """``keep``: how many features to keep (a 0-dim tensor: the output's width follows it;
    a tensor of one value per row: each micro-batch's first row decides); narrower inputs are
    padded back to ``D``. ``scale``: any object, ignored."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, keep=None, scale=None):
        if x.shape[1] < D:
            x = F.pad(x, (0, D - x.shape[1]))
        h = torch.tanh(self.lin(x))
        return h if keep is None else h[:, :int(keep.reshape(-1)[0])]


def _loss(output, target):
    return F.mse_loss(output, target[:, :output.shape[1]])


def _pipeline(name: str, modules: list):
    cls, per_rank, placement = SCHEDULES[name]
    n, rank = len(modules), dist.get_rank()
    mine = [s for s in range(n) if stage_rank(s, n, 2, placement) == rank]
    stages = [PipelineStage(modules[s], s, n, placement=placement) for s in mine]
    return cls(stages[0] if per_rank == 1 else stages, 2, _loss), mine


class _Config:
    """A keyword value that is neither a tensor nor a plain value."""


def _messages_and_parity(name: str) -> tuple:
    """Point-to-point ops of this rank per step after the first (no keyword arguments; the
    same _Config object; a 0-dim ``keep`` of 6, 6, 4, 4), and the worst |loss - one process's|
    and |weight - one process's| over the steps."""
    n = 2 * SCHEDULES[name][1]
    torch.manual_seed(0)
    modules = [_Layer() for _ in range(n)]
    torch.manual_seed(0)
    reference = [_Layer() for _ in range(n)]
    schedule, mine = _pipeline(name, modules)
    opt = torch.optim.SGD([p for s in mine for p in modules[s].parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in reference for p in m.parameters()], lr=0.1)
    config, counts, worst = _Config(), [], 0.0
    steps = [{}] * 3 + [{"scale": config}] * 3 + [{"keep": torch.tensor(k)} for k in (6, 6, 4, 4)]
    for step, kwargs in enumerate(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, D, generator=g), torch.randn(4, D, generator=g)
        opt.zero_grad()
        ref_opt.zero_grad()
        ref_loss = 0
        for rows in (slice(0, 2), slice(2, 4)):
            h = x[rows]
            for m in reference:
                h = m(h, **kwargs)
            ref_loss = ref_loss + _loss(h, y[rows]) / 2
        ref_loss.backward()
        ref_opt.step()
        with dist.CommCounter() as comm:
            loss = schedule.step(*((x,) if 0 in mine else ()),
                                 target=y if n - 1 in mine else None, **kwargs)
        opt.step()
        counts.append(len(comm.calls))
        if loss is not None:
            worst = max(worst, abs(loss.item() - ref_loss.item()))
        worst = max([worst] + [(p - q).abs().max().item() for s in mine for p, q in
                               zip(modules[s].parameters(), reference[s].parameters())])
    return counts, worst


def test_an_object_or_0_dim_keyword_sends_no_headers_again_with_one_stage_per_rank(world2):
    """Before: with one stage per rank (GPipe, 1F1B, ZB-H1) a 0-dim tensor or any other object
    passed by keyword, even the same one every step, made every step a new batch: the shape
    headers went again each step (twice the point-to-point messages of rank 0) although those
    schedules announce changed output shapes themselves. With several stages per rank (ZBV)
    they still go again: there a 0-dim value may change shapes nothing else announces."""
    for name in ("GPipe", "1F1B", "ZB-H1", "ZBV"):
        for rank, (counts, worst) in enumerate(world2.run(_messages_and_parity, name)):
            assert worst < 1e-6, (name, rank, worst)
            plain, config, zero_dim = counts[2], counts[4:6], counts[7::2]
            if SCHEDULES[name][1] == 1:
                assert config == [plain] * 2 and zero_dim == [plain] * 2, (name, rank, counts)
            elif rank == 0:
                assert min(config + zero_dim) > plain, (name, rank, counts)


def _outputs_differing_past_dim_0(name: str) -> list:
    """``eval(x, return_outputs=True, keep=widths)`` where micro-batch 0 keeps 6 features and
    micro-batch 1 keeps 3 (what this rank raised, or returned), then a step where both keep
    6 (the shapes it merged)."""
    n = 2 * SCHEDULES[name][1]
    torch.manual_seed(0)
    schedule, mine = _pipeline(name, [_Layer() for _ in range(n)])
    x, found = torch.randn(4, D), []
    for widths in ((6, 6, 3, 3), (6, 6, 6, 6)):
        try:
            merged = schedule.eval(*((x,) if 0 in mine else ()), return_outputs=True,
                                   keep=torch.tensor(widths))
            found.append(None if merged is None else tuple(merged.shape))
        except Exception as error:  # noqa: BLE001 -- the old code's RuntimeError, too
            found.append(f"{type(error).__name__}: {error}")
    return found


def test_return_outputs_differing_past_dim_0_fail_on_every_rank(world2):
    """Before: micro-batch outputs whose shapes differ past dim 0 (a last stage trimming each
    micro-batch to its own length) reached ``torch.cat`` after the step, which raised
    RuntimeError on the last stage's rank only, while the other ranks returned ``None``."""
    for name in ("GPipe", "ZBV"):
        results = world2.run(_outputs_differing_past_dim_0, name)
        last = stage_rank(2 * SCHEDULES[name][1] - 1, 2 * SCHEDULES[name][1], 2,
                          SCHEDULES[name][2])
        for rank, (failed, merged) in enumerate(results):
            assert isinstance(failed, str), (name, rank, failed)
            assert failed.startswith("ValueError"), (name, rank, failed)
            assert "micro-batch 1" in failed, failed
            assert "shape (2, 3), micro-batch 0's (2, 6)" in failed, failed
            assert merged == ((4, D) if rank == last else None), (name, rank, merged)


def _stage_given_a_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    try:
        PipelineStage(nn.Linear(D, D), dist.get_rank(), 2, mesh)
    except TypeError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 -- what the old code raised, for the assertion
        return f"{type(error).__name__}: {error}"
    return None


def test_pipeline_stage_given_a_device_mesh_names_it(world2):
    """Before: torch's "Group DeviceMesh(...) is not registered" ValueError, which names
    neither the argument nor the process group to pass."""
    for message in world2.run(_stage_given_a_device_mesh):
        assert message.startswith("PipelineStage(group=DeviceMesh"), message
        assert 'mesh.get_group("pp")' in message, message


def _evaluations_where_the_last_microbatch_changes_shape(name: str) -> list:
    """Three ``eval`` steps (with a loss) whose first stage keeps 6, 6, 3, 3 features per row
    (micro-batch 1 narrower), then 6 everywhere (micro-batch 1 alone differs from what was
    announced for it), then 6 again: what this rank raised or returned, per step."""
    n = 2 * SCHEDULES[name][1]
    torch.manual_seed(0)
    schedule, mine = _pipeline(name, [_Layer() for _ in range(n)])
    x, y, found = torch.randn(4, D), torch.randn(4, D), []
    for widths in ((6, 6, 3, 3), (6, 6, 6, 6), (6, 6, 6, 6)):
        try:
            loss = schedule.eval(*((x,) if 0 in mine else ()),
                                 target=y if n - 1 in mine else None, keep=torch.tensor(widths))
            found.append(None if loss is None else "loss")
        except ValueError as error:
            found.append(str(error))
    return found


def test_a_forward_only_step_whose_last_microbatch_changed_shape_fails_on_every_rank(world2):
    """Before: the first stage sent zeros for its last micro-batch's changed output with the
    step's verdict still "ok" and only then failed; a forward-only step has no settle, so the
    next rank finished the step while the first waited in the failure's all-gather (hung)."""
    for name in ("GPipe", "Interleaved1F1B"):
        results = world2.run(_evaluations_where_the_last_microbatch_changes_shape, name)
        for rank, (first, failed, after) in enumerate(results):
            assert first == after == ("loss" if rank == 1 else None), (name, rank, results)
            assert isinstance(failed, str) and "stage 0, micro-batch 1: expected an output of " \
                "float32 (2, 3)" in failed, (name, rank, failed)
