"""What the planner (:mod:`shardkit.plan`) learns from a real module: its parameter count, the
sizes of the FSDP units an auto-wrap would make, and the transformer shape the activation
estimate needs; plus :class:`PlanError`, the planner's one error for bad input. Builds the model
on the CPU once; no communication.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Optional

__all__ = ["PlanError", "ModelSummary", "RankLayout", "load_factory_module", "fsdp_unit_sizes",
           "rank_layout", "summarize_model", "estimate_activation_bytes", "fp32_elements",
           "has_non_fp32_parameters"]


class PlanError(ValueError):
    """Bad input to the planner; the message names the argument, the value and what is valid."""


@dataclass(frozen=True)
class ModelSummary:
    """What the planner learns from a real module: parameter count, largest FSDP unit, and the
    transformer shape the activation estimate needs (zeros where it could not be found)."""

    params: int
    largest_unit_params: int
    num_units: int
    num_blocks: int
    hidden: int
    heads: int
    vocab: int
    root_unit_params: int = 0  # parameters left to the root unit (gathered once per step)
    # Parameters that train (``requires_grad``; -1: not counted, read as ``params``), and the
    # parameters of the FSDP units holding at least one of them: FSDP keeps a gradient shard
    # (and reduce-scatters it) for every parameter of such a unit, frozen ones included.
    trainable_params: int = -1
    grad_unit_params: int = -1


def load_factory_module(spec: str):
    """Import ``pkg.module:factory`` and call ``factory()``; returns the ``nn.Module``."""
    import torch.nn as nn

    if ":" not in spec:
        raise PlanError(f"--model {spec!r} is not of the form 'pkg.module:factory' (a module "
                        f"import path, a colon, then a callable returning an nn.Module)")
    module_path, attr = spec.split(":", 1)
    try:
        module = _import_from_working_directory_too(module_path)
    except Exception as e:  # any failure to import is the user's input, reported in one line
        raise PlanError(f"--model {spec!r}: module {module_path!r} does not import "
                        f"({type(e).__name__}: {e})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise PlanError(f"--model {spec!r}: {module_path!r} has no callable {attr!r}")
    try:
        model = factory()
    except Exception as e:  # the factory is the user's code: one line, not a traceback
        raise PlanError(f"--model {spec!r}: {attr}() raised {type(e).__name__}: {e} (the "
                        f"factory is called with no arguments)") from None
    if not isinstance(model, nn.Module):
        raise PlanError(f"--model {spec!r}: {attr}() returned {type(model).__name__}, "
                        f"not an nn.Module")
    return model


def _import_from_working_directory_too(module_path: str):
    """``importlib.import_module(module_path)``, also finding a module in the working
    directory (``mymodel:build`` beside the user) as ``python -m shardkit plan`` does: the
    installed ``shardkit`` command does not put that directory on ``sys.path``, so it is put
    there first, where ``python -m`` puts it (as uvicorn and gunicorn do for ``module:attr``):
    a file of the user's that shares a name with an installed module is the one planned by
    both commands alike."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        # Note: first, not last: last, an installed module of the same name was planned in
        # place of the user's file (silently, where it had a callable of that name too)
        sys.path.insert(0, cwd)
    return importlib.import_module(module_path)


def fsdp_unit_sizes(model, wrap_block: Optional[str] = None,
                    min_num_params: Optional[int] = None) -> list[int]:
    """Parameters held by each FSDP unit when ``model`` is auto-wrapped, root unit last.

    ``wrap_block``: every module whose class name is ``wrap_block`` becomes a unit (FSDP's
    ``transformer_auto_wrap_policy``). ``min_num_params``: a module becomes a unit when the
    parameters not already in a unit below it number at least ``min_num_params`` (FSDP's
    ``default_auto_wrap_policy``: children first, never a ``ModuleList``/``ModuleDict``). The
    root unit holds whatever remains. A parameter shared between modules counts in the first
    unit that owns it. The units are those :func:`shardkit.nn.wrap.auto_wrap` builds (a dry
    run of it: nothing is wrapped). Both given is a :class:`PlanError` (auto_wrap takes one
    policy), here and in :func:`rank_layout` and :func:`summarize_model`.
    """
    return [sum(p.numel() for p in unit)
            for unit in _fsdp_unit_params(model, wrap_block, min_num_params)]


def _fsdp_units(model, wrap_block: Optional[str] = None, min_num_params: Optional[int] = None,
                in_fp32_elements: bool = False) -> list[tuple[float, float]]:
    """``(parameters, trainable parameters)`` of each unit of :func:`fsdp_unit_sizes`, in
    :func:`fp32_elements` with ``in_fp32_elements``."""
    size = fp32_elements if in_fp32_elements else _numel
    return [(sum(size(p) for p in unit), sum(size(p) for p in unit if p.requires_grad))
            for unit in _fsdp_unit_params(model, wrap_block, min_num_params)]


def fp32_elements(p) -> float:
    """``p``'s elements weighted by its dtype's size against fp32's 4 bytes (a bf16 element
    counts 0.5, an fp64 one 2): what it weighs in the planner's byte formulas, whose W, G and
    K are per fp32 element, when the model is trained in the parameters' own dtypes (torch's
    optimizers keep their state in each parameter's dtype)."""
    return p.numel() * p.element_size() / 4


def _numel(p) -> int:
    return p.numel()


def has_non_fp32_parameters(model) -> bool:
    """Whether any parameter of ``model`` is not fp32 (a model loaded in bf16, an fp64
    layer): then its bytes differ from the fp32 formulas' (:func:`fp32_elements`)."""
    import torch
    return any(p.dtype != torch.float32 for p in model.parameters())


def _fsdp_unit_params(model, wrap_block: Optional[str] = None,
                      min_num_params: Optional[int] = None) -> list[list]:
    """The distinct parameters of each unit of :func:`fsdp_unit_sizes`, root unit last: a dry
    run of :func:`shardkit.nn.wrap.auto_wrap` with the policy the flags name
    (:func:`~shardkit.nn.wrap.transformer_auto_wrap_policy` of the classes named
    ``wrap_block``, or :func:`~shardkit.nn.wrap.default_auto_wrap_policy` with
    ``min_num_params``, which never wraps a ``ModuleList`` and keeps tied weights in one unit),
    so that the planned units are the ones FSDP builds."""
    import functools

    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.wrap import default_auto_wrap_policy, transformer_auto_wrap_policy
    from shardkit.nn.wrap.auto_wrap import planned_units

    _check_one_wrap_policy(wrap_block, min_num_params)
    if wrap_block is not None:
        blocks = {type(m) for m in model.modules() if type(m).__name__ == wrap_block}
        policy = transformer_auto_wrap_policy(blocks)
    elif min_num_params is not None:
        policy = functools.partial(default_auto_wrap_policy, min_num_params=min_num_params)
    else:
        return [list(_distinct(model.parameters()))]  # the root is the one unit
    return [own for _, own in planned_units(model, policy, FullyShardedDataParallel)]


def _check_one_wrap_policy(wrap_block: Optional[str], min_num_params: Optional[int]) -> None:
    """:class:`PlanError` when both policies are named: ``auto_wrap`` takes one policy, so
    the planned units would follow one of them only (as ``--wrap-block`` and
    ``--min-num-params`` together are refused)."""
    if wrap_block is not None and min_num_params is not None:
        raise PlanError(f"wrap_block={wrap_block!r} and min_num_params={min_num_params!r}: give "
                        f"at most one wrap policy (the block class whose modules become FSDP "
                        f"units, or the parameter count of FSDP's size policy), not both")


@dataclass(frozen=True)
class RankLayout:
    """What the wrappers really hold at ``world_size`` ranks, from the model's shapes (no
    communication, no wrapper built):

    - ``padded_params``, ``padded_trainable``, ``padded_grad_units``, ``padded_root``: stage 3's
      Ψ', Ψ'_t, Ψ'_g and root unit with FSDP's padding (each parameter cut into ``world_size``
      dim-0 blocks of ``ceil(rows / N)`` rows);
    - ``oss_numel_per_rank``: trainable elements each rank owns under OSS's whole-parameter
      partition (stages 1-2; :func:`shardkit.optim.partition.plan_ownership`, the one
      ownership algorithm), whose largest entry can exceed Ψ_t/N by up to one parameter;
    - ``oss_sync_padding``: the elements by which OSS's flat parameter-sync buckets pad their
      segments (:mod:`shardkit.optim.param_sync`, at most 3% of a bucket); every rank holds
      the whole buffers, so every rank holds this padding beside its weights.
    """

    world_size: int
    padded_params: int
    padded_trainable: int
    padded_grad_units: int
    padded_root: int
    oss_numel_per_rank: tuple
    oss_sync_padding: float = 0


def rank_layout(model, world_size: int, wrap_block: Optional[str] = None,
                min_num_params: Optional[int] = None,
                in_fp32_elements: bool = False) -> RankLayout:
    """The :class:`RankLayout` of ``model`` at ``world_size`` ranks (stage 3 units as
    :func:`fsdp_unit_sizes` finds them), every count in :func:`fp32_elements` with
    ``in_fp32_elements`` (the partitions themselves stay by elements, as the wrappers cut
    them). Costs a pass over the parameters' shapes."""
    from shardkit.checkpoint.resharding import ParamLayout
    from shardkit.optim.partition import plan_ownership

    def scale(p):  # the weight of one element of p in the counts
        return p.element_size() / 4 if in_fp32_elements else 1

    def padded(p):
        return ParamLayout(p.shape, world_size).chunk_numel * world_size * scale(p)

    units = _fsdp_unit_params(model, wrap_block, min_num_params)
    trainable = [p for p in _distinct(model.parameters()) if p.requires_grad]
    owned, sync_padding = [0] * world_size, 0
    if trainable:
        ownership = plan_ownership([trainable], world_size)
        partition = ownership.partition
        owned = [sum(p.numel() * scale(p) for group in partition.params_of(rank) for p in group)
                 for rank in range(world_size)]
        sync_padding = _sync_bucket_padding(ownership, trainable, scale)
    return RankLayout(
        world_size=world_size,
        padded_params=sum(padded(p) for unit in units for p in unit),
        padded_trainable=sum(padded(p) for unit in units for p in unit if p.requires_grad),
        padded_grad_units=sum(padded(p) for unit in units
                              if any(q.requires_grad for q in unit) for p in unit),
        padded_root=sum(padded(p) for p in units[-1]),
        oss_numel_per_rank=tuple(owned), oss_sync_padding=sync_padding)


def _sync_bucket_padding(ownership, trainable: list, scale) -> float:
    """Elements (weighted by ``scale``) by which OSS's parameter-sync buckets of
    ``ownership`` pad their segments: per bucket and parameter dtype, the segments are padded
    to the widest owner's load where :mod:`shardkit.optim.param_sync` chooses to (none in a
    world of one: nothing is synchronised)."""
    from shardkit.optim.param_sync import _segment_numels

    world_size = ownership.partition.world_size
    if world_size == 1:
        return 0
    loads: dict = {}  # (bucket, device, dtype) -> per-rank elements, as build_buckets groups
    weight: dict = {}
    for p in trainable:
        key = (ownership.bucket_of[id(p)], p.device, p.dtype)
        loads.setdefault(key, [0] * world_size)[ownership.partition.owner(p)] += p.numel()
        weight[key] = scale(p)
    return sum((sum(_segment_numels(per_rank)) - sum(per_rank)) * weight[key]
               for key, per_rank in loads.items())


def _distinct(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def summarize_model(model, wrap_block: Optional[str] = None,
                    min_num_params: Optional[int] = None,
                    in_fp32_elements: bool = False) -> ModelSummary:
    """Count ``model``'s parameters and find its largest FSDP unit and transformer shape.
    With ``in_fp32_elements`` the parameter counts are :func:`fp32_elements` (the sizes the
    byte formulas take for a model trained in its own dtypes)."""
    import torch.nn as nn

    def count_params(params) -> float:
        size = fp32_elements if in_fp32_elements else _numel
        return sum(size(p) for p in _distinct(params))

    if wrap_block is not None and not any(type(m).__name__ == wrap_block
                                          for m in model.modules()):
        found = sorted({type(m).__name__ for m in model.modules()})
        raise PlanError(f"--wrap-block {wrap_block!r} matches no submodule; the model's module "
                        f"classes are {', '.join(found)}")
    unit_counts = _fsdp_units(model, wrap_block, min_num_params, in_fp32_elements)
    units = [size for size, _ in unit_counts]
    blocks = [m for m in model.modules() if wrap_block and type(m).__name__ == wrap_block]
    hidden = heads = 0
    if blocks:
        norms = [m for m in blocks[0].modules() if isinstance(m, nn.LayerNorm)]
        linears = [m for m in blocks[0].modules() if isinstance(m, nn.Linear)]
        hidden = norms[0].normalized_shape[-1] if norms else (
            linears[0].in_features if linears else 0)
        heads = _attention_heads(model, blocks[0]) or max(1, hidden // 64)
    return ModelSummary(params=count_params(model.parameters()),
                        largest_unit_params=max(units), num_units=len(units),
                        num_blocks=len(blocks), hidden=hidden, heads=heads,
                        vocab=_vocabulary_size(model),
                        root_unit_params=units[-1],
                        trainable_params=count_params(p for p in model.parameters()
                                                      if p.requires_grad),
                        grad_unit_params=sum(size for size, trained in unit_counts if trained))


# Where models keep their attention head count: shardkit's and GPT-2's blocks (n_head,
# num_heads), T5's (n_heads), BERT's and Hugging Face configs (num_attention_heads).
_HEAD_ATTRIBUTES = ("n_head", "num_heads", "n_heads", "num_attention_heads")


def _attention_heads(model, block) -> int:
    """The query heads of ``block``'s attention: an attribute of one of its modules, else of
    the configuration a module or the model carries (Llama's attention layer keeps only its
    ``config``); 0 when none says."""
    modules = list(block.modules())
    holders = modules + [getattr(m, "config", None) for m in modules + [model]]
    for holder in holders:
        for attribute in _HEAD_ATTRIBUTES:
            value = getattr(holder, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def _vocabulary_size(model) -> int:
    """The logits' width: the rows of the model's input token embedding where it names one
    (Hugging Face's ``get_input_embeddings()``; its position embeddings can be larger in a
    small vocabulary), else the largest ``nn.Embedding``; 0 without embeddings."""
    import torch.nn as nn

    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            tokens = getter()
        except (NotImplementedError, AttributeError):  # a model class that does not say
            tokens = None
        if isinstance(tokens, nn.Embedding):
            return tokens.num_embeddings
    embeddings = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return max(embeddings) if embeddings else 0


def estimate_activation_bytes(summary: ModelSummary, batch: int, seq_len: int,
                              mixed_precision: bool, fused_attention: bool = True) -> float:
    """Activation memory one rank keeps for backward, for ``batch`` sequences of ``seq_len``.

    Per transformer block, without recomputation, the estimate of Korthikanti et al. (2022,
    "Reducing Activation Recomputation in Large Transformer Models") in 16-bit activations:
    ``s·b·h·(34 + 5·a·s/h)`` bytes (s sequence, b batch, h hidden, a heads), doubled for fp32.
    Fused attention (torch's ``scaled_dot_product_attention``, flash attention) keeps no
    ``a·s·s`` score matrices, so with ``fused_attention`` (the default) the ``5·a·s/h`` term is
    left out. Plus the logits and their log-softmax for the loss, ``2·b·s·V·4`` bytes (fp32).
    The block count, h and a come from the ``--wrap-block`` modules, V from the largest
    embedding. For the reference GPT (batch 4, seq 128, fp32) this gives 140 MB where the
    tensors autograd saves measure 120 MB: a deliberate over-estimate of about 17%.
    Returns 0 when the model's shape could not be read (no ``--wrap-block``).
    """
    if not summary.num_blocks or not summary.hidden:
        return 0.0
    s, b, h, a = seq_len, batch, summary.hidden, summary.heads
    scores = 0.0 if fused_attention else 5 * a * s / h
    per_block = s * b * h * (34 + scores) * (1 if mixed_precision else 2)
    logits = 2 * b * s * summary.vocab * 4
    return summary.num_blocks * per_block + logits
