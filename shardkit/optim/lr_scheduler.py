"""DeepSpeed's warm-up learning-rate schedules as torch ``LRScheduler`` subclasses.

Same parameter names and the same numbers as ``deepspeed.runtime.lr_schedules`` (past
``total_num_steps`` :class:`WarmupCosineLR` holds its floor, as clamped DeepSpeed releases do):

- :class:`WarmupLR`: from ``warmup_min_lr`` up to ``warmup_max_lr`` over ``warmup_num_steps``
  (``log`` or ``linear`` ramp), then constant.
- :class:`WarmupDecayLR`: the same warm-up, then a linear decay back to ``warmup_min_lr`` at
  ``total_num_steps``.
- :class:`WarmupCosineLR`: a ratio of each group's initial lr: warm-up from
  ``warmup_min_ratio`` to 1, then a cosine down to ``cos_min_ratio`` at ``total_num_steps``.
- :class:`OneCycle`: a triangle from ``cycle_min_lr`` up to ``cycle_max_lr`` and back (Adam's
  ``beta1`` moving the other way), then an optional decay below ``cycle_min_lr``.
- :class:`LRRangeTest`: the learning-rate range test, growing the lr linearly (or in stairs)
  from ``lr_range_test_min_lr`` to find the largest one that still trains.

As in DeepSpeed, ``last_batch_iteration`` counts scheduler steps: it is -1 after construction
(the optimizer then holds the schedule's starting lr) and ``k`` after ``k + 1`` calls to
:meth:`step`; a schedule built with ``last_batch_iteration=k`` starts there and, as DeepSpeed's,
leaves the optimizer's lr as it was until its first :meth:`step` (which sets iteration
``k + 1``'s). torch's ``last_epoch`` is ``last_batch_iteration + 1``. The schedules hold a few
floats per param group and issue no communication. ``state_dict()`` is torch's plus
``last_batch_iteration``; as in DeepSpeed, ``load_state_dict()`` restores only the position in
the schedule, so a run resumed with a changed schedule (a longer ``total_num_steps``, another
peak lr) follows the schedule it was built with, from the saved iteration on. DeepSpeed's own
``{"last_batch_iteration": k}`` loads too.
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "WARMUP_TYPES", "loads_position_only"]

WARMUP_TYPES = ("log", "linear")
Number = Union[int, float]

logger = logging.getLogger("shardkit")


class _IterationSchedule(LRScheduler):
    """Shared mechanics: DeepSpeed's iteration counter on top of torch's ``last_epoch``."""

    def __init__(self, optimizer, last_batch_iteration: int):
        if not isinstance(last_batch_iteration, int) or last_batch_iteration < -1:
            raise ValueError(f"{type(self).__name__}(last_batch_iteration="
                             f"{last_batch_iteration!r}): must be an integer >= -1")
        # values, not the objects: torch's first step below fills a tensor lr in place
        as_given = [(float(group["lr"]), group.get("betas")) for group in optimizer.param_groups]
        super().__init__(optimizer)
        if last_batch_iteration != -1:
            # DeepSpeed's rule: a schedule resumed at an iteration leaves each group's lr (and
            # OneCycle's beta1) as the optimizer has it; its first step() sets the schedule's
            self.last_epoch = last_batch_iteration + 1
            self._step_count = last_batch_iteration + 2
            for group, (lr, betas) in zip(optimizer.param_groups, as_given):
                _set_lr(group, lr)
                if betas is not None:
                    group["betas"] = betas
            self._last_lr = [lr for lr, _ in as_given]  # the lrs in effect until step()

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step counter: -1 before the first :meth:`step`."""
        return self.last_epoch - 1

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one step (or jump to ``last_batch_iteration``) and set each group's lr."""
        if last_batch_iteration is None:
            self.last_epoch += 1
        else:
            self.last_epoch = int(last_batch_iteration) + 1
        self._step_count = getattr(self, "_step_count", 0) + 1
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            _set_lr(group, lr)
        self._last_lr = list(lrs)

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_batch_iteration)

    def state_dict(self) -> dict:
        """torch's state dict with DeepSpeed's ``last_batch_iteration`` beside it."""
        return {**super().state_dict(), "last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the saved position only (DeepSpeed's rule); the schedule's parameters stay
        those this scheduler was built with. The optimizer's lrs are left alone (they come
        back with its own state); the next :meth:`step` sets them. No communication."""
        if "last_batch_iteration" in state_dict:
            iteration = int(state_dict["last_batch_iteration"])
        elif "last_epoch" in state_dict:
            iteration = int(state_dict["last_epoch"]) - 1
        else:
            raise KeyError(f"{type(self).__name__}.load_state_dict: expected "
                           f"'last_batch_iteration' (DeepSpeed's) or 'last_epoch' (torch's), "
                           f"got keys {sorted(state_dict)}")
        self.last_epoch = iteration + 1
        self._step_count = int(state_dict.get("_step_count", iteration + 2))
        self._last_lr = self.lrs_at(iteration)

    def lrs_at(self, iteration: int) -> list[float]:  # pragma: no cover - abstract
        raise NotImplementedError


def loads_position_only(scheduler) -> bool:
    """Whether ``scheduler`` is one of this module's DeepSpeed schedules, whose
    ``load_state_dict`` takes only the saved position (``last_batch_iteration`` or torch's
    ``last_epoch``) from any scheduler's state, as DeepSpeed's do. Local."""
    return isinstance(scheduler, _IterationSchedule)


class _DeepSpeedSchedule(_IterationSchedule):
    """The warm-up shared by DeepSpeed's warm-up schedules."""

    def __init__(self, optimizer, warmup_num_steps: int, warmup_type: str,
                 last_batch_iteration: int):
        name = type(self).__name__
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"{name}(warmup_type={warmup_type!r}): valid types are "
                             f"{list(WARMUP_TYPES)}")
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) \
                or warmup_num_steps < 1:
            raise ValueError(f"{name}(warmup_num_steps={warmup_num_steps!r}): must be an "
                             f"integer >= 1 (as DeepSpeed's)")
        # DeepSpeed's floor: log(1) would divide by zero below two steps.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        super().__init__(optimizer, last_batch_iteration)

    def _warmup_fraction(self, iteration: int) -> float:
        """0 at the start of warm-up, rising to 1 at ``warmup_num_steps``."""
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def _per_group(self, value, what: str) -> list[float]:
        groups = self.optimizer.param_groups
        if isinstance(value, (list, tuple)):
            if len(value) != len(groups):
                raise ValueError(f"{type(self).__name__}({what}={list(value)!r}): one value per "
                                 f"param group is needed, and the optimizer has {len(groups)}")
            return [float(v) for v in value]
        return [float(value)] * len(groups)


class WarmupLR(_DeepSpeedSchedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    At iteration ``i < warmup_num_steps`` the lr is ``min + (max - min) * g(i)`` with
    ``g = log(i + 1) / log(warmup_num_steps)`` (``log``) or ``i / warmup_num_steps``
    (``linear``); afterwards ``warmup_max_lr``. ``warmup_max_lr=None`` (the default) warms each
    param group up to the lr it holds when the schedule is built, as DeepSpeed does since
    0.17.2 (earlier releases, and its docstring still, used a fixed 0.001 whatever lr the
    optimizer was given: pass ``warmup_max_lr=0.001`` for their schedule).

    Args:
        optimizer: any torch optimizer (OSS included).
        warmup_min_lr, warmup_max_lr: a float, or one per param group; ``warmup_max_lr=None``:
            each group's own lr.
        warmup_num_steps: warm-up length in scheduler steps (at least 2 is used).
        warmup_type: ``"log"`` (DeepSpeed's default) or ``"linear"``.
        last_batch_iteration: resume position (-1: start).

    Memory: two floats per param group. Communication: none.
    """

    def __init__(self, optimizer, warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[Number, Sequence[Number], None] = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        self.optimizer = optimizer
        if warmup_max_lr is None:  # every group warms up to its own lr (groups may differ)
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs)]
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_fraction(iteration)
        return 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        """Each param group's lr at ``iteration`` (``warmup_min_lr`` before the first)."""
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`'s warm-up, then a linear decay back to ``warmup_min_lr``.

    After warm-up the lr is ``min + (max - min) * g`` with
    ``g = (total_num_steps - i) / (total_num_steps - warmup_num_steps)`` floored at 0, so it
    reaches ``warmup_min_lr`` at ``total_num_steps`` and stays there. Args as
    :class:`WarmupLR` plus ``total_num_steps`` (>= 1). Memory: two floats per param group.
    Communication: none.
    """

    def __init__(self, optimizer, total_num_steps: int,
                 warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[Number, Sequence[Number], None] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1):
        _require_total_steps(type(self).__name__, total_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_fraction(iteration)
        decay_span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - iteration) / decay_span)


class WarmupCosineLR(_DeepSpeedSchedule):
    """Scale each group's initial lr by a ratio: warm-up, then cosine decay.

    During warm-up the ratio rises from ``warmup_min_ratio`` to 1 (``log`` or ``linear``);
    afterwards it is ``cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * min(t / T, 1))) / 2``
    with ``t = i - warmup_num_steps + 1`` and ``T = total_num_steps - warmup_num_steps``: it
    reaches ``cos_min_ratio`` at ``total_num_steps`` and stays there when training goes on
    (DeepSpeed releases whose cosine is not clamped let it swing back up towards the peak past
    ``total_num_steps``). As in DeepSpeed the lr is 0 before the first :meth:`step`.

    Args:
        optimizer: any torch optimizer; its current lrs are the peak lrs.
        total_num_steps: length of the whole schedule. At or below ``warmup_num_steps`` there
            is no decay window: the warm-up runs its full length, then the ratio drops to
            ``cos_min_ratio`` (below: a warning, as DeepSpeed gives).
        warmup_min_ratio: starting ratio of the warm-up.
        warmup_num_steps: warm-up length (at least 2 is used).
        cos_min_ratio: final ratio at ``total_num_steps``.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: resume position (-1: start).

    Memory: one float per param group. Communication: none.
    """

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        name = type(self).__name__
        _require_total_steps(name, total_num_steps)
        for label, ratio in (("warmup_min_ratio", warmup_min_ratio),
                             ("cos_min_ratio", cos_min_ratio)):
            if not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
                raise ValueError(f"{name}({label}={ratio!r}): must be a number in [0, 1]")
        if isinstance(warmup_num_steps, int) and total_num_steps < max(2, warmup_num_steps):
            # DeepSpeed warns and runs: the full warm-up, then cos_min_ratio (no decay window)
            logger.warning("%s: total_num_steps %d is less than warmup_num_steps %d; the lr "
                           "warms up over warmup_num_steps, then holds cos_min_ratio",
                           name, total_num_steps, max(2, warmup_num_steps))
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.org_lrs = [float(group["lr"]) for group in optimizer.param_groups]  # tensors too
        super().__init__(optimizer, warmup_num_steps, warmup_type, last_batch_iteration)

    def ratio_at(self, iteration: int) -> float:
        """The factor applied to every group's initial lr at ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            rise = self._warmup_fraction(iteration)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        step_into_decay = iteration - self.warmup_num_steps + 1
        # total_num_steps == warmup_num_steps: no decay window, the floor right after warm-up
        decay_span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, step_into_decay / decay_span)  # held at the floor past the end
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs_at(self, iteration: int) -> list[float]:
        """Each param group's lr at ``iteration``: its initial lr times :meth:`ratio_at`."""
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_IterationSchedule):
    """DeepSpeed's 1Cycle: the lr climbs from ``cycle_min_lr`` to ``cycle_max_lr`` and comes
    back, then optionally decays; Adam's ``beta1`` moves the other way.

    With ``S1 = cycle_first_step_size``, ``S2 = cycle_second_step_size`` (default ``S1``; 0:
    no falling half), ``T = S1 + S2`` and ``c = (iteration + 1) mod T``, during the cycle
    (iteration < ``T``) the lr is ``min + (max - min) * f`` with ``f = c / S1`` while
    ``c <= S1``, else ``(T - c) / S2``. A stair count ``k > 0`` for a half
    (``cycle_first_stair_count``; ``cycle_second_stair_count``, default the first's) holds
    the lr flat in ``k`` stairs over that half: ``f`` becomes ``floor(f * k) / k``, computed
    from the whole step counts (so ``k`` equal to the half's length is the continuous
    schedule). After the cycle the lr is ``cycle_min_lr / (1 + decay_lr_rate * j /
    decay_step_size)`` with ``j = iteration - T + 1`` (held at ``cycle_min_lr`` when either is
    0). The optimizer holds ``cycle_min_lr`` from construction until the first :meth:`step`, as
    in DeepSpeed.

    Momentum (``cycle_momentum``, the default): ``beta1 = max_mom - (max_mom - min_mom) * f``
    during the cycle, ``cycle_max_mom * (1 + decay_mom_rate * j / decay_step_size)`` after it,
    ``cycle_min_mom`` before the first step. Only optimizers with ``betas`` (Adam, AdamW) have
    their momentum cycled; with any other (SGD) a warning says it stays fixed, as DeepSpeed
    does. Unlike DeepSpeed, which sets ``beta2`` to 0.99 whenever it cycles ``beta1``, each
    group keeps its own ``beta2``.

    Args:
        optimizer: any torch optimizer (OSS included).
        cycle_min_lr, cycle_max_lr: the cycle's bounds: a number, or one per param group.
        decay_lr_rate: lr decay after the cycle (0: none).
        cycle_first_step_size: iterations of the rising half (>= 1).
        cycle_second_step_size: iterations of the falling half (>= 0; ``None``: the first's).
        cycle_first_stair_count, cycle_second_stair_count: stairs per half (0: continuous).
        decay_step_size: iterations per decay interval after the cycle (0: no decay).
        cycle_momentum: cycle ``beta1`` between ``cycle_min_mom`` and ``cycle_max_mom``.
        cycle_min_mom, cycle_max_mom: the momentum bounds: a number, or one per param group.
        decay_mom_rate: momentum growth rate after the cycle (0: held at ``cycle_max_mom``).
        last_batch_iteration: resume position (-1: start).

    Memory: a few floats per param group. Communication: none.
    """

    def __init__(self, optimizer, cycle_min_lr: Union[Number, Sequence[Number]],
                 cycle_max_lr: Union[Number, Sequence[Number]],
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None,
                 cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True,
                 cycle_min_mom: Union[Number, Sequence[Number]] = 0.8,
                 cycle_max_mom: Union[Number, Sequence[Number]] = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        name = type(self).__name__
        for label, value, least in (("cycle_first_step_size", cycle_first_step_size, 1),
                                    ("cycle_second_step_size", cycle_second_step_size, 0),
                                    ("cycle_first_stair_count", cycle_first_stair_count, 0),
                                    ("cycle_second_stair_count", cycle_second_stair_count, 0)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise ValueError(f"{name}({label}={value!r}): must be an integer >= {least}")
        for label, value in (("decay_lr_rate", decay_lr_rate),
                             ("decay_step_size", decay_step_size),
                             ("decay_mom_rate", decay_mom_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}({label}={value!r}): must be a number >= 0")
        self.optimizer = optimizer
        self.min_lrs = self._bounds(cycle_min_lr, "cycle_min_lr", None)
        self.max_lrs = self._bounds(cycle_max_lr, "cycle_max_lr", None)
        self.min_moms = self._bounds(cycle_min_mom, "cycle_min_mom", 1.0)
        self.max_moms = self._bounds(cycle_max_mom, "cycle_max_mom", 1.0)
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(cycle_first_step_size if cycle_second_step_size is None
                                      else cycle_second_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.decay_lr_rate = float(decay_lr_rate)
        self.decay_mom_rate = float(decay_mom_rate)
        self.cycle_momentum = bool(cycle_momentum) and _cycles_betas(optimizer, name)
        super().__init__(optimizer, last_batch_iteration)

    def _bounds(self, value, label: str, below: Optional[float]) -> list[float]:
        """``value`` (a number, or a list with one per param group) as one float per group,
        each >= 0 (and < ``below`` when given: Adam's beta1 must stay under 1)."""
        values = value if isinstance(value, (list, tuple)) else [value]
        valid = (f"a number in [0, {below:g})" if below is not None else "a number >= 0") + \
            " or a list of them, one per param group"
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
                             or (below is not None and not v < below) for v in values):
            raise ValueError(f"{type(self).__name__}({label}={value!r}): must be {valid}")
        return self._per_group(value, label)

    _per_group = _DeepSpeedSchedule._per_group

    def _cycle_fraction(self, iteration: int) -> float:
        """0 at the cycle's start, 1 at its peak (after ``S1`` steps), 0 again at its end;
        in stairs where a stair count is set."""
        position = (iteration + 1) % self.total_size
        rising = position <= self.first_step_size
        span = self.first_step_size if rising else self.second_step_size
        done = position if rising else self.total_size - position
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:
            return math.floor(done * stairs / span) / stairs
        return done / span

    def _decay_intervals(self, iteration: int) -> float:
        """Decay intervals since the cycle ended (0 with no decay configured)."""
        if not self.decay_step_size:
            return 0.0
        return (iteration - self.total_size + 1) / self.decay_step_size

    def lrs_at(self, iteration: int) -> list[float]:
        """Each param group's lr at ``iteration`` (``cycle_min_lr`` before the first)."""
        if iteration < 0:
            return list(self.min_lrs)
        if iteration < self.total_size:
            f = self._cycle_fraction(iteration)
            return [lo + (hi - lo) * f for lo, hi in zip(self.min_lrs, self.max_lrs)]
        return [lo / (1 + self.decay_lr_rate * self._decay_intervals(iteration))
                for lo in self.min_lrs]

    def momenta_at(self, iteration: int) -> list[float]:
        """Each param group's ``beta1`` at ``iteration``."""
        if iteration < 0:
            return list(self.min_moms)
        if iteration < self.total_size:
            f = self._cycle_fraction(iteration)
            return [hi - (hi - lo) * f for lo, hi in zip(self.min_moms, self.max_moms)]
        growth = 1 + self.decay_mom_rate * self._decay_intervals(iteration)
        return [hi * growth for hi in self.max_moms]

    def momentum_at(self, iteration: int) -> float:
        """The first param group's ``beta1`` at ``iteration`` (:meth:`momenta_at`: every
        group's)."""
        return self.momenta_at(iteration)[0]

    def step(self, batch_iteration: Optional[int] = None) -> None:
        """Advance one step (or jump to ``batch_iteration``, DeepSpeed's name here); set each
        group's lr and, when cycling momentum, its ``beta1``."""
        super().step(batch_iteration)
        if self.cycle_momentum:
            for group, beta1 in zip(self.optimizer.param_groups,
                                    self.momenta_at(self.last_batch_iteration)):
                group["betas"] = (beta1, group["betas"][1])


class LRRangeTest(_IterationSchedule):
    """DeepSpeed's learning-rate range test: the lr grows from ``lr_range_test_min_lr`` by
    ``lr_range_test_step_rate`` times it every ``lr_range_test_step_size`` iterations, to find
    the largest lr that still trains (the bounds of a :class:`OneCycle`).

    At iteration ``i`` the lr is ``min_lr * (1 + step_rate * k)`` with ``k = (i + 1) /
    step_size``, or ``floor((i + 1) / step_size)`` with ``lr_range_test_staircase`` (the lr
    then holds for ``step_size`` iterations at a time). The optimizer holds ``min_lr`` from
    construction until the first :meth:`step`, as in DeepSpeed.

    Args:
        optimizer: any torch optimizer (OSS included).
        lr_range_test_min_lr: the starting lr: a number, or one per param group.
        lr_range_test_step_size: iterations per growth interval (>= 1).
        lr_range_test_step_rate: growth per interval, in multiples of the starting lr (>= 0).
        lr_range_test_staircase: grow in stairs rather than continuously.
        last_batch_iteration: resume position (-1: start).

    Memory: one float per param group. Communication: none.
    """

    def __init__(self, optimizer, lr_range_test_min_lr: Union[Number, Sequence[Number]] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1):
        name = type(self).__name__
        if isinstance(lr_range_test_step_size, bool) \
                or not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size < 1:
            raise ValueError(f"{name}(lr_range_test_step_size={lr_range_test_step_size!r}): "
                             f"must be an integer >= 1")
        if isinstance(lr_range_test_step_rate, bool) \
                or not isinstance(lr_range_test_step_rate, (int, float)) \
                or not math.isfinite(lr_range_test_step_rate) or lr_range_test_step_rate < 0:
            raise ValueError(f"{name}(lr_range_test_step_rate={lr_range_test_step_rate!r}): "
                             f"must be a finite number >= 0")
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(f"{name}(lr_range_test_staircase={lr_range_test_staircase!r}): "
                             f"expected True or False")
        self.optimizer = optimizer
        self.min_lrs = self._bounds(lr_range_test_min_lr, "lr_range_test_min_lr", None)
        self.step_size = lr_range_test_step_size
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    _per_group = _DeepSpeedSchedule._per_group
    _bounds = OneCycle._bounds

    def step(self, batch_iteration: Optional[int] = None) -> None:
        """Advance one step (or jump to ``batch_iteration``, DeepSpeed's name here)."""
        super().step(batch_iteration)

    def lrs_at(self, iteration: int) -> list[float]:
        """Each param group's lr at ``iteration``."""
        intervals = (iteration + 1) / self.step_size
        if self.staircase:
            intervals = math.floor(intervals)
        return [lr * (1 + self.step_rate * intervals) for lr in self.min_lrs]


def _set_lr(group: dict, lr: float) -> None:
    """Write ``lr`` into ``group``; a tensor lr (torch's ``lr=torch.tensor(...)``, e.g. for a
    captured graph) is filled in place, so the caller's tensor keeps its identity, shape and
    dtype, as DeepSpeed's schedulers do."""
    current = group["lr"]
    if isinstance(current, torch.Tensor):
        current.fill_(lr)
    else:
        group["lr"] = lr


def _cycles_betas(optimizer, name: str) -> bool:
    """Whether ``optimizer`` has Adam's ``betas`` to cycle; warns (as DeepSpeed) when not."""
    if "betas" in getattr(optimizer, "defaults", {}):
        return True
    inner = getattr(optimizer, "optim", None)  # OSS: name the optimizer it shards
    described = type(optimizer).__name__ if not hasattr(inner, "param_groups") else \
        f"{type(optimizer).__name__}({type(inner).__name__})"
    logger.warning(
        "%s: cycle_momentum is off because %s has no betas (only Adam-style momentum is "
        "cycled); set \"cycle_momentum\": false to silence this", name, described)
    return False


def _require_total_steps(name: str, total_num_steps) -> None:
    if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) \
            or total_num_steps < 1:
        raise ValueError(f"{name}(total_num_steps={total_num_steps!r}): must be an integer >= 1")
