"""shardkit keeps no weak reference to a user's parameter or gradient, because
``torch.utils.swap_tensors`` (what ``load_state_dict`` and ``.to()`` do under
``torch.__future__.set_swap_module_params_on_conversion(True)``, and for tensor-subclass
parameters always) refuses a tensor that has one.

* ``safe_get_full_fp32_param(p)`` remembered ``p``'s engine through a weak reference: a
  swapped load of the engine's model afterwards raised "Cannot swap t1 because it has weakref
  associated with it" on every parameter.
* ``MasterWeights`` remembered the 16-bit gradient it had widened the same way (until the
  step): a swapped conversion of the model between the widening (unscaling, clipping) and the
  step raised on the gradients, and a swapped gradient must be widened again.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed as skdist
from shardkit.optim import MasterWeights
from shardkit.testing import world_fixture

world2 = world_fixture(2)
MICRO = 2


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(MICRO * world, 4, generator=gen)
    return x, torch.randn(MICRO * world, 2, generator=gen)


def _swapped_load_after_safe_get():
    """Stage 2, fp32: a step, ``safe_get_full_fp32_param`` of every parameter, a swapped
    ``load_state_dict`` of the one-process model's values (equal), two more steps: the largest
    difference from one process, and whether the looked-up values were the full weights."""
    from shardkit.utils import safe_get_full_fp32_param
    model, oracle = _net(), _net()
    cfg = {"train_batch_size": MICRO * 2, "steps_per_print": 10 ** 6,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 2}}
    engine, *_ = shardkit.initialize(model=model, config=cfg)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    rank, world = skdist.get_rank(), skdist.get_world_size()
    mine = slice(rank * MICRO, (rank + 1) * MICRO)
    full = True
    worst = 0.0
    for step in range(3):
        x, y = _batch(step, world)
        engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
        ref.zero_grad()
        F.mse_loss(oracle(x), y).backward()
        ref.step()
        if step == 0:
            full = all(torch.equal(safe_get_full_fp32_param(p), p.detach())
                       for p in engine.module.parameters())
            state = {k: v.clone() for k, v in oracle.state_dict().items()}
            previous = torch.__future__.get_swap_module_params_on_conversion()
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                engine.module.load_state_dict(state)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(previous)
        worst = max(worst, max((a - b).abs().max().item()
                               for a, b in zip(engine.module.parameters(), oracle.parameters())))
    return worst, full


def test_a_swapped_load_after_safe_get_full_fp32_param_trains_as_one_process(world2):
    for worst, full in world2.run(_swapped_load_after_safe_get):
        assert full and worst < 1e-6, (full, worst)


def _bf16_model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = MasterWeights.over(torch.optim.SGD)(model.parameters(), lr=0.5)
    model(torch.randn(5, 4, dtype=torch.bfloat16)).float().square().sum().backward()
    return model, optimizer


def test_master_weights_follow_a_widened_gradient_through_a_swapped_conversion():
    """A bf16 model under ``MasterWeights.over(SGD)``, its gradients widened
    (``prepare_master_grads()``, as unscaling and clipping do), then ``model.to(torch.float16)``
    under swap mode (it raised "Couldn't swap Linear.weight.grad") and the step: the masters
    step as a twin's that was not converted (bf16 values are exact in fp16)."""
    model, optimizer = _bf16_model_and_optimizer()
    twin, twin_optimizer = _bf16_model_and_optimizer()
    optimizer.prepare_master_grads()
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float16)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    optimizer.step()
    twin_optimizer.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(optimizer.master_weight_of(p), twin_optimizer.master_weight_of(q))
