"""A seeded random matrix of tensor-parallel configurations against one-process training.

Each world (1, 2 and 4 ranks) starts once. Inside it, configurations drawn from a fixed seed
(sizes, some that must be refused, bias, gather_output / input_is_parallel, skip_bias_add,
sequence parallelism, stride, init methods, fp32 and bf16, SGD with momentum / AdamW, gradient
clipping with 1-, 2- and inf-norms) train a few steps at tensor-parallel sizes 1, 2 and 4, and
every rank compares, at every step, the outputs, the loss, the input and weight gradients, the
clipped norm and the updated weights with the unsplit torch model trained in one process.
Embeddings (padding_idx, max_norm, scale_grad_by_freq) and vocabulary-parallel cross-entropy
(ignore_index, label smoothing, ragged and empty targets, int32 targets) get the same treatment.
World 4 also checks unsplit state export/import across tensor-parallel sizes, the wrapped model's
state_dict, TP2 x DP2 under torch DDP / OSS / ShardedDataParallel / FSDP and TP2 x PP2 under the
GPipe and 1F1B schedules. Refused configurations must fail before any collective with a message
that names the argument and what is valid.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.distributed import CommCounter
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.full_state import (
    full_model_state_dict, load_full_model_state_dict)
from shardkit.nn.model_parallel.gpt import (
    TensorParallelGPT, from_reference_state_dict, gpt_loss, to_reference_state_dict)
from shardkit.nn.model_parallel.utils import shard_of
from shardkit.testing import world_fixture

MATRIX_SEED = 1204
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}  # relative to the largest reference value
INITS = {"xavier_normal_": nn.init.xavier_normal_,
         "normal_0.2": lambda w: nn.init.normal_(w, 0.0, 0.2),
         "kaiming_uniform_": nn.init.kaiming_uniform_}

world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)


# ----------------------------------------------------------------------------- helpers


def _rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    diff = (got.detach().float() - want.detach().float()).abs().max().item()
    return diff / (want.detach().float().abs().max().item() + 1e-6)


def _fixed(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _optimizer(name: str, params, sgd_lr: float = 0.1):
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=sgd_lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _slice_of(full: torch.Tensor, layer, name: str) -> torch.Tensor:
    """This rank's part of the unsplit ``full`` value of ``layer``'s parameter ``name``."""
    spec = layer._shard_dims[name]
    return full if spec is None else shard_of(full, layer.tp_rank, layer.tp_size, *spec)


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The tensor-parallel ranks' ``t`` concatenated along ``dim`` (test-side, no autograd;
    an all-gather over the tensor-parallel group only)."""
    tp = mp.get_model_parallel_world_size()
    flat = torch.empty(tp * t.numel(), dtype=t.dtype)
    distributed.all_gather_into_tensor(flat, t.detach().contiguous().reshape(-1),
                                       group=mp.get_model_parallel_group())
    return torch.cat(list(flat.view((tp,) + tuple(t.shape)).unbind(0)), dim=dim)


def _loss_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / (1 + |want|): a loss may sum to nearly zero."""
    return (got.detach().float() - want.detach().float()).abs().max().item() / (
        1.0 + want.detach().float().abs().item())


def _refusal(build) -> tuple[str, int]:
    """(error message, collectives issued) of ``build()``, which must raise."""
    with CommCounter() as comm:
        try:
            build()
        except Exception as e:  # the wrong type fails the check, not the whole world
            return f"{type(e).__name__}: {e}", len(comm.calls)
    return "accepted", len(comm.calls)


# ----------------------------------------------------------------------------- linear layers


@dataclass(frozen=True)
class LinearCase:
    """One linear configuration: ``kind`` is ``column``, ``row``, ``mlp`` (column -> GeLU ->
    row), ``column_sp`` or ``mlp_sp`` (sequence parallel)."""

    kind: str
    stride: int
    in_f: int
    hidden: int
    out_f: int
    bias: bool
    bias2: bool
    gather_output: bool
    input_is_parallel: bool
    skip_bias_add: bool
    skip_bias_add2: bool
    init: str
    optimizer: str
    clip: float | None
    norm_type: float
    lead: tuple
    dtype: torch.dtype
    steps: int


def _feature_size(rng: random.Random, tp: int, stride: int) -> int:
    """Mostly a valid multiple of ``tp * stride``; sometimes any size (maybe refused)."""
    return tp * stride * rng.randint(1, 3) if rng.random() < 0.8 else rng.randint(1, 11)


def draw_linear_case(rng: random.Random, tp: int) -> LinearCase:
    stride = rng.choice([1, 1, 2, 3])
    kind = rng.choice(["column", "row", "mlp", "column_sp", "mlp_sp"])
    batch, seq = rng.randint(1, 2), tp * rng.randint(1, 2)
    lead = (batch, seq) if kind.endswith("_sp") or rng.random() < 0.5 else (batch,)
    return LinearCase(
        kind=kind, stride=stride, in_f=_feature_size(rng, tp, stride),
        hidden=_feature_size(rng, tp, stride), out_f=_feature_size(rng, tp, stride),
        bias=rng.random() < 0.7, bias2=rng.random() < 0.7, gather_output=rng.random() < 0.5,
        input_is_parallel=rng.random() < 0.5, skip_bias_add=rng.random() < 0.3,
        skip_bias_add2=rng.random() < 0.3, init=rng.choice(sorted(INITS)),
        optimizer=rng.choice(["sgd_momentum", "adamw"]),
        clip=rng.choice([None, 0.05, 1.0]), norm_type=rng.choice([2.0, 1.0, math.inf]),
        lead=lead, dtype=rng.choice([torch.float32] * 4 + [torch.bfloat16]),
        steps=rng.randint(1, 3))


def _build_linear_layers(case: LinearCase) -> list:
    """The tensor-parallel layers of ``case`` (``ValueError`` when the sizes are refused)."""
    sp = case.kind.endswith("_sp")
    common = dict(init_method=INITS[case.init], stride=case.stride,
                  keep_master_weight_for_test=True, sequence_parallel=sp)
    if case.kind == "row":
        return [mp.RowParallelLinear(case.in_f, case.out_f, bias=case.bias,
                                     input_is_parallel=case.input_is_parallel,
                                     skip_bias_add=case.skip_bias_add, **common)]
    width = case.out_f if case.kind.startswith("column") else case.hidden
    column = mp.ColumnParallelLinear(
        case.in_f, width, bias=case.bias, skip_bias_add=case.skip_bias_add,
        gather_output=case.gather_output and case.kind == "column", **common)
    if case.kind.startswith("column"):
        return [column]
    return [column, mp.RowParallelLinear(case.hidden, case.out_f, bias=case.bias2,
                                         input_is_parallel=True,
                                         skip_bias_add=case.skip_bias_add2, **common)]


def _reference_linear(layer) -> nn.Linear:
    ref = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        ref.weight.copy_(layer.master_weight)
        if ref.bias is not None:
            ref.bias.zero_()
    return ref


def _add_bias(output):
    """A ``skip_bias_add`` layer's ``(output, bias)`` added as the caller would."""
    if not isinstance(output, tuple):
        return output
    y, bias = output
    return y if bias is None else y + bias


def _output_layout(case: LinearCase) -> str:
    """How the last layer's output is split: ``full``, ``hidden`` (last dim) or ``sequence``."""
    if case.kind == "mlp_sp":
        return "sequence"
    if case.kind == "column_sp" or (case.kind == "column" and not case.gather_output):
        return "hidden"
    return "full"


def _local_input(case: LinearCase, x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if case.kind.endswith("_sp"):
        return x.chunk(tp, dim=1)[rank]
    if case.kind == "row" and case.input_is_parallel:
        return shard_of(x, rank, tp, x.dim() - 1, case.stride)
    return x


def _local_loss(y, layout: str, case: LinearCase, tp: int, rank: int, seed: int):
    """This rank's share of ``sum(full_output * W)`` for a fixed ``W``; the shares add up to
    the unsplit loss (a replicated output's loss is the same whole loss on every rank)."""
    full_shape = list(y.shape)
    if layout == "full":
        return (y * _fixed(full_shape, seed).to(y.dtype)).sum()
    dim = y.dim() - 1 if layout == "hidden" else 1
    full_shape[dim] *= tp
    weight = _fixed(full_shape, seed)
    weight = (shard_of(weight, rank, tp, dim, case.stride) if layout == "hidden"
              else weight.chunk(tp, dim=dim)[rank])
    return (y * weight.to(y.dtype)).sum()


def _unsplit_output(y, layout: str, case: LinearCase) -> torch.Tensor:
    if layout == "hidden":
        return mp.gather_from_model_parallel_region(y.detach(), stride=case.stride)
    return _gather_tp(y, 1) if layout == "sequence" else y


def run_linear_case(case: LinearCase, seed: int) -> dict:
    """Train ``case`` ``steps`` steps beside its unsplit reference; the worst relative
    differences, or ``{"refused": message}``."""
    tp, rank = mp.get_model_parallel_world_size(), mp.get_model_parallel_rank()
    torch.manual_seed(seed)
    with CommCounter() as comm:
        try:
            layers = _build_linear_layers(case)
        except ValueError as e:
            return {"refused": str(e), "collectives": len(comm.calls)}
    refs = [_reference_linear(layer) for layer in layers]
    for module in layers + refs:
        module.to(case.dtype)
    params = [p for layer in layers for p in layer.parameters()]
    ref_params = [p for ref in refs for p in ref.parameters()]
    opt, ref_opt = _optimizer(case.optimizer, params), _optimizer(case.optimizer, ref_params)
    layout = _output_layout(case)
    worst = {"output": 0.0, "loss": 0.0, "input_grad": 0.0, "grad": 0.0, "weight": 0.0,
             "norm": 0.0}
    for step in range(case.steps):
        x = _fixed(list(case.lead) + [case.in_f], seed + step).to(case.dtype)
        x_ref, x_tp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        h = refs[0](x_ref)
        if len(refs) == 2:
            h = refs[1](F.gelu(h))
        ref_loss = _local_loss(h, "full", case, tp, rank, seed + 99 + step)
        y = _add_bias(layers[0](_local_input(case, x_tp, tp, rank)))
        if len(layers) == 2:
            y = _add_bias(layers[1](F.gelu(y)))
        loss = _local_loss(y, layout, case, tp, rank, seed + 99 + step)
        worst["output"] = max(worst["output"], _rel_diff(_unsplit_output(y, layout, case), h))
        total = loss.detach().float().reshape(1)
        if layout != "full":
            total = _gather_tp(total, 0).sum()
        worst["loss"] = max(worst["loss"], _loss_diff(total, ref_loss))
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        # the part of the input gradient this rank computes: its slice, or all of it
        worst["input_grad"] = max(worst["input_grad"], _rel_diff(
            _local_input(case, x_tp.grad, tp, rank), _local_input(case, x_ref.grad, tp, rank)))
        for layer in layers:
            mp.reduce_sequence_parallel_grads(layer)
        if case.clip is not None:
            norm = mp.clip_grad_norm(params, case.clip, case.norm_type)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, case.clip, case.norm_type)
            worst["norm"] = max(worst["norm"], _rel_diff(norm.float(), ref_norm.float()))
        worst["grad"] = max(worst["grad"], _worst_param_diff(layers, refs, grads=True))
        opt.step()
        ref_opt.step()
        worst["weight"] = max(worst["weight"], _worst_param_diff(layers, refs, grads=False))
    worst["dtype_kept"] = all(p.dtype == case.dtype for p in params)
    return worst


def _worst_param_diff(layers, refs, grads: bool) -> float:
    worst = 0.0
    for layer, ref in zip(layers, refs):
        for name, param in layer.named_parameters(recurse=False):
            want = getattr(ref, name)
            got, want = (param.grad, want.grad) if grads else (param, want)
            worst = max(worst, _rel_diff(got, _slice_of(want, layer, name)))
    return worst


def linear_matrix(tp: int, cases: int, seed: int) -> list:
    """``cases`` random linear configurations at tensor-parallel size ``tp``."""
    mp.initialize_model_parallel(tp)
    try:
        rng = random.Random(seed)
        drawn = [draw_linear_case(rng, tp) for _ in range(cases)]
        return [(case, run_linear_case(case, seed * 1000 + i)) for i, case in enumerate(drawn)]
    finally:
        mp.destroy_model_parallel()


def _check_linear_results(results: list) -> None:
    ran = refused = 0
    for case, worst in results:
        if "refused" in worst:
            refused += 1
            assert "is not divisible by tensor-parallel size" in worst["refused"], (case, worst)
            assert "use a multiple of" in worst["refused"], (case, worst)
            assert worst["collectives"] == 0, (case, worst)
            continue
        ran += 1
        tol = TOL[case.dtype]
        assert worst.pop("dtype_kept"), case
        assert all(v <= tol for v in worst.values()), (case, worst)
    assert ran >= len(results) // 2, (ran, refused)


# ----------------------------------------------------------------------------- embeddings, CE


@dataclass(frozen=True)
class EmbeddingCase:
    """``kind``: ``vocab``, ``vocab_sp``, ``columns`` (ParallelEmbedding) or ``cross_entropy``
    (a column-parallel head, ``gather_output=False``, into vocab_parallel_cross_entropy)."""

    kind: str
    vocab: int
    dim: int
    padding_idx: int | None
    max_norm: float | None
    norm_type: float
    scale_grad_by_freq: bool
    ignore_index: int
    label_smoothing: float
    shape: tuple
    ignored_fraction: float
    target_dtype: torch.dtype
    optimizer: str
    clip: float | None
    steps: int


def draw_embedding_case(rng: random.Random, tp: int) -> EmbeddingCase:
    kind = rng.choice(["vocab", "vocab_sp", "columns", "cross_entropy", "cross_entropy"])
    vocab = tp * rng.randint(1, 5) if rng.random() < 0.8 else rng.randint(2, 11)
    dim = tp * rng.randint(1, 3) if rng.random() < 0.8 else rng.randint(1, 7)
    shape = rng.choice([(rng.randint(1, 5),), (rng.randint(1, 3), tp * rng.randint(1, 2)),
                        (2, tp, rng.randint(1, 2)), (0,)])
    return EmbeddingCase(
        kind=kind, vocab=vocab, dim=dim,
        padding_idx=rng.choice([None, None, 0, vocab - 1, -1]),
        max_norm=rng.choice([None, None, 0.5, 1.0]), norm_type=rng.choice([2.0, 1.0, math.inf]),
        scale_grad_by_freq=kind == "columns" and rng.random() < 0.3,
        ignore_index=rng.choice([-100, -100, 0, vocab - 1]),
        label_smoothing=rng.choice([0.0, 0.0, 0.1, 1.0]),
        shape=(2, 2 * tp) if kind == "vocab_sp" else shape,
        ignored_fraction=rng.choice([0.0, 0.3, 1.0]),
        target_dtype=rng.choice([torch.long, torch.int32]),
        optimizer=rng.choice(["sgd_momentum", "adamw"]), clip=rng.choice([None, 0.05]),
        steps=rng.randint(1, 3))


def _build_embedding_pair(case: EmbeddingCase):
    """(tensor-parallel layer, unsplit torch layer from the same master weight)."""
    if case.kind == "cross_entropy":
        layer = mp.ColumnParallelLinear(case.dim, case.vocab, gather_output=False,
                                        keep_master_weight_for_test=True)
        ref = nn.Linear(case.dim, case.vocab)
        with torch.no_grad():
            ref.bias.zero_()
    else:
        options = dict(padding_idx=case.padding_idx, max_norm=case.max_norm,
                       norm_type=case.norm_type)
        if case.kind == "columns":
            layer = mp.ParallelEmbedding(case.vocab, case.dim, keep_master_weight_for_test=True,
                                         scale_grad_by_freq=case.scale_grad_by_freq, **options)
        else:
            layer = mp.VocabParallelEmbedding(case.vocab, case.dim,
                                              keep_master_weight_for_test=True,
                                              sequence_parallel=case.kind == "vocab_sp",
                                              **options)
        ref = nn.Embedding(case.vocab, case.dim, scale_grad_by_freq=case.scale_grad_by_freq,
                           **options)
    with torch.no_grad():
        ref.weight.copy_(layer.master_weight)
    return layer, ref


def _cross_entropy_losses(layer, ref, case: EmbeddingCase, gen: torch.Generator):
    """(tensor-parallel loss, reference loss, worst per-token difference): the mean over the
    kept tokens of vocab_parallel_cross_entropy and of F.cross_entropy."""
    x = torch.randn(case.shape + (case.dim,), generator=gen)
    target = torch.randint(0, case.vocab, case.shape, generator=gen)
    ignored = torch.rand(case.shape, generator=gen) < case.ignored_fraction
    target = target.masked_fill(ignored, case.ignore_index).to(case.target_dtype)
    per_token = mp.vocab_parallel_cross_entropy(layer(x), target, case.ignore_index,
                                                label_smoothing=case.label_smoothing)
    ref_per_token = F.cross_entropy(
        ref(x).reshape(-1, case.vocab), target.long().reshape(-1), reduction="none",
        ignore_index=case.ignore_index, label_smoothing=case.label_smoothing).reshape(case.shape)
    kept = (target.long() != case.ignore_index).sum().clamp(min=1)
    diff = _rel_diff(per_token, ref_per_token) if per_token.shape == ref_per_token.shape else 1.0
    return per_token.sum() / kept, ref_per_token.sum() / kept, diff


def _embedding_losses(layer, ref, case: EmbeddingCase, gen: torch.Generator, seed: int):
    tp, rank = mp.get_model_parallel_world_size(), mp.get_model_parallel_rank()
    idx = torch.randint(0, case.vocab, case.shape, generator=gen)
    y, y_ref = layer(idx), ref(idx)
    sp = case.kind == "vocab_sp"
    diff = _rel_diff(_gather_tp(y, 1) if sp else y, y_ref)
    weight = _fixed(y_ref.shape, seed)
    local_weight = weight.chunk(tp, dim=1)[rank] if sp else weight
    return (y * local_weight).sum(), (y_ref * weight).sum(), diff


def run_embedding_case(case: EmbeddingCase, seed: int) -> dict:
    """Train ``case`` beside its reference: worst absolute differences, or the refusal."""
    torch.manual_seed(seed)
    with CommCounter() as comm:
        try:
            layer, ref = _build_embedding_pair(case)
        except ValueError as e:
            return {"refused": str(e), "collectives": len(comm.calls)}
    opt = _optimizer(case.optimizer, list(layer.parameters()))
    ref_opt = _optimizer(case.optimizer, list(ref.parameters()))
    gen = torch.Generator().manual_seed(seed)
    worst = {"output": 0.0, "grad": 0.0, "weight": 0.0, "norm": 0.0}
    for step in range(case.steps):
        if case.kind == "cross_entropy":
            loss, ref_loss, diff = _cross_entropy_losses(layer, ref, case, gen)
        else:
            loss, ref_loss, diff = _embedding_losses(layer, ref, case, gen, seed + step)
        worst["output"] = max(worst["output"], diff)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        if case.clip is not None:
            norm = mp.clip_grad_norm(list(layer.parameters()), case.clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), case.clip)
            worst["norm"] = max(worst["norm"], _rel_diff(norm, ref_norm))
        worst["grad"] = max(worst["grad"], _worst_param_diff([layer], [ref], grads=True))
        opt.step()
        ref_opt.step()
        worst["weight"] = max(worst["weight"], _worst_param_diff([layer], [ref], grads=False))
    return worst


def embedding_matrix(tp: int, cases: int, seed: int) -> list:
    mp.initialize_model_parallel(tp)
    try:
        rng = random.Random(seed)
        drawn = [draw_embedding_case(rng, tp) for _ in range(cases)]
        return [(case, run_embedding_case(case, seed * 1000 + i)) for i, case in enumerate(drawn)]
    finally:
        mp.destroy_model_parallel()


def _check_embedding_results(results: list) -> None:
    ran = 0
    for case, worst in results:
        if "refused" in worst:
            assert "is not divisible by tensor-parallel size" in worst["refused"], (case, worst)
            assert worst["collectives"] == 0, (case, worst)
            continue
        ran += 1
        assert all(v <= TOL[torch.float32] for v in worst.values()), (case, worst)
    assert ran >= len(results) // 2, ran


# ----------------------------------------------------------------------------- bad input


def _bad_input_messages() -> dict:
    """Each misuse that used to fail late or unclearly: its message and collectives issued."""
    tp = mp.get_model_parallel_world_size()
    return {
        "padding_idx": _refusal(lambda: mp.ParallelEmbedding(8, 2 * tp, padding_idx=8)),
        "negative padding_idx": _refusal(lambda: mp.ParallelEmbedding(8, 2 * tp,
                                                                      padding_idx=-9)),
        "gather_output": _refusal(lambda: mp.ColumnParallelLinear(4, 4 * tp,
                                                                  gather_output="no")),
        "input_is_parallel": _refusal(lambda: mp.RowParallelLinear(4 * tp, 4,
                                                                   input_is_parallel="no")),
        "sequence_parallel": _refusal(lambda: mp.VocabParallelEmbedding(
            4 * tp, 4, sequence_parallel="yes")),
        "out_features": _refusal(lambda: mp.ColumnParallelLinear(4, -2 * tp)),
        "in_features": _refusal(lambda: mp.ColumnParallelLinear(4.0, 4 * tp)),
        "embedding_dim": _refusal(lambda: mp.VocabParallelEmbedding(4 * tp, -1)),
        "init_method": _refusal(lambda: mp.RowParallelLinear(4 * tp, 4,
                                                             init_method="xavier_normal_")),
        # used to build, then fail in forward with a bare view() shape error
        "d_model": _refusal(lambda: TensorParallelGPT(GPTConfig(
            vocab_size=4 * tp, n_layer=1, n_head=4, d_model=18, seq_len=4))),
    }


def _negative_padding_idx_as_torch() -> tuple:
    """``ParallelEmbedding(padding_idx=-1)``: the attribute and the zero, gradient-free row are
    nn.Embedding's (row V-1)."""
    torch.manual_seed(0)
    layer = mp.ParallelEmbedding(8, 2 * mp.get_model_parallel_world_size(), padding_idx=-1,
                                 keep_master_weight_for_test=True)
    ref = nn.Embedding(8, layer.embedding_dim, padding_idx=-1)
    with torch.no_grad():
        ref.weight.copy_(layer.master_weight)
    idx = torch.tensor([7, 2, 7])
    layer(idx).sum().backward()
    ref(idx).sum().backward()
    return (layer.padding_idx, ref.padding_idx, layer.master_weight[7].abs().max().item(),
            _rel_diff(layer.weight.grad, _slice_of(ref.weight.grad, layer, "weight")))


def bad_input(tp: int) -> dict:
    mp.initialize_model_parallel(tp)
    try:
        return {"messages": _bad_input_messages(), "padding": _negative_padding_idx_as_torch()}
    finally:
        mp.destroy_model_parallel()


EXPECTED_MESSAGES = {
    "padding_idx": "ValueError: ParallelEmbedding: padding_idx=8 is outside [-8, 8)",
    "negative padding_idx": "ValueError: ParallelEmbedding: padding_idx=-9 is outside [-8, 8)",
    "gather_output": "TypeError: ColumnParallelLinear: gather_output='no' (str); it must be a "
                     "bool, True or False",
    "input_is_parallel": "TypeError: RowParallelLinear: input_is_parallel='no' (str); it must be "
                         "a bool, True or False",
    "sequence_parallel": "TypeError: VocabParallelEmbedding: sequence_parallel='yes' (str); it "
                         "must be a bool, True or False",
    "out_features": "ValueError: ColumnParallelLinear: out_features=-",
    "in_features": "ValueError: ColumnParallelLinear: in_features=4.0; it must be an int >= 0",
    "embedding_dim": "ValueError: VocabParallelEmbedding: embedding_dim=-1; it must be an int >= 0",
    "init_method": "TypeError: RowParallelLinear: init_method='xavier_normal_' is not callable; "
                   "pass an in-place initialiser such as torch.nn.init.xavier_normal_",
    "d_model": "ValueError: TensorParallelAttention: GPTConfig d_model=18 is not divisible by "
               "n_head=4",
}


def _check_bad_input(results: list) -> None:
    for res in results:
        for key, expected in EXPECTED_MESSAGES.items():
            message, collectives = res["messages"][key]
            assert message.startswith(expected), (key, message)
            assert collectives == 0, (key, collectives)
        own, torch_attr, padding_row, grad_diff = res["padding"]
        assert own == torch_attr == 7 and padding_row == 0.0 and grad_diff == 0.0, res["padding"]


# ----------------------------------------------------------------------------- world 4 only


def _mixed_model(vocab: int, dim: int, hidden: int, stride: int, padding_idx) -> nn.Sequential:
    """Every split layer kind and a replicated LayerNorm, ending in full logits."""
    return nn.Sequential(
        mp.VocabParallelEmbedding(vocab, dim, padding_idx=padding_idx),
        mp.ColumnParallelLinear(dim, hidden, gather_output=False, stride=stride), nn.GELU(),
        mp.RowParallelLinear(hidden, dim, input_is_parallel=True, stride=stride),
        nn.LayerNorm(dim),
        mp.ColumnParallelLinear(dim, hidden, gather_output=True, stride=stride),
        mp.RowParallelLinear(hidden, vocab, bias=False, stride=stride))


def _reload_at(tp: int, shape: tuple, full_state: dict, idx: torch.Tensor, seed: int):
    """Output, re-exported full state and the model, after loading ``full_state`` into a model
    of ``shape`` built (from another seed) at tensor-parallel size ``tp``."""
    mp.initialize_model_parallel(tp)
    try:
        torch.manual_seed(seed)
        model = _mixed_model(*shape)
        load_full_model_state_dict(model, full_state)
        return model(idx).detach(), full_model_state_dict(model), model
    finally:
        mp.destroy_model_parallel()


def state_round_trips(cases: int, seed: int) -> list:
    """Save the unsplit state at TP2, load it at TP4 and TP1 (and the local state_dict at TP2):
    worst output and re-export differences."""
    rng = random.Random(seed)
    worst = []
    for i in range(cases):
        stride = rng.choice([1, 2, 3])
        shape = (4 * rng.randint(1, 2), rng.randint(2, 5), 4 * stride * rng.randint(1, 2),
                 stride, rng.choice([None, 0, -1]))
        idx = torch.randint(0, shape[0], (2, 3), generator=torch.Generator().manual_seed(i))
        mp.initialize_model_parallel(2)
        try:
            torch.manual_seed(i)
            model = _mixed_model(*shape)
            with torch.no_grad():  # so that the zero-initialised biases are checked too
                for p in model.parameters():
                    p.add_(0.01)
            expected, full_state = model(idx).detach(), full_model_state_dict(model)
            local_state = model.state_dict()
        finally:
            mp.destroy_model_parallel()
        diffs = {}
        for tp in (4, 1, 2):
            out, again, reloaded = _reload_at(tp, shape, full_state, idx, 1000 + i)
            diffs[f"tp2->tp{tp} output"] = _rel_diff(out, expected)
            diffs[f"tp2->tp{tp} re-export"] = max(_rel_diff(again[k], v)
                                                  for k, v in full_state.items())
        reloaded.load_state_dict(local_state)  # the TP2 model: its own local state_dict
        with torch.no_grad():
            diffs["local state_dict"] = _rel_diff(reloaded(idx), expected)
        worst.append((shape, diffs))
    return worst


def _wrap_data_parallel(model, wrapper: str, optimizer: str):
    """(wrapped model, optimizer, clip function) over the data-parallel group."""
    from torch.nn.parallel import DistributedDataParallel

    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    group = mp.get_data_parallel_group()
    cls, kwargs = ((torch.optim.SGD, dict(lr=0.5, momentum=0.9)) if optimizer == "sgd_momentum"
                   else (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)))
    if wrapper == "fsdp":
        wrapped = FullyShardedDataParallel(model, process_group=group)
        return wrapped, cls(wrapped.parameters(), **kwargs), wrapped.clip_grad_norm_
    if wrapper == "ddp":
        wrapped = DistributedDataParallel(model, process_group=group)
        opt = cls(model.parameters(), **kwargs)
        return wrapped, opt, lambda max_norm: mp.clip_grad_norm(model.parameters(), max_norm)
    opt = OSS(model.parameters(), optim=cls, group=group, **kwargs)
    wrapped = (ShardedDataParallel(model, opt, process_group=group) if wrapper == "sdp"
               else DistributedDataParallel(model, process_group=group))
    return wrapped, opt, opt.clip_grad_norm


DP_CASES = [  # (wrapper, sequence_parallel, optimizer, clip)
    ("ddp", True, "sgd_momentum", 0.2), ("oss_ddp", False, "adamw", 0.2),
    ("sdp", True, "sgd_momentum", None), ("fsdp", True, "adamw", 0.2),
    ("fsdp", False, "sgd_momentum", 0.2),
]
GPT_CFG = GPTConfig(vocab_size=12, n_layer=1, n_head=2, d_model=6, seq_len=4)


def _unsplit_reference_keys(state: dict) -> dict:
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    return to_reference_state_dict(state, GPT_CFG)


def data_parallel_case(wrapper: str, sequence_parallel: bool, optimizer: str, clip) -> dict:
    """TensorParallelGPT at TP2 x DP2 inside ``wrapper``, 3 steps beside the one-process GPT on
    the whole batch: worst loss / norm / final-weight differences, and the wrapped model's
    state_dict into a fresh wrapped model."""
    torch.manual_seed(0)
    ref = GPT(GPT_CFG)
    ref_opt = _optimizer(optimizer, ref.parameters(), sgd_lr=0.5)
    mp.initialize_model_parallel(2)
    try:
        model = TensorParallelGPT(GPT_CFG, sequence_parallel=sequence_parallel)
        load_full_model_state_dict(model, from_reference_state_dict(ref.state_dict(), GPT_CFG))
        wrapped, opt, clip_fn = _wrap_data_parallel(model, wrapper, optimizer)
        rows = slice(2 * mp.get_data_parallel_rank(), 2 * mp.get_data_parallel_rank() + 2)
        worst = {"loss": 0.0, "norm": 0.0}
        for step in range(3):
            idx, target = synthetic_batch(GPT_CFG, 4, step)
            opt.zero_grad()
            loss = gpt_loss(wrapped(idx[rows]), target[rows])
            loss.backward()
            mp.reduce_sequence_parallel_grads(wrapped)
            norm = clip_fn(clip) if clip else None
            opt.step()
            ref_opt.zero_grad()
            ref_loss = ref.loss(idx, target)
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else None
            ref_opt.step()
            mean_loss = _gather_dp_mean(loss.detach())
            worst["loss"] = max(worst["loss"], _loss_diff(mean_loss, ref_loss))
            if clip:
                worst["norm"] = max(worst["norm"], _rel_diff(norm, ref_norm))
        state = _unsplit_reference_keys(full_model_state_dict(wrapped))
        # AdamW: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift)
        # and ~1e-9 in floats, which Adam normalises into a full step on either side
        worst["weights"] = max(_rel_diff(state[k], v) for k, v in ref.state_dict().items()
                               if optimizer != "adamw" or not k.endswith("qkv.bias"))
        worst["wrapped state_dict"] = _wrapped_state_dict_round_trip(
            wrapped, wrapper, optimizer, sequence_parallel)
        return worst
    finally:
        mp.destroy_model_parallel()


def _gather_dp_mean(value: torch.Tensor) -> torch.Tensor:
    total = value.clone().reshape(1)
    distributed.all_reduce(total, group=mp.get_data_parallel_group())
    return total / mp.get_data_parallel_world_size()


def _wrapped_state_dict_round_trip(wrapped, wrapper, optimizer, sequence_parallel) -> float:
    torch.manual_seed(123)
    fresh, _, _ = _wrap_data_parallel(
        TensorParallelGPT(GPT_CFG, sequence_parallel=sequence_parallel), wrapper, optimizer)
    fresh.load_state_dict(wrapped.state_dict())
    idx, _ = synthetic_batch(GPT_CFG, 2, 9)
    with torch.no_grad():
        return _rel_diff(fresh(idx), wrapped(idx))


class _PipelineBlock(nn.Module):
    """``x + row(gelu(column(layer_norm(x))))``, optionally sequence parallel."""

    def __init__(self, dim: int, hidden: int, stride: int, sequence_parallel: bool):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.column = mp.ColumnParallelLinear(dim, hidden, gather_output=False, stride=stride,
                                              sequence_parallel=sequence_parallel,
                                              keep_master_weight_for_test=True)
        self.row = mp.RowParallelLinear(hidden, dim, input_is_parallel=True, stride=stride,
                                        sequence_parallel=sequence_parallel,
                                        keep_master_weight_for_test=True)
        if sequence_parallel:
            mp.mark_sequence_parallel(self.norm)

    def forward(self, x):
        return x + self.row(F.gelu(self.column(self.norm(x))))

    def reference(self) -> nn.Module:
        """The unsplit block, from the same initial weights."""
        ref = _PipelineBlock.__new__(_PipelineBlock)
        nn.Module.__init__(ref)
        ref.norm = nn.LayerNorm(self.norm.normalized_shape)
        ref.column, ref.row = _reference_linear(self.column), _reference_linear(self.row)
        return ref


def pipeline_case(schedule: str, chunks: int, sequence_parallel: bool, clip) -> dict:
    """Four blocks at TP2 x PP2 under ``schedule``, 2 steps beside the one-process model:
    worst loss, norm and final-weight differences (every rank, its own stage)."""
    from shardkit.nn import pipe

    dim, hidden, seq = 4, 8, 4
    mp.initialize_model_parallel(2, pipeline_length=2)
    try:
        torch.manual_seed(0)
        blocks = [_PipelineBlock(dim, hidden, 2, sequence_parallel) for _ in range(4)]
        refs = nn.Sequential(*[b.reference() for b in blocks])
        stage_index, tp_rank = mp.get_pipeline_parallel_rank(), mp.get_model_parallel_rank()
        part = pipe.split_sequential(nn.Sequential(*blocks), [2, 2])[stage_index]
        local_refs = list(refs)[2 * stage_index:2 * stage_index + 2]

        def loss_fn(y, target):
            if sequence_parallel:  # this rank's share of the mean over the whole sequence
                return ((y - target.chunk(2, dim=1)[tp_rank]) ** 2).sum() / (2 * y.numel())
            return ((y - target) ** 2).mean()

        stage = pipe.PipelineStage(part, stage_index, 2, group=mp.get_pipeline_parallel_group())
        cls = pipe.ScheduleGPipe if schedule == "gpipe" else pipe.Schedule1F1B
        runner = cls(stage, chunks, loss_fn)
        opt = torch.optim.SGD(part.parameters(), lr=0.2, momentum=0.5)
        ref_opt = torch.optim.SGD(refs.parameters(), lr=0.2, momentum=0.5)
        worst = {"loss": 0.0, "norm": 0.0, "weights": 0.0}
        for step in range(2):
            x, target = _fixed((2, seq, dim), 10 + step), _fixed((2, seq, dim), 20 + step)
            opt.zero_grad()
            first = (x.chunk(2, dim=1)[tp_rank].contiguous() if sequence_parallel else x,)
            loss = runner.step(*(first if stage_index == 0 else ()),
                               target=target if stage_index == 1 else None)
            mp.reduce_sequence_parallel_grads(part)
            norm = mp.clip_grad_norm(part.parameters(), clip) if clip else None
            opt.step()
            ref_opt.zero_grad()
            ref_loss = sum(((refs(xc) - tc) ** 2).mean()
                           for xc, tc in zip(x.chunk(chunks), target.chunk(chunks))) / chunks
            ref_loss.backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(refs.parameters(), clip) if clip else None
            ref_opt.step()
            if loss is not None:
                if sequence_parallel:  # both ranks of this tensor-parallel group hold a share
                    loss = _gather_tp(loss.reshape(1), 0).sum()
                worst["loss"] = max(worst["loss"], _loss_diff(loss, ref_loss))
            if clip:
                worst["norm"] = max(worst["norm"], _rel_diff(norm, ref_norm))
        for block, ref in zip(part, local_refs):
            worst["weights"] = max(worst["weights"], _rel_diff(block.norm.weight, ref.norm.weight),
                                   _worst_param_diff([block.column, block.row],
                                                     [ref.column, ref.row], grads=False))
        return worst
    finally:
        mp.destroy_model_parallel()


def world4_matrix() -> dict:
    """Everything world 4 checks, in one call (one round trip to the ranks)."""
    return {
        "linear": {tp: linear_matrix(tp, 10, MATRIX_SEED + tp) for tp in (1, 2, 4)},
        "embedding": {tp: embedding_matrix(tp, 10, MATRIX_SEED + 10 + tp) for tp in (2, 4)},
        "bad_input": bad_input(4),
        "state": state_round_trips(4, MATRIX_SEED),
        "data_parallel": [(case, data_parallel_case(*case)) for case in DP_CASES],
        "pipeline": [(case, pipeline_case(*case))
                     for case in (("gpipe", 2, True, 0.1), ("1f1b", 1, False, 0.1),
                                  ("1f1b", 2, True, None))],
    }


def padded_gpt_loss(tp: int) -> dict:
    """TensorParallelGPT's loss and gradients with padded targets (-100, the ignore_index of
    F.cross_entropy) against the reference GPT's, with and without sequence parallelism."""
    cfg = GPTConfig(vocab_size=16, n_layer=1, n_head=4, d_model=8, seq_len=8)
    idx, target = synthetic_batch(cfg, 2, 0)
    target[0, 5:] = -100
    target[1, 7] = -100
    ref = GPT(cfg)
    want = ref.loss(idx, target)
    want.backward()
    want_grads = dict(ref.named_parameters())
    diffs = {}
    for sp in (False, True):
        mp.initialize_model_parallel(tp)
        try:
            model = TensorParallelGPT(cfg, sequence_parallel=sp)
            load_full_model_state_dict(model, from_reference_state_dict(ref.state_dict(), cfg))
            got = model.loss(idx, target)
            got.backward()
            model.reduce_sequence_parallel_grads()
            for p in model.parameters():
                p.data = p.grad  # full_model_state_dict then joins the gradients
            grads = to_reference_state_dict(full_model_state_dict(model), cfg)
        finally:
            mp.destroy_model_parallel()
        diffs[f"sp={sp} loss"] = _loss_diff(got, want)
        diffs[f"sp={sp} grads"] = max(_rel_diff(g, want_grads[k].grad) for k, g in grads.items())
    return diffs


def small_world_matrix(tp: int, cases: int) -> dict:
    return {"linear": linear_matrix(tp, cases, MATRIX_SEED + 100 + tp),
            "embedding": embedding_matrix(tp, cases, MATRIX_SEED + 200 + tp),
            "bad_input": bad_input(tp), "padded_gpt_loss": padded_gpt_loss(tp)}


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def matrix4(world4):
    return world4.run(world4_matrix)


@pytest.fixture(scope="module")
def matrix2(world2):
    return world2.run(small_world_matrix, 2, 14)


@pytest.fixture(scope="module")
def matrix1(world1):
    return world1.run(small_world_matrix, 1, 10)


@pytest.mark.parametrize("tp", (1, 2, 4))
def test_linear_layers_train_as_the_unsplit_model(matrix4, tp):
    for res in matrix4:
        _check_linear_results(res["linear"][tp])


@pytest.mark.parametrize("tp", (2, 4))
def test_embeddings_and_cross_entropy_train_as_torch(matrix4, tp):
    for res in matrix4:
        _check_embedding_results(res["embedding"][tp])


def test_small_worlds_match_too(matrix1, matrix2):
    for res in matrix1 + matrix2:
        _check_linear_results(res["linear"])
        _check_embedding_results(res["embedding"])


def test_gpt_loss_ignores_padded_targets_as_the_reference(matrix1, matrix2):
    for res in matrix1 + matrix2:
        diffs = res["padded_gpt_loss"]
        assert all(d <= TOL[torch.float32] for d in diffs.values()), diffs


def test_misuse_is_a_clear_error_before_any_collective(matrix1, matrix2, matrix4):
    _check_bad_input([res["bad_input"] for res in matrix1 + matrix2 + matrix4])


def test_unsplit_state_moves_between_tensor_parallel_sizes(matrix4):
    for res in matrix4:
        for shape, diffs in res["state"]:
            assert all(d <= TOL[torch.float32] for d in diffs.values()), (shape, diffs)


def test_tensor_x_data_parallel_wrappers_match_one_process(matrix4):
    for res in matrix4:
        for case, worst in res["data_parallel"]:
            assert all(d <= TOL[torch.float32] for d in worst.values()), (case, worst)


def test_tensor_x_pipeline_parallel_matches_one_process(matrix4):
    for rank, res in enumerate(matrix4):
        for case, worst in res["pipeline"]:
            assert all(d <= TOL[torch.float32] for d in worst.values()), (rank, case, worst)
