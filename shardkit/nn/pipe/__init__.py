"""Pipeline parallelism.

- :class:`Pipe`: GPipe in one process over several devices (FairScale's ``Pipe``), with
  activation checkpointing, skip connections (:mod:`shardkit.nn.pipe.skip`) and deferred batch
  norm.
- :class:`PipelineStage` with :class:`ScheduleGPipe` / :class:`Schedule1F1B` /
  :class:`ScheduleZeroBubble` (ZB-H1): one stage per process over ``torch.distributed``
  point-to-point ops, optionally data-parallel per stage; :class:`ScheduleInterleaved1F1B` and
  :class:`ScheduleZBV` with several stages per process. :mod:`shardkit.nn.pipe.plan` holds every
  schedule as printable per-rank action lists with a dry run (deadlocks, bubble), and one
  executor (:class:`PlanSchedule`) runs them all.
- :func:`split_sequential` cuts an ``nn.Sequential`` by a ``balance`` list for either;
  :mod:`shardkit.nn.pipe.balance` (``balance_by_time``, ``balance_by_size``) proposes one.
"""

import importlib

from shardkit.nn.checkpoint import is_checkpointing, is_recomputing
from shardkit.nn.pipe import skip
from shardkit.nn.pipe.partition import split_sequential

_LAZY = {
    "Pipe": "shardkit.nn.pipe.pipe",
    "DeferredBatchNorm": "shardkit.nn.pipe.batchnorm",
    "PipelineStage": "shardkit.nn.pipe.stage",
    "ScheduleGPipe": "shardkit.nn.pipe.plan_schedules",
    "Schedule1F1B": "shardkit.nn.pipe.plan_schedules",
    "ActivationMemoryMeter": "shardkit.nn.pipe.schedules",
    "PlanSchedule": "shardkit.nn.pipe.plan_schedules",
    "ScheduleInterleaved1F1B": "shardkit.nn.pipe.plan_schedules",
    "ScheduleZeroBubble": "shardkit.nn.pipe.plan_schedules",
    "ScheduleZBV": "shardkit.nn.pipe.plan_schedules",
}

__all__ = sorted(["is_checkpointing", "is_recomputing", "skip", "split_sequential", *_LAZY])


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardkit.nn.pipe' has no attribute {name!r}")
