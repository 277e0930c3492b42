"""The losses of a pipeline step on the rank running the last stage (:class:`StepLosses`,
mixed into :class:`~shardkit.nn.pipe.PlanSchedule`): the target's micro-batches, ``loss_fn`` on each
(watched by :class:`~shardkit.nn.pipe.loss_count.LossCountWatch` where it declares nothing), what
each micro-batch's loss is divided by (``chunks``, the target's rows, or the counts its mean divides
by; see :mod:`~shardkit.nn.pipe.plan_schedules`), and the loss
:meth:`~shardkit.nn.pipe.PlanSchedule.step` returns. Local; no communication. Memory: the target's
micro-batches (views) and one detached loss per micro-batch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_flatten

from shardkit.nn.pipe.loss_count import (LossCountWatch, NotCounted, count_value,
                                         declared_denominator, declared_reduction)
from shardkit.nn.pipe.microbatch import part_rows, split_target, target_rows


class StepLosses:
    """The executor's loss handling on the last stage (see the module); mixed into
    :class:`~shardkit.nn.pipe.PlanSchedule`."""

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
        over its rows (:func:`~shardkit.nn.pipe.loss_count.declared_reduction`): the target's rows
        over the micro-batch's, so the gradients are those of the batch mean, as in one process."""
        rows = target_rows(self._target, self._target_dims)
        if rows is None or rows % self.chunks == 0 or \
                declared_reduction(self.loss_fn, self._loss_kwargs) != "mean":
            return [self.chunks] * self.chunks
        return [rows / part for part in part_rows(rows, self.chunks)]

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
        if torch.is_grad_enabled() and not loss.requires_grad and _needs_grad(output):
            # as loss.backward() refuses it in one process: every step would train nothing
            self._fail_at_last_stage(i, "loss_fn returned a tensor that does not require grad "
                                        "(detached, computed under torch.no_grad(), or rebuilt "
                                        "from .item()) from an output that does: backward "
                                        "would train nothing; return the loss computed from "
                                        "the output")
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

    def _step_loss(self) -> torch.Tensor:
        """The loss :meth:`~shardkit.nn.pipe.PlanSchedule.step` returns: the micro-batch losses' sum
        (``scale_grads=False``), else their mean, each weighted by its share of the target's rows
        where the split is uneven and ``loss_fn`` declares that it averages (the batch mean, as in
        one process)."""
        total = torch.stack(self._losses)
        if not self.scale_grads:
            return total.sum()
        if all(d == self.chunks for d in self._loss_divisors):
            return total.mean()
        return sum(loss / d for loss, d in zip(self._losses, self._loss_divisors)
                   if d != float("inf"))


def _needs_grad(output) -> bool:
    """Whether some tensor of ``output`` requires grad (the step's graph reaches it). Local."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(output)[0])
