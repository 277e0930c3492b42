"""FSDP ``no_sync`` accumulation when ``.grad`` is touched in place between micro-batches:
``torch.nn.utils.clip_grad_norm_`` (its ``_foreach_mul_`` runs even when nothing is clipped)
or a GradScaler-style unscale reads every ``.grad`` in place. Such a change is no clearing:
the gradient accumulated so far must still reach the step, as in one process, while
``optimizer.zero_grad(set_to_none=False)`` still discards it.

One world of 2.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 6)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """A root holding the head, two blocks as inner units."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch(i: int) -> tuple:
    g = torch.Generator().manual_seed(30 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // skdist.get_world_size()
    return t[skdist.get_rank() * per:(skdist.get_rank() + 1) * per]


def _touch_grads_in_place(model: nn.Module, how: str) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    if how == "clip":  # a norm far above the gradients': the coefficient is clamped to 1
        torch.nn.utils.clip_grad_norm_(params, max_norm=1e6)
    elif how == "unscale":  # GradScaler's unscale at a scale of 1
        with torch.no_grad():
            torch._foreach_mul_([p.grad for p in params], 1.0)
    elif how == "zero":
        for p in params:
            p.grad.zero_()


def _accumulate_touching_grads(how: str, keep: bool) -> dict:
    """Three micro-batches (two inside ``no_sync``), ``.grad`` touched in place after the
    first: the gradient of every parameter against one process doing the same."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.flat_param import shard_rows
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, reshard_after_forward=not keep)
    model = FSDP(model, reshard_after_forward=not keep)
    for micro in range(3):
        x, y = _batch(micro)
        F.cross_entropy(reference(x), y).backward()
        if micro < 2:
            with model.no_sync():
                F.cross_entropy(model(_local(x)), _local(y)).backward()
        else:
            F.cross_entropy(model(_local(x)), _local(y)).backward()
        if micro == 0:
            _touch_grads_in_place(reference, how)
            _touch_grads_in_place(model, how)
    mine = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    out = {}
    for name, p in reference.named_parameters():
        expected = shard_rows(p.grad, model._param_layouts()[id(mine[name])], model.rank)
        out[name] = (mine[name].grad - expected).abs().max().item() < 1e-6
    return out


def test_grads_read_in_place_inside_no_sync_keep_the_accumulated_gradient(world2):
    """Regression: after a backward inside ``no_sync``, any in-place operation on ``.grad``
    (bumping its version) was taken for ``optimizer.zero_grad()`` and dropped the gradient
    held for the next reduce: ``clip_grad_norm_`` that clipped nothing or an unscale by 1
    between micro-batches made every parameter's step miss the first micro-batch. A zeroing
    still drops it."""
    for how in ("clip", "unscale", "zero"):
        for keep in (False, True):
            for out in world2.run(_accumulate_touching_grads, how, keep):
                assert all(out.values()), (how, keep, {k: v for k, v in out.items() if not v})
