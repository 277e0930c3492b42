"""``communication_data_type: "fp32"`` under ``bf16``/``fp16`` at ZeRO stages 0-2.

DeepSpeed widens 16-bit gradients to the communication dtype for the reduction
(``tensor.to(communication_data_type)`` before the all-reduce or reduce, and back), so a bf16
model with ``"communication_data_type": "fp32"`` sums its gradients in fp32 and rounds them
once. The engine read "fp32" as "the gradients' own dtype" at stages 0-2 and reduced bf16
values: the key had no effect. Checked in one world of 2 gloo ranks: the engine's gradient
reduction bytes (fp32: twice bf16's, with and without gradient accumulation), torch DDP's
gradients through the fp32 hook (exactly the fp32 average of every rank's 16-bit gradient,
rounded once), and ``recipes.compose(..., reduce_dtype=torch.float32)`` over a bf16 model
(widened) and an fp32 one (unchanged).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.recipes import adamw, compose
from shardkit.testing import world_fixture

world2 = world_fixture(2)

ROWS = 4  # per rank and micro-batch
GRAD_OPS = ("all_reduce", "reduce", "reduce_scatter")  # stage 1 reduces onto the owners


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 4))


def _config(stage, precision="bf16", comm=None, accumulation=1):
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": accumulation,
           "steps_per_print": 1000, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
           precision: {"enabled": True}}
    if precision == "fp16":
        cfg["fp16"]["initial_scale_power"] = 4
    if comm is not None:
        cfg["communication_data_type"] = comm
    return cfg


def _batch(step, rank, world):
    gen = torch.Generator().manual_seed(50 + step)
    x = torch.randn(ROWS * world, 8, generator=gen)
    y = torch.randn(ROWS * world, 4, generator=gen)
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    return x[mine], y[mine], x, y


def _gradient_bytes(stage, precision, comm, accumulation):
    """Bytes of the gradient reduction and of the parameter all-gather over two steps."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    engine, *_ = shardkit.initialize(model=_model(), config=_config(stage, precision, comm,
                                                                    accumulation))
    counter = distributed.CommCounter()
    for step in range(2 * accumulation):
        x, y, _, _ = _batch(step, rank, world)
        with counter:
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    by_op = dict(counter.by_op)
    return sum(by_op.get(op, 0) for op in GRAD_OPS), by_op.get("all_gather", 0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_communication_moves_fp32_gradients(world2, stage, precision):
    def figures(comm, accumulation=1):
        return world2.run(_gradient_bytes, stage, precision, comm, accumulation)[0]
    half, wide = figures(None), figures("fp32")
    assert half[0] > 0 and wide[0] == pytest.approx(2 * half[0], rel=0.02), (half, wide)
    assert wide[1] == half[1]  # the parameter sync is not the gradients' business
    assert figures("fp32", accumulation=2)[0] == pytest.approx(
        wide[0] * (2 if stage == 2 else 1), rel=0.02)  # stage 2 reduces every micro-batch


def _ddp_gradients_with_fp32_hook(dtype):
    """torch DDP over a 16-bit model with ``allreduce_hook_for(torch.float32)``: the gradients
    after one backward, against the fp32 average of every rank's local 16-bit gradient
    rounded once (exactly equal: each is halved in fp32, summed in fp32, rounded)."""
    import copy
    from shardkit.comm_hooks import allreduce_hook_for
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = _model().to(dtype)
    alone = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_hook_for(torch.float32))
    x, y, _, _ = _batch(0, rank, world)
    counter = distributed.CommCounter()
    with counter:
        F.mse_loss(ddp(x.to(dtype)).float(), y).backward()
    F.mse_loss(alone(x.to(dtype)).float(), y).backward()
    every = distributed.all_gather_object([p.grad.float() for p in alone.parameters()])
    expected = [sum(grads[k] for grads in every).div(world).to(dtype)
                for k in range(len(every[0]))]
    exact = all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    elements = sum(p.numel() for p in model.parameters())
    return exact, counter.by_op["all_reduce"] / elements  # bytes per element on the wire


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_hook_sums_16bit_gradients_in_fp32_and_rounds_once(world2, dtype):
    for exact, bytes_per_element in world2.run(_ddp_gradients_with_fp32_hook, dtype):
        assert exact
        assert bytes_per_element == pytest.approx(2 * 4 * (2 - 1) / 2)  # 2(N-1)/N x 4 bytes


def _compose_wire(stage, dtype, reduce_dtype):
    """Gradient-reduction bytes per element of one step of ``compose`` over a ``dtype`` model
    with ``reduce_dtype``; and whether a hook of the user's can still replace the counted
    default (for an fp32 model, where fp32 asks for nothing)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = _model().to(dtype)
    composition = compose(model, stage, adamw(1e-3), reduce_dtype=reduce_dtype)
    setup = composition.training_setup(F.mse_loss)
    x, y, _, _ = _batch(0, rank, world)
    counter = distributed.CommCounter()
    with counter:
        setup.train_step(x.to(dtype), y.to(dtype))
    grads = sum(counter.by_op.get(op, 0) for op in GRAD_OPS)
    return grads / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_compose_reduce_dtype_fp32_widens_16bit_gradients(world2, stage):
    for dtype in (torch.bfloat16, torch.float32):
        plain = world2.run(_compose_wire, stage, dtype, None)[0]
        wide = world2.run(_compose_wire, stage, dtype, torch.float32)[0]
        factor = 2 if dtype == torch.bfloat16 else 1
        assert wide == pytest.approx(factor * plain, rel=0.02), (dtype, plain, wide)


def _by_hand_bytes_per_element(stage, comm):
    """A script that calls ``engine.module`` itself at stages 0-1 has its gradients averaged
    by the engine: the all-reduce's bytes per element of the model."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    engine, *_ = shardkit.initialize(model=_model(), config=_config(stage, comm=comm))
    x, y, _, _ = _batch(0, rank, world)
    counter = distributed.CommCounter()
    with counter:
        engine.backward(F.mse_loss(engine.module(x.bfloat16()).float(), y))
    return counter.by_op.get("all_reduce", 0) / sum(p.numel() for p in _model().parameters())


@pytest.mark.parametrize("stage", [0, 1])
def test_the_engines_own_average_widens_too(world2, stage):
    half = world2.run(_by_hand_bytes_per_element, stage, None)[0]
    wide = world2.run(_by_hand_bytes_per_element, stage, "fp32")[0]
    assert half == pytest.approx(2.0, rel=0.02) and wide == pytest.approx(4.0, rel=0.02)
