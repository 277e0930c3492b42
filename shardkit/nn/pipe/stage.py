"""PipelineStage: this process's part of a multi-process pipeline, and its neighbours."""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.nn as nn

from shardkit import distributed as dist

__all__ = ["PipelineStage"]


def _stage_problem(stage_index, num_stages, group_rank: int, group_size: int) -> Optional[str]:
    for name, value in (("stage_index", stage_index), ("num_stages", num_stages)):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name}={value!r} is not an int"
    if num_stages != group_size:
        return (f"num_stages={num_stages} but the pipeline group has {group_size} ranks (group "
                f"rank i runs stage i, so num_stages must equal the group size)")
    if stage_index != group_rank:
        return (f"stage_index={stage_index} but this process is rank {group_rank} of the "
                f"pipeline group (group rank i runs stage i)")
    return None


class PipelineStage:
    """Stage ``stage_index`` of a ``num_stages``-stage pipeline, run by this process.

    Rank ``i`` of ``group`` (default: the whole world) runs stage ``i``; activations go to
    group rank ``i+1`` and gradients back to rank ``i-1`` by point-to-point ops. Drive it with
    :class:`ScheduleGPipe` or :class:`Schedule1F1B`; step an optimizer over
    ``stage.parameters()`` (each stage steps its own parameters).

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

    Memory: this stage's parameters and gradients only; activations as the schedule keeps
    them. Communication per step: each micro-batch's activations sent forward once and their
    gradients sent back once (``send`` counts their bytes), plus one all-reduce of this stage's
    gradients, ``2(d-1)/d`` of their bytes, with a data-parallel group of ``d`` ranks.

    .. warning:: The constructor exchanges ``(stage_index, num_stages)`` over ``group`` (one
       small all-gather) so every rank raises the same error on a mismatch: construct the
       stages on all ranks of the group.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, group=None,
                 data_parallel_group=None):
        dist.require_initialized("PipelineStage")
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage(module={type(module).__name__}): expected an "
                            f"nn.Module")
        group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
        if group_rank < 0:
            raise ValueError(f"PipelineStage(group=...): global rank {dist.get_rank()} is not "
                             f"a member of the pipeline group")
        views = dist.all_gather_object((stage_index, num_stages), group=group)
        problems = []
        for rank, (index, count) in enumerate(views):
            problem = _stage_problem(index, count, rank, group_size)
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
        self.prev_rank = dist.get_global_rank(group, stage_index - 1) if stage_index > 0 else None
        self.next_rank = (dist.get_global_rank(group, stage_index + 1)
                          if stage_index < num_stages - 1 else None)

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
