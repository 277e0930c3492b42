"""The accumulation boundary decided between forward and backward, as Accelerate (1.x) drives
DeepSpeed: ``out = engine(x)``, then ``engine.set_gradient_accumulation_boundary(sync)``,
``engine.backward(loss, scale_wrt_gas=False)`` and ``engine.step()`` on the boundary only
(and the same with the script's own ``loss.backward()``, or a forward run inside
``engine.no_sync()`` whose backward is the boundary's). DeepSpeed decides in backward whether
to reduce; torch DDP (stages 0-1) decides in its forward, so these boundary backwards reduced
nothing and each rank stepped on its own gradients. The engine now averages them itself, as it
does for a model the script calls directly: in each gradient's own dtype, as DDP does (a bf16
model's fp32 LayerNorm gradients were averaged in bf16).

The engine's average by hand also runs where the script calls the model itself (after an
engine forward under ``torch.no_grad()`` too, which arms nothing); it divides before the sum as
DDP does (fp16 sums overflowed) and leaves the parameters DDP ignores alone.

One world of 2 gloo ranks; each check trains three steps against one process, or compares the
gradients with those DDP reduces.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture

world2 = world_fixture(2)

WIDTH, GAS, STEPS, LR = 8, 2, 3, 0.05


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, micro: int, world: int):
    gen = torch.Generator().manual_seed(100 + 10 * step + micro)
    return torch.randn(2 * world, WIDTH, generator=gen), torch.randn(2 * world, 4, generator=gen)


def _config(stage: int, gas: int, **extra) -> dict:
    """An SGD engine config: 2 rows a micro-batch, ``gas`` micro-batches a step."""
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "zero_optimization": {"stage": stage}, "steps_per_print": 1000, **extra}


def _micro_step(engine, x, y, sync: bool, pattern: str) -> None:
    """One micro-batch the way ``pattern`` drives the engine; the loss is already divided
    by the accumulation steps, as Hugging Face's Trainer divides it."""
    if pattern == "no_sync_forward":  # the forward in no_sync, the boundary's backward out
        with engine.no_sync():
            out = engine(x)
        engine.set_gradient_accumulation_boundary(sync)
    else:
        out = engine(x)
        engine.set_gradient_accumulation_boundary(sync)
    loss = F.mse_loss(out, y) / GAS
    if pattern == "torch_backward":
        loss.backward()
    else:
        engine.backward(loss, scale_wrt_gas=False)
    if sync:
        engine.step()


def _boundary_after_forward(stage: int, pattern: str) -> dict:
    rank, world = distributed.get_rank(), distributed.get_world_size()
    config = _config(stage, GAS)
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    oracle = _model()
    sgd = torch.optim.SGD(oracle.parameters(), lr=LR)
    rows = slice(2 * rank, 2 * rank + 2)
    for step in range(STEPS):
        sgd.zero_grad()
        for micro in range(GAS):
            x, y = _batch(step, micro, world)
            _micro_step(engine, x[rows], y[rows], micro == GAS - 1, pattern)
            (F.mse_loss(oracle(x), y) / GAS).backward()
        sgd.step()
    got = engine.module_state_dict()
    diff = max((got[k].float() - v).abs().max().item() for k, v in oracle.state_dict().items())
    return {"diff": diff, "steps": engine.global_steps}


@pytest.mark.parametrize("pattern", ["engine_backward", "torch_backward"])
def test_boundary_set_after_the_forward_trains_as_one_process(world2, pattern):
    # stages 0-1 stepped on each rank's own gradients (1e-2 off, replicas apart at stage 0)
    for stage in (0, 1, 2, 3):
        for r in world2.run(_boundary_after_forward, stage, pattern):
            assert r["steps"] == STEPS, (stage, r)
            assert r["diff"] < 1e-6, (stage, r)


def test_forward_in_no_sync_then_boundary_backward_reduces(world2):
    for stage in (0, 1):
        for r in world2.run(_boundary_after_forward, stage, "no_sync_forward"):
            assert r["steps"] == STEPS and r["diff"] < 1e-6, (stage, r)


class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(WIDTH, 16)
        self.norm = nn.LayerNorm(16)  # its weights stay fp32 in a bf16 model
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


def _boundary_gradients(pattern: str) -> dict:
    """Stage 0 under bf16: each parameter's gradient (dtype, values) after one accumulation
    window, the boundary reduced by DDP (``"counted"``), by the engine after a forward run off
    the boundary (``"after_forward"``) or after the script called the model itself
    (``"model_called"``)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    config = _config(0, GAS, bf16={"enabled": True})
    engine, *_ = shardkit.initialize(model=_Normed(), config=config)
    rows = slice(2 * rank, 2 * rank + 2)
    for micro in range(GAS):
        x, y = _batch(0, micro, world)
        last = micro == GAS - 1
        if pattern == "model_called" and last:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = engine.module(x[rows])
        else:
            out = engine(x[rows])
        if pattern == "after_forward":
            engine.set_gradient_accumulation_boundary(last)
        engine.backward(F.mse_loss(out.float(), y[rows]))
        if not last:  # (the boundary's step would clear the gradients)
            engine.step()
    return {name: (str(p.grad.dtype), p.grad.float().clone())
            for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize("pattern", ["after_forward", "model_called"])
def test_boundary_averaged_by_the_engine_keeps_each_gradient_dtype(world2, pattern):
    for counted, other in zip(world2.run(_boundary_gradients, "counted"),
                              world2.run(_boundary_gradients, pattern)):
        assert counted["norm.weight"][0] == "torch.float32", counted["norm.weight"]
        for name, (dtype, grad) in counted.items():
            assert other[name][0] == dtype, name
            assert torch.equal(other[name][1], grad), (name, (other[name][1] - grad).abs().max())


def _fp16_boundary_near_the_top_of_the_range(pattern: str) -> dict:
    """Stage 0 under fp16 (static loss scale 1): one weight whose gradient is 40000 on each
    rank, the average within fp16's range, the sum (80000) not. The boundary reduced by DDP
    (``"counted"``), or by the engine after a forward inside ``no_sync`` (``"no_sync_forward"``)
    or after the script called the model itself (``"model_called"``)."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
              "fp16": {"enabled": True, "loss_scale": 1}, "zero_optimization": {"stage": 0},
              "steps_per_print": 1000}
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    engine, *_ = shardkit.initialize(model=model, config=config)
    x = torch.full((2, 1), 20000.0)
    if pattern == "no_sync_forward":
        with engine.no_sync():
            out = engine(x)
    elif pattern == "model_called":
        out = engine.module(x.half())
    else:
        out = engine(x)
    engine.backward(out.float().sum())
    grad = engine.module.weight.grad.float().item()
    engine.step()
    return {"grad": grad, "skipped": engine.skipped_steps,
            "weight": engine.module.weight.float().item()}


@pytest.mark.parametrize("pattern", ["no_sync_forward", "model_called"])
def test_fp16_gradients_averaged_by_the_engine_do_not_overflow_where_ddp_does_not(world2,
                                                                                  pattern):
    # the engine summed the ranks' fp16 gradients before dividing: inf, a skipped step (and
    # a halved dynamic loss scale) where DDP, which divides first, averages to 40000
    counted = world2.run(_fp16_boundary_near_the_top_of_the_range, "counted")
    assert counted[0]["grad"] == 40000.0 and counted[0]["skipped"] == 0, counted
    assert world2.run(_fp16_boundary_near_the_top_of_the_range, pattern) == counted


def _gradients_with_a_parameter_ddp_ignores(pattern: str) -> dict:
    """Stage 0, ``0.weight`` in torch DDP's ignore list (each rank keeps its own gradient
    there, as for rank-local experts): the gradients after a boundary reduced by DDP
    (``"counted"``), or by the engine after a forward inside ``no_sync``
    (``"no_sync_forward"``) or after the script called the model itself (``"model_called"``)."""
    config = _config(0, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["0.weight"])
    engine, *_ = shardkit.initialize(model=model, config=config)
    x = torch.full((2, 2), float(distributed.get_rank() + 1))
    if pattern == "no_sync_forward":
        with engine.no_sync():
            out = engine(x)
    elif pattern == "model_called":
        out = engine.module(x)
    else:
        out = engine(x)
    engine.backward(out.sum())
    return {name: p.grad.clone() for name, p in engine.module.named_parameters()}


@pytest.mark.parametrize("pattern", ["no_sync_forward", "model_called"])
def test_parameters_ddp_ignores_keep_their_own_gradients_when_averaged_by_hand(world2, pattern):
    # the engine averaged every trainable parameter, those DDP was told to ignore too
    counted = world2.run(_gradients_with_a_parameter_ddp_ignores, "counted")
    assert not torch.equal(counted[0]["0.weight"], counted[1]["0.weight"])
    for want, got in zip(counted, world2.run(_gradients_with_a_parameter_ddp_ignores, pattern)):
        for name, grad in want.items():
            assert torch.equal(got[name], grad), (name, got[name], grad)


def _model_called_after_a_no_grad_engine_forward(stage: int, pattern: str) -> dict:
    """Each step: an engine forward under ``torch.no_grad()`` (old values, a reference, as
    an RLHF trainer takes them), then the training forward by the script's own call of the
    model (``engine.module(x)``), ``engine.backward`` or ``loss.backward()``, and the step;
    against one process on the whole batch."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    config = _config(stage, 1)
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    oracle = _model()
    sgd = torch.optim.SGD(oracle.parameters(), lr=LR)
    rows = slice(2 * rank, 2 * rank + 2)
    for step in range(STEPS):
        x, y = _batch(step, 0, world)
        with torch.no_grad():
            engine(x[rows])
        loss = F.mse_loss(engine.module(x[rows]), y[rows])
        if pattern == "torch_backward":
            loss.backward()
        else:
            engine.backward(loss)
        engine.step()
        sgd.zero_grad()
        F.mse_loss(oracle(x), y).backward()
        sgd.step()
    got = engine.module_state_dict()
    return {"diff": max((got[k].float() - v).abs().max().item()
                        for k, v in oracle.state_dict().items())}


@pytest.mark.parametrize("pattern", ["engine_backward", "torch_backward"])
def test_model_called_after_a_no_grad_engine_forward_is_averaged(world2, pattern):
    # the forward under no_grad counted as one through DDP, which armed nothing: no rank
    # averaged, each stepped on its own gradients (stage 0: the replicas drifted apart)
    for stage in (0, 1):
        for r in world2.run(_model_called_after_a_no_grad_engine_forward, stage, pattern):
            assert r["diff"] < 1e-6, (stage, r)
