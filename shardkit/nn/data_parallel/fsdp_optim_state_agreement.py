"""How the ranks agree on an optimizer-state load before anything is loaded: torch's param
group checks, each rank's state keys compared over the group and the replicas, and one
``ValueError`` on every rank naming the ranks that failed (or whose dicts differ). Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from shardkit import distributed as skdist
from shardkit.nn.data_parallel.fsdp_state_dict_type import StateDictType
from shardkit.nn.data_parallel.fsdp_state_names import _state_dict_keys


def _check_loadable_groups(optim: torch.optim.Optimizer, osd) -> None:
    """torch's ``load_state_dict`` checks of the param groups (their number, each one's
    size), made before the ranks agree, as a ValueError naming what differs. Local."""
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list) \
            or not isinstance(osd.get("state"), dict):
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups'")
    saved = [len(g.get("params", ())) if isinstance(g, dict) else None
             for g in osd["param_groups"]]
    mine = [len(g["params"]) for g in optim.param_groups]
    if saved != mine:
        raise ValueError(f"the dict's param groups hold {saved} parameters, this optimizer's "
                         f"{mine}; build the optimizer's param groups as when it was saved")


def _state_keys(model, optim: torch.optim.Optimizer, osd: dict) -> list:
    """``(name, state keys)`` in ``osd`` (``optim.load_state_dict``'s id-keyed dict) of each
    parameter sharded over the model's own group: alike on every rank for the dicts one run
    saved (units over other groups, e.g. experts, may differ). Local."""
    names = _state_dict_keys(model)
    groups = model._param_unit_attr("process_group")
    ordered = [p for g in optim.param_groups for p in g["params"]]

    def keys_of(i, entry):
        if entry is not None and not isinstance(entry, dict):
            raise ValueError(f"the state of parameter {i} is a {type(entry).__name__}, "
                             f"expected a dict of state keys")
        return sorted(map(str, entry or {}))
    return [(names.get(id(p), str(i)), keys_of(i, osd["state"].get(i)))
            for i, p in enumerate(ordered) if groups.get(id(p)) is model.process_group]


def _agree_on_optim_load(model, optim: torch.optim.Optimizer, keys: Optional[list],
                         cause: Optional[BaseException], kind,
                         sent_from_first: bool = False) -> None:
    """:meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.optim_state_dict_to_load`'s
    agreement: returns when no rank of the model's group and replicas failed (``cause``) and the
    ranks' dicts give the same parameters state (same keys); else the same ValueError on every rank,
    naming the ranks that failed and their problems (this rank's own error as its ``__cause__``;
    ranks with the same problem on one line; ``sent_from_first``: the dict was the first rank's,
    sent to every rank). Communication: a three-element all-reduce per group; on failure, an object
    all-gather."""
    groups = [model.process_group] + ([model.replicate_group]
                                      if model.replicate_group is not None else [])
    signature = zlib.crc32(repr(keys).encode()) if keys is not None else 0
    votes = torch.tensor([int(cause is not None), signature, -signature], dtype=torch.int64,
                         device=model._comm_device())
    for group in groups:
        skdist.all_reduce(votes, op=torch.distributed.ReduceOp.MAX, group=group)
    failed, high, low = votes.tolist()
    if not failed and high == -low:
        return
    problem = f"{type(cause).__name__}: {cause}" if cause is not None else None
    ordered = [p for g in optim.param_groups for p in g["params"]]
    held = {"state": {i: optim.state[p] for i, p in enumerate(ordered) if p in optim.state}}
    every = [(skdist.get_rank(), problem, keys, _state_keys(model, optim, held))]
    for group in groups:
        every = [entry for part in skdist.all_gather_object(
            every, group=group, counted=False, operation="optim_state_dict_to_load's agreement")
            for entry in part]
    every.sort(key=lambda e: e[0])
    failing: dict = {}  # a problem several ranks share (a rank0_only dict's) is told once
    for r, p, _, _ in every:
        if p is not None:
            failing.setdefault(p, []).append(r)
    lines = [f"on rank {ranks[0]}: {p}" if len(ranks) == 1 else f"on ranks {ranks}: {p}"
             for p, ranks in failing.items()]
    blamed = sum(map(len, failing.values()))
    if lines and sent_from_first:
        lines.append("(rank0_only: every rank cut its rows from the dict given on the first "
                     "rank, the others' were ignored)")
    if not lines:  # every rank's dict fits, but they give different parameters state
        hint = ("give every rank the same full dict" if kind is StateDictType.FULL_STATE_DICT
                else "each rank must load the dict it saved in one run")
        lines, blamed = _state_disagreement(every, hint)
    raise ValueError(f"FSDP.optim_state_dict_to_load ({getattr(kind, 'name', kind)}): the "
                     f"optimizer state dict "
                     f"{f'does not fit on {blamed} rank(s)' if blamed else 'differs between ranks'}"
                     f", nothing was loaded on any rank:\n\t" + "\n\t".join(lines)) from cause


def _state_disagreement(every: list, hint: str) -> tuple:
    """``(lines, number of ranks blamed)`` for ranks whose dicts fit but give a parameter
    different state keys (``every``: ``(rank, None, [(name, keys)], [(name, the optimizer's
    own keys)])`` of every rank, in rank order), at the first parameter they differ on. The
    keys most ranks give are taken as right; without a majority (two ranks), those the
    optimizer already holds for the parameter, else those of the ranks that give it some
    state; failing all, each side is named and no rank blamed. Local."""
    own = dict(every[0][3])
    sizes = {len(theirs) for _, _, theirs, _ in every}
    if len(sizes) > 1:
        return [f"the ranks' dicts give state for different numbers of parameters "
                f"({[len(theirs) for _, _, theirs, _ in every]} on ranks "
                f"{[r for r, _, _, _ in every]}); {hint}"], 0
    for position, (name, _) in enumerate(every[0][2]):
        sides: dict = {}
        for r, _, theirs, _ in every:
            sides.setdefault(tuple(theirs[position][1]), []).append(r)
        if len(sides) == 1:
            continue
        counts = sorted((len(ranks) for ranks in sides.values()), reverse=True)
        right = None
        if counts[0] > counts[1]:
            right = max(sides, key=lambda k: len(sides[k]))
        elif own.get(name) and tuple(own[name]) in sides:
            right = tuple(own[name])
        elif len(sides) == 2 and () in sides:
            right = next(k for k in sides if k)
        if right is None:
            told = "; ".join(f"{list(k)} on rank(s) {ranks}" for k, ranks in sides.items())
            return [f"parameter {name} has state {told} (the ranks were given different "
                    f"dicts); {hint}"], 0
        wrong = [(ranks, k) for k, ranks in sides.items() if k != right]
        return [f"on rank {r}: parameter {name} has state {list(k)}, on rank(s) "
                f"{sides[right]} {list(right)}; {hint}" for ranks, k in wrong for r in ranks], \
            sum(len(ranks) for ranks, _ in wrong)
    return [f"the ranks' dicts differ; {hint}"], 0


def _agree_over_group_and_replicas(model, call: str, problem) -> None:
    """``problem`` (what this rank found wrong with its arguments, or ``None``) raised here,
    and a ValueError naming the ranks that had one on every other rank of the model's group
    and of its replicas, before anything is sent. Agreed over the replicas, then over the
    group, a rank told of a problem in the first carrying it into the second, so that every
    rank of the grid raises. One all-gather of one integer a rank over each (control
    messages, not counted)."""
    groups = ([model.replicate_group] if model.replicate_group is not None else []) + \
        [model.process_group]
    for group in groups:
        try:
            skdist._agree_on_call(f"FSDP.{call}", problem, [], group, model._comm_device(),
                                  outcome="nothing was sent")
        except (TypeError, ValueError) as error:
            problem = error
    if problem is not None:
        raise problem
