"""Pipeline messages follow the stages' device (world 2): every tensor ``TaggedLinks`` creates
for the wire (receive buffers, zeros, headers, tails, verdict and settle messages) and the
data-parallel reduction's tail are created on ``stage.device`` (NCCL sends and receives CUDA
tensors only); a rank whose stages are on two devices is refused on every rank. There is no GPU
here: a recording stand-in for ``torch`` notes the device each tensor factory is asked for
(and builds on the CPU), so the steps still run, and match one process, over gloo."""

import copy
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn.pipe import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBV
from shardkit.nn.pipe import p2p
from shardkit.nn.pipe import stage as stage_module
from shardkit.nn.pipe.stage import stage_rank
from shardkit.testing import world_fixture

D = 4
ELSEWHERE = torch.device("cuda", 1)  # a device the stages claim; nothing is allocated there
world2 = world_fixture(2, timeout=240)


class _RecordingTorch(types.ModuleType):
    """``torch``, but ``empty`` / ``zeros`` / ``full`` / ``tensor`` note the ``device`` they
    are asked for and build on the CPU."""

    def __init__(self):
        super().__init__("torch")
        self.devices = []
        for name in ("empty", "zeros", "full", "tensor"):
            setattr(self, name, self._recording(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)

    def _recording(self, factory):
        def build(*args, device=None, **kwargs):
            self.devices.append(None if device is None else torch.device(device))
            return factory(*args, **kwargs)
        return build


def _steps_on_another_device(schedule_name: str) -> tuple:
    """Train, train again (the lead window), a new batch size (the zero window), evaluate,
    and a step whose loss raises on the last stage (verdict, settle, no-output zeros), with the
    stages claiming ``ELSEWHERE``: the devices the links asked for, and the worst difference
    of a loss or gradient from one process's."""
    cls, per_rank, placement = {"GPipe": (ScheduleGPipe, 1, "loop"),
                                "ZBV": (ScheduleZBV, 2, "v")}[schedule_name]
    p, rank = dist.get_world_size(), dist.get_rank()
    n = p * per_rank
    torch.manual_seed(0)
    blocks = [nn.Linear(D, D) for _ in range(n)]
    reference = copy.deepcopy(blocks)
    mine = [s for s in range(n) if stage_rank(s, n, p, placement) == rank]
    stages = [PipelineStage(blocks[s], s, n, "cpu", placement=placement) for s in mine]
    for stage in stages:
        stage.device = ELSEWHERE
    calls = {"n": 0}

    def loss_fn(output, target):
        calls["n"] += 1
        if calls["n"] > 8:  # 3 steps and an eval of 2 micro-batches, then the failing step
            raise RuntimeError("loss broken on purpose")
        return F.mse_loss(output, target)

    recorder, real = _RecordingTorch(), p2p.torch
    p2p.torch = recorder
    try:
        schedule = cls(stages[0] if per_rank == 1 else stages, 2, loss_fn)
        worst = 0.0
        for rows in (4, 4, 6):
            g = torch.Generator().manual_seed(rows)
            x, y = torch.randn(rows, D, generator=g), torch.randn(rows, D, generator=g)
            for module in blocks + reference:
                module.zero_grad()
            loss = schedule.step(*((x,) if 0 in mine else ()),
                                 **({"target": y} if n - 1 in mine else {}))
            h = x
            for block in reference:
                h = block(h)
            expected = torch.stack([F.mse_loss(a, b) for a, b in zip(h.chunk(2), y.chunk(2))])
            expected.mean().backward()
            for s in mine:
                for a, b in zip(blocks[s].parameters(), reference[s].parameters()):
                    worst = max(worst, (a.grad - b.grad).abs().max().item())
            if n - 1 in mine:
                worst = max(worst, abs(loss.item() - expected.mean().item()))
        schedule.eval(*((x,) if 0 in mine else ()), **({"target": y} if n - 1 in mine else {}))
        try:
            schedule.step(*((x,) if 0 in mine else ()), **({"target": y} if n - 1 in mine else {}))
            failed = None
        except ValueError as error:
            failed = str(error)
    finally:
        p2p.torch = real
    return recorder.devices, worst, failed


def test_every_tensor_the_links_create_is_on_the_stages_device(world2):
    """Before: ``TaggedLinks`` built every buffer, zero window, header and verdict on the CPU
    whatever the stages' device, so a pipeline over NCCL could not receive."""
    for name in ("GPipe", "ZBV"):
        for devices, worst, failed in world2.run(_steps_on_another_device, name):
            assert len(devices) > 10 and set(devices) == {ELSEWHERE}, (name, set(devices))
            assert worst < 1e-6, (name, worst)
            assert failed is not None and "loss broken on purpose" in failed, failed


def _stages_on_two_devices():
    """Rank 0 runs stages 0 (CPU) and 2 (meta); rank 1 runs 1 and 3, both on the CPU."""
    rank = dist.get_rank()
    stages = [PipelineStage(nn.Linear(D, D, device="meta" if s == 2 else "cpu"), s, 4)
              for s in (rank, rank + 2)]
    schedule = ScheduleInterleaved1F1B(stages, 2, F.mse_loss)
    try:
        schedule.step(*((torch.randn(4, D),) if rank == 0 else ()),
                      **({"target": torch.randn(4, D)} if rank == 1 else {}))
    except ValueError as error:
        return str(error)
    return None


def test_a_rank_whose_stages_are_on_two_devices_is_refused_on_every_rank(world2):
    """Before: nothing checked it; the step failed in a stage's forward (and on GPUs the
    messages of one of the two devices could not go)."""
    for message in world2.run(_stages_on_two_devices):
        assert message is not None and "rank 0: the stages of one rank must be on one device" \
            in message, message
        assert "stage 0 on 'cpu', stage 2 on 'meta'" in message, message


def _reduction_tail_device():
    """A one-stage pipeline per rank, replicated over both ranks: the devices asked for by
    ``reduce_gradients`` (the failure flag and presence elements riding on the all-reduce),
    and the averaged gradient against the mean of the ranks' gradients."""
    rank = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(D, D), 0, 1, group=alone[rank],
                          data_parallel_group=torch.distributed.group.WORLD)
    stage.device = ELSEWHERE
    for p in stage.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    recorder, real = _RecordingTorch(), stage_module.torch
    stage_module.torch = recorder
    try:
        failed = stage.reduce_gradients(False)
    finally:
        stage_module.torch = real
    return recorder.devices, failed, max((p.grad - 1.5).abs().max().item()
                                         for p in stage.parameters())


def test_the_data_parallel_reduction_tail_is_on_the_stages_device(world2):
    """Before: the tail was a CPU tensor flattened with the (CUDA) gradients: torch.cat
    refuses tensors on two devices."""
    for devices, failed, worst in world2.run(_reduction_tail_device):
        assert devices == [ELSEWHERE] and failed is False and worst == 0.0, (devices, worst)


def test_links_default_to_the_cpu():
    """Without a device (as before), the links build on the CPU."""
    links = p2p.TaggedLinks(None, 2, 2)
    assert links.device == torch.device("cpu")
    assert links._zeros(p2p.TensorMeta(torch.float32, (2,), False)).device.type == "cpu"


def _stage_with_positional_data_parallel_group():
    world = torch.distributed.group.WORLD
    try:
        PipelineStage(nn.Linear(D, D), dist.get_rank(), 2, world, world)
    except ValueError as error:
        return str(error)
    return None


def test_a_positional_data_parallel_group_is_told_to_go_by_keyword(world2):
    """shardkit's earlier ``PipelineStage(module, i, n, group, data_parallel_group)``: the 5th
    place is torch's ``input_args`` now. Before: "input_args=['ProcessGroup']: expected a
    tensor ... (example inputs ...)", which did not say where the group should go."""
    for message in world2.run(_stage_with_positional_data_parallel_group):
        assert message is not None and "data_parallel_group and placement are keyword-only" \
            in message, message
