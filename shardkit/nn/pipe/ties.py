"""Weights tied between pipeline stages that different ranks run (a GPT's token embedding and
output head, split into the first and the last stage): each of the two ranks holds a copy, and
the copies stay one weight as in Megatron-LM: the later stage's copy takes the earlier one's
values before the first step, and after every training step each rank adds the other's share
of the gradient to its own, so both optimizers apply the same update. The later copy is marked
``shared = True`` (Megatron's mark), so :func:`shardkit.nn.model_parallel.clip_grad_norm`
counts it once.

A tie frozen when the stages are built is kept too: its values are synced before the first
step like a trainable tie's, and its gradients are added up again from the first training step
after both ranks unfroze it.

Cost, for each tied weight of ``S`` bytes on this rank, frozen or not: before the first step,
one send of ``S`` bytes from the earlier copy's rank to the later one's; per training step, a
one-element message each way (whether each copy is trainable), then, where both are, one send
of ``S`` bytes to the other copy's rank (this step's gradient, not what earlier steps
accumulated into ``.grad``) and one receive; memory: a copy of the ``.grad`` the step started
with, when there was one (gradient accumulation across steps), and the received gradient while
it is added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardkit import distributed as dist
from shardkit.nn.pipe.p2p import MAX_TENSORS

__all__ = ["Tie", "TiedWeights", "cross_rank_copies", "frozen_copy_problems"]


@dataclass(frozen=True)
class Tie:
    """A trainable parameter this stage shares with a stage another rank runs."""

    param: torch.nn.Parameter
    stage: int          # this stage
    name: str           # its name in this stage
    other_stage: int
    other_name: str
    peer: int           # the global rank running ``other_stage``

    @property
    def key(self) -> tuple:
        """The same on both ranks: (earlier stage, its name, later stage, its name)."""
        mine, theirs = (self.stage, self.name), (self.other_stage, self.other_name)
        return (*min(mine, theirs), *max(mine, theirs))

    @property
    def is_earlier(self) -> bool:
        """Whether this stage comes before the other one in the pipeline."""
        return self.stage < self.other_stage


class TiedWeights:
    """The cross-rank ties of one rank's stages, and the messages that keep them one weight.

    ``tag(stage, index)`` gives the point-to-point tag of the ``index``-th tie between
    ``stage`` and a later stage (:meth:`~shardkit.nn.pipe.p2p.TaggedLinks.tie_tag`: a message
    kind of their own, so they never meet an activation or a gradient)."""

    def __init__(self, ties: list, group, tag):
        self.ties = sorted(ties, key=lambda t: t.key)
        self.group, self._tag = group, tag
        self._index = {}
        for tie in self.ties:
            pair = (tie.key[0], tie.key[2])
            self._index[tie.key] = sum(1 for k in self._index if (k[0], k[2]) == pair)
            if self._index[tie.key] >= MAX_TENSORS:
                raise ValueError(f"stages {pair[0]} and {pair[1]} share more than "
                                 f"{MAX_TENSORS} weights across ranks; tie fewer")
        self._synced = False
        self._trains: list = []  # per tie, from exchange_flags
        self._before: list = []

    def __bool__(self) -> bool:
        return bool(self.ties)

    def _tag_of(self, tie: Tie) -> int:
        return self._tag(min(tie.stage, tie.other_stage), self._index[tie.key])

    def _exchange(self, outgoing: list, incoming: list, what: str) -> None:
        """Send ``outgoing[k]`` to tie ``k``'s peer and receive ``incoming[k]`` from it
        (``None``: nothing that way); sends are posted first, so no pair waits on the other."""
        works = []
        with dist.reporting_broken_links(f"pipeline exchange of tied weights' {what}",
                                         self.group):
            for tie, tensor in zip(self.ties, outgoing):
                if tensor is not None:
                    works.append(dist.isend(tensor, tie.peer, group=self.group,
                                            tag=self._tag_of(tie)))
            for tie, tensor in zip(self.ties, incoming):
                if tensor is not None:
                    works.append(dist.irecv(tensor, tie.peer, group=self.group,
                                            tag=self._tag_of(tie)))
            for work in works:
                work.wait()

    def sync_weights(self) -> None:
        """Once, before the first step: the later stage's copy of each tie, frozen or not,
        takes the earlier one's values (ranks that initialised the model differently then
        still compute with one weight, and train one once it is trainable, as DeepSpeed's
        broadcast of every tied weight at construction gives)."""
        if self._synced:
            return
        outgoing = [t.param.detach().contiguous() if t.is_earlier else None for t in self.ties]
        incoming = [None if t.is_earlier else torch.empty_like(t.param) for t in self.ties]
        self._exchange(outgoing, incoming, "values")
        with torch.no_grad():
            for tie, values in zip(self.ties, incoming):
                if values is not None:
                    tie.param.copy_(values)
        self._synced = True

    def remember_gradients(self) -> None:
        """At the start of a training step: what ``.grad`` already holds (from earlier steps
        of an accumulation), so that only this step's share crosses to the other copy."""
        self._before = [None if t.param.grad is None else t.param.grad.clone()
                        for t in self.ties]

    def exchange_flags(self) -> list[str]:
        """After a training step's backward, before its verdict: whether each tie's two copies
        require grad now (a one-element message each way per tie), so that a weight frozen when
        the stages were built and unfrozen later (on both ranks) is added up again, and a
        frozen one sends nothing. Returns a problem for each tie frozen on one rank only since
        the first step's checks (it would train as two weights)."""
        mine = [torch.tensor([float(t.param.requires_grad)], device=t.param.device)
                for t in self.ties]
        theirs = [torch.empty_like(flag) for flag in mine]
        self._exchange(mine, theirs, "trainable flags")
        theirs = [bool(flag.item()) for flag in theirs]
        self._trains = [t.param.requires_grad and other for t, other in zip(self.ties, theirs)]
        return [f"the tied weight (stage {t.key[0]}'s {t.key[1]!r} = stage {t.key[2]}'s "
                f"{t.key[3]!r}) is {'trainable' if t.param.requires_grad else 'frozen'} here and "
                f"{'trainable' if other else 'frozen (requires_grad=False)'} on global rank "
                f"{t.peer}; freeze both copies or neither"
                for t, other in zip(self.ties, theirs) if t.param.requires_grad != other]

    def add_gradients(self) -> None:
        """After a training step's backward: each copy gets the other's share of this step's
        gradient (where :meth:`exchange_flags` found both trainable), so both hold the tied
        weight's whole gradient. A tie frozen on both ranks (when the stages were built or
        later) keeps ``.grad`` None, so an optimizer's weight decay or momentum leaves it
        alone, as in one process."""
        mine = []
        for tie, before, trains in zip(self.ties, self._before, self._trains):
            grad = tie.param.grad
            share = torch.zeros_like(tie.param) if grad is None else grad.detach().clone()
            mine.append(None if not trains else share if before is None else share.sub_(before))
        theirs = [None if share is None else torch.empty_like(share) for share in mine]
        self._exchange(mine, theirs, "gradients")
        for tie, share in zip(self.ties, theirs):
            if share is None:
                continue  # frozen (on both ranks): .grad stays None, as in one process
            if tie.param.grad is None:
                tie.param.grad = share
            else:
                tie.param.grad.add_(share)
        self._before = []


def cross_rank_copies(shared: dict, stage_index: int, placement_rank, my_rank: int) -> list:
    """Every parameter of this stage that is the same tensor as one of a stage another rank
    runs, frozen or not, as ``(key, parameter)`` (``key`` as :attr:`Tie.key`, the same on
    both ranks), so the ranks can check before a step that both copies agree on
    ``requires_grad``."""
    copies = []
    for name, (param, others) in shared.items():
        for other, other_name in others:
            if placement_rank(other) != my_rank:
                mine, theirs = (stage_index, name), (other, other_name)
                copies.append(((*min(mine, theirs), *max(mine, theirs)), param))
    return copies


def frozen_copy_problems(views: list) -> list[str]:
    """From each rank's ``{key: requires_grad}`` of its cross-rank copies: the ties whose two
    copies disagree (one frozen, one trainable), which would train two weights, or leave the
    trainable copy waiting for a gradient the frozen one never sends."""
    seen, problems = {}, []
    for rank, status in enumerate(views):
        for key, trainable in status.items():
            if key in seen and seen[key][1] != trainable:
                first, first_trainable = seen[key]
                frozen, free = (first, rank) if not first_trainable else (rank, first)
                problems.append(
                    f"the tied weight (stage {key[0]}'s {key[1]!r} = stage {key[2]}'s "
                    f"{key[3]!r}) is frozen (requires_grad=False) on group rank {frozen} and "
                    f"trainable on group rank {free}; freeze both copies or neither")
            seen.setdefault(key, (rank, trainable))
    return problems


def cross_rank_ties(shared: dict, stage_index: int, placement_rank, my_rank: int,
                    global_rank) -> tuple[list, list]:
    """From :func:`~shardkit.nn.pipe.partition.shared_parameters`' ``{name: (param, [(stage,
    name there), ...])}``: the ties with stages another rank runs, frozen ones too (they may be
    unfrozen later), and what cannot be supported (a trainable weight shared with stages on two
    or more other ranks). ``placement_rank`` maps a stage to its group rank, ``global_rank`` a
    group rank to its global rank."""
    ties, problems = [], []
    for name, (param, others) in shared.items():
        remote = [(s, n) for s, n in others if placement_rank(s) != my_rank]
        if len({placement_rank(s) for s, _ in remote}) > 1:
            if not param.requires_grad:
                continue  # frozen: no copy trains, nothing crosses
            problems.append(f"stage {stage_index}'s parameter {name!r} is tied with stages "
                            f"{sorted(s for s, _ in remote)}, run by several other ranks; a "
                            f"tie may span two ranks only")
            continue
        if remote:
            other, other_name = min(remote)
            ties.append(Tie(param, stage_index, name, other, other_name,
                            global_rank(placement_rank(other))))
            if other < stage_index:  # the later copy: a global norm counts the earlier only
                param.shared = True  # Megatron's mark
    return ties, problems
