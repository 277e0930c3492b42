"""Multi-process pipeline schedules: GPipe (all forwards, then all backwards) and 1F1B.

A schedule is an order of actions on one stage: ``("F", i)`` runs micro-batch ``i`` forward and
sends its activation on, ``("B", i)`` receives the gradient of that activation, runs backward and
sends the gradient of the stage's input back. Every stage executes its own order; sends are
asynchronous and receives are posted ahead, so neighbours overlap. The mechanism that executes an
order (:class:`PipelineSchedule`) is the same for both; they differ only in :meth:`actions`.

Loss: each micro-batch's loss is divided by the number of micro-batches before its backward, so
the gradients accumulated over a step equal those of the whole batch under a mean loss (for
micro-batches of equal size). The optimizer is not stepped: call ``optimizer.zero_grad()`` before
and ``optimizer.step()`` after :meth:`PipelineSchedule.step`, on every stage.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch

from shardkit import distributed as dist
from shardkit.nn.pipe.batched_weight_grads import BatchedLinearWeightGrads
from shardkit.nn.pipe.microbatch import batch_size, split_microbatches
from shardkit.nn.pipe.p2p import (ActivationReceiver, ActivationSender, GradientReceiver,
                                  GradientSender)
from shardkit.nn.pipe.stage import PipelineStage

__all__ = ["PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ActivationMemoryMeter"]


class _SavedActivation:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMemoryMeter:
    """Bytes of the tensors autograd keeps saved for backward, live and at peak.

    Used as ``saved_tensors_hooks`` around each forward; parameters are not activations and are
    left out. A tensor saved several times (an input saved by two ops) counts once, until the
    last of its saves is released by backward; a view counts the bytes it spans (a micro-batch
    is a view of the batch). Costs a Python call per saved tensor.
    """

    def __init__(self):
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict = {}  # (data pointer, bytes) -> [saves, bytes]
        self._excluded: set = set()

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    @contextlib.contextmanager
    def recording(self, parameters) -> Iterator[None]:
        """Count tensors saved for backward inside the block (except ``parameters``)."""
        self._excluded = {p.untyped_storage().data_ptr() for p in parameters}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().data_ptr() in self._excluded:
            return tensor
        # a micro-batch is often a view of the whole batch: count the bytes the view spans
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)
        if nbytes == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [1, nbytes]
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[0] += 1
        return _SavedActivation(tensor, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _SavedActivation) else saved

    def _release(self, key) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.current_bytes -= entry[1]


class PipelineSchedule:
    """Runs one stage's part of a pipeline step in the order :meth:`actions` gives.

    Args:
        stage: this process's :class:`PipelineStage`.
        chunks: micro-batches per step (the same on every stage; at most the batch size).
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage (may be ``None``
            elsewhere); applied to each micro-batch.
        track_activation_memory: measure the bytes saved for backward on this stage
            (``self.activation_memory.peak_bytes``); off by default (a Python call per saved
            tensor).

    After each :meth:`step`, ``peak_live_microbatches`` is the largest number of micro-batches
    whose activations were alive at once on this stage, and ``busy_seconds`` the time spent in
    forward and backward (not waiting for neighbours).

    .. warning:: :meth:`step` must be called on every rank of the pipeline group (and of the
       data-parallel group). The first step exchanges a small description of the step (schedule,
       chunks, batch) so a mismatch raises the same error everywhere; later steps reuse the
       shapes of the first, so keep the batch size fixed.
    """

    def __init__(self, stage: PipelineStage, chunks: int, loss_fn: Optional[Callable] = None,
                 track_activation_memory: bool = False):
        name = type(self).__name__
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{name}(stage={type(stage).__name__}): expected a PipelineStage")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"{name}(chunks={chunks!r}): expected a positive int")
        if stage.num_stages != stage.group_size:
            raise ValueError(f"{name}(stage=...): runs one stage per rank, but the pipeline has "
                             f"{stage.num_stages} stages on {stage.group_size} ranks; use "
                             f"ScheduleInterleaved1F1B or ScheduleZBV with several stages per "
                             f"rank")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{name}(loss_fn={loss_fn!r}): expected a callable "
                            f"loss_fn(output, target) or None")
        self.stage = stage
        self.chunks = chunks
        self.loss_fn = loss_fn
        group = stage.group
        self.receiver = None if stage.is_first else ActivationReceiver(stage.prev_rank, group)
        self.grad_sender = None if stage.is_first else GradientSender(stage.prev_rank, group)
        self.sender = None if stage.is_last else ActivationSender(stage.next_rank, group)
        self.grad_receiver = None if stage.is_last else GradientReceiver(stage.next_rank, group)
        self.activation_memory = ActivationMemoryMeter() if track_activation_memory else None
        self.peak_live_microbatches = 0
        self._checked = False
        self._batched: Optional[BatchedLinearWeightGrads] = None  # see ScheduleGPipe
        self._records: dict = {}

    # ------------------------------------------------------------------ the order
    def actions(self) -> list[tuple[str, int]]:
        """This stage's order of ``("F", i)`` and ``("B", i)`` actions for one step."""
        raise NotImplementedError

    # ------------------------------------------------------------------ one step
    def step(self, *inputs: torch.Tensor, target: Optional[torch.Tensor] = None):
        """Run forward and backward of one mini-batch through the pipeline.

        The first stage uses ``inputs`` (one tensor, or several with one batch size, which its
        module gets as a tuple), the last stage uses ``target``; other stages ignore them.
        Gradients accumulate into ``.grad`` of this stage's parameters. Returns the mean of
        the micro-batch losses (detached) on the last stage, ``None`` elsewhere.
        """
        stage = self.stage
        if not self._checked:
            self._check_first_step(inputs, target)
        self._inputs = (split_microbatches(inputs, self.chunks, f"{type(self).__name__}.step")
                        if stage.is_first else None)
        self._targets = self._split_target(target) if stage.is_last else None
        self._live: dict[int, tuple] = {}
        self._losses: list[torch.Tensor] = []
        self._batching = self._batched is not None and self._batched.usable()
        self._records = {}
        if self._batched is not None:
            self._batched.discard()
        self._next_backward = 0
        self.peak_live_microbatches = 0
        self.busy_seconds = 0.0
        if self.activation_memory is not None:
            self.activation_memory.reset_peak()
        if self.receiver is not None:
            self.receiver.post(0)
        for kind, index in self.actions():
            if kind == "F":
                self._forward(index)
            else:
                self._backward(index)
        if self._batching:
            with self._busy():
                self._batched.flush()
        stage.reduce_gradients()
        for channel in (self.sender, self.grad_sender):
            if channel is not None:
                channel.wait()
        self._inputs = self._targets = None
        return torch.stack(self._losses).mean() if stage.is_last else None

    def _split_target(self, target):
        if isinstance(target, torch.Tensor):
            return [t[0] for t in split_microbatches((target,), self.chunks, "target")]
        return [target] * self.chunks  # not a tensor: every micro-batch gets it as is

    def _forward(self, i: int) -> None:
        stage = self.stage
        if stage.is_first:
            activation, packed = self._inputs[i], len(self._inputs[i]) > 1
        else:
            activation, packed = self.receiver.take(i)
            if i + 1 < self.chunks:
                self.receiver.post(i + 1)
        meter = self.activation_memory
        metering = meter.recording(stage.module.parameters()) if meter else contextlib.nullcontext()
        batching = self._batched.recording() if self._batching else contextlib.nullcontext([])
        with metering, batching as record, self._busy():
            output = stage.module(activation if packed else activation[0])
            if stage.is_last:
                loss = self.loss_fn(output, self._targets[i])
        self._records[i] = record
        if stage.is_last:
            self._losses.append(loss.detach())
            roots = [loss / self.chunks]
        else:
            outputs = (output,) if isinstance(output, torch.Tensor) else tuple(output)
            self.sender.send(i, outputs, packed=not isinstance(output, torch.Tensor))
            roots = [o for o in outputs if o.requires_grad]
        self._live[i] = (activation, roots)
        self.peak_live_microbatches = max(self.peak_live_microbatches, len(self._live))
        if i == self._next_backward and self.grad_receiver is not None:
            self.grad_receiver.post(i, roots)

    def _backward(self, i: int) -> None:
        activation, roots = self._live.pop(i)
        if self.grad_receiver is not None:
            grads = self.grad_receiver.take(i, roots)
            if i + 1 in self._live:
                self.grad_receiver.post(i + 1, self._live[i + 1][1])
        else:
            grads = None
        record = self._records.pop(i, [])
        with self._busy():
            if roots and self._batching:
                self._batched.backward(roots, grads, record,
                                       [a for a in activation if a.requires_grad])
            elif roots:
                torch.autograd.backward(roots, grads)
        self._next_backward = i + 1
        if self.grad_sender is not None:
            self.grad_sender.send([a.grad if a.grad is not None else torch.zeros_like(a)
                                   for a in activation if a.requires_grad])

    def _busy(self):
        return busy_time(self)

    @property
    def plan(self):
        """This schedule's order on every rank as a :class:`~shardkit.nn.pipe.plan.PipelinePlan`
        (for printing and :meth:`~shardkit.nn.pipe.plan.PipelinePlan.dry_run`)."""
        from shardkit.nn.pipe.plan import gpipe_plan, one_f_one_b_plan

        make = gpipe_plan if isinstance(self, ScheduleGPipe) else one_f_one_b_plan
        return make(self.stage.num_stages, self.chunks)

    # ------------------------------------------------------------------ checks
    def _local_problems(self, inputs, target) -> list[str]:
        stage, name, problems = self.stage, type(self).__name__, []
        if stage.is_first:
            if not inputs:
                problems.append(f"the first stage needs the batch: call {name}.step(*inputs)")
            else:
                try:
                    size = batch_size(inputs, f"{name}.step(*inputs)")
                    if self.chunks > size:
                        problems.append(f"chunks={self.chunks} is larger than the batch size "
                                        f"{size}; use chunks <= {size}")
                except (TypeError, ValueError) as error:
                    problems.append(str(error))
        if stage.is_last:
            if self.loss_fn is None:
                problems.append(f"the last stage needs {name}(..., loss_fn=...)")
            if target is None:
                problems.append(f"the last stage needs the target: call "
                                f"{name}.step(..., target=...)")
            elif isinstance(target, torch.Tensor) and (target.dim() == 0
                                                       or target.shape[0] < self.chunks):
                problems.append(f"target of shape {tuple(target.shape)} cannot be split into "
                                f"chunks={self.chunks} micro-batches along dim 0")
        return problems

    def _check_first_step(self, inputs, target) -> None:
        check_schedule_agreement(type(self).__name__, self.chunks,
                                 self._local_problems(inputs, target), self.stage.group, "stage")
        self._checked = True


@contextlib.contextmanager
def busy_time(schedule):
    """Add the wall-clock time of the block to ``schedule.busy_seconds`` (compute time per
    step, beside the idle time a pipeline schedule leaves)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        schedule.busy_seconds += time.perf_counter() - start


def check_schedule_agreement(kind: str, chunks: int, local_problems: list, group,
                             who: str) -> None:
    """Before a schedule's first step, every rank of ``group`` shares what it runs and what is
    wrong with its inputs (one small object all-gather); any problem, or ranks that disagree on
    the schedule, is a ValueError on every rank naming each ``who`` (``"stage"``/``"rank"``)."""
    views = dist.all_gather_object((kind, chunks, local_problems), group=group)
    problems = [f"{who} {rank}: {p}" for rank, (_, _, ps) in enumerate(views) for p in ps]
    if len({(k, c) for k, c, _ in views}) > 1:
        problems.append(f"the {who}s disagree on the schedule: " + ", ".join(
            f"{who} {rank} runs {k}(chunks={c})" for rank, (k, c, _) in enumerate(views)))
    if problems:
        raise ValueError(f"{kind}.step: the pipeline cannot run this step:\n  "
                         + "\n  ".join(problems))


class ScheduleGPipe(PipelineSchedule):
    """GPipe: every micro-batch forward, then every micro-batch backward.

    Memory: the activations of all ``chunks`` micro-batches are alive on every stage at the end
    of the forwards. Bubble: ``(p-1)/(m+p-1)`` of the step for ``p`` stages and ``m`` chunks.
    Communication: see :class:`PipelineStage`.

    Args (beyond :class:`PipelineSchedule`'s):
        batch_weight_grads: compute each ``nn.Linear``'s weight gradient once per step over all
            micro-batches instead of once per micro-batch
            (:class:`~shardkit.nn.pipe.batched_weight_grads.BatchedLinearWeightGrads`: the same
            gradients up to rounding, much faster with small micro-batches, and each
            ``Linear``'s input and output gradient kept until the end of the step). ``None``
            (default): where the stage is an ``nn.Sequential`` of ``nn.Linear`` layers and
            parameter-free modules; ``False``: never; ``True``: required (``ValueError`` if the
            stage does not qualify).
    """

    def __init__(self, stage: PipelineStage, chunks: int, loss_fn: Optional[Callable] = None,
                 track_activation_memory: bool = False,
                 batch_weight_grads: Optional[bool] = None):
        super().__init__(stage, chunks, loss_fn, track_activation_memory)
        if batch_weight_grads not in (None, True, False):
            raise ValueError(f"ScheduleGPipe(batch_weight_grads={batch_weight_grads!r}): "
                             f"expected None (automatic), True or False")
        qualifies = BatchedLinearWeightGrads.applies_to(stage.module)
        if batch_weight_grads and not qualifies:
            raise ValueError("ScheduleGPipe(batch_weight_grads=True): the stage module must be "
                             "an nn.Sequential of nn.Linear layers and modules without "
                             "parameters; pass None to use it only where it applies")
        if qualifies and batch_weight_grads is not False:
            self._batched = BatchedLinearWeightGrads(stage.module)

    def actions(self) -> list[tuple[str, int]]:
        m = self.chunks
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


class Schedule1F1B(PipelineSchedule):
    """1F1B: after a warm-up of ``p - s - 1`` forwards, stage ``s`` alternates one forward and
    one backward, then drains the remaining backwards.

    Memory: at most ``min(p - s, m)`` micro-batches of activations alive on stage ``s`` (the
    first stage holds the most), instead of GPipe's ``m``. Same bubble and communication as
    :class:`ScheduleGPipe`.
    """

    def actions(self) -> list[tuple[str, int]]:
        m = self.chunks
        warmup = min(self.stage.num_stages - self.stage.stage_index - 1, m)
        order = [("F", i) for i in range(warmup)]
        for k in range(m - warmup):
            order += [("F", warmup + k), ("B", k)]
        return order + [("B", k) for k in range(m - warmup, m)]
