"""``OSS.step`` runs the local optimizer's step without autograd, as it always had.

Regression: a method added between ``@torch.no_grad()`` and ``def step`` took the decorator,
and ``step`` ran in the caller's grad mode: a local optimizer that updates its parameters in
place without a ``no_grad`` of its own (relying on OSS's, as shardkit documents) raised "a leaf
Variable that requires grad is being used in an in-place operation" on its owner's rank.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.optim import OSS
from shardkit.testing import world_fixture

world2 = world_fixture(2)


class InPlaceSGD(torch.optim.Optimizer):
    """Plain SGD whose ``step`` updates the parameters in place with no ``no_grad`` of its own
    (and no ``.data``), recording the grad mode it ran in."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self.grad_modes = []

    def step(self, closure=None):
        self.grad_modes.append(torch.is_grad_enabled())
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"])


def _two_steps():
    """Two steps of OSS over :class:`InPlaceSGD` and of torch's SGD in one process on the same
    batch: the largest difference, and the grad modes the local optimizer stepped in."""
    torch.manual_seed(0)
    model, oracle = nn.Linear(4, 3), nn.Linear(4, 3)
    oracle.load_state_dict(model.state_dict())
    optimizer = OSS(model.parameters(), optim=InPlaceSGD, lr=0.1)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    for net, opt in ((model, optimizer), (oracle, ref)):
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()
            opt.step()
    worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                           oracle.parameters()))
    return worst, optimizer.optim.grad_modes


def test_step_runs_the_local_optimizer_without_autograd(world2):
    for worst, modes in world2.run(_two_steps):
        assert worst < 1e-6 and not any(modes), (worst, modes)
