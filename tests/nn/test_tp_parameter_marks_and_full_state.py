"""Tensor-parallel corners found by helper tp65, in one world of 2 gloo ranks.

The marks the tensor-parallel layers put on their parameters (``tensor_model_parallel``,
``model_parallel_groups``, a sequence-parallel bias's ``sequence_parallel``), and the
``sequence_parallel`` mark of a LayerNorm (``mark_sequence_parallel``), were attributes of the
parameter objects only, and torch replaces those objects without them: ``to_empty`` of a model
built under ``torch.device("meta")`` (the documented way to materialise one), ``.to()`` under
``torch.__future__.set_swap_module_params_on_conversion(True)``, ``load_state_dict(sd,
assign=True)`` into a meta-built model, and ``copy.deepcopy`` of a plain module holding a marked
LayerNorm. ``clip_grad_norm`` then counted every split slice on
tensor-parallel rank 0 only (a wrong norm, the same on every rank), and
``reduce_sequence_parallel_grads`` summed nothing: the row-parallel bias and the LayerNorm
kept each rank's partial gradient, and their replicas trained apart. Silently, in each case.

``load_full_model_state_dict`` into a model built on ``meta`` loaded nothing (torch's warning
only; the first forward failed on meta tensors). It now takes torch's ``assign=True``, giving
the parameters this rank's slices with their marks, and without it is a ``ValueError`` naming
the fix.

A model's own split layer, its weight marked as Megatron marks one (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``: the marks ``clip_grad_norm`` and the data-parallel
wrappers already honour), was taken for a replicated one by the full-state helpers:
``full_model_state_dict`` exported rank 0's slice as the unsplit weight,
``load_full_model_state_dict`` loaded that slice on every rank, and ``sync_module_states``
overwrote each rank's slice with rank 0's. Silently. They now join, split and keep its slices
(a mark without ``partition_dim`` is a ``ValueError`` naming it).
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.models import GPTConfig
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.full_state import (
    full_model_state_dict, load_full_model_state_dict, split_specs, sync_module_states)
from shardkit.nn.model_parallel.gpt import TensorParallelGPT
from shardkit.nn.model_parallel.utils import shard_of
from shardkit.testing import world_fixture

TP, WIDTH, SEQ = 2, 8, 4
WAYS = ("meta", "assign", "deepcopy", "swapped")  # of getting the block; see _built
world2 = world_fixture(2)


class _SequenceParallelBlock(nn.Module):
    """A user's Megatron-style block: a plain module around a marked LayerNorm and the
    sequence-parallel column -> row pair."""

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        mp.mark_sequence_parallel(self.ln)
        self.fc = mp.ColumnParallelLinear(WIDTH, 2 * WIDTH, gather_output=False,
                                          sequence_parallel=True)
        self.out = mp.RowParallelLinear(2 * WIDTH, WIDTH, input_is_parallel=True,
                                        sequence_parallel=True)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


def _built(where: str) -> nn.Module:
    """The block as eagerly built, or built on ``meta`` and materialised one of the torch ways
    (``to_empty`` and ``reset_parameters()``, ``load_state_dict(assign=True)``), or
    deep-copied, or converted with swapped parameters; the same values in each case."""
    torch.manual_seed(0)
    if where == "eager":
        return _SequenceParallelBlock()
    if where == "deepcopy":
        return copy.deepcopy(_SequenceParallelBlock())
    if where == "swapped":
        block = _SequenceParallelBlock()
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return block.double().float()
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
    if where == "assign":
        state = _SequenceParallelBlock().state_dict()
        with torch.device("meta"):
            block = _SequenceParallelBlock()
        block.load_state_dict(state, assign=True)
        return block
    with torch.device("meta"):
        block = _SequenceParallelBlock()
    block.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in block.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return block


def _marks(model: nn.Module) -> dict:
    return {name: sorted(k for k in p.__dict__ if not k.startswith("_"))
            for name, p in model.named_parameters()}


def _one_step(model: nn.Module, rank: int) -> dict:
    """Gradients (sequence-parallel ones summed) and the clipped norm of one backward, then
    the parameters after an SGD step; the gradients as this rank holds them."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, SEQ, WIDTH, generator=gen).chunk(TP, dim=1)[rank]
    model(x).pow(2).sum().backward()
    mp.reduce_sequence_parallel_grads(model)
    norm = mp.clip_grad_norm(model.parameters(), max_norm=0.5)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return {"norm": norm.item(), "grads": grads,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def _marks_and_training_after_replacement() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        rank = mp.get_model_parallel_rank()
        eager = _built("eager")
        want, want_marks = _one_step(eager, rank), _marks(eager)
        out = {}
        for where in WAYS:
            model = _built(where)
            # marks as reduce_sequence_parallel_grads left them (it marks a LayerNorm that
            # mark_sequence_parallel marked whole again; the layers' own keep theirs)
            got = _one_step(model, rank)
            got_marks = _marks(model)
            out[where] = {
                "marks": got_marks == want_marks or got_marks,
                "norm": abs(got["norm"] - want["norm"]) < 1e-5 or (got["norm"], want["norm"]),
                "grads": max((got["grads"][k] - v).abs().max().item()
                             for k, v in want["grads"].items()) < 1e-5,
                "params": max((got["params"][k] - v).abs().max().item()
                              for k, v in want["params"].items()) < 1e-5}
        cfg = GPTConfig(vocab_size=8, seq_len=4, d_model=8, n_head=2, n_layer=1, dropout=0.0,
                        tie_weights=False)
        torch.manual_seed(0)
        gpt_marks = _marks(TensorParallelGPT(cfg, sequence_parallel=True))
        with torch.device("meta"):
            lazy_gpt = TensorParallelGPT(cfg, sequence_parallel=True)
        out["gpt_meta_marks"] = _marks(lazy_gpt.to_empty(device="cpu")) == gpt_marks
        # the bias's parameter object carried its marks through to_empty, not only its name
        out["sequence_parallel_bias"] = getattr(lazy_gpt[1].out.bias, "sequence_parallel", False)
        return out
    finally:
        mp.destroy_model_parallel()


def test_parameter_marks_survive_to_empty_deepcopy_and_swapped_conversion(world2):
    expected = {where: {"marks": True, "norm": True, "grads": True, "params": True}
                for where in WAYS}
    expected.update(gpt_meta_marks=True, sequence_parallel_bias=True)
    for result in world2.run(_marks_and_training_after_replacement):
        assert result == expected, result


def _unsplit_state_into_a_meta_built_model() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        rank = mp.get_model_parallel_rank()
        eager = _built("eager")
        full = full_model_state_dict(eager)
        want, want_marks = _one_step(eager, rank), _marks(eager)
        with torch.device("meta"):
            lazy = _SequenceParallelBlock()
        try:
            load_full_model_state_dict(lazy, full)
            refused = "loaded"
        except ValueError as error:
            refused = str(error)
        load_full_model_state_dict(lazy, full, assign=True)
        got = _one_step(lazy, rank)
        return {"refused": refused,
                "marks": _marks(lazy) == want_marks,
                "norm": abs(got["norm"] - want["norm"]) < 1e-5,
                "params": max((got["params"][k] - v).abs().max().item()
                              for k, v in want["params"].items()) < 1e-5}
    finally:
        mp.destroy_model_parallel()


def test_unsplit_state_loads_into_a_meta_built_model_with_assign(world2):
    for result in world2.run(_unsplit_state_into_a_meta_built_model):
        refused = result.pop("refused")
        assert "meta tensors" in refused and "assign=True" in refused, refused
        assert result == {"marks": True, "norm": True, "params": True}, result


class _OwnColumnLinear(nn.Module):
    """A model's own column-split linear layer (no tensor-parallel base class), its weight
    marked as Megatron's ``set_tensor_model_parallel_attributes`` marks one."""

    def __init__(self, full_weight: torch.Tensor, partition_dim=0):
        super().__init__()
        rank, size = mp.get_model_parallel_rank(), mp.get_model_parallel_world_size()
        self.weight = nn.Parameter(shard_of(full_weight, rank, size, 0))
        self.weight.tensor_model_parallel = True
        if partition_dim is not None:
            self.weight.partition_dim, self.weight.partition_stride = partition_dim, 1

    def forward(self, x):
        y = F.linear(mp.copy_to_model_parallel_region(x), self.weight)
        return mp.gather_from_model_parallel_region(y)


def _own_split_layer_in_the_full_state_helpers() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        rank = mp.get_model_parallel_rank()
        full_weight = torch.randn(2 * WIDTH, WIDTH, generator=torch.Generator().manual_seed(5))
        model = nn.Sequential(_OwnColumnLinear(full_weight), nn.LayerNorm(2 * WIDTH))
        state = full_model_state_dict(model)
        fresh = nn.Sequential(_OwnColumnLinear(torch.zeros_like(full_weight)),
                              nn.LayerNorm(2 * WIDTH))
        load_full_model_state_dict(fresh, state)
        torch.manual_seed(rank)  # ranks seeded apart: the LayerNorm differs, the slices too
        synced = nn.Sequential(_OwnColumnLinear(full_weight), nn.LayerNorm(2 * WIDTH))
        with torch.no_grad():
            synced[1].weight.normal_()
        sync_module_states(synced)
        try:
            full_model_state_dict(nn.Sequential(_OwnColumnLinear(full_weight, None)))
            refused = "exported"
        except ValueError as error:
            refused = str(error)
        return {"exported": torch.equal(state["0.weight"], full_weight),
                "loaded": torch.equal(fresh[0].weight, shard_of(full_weight, rank, TP, 0)),
                "specs": split_specs(model),
                "synced_slice": torch.equal(synced[0].weight, shard_of(full_weight, rank, TP, 0)),
                "synced_norm": synced[1].weight.detach().clone(),
                "refused": refused}
    finally:
        mp.destroy_model_parallel()


def test_own_split_layer_marked_as_megatron_does_joins_splits_and_keeps_its_slices(world2):
    results = world2.run(_own_split_layer_in_the_full_state_helpers)
    for result in results:
        assert {k: result[k] for k in ("exported", "loaded", "specs", "synced_slice")} == {
            "exported": True, "loaded": True, "specs": {"0.weight": (0, 1)},
            "synced_slice": True}, result
        assert "'0.weight'" in result["refused"] and "partition_dim" in result["refused"], \
            result["refused"]
    # the replicated LayerNorm still takes tensor-parallel rank 0's values
    assert torch.equal(results[0]["synced_norm"], results[1]["synced_norm"])
