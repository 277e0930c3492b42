"""FSDP core as torch FSDP1 / single-process users drive it:

- ``optimizer.step()`` between the micro-batches of a ``no_sync`` cycle stepped with zeros:
  the accumulated gradient is held unsharded outside ``.grad`` (which reads as zeros of the
  shard), so the step applied momentum and weight decay alone, silently, and the held
  gradient reached the next step too. It is now refused, before the step changes anything;
- ``p.grad.data.zero_()`` between such micro-batches (FairScale-era zeroing loops) was not
  seen (it bumps the version of the ``.data`` alias only), so the discarded gradient reached
  the step;
- ``p.grad.mul_(s)`` there cannot reach the held gradient (``.grad`` reads as zeros): it is
  reduced unscaled, which now comes with a warning instead of silently;
- a forward that raised (a bad batch the training loop catches and skips) left the units it
  had gathered (the root and the unit that raised) holding their full parameters until the
  next forward;
- ``summon_full_params(with_grads=True)`` was refused; as in torch FSDP1 with
  ``use_orig_params=True`` it now shows each parameter's full gradient in ``.grad``.

Its review found:

Review of the FSDP core change that added ``summon_full_params(with_grads=True)`` and the
optimizer-step check over gradients held inside ``no_sync``:

- after a backward inside ``no_sync``, ``optimizer.zero_grad()`` discards what was held (the
  step's check allows the step), yet ``summon_full_params(with_grads=True)`` and
  ``clip_grad_norm_`` still refused, saying gradients were held unreduced;
- ``summon_full_params(with_grads=True)`` nested in a ``summon_full_params()`` block over the
  same units left this rank's gradient shard in ``.grad`` beside the full parameter, silently.

One world of 2.
"""

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

from tests.nn.fsdp_common import TwoBlockNet as Net

world2 = world_fixture(2)


def _batch(i: int) -> tuple:
    g = torch.Generator().manual_seed(40 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // skdist.get_world_size()
    return t[skdist.get_rank() * per:(skdist.get_rank() + 1) * per]


def _wrapped(reference: nn.Module, **kwargs) -> nn.Module:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    model = copy.deepcopy(reference)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, **kwargs)
    return FSDP(model, **kwargs)


def _named(model: nn.Module) -> dict:
    return {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}


def _full_values(model: nn.Module) -> dict:
    with model.summon_full_params():
        return {n: p.detach().clone() for n, p in _named(model).items()}


def _step_inside_no_sync() -> dict:
    """A step between no_sync micro-batches is refused on every rank and changes nothing;
    after the cycle's synchronising backward the step matches one process (SGD with
    momentum and weight decay, two cycles)."""
    torch.manual_seed(0)
    reference = Net()
    model = _wrapped(reference)
    make = dict(lr=0.1, momentum=0.9, weight_decay=0.1)
    opt, ref_opt = torch.optim.SGD(model.parameters(), **make), \
        torch.optim.SGD(reference.parameters(), **make)
    out = {"refused": [], "unchanged": True, "after_zero_grad": None}
    for cycle in range(2):
        for micro in range(2):
            x, y = _batch(2 * cycle + micro)
            F.cross_entropy(reference(x), y).backward()
            if micro == 0:
                with model.no_sync():
                    F.cross_entropy(model(_local(x)), _local(y)).backward()
                before = _full_values(model)
                try:
                    opt.step()
                    out["refused"].append("stepped")
                except RuntimeError as error:
                    out["refused"].append(str(error))
                after = _full_values(model)
                out["unchanged"] &= all(torch.equal(before[n], after[n]) for n in before)
            else:
                F.cross_entropy(model(_local(x)), _local(y)).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    mine = _full_values(model)
    out["worst"] = max((mine[n] - p.detach()).abs().max().item()
                       for n, p in reference.named_parameters())
    # what the cycle held, discarded by zero_grad, no longer stops a step
    x, y = _batch(9)
    with model.no_sync():
        F.cross_entropy(model(_local(x)), _local(y)).backward()
    opt.zero_grad()
    opt.step()
    out["after_zero_grad"] = "stepped"
    return out


def test_optimizer_step_inside_no_sync_is_refused(world2):
    """Regression: ``optimizer.step()`` after a backward inside ``no_sync`` stepped every
    parameter with a zero gradient (momentum and weight decay alone), silently, and the held
    gradient was added to the next step's."""
    for out in world2.run(_step_inside_no_sync):
        assert len(out["refused"]) == 2, out
        for message in out["refused"]:
            assert "SGD.step()" in message and "no_sync()" in message, message
            assert "optimizer.zero_grad()" in message, message
        assert out["unchanged"], out
        assert out["worst"] < 1e-6, out
        assert out["after_zero_grad"] == "stepped", out


def _zeroed_through_data() -> float:
    """Micro-batch 0 inside no_sync, its gradient zeroed with ``p.grad.data.zero_()`` (and
    the optimizer then allowed to step over it), micro-batch 1 synchronising: the gradient
    against one process doing the same."""
    from shardkit.nn.data_parallel.flat_param import shard_rows
    torch.manual_seed(0)
    reference = Net()
    model = _wrapped(reference)
    for micro in range(2):
        x, y = _batch(5 + micro)
        F.cross_entropy(reference(x), y).backward()
        if micro == 0:
            with model.no_sync():
                F.cross_entropy(model(_local(x)), _local(y)).backward()
            for m in (reference, model):
                for p in m.parameters():
                    p.grad.data.zero_()
            torch.optim.SGD(model.parameters(), lr=0.0).step()
        else:
            F.cross_entropy(model(_local(x)), _local(y)).backward()
    mine = _named(model)
    return max((mine[n].grad - shard_rows(p.grad, model._param_layouts()[id(mine[n])],
                                          model.rank)).abs().max().item()
               for n, p in reference.named_parameters())


def test_grad_zeroed_through_data_inside_no_sync_is_discarded(world2):
    """Regression: ``p.grad.data.zero_()`` inside a no_sync cycle left the held gradient in
    place, so it was added to the next step (off by a whole micro-batch)."""
    for worst in world2.run(_zeroed_through_data):
        assert worst < 1e-6, worst


def _warnings_for_grads_touched_inside_no_sync() -> dict:
    """Which in-place changes of ``.grad`` between no_sync micro-batches warn that the held
    gradient did not follow (none do now: ``.grad`` is the accumulator, as in torch FSDP1)."""
    import warnings
    torch.manual_seed(0)
    model = _wrapped(Net())
    out = {}
    for how in ("scale", "zero"):
        model.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for micro in range(2):
                x, y = _batch(micro)
                with model.no_sync():
                    F.cross_entropy(model(_local(x)), _local(y)).backward()
                for p in model.parameters():
                    p.grad.mul_(0.5) if how == "scale" else p.grad.zero_()
            F.cross_entropy(model(_local(x)), _local(y)).backward()
        out[how] = [str(w.message) for w in caught if "no_sync()" in str(w.message)]
    return out


def test_grads_scaled_or_zeroed_inside_no_sync_need_no_warning(world2):
    """Before: a ``p.grad.mul_(0.5)`` between no_sync micro-batches was ignored silently (the
    accumulated gradient, held outside ``.grad``, was reduced unscaled), later with a warning;
    now ``.grad`` is the accumulator the reduce-scatter reads (parity:
    tests/nn/test_fsdp_no_sync_grads.py) and neither a scaling nor a zeroing warns."""
    for out in world2.run(_warnings_for_grads_touched_inside_no_sync):
        assert out == {"scale": [], "zero": []}, out


def _forward_that_raises() -> list:
    """Bytes held gathered after forwards that raised (in the unit's module, in the root's
    own code), with and without gradients, then after a normal training step."""
    from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
    gc.collect()  # models of earlier checks in this process, possibly still gathered
    held_before = gathered_param_bytes().live
    torch.manual_seed(0)
    model = _wrapped(Net())
    live = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for bad in (torch.randn(4, 5), torch.randn(4, 6, 2)):
                with pytest.raises(RuntimeError):
                    model(bad)
                live.append(gathered_param_bytes().live - held_before)
    x, y = _batch(0)
    F.cross_entropy(model(_local(x)), _local(y)).backward()
    live.append(gathered_param_bytes().live - held_before)
    return live


def test_forward_that_raised_frees_the_units_it_gathered(world2):
    """Regression: a forward that raised left the root and the unit that raised gathered
    (their full parameters held) until the next forward."""
    for live in world2.run(_forward_that_raises):
        assert live == [0] * len(live), live


def _summon_with_grads() -> dict:
    torch.manual_seed(0)
    reference = Net()
    model = _wrapped(reference, use_orig_params=True)
    x, y = _batch(3)
    F.cross_entropy(reference(x), y).backward()
    F.cross_entropy(model(_local(x)), _local(y)).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}
    out = {}
    with model.summon_full_params(with_grads=True):
        out["full"] = max((p.grad - expected[n]).abs().max().item()
                          for n, p in _named(model).items())
        model.head.weight.grad.mul_(2)
        model.blocks[0].a.bias.grad = None
    with model.summon_full_params(with_grads=True, writeback=False):
        out["edited"] = (model.head.weight.grad - 2 * expected["head.weight"]).abs().max().item()
        out["set_to_none"] = model.blocks[0].a.bias.grad is None
        model.head.weight.grad.zero_()
    with model.summon_full_params(with_grads=True):
        out["not_written"] = (model.head.weight.grad
                              - 2 * expected["head.weight"]).abs().max().item()
    out["shapes"] = all(p.grad is None or p.grad.shape == p.shape for p in model.parameters())
    try:
        with _wrapped(reference).summon_full_params(with_grads=True):
            out["default"] = "summoned"
    except NotImplementedError as error:
        out["default"] = str(error)
    return out


def test_summon_full_params_with_grads(world2):
    """Before: ``with_grads=True`` was refused. Now, with units built with
    ``use_orig_params=True`` (torch FSDP1's requirement, whose NotImplementedError stays
    otherwise), ``.grad`` holds the full gradient inside the block, equal to one process's;
    edits are written back unless ``writeback=False``."""
    for out in world2.run(_summon_with_grads):
        assert out["full"] < 1e-6 and out["edited"] < 1e-6, out
        assert out["set_to_none"] and out["not_written"] < 1e-6 and out["shapes"], out
        assert "use_orig_params=True" in out["default"], out


class Net_rev(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _batch_rev(i: int) -> tuple:
    g = torch.Generator().manual_seed(70 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _wrapped_rev(reference: nn.Module) -> nn.Module:
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
    reference = Net_rev()
    model = _wrapped_rev(reference)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for set_to_none in (True, False):
        x, y = _batch_rev(0)
        with model.no_sync():
            F.cross_entropy(model(_local(x)), _local(y)).backward()
        opt.zero_grad(set_to_none=set_to_none)
        grads = _full_grads(model)
        out[f"summoned_{set_to_none}"] = sorted(
            "none" if g is None else ("zeros" if not g.any() else "values")
            for g in grads.values())
        out[f"norm_{set_to_none}"] = float(model.clip_grad_norm_(1.0))
        x, y = _batch_rev(1)
        F.cross_entropy(model(_local(x)), _local(y)).backward()
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        grads = _full_grads(model)
        out[f"worst_{set_to_none}"] = max((grads[n] - p.grad).abs().max().item()
                                          for n, p in reference.named_parameters())
        model.zero_grad()
    x, y = _batch_rev(2)
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
    reference = Net_rev()
    model = _wrapped_rev(reference)
    x, y = _batch_rev(3)
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
