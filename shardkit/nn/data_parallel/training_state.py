"""Where a FullyShardedDataParallel unit is in its step: :class:`TrainingState` (FairScale's
names), read from ``unit.training_state`` and checked with ``unit.assert_state(...)``.

A unit moves ``IDLE -> FORWARD -> IDLE`` through its forward, ``BACKWARD_PRE`` once backward
reaches it (its parameters are gathered again), ``BACKWARD_POST`` once its gradient is whole
(its reduce-scatter issued), and back to ``IDLE`` when the root finishes the backward;
``SUMMON_FULL_PARAMS`` inside
:meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.summon_full_params`. A forward recomputed
during backward (activation checkpointing) leaves the backward state as it is. Costs nothing: one
attribute per unit, no communication.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Iterable, Union

__all__ = ["TrainingState", "check_state"]


class TrainingState(Enum):
    """The phase of the step a FullyShardedDataParallel unit is in (see the module's doc)."""

    IDLE = auto()
    FORWARD = auto()
    BACKWARD_PRE = auto()
    BACKWARD_POST = auto()
    SUMMON_FULL_PARAMS = auto()


def check_state(unit, expected: Union[TrainingState, Iterable[TrainingState]]) -> None:
    """Raise ``ValueError`` naming the expected and the current state unless ``unit`` is in
    ``expected`` (one state or several). A ``ValueError``, as FairScale's, so that it is not
    skipped under ``python -O``; anything that is not a :class:`TrainingState` is a TypeError."""
    states = [expected] if isinstance(expected, TrainingState) else list(expected)
    wrong = [s for s in states if not isinstance(s, TrainingState)]
    if wrong or not states:
        raise TypeError(f"assert_state(state={expected!r}): expected a TrainingState or a list of "
                        f"them ({', '.join(s.name for s in TrainingState)})")
    if unit.training_state not in states:
        names = ", ".join(s.name for s in states)
        raise ValueError(f"FullyShardedDataParallel unit {type(unit.module).__name__}: expected to "
                         f"be in state {names}, but it is in {unit.training_state.name}")
