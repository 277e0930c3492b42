"""The checks before a pipeline step (:class:`StepChecks`, mixed into
:class:`~shardkit.nn.pipe.PlanSchedule`): what is wrong with this rank's stages, batch, keyword
arguments and target, and the pipeline group's agreement on them, so that every rank raises the same
error before any work. Local, except :meth:`StepChecks._check_agreement`: one small all-gather over
the pipeline group (:func:`~shardkit.nn.pipe.schedules.check_schedule_agreement`), on the first
step, the first after a failed one, and a step that a rank refuses.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from shardkit.nn.pipe.fsdp_weight_sink import params_outside_fsdp, stage_is_fully_sharded
from shardkit.nn.pipe.microbatch import (batch_size, keyword_argument_problems,
                                         target_split_problems)
from shardkit.nn.pipe.schedules import check_schedule_agreement
from shardkit.nn.pipe.stage_hints import _device_problems


class StepChecks:
    """The executor's checks of its stages and of each step's arguments (see the
    module); mixed into :class:`~shardkit.nn.pipe.PlanSchedule`."""

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
        """What is wrong with this rank's keyword arguments to
        :meth:`~shardkit.nn.pipe.PlanSchedule.step` (on any rank; given the batch's rows, where this
        rank knows them, also a keyword tensor that would be cut at other rows than the batch)."""
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
        stages' data-parallel replicas first
        (:meth:`~shardkit.nn.pipe.PlanSchedule._refuse_to_replicas`: ``grad``, the step's grad mode,
        default this rank's), so a pipeline that ran the step is not left waiting for this one.
        ``replicas_too`` (the first step): ShardedDataParallel / FSDP stages' replicas share their
        refusals before (:meth:`~shardkit.nn.pipe.PlanSchedule._replica_refusals`). The same
        all-gather says whether the pipeline's stage modules are all in one ``train()`` /
        ``eval()`` mode (a warning on every rank otherwise: :meth:`_warn_mixed_modes`), a
        frozen stage in ``eval()`` left out (:func:`_frozen_in_eval`)."""
        grad = torch.is_grad_enabled() if grad is None else grad
        local = self._local_problems(inputs, target)
        if replicas_too:
            local += self._replica_refusals(local, grad)
        shards = (bool(self._reducing_replica_groups(True)),
                  bool(self._reducing_replica_groups(False)))
        modes = {stage.module.training for stage in self.stages.values()
                 if not _frozen_in_eval(stage.module)}
        try:
            training, evaluating, some_train, some_eval = check_schedule_agreement(
                type(self).__name__, self.chunks, local, self.group, self._who,
                self._tie_status(), self._keyword_dims, flags=shards + (True in modes,
                                                                        False in modes))
            self._pipeline_shards = {True: training, False: evaluating}
        except ValueError as refusal:
            self._refuse_to_replicas(str(refusal), grad)
            raise
        if some_train and some_eval:
            self._warn_mixed_modes()

    def _warn_mixed_modes(self) -> None:
        """Once per schedule, on every rank alike: the pipeline's stage modules are not all in
        the same ``train()`` / ``eval()`` mode (learnt in the agreement's all-gather, at no
        cost of its own). One process would run so only where part of the model was switched
        on purpose (a frozen first stage in eval, which is not counted: every parameter of it
        frozen, see :func:`_frozen_in_eval`); a stage left in the other mode on one
        rank (a ``.eval()`` for validation on rank 0 only) silently changes what its dropout
        and batch norm do.

        Note: checked at the first step and the first after a failed one, where the ranks
        agree on the step anyway: a stage switched on one rank between two good steps is not
        seen (noticing it would cost a message every step)."""
        if self._mixed_modes_warned:
            return
        self._mixed_modes_warned = True
        here = ", ".join(f"stage {s} in {'train' if stage.module.training else 'eval'}()"
                         for s, stage in sorted(self.stages.items()))
        warnings.warn(f"{type(self).__name__}: the pipeline's stage modules are not all in the "
                      f"same mode: some are in train(), others in eval() (on this rank: "
                      f"{here}); dropout and batch norm follow each stage's own mode, as in one "
                      f"process where part of the model was switched on purpose. If that is "
                      f"not what you meant, call .train() or .eval() on the stages of every "
                      f"rank alike", UserWarning, stacklevel=4)

    def _tie_status(self) -> dict:
        """``{key: requires_grad}`` of this rank's copies of weights tied across ranks."""
        return {key: param.requires_grad for stage in self.stages.values()
                for key, param in stage.tie_copies}

    def _check_first_step(self, inputs, target, grad: bool) -> None:
        """The first step's checks; again at the first step after a failed one, and at the
        first training step after eval steps (these share no refusal over the replicas of
        ShardedDataParallel stages: see
        :meth:`~shardkit.nn.pipe.PlanSchedule._replica_refusals`)."""
        self._check_agreement(inputs, target, grad, replicas_too=True)
        self._checked = True
        self._replicas_checked = self._replicas_checked or grad


def _frozen_in_eval(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a frozen stage put in ``eval()`` on purpose: in eval mode, with
    parameters and none requiring grad (a frozen embedding or encoder, the usual way to keep
    its dropout and batch-norm statistics fixed while the other stages train). Such a stage
    is left out of the train/eval comparison, where it made every rank warn of mixed modes.
    Local."""
    if module.training:
        return False
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)
