"""shardkit's DDP comm hooks given the wrong state, in one world of 2 gloo ranks.

A user moving from torch DDP registers ``ddp.register_comm_hook(state, hook)``; the state of
each of shardkit's hooks is its own (a process group or None, a QuantizedHookState, an OSS or
an OwnersHookState). A state meant for another hook, a plain torch optimizer where an OSS is
needed, bits or a block the quantizer cannot use, or a wire dtype given as a string used to
fail inside DDP's backward with an AttributeError ("'OSS' object has no attribute 'size'",
"'SGD' object has no attribute 'group'") or a ValueError naming neither the state nor the hook,
and a compressing hook given a sparse bucket (nn.Embedding(sparse=True)) with "reshape is not
implemented for sparse tensors".
Now the state's own construction refuses what it cannot use, naming the field, and a hook
given another hook's state raises a TypeError naming the hook, on every rank and before any
transfer (CommCounter sees nothing).

From a review:

The errors of shardkit's DDP comm hooks for a state that is not theirs say where such a state
belongs by its class, not by its name (review of 517686a). The checks run first and are
local, so the hooks are called directly with no bucket (a world of one rank only to build
an OSS subclass).

A user coming from FairScale hands ``fairscale.optim.OSS`` (a class also named ``OSS``) to
``reduce_to_owners_hook``: the refusal said both "expected a shardkit.optim.OSS" and "an OSS is
the state of reduce_to_owners_hook", contradicting itself; a subclass of shardkit's OSS given to
``fp16_allreduce_hook`` got no hint at all.
"""

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed as skdist
from shardkit.comm_hooks import (OwnersHookState, QuantizedHookState, bf16_allreduce_hook,
                                 counted_allreduce_hook, fp16_allreduce_hook,
                                 quantized_allreduce_hook, reduce_to_owners_hook,
                                 step_oss_in_ddp_backward)
from shardkit.optim import OSS
from shardkit.testing import world_fixture

world2 = world_fixture(2)


@pytest.mark.parametrize("fields, message", [
    (dict(bits=3), "QuantizedHookState(bits=3): valid values are [4, 8]"),
    (dict(bits=True), "QuantizedHookState(bits=True): valid values are [4, 8]"),
    (dict(block=0), "QuantizedHookState(block=0): valid values are the powers of two"),
    (dict(block=100), "QuantizedHookState(block=100): valid values are the powers of two"),
])
def test_quantized_hook_state_refuses_what_the_quantizer_cannot_use(fields, message):
    with pytest.raises(ValueError) as refused:
        QuantizedHookState(**fields)
    assert message in str(refused.value)


def _refusal(build_and_register) -> tuple:
    """(exception type, message, collectives shardkit issued) of building a DDP over a small
    model, registering a hook with ``build_and_register(ddp, oss)`` and running one backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp = DDP(model)
    oss = OSS(ddp.parameters(), optim=torch.optim.SGD, lr=0.1)
    with skdist.CommCounter() as comm:
        try:
            build_and_register(ddp, oss)
            ddp(torch.ones(2, 8)).sum().backward()
        except Exception as e:  # DDP re-raises the hook's error as it is
            return type(e).__name__, str(e), len(comm.calls)
    return None, "", len(comm.calls)


SPARSE_HOOKS = {"fp16_allreduce_hook": (None, fp16_allreduce_hook),
                "bf16_allreduce_hook": (None, bf16_allreduce_hook),
                "quantized_allreduce_hook": (QuantizedHookState(), quantized_allreduce_hook)}


CASES = {
    "oss_to_fp16_hook": lambda ddp, oss: ddp.register_comm_hook(oss, fp16_allreduce_hook),
    "oss_to_bf16_hook": lambda ddp, oss: ddp.register_comm_hook(oss, bf16_allreduce_hook),
    "quantized_state_to_counted_hook": lambda ddp, oss: ddp.register_comm_hook(
        QuantizedHookState(bits=4), counted_allreduce_hook),
    "owners_state_to_quantized_hook": lambda ddp, oss: ddp.register_comm_hook(
        OwnersHookState(oss), quantized_allreduce_hook),
    "torch_optimizer_to_owners_hook": lambda ddp, oss: ddp.register_comm_hook(
        torch.optim.SGD(ddp.parameters(), lr=0.1), reduce_to_owners_hook),
    "none_to_owners_hook": lambda ddp, oss: ddp.register_comm_hook(None, reduce_to_owners_hook),
    "torch_optimizer_in_owners_state": lambda ddp, oss: OwnersHookState(
        torch.optim.SGD(ddp.parameters(), lr=0.1), torch.bfloat16),
    "owners_wire_as_string": lambda ddp, oss: OwnersHookState(oss, "bf16"),
    "owners_wire_int8": lambda ddp, oss: OwnersHookState(oss, torch.int8),
    "torch_optimizer_stepped_in_backward": lambda ddp, oss: step_oss_in_ddp_backward(
        DDP(ddp.module, gradient_as_bucket_view=True), torch.optim.SGD(ddp.parameters(), lr=0.1)),
}

EXPECTED = {
    "oss_to_fp16_hook": ("TypeError", ["fp16_allreduce_hook", "takes a process group or None",
                                       "shardkit.optim.oss.OSS",
                                       "an OSS is the state of reduce_to_owners_hook"]),
    "oss_to_bf16_hook": ("TypeError", ["bf16_allreduce_hook", "shardkit.optim.oss.OSS"]),
    "quantized_state_to_counted_hook": ("TypeError", [
        "counted_allreduce_hook", "a QuantizedHookState is the state of quantized_allreduce_hook"]),
    "owners_state_to_quantized_hook": ("TypeError", [
        "quantized_allreduce_hook", "takes a QuantizedHookState, a process group or None",
        "an OwnersHookState is the state of reduce_to_owners_hook"]),
    "torch_optimizer_to_owners_hook": ("TypeError", [
        "reduce_to_owners_hook", "expected a shardkit.optim.OSS", "torch.optim.sgd.SGD"]),
    "none_to_owners_hook": ("TypeError", ["reduce_to_owners_hook", "got None"]),
    "torch_optimizer_in_owners_state": ("TypeError", [
        "OwnersHookState(optimizer=...)", "expected a shardkit.optim.OSS"]),
    "owners_wire_as_string": ("ValueError", ["OwnersHookState(dtype='bf16')",
                                             "torch.bfloat16 and torch.float16"]),
    "owners_wire_int8": ("ValueError", ["OwnersHookState(dtype=torch.int8)"]),
    "torch_optimizer_stepped_in_backward": ("TypeError", [
        "step_oss_in_ddp_backward(optimizer=...)", "expected a shardkit.optim.OSS"]),
    # nn.Embedding(sparse=True): "reshape is not implemented for sparse tensors" before
    **{f"sparse_{name}": ("ValueError", [f"{name}: DDP gave the hook a bucket of sparse",
                                         "register counted_allreduce_hook"])
       for name in SPARSE_HOOKS},
}


def _sparse_refusal(state, hook) -> tuple:
    """(exception type, message, collectives) of one backward through a sparse embedding."""
    ddp = DDP(nn.Embedding(10, 4, sparse=True))
    ddp.register_comm_hook(state, hook)
    with skdist.CommCounter() as comm:
        try:
            ddp(torch.tensor([1, 3, 5])).sum().backward()
        except Exception as e:
            return type(e).__name__, str(e), len(comm.calls)
    return None, "", len(comm.calls)


def _all_refusals():
    refusals = {name: _refusal(case) for name, case in CASES.items()}
    refusals.update({f"sparse_{name}": _sparse_refusal(*hook)
                     for name, hook in SPARSE_HOOKS.items()})
    return refusals


def test_a_hook_given_another_hooks_state_names_the_hook_before_any_transfer(world2):
    by_rank = world2.run(_all_refusals)
    for name, (kind, parts) in EXPECTED.items():
        for refusals in by_rank:
            got_kind, message, collectives = refusals[name]
            assert got_kind == kind, (name, got_kind, message)
            for part in parts:
                assert part in message, (name, part, message)
            assert collectives == 0, (name, "nothing sent before the refusal")
        assert by_rank[0][name] == by_rank[1][name], "the same refusal on every rank"


def _hooks_still_train_with_their_own_states():
    """The checks let every documented state through: gradients against the fp32 average."""
    rank = skdist.get_rank()
    grads = {}
    for name, state_of in {
            "counted_default_group": lambda oss: (None, counted_allreduce_hook),
            "fp16_world_group": lambda oss: (skdist.resolved_group(None), fp16_allreduce_hook),
            "quantized_group": lambda oss: (skdist.resolved_group(None),
                                            quantized_allreduce_hook),
            "owners_oss": lambda oss: (oss, reduce_to_owners_hook),
            "owners_state_fp32": lambda oss: (OwnersHookState(oss, torch.float32),
                                              reduce_to_owners_hook)}.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
        ddp = DDP(model)
        oss = OSS(ddp.parameters(), optim=torch.optim.SGD, lr=0.1)
        ddp.register_comm_hook(*state_of(oss))
        ddp(torch.full((2, 8), float(rank + 1))).pow(2).sum().backward()
        owned = [p for p in model.parameters() if oss.partition.owner(p) == rank]
        grads[name] = [p.grad.clone() for p in owned]
    return grads


def test_documented_states_still_average(world2):
    by_rank = world2.run(_hooks_still_train_with_their_own_states)
    for grads in by_rank:
        reference = grads["counted_default_group"]
        for name, got in grads.items():
            tolerance = 3e-2 if name == "quantized_group" else 1e-3 if "fp16" in name else 1e-6
            for g, ref in zip(got, reference):
                assert torch.allclose(g, ref, rtol=tolerance, atol=tolerance * ref.abs().max()), \
                    name


def _two_sharded_ddp_over_one_oss():
    """A generator and a discriminator wrapped apart, over one OSS covering both: refused at
    the first wrap, before any collective, saying how to wrap them."""
    from shardkit.nn.data_parallel import ShardedDataParallel

    generator, discriminator = nn.Linear(4, 4), nn.Linear(4, 1)
    shared = OSS(list(generator.parameters()) + list(discriminator.parameters()),
                 optim=torch.optim.SGD, lr=0.1)
    with skdist.CommCounter() as comm:
        try:
            ShardedDataParallel(generator, shared)
        except ValueError as e:
            return str(e), len(comm.calls)
    return "", len(comm.calls)


def test_two_sharded_ddp_sharing_one_oss_are_told_to_take_one_each(world2):
    for message, collectives in world2.run(_two_sharded_ddp_over_one_oss):
        assert "is not a parameter of the wrapped module" in message, message
        assert "need one OSS each, or one wrapper around a module holding both" in message
        assert collectives == 0


OWNERS_HINT = "is the state of reduce_to_owners_hook"


class ForeignOSS(torch.optim.SGD):
    """Another library's optimizer that happens to be called OSS (FairScale's is)."""


ForeignOSS.__name__ = ForeignOSS.__qualname__ = "OSS"


class TunedOSS(OSS):
    """A user's subclass of shardkit's OSS."""


def _foreign_oss() -> ForeignOSS:
    return ForeignOSS([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def _type_error(call) -> str:
    with pytest.raises(TypeError) as refused:
        call()
    return str(refused.value)


@pytest.mark.parametrize("call", [
    lambda state: reduce_to_owners_hook(state, None),
    lambda state: OwnersHookState(state),
    lambda state: step_oss_in_ddp_backward(None, state),
    lambda state: counted_allreduce_hook(state, None),
    lambda state: quantized_allreduce_hook(state, None),
], ids=["owners_hook", "owners_state", "step_in_backward", "counted_hook", "quantized_hook"])
def test_another_librarys_oss_is_not_called_the_state_of_the_owners_hook(call):
    message = _type_error(lambda: call(_foreign_oss()))
    assert f"got a {__name__}.OSS" in message, message
    assert OWNERS_HINT not in message, message


def _refusal_of_a_tuned_oss_to_the_fp16_hook() -> tuple:
    tuned = TunedOSS([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    wide = OwnersHookState(tuned, torch.float64)  # an fp64 model's own dtype: accepted
    return _type_error(lambda: fp16_allreduce_hook(tuned, None)), wide.dtype


def test_a_subclass_of_shardkits_oss_is_pointed_to_the_owners_hook(world2):
    for message, wide in world2.run(_refusal_of_a_tuned_oss_to_the_fp16_hook):
        assert f"a TunedOSS {OWNERS_HINT} (or step_oss_in_ddp_backward" in message, message
        assert wide == torch.float64
