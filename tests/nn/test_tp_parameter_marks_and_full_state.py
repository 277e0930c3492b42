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

From a review:

Review of the parameter marks that survive replacement (helper revtp65), in one world of 2
gloo ranks (tensor-parallel size 2).

``sequence_parallel_parameters`` marked again, by name, every parameter of a module that
``mark_sequence_parallel`` had marked whole, even one the user had since set
``sequence_parallel = False`` (as Megatron sets the attribute per parameter): its gradient was
then summed over the tensor-parallel group, silently ``n`` times too large. Only a parameter
lacking the attribute (a replacement) is marked again now.

``KeepsParameterMarks`` handed every attribute of a replaced parameter to its replacement,
tensors included: Megatron's ``main_grad`` of a meta-built layer stayed a ``meta`` tensor on the
materialised parameter after ``to_empty``, and a swapped ``.double()`` kept the old float32
buffer alive on the new parameter. Only marks (non-tensor attributes) travel now.

``load_full_model_state_dict(model, sd, assign=True)`` into a meta-built model whose own split
layer carries Megatron's marks (``tensor_model_parallel``, ``partition_dim``) gave it new
parameters without them: ``full_model_state_dict`` then exported rank 0's slice as the whole
weight and clipping counted it on one rank only, silently. The marks are kept now.

A parameter that a subclass of a tensor-parallel layer adds and marks as Megatron does was taken
for a replicated one by the full-state helpers (only the layer's listed ``_shard_dims`` were
read): each rank exported its own slice as the whole tensor. It is joined now.
"""

import copy
import gc
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.models import GPTConfig
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.full_state import (full_model_state_dict,
                                                   load_full_model_state_dict, split_specs,
                                                   sync_module_states)
from shardkit.nn.model_parallel.gpt import TensorParallelGPT
from shardkit.nn.model_parallel.sequence_parallel import sequence_parallel_parameters
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


TP = 2


def _unmarked_parameter_stays_unmarked() -> dict:
    """A LayerNorm marked whole, its bias unmarked afterwards: the parameters found, and the
    gradients after ``reduce_sequence_parallel_grads`` (each rank's grads are ``rank + 1``)."""
    mp.initialize_model_parallel(TP)
    try:
        rank = mp.get_model_parallel_rank()
        block = nn.Sequential(nn.LayerNorm(4), mp.ColumnParallelLinear(4, 8, gather_output=False))
        mp.mark_sequence_parallel(block[0])
        block[0].bias.sequence_parallel = False
        found = [name for name, p in block.named_parameters()
                 if any(p is q for q in sequence_parallel_parameters(block))]
        for p in block.parameters():
            p.grad = torch.full_like(p, rank + 1.0)
        mp.reduce_sequence_parallel_grads(block)
        return {"found": found, "bias_mark": block[0].bias.sequence_parallel,
                "weight_grad": block[0].weight.grad[0].item(),
                "bias_grad": block[0].bias.grad[0].item(), "rank": rank}
    finally:
        mp.destroy_model_parallel()


def test_parameter_unmarked_after_mark_sequence_parallel_is_not_summed(world2):
    for result in world2.run(_unmarked_parameter_stays_unmarked):
        assert result["found"] == ["0.weight"], result
        assert result["bias_mark"] is False, result
        assert result["weight_grad"] == 1.0 + 2.0, result  # summed over the two ranks
        assert result["bias_grad"] == result["rank"] + 1.0, result  # this rank's own


def _tensor_attributes_stay_with_the_old_parameter() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        with torch.device("meta"):
            lazy = mp.ColumnParallelLinear(4, 8, gather_output=False)
        lazy.weight.main_grad = torch.empty_like(lazy.weight)  # meta, like the weight
        lazy.to_empty(device="cpu")
        eager = mp.RowParallelLinear(8, 4, input_is_parallel=True, sequence_parallel=True)
        eager.weight.main_grad = torch.zeros(eager.weight.shape)
        old_buffer = weakref.ref(eager.weight.main_grad)
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            eager.double()
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)
        gc.collect()
        return {"meta_main_grad_on_materialised": hasattr(lazy.weight, "main_grad"),
                "lazy_marks": (lazy.weight.tensor_model_parallel,
                               lazy.weight.model_parallel_groups is not None),
                "old_buffer_alive": old_buffer() is not None,
                "swapped_marks": (eager.weight.tensor_model_parallel,
                                  eager.bias.sequence_parallel)}
    finally:
        mp.destroy_model_parallel()


def test_tensor_attributes_are_not_handed_to_replaced_parameters(world2):
    for result in world2.run(_tensor_attributes_stay_with_the_old_parameter):
        assert result == {"meta_main_grad_on_materialised": False, "lazy_marks": (True, True),
                          "old_buffer_alive": False, "swapped_marks": (True, True)}, result


class _OwnColumnLinear_rev(nn.Module):
    """A model's own column-split linear layer, marked as Megatron marks one."""

    def __init__(self, full_weight: torch.Tensor):
        super().__init__()
        rank = mp.get_model_parallel_rank()
        self.weight = nn.Parameter(shard_of(full_weight, rank, TP, 0))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim, self.weight.partition_stride = 0, 1

    def forward(self, x):
        y = F.linear(mp.copy_to_model_parallel_region(x), self.weight)
        return mp.gather_from_model_parallel_region(y)


def _own_split_layer_loaded_with_assign_into_a_meta_model() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        full_weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
        eager = nn.Sequential(_OwnColumnLinear_rev(full_weight), nn.LayerNorm(8))
        state = full_model_state_dict(eager)
        with torch.device("meta"):
            lazy = nn.Sequential(_OwnColumnLinear_rev(full_weight), nn.LayerNorm(8))
        load_full_model_state_dict(lazy, state, assign=True)
        norms = []
        for model in (eager, lazy):
            (model(torch.ones(2, 4)) * torch.arange(8.0)).sum().backward()
            norms.append(mp.clip_grad_norm(model.parameters(), max_norm=1e9).item())
        return {"specs": split_specs(lazy),
                "exported": torch.equal(full_model_state_dict(lazy)["0.weight"], full_weight),
                "norms_match": abs(norms[0] - norms[1]) <= 1e-6 * norms[0]}
    finally:
        mp.destroy_model_parallel()


def test_assign_load_into_meta_model_keeps_megatron_marks_of_own_split_layer(world2):
    for result in world2.run(_own_split_layer_loaded_with_assign_into_a_meta_model):
        assert result == {"specs": {"0.weight": (0, 1)}, "exported": True,
                          "norms_match": True}, result


class _ScaledColumnLinear(mp.ColumnParallelLinear):
    """A user's column-parallel layer with an extra output scale, split and marked as Megatron
    marks one; rank ``r`` holds ``r`` in its slice."""

    def __init__(self):
        super().__init__(4, 8, gather_output=False)
        self.scale = nn.Parameter(torch.full((4,), float(mp.get_model_parallel_rank())))
        self.scale.tensor_model_parallel = True
        self.scale.partition_dim = 0


def _extra_marked_parameter_of_a_layer_subclass() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        layer = _ScaledColumnLinear()
        return {"specs": split_specs(layer),
                "scale": full_model_state_dict(layer)["scale"].tolist()}
    finally:
        mp.destroy_model_parallel()


def test_extra_marked_parameter_of_a_layer_subclass_is_joined(world2):
    for result in world2.run(_extra_marked_parameter_of_a_layer_subclass):
        assert result == {"specs": {"weight": (0, 1), "bias": (0, 1), "scale": (0, 1)},
                          "scale": [0.0] * 4 + [1.0] * 4}, result


class _TiedHead(nn.Module):
    """A GPT's output head reusing the token embedding's weight (Megatron's tied embedding),
    the last layer of an ``nn.Sequential`` that a pipeline cuts away from the embedding."""

    def __init__(self, embedding: mp.VocabParallelEmbedding):
        super().__init__()
        self.weight = embedding.weight

    def forward(self, h):
        return F.linear(mp.copy_to_model_parallel_region(h), self.weight)


def _tied_head_in_a_stage_of_its_own() -> dict:
    from shardkit.nn.pipe import split_sequential

    mp.initialize_model_parallel(TP)
    try:
        torch.manual_seed(0)
        embedding = mp.VocabParallelEmbedding(16, WIDTH)
        whole = embedding.full_weight()
        _, last = split_sequential(nn.Sequential(embedding, _TiedHead(embedding)), [1, 1])
        out = {"specs": split_specs(last),
               "fused_qkv_marks": [(p.partition_dim, p.partition_stride) for p in
                                   mp.ColumnParallelLinear(WIDTH, 3 * WIDTH, stride=3,
                                                           gather_output=False).parameters()]}
        exported = full_model_state_dict(last)
        out["exported"] = torch.equal(exported["1.weight"], whole)
        load_full_model_state_dict(last, {"1.weight": whole + 1.0})
        out["loaded"] = torch.equal(embedding.weight,
                                    shard_of(whole + 1.0, mp.get_model_parallel_rank(), TP, 0, 1))
        return out
    finally:
        mp.destroy_model_parallel()


def test_tied_copy_of_a_split_weight_in_another_stage_is_joined_and_split(world2):
    # The last pipeline stage holds the head alone, not the embedding layer: the tied weight
    # raised "marked tensor_model_parallel=True ... with partition_dim=None" in every
    # full-state helper, as the layers set only tensor_model_parallel of Megatron's marks.
    for result in world2.run(_tied_head_in_a_stage_of_its_own):
        assert result == {"specs": {"1.weight": (0, 1)},
                          "fused_qkv_marks": [(0, 3), (0, 3)],
                          "exported": True, "loaded": True}, result
