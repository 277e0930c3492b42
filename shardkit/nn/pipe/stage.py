"""PipelineStage: this process's part of a multi-process pipeline, and its neighbours."""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn as nn

from shardkit import distributed as dist

__all__ = ["PipelineStage"]


PLACEMENTS = ("loop", "v")


def stage_rank(stage_index: int, num_stages: int, group_size: int, placement: str) -> int:
    """The pipeline-group rank that runs ``stage_index`` under ``placement``: ``"loop"``
    puts stage ``s`` on rank ``s % group_size``; ``"v"`` (``2 * group_size`` stages) goes down the
    ranks and back up, so rank 0 runs the first and the last stage."""
    if placement == "v" and stage_index >= group_size:
        return num_stages - 1 - stage_index
    return stage_index % group_size


def _stage_problem(stage_index, num_stages, group_rank: int, group_size: int,
                   placement) -> Optional[str]:
    for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name}={value!r} is not an int"
    if placement not in PLACEMENTS:
        return f"placement={placement!r} is not one of {list(PLACEMENTS)}"
    if placement == "v" and num_stages != 2 * group_size:
        return (f"placement='v' needs num_stages = 2 x the pipeline group size = "
                f"{2 * group_size}, got num_stages={num_stages}")
    if num_stages < group_size or num_stages % group_size:
        return (f"num_stages={num_stages} but the pipeline group has {group_size} ranks "
                f"(num_stages must be a multiple of the group size: one stage per rank, or "
                f"several with ScheduleInterleaved1F1B / ScheduleZBV)")
    if not 0 <= stage_index < num_stages:
        return f"stage_index={stage_index} is not in [0, {num_stages})"
    owner = stage_rank(stage_index, num_stages, group_size, placement)
    if owner != group_rank:
        return (f"stage_index={stage_index} but this process is rank {group_rank} of the "
                f"pipeline group (with placement={placement!r} and {num_stages} stages, stage "
                f"{stage_index} runs on group rank {owner})")
    return None


class PipelineStage:
    """Stage ``stage_index`` of a ``num_stages``-stage pipeline, run by this process.

    Rank ``i`` of ``group`` (default: the whole world) runs stage ``i``; activations go to
    group rank ``i+1`` and gradients back to rank ``i-1`` by point-to-point ops. Drive it with
    :class:`ScheduleGPipe`, :class:`Schedule1F1B` or :class:`ScheduleZeroBubble`; step an
    optimizer over ``stage.parameters()`` (each stage steps its own parameters). With more
    stages than ranks (``placement``), each rank builds several stages and passes them as a list
    to :class:`ScheduleInterleaved1F1B` or :class:`ScheduleZBV`.

    With several pipelines side by side (data parallelism across pipelines), pass
    ``data_parallel_group``: the group of ranks that run this same stage in the other
    pipelines. After the last backward of each step the schedule calls
    :meth:`reduce_gradients`, which averages this stage's gradients over that group.

    Args:
        module: this stage's layers (e.g. one part of :func:`split_sequential`). It gets what
            the previous stage's module returned (a tensor or a tuple of tensors) as its one
            argument, as in ``nn.Sequential``.
        stage_index: which stage this is; must equal this process's rank in ``group``.
        num_stages: number of stages; must equal the size of ``group``.
        group: the pipeline's process group (``None``: the default group).
        data_parallel_group: optional group over which gradients are averaged every step.
        placement: with more stages than ranks, which rank runs which stage: ``"loop"``
            (default; stage ``s`` on group rank ``s % p``, for :class:`ScheduleInterleaved1F1B`)
            or ``"v"`` (``2p`` stages, rank ``r`` runs stages ``r`` and ``2p-1-r``, for
            :class:`ScheduleZBV`). Build one ``PipelineStage`` per stage the rank runs, in the
            same order on every rank.

    Memory: this stage's parameters and gradients only; activations as the schedule keeps
    them. Communication per step: each micro-batch's activations sent forward once and their
    gradients sent back once (``send`` counts their bytes), plus one all-reduce of this stage's
    gradients, ``2(d-1)/d`` of their bytes, with a data-parallel group of ``d`` ranks.

    .. warning:: The constructor exchanges ``(stage_index, num_stages)`` over ``group`` (one
       small all-gather) so every rank raises the same error on a mismatch: construct the
       stages on all ranks of the group.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, group=None,
                 data_parallel_group=None, placement: str = "loop"):
        dist.require_initialized("PipelineStage")
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage(module={type(module).__name__}): expected an "
                            f"nn.Module")
        group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
        if group_rank < 0:
            raise ValueError(f"PipelineStage(group=...): global rank {dist.get_rank()} is not "
                             f"a member of the pipeline group")
        views = dist.all_gather_object((stage_index, num_stages, placement), group=group)
        problems = []
        for rank, (index, count, where) in enumerate(views):
            problem = _stage_problem(index, count, rank, group_size, where)
            if problem:
                problems.append(f"group rank {rank}: {problem}")
        if problems:
            raise ValueError("PipelineStage: the ranks of the pipeline group disagree on the "
                             "stages:\n  " + "\n  ".join(problems))
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.data_parallel_group = data_parallel_group
        self.placement = placement
        self.group_size = group_size
        self.prev_rank = self.global_rank_of(stage_index - 1) if stage_index > 0 else None
        self.next_rank = (self.global_rank_of(stage_index + 1)
                          if stage_index < num_stages - 1 else None)

    def global_rank_of(self, stage_index: int) -> int:
        """The global rank that runs stage ``stage_index`` of this pipeline."""
        group_rank = stage_rank(stage_index, self.num_stages, self.group_size, self.placement)
        return dist.get_global_rank(self.group, group_rank)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters (those of its module)."""
        return self.module.parameters()

    def reduce_gradients(self) -> None:
        """Average this stage's gradients over ``data_parallel_group`` (one flat all-reduce).

        No-op without a data-parallel group or with a group of one rank. Parameters that
        require grad but got none are treated as zero gradients (and then hold them).
        """
        group = self.data_parallel_group
        if group is None or dist.get_world_size(group) == 1:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"module={type(self.module).__name__})")
