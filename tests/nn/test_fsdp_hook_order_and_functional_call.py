"""FSDP and the ways torch code reaches a wrapped module's tensors (one world of 2 ranks):

* a forward pre-hook registered with ``prepend=True`` on a wrapped module after wrapping sees
  the gathered weight, as under FairScale's and torch FSDP1's wrappers, which gather before
  calling the wrapped module;
* ``torch.func.functional_call`` (EMA evaluation) on an FSDP model cannot compute with the
  tensors it is given (the unit computes with its own gathered parameters): a RuntimeError
  naming it, not the model's own output, under FSDP's inner names and under the names
  ``named_parameters()`` gives;
* ``get_buffer`` takes the names ``named_buffers()`` gives (no wrapper levels), as
  ``get_parameter`` does.

Regressions: the prepended hook read this rank's row shard (the output was off by 0.44);
``functional_call`` returned the model's own output, silently, once a forward had gathered the
root (and a misleading "replaced by another parameter after wrapping" before); ``get_buffer``
raised "`shift` is not a buffer".
"""

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call

from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _prepended_pre_hook(compiled=False):
    torch.manual_seed(0)
    seen = []

    def hook(module, args):  # reads the weight, as in one process
        seen.append(tuple(module.weight.shape))
        return (args[0] * module.weight.norm(),)

    plain = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))
    model.load_state_dict(plain.state_dict())
    model[0] = FSDP(model[0])
    wrapped = FSDP(model)
    wrapped.module[0].module.register_forward_pre_hook(hook, prepend=True)
    plain[0].register_forward_pre_hook(hook, prepend=True)
    run = torch.compile(wrapped, backend="eager") if compiled else wrapped
    x = torch.randn(2, 6)
    diffs = [float((run(x) - plain(x)).abs().max()) for _ in range(2)]
    return seen, diffs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_pre_hook_prepended_after_wrapping_sees_the_gathered_weight(world2, compiled):
    """Compiled: ``torch.compile(model)`` (Dynamo; its forward skipped the reordering)."""
    for seen, diffs in world2.run(_prepended_pre_hook, compiled):
        assert seen == [(6, 6)] * 4, seen  # wrapped and plain, two forwards
        assert max(diffs) <= 1e-6, diffs


class _Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 1)
        self.register_buffer("shift", torch.zeros(6))

    def forward(self, x):
        return self.linear(x + self.shift)


def _functional_calls():
    torch.manual_seed(0)
    wrapped = FSDP(_Shifted())
    x = torch.randn(4, 6)
    ema = {name: torch.full_like(p, 0.1) for name, p in nn.Module.named_parameters(wrapped)}
    said = {}
    for when in ("before a forward", "after a forward"):
        if when == "after a forward":
            wrapped(x)
        try:
            with torch.no_grad():
                functional_call(wrapped, ema, (x,))
            said[when] = "computed"
        except RuntimeError as error:
            said[when] = str(error)
    said["still trains"] = wrapped(x).sum().backward() is None
    said["buffer"] = wrapped.get_buffer("shift") is dict(wrapped.named_buffers())["shift"]
    return said


def test_functional_call_is_refused_and_get_buffer_takes_clean_names(world2):
    for said in world2.run(_functional_calls):
        for when in ("before a forward", "after a forward"):
            assert "torch.func.functional_call" in said[when], (when, said)
        assert said["still trains"] and said["buffer"], said


def _functional_calls_by_clean_names():
    """``functional_call`` under the names ``named_parameters()`` gives, where they end at a
    unit that holds its parameters directly (``FSDP(nn.Linear)``, a size-wrapped leaf)."""
    torch.manual_seed(0)
    single = FSDP(nn.Linear(6, 1))
    nested = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 1))
    nested[0] = FSDP(nested[0])
    nested = FSDP(nested)
    x = torch.randn(4, 6)
    said = {}
    for name, model in (("single", single), ("nested", nested)):
        ema = {key: torch.full_like(p, 0.1) for key, p in model.named_parameters()}
        for when in ("before a forward", "after a forward"):
            if when == "after a forward":
                model(x)
            try:
                with torch.no_grad():
                    functional_call(model, ema, (x,))
                said[name, when] = "computed"
            except RuntimeError as error:
                said[name, when] = str(error)
        model(x).sum().backward()  # nothing was left set on the unit
        said[name, "left on the unit"] = [k for k in ("weight", "bias") if k in vars(model)]
    return said


def test_functional_call_by_the_names_named_parameters_gives_is_refused(world2):
    """Before: the tensors were set as attributes of the unit, the forward computed with the
    unit's own weights (silently), and restoring raised "KeyError: attribute 'weight' already
    exists"."""
    for said in world2.run(_functional_calls_by_clean_names):
        for name in ("single", "nested"):
            for when in ("before a forward", "after a forward"):
                assert "torch.func.functional_call" in said[name, when], (name, when, said)
            assert said[name, "left on the unit"] == [], said


if __name__ == "__main__":
    pytest.main([__file__])
