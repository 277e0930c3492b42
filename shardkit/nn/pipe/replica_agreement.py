"""A pipeline's agreement on each step with the data-parallel replicas of its stages in
other pipelines (:class:`ReplicaAgreement`, mixed into :class:`~shardkit.nn.pipe.PlanSchedule`).

The end-of-step gradient reduction over each stage's ``data_parallel_group`` carries whether the
step failed, and a pipeline that refuses a step before running it joins that reduction saying
so. Where stage modules communicate over the replicas inside forward or backward
(ShardedDataParallel, FSDP), the refusals and the kind of step (training or eval) are shared
before the step, so no pipeline waits in those modules' collectives for one that refused.
Communication: one all-reduce of three elements per replica group before such a step, and one
of two over the pipeline group; one small object all-gather only where a replica refused or
failed.
"""

from __future__ import annotations

import torch

from shardkit import distributed as dist
from shardkit.nn.pipe.stage import PipelineStage


def _replica_verdicts(groups: list, refused: bool, grad: bool) -> list:
    """Over each ``(group, device)`` of replicas that a stage module communicates with inside
    forward or backward, in order: ``(group, some replica refuses the step, the replicas
    disagree on training against eval)``, from one all-reduce of three elements per group."""
    verdicts = []
    for group, device in groups:
        flags = torch.tensor([float(refused), float(grad), 1.0], device=device)
        dist.all_reduce(flags, group=group)
        refusals, training, replicas = flags.tolist()
        verdicts.append((group, refusals > 0, 0 < training < replicas))
    return verdicts


def _step_kind_disagreement(grad: bool) -> str:
    kind = "a training step" if grad else "eval (forward only, under torch.no_grad())"
    return (f"this rank runs {kind}, but a data-parallel replica of its ShardedDataParallel / "
            f"FSDP stage module (whose collectives span the pipelines) runs the other kind; "
            f"call step() or eval() alike on every pipeline")


def _reduces_during_backward(stage: PipelineStage) -> bool:
    """Whether the stage module's own hooks reduce gradients over replicas inside backward
    (ShardedDataParallel, FSDP on more than one rank): a backward raising there cannot be
    passed over, since its replicas may already wait in that reduction."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

    return any(isinstance(m, ShardedDataParallel) and m.world_size > 1
               or isinstance(m, FullyShardedDataParallel) and (
                   m.world_size > 1 or getattr(m, "replicate_group", None) is not None)
               for m in stage.module.modules())


class ReplicaAgreement:
    """The executor's methods that share a step's refusals and failures with the
    replicas of its stages (see the module); mixed into :class:`~shardkit.nn.pipe.PlanSchedule`."""

    def _reduce_over_replicas(self, failed: bool) -> bool:
        """Each stage's end-of-step gradient reduction over its ``data_parallel_group``, which
        also carries whether the step failed in some pipeline; where it did, the replicas
        share what went wrong (one small all-gather, only then) and this pipeline's step fails
        too, naming the replica that failed. Returns whether the step failed."""
        for s, stage in self.stages.items():
            if not stage.reduces_gradients_now():
                continue
            ours = failed
            if not stage.reduce_gradients(failed):
                continue
            problem = (self._faults[0] if self._faults else
                       "its pipeline's step failed (another rank of it found why)") if ours \
                else None
            others = stage.replica_failures(problem)
            if not ours:
                self._fail(f"stage {s}: the step failed in another pipeline, so no replica "
                           f"keeps it: " + "; ".join(others))
            failed = True
        return failed

    def _refuse_to_replicas(self, refusal: str, grad: bool) -> None:
        """This pipeline refuses the step before running it: the replicas of its stages in
        other pipelines run it and wait in the end-of-step reduction, so join that reduction
        saying the step failed (``.grad`` is left alone here) and share why, as
        :meth:`_reduce_over_replicas` does there. Only for a step that records for backward
        (a forward-only step reduces nothing)."""
        if not grad:
            return
        problem = f"its pipeline refused the step before running it: {refusal}"
        for stage in self.stages.values():
            if stage.reduces_gradients_now():
                stage.refuse_step_to_replicas()
                stage.replica_failures(problem)

    def _replica_refusals(self, local: list, grad: bool) -> list[str]:
        """Before the first step (and the next after a failed one): where a stage's module
        reduces inside forward and backward over replicas in other pipelines
        (ShardedDataParallel, FSDP), whether a replica's rank refuses the step (``local``:
        this rank's problems), as problems naming it, and whether the replicas disagree on
        training against eval; one all-reduce of three elements per such group, and one
        small all-gather only where some replica refused. A pipeline that ran
        the step would otherwise wait in those modules' collectives for the one that refused
        it. No communication for other stages (their refusal rides on the step's gradient
        all-reduce: :meth:`_refuse_to_replicas`). A step that records no backward (``grad``
        false: :meth:`eval`) shares them over FSDP groups only, whose forward gathers
        parameters over the replicas: ShardedDataParallel communicates in backward only, so an
        eval step that one pipeline runs alone joins no all-reduce there."""
        problems = []
        groups = self._reducing_replica_groups(grad)
        for group, refused, disagree in _replica_verdicts(groups, bool(local), grad):
            if disagree:
                problems.append(_step_kind_disagreement(grad))
            if not refused:
                continue
            found = dist.all_gather_object(local, group=group)
            problems += [f"data-parallel replica at global rank {rank} (of the group of a "
                         f"ShardedDataParallel / FSDP stage module) refuses the step: {p}"
                         for rank, ps in zip(dist.group_ranks(group), found)
                         if rank != dist.get_rank() for p in ps]
        return problems

    def _check_with_sharded_replicas(self, inputs, target, grad: bool) -> None:
        """Before a step after the first, where this rank's stage modules communicate over
        replicas in other pipelines inside forward or backward (ShardedDataParallel in a
        training step, FSDP in any): whether any rank of any such pipeline refuses the step
        (its batch, keyword arguments or target, as the first step checks them), or a replica
        runs the other kind of step (eval against training). One all-reduce of three
        elements per replica group, then one of two over the pipeline group, reach every
        rank of every pipeline; a refusal then takes
        :meth:`~shardkit.nn.pipe.PlanSchedule._check_agreement`'s path (the same error on every
        rank, naming the replica), a disagreement on the kind of step is a ValueError on every rank.
        Without this a pipeline that ran the step waits forever in those modules' collectives for
        the one that refused it. Every rank of a pipeline with such a stage module joins the
        pipeline group's all-reduce, its ranks running other stages too (learnt at the first step:
        ``_pipeline_shards``)."""
        if not self._pipeline_shards.get(grad):
            return
        groups = self._reducing_replica_groups(grad)
        verdicts = _replica_verdicts(groups, bool(self._local_problems(inputs, target)), grad)
        verdict = torch.tensor([float(any(refused for _, refused, _ in verdicts)),
                                float(any(disagree for _, _, disagree in verdicts))],
                               device=next(iter(self.stages.values())).device)
        if self.num_ranks > 1:
            dist.all_reduce(verdict, group=self.group)
        if verdict[1] > 0:
            raise ValueError(f"{type(self).__name__}.step: the pipelines cannot run this step: "
                             f"{_step_kind_disagreement(grad)}")
        if verdict[0] > 0:
            self._check_agreement(inputs, target, grad, replicas_too=True)

    def _reducing_replica_groups(self, grad: bool = True) -> list:
        """``(group, device)`` of each process group over more than one rank that this rank's
        ShardedDataParallel / FSDP stage modules communicate over (FSDP's only where ``grad``
        is false), once each, in stage and module order (alike on every replica)."""
        from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

        groups = {}
        for s, stage in self.stages.items():
            if not self._reducing[s]:
                continue
            for m in stage.module.modules():
                if isinstance(m, FullyShardedDataParallel) or \
                        grad and isinstance(m, ShardedDataParallel):
                    for group in (m.process_group, getattr(m, "replicate_group", None)):
                        if group is not None and dist.get_world_size(group) > 1:
                            groups.setdefault(id(group), (group, stage.device))
        return list(groups.values())
