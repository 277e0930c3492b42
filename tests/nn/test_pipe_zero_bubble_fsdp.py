"""Zero-bubble schedules (ZB-H1, ZBV: backward split into B and W) over stages wrapped in FSDP,
2 pipelines x 2 ranks, beside one process on the whole batch: stages whose replicas reach
their input differently, stages whose W runs several weight-reading ops of one unit, and W
gathering a unit only for ops that read its weights."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, ScheduleZBV, ScheduleZeroBubble
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture
from tests.nn.test_pipe_composition import _unused_outputs_under

world4 = world_fixture(4)

D = 6


def test_fsdp_zbv_middle_stage_ignoring_its_input_on_one_replica_only(world4):
    """ZBV under FSDP whose middle stages (two outputs) ignore their input in one pipeline and
    use it in the other (``use`` 3 against 1, 2 or 0): W started where the parameters meet the
    input path, so the replica that ignored its input ran its whole backward in W and gathered
    its unit for it, the other did not: gloo aborted on the mismatched collectives. B now stops
    at each parameter's first use whatever reaches the input, so the replicas' W are alike;
    flat and nested units match one process."""
    routes = [[[3, 3], [1, 1]], [[1, 3], [3, 1]], [[0, 3], [3, 2]], [[3, 3], [3, 3]]]
    for nested in (False, True):
        for rank, worst in enumerate(world4.run(_unused_outputs_under, "fsdp", "ZBV", routes,
                                                "fork", nested)):
            assert worst < 1e-5, (nested, rank, worst)


class _PostNormLayer(nn.Module):
    """A post-LN (BERT) layer, whose FSDP unit ends with a LayerNorm, and a weight that is the
    product of two parameters (weight norm's ``g * v``)."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D, D), nn.Linear(D, D)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.g = nn.Parameter(torch.rand(D, 1) + 0.5)
        self.v = nn.Parameter(torch.randn(D, D) / D ** 0.5)

    def forward(self, x):
        h = self.ln1(x + F.linear(x, self.g * self.v))
        return self.ln2(h + self.lin2(torch.relu(self.lin1(h))))


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


def _fsdp_zero_bubble(schedule_name, kind, nested=False, steps=2, chunks=2):
    """SGD through ZB-H1 / ZBV over ``kind()`` stages, each an FSDP unit over its replicas
    (``nested``: each child its own unit too), beside one process: (worst |weight -
    reference| over the steps, all-gathers issued inside the W passes of the last step)."""
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


def test_fsdp_zero_bubble_stage_whose_unit_ends_with_a_layer_norm(world4):
    """A post-LN layer under FSDP with ZB-H1 / ZBV: W ran the closing LayerNorm's weight
    gradient, at the unit's output, whose FSDP hook then closed a backward and freed the unit;
    W's next weight-reading op (the other LayerNorm, the ``g * v`` product) read the freed
    weights (a crash, 'data is not allocated yet', or a hang). W now runs with the units'
    hooks paused, gathers what it reads, and matches one process."""
    for name in ("ZB-H1", "ZBV"):
        for rank, (worst, _) in enumerate(world4.run(_fsdp_zero_bubble, name, _PostNormLayer,
                                                     steps=3)):
            assert worst < 1e-5, (name, rank, worst)


def test_fsdp_zero_bubble_weight_pass_gathers_only_for_ops_reading_weights(world4):
    """Units ending with a Linear: W started at the Linear's Addmm, whose output carries the
    unit's pre-backward hook, so FSDP gathered the whole unit for a ``g^T x`` that reads no
    weight (and freed every unit at the end of each W call): one more all-gather per unit and
    micro-batch (on the first stage too since W starts at each parameter's first use). Now W
    gathers nothing there; a weight used twice, whose W reads it, is still gathered for it;
    both match one process."""
    for name in ("ZB-H1", "ZBV"):
        for nested in (False, True):
            runs = world4.run(_fsdp_zero_bubble, name, _Mlp, nested)
            for rank, (worst, gathers) in enumerate(runs):
                assert worst < 1e-5, (name, nested, rank, worst)
                assert gathers == 0, (name, nested, rank, gathers)
        for rank, (worst, gathers) in enumerate(world4.run(_fsdp_zero_bubble, name, _Tied)):
            assert worst < 1e-5, (name, rank, worst)
            assert gathers > 0, (name, rank, gathers)
