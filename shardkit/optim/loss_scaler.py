"""DeepSpeed's dynamic loss scaler for fp16 training: skip on overflow, hysteresis, growth.

The scaler is bookkeeping on the host: it holds one float and a few counters, keeps no
tensors and issues no collectives. Whoever detects the overflow (the engine) must make the
decision identical on every rank (an all-reduce of one flag) before calling :meth:`update_scale`.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Iterable

import torch

__all__ = ["DynamicLossScaler", "LossScaleAtMinimumError", "LossScaleAtMinimumWarning"]

logger = logging.getLogger("shardkit")


class LossScaleAtMinimumError(RuntimeError):
    """The gradients overflowed with the loss scale already at ``min_scale``."""


class LossScaleAtMinimumWarning(UserWarning, RuntimeWarning):
    """The gradients overflowed with the loss scale already at ``min_scale``; the step is
    skipped and training goes on (``raise_error_at_min_scale=False``). Both a ``UserWarning``
    (Python's default category) and a ``RuntimeWarning`` (what it reports), so filters and
    ``pytest.warns`` written for either catch it."""


class _ScaledBackward:
    """DeepSpeed's loss-scaler calls around ``loss_scale``, shared by both scalers: scale a
    loss, run its backward, look for inf/nan in this rank's gradients. Local, no collective:
    to skip a step, combine :meth:`has_overflow_serial` over the ranks first."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (DeepSpeed's ``scale_loss``)."""
        return loss * self.loss_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backward of the scaled loss: the gradients come out multiplied by ``loss_scale``."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    @staticmethod
    def has_overflow_serial(params: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``params``' gradients on this rank holds an inf or a nan."""
        return any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                   for p in params)


class DynamicLossScaler(_ScaledBackward):
    """Multiply the loss by ``loss_scale``; shrink the scale on overflow, grow it when stable.

    The rules are DeepSpeed's (``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``), one
    :meth:`update_scale` call per optimizer step:

    - **Overflow** (inf/nan in the gradients): the step is skipped. If the hysteresis budget is
      down to 1, the scale is divided by ``scale_factor`` (never below ``min_scale``); otherwise
      the budget is decremented and the scale kept. An overflow with the scale already at
      ``min_scale`` warns (a :class:`LossScaleAtMinimumWarning` through :mod:`warnings`, and
      a warning on the ``shardkit`` logger) and keeps skipping, or raises
      :class:`LossScaleAtMinimumError` when ``raise_error_at_min_scale``.
    - **No overflow**: with ``consecutive_hysteresis`` the budget is restored to ``hysteresis``
      at once. The scale is multiplied by ``scale_factor`` on each step that completes a
      multiple of ``scale_window`` clean steps since the last overflow (or the start), as torch's
      ``GradScaler`` does with ``growth_interval`` and DeepSpeed did up to 0.17.0 (since 0.17.1
      it grows one clean step later, on the ``scale_window + 1``-th); growing also restores
      the hysteresis budget.

    Args:
        init_scale: starting scale (DeepSpeed: ``2 ** initial_scale_power``).
        scale_window: clean steps between two growths (DeepSpeed: ``loss_scale_window``).
        hysteresis: overflows tolerated before the scale is halved (DeepSpeed's delayed shift).
        min_scale: floor of the scale (DeepSpeed: ``min_loss_scale``).
        raise_error_at_min_scale: raise instead of warning when overflowing at the floor.
        scale_factor: growth / back-off factor (2).
        consecutive_hysteresis: restore the hysteresis budget after every clean step.

    DeepSpeed's ``scale_loss(loss)``, ``backward(loss)`` and ``has_overflow_serial(params)``
    (this rank's gradients only) are there too.

    Memory: a few Python numbers. Communication: none (the caller all-reduces the overflow flag).

    Usage::

        scaler = DynamicLossScaler(init_scale=2**16)
        scaler.backward(loss)                       # (loss * scaler.loss_scale).backward()
        overflow = any_rank_has_inf_or_nan(grads)   # identical on every rank
        if not overflow:
            unscale(grads, 1 / scaler.loss_scale); optimizer.step()
        scaler.update_scale(overflow)
    """

    def __init__(self, init_scale: float = 2 ** 32, scale_window: int = 1000,
                 hysteresis: int = 2, min_scale: float = 1, raise_error_at_min_scale: bool = False,
                 scale_factor: float = 2.0, consecutive_hysteresis: bool = False):
        _require_positive_number("init_scale", init_scale)
        _require_positive_number("min_scale", min_scale)
        _require_positive_number("scale_factor", scale_factor)
        if scale_factor <= 1:
            raise ValueError(f"DynamicLossScaler(scale_factor={scale_factor!r}): must be > 1")
        _require_positive_int("scale_window", scale_window)
        _require_positive_int("hysteresis", hysteresis)
        if init_scale < min_scale:
            raise ValueError(f"loss scaler: init_scale={init_scale!r} is below min_scale="
                             f"{min_scale!r}; the scale must start at or above its floor (in a "
                             f"DeepSpeed config: 2 ** fp16.initial_scale_power >= "
                             f"fp16.min_loss_scale)")
        self.cur_scale = float(init_scale)
        self.scale_window = int(scale_window)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.scale_factor = float(scale_factor)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        """True: the scale moves with overflows (DeepSpeed's ``dynamic_loss_scale``)."""
        return True

    def update_scale(self, overflow: bool) -> None:
        """Account for one optimizer step; ``overflow`` must be the same on every rank."""
        if overflow:
            self._on_overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._on_clean_step()
        self.cur_iter += 1

    def _on_overflow(self) -> None:
        if self.cur_hysteresis > 1:
            self.cur_hysteresis -= 1
            logger.debug("loss scaler: overflow; scale stays %g, hysteresis now %d",
                         self.cur_scale, self.cur_hysteresis)
            return
        if self.cur_scale <= self.min_scale:
            if self.raise_error_at_min_scale:
                raise LossScaleAtMinimumError(
                    f"DynamicLossScaler: gradients overflowed with the loss scale already at "
                    f"min_scale={self.min_scale:g}; the model diverges in fp16 (try bf16, a lower "
                    f"learning rate, or gradient clipping)")
            message = (f"loss scaler: overflow at the minimum loss scale {self.min_scale:g}; "
                       f"skipping step (raise_error_at_min_scale=True makes this an error)")
            warnings.warn(message, LossScaleAtMinimumWarning, stacklevel=3)
            logger.warning(message)
            return
        new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
        logger.debug("loss scaler: overflow; scale %g -> %g",
                     self.cur_scale, new_scale)
        self.cur_scale = new_scale

    def _on_clean_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        # this step included: the scale grows on the step that completes a whole window of
        # clean steps (torch GradScaler's growth_interval; DeepSpeed's rule up to 0.17.0)
        clean_steps = self.cur_iter - self.last_overflow_iter
        if clean_steps % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            self.cur_scale *= self.scale_factor

    def state_dict(self) -> dict:
        """Everything needed to resume the scale schedule exactly."""
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter,
                "cur_hysteresis": self.cur_hysteresis, "scale_window": self.scale_window,
                "hysteresis": self.hysteresis, "min_scale": self.min_scale,
                "scale_factor": self.scale_factor,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "raise_error_at_min_scale": self.raise_error_at_min_scale}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict` (keys it lacks keep their current values); an
        unknown key raises ``KeyError`` before anything is changed. Local."""
        valid = self.state_dict()
        for key in state:
            if key not in valid:
                raise KeyError(f"DynamicLossScaler.load_state_dict: unknown key {key!r}; valid "
                               f"keys are {sorted(valid)} (a torch GradScaler's state has "
                               f"'scale' and '_growth_tracker' instead)")
        for key, value in state.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.cur_scale:g}, hysteresis={self.cur_hysteresis}/"
                f"{self.hysteresis}, window={self.scale_window}, iter={self.cur_iter})")


class StaticLossScaler(_ScaledBackward):
    """A fixed loss scale (DeepSpeed's ``fp16.loss_scale > 0``): overflowing steps are skipped
    but the scale never changes. Same interface as :class:`DynamicLossScaler`; no memory, no
    communication."""

    def __init__(self, scale: float = 1.0):
        _require_positive_number("scale", scale)
        self.cur_scale = float(scale)
        self.cur_iter = 0

    @property
    def loss_scale(self) -> float:
        """The fixed factor the loss is multiplied by before backward."""
        return self.cur_scale

    @property
    def dynamic(self) -> bool:
        """False: the scale never changes."""
        return False

    def update_scale(self, overflow: bool) -> None:
        """Account for one optimizer step (an overflowing one was skipped; logged)."""
        if overflow:
            logger.info("static loss scale %g: overflow, skipping step", self.cur_scale)
        self.cur_iter += 1

    def state_dict(self) -> dict:
        """``{"cur_scale", "cur_iter"}``, for checkpoints."""
        return {"cur_scale": self.cur_scale, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])


def _require_positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"loss scaler: {name}={value!r}; it must be a finite number > 0")


def _require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"loss scaler: {name}={value!r}; it must be an integer >= 1")
