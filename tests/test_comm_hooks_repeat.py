"""reduce_to_owners_hook with several reduced backwards per optimizer step, in one world of 4
gloo ranks: torch DDP + OSS(SGD) against one process on the concatenated batch, step by step.

An owner holds the average of a reduction and the other ranks zero, so a second reduction
without zero_grad in between used to give the owner ``(avg1 + sum g2) / N`` instead of
``avg1 + avg2``. Covered: 1-3 backwards outside ``no_sync`` per step, mixed with ``no_sync``
ones, ``zero_grad`` to None or to zero (also between backwards), gradients kept across a
step, ``gradient_as_bucket_view`` on and off, a parameter unused in one backward
(``find_unused_parameters``), ``OSS.clip_grad_norm``, 16-bit wires,
``compose(stage=1, reduce_to_owners=True)`` and ``step_oss_in_ddp_backward``.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed as skdist
from shardkit.comm_hooks import OwnersHookState, reduce_to_owners_hook, step_oss_in_ddp_backward
from shardkit.optim import OSS
from shardkit.testing import world_fixture

world4 = world_fixture(4)
STEPS = 3
LR = 0.1


class _Branchy(nn.Module):
    """A trunk and two heads; ``use_b=False`` leaves head ``b`` out of the graph."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(12, 16)
        self.mid = nn.Linear(16, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)

    def forward(self, x, use_b: bool = True):
        h = torch.tanh(self.mid(torch.tanh(self.trunk(x))))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 12, generator=torch.Generator().manual_seed(1000 * step + 10 * micro
                                                                      + rank))


def _build(kind: str, view: bool, unused: bool, dtype):
    model = _Branchy()
    if kind == "compose":
        from shardkit.recipes import OptimizerRecipe, compose
        comp = compose(model, 1, OptimizerRecipe(torch.optim.SGD, dict(lr=LR)),
                       reduce_to_owners=True, find_unused_parameters=unused, reduce_dtype=dtype)
        return model, comp.wrapped, comp.optimizer, comp.clip_grad_norm
    ddp = DDP(model, bucket_cap_mb=0.001, gradient_as_bucket_view=view,
              find_unused_parameters=unused)
    optimizer = OSS(ddp.parameters(), optim=torch.optim.SGD, lr=LR)
    if kind == "hook":
        ddp.register_comm_hook(OwnersHookState(optimizer, dtype), reduce_to_owners_hook)
    else:  # "in_backward"
        step_oss_in_ddp_backward(ddp, optimizer)
    return model, ddp, optimizer, optimizer.clip_grad_norm


def _train(schedule, kind="hook", view=False, set_to_none=True, keep=False, unused=False,
           dtype=None, clip=None):
    """Per step: zero_grad (unless ``keep``), then ``schedule``'s actions: ``sync`` (a reduced
    backward), ``local`` (inside no_sync), ``sync_a`` (reduced, head b unused), ``zero``
    (zero_grad between backwards); clip if asked; step. One process does the same on the
    concatenated batch. Returns the largest weight difference after each step."""
    rank, n = skdist.get_rank(), skdist.get_world_size()
    model, ddp, optimizer, clip_fn = _build(kind, view, unused, dtype)
    oracle = _Branchy()
    reference = torch.optim.SGD(oracle.parameters(), lr=LR)
    worst = []
    for step in range(STEPS):
        if not keep or step == 0:
            optimizer.zero_grad(set_to_none=set_to_none)
            reference.zero_grad(set_to_none=set_to_none)
        for micro, action in enumerate(schedule):
            if action == "zero":
                optimizer.zero_grad(set_to_none=set_to_none)
                reference.zero_grad(set_to_none=set_to_none)
                continue
            use_b = action != "sync_a"
            xs = [_batch(step, micro, r) for r in range(n)]
            oracle(torch.cat(xs), use_b).pow(2).mean().backward()
            if action == "local":
                with ddp.no_sync():
                    ddp(xs[rank], use_b).pow(2).mean().backward()
            else:
                ddp(xs[rank], use_b).pow(2).mean().backward()
        if clip is not None:
            clip_fn(clip)
            torch.nn.utils.clip_grad_norm_(oracle.parameters(), clip)
        optimizer.step()
        reference.step()
        optimizer.wait_for_sync()
        worst.append(max((p - q).abs().max().item()
                         for p, q in zip(model.parameters(), oracle.parameters())))
    return worst


FP32_CASES = {
    **{f"sync{k}_view{view}": dict(schedule=["sync"] * k, view=view, set_to_none=view)
       for k in (1, 2, 3) for view in (False, True)},
    "sync2_view_zeroed": dict(schedule=["sync"] * 2, view=True, set_to_none=False),
    "sync2_copy_none": dict(schedule=["sync"] * 2, view=False, set_to_none=True),
    "local_sync_sync": dict(schedule=["local", "sync", "sync"], view=True),
    "sync_local_sync": dict(schedule=["sync", "local", "sync"], set_to_none=False),
    "sync_zero_sync": dict(schedule=["sync", "zero", "sync"], view=True, set_to_none=False),
    "kept_across_steps": dict(schedule=["sync"], keep=True),
    "unused_copy": dict(schedule=["sync", "sync_a"], unused=True),
    "unused_view": dict(schedule=["sync", "sync_a", "sync"], unused=True, view=True,
                        set_to_none=False),
    "clip": dict(schedule=["sync", "sync"], clip=0.05),
    "compose": dict(schedule=["sync", "sync"], kind="compose"),
    "compose_unused": dict(schedule=["sync", "sync_a"], kind="compose", unused=True),
    "in_backward_no_sync": dict(schedule=["local", "local", "sync"], kind="in_backward",
                                view=True),
}
WIRE_CASES = {"bf16": (torch.bfloat16, 1e-3), "fp16": (torch.float16, 1e-4)}


def _second_reduced_backward_in_backward_stepping():
    """step_oss_in_ddp_backward: a second backward outside no_sync before step() is refused
    before it reduces; the weights are those of the one step taken."""
    rank = skdist.get_rank()
    model, ddp, optimizer, _ = _build("in_backward", True, False, None)
    ddp(_batch(0, 0, rank)).pow(2).mean().backward()
    optimizer.wait_for_sync()
    after_one = [p.detach().clone() for p in model.parameters()]
    try:
        ddp(_batch(0, 1, rank)).pow(2).mean().backward()
    except RuntimeError as error:
        message = str(error)
    else:
        message = None
    optimizer.wait_for_sync()
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), after_one))
    return message, same


def _run_all():
    results = {name: _train(**case) for name, case in FP32_CASES.items()}
    for name, (dtype, _) in WIRE_CASES.items():
        results[name] = _train(["sync"] * 3, dtype=dtype)
        results[name + "_compose"] = _train(["sync"] * 2, kind="compose", dtype=dtype)
    results["refused"] = _second_reduced_backward_in_backward_stepping()
    return results


@pytest.fixture(scope="module")
def runs(world4):
    return world4.run(_run_all)


@pytest.mark.parametrize("case", sorted(FP32_CASES))
def test_several_reduced_backwards_per_step_train_like_one_process(runs, case):
    for rank, results in enumerate(runs):
        assert max(results[case]) < 1e-6, (case, rank, results[case])


@pytest.mark.parametrize("wire", sorted(WIRE_CASES))
def test_16_bit_wires_with_three_reduced_backwards_stay_within_their_precision(runs, wire):
    tolerance = WIRE_CASES[wire][1]
    for rank, results in enumerate(runs):
        for name in (wire, wire + "_compose"):
            assert max(results[name]) < tolerance, (name, rank, results[name])


def test_step_oss_in_ddp_backward_refuses_a_second_reduced_backward_before_step(runs):
    for results in runs:
        message, unchanged = results["refused"]
        assert message is not None and "optimizer.step() has not been called" in message, message
        assert "ddp.no_sync()" in message, message
        assert unchanged
