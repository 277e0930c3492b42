"""PipelineStage: this process's part of a multi-process pipeline, and its neighbours."""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import torch
import torch.distributed
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit import distributed as dist
from shardkit.nn.pipe.partition import shared_parameters
from shardkit.nn.pipe.ties import cross_rank_copies, cross_rank_ties

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


def _ties(module: nn.Module, stage_index: int, num_stages: int, group, group_size: int,
          placement: str) -> tuple[list, list[str]]:
    """This stage's parameters that :func:`~shardkit.nn.pipe.split_sequential` found to be the
    same tensor as a parameter of a stage another rank runs (see
    :mod:`~shardkit.nn.pipe.ties`; frozen ones too, which may be unfrozen later, except in a
    stage module that reduces its gradients itself), and what about them cannot run. Local;
    no communication."""
    count, shared = shared_parameters(module)
    if count != num_stages or not shared:
        return [], []
    where = lambda s: stage_rank(s, num_stages, group_size, placement)  # noqa: E731
    ties, problems = cross_rank_ties(shared, stage_index, where, where(stage_index),
                                     lambda r: dist.get_global_rank(group, r))
    if _reduces_itself(module):
        ties = [tie for tie in ties if tie.param.requires_grad]
    if ties and _reduces_itself(module):
        problems.append(f"stage {stage_index}'s parameter {ties[0].name!r} is tied with stage "
                        f"{ties[0].other_stage}, which another rank runs, and the stage module "
                        f"reduces its gradients itself (ShardedDataParallel / FSDP), so the "
                        f"copies' gradients cannot be added: untie them, or run both stages "
                        f"on one rank (ScheduleZBV with placement='v' runs the first and the "
                        f"last stage on group rank 0)")
    return ties, problems


def _tie_copies(module: nn.Module, stage_index: int, num_stages: int, group_size: int,
                placement: str) -> list:
    """This stage's parameters shared with a stage another rank runs, frozen or not, as
    ``(key, parameter)``: the schedule checks that both copies agree on ``requires_grad``."""
    count, shared = shared_parameters(module)
    if count != num_stages or not shared:
        return []
    where = lambda s: stage_rank(s, num_stages, group_size, placement)  # noqa: E731
    return cross_rank_copies(shared, stage_index, where, where(stage_index))


def _is_group(value) -> bool:
    """A process group (or torch's marker for one this rank is not in), or a DeviceMesh."""
    outside = torch.distributed.GroupMember.NON_GROUP_MEMBER  # new_group's value off its ranks
    return isinstance(value, (torch.distributed.ProcessGroup, DeviceMesh)) or (
        type(value) is type(outside) and value == outside)


def _split_device_from_group(device, group):
    """``(device, group)`` from the 4th positional argument and ``group=``: the 4th is torch's
    ``device``; a process group there (shardkit's earlier ``PipelineStage(module, i, n,
    group)``) is taken as ``group``. Local, before any collective."""
    if _is_group(device):
        if group is not None:
            raise TypeError(f"PipelineStage(..., {device!r}, group={group!r}): got a process "
                            f"group both as the 4th argument (torch's place for the device) and "
                            f"by keyword; pass it once, by keyword")
        device, group = None, device
    if isinstance(group, DeviceMesh):
        raise TypeError(f"PipelineStage(group={group!r}): expected the pipeline's process group "
                        f"or None, got a DeviceMesh; pass the process group of its pipeline "
                        f"dimension, mesh.get_group(\"pp\") (as torch's PipelineStage takes)")
    dist.check_group(group, "PipelineStage")
    return device, group


def _device_problem(module: nn.Module, device) -> Optional[str]:
    """What is wrong with torch's ``device`` argument: shardkit runs a stage where its module's
    parameters and buffers are, so ``device`` must name where they are (as torch's
    ``PipelineStage`` expects the module to be moved there first). Local."""
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError) as error:
        return f"device={device!r} is not a device ({error})"
    for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
        here = tensor.device
        if here.type != wanted.type or (wanted.index is not None and here.index != wanted.index):
            return (f"device={str(wanted)!r}, but the stage module's {name!r} is on "
                    f"{str(here)!r}; move the module there first (module.to(device)), as "
                    f"torch's PipelineStage expects, or leave device out (a stage runs where "
                    f"its module's parameters are)")
    return None


def _example_tensors_problems(examples: dict) -> list[str]:
    """torch's ``input_args`` / ``output_args`` / ``input_grads`` / ``output_grads`` (example
    tensors torch uses to skip its shape inference): shardkit announces shapes in the first
    step's messages and needs none, so any tensor, tuple of tensors (``None`` among gradients)
    or ``None`` is accepted and not kept; anything else is named. Local."""
    problems = []
    for name, value in examples.items():
        if _is_group(value) or isinstance(value, str):
            # shardkit's earlier PipelineStage(module, i, n, group, data_parallel_group,
            # placement) lands its 5th and 6th arguments here
            problems.append(f"{name}={value!r}: expected example tensors (torch's argument in "
                            f"this place); data_parallel_group and placement are "
                            f"keyword-only: pass data_parallel_group=... / placement=...")
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        allowed = (torch.Tensor, type(None)) if name.endswith("grads") else (torch.Tensor,)
        if value is not None and not all(isinstance(v, allowed) for v in values):
            kinds = [type(v).__name__ for v in values]
            problems.append(f"{name}={kinds}: expected a tensor or a tuple of tensors (example "
                            f"{name.split('_')[0]}s, which shardkit does not need: the first "
                            f"step announces the shapes), or None")
    return problems


def _torch_only_problems(dw_builder, get_mesh) -> list[str]:
    """torch options that change what a stage computes and that shardkit does not run. Local."""
    problems = []
    if dw_builder is not None:
        problems.append(f"dw_builder={dw_builder!r}: shardkit's split-backward schedules "
                        f"(ScheduleZeroBubble, ScheduleZBV) compute the weight gradients "
                        f"themselves and would never call it; pass dw_builder=None")
    if get_mesh is not None:
        problems.append(f"get_mesh={get_mesh!r}: shardkit's stages send plain tensors, not "
                        f"DTensors; pass get_mesh=None")
    return problems


def _reduces_itself(module: nn.Module) -> bool:
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

    return any(isinstance(m, (ShardedDataParallel, FullyShardedDataParallel))
               for m in module.modules())


def _double_reduction_problems(module: nn.Module, data_parallel_group) -> list[str]:
    """A ``data_parallel_group`` sharing ranks with the group of a stage module that reduces
    its gradients itself (ShardedDataParallel: each gradient to its owner; FSDP: sharded):
    the stage's all-reduce would average what is already reduced with zeros or with other
    ranks' shards. A group across replicas of the same shards (hybrid: it meets the
    wrapper's group in this rank only) is fine. Local; no communication."""
    if data_parallel_group is None:
        return []
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

    replicas = set(dist.group_ranks(data_parallel_group))
    for m in module.modules():
        if not isinstance(m, (ShardedDataParallel, FullyShardedDataParallel)):
            continue
        shared = sorted(replicas & set(dist.group_ranks(m.process_group)))
        if len(shared) > 1:
            return [f"data_parallel_group (ranks {sorted(replicas)}) shares ranks {shared} "
                    f"with the stage module's {type(m).__name__}, which reduces the gradients "
                    f"over its own process group in backward; averaging them again over "
                    f"data_parallel_group would mix in zeros or other ranks' shards. Pass "
                    f"data_parallel_group=None"]
    return []


def is_torch_ddp(module: nn.Module) -> bool:
    """Whether ``module`` is torch's ``DistributedDataParallel`` (whose reducer expects one
    backward per forward, so a pipeline runs its forwards inside ``no_sync()`` and averages
    its gradients itself at the end of the step)."""
    return isinstance(module, nn.parallel.DistributedDataParallel)


def _replica_group(module: nn.Module, data_parallel_group) -> tuple:
    """The group this stage's gradients are averaged over: ``data_parallel_group``, or the
    process group of a torch ``DistributedDataParallel`` stage module (which must be the same
    ranks when both are given, not ``static_graph``, and without a communication hook, which
    the schedule's own all-reduce would skip), and what is wrong. Local; no
    communication."""
    if not is_torch_ddp(module):
        return data_parallel_group, []
    if module.static_graph:
        return data_parallel_group, [
            "the stage module is DistributedDataParallel(static_graph=True); a pipeline runs "
            "its forwards inside no_sync() (one backward per micro-batch) and averages the "
            "gradients itself, where static_graph's delayed all-reduce cannot run: build the "
            "DDP module with static_graph=False"]
    if module._comm_hooks:
        hooks = ", ".join(getattr(hook, "__name__", repr(hook)) for hook, _ in module._comm_hooks)
        return data_parallel_group, [
            f"the DistributedDataParallel stage module has a communication hook ({hooks}); "
            f"a pipeline runs its forwards inside no_sync() and averages the gradients itself "
            f"in one plain all-reduce, so the hook would never run: build the stage's DDP "
            f"module without register_comm_hook (or wrap the stage in ShardedDataParallel / "
            f"FullyShardedDataParallel, which take a comm= transport)"]
    if data_parallel_group is not None and \
            dist.group_ranks(data_parallel_group) != dist.group_ranks(module.process_group):
        return data_parallel_group, [
            f"data_parallel_group has ranks {dist.group_ranks(data_parallel_group)}, but the "
            f"DistributedDataParallel stage module's process group has "
            f"{dist.group_ranks(module.process_group)}; pass the DDP module's process group "
            f"or None"]
    return module.process_group, []


def _stage_device(module: nn.Module, device) -> torch.device:
    """Where the stage runs: where its module's first parameter (or buffer) is (``device``,
    checked to match, may leave out the index: ``"cuda"``); for a module without any,
    ``device``, else the CPU."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu") if device is None else torch.device(device)


class PipelineStage:
    """Stage ``stage_index`` of a ``num_stages``-stage pipeline, run by this process.

    Rank ``i`` of ``group`` (default: the whole world) runs stage ``i``; activations go to
    group rank ``i+1`` and gradients back to rank ``i-1`` by point-to-point ops. Drive it with
    :class:`~shardkit.nn.pipe.ScheduleGPipe`, :class:`~shardkit.nn.pipe.Schedule1F1B` or
    :class:`~shardkit.nn.pipe.ScheduleZeroBubble`; step an optimizer over ``stage.parameters()``
    (each stage steps its own parameters). With more stages than ranks (``placement``), each rank
    builds several stages and passes them as a list to
    :class:`~shardkit.nn.pipe.ScheduleInterleaved1F1B` or :class:`~shardkit.nn.pipe.ScheduleZBV`.

    With several pipelines side by side (data parallelism across pipelines), pass
    ``data_parallel_group``: the group of ranks that run this same stage in the other
    pipelines. After the last backward of each step the schedule calls
    :meth:`reduce_gradients`, which averages this stage's gradients over that group and tells
    every replica whether the step failed in any pipeline (each then raises, naming the replica
    and its problem). A pipeline that refuses a step before running it (a target or batch its
    first-step checks reject) still takes part in that all-reduce, with zeros, so the other
    pipelines raise too instead of waiting; its own ``.grad`` is left as it was.

    Args:
        module: this stage's layers (e.g. one part of
            :func:`~shardkit.nn.pipe.split_sequential`). It gets what the previous stage's
            module returned (a tensor or a tuple of tensors) as its one argument, as in
            ``nn.Sequential``.
        stage_index: which stage this is; must equal this process's rank in ``group``.
        num_stages: number of stages; must equal the size of ``group``.
        device: torch's 4th argument: where the stage runs (a ``torch.device``, a device
            string or an index). The stage module must already be there (every parameter and
            buffer; else a ``ValueError`` on every rank naming one that is not); ``None``:
            where its parameters are. Kept as ``self.device``.
        input_args, output_args, input_grads, output_grads: torch's example tensors, used
            there to skip its shape inference; shardkit announces shapes in the first step's
            messages, so they are checked to be tensors and not kept.
        group: the pipeline's process group (``None``: the default group), by keyword as in
            torch (``group=pp_group``); a process group as the 4th argument (shardkit's
            earlier ``PipelineStage(module, i, n, group)``) is taken as ``group`` too.
        dw_builder, get_mesh: torch's; only ``None`` (a ``ValueError`` otherwise: shardkit's
            split-backward schedules compute the weight gradients themselves, and stages send
            plain tensors, not DTensors).
        data_parallel_group: optional group over which gradients are averaged every step;
            leave it ``None`` for a ShardedDataParallel or FullyShardedDataParallel stage
            module, which reduces its gradients itself (a ``ValueError`` otherwise).
            A torch ``DistributedDataParallel`` stage module brings its own (its
            ``process_group``): the schedule runs its forwards inside ``no_sync()`` (its
            reducer expects one backward per forward, a pipeline runs one per micro-batch) and
            averages the gradients in one flat all-reduce after the step's last backward
            (so a DDP module with ``register_comm_hook`` is refused: its hook would not run).
        placement: with more stages than ranks, which rank runs which stage: ``"loop"``
            (default; stage ``s`` on group rank ``s % p``, for
            :class:`~shardkit.nn.pipe.ScheduleInterleaved1F1B`) or ``"v"`` (``2p`` stages, rank
            ``r`` runs stages ``r`` and ``2p-1-r``, for :class:`~shardkit.nn.pipe.ScheduleZBV`).
            Build one ``PipelineStage`` per stage the rank runs, in the same order on every rank.
            ``data_parallel_group`` and ``placement`` go by keyword.

    Memory: this stage's parameters and gradients only; activations as the schedule keeps
    them. Communication per step: each micro-batch's activations sent forward once and their
    gradients sent back once, each gradient tensor with one element more saying whether it is
    present (``send`` counts their bytes; see :func:`shardkit.plan.pipeline_comm_elements`),
    plus one all-reduce of this stage's gradients, one element more (whether the step failed
    in some pipeline) and one per trainable parameter (whether it got a gradient), ``2(d-1)/d``
    of their bytes, with a data-parallel group of ``d`` ranks.

    Tied weights (a parameter :func:`~shardkit.nn.pipe.split_sequential` put in two stages, as a
    GPT's token embedding and output head): when another rank runs the other stage, each rank holds
    a copy and the schedule keeps them one weight (the later stage's copy takes the earlier one's
    values before the first step, frozen or not; after each training step the two ranks add
    each other's share of the gradient: one send of the weight's bytes each way; see
    :mod:`~shardkit.nn.pipe.ties`), so an optimizer over each stage's parameters trains them
    as one. A weight tied across three or more ranks, or inside a ShardedDataParallel / FSDP
    stage module, is refused. When one rank runs both stages (``placement="v"``) nothing
    crosses. Freeze a tied weight on both ranks or on neither (the schedule's first step
    checks, and raises on every rank; a later training step fails on every rank); a frozen
    tie keeps ``.grad`` None, as in one process, and one frozen when the stages are built and
    unfrozen later on both ranks trains as one weight again.

    .. warning:: The constructor exchanges ``(stage_index, num_stages)`` and what it found
       wrong over ``group`` (one small all-gather) so every rank raises the same error on a
       mismatch or a tie across ranks: construct the stages on all ranks of the group.
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int, device=None,
                 input_args=None, output_args=None, output_grads=None, input_grads=None,
                 group=None, dw_builder=None, get_mesh=None, *, data_parallel_group=None,
                 placement: str = "loop"):
        dist.require_initialized("PipelineStage")
        if not isinstance(module, nn.Module):
            raise TypeError(f"PipelineStage(module={type(module).__name__}): expected an "
                            f"nn.Module")
        device, group = _split_device_from_group(device, group)
        dist.check_group(data_parallel_group, "PipelineStage", "data_parallel_group")
        group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
        if group_rank < 0:
            raise ValueError(f"PipelineStage(group=...): global rank {dist.get_rank()} is not "
                             f"a member of the pipeline group")
        ties, local = ([], []) if _stage_problem(stage_index, num_stages, group_rank,
                                                 group_size, placement) else \
            _ties(module, stage_index, num_stages, group, group_size, placement)
        local += _double_reduction_problems(module, data_parallel_group)
        replicas, wrong = _replica_group(module, data_parallel_group)
        local += wrong
        if device is not None:
            local += [p for p in [_device_problem(module, device)] if p]
        local += _example_tensors_problems({"input_args": input_args, "output_args": output_args,
                                            "input_grads": input_grads,
                                            "output_grads": output_grads})
        local += _torch_only_problems(dw_builder, get_mesh)
        views = dist.all_gather_object((stage_index, num_stages, placement, local), group=group)
        problems = []
        for rank, (index, count, where, found) in enumerate(views):
            problem = _stage_problem(index, count, rank, group_size, where)
            if problem:
                problems.append(f"group rank {rank}: {problem}")
            problems += [f"group rank {rank}: {p}" for p in found]
        if problems:
            raise ValueError("PipelineStage: the pipeline group's stages cannot run "
                             "together:\n  " + "\n  ".join(problems))
        self.module = module
        self.device = _stage_device(module, device)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.data_parallel_group = replicas
        self.placement = placement
        self.group_size = group_size
        self.ties = ties  # weights shared with a stage another rank runs
        self.tie_copies = _tie_copies(module, stage_index, num_stages, group_size, placement)
        self.prev_rank = self.global_rank_of(stage_index - 1) if stage_index > 0 else None
        self.next_rank = (self.global_rank_of(stage_index + 1)
                          if stage_index < num_stages - 1 else None)

    def global_rank_of(self, stage_index: int) -> int:
        """The global rank that runs stage ``stage_index`` of this pipeline."""
        group_rank = stage_rank(stage_index, self.num_stages, self.group_size, self.placement)
        return dist.get_global_rank(self.group, group_rank)

    @property
    def submod(self) -> nn.Module:
        """This stage's module (torch's name for :attr:`module`)."""
        return self.module

    @property
    def group_rank(self) -> int:
        """This process's rank in the pipeline group (torch's ``PipelineStage.group_rank``)."""
        return stage_rank(self.stage_index, self.num_stages, self.group_size, self.placement)

    @property
    def is_first(self) -> bool:
        """Whether this is the pipeline's first stage (it takes the batch)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this is the pipeline's last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> Iterator[nn.Parameter]:
        """This stage's parameters (those of its module)."""
        return self.module.parameters()

    def reduces_gradients_now(self) -> bool:
        """Whether :meth:`reduce_gradients` communicates at this step's end: a data-parallel
        group of more than one rank, outside a torch ``DistributedDataParallel`` stage
        module's ``no_sync()``."""
        group = self.data_parallel_group
        if group is None or dist.get_world_size(group) == 1:
            return False
        return not (is_torch_ddp(self.module) and not self.module.require_backward_grad_sync)

    def reduce_gradients(self, failed: bool = False) -> bool:
        """Average this stage's gradients over ``data_parallel_group`` (one flat all-reduce),
        and share whether the step failed: ``failed`` (this pipeline's step failed) rides as
        one more element, and the return value is whether the step failed in any replica's
        pipeline (the gradients then belong to no whole step: zero them; every replica then
        calls :meth:`replica_failures` to learn which one failed). Every replica takes
        part, failed or not, so none is left waiting in the all-reduce.

        No-op (returns ``failed``) without a data-parallel group or with a group of one rank,
        and inside a torch ``DistributedDataParallel`` stage module's ``no_sync()`` (its
        gradients accumulate locally until a step outside it averages them all, as under
        DDP). Parameters that require grad but got none on some replicas are treated as zero
        gradients there; one that got none on every replica keeps ``.grad`` ``None``, as under
        torch DDP (one presence element per parameter rides on the all-reduce).
        """
        if not self.reduces_gradients_now():
            return failed
        group = self.data_parallel_group
        params = [p for p in self.module.parameters() if p.requires_grad]
        present = [float(p.grad is not None) for p in params]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        tail = self._reduction_tail(failed, present, params)
        dist.all_reduce_as_one([p.grad for p in params] + [tail], group,
                               divide_by=dist.get_world_size(group))
        for p, seen in zip(params, tail[1:].tolist()):
            if seen == 0:  # no replica gave it a gradient: None, as torch DDP leaves it
                p.grad = None
        return bool(tail[0] > 0)

    def refuse_step_to_replicas(self) -> None:
        """For a step this pipeline refused before running it: take part in the replicas'
        end-of-step reduction (:meth:`reduce_gradients`' all-reduce, the same layout) with
        zeros and the step marked failed, so replicas whose pipelines ran the step learn it
        failed instead of waiting; this stage's ``.grad`` is left as it was. Then call
        :meth:`replica_failures`, as every replica does. No-op where
        :meth:`reduce_gradients` would not communicate."""
        if not self.reduces_gradients_now():
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        zeros = [torch.zeros_like(p if p.grad is None else p.grad) for p in params]
        tail = self._reduction_tail(True, [0.0] * len(params), params)
        dist.all_reduce_as_one(zeros + [tail], self.data_parallel_group)

    def replica_failures(self, problem: Optional[str]) -> list[str]:
        """After a reduction that said the step failed (on every replica alike): what each
        replica's pipeline found wrong (``problem`` is this rank's, ``None`` if its pipeline
        ran the step), as ``"data-parallel replica at global rank R: ..."`` lines, one small
        object all-gather over ``data_parallel_group``."""
        group = self.data_parallel_group
        found = dist.all_gather_object(problem, group=group)
        return [f"data-parallel replica at global rank {rank}: {p}"
                for rank, p in zip(dist.group_ranks(group), found) if p]

    def _reduction_tail(self, failed: bool, present: list, params: list) -> torch.Tensor:
        """The elements riding on the gradients' all-reduce: whether the step failed, then
        one presence flag per trainable parameter; in the gradients' dtype, on their device
        (the all-reduce flattens them together; NCCL: CUDA only)."""
        first = params[0] if params else None
        dtype = torch.float32 if first is None else \
            (first if first.grad is None else first.grad).dtype
        return torch.tensor([float(failed)] + present, dtype=dtype, device=self.device)

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"module={type(self.module).__name__})")
