"""Argument checks of FSDP's optimizer-state functions, made before any collective: the
optimizer is one over the model's parameters (and can be keyed by their names), not LBFGS,
holds no rank-local state where a full dict is asked for, a local dict has this rank's shard
shapes, torch-only arguments are left unset, and a dict kept on one rank does not stand for
experts' state. Split out of :mod:`shardkit.nn.data_parallel.fsdp_state_dict`.
"""

from __future__ import annotations

import copy

import torch

from shardkit import distributed as skdist
from shardkit.checkpoint.optimizer_state import ELEMENTWISE_STATE
from shardkit.nn.data_parallel.fsdp_optim_state_rank_local import _refuse_rank_local_state
from shardkit.nn.data_parallel.fsdp_state_names import _state_dict_keys


# top-level keys of a full optimizer state dict that are torch's or FSDP's own
_OWN_KEYS = ("state", "param_groups", "param_names", "uncollected_local_ids", "param_id_map")


def _torch_optimizer_in(optim):
    """``optim`` when it is a torch optimizer; else the one a training framework's wrapper
    holds as ``.optimizer``, followed down (fairseq's ``FairseqOptimizer`` and its fp16
    wrappers, Accelerate's ``AcceleratedOptimizer``), which FairScale's duck-typed
    ``gather_full_optim_state_dict`` took; else ``optim`` itself (refused by the checks),
    also for an LR scheduler, which holds its optimizer as ``.optimizer`` too but whose
    ``state_dict()`` is no optimizer's. Local."""
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    for _ in range(8):  # a bounded walk: a wrapper may point at itself
        if isinstance(optim, (torch.optim.Optimizer, *schedulers)):
            break
        inner = getattr(optim, "optimizer", None)
        if inner is None or inner is optim:
            break
        optim = inner
    return optim


def _extra_entries(osd: dict) -> dict:
    """The top-level entries of an optimizer state dict beyond torch's and FSDP's own (the
    ``loss_scale`` fairseq's fp16 optimizers add), copied: FairScale's full and sharded
    optimizer state dicts keep them. Local."""
    return {k: copy.deepcopy(v) for k, v in osd.items() if k not in _OWN_KEYS}


def _check_optimizer_of(model, optim, call: str) -> None:
    """A clear error, on every rank alike and before any collective, for something that is
    not a torch optimizer, or an optimizer none of whose parameters belong to ``model`` (built
    over another model: its state would be returned as if it were this model's). Parameters
    outside the model beside some of its own are allowed: their state is kept whole. Local."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{call}(optim={type(optim).__name__}): expected the torch.optim."
                        f"Optimizer built over this model's parameters (for a saved state "
                        f"dict, use get_shard_from_optim_state_dict)")
    ordered = [p for g in optim.param_groups for p in g["params"]]
    mine = {id(p) for p in model.parameters()}
    if ordered and not any(id(p) in mine for p in ordered):
        raise ValueError(f"{call}(optim={type(optim).__name__}): none of the optimizer's "
                         f"{len(ordered)} parameters belongs to this FullyShardedDataParallel "
                         f"model; pass the optimizer built over this model's "
                         f"parameters")


def _check_gatherable(model, optim, call: str) -> None:
    """:func:`_check_optimizer_of`, a TypeError for LBFGS, whose state cannot be unsharded,
    and :func:`_refuse_rank_local_state`. Local."""
    _check_optimizer_of(model, optim, call)
    if isinstance(optim, torch.optim.LBFGS):  # its state is over the flattened shard
        raise TypeError(f"{call}: LBFGS keeps one state over the "
                        "flattened parameters, here this rank's shards, not one per "
                        "parameter; FullyShardedDataParallel does not support LBFGS (use "
                        "DistributedDataParallel with OSS, which runs it on the whole model)")
    _refuse_rank_local_state(model, optim, call)


def _refuse_other_shards(model, optim: torch.optim.Optimizer, osd) -> None:
    """A ValueError when a local optimizer state dict holds per-element state whose shape is
    not this rank's shard of its parameter (saved at another world size or by another model):
    torch's ``load_state_dict`` takes it and the next ``step()`` fails on a size mismatch.
    Local, no copy."""
    ordered = [p for g in optim.param_groups for p in g["params"]]
    names = _state_dict_keys(model)
    problems = []
    for index, entry in (osd.get("state", {}) if isinstance(osd, dict) else {}).items():
        p = ordered[index] if isinstance(index, int) and 0 <= index < len(ordered) else None
        for key, value in (entry.items() if p is not None else ()):
            if key in ELEMENTWISE_STATE and torch.is_tensor(value) \
                    and tuple(value.shape) != tuple(p.shape):
                problems.append(f"{names.get(id(p), index)} {key!r} {tuple(value.shape)} "
                                f"(this rank's shard: {tuple(p.shape)})")
                break
    if problems:
        raise ValueError(
            f"FSDP.optim_state_dict_to_load (LOCAL_STATE_DICT): the state of {len(problems)} "
            f"parameter(s) does not have this rank's shard shapes, e.g. {problems[:2]}; a local "
            f"optimizer state dict loads only at the world size that saved it: to reshard, "
            f"pass every rank's dicts with their local_metadata_dict() to "
            f"shardkit.checkpoint.reshard_local_optim_state_dicts")


def _optimizer_names(model, optim, call: str, kind: str = "SHARDED_STATE_DICT") -> list:
    """The clean name of each of the optimizer's parameters, in its order; a ValueError for
    one that is not the model's (under ``FULL_STATE_DICT`` several such would all be keyed
    ``None``, one's state kept for all). Local."""
    _check_optimizer_of(model, optim, call)
    names = _state_dict_keys(model)
    ordered = [p for g in optim.param_groups for p in g["params"]]
    outside = [i for i, p in enumerate(ordered) if id(p) not in names]
    if outside:
        raise ValueError(f"FSDP.{call} ({kind}): the optimizer's parameters "
                         f"{outside[:5]} (in param-group order) are not parameters of this "
                         f"model; their state cannot be keyed by a parameter name (keep them "
                         f"in an optimizer of their own, or use FSDP.full_optim_state_dict / "
                         f"shard_full_optim_state_dict, keyed by the optimizer's ids)")
    return [names[id(p)] for p in ordered]


def _optimizer_names_agreed(model, optim, call: str) -> list:
    """:func:`_optimizer_names` on every rank of the model's group before a collective: an
    optimizer refused on some ranks only raises there, and a ValueError naming those ranks on
    the others (they waited in the broadcast of a 0-dim parameter's state). One all-gather of
    one integer a rank over the group (a control message, not counted)."""
    names, problem = None, None
    try:
        names = _optimizer_names(model, optim, call)
    except (TypeError, ValueError) as error:
        problem = error
    skdist._agree_on_call(f"FSDP.{call}", problem, [], model.process_group,
                          model._comm_device(), outcome="nothing was sent")
    return names


def _refuse_torch_only_arguments(call: str, **given) -> None:
    """torch FSDP1 arguments with no meaning here: a ValueError unless left unset."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"FSDP.{call}({name}=...): not supported by shardkit's FSDP (the "
                             f"model's own process group and its optimizer's param groups are "
                             f"used); leave it unset")


def _refuse_experts_on_one_rank(model, call: str) -> None:
    """A ValueError, on every rank alike and before any collective, where a full optimizer
    state dict kept or given on the first rank alone (``rank0_only``, scatter) would stand for
    every rank while parameters sharded over other groups (experts) hold different state on
    other ranks under the same names: their state would be dropped (saving) or rank 0's
    loaded everywhere (loading). Local."""
    foreign = model._params_holding_rank_own_values()
    if foreign:
        raise ValueError(f"FSDP.{call}: the parameters {foreign[:3]} are sharded over other "
                         f"ranks than the model's group (experts: each group holds its own "
                         f"values under the same name), so one rank's full optimizer state "
                         f"dict cannot stand for every rank; give every rank its own full dict "
                         f"(FullOptimStateDictConfig(rank0_only=False), one file per rank) or "
                         f"use LOCAL_STATE_DICT")
