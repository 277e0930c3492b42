"""FSDP units whose forward reads their parameters inside several reentrant activation
checkpoints (``checkpoint(layer, x, use_reentrant=True)`` for each layer of a wrapped block,
or HF's reentrant gradient checkpointing of a model wrapped as one unit): each checkpoint's
backward reduce-scattered the unit and freed it, and the next recomputation all-gathered it
again, so ``k`` checkpoints cost ``k`` all-gathers and ``k`` reduce-scatters of the whole unit
per backward. The checkpoints' gradients now go in one reduce-scatter after one all-gather,
training matches one process at every step, and the unit is freed after each backward.

``loss.backward(create_graph=True)`` through sharded parameters failed deep inside the
reduce-scatter ("a leaf Variable that requires grad is being used in an in-place operation")
after gathers in backward; it is now refused as torch's FSDP refuses it (gradients of
gradients), on every rank before any collective of that backward, and the model trains as one
process afterwards.

From a review:

A root whose own parameters are read in one reentrant checkpoint (a checkpointed LM head)
while its forward also runs reentrant checkpoints of nested FSDP units (HF's
``gradient_checkpointing_func(layer.__call__, ...)`` over wrapped layers, or a checkpoint
inside each layer unit): the root counted the layers' checkpoints as its own, so the head's
gradient stayed unsharded (and unreduced) from the head's backward to the end of the last
layer's, for no collective saved. Now only checkpoints that may read the unit's parameters
count: training matches one process, the collectives are unchanged and the backward's peak
is that of the same model with the head not checkpointed.
"""

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff
from shardkit.utils.memory import LiveStorageTracker

world2 = world_fixture(2)

LAYERS = 3


class CheckpointedLayers(nn.Module):
    """Runs each layer inside a reentrant checkpoint of its own."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=True)
        return torch.tanh(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.block = CheckpointedLayers()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


def _models(case: str):
    """``(reference, FSDP model)`` with the same initial weights."""
    torch.manual_seed(0)
    reference = CheckpointedLayers() if case == "one_unit" else Net()
    torch.manual_seed(0)
    net = CheckpointedLayers() if case == "one_unit" else Net()
    if case == "child_unit_in_a_checkpoint":
        net.block.layers[0] = FSDP(net.block.layers[0])
    if case != "one_unit":
        net.block = FSDP(net.block)
    return reference, FSDP(net)


def _train_beside_one_process(case: str, micro_batches: int = 1) -> dict:
    """Three SGD steps of FSDP and of one process on the whole batch (``micro_batches`` per
    step, all but the last inside ``no_sync``): the largest weight difference after each
    step, the collectives of each step's backwards, whether any unit stayed gathered."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    reference, model = _models(case)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    out = {"diffs": [], "backward_calls": [], "gathered_after": []}
    for step in range(3):
        batches = torch.randn(world * micro_batches, 3, 4,
                              generator=torch.Generator().manual_seed(step))
        optim.zero_grad()
        ref_optim.zero_grad()
        calls: dict = {}
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                x = batches[rank * micro_batches + micro].requires_grad_()
                loss = model(x).pow(2).sum() / micro_batches
                with skdist.CommCounter() as comm:
                    loss.backward()
            for op, n in comm.calls_by_op.items():
                calls[op] = calls.get(op, 0) + n
        out["backward_calls"].append(calls)
        out["gathered_after"].append(any(u._shard.gathered for u in model.sharded_units()
                                         if u._shard is not None))
        optim.step()
        total = sum(reference(b.requires_grad_()).pow(2).sum() for b in batches)
        (total / (world * micro_batches)).backward()
        ref_optim.step()
        with model.summon_full_params():
            mine = [p.detach().clone() for p in model.parameters()]
        out["diffs"].append(max_diff(mine, reference.parameters()))
    return out


def _check(results: list, backward_calls: dict) -> None:
    for r in results:
        assert max(r["diffs"]) < 1e-6, r
        assert r["backward_calls"] == [backward_calls] * 3, r
        assert r["gathered_after"] == [False] * 3, r


def test_a_unit_recomputed_by_several_checkpoints_is_gathered_and_reduced_once(world2):
    # the block: one all-gather and one reduce-scatter (3 of each before); the root: one
    _check(world2.run(_train_beside_one_process, "block"),
           {"all_gather": 1, "reduce_scatter": 2})


def test_a_model_wrapped_as_one_unit_under_reentrant_checkpointing_reduces_once(world2):
    # kept gathered from forward to backward; one reduce-scatter of the whole model (3 before)
    _check(world2.run(_train_beside_one_process, "one_unit"), {"reduce_scatter": 1})


def test_checkpoints_inside_no_sync_hold_one_unreduced_gradient(world2):
    # the micro-batch inside no_sync gathers the block once and reduces nothing; the last one
    # gathers it once and reduces block and root once (before: 3 + 3 gathers, 3 + 1 reduces)
    results = world2.run(_train_beside_one_process, "block", micro_batches=2)
    for r in results:
        assert max(r["diffs"]) < 1e-6, r
        assert all(c.get("all_gather") == 2 and c.get("reduce_scatter") == 2
                   for c in r["backward_calls"]), r


def test_a_last_checkpoint_reading_only_a_child_unit_reduces_the_parent_after_it(world2):
    # the last checkpoint to run (the first layer's) reads the child unit only: the parent's
    # gradients held by the earlier ones are reduced as that checkpoint's backward ends.
    # block: 1 all-gather; child: its recomputation's and its backward's; one reduce-scatter
    # each of child, block and root (before: 2 gathers and 2 reduce-scatters of the block)
    _check(world2.run(_train_beside_one_process, "child_unit_in_a_checkpoint"),
           {"all_gather": 3, "reduce_scatter": 3})


def _create_graph_backward_then_train(nested: bool, inside_no_sync: bool) -> dict:
    """A ``backward(create_graph=True)`` (inside ``no_sync`` or not): its error and the
    collectives its backward ran; then two plain steps beside one process."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if nested:
        net[2] = FSDP(net[2])
    model = FSDP(net)
    out = {"error": None}
    x = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(9))
    loss = model(x[rank]).pow(2).sum()
    try:
        with model.no_sync() if inside_no_sync else contextlib.nullcontext():
            with skdist.CommCounter() as comm:
                loss.backward(create_graph=True)
    except RuntimeError as error:
        out["error"] = str(error)
    out["backward_calls"] = dict(comm.calls_by_op)
    model.zero_grad()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        batches = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(step))
        model(batches[rank]).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
        sum(reference(b).pow(2).sum() for b in batches).div(world).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    state = model.state_dict()
    out["diff"] = max((state[k] - v).abs().max().item()
                      for k, v in reference.state_dict().items())
    return out


def test_backward_with_create_graph_is_refused_before_its_collectives(world2):
    for nested in (False, True):
        for inside_no_sync in (False, True):
            for r in world2.run(_create_graph_backward_then_train, nested, inside_no_sync):
                assert r["error"] is not None and "create_graph=True" in r["error"] \
                    and "gradients of gradients" in r["error"] \
                    and "torch.autograd.grad" in r["error"], (nested, inside_no_sync, r)
                assert r["backward_calls"] == {}, (nested, inside_no_sync, r)
                assert r["diff"] < 1e-6, (nested, inside_no_sync, r)


WIDTH, VOCAB, LAYERS = 32, 512, 3
reentrant = functools.partial(checkpoint, use_reentrant=True)


class Layer(nn.Module):
    def __init__(self, inner_checkpoint: bool):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.inner_checkpoint = inner_checkpoint

    def forward(self, x):
        if self.inner_checkpoint:
            return reentrant(self.mlp, x)
        return self.mlp(x)

    def mlp(self, x):
        return x + torch.tanh(self.fc(x))


class LM(nn.Module):
    """Layers checkpointed from outside (HF style: ``layer.__call__``) or inside, then a head
    (``VOCAB x WIDTH``, the root's only parameters) checkpointed or not."""

    def __init__(self, style: str, head_checkpointed: bool):
        super().__init__()
        self.style = style
        self.layers = nn.ModuleList(Layer(style == "inside") for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head_checkpointed = head_checkpointed

    def forward(self, x):
        for layer in self.layers:
            x = reentrant(layer.__call__, x) if self.style == "outside" else layer(x)
        return reentrant(self.head, x) if self.head_checkpointed else self.head(x)


def _wrapped(style: str, head_checkpointed: bool):
    torch.manual_seed(0)
    net = LM(style, head_checkpointed)
    for i, layer in enumerate(net.layers):
        net.layers[i] = FSDP(layer)
    return FSDP(net)


def _at_first_layer(style: str, head_checkpointed: bool) -> dict:
    """As the first layer's recomputation begins (the last unit of the backward): the live
    storage bytes above the backward's start and the reduce-scatters issued so far; and the
    backward's collectives."""
    model = _wrapped(style, head_checkpointed)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(skdist.get_rank()))
    loss = model(x.requires_grad_()).pow(2).mean()
    seen = []

    def sample(module, args):
        seen.append((tracker.sample() - start, comm.calls_by_op.get("reduce_scatter", 0)))

    hook = model.layers[0].module.fc.register_forward_pre_hook(sample)
    with LiveStorageTracker() as tracker, skdist.CommCounter() as comm:
        start = tracker.live_bytes()
        loss.backward()
    hook.remove()
    return {"bytes": seen[-1][0], "reduced_before": seen[-1][1],
            "calls": dict(comm.calls_by_op)}


def _head_checkpointed_or_not(style: str) -> dict:
    return {"checkpointed": _at_first_layer(style, head_checkpointed=True),
            "plain": _at_first_layer(style, head_checkpointed=False)}


def test_a_checkpointed_head_is_reduced_before_the_nested_layers_backward(world2):
    for style in ("outside", "inside"):
        for r in world2.run(_head_checkpointed_or_not, style):
            checkpointed, plain = r["checkpointed"], r["plain"]
            # the head's reduce-scatter, then the last two layers': the head's gradient is
            # not held through the layers' backward (before: 2, the head's came last)
            assert checkpointed["reduced_before"] == 3, (style, r)
            assert checkpointed["bytes"] <= plain["bytes"], (style, r)
            assert checkpointed["calls"] == plain["calls"], (style, r)


def _train_beside_one_process_rev(style: str) -> list:
    """Three SGD steps with momentum of the wrapped model with its head checkpointed, and of
    one process on the whole batch: the largest weight difference after each step."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    model = _wrapped(style, head_checkpointed=True)
    torch.manual_seed(0)
    reference = LM(style, head_checkpointed=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    diffs = []
    for step in range(3):
        batches = torch.randn(world, 4, WIDTH, generator=torch.Generator().manual_seed(step))
        model(batches[rank].requires_grad_()).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sum(reference(b.requires_grad_()).pow(2).mean() for b in batches).div(world).backward()
        ref_optim.step()
        ref_optim.zero_grad()
        with model.summon_full_params():
            mine = [p.detach().clone() for p in model.parameters()]
        diffs.append(max_diff(mine, reference.parameters()))
    return diffs


def test_a_checkpointed_head_over_checkpointed_layer_units_trains_as_one_process(world2):
    for style in ("outside", "inside"):
        for diffs in world2.run(_train_beside_one_process_rev, style):
            assert max(diffs) < 1e-5, (style, diffs)
