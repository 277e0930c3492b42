"""``python -m shardkit plan``: per-rank memory of each ZeRO stage, before you launch anything.

By the formulas of DESIGN.md (Ψ parameters, N data-parallel ranks, per parameter W bytes of
weights, G bytes of gradients and K bytes of optimizer state)::

    stage 0  DDP               (W + G + K)Ψ
    stage 1  OSS               (W + G)Ψ + KΨ/N
    stage 2  ShardedDDP + OSS  WΨ + (G + K)Ψ/N          (+ one reduce bucket while reducing)
    stage 3  FSDP              (W + G + K)Ψ/N           (+ the unit being computed, unsharded)

Wire per step (elements, :func:`zero_comm_elements_per_step`): stage 0 ``2Ψ(N-1)/N``, stage 1
(OSS under DDP) ``3Ψ(N-1)/N``, stage 2 ``2Ψ(N-1)/N``, stage 3 ``3Ψ(N-1)/N``.

fp32 training: W = G = 4 and K = 8 for Adam/AdamW (two moments), 4 for SGD with momentum.
Mixed precision: W = G = 2 and K = 12 for Adam/AdamW (fp32 master weights + two moments),
8 for SGD (master weights + momentum). ``--params 7.5e9 --world-size 64 --mixed-precision``
reproduces the ZeRO paper's example: 120.0 GB, 31.4 GB, 16.6 GB, 1.9 GB (GB = 1e9 bytes).

``--model pkg.module:factory`` calls ``factory()`` for an ``nn.Module``, counts its real
parameters (tied weights once) and finds the largest FSDP unit under a wrap policy
(``--wrap-block ClassName``: every instance of that class is a unit, like
``transformer_auto_wrap_policy``; or ``--min-num-params``: like ``default_auto_wrap_policy``);
with ``--gpu-memory`` it recommends the lowest stage whose model states, transient buffer and
activations fit. The activation estimate is documented in :func:`estimate_activation_bytes`.
With ``--model`` the rows are what the most loaded rank really holds
(:func:`shardkit.plan_model.rank_layout`): frozen parameters keep weights only (no gradient, no
optimizer state; at stage 3 a unit that trains at all keeps a gradient shard for all of its
parameters), stages 1-2 the rank holding the most under OSS's whole-parameter partition
(with the padding of OSS's sync buckets, which every rank holds), stage 3 FSDP's rows padded
to a multiple of N; without ``--mixed-precision`` a parameter not in fp32 (a model loaded in
bf16, an fp64 layer) holds its weight, gradient and optimizer state in its own dtype
(``fp32_equivalent_params`` in JSON: the fp32 count of the same bytes);
``formula_model_states`` (JSON) keeps the ZeRO formula. ``tests/test_plan_matrix.py`` checks
both against storages and ``CommCounter``.

Costs: no communication, no process group; ``--model`` builds the model once on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Optional

from shardkit.plan_model import (ModelSummary, PlanError, RankLayout, estimate_activation_bytes,
                                 has_non_fp32_parameters, load_factory_module, rank_layout,
                                 summarize_model)

__all__ = ["Precision", "StageMemory", "ModelSummary", "precision_for", "zero_model_state_bytes",
           "zero_comm_elements_per_step", "pipeline_comm_elements", "zeropp_traffic",
           "CommOption", "COMM_OPTIONS", "LinkTraffic", "link_traffic", "link_traffic_table",
           "stage_table", "summarize_model", "estimate_activation_bytes", "recommend_stage",
           "parse_size", "format_bytes", "FP32_ADAMW", "main"]

STAGES = (0, 1, 2, 3)
STAGE_WRAPPERS = {0: "DDP", 1: "OSS", 2: "ShardedDDP + OSS", 3: "FSDP"}
OPTIMIZERS = ("adam", "adamw", "sgd")
# Bytes of one ShardedDataParallel reduce bucket (its reduce_buffer_size default, FairScale's
# unit: bytes in the gradients' dtype).
DEFAULT_REDUCE_BUCKET_BYTES = 2 ** 23
# Bytes of one torch DDP bucket (its bucket_cap_mb default, 25 MiB), stage 1's reducer.
DDP_BUCKET_BYTES = 25 * 2 ** 20


# ----------------------------------------------------------------------------- formulas


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: ``weights`` W, ``grads`` G, ``optimizer`` K (see module docstring)."""

    weights: int
    grads: int
    optimizer: int
    label: str


def precision_for(optimizer: str = "adam", mixed_precision: bool = False) -> Precision:
    """W, G and K for ``optimizer`` in fp32 or mixed precision (DESIGN.md's K)."""
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"--optimizer {optimizer!r} is unknown; valid optimizers are "
                        f"{', '.join(OPTIMIZERS)}")
    moments = 8 if optimizer in ("adam", "adamw") else 4
    if mixed_precision:
        return Precision(2, 2, 4 + moments, f"{optimizer}, mixed precision")
    return Precision(4, 4, moments, f"{optimizer}, fp32")


# fp32 training with AdamW: what the demo, the benchmarks and the engine's tests measure.
FP32_ADAMW = precision_for("adamw", mixed_precision=False)


def zero_model_state_bytes(params: float, world_size: int, stage: int,
                           precision: Precision, trainable: Optional[float] = None,
                           grad_unit_params: Optional[float] = None,
                           largest_owned: Optional[float] = None) -> float:
    """Per-rank bytes of weights + grads + optimizer state for ZeRO ``stage`` (DESIGN.md).

    ``trainable`` (Ψ_t, default Ψ): the parameters that train. Frozen ones hold weights only:
    no gradient, no optimizer state, so Ψ_t replaces Ψ in the G and K terms. Stage 3 is the
    exception for gradients: FSDP keeps a gradient shard for every parameter of a unit that
    trains at all, ``grad_unit_params`` (Ψ_g, default Ψ_t). With every parameter trainable
    these are the table's formulas. Not counted: torch's per-tensor ``step`` count (4 bytes
    per trainable tensor for Adam/AdamW), stage 2's presence flag per owned gradient (one
    element of its dtype, kept in the storage the gradient arrived in), FSDP's padding (use
    the padded Ψ for it) and OSS's sync-bucket padding (``stage_table`` adds it).

    ``largest_owned`` (stages 1-2): the trainable elements the most loaded rank owns under
    OSS's whole-parameter partition (:func:`shardkit.plan_model.rank_layout`), which replaces
    the ideal Ψ_t/N: the figure of that rank, the one that must fit."""
    if stage not in STAGES:
        raise PlanError(f"stage {stage!r} is unknown; valid stages are {list(STAGES)}")
    w, g, k, n = precision.weights, precision.grads, precision.optimizer, world_size
    t = params if trainable is None else trainable
    if stage == 0:
        return w * params + (g + k) * t
    owned = t / n if largest_owned is None else largest_owned
    if stage == 1:
        return w * params + g * t + k * owned
    if stage == 2:
        return w * params + (g + k) * owned
    grads = t if grad_unit_params is None else grad_unit_params
    return (w * params + g * grads + k * t) / n


def zero_formula_text(stage: int) -> str:
    """The stage's formula in W, G, K, Ψ, N (as printed by ``plan``)."""
    return {0: "(W+G+K)Ψ", 1: "(W+G)Ψ + KΨ/N", 2: "WΨ + (G+K)Ψ/N", 3: "(W+G+K)Ψ/N"}[stage]


def zero_comm_elements_per_step(params: float, world_size: int, stage: int,
                                padded_params: Optional[float] = None,
                                root_params: float = 0.0, trainable: Optional[float] = None,
                                grad_unit_params: Optional[float] = None) -> float:
    """Elements one rank puts on the wire per step with shardkit's stage wrappers
    (:func:`shardkit.recipes.compose`), ring convention of :mod:`shardkit.distributed`:

    - stage 0, DDP: gradient all-reduce ``2Ψ(N-1)/N``;
    - stage 1, OSS under DDP: all-reduce ``2Ψ(N-1)/N`` + parameter sync ``Ψ'(N-1)/N``, so
      ``3Ψ(N-1)/N``;
    - stage 2, ShardedDDP + OSS: gradients reduced to their owner ``Ψ(N-1)/N`` + parameter sync
      ``Ψ'(N-1)/N``, so ``2Ψ(N-1)/N``;
    - stage 3, FSDP: all-gather in forward and in backward and a reduce-scatter,
      ``3Ψ'(N-1)/N``, less one gather of the root unit's ``root_params`` (kept gathered from
      forward into backward).

    ``padded_params`` (Ψ', default Ψ) is what the wrapper's flat buffers hold, padding included.

    Frozen parameters: stages 0-2 reduce and re-sync only the ``trainable`` ones (Ψ_t, default
    Ψ; Ψ' then stands for their padded count); stage 3 gathers every parameter and
    reduce-scatters the units that train at all, ``grad_unit_params`` (Ψ_g, default Ψ_t, or Ψ'
    when ``padded_params`` is given and every parameter trains). Not counted: the few side
    elements per parameter (presence flags, use counts) that ride on the reductions.
    """
    if stage not in STAGES:
        raise PlanError(f"stage {stage!r} is unknown; valid stages are {list(STAGES)}")
    t = params if trainable is None else trainable
    padded = (params if stage == 3 else t) if padded_params is None else padded_params
    if stage == 3:
        reduced = (padded if trainable is None else t) if grad_unit_params is None \
            else grad_unit_params
        elements = 2 * padded - root_params + reduced
    else:
        elements = {0: 2 * t, 1: 2 * t + padded, 2: t + padded}[stage]
    return elements * (world_size - 1) / world_size


def pipeline_comm_elements(boundary_numel: float, rank: int, world_size: int,
                           chunks: int = 1, grad_tensors: int = 1) -> float:
    """Elements pipeline rank ``rank`` of ``world_size`` sends per step: ``boundary_numel``
    (one step's activations crossing one stage boundary) forward to the next stage, with the
    step state (``StepState.BITS`` elements riding on micro-batch 0), and the same number of
    gradients back to the previous one, each of the ``chunks`` gradient messages with one
    presence flag per tensor (``GRADIENT_FLAGS`` for each of ``grad_tensors``, the tensors of
    one micro-batch's activation that require grad); the last message each way carries the
    step's verdict (``VERDICT_ELEMENTS``), and the training step ends with the final verdict
    settled through rank 0 (``SETTLE_ELEMENTS`` from every other rank to rank 0 and from rank 0
    to each)."""
    from shardkit.nn.pipe.p2p import GRADIENT_FLAGS, SETTLE_ELEMENTS, VERDICT_ELEMENTS, StepState
    forward, backward = rank < world_size - 1, rank > 0
    settle = SETTLE_ELEMENTS * ((world_size - 1) if rank == 0 else 1) if world_size > 1 else 0
    return (forward + backward) * (boundary_numel + VERDICT_ELEMENTS) \
        + forward * StepState.BITS + backward * chunks * grad_tensors * GRADIENT_FLAGS + settle


# Bytes per element of ZeRO++'s quantized transfers with blocks of 256 and fp32 scales
# (shardkit.quantized_transport): int8 weights 1 + 4/256, int4 gradients 0.5 + 4/256.
QWZ_BYTES = 1 + 4 / 256
QGZ_BYTES = 0.5 + 4 / 256


def zeropp_traffic(params: float, world_size: int, precision: Precision,
                   root_params: float = 0.0) -> dict[str, float]:
    """Bytes one rank puts on the wire per stage-3 step for each communication option of FSDP:
    ``fp32`` (plain: two all-gathers of W-byte weights, one reduce-scatter of G-byte
    gradients, each ``Ψ(N-1)/N`` elements), ``qwZ`` (int8 weight gathers), ``qgZ`` (int4
    gradient reduce-scatter) and ``qwZ+qgZ``. The root unit's ``root_params`` are gathered
    once (kept from forward into backward), as :func:`link_traffic` counts them. Ignores the
    up to one block of padding per unit's segment (small for large models)."""
    elements = params * (world_size - 1) / world_size
    gathered = (2 * params - root_params) * (world_size - 1) / world_size
    gathers = {False: precision.weights, True: QWZ_BYTES}
    reduce = {False: precision.grads, True: QGZ_BYTES}
    options = {"fp32": (False, False), "qwZ": (True, False), "qgZ": (False, True),
               "qwZ+qgZ": (True, True)}
    return {name: gathered * gathers[qw] + elements * reduce[qg]
            for name, (qw, qg) in options.items()}


@dataclass(frozen=True)
class CommOption:
    """One way to run FSDP's collectives: int8 weight gathers (``qwz``), int4 hierarchical
    gradient reduction (``qgz``), hpZ's node-sized secondary weight partition (``hpz``), or
    HYBRID_SHARD (``hybrid``: shard inside the node, all-reduce the shard across nodes)."""

    qwz: bool = False
    qgz: bool = False
    hpz: bool = False
    hybrid: bool = False


COMM_OPTIONS = {
    "fp32": CommOption(),
    "qwZ": CommOption(qwz=True),
    "qgZ": CommOption(qgz=True),
    "hpZ": CommOption(hpz=True),
    "qwZ+qgZ": CommOption(qwz=True, qgz=True),
    "qwZ+hpZ": CommOption(qwz=True, hpz=True),
    "hpZ+qgZ": CommOption(qgz=True, hpz=True),
    "qwZ+hpZ+qgZ": CommOption(qwz=True, qgz=True, hpz=True),
    "HYBRID": CommOption(hybrid=True),
    "HYBRID+qwZ+qgZ": CommOption(qwz=True, qgz=True, hybrid=True),
}


@dataclass(frozen=True)
class LinkTraffic:
    """Bytes one rank puts on the wire per step, split as ``CommCounter`` splits them: ops on
    groups inside one node (``intra_node``) and ops on groups spanning nodes (``inter_node``)."""

    intra_node: float
    inter_node: float

    @property
    def total(self) -> float:
        """Bytes on both kinds of link together."""
        return self.intra_node + self.inter_node


def _ring(full_elements: float, group_size: int) -> float:
    """Elements one rank sends in an all-gather / reduce-scatter of ``full_elements``."""
    return full_elements * (group_size - 1) / group_size


def link_traffic(params: float, ranks_per_node: int, nodes: int, precision: Precision,
                 option: CommOption, root_params: float = 0.0) -> LinkTraffic:
    """Per-link bytes per stage-3 step for one rank, n = ``ranks_per_node`` ranks on each of
    k = ``nodes`` nodes (N = nk), Ψ = ``params``, of which ``root_params`` sit in the root unit
    (gathered once per step: it is kept from forward to backward; every other unit twice).

    Weight gathers move W bytes per element (``precision.weights``) or, with qwZ, int8 plus one
    fp32 scale per 256 (``QWZ_BYTES``); gradients G bytes or, with qgZ, int4 plus scales
    (``QGZ_BYTES``). Over the whole group (spanning nodes when k > 1):

    - plain: gathers ``(2Ψ_r + R)(N-1)/N``, reduce-scatter ``Ψ(N-1)/N`` (Ψ_r = Ψ - R);
    - hpZ (n > 1): the forward gather ``Ψ(N-1)/N`` over the group, the backward gather
      ``Ψ_r(n-1)/n`` inside the node, always W bytes per element (exact even with qwZ, so
      backward sees the forward's weights);
    - qgZ with n > 1 and k > 1 (hierarchical): ``Ψ(n-1)/n`` inside the node, then
      ``(Ψ/n)(k-1)/k`` across nodes; otherwise one flat exchange over the group;
    - HYBRID: gathers and reduce-scatter inside the node (``(n-1)/n``), then an all-reduce of
      the G-byte gradient shard across nodes, ``2(Ψ/n)(k-1)/k``.

    Ignores padding (to a multiple of N per unit, to whole blocks per quantized chunk): a few
    per cent on models of large matrices. Costs nothing (arithmetic)."""
    n, k = ranks_per_node, nodes
    if n < 1 or k < 1:
        raise PlanError(f"ranks_per_node={n} and nodes={k} must both be at least 1")
    weight_bytes = QWZ_BYTES if option.qwz else precision.weights
    grad_bytes = QGZ_BYTES if option.qgz else precision.grads
    resharded = params - root_params
    gathered = 2 * resharded + root_params
    links = {"intra": 0.0, "inter": 0.0}
    spanning = "inter" if k > 1 else "intra"  # the link class of a group holding all N ranks
    if option.hybrid:
        links["intra"] += _ring(gathered, n) * weight_bytes + _ring(params, n) * grad_bytes
        links["inter"] += 2 * _ring(params / n, k) * precision.grads
        return LinkTraffic(links["intra"], links["inter"])
    if option.hpz and n > 1:
        links[spanning] += _ring(params, n * k) * weight_bytes
        links["intra"] += _ring(resharded, n) * precision.weights
    else:
        links[spanning] += _ring(gathered, n * k) * weight_bytes
    if option.qgz and n > 1 and k > 1:
        links["intra"] += _ring(params, n) * grad_bytes
        links["inter"] += _ring(params / n, k) * grad_bytes
    else:
        links[spanning] += _ring(params, n * k) * grad_bytes
    return LinkTraffic(links["intra"], links["inter"])


def link_traffic_table(params: float, ranks_per_node: int, nodes: int, precision: Precision,
                       root_params: float = 0.0) -> dict[str, LinkTraffic]:
    """:func:`link_traffic` for every option of :data:`COMM_OPTIONS`."""
    return {name: link_traffic(params, ranks_per_node, nodes, precision, option, root_params)
            for name, option in COMM_OPTIONS.items()}


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class StageMemory:
    """One row of the plan: per-rank bytes of model states, of the transient buffer the stage
    needs on top (a reduce bucket, an unsharded FSDP unit) and of activations, and the bytes
    each rank puts on the wire per step (gradients' dtype, DESIGN.md's element counts)."""

    stage: int
    wrapper: str
    formula: str
    model_states: float
    transient: float
    activations: float
    comm_per_step: float = 0.0
    formula_model_states: Optional[float] = None  # the ZeRO formula (ideal balance, no padding)

    @property
    def total(self) -> float:
        """Per-rank bytes in all: model states, transient buffer and activations."""
        return self.model_states + self.transient + self.activations


def transient_bytes(stage: int, precision: Precision, params: float,
                    summary: Optional[ModelSummary], world_size: int = 2) -> float:
    """Memory a stage needs beyond its model states while it runs (needs ``--model``), at its
    backward's peak, as measured on CPU (world 2, an MLP of 8 x Linear(1024, 1024): stage 1
    155 MB predicted 153, stage 2 101 / 101, stage 3 82 / 82):

    - stage 1: two of torch DDP's buckets, the one being reduced and its copy in flight
      (``initialize``'s ``reduce_to_owners`` hook packs each bucket and receives the owners'
      parts; without the hook about a sixth of that);
    - stage 2: two ShardedDDP reduce buckets (one reducing while the next fills);
    - stage 3: the gathered unit and the next one prefetched, the unit's full gradient and
      what its reduce-scatter receives (``(N-1)/N`` of it), for the largest unit."""
    if summary is None:
        return 0.0
    gradients = _trainable(params, summary) * precision.grads
    if stage == 1:
        return min(2 * DDP_BUCKET_BYTES, 2 * gradients)
    if stage == 2:
        return min(2 * DEFAULT_REDUCE_BUCKET_BYTES, 2 * gradients)
    if stage == 3:
        received = (world_size - 1) / world_size
        return summary.largest_unit_params * (2 * precision.weights
                                              + (1 + received) * precision.grads)
    return 0.0


def _trainable(params: float, summary: Optional[ModelSummary]) -> float:
    """Ψ_t: the summary's trainable count, else ``params`` (everything trains)."""
    if summary is None or summary.trainable_params < 0:
        return params
    return summary.trainable_params


def _grad_unit_params(params: float, summary: Optional[ModelSummary]) -> float:
    if summary is None or summary.grad_unit_params < 0:
        return _trainable(params, summary)
    return summary.grad_unit_params


def stage_table(params: float, world_size: int, precision: Precision,
                stages=STAGES, summary: Optional[ModelSummary] = None,
                activations: float = 0.0,
                layout: Optional[RankLayout] = None) -> list[StageMemory]:
    """The plan's rows: per-rank memory of each stage in ``stages``. With a model
    ``summary``: its frozen parameters hold weights only, and stage 3's traffic gathers the
    root unit once (as :func:`link_traffic` and the demo count it). With its ``layout`` at
    ``world_size`` (:func:`shardkit.plan_model.rank_layout`), ``model_states`` is the most
    loaded rank's: OSS's whole-parameter owners and sync-bucket padding at stages 1-2, FSDP's
    padded rows at stage 3 (``formula_model_states`` keeps the ZeRO formula)."""
    trainable = _trainable(params, summary)
    grad_units = _grad_unit_params(params, summary)
    root = summary.root_unit_params if summary is not None else 0.0
    rows = []
    for s in stages:
        formula = zero_model_state_bytes(params, world_size, s, precision, trainable,
                                         grad_units)
        states, wire = formula, zero_comm_elements_per_step(
            params, world_size, s, root_params=root if s == 3 else 0.0, trainable=trainable,
            grad_unit_params=grad_units)
        if layout is not None and s in (1, 2):
            states = _most_loaded_oss_rank(params, world_size, s, precision, trainable, layout)
        elif layout is not None and s == 3:
            states = zero_model_state_bytes(layout.padded_params, world_size, 3, precision,
                                            layout.padded_trainable, layout.padded_grad_units)
            wire = zero_comm_elements_per_step(
                params, world_size, 3, padded_params=layout.padded_params,
                root_params=layout.padded_root, trainable=trainable,
                grad_unit_params=layout.padded_grad_units)
        rows.append(StageMemory(stage=s, wrapper=STAGE_WRAPPERS[s],
                                formula=zero_formula_text(s), model_states=states,
                                transient=transient_bytes(s, precision, params, summary,
                                                          world_size),
                                activations=activations, comm_per_step=precision.grads * wire,
                                formula_model_states=formula))
    return rows


def _most_loaded_oss_rank(params: float, world_size: int, stage: int, precision: Precision,
                          trainable: float, layout: RankLayout) -> float:
    """Stage 1 or 2's model states on the rank that owns the most under OSS's partition of
    ``layout``: the ZeRO formula with that rank's owned elements, plus the padding of OSS's
    flat sync buckets, whose weights every rank holds (:mod:`shardkit.optim.param_sync`)."""
    return (zero_model_state_bytes(params, world_size, stage, precision, trainable,
                                   largest_owned=max(layout.oss_numel_per_rank))
            + precision.weights * layout.oss_sync_padding)


def recommend_stage(rows: list[StageMemory], budget: float) -> Optional[StageMemory]:
    """The lowest stage whose total fits ``budget`` bytes (lower stages communicate less and
    recompute nothing), or None."""
    for row in sorted(rows, key=lambda r: r.stage):
        if row.total <= budget:
            return row
    return None


# ----------------------------------------------------------------------------- parsing


_SIZE_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12,
                "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
                "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str, what: str) -> float:
    """``"7.5e9"``, ``"7.5B"``, ``"350M"``, ``"80GB"``, ``"40GiB"`` -> a positive number."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    suffix = m.group(2).lower() if m else None
    if not m or suffix not in _SIZE_SUFFIX or not 0 < float(m.group(1)) < 1e300:
        raise PlanError(f"{what} {text!r} is not a positive number; write e.g. 7.5e9, 350M, "
                        f"7.5B, 80GB or 40GiB")
    return float(m.group(1)) * _SIZE_SUFFIX[suffix]


def parse_stages(text: str) -> tuple[int, ...]:
    """``"0,1,2,3"`` -> (0, 1, 2, 3); an unknown stage is a :class:`PlanError`."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if part not in {str(s) for s in STAGES}:
            raise PlanError(f"--stages: stage {part!r} is unknown; valid stages are "
                            f"{', '.join(map(str, STAGES))}")
        out.append(int(part))
    return tuple(sorted(set(out)))


def format_bytes(n: float) -> str:
    """Bytes with one decimal in decimal units (GB = 1e9), as the ZeRO paper prints them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def format_count(n: float) -> str:
    """A parameter count the way people say it: 7.5B, 27.37M, 530k."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.0f}"


def build_parser() -> argparse.ArgumentParser:
    """The planner's command-line options (validated afterwards by :func:`validate`)."""
    p = argparse.ArgumentParser(
        prog="python -m shardkit plan",
        description="Per-rank model-state memory of ZeRO stages 0-3 (DESIGN.md formulas), "
                    "and the lowest stage that fits a memory budget.")
    src = p.add_argument_group("what to plan for (one of)")
    src.add_argument("--params", help="parameter count Ψ, e.g. 7.5e9 or 350M")
    src.add_argument("--model", metavar="PKG.MODULE:FACTORY",
                     help="count the parameters of FACTORY() (an nn.Module)")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks N")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks on each node (default: all on one node): splits stage 3's "
                        "traffic per option between intra-node and inter-node links")
    p.add_argument("--optimizer", default="adam", help=f"one of {', '.join(OPTIMIZERS)}")
    p.add_argument("--mixed-precision", action="store_true",
                   help="16-bit weights and grads with fp32 master state (K=12 for Adam)")
    p.add_argument("--stages", default="0,1,2,3", help="stages to show (default 0,1,2,3)")
    p.add_argument("--wrap-block", metavar="CLASS",
                   help="with --model: every CLASS instance is one FSDP unit")
    p.add_argument("--min-num-params", type=int,
                   help="with --model: wrap modules holding at least this many parameters")
    p.add_argument("--gpu-memory", help="per-rank memory budget, e.g. 80GB, to recommend a stage")
    p.add_argument("--batch", type=int, default=1, help="per-rank micro-batch (activations)")
    p.add_argument("--seq-len", type=int, default=0, help="sequence length (activations)")
    p.add_argument("--unfused-attention", action="store_true",
                   help="count the attention score matrices in the activation estimate")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--chart", metavar="PNG",
                   help="also draw the rows as a bar chart (matplotlib), figures in .chart.json")
    return p


@dataclass(frozen=True)
class PlanRequest:
    """Validated command-line input of ``plan``."""

    params: Optional[float]
    model: Optional[str]
    world_size: int
    precision: Precision
    stages: tuple
    wrap_block: Optional[str]
    min_num_params: Optional[int]
    gpu_memory: Optional[float]
    batch: int
    seq_len: int
    fused_attention: bool = True
    ranks_per_node: Optional[int] = None


def validate(args) -> PlanRequest:
    """Check every argument before any work; a :class:`PlanError` names what is wrong."""
    if (args.params is None) == (args.model is None):
        raise PlanError("give exactly one of --params (a count such as 7.5e9) or --model "
                        "pkg.module:factory")
    if args.world_size < 1:
        raise PlanError(f"--world-size {args.world_size} must be a positive integer")
    if args.wrap_block is not None and args.min_num_params is not None:
        raise PlanError("give at most one wrap policy: --wrap-block or --min-num-params")
    if args.min_num_params is not None and args.min_num_params < 1:
        raise PlanError(f"--min-num-params {args.min_num_params} must be at least 1")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1
                                            or args.world_size % args.ranks_per_node):
        raise PlanError(f"--ranks-per-node {args.ranks_per_node} must be a positive divisor of "
                        f"--world-size {args.world_size} (the same number of ranks per node)")
    if args.batch < 1:
        raise PlanError(f"--batch {args.batch} must be at least 1 (sequences per rank)")
    if args.seq_len < 0:
        raise PlanError(f"--seq-len {args.seq_len} must be 0 (no activation estimate) or more")
    if args.model is None:
        given = [flag for flag, value in (("--wrap-block", args.wrap_block),
                                          ("--min-num-params", args.min_num_params),
                                          ("--seq-len", args.seq_len or None),
                                          ("--unfused-attention", args.unfused_attention or None))
                 if value is not None]
        if given:
            raise PlanError(f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} a "
                            f"real model: give --model pkg.module:factory with "
                            f"{'it' if len(given) == 1 else 'them'} (--params counts only)")
    return PlanRequest(
        params=parse_size(args.params, "--params") if args.params is not None else None,
        model=args.model, world_size=args.world_size,
        precision=precision_for(args.optimizer, args.mixed_precision),
        stages=parse_stages(args.stages), wrap_block=args.wrap_block,
        min_num_params=args.min_num_params,
        gpu_memory=parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None,
        batch=args.batch, seq_len=args.seq_len, fused_attention=not args.unfused_attention,
        ranks_per_node=args.ranks_per_node)


def make_plan(req: PlanRequest) -> dict:
    """The plan as plain data: inputs, model summary, rows and recommendation."""
    summary = sizing = layout = None
    params = sized = req.params
    if req.model is not None:
        model = load_factory_module(req.model)
        summary = summarize_model(model, req.wrap_block, req.min_num_params)
        params = summary.params
        if not params:
            raise PlanError(f"--model {req.model!r}: the module has no parameters; nothing to "
                            f"plan")
        sizing, layout = _model_sizing(model, req, summary)
        sized = sizing.params
    activations = 0.0
    if summary is not None and req.seq_len:
        activations = estimate_activation_bytes(summary, req.batch, req.seq_len,
                                                req.precision.weights == 2, req.fused_attention)
    rows = stage_table(sized, req.world_size, req.precision, req.stages, sizing, activations,
                       layout)
    best = recommend_stage(rows, req.gpu_memory) if req.gpu_memory else None
    return {
        "params": params, "fp32_equivalent_params": sized,
        "world_size": req.world_size, "precision": asdict(req.precision),
        "model": req.model, "summary": asdict(summary) if summary else None,
        "activations_bytes": activations, "gpu_memory_bytes": req.gpu_memory,
        "rows": [dict(asdict(r), total=r.total) for r in rows],
        "stage3_traffic": zeropp_traffic(sized, req.world_size, req.precision,
                                         sizing.root_unit_params if sizing else 0.0)
        if 3 in req.stages else None,
        "stage1_owners_traffic": stage1_owners_traffic(sized, req.world_size, req.precision,
                                                       sizing) if 1 in req.stages else None,
        "recommended_stage": best.stage if best else None,
        "ranks_per_node": req.ranks_per_node or req.world_size,
        "stage3_link_traffic": _link_traffic_data(req, sized, sizing)
        if 3 in req.stages else None,
    }


def _model_sizing(model, req: PlanRequest,
                  summary: ModelSummary) -> tuple[ModelSummary, RankLayout]:
    """The summary and rank layout the byte figures take. In fp32 training a parameter
    that is not fp32 (a model loaded in bf16, an fp64 layer) holds its weight, gradient and
    optimizer state in its own dtype (torch's optimizers keep their state in the
    parameter's), so its counts are :func:`shardkit.plan_model.fp32_elements`; the
    displayed counts stay elements. ``--mixed-precision`` keeps elements: its W, G and K
    already say the dtypes of every parameter."""
    weigh = req.precision.weights == 4 and has_non_fp32_parameters(model)
    if weigh:
        summary = summarize_model(model, req.wrap_block, req.min_num_params,
                                  in_fp32_elements=True)
    return summary, rank_layout(model, req.world_size, req.wrap_block, req.min_num_params,
                                in_fp32_elements=weigh)


def stage1_owners_traffic(params: float, world_size: int, precision: Precision,
                          summary: Optional[ModelSummary] = None) -> float:
    """Stage 1's wire bytes per step per rank with
    :func:`shardkit.comm_hooks.reduce_to_owners_hook` (what :func:`shardkit.initialize` builds
    under DeepSpeed's default ``zero_optimization.reduce_scatter: true``): each gradient
    averaged onto its owner only, ``Ψ(N-1)/N``, plus the owners' parameter sync ``Ψ(N-1)/N``:
    stage 2's ``2Ψ(N-1)/N``, against plain OSS + DDP's ``3Ψ(N-1)/N``. In bytes of the
    gradients' dtype, ``precision.grads`` per element as in the stage rows: under fp16/bf16
    ``initialize`` keeps 16-bit weights and gradients at stages 0-2 (fp32 masters in the
    optimizer), so its reductions and parameter sync send 2 bytes per element."""
    return precision.grads * zero_comm_elements_per_step(
        params, world_size, 2, trainable=_trainable(params, summary))


def _link_traffic_data(req: PlanRequest, params: float, summary: Optional[ModelSummary]):
    n = req.ranks_per_node or req.world_size
    root = summary.root_unit_params if summary is not None else 0.0
    table = link_traffic_table(params, n, req.world_size // n, req.precision, root)
    return {name: {"intra_node": t.intra_node, "inter_node": t.inter_node}
            for name, t in table.items()}


def render_link_traffic(plan: dict) -> list[str]:
    """The per-link table of ``plan`` (stage 3, one row per FSDP communication option)."""
    links = plan["stage3_link_traffic"]
    n = plan["ranks_per_node"]
    k = plan["world_size"] // n
    plain = links["fp32"]  # the unquantized row, in the plan's precision
    baseline = "fp32" if plan["precision"]["weights"] == 4 else "16-bit"
    lines = [f"stage 3 wire/step per rank by link, {k} node{'s' if k > 1 else ''} x {n} "
             f"rank{'s' if n > 1 else ''} (bytes on groups inside a node / spanning nodes, "
             f"as CommCounter splits them):",
             f"{'option':<16}{'intra-node':>12}{'inter-node':>12}"
             f"{'x ' + baseline + ' inter':>16}"]
    for name, t in links.items():
        ratio = (f"{t['inter_node'] / plain['inter_node']:.2f}x" if plain["inter_node"]
                 else "-")
        label = baseline if name == "fp32" else name
        lines.append(f"{label:<16}{format_bytes(t['intra_node']):>12}"
                     f"{format_bytes(t['inter_node']):>12}{ratio:>16}")
    return lines


def render_plan(plan: dict) -> str:
    """The plan as the text table ``plan`` prints."""
    pr = plan["precision"]
    lines = [f"Per-rank model states by the ZeRO formulas: Ψ = {format_count(plan['params'])} "
             f"parameters, "
             f"N = {plan['world_size']} ranks, {pr['label']} "
             f"(W={pr['weights']}, G={pr['grads']}, K={pr['optimizer']} bytes per parameter)"]
    summary = plan["summary"]
    if summary:
        trainable = summary.get("trainable_params", -1)
        frozen = (f" ({summary['params'] - trainable:,} frozen: weights only)"
                  if 0 <= trainable < summary["params"] else "")
        lines.append(f"model {plan['model']}: {summary['params']:,} parameters{frozen}, "
                     f"{summary['num_units']} FSDP units, the largest "
                     f"{summary['largest_unit_params']:,} parameters")
        sized = plan.get("fp32_equivalent_params", plan["params"])
        if sized != plan["params"]:
            lines.append(f"parameters not in fp32 keep weights, gradients and optimizer state "
                         f"in their own dtype: the bytes below are those of "
                         f"{format_count(sized)} fp32 parameters")
    show_extra = summary is not None
    header = f"{'stage':<6}{'wrapper':<18}{'formula':<16}{'wire/step':>12}{'model states':>14}"
    if show_extra:
        header += f"{'+ transient':>14}{'+ activations':>15}{'total':>12}"
    lines += [header, "-" * len(header)]
    for r in plan["rows"]:
        line = (f"{r['stage']:<6}{r['wrapper']:<18}{r['formula']:<16}"
                f"{format_bytes(r['comm_per_step']):>12}"
                f"{format_bytes(r['model_states']):>14}")
        if show_extra:
            line += (f"{format_bytes(r['transient']):>14}{format_bytes(r['activations']):>15}"
                     f"{format_bytes(r['total']):>12}")
        lines.append(line)
    if plan.get("stage1_owners_traffic") is not None:
        lines.append(f"stage 1 wire/step with reduce_to_owners_hook (what initialize builds "
                     f"under zero_optimization.reduce_scatter: true, DeepSpeed's default): "
                     f"{format_bytes(plan['stage1_owners_traffic'])}")
    traffic = plan.get("stage3_traffic")
    if traffic:
        plain = traffic["fp32"]
        label = "16-bit" if pr["weights"] == 2 else "fp32"
        lines.append("stage 3 wire/step by FSDP option (ZeRO++): " + ", ".join(
            f"{label if name == 'fp32' else name} {format_bytes(b)}"
            + ("" if name == "fp32" else f" ({b / plain:.2f}x)") for name, b in traffic.items()))
    if plan.get("stage3_link_traffic"):
        lines += render_link_traffic(plan)
    if show_extra:
        lines.append("model states with --model: the most loaded rank (OSS owns whole "
                     "parameters at stages 1-2, FSDP pads each parameter's rows to a multiple "
                     "of N at stage 3; frozen parameters hold weights only)")
    if show_extra and not plan["activations_bytes"]:
        lines.append("activations not estimated: give --seq-len (and --batch) and --wrap-block "
                     "naming the transformer block class")
    if plan["gpu_memory_bytes"]:
        budget = format_bytes(plan["gpu_memory_bytes"])
        if plan["recommended_stage"] is None:
            lines.append(f"no stage fits {budget} per rank: add ranks, use --mixed-precision, "
                         f"activation checkpointing or a smaller batch")
        else:
            stage = plan["recommended_stage"]
            lines.append(f"recommended: stage {stage} ({STAGE_WRAPPERS[stage]}), the lowest "
                         f"stage that fits {budget} per rank")
    return "\n".join(lines)


def write_plan_chart(plan: dict, path: str) -> str:
    """Per-rank memory (model states, + transient, + activations) and wire bytes of each stage
    as a bar chart at ``path`` (:func:`shardkit.utils.charts.write_bar_chart`: matplotlib, and
    the figures as JSON beside it). Raises ``ChartError`` without matplotlib."""
    from shardkit.utils.charts import BarGroup, write_bar_chart
    groups = [BarGroup(f"stage {r['stage']} {r['wrapper']}", {
        "model states (GB)": r["model_states"] / 1e9,
        "total with transient + activations (GB)": r["total"] / 1e9,
        "wire per step (GB)": r["comm_per_step"] / 1e9}) for r in plan["rows"]]
    title = (f"per rank: Ψ = {format_count(plan['params'])}, N = {plan['world_size']}, "
             f"{plan['precision']['label']}")
    return write_bar_chart(path, title, groups)


def _check_chart_path(path: str) -> None:
    """``--chart``'s folder must exist and be writable (checked before any work)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise PlanError(f"--chart {path!r}: the folder {folder!r} does not exist or is not "
                        f"writable; give a .png path in an existing folder")
    suffix = os.path.splitext(path)[1].lower()
    if suffix and suffix not in (".png", ".svg", ".pdf"):
        raise PlanError(f"--chart {path!r}: {suffix} is not an image format the chart is "
                        f"written in; give a .png, .svg or .pdf path")


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m shardkit plan``; returns the exit code (2 on bad input)."""
    from shardkit.utils.charts import ChartError
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.chart is not None:
            _check_chart_path(args.chart)
        plan = make_plan(validate(args))
    except PlanError as e:
        print(f"python -m shardkit plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    if args.chart:
        try:
            line = write_plan_chart(plan, args.chart)
        except (ChartError, OSError) as e:
            print(f"python -m shardkit plan: --chart {args.chart}: {e}", file=sys.stderr)
            return 2
        if not args.json:
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
