"""What the engine reports of its progress: rank 0's log line every ``steps_per_print`` steps
(:class:`ProgressLog`, mixed into :class:`shardkit.engine.ShardedEngine`; the losses summed on
their device, read once per line), DeepSpeed's ``engine.tput_timer`` (:class:`ThroughputTimer`),
and the ``shardkit`` logger's handler when logging is not configured. Host clock only; no
communication.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from shardkit import distributed

logger = logging.getLogger("shardkit")


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``, as scripts read it: the engine calls :meth:`start`
    at the first forward of each optimizer step and :meth:`stop` at its ``step()``;
    :meth:`avg_samples_per_sec` is the samples of the measured optimizer steps (``batch_size``
    each, the engine's ``train_batch_size`` at the time) over the wall time measured;
    ``update_epoch_count()`` counts epochs (``epoch_count``, DeepSpeed-Chat ticks it). A
    forward outside training (evaluation between two steps) counts in the step's time, as the
    timer starts at the first forward after a step. ``stop(report_speed=...)`` is accepted for
    DeepSpeed's signature and ignored (nothing is logged). Host clock only: no device
    synchronisation, no communication."""

    def __init__(self, batch_size: int = 1):
        self.batch_size = batch_size
        self.epoch_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.total_samples = 0
        self._started: Optional[float] = None

    def update_epoch_count(self) -> None:
        """Count one more epoch in ``epoch_count``."""
        self.epoch_count += 1

    def start(self) -> None:
        """Start timing the current optimizer step, unless already started."""
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """With ``global_step``, end the step started by :meth:`start` and count its time and
        ``batch_size`` samples; otherwise (or when not started) do nothing."""
        if self._started is None or not global_step:
            return
        self.total_elapsed_time += time.perf_counter() - self._started
        self.global_step_count += 1
        self.total_samples += self.batch_size
        self._started = None

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the measured optimizer steps (0.0 before the first)."""
        if self.total_elapsed_time <= 0:
            return 0.0
        return self.total_samples / self.total_elapsed_time


def _ensure_log_handler() -> None:
    """Rank 0 prints the progress lines (as DeepSpeed does) unless logging is configured."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[shardkit] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


class ProgressLog:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.config``,
    ``self.global_steps``, ``self.skipped_steps``, ``self._loss_sum``, ``self._losses_counted``,
    ``self._clock``, ``self._steps_at_clock``, ``loss_scale`` and ``get_lr``."""

    def _maybe_print(self) -> None:
        if self.global_steps % self.config.steps_per_print:
            return
        if distributed.get_rank() == 0:
            elapsed = max(time.perf_counter() - self._clock, 1e-9)
            samples = (self.global_steps - self._steps_at_clock) * self.config.train_batch_size
            counted = self._losses_counted
            loss = float(self._loss_sum) / counted if counted else float("nan")
            lrs = ", ".join(f"{lr:.3e}" for lr in self.get_lr())
            logger.info("step=%d loss=%.6f lr=[%s] loss_scale=%g samples/s=%.1f skipped=%d",
                        self.global_steps, loss, lrs, self.loss_scale, samples / elapsed,
                        self.skipped_steps)
        self._reset_print_window()

    def _count_loss(self, loss: torch.Tensor) -> None:
        """Add ``loss`` to the log window's sum on its device (no host sync; one scalar)."""
        detached = loss.detach().float().reshape(())
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._losses_counted += 1

    def _reset_print_window(self) -> None:
        self._loss_sum = None
        self._losses_counted = 0
        self._clock = time.perf_counter()
        self._steps_at_clock = self.global_steps
