"""A pipeline schedule as data: per rank, an ordered list of actions, printable and checkable.

An :class:`Action` is ``F`` (forward of one micro-batch through one stage), ``BW`` (its whole
backward), ``B`` (the input-gradient half of the backward) or ``W`` (the parameter-gradient
half). Communication is implied by the stages' placement: ``F`` of stage ``s`` receives from
stage ``s-1`` and sends to ``s+1``, ``B``/``BW`` receive from ``s+1`` and send to ``s-1``, when
those stages live on another rank (``recv``/``send`` in :meth:`PipelinePlan.format`); sends
never block, receives wait. :meth:`PipelinePlan.dry_run` executes the lists on a clock without
running any model: it finds deadlocks (every unfinished rank waiting on a receive that no one will
send) and measures the bubble (idle fraction) and the micro-batches alive per stage.

The generators build the classic orders: :func:`gpipe_plan`, :func:`one_f_one_b_plan`,
:func:`interleaved_1f1b_plan` (Megatron's), and :func:`greedy_zero_bubble_plan`, a list
scheduler that splits backward into B and W, runs B before F before W whenever they are ready, and
lets W wait only while a cap on live micro-batches allows (with two stages per rank placed in a V
and a cap of ``2p`` half-stage micro-batches it is ZBV, :func:`zbv_plan`), and :func:`zb_h1_plan`
(1F1B with each W delayed so it fills the cool-down).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Action", "PipelinePlan", "DryRun", "PipelineDeadlock", "loop_placement",
           "v_placement", "gpipe_plan", "one_f_one_b_plan", "interleaved_1f1b_plan",
           "greedy_zero_bubble_plan", "zb_h1_plan", "zbv_plan", "DEFAULT_COSTS"]

KINDS = ("F", "B", "W", "BW")
DEFAULT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` (F, B, W or BW) of ``microbatch`` through ``stage``."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


class PipelineDeadlock(RuntimeError):
    """A plan in which some ranks wait forever."""


@dataclass
class DryRun:
    """What :meth:`PipelinePlan.dry_run` measured, in units of the costs given.

    ``makespan``: time from the first action to the last; ``busy``: work per rank;
    ``idle_fraction``: ``1 - sum(busy) / (ranks * makespan)``, the bubble;
    ``peak_live``: per rank, the most micro-batch-stages whose activations were alive at once
    (from F until their BW or W); ``timeline``: per rank, ``(start, end, action)``.
    """

    makespan: float
    busy: list
    idle_fraction: float
    peak_live: list
    timeline: list = field(repr=False)


def loop_placement(num_stages: int, num_ranks: int) -> tuple:
    """Stage ``s`` on rank ``s % num_ranks`` (one stage per rank, or interleaved chunks)."""
    return tuple(s % num_ranks for s in range(num_stages))


def v_placement(num_ranks: int) -> tuple:
    """``2 * num_ranks`` stages in a V: stage ``s`` on rank ``s`` going down, then back up, so
    rank 0 holds the first and the last stage."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


@dataclass(frozen=True)
class PipelinePlan:
    """Per-rank action lists of one pipeline step, with the stage placement they assume."""

    name: str
    placement: tuple  # stage -> rank
    chunks: int
    orders: tuple     # rank -> tuple of Action

    @property
    def num_stages(self) -> int:
        """Number of stages (the length of ``placement``)."""
        return len(self.placement)

    @property
    def num_ranks(self) -> int:
        """Number of ranks (one action list each)."""
        return len(self.orders)

    def stages_of(self, rank: int) -> list:
        """The stages placed on ``rank``, in ascending order."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def split_backward(self) -> bool:
        """Whether the plan runs backward as separate B and W actions."""
        return any(a.kind == "W" for order in self.orders for a in order)

    # ------------------------------------------------------------------ printing
    def lowered(self, rank: int) -> list[str]:
        """Rank ``rank``'s actions with the receives and sends they imply, as strings."""
        out, last = [], self.num_stages - 1
        for a in self.orders[rank]:
            s, i = a.stage, a.microbatch
            if a.kind == "F" and s > 0 and self.placement[s - 1] != rank:
                out.append(f"recv_F{s}.{i}<r{self.placement[s - 1]}")
            if a.kind in ("B", "BW") and s < last and self.placement[s + 1] != rank:
                out.append(f"recv_B{s}.{i}<r{self.placement[s + 1]}")
            out.append(str(a))
            if a.kind == "F" and s < last and self.placement[s + 1] != rank:
                out.append(f"send_F{s}.{i}>r{self.placement[s + 1]}")
            if a.kind in ("B", "BW") and s > 0 and self.placement[s - 1] != rank:
                out.append(f"send_B{s}.{i}>r{self.placement[s - 1]}")
        return out

    def format(self, communication: bool = False) -> str:
        """One line per rank (``F<stage>.<micro-batch>`` etc.), optionally with send/recv."""
        lines = [f"{self.name}: {self.num_stages} stages on {self.num_ranks} ranks, "
                 f"{self.chunks} micro-batches"]
        for rank, order in enumerate(self.orders):
            items = self.lowered(rank) if communication else [str(a) for a in order]
            lines.append(f"rank {rank}: " + " ".join(items))
        return "\n".join(lines)

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        """What makes the lists incomplete or out of order (empty when well formed)."""
        found, seen = [], {}
        for rank, order in enumerate(self.orders):
            for pos, a in enumerate(order):
                if a.kind not in KINDS or not 0 <= a.stage < self.num_stages \
                        or not 0 <= a.microbatch < self.chunks:
                    found.append(f"rank {rank}: {a} is not a valid action")
                    continue
                if self.placement[a.stage] != rank:
                    found.append(f"rank {rank}: {a} runs stage {a.stage}, which lives on rank "
                                 f"{self.placement[a.stage]}")
                if a in seen:
                    found.append(f"rank {rank}: {a} appears twice")
                seen[a] = pos
        split = self.split_backward()
        wanted = ("F", "B", "W") if split else ("F", "BW")
        for s in range(self.num_stages):
            for i in range(self.chunks):
                positions = [seen.get(Action(k, s, i)) for k in wanted]
                missing = [k for k, p in zip(wanted, positions) if p is None]
                if missing:
                    found.append(f"stage {s}, micro-batch {i}: no {'/'.join(missing)} action")
                elif positions != sorted(positions):
                    found.append(f"stage {s}, micro-batch {i}: {' before '.join(wanted)} "
                                 f"is not respected")
        return found

    def dry_run(self, costs: Optional[dict] = None) -> DryRun:
        """Run the lists on a clock (``costs``: time per action kind, default
        F=B=W=1, BW=2; communication is free). Raises :class:`PipelineDeadlock` naming what each
        stuck rank waits for, ``ValueError`` for a malformed plan."""
        problems = self.problems()
        if problems:
            raise ValueError(f"{self.name}: malformed plan:\n  " + "\n  ".join(problems))
        costs = {**DEFAULT_COSTS, **(costs or {})}
        last = self.num_stages - 1
        done: dict = {}  # Action -> finish time
        pos = [0] * self.num_ranks
        clock = [0.0] * self.num_ranks
        busy = [0.0] * self.num_ranks
        live = [0] * self.num_ranks
        peak = [0] * self.num_ranks
        timeline = [[] for _ in range(self.num_ranks)]
        split = self.split_backward()

        def needs(a: Action) -> list:
            if a.kind == "F":
                return [Action("F", a.stage - 1, a.microbatch)] if a.stage > 0 else []
            if a.kind == "W":
                return [Action("B", a.stage, a.microbatch)]
            deps = [Action("F", a.stage, a.microbatch)]
            if a.stage < last:
                deps.append(Action("B" if split else "BW", a.stage + 1, a.microbatch))
            return deps

        progressed = True
        while progressed:
            progressed = False
            for rank, order in enumerate(self.orders):
                while pos[rank] < len(order):
                    a = order[pos[rank]]
                    deps = needs(a)
                    if any(d not in done for d in deps):
                        break
                    start = max([clock[rank]] + [done[d] for d in deps])
                    end = start + costs[a.kind]
                    done[a] = end
                    clock[rank] = end
                    busy[rank] += costs[a.kind]
                    timeline[rank].append((start, end, a))
                    if a.kind == "F":
                        live[rank] += 1
                        peak[rank] = max(peak[rank], live[rank])
                    elif a.kind in ("W", "BW"):
                        live[rank] -= 1
                    pos[rank] += 1
                    progressed = True
        stuck = [r for r in range(self.num_ranks) if pos[r] < len(self.orders[r])]
        if stuck:
            lines = []
            for r in stuck:
                a = self.orders[r][pos[r]]
                waits = [f"{d} on rank {self.placement[d.stage]}" for d in needs(a)
                         if d not in done]
                lines.append(f"rank {r} stops at {a}, waiting for {', '.join(waits)}")
            raise PipelineDeadlock(f"{self.name}: deadlock:\n  " + "\n  ".join(lines))
        start = min(t[0][0] for t in timeline if t)
        makespan = max(clock) - start
        idle = 1.0 - sum(busy) / (self.num_ranks * makespan)
        return DryRun(makespan, busy, idle, peak, timeline)


# ---------------------------------------------------------------------- generators
def _check_sizes(name: str, num_ranks: int, chunks: int) -> None:
    for arg, value in (("num_ranks", num_ranks), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}({arg}={value!r}): expected a positive int")


def gpipe_plan(num_ranks: int, chunks: int) -> PipelinePlan:
    """All forwards, then all backwards; one stage per rank. Bubble ``(p-1)/(m+p-1)``; every
    micro-batch alive at the end of the forwards."""
    _check_sizes("gpipe_plan", num_ranks, chunks)
    orders = tuple(tuple([Action("F", r, i) for i in range(chunks)]
                         + [Action("BW", r, i) for i in range(chunks)]) for r in range(num_ranks))
    return PipelinePlan("GPipe", loop_placement(num_ranks, num_ranks), chunks, orders)


def one_f_one_b_plan(num_ranks: int, chunks: int) -> PipelinePlan:
    """1F1B: ``p - r - 1`` warm-up forwards on rank ``r``, then one forward and one backward
    alternately. Bubble ``(p-1)/(m+p-1)``; at most ``p - r`` micro-batches alive on rank ``r``."""
    _check_sizes("one_f_one_b_plan", num_ranks, chunks)
    orders = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, chunks)
        order = [Action("F", r, i) for i in range(warmup)]
        for k in range(chunks - warmup):
            order += [Action("F", r, warmup + k), Action("BW", r, k)]
        order += [Action("BW", r, k) for k in range(chunks - warmup, chunks)]
        orders.append(tuple(order))
    return PipelinePlan("1F1B", loop_placement(num_ranks, num_ranks), chunks, tuple(orders))


def interleaved_1f1b_plan(num_ranks: int, chunks: int, stages_per_rank: int) -> PipelinePlan:
    """Megatron's interleaved 1F1B: ``v = stages_per_rank`` stages per rank (stage ``c*p + r`` on
    rank ``r``); micro-batches go through in rounds of ``g`` (``g = p`` when ``chunks`` is a
    multiple of ``p``; otherwise ``m / max(1, m // p)``, which must be whole, as in torch's
    flexible schedule: ``m < p`` runs one round of ``m``, ``m = 10`` on 4 ranks two rounds of 5).
    Bubble ``(p-1)/(v*m)`` of the work, i.e. ``(p-1)/(v*m+p-1)`` of the step, when ``g = p``;
    at most ``(v-1)*g + 2*(p-1-r) + 1`` stage-micro-batches alive on rank ``r``."""
    _check_sizes("interleaved_1f1b_plan", num_ranks, chunks)
    p, v, m = num_ranks, stages_per_rank, chunks
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"interleaved_1f1b_plan(stages_per_rank={v!r}): expected a positive int")
    g = interleaved_round_size(p, m)
    total = m * v

    def unit(k: int, forward: bool) -> tuple:
        chunk = (k % (g * v)) // g
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (g * v)) * g + k % g

    orders = []
    for r in range(p):
        warmup = min((v - 1) * g + 2 * (p - 1 - r), total)
        order = []
        for k in range(warmup):
            c, i = unit(k, True)
            order.append(Action("F", c * p + r, i))
        for k in range(total - warmup):
            c, i = unit(warmup + k, True)
            order.append(Action("F", c * p + r, i))
            c, i = unit(k, False)
            order.append(Action("BW", c * p + r, i))
        for k in range(total - warmup, total):
            c, i = unit(k, False)
            order.append(Action("BW", c * p + r, i))
        orders.append(tuple(order))
    return PipelinePlan(f"Interleaved1F1B(v={v})", loop_placement(p * v, p), m, tuple(orders))


def interleaved_round_size(num_ranks: int, chunks: int) -> int:
    """Micro-batches per round of interleaved 1F1B: ``chunks / max(1, chunks // num_ranks)``
    (``num_ranks`` when ``chunks`` is a multiple of it). ValueError, naming sizes that work,
    when that is not whole (e.g. 6 chunks on 4 ranks: one round would hold 6 and a second none)."""
    def whole_rounds(c: int) -> bool:
        return c % max(1, c // num_ranks) == 0

    rounds = max(1, chunks // num_ranks)
    if not whole_rounds(chunks):
        below = next(c for c in range(chunks - 1, 0, -1) if whole_rounds(c))
        above = next(c for c in range(chunks + 1, chunks + num_ranks + 1) if whole_rounds(c))
        raise ValueError(f"interleaved 1F1B runs micro-batches in rounds of about the number of "
                         f"ranks: chunks={chunks} on ranks={num_ranks} gives {rounds} rounds, "
                         f"which do not divide the chunks; use chunks={below} or {above} (any "
                         f"multiple of the ranks, or fewer chunks than ranks, works)")
    return chunks // rounds


def greedy_zero_bubble_plan(name: str, placement: tuple, chunks: int, live_cap: int,
                            costs: Optional[dict] = None) -> PipelinePlan:
    """List-schedule F/B/W on a clock: each rank, when free, runs a ready B (oldest micro-batch,
    latest stage first), else a ready F if it keeps at most ``live_cap`` stage-micro-batches alive
    on the rank (latest stage first; one slot kept per later stage of the rank), else the oldest
    pending W, else waits. The lists follow a feasible timeline, so they cannot deadlock; where
    the cap leaves no feasible timeline, :class:`PipelineDeadlock` is raised."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    num_ranks, last = max(placement) + 1, len(placement) - 1
    stages = [[s for s, r in enumerate(placement) if r == rank] for rank in range(num_ranks)]
    finish: dict = {}
    clock = [0.0] * num_ranks
    next_f = {s: 0 for s in range(len(placement))}
    pending_w = [[] for _ in range(num_ranks)]
    live = [0] * num_ranks
    orders = [[] for _ in range(num_ranks)]
    remaining = [len(stages[r]) * chunks * 3 for r in range(num_ranks)]

    def ready_at(a: Action) -> Optional[float]:
        if a.kind == "F":
            dep = Action("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
        else:
            if Action("F", a.stage, a.microbatch) not in finish:
                return None
            dep = Action("B", a.stage + 1, a.microbatch) if a.stage < last else None
        if dep is None:
            return 0.0
        return finish.get(dep)

    def choices(rank: int) -> list:
        out = []
        for s in sorted(stages[rank], reverse=True):  # B: latest stage first
            for i in range(chunks):
                a = Action("B", s, i)
                if a not in finish and Action("F", s, i) in finish:
                    out.append(("B", i, -s, a))
                    break
        for s in sorted(stages[rank], reverse=True):
            # keep one slot per later stage of this rank, so a micro-batch already on the rank
            # can always go on to the stage whose B frees it (else the cap can stall every rank)
            reserved = sum(1 for later in stages[rank] if later > s)
            if next_f[s] < chunks and live[rank] < live_cap - reserved:
                out.append(("F", next_f[s], -s, Action("F", s, next_f[s])))
        return out

    idle_turns = 0
    while any(remaining):
        if idle_turns > 4 * num_ranks * (sum(remaining) + 1):
            raise PipelineDeadlock(f"{name}: the list scheduler stalled (live_cap={live_cap} is "
                                   f"too small for these costs: {costs})")
        rank = min((r for r in range(num_ranks) if remaining[r]), key=lambda r: (clock[r], r))
        now, best, soonest = clock[rank], None, None
        for kind, i, neg_s, a in sorted(choices(rank), key=lambda c: ("BF".index(c[0]), c[1],
                                                                      c[2])):
            t = ready_at(a)
            if t is None:
                continue
            if t <= now:
                best = a
                break
            soonest = t if soonest is None else min(soonest, t)
        if best is None and pending_w[rank]:
            best = pending_w[rank].pop(0)
        if best is None:
            if soonest is None:  # waiting on another rank whose clock is behind
                others = [clock[r] for r in range(num_ranks) if r != rank and remaining[r]]
                soonest = min(t for t in others if t > now) if any(t > now for t in others) \
                    else now + min(costs.values())
            clock[rank] = soonest
            idle_turns += 1
            continue
        idle_turns = 0
        start = max(now, ready_at(best) or 0.0) if best.kind != "W" else now
        finish[best] = start + costs[best.kind]
        clock[rank] = finish[best]
        orders[rank].append(best)
        remaining[rank] -= 1
        if best.kind == "F":
            next_f[best.stage] += 1
            live[rank] += 1
        elif best.kind == "B":
            pending_w[rank].append(Action("W", best.stage, best.microbatch))
        else:
            live[rank] -= 1
    return PipelinePlan(name, tuple(placement), chunks, tuple(tuple(o) for o in orders))


def zb_h1_plan(num_ranks: int, chunks: int) -> PipelinePlan:
    """ZB-H1: 1F1B's warm-up and F/B alternation with backward split in B and W, rank ``r``
    running each W ``r`` micro-batches late (the W's fill what would be 1F1B's cool-down
    bubble). At most ``p`` micro-batches alive on every rank (1F1B's peak, on rank 0); bubble
    ``(p-1)(F+B-W)``, a third of 1F1B's ``(p-1)(F+B+W)`` when F=B=W."""
    _check_sizes("zb_h1_plan", num_ranks, chunks)
    orders = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, chunks)
        order = [Action("F", r, i) for i in range(warmup)]
        waiting: list = []
        for k in range(chunks):
            if warmup + k < chunks:
                order.append(Action("F", r, warmup + k))
            order.append(Action("B", r, k))
            waiting.append(Action("W", r, k))
            while len(waiting) > r:
                order.append(waiting.pop(0))
        orders.append(tuple(order + waiting))
    return PipelinePlan("ZB-H1", loop_placement(num_ranks, num_ranks), chunks, tuple(orders))


def zbv_plan(num_ranks: int, chunks: int, costs: Optional[dict] = None) -> PipelinePlan:
    """ZBV: two stages per rank in a V (rank 0 holds the first and the last), backward split in
    B and W, at most ``2p`` half-size stage-micro-batches alive per rank (1F1B's peak). ``costs``
    (time of F, B and W) shape the list scheduling: with W much cheaper than B, as when weight
    gradients are merged, the order for F = B = W leaves bubbles a measured one closes."""
    _check_sizes("zbv_plan", num_ranks, chunks)
    return greedy_zero_bubble_plan("ZBV", v_placement(num_ranks), chunks,
                                   live_cap=2 * num_ranks, costs=costs)
