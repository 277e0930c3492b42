"""Tensor-parallel corners a FairScale / Megatron user met, in one world of 2 ranks.

- The tensor-parallel layers had no ``reset_parameters()``. A model built under
  ``torch.device("meta")`` and materialized the torch way (``to_empty(device=...)``, then each
  module's ``reset_parameters()``) kept uninitialised memory in every split weight and bias,
  silently; shardkit's FSDP refused such a model. They now draw their full weight again with
  their ``init_method`` and keep their slice: the same values as an eagerly built model.
- ``vocab_parallel_cross_entropy`` made two (fp32 logits) or three (fp16/bf16 logits) fp32
  buffers of the logits shard's size in forward, the largest activation of a language model;
  it now makes one, which becomes the softmax kept for backward.
- ``RowParallelLinear`` and ``VocabParallelEmbedding`` made three and two copies of their output
  in forward (the partial result, a copy to all-reduce, the bias added or the masked copy), where
  ``nn.Linear`` and Megatron-LM make one: the partial result is now summed and completed in
  place (no backward reads it).
- At tensor-parallel size 1 (the same model code on one device, or data parallelism only), an
  in-place op on the output of ``ColumnParallelLinear(gather_output=True)``,
  ``ParallelEmbedding``, the sequence-parallel ``RowParallelLinear`` / ``VocabParallelEmbedding``
  (``nn.ReLU(inplace=True)``, ``h += residual``) raised torch's "output of a custom Function is a
  view and is being modified inplace", which size 2 does not: the mappings returned their input
  from inside an autograd function. At size 1 they now hand it back outside any.
- FairScale's and Megatron-LM's ``broadcast_data`` (``fairscale.nn.model_parallel.data``), with
  which their training loops read a batch on tensor-parallel rank 0 only and hand it to the
  group, was missing; ``shardkit.nn.model_parallel.data.broadcast_data`` provides it, and a
  bad batch on rank 0 raises on every rank instead of leaving the others waiting.
"""

import io

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.models import GPTConfig
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.gpt import TensorParallelGPT
from shardkit.testing import world_fixture
from shardkit.utils.memory import LiveStorageTracker

TP = 2

world2 = world_fixture(2)


def _setup() -> None:
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)


def _layers() -> nn.ModuleDict:
    """A GPT (fused q/k/v with stride 3, vocabulary-parallel embedding) and the layers it does
    not use: embeddings with a padding row, a kept master weight."""
    cfg = GPTConfig(vocab_size=16 * TP, n_layer=1, n_head=2 * TP, d_model=8 * TP, seq_len=4)
    return nn.ModuleDict({
        "gpt": TensorParallelGPT(cfg),
        "vocab": mp.VocabParallelEmbedding(8 * TP, 6, padding_idx=TP + 1,
                                           init_method=nn.init.normal_),
        "columns": mp.ParallelEmbedding(10, 4 * TP, padding_idx=3),
        "kept": mp.RowParallelLinear(4 * TP, 5, keep_master_weight_for_test=True)})


def _meta_model_materialized_like_torch() -> dict:
    """Differences between an eagerly built model and the same model built on ``meta``, then
    ``to_empty`` and each module's ``reset_parameters()`` after the same seed."""
    _setup()
    try:
        torch.manual_seed(0)
        eager = _layers()
        with torch.device("meta"):
            lazy = _layers()
        lazy.to_empty(device="cpu")
        params_before = [id(p) for p in lazy.parameters()]
        torch.manual_seed(0)
        without = [name for name, module in lazy.named_modules()
                   if any(True for _ in module.parameters(recurse=False))
                   and not hasattr(module, "reset_parameters")]
        for module in lazy.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        want = eager.state_dict()
        return {"without_reset": without,
                "different": [key for key, value in lazy.state_dict().items()
                              if not torch.equal(value, want[key])],
                "master_weight": torch.equal(lazy["kept"].master_weight,
                                             eager["kept"].master_weight),
                "same_parameters": params_before == [id(p) for p in lazy.parameters()],
                # the next draw: resetting consumed what constructing did
                "generator_in_step": torch.equal(torch.get_rng_state(), _state_after_eager())}
    finally:
        mp.destroy_model_parallel()


def _state_after_eager() -> torch.Tensor:
    torch.manual_seed(0)
    _layers()
    return torch.get_rng_state()


def test_a_meta_built_model_reset_like_torch_holds_the_eager_weights(world2):
    for result in world2.run(_meta_model_materialized_like_torch):
        assert result == {"without_reset": [], "different": [], "master_weight": True,
                          "same_parameters": True, "generator_in_step": True}, result


def _pickled_layers_keep_or_refuse_their_init() -> dict:
    """``torch.save`` of layers whose ``init_method`` is a module-level function or a closure
    (Megatron's ``init_method_normal(0.02)``), loaded back: does ``reset_parameters`` work?"""
    _setup()
    try:
        sigma = 0.02

        def init_normal(tensor):  # a closure, as Megatron's init_method_normal returns
            return nn.init.normal_(tensor, std=sigma)

        result = {}
        for name, init in (("function", nn.init.xavier_normal_), ("closure", init_normal)):
            layer = mp.ColumnParallelLinear(4, 2 * TP, init_method=init)
            buffer = io.BytesIO()
            torch.save(layer, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            try:
                torch.manual_seed(1)
                loaded.reset_parameters()
                torch.manual_seed(1)
                layer.reset_parameters()
                result[name] = torch.equal(loaded.weight, layer.weight)
            except RuntimeError as error:
                result[name] = str(error)
        return result
    finally:
        mp.destroy_model_parallel()


def test_pickled_layers_keep_a_picklable_init_method_and_name_a_lost_one(world2):
    for result in world2.run(_pickled_layers_keep_or_refuse_their_init):
        assert result["function"] is True, result
        assert "has no init_method" in result["closure"], result
        assert "set layer.init_method" in result["closure"], result


def _cross_entropy_forward_buffers() -> dict:
    """Per logits dtype: bytes the loss's forward allocated at its peak (beyond the logits),
    in units of one fp32 logits shard, and the largest difference from ``F.cross_entropy``."""
    _setup()
    try:
        rank = mp.get_model_parallel_rank()
        per_rank, tokens = 512, 64
        generator = torch.Generator().manual_seed(0)
        full = torch.randn(tokens, TP * per_rank, generator=generator)
        target = torch.randint(0, TP * per_rank, (tokens,), generator=generator)
        result = {}
        for dtype in (torch.float32, torch.bfloat16):
            shard = full[:, rank * per_rank:(rank + 1) * per_rank].to(dtype).requires_grad_()
            with LiveStorageTracker(sample_every_op=True) as tracker:
                before = tracker.live_bytes()
                loss = mp.vocab_parallel_cross_entropy(shard, target, label_smoothing=0.1)
                peak = tracker.peak_bytes - before
            want = F.cross_entropy(full.to(dtype).float(), target, reduction="none",
                                   label_smoothing=0.1)
            result[str(dtype)] = (peak / (tokens * per_rank * 4),
                                  (loss - want).abs().max().item())
        return result
    finally:
        mp.destroy_model_parallel()


def test_vocab_parallel_cross_entropy_forward_makes_one_shard_sized_buffer(world2):
    for result in world2.run(_cross_entropy_forward_buffers):
        for dtype, (shards, error) in result.items():
            # one fp32 shard, plus per-token vectors (max, sums, target logits: ~1%)
            assert 1.0 <= shards < 1.1, (dtype, shards)
            assert error < 1e-5, (dtype, error)


def _layer_forward_buffers() -> dict:
    """Bytes each layer's forward allocated at its peak, in units of its output's bytes (an
    ``nn.Linear`` allocates exactly its output), and whether the output is the unsplit one."""
    _setup()
    try:
        torch.manual_seed(0)
        tokens, width = 64, 32
        row = mp.RowParallelLinear(4 * width, width, input_is_parallel=True)
        embedding = mp.VocabParallelEmbedding(16 * TP, width, padding_idx=1)
        with torch.no_grad():
            row.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
        ref_row, ref_embedding = nn.Linear(4 * width, width), nn.Embedding(16 * TP, width)
        ref_row.load_state_dict(row.full_state_dict())
        ref_embedding.load_state_dict(embedding.full_state_dict())
        generator = torch.Generator().manual_seed(2)
        x = torch.randn(2, tokens // 2, 4 * width, generator=generator)
        x_local = x.chunk(TP, dim=-1)[mp.get_model_parallel_rank()].clone().requires_grad_()
        ids = torch.randint(0, 16 * TP, (2, tokens // 2), generator=generator)
        result = {}
        for name, layer, inputs, want in (("row", row, x_local, ref_row(x)),
                                          ("embedding", embedding, ids, ref_embedding(ids))):
            with LiveStorageTracker(sample_every_op=True) as tracker:
                before = tracker.live_bytes()
                out = layer(inputs)
                peak = tracker.peak_bytes - before
            out.sum().backward()
            result[name] = (peak / (out.numel() * out.element_size()),
                            (out - want).abs().max().item())
        return result
    finally:
        mp.destroy_model_parallel()


def test_row_parallel_and_vocab_embedding_forwards_make_one_output_sized_buffer(world2):
    for result in world2.run(_layer_forward_buffers):
        for name, (outputs, error) in result.items():
            assert outputs < 1.1, (name, outputs)
            assert error < 1e-5, (name, error)


def _in_place_ops_on_outputs_at_size_1() -> dict:
    """Per layer at tensor-parallel size 1: its weight gradient after ``out.mul_(2)``, over the
    one without the in-place op (2.0 expected), or the error the in-place op raised."""
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(1)  # each rank alone; data parallelism over the world
    try:
        torch.manual_seed(0)
        x = torch.randn(2, 4, 8)
        ids = torch.randint(0, 8, (2, 4))
        cases = {
            "gathered columns": (mp.ColumnParallelLinear(8, 8, gather_output=True), x),
            "sequence-parallel rows": (mp.RowParallelLinear(8, 8, input_is_parallel=True,
                                                            sequence_parallel=True), x),
            "sequence-parallel vocabulary": (mp.VocabParallelEmbedding(
                8, 8, sequence_parallel=True), ids),
            "column embedding": (mp.ParallelEmbedding(8, 8), ids)}
        result = {}
        for name, (layer, inputs) in cases.items():
            layer(inputs).sum().backward()
            plain = layer.weight.grad.clone()
            layer.zero_grad()
            try:
                layer(inputs).mul_(2).sum().backward()
            except RuntimeError as error:
                result[name] = str(error)[:80]
                continue
            result[name] = (layer.weight.grad / plain).nan_to_num(2.0).unique().tolist()
        return result
    finally:
        mp.destroy_model_parallel()


def test_in_place_ops_on_layer_outputs_work_at_tensor_parallel_size_1(world2):
    for result in world2.run(_in_place_ops_on_outputs_at_size_1):
        assert result == dict.fromkeys(result, [2.0]) and len(result) == 4, result


def _broadcast_a_batch_read_on_rank_0() -> list:
    """What every rank receives of a batch that only tensor-parallel rank 0 read, then the
    errors of two bad batches on rank 0 (a wrong dtype, a missing key)."""
    from shardkit.nn.model_parallel.data import broadcast_data
    _setup()
    try:
        source = mp.get_model_parallel_rank() == 0
        batch = {"text": torch.arange(10).view(2, 5), "labels": torch.tensor([7, 8, 9])}
        got = broadcast_data(["text", "labels"], batch if source else None, torch.int64)
        result = [{key: (value.tolist(), value.dtype) for key, value in got.items()}]
        for bad in ({"text": batch["text"].int(), "labels": batch["labels"]},
                    {"text": batch["text"]}):
            try:
                broadcast_data(["text", "labels"], bad if source else None, torch.int64)
                result.append("no error")
            except (KeyError, TypeError) as error:
                result.append(f"{type(error).__name__}: {error}")
        return result
    finally:
        mp.destroy_model_parallel()


def test_broadcast_data_hands_rank_0s_batch_to_the_group_and_its_errors_too(world2):
    for got, wrong_dtype, missing in world2.run(_broadcast_a_batch_read_on_rank_0):
        assert got == {"text": ([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], torch.int64),
                       "labels": ([7, 8, 9], torch.int64)}, got
        assert wrong_dtype.startswith("TypeError: broadcast_data: tensor-parallel rank 0's "
                                      "data ['text'] has dtype torch.int32"), wrong_dtype
        assert missing.startswith("KeyError") and "missing key(s) ['labels']" in missing, missing
