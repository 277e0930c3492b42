"""Every multi-process pipeline schedule runs a :class:`~shardkit.nn.pipe.plan.PipelinePlan` here:
GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZBV share one executor and one action-list form.

Each rank holds one or more :class:`PipelineStage` objects and walks its action list in order:
``F`` runs a micro-batch forward through a stage and hands its output to the next stage (locally
when that stage lives on the same rank, otherwise by an asynchronous tagged send); ``BW`` runs the
whole backward (as B then W at once, so its matrix-product weight gradients merge like W's);
``B`` only the input gradient (:func:`~shardkit.nn.pipe.split_backward.
backward_input`), and ``W`` later the parameter gradients. Receives for the next few actions are
posted ahead once the shapes are known (after the first step), so data lands while the rank
computes. Every message carries a tag naming (kind, stage boundary, micro-batch, tensor), so two
stages of one rank talking to the same neighbour never mix their messages. Before each step the
first stage's rank tells every rank, inside its first messages, whether the batch is as before,
new or unusable, and whether the step records for backward
(:class:`~shardkit.nn.pipe.p2p.TaggedLinks`), so a changed batch, an evaluation step under
``torch.no_grad()`` or a bad batch is handled alike on every rank. What only a later stage can
find (a target it cannot split or that ``loss_fn`` refuses, an output that no longer matches the
shapes it announced) does not stop that stage: it sends zeros of the shapes its neighbours
expect and sets the step's verdict, which rides on the last message across each boundary each
way; every rank runs its action list to the end, so nothing is left in flight, and raises the
same error.

Under FullyShardedDataParallel (a stage module that is or holds FSDP units on the stage's
data-parallel group): ``BW`` stays one plain backward (FSDP's hooks gather, reduce-scatter and
free as usual); ``B`` and ``W`` go through :class:`~shardkit.nn.pipe.fsdp_weight_sink.
ShardedGradientSink`, which hands each unit its gradients after every W (one reduce-scatter per
unit and micro-batch, or accumulation inside the unit's ``no_sync()``) and says what is gathered
between B and W (nothing) and during W. A stage holding a ``checkpoint_wrapper`` module under
FSDP is refused when backward is split.

Loss and micro-batches: the batch is split into ``chunks`` micro-batches along dim 0 as
``torch.tensor_split`` does (as in ``torch.distributed.pipelining``: where ``chunks`` does not
divide the batch, the first ones are one row longer). The target is split the same way (its
tensors, inside tuples, lists and dicts too; ``target_chunk_spec`` passes a tensor that is not
per-sample, a class-weight tensor, whole to every micro-batch), and so are keyword tensors;
every rank checks those it gets against the batch's rows (sent with the first stage's shape
headers), so a tensor whose micro-batches would not hold the batch's samples (fewer rows, or a
target flattened over ``(batch * seq)`` on an uneven split) fails the step on every rank, naming
it. Each micro-batch's loss is divided by ``chunks`` before its backward (``scale_grads=True``,
the default, as in torch), except where the split is uneven and ``loss_fn`` declares that it
averages (``reduction="mean"``: a ``torch.nn`` loss module's or any callable's ``reduction``
attribute, a ``functools.partial`` keyword, ``loss_kwargs``, or the default of the function's
own ``reduction`` parameter, as ``F.mse_loss`` and ``F.cross_entropy`` have): it is then divided
by the target's rows over the micro-batch's, so the gradients are the batch mean's, as one
process's (torch divides by ``chunks`` there too, which weighs the rows of shorter micro-batches
more). A ``loss_fn`` that says nothing (a lambda, a plain ``def``) keeps torch's ``1/chunks``: a
summing one gives the batch's sum over ``chunks``, every row weighted alike, as torch; give an
averaging one ``loss_fn.reduction = "mean"`` for the batch mean on uneven splits. A ``loss_fn``
whose mean divides by a count its target decides (cross-entropy with ``ignore_index``: the
non-ignored tokens, or their class weights) is weighted by that count instead, on even splits
too (a mean of micro-batch means is not the batch's mean when the micro-batches hold different
numbers of counted tokens): ``nn.CrossEntropyLoss``, ``nn.NLLLoss``, ``F.cross_entropy`` and
``F.nll_loss`` (and their ``functools.partial``, and subclasses of the modules that keep
their ``forward``) with ``reduction="mean"`` and class-index targets are counted as torch
counts them; any other declares its count with ``loss_denominator=lambda target: ...``. A
``loss_fn`` that says nothing (``lambda out, y: F.cross_entropy(out.view(-1, V), y.view(-1))``)
is watched at the step's first loss (:mod:`~shardkit.nn.pipe.loss_count`): where it returns
one of those losses with ``reduction="mean"`` on its micro-batch's target reshaped (or several
added up, each times a constant, counting alike: two heads, ``0.5 * (ce1 + ce2)``), every
micro-batch is counted alike, as above; where on another target (``y[:, 1:]``), where that
mean is only part of what it returns (an auxiliary or class-probability term added), or where
it divides by a count of its target by hand (``(ce * mask).sum() / mask.sum()``, also
``/ mask.sum().item()``, ``ce[mask].float().mean()``), every micro-batch must count as many
targets as the first, else the step fails on every rank asking for ``loss_denominator``. A
guard's zero before that loss (a micro-batch whose targets are all ignored) must count
nothing.
Each micro-batch's loss is then divided by the whole target's count over its own (a
micro-batch counting nothing, whose mean is NaN, adds no gradient), so the gradients and the
returned loss are one process's on the whole batch. Under data parallelism each pipeline's
count is its own (as DDP averages per-rank means). With ``scale_grads=False`` no loss is
divided, and the gradients are those of the sum of the micro-batch losses (a summing
``loss_fn``: the batch's sum, as one process). Call ``optimizer.zero_grad()`` before and
``optimizer.step()`` after :meth:`PlanSchedule.step` on every rank, over the parameters of
all the rank's stages.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Callable, Optional

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten, tree_map

from shardkit import distributed as dist
from shardkit.nn.data_parallel.flat_param import zeros_only_views
from shardkit.nn.pipe.microbatch import (batch_size, keyword_argument_problems,
                                         keyword_chunk_dims, keyword_signature, merge_outputs,
                                         mergeable_output_problem, own_microbatches,
                                         part_rows, positional_chunk_spec_problem,
                                         split_keyword_arguments, split_microbatches,
                                         split_target, target_chunk_dims, target_rows,
                                         target_split_problems)
from shardkit.nn.pipe.p2p import (ACTIVATION, GRADIENT, MAX_TENSORS, StepState, TaggedLinks,
                                  batch_signature, output_tensors)
from shardkit.nn.pipe.plan import (PipelineDeadlock, PipelinePlan, gpipe_plan,
                                   interleaved_1f1b_plan, one_f_one_b_plan, zb_h1_plan, zbv_plan)
from shardkit.nn.pipe.schedules import (COMMUNICATION_ERRORS, ActivationMemoryMeter, busy_time,
                                        check_schedule_agreement, raise_step_failure)
from shardkit.nn.pipe.loss_count import (LossCountWatch, NotCounted, count_value,
                                         declared_denominator, declared_reduction)
from shardkit.nn.pipe.fsdp_weight_sink import (ShardedGradientSink, frozen_units_with_replicas,
                                               params_outside_fsdp, stage_is_fully_sharded)
from shardkit.nn.pipe.split_backward import GradientSink, backward_input
from shardkit.nn.pipe.stage import PipelineStage, is_torch_ddp
from shardkit.nn.pipe.ties import TiedWeights

__all__ = ["PlanSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "ScheduleZBV"]

_FAILED = object()  # a stage forward or backward that raised (the step fails)
_UNSPLIT = object()  # this step's keyword arguments, before this rank's first forward

_LOOKAHEAD = 4
_REPLAN_AT = 2  # training steps; the first's timings include one-off costs (allocation, autograd)


class PlanSchedule:
    """Runs this rank's part of a :class:`PipelinePlan` over its :class:`PipelineStage` objects.

    Args:
        stages: this rank's stage, or its stages (a list, as the schedule's placement needs).
        chunks: micro-batches per step, at most the batch size (a batch it does not divide
            splits unevenly, see above). torch's keyword ``n_microbatches=`` is taken in its
            place.
        loss_fn: ``loss_fn(output, target) -> scalar`` on the rank running the last stage
            (``None``: forward-only steps with ``return_outputs=True`` only).
        track_activation_memory: measure the bytes saved for backward on this rank
            (``self.activation_memory``).
        weight_grad_merge: at most how many micro-batches' matrix-product weight gradients
            (``Linear`` layers, wherever they sit; see :mod:`~shardkit.nn.pipe.split_backward`)
            are added in one product: ``1`` adds each micro-batch's as its W runs; ``k`` keeps
            the inputs and output gradients of up to ``k - 1`` micro-batches until one
            ``addmm_`` per weight, except that a weight whose waiting micro-batches hold
            :data:`~shardkit.nn.pipe.split_backward.ENOUGH_ROWS` rows (128) is added at once
            (merging larger products gains nothing, and adding them where the plan put their W
            keeps its bubbles filled). ``None``: the schedule's default (``chunks`` for GPipe,
            which keeps every micro-batch anyway; the number of pipeline ranks otherwise). What
            waits is not in ``activation_memory`` (which counts tensors saved by autograd); pass
            ``1`` where the schedule's activation bound must hold exactly.
        scale_grads: torch's meaning: ``True`` (default) divides the gradients by ``chunks``
            (each micro-batch's loss is divided before its backward), so a ``loss_fn`` that
            averages over its micro-batch gives the gradients of the batch mean, and
            :meth:`step` returns the mean micro-batch loss (with an uneven split and a
            ``loss_fn`` declaring ``reduction="mean"``, each micro-batch's weighted by its
            share of the target's rows: see above); ``False`` leaves them
            unscaled (the gradients of the sum of the micro-batch losses, for a ``loss_fn``
            that sums, or a caller that scales itself), and :meth:`step` returns that sum.
        kwargs_chunk_spec: torch's ``{keyword: TensorChunkSpec(dim) or _Replicate()}``
            (``TensorChunkSpec.from_dict``): a keyword argument's tensors split along ``dim``
            (negative: counted from the end) into ``chunks`` parts as the batch is, or passed
            whole to every micro-batch; for a keyword holding a tuple, list or dict of
            tensors, one spec for all of them or the same structure of specs, one per tensor;
            keywords it does not name split along dim 0 (``None``, the default: all of them).
            A step with keyword arguments that lack one it names fails on every rank.
        target_chunk_spec: how the target is split (shardkit's; torch splits a tensor target
            along dim 0): ``TensorChunkSpec(dim)``, ``_Replicate()`` (passed whole to every
            micro-batch: a class-weight tensor, or one whose dim 0 only happens to equal the
            batch's rows), or a tuple, list or dict of them matching the target's structure
            (``{"labels": TensorChunkSpec(0), "class_weight": _Replicate()}``). ``None``
            (default): every tensor split along dim 0. A spec whose structure is not the
            target's fails the step on every rank.
        loss_denominator: ``loss_denominator(target) -> count`` (a number, NumPy's too, or a
            one-element tensor; finite, >= 0), called on each micro-batch's target: what
            ``loss_fn``'s mean divides by (``lambda t: (t != -100).sum()`` for a masked
            mean); each micro-batch's loss is weighted by its count's share of the whole
            target's, so the step is one process's. ``None`` (default): derived for torch's
            class-index cross-entropy and NLL losses (see above), also where a ``loss_fn``
            that declares no reduction calls one of them on its target reshaped (watched at
            the step's first loss), otherwise the rows.
        args_chunk_spec: torch's; ``None`` or a tuple of ``TensorChunkSpec(0)`` (the batch is
            split along dim 0); another value is a ValueError naming it.
        output_merge_spec, use_full_backward, backward_requires_autograd, defer_pp_recv:
            torch's options, accepted at torch's defaults (what shardkit does: outputs
            concatenated along dim 0, the backward run by the schedule); another value is a
            ValueError naming it.

    After a step, ``peak_live_microbatches`` is the most (stage, micro-batch) pairs whose
    activations were alive at once on this rank (from F until BW or W), and ``busy_seconds``
    the time spent computing (forward, backward, W), not waiting.

    Memory and communication: see the subclasses; each activation crosses each stage boundary
    that spans two ranks once forward and its gradient once back; micro-batch 0 from group
    rank ``r`` to ``r + 1`` carries three more elements, the step state, each gradient message
    one more per tensor, whether that gradient is present (``GRADIENT_FLAGS``: an output the
    next stage ignored or detached gets none, and is left out of this stage's backward as in one
    process), and the last message across each such boundary one more each way, the verdict
    (``VERDICT_ELEMENTS``; a one-byte message of its own where that gradient message has no
    tensors, as under ``torch.no_grad()``); :func:`shardkit.plan.pipeline_comm_elements`
    counts them. The shape headers (a few int64 per micro-batch and boundary) go
    again only on a step whose batch shapes, grad mode or data-dependent output shapes changed.
    A step that fails part-way costs one small object all-gather more. A stage under FSDP
    holding nested units whose parameters are all frozen shares, before each backward, which
    of those units (and of its inputs) that backward runs through with its replicas (one
    all-reduce of ``units + MAX_TENSORS + 1`` elements per micro-batch over those units'
    group): replicas that differ on a unit would gather it on one side only, so the step
    fails on every rank instead.

    .. warning:: :meth:`step` must be called on every rank of the pipeline group. The first step
       exchanges a description of the step so a mismatch raises the same error everywhere; on
       later steps a batch the first stage cannot split, a target the last stage cannot use,
       or an output that changed shape where that cannot be announced raises one error on every
       rank of the pipeline too. With several pipelines side by side whose stages average
       their gradients through ``data_parallel_group`` (or are torch DDP modules), the
       verdict rides on that all-reduce (one element more), so a step that fails in one
       pipeline raises in every pipeline. Under ShardedDDP or FSDP stage modules, whose
       collectives inside forward and backward span the pipelines, a step's refusals (a
       batch, keyword argument or target that the checks before the step reject) are shared
       before every step that communicates over the replicas (one all-reduce of three
       elements per replica group and one of two over the pipeline group, beside the first
       step's checks, which share them too), so every pipeline raises; under FSDP so does a
       step that one pipeline runs as eval and another as a training step. What fails only
       during the step (a forward or ``loss_fn`` raising) still leaves the other pipelines
       waiting in those collectives, and so does eval on one pipeline while the others call
       nothing or, under ShardedDDP (whose eval joins no collective, so that one pipeline
       may evaluate alone), train: give every pipeline usable batches and call
       :meth:`step` / :meth:`eval` on all of them alike.
    """

    def __init__(self, stages, chunks: Optional[int] = None, loss_fn: Optional[Callable] = None,
                 track_activation_memory: bool = False, weight_grad_merge: Optional[int] = None,
                 scale_grads: bool = True, **torch_options):
        name = type(self).__name__
        chunks = _microbatch_count(name, chunks, torch_options.pop("n_microbatches", None))
        self._keyword_dims = keyword_chunk_dims(torch_options.pop("kwargs_chunk_spec", None),
                                                name)
        self._target_dims = target_chunk_dims(torch_options.pop("target_chunk_spec", None), name)
        self.loss_denominator = torch_options.pop("loss_denominator", None)
        if self.loss_denominator is not None and not callable(self.loss_denominator):
            raise TypeError(f"{name}(loss_denominator={self.loss_denominator!r}): expected a "
                            f"callable loss_denominator(target) -> the count loss_fn's mean "
                            f"divides a micro-batch's loss by, or None")
        _check_torch_options(name, torch_options)
        if not isinstance(track_activation_memory, bool):
            # torch's 4th positional argument is args_chunk_spec (output_merge_spec in
            # ScheduleLoopedBFS): a torch call passing it by position lands here
            raise TypeError(f"{name}(track_activation_memory={track_activation_memory!r}): "
                            f"expected True or False; torch's schedules take args_chunk_spec "
                            f"in this position, so pass torch's options by keyword "
                            f"(args_chunk_spec=..., output_merge_spec=...)")
        if not isinstance(scale_grads, bool):
            raise TypeError(f"{name}(scale_grads={scale_grads!r}): expected True (gradients "
                            f"divided by chunks, the mean of the micro-batch losses) or False "
                            f"(their sum; the caller scales)")
        if weight_grad_merge is not None and (isinstance(weight_grad_merge, bool) or not isinstance(
                weight_grad_merge, int) or weight_grad_merge < 1):
            raise ValueError(f"{name}(weight_grad_merge={weight_grad_merge!r}): expected a "
                             f"positive int or None (the schedule's default)")
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages) \
            if isinstance(stages, (list, tuple)) else stages
        if not isinstance(stages, list) or not stages or \
                not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}(stages={stages!r}): expected a PipelineStage or a list of "
                            f"them")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"{name}(chunks={chunks!r}): expected a positive int")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{name}(loss_fn={loss_fn!r}): expected a callable "
                            f"loss_fn(output, target) or None")
        first = stages[0]
        self.group, self.rank = first.group, dist.get_rank(first.group)
        self.num_ranks, self.num_stages = first.group_size, first.num_stages
        self.plan: PipelinePlan = self.build_plan(self.num_ranks, chunks)
        self.stages = {s.stage_index: s for s in stages}
        self.chunks, self.loss_fn, self.scale_grads = chunks, loss_fn, scale_grads
        self._problems = self._stage_problems(stages)
        self.links = TaggedLinks(self.group, self.num_stages, chunks,
                                 reannounce=self.num_stages == self.num_ranks,
                                 device=first.device)
        self.links.carriers = last_messages(self.plan)
        self._group_ranks = [dist.get_global_rank(self.group, r) for r in range(self.num_ranks)]
        self.activation_memory = ActivationMemoryMeter() if track_activation_memory else None
        self.weight_grad_merge = min(chunks, weight_grad_merge or self.default_merge())
        self._whole_backward = {s: _runs_whole_backward(stage) for s, stage in
                                self.stages.items()}
        self._reducing = {s: _reduces_during_backward(stage) for s, stage in self.stages.items()}
        self._ties = TiedWeights(_one_tie_per_weight(stages), self.group, self.links.tie_tag)
        self.peak_live_microbatches = 0
        self.busy_seconds = 0.0
        self.action_seconds: dict = {}
        self._training_steps = 0
        self._checked = False
        # whether a training step shared the replicas' refusals (ShardedDataParallel / FSDP
        # stages) since the last failed step: eval steps share none over ShardedDataParallel
        self._replicas_checked = False
        # {grad: whether a rank of this pipeline has ShardedDataParallel / FSDP stage modules
        # communicating over replicas in such a step}, learnt at the first step's agreement
        self._pipeline_shards: dict = {}
        self._signature = None  # the first stage's last batch_signature
        self._losses_arg, self._kwargs_arg = None, {}  # this step's losses list and kwargs
        self._return_outputs, self._loss_kwargs = None, None  # and its torch-style options
        self._outputs: list = []  # the last stage's outputs, kept under return_outputs=True

    plans_from_measured_costs = False

    def _replan(self) -> None:
        """Rebuild the plan from the last step's compute seconds per action kind, averaged
        over every rank of the default group (one small all-gather), so that every pipeline
        builds the same plan: the replicas of a stage (whose data-parallel wrappers reduce
        inside W) and its tensor-parallel peers must run their actions in the same order.
        Every rank of the default group runs such a schedule."""
        views = dist.all_gather_object(self.action_seconds)
        costs = {}
        for kind in ("F", "B", "W"):
            values = [v[kind] for v in views if kind in v]
            if values:
                costs[kind] = max(sum(values) / len(values), 1e-6)
        if len(costs) < 3:
            return
        costs["BW"] = costs["B"] + costs["W"]
        try:
            plan = self.build_plan(self.num_ranks, self.chunks, costs)
            plan.dry_run(costs)
        except PipelineDeadlock:  # same outcome on every rank: keep the current lists
            return
        self.plan = plan
        self.links.carriers = last_messages(plan)

    def default_merge(self) -> int:
        """Micro-batches whose matrix-product weight gradients are merged when the constructor
        gets ``weight_grad_merge=None``: the pipeline depth, which bounds what waits to about
        1F1B's live micro-batches."""
        return self.num_ranks

    _who = "rank"  # how errors name a process of the pipeline

    def build_plan(self, num_ranks: int, chunks: int, costs: Optional[dict] = None
                   ) -> PipelinePlan:
        """The plan for ``num_ranks`` ranks and ``chunks`` micro-batches (subclasses); ``costs``
        (seconds of F, B, W, BW) where the schedule plans from measured costs."""
        raise NotImplementedError

    def _stage_problems(self, stages) -> list[str]:
        mine = sorted(self.plan.stages_of(self.rank))
        given = sorted(s.stage_index for s in stages)
        problems = []
        if len(self.plan.placement) != self.num_stages:
            problems.append(f"{type(self).__name__} runs {len(self.plan.placement)} stages on "
                            f"{self.num_ranks} ranks, but the stages say num_stages="
                            f"{self.num_stages}")
        elif given != mine:
            problems.append(f"this rank must pass stages {mine} (the plan's placement), got "
                            f"{given}")
        if any(s.group is not self.group for s in stages):
            problems.append("the stages of one rank must share one pipeline group")
        problems += _device_problems(stages)
        if self.plan.split_backward():
            from shardkit.nn.checkpoint import is_checkpoint_wrapped

            for stage in stages:
                outside = params_outside_fsdp(stage.module)
                if stage_is_fully_sharded(stage.module) and outside:
                    problems.append(
                        f"stage {stage.stage_index} holds FullyShardedDataParallel units and "
                        f"{len(outside)} trainable parameters outside them (e.g. "
                        f"{outside[0]!r}); {type(self).__name__} splits backward into B and W "
                        f"and hands W's gradients to the FSDP units only. Wrap the whole stage "
                        f"module in FullyShardedDataParallel (inner units may stay)")
                if stage_is_fully_sharded(stage.module) and any(
                        is_checkpoint_wrapped(m) for m in stage.module.modules()):
                    problems.append(
                        f"stage {stage.stage_index} is wrapped in FullyShardedDataParallel and "
                        f"holds a checkpoint_wrapper module; {type(self).__name__} splits "
                        f"backward into B and W, and W would meet recomputed weights FSDP has "
                        f"already freed. Remove checkpoint_wrapper from this stage, or use "
                        f"Schedule1F1B / ScheduleInterleaved1F1B")
        return problems

    # ------------------------------------------------------------------ one step
    def step(self, *inputs: torch.Tensor, target: Optional[torch.Tensor] = None,
             losses: Optional[list] = None, return_outputs: Optional[bool] = None,
             loss_kwargs: Optional[dict] = None, **kwargs):
        """Forward and backward of one mini-batch; returns the mean micro-batch loss (detached;
        their sum under ``scale_grads=False``) on the rank running the last stage, ``None``
        elsewhere. Gradients accumulate in
        ``.grad`` of the stages' parameters (and are averaged over each stage's
        ``data_parallel_group``). Batch tensors that require grad get their gradient too, at
        the end of the step, as from one process's backward (so do the weights that built them).

        As in ``torch.distributed.pipelining``: ``losses``, a list, receives each micro-batch's
        loss (detached, before the division by ``chunks``) on the rank running the last stage
        (other ranks leave it alone); keyword arguments given to a rank's ``step`` go to the
        modules of that rank's stages beside their input (``module(x, mask=mask_i)``), tensors
        split along dim 0 into ``chunks`` parts as the batch is, inside tuples, lists and dicts
        too (they need no gradient; one whose micro-batches would not hold the batch's
        micro-batches' rows is refused on every rank: by the first stage's rank before the
        step, by a later one, which learns the batch's rows from the shape headers, at its
        first forward, failing the step), other values
        passed to every micro-batch as they are (with several stages per rank, where the first
        stage's rank gets other plain values than on the last step, or 0-dim tensors or other
        objects, which may decide shapes, the shape headers go again; with one stage per rank
        a stage announces its changed shapes itself).
        ``loss_kwargs``, a dict, goes to every call of ``loss_fn(output, target,
        **loss_kwargs)`` as it is (not split).
        ``return_outputs``: left unset, :meth:`step` returns the loss as above; ``True``
        returns instead, as torch's schedules do, the last stage's outputs of every
        micro-batch (detached), concatenated along dim 0 (tuples, lists and dicts of tensors:
        each tensor concatenated, in the output's structure, as torch's ``merge_chunks``), on
        the rank running the last stage; ``False`` returns ``None`` there (the loss is still in
        ``losses``). Other ranks return ``None`` in every case. A forward-only step with
        ``return_outputs=True`` needs no ``target`` and no ``loss_fn`` (inference, as with
        torch's schedules built without ``loss_fn``): without either, no loss is computed and
        ``losses`` is left empty. A forward-only step without a ``target`` has no loss to
        return: with ``return_outputs`` unset it returns the outputs, as torch's ``eval(x)``
        does without ``loss_fn`` (with one, torch's raises a TypeError).

        Under ``torch.no_grad()`` (or through :meth:`eval`) the step only runs forward: it
        returns the loss the same way and leaves ``.grad`` and the data-parallel reduction
        alone, so evaluation steps may come between training steps. Enter it on every rank: on
        the first step ranks that disagree get the same error; later, the grad mode of the rank
        running the first stage holds for all. The batch may change size or shape between
        steps as long as it has at least ``chunks`` rows (the shape headers then go again). With
        one stage per rank (GPipe, 1F1B, ZB-H1) a stage's output shapes may also change with
        the data, when micro-batch 0's change too (that stage announces the new shapes).

        Raises:
            ValueError: on every rank, naming the stage, the micro-batch, what was expected and
                what was found: a batch the first stage cannot split (before any work); a
                target the last stage cannot use (not splittable into ``chunks``, cut at
                other rows than the batch, or one that makes ``loss_fn`` raise), a keyword
                tensor a later stage's rank got cut at other rows than the batch, a
                ``loss_fn`` value that is not a one-element tensor (``reduction="none"``, a
                Python float), a stage whose forward or backward
                (or a gradient hook) raises, or whose output cannot cross a boundary (not
                tensors, or a dtype a header cannot name), a step that failed in another
                pipeline (see the class; a step another pipeline refused before running it
                too: where the stages are ShardedDataParallel / FSDP modules over the
                replicas, the refusals are shared before every step that communicates over
                them (training steps; eval steps too under FSDP), and under FSDP so is
                whether a replica runs eval while this one trains, or the reverse), or a stage
                output that no longer matches the shapes it announced. Found during the step,
                these end it the same way: the stage stops computing and sends its
                neighbours what they expect, every rank finishes the step's messages, then
                raises (on the rank that caught an
                exception, chained to it), so the pipeline stays usable; ``.grad`` may hold
                part of the step's gradients, so zero them before the next step. The next
                step repeats the first step's checks (one small all-gather). A communication
                error inside a stage (a peer died) propagates at once, and so does a backward
                raising inside a ShardedDataParallel or FSDP stage that has replicas (their
                gradient reduction is already under way)."""
        self._losses_arg, self._kwargs_arg = losses, kwargs
        self._return_outputs, self._loss_kwargs = return_outputs, loss_kwargs
        try:
            grad = torch.is_grad_enabled()
            if not self._checked or (grad and not self._replicas_checked):
                self._check_first_step(inputs, target, grad)
            else:
                self._check_with_sharded_replicas(inputs, target, grad)
            self._prepare_step()  # before _start_step, which waits for micro-batch 0 off rank 0
            grad = self._start_step(inputs, target)
            with torch.set_grad_enabled(grad):
                return self._run_step(inputs, target, grad)
        finally:  # the caller's list and tensors are not kept past the step, even a failed one
            self._losses_arg, self._kwargs_arg = None, {}
            self._return_outputs, self._loss_kwargs, self._outputs = None, None, []

    def eval(self, *inputs: torch.Tensor, target: Optional[torch.Tensor] = None,
             losses: Optional[list] = None, return_outputs: Optional[bool] = None,
             loss_kwargs: Optional[dict] = None, **kwargs):
        """Forward only (:meth:`step` under ``torch.no_grad()``), as
        ``torch.distributed.pipelining``'s ``eval``: the loss :meth:`step` returns on the rank
        running the last stage (``losses`` filled as by :meth:`step`), ``None`` elsewhere;
        ``.grad`` is left alone; ``return_outputs`` and ``loss_kwargs`` as in :meth:`step`
        (``eval(x, return_outputs=True)`` runs inference without target or ``loss_fn``;
        ``eval(x)`` without a target returns the merged outputs, as torch's does on a
        schedule built without ``loss_fn``).
        Call it on every rank of the pipeline. Dropout and batch norm follow the modules' own
        ``train()``/``eval()`` mode, as in one process."""
        with torch.no_grad():
            return self.step(*inputs, target=target, losses=losses,
                             return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs)

    def _start_step(self, inputs, target) -> bool:
        """Learn the step's :class:`~shardkit.nn.pipe.p2p.StepState` (made here on group rank 0,
        which runs stage 0; received with micro-batch 0 elsewhere), pass it on to the next
        rank, and act on it alike everywhere: drop the cached headers for a new batch, raise
        the first step's clear error for a bad one. Returns whether the step records for
        backward."""
        grad = torch.is_grad_enabled()
        if 0 in self.stages:
            state = self._first_stage_state(inputs, target, grad)
        else:
            state = self.links.take_lead(self.rank - 1, self._remote(self.rank - 1))
            if state is None:  # the first step: nothing cached, the batch checked by all
                state = StepState(StepState.NEW, grad)
        if self.rank < self.num_ranks - 1:
            self.links.start_lead(self.rank, state, self._remote(self.rank + 1))
        if state.batch == StepState.BAD:  # only zeros went out, all received: nothing half-done
            self._check_agreement(inputs, target, state.grad)
        if state.batch == StepState.NEW:
            self.links.metas.clear()
            self.links.batch_rows = None  # the headers bring this step's
        return state.grad

    def _first_stage_state(self, inputs, target, grad: bool) -> StepState:
        rows = self._batch_rows(inputs)
        if self._batch_problems(inputs) or self._call_problems(rows):
            return StepState(StepState.BAD, grad)
        if self.num_stages - 1 in self.stages and self._target_problems(target, rows):
            return StepState(StepState.BAD, grad)  # ZBV: the last stage sees the batch too
        # with one stage per rank a stage announces output shapes that change with a keyword
        # value itself (micro-batch 0's change too): no need to send every header again
        signature = batch_signature(inputs, grad), keyword_signature(
            self._kwargs_arg, by_value=not self.links.reannounce)
        if signature == self._signature:
            return StepState(StepState.SAME, grad)
        self._signature = signature
        return StepState(StepState.NEW, grad)

    def _prepare_step(self) -> None:
        self._live: dict = {}      # (stage, i) -> (inputs, roots)
        self._weights: dict = {}   # (stage, i) -> WeightGradPass
        self._handoff: dict = {}   # local activations and gradients between this rank's stages
        self._losses: list = []
        self._faults: list = []    # what this rank found wrong during the step (the first)
        self._fault_cause: Optional[BaseException] = None  # the exception behind it, if any
        self._targets: Optional[list] = None  # the target's micro-batches; [] if unusable
        # what each micro-batch's loss is divided by under scale_grads: chunks, or the
        # target's rows over the micro-batch's where chunks does not divide them (and the
        # loss_fn does not declare that it sums)
        self._loss_divisors: list = [self.chunks] * self.chunks
        self._loss_watch: Optional[LossCountWatch] = None  # for a loss_fn declaring nothing
        self._batch_grads: list = []  # (micro-batch view, its gradient) of inputs needing grad
        self.links.failed = False
        self._sinks = {s: ShardedGradientSink() if self._whole_backward[s] else
                       GradientSink(stage.parameters(), self.weight_grad_merge)
                       for s, stage in self.stages.items()}
        self._frozen_units = {s: frozen_units_with_replicas(stage.module) if
                              self._whole_backward[s] else [] for s, stage in self.stages.items()}
        # (stage, i) -> per frozen unit, the autograd nodes of its outputs in that forward
        self._frozen_outputs: dict = {}
        self._alive = 0
        self.peak_live_microbatches = 0
        self.busy_seconds = 0.0
        if self.activation_memory is not None:
            self.activation_memory.reset_peak()

    def _run_step(self, inputs, target, grad: bool):
        last = self.num_stages - 1
        self._inputs = split_microbatches(inputs, self.chunks, "step") if 0 in self.stages \
            else None
        if self._inputs is not None:
            self._inputs = own_microbatches(self._inputs, grad)
            self.links.batch_rows = self._batch_rows(inputs)
        self._kwargs = _UNSPLIT  # split at this rank's first forward, once the batch is known
        self._target = target
        returns_outputs = self._returns_outputs(target)
        seconds = {kind: 0.0 for kind in ("F", "B", "W", "BW")}
        if self._ties:
            self._ties.sync_weights()  # the first step only
            if grad:
                self._ties.remember_gradients()
        order = self.plan.orders[self.rank]
        for position, action in enumerate(order):
            for ahead in itertools.islice(order, position, position + _LOOKAHEAD):
                self._post_ahead(ahead)
            before = self.busy_seconds
            getattr(self, "_run_" + action.kind)(action.stage, action.microbatch)
            seconds[action.kind] += self.busy_seconds - before
        for s in self.stages:  # completes what W started (FSDP reduce-scatters); hooks run
            self._backward(s, None, self._sinks[s].deliver)
        if self._batch_grads:
            self._backward(0, None, self._hand_batch_grads, "handing the batch its gradients")
        if grad and self.num_ranks > 1:  # a backward that raised may not have been heard yet
            self.links.settle(self._group_ranks)
        failed = self.links.failed  # every rank knows by now; no message is left to receive
        if grad and not failed and self._ties:
            self._ties.add_gradients()
        if grad:
            failed = self._reduce_over_replicas(failed)
        if grad and not failed:  # a forward-only step measures no B or W: no re-plan input
            self._training_steps += 1
            counts = {kind: sum(1 for a in order if a.kind == kind) for kind in seconds}
            self.action_seconds = {kind: seconds[kind] / counts[kind] for kind in seconds
                                   if counts[kind]}
        with dist.reporting_broken_links("pipeline sends in flight at the end of the step",
                                         self.group):
            self.links.pending.wait()
        self._inputs = self._target = self._targets = self._sinks = self._kwargs = None
        if failed:  # the same error on every rank (one small object all-gather)
            self._forget_shapes()
            cause, self._fault_cause = self._fault_cause, None  # its frames hold tensors
            raise_step_failure(type(self).__name__, self._faults, self.group, cause)
        # here, not at the next step's start: ranks other than 0 then wait for micro-batch 0
        if grad and self._training_steps == _REPLAN_AT and self.plans_from_measured_costs:
            self._replan()
        if last not in self.stages:
            return None
        if self._losses_arg is not None:
            self._losses_arg[:] = self._losses
        if returns_outputs:
            return merge_outputs(self._outputs)
        if self._return_outputs is False:
            return None
        return self._step_loss()

    def _reduce_over_replicas(self, failed: bool) -> bool:
        """Each stage's end-of-step gradient reduction over its ``data_parallel_group``, which
        also carries whether the step failed in some pipeline; where it did, the replicas
        share what went wrong (one small all-gather, only then) and this pipeline's step fails
        too, naming the replica that failed. Returns whether the step failed."""
        for s, stage in self.stages.items():
            if not stage.reduces_gradients_now():
                continue
            ours = failed
            if not stage.reduce_gradients(failed):
                continue
            problem = (self._faults[0] if self._faults else
                       "its pipeline's step failed (another rank of it found why)") if ours \
                else None
            others = stage.replica_failures(problem)
            if not ours:
                self._fail(f"stage {s}: the step failed in another pipeline, so no replica "
                           f"keeps it: " + "; ".join(others))
            failed = True
        return failed

    def _refuse_to_replicas(self, refusal: str, grad: bool) -> None:
        """This pipeline refuses the step before running it: the replicas of its stages in
        other pipelines run it and wait in the end-of-step reduction, so join that reduction
        saying the step failed (``.grad`` is left alone here) and share why, as
        :meth:`_reduce_over_replicas` does there. Only for a step that records for backward
        (a forward-only step reduces nothing)."""
        if not grad:
            return
        problem = f"its pipeline refused the step before running it: {refusal}"
        for stage in self.stages.values():
            if stage.reduces_gradients_now():
                stage.refuse_step_to_replicas()
                stage.replica_failures(problem)

    def _step_loss(self) -> torch.Tensor:
        """The loss :meth:`step` returns: the micro-batch losses' sum (``scale_grads=False``),
        else their mean, each weighted by its share of the target's rows where the split is
        uneven and ``loss_fn`` declares that it averages (the batch mean, as in one process)."""
        total = torch.stack(self._losses)
        if not self.scale_grads:
            return total.sum()
        if all(d == self.chunks for d in self._loss_divisors):
            return total.mean()
        return sum(loss / d for loss, d in zip(self._losses, self._loss_divisors)
                   if d != float("inf"))

    def _loss_root(self, loss: torch.Tensor, output, i: int) -> torch.Tensor:
        """What micro-batch ``i``'s backward starts from: its loss, divided under
        ``scale_grads``; for a micro-batch whose loss counts nothing (all its targets
        ignored: a NaN mean) a zero on its outputs, so it adds no gradient, as those rows add
        none in one process."""
        if not self.scale_grads:
            return loss
        divisor = self._loss_divisors[i]
        if divisor != float("inf"):
            return loss / divisor
        return sum((t.sum() * 0 for t in tree_flatten(output)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad), loss.new_zeros(()))

    def _keep_output(self, s: int, i: int, output) -> None:
        """Keep the last stage's output of micro-batch ``i`` (detached) for ``return_outputs``;
        one that cannot be concatenated along dim 0 fails the step on every rank."""
        problem = mergeable_output_problem(output, self._outputs[0] if self._outputs else None)
        if problem:
            self._fail_at(s, i, f"step(return_outputs=True) concatenates the last stage's "
                                f"outputs along dim 0, but {problem}; or leave return_outputs "
                                f"unset (step returns the loss)")
            return
        self._outputs.append(tree_map(lambda t: t.detach(), output))

    def _forget_shapes(self) -> None:
        """After a failed step (on every rank alike): the next step starts as the first did,
        with the ranks' agreement check and the shape headers sent again, since a stage that
        failed may have announced a ``VOID`` output instead of its shapes."""
        self.links.metas.clear()
        self._signature = None
        self._checked = self._replicas_checked = False

    def _fail(self, problem: str, cause: Optional[BaseException] = None) -> None:
        """Record what this rank found wrong; the verdict carries it to the other ranks."""
        self.links.failed = True
        if not self._faults:
            self._faults.append(problem)
            self._fault_cause = cause

    def _fail_at(self, s: int, index: int, problem: str,
                 cause: Optional[BaseException] = None) -> None:
        """:meth:`_fail` with the stage and micro-batch named ("stage 3 (the last), ...")."""
        last = " (the last)" if s == self.num_stages - 1 else ""
        self._fail(f"stage {s}{last}, micro-batch {index}: {problem}", cause)

    def _fail_at_last_stage(self, index: int, problem: str,
                            cause: Optional[BaseException] = None) -> None:
        self._fail_at(self.num_stages - 1, index, problem, cause)

    def _step_targets(self, index: int) -> list:
        """The target's micro-batches, checked at the last stage's first forward of the step
        (micro-batch ``index``) against the batch's rows (known from the headers by then);
        ``[]`` when the target is unusable, which fails the step."""
        if self._targets is None:
            problems = self._target_problems(self._target, self.links.batch_rows)
            if problems:
                self._fail_at_last_stage(index, problems[0])
                self._targets = []
            elif self._outputs_only(self._target):
                self._targets = [None] * self.chunks  # no loss this step
            else:
                self._targets = split_target(self._target, self.chunks, self._target_dims)
                self._loss_divisors = self._counted_divisors(index)
                if self._loss_divisors is None:
                    self._targets = []
        return self._targets

    def _counted_divisors(self, index: int) -> Optional[list]:
        """What each micro-batch's loss is divided by under ``scale_grads`` where ``loss_fn``
        averages over a count its target decides (``loss_denominator``, or a class-index
        target of ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` / ``F.cross_entropy`` /
        ``F.nll_loss`` with ``reduction="mean"``: the non-ignored targets, weighted by the
        class weights where there are some): the whole target's count over the micro-batch's,
        so the gradients are one process's on the whole batch, even or uneven split (``inf``
        for a micro-batch that counts nothing: it contributes no gradient). Otherwise
        :meth:`_row_weighted_divisors`. ``None`` (the step fails, naming micro-batch
        ``index``) where ``loss_denominator`` raises or returns no count."""
        counter = self.loss_denominator or declared_denominator(self.loss_fn, self._loss_kwargs)
        if self.scale_grads and counter is None and \
                declared_reduction(self.loss_fn, self._loss_kwargs) in (None, "mean"):
            # a lambda, or a callable that says "mean" without saying over what: learnt at
            # the first loss_fn call (before any backward)
            self._loss_watch = LossCountWatch(self._targets)
        if not self.scale_grads or counter is None:
            return self._row_weighted_divisors()
        try:
            counts = [count_value(counter(target)) for target in self._targets]
        except NotCounted:  # not a class-index target of a declared loss
            return self._row_weighted_divisors()
        except Exception as error:  # a user's loss_denominator: the same error on every rank
            self._fail_at_last_stage(index, f"loss_denominator raised {type(error).__name__}: "
                                            f"{error}; expected the count (a finite number >= 0) "
                                            f"loss_fn's mean divides by", error)
            return None
        return self._divisors_of_counts(counts)

    def _divisors_of_counts(self, counts: list) -> list:
        """Each micro-batch's divisor given what its loss's mean divides by: the whole
        target's count over its own (``inf`` for one counting nothing: no gradient)."""
        total = sum(counts)
        if total == 0:  # nothing counted anywhere: one process's loss is NaN too
            return [self.chunks] * self.chunks
        return [total / count if count else float("inf") for count in counts]

    def _row_weighted_divisors(self) -> list:
        """What each micro-batch's loss is divided by under ``scale_grads``: ``chunks`` (as
        torch), except where the split is uneven and ``loss_fn`` declares that it averages
        over its rows (:func:`_declared_reduction`): the target's rows over the micro-batch's,
        so the gradients are those of the batch mean, as in one process."""
        rows = target_rows(self._target, self._target_dims)
        if rows is None or rows % self.chunks == 0 or \
                declared_reduction(self.loss_fn, self._loss_kwargs) != "mean":
            return [self.chunks] * self.chunks
        return [rows / part for part in part_rows(rows, self.chunks)]

    def _step_keyword_arguments(self) -> Optional[list]:
        """This step's keyword arguments per micro-batch, checked against the batch's rows
        (on a later stage's rank known from the headers, so at its first forward); a problem
        fails the step on every rank (the first stage's rank refused it before the step)."""
        problems = self._call_problems(self.links.batch_rows)
        if problems:
            self._fail(problems[0])
            return None
        return split_keyword_arguments(self._kwargs_arg, self.chunks, self._keyword_dims)

    def _remote(self, stage: int) -> Optional[int]:
        """The global rank of ``stage`` if another rank runs it, else ``None``."""
        if stage in self.stages or not 0 <= stage < self.num_stages:
            return None
        return next(iter(self.stages.values())).global_rank_of(stage)

    def _post_ahead(self, action) -> None:
        s, i = action.stage, action.microbatch
        if action.kind == "F" and s > 0 and self._remote(s - 1) is not None:
            self.links.post_activation(s - 1, i, self._remote(s - 1))
        elif action.kind in ("B", "BW") and (s, i) in self._live \
                and self._remote(s + 1) is not None:
            self.links.post_gradient(s, i, self._remote(s + 1))

    def _run_F(self, s: int, i: int) -> None:
        stage, last = self.stages[s], self.num_stages - 1
        if s == 0:
            activation, packed = self._stage_input(i), len(self._inputs[i]) > 1
        elif self._remote(s - 1) is None:
            activation, packed = self._handoff.pop(("F", s - 1, i))
        else:
            activation, packed = self.links.take_activation(s - 1, i, self._remote(s - 1))
        if self._kwargs is _UNSPLIT:
            self._kwargs = self._step_keyword_arguments()
        if s == last:
            self._step_targets(i)  # checked once a step; an unusable target fails the step
        if self.links.failed:  # no more work this step: pass on what the next stage expects
            self._skip_forward(s, i, activation)
            return
        meter = self.activation_memory
        metering = meter.recording(stage.parameters()) if meter else contextlib.nullcontext()
        with metering, self._busy():
            output = self._forward(s, i, activation if packed else activation[0])
            loss = self._loss(output, i) if s == last and output is not _FAILED \
                and not self._outputs_only(self._target) else None
        if output is _FAILED:
            self._skip_forward(s, i, activation)
            return
        if s == last:
            if loss is not None:
                self._losses.append(loss.detach())
            if loss is not None and loss.requires_grad and torch.is_grad_enabled():
                roots = [self._loss_root(loss, output, i)]
            else:
                roots = []
            if self._returns_outputs(self._target):
                self._keep_output(s, i, output)
        else:
            outputs, problem = output_tensors(output)
            if problem:
                self._fail_at(s, i, problem)
                self._skip_forward(s, i, activation)
                return
            if not torch.is_grad_enabled():  # a forward-only step records nothing: an output
                # that is a leaf requiring grad (the batch or a parameter passed on) must not
                # ask the next stage for a gradient, nor be backpropagated here
                outputs = tuple(o.detach() for o in outputs)
            packed_out = not isinstance(output, torch.Tensor)
            roots = [o for o in outputs if o.requires_grad]
            if self._remote(s + 1) is None:
                self._handoff[("F", s, i)] = (tuple(
                    o.detach().requires_grad_(o.requires_grad) for o in outputs), packed_out)
            else:
                problem = self.links.send_activation(s, i, outputs, packed_out,
                                                     self._remote(s + 1))
                if problem:  # zeros went in its place: nothing to backpropagate
                    self._fail(problem)
                    roots = []
        self._keep_live(s, i, activation, roots)

    def _stage_input(self, i: int) -> tuple:
        """The first stage's input for micro-batch ``i``: the batch's views, except that under
        a stage that may backpropagate zeros for an output no later stage used (ShardedDDP,
        FSDP: see :meth:`_output_grads`) the views requiring grad are replaced by detached
        leaves, so those zeros stop there: the batch gets only the gradients real output
        gradients reach (:func:`_reached`), handed back at the step's end as from B, and
        ``None`` where none does, as in one process."""
        views = self._inputs[i]
        if not (self._reducing[0] or self._whole_backward[0]) or not torch.is_grad_enabled() \
                or not any(v.requires_grad for v in views):
            return views
        return tuple(v.detach().requires_grad_() if v.requires_grad else v for v in views)

    def _forward(self, s: int, i: int, activation):
        """Stage ``s``'s module on micro-batch ``i``; an exception there fails the step on
        every rank (re-raised at its end, chained here) and gives ``_FAILED``. Communication
        errors (a peer died or is out of step) propagate at once."""
        module = self.stages[s].module
        try:
            kwargs = self._kwargs[i] if self._kwargs else {}
            with module.no_sync() if is_torch_ddp(module) else contextlib.nullcontext(), \
                    self._recording_frozen_outputs(s, i):
                return module(activation, **kwargs)
        except COMMUNICATION_ERRORS:
            raise
        except Exception as error:
            self._fail_at(s, i, f"its forward raised {type(error).__name__}: {error}"
                          + _packed_input_hint(activation, error), error)
            return _FAILED

    @contextlib.contextmanager
    def _recording_frozen_outputs(self, s: int, i: int):
        """While stage ``s`` runs micro-batch ``i`` forward: the autograd nodes of each of its
        frozen FSDP units' outputs (none for a unit not called, or whose outputs do not
        require grad: no backward gathers it), or ``None`` for a unit called under
        ``no_grad`` (inside activation checkpointing: what its backward does is unknown
        here), for :meth:`_replicas_reach_alike`. Nothing where the stage holds none."""
        units = self._frozen_units[s]
        if not units:
            yield
            return
        nodes = [set() for _ in units]

        def record(k, _module, _args, output):
            if not torch.is_grad_enabled():
                nodes[k] = None
            elif nodes[k] is not None:
                nodes[k] |= {get_gradient_edge(t).node for t in tree_flatten(output)[0]
                             if isinstance(t, torch.Tensor) and t.requires_grad}

        handles = [unit.register_forward_hook(functools.partial(record, k))
                   for k, (_, unit) in enumerate(units)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._frozen_outputs[(s, i)] = nodes

    def _skip_forward(self, s: int, i: int, activation) -> None:
        """Micro-batch ``i`` of a failed step at stage ``s``: no forward (no loss, zero input
        gradients on the way back), and the next stage gets what it expects."""
        if s < self.num_stages - 1:
            if self._remote(s + 1) is None:
                self._handoff[("F", s, i)] = ((torch.zeros(1, dtype=torch.uint8),), False)
            else:
                self.links.send_no_output(s, i, self._remote(s + 1))
        self._keep_live(s, i, activation, [])

    def _loss(self, output, i: int) -> Optional[torch.Tensor]:
        """``loss_fn`` on micro-batch ``i``; an exception there (a target that does not fit
        the output), or a value that is not a one-element tensor (``reduction="none"``: its
        backward would sum the elements, not average them), fails the step on every rank
        instead of leaving the others waiting."""
        watch = self._loss_watch
        try:
            if watch is not None and watch.watching:
                loss, record = watch.call(self.loss_fn, output, self._targets[i],
                                          self._loss_kwargs or {})
            else:
                loss = self.loss_fn(output, self._targets[i], **(self._loss_kwargs or {}))
        except Exception as error:  # re-raised on every rank at the end of the step
            self._fail_at_last_stage(i, f"loss_fn raised {type(error).__name__}: {error}"
                                     + self._target_rows_hint(output, i), error)
            return None
        if watch is not None and watch.watching:
            self._check_loss_count(watch, i, record, loss)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            found = f"a tensor of shape {tuple(loss.shape)}" if isinstance(
                loss, torch.Tensor) else f"a {type(loss).__name__}"
            self._fail_at_last_stage(i, f"loss_fn returned {found}; expected a one-element "
                                        f"tensor (the micro-batch's loss, e.g. "
                                        f"reduction='mean', or 'sum' with scale_grads=False)")
            return None
        return loss

    def _check_loss_count(self, watch: LossCountWatch, i: int, record, loss) -> None:
        """For a ``loss_fn`` that does not declare what its mean divides by: at the step's
        first loss averaging by its target's counts, learn it
        (:class:`~shardkit.nn.pipe.loss_count.LossCountWatch`) and weigh every micro-batch by
        it (only guards' zeros, which add no gradient, have been backpropagated before); at
        later ones, fail the step where a micro-batch's counts differ from what was learnt."""
        learnt = watch.learnt
        problem = watch.observe(i, record, loss)
        if problem:
            self._fail_at_last_stage(i, problem)
        elif not learnt and watch.counts is not None:
            self._loss_divisors = self._divisors_of_counts(watch.counts)
        elif not learnt and watch.watching:  # a masked mean whose counts must all be alike
            self._loss_divisors = [self.chunks] * self.chunks

    def _target_rows_hint(self, output, i: int) -> str:
        """Where micro-batch ``i``'s target and output disagree on dim 0 (the likely reason
        ``loss_fn`` raised), how the target was cut."""
        target = self._targets[i]
        leaves = tree_flatten(output)[0]
        if self._target_dims != 0 or not isinstance(target, torch.Tensor) or not leaves or \
                not isinstance(leaves[0], torch.Tensor) or leaves[0].dim() == 0 or \
                leaves[0].shape[0] == target.shape[0]:
            return ""
        return (f" (its target has {target.shape[0]} rows, its output {leaves[0].shape[0]}: "
                f"the target's {self._target.shape[0]} rows are cut into chunks={self.chunks} "
                f"micro-batches along dim 0 with torch.tensor_split, as the batch is)")

    def _keep_live(self, s: int, i: int, activation, roots) -> None:
        self._live[(s, i)] = (activation, roots)
        self._alive += 1
        self.peak_live_microbatches = max(self.peak_live_microbatches, self._alive)

    def _output_grads(self, s: int, i: int, roots: list,
                      split: bool = False) -> tuple[list, Optional[list], Optional[list]]:
        """The roots of stage ``s``'s backward on micro-batch ``i`` that get a gradient, those
        gradients (``None``: the last stage's loss, ones), and ``None``, or the roots whose
        gradient is real when some fed are zeros. An output the next stage gave no gradient
        (it ignored or detached that tensor) is left out, as one process's backward never
        reaches it: the parameters only it depends on keep ``.grad`` ``None``, and with no
        gradient at all there is no backward.

        A stage whose module reduces gradients inside backward (ShardedDataParallel, FSDP) must
        issue the same reductions as its replicas, whose next stages may have used that output:
        a ShardedDDP stage leaves the output out when the backward still reaches some trainable
        parameter, and otherwise takes zeros for it (those parameters then get zeros, which is
        one process's gradient wherever a replica gave them one). An FSDP stage always takes
        zeros, so that every replica gathers and reduce-scatters the same units in the same
        order (a frozen unit only that output reaches gathers; units both outputs reach may be
        reached in another order): its units get ``None`` for the views only the zeros reached
        (:func:`zeros_only_views`; under B and W, :class:`ShardedGradientSink`). The caller
        reports the input gradients only the real roots reach (:func:`_reached`)."""
        if s == self.num_stages - 1:
            return roots, None, None
        if self._remote(s + 1) is None:
            grads = self._handoff.pop(("B", s, i))
        else:
            grads = self.links.take_gradient(s, i, self._remote(s + 1))
        pairs = list(zip(roots, grads))
        real = [(r, g) for r, g in pairs if g is not None]
        if len(real) < len(pairs) and self._feeds_zeros(s, roots, [r for r, _ in real], split):
            return [r for r, _ in pairs], [g if g is not None else torch.zeros_like(r)
                                           for r, g in pairs], [r for r, _ in real]
        return [r for r, _ in real], [g for _, g in real], None

    def _feeds_zeros(self, s: int, roots: list, real: list, split: bool) -> bool:
        """Whether stage ``s`` must backpropagate zeros for its roots without a gradient (see
        :meth:`_output_grads`). Walks the micro-batch's graph; local."""
        if self._whole_backward[s] and (split or self._reducing[s]):
            # FSDP: the replicas' gathers and reduce-scatters follow the graph's units in the
            # order backward reaches them (a frozen unit gathers too), so every replica runs the
            # whole graph; the views only zeros reach get None (zeros_only_views, or W)
            return True
        if not self._reducing[s]:
            return False
        params = {id(p) for p in self.stages[s].module.parameters() if p.requires_grad}
        return _reaches_a_parameter(roots, params) != _reaches_a_parameter(real, params)

    def _replicas_reach_alike(self, s: int, i: int, activation, roots: list) -> bool:
        """Whether stage ``s``'s replicas agree on which of its frozen FSDP units micro-batch
        ``i``'s backward runs through (else ``True`` at no cost, where it holds none).

        Note: a backward gathers a frozen unit only where it runs through the unit's output,
        that is where a path leads from there to something needing a gradient (a trainable
        parameter, or the stage's input): a stage that ignores its input on one replica and
        uses it on another may gather a unit on one side only (gloo aborts both). So every
        replica shares, before this backward, whether it runs through each unit, which inputs
        it reaches, and whether it called a unit under ``no_grad`` (inside activation
        checkpointing, where what the backward gathers is unknown here): one all-reduce of
        ``units + MAX_TENSORS + 1`` elements over each frozen unit's group, on every replica.
        Where they differ on a unit (or, with a unit unknown somewhere, on an input) every
        replica skips this backward alike (no unit gathers or reduce-scatters for it) and
        fails the step. A unit that every replica's backward runs through (a trainable layer
        before it) is no reason to refuse, whatever the input."""
        units = self._frozen_units[s]
        if not units:
            return True
        outputs = self._frozen_outputs.pop((s, i), None) or [set() for _ in units]
        needed = _nodes_needing_gradients(roots, activation)
        runs = [float(bool(nodes and nodes & needed)) for nodes in outputs]
        unknown = float(any(nodes is None for nodes in outputs))
        local = torch.tensor(runs + _inputs_reached(roots, activation) + [unknown],
                             device=self.stages[s].device)
        differ_units, differ_inputs, unknown_somewhere = [], set(), False
        groups = {id(unit.process_group): unit.process_group for _, unit in units}
        for group in groups.values():  # one per group, in module order
            total = local.clone()
            dist.all_reduce(total, group=group)
            size, total = dist.get_world_size(group), total.tolist()
            split = [k for k, v in enumerate(total[:-1]) if 0 < v < size]
            differ_units += [units[k][0] for k in split
                             if k < len(units) and units[k][1].process_group is group]
            differ_inputs.update(k - len(units) for k in split if k >= len(units))
            unknown_somewhere |= total[-1] > 0  # then the inputs decide
        if not differ_units and not (unknown_somewhere and differ_inputs):
            return True
        names = ", ".join(differ_units or [n for n, _ in units])
        what = f"whether its backward reaches its input {sorted(differ_inputs)} (the stage " \
            f"ignores it on some replicas only) and " if differ_inputs else "whether its " \
            "backward "
        self._fail_at(s, i, f"its replicas (FSDP's data-parallel ranks) disagree on {what}"
                            f"runs through FSDP units whose parameters are all frozen "
                            f"({names}), which a backward gathers only where it reaches "
                            f"them: their collectives would not pair. Use the input alike on "
                            f"every replica, or leave the frozen layers in the stage's outer "
                            f"unit (kept gathered from forward to backward)")
        return False

    def _send_input_grads(self, s: int, i: int, activation, grads) -> None:
        """Hand the gradients of stage ``s``'s inputs back (one per input requiring grad,
        ``None`` where the backward did not reach it: the previous stage leaves that output
        out of its backward)."""
        if s == 0:  # to the batch's views (the stage may have run on leaves standing in)
            self._batch_grads += [(a, g) for a, g in zip(self._inputs[i], grads)
                                  if a.requires_grad and g is not None]
            return
        grads = [g for a, g in zip(activation, grads) if a.requires_grad]
        if self._remote(s - 1) is None:
            self._handoff[("B", s - 1, i)] = grads
        else:
            self.links.send_gradient(s - 1, i, grads, self._remote(s - 1))

    def _run_BW(self, s: int, i: int) -> None:
        if not self._whole_backward[s] and not self._sinks[s].deferred:
            self._run_B(s, i)  # the input gradient goes back first, then W
            self._run_W(s, i)
            return
        # gradient hooks (data-parallel wrappers, FSDP) see one plain backward per micro-batch
        activation, roots = self._live.pop((s, i))
        roots, grads, real = self._output_grads(s, i, roots)
        if not self._replicas_reach_alike(s, i, activation, roots):
            roots = []
        views = zeros_only_views(roots, real) if real is not None and self._whole_backward[s] \
            else contextlib.nullcontext()

        def run():
            with views:
                torch.autograd.backward(roots, grads)
        failed = roots and self._backward(s, i, run) is _FAILED
        # stage 0 on the batch's own views: the plain backward has already reached the batch
        input_grads = [None] * len(activation) if failed or \
            s == 0 and activation is self._inputs[i] else \
            _reached(real, activation, [a.grad for a in activation])
        self._send_input_grads(s, i, activation, input_grads)
        self._alive -= 1

    def _run_B(self, s: int, i: int) -> None:
        activation, roots = self._live.pop((s, i))
        roots, grads, real = self._output_grads(s, i, roots, split=True)
        if not self._replicas_reach_alike(s, i, activation, roots):
            roots = []
        result = self._backward(s, i, lambda: backward_input(
            roots, grads, activation, self._sinks[s].weight_targets(roots, real),
            split_at_parameters=self._whole_backward[s])) if roots else None
        if result is None or result is _FAILED:
            result = [None] * len(activation), None
        input_grads, self._weights[(s, i)] = result
        input_grads = _reached(real, activation, input_grads)
        self._send_input_grads(s, i, activation, input_grads)

    def _run_W(self, s: int, i: int) -> None:
        weight_pass = self._weights.pop((s, i))
        if weight_pass is not None:
            self._backward(s, i, lambda: self._sinks[s].run(weight_pass))
        self._alive -= 1

    def _hand_batch_grads(self) -> None:
        """Give the step's batch tensors that require grad their gradient, as one process's
        backward would (B computed each micro-batch's for stage 0; its inputs are views of the
        batch): one autograd call for the step, so a graph that built the batch before the
        pipeline is walked once. Memory: the first stage's input gradients until the step's
        end (the batch's size), only where the batch requires grad."""
        views, grads = zip(*self._batch_grads)
        self._batch_grads = []
        torch.autograd.backward(list(views), list(grads))

    def _backward(self, s: int, i: Optional[int], run: Callable,
                  what: str = "handing the weight gradients to the parameters"):
        """``run()``, a backward part of stage ``s`` on micro-batch ``i`` (``None``: ``what``,
        a part of the step's end); an exception there (a custom autograd
        function or a gradient hook raising, a tensor modified in place) fails the step on
        every rank as a forward's does: the stage sends zero input gradients and gives
        ``_FAILED``. Communication errors propagate at once, and so does any exception in a
        stage that reduces gradients inside backward (see ``_reduces_during_backward``)."""
        try:
            with self._busy():
                return run()
        except COMMUNICATION_ERRORS:
            raise
        except Exception as error:
            if self._reducing[s]:
                raise
            problem = f"its backward raised {type(error).__name__}: {error}"
            if i is None:
                self._fail(f"stage {s}: {what}, {problem}", error)
            else:
                self._fail_at(s, i, problem, error)
            return _FAILED

    def _busy(self):
        return busy_time(self)

    # ------------------------------------------------------------------ checks
    def _batch_problems(self, inputs) -> list[str]:
        """What is wrong with the batch the first stage got (checked every step)."""
        name = type(self).__name__
        if not inputs:
            return [f"the first stage needs the batch: call {name}.step(*inputs)"]
        try:
            size = batch_size(inputs, f"{name}.step(*inputs)")
        except (TypeError, ValueError) as error:
            return [str(error)]
        if self.chunks > size:
            return [f"chunks={self.chunks} is larger than the batch size {size}; use "
                    f"chunks <= {size}"]
        return []

    def _batch_rows(self, inputs) -> Optional[int]:
        """The batch's rows on the rank running the first stage; ``None`` elsewhere, or where
        the batch is unusable (:meth:`_batch_problems` names why)."""
        if 0 not in self.stages or self._batch_problems(inputs):
            return None
        return batch_size(inputs, "step")

    def _local_problems(self, inputs, target) -> list[str]:
        problems = list(self._problems)
        if 0 in self.stages:
            problems += self._batch_problems(inputs)
        rows = self._batch_rows(inputs)  # None on the other ranks: checked during the step
        problems += self._call_problems(rows)
        last = self.num_stages - 1
        if last in self.stages:
            where = f"stage {last} (the last): " if len(self.stages) > 1 else ""
            problems += [where + p for p in self._target_problems(target, rows)]
        return problems

    def _call_problems(self, batch_rows: Optional[int] = None) -> list[str]:
        """What is wrong with this rank's keyword arguments to :meth:`step` (on any rank;
        given the batch's rows, where this rank knows them, also a keyword tensor that would
        be cut at other rows than the batch)."""
        name = type(self).__name__
        problems = keyword_argument_problems(f"{name}.step", self._kwargs_arg, self.chunks,
                                             self._keyword_dims, batch_rows)
        if self._return_outputs is not None and not isinstance(self._return_outputs, bool):
            problems.append(f"{name}.step(return_outputs={self._return_outputs!r}): expected "
                            f"True (the last stage returns its merged outputs), False (it "
                            f"returns None) or None (the default: it returns the loss)")
        loss_kwargs = self._loss_kwargs
        if loss_kwargs is not None and (not isinstance(loss_kwargs, dict) or not all(
                isinstance(k, str) for k in loss_kwargs)):
            problems.append(f"{name}.step(loss_kwargs={type(loss_kwargs).__name__}): expected a "
                            f"dict of keyword arguments for loss_fn(output, target, **"
                            f"loss_kwargs), with str keys, or None")
        return problems

    def _outputs_only(self, target) -> bool:
        """Whether the last stage computes no loss this step: a forward-only step asked for its
        outputs (``return_outputs=True``) without a ``loss_fn`` or without a ``target``, or
        one without a ``target`` and ``return_outputs`` unset (there is no loss to return: the
        outputs are returned, as torch's inference with a schedule built without
        ``loss_fn``)."""
        if torch.is_grad_enabled() or self._return_outputs is False:
            return False
        if self._return_outputs is None:
            return target is None
        return self.loss_fn is None or target is None

    def _returns_outputs(self, target) -> bool:
        """Whether this step returns the last stage's merged outputs rather than the loss."""
        return self._return_outputs is True or self._outputs_only(target)

    def _target_problems(self, target, batch_rows: Optional[int] = None) -> list[str]:
        """What is wrong with the last stage's target (its tensors split along dim 0 like the
        batch, inside tuples, lists and dicts too): given the batch's rows, also a tensor
        whose micro-batches would not hold the batch's micro-batches' samples (a flattened
        target is fine where ``chunks`` divides the batch, not elsewhere)."""
        losses = self._losses_arg
        if losses is not None and not isinstance(losses, list):
            return [f"losses={type(losses).__name__}: expected a list (it receives each "
                    f"micro-batch's loss) or None"]
        if self._outputs_only(target):
            return []  # no loss this step: the target is not used
        name, problems = type(self).__name__, []
        if self.loss_fn is None:  # checked every step: an inference step may have come first
            problems.append(f"the last stage needs {name}(..., loss_fn=...) (without one, only "
                            f"a forward-only step with return_outputs=True runs: "
                            f"{name}.eval(x, return_outputs=True))")
        if target is None:
            outputs = "" if torch.is_grad_enabled() else \
                " (or, for the outputs without a loss, return_outputs=True)"
            problems.append(f"the last stage needs the target: call {name}.step(..., "
                            f"target=...){outputs}")
        else:
            problems += target_split_problems(target, self.chunks, batch_rows,
                                              self._target_dims)
        return problems

    def _check_agreement(self, inputs, target, grad: Optional[bool] = None,
                         replicas_too: bool = False) -> None:
        """The pipeline group's agreement on the step (see
        :func:`~shardkit.nn.pipe.schedules.check_schedule_agreement`); a refusal is told to the
        stages' data-parallel replicas first (:meth:`_refuse_to_replicas`: ``grad``, the
        step's grad mode, default this rank's), so a pipeline that ran the step is not left
        waiting for this one. ``replicas_too`` (the first step): ShardedDataParallel / FSDP
        stages' replicas share their refusals before (:meth:`_replica_refusals`)."""
        grad = torch.is_grad_enabled() if grad is None else grad
        local = self._local_problems(inputs, target)
        if replicas_too:
            local += self._replica_refusals(local, grad)
        shards = (bool(self._reducing_replica_groups(True)),
                  bool(self._reducing_replica_groups(False)))
        try:
            training, evaluating = check_schedule_agreement(
                type(self).__name__, self.chunks, local, self.group, self._who,
                self._tie_status(), self._keyword_dims, flags=shards)
            self._pipeline_shards = {True: training, False: evaluating}
        except ValueError as refusal:
            self._refuse_to_replicas(str(refusal), grad)
            raise

    def _tie_status(self) -> dict:
        """``{key: requires_grad}`` of this rank's copies of weights tied across ranks."""
        return {key: param.requires_grad for stage in self.stages.values()
                for key, param in stage.tie_copies}

    def _check_first_step(self, inputs, target, grad: bool) -> None:
        """The first step's checks; again at the first step after a failed one, and at the
        first training step after eval steps (these share no refusal over the replicas of
        ShardedDataParallel stages: see :meth:`_replica_refusals`)."""
        self._check_agreement(inputs, target, grad, replicas_too=True)
        self._checked = True
        self._replicas_checked = self._replicas_checked or grad

    def _replica_refusals(self, local: list, grad: bool) -> list[str]:
        """Before the first step (and the next after a failed one): where a stage's module
        reduces inside forward and backward over replicas in other pipelines
        (ShardedDataParallel, FSDP), whether a replica's rank refuses the step (``local``:
        this rank's problems), as problems naming it, and whether the replicas disagree on
        training against eval; one all-reduce of three elements per such group, and one
        small all-gather only where some replica refused. A pipeline that ran
        the step would otherwise wait in those modules' collectives for the one that refused
        it. No communication for other stages (their refusal rides on the step's gradient
        all-reduce: :meth:`_refuse_to_replicas`). A step that records no backward (``grad``
        false: :meth:`eval`) shares them over FSDP groups only, whose forward gathers
        parameters over the replicas: ShardedDataParallel communicates in backward only, so an
        eval step that one pipeline runs alone joins no all-reduce there."""
        problems = []
        groups = self._reducing_replica_groups(grad)
        for group, refused, disagree in _replica_verdicts(groups, bool(local), grad):
            if disagree:
                problems.append(_step_kind_disagreement(grad))
            if not refused:
                continue
            found = dist.all_gather_object(local, group=group)
            problems += [f"data-parallel replica at global rank {rank} (of the group of a "
                         f"ShardedDataParallel / FSDP stage module) refuses the step: {p}"
                         for rank, ps in zip(dist.group_ranks(group), found)
                         if rank != dist.get_rank() for p in ps]
        return problems

    def _check_with_sharded_replicas(self, inputs, target, grad: bool) -> None:
        """Before a step after the first, where this rank's stage modules communicate over
        replicas in other pipelines inside forward or backward (ShardedDataParallel in a
        training step, FSDP in any): whether any rank of any such pipeline refuses the step
        (its batch, keyword arguments or target, as the first step checks them), or a replica
        runs the other kind of step (eval against training). One all-reduce of three
        elements per replica group, then one of two over the pipeline group, reach every
        rank of every pipeline; a refusal then takes :meth:`_check_agreement`'s path (the
        same error on every rank, naming the replica), a disagreement on the kind of step
        is a ValueError on every rank. Without this a pipeline that ran the step waits
        forever in those modules' collectives for the one that refused it. Every rank of a
        pipeline with such a stage module joins the pipeline group's all-reduce, its ranks
        running other stages too (learnt at the first step: ``_pipeline_shards``)."""
        if not self._pipeline_shards.get(grad):
            return
        groups = self._reducing_replica_groups(grad)
        verdicts = _replica_verdicts(groups, bool(self._local_problems(inputs, target)), grad)
        verdict = torch.tensor([float(any(refused for _, refused, _ in verdicts)),
                                float(any(disagree for _, _, disagree in verdicts))],
                               device=next(iter(self.stages.values())).device)
        if self.num_ranks > 1:
            dist.all_reduce(verdict, group=self.group)
        if verdict[1] > 0:
            raise ValueError(f"{type(self).__name__}.step: the pipelines cannot run this step: "
                             f"{_step_kind_disagreement(grad)}")
        if verdict[0] > 0:
            self._check_agreement(inputs, target, grad, replicas_too=True)

    def _reducing_replica_groups(self, grad: bool = True) -> list:
        """``(group, device)`` of each process group over more than one rank that this rank's
        ShardedDataParallel / FSDP stage modules communicate over (FSDP's only where ``grad``
        is false), once each, in stage and module order (alike on every replica)."""
        from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

        groups = {}
        for s, stage in self.stages.items():
            if not self._reducing[s]:
                continue
            for m in stage.module.modules():
                if isinstance(m, FullyShardedDataParallel) or \
                        grad and isinstance(m, ShardedDataParallel):
                    for group in (m.process_group, getattr(m, "replicate_group", None)):
                        if group is not None and dist.get_world_size(group) > 1:
                            groups.setdefault(id(group), (group, stage.device))
        return list(groups.values())


def _replica_verdicts(groups: list, refused: bool, grad: bool) -> list:
    """Over each ``(group, device)`` of replicas that a stage module communicates with inside
    forward or backward, in order: ``(group, some replica refuses the step, the replicas
    disagree on training against eval)``, from one all-reduce of three elements per group."""
    verdicts = []
    for group, device in groups:
        flags = torch.tensor([float(refused), float(grad), 1.0], device=device)
        dist.all_reduce(flags, group=group)
        refusals, training, replicas = flags.tolist()
        verdicts.append((group, refusals > 0, 0 < training < replicas))
    return verdicts


def _step_kind_disagreement(grad: bool) -> str:
    kind = "a training step" if grad else "eval (forward only, under torch.no_grad())"
    return (f"this rank runs {kind}, but a data-parallel replica of its ShardedDataParallel / "
            f"FSDP stage module (whose collectives span the pipelines) runs the other kind; "
            f"call step() or eval() alike on every pipeline")


def last_messages(plan: PipelinePlan) -> dict:
    """Which micro-batch's message crosses each stage boundary last, each way (the step's
    verdict rides on it): ``(ACTIVATION, b)``: stage ``b``'s last F; ``(GRADIENT, b)``: stage
    ``b + 1``'s last B or BW."""
    last = {}
    for order in plan.orders:
        for action in order:
            if action.kind == "F":
                last[(ACTIVATION, action.stage)] = action.microbatch
            elif action.kind in ("B", "BW"):
                last[(GRADIENT, action.stage - 1)] = action.microbatch
    return last


def _one_tie_per_weight(stages: list) -> list:
    """The stages' cross-rank ties, one per weight: a weight two of this rank's stages hold
    is tied once, from the earlier of them (as the other rank sees it)."""
    ties = {}
    for stage in sorted(stages, key=lambda st: st.stage_index, reverse=True):
        for tie in stage.ties:
            ties[id(tie.param)] = tie
    return list(ties.values())


def _graph_nodes(roots: list) -> set:
    """The autograd nodes below ``roots`` (theirs included)."""
    stack = [get_gradient_edge(r).node for r in roots if r.requires_grad]
    seen = set(stack)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def _inputs_reached(roots: list, activation) -> list:
    """``1.0`` for each of the first ``MAX_TENSORS`` of ``activation``'s tensors requiring
    grad that a backward from ``roots`` reaches, else ``0.0``."""
    nodes = _graph_nodes(roots)
    reached = [0.0] * MAX_TENSORS
    for k, a in enumerate(activation[:MAX_TENSORS]):
        if isinstance(a, torch.Tensor) and a.requires_grad and get_gradient_edge(a).node in nodes:
            reached[k] = 1.0
    return reached


def _nodes_needing_gradients(roots: list, activation) -> set:
    """The autograd nodes below ``roots`` that a backward from them runs: those with a path
    to a leaf requiring grad (a trainable parameter's or input's ``AccumulateGrad``) or to
    one of ``activation``'s tensors requiring grad."""
    targets = {get_gradient_edge(a).node for a in activation
               if isinstance(a, torch.Tensor) and a.requires_grad}
    needed, done = set(), set()
    stack = [(get_gradient_edge(r).node, False) for r in roots if r.requires_grad]
    while stack:  # post-order, so that a node is decided after its children
        node, expanded = stack.pop()
        if node in done:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in done)
            continue
        done.add(node)
        if node in targets or hasattr(node, "variable") or \
                any(child in needed for child in children):
            needed.add(node)
    return needed


def _reaches_a_parameter(roots: list, params: set) -> bool:
    """Whether a backward from ``roots`` accumulates into a parameter whose ``id`` is in
    ``params``."""
    return any(id(getattr(n, "variable", None)) in params for n in _graph_nodes(roots))


def _reached(real: Optional[list], tensors, grads: list) -> list:
    """``grads`` of ``tensors``, ``None`` where a backward from the ``real`` roots alone
    (``None``: every root was real) would not reach the tensor (zeros fed for the others
    reached it)."""
    if real is None:
        return list(grads)
    nodes = _graph_nodes(real)
    return [g if g is not None and isinstance(t, torch.Tensor) and t.requires_grad
            and get_gradient_edge(t).node in nodes else None for t, g in zip(tensors, grads)]


def _device_problems(stages: list) -> list[str]:
    """A rank whose stages are on different devices: its pipeline messages (activations,
    gradients, headers) are sent and received on one device, its stages'. Local."""
    if len({stage.device for stage in stages}) < 2:
        return []
    where = ", ".join(f"stage {stage.stage_index} on {str(stage.device)!r}" for stage in stages)
    return [f"the stages of one rank must be on one device (its pipeline messages are sent and "
            f"received there), got {where}; move their modules to one device (module.to(...)) "
            f"and pass it as each PipelineStage's device"]


def _packed_input_hint(activation, error: Exception) -> str:
    """What to do when a stage module given several tensors raised a TypeError (most likely
    a ``forward(self, a, b)``): shardkit passes them as one tuple, where torch unpacks them."""
    if not isinstance(activation, tuple) or not isinstance(error, TypeError):
        return ""
    return (f" (the stage's input is a tuple of {len(activation)} tensors, passed as one "
            f"argument as in nn.Sequential, where torch.distributed.pipelining unpacks it: "
            f"take one argument and unpack it in forward)")


def _reduces_during_backward(stage: PipelineStage) -> bool:
    """Whether the stage module's own hooks reduce gradients over replicas inside backward
    (ShardedDataParallel, FSDP on more than one rank): a backward raising there cannot be
    passed over, since its replicas may already wait in that reduction."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

    return any(isinstance(m, ShardedDataParallel) and m.world_size > 1
               or isinstance(m, FullyShardedDataParallel) and (
                   m.world_size > 1 or getattr(m, "replicate_group", None) is not None)
               for m in stage.module.modules())


def _runs_whole_backward(stage: PipelineStage) -> bool:
    """Whether BW stays one plain backward (FSDP's hooks then reduce-scatter as usual); B and W
    of such a stage go through :class:`ShardedGradientSink`."""
    return stage_is_fully_sharded(stage.module)


class ScheduleGPipe(PlanSchedule):
    """GPipe: every micro-batch forward, then every micro-batch backward; one stage per rank.

    Memory: the activations of all ``chunks`` micro-batches are alive on every stage at the end
    of the forwards. Bubble: ``(p-1)/(m+p-1)`` of the step for ``p`` stages and ``m`` chunks.
    Communication: see :class:`PipelineStage`.

    Args (beyond :class:`PlanSchedule`'s):
        batch_weight_grads: ``False`` is ``weight_grad_merge=1`` (each micro-batch's weight
            gradients as its backward runs); ``None`` or ``True``: the default, every
            matrix-product weight gradient merged over all micro-batches, or over as many as
            make 128 rows (the same gradients up to rounding, much faster with small
            micro-batches).
    """

    _who = "stage"

    def __init__(self, stage: PipelineStage, chunks: Optional[int] = None,
                 loss_fn: Optional[Callable] = None,
                 track_activation_memory: bool = False, batch_weight_grads: Optional[bool] = None,
                 weight_grad_merge: Optional[int] = None, scale_grads: bool = True,
                 **torch_options):
        if batch_weight_grads not in (None, True, False):
            raise ValueError(f"ScheduleGPipe(batch_weight_grads={batch_weight_grads!r}): "
                             f"expected None (automatic), True or False")
        if batch_weight_grads is False and weight_grad_merge is None:
            weight_grad_merge = 1
        super().__init__(_one_stage(self, stage), chunks, loss_fn, track_activation_memory,
                         weight_grad_merge, scale_grads, **torch_options)

    def default_merge(self) -> int:
        return self.chunks

    def build_plan(self, num_ranks, chunks, costs=None):
        if self.num_stages != num_ranks:
            return _unrunnable(self, "one stage per rank")
        return gpipe_plan(num_ranks, chunks)


class Schedule1F1B(PlanSchedule):
    """1F1B: after a warm-up of ``p - s - 1`` forwards, stage ``s`` alternates one forward and
    one backward, then drains the remaining backwards; one stage per rank.

    Memory: at most ``min(p - s, m)`` micro-batches of activations alive on stage ``s`` (the
    first stage holds the most), instead of GPipe's ``m``, plus the merged weight-gradient
    inputs (``weight_grad_merge``). Same bubble and communication as :class:`ScheduleGPipe`.
    """

    _who = "stage"

    def __init__(self, stage: PipelineStage, chunks: Optional[int] = None,
                 loss_fn: Optional[Callable] = None,
                 track_activation_memory: bool = False, weight_grad_merge: Optional[int] = None,
                 scale_grads: bool = True, **torch_options):
        super().__init__(_one_stage(self, stage), chunks, loss_fn, track_activation_memory,
                         weight_grad_merge, scale_grads, **torch_options)

    def build_plan(self, num_ranks, chunks, costs=None):
        if self.num_stages != num_ranks:
            return _unrunnable(self, "one stage per rank")
        return one_f_one_b_plan(num_ranks, chunks)


def _one_stage(schedule, stage):
    if not isinstance(stage, PipelineStage):
        several = (f"; {type(schedule).__name__} runs one stage per rank (pass the stage "
                   f"itself), ScheduleInterleaved1F1B and ScheduleZBV take a list of several"
                   if isinstance(stage, (list, tuple)) else "")
        raise TypeError(f"{type(schedule).__name__}(stage={type(stage).__name__}): expected a "
                        f"PipelineStage{several}")
    if stage.num_stages != stage.group_size:
        raise ValueError(f"{type(schedule).__name__}(stage=...): runs one stage per rank, but "
                         f"the pipeline has {stage.num_stages} stages on {stage.group_size} "
                         f"ranks; use ScheduleInterleaved1F1B or ScheduleZBV with several "
                         f"stages per rank")
    return stage


class ScheduleInterleaved1F1B(PlanSchedule):
    """Interleaved 1F1B (Megatron-LM): ``v = len(stages)`` stages per rank, stage ``c*p + r`` on
    rank ``r`` (``PipelineStage(..., placement="loop")``). Micro-batches go through in rounds
    of ``g = p`` when ``chunks`` is a multiple of ``p``, else of ``g = m / max(1, m // p)``,
    which must be whole (torch's rule: 3 chunks on 4 ranks, 10 on 4, 6 on 4 work; 9 on 4 does
    not, and the error names the nearest sizes that do).

    Bubble: ``(p-1)/(v*m)`` of the work when ``g = p``, ``v`` times less than 1F1B's. Memory:
    at most ``(v-1)*g + 2*(p-1-r) + 1`` stage-micro-batches alive on rank ``r`` (each stage
    ``1/v`` of the layers a 1F1B stage would hold). Communication: ``v`` times 1F1B's
    messages, each of one activation (or its gradient).
    """

    def build_plan(self, num_ranks, chunks, costs=None):
        return interleaved_1f1b_plan(num_ranks, chunks, self.num_stages // num_ranks)


class ScheduleZeroBubble(PlanSchedule):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): one stage per rank; backward split
    into B (input gradient, sent back at once) and W (parameter gradients), W delayed ``r``
    micro-batches on rank ``r`` so it fills the cool-down.

    Bubble: ``(p-1)(F+B-W)``, a third of 1F1B's when F, B and W take equal time. Memory: at most
    ``p`` micro-batches alive on every rank (1F1B's peak), plus the gradients B records for W
    (about one activation per parameterised layer per waiting micro-batch). Gradient hooks on
    parameters fire once per step. Communication: as 1F1B. Under FSDP: see
    :mod:`~shardkit.nn.pipe.fsdp_weight_sink` (each unit reduce-scatters after each W).
    """

    def build_plan(self, num_ranks, chunks, costs=None):
        if self.num_stages != num_ranks:
            return _unrunnable(self, "one stage per rank")
        return zb_h1_plan(num_ranks, chunks)


class ScheduleZBV(PlanSchedule):
    """ZBV: two stages per rank in a V (``PipelineStage(..., placement="v")``: rank ``r`` runs
    stages ``r`` and ``2p-1-r``, so the last stage sits beside the first), backward split into B
    and W, F/B/W list-scheduled with at most ``2p`` stage-micro-batches alive per rank.

    Bubble: close to zero (see :func:`~shardkit.nn.pipe.plan.zbv_plan`'s dry run). Memory: at
    most ``2p`` half-size stage-micro-batches per rank, 1F1B's peak. Communication: about twice
    1F1B's messages, each of one activation; the hand-over at the V's tip stays on the rank.
    Each of the two stages may be wrapped in its own FSDP (see
    :mod:`~shardkit.nn.pipe.fsdp_weight_sink`).

    The first two training steps run the order planned for F = B = W; at the end of the
    second, the ranks of every pipeline share the compute seconds they measured per F, B and W
    in it (one small all-gather over the default group) and every rank re-plans with them
    (``self.plan`` changes once; the memory bound stays). Steps under ``torch.no_grad()`` do
    not count.
    """

    plans_from_measured_costs = True

    def build_plan(self, num_ranks, chunks, costs=None):
        if self.num_stages != 2 * num_ranks:
            return _unrunnable(self, "two stages per rank")
        return zbv_plan(num_ranks, chunks, costs)


# torch.distributed.pipelining's constructor options, with the values that mean what shardkit
# does (tensors split along dim 0 into equal chunks, outputs concatenated along dim 0 by
# step(return_outputs=True), the split backward run by the schedule itself)
_TORCH_DEFAULTS = {"args_chunk_spec": None, "output_merge_spec": None,
                   "use_full_backward": None, "backward_requires_autograd": True,
                   "defer_pp_recv": False}


def _microbatch_count(name: str, chunks, n_microbatches):
    """The micro-batches per step, given as ``chunks`` (shardkit's and FairScale's name) or
    ``n_microbatches=`` (torch's). Local, before any collective."""
    if n_microbatches is None:
        if chunks is None:
            raise TypeError(f"{name}() needs the number of micro-batches per step: chunks "
                            f"(2nd argument) or n_microbatches=... (torch's name)")
        return chunks
    if chunks is not None:
        raise TypeError(f"{name}(chunks={chunks!r}, n_microbatches={n_microbatches!r}): the "
                        f"number of micro-batches is given twice (n_microbatches is torch's "
                        f"name for chunks); pass it once")
    return n_microbatches


def _check_torch_options(name: str, options: dict) -> None:
    """Accept torch's schedule options at their defaults (code written for torch's schedules
    often spells them out), and an ``args_chunk_spec`` that splits along dim 0 as shardkit does;
    refuse any other value by name, and unknown names as Python would. Local, before any
    collective."""
    for option, value in options.items():
        if option not in _TORCH_DEFAULTS:
            raise TypeError(f"{name}.__init__() got an unexpected keyword argument {option!r}")
        if option == "args_chunk_spec":
            problem = positional_chunk_spec_problem(value)
            if problem:
                raise ValueError(f"{name}(args_chunk_spec={value!r}): {problem}")
            continue
        default = _TORCH_DEFAULTS[option]
        if value is default or (default is not None and value == default
                                and isinstance(value, bool)):
            continue
        raise ValueError(
            f"{name}({option}={value!r}): shardkit's schedules take only torch's default "
            f"({default!r}): they split every tensor argument along dim 0 into equal chunks, "
            f"concatenate the last stage's outputs along dim 0 (step(return_outputs=True)) and "
            f"run the backward themselves; split or merge other dimensions in the stage module")


def _unrunnable(schedule: PlanSchedule, need: str) -> PipelinePlan:
    raise ValueError(f"{type(schedule).__name__} runs {need}, but the pipeline has "
                     f"{schedule.num_stages} stages on {schedule.num_ranks} ranks")
