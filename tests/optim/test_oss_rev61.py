"""Review of OSS's param-group agreement (one world of 2 gloo ranks).

Regressions:

- ``ShardedDataParallel(step_in_backward=True)``: the step begins in backward and skipped the
  agreement that ``OSS.step`` runs, so a learning rate set on some ranks only stepped each
  parameter silently with its owner's rate. Now a ValueError on every rank, nothing stepped;
- Adam's ``betas`` given as tensors were compared by their ``repr`` (rounded to 4 digits, and
  naming the rank's own ``cuda:r``): betas that differ between ranks stepped silently (and on
  GPUs identical ones were refused). Now compared exactly, without the device;
- the agreement pickled an object all-gather on every step; it is now one all-gather of two
  int64s a rank (no object all-gather per step).
"""

import copy

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.optim.oss_arguments import param_group_settings
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    rows = torch.randn(8, 6, generator=gen)
    return rows.chunk(skdist.get_world_size())[skdist.get_rank()]


def _error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def _lr_on_one_rank_with_step_in_backward():
    """An lr set on rank 0 only under step_in_backward=True: the backward's error, whether any
    parameter moved, and a few steps after it is set alike again against one process."""
    model, oracle = _mlp(), _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    wrapped = ShardedDataParallel(model, opt, step_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    if skdist.get_rank() == 0:
        opt.param_groups[0]["lr"] = 0.5
    error = _error_of(lambda: wrapped(_batch(0)).pow(2).mean().backward())
    if error is None:  # the owners stepped in that backward: finish the step
        opt.step()
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.param_groups[0]["lr"] = 0.1
    for step in range(3):
        opt.zero_grad()
        ref.zero_grad()
        wrapped(_batch(step)).pow(2).mean().backward()
        opt.step()
        oracle(_full_batch(step)).pow(2).mean().backward()
        ref.step()
    opt.wait_for_sync()
    worst = max((p - q).abs().max().item()
                for p, q in zip(model.parameters(), oracle.parameters()))
    return {"error": error, "unchanged": unchanged, "worst": worst}


def _full_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step))


def test_lr_set_on_one_rank_fails_on_every_rank_with_step_in_backward(world2):
    for got in world2.run(_lr_on_one_rank_with_step_in_backward):
        assert got["error"] is not None, "an lr set on rank 0 only stepped silently in backward"
        kind, message = got["error"]
        assert kind == "ValueError", got
        assert "param_groups[0]['lr'] is 0.5 on rank 0" in message and "0.1 on rank 1" in message
        assert got["unchanged"], got
        assert got["worst"] < 1e-6, got


def _tensor_betas_that_differ_between_ranks():
    """Adam with betas as tensors, beta2 then set in the 6th digit on rank 1 only (a schedule
    of its own there): the step's error and whether any parameter moved."""
    model = _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3,
              betas=(torch.tensor(0.9), torch.tensor(0.999)))
    if skdist.get_rank() == 1:
        opt.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.99901))
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    error = _error_of(opt.step)
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return {"error": error, "unchanged": unchanged}


def test_tensor_betas_that_differ_between_ranks_fail_on_every_rank(world2):
    for got in world2.run(_tensor_betas_that_differ_between_ranks):
        assert got["error"] is not None, "betas that differ between ranks stepped silently"
        kind, message = got["error"]
        assert kind == "ValueError" and "param_groups[0]['betas']" in message, got
        assert got["unchanged"], got


def test_tensor_betas_are_compared_exactly_and_without_their_device():
    def text(beta2, device="cpu"):
        betas = (torch.tensor(0.9, device=device), torch.tensor(beta2, device=device))
        return param_group_settings([{"params": [], "betas": betas}])["param_groups[0]['betas']"]

    assert text(0.999) != text(0.99901)
    assert "device" not in text(0.999)
    assert text(0.999) == text(0.999)


def _object_all_gathers_in_steps():
    """How many object all-gathers ten steps (five with a LambdaLR) issue, and parity with one
    process."""
    model = _mlp()
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref)]
    gathered = []
    original = skdist.all_gather_object
    skdist.all_gather_object = lambda *a, **k: gathered.append(1) or original(*a, **k)
    try:
        for step in range(10):
            gen = torch.Generator().manual_seed(step)
            grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
            for m in (model, oracle):
                for p, g in zip(m.parameters(), grads):
                    p.grad = g.clone()
            opt.step()
            ref.step()
            for schedule in schedules[: 2 if step < 5 else 0]:
                schedule.step()
    finally:
        skdist.all_gather_object = original
    worst = max((p - q).abs().max().item()
                for p, q in zip(model.parameters(), oracle.parameters()))
    return len(gathered), worst


def test_the_agreement_of_a_step_pickles_nothing(world2):
    for gathered, worst in world2.run(_object_all_gathers_in_steps):
        assert gathered == 0, f"{gathered} object all-gathers in 10 steps"
        assert worst < 1e-6
