"""Zero-bubble schedules (ZB-H1, ZBV) over stages wrapped in FSDP, 2 pipelines x 2 ranks: the
weight-gradient pass (W) gathers a unit only for ops that read its weights."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, ScheduleZBV, ScheduleZeroBubble
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

world4 = world_fixture(4)

D = 6


class _Mlp(nn.Module):
    """Two Linear layers: each unit's output is a Linear's, whose W reads no weight."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class _Tied(nn.Module):
    """One weight used twice (``w @ tanh(w @ x)``): W walks between its two uses, reading it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.b = nn.Parameter(torch.zeros(D))

    def forward(self, x):
        return F.linear(torch.tanh(F.linear(x, self.w)), self.w, self.b)


def _w_gathers(schedule_name, kind, nested, steps=2, chunks=2):
    """SGD through ZB-H1 / ZBV over FSDP stages beside one process: (worst |weight -
    reference|, all-gathers issued inside the W passes of the last step)."""
    from shardkit.comm_counter import CommCounter
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.pipe import fsdp_weight_sink

    cls, per_rank, placement = {"ZB-H1": (ScheduleZeroBubble, 1, "loop"),
                                "ZBV": (ScheduleZBV, 2, "v")}[schedule_name]
    rank, n = dist.get_rank(), 2 * per_rank
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    pipeline = rank // 2
    torch.manual_seed(0)
    ref = [kind() for _ in range(n)]
    torch.manual_seed(0)
    parts = [kind() for _ in range(n)]
    mine = [s for s in range(n) if stage_rank(s, n, 2, placement) == rank % 2]
    modules = {}
    for s in mine:
        if nested:
            for name, child in list(parts[s].named_children()):
                setattr(parts[s], name, FullyShardedDataParallel(child, process_group=replicas))
        modules[s] = FullyShardedDataParallel(parts[s], process_group=replicas)
    stages = [PipelineStage(modules[s], s, n, group=pipelines[pipeline], placement=placement)
              for s in mine]
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, F.mse_loss)
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([p for m in ref for p in m.parameters()], lr=0.1)
    in_w = CommCounter()
    run = fsdp_weight_sink.ShardedGradientSink.run

    def counted_run(sink, weight_pass):
        with in_w:
            return run(sink, weight_pass)
    fsdp_weight_sink.ShardedGradientSink.run = counted_run
    rows, worst = 4 * chunks, 0.0
    half = slice(pipeline * rows // 2, (pipeline + 1) * rows // 2)
    try:
        for step in range(steps):
            in_w.calls.clear()
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
            opt.zero_grad()
            ref_opt.zero_grad()
            schedule.step(*((x[half],) if 0 in mine else ()),
                          target=y[half] if n - 1 in mine else None)
            loss = 0
            for xi, yi in zip(x.tensor_split(2 * chunks), y.tensor_split(2 * chunks)):
                for module in ref:
                    xi = module(xi)
                loss = loss + F.mse_loss(xi, yi) / (2 * chunks)
            loss.backward()
            opt.step()
            ref_opt.step()
            for s in mine:
                with modules[s].summon_full_params():
                    worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(
                        parts[s].parameters(), ref[s].parameters())])
    finally:
        fsdp_weight_sink.ShardedGradientSink.run = run
    return worst, in_w.calls_by_op.get("all_gather", 0)


def test_fsdp_zero_bubble_weight_pass_gathers_only_for_ops_reading_weights(world4):
    """Units ending with a Linear: W started at the Linear's Addmm, whose output carries the
    unit's pre-backward hook, so FSDP gathered the whole unit for a ``g^T x`` that reads no
    weight (and freed every unit at the end of each W call): one more all-gather per unit and
    micro-batch (on the first stage too since W starts at each parameter's first use). Now W
    gathers nothing there; a weight used twice, whose W reads it, is still gathered for it;
    both match one process."""
    for name in ("ZB-H1", "ZBV"):
        for nested in (False, True):
            for rank, (worst, gathers) in enumerate(world4.run(_w_gathers, name, _Mlp, nested)):
                assert worst < 1e-5, (name, nested, rank, worst)
                assert gathers == 0, (name, nested, rank, gathers)
        for rank, (worst, gathers) in enumerate(world4.run(_w_gathers, name, _Tied, False)):
            assert worst < 1e-5, (name, rank, worst)
            assert gathers > 0, (name, rank, gathers)
