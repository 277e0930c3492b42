"""torch's ``torch.distributed.checkpoint.state_dict`` API over shardkit's wrappers.

``from shardkit.checkpoint import get_state_dict, set_state_dict, StateDictOptions`` (and
``get_model_state_dict``, ``get_optimizer_state_dict``, ``set_model_state_dict``,
``set_optimizer_state_dict``) take torch's arguments, torch's ``StateDictOptions`` included,
so a script that saves with torch.distributed.checkpoint (dcp) changes its import only.

Over a model that holds shardkit ``FullyShardedDataParallel`` units (its root one of them):

- default options: ``SHARDED_STATE_DICT``. The model's parameters and the optimizer's
  per-element state (``exp_avg``...) are ``Shard(0)`` DTensors of this rank's rows, keyed by
  the parameters' FQNs (the names of the unwrapped model, as torch gives them), so ``dcp.save``
  writes each row once and ``dcp.load`` reshards to any world size. A fresh optimizer is
  given its state tensors first, as torch does (one ``step()`` with zero gradients and ``lr``
  0, :func:`~shardkit.checkpoint.dtensor_state.init_optimizer_state`), so that ``dcp.load``
  has tensors to fill. No gather and no copy of a shard (a broadcast of each 0-dim
  parameter, as :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.sharded_state_dict`
  does).
- ``full_state_dict=True``: full tensors (FSDP's ``FULL_STATE_DICT`` and its gathered
  optimizer state, keyed by FQN), on every rank; with ``cpu_offload=True`` on rank 0 only
  (``{}`` elsewhere), as torch does. Loadable into a single-process model and
  ``torch.optim`` optimizer, and back at any world size.
- ``set_*``: either kind of dict, from any world size (DTensors filled by ``dcp.load``, or
  full tensors whose rows are cut here); ``broadcast_from_rank0=True`` (with
  ``full_state_dict=True``): only rank 0's dicts are read, and sent to every rank (one
  object broadcast over the world: the full dict is in every rank's memory while it is cut).

Over a plain module or torch ``DistributedDataParallel`` (replicated parameters, a plain
optimizer) torch's own functions are correct and are called as given; so is the model state
of a ``ShardedDataParallel`` (keyed as its unwrapped module), and of a ``shardkit.initialize``
engine at stages 0-2 (its ``engine.module``: the same names as at stage 3, so a dcp
checkpoint moves between stages). An OSS optimizer (ZeRO-1/2) is
refused with an error naming its checkpoint path (``consolidate_state_dict`` then
``state_dict()``, or the engine's checkpoints): each parameter's state lives on its owner
rank only, which torch's functions do not know. So is a model with tensor-parallel layers
split over several ranks (each rank's slice would come under the parameter's one name, which
dcp takes for a replicated tensor): ``engine.save_checkpoint`` keeps those slices apart.

Why not torch's own functions over shardkit FSDP: they do not recognise it, take
``optim.state_dict()`` (this rank's padded rows, as plain tensors under the same key on
every rank) for replicated state, and ``dcp.save`` would write one rank's rows for all.
:func:`mark_sharded_state_for_dcp` (registered by ``shardkit.recipes.compose`` at stage 3
and so by ``shardkit.initialize``) makes that fail clearly instead. An optimizer a user
builds over a plain ``FullyShardedDataParallel`` gets it when it is passed to torch's
functions (FSDP's ``_fqn_modifiers``, the hook they call on the model's modules, finds it:
:func:`mark_optimizers_of_torch_call`), and torch's functions with
``full_state_dict=True`` over it, which would return this rank's rows as the full state,
raise a ``ValueError`` naming these functions.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Iterable, Optional, Union

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from shardkit.utils.call_stack import frames_running

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict", "mark_sharded_state_for_dcp"]

_HOOKED = "_shardkit_dcp_marking_hook"


# ----------------------------------------------------------------------- arguments


def _checked_options(options, call: str) -> StateDictOptions:
    """``options`` (torch's ``StateDictOptions``; ``None``: its defaults) checked locally, so
    that every rank raises the same ``ValueError`` before any collective."""
    if options is None:
        return StateDictOptions()
    if not isinstance(options, StateDictOptions):
        raise TypeError(f"{call}(options={type(options).__name__}): expected "
                        f"torch.distributed.checkpoint.state_dict.StateDictOptions (also "
                        f"shardkit.checkpoint.StateDictOptions) or None")
    for field in fields(StateDictOptions):
        value = getattr(options, field.name)
        if field.name == "dsd_fqn_modifiers":
            if value != "_fqn_modifiers":
                raise ValueError(f"{call}(options=StateDictOptions(dsd_fqn_modifiers="
                                 f"{value!r})): shardkit's wrappers keep the unwrapped model's "
                                 f"names; only the default '_fqn_modifiers' is valid")
        elif not isinstance(value, bool):
            raise ValueError(f"{call}(options=StateDictOptions({field.name}={value!r})): must "
                             f"be True or False")
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(f"{call}(options=StateDictOptions(broadcast_from_rank0=True, "
                         f"full_state_dict=False)): broadcast_from_rank0 sends rank 0's full "
                         f"state dict; set full_state_dict=True too")
    return options


def _checked_optimizers(optimizers, call: str) -> tuple:
    optims = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else \
        tuple(optimizers) if isinstance(optimizers, (list, tuple)) else None
    if not optims or not all(isinstance(o, torch.optim.Optimizer) for o in optims):
        raise TypeError(f"{call}(optimizers={type(optimizers).__name__}): expected a "
                        f"torch.optim.Optimizer or a non-empty list/tuple of them")
    return optims


def _fsdp_root(model: nn.Module, call: str, optims: tuple = (), submodules=None):
    """The shardkit FSDP root of ``model`` (``None``: no shardkit wrapper involved, torch's
    functions apply). Clear errors for OSS / ShardedDataParallel and for options or layouts
    this module cannot serve. Local."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS
    if not isinstance(model, nn.Module):
        raise TypeError(f"{call}(model={type(model).__name__}): expected a torch.nn.Module")
    if (isinstance(model, ShardedDataParallel) and optims) or \
            any(isinstance(o, OSS) for o in optims):
        raise ValueError(
            f"{call}: OSS / ShardedDataParallel (ZeRO-1/2) keep each parameter's optimizer "
            f"state on its owner rank only, which this API does not handle; save the model's "
            f"state_dict() (replicated) and, for the optimizer, optim.consolidate_state_dict"
            f"(recipient_rank=0) then optim.state_dict() on rank 0 (torch format, loads at any "
            f"world size with OSS.load_state_dict), or use shardkit.initialize's "
            f"engine.save_checkpoint / load_checkpoint")
    _refuse_tensor_parallel(_replicated(model), call)
    while isinstance(getattr(model, "_orig_mod", None), nn.Module) and \
            type(model).__name__ == "OptimizedModule":
        model = model._orig_mod  # torch.compile(root): torch's functions drop it too
    if isinstance(getattr(model, "wrapped", None), FSDP) and not isinstance(model, FSDP):
        model = model.wrapped  # a shardkit.initialize engine at stage 3: its FSDP root
    units = [m for m in model.modules() if isinstance(m, FSDP)]
    if not units:
        return None
    if not isinstance(model, FSDP):
        raise ValueError(f"{call}(model={type(model).__name__}): the model holds "
                         f"FullyShardedDataParallel units but its root is not one; pass the "
                         f"root FullyShardedDataParallel (compose's composition.wrapped, or "
                         f"the shardkit.initialize engine itself), or wrap the root too")
    if submodules is not None:
        raise ValueError(f"{call}(submodules=...): not supported over FullyShardedDataParallel "
                         f"(deprecated in torch too); filter the returned state dict by key "
                         f"instead")
    return model


def _refuse_tensor_parallel(model: nn.Module, call: str) -> None:
    """A ValueError, on every rank alike (no communication), for a model holding
    tensor-parallel layers split over more than one rank: each rank's slice of a parameter
    comes under the parameter's one name, so ``dcp.save`` would take them for replicated
    tensors, write one rank's slice and load it into every rank's."""
    from shardkit.nn.model_parallel.layers import TensorParallelModule
    split = {name: m.tp_size for name, m in model.named_modules()
             if isinstance(m, TensorParallelModule) and m.tp_size > 1}
    if split:
        raise ValueError(
            f"{call}: the model holds tensor-parallel layers split over {max(split.values())} "
            f"ranks ({list(split)[:4]}); their per-rank slices would be saved under the same "
            f"names, which dcp takes for one replicated tensor. Use shardkit.initialize's "
            f"engine.save_checkpoint / load_checkpoint (each tensor-parallel rank's slices in "
            f"its own files), or shardkit.nn.model_parallel.full_state.full_model_state_dict "
            f"for the unsplit model state")


def _replicated(model: nn.Module) -> nn.Module:
    """The module torch's functions are given where no shardkit FSDP is involved: a
    ShardedDataParallel's module (its parameters are whole and the same on every rank, so
    torch's functions serve its model state, keyed as the unwrapped model's), and a
    ``shardkit.initialize`` engine's model (``engine.module``); others as given.

    Note: an engine holds the model twice (``engine.module`` and, wrapped, ``engine.wrapped``):
    through the engine itself every tensor came twice, under ``module.`` and ``wrapped.``
    prefixes, so ``dcp.save`` wrote the model twice, and a checkpoint of stages 0-2 did not
    load at stage 3 (unprefixed names, those of the FSDP root) nor the other way round."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.utils.tensor_fragment import is_engine
    if isinstance(model, ShardedDataParallel) or is_engine(model):
        return model.module
    return model


def _torch_optimizers(optims: tuple) -> tuple:
    """``optims``, each given its state first where it has none (as torch's functions do), by
    :func:`~shardkit.checkpoint.dtensor_state.init_optimizer_state`, whose step runs without
    the step hooks: torch's own zero-lr ``step()`` ran them, and an engine's optimizer refuses
    a direct step under gradient accumulation. Local."""
    from shardkit.checkpoint.dtensor_state import init_optimizer_state
    for optim in optims:
        init_optimizer_state(optim)
    return optims


def _fqns_of(model, optim: torch.optim.Optimizer) -> list:
    from shardkit.nn.data_parallel.fsdp_state_dict import clean_name
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return [names.get(id(p)) for g in optim.param_groups for p in g["params"]]


# ----------------------------------------------------------------------- get


def _fsdp_settings(options: StateDictOptions) -> tuple:
    """``(StateDictType, model config, optimizer config)`` for torch's ``options``: FULL
    (rank 0 only with ``cpu_offload``, as torch) or SHARDED. Local."""
    from shardkit.nn.data_parallel.fsdp_state_dict_type import (
        FullOptimStateDictConfig, FullStateDictConfig, ShardedOptimStateDictConfig,
        ShardedStateDictConfig, StateDictType)
    offload = options.cpu_offload
    if options.full_state_dict:
        return (StateDictType.FULL_STATE_DICT,
                FullStateDictConfig(offload_to_cpu=offload, rank0_only=offload),
                FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=offload))
    return (StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=offload),
            ShardedOptimStateDictConfig(offload_to_cpu=offload))


def _model_state(model, options: StateDictOptions) -> dict:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.fsdp_state_dict import clean_name
    kind, config, _ = _fsdp_settings(options)
    with FSDP.state_dict_type(model, kind, config):
        state = model.state_dict()
    if options.ignore_frozen_params and state:
        frozen = {clean_name(n) for n, p in model.named_parameters() if not p.requires_grad}
        state = type(state)((k, v) for k, v in state.items() if k not in frozen)
    return state


def _optim_state(model, optims: tuple, options: StateDictOptions) -> dict:
    from shardkit.checkpoint.dtensor_state import init_optimizer_state
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    for optim in optims:
        outside = [i for i, n in enumerate(_fqns_of(model, optim)) if n is None]
        if outside:
            raise ValueError(f"get_optimizer_state_dict: the optimizer's parameters "
                             f"{outside[:5]} (in param-group order) are not parameters of the "
                             f"model; pass the optimizer built over this model's parameters")
    kind, config, optim_config = _fsdp_settings(options)
    merged = {"state": {}, "param_groups": []}
    for optim in optims:
        init_optimizer_state(optim)  # torch's _init_optim_state: a fresh optimizer's tensors
        _refuse_factored_state(optim, "get_optimizer_state_dict")
        with FSDP.state_dict_type(model, kind, config, optim_config):
            osd = FSDP.optim_state_dict(model, optim)
        if not osd:  # rank0_only, off rank 0
            continue
        merged["state"].update(osd["state"])
        merged["param_groups"].extend(osd["param_groups"])
    if not merged["param_groups"]:
        return {}
    if options.cpu_offload:
        merged["state"] = {k: {s: v.cpu() if torch.is_tensor(v) else v for s, v in e.items()}
                           for k, e in merged["state"].items()}
    return merged


def _refuse_factored_state(optim: torch.optim.Optimizer, call: str) -> None:
    """A ValueError (the same on every rank: shard shapes are padded alike) when the state of a
    parameter sharded over several ranks holds a tensor of one dimension or more that is not
    shaped as the shard (Adafactor's ``row_var``/``col_var``, see
    :func:`~shardkit.nn.data_parallel.fsdp_state_dict.rank_local_state`): it is computed from
    this rank's rows only, so neither a DTensor of rows nor a replicated tensor describes it.
    Local."""
    from shardkit.nn.data_parallel.fsdp_state_dict import rank_local_shape, rank_local_state
    for _, key, shape, shard in rank_local_state(optim)[:1]:
        raise ValueError(
            f"{call}: optimizer state {key!r} of a parameter sharded by "
            f"FullyShardedDataParallel (shard {shard}) has {rank_local_shape(shape, shard)} "
            f"(e.g. Adafactor's factored moments): it is computed from this rank's rows only "
            f"and cannot be saved as one tensor")


def get_model_state_dict(model: nn.Module, *, submodules: Optional[set] = None,
                         options: Optional[StateDictOptions] = None) -> dict:
    """torch's ``get_model_state_dict`` (see the module docstring for shardkit FSDP). All
    ranks must call it (full: collective; sharded: local)."""
    options = _checked_options(options, "get_model_state_dict")
    root = _fsdp_root(model, "get_model_state_dict", submodules=submodules)
    if root is None:
        from torch.distributed.checkpoint import state_dict as tsd
        return tsd.get_model_state_dict(_replicated(model), submodules=submodules,
                                        options=options)
    return _model_state(root, options)


def get_optimizer_state_dict(model: nn.Module,
                             optimizers: Union[torch.optim.Optimizer, Iterable],
                             *, submodules: Optional[set] = None,
                             options: Optional[StateDictOptions] = None) -> dict:
    """torch's ``get_optimizer_state_dict``: ``{"state": {fqn: {...}}, "param_groups": [...,
    "params": [fqns]]}`` (see the module docstring for shardkit FSDP). A fresh optimizer is
    given its state first (as torch does). All ranks must call it."""
    options = _checked_options(options, "get_optimizer_state_dict")
    optims = _checked_optimizers(optimizers, "get_optimizer_state_dict")
    root = _fsdp_root(model, "get_optimizer_state_dict", optims, submodules)
    if options.flatten_optimizer_state_dict and root is not None:
        raise ValueError("get_optimizer_state_dict(options=StateDictOptions("
                         "flatten_optimizer_state_dict=True)): not supported over "
                         "FullyShardedDataParallel; leave it False (the nested dict "
                         "reshards with dcp as it is)")
    if root is None:
        from torch.distributed.checkpoint import state_dict as tsd
        return tsd.get_optimizer_state_dict(_replicated(model), _torch_optimizers(optims),
                                            submodules=submodules, options=options)
    return _optim_state(root, optims, options)


def get_state_dict(model: nn.Module, optimizers: Union[torch.optim.Optimizer, Iterable],
                   *, submodules: Optional[set] = None,
                   options: Optional[StateDictOptions] = None) -> tuple:
    """torch's ``get_state_dict``: ``(model_state_dict, optimizer_state_dict)``."""
    options = _checked_options(options, "get_state_dict")
    optims = _checked_optimizers(optimizers, "get_state_dict")
    root = _fsdp_root(model, "get_state_dict", optims, submodules)
    if root is None:
        from torch.distributed.checkpoint import state_dict as tsd
        return tsd.get_state_dict(_replicated(model), _torch_optimizers(optims),
                                  submodules=submodules, options=options)
    return (get_model_state_dict(root, options=options),
            get_optimizer_state_dict(root, optims, options=options))


# ----------------------------------------------------------------------- set


def _from_rank0(state: dict, call: str, what: str) -> dict:
    """Rank 0's ``state`` on every rank (one object broadcast over the world)."""
    from shardkit import distributed as skdist
    payload = state if skdist.get_rank() == 0 else None
    if skdist.get_rank() == 0 and not isinstance(state, dict):
        payload = TypeError(f"{call}({what}={type(state).__name__}) on rank 0 with "
                            f"broadcast_from_rank0=True: rank 0 must pass the full state dict")
    payload = skdist.broadcast_object(payload, src=0)
    if isinstance(payload, Exception):
        raise payload
    return payload


def _load_model(model, state: dict, options: StateDictOptions):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.fsdp_state_dict_type import StateDictType
    if not isinstance(state, dict):
        raise TypeError(f"set_model_state_dict(model_state_dict={type(state).__name__}): "
                        f"expected a dict (from get_model_state_dict, e.g. filled by dcp.load)")
    sharded = any(_is_dtensor(v) for v in state.values())
    kind = StateDictType.SHARDED_STATE_DICT if sharded else StateDictType.FULL_STATE_DICT
    with FSDP.state_dict_type(model, kind):
        return model.load_state_dict(state, strict=options.strict)


def _is_dtensor(value) -> bool:
    from shardkit.checkpoint.dtensor_state import is_dtensor
    return is_dtensor(value)


def _split_by_optimizer(model, optims: tuple, osd) -> list:
    """The part of a merged, FQN-keyed optimizer state dict each optimizer takes."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ValueError("set_optimizer_state_dict(optim_state_dict=...): expected a dict with "
                         "'state' and 'param_groups' (from get_optimizer_state_dict, e.g. "
                         "filled by dcp.load)")
    if len(optims) == 1:
        return [osd]
    parts = []
    for optim in optims:
        mine = set(_fqns_of(model, optim))
        groups = [g for g in osd["param_groups"] if set(g["params"]) <= mine]
        parts.append({"state": {k: v for k, v in osd["state"].items() if k in mine},
                      "param_groups": groups})
    return parts


def _load_optims(model, optims: tuple, osd, options: StateDictOptions) -> None:
    from shardkit.checkpoint.dtensor_state import init_optimizer_state
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.fsdp_state_dict_type import StateDictType
    parts = _split_by_optimizer(model, optims, osd)
    mine = []
    for optim, part in zip(optims, parts):
        sharded = any(_is_dtensor(v) for e in part["state"].values() for v in e.values())
        kind = StateDictType.SHARDED_STATE_DICT if sharded else StateDictType.FULL_STATE_DICT
        with FSDP.state_dict_type(model, kind):
            mine.append(FSDP.optim_state_dict_to_load(model, optim, part))
    for optim, loaded in zip(optims, mine):  # every part checked before any is loaded
        init_optimizer_state(optim)
        optim.load_state_dict(loaded)


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *,
                         options: Optional[StateDictOptions] = None):
    """torch's ``set_model_state_dict``: DTensors (e.g. filled by dcp.load) or full tensors,
    from any world size; returns torch's ``_IncompatibleKeys``. All ranks must call it."""
    options = _checked_options(options, "set_model_state_dict")
    root = _fsdp_root(model, "set_model_state_dict")
    if root is None:
        from torch.distributed.checkpoint import state_dict as tsd
        return tsd.set_model_state_dict(_replicated(model), model_state_dict, options=options)
    if options.broadcast_from_rank0:
        model_state_dict = _from_rank0(model_state_dict, "set_model_state_dict",
                                       "model_state_dict")
    return _load_model(root, model_state_dict, options)


def set_optimizer_state_dict(model: nn.Module,
                             optimizers: Union[torch.optim.Optimizer, Iterable],
                             optim_state_dict: dict, *,
                             options: Optional[StateDictOptions] = None) -> None:
    """torch's ``set_optimizer_state_dict``: the dict of :func:`get_optimizer_state_dict`
    (DTensors filled by dcp.load, or full tensors) from any world size. Checked before
    anything is loaded. All ranks must call it."""
    options = _checked_options(options, "set_optimizer_state_dict")
    optims = _checked_optimizers(optimizers, "set_optimizer_state_dict")
    root = _fsdp_root(model, "set_optimizer_state_dict", optims)
    if root is None:
        from torch.distributed.checkpoint import state_dict as tsd
        return tsd.set_optimizer_state_dict(_replicated(model), _torch_optimizers(optims),
                                            optim_state_dict, options=options)
    if options.broadcast_from_rank0:
        optim_state_dict = _from_rank0(optim_state_dict, "set_optimizer_state_dict",
                                       "optim_state_dict")
    _load_optims(root, optims, optim_state_dict, options)
    return None


def set_state_dict(model: nn.Module, optimizers: Union[torch.optim.Optimizer, Iterable], *,
                   model_state_dict: dict, optim_state_dict: dict,
                   options: Optional[StateDictOptions] = None):
    """torch's ``set_state_dict``: the model, then the optimizers; returns the model's
    ``_IncompatibleKeys``. All ranks must call it."""
    options = _checked_options(options, "set_state_dict")
    optims = _checked_optimizers(optimizers, "set_state_dict")
    root = _fsdp_root(model, "set_state_dict", optims)
    if root is None and options.broadcast_from_rank0:
        # torch's set_state_dict skips the model on a rank given an empty model_state_dict
        # (optimizer only), so ranks other than 0, which may pass {}, left rank 0 waiting in
        # its broadcast of the model's tensors; its two functions take part on every rank
        keys = set_model_state_dict(model, model_state_dict, options=options)
        set_optimizer_state_dict(model, optims, optim_state_dict, options=options)
        return keys
    if root is None:
        from torch.distributed.checkpoint import state_dict as tsd
        return tsd.set_state_dict(_replicated(model), _torch_optimizers(optims),
                                  model_state_dict=model_state_dict,
                                  optim_state_dict=optim_state_dict, options=options)
    keys = set_model_state_dict(root, model_state_dict, options=options)
    set_optimizer_state_dict(root, optims, optim_state_dict, options=options)
    return keys


# ----------------------------------------------------------------------- torch's own functions


def mark_sharded_state_for_dcp(optim: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Register, on this optimizer instance only, a ``state_dict`` post-hook that marks the
    per-element state of parameters sharded by a shardkit FSDP unit over several ranks
    (``optim.state_dict()``: this rank's padded rows, plain tensors under the same key on every
    rank) with :func:`~shardkit.checkpoint.dtensor_state.refuse_in_dcp`. torch's own
    ``get_state_dict`` passes those tensors on, and ``dcp.save`` then refuses them on every
    rank before anything is written, naming ``shardkit.checkpoint.get_state_dict``, instead of
    writing one rank's rows as if replicated. ``torch.save`` and ``load_state_dict`` are
    unaffected (the marked values are aliases, ``detach``: no copy). Idempotent; returns
    ``optim``. Cost per ``state_dict()`` call: one dictionary lookup per parameter and one
    alias per marked tensor. Local."""
    if getattr(optim, _HOOKED, False):
        return optim
    optim.register_state_dict_post_hook(_mark_state)
    setattr(optim, _HOOKED, True)
    return optim


def mark_optimizers_of_torch_call() -> None:
    """Called by a shardkit FSDP unit's ``_fqn_modifiers`` (the hook torch's
    ``torch.distributed.checkpoint.state_dict`` functions call on each module of the model
    they are given, first while checking their arguments): the optimizers passed to that
    call (``get_state_dict(model, optim)``, ``get_optimizer_state_dict``...), found in the
    frame of torch's argument check, get :func:`mark_sharded_state_for_dcp`, so that the
    optimizer state torch's functions return for an optimizer a user built over shardkit FSDP
    (this rank's rows as plain tensors) is refused by ``dcp.save`` on every rank instead of
    being written as if replicated. Nothing happens outside such a call (or where torch's
    internals differ: then as before). Local: the hook is on those optimizer instances only."""
    try:
        from torch.distributed.checkpoint import state_dict as torch_dsd
        code = torch_dsd._verify_options.__code__
    except (ImportError, AttributeError):
        return
    # torch's check -> its model walk (nested generators) -> the hook: within 64 frames
    frames = frames_running(code, depth=64)
    if not frames:
        return
    optims = [o for o in frames[0].f_locals.get("optims") or ()
              if isinstance(o, torch.optim.Optimizer)]
    options = frames[0].f_locals.get("options")
    if getattr(options, "full_state_dict", False) and any(map(_over_shards, optims)):
        raise ValueError(
            "torch.distributed.checkpoint.state_dict's functions with "
            "StateDictOptions(full_state_dict=True) over an optimizer of shardkit "
            "FullyShardedDataParallel parameters: torch's take its state (this rank's "
            "rows) for full tensors; use shardkit.checkpoint.get_state_dict / "
            "set_state_dict (same arguments), which gather and cut the rows")
    for optim in optims:
        mark_sharded_state_for_dcp(optim)


def _over_shards(optim: torch.optim.Optimizer) -> bool:
    """Whether some of ``optim``'s parameters are sharded by shardkit FSDP over several
    ranks. Local."""
    from shardkit.nn.data_parallel.fsdp_state_dict import shard_shapes
    return bool(shard_shapes([p for g in optim.param_groups for p in g["params"]]))


def _mark_state(optim: torch.optim.Optimizer, osd: dict) -> dict:
    from shardkit.nn.data_parallel.fsdp_state_dict import mark_rank_local_state
    return mark_rank_local_state(optim, osd, _SOURCE, shard_shaped_only=False)


_SOURCE = ("optim.state_dict() over FullyShardedDataParallel shards (e.g. via torch's "
           "torch.distributed.checkpoint.state_dict.get_state_dict, which does not know "
           "shardkit's FSDP; use shardkit.checkpoint.get_state_dict / set_state_dict, same "
           "arguments)")
