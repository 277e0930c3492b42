"""FSDP units whose own code reads their parameters only inside reentrant activation
checkpoints (``checkpoint(lambda t: F.linear(t, self.weight), x, use_reentrant=True)``, twice
in one forward): the first checkpoint's backward reduces and frees a unit that reshards after
forward; the second checkpoint's recomputation, which calls no module holding the parameters,
read this rank's row shard (a shape error, or wrong numbers where a one-row parameter
broadcast). Training matches one process at every step, and the unit is gathered only around
each recomputation.

From a review:

FSDP units whose parameters are read only inside two reentrant activation checkpoints,
beyond torch's checkpoint over the wrapped module's own parameters: regions of
``shardkit.checkpointing.checkpoint`` (its own autograd function, which the regather before
each later recomputation did not recognise: silently wrong training), and a plain
submodule's parameters read without calling it (``F.linear(t, self.sub.weight)``), in a unit
whose module holds no parameter itself (a shape error: the second recomputation read this
rank's shard). Training matches one process for three steps and the unit is freed after
each backward.

From a second review:

From a review of the regather before reentrant recomputations (8a32725, 657629e):

a unit that stays gathered from forward to backward (the root, ``reshard_after_forward=False``)
whose parameters sit in plain submodules and are read only inside reentrant activation
checkpoints (a model wrapped as one unit under ``gradient_checkpointing_enable(use_reentrant=
True)``, its embedding frozen) was freed after each checkpoint's backward and all-gathered
whole again before the next recomputation: one all-gather of the whole unit per checkpoint,
quadratic in depth for a model wrapped as one unit, for memory the unit keeps anyway. Like a
unit holding its parameters itself, it now stays exposed until the end of backward: no
all-gather in backward, training as one process, freed after each backward.

A unit whose own code nests a reentrant checkpoint inside another (``checkpoint(self.outer,
x)``, ``outer`` calling ``checkpoint(self.inner, t * self.scale)``) was freed as the inner
checkpoint's backward ended, while the outer one still held views of its parameters
(``self.scale``): the process died (a segfault) on every rank. It is now freed as the outer
checkpoint's backward ends, and trains as one process.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint as torch_checkpoint

import shardkit.checkpointing as sk_checkpointing
from shardkit import distributed as skdist
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

world2 = world_fixture(2)


class TwoCheckpointBlock(nn.Module):
    """Holds its parameters itself and reads them only inside two reentrant checkpoints; the
    one-row ``scale`` broadcasts, so a rank reading its shard of it computes silently."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.scale = nn.Parameter(torch.rand(1, 4) + 0.5)
        self.lin = nn.Linear(4, 4)

    def first(self, t):
        return torch.tanh(t * self.scale)

    def second(self, t):
        return torch.tanh(F.linear(t, self.weight) + self.lin(t))

    def forward(self, x):
        h = checkpoint(self.first, x, use_reentrant=True)
        return checkpoint(self.second, h, use_reentrant=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.block = TwoCheckpointBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


def _train_against_one_process(root_kwargs: dict) -> dict:
    reference, net = Net(), Net()
    net.block = FSDP(net.block)
    model = FSDP(net, **root_kwargs)
    return _three_steps_beside_one_process(reference, model, model.block)


def _three_steps_beside_one_process(reference: nn.Module, model: FSDP, unit: FSDP,
                                    lr: float = 0.1) -> dict:
    """Three SGD steps of ``model`` (FSDP) and of ``reference`` on the whole batch (inputs that
    require grad, as a reentrant checkpoint on the input needs): the largest difference of the
    weights after each, the all-gathers run inside each backward, and whether ``unit`` stayed
    gathered after each backward (or the backward's error)."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=lr)
    out = {"diffs": [], "gathers_in_backward": [], "gathered_after_backward": []}
    for step in range(3):
        batches = torch.randn(world, 3, 4, generator=torch.Generator().manual_seed(step))
        optim.zero_grad()
        ref_optim.zero_grad()
        try:
            loss = model(batches[rank].requires_grad_()).pow(2).sum()
            with skdist.CommCounter() as comm:
                loss.backward()
        except RuntimeError as error:
            out["error"] = str(error)
            return out
        out["gathers_in_backward"].append(sum(n for op, n in comm.calls_by_op.items()
                                              if "gather" in op))
        out["gathered_after_backward"].append(unit._shard.gathered)
        optim.step()
        sum(reference(b.requires_grad_()).pow(2).sum() for b in batches).div(world).backward()
        ref_optim.step()
        with model.summon_full_params():
            mine = [p.detach().clone() for p in model.parameters()]
        out["diffs"].append(max_diff(mine, reference.parameters()))
    return out


def test_reentrant_checkpoints_reading_a_units_own_parameters_train_as_one_process(world2):
    for root_kwargs in ({}, {"disable_reshard_on_root": False}):
        for r in world2.run(_train_against_one_process, root_kwargs):
            assert "error" not in r, (root_kwargs, r)
            assert max(r["diffs"]) < 1e-6, (root_kwargs, r)
            assert r["gathered_after_backward"] == [False] * 3, (root_kwargs, r)


def _replace_grads_between_micro_batches(zero_grad_each_step: bool) -> dict:
    """Two steps of a two-micro-batch cycle (the first inside ``no_sync``) under ``NO_SHARD``,
    ``p.grad = p.grad * 0.5`` between the micro-batches, against one process doing the same
    to its accumulated ``.grad``; without ``zero_grad`` the cycle starts from the last step's
    reduced ``.grad``."""
    world, rank = skdist.get_world_size(), skdist.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
                 sharding_strategy="NO_SHARD")
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    diffs = []
    for step in range(2):
        batches = torch.randn(2, world, 3, 4, generator=torch.Generator().manual_seed(step))
        if zero_grad_each_step:
            optim.zero_grad()
            ref_optim.zero_grad()
        with model.no_sync():
            model(batches[0, rank]).pow(2).sum().backward()
        sum(reference(b).pow(2).sum() for b in batches[0]).div(world).backward()
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = p.grad * 0.5
        model(batches[1, rank]).pow(2).sum().backward()
        sum(reference(b).pow(2).sum() for b in batches[1]).div(world).backward()
        diffs.append(max((a.grad - b.grad).abs().max().item()
                         for a, b in zip(model.parameters(), reference.parameters())))
        optim.step()
        ref_optim.step()
    return {"diffs": diffs}


def test_grads_replaced_between_micro_batches_reach_the_reduction(world2):
    for zero_grad_each_step in (True, False):
        for r in world2.run(_replace_grads_between_micro_batches, zero_grad_each_step):
            assert max(r["diffs"]) < 1e-5, (zero_grad_each_step, r)


def _reentrant(kind: str, function, x):
    if kind == "torch":
        return torch_checkpoint(function, x, use_reentrant=True)
    return sk_checkpointing.checkpoint(function, x)


class OwnParameters(nn.Module):
    """Reads its own parameters in two checkpoints; the one-row ``scale`` broadcasts, so a
    rank reading its shard of it computes silently."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.scale = nn.Parameter(torch.rand(1, 4) + 0.5)

    def forward(self, x):
        h = _reentrant(self.kind, lambda t: torch.tanh(t * self.scale), x)
        return _reentrant(self.kind, lambda t: torch.tanh(F.linear(t, self.weight) + t), h)


class SubmoduleParameters(nn.Module):
    """Holds no parameter itself: reads those of ``sub`` in two checkpoints without
    calling it."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.sub = nn.Linear(4, 4)

    def forward(self, x):
        h = _reentrant(self.kind, lambda t: torch.tanh(t * self.sub.bias.view(1, 4)), x)
        return _reentrant(self.kind, lambda t: torch.tanh(F.linear(t, self.sub.weight) + t), h)


class BlockNet(nn.Module):
    """``bare``: the block alone (its parameters the only ones, read only in the checkpoints:
    the root that stays gathered releases them after the first checkpoint's backward)."""

    def __init__(self, block: type, kind: str, bare: bool):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Identity() if bare else nn.Linear(4, 4)
        self.block = block(kind)
        self.head = nn.Identity() if bare else nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


def _train_block_against_one_process(block_name: str, kind: str, wrap_block: bool) -> dict:
    """Three SGD steps of ``BlockNet`` (its block an FSDP unit of its own, or alone in the root that
    stays gathered) against one process on the whole batch."""
    block = {"own": OwnParameters, "submodule": SubmoduleParameters}[block_name]
    bare = not wrap_block
    reference, net = BlockNet(block, kind, bare), BlockNet(block, kind, bare)
    if wrap_block:
        net.block = FSDP(net.block)
    model = FSDP(net)
    unit = net.block if wrap_block else model
    return _three_steps_beside_one_process(reference, model, unit)


def _check_trains_as_one_process(world, case: tuple) -> None:
    for r in world.run(_train_block_against_one_process, *case):
        assert "error" not in r, (case, r)
        assert max(r["diffs"]) < 1e-6, (case, r)
        assert r["gathered_after_backward"] == [False] * 3, (case, r)


def test_shardkit_reentrant_checkpoints_reading_a_units_parameters_train_as_one_process(world2):
    for case in (("own", "shardkit", True), ("submodule", "shardkit", True),
                 ("submodule", "shardkit", False)):
        _check_trains_as_one_process(world2, case)


def test_a_submodules_parameters_read_without_calling_it_train_as_one_process(world2):
    _check_trains_as_one_process(world2, ("submodule", "torch", True))


DEPTH = 4


class Layer(nn.Module):
    """A plain layer whose parameters its parent reads without calling it; the one-row
    ``scale`` broadcasts, so a rank reading its shard of it computes silently."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.scale = nn.Parameter(torch.rand(1, 4) + 0.5)


class CheckpointedLayers(nn.Module):
    """Holds no parameter itself; reads each layer's parameters in a reentrant checkpoint of
    its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = checkpoint(lambda t, own=layer: torch.tanh(F.linear(t, own.weight) * own.scale) + t,
                           x, use_reentrant=True)
        return x


class NestedCheckpoints(nn.Module):
    """Reads ``scale`` in an outer reentrant checkpoint and ``weight`` in one nested in it,
    twice."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.scale = nn.Parameter(torch.rand(1, 4) + 0.5)

    def inner(self, t):
        return torch.tanh(F.linear(t, self.weight))

    def outer(self, t):
        return checkpoint(self.inner, t * self.scale, use_reentrant=True) + t

    def forward(self, x):
        return checkpoint(self.outer, checkpoint(self.outer, x, use_reentrant=True),
                          use_reentrant=True)


class NestedInBlock(nn.Module):
    """``NestedCheckpoints`` as the block of a root holding the layers around it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.block = NestedCheckpoints()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x)))


def _nested_model(root_kwargs: dict) -> tuple:
    net = NestedInBlock()
    net.block = FSDP(net.block)
    return NestedInBlock(), FSDP(net, **root_kwargs), net.block


def _kept_gathered_model(unit_kwargs: dict) -> tuple:
    model = FSDP(CheckpointedLayers(), **unit_kwargs)
    return CheckpointedLayers(), model, model


def _train_built_against_one_process(build: str, kwargs: dict) -> dict:
    """:func:`_three_steps_beside_one_process` of a model ``build`` names."""
    builder = {"kept gathered": _kept_gathered_model, "nested": _nested_model}[build]
    return _three_steps_beside_one_process(*builder(kwargs), lr=0.05)


def test_a_kept_gathered_unit_read_only_in_checkpoints_is_not_gathered_again(world2):
    for unit_kwargs in ({}, {"reshard_after_forward": False}):
        for r in world2.run(_train_built_against_one_process, "kept gathered", unit_kwargs):
            assert max(r["diffs"]) < 1e-6, (unit_kwargs, r)
            assert r["gathers_in_backward"] == [0] * 3, (unit_kwargs, r)
            assert r["gathered_after_backward"] == [False] * 3, (unit_kwargs, r)


def test_a_checkpoint_nested_in_a_checkpoint_trains_as_one_process(world2):
    for root_kwargs in ({}, {"disable_reshard_on_root": False}):
        for r in world2.run(_train_built_against_one_process, "nested", root_kwargs):
            assert max(r["diffs"]) < 1e-6, (root_kwargs, r)
            assert r["gathered_after_backward"] == [False] * 3, (root_kwargs, r)
