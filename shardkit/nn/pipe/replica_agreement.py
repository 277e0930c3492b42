"""A pipeline's agreement on each step with the data-parallel replicas of its stages in
other pipelines (:class:`ReplicaAgreement`, mixed into :class:`~shardkit.nn.pipe.PlanSchedule`).

The end-of-step gradient reduction over each stage's ``data_parallel_group`` carries whether the
step failed, and a pipeline that refuses a step before running it joins that reduction saying
so. Where stage modules communicate over the replicas inside forward or backward
(ShardedDataParallel, FSDP), the refusals and the kind of step (training or eval) are shared
before the step, so no pipeline waits in those modules' collectives for one that refused.
During such a step, before each of its actions (F, B, BW, W) a stage of that kind shares with
its replicas whether its pipeline's step has failed so far (a forward or ``loss_fn`` that
raised, a verdict heard) and whether its module is in ``train()`` or ``eval()`` mode
(:meth:`ReplicaAgreement._replicas_go_on`), so that where one pipeline stops the step, every
replica stops its collectives at the same action instead of waiting for the stopped one.
Communication: one all-reduce of three elements per replica group before such a step, and one
of two over the pipeline group; one all-reduce of two elements per replica group before each
action of such a stage; one small object all-gather only where a replica refused or failed.
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
        groups = {}
        for s in self.stages:
            for group, device in self._stage_replica_groups(s, grad):
                groups.setdefault(id(group), (group, device))
        return list(groups.values())

    def _stage_replica_groups(self, s: int, grad: bool) -> list:
        """:meth:`_reducing_replica_groups` of stage ``s`` alone. Local."""
        from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel

        if not self._reducing[s]:
            return []
        stage, groups = self.stages[s], {}
        for m in stage.module.modules():
            if isinstance(m, FullyShardedDataParallel) or \
                    grad and isinstance(m, ShardedDataParallel):
                for group in (m.process_group, getattr(m, "replicate_group", None)):
                    if group is not None and dist.get_world_size(group) > 1:
                        groups.setdefault(id(group), (group, stage.device))
        return list(groups.values())

    def _replicas_go_on(self, s: int, i: int) -> bool:
        """Before each action (F, B, BW, W) of stage ``s`` on micro-batch ``i`` in a step:
        whether the stage runs its module (or its backward) there. ``True`` at no cost for a
        stage whose module does not communicate over replicas in other pipelines inside forward
        or backward (those learn of a failure at the step's end: the gradient all-reduce over
        ``data_parallel_group`` carries it). A ShardedDataParallel (in a training step) or
        FSDP stage module with replicas shares with them whether its pipeline's step has
        failed so far and whether the module is in ``train()`` mode (one all-reduce of two
        elements per replica group, in module order, each carrying what the ones before it
        learnt); where some replica's step failed, or the replicas are in different modes
        (under ShardedDataParallel only training forwards communicate, so the two sides would
        wait for each other), every replica stops the stage's work for the rest of the step
        at this same action (no module collective is left unpaired), fails its pipeline's step
        naming the replicas and why (one small object all-gather per group, only then), and
        returns ``False`` here and, without communicating, at the stage's later actions.

        Note: this pairs the collectives of actions that run whole or not at all. A forward
        that raises between two of its own collectives (an FSDP stage holding nested units,
        failing after the first gathered) leaves its replicas in the second one: that still
        waits until the process group's timeout, as a peer that died would."""
        if self._agreeing is None:  # once a step: the groups of each stage in this grad mode
            grad = torch.is_grad_enabled()
            self._agreeing = {t: self._stage_replica_groups(t, grad) for t in self.stages}
        groups = self._agreeing[s]
        if not groups:
            return True
        if s in self._replicas_stopped:
            return False
        failed, training = self.links.failed, self.stages[s].module.training
        stop, differ = failed, False
        for group, device in groups:
            flags = torch.tensor([float(stop), float(training)], device=device)
            dist.all_reduce(flags, group=group)
            failures, trainers = flags.tolist()
            differ = differ or 0 < trainers < dist.get_world_size(group)
            stop = stop or failures > 0 or differ
        if not stop:
            return True
        self._replicas_stopped.add(s)
        self._fail_at(s, i, self._replica_stop_problem(groups, failed, training))
        return False

    def _reshard_stopped_stages(self) -> None:
        """At the end of a step whose replicas stopped a stage (:meth:`_replicas_go_on`): free
        the parameters its FSDP units still hold gathered (``reshard()``, local), so that every
        replica starts the next step with none kept. A forward that no backward followed keeps
        its unit gathered on one replica while the replica whose forward raised holds none, and
        FSDP's next forward decides locally whether to ask its replicas if a kept unit went
        stale: unpaired, that question waited forever."""
        from shardkit.nn.data_parallel import FullyShardedDataParallel

        for s in sorted(self._replicas_stopped):
            for m in self.stages[s].module.modules():
                if isinstance(m, FullyShardedDataParallel):
                    m.reshard()

    def _replica_stop_problem(self, groups: list, failed: bool, training: bool) -> str:
        """Why the replicas of a stage stopped the step (see :meth:`_replicas_go_on`):
        each replica's problem and mode, one small object all-gather per group."""
        mine = None
        if failed:
            mine = self._faults[0] if self._faults else \
                "its pipeline's step failed (another rank of it found why)"
        views = {}
        for group, _ in groups:
            found = dist.all_gather_object((mine, training), group=group)
            views.update(zip(dist.group_ranks(group), found))
        me = dist.get_rank()
        modes = {mode: [r for r, (_, t) in sorted(views.items()) if t == mode]
                 for mode in (True, False)}
        problems = []
        if modes[True] and modes[False]:
            problems.append(
                f"its module is in train() mode on global rank(s) {modes[True]} and in eval() "
                f"mode on global rank(s) {modes[False]}, data-parallel replicas of its "
                f"ShardedDataParallel / FSDP stage module (whose collectives span the "
                f"pipelines; ShardedDataParallel's training forward communicates, its eval "
                f"forward does not); call .train() or .eval() alike on this stage in every "
                f"pipeline")
        others = [f"global rank {r}: {p}" for r, (p, _) in sorted(views.items())
                  if p and r != me]
        if others:
            problems.append("the step failed in a data-parallel replica's pipeline, so every "
                            "replica of this ShardedDataParallel / FSDP stage stopped its "
                            "work here (" + "; ".join(others) + ")")
        if not problems:  # this rank's own pipeline failed, learnt from a message
            problems.append("its pipeline's step failed (its other ranks say why), so every "
                            "replica of this ShardedDataParallel / FSDP stage stopped its "
                            "work here")
        return "; ".join(problems)
