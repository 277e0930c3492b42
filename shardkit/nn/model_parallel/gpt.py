"""A small GPT written with tensor-parallel layers: shardkit's reference GPT, Megatron-split.

Same architecture and parameter shapes (unsplit) as :class:`shardkit.models.GPT`, laid out as an
``nn.Sequential`` of ``[GPTEmbedding, TensorParallelBlock x n_layer, GPTHead]`` so that pipeline
stages can cut it anywhere. Per block: the fused q/k/v projection and the first MLP linear are
column-parallel, the attention output and the second MLP linear row-parallel, so a block costs
exactly two all-reduces of the activation (``[batch, seq, d_model]``) forward and two backward
(with ``sequence_parallel``: two all-gathers + two reduce-scatters each way, the same bytes),
plus, forward in the collective debug mode only, each layer's agreement on its input's shape
(four control all-gathers of 16 int64s per rank, not counted by ``CommCounter``; see
:mod:`.layers`). The embedding is
vocabulary-parallel and the head column-parallel without gathering: the loss is
:func:`vocab_parallel_cross_entropy`, so the ``[tokens, vocab]`` logits never exist whole.

Memory per rank: the linear and embedding weights ``1/n``; LayerNorms, biases of row-parallel
layers and the position embedding replicated.

Usage::

    from shardkit.models import GPT, GPTConfig
    from shardkit.nn.model_parallel import initialize_model_parallel
    from shardkit.nn.model_parallel.full_state import load_full_model_state_dict
    from shardkit.nn.model_parallel.gpt import TensorParallelGPT, from_reference_state_dict

    initialize_model_parallel(2)
    cfg = GPTConfig(...)
    model = TensorParallelGPT(cfg)
    load_full_model_state_dict(model, from_reference_state_dict(GPT(cfg).state_dict(), cfg))
    loss = model.loss(idx, target)
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.models import GPTConfig
from shardkit.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardkit.nn.model_parallel.initialize import get_model_parallel_world_size
from shardkit.nn.model_parallel.layers import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    deepcopy_keeping_parameter_marks)
from shardkit.nn.model_parallel.parameter_marks import KeepsParameterMarks
from shardkit.nn.model_parallel.random import MODEL_PARALLEL_RNG, get_model_parallel_rng_tracker
from shardkit.nn.model_parallel.sequence_parallel import (
    mark_sequence_parallel, reduce_sequence_parallel_grads)
from shardkit.nn.model_parallel.utils import divide

__all__ = ["TensorParallelGPT", "TensorParallelBlock", "TensorParallelAttention", "GPTEmbedding",
           "GPTHead", "from_reference_state_dict", "to_reference_state_dict", "gpt_loss"]

SEQ = 1  # activations are [batch, seq, d_model]


def _check_sharded_dropout_rng(what: str, p: float, training: bool, tp: int) -> None:
    """Raise a clear error unless dropout ``p`` on shards of a tensor-parallel size ``tp`` can
    draw from the model-parallel stream (drawing from the default stream, seeded alike on every
    rank, would repeat one mask on every shard). No communication."""
    if (training and p > 0 and tp > 1
            and MODEL_PARALLEL_RNG not in get_model_parallel_rng_tracker().names()):
        raise RuntimeError(
            f"{what}: dropout={p} in training at tensor-parallel size {tp} needs the "
            f"model-parallel RNG stream (a different dropout mask on each shard): call "
            f"shardkit.nn.model_parallel.model_parallel_manual_seed(seed) on every rank after "
            f"initialize_model_parallel, or use dropout=0 / model.eval()")


def _sharded_dropout_rng(what: str, p: float, tp: int):
    """The context for dropout ``p`` (0: none) on activations that differ across the ``tp``
    tensor-parallel ranks: the model-parallel stream's fork; at tensor-parallel size 1 without
    that stream, the default stream (else :func:`_check_sharded_dropout_rng`'s error)."""
    if p <= 0:
        return contextlib.nullcontext()
    if MODEL_PARALLEL_RNG in get_model_parallel_rng_tracker().names():
        return get_model_parallel_rng_tracker().fork()
    _check_sharded_dropout_rng(what, p, True, tp)
    return contextlib.nullcontext()


class TensorParallelAttention(KeepsParameterMarks):
    """Causal self-attention with ``n_head / n`` heads per tensor-parallel rank."""

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool = False):
        super().__init__()
        tp = get_model_parallel_world_size()
        if cfg.d_model % cfg.n_head:  # as the reference GPT: else a shape error in forward
            raise ValueError(f"TensorParallelAttention: GPTConfig d_model={cfg.d_model} is not "
                             f"divisible by n_head={cfg.n_head}; use a multiple of n_head")
        self.local_heads = divide(cfg.n_head, tp, f"GPTConfig.n_head over tensor-parallel size "
                                                  f"{tp}: n_head")
        self.head_dim = cfg.d_model // cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, stride=3,
                                        gather_output=False, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, input_is_parallel=True,
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)
                   for z in qkv.chunk(3, dim=-1))
        p = self.dropout if self.training else 0.0
        with _sharded_dropout_rng("TensorParallelAttention", p, self.qkv.tp_size):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class TensorParallelBlock(KeepsParameterMarks):
    """Pre-norm transformer block (``x + attn(ln(x)); x + mlp(ln(x))``), tensor-parallel.

    With ``sequence_parallel`` the input and output are this rank's ``seq / n`` slice and the
    LayerNorm parameters are marked for :func:`reduce_sequence_parallel_grads`.
    """

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = TensorParallelAttention(cfg, sequence_parallel)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = ColumnParallelLinear(cfg.d_model, 4 * cfg.d_model, gather_output=False,
                                       sequence_parallel=sequence_parallel)
        self.out = RowParallelLinear(4 * cfg.d_model, cfg.d_model, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel)
        self.drop = nn.Dropout(cfg.dropout)
        if sequence_parallel:
            mark_sequence_parallel(self.ln1)
            mark_sequence_parallel(self.ln2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # before any collective: attention heads (and sequence-split activations) are shards
        tp = self.fc.tp_size
        _check_sharded_dropout_rng("TensorParallelBlock", self.attn.dropout, self.training, tp)
        x = x + self.attn(self.ln1(x))
        h = self.out(F.gelu(self.fc(self.ln2(x))))
        # sequence-split activations need the shards' stream; replicated ones the default one
        sharded_p = self.drop.p if self.sequence_parallel and self.training else 0.0
        with _sharded_dropout_rng("TensorParallelBlock", sharded_p, tp):
            return x + self.drop(h)


class GPTEmbedding(KeepsParameterMarks):
    """Vocabulary-parallel token embedding plus a replicated position embedding."""

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool = False):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.sequence_parallel = sequence_parallel
        self.tok_emb = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model,
                                              sequence_parallel=sequence_parallel)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        if sequence_parallel:
            mark_sequence_parallel(self.pos_emb)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"TensorParallelGPT: sequence length {t} exceeds "
                             f"seq_len={self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        if self.sequence_parallel:  # this rank's part of the sequence, in the embedding's group
            rank, size = self.tok_emb.tp_rank, self.tok_emb.tp_size
            local = divide(t, size,
                           "sequence length with sequence_parallel over the tensor-parallel size")
            pos = pos[rank * local:(rank + 1) * local]
        return self.tok_emb(idx) + self.pos_emb(pos)


class GPTHead(KeepsParameterMarks):
    """Final LayerNorm and a column-parallel LM head; returns this rank's vocabulary slice of
    the logits (``[batch, seq, vocab / n]``, full sequence)."""

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool = False):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, bias=False,
                                         gather_output=False, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            mark_sequence_parallel(self.ln_f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt_loss(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, *,
             group=None, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy of vocabulary-split logits (a pipeline ``loss_fn``), as
    ``F.cross_entropy`` (:meth:`shardkit.models.GPT.loss`) takes it: targets equal to
    ``ignore_index`` (padding) count neither in the sum nor in the number of tokens it is
    divided by (all ignored: ``nan``, as torch). ``group``: the head's ``tp_group`` (default:
    the current tensor-parallel group). As a pipeline's ``loss_fn`` (or a
    ``functools.partial`` of it) it declares that count (``gpt_loss.target_count``): each
    micro-batch's loss is weighted by its share of the batch's counted tokens, as for
    ``F.cross_entropy``, so the step's loss and gradients are one process's on the whole batch
    however unequally the micro-batches are padded."""
    losses = vocab_parallel_cross_entropy(vocab_parallel_logits, target, ignore_index,
                                          group=group)
    return losses.sum() / (target != ignore_index).sum().to(losses.dtype)


def _counted_tokens(target: torch.Tensor, *, ignore_index: int = -100, **_) -> int:
    """What :func:`gpt_loss` divides by for ``target``: its tokens that are not
    ``ignore_index``. Local."""
    return int((target != ignore_index).sum())


# the pipeline schedules weigh each micro-batch's loss by its share of the batch's counted
# tokens, so that micro-batches padded unequally still give one process's mean
gpt_loss.target_count = _counted_tokens


class TensorParallelGPT(nn.Sequential):
    """:class:`shardkit.models.GPT` with Megatron-split layers (untied weights only).

    Args:
        cfg: the model's shape; ``d_model`` must divide by ``n_head``, and ``n_head``,
            ``vocab_size`` and ``4 * d_model`` by the tensor-parallel size (and the input's
            sequence length too with ``sequence_parallel``); ``ValueError`` otherwise.
        sequence_parallel: keep LayerNorm/dropout/residual activations split along the sequence.
            Call :meth:`reduce_sequence_parallel_grads` after backward.

    Dropout (``cfg.dropout > 0``, training) on split activations (attention heads; with
    ``sequence_parallel`` the sequence-split residual branch) draws from the model-parallel RNG
    stream: at tensor-parallel size > 1 call
    :func:`~shardkit.nn.model_parallel.model_parallel_manual_seed` first (a ``RuntimeError`` before
    any collective otherwise), as FairScale and Megatron require. Activation checkpointing of blocks
    with dropout replays that stream in the recomputation (the same masks, the gradients of the
    plain run) under :func:`shardkit.nn.model_parallel.random.checkpoint`,
    :mod:`shardkit.nn.checkpoint` and ``torch.utils.checkpoint`` (reentrant or not, torch's
    ``checkpoint_wrapper`` too) with its default ``preserve_rng_state=True`` (``False`` replays no
    generator: other masks).

    ``forward(idx)`` returns vocabulary-split logits; ``loss(idx, target)`` the mean
    cross-entropy. Initialisation follows each layer's master-weight rule; load
    :func:`from_reference_state_dict` of a :class:`shardkit.models.GPT` for its exact weights.
    """

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool = False):
        if cfg.tie_weights:
            raise ValueError("TensorParallelGPT: GPTConfig.tie_weights=True is not supported; "
                             "use tie_weights=False")
        super().__init__(GPTEmbedding(cfg, sequence_parallel),
                         *[TensorParallelBlock(cfg, sequence_parallel) for _ in range(cfg.n_layer)],
                         GPTHead(cfg, sequence_parallel))
        self.cfg = cfg
        self.sequence_parallel = sequence_parallel

    def __deepcopy__(self, memo):
        """A deep copy (an EMA or evaluation copy) sharing the process groups and keeping the
        parameters' marks (the LayerNorms' ``sequence_parallel`` too)."""
        return deepcopy_keeping_parameter_marks(self, memo)

    def __getitem__(self, index):
        """A layer, or for a slice a plain ``nn.Sequential`` of those layers under their
        original names (a pipeline stage; shares the layers)."""
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(list(self.named_children())[index]))
        return super().__getitem__(index)

    def loss(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over all tokens (same value on every tensor-parallel rank)."""
        return gpt_loss(self(idx), target, group=self[-1].head.tp_group)

    def reduce_sequence_parallel_grads(self) -> None:
        """Sum the sequence-parallel parameters' gradients over the tensor-parallel group
        (one all-reduce; nothing without sequence parallelism)."""
        if self.sequence_parallel:
            reduce_sequence_parallel_grads(self)


def _reference_key_map(n_layer: int) -> list[tuple[str, str]]:
    """(reference prefix, tensor-parallel prefix) pairs."""
    pairs = [("tok_emb.", "0.tok_emb."), ("pos_emb.", "0.pos_emb."),
             ("ln_f.", f"{n_layer + 1}.ln_f."), ("head.", f"{n_layer + 1}.head.")]
    pairs += [(f"blocks.{i}.", f"{i + 1}.") for i in range(n_layer)]
    return pairs


def from_reference_state_dict(state_dict: dict, cfg: GPTConfig) -> dict:
    """Rename a :class:`shardkit.models.GPT` state dict to :class:`TensorParallelGPT`'s (unsplit)
    keys, for :func:`~shardkit.nn.model_parallel.full_state.load_full_model_state_dict`."""
    return _rename(state_dict, _reference_key_map(cfg.n_layer))


def to_reference_state_dict(state_dict: dict, cfg: GPTConfig) -> dict:
    """Inverse of :func:`from_reference_state_dict` (e.g. on
    :func:`~shardkit.nn.model_parallel.full_state.full_model_state_dict`)."""
    return _rename(state_dict, [(b, a) for a, b in _reference_key_map(cfg.n_layer)])


def _rename(state_dict: dict, pairs: list[tuple[str, str]]) -> dict:
    out = {}
    for key, value in state_dict.items():
        for old, new in pairs:
            if key.startswith(old):
                out[new + key[len(old):]] = value
                break
        else:
            raise KeyError(f"GPT state dict key {key!r} matches none of "
                           f"{[old for old, _ in pairs]}")
    return out
