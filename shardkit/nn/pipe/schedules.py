"""What every multi-process pipeline schedule shares: the activation-memory meter, the busy-time
clock, the first-step agreement check and the error of a step that failed part-way.

The schedules themselves (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZBV) all run on one executor,
:class:`~shardkit.nn.pipe.plan_schedules.PlanSchedule`; ``ScheduleGPipe`` and ``Schedule1F1B``
stay importable from here.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch
import torch.distributed

from shardkit import distributed as dist
from shardkit.collective_check import CollectiveMismatchError
from shardkit.shm_transport import TransportError

__all__ = ["ActivationMemoryMeter", "busy_time", "check_schedule_agreement",
           "raise_step_failure", "COMMUNICATION_ERRORS"]

# Raised inside a stage's forward, these stop the step on this rank at once: a peer died or
# the ranks are out of step, so the step's remaining messages could not go through either.
COMMUNICATION_ERRORS = (dist.CollectiveError, torch.distributed.DistError,
                        CollectiveMismatchError, TransportError)


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
        """Start a new peak from the bytes saved now."""
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
        # detached: the graph keeps what it needs; a saved output with its grad_fn would make a
        # reference cycle that keeps a retained graph alive after its last use
        return _SavedActivation(tensor.detach(), self, key)

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


@contextlib.contextmanager
def busy_time(schedule):
    """Add the wall-clock time of the block to ``schedule.busy_seconds`` (compute time per
    step, beside the idle time a pipeline schedule leaves)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        schedule.busy_seconds += time.perf_counter() - start


def _comparable_dims(dims):
    """``dims`` (a keyword's split dimensions, nested as its value) as a hashable value equal
    for equal splits: a dict's entries in key order and tuples and lists alike, since nested
    specs pair with a keyword's dict by key and with its tuple or list by position, so two
    ranks that wrote one spec's keys in another order (or a list for a tuple) split alike."""
    if isinstance(dims, dict):
        return dict, tuple(sorted((repr(k), _comparable_dims(v)) for k, v in dims.items()))
    if isinstance(dims, (tuple, list)):
        return "sequence", tuple(_comparable_dims(d) for d in dims)
    return dims


def check_schedule_agreement(kind: str, chunks: int, local_problems: list, group,
                             who: str, tie_status: Optional[dict] = None,
                             keyword_dims: Optional[dict] = None, flags: tuple = ()) -> tuple:
    """Before a schedule's first step (and a later step the first stage cannot run), every rank
    of ``group`` shares what it runs, whether under ``torch.no_grad()``, how it splits keyword
    arguments (``keyword_dims``: its ``kwargs_chunk_spec`` as ``{name: dim or None}``, or a
    structure of these per keyword), and what is wrong with its inputs (one small object
    all-gather); any problem, or ranks that disagree on the schedule, is a ValueError on every
    rank naming each ``who`` (``"stage"``/``"rank"``). ``tie_status``: ``{key:
    requires_grad}`` of this rank's copies of weights tied across ranks (see
    :func:`~shardkit.nn.pipe.ties.frozen_copy_problems`). ``flags``: booleans this rank
    shares in the same all-gather; returns, for each, whether any rank of ``group`` set it.

    Note: ranks that split a keyword argument differently (dim 1 on one, whole on another)
    computed each micro-batch from other rows, silently where the shapes still fit."""
    from shardkit.nn.pipe.ties import frozen_copy_problems

    split = tuple(sorted((keyword_dims or {}).items()))
    views = dist.all_gather_object((kind, chunks, torch.is_grad_enabled(), split,
                                    local_problems, tie_status or {}, tuple(flags)),
                                   group=group)
    problems = [f"{who} {rank}: {p}" for rank, view in enumerate(views) for p in view[4]]
    problems += frozen_copy_problems([view[5] for view in views])
    if len({(*view[:3], _comparable_dims(view[3])) for view in views}) > 1:
        problems.append(f"the {who}s disagree on the schedule: " + ", ".join(
            f"{who} {rank} runs {k}(chunks={c}"
            + (f", kwargs_chunk_spec dims {dict(dims)}" if dims else "") + ")"
            + ("" if grad else " under torch.no_grad()")
            for rank, (k, c, grad, dims, *_) in enumerate(views)))
    if problems:
        raise ValueError(f"{kind}.step: the pipeline cannot run this step:\n  "
                         + "\n  ".join(problems))
    return tuple(any(view[6][i] for view in views) for i in range(len(flags)))


def raise_step_failure(kind: str, local_problems: list, group,
                       cause: Optional[BaseException] = None) -> None:
    """End a step that a stage found wrong part-way: every rank of ``group`` has run its whole
    action list (so no message is left in flight) and knows the step failed; they share what
    each found (one small object all-gather) and raise the same ValueError (chained to
    ``cause``, this rank's own exception behind its problem, where there is one)."""
    views = dist.all_gather_object(list(local_problems), group=group)
    problems = [f"rank {rank}: {p}" for rank, found in enumerate(views) for p in found]
    raise ValueError(f"{kind}.step: the pipeline could not finish this step:\n  "
                     + "\n  ".join(problems or ["(no rank recorded the problem)"])
                     + "\nEvery rank ran the step to its end, so the pipeline can go on with "
                       "another batch; the stages' .grad may hold part of this step's "
                       "gradients: zero them before the next step") from cause


def __getattr__(name):
    # ScheduleGPipe and Schedule1F1B moved to the one plan executor; keep this import path
    if name in ("ScheduleGPipe", "Schedule1F1B"):
        from shardkit.nn.pipe import plan_schedules

        return getattr(plan_schedules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
