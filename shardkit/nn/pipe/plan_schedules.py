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
counts them, and so is :func:`~shardkit.nn.model_parallel.gpt.gpt_loss` (its non-ignored tokens,
declared in its ``target_count`` attribute); any other declares its count with
``loss_denominator=lambda target: ...``. A
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

This module holds the schedules and the executor's main loop (a step, its forwards); the
executor's other concepts are mixins of :class:`PlanSchedule`, one module each:
:mod:`~shardkit.nn.pipe.step_checks` (before a step), :mod:`~shardkit.nn.pipe.replica_agreement`
and :mod:`~shardkit.nn.pipe.frozen_unit_agreement` (with the stages' data-parallel replicas),
:mod:`~shardkit.nn.pipe.stage_messages` (where activations and gradients go),
:mod:`~shardkit.nn.pipe.stage_backward` (``BW``, ``B``, ``W``),
:mod:`~shardkit.nn.pipe.step_losses` and :mod:`~shardkit.nn.pipe.step_outputs` (the last
stage); with :mod:`~shardkit.nn.pipe.autograd_graph`, :mod:`~shardkit.nn.pipe.stage_hints` and
:mod:`~shardkit.nn.pipe.torch_schedule_options` as helpers.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Optional

import torch

from shardkit import distributed as dist
from shardkit.nn.pipe.microbatch import (keyword_chunk_dims, keyword_signature, merge_outputs,
                                         own_microbatches, split_keyword_arguments,
                                         split_microbatches, target_chunk_dims)
from shardkit.nn.pipe.p2p import StepState, TaggedLinks, batch_signature, output_tensors
from shardkit.nn.pipe.plan import (PipelineDeadlock, PipelinePlan, gpipe_plan,
                                   interleaved_1f1b_plan, one_f_one_b_plan, zb_h1_plan, zbv_plan)
from shardkit.nn.pipe.schedules import (COMMUNICATION_ERRORS, ActivationMemoryMeter, busy_time,
                                        raise_step_failure)
from shardkit.nn.pipe.loss_count import LossCountWatch
from shardkit.nn.pipe.fsdp_weight_sink import ShardedGradientSink, frozen_units_with_replicas
from shardkit.nn.pipe.split_backward import GradientSink
from shardkit.nn.pipe.stage import PipelineStage, is_torch_ddp
from shardkit.nn.pipe.ties import TiedWeights
# the executor's concepts, one module each (mixins of PlanSchedule, and their helpers)
from shardkit.nn.pipe.frozen_unit_agreement import FrozenUnitAgreement
from shardkit.nn.pipe.replica_agreement import ReplicaAgreement, _reduces_during_backward
from shardkit.nn.pipe.stage_backward import _FAILED, StageBackward, _runs_whole_backward
from shardkit.nn.pipe.stage_hints import _packed_input_hint
from shardkit.nn.pipe.stage_messages import StageMessages, last_messages
from shardkit.nn.pipe.step_checks import StepChecks
from shardkit.nn.pipe.step_losses import StepLosses
from shardkit.nn.pipe.step_outputs import StepOutputs
from shardkit.nn.pipe.torch_schedule_options import _check_torch_options, _microbatch_count

__all__ = ["PlanSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "ScheduleZBV"]

_UNSPLIT = object()  # this step's keyword arguments, before this rank's first forward

_LOOKAHEAD = 4
_REPLAN_AT = 2  # training steps; the first's timings include one-off costs (allocation, autograd)


_MODES_AGREEMENT = dist.control_kind("the pipeline stages' trainable parameters and autocast")


class PlanSchedule(StepChecks, ReplicaAgreement, FrozenUnitAgreement, StepLosses,
                   StepOutputs, StageMessages, StageBackward):
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
    fails on every rank instead. A ShardedDataParallel (training steps) or FSDP stage module
    with replicas in other pipelines shares with them, before each of the stage's actions (F,
    B, BW, W), whether its pipeline's step has failed so far and whether the module is in
    ``train()`` mode: one all-reduce of two elements per replica group and action (``2m`` for
    a 1F1B stage, ``3m`` under ZB-H1, with ``m`` micro-batches); nothing where no stage module
    communicates over replicas.

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
       during the step (a forward or ``loss_fn`` raising on one pipeline) is shared before
       the stage's next action (see above): every replica stops that stage's collectives at
       the same action and every rank of every pipeline raises, naming the replica and what
       it raised; so do replicas whose stage modules are in different ``train()`` /
       ``eval()`` modes (ShardedDDP's training forward communicates, its eval forward does
       not). Still left waiting, until the process group's timeout (as for a peer that
       died): the replicas of a stage whose forward raised between two of its own
       collectives (an FSDP stage holding nested units, failing after the first gathered),
       or whose backward raised (it propagates at once), and eval on one pipeline while the
       others call nothing or, under ShardedDDP (whose eval joins no collective, so that one
       pipeline may evaluate alone), train: call :meth:`step` / :meth:`eval` on all of them
       alike. Stage modules of one pipeline in different ``train()`` / ``eval()`` modes are a
       ``UserWarning`` on every rank at the first step (and the first after a failed one),
       once per schedule: as in one process, each stage's dropout and batch norm follow its
       own mode, which a ``.eval()`` on one rank only changes unseen.
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
        self._mixed_modes_warned = False  # stage modules in train() and eval() (step_checks)
        # whether a training step shared the replicas' refusals (ShardedDataParallel / FSDP
        # stages) since the last failed step: eval steps share none over ShardedDataParallel
        self._replicas_checked = False
        # {grad: whether a rank of this pipeline has ShardedDataParallel / FSDP stage modules
        # communicating over replicas in such a step}, learnt at the first step's agreement
        self._pipeline_shards: dict = {}
        self._signature = None  # the first stage's last batch_signature
        self._stage_modes = None  # this rank's stages' trainable parameters and autocast, last step
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
                whether a replica runs eval while this one trains, or the reverse; and a
                ShardedDataParallel / FSDP stage module whose replicas' forward or
                ``loss_fn`` raised during the step, or whose replicas are in different
                ``train()`` / ``eval()`` modes), or a stage
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
            self._forget_shapes_if_a_stage_changed_mode()
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

    def _forget_shapes_if_a_stage_changed_mode(self) -> None:
        """With several stages per rank, whose headers go only when the first stage's rank
        finds a new batch (:meth:`_first_stage_state`): when some rank's stages changed which
        of their parameters train (a layer frozen or unfrozen: an output now requires grad, or
        no longer) or the autocast state (an output's dtype) since the last step, every rank
        forgets the headers, as after a failed step, and the step announces its outputs again
        (before, the step failed on every rank: "expected an output of float32 (2, 8) ...
        found float32 (2, 8) requiring grad"). With one stage per rank a stage announces its
        changed outputs itself. One control all-gather of a flag per step (uncounted); the
        parameters' ``requires_grad`` read locally."""
        if self.links.reannounce:
            return
        # imported here: the config module behind it is not needed at import
        from shardkit.checkpointing import _autocast_states
        modes = (tuple(p.requires_grad for stage in self.stages.values()
                       for p in stage.module.parameters()), _autocast_states())
        changed, self._stage_modes = modes != self._stage_modes, modes
        if not self._checked:
            return  # the first step (or the one after a failure) announces every output
        rows = dist.gather_control_rows(f"{type(self).__name__}.step", [int(changed)],
                                        self.group, kind=_MODES_AGREEMENT)
        if any(row[0] for row in rows):
            self._forget_shapes()

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
        self._agreeing: Optional[dict] = None  # stage -> its replica groups (_replicas_go_on)
        self._replicas_stopped: set = set()  # stages whose replicas stopped the step together
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
        self._reshard_stopped_stages()
        if grad and self._ties:  # a tie frozen on one rank only fails the step everywhere
            for problem in self._ties.exchange_flags():
                self._fail(problem)
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

    def _step_keyword_arguments(self) -> Optional[list]:
        """This step's keyword arguments per micro-batch, checked against the batch's rows
        (on a later stage's rank known from the headers, so at its first forward); a problem
        fails the step on every rank (the first stage's rank refused it before the step)."""
        problems = self._call_problems(self.links.batch_rows)
        if problems:
            self._fail(problems[0])
            return None
        return split_keyword_arguments(self._kwargs_arg, self.chunks, self._keyword_dims)

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
        # a stage whose module communicates over its replicas asks them first, every time
        if not self._replicas_go_on(s, i) or self.links.failed:
            # no more work this step: pass on what the next stage expects
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
        gradients reach (:func:`~shardkit.nn.pipe.autograd_graph._reached`), handed back at the
        step's end as from B, and ``None`` where none does, as in one process."""
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

    def _keep_live(self, s: int, i: int, activation, roots) -> None:
        self._live[(s, i)] = (activation, roots)
        self._alive += 1
        self.peak_live_microbatches = max(self.peak_live_microbatches, self._alive)

    def _busy(self):
        return busy_time(self)


def _one_tie_per_weight(stages: list) -> list:
    """The stages' cross-rank ties, one per weight: a weight two of this rank's stages hold
    is tied once, from the earlier of them (as the other rank sees it)."""
    ties = {}
    for stage in sorted(stages, key=lambda st: st.stage_index, reverse=True):
        for tie in stage.ties:
            ties[id(tie.param)] = tie
    return list(ties.values())


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


def _unrunnable(schedule: PlanSchedule, need: str) -> PipelinePlan:
    raise ValueError(f"{type(schedule).__name__} runs {need}, but the pipeline has "
                     f"{schedule.num_stages} stages on {schedule.num_ranks} ranks")
