"""Optimizer classes a training script might write itself, for tests of how the wrappers take
an optimizer instance that is not torch's or shardkit's."""

import torch


class ScaledSGD(torch.optim.SGD):
    """A script's own optimizer class: its step reads an attribute its constructor stored
    beside ``defaults`` (``factor``, a required argument)."""

    def __init__(self, params, lr: float, factor: float):
        super().__init__(params, lr=lr)
        self.factor = factor

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"] * self.factor)
