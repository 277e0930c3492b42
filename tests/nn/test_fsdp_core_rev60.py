"""Review of the FSDP core change that added ``summon_full_params(with_grads=True)`` and the
optimizer-step check over gradients held inside ``no_sync``:

- after a backward inside ``no_sync``, ``optimizer.zero_grad()`` discards what was held (the
  step's check allows the step), yet ``summon_full_params(with_grads=True)`` and
  ``clip_grad_norm_`` still refused, saying gradients were held unreduced;
- ``summon_full_params(with_grads=True)`` nested in a ``summon_full_params()`` block over the
  same units left this rank's gradient shard in ``.grad`` beside the full parameter, silently.

One world of 2.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _batch(i: int) -> tuple:
    g = torch.Generator().manual_seed(70 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // skdist.get_world_size()
    return t[skdist.get_rank() * per:(skdist.get_rank() + 1) * per]


def _wrapped(reference: nn.Module) -> nn.Module:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    model = copy.deepcopy(reference)
    model.body = FSDP(model.body, use_orig_params=True)
    return FSDP(model, use_orig_params=True)


def _full_grads(model: nn.Module) -> dict:
    with model.summon_full_params(with_grads=True, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()}


def _summon_and_clip_after_zero_grad() -> dict:
    """A micro-batch inside no_sync, discarded with ``optimizer.zero_grad()`` (both ways):
    the full gradients, the clipped norm, then a synchronising backward's gradients against
    one process that never saw the discarded micro-batch; and the refusal while held."""
    torch.manual_seed(0)
    reference = Net()
    model = _wrapped(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for set_to_none in (True, False):
        x, y = _batch(0)
        with model.no_sync():
            F.cross_entropy(model(_local(x)), _local(y)).backward()
        opt.zero_grad(set_to_none=set_to_none)
        grads = _full_grads(model)
        out[f"summoned_{set_to_none}"] = sorted(
            "none" if g is None else ("zeros" if not g.any() else "values")
            for g in grads.values())
        out[f"norm_{set_to_none}"] = float(model.clip_grad_norm_(1.0))
        x, y = _batch(1)
        F.cross_entropy(model(_local(x)), _local(y)).backward()
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        grads = _full_grads(model)
        out[f"worst_{set_to_none}"] = max((grads[n] - p.grad).abs().max().item()
                                          for n, p in reference.named_parameters())
        model.zero_grad()
    x, y = _batch(2)
    with model.no_sync():
        F.cross_entropy(model(_local(x)), _local(y)).backward()
    for what in ("summon", "clip"):
        try:
            _full_grads(model) if what == "summon" else model.clip_grad_norm_(1.0)
            out[what] = "allowed"
        except RuntimeError as error:
            out[what] = str(error)
    return out


def test_zero_grad_inside_no_sync_lets_summon_with_grads_and_clip_run(world2):
    """Regression: after ``optimizer.zero_grad()`` had discarded what a backward inside
    ``no_sync`` held, ``summon_full_params(with_grads=True)`` and ``clip_grad_norm_`` were
    refused ("accumulated inside no_sync() and are not reduced yet") while ``optimizer.step()``
    was allowed. They now see what one process sees; gradients still held are refused."""
    for out in world2.run(_summon_and_clip_after_zero_grad):
        assert out["summoned_True"] == ["none"] * 4, out
        assert out["summoned_False"] == ["zeros"] * 4, out
        assert out["norm_True"] == 0.0 and out["norm_False"] == 0.0, out
        assert out["worst_True"] < 1e-6 and out["worst_False"] < 1e-6, out
        for what in ("summon", "clip"):
            assert "not reduced yet" in out[what], out


def _nested_summons() -> dict:
    """``with_grads=True`` inside a plain block (refused), and inside a ``with_grads`` block
    (the full gradients, as one process)."""
    torch.manual_seed(0)
    reference = Net()
    model = _wrapped(reference)
    x, y = _batch(3)
    F.cross_entropy(model(_local(x)), _local(y)).backward()
    F.cross_entropy(reference(x), y).backward()
    out = {}
    with model.summon_full_params():
        try:
            with model.summon_full_params(with_grads=True):
                out["inside_plain"] = [tuple(p.grad.shape) for p in model.parameters()]
        except RuntimeError as error:
            out["inside_plain"] = str(error)
    with model.summon_full_params(with_grads=True):
        with model.summon_full_params(with_grads=True):
            named = {n.replace("_fsdp_wrapped_module.", ""): p
                     for n, p in model.named_parameters()}
            out["inside_grads"] = max((named[n].grad - p.grad).abs().max().item()
                                      for n, p in reference.named_parameters())
    out["after"] = all(p.grad.shape == p.shape for p in model.parameters())
    return out


def test_summon_with_grads_inside_a_summon_without_is_refused(world2):
    """Regression: inside ``summon_full_params()``, a nested ``with_grads=True`` block left
    ``.grad`` as this rank's shard of the gradient beside the full parameter (``(3, 6)``
    beside ``(5, 6)``), silently. It is now refused on every rank, before any gather."""
    for out in world2.run(_nested_summons):
        assert "with_grads=True to the outer" in out["inside_plain"], out
        assert out["inside_grads"] < 1e-6 and out["after"], out
