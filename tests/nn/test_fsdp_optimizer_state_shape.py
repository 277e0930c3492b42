"""FSDP regressions found reviewing commit 1a0b341.

- The optimizer step pre-hook that refuses state made for the whole parameter (an optimizer
  that stepped before wrapping) refused any state tensor of the whole parameter's shape, so
  an optimizer built after wrapping that keeps Shampoo-style statistics (a ``(cols, cols)``
  statistic is the whole shape of a square weight cut by rows) could not step at all.

One world of 2.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.testing import world_fixture

world2 = world_fixture(2)


class _SGDWithStatistics(torch.optim.Optimizer):
    """SGD with momentum that also keeps Shampoo's statistics of each 2-D parameter it steps:
    ``left`` (rows x rows) and ``right`` (cols x cols) sums of gradient products. A
    preconditioned optimizer would apply them; here the update is plain SGD, so that stepping
    the shards compares with one process."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                if p.dim() == 2:
                    state.setdefault("left", torch.zeros(p.shape[0], p.shape[0]))
                    state.setdefault("right", torch.zeros(p.shape[1], p.shape[1]))
                    state["left"] += p.grad @ p.grad.T
                    state["right"] += p.grad.T @ p.grad
                p.add_(buf, alpha=-group["lr"])


def _batch(i: int) -> tuple:
    g = torch.Generator().manual_seed(6100 + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def _train_with_statistics(stepped_before_wrapping: bool):
    """Two steps of a square-weighted model wrapped at world 2 (``use_orig_params=True``) with
    :class:`_SGDWithStatistics`: the largest difference of the parameters from one process,
    or the error ``step()`` raised."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit import distributed as skdist
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    plain = copy.deepcopy(reference)
    ref_opt = _SGDWithStatistics(reference.parameters())
    if stepped_before_wrapping:
        opt = _SGDWithStatistics(plain.parameters())
        for m, o in ((plain, opt), (reference, ref_opt)):
            F.mse_loss(m(_batch(9)[0]), _batch(9)[1]).backward()
            o.step()
            o.zero_grad()
    model = FSDP(plain, use_orig_params=True)
    if not stepped_before_wrapping:
        opt = _SGDWithStatistics(model.parameters())
    rank = skdist.get_rank()
    try:
        for step in range(2):
            x, y = _batch(step)
            F.mse_loss(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
            opt.step()
            opt.zero_grad()
            F.mse_loss(reference(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    except RuntimeError as error:
        return str(error)
    with model.summon_full_params():
        return max((p - q).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters()))


def test_optimizer_with_statistics_of_the_whole_shape_steps_the_shards(world2):
    """Regression: an optimizer built after wrapping that keeps Shampoo-style statistics
    (``right``: cols x cols, the whole shape (6, 6) of a square weight whose shard is (3, 6))
    was refused at its first step as "state made for the whole parameter". Its state is the
    shard's (the row statistic and the momentum have the shard's rows): it now trains as one
    process. The same optimizer stepped before wrapping (every statistic of the whole
    parameter's shape) is still refused, on every rank, naming the state."""
    for out in world2.run(_train_with_statistics, False):
        assert isinstance(out, float) and out < 1e-6, out
    for out in world2.run(_train_with_statistics, True):
        assert isinstance(out, str), out
        assert "_SGDWithStatistics.step() holds state" in out, out
        assert "before the model was wrapped" in out, out
