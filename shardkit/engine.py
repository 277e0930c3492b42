"""``shardkit.initialize``: a DeepSpeed-style front end over :func:`shardkit.recipes.compose`.

The config (validated by :mod:`shardkit.config`) picks a ZeRO stage, and
:func:`compose_from_config` turns its choices into :func:`shardkit.recipes.compose`'s
arguments (stage-3 wrap units: ``initialize(wrap_policy=...)``, default
:func:`shardkit.recipes.default_wrap_policy`). Per-rank memory and traffic are
:func:`shardkit.plan.zero_model_state_bytes` and :func:`shardkit.plan.zero_comm_elements_per_step`:

====== ======================================= ===== ===== ========= ==========================
stage  wrappers                                 params grads optimizer communication per step
====== ======================================= ===== ===== ========= ==========================
0      torch DistributedDataParallel           full  full  full      all-reduce 2Ψ(N-1)/N
1      OSS + torch DDP, reduce to owners        full  full* 1/N       2Ψ(N-1)/N
2      OSS + ShardedDataParallel                full  1/N   1/N       2Ψ(N-1)/N
3      FullyShardedDataParallel per block       1/N   1/N   1/N       3Ψ(N-1)/N
====== ======================================= ===== ===== ========= ==========================

(*) At stage 1 each gradient is averaged onto its OSS owner only
(``zero_optimization.reduce_scatter``, default true as in DeepSpeed;
:func:`shardkit.comm_hooks.reduce_to_owners_hook`): a rank's gradients of parameters it does
not own read zero after backward, and several reducing backwards in one step add up on the
owner as under the all-reduce (the hook carries the owner's earlier average).
``"reduce_scatter": false`` keeps torch DDP's all-reduce (every rank holds the averaged
gradients; ``3Ψ(N-1)/N``), and so does an optimizer that leaves some trainable parameters
out (``model_parameters=`` a subset, as DeepSpeed allows: those get gradients and are never
stepped; rank 0 says so once). At stage 2 such an optimizer is a ConfigError before any
collective (freeze those parameters instead); stages 0 and 3 train it as DeepSpeed does. At
every stage ``gradient_clipping`` and ``get_global_grad_norm()`` take the norm over the
parameters the optimizer steps, as DeepSpeed's ZeRO stages do, and ``engine.step()`` clears the
gradients of the trainable parameters it leaves out (they never accumulate).

``zero_optimization.zero_hpz_partition_size=h`` (stage 3, DeepSpeed's hpZ) gives every FSDP unit
``hpz_partition_size=h``: backward gathers inside blocks of ``h`` ranks (a node), leaving
``2Ψ(N-1)/N`` on links between blocks, for ``Ψ/h`` more memory per resharded unit.

Master weights and optimizer state are always fp32; ``fp16``/``bf16`` run the forward and
backward under ``torch.autocast`` (CPU or CUDA), fp16 with a :class:`DynamicLossScaler`. A
model passed in fp16 or bf16 to train that way has its 16-bit parameters and buffers cast to
fp32 first (the same ``Parameter`` objects; rank 0 says so), as DeepSpeed keeps fp32 master
weights whatever the model's dtype. A step
whose gradients hold inf/nan is skipped under fp16, and under bf16 unless
``bf16.check_grad_overflow`` is false (DeepSpeed's default, true); the decision is all-reduced
(one element) so every rank skips together. A script's own ``engine.optimizer.step()`` gets
that work on the gradients first, as DeepSpeed's wrapped optimizers do
(:mod:`shardkit.engine_direct_step`).

A model built from ``shardkit.nn.model_parallel`` layers trains through ``mpu=`` (DeepSpeed's
model-parallel unit): the table's wrappers then run over the data-parallel group, N is its size,
and the tensor-parallel ranks add one one-element all-reduce a step for the gradient norm
(:func:`initialize`).

Without any optimizer (no ``optimizer=`` and no config ``optimizer`` section: DeepSpeed's
reference, reward and EMA engines, "ZeRO-3 inference") ``initialize`` returns a forward-only
engine, ``optimizer`` and ``lr_scheduler`` ``None``: stage 3 shards the parameters with FSDP
(``4Ψ/N`` bytes of fp32 parameters per rank, no gradients, no optimizer state; each forward
all-gathers the units it runs); stages 0-2 have nothing to shard without an optimizer and keep
the model whole (``4Ψ``, rank 0's weights broadcast once, forwards local). ``fp16``/``bf16``
run the forward under ``torch.autocast`` as with an optimizer. ``engine.backward`` and
``engine.step`` are a RuntimeError on every rank before any collective, as DeepSpeed asserts;
``module_state_dict``, ``save_16bit_model`` and ``save_checkpoint``/``load_checkpoint``
(weights, counters and RNG; a training checkpoint loads its weights) work.

Usage::

    engine, optimizer, _, scheduler = shardkit.initialize(model=model, config="ds_config.json")
    for x, y in batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import io
import logging
import math
import os
import re
import time
import warnings
import weakref
from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import distributed, engine_direct_step, engine_export
from shardkit.config import TORCH_SCHEDULER_TYPES, ConfigError, EngineConfig, load_config
from shardkit.deepspeed_compat import ensure_process_group
from shardkit.engine_accessors import DeepSpeedAccessors, LossScaleReading
from shardkit.model_parallel_unit import (ModelParallelGroups, checkpoint_location,
                                          model_parallel_groups, mp_rank_name,
                                          write_tensor_parallel_layout)
from shardkit.optim.loss_scaler import DynamicLossScaler, StaticLossScaler
from shardkit.optim.oss import OSS
from shardkit.recipes import (Composition, OptimizerRecipe, agree_on_refusal,
                              check_composable, compose, model_fingerprint,
                              optimizer_fingerprint, refuse_meta_tensors, stable_repr,
                              why_not_on_row_shards, why_not_steppable_on_shards)
from shardkit.utils.nested import tensors_in
from shardkit.utils.wrapped_attributes import attribute_through

__all__ = ["initialize", "ShardedEngine"]

# the config's names of the 16-bit dtypes (precision and communication_data_type)
_HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# parameter -> the gradient-arrival hook of the latest engine built over it (a new engine over
# the same model replaces it rather than adding one more; see _watch_gradient_arrivals)
_ARRIVAL_HOOKS = WeakIdKeyDictionary()
# optimizer -> weak reference to the latest engine built over it, read by the one step pre-hook
# each optimizer gets (see _guard_direct_steps)
_STEP_OWNERS = WeakIdKeyDictionary()
# optimizer -> how many engine.step() calls are inside its step() now (any engine over it, not
# only the latest: an earlier engine over a shared optimizer steps it legitimately too)
_ENGINE_STEPPING = WeakIdKeyDictionary()
# what a rank tells the others in the step agreement (see ShardedEngine._agree_on_step): first
# whether it steps, and whether its optimizer state is offloaded
_NOT_STEPPING, _STEPPING = 0, 1
# then OSS's own agreement row (two ints) for each of these calls of the step, carried in the
# engine's exchange (see ShardedEngine._oss_calls_to_carry), or _NOT_CARRIED twice: every rank
# sends a row of one length, whether it steps or not
_CARRIED_OSS_CALLS = ("clip_grad_norm", "step")
_NOT_CARRIED = -1

logger = logging.getLogger("shardkit")


# ----------------------------------------------------------------------------- optimizer recipe


def _optimizer_recipe(cfg: EngineConfig, optimizer, model_parameters,
                      model) -> Optional[OptimizerRecipe]:
    """How to build the optimizer; ``None`` without one (a forward-only engine)."""
    if cfg.optimizer is None and optimizer is None:
        return None
    if cfg.optimizer is not None:
        groups = None if model_parameters is None else [
            dict(g, params=list(g["params"])) if isinstance(g, Mapping)
            and not isinstance(g["params"], torch.Tensor) else g for g in model_parameters]
        return OptimizerRecipe(getattr(torch.optim, cfg.optimizer.torch_class),
                               dict(cfg.optimizer.kwargs), groups)
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        params = model_parameters if model_parameters is not None else \
            [p for p in model.parameters() if p.requires_grad]
        optimizer = _built_by_callable(optimizer, params, cfg)
        if cfg.zero.stage == 3 and optimizer.state:
            return _recipe_rebuilt_on_shards(optimizer)
    return OptimizerRecipe.of(optimizer)


def _built_by_callable(factory, params, cfg: EngineConfig) -> torch.optim.Optimizer:
    """The optimizer the caller's ``callable(params)`` builds, checked as a passed instance is
    (:func:`_check_arguments`): a torch optimizer, and at stage 3 one that can step FSDP's row
    shards (state it built already is no reason to refuse: it is rebuilt over the shards, see
    :func:`_recipe_rebuilt_on_shards`). The same :class:`ConfigError` on every rank, before
    any wrapper exists or any collective starts. Local."""
    built = factory(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"initialize(optimizer=<callable>): the callable must return a "
                        f"torch.optim.Optimizer built over the params it is given, it returned "
                        f"{type(built).__name__}")
    problem = cfg.zero.stage == 3 and why_not_on_row_shards(type(built))
    if problem:
        raise ConfigError(f"initialize(optimizer=<callable>) at zero_optimization.stage=3: "
                          f"{problem}")
    return built


def _recipe_rebuilt_on_shards(optimizer: torch.optim.Optimizer) -> OptimizerRecipe:
    """Stage 3, an optimizer made by the caller's ``callable(params)`` that built state in its
    constructor (Adagrad's sums, full-size): its class, hyper-parameters and param groups
    without the instance, so it is built again over FSDP's shards (the same ``Parameter``
    objects, cut in place) and its state is shard-sized. The caller never held the first
    instance; its full-size state is dropped."""
    recipe = OptimizerRecipe.of(optimizer)
    groups = [dict(group) for group in optimizer.param_groups]
    return OptimizerRecipe(recipe.cls, recipe.defaults, groups)


def _check_arguments(model, optimizer, lr_scheduler, cfg: EngineConfig) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...): expected a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if cfg.optimizer is not None and optimizer is not None:
        raise ConfigError(
            f"initialize: both an optimizer object (optimizer=<{type(optimizer).__name__}>) and "
            f"a config 'optimizer' section (type {cfg.optimizer.torch_class}) were given; pass "
            f"exactly one of them (DeepSpeed would use the object and ignore the section: to "
            f"keep that behaviour, delete the config's 'optimizer' section)")
    if cfg.optimizer is None and optimizer is None:
        _check_forward_only(lr_scheduler, cfg)
    if optimizer is not None and not (isinstance(optimizer, torch.optim.Optimizer)
                                      or callable(optimizer)):
        raise TypeError(f"initialize(optimizer=...): expected a torch.optim.Optimizer or a "
                        f"callable(params) -> Optimizer, got {type(optimizer).__name__}")
    if cfg.scheduler is not None and lr_scheduler is not None:
        raise ConfigError("initialize: both lr_scheduler=... and a config 'scheduler' section "
                          "were given; pass exactly one of them")
    if lr_scheduler is not None and not _is_scheduler_instance(lr_scheduler) \
            and not callable(lr_scheduler):
        raise TypeError(f"initialize(lr_scheduler={lr_scheduler!r}): expected a scheduler (an "
                        f"object with step() and state_dict()) or a callable(optimizer) -> "
                        f"scheduler")
    if lr_scheduler is not None and not _is_scheduler_instance(lr_scheduler):
        _check_builds_from_the_optimizer(lr_scheduler)
    if _is_scheduler_instance(lr_scheduler) \
            and getattr(lr_scheduler, "optimizer", None) is not optimizer:
        name = type(lr_scheduler).__name__
        if isinstance(optimizer, torch.optim.Optimizer):
            problem = ("the scheduler is not attached to the optimizer passed as optimizer=... "
                       "(the one the engine steps); build it on that optimizer, or pass a "
                       "callable")
        else:  # the optimizer does not exist yet: built by initialize
            source = "the callable optimizer=..." if optimizer is not None \
                else "the config's 'optimizer' section"
            problem = (f"the scheduler is not attached to the optimizer the engine steps, "
                       f"which initialize builds (from {source}), so no scheduler object can "
                       f"be attached to it beforehand; pass a callable that initialize calls "
                       f"with it")
        raise ConfigError(f"initialize(lr_scheduler=<{name}>): {problem}, e.g. "
                          f"lr_scheduler=lambda opt: {name}(opt, ...)")
    problem = cfg.zero.stage == 3 and isinstance(optimizer, torch.optim.Optimizer) \
        and why_not_steppable_on_shards(optimizer)
    if problem:
        raise ConfigError(f"initialize(optimizer=...) at zero_optimization.stage=3: {problem}")


def _check_forward_only(lr_scheduler, cfg: EngineConfig) -> None:
    """An engine without an optimizer (forward only) has nothing for a scheduler to drive: a
    config ``scheduler`` section or ``lr_scheduler=...`` is a :class:`ConfigError` on every
    rank before any collective (DeepSpeed would build the scheduler on a missing optimizer)."""
    given = "a config 'scheduler' section (type " + cfg.scheduler.type + ")" \
        if cfg.scheduler is not None else \
        f"lr_scheduler=<{type(lr_scheduler).__name__}>" if lr_scheduler is not None else None
    if given is not None:
        raise ConfigError(
            f"initialize: {given} was given without an optimizer (no optimizer=... and no "
            f"config 'optimizer' section); a scheduler drives an optimizer's learning rate. "
            f"Pass an optimizer to train, or drop the scheduler for a forward-only engine "
            f"(reference/reward/EMA model, inference)")


def _check_sparse_modules(model: nn.Module, cfg: EngineConfig, optimizer=None) -> None:
    """Embeddings with ``sparse=True`` give sparse gradients, which torch DDP reduces (stage 0,
    as DeepSpeed's ``sparse_gradients``) but OSS's owner reduction, ShardedDataParallel's
    buckets and FSDP's flat shards cannot: a :class:`ConfigError` naming the modules at stages
    1-3, on every rank before any collective (forward only, stages 1-2 keep the model whole
    and reduce nothing: accepted). Local."""
    if cfg.zero.stage == 0 or (cfg.zero.stage < 3 and _forward_only(cfg, optimizer)):
        return
    sparse = [name or type(model).__name__ for name, module in model.named_modules()
              if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
              and getattr(module, "sparse", False)
              and any(p.requires_grad for p in module.parameters(recurse=False))]
    if sparse:
        raise ConfigError(
            f"initialize: zero_optimization.stage={cfg.zero.stage} cannot reduce sparse "
            f"gradients, and the embedding module(s) {sparse[:4]} were built with sparse=True; "
            f"build them with sparse=False (dense gradients), or use zero_optimization.stage=0 "
            f"(torch DDP reduces sparse gradients)")


def _forward_only(cfg: EngineConfig, optimizer) -> bool:
    """No optimizer object and no config ``optimizer`` section: a forward-only engine."""
    return cfg.optimizer is None and optimizer is None


def _param_group_count(recipe: OptimizerRecipe) -> int:
    """How many param groups the optimizer built from ``recipe`` will have (OSS and FSDP keep
    the user's grouping at every stage)."""
    if recipe.instance is not None:
        return len(recipe.instance.param_groups)
    groups = recipe.param_groups
    if groups and all(isinstance(g, dict) for g in groups):
        return len(groups)
    return 1


def _check_config_scheduler(cfg: EngineConfig, recipe: OptimizerRecipe) -> None:
    """A per-group list in the config's ``scheduler.params`` (``warmup_min_lr``,
    ``warmup_max_lr``) must have one value per param group, and a torch scheduler (whose values
    torch checks only when it is built over an optimizer: ``OneCycleLR`` without
    ``total_steps``, ``CyclicLR`` cycling a momentum the optimizer lacks) must build over the
    optimizer's param groups: checked before any collective (the latter by building it over a
    stand-in of the optimizer and stepping it once), so every rank raises the same
    :class:`ConfigError` naming the section. Local; memory: one element per param group."""
    if cfg.scheduler is None:
        return
    groups = _param_group_count(recipe)
    if cfg.scheduler.type not in TORCH_SCHEDULER_TYPES:  # DeepSpeed's: values checked already
        for key, value in cfg.scheduler.kwargs.items():
            if isinstance(value, (list, tuple)) and len(value) != groups:
                raise ConfigError(
                    f"scheduler.params.{key}={list(value)!r}: one value per optimizer param "
                    f"group is needed and the optimizer has {groups} group(s); give a list of "
                    f"{groups} or a single number")
        return
    try:
        with warnings.catch_warnings():  # torch's warnings come once, from the real one
            warnings.simplefilter("ignore")
            # and stepped once: some values fail only in step (StepLR's step_size=0)
            cfg.scheduler.build(_stand_in_optimizer(recipe)).step(
                **({"metrics": 0.0} if cfg.scheduler.type == "ReduceLROnPlateau" else {}))
    except (ValueError, TypeError, KeyError, ArithmeticError) as error:
        raise ConfigError(f"scheduler.type={cfg.scheduler.type!r} with scheduler.params="
                          f"{dict(cfg.scheduler.kwargs)!r} cannot be built over the optimizer "
                          f"({recipe.cls.__name__}, {groups} param group(s)): {error}") from None


def _stand_in_optimizer(recipe: OptimizerRecipe) -> torch.optim.Optimizer:
    """An optimizer with the param groups ``recipe`` builds (their hyper-parameters copied,
    tensors included) over one one-element tensor each: a scheduler built on it runs its own
    checks without touching the real optimizer's lrs or momenta."""
    if recipe.instance is not None:
        defaults, groups = recipe.instance.defaults, recipe.instance.param_groups
    else:
        defaults = recipe.defaults
        given = recipe.param_groups
        groups = given if given and all(isinstance(g, Mapping) for g in given) else [{}]
    settings = [copy.deepcopy({k: v for k, v in group.items() if k != "params"})
                for group in groups]
    return torch.optim.Optimizer(
        [{**copy.deepcopy(dict(defaults)), **values,
          "params": [torch.zeros(1, requires_grad=True)]} for values in settings],
        copy.deepcopy(dict(defaults)))


def _names_by_trainability(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(trainable parameter names, frozen parameter names)`` of ``model``, every name of a
    tied parameter (its aliases share its ``requires_grad``)."""
    named = list(model.named_parameters(remove_duplicate=False))
    return ([n for n, p in named if p.requires_grad], [n for n, p in named if not p.requires_grad])


def _guard_direct_steps(engine) -> None:
    """Make ``engine.optimizer.step()`` called by the script (not by ``engine.step()``) a
    RuntimeError while ``gradient_accumulation_steps > 1``: the engine reduces gradients only in
    the boundary micro-batch's ``engine.backward`` and counts micro-batches in ``engine.step()``,
    so a loop of ``loss.backward()`` and ``optimizer.step()`` (nanoGPT's) never reduces and
    would step on each rank's own gradients, silently. Raised on every rank that steps, before
    the optimizer's collectives. One pre-hook per optimizer, reading the latest engine built
    over it (a weak reference: the hook keeps no engine alive). With one micro-batch per step,
    calling the optimizer directly keeps working, with ``engine.step()``'s work on the
    gradients done first (unscaled, an overflow skipped, clipped:
    :mod:`shardkit.engine_direct_step`), but it is collective, as ``engine.step()`` is: the
    ranks first agree that all of them step and none holds its state offloaded (one
    all-gather of six int64s a rank over the world, see ``ShardedEngine._agree_on_step``), so
    a step called on some ranks only is a RuntimeError on every rank, the ranks that skipped
    it raising at their next training forward."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    if optimizer not in _STEP_OWNERS:
        optimizer.register_step_pre_hook(_refuse_direct_step)
        optimizer.register_step_post_hook(engine_direct_step.close_carried_step)
    _STEP_OWNERS[optimizer] = weakref.ref(engine)


def _expose_offload_on_optimizer(engine) -> None:
    """DeepSpeed's ZeRO optimizers have ``offload_states`` / ``reload_states``, and OpenRLHF
    calls them there (``engine.optimizer.offload_states(include=...)``): set on the engine's
    optimizer, forwarding to this engine (held weakly), unless the optimizer's class defines
    the name itself. Costs nothing."""
    optimizer = engine.optimizer
    if optimizer is None:
        return
    owner = weakref.ref(engine)
    for name in ("offload_states", "reload_states"):
        if not hasattr(type(optimizer), name):
            setattr(optimizer, name, _ForwardedToEngine(owner, name))


class _ForwardedToEngine:
    """``optimizer.<name>(...)`` calling the engine's method of that name, through a weak
    reference (the optimizer keeps no engine alive).

    Note: an optimizer whose ``__getstate__`` keeps its ``__dict__`` pickles and copies this
    too: the copy is bound to no engine (a copied or loaded optimizer is not the one the
    engine steps, and an engine does not pickle), so calling it raises as when the engine is
    gone. A plain closure here made ``pickle.dumps(optimizer)`` fail."""

    def __init__(self, owner: Optional[weakref.ref], name: str):
        self.owner, self.__name__ = owner, name
        self.__doc__ = f"The engine's :meth:`ShardedEngine.{name}` (DeepSpeed's optimizer call)."

    def __call__(self, *args, **kwargs):
        engine = self.owner() if self.owner is not None else None
        if engine is None:
            raise RuntimeError(f"optimizer.{self.__name__}(): the engine this optimizer was "
                               f"built into no longer exists, or this optimizer is a copy "
                               f"(pickled or deep-copied) of the engine's; call "
                               f"engine.{self.__name__}() on the engine")
        return getattr(engine, self.__name__)(*args, **kwargs)

    def __reduce__(self):
        return _ForwardedToEngine, (None, self.__name__)


def _refuse_direct_step(optimizer, args, kwargs) -> None:
    """The step pre-hook of the engine's optimizer: a direct ``engine.optimizer.step()`` (not
    ``engine.step()``'s) agrees on the step, is refused with accumulation, and otherwise gets
    ``engine.step()``'s work on the gradients first (:func:`engine_direct_step.prepare`)."""
    owner = _STEP_OWNERS.get(optimizer)
    engine = owner() if owner is not None else None
    if engine is None or _ENGINE_STEPPING.get(optimizer, 0) > 0:
        return None
    # as engine.step(): on a GPU torch's AdamW would count the step on its (host) step
    # tensors, then fail on the moments, so the bias correction would drift by one
    agreed = engine._agree_on_step("engine.optimizer.step()", carry=engine._oss_calls_to_carry())
    engine._weights_version += 1
    steps = engine.config.gradient_accumulation_steps
    if steps == 1:
        engine_direct_step.prepare(engine, optimizer, agreed, args, kwargs)
        return None
    raise RuntimeError(
        f"engine.optimizer.step() was called directly with gradient_accumulation_steps={steps}: "
        f"the engine averages gradients over the ranks only in engine.backward(loss) of the "
        f"accumulation boundary and counts micro-batches in engine.step(), so this step would "
        f"apply this rank's own gradients; call engine.backward(loss) and engine.step() for "
        f"every micro-batch (engine.step() runs the optimizer at the boundary)")


def _split_carried_rows(rows: list) -> tuple:
    """``(engine rows, {call: OSS rows})`` of the step agreement's gathered ``rows``: each
    rank's own two ints, and for each call of :data:`_CARRIED_OSS_CALLS` that every rank
    carried, every rank's OSS row for it (group-rank order: OSS spans the world)."""
    carried = {}
    for i, call in enumerate(_CARRIED_OSS_CALLS):
        oss_rows = [row[2 + 2 * i:4 + 2 * i] for row in rows]
        if all(_NOT_CARRIED not in oss_row for oss_row in oss_rows):
            carried[call] = oss_rows
    return [row[:2] for row in rows], carried


def _is_oss_clip(clip: Callable, optimizer: OSS) -> bool:
    """Whether the composition's ``clip`` is ``optimizer.clip_grad_norm`` itself (stages 1-2),
    whose agreement the step agreement can carry."""
    return getattr(clip, "__self__", None) is optimizer and \
        getattr(clip, "__func__", None) is OSS.clip_grad_norm


def _step_runs_no_foreign_code(optimizer: OSS) -> bool:
    """Whether ``optimizer.step()`` runs only torch's and shardkit's code before OSS's
    agreement: no step hook (instance or global, pre or post: nothing of the script's runs
    inside ``OSS.agreed_in_advance``) but shardkit's own checks (:func:`_refuse_direct_step`;
    the global ones FSDP registers once a process builds a unit, as a ZeRO-3 reference model
    beside a ZeRO-2 actor does), and ``step`` itself OSS's, or torch's scheduler's counting
    wrapper around OSS's own (:func:`_is_schedulers_wrapper_of_oss_step`). Where torch keeps
    its hooks elsewhere than this reads, False (OSS then agrees on its own, as before)."""
    from torch.optim import optimizer as torch_optimizer
    hook_tables = [getattr(optimizer, "_optimizer_step_pre_hooks", None),
                   getattr(optimizer, "_optimizer_step_post_hooks", None),
                   getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
                   getattr(torch_optimizer, "_global_optimizer_post_hooks", None)]
    if not all(isinstance(table, Mapping) for table in hook_tables):
        return False
    hooks = [hook for table in hook_tables for hook in table.values()]
    if not all(_is_shardkit_function(hook) for hook in hooks):
        return False
    own_step = optimizer.__dict__.get("step")
    return type(optimizer).step is OSS.step and \
        (own_step is None or _is_schedulers_wrapper_of_oss_step(own_step))


def _is_schedulers_wrapper_of_oss_step(step) -> bool:
    """Whether ``step``, set on an OSS instance, is the wrapper a torch ``LRScheduler`` puts
    there around OSS's own ``step`` (it only notes that the optimizer stepped). That wrapper
    calls whatever ``step`` the instance held when the scheduler was built, which
    ``functools.wraps`` records: a script's own ``step`` set before (a warmup that sets the
    learning rate in it) runs under the same mark, and is the script's code."""
    return bool(getattr(step, "_wrapped_by_lr_sched", False)) and \
        getattr(step, "__wrapped__", None) is OSS.step


def _is_shardkit_function(hook) -> bool:
    """Whether ``hook`` is a plain function defined in shardkit (a check of its own, which
    changes no setting), not the script's."""
    return inspect.isfunction(hook) and (hook.__module__ or "").startswith("shardkit.")


def _write_atomically(state: dict, path: str) -> Optional[str]:
    """``torch.save`` of ``state`` (tensors on CPU; a module's ``get_extra_state()`` object
    as it is, as torch's ``state_dict`` holds it) to ``path`` through a temporary file renamed
    into place; returns the error's text instead of raising (any error: the caller's other
    ranks wait to hear the outcome), and leaves no temporary behind."""
    from shardkit.checkpoint.file_writes import save_torch_file
    staging = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_torch_file({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                         for k, v in state.items()}, staging)  # a full disk named as such
        os.replace(staging, path)
        return None
    except Exception as error:  # noqa: BLE001 - an unpicklable extra state too, not only I/O
        return f"{type(error).__name__}: {error}"
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _note_step_taken_for(lr_scheduler) -> None:
    """At stages 1-2 OSS steps for the optimizer a torch scheduler was built on (it shares that
    optimizer's param groups), so that optimizer's own ``step`` never runs; mark it stepped
    the way torch's scheduler checks, or its first ``step`` warns that it came before any
    optimizer step."""
    optimizer = getattr(lr_scheduler, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer._opt_called = True


def _is_floating_weight(name: str, value) -> bool:
    """A floating parameter or buffer of a ``state_dict``, which the 16-bit export casts; not a
    module's ``get_extra_state()`` object, even a float tensor (its own format, which
    ``set_extra_state`` reads back, as DeepSpeed writes it)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() \
        and not name.endswith("_extra_state")


def _check_builds_from_the_optimizer(lr_scheduler) -> None:
    """A callable ``lr_scheduler=`` (a scheduler class, a factory) is called with the optimizer
    alone, as DeepSpeed calls it: one whose signature needs more arguments is a ``TypeError``
    naming it and the way to bind them, before anything is built. Local."""
    try:
        signature = inspect.signature(lr_scheduler)
    except (TypeError, ValueError):  # a builtin without a signature: left to the call
        return
    try:
        signature.bind(object())
    except TypeError as error:
        name = getattr(lr_scheduler, "__name__", type(lr_scheduler).__name__)
        raise TypeError(f"initialize(lr_scheduler={name}): it is called with the optimizer "
                        f"alone (as DeepSpeed calls it), but {name}{signature} cannot be "
                        f"({error}); pass functools.partial({name}, <its other arguments>) or "
                        f"a function of the optimizer") from None


def _is_scheduler_instance(lr_scheduler) -> bool:
    """A built scheduler (``step`` and ``state_dict``); a scheduler class is a callable that
    builds one from the optimizer, as DeepSpeed takes ``lr_scheduler=MyScheduler``."""
    return lr_scheduler is not None and not isinstance(lr_scheduler, type) \
        and hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")


# ----------------------------------------------------------------------------- composition


def compose_from_config(model: nn.Module, recipe: Optional[OptimizerRecipe], cfg: EngineConfig,
                        wrap_policy: Optional[Callable] = None,
                        process_group=None, param_init_fn: Optional[Callable] = None,
                        agree_across_ranks: bool = True) -> Composition:
    """The stage's wrappers, built by :func:`shardkit.recipes.compose` from the config's
    choices, over ``process_group`` (the data-parallel group; ``None``: the world). DeepSpeed
    counts ``reduce_bucket_size`` in elements; ShardedDataParallel's bucket is in bytes of the
    (fp32) gradients, so the size is converted here, once. ``agree_across_ranks``: compose's
    (``False`` when the caller's ranks have agreed already, as :func:`initialize` does)."""
    kwargs = _compose_arguments(model, recipe, cfg, wrap_policy, param_init_fn)
    # torch DDP's all-reduce (stages 0-1) goes through shardkit's averaging hook, so that a
    # CommCounter around a step shows the stage's bytes (DESIGN.md's per-stage formulas).
    return compose(model, cfg.zero.stage, recipe, count_ddp_comm=True,
                   process_group=process_group, agree_across_ranks=agree_across_ranks, **kwargs)


def _compose_arguments(model: nn.Module, recipe: Optional[OptimizerRecipe], cfg: EngineConfig,
                       wrap_policy: Optional[Callable], param_init_fn: Optional[Callable]) -> dict:
    """:func:`shardkit.recipes.compose`'s keyword arguments for the config (beside the stage,
    the recipe and the group); a ValueError for ``param_init_fn`` below stage 3. Local."""
    zero = cfg.zero
    kwargs: dict = {}
    if zero.stage == 3:
        kwargs["param_init_fn"] = param_init_fn
    elif param_init_fn is not None:
        raise ValueError(f"initialize(param_init_fn=...): it materializes a model built on the "
                         f"meta device unit by unit at ZeRO stage 3; this config has stage "
                         f"{zero.stage}, which keeps the whole model on every rank")
    if recipe is None and zero.stage < 3:  # forward only: the model whole, nothing reduced
        return kwargs
    if zero.stage == 3 and recipe is not None:
        _refuse_sequence_parallel_at_stage3(model)
    if zero.stage in (0, 1):
        kwargs["find_unused_parameters"] = zero.ignore_unused_parameters
    left_out = _left_out_of_optimizer(model, recipe)
    if zero.stage == 1:
        # the owners' hook needs every reduced gradient in OSS's partition: with some trainable
        # parameters outside the optimizer, torch DDP's all-reduce (see initialize's note)
        kwargs["reduce_to_owners"] = zero.reduce_to_owners and not left_out
    if zero.stage == 2 and left_out:
        raise ConfigError(
            f"initialize: zero_optimization.stage=2 reduces each gradient onto the rank whose "
            f"optimizer shard steps it, so every trainable parameter must be in the optimizer, "
            f"and {_shown(left_out)} are not (model_parameters=... or the optimizer's param "
            f"groups leave them out); set requires_grad=False on them before initialize (they "
            f"are not trained either way), add them to the optimizer, or use "
            f"zero_optimization.stage 0, 1 or 3")
    if zero.stage == 2 and zero.reduce_bucket_numel is not None:
        grad_bytes = next(model.parameters()).element_size()
        kwargs["reduce_bucket_bytes"] = zero.reduce_bucket_numel * grad_bytes
    if zero.stage == 3:  # the FSDP units' choices
        kwargs.update(wrap_policy=wrap_policy,
                      offload="cpu" in (zero.offload_param_device, zero.offload_optimizer_device),
                      quantize_weights=zero.quantized_weights,
                      quantize_gradients=zero.quantized_gradients,
                      hpz_partition_size=zero.hpz_partition_size)
    if cfg.communication_dtype is not None:
        kwargs["reduce_dtype"] = _HALF_DTYPES[cfg.communication_dtype]
    return kwargs


def _left_out_of_optimizer(model: nn.Module, recipe: Optional[OptimizerRecipe]) -> list[str]:
    """Names of ``model``'s trainable parameters that the optimizer built from ``recipe`` does
    not step (``model_parameters=...`` or a passed optimizer covering only some of them, as
    DeepSpeed allows: the others get gradients and are never updated); ``[]`` when it steps
    them all or there is no optimizer. Local."""
    if recipe is None:
        return []
    groups = recipe.instance.param_groups if recipe.instance is not None \
        else recipe.param_groups
    if groups is None:  # every trainable parameter
        return []
    stepped = set()
    for group in groups:
        params = group["params"] if isinstance(group, Mapping) else group
        params = [params] if isinstance(params, torch.Tensor) else params
        # torch's optimizers also take (name, parameter) pairs (model.named_parameters())
        stepped.update(id(p[1] if isinstance(p, tuple) else p) for p in params)
    return [name for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in stepped]


def _refuse_sequence_parallel_at_stage3(model: nn.Module) -> None:
    """Stage 3 cannot sum the gradients of sequence-parallel parameters over the
    tensor-parallel group (FSDP flattens them into its shards, whose gradients it reduces over
    the data-parallel group only): a ConfigError naming them, rather than partial gradients.
    Local."""
    marked = [name for name, p in model.named_parameters()
              if getattr(p, "sequence_parallel", False)]
    if marked:
        raise ConfigError(f"initialize: zero_optimization.stage=3 with sequence parallelism: "
                          f"{_shown(marked)} are marked sequence_parallel, and their gradients "
                          f"must be summed over the tensor-parallel group, which stage 3's "
                          f"sharded gradients cannot be; use stage 0, 1 or 2 (the engine sums "
                          f"them before each step), or build the layers without "
                          f"sequence_parallel")


def _shown(names: list[str], limit: int = 6) -> str:
    """``names`` for a message: the first ``limit``, then how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


def _checks_of_compose(model: nn.Module, recipe: Optional[OptimizerRecipe], cfg: EngineConfig,
                       wrap_policy: Optional[Callable], param_init_fn: Optional[Callable]) -> None:
    """What :func:`shardkit.recipes.compose` would refuse for this config, raised here. Local."""
    kwargs = _compose_arguments(model, recipe, cfg, wrap_policy, param_init_fn)
    kwargs.pop("reduce_bucket_bytes", None)  # compose's own, not a check's
    check_composable(model, cfg.zero.stage, recipe, **kwargs)


# Config sections that only log or profile: a rank may name its own output there.
_PER_RANK_SECTIONS = frozenset({"tensorboard", "wandb", "csv_monitor", "comms_logger",
                                "flops_profiler", "wall_clock_breakdown", "steps_per_print",
                                "autotuning", "memory_breakdown", "dump_state"})
# Leaf keys a rank may set to its own value anywhere in the config: accepted without effect
# (offload to NVMe is refused; with device "cpu" a per-node or per-rank nvme_path is common).
_PER_RANK_KEYS = frozenset({"nvme_path"})


def _flat_config(raw, prefix: str = "config") -> dict:
    """``{"config.a.b": repr(value)}`` for every leaf of the config the caller gave, to compare
    between ranks (lists as one leaf; long values shortened to a digest), without the
    logging and profiling sections (:data:`_PER_RANK_SECTIONS`). Local."""
    out: dict = {}
    for key, value in (raw or {}).items():
        if prefix == "config" and key in _PER_RANK_SECTIONS:
            continue
        if key in _PER_RANK_KEYS:
            continue
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            out.update(_flat_config(value, name))
            continue
        text = stable_repr(value)
        if len(text) > 120:
            text = f"{text[:80]}... (sha1 {hashlib.sha1(text.encode()).hexdigest()[:12]})"
        out[name] = text
    return out


# ----------------------------------------------------------------------------- engine


_NO_FORWARD = object()


class ShardedEngine(DeepSpeedAccessors, nn.Module):
    """The object ``initialize`` returns: call it, ``backward`` the loss, ``step``.

    Gradient accumulation: ``backward`` divides the loss by ``gradient_accumulation_steps``
    (and multiplies it by the fp16 loss scale) and suppresses the gradient reduction except on
    the last micro-batch; ``step`` runs the optimizer, scheduler and loss scaler only at that
    boundary, then zeroes the gradients. Memory and communication are those of the stage's
    wrappers (module docstring); the engine adds one all-reduced flag per step under fp16 and
    bf16 (the overflow check).

    Attributes:
        module: the user's model (at stage 3 its blocks are FSDP units).
        wrapped: the outermost wrapper (DDP, ShardedDataParallel or FSDP).
        optimizer, lr_scheduler, loss_scaler: the composed parts (``None`` when unused;
            ``optimizer`` is ``None`` for a forward-only engine, built without one: then
            ``backward`` and ``step`` raise, see the module docstring). As on DeepSpeed's
            optimizers, ``optimizer.loss_scale`` and ``optimizer.cur_scale`` hold the loss scale
            (unless the optimizer's class defines that name itself).
        global_steps: optimizer steps taken (skipped fp16 steps included, as in DeepSpeed).
        micro_steps, skipped_steps: micro-batches seen; steps skipped on overflow.
        training_dataloader, collate_fn: the loader ``initialize(training_data=...)`` built
            (``None`` without one) and its ``collate_fn`` (:meth:`deepspeed_io`'s default).

    DeepSpeed's accessors: ``zero_optimization_stage()``, ``zero_optimization()``,
    ``gradient_accumulation_steps()``, ``train_batch_size()``,
    ``train_micro_batch_size_per_gpu()``, ``get_batch_info()``, ``gradient_clipping()``,
    ``get_lr()``, ``get_mom()``, ``get_global_grad_norm()``, ``was_step_applied()``,
    ``fp16_enabled()``, ``bfloat16_enabled()``, ``steps_per_print()``, ``loss_scale``,
    ``global_samples``, ``global_rank``, ``local_rank``, ``world_size``, ``dp_world_size``,
    ``mp_world_size``, ``device``; and ``no_sync()``, ``set_gradient_accumulation_boundary()``,
    ``deepspeed_io()``, ``module_state_dict()``, ``load_module_state_dict()``,
    ``save_fp16_model()`` (the older name of ``save_16bit_model``); between training and
    generation (RLHF), ``empty_partition_cache()`` and ``offload_states()`` /
    ``reload_states()``.
    """

    def __init__(self, model: nn.Module, composition: Composition, cfg: EngineConfig,
                 lr_scheduler=None, state_names: Optional[list] = None,
                 trainable_param_names: Optional[list] = None,
                 frozen_param_names: Optional[list] = None,
                 model_parallel: Optional[ModelParallelGroups] = None):
        super().__init__()
        self.module = model
        self.model_parallel = model_parallel
        # parameters of sequence-parallel regions: their gradients cover this tensor-parallel
        # rank's part of the sequence until summed over the group (before each step)
        self._sums_sequence_parallel_grads = composition.stage < 3 and any(
            getattr(p, "sequence_parallel", False) for p in model.parameters())
        if self._sums_sequence_parallel_grads:  # tell a script's clipping from a new backward
            from shardkit.nn.model_parallel.sequence_parallel import (
                watch_sequence_parallel_grads)
            watch_sequence_parallel_grads(model)
        # Names of the unwrapped model, recorded before wrapping (FSDP renames and flattens).
        self._state_names = list(state_names or _state_names_of(model))
        trainable, frozen = _names_by_trainability(model)
        self.trainable_param_names = list(
            trainable if trainable_param_names is None else trainable_param_names)
        self.frozen_param_names = list(frozen if frozen_param_names is None else frozen_param_names)
        self.wrapped = composition.wrapped
        self.config = cfg
        self.composition = composition
        self.optimizer = composition.optimizer
        if self.optimizer is not None:  # DeepSpeed's optimizer.overflow before a first step
            self.optimizer.overflow = False
        _guard_direct_steps(self)
        _expose_offload_on_optimizer(self)
        self._export_serial = engine_export.next_engine_serial()
        # bumped on every rank wherever the weights may change (a step, direct or not; a load):
        # keeps save_16bit_model's outcome of one state apart from another's
        self._weights_version = 0
        self._save_calls = engine_export.SaveCalls()
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = _loss_scaler(cfg)
        self._publish_loss_scale()
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        # samples and steps before the last set_train_batch_size (global_samples counts on)
        self._samples_before_resize = self._steps_before_resize = 0
        self._autocast_dtype = _HALF_DTYPES.get(cfg.precision.dtype)
        self._device_type = next(model.parameters()).device.type
        # the losses since the last log line, summed on their device: read (one host sync)
        # only when a line is printed, never per micro-batch
        self._loss_sum: Optional[torch.Tensor] = None
        self._losses_counted = 0
        self._clock = time.perf_counter()
        self._steps_at_clock = 0
        self._pending_save = None  # an asynchronous save under way (checkpoint.async_save)
        # offload_states(): {id(host copy): (host copy, device it came from)}; None: not offloaded
        self._offloaded_optimizer_state: Optional[dict] = None
        self._last_grad_norm: Optional[torch.Tensor] = None  # read lazily: no device sync a step
        self._last_step_applied = False
        self._boundary_override: Optional[bool] = None
        self._no_sync_depth = 0  # how many engine.no_sync() contexts are open
        # the boundary backward ran inside engine.no_sync(): its gradients were never averaged
        self._boundary_unreduced = False
        # the class name of the optimizer the script passed (None: built from the config)
        self.client_optimizer_name: Optional[str] = None
        # engine forwards since the last backward: none means the script called the model
        # itself (DeepSpeed's GAN example), so torch DDP's hooks were never armed (stages 0-1)
        self._forwards_since_backward = 0
        # engine forwards and backwards since the last step(): a boundary step after none of
        # the latter means the script ran loss.backward() itself (DeepSpeed's PyTorch-style
        # backward): no loss scale was applied, and at stages 0-1 nothing was reduced unless
        # the forward ran through DDP
        self._forwards_since_step = self._backwards_since_step = 0
        # the backward of a reducing training pass ran since the ranks last agreed on a step:
        # the next forward (or backward) first checks that no other rank stepped meanwhile
        # (_agree_on_step)
        self._awaiting_step = False
        # leaf tensors the forward returned as is -> [armed] (see _arm_leaf_output)
        self._armed_leaf_outputs = WeakIdKeyDictionary()
        # stages 0-1 under torch DDP without find_unused_parameters: the trainable parameters
        # a gradient reached in the current reducing backward (see _refuse_unused_parameters)
        self._grads_arrived: Optional[set] = self._watch_gradient_arrivals()
        # stages 0-2: the parameters the wrappers and the optimizer were built over (stage 3's
        # FSDP refuses a changed parameter itself), by identity (a wrapper applied later, such
        # as torch's activation checkpointing, renames them). Held strongly, so that an id here
        # is never reused by a new parameter: a weak reference would make torch.utils.
        # swap_tensors (load_state_dict and .to() under torch.__future__'s
        # set_swap_module_params_on_conversion) refuse every parameter; one the script removes
        # from the model is let go at the next forward (_forget_parameters_removed)
        self._params_at_initialize: Optional[dict] = None
        if self.optimizer is not None and composition.stage < 3:
            self._params_at_initialize = {id(p): (p, p.shape) for p in model.parameters()}
        from shardkit.utils.tensor_fragment import register_engine
        register_engine(self)  # deepspeed.utils.safe_* find the engine of a parameter
        if composition.stage == 3:  # DeepSpeed's ds_id / ds_status / ds_shape on the shards
            from shardkit.zero import expose_ds_attributes, placeholder_state_dict
            expose_ds_attributes(model)
            placeholder_state_dict(model, self.wrapped)
        # DeepSpeed's throughput timer (DeepSpeed-Chat ticks its epoch count)
        self.tput_timer = ThroughputTimer(cfg.train_batch_size)

    def __getattr__(self, name: str):
        # DeepSpeed's engine forwards unknown attributes to the model (engine.config_class,
        # a custom method of the user's model)
        try:
            value = attribute_through(self, name, "module")
        except AttributeError as error:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or not str(error).endswith(f"has no attribute '{name}'") \
                    or hasattr(type(module), name):  # a property of the module that raised
                raise
            # name the engine the script asked, not only the model the lookup fell through to
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}', nor has its module "
                f"(a {type(module).__name__}); shardkit's engine has the DeepSpeed engine "
                f"methods listed in help(shardkit.engine.ShardedEngine)") from None
        composition = self.__dict__.get("composition")
        if (composition is not None and composition.stage == 3 and name.startswith("forward")
                and self._in_root_unit(getattr(value, "__self__", None))):
            # the method's name, docstring and signature (inspect follows __wrapped__)
            return functools.update_wrapper(
                functools.partial(self._forward_through_root, value), value)
        return value

    def _in_root_unit(self, owner) -> bool:
        """Whether ``owner`` (what a method is bound to) is the model or a module of it outside
        the nested FSDP units: a wrapper around the model (PEFT's ``PeftModel``,
        ``torch.compile``'s ``OptimizedModule``) hands out its inner model's methods. Local."""
        from shardkit.nn.data_parallel import FullyShardedDataParallel
        module = self.__dict__["_modules"].get("module")
        if not isinstance(owner, nn.Module) or module is None:
            return False
        stack = [module]
        while stack:
            current = stack.pop()
            if current is owner:
                return True
            stack.extend(child for child in current.children()
                         if not isinstance(child, FullyShardedDataParallel))
        return False

    def _forward_through_root(self, method, *args, **kwargs):
        """Stage 3: the model's ``forward_*`` method (DeepSpeed-Chat's ``forward_value``) run
        as the root FSDP unit's forward (through the engine's forward, its precision context
        included), so the root's parameters are gathered for it and their gradients reach the
        shards. The method runs once in place of ``module.forward``, which it may call
        itself. Costs what the engine's forward costs."""
        module = self.module
        before = module.__dict__.get("forward", _NO_FORWARD)

        def restore():
            if before is _NO_FORWARD:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before

        def run_method(*a, **k):
            restore()
            return method(*a, **k)

        module.forward = run_method
        try:
            return self.forward(*args, **kwargs)
        finally:
            restore()

    # -- properties DeepSpeed users reach for
    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag on the wrapped model (torch DDP, ShardedDataParallel or FSDP), for
        scripts written for torch DDP that accumulate with ``model.require_backward_grad_sync
        = (micro_step == last)`` and call ``loss.backward()`` themselves (nanoGPT): ``False``
        makes the following backward passes accumulate locally, as :meth:`no_sync` does. With
        ``gradient_accumulation_steps`` above 1 such a script's ``optimizer.step()`` is
        refused, and a boundary ``engine.step()`` after an ``engine.backward`` run with it
        ``False`` is refused, as inside :meth:`no_sync`. Set it alike on every rank. Local."""
        return bool(getattr(self.wrapped, "require_backward_grad_sync", True))

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"engine.require_backward_grad_sync = {value!r}: expected True or "
                            f"False")
        if hasattr(self.wrapped, "require_backward_grad_sync"):
            self.wrapped.require_backward_grad_sync = value

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the config chose (0-3)."""
        return self.composition.stage

    # Methods, not properties: DeepSpeed's engine spells them as calls.
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3), as DeepSpeed's engine reports it."""
        return self.composition.stage

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's, after the batch-size arithmetic)."""
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    @property
    def loss_scale(self) -> LossScaleReading:
        """The fp16 loss scale now (1.0 without fp16 loss scaling); a float that DeepSpeed
        scripts may also call, ``engine.loss_scale()`` (:class:`LossScaleReading`)."""
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        return LossScaleReading(scale)

    def _publish_loss_scale(self) -> None:
        """DeepSpeed's fp16 and ZeRO optimizers carry the loss scale as ``optimizer.cur_scale``
        and ``optimizer.loss_scale``, which training scripts log (DeiT's and BEiT's
        ``get_loss_scale_for_deepspeed(model)`` reads ``model.optimizer.loss_scale``, else
        ``cur_scale``): set on the engine's optimizer whenever the scale may change. A name the
        optimizer's class defines itself (a read-only property, a method) is its own and left
        as it is: setting it raised AttributeError in initialize, or shadowed the method. Local."""
        if self.optimizer is None:
            return
        for name in ("loss_scale", "cur_scale"):
            if not hasattr(type(self.optimizer), name):
                setattr(self.optimizer, name, self.loss_scale)

    def module_state_dict(self, destination: Optional[dict] = None, prefix: str = "",
                          keep_vars: bool = False, exclude_frozen_parameters: bool = False) -> dict:
        """The unwrapped model's full fp32 ``state_dict`` (stage 3: gathered by FSDP, a
        collective on every rank; memory: the full model on each rank). Under tensor
        parallelism the unsplit model's (:func:`shardkit.nn.model_parallel.full_state.
        full_model_state_dict`: one all-gather per split parameter over the tensor-parallel
        group, on every rank). DeepSpeed's arguments: ``prefix`` goes before every key,
        ``destination`` (a dict) receives the entries and is returned, ``keep_vars`` is
        ``nn.Module.state_dict``'s at stages 0-2 without tensor parallelism (elsewhere the
        values are gathered copies whatever it says), ``exclude_frozen_parameters`` leaves out
        the parameters that do not require grad. A bad argument is a ValueError on every rank
        before any collective. Where it gathers (stage 3, tensor parallelism), a rank owing a
        step first joins the step agreement, as :meth:`save_checkpoint` does."""
        return self._module_state_dict_for("engine.module_state_dict()", destination, prefix,
                                           keep_vars, exclude_frozen_parameters)

    def _module_state_dict_for(self, call: Optional[str], destination: Optional[dict] = None,
                               prefix: str = "", keep_vars: bool = False,
                               exclude_frozen_parameters: bool = False) -> dict:
        """:meth:`module_state_dict`, which ``call`` asked for: where the state is gathered,
        ``call`` joins the step agreement first (:meth:`_agree_on_step_skipped`), unless it
        is None (its caller joined it already)."""
        if destination is not None and not isinstance(destination, dict):
            raise ValueError(f"engine.module_state_dict(destination={type(destination).__name__}"
                             f"): expected a dict (it receives the entries) or None")
        if not isinstance(prefix, str):
            raise ValueError(f"engine.module_state_dict(prefix={prefix!r}): expected a str")
        for name, value in (("keep_vars", keep_vars),
                            ("exclude_frozen_parameters", exclude_frozen_parameters)):
            if not isinstance(value, bool):
                raise ValueError(f"engine.module_state_dict({name}={value!r}): expected True "
                                 f"or False")
        excluded = frozenset()
        if exclude_frozen_parameters:
            from shardkit.checkpoint.engine_state import _frozen_state_names
            excluded = _frozen_state_names(self)
        # the gather would meet a stepping rank's agreement
        if self._gathers_full_weights and call is not None:
            self._agree_on_step_skipped(call, keeps_step_owed=True)
        if self.model_parallel is not None:
            from shardkit.nn.model_parallel.full_state import full_model_state_dict
            state = full_model_state_dict(self.wrapped if self.zero_stage == 3 else self.module)
        elif self.zero_stage == 3:
            state = self.wrapped.state_dict()
        else:
            state = self.module.state_dict(keep_vars=keep_vars)
        out = destination if destination is not None else type(state)()
        for key, value in state.items():
            if key not in excluded:
                out[prefix + key] = value
        return out

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True,
                               custom_load_fn: Optional[Callable] = None,
                               fetch_z3_params: bool = False, z3_params_to_fetch=None,
                               allowed_missing_keys=None):
        """DeepSpeed's: load ``checkpoint["module"]`` (a full ``state_dict`` of the unwrapped
        model, as :meth:`module_state_dict` returns) into the model on every rank: at stage 3
        each rank keeps its shard of every tensor, under tensor parallelism its slices.
        ``strict`` is torch's; ``allowed_missing_keys`` (an iterable of keys) may be missing
        from a strict load. ``custom_load_fn(src=state, dst=engine.module)`` replaces the load
        at stages 0-2 (stage 3: a ValueError, the module holds shards there).
        ``fetch_z3_params`` / ``z3_params_to_fetch`` are accepted and have no effect (the load
        already writes whole tensors). Keys are checked on every rank before any collective: a
        missing or unexpected key under ``strict`` is a RuntimeError naming them. Collective at
        stage 3 (FSDP's load) and under tensor parallelism; memory: the state given."""
        del fetch_z3_params, z3_params_to_fetch  # DeepSpeed's ZeRO-3 gather: nothing to do
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("module"), dict):
            raise ValueError("engine.load_module_state_dict(checkpoint=...): expected a dict "
                             "whose 'module' entry is the model's state_dict (DeepSpeed's "
                             "layout, e.g. {'module': engine.module_state_dict()})")
        if not isinstance(strict, bool):
            raise ValueError(f"engine.load_module_state_dict(strict={strict!r}): expected True "
                             f"or False")
        state = checkpoint["module"]
        if custom_load_fn is not None:
            if self.zero_stage == 3:
                raise ValueError("engine.load_module_state_dict(custom_load_fn=...): not "
                                 "supported at zero_optimization.stage=3, where engine.module "
                                 "holds parameter shards; load a full state_dict without it")
            custom_load_fn(src=state, dst=self.module)
            return None
        allowed = set(allowed_missing_keys or ())
        own = set(self.module_state_names())
        missing = sorted(own - set(state) - allowed)
        unexpected = sorted(set(state) - own)
        if strict and (missing or unexpected):
            raise RuntimeError(f"engine.load_module_state_dict: the checkpoint's module state "
                               f"does not match the model: missing keys {missing[:8]}"
                               f"{' ...' if len(missing) > 8 else ''}, unexpected keys "
                               f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if self.model_parallel is not None:
            from shardkit.nn.model_parallel.full_state import load_full_model_state_dict
            if set(state) != own:
                raise RuntimeError("engine.load_module_state_dict: under tensor parallelism "
                                   "the module state must hold exactly the model's keys")
            load_full_model_state_dict(self.wrapped if self.zero_stage == 3 else self.module,
                                       state)
            return None
        target = self.wrapped if self.zero_stage == 3 else self.module
        return target.load_state_dict(state, strict=strict and not allowed)

    def module_state_names(self) -> list[str]:
        """The ``state_dict`` keys of the unwrapped model (what a checkpoint stores)."""
        return list(self._state_names)

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer parameter group (``[]`` without an optimizer,
        as DeepSpeed returns)."""
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def gradient_clipping(self) -> float:
        """The config's ``gradient_clipping`` (0: off)."""
        return self.config.gradient_clipping

    def get_global_grad_norm(self) -> Optional[float]:
        """The total gradient norm (over every rank, before clipping) of the last optimizer
        step, as DeepSpeed reports it: measured at ZeRO stages 1-3 and with fp16/bf16 whether
        or not ``gradient_clipping`` is set (one all-reduce of one element a step), at stage 0
        in fp32 only when clipping (else ``None``: no extra pass). ``None`` also before the
        first step and after a skipped step (fp16, or bf16 with inf/nan gradients)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def _measures_grad_norm(self) -> bool:
        return self.zero_stage > 0 or self.config.precision.dtype != "fp32"

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` stepped the optimizer, as in DeepSpeed: ``False``
        after a ``step()`` inside an accumulation window (no update), when inf/nan gradients
        skipped the boundary's step under fp16 or bf16, and before the first ``step()``."""
        return self._last_step_applied

    @property
    def global_samples(self) -> int:
        """Samples consumed by the optimizer steps taken: ``global_steps x train_batch_size``
        (each step at the batch size it ran with, after ``set_train_batch_size``)."""
        return self._samples_before_resize + \
            (self.global_steps - self._steps_before_resize) * self.config.train_batch_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group."""
        return distributed.get_rank()

    @property
    def world_size(self) -> int:
        """Ranks in the default process group."""
        return distributed.get_world_size()

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without it)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def device(self) -> torch.device:
        """Where the model's parameters (and so the batches) live."""
        return next(self.module.parameters()).device

    @property
    def dp_world_size(self) -> int:
        """Ranks the batch is split over: the data-parallel group's (every rank without
        tensor parallelism)."""
        if self.model_parallel is not None:
            return self.model_parallel.data_size
        return distributed.get_world_size()

    @property
    def checkpoint_group(self):
        """The ranks that write one checkpoint directory together: the data-parallel group
        under tensor parallelism (each tensor-parallel rank's slices go to ``TAG/mp_rank_XX``),
        ``None`` (the world) otherwise."""
        return None if self.model_parallel is None else self.model_parallel.data_group

    @property
    def mp_world_size(self) -> int:
        """Ranks that split each tensor-parallel layer (1 without tensor parallelism)."""
        return 1 if self.model_parallel is None else self.model_parallel.tensor_size

    def fp16_enabled(self) -> bool:
        """Whether the config's ``fp16.enabled`` runs the model in fp16 with loss scaling."""
        return self.config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        """Whether the config's ``bf16.enabled`` runs the model in bf16."""
        return self.config.precision.dtype == "bf16"

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage (1-3) shards anything."""
        return self.composition.stage > 0

    def steps_per_print(self) -> int:
        """Optimizer steps between two log lines (the config's ``steps_per_print``)."""
        return self.config.steps_per_print

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return (self.config.train_batch_size, self.config.train_micro_batch_size_per_gpu,
                self.config.gradient_accumulation_steps)

    def get_mom(self) -> list:
        """Each parameter group's momentum: Adam's ``betas``, else SGD's ``momentum`` (``[]``
        without an optimizer, as DeepSpeed returns)."""
        if self.optimizer is None:
            return []
        return [group["betas"] if "betas" in group else group.get("momentum")
                for group in self.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-batch whose ``step`` will run the optimizer (unless
        :meth:`set_gradient_accumulation_boundary` decided it)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Decide by hand whether the coming micro-batches end an accumulation window (``True``:
        ``backward`` reduces and ``step`` steps; ``False``: neither), as DeepSpeed's engine
        allows for variable-length accumulation; ``None`` returns to counting micro-batches.
        Every rank must make the same choice (the reduction is a collective)."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"engine.set_gradient_accumulation_boundary({is_boundary!r}): "
                             f"expected True, False or None")
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """A context in which ``backward`` accumulates gradients locally without reducing them
        (the wrappers' ``no_sync``); the first backward outside it reduces everything.
        As in DeepSpeed, ``step()`` inside it is an error, and so is a boundary ``step()``
        whose last ``backward`` ran inside it: either would apply this rank's own, unaveraged
        gradients (at stage 0 the replicas would silently drift apart). No memory or
        communication of its own."""
        with self.composition.no_sync():
            self._no_sync_depth += 1
            try:
                yield
            finally:
                self._no_sync_depth -= 1

    # -- training
    def forward(self, *args, **kwargs):
        self.tput_timer.start()
        self._refuse_parameters_changed_since_initialize()
        starts_reducing_pass = self._agree_on_step_skipped_at_forward()
        self._forwards_since_backward += 1
        self._forwards_since_step += 1
        with self._precision_context(), self._reduction_context():
            output = self.wrapped(*args, **kwargs)
        if starts_reducing_pass:
            self._await_step_after_backward_of(output)
        return output

    def _refuse_parameters_changed_since_initialize(self) -> None:
        """Stages 0-2: a ValueError naming each trainable parameter of the model that was
        replaced by a new Parameter object, resized, or registered after ``initialize``
        (Hugging Face's ``resize_token_embeddings()`` or a new head called on
        ``engine.module``): torch DDP (stages 0-1) failed in backward with autograd's "invalid
        gradient" for a resized one and silently left a new one unaveraged and unstepped, as
        ShardedDataParallel (stage 2) did. Checked at each forward before the wrapper's, on
        every rank (each rank changing its model alike raises at the same forward, before any
        collective). Local: one pass over the parameters."""
        known = self._params_at_initialize
        if known is None:
            return
        changed, still_there = [], 0
        for name, p in self.module.named_parameters():
            was = known.get(id(p))  # the recorded parameter itself: held, its id is its own
            still_there += was is not None
            if not p.requires_grad:
                continue
            if was is None:
                changed.append(f"{name} (a Parameter registered after initialize, shape "
                               f"{tuple(p.shape)})")
            elif p.shape != was[1]:
                changed.append(f"{name} (resized from {tuple(was[1])} to {tuple(p.shape)})")
        if still_there < len(known):
            self._forget_parameters_removed()
        if changed:
            raise ValueError(
                f"engine forward: trainable parameter(s) {_shown(changed)} changed after "
                f"shardkit.initialize (zero_optimization.stage={self.composition.stage}), whose "
                f"optimizer and gradient reduction were built over the model as it was then "
                f"(a new parameter would be neither averaged nor stepped, a resized one no "
                f"longer fits the reduction buckets and optimizer state). Change the model "
                f"(resize_token_embeddings, new heads or adapters) before shardkit.initialize")

    def _forget_parameters_removed(self) -> None:
        """Drop the recorded parameters no longer in the model (a frozen embedding the script
        replaced), so that they are not kept alive here; should one come back, it is then
        refused as registered after ``initialize``."""
        present = {id(p) for p in self.module.parameters()}
        known = self._params_at_initialize
        for key in [key for key in known if key not in present]:
            del known[key]

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        the gradient reduction runs only on the boundary micro-batch. ``scale_wrt_gas=False``
        (DeepSpeed's, for a loss the script already divided, as Hugging Face's Trainer does)
        skips the division. Returns what DeepSpeed returns: the loss divided as the gradients
        were (``loss / gradient_accumulation_steps`` unless ``scale_wrt_gas=False``).
        No memory or communication beyond the backward's own. Without an optimizer: a
        RuntimeError on every rank, before any collective (see :meth:`_refuse_without_optimizer`).
        """
        self._refuse_without_optimizer("backward(loss)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward(loss): expected a scalar tensor, got "
                             f"{loss if not isinstance(loss, torch.Tensor) else loss.shape}")
        if not isinstance(scale_wrt_gas, bool):
            raise ValueError(f"engine.backward(scale_wrt_gas={scale_wrt_gas!r}): expected True "
                             f"or False")
        self._count_loss(loss)
        self._backwards_since_step += 1
        # a torch-DDP script's require_backward_grad_sync = False turns the reduction off too
        unsynced = self._no_sync_depth > 0 or not self.require_backward_grad_sync
        reducing = self.is_gradient_accumulation_boundary() and not unsynced
        if self.is_gradient_accumulation_boundary():
            self._boundary_unreduced = unsynced
        # stages 0-1 (torch DDP): a loss computed by calling the model itself bypassed DDP's
        # forward, so DDP reduces nothing; DeepSpeed averages the gradients in backward anyway
        model_called_by_script = reducing and self._forwards_since_backward == 0
        by_hand = model_called_by_script \
            and isinstance(self.wrapped, nn.parallel.DistributedDataParallel)
        self._forwards_since_backward = 0
        if model_called_by_script:  # no engine forward of this step met the check
            self._agree_on_step_skipped("engine.backward(loss)")
            self._awaiting_step = True
        divisor = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        factor = self.loss_scale / divisor
        scaled = loss.float() * factor if factor != 1.0 else loss
        watching = reducing and not by_hand and self._grads_arrived is not None
        if watching:
            self._grads_arrived.clear()
        with self._reduction_context():
            try:
                scaled.backward(retain_graph=retain_graph)
            except RuntimeError as error:
                raise _explained_backward_error(error, self.config.zero) from error
        if watching:
            self._refuse_unused_parameters()
        if by_hand:
            self._average_gradients_by_hand()
        return loss / divisor if divisor != 1 else loss

    def _watch_gradient_arrivals(self) -> Optional[set]:
        """Under torch DDP without ``find_unused_parameters`` (stages 0-1 with
        ``"ignore_unused_parameters": false``; not with DDP's ``static_graph``, which allows
        unused parameters) over more than one rank: a set that a hook on
        each trainable parameter fills with the parameter's id when its gradient is
        accumulated, so that :meth:`_refuse_unused_parameters` can tell after a reducing
        backward whether DDP's reduction finished. ``None`` elsewhere (nothing registered).
        A later engine over the same model replaces these hooks (they never pile up). Costs
        one Python call per parameter and backward; no communication."""
        ddp = self.wrapped
        if not isinstance(ddp, nn.parallel.DistributedDataParallel) \
                or getattr(ddp, "find_unused_parameters", True) \
                or getattr(ddp, "static_graph", False) \
                or distributed.get_world_size(ddp.process_group) == 1:
            return None
        arrived: set = set()
        self._arrival_hooks = {}  # name -> this engine's hook on the parameter
        for name, param in self._ddp_reduced_parameters():
            earlier = _ARRIVAL_HOOKS.pop(param, None)
            if earlier is not None:  # an earlier engine's: this one takes over
                earlier.remove()
            _ARRIVAL_HOOKS[param] = self._arrival_hooks[name] = \
                param.register_post_accumulate_grad_hook(
                    lambda p, arrived=arrived: arrived.add(id(p)))
        return arrived

    def _ddp_reduced_parameters(self) -> list:
        """``(name, parameter)`` for every parameter torch DDP reduces now: trainable and
        not in its ``parameters_to_ignore``."""
        ddp = self.wrapped
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        return [(name, p) for name, p in ddp.module.named_parameters()
                if p.requires_grad and name not in ignored]

    def _refuse_unused_parameters(self) -> None:
        """After a reducing backward under torch DDP without ``find_unused_parameters``:
        raise, before the step and before any further collective, when a trainable parameter
        got no gradient on this rank. DDP then never reduced that parameter's bucket (its
        error would come only at the next forward, after a step on this rank's own gradients
        of the whole bucket). A rank where every parameter got one is meanwhile still inside
        backward, where DDP waits for the buckets this rank never started reducing, until this
        process exits or the group times out. A parameter made trainable after ``initialize``
        is refused as such (DDP built its reducer without it and never averages its
        gradient). No communication."""
        trainable = self._ddp_reduced_parameters()
        late = [name for name, _ in trainable if name not in self._arrival_hooks]
        # a later engine over the same model took a parameter's hook over: not ours to judge
        trainable = [(name, p) for name, p in trainable if name not in late
                     and _ARRIVAL_HOOKS.get(p) is self._arrival_hooks[name]]
        if late:
            raise RuntimeError(
                f"engine.backward: {', '.join(late[:6])}"
                f"{f' and {len(late) - 6} more' if len(late) > 6 else ''} became trainable "
                f"after shardkit.initialize; torch DDP (stage {self.config.zero.stage}) built "
                f"its reducer then and never averages their gradients across ranks: set "
                f"requires_grad before initialize")
        missing = [name for name, p in trainable if id(p) not in self._grads_arrived]
        if not missing:
            return
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6
                                          else "")
        raise RuntimeError(
            f"engine.backward: zero_optimization.stage={self.config.zero.stage} with "
            f"\"ignore_unused_parameters\": false runs torch DDP without "
            f"find_unused_parameters, so every trainable parameter must get a gradient in each "
            f"reducing backward on every rank, but on rank {distributed.get_rank()} "
            f"{len(missing)} got none ({shown}; e.g. a head the loss does not use, or an "
            f"expert that received no tokens on this rank): DDP left their gradient buckets "
            f"unreduced and a step would apply this rank's own gradients. Set "
            f"\"ignore_unused_parameters\": true in zero_optimization (the default), freeze "
            f"those parameters (requires_grad=False) before initialize, or use stage 2 or 3")

    def _ddp_parameters(self) -> list:
        return [p for p in self.wrapped.module.parameters() if p.requires_grad]

    def _average_gradients_by_hand(self) -> None:
        """Average every trainable parameter's gradient over the data-parallel group, as DDP
        would have (absent ones count as zero, and stay ``None`` where every rank's is): one
        all-reduce of a flat buffer of Ψ elements, every rank the same parameters in the same
        order, so ranks whose forward left different parameters unused still agree. The buffer
        travels in ``communication_data_type`` when the config sets one (fp16/bf16: each
        gradient divided by the group size in fp32 first, then cast, as torch's fp16/bf16
        compression hooks and the wrappers' own 16-bit reductions do), else in the gradients'
        dtype. Costs DDP's all-reduce traffic (half of it in 16 bits) and one temporary
        Ψ-element buffer. A sparse gradient (an embedding with ``sparse=True``, stage 0)
        travels dense in that buffer and comes back sparse over the rows it touches on some
        rank."""
        params = self._ddp_parameters()
        group = self.wrapped.process_group
        size = distributed.get_world_size(group)
        if not params or size == 1:
            return
        wire = _HALF_DTYPES.get(self.config.communication_dtype)
        grads = [None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad
                 for p in params]
        if wire is None:
            dtype = grads[0].dtype if grads[0] is not None else params[0].dtype
            work = [g.to(dtype) if g is not None else torch.zeros_like(p, dtype=dtype)
                    for p, g in zip(params, grads)]
            distributed.all_reduce_as_one(work, group, divide_by=size)
        else:
            work = [(g.float() / size).to(wire) if g is not None
                    else torch.zeros_like(p, dtype=wire) for p, g in zip(params, grads)]
            distributed.all_reduce_as_one(work, group)
        for param, averaged in zip(params, work):
            if param.grad is None:
                if averaged.any():  # another rank's forward used it; nobody's did: stays None
                    param.grad = averaged.to(param.dtype)
            elif param.grad.is_sparse:
                param.grad = averaged.to(param.grad.dtype).to_sparse(param.grad.sparse_dim())
            elif averaged is not param.grad:  # reduced in another dtype
                param.grad.copy_(averaged)

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """At the accumulation boundary: (fp16) agree on overflow, unscale, clip, step the
        optimizer and scheduler (``scheduler.step(**lr_kwargs)``, DeepSpeed's argument), update
        the loss scale, zero gradients. Elsewhere: count. Without an optimizer, or at the
        boundary while any rank's optimizer state is offloaded (:meth:`offload_states`), or
        when only some ranks step (the others going on to their next training forward): a
        RuntimeError on every rank, before any collective of the step (the ranks agree first:
        one all-gather of six int64s a rank per boundary, in a world of several; see
        :meth:`_agree_on_step`). At stages 1-2 that exchange also carries OSS's agreements on
        its param groups before its clip and its step, which then make none of their own: one
        control all-gather a step in all. OSS's step still agrees on its own where a step hook
        of the script's is registered on the optimizer, and its clip and step with tensor
        parallelism (OSS over the data-parallel group only)."""
        self._refuse_without_optimizer("step()")
        if lr_kwargs is not None and not isinstance(lr_kwargs, dict):
            raise ValueError(f"engine.step(lr_kwargs={lr_kwargs!r}): expected a dict of keyword "
                             f"arguments for lr_scheduler.step(), or None")
        torch_backward = self._backwards_since_step == 0
        engine_direct_step.close_carried_step(self.optimizer)  # left open by a failed step
        if self.is_gradient_accumulation_boundary():
            agreed_in_advance = self._agree_on_step(carry=self._oss_calls_to_carry())
            if self.lr_scheduler is not None:  # the scheduler steps at the boundary only
                _check_lr_kwargs(self.lr_scheduler, lr_kwargs or {})
            self._check_gradients_reduced(torch_backward)
            self._optimizer_step(lr_kwargs or {}, loss_scaled=not torch_backward,
                                 agreed_in_advance=agreed_in_advance)
            self.tput_timer.stop(global_step=True)
            self.global_steps += 1
            self._maybe_print()
        else:
            self._last_step_applied = False  # DeepSpeed: a step inside the window applies nothing
        self._forwards_since_step = self._backwards_since_step = 0
        self.micro_steps += 1
        self._weights_version += 1

    def deepspeed_io(self, dataset, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: Optional[int] = None):
        """DeepSpeed's loader factory (what ``initialize(training_data=...)`` returns, and
        what scripts call for their evaluation data): a ``torch.utils.data.DataLoader`` over
        this data-parallel rank's share of ``dataset`` (a ``DistributedSampler`` over the
        data-parallel ranks; the tensor-parallel ranks of a replica read the same samples),
        ``batch_size`` samples a batch (default ``train_micro_batch_size_per_gpu``), the
        config's ``dataloader_drop_last``. As in DeepSpeed, ``route`` ``"eval"`` and
        ``"predict"`` read in order (``shuffle=False``), ``"train"`` and ``"encode"`` shuffled
        (the sampler's seed, the same order each epoch unless ``loader.sampler.set_epoch``);
        ``data_sampler`` replaces the sampler; ``collate_fn`` defaults to the one given to
        ``initialize``. ``pin_memory`` applies with CUDA only; ``num_local_io_workers`` is
        the loader's ``num_workers`` (default 0: loading in this process, where DeepSpeed
        starts 2 workers). A bad argument is a ValueError naming it. Local: no
        communication."""
        _check_dataset(dataset, "engine.deepspeed_io(dataset=", data_sampler)
        if route not in _IO_ROUTES:
            raise ValueError(f"engine.deepspeed_io(route={route!r}): valid routes are "
                             f"{list(_IO_ROUTES)}")
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"engine.deepspeed_io(batch_size={batch_size!r}): expected an "
                             f"integer >= 1, or None for train_micro_batch_size_per_gpu")
        workers = 0 if num_local_io_workers is None else num_local_io_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"engine.deepspeed_io(num_local_io_workers="
                             f"{num_local_io_workers!r}): expected an integer >= 0 or None")
        if collate_fn is None:
            collate_fn = self.__dict__.get("collate_fn")
        return _data_loader(dataset, self.config, collate_fn,
                            self.model_parallel, batch_size=batch_size,
                            shuffle=route not in ("eval", "predict"), sampler=data_sampler,
                            pin_memory=bool(pin_memory) and torch.cuda.is_available(),
                            num_workers=workers)

    def _refuse_without_optimizer(self, call: str) -> None:
        """DeepSpeed asserts "must provide optimizer during init in order to use backward"
        (and ``step``): an engine built without an optimizer runs forward only. Its gradients
        would have no one to step them, and at stages 0-2 the model is not wrapped for a
        gradient reduction at all, so training through it is refused rather than half-done.
        Local, so every rank raises it before any collective."""
        if self.optimizer is not None:
            return
        raise RuntimeError(
            f"engine.{call}: this engine has no optimizer (shardkit.initialize was called "
            f"without optimizer=... and without a config 'optimizer' section), so it runs "
            f"forward only, as DeepSpeed's does (a reference, reward or EMA model, inference); "
            f"to train it, pass optimizer=<torch optimizer> or add an 'optimizer' section to "
            f"the config")

    def _refuse_unreduced_step(self, call: str) -> None:
        """DeepSpeed's rule, checked on every rank before any collective: a boundary step
        (``call``) must follow a backward whose gradients were reduced (outside
        :meth:`no_sync`)."""
        if self._no_sync_depth > 0:
            raise RuntimeError(
                f"{call} was called inside engine.no_sync(): the gradients there are "
                "this rank's own, not averaged over the ranks, so the step would diverge from "
                "single-process training (as in DeepSpeed, this is not allowed); leave the "
                "no_sync() block, run the accumulation boundary's engine.backward(loss) "
                "outside it, then call engine.step()")
        if self._boundary_unreduced:
            raise RuntimeError(
                f"{call}: the accumulation boundary's engine.backward(loss) ran inside "
                "engine.no_sync() or with engine.require_backward_grad_sync = False, so its "
                "gradients were never averaged over the ranks and the step would apply this "
                "rank's own; run the last backward of each accumulation window outside "
                "no_sync() with require_backward_grad_sync True (it reduces everything "
                "accumulated before it)")

    def _check_gradients_reduced(self, torch_backward: bool,
                                 call: str = "engine.step()") -> None:
        """Before a boundary step (``engine.step()`` or a direct ``engine.optimizer.step()``):
        refuse gradients left unreduced (:meth:`_refuse_unreduced_step`), and at stages 0-1
        average those of a model the script called itself with ``loss.backward()``
        (``torch_backward``: no ``engine.backward`` since the last step), which torch DDP did
        not reduce. Local, or one all-reduce of the gradients where averaged by hand."""
        self._refuse_unreduced_step(call)
        if torch_backward and self._forwards_since_step == 0 and self._no_sync_depth == 0 \
                and isinstance(self.wrapped, nn.parallel.DistributedDataParallel):
            self._average_gradients_by_hand()  # model called and loss.backward() by hand

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every wrapped parameter (``None`` by default, as torch).
        No communication."""
        self.composition.zero_grad(set_to_none=set_to_none)

    def _optimizer_step(self, lr_kwargs: dict, loss_scaled: bool = True,
                        agreed_in_advance: Optional[dict] = None) -> None:
        """Step at the boundary; ``agreed_in_advance``: the OSS agreements the step agreement
        carried (:meth:`_agree_on_step`), whose calls here then skip their own exchange."""
        agreed_in_advance = agreed_in_advance or {}
        scale_before = self.loss_scale
        overflow = self._prepare_gradients_for_step(loss_scaled, agreed_in_advance)
        if not overflow:
            optimizer = self.optimizer
            _ENGINE_STEPPING[optimizer] = _ENGINE_STEPPING.get(optimizer, 0) + 1
            try:
                with self._in_oss_agreement(agreed_in_advance, "step"):
                    optimizer.step()
            finally:
                _ENGINE_STEPPING[optimizer] -= 1
            if self.lr_scheduler is not None:
                _note_step_taken_for(self.lr_scheduler)
                self.lr_scheduler.step(**lr_kwargs)
        self._update_loss_scale(overflow, scale_before)
        self._boundary_unreduced = False
        self.zero_grad()

    def _prepare_gradients_for_step(self, loss_scaled: bool, agreed_in_advance: dict) -> bool:
        """The boundary step's work on the gradients before the optimizer runs (also that of
        a direct ``engine.optimizer.step()``, :mod:`shardkit.engine_direct_step`): clear
        those the optimizer leaves out, sum sequence-parallel ones, agree on overflow (fp16,
        bf16 as configured), then unless it overflowed unscale them (``loss_scaled``: by the
        loss scale; times the data-parallel size under ``gradient_allreduce_op`` "sum") and
        clip or measure their norm (``gradient_clipping``). Returns whether the step
        overflowed and must be skipped. Communication: the overflow flag's one-element
        all-reduce and the clip's norm all-reduce, where configured."""
        for param in self._left_out():  # never stepped: kept out of the clip, never accumulated
            param.grad = None
        if self._sums_sequence_parallel_grads:  # (not again where the script summed them)
            from shardkit.nn.model_parallel import reduce_sequence_parallel_grads
            reduce_sequence_parallel_grads(self.module, unless_summed=True)
        overflow = self._agreed_overflow() if self.config.precision.check_grad_overflow \
            else False
        self._last_step_applied = not overflow
        # DeepSpeed's ZeRO and fp16 optimizers' flag: did the last step overflow (skipped)
        self.optimizer.overflow = overflow
        if overflow:
            self.skipped_steps += 1
            self._last_grad_norm = None
            return True
        factor = 1.0 / self.loss_scale if self.loss_scaler is not None and loss_scaled else 1.0
        if self.config.gradient_allreduce_op == "sum":  # the reduction averaged them
            factor *= self.dp_world_size
        if factor != 1.0:
            self._unscale_gradients(factor)
        max_norm = self._clip_max_norm()
        if max_norm is not None:
            with self._in_oss_agreement(agreed_in_advance, "clip_grad_norm"):
                norm = self._clip_grad_norm(max_norm)
            self._last_grad_norm = None if norm is None else torch.as_tensor(norm).detach()
        return False

    def _update_loss_scale(self, overflow: bool, scale_before: float) -> None:
        """Tell the fp16 loss scaler how the step went (an overflow backs the scale off) and
        publish the new scale on the optimizer; rank 0 logs a skipped step. Local."""
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
            self._publish_loss_scale()
        if overflow and distributed.get_rank() == 0:
            logger.info("step %d: %s gradients overflowed (inf/nan); step skipped, loss scale "
                        "%g -> %g", self.global_steps + 1, self.config.precision.dtype,
                        scale_before, self.loss_scale)

    def _clip_max_norm(self) -> Optional[float]:
        """The ``max_norm`` the step clips with (``inf``: measures the norm only), or ``None``
        where it neither clips nor measures."""
        if self.config.gradient_clipping > 0 or self._measures_grad_norm:
            return self.config.gradient_clipping or math.inf
        return None

    def _in_oss_agreement(self, agreed_in_advance: dict, call: str):
        """The block that runs OSS's ``call`` (``"step"`` or ``"clip_grad_norm"``) on the rows
        the step agreement carried for it (``OSS.agreed_in_advance``, which checks them as the
        call would: the same error on every rank), so the call makes no exchange of its own;
        where the agreement did not carry it, a block that changes nothing."""
        if call not in agreed_in_advance:
            return contextlib.nullcontext()
        rows, arguments = agreed_in_advance[call]
        return self.optimizer.agreed_in_advance(call, rows, **arguments)

    def _left_out(self) -> list:
        """Trainable parameters the optimizer does not step now (``model_parameters=...`` a
        subset): read at each step, so that parameters added later by
        ``optimizer.add_param_group`` (or unfrozen later) are counted as they are then."""
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return [p for p in self.module.parameters() if p.requires_grad and id(p) not in stepped]

    def _local_gradients(self) -> list[torch.Tensor]:
        return [p.grad for group in self.optimizer.param_groups for p in group["params"]
                if p.grad is not None]

    def _agreed_overflow(self) -> bool:
        """Inf/nan in any rank's gradients, all-reduced so every rank decides the same. A sparse
        gradient (an embedding with ``sparse=True``, stage 0) is checked on its coalesced
        values, the entries it adds to the weight."""
        grads = [_sparse_values(g) for g in self._local_gradients()]
        overflow = bool(grads) and not bool(
            torch.stack([torch.isfinite(g).all() for g in grads]).all())
        device = grads[0].device if grads else torch.device("cpu")
        return distributed.any_rank(overflow, device=device)

    def _unscale_gradients(self, inv_scale: float) -> None:
        grads = self._local_gradients()
        dense = [g for g in grads if not g.is_sparse]
        if dense:
            torch._foreach_mul_(dense, inv_scale)
        for grad in grads:
            if grad.is_sparse:
                grad.mul_(inv_scale)

    def _clip_grad_norm(self, max_norm: float):
        """The composition's clip (``max_norm=inf``: measure only), except with sparse
        gradients (stage 0, every rank holds the averaged ones), which torch's
        ``clip_grad_norm_`` cannot take: the 2-norm over the dense gradients and the sparse
        ones' coalesced values, and torch's clip coefficient ``max_norm / (norm + 1e-6)``
        (at most 1) applied to both. No communication."""
        grads = self._local_gradients()
        if self.composition.stage != 0 or not any(g.is_sparse for g in grads):
            return self.composition.clip_grad_norm(max_norm)
        squares = [torch.linalg.vector_norm(_sparse_values(g).float()) ** 2 for g in grads]
        total = torch.stack(squares).sum().sqrt()
        if not math.isinf(max_norm):
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for grad in grads:
                if grad.is_sparse:
                    grad.mul_(coefficient.to(grad.dtype).item())
                else:
                    grad.mul_(coefficient.to(grad.dtype))
        return total

    # -- contexts
    def _precision_context(self):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, dtype=self._autocast_dtype)

    def _reduction_context(self):
        if self.is_gradient_accumulation_boundary():
            return contextlib.nullcontext()
        return self.composition.no_sync()

    # -- logging
    def _maybe_print(self) -> None:
        if self.global_steps % self.config.steps_per_print:
            return
        if distributed.get_rank() == 0:
            elapsed = max(time.perf_counter() - self._clock, 1e-9)
            samples = (self.global_steps - self._steps_at_clock) * self.config.train_batch_size
            counted = self._losses_counted
            loss = float(self._loss_sum) / counted if counted else float("nan")
            lrs = ", ".join(f"{lr:.3e}" for lr in self.get_lr())
            logger.info("step=%d loss=%.6f lr=[%s] loss_scale=%g samples/s=%.1f skipped=%d",
                        self.global_steps, loss, lrs, self.loss_scale, samples / elapsed,
                        self.skipped_steps)
        self._reset_print_window()

    def _count_loss(self, loss: torch.Tensor) -> None:
        """Add ``loss`` to the log window's sum on its device (no host sync; one scalar)."""
        detached = loss.detach().float().reshape(())
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self._losses_counted += 1

    def _reset_print_window(self) -> None:
        self._loss_sum = None
        self._losses_counted = 0
        self._clock = time.perf_counter()
        self._steps_at_clock = self.global_steps

    # -- checkpoints
    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's export: the unwrapped model's full ``state_dict`` (gathered at stage 3;
        under tensor parallelism the unsplit model's, see :meth:`module_state_dict`), floating
        tensors in the compute dtype (fp16/bf16; fp32 without mixed precision), written by rank
        0 to ``save_dir/save_filename`` through a temporary file renamed into place, so a crash
        leaves no partial file; a failure to write raises ``RuntimeError`` on every rank that
        calls it. ``exclude_frozen_parameters`` drops parameters that do not require grad.

        Stage 3 and tensor parallelism gather the weights: every rank must call it (a rank
        owing a step joins the step agreement first). At stages 0-2 without tensor parallelism
        it makes no collective, so rank 0 may call it alone (``if rank == 0:``, as DeepSpeed
        scripts do), also between backward and step; the other ranks, when they call it, learn
        rank 0's outcome from the store (:mod:`shardkit.engine_export`). Memory: the full
        model on each rank at stage 3 (rank 0 elsewhere)."""
        if not isinstance(save_filename, str) or not save_filename or os.sep in save_filename:
            raise ValueError(f"engine.save_16bit_model(save_filename={save_filename!r}): must be "
                             f"a file name (no directory part)")
        path = os.path.join(save_dir, save_filename)
        if not self._gathers_full_weights:
            return self._save_16bit_model_locally(path, exclude_frozen_parameters)
        self._agree_on_step_skipped("engine.save_16bit_model()", keeps_step_owed=True)
        state = self._16bit_state_dict(exclude_frozen_parameters, call=None)
        error = _write_atomically(state, path) if distributed.get_rank() == 0 else None
        if distributed.is_initialized():  # every rank learns the outcome: none waits on a failure
            error = distributed.broadcast_object(error, src=0)
        if error is not None:
            raise RuntimeError(f"engine.save_16bit_model: rank 0 could not write {path}: {error}")
        return True

    @property
    def _gathers_full_weights(self) -> bool:
        """Whether the full weights are gathered (stage 3, tensor parallelism): a collective."""
        return self.model_parallel is not None or self.zero_stage == 3

    def _save_16bit_model_locally(self, path: str, exclude_frozen_parameters: bool) -> bool:
        """:meth:`save_16bit_model` where every rank holds the whole model: rank 0 writes and
        posts its outcome on the store; the other ranks read it there (no collective)."""
        rank = distributed.get_rank() if distributed.is_initialized() else 0
        call = self._save_calls.count(self._weights_version)
        error = None
        if rank == 0:
            state = self._16bit_state_dict(exclude_frozen_parameters, call=None)
            error = _write_atomically(state, path)
        if distributed.get_world_size() > 1:
            key = engine_export.outcome_key(self._export_serial, self._weights_version, call)
            if rank == 0:
                engine_export.post_outcome(key, error)
            else:
                error = engine_export.await_outcome(key, path)
        if error is not None:
            raise RuntimeError(f"engine.save_16bit_model: rank 0 could not write {path}: {error}")
        return True

    def _16bit_state_dict(self, exclude_frozen_parameters: bool, call: Optional[str]) -> dict:
        """:meth:`module_state_dict` with floating tensors in the compute dtype (other entries,
        such as a module's ``get_extra_state()`` object, as they are); ``call`` as in
        :meth:`_module_state_dict_for`."""
        state = self._module_state_dict_for(
            call, exclude_frozen_parameters=exclude_frozen_parameters)
        dtype = self._autocast_dtype
        if dtype is not None:
            state = {k: v.to(dtype) if _is_floating_weight(k, v) else v
                     for k, v in state.items()}
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict]:
        """What :meth:`save_16bit_model` writes, returned instead: the full ``state_dict`` in the
        compute dtype on rank 0, ``None`` on the other ranks (DeepSpeed's name, which HF
        Accelerate-style save code calls at stage 3; any stage works here). Collective; the
        memory and communication of :meth:`module_state_dict`."""
        state = self._16bit_state_dict(exclude_frozen_parameters,
                                       call="engine._zero3_consolidated_16bit_state_dict()")
        return state if distributed.get_rank() == 0 else None

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model` (same file, same costs)."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> str:
        """Write a resharding checkpoint under ``save_dir/tag`` (default ``global_step<N>``) and
        point ``save_dir/latest`` at it, atomically. Must be called on every rank.

        With ``async_save=True`` only the copy of this rank's share into host memory happens
        here; a background thread writes and commits it (:mod:`shardkit.checkpoint.async_save`)
        and the next ``save_checkpoint``, ``load_checkpoint``, :meth:`wait_for_checkpoint` or
        the end of the process waits for it (raising its error, if any).

        Each rank writes the fp32 parameters and optimizer state it owns (stage 3: its dim-0
        row block of each), keyed by parameter name; rank 0 adds metadata, scheduler, loss
        scaler and ``client_state``. A ``tag`` that is not a string (an epoch, a loss) is
        used as ``str(tag)``, as DeepSpeed does. Memory: a CPU copy of this rank's share.
        Communication: the tags compared across ranks (one small all-gather, unless the
        config's ``checkpoint.tag_validation`` is ``"Ignore"``: then a small broadcast), three
        one-element all-reduces and one barrier. A rank that ran a backward it has not stepped
        for first joins the step agreement (:meth:`_agree_on_step_skipped`): when other ranks
        stepped meanwhile (a step skipped behind a rank-local check of the loss), every rank
        raises a RuntimeError and nothing is written, as at a forward; likewise in
        :meth:`load_checkpoint` and :meth:`save_16bit_model`.

        ``client_state`` must load back: checkpoints are read with
        ``torch.load(weights_only=True)`` (tensors, numbers, strings, bools, None and
        lists/tuples/dicts of them). Rank 0's (the one written) is tried in memory first; any
        other object (an ``argparse.Namespace``, a NumPy scalar) is a ``TypeError`` on every rank
        naming its key, before anything is written, rather than a checkpoint that cannot be
        resumed from.
        ``exclude_frozen_parameters=True`` (DeepSpeed's, in its position) leaves the parameters
        that do not require grad out of the saved weights (a fine-tuned adapter's checkpoint
        without the frozen base); loading it keeps the model's own values of those parameters
        (and needs no ``load_module_strict=False``).

        Returns the checkpoint directory (when ``async_save``, where it will be once written).
        """
        from shardkit.checkpoint.engine_state import save_engine_checkpoint
        if not isinstance(exclude_frozen_parameters, bool):
            raise ValueError(f"engine.save_checkpoint(exclude_frozen_parameters="
                             f"{exclude_frozen_parameters!r}): expected True or False; nothing "
                             f"was written")
        if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
            raise ValueError(f"engine.save_checkpoint(save_dir={save_dir!r}): expected a "
                             f"non-empty directory path (a str or os.PathLike); nothing was "
                             f"written")
        save_dir = os.fspath(save_dir)
        self._agree_on_step_skipped("engine.save_checkpoint()", keeps_step_owed=True)
        self.wait_for_checkpoint()
        tag = None if tag is None else str(tag)  # DeepSpeed's: an epoch or a loss names a tag
        if self.model_parallel is not None and async_save:
            raise ValueError(
                f"engine.save_checkpoint(async_save=True): not with tensor parallelism "
                f"(tensor-parallel size {self.mp_world_size}); save with async_save=False")
        tag = self._validate_tag(tag, client_state)
        if self.model_parallel is not None:
            return self._save_tensor_parallel_checkpoint(save_dir, tag, client_state,
                                                         save_latest, exclude_frozen_parameters)
        with self._optimizer_state_for_checkpoint():
            result = save_engine_checkpoint(self, save_dir, tag, client_state, save_latest,
                                            async_save=async_save,
                                            exclude_frozen_parameters=exclude_frozen_parameters)
        if not async_save:
            return result
        self._pending_save = result
        return result.path

    def _save_tensor_parallel_checkpoint(self, save_dir: str, tag: Optional[str],
                                         client_state, save_latest: bool,
                                         exclude_frozen_parameters: bool = False) -> str:
        """Each tensor-parallel rank's data-parallel group writes a complete resharding
        checkpoint of its slices into ``save_dir/TAG/mp_rank_XX`` (as DeepSpeed's
        ``mp_rank_XX`` files); once every group has committed (one one-element all-reduce
        over the world), rank 0 points ``save_dir/latest`` at ``TAG`` (one more, to agree that
        it could). A failure in any group raises :class:`CheckpointError` on every rank and
        leaves ``latest`` as it was."""
        from shardkit.checkpoint.engine_state import save_engine_checkpoint
        from shardkit.checkpoint.sharded import write_latest_tag
        from shardkit.nn.model_parallel.full_state import split_specs
        tag = f"global_step{self.global_steps}" if tag is None else tag
        path, error = os.path.join(save_dir, tag), None
        try:
            with self._optimizer_state_for_checkpoint():
                save_engine_checkpoint(self, path,
                                       mp_rank_name(self.model_parallel.tensor_rank),
                                       client_state, save_latest=False,
                                       exclude_frozen_parameters=exclude_frozen_parameters)
            if distributed.get_rank() == 0:  # how to join the slices offline (consolidate)
                # stage 3: the model's own state_dict() is refused (FSDP row shards), the
                # split of each key was read unwrapped by initialize
                specs = self.tp_split_specs if self.zero_stage == 3 else split_specs(self.module)
                write_tensor_parallel_layout(path, self.mp_world_size, specs)
        except Exception as e:  # the other groups must learn of it rather than go on
            error = e
        self._agree_on_save(error, save_dir, tag)  # every group saved: only now move latest
        if save_latest and distributed.get_rank() == 0:
            try:
                write_latest_tag(save_dir, tag)
            except OSError as e:
                error = e
        self._agree_on_save(error, save_dir, tag)
        return path

    @contextlib.contextmanager
    def _optimizer_state_for_checkpoint(self):
        """Without an optimizer, the checkpoint writer sees an empty one (no param groups, no
        state) for the duration of the save, so a forward-only engine writes its weights,
        counters and RNG only (what DeepSpeed's writes: the model states, optimizer ``None``);
        its metadata names the optimizer class ``NoOptimizer``. Local; the shares are copied
        before this returns (an asynchronous save writes copies)."""
        if self.optimizer is not None:
            yield
            return
        self.optimizer = NoOptimizer()
        try:
            yield
        finally:
            self.optimizer = None

    @staticmethod
    def _agree_on_save(error: Optional[BaseException], save_dir: str, tag: str) -> None:
        """:class:`CheckpointError` on every rank when ``error`` happened on any (one
        one-element all-reduce over the world)."""
        from shardkit.checkpoint import CheckpointError
        if distributed.any_rank(error is not None):
            raise CheckpointError(f"save_checkpoint({save_dir!r}, tag={tag!r}) failed"
                                  f"{f': {error}' if error else ' on another rank'}; "
                                  f"'latest' still names the previous checkpoint") from error

    def _validate_tag(self, tag: Optional[str], client_state=None) -> Optional[str]:
        """What every rank must agree on before a save writes anything: rank 0's
        ``client_state`` loads back (else a ``TypeError`` on every rank), and the config's
        ``checkpoint.tag_validation``: unless ``"ignore"``, the tag is compared across ranks
        and a difference raises on every rank with ``"fail"``, or with ``"warn"`` warns. Returns
        the tag to save under: rank 0's on every rank (with ``"warn"`` and ``"ignore"`` the
        save goes on, as in DeepSpeed, into one checkpoint that loads, rather than a share of
        it in each rank's own directory). Communication: one small all-gather (a broadcast of
        rank 0's verdict and tag with ``"ignore"``); none at world 1."""
        mode = self.config.checkpoint_tag_validation
        problem = _client_state_problem(client_state) if distributed.get_rank() == 0 else None
        if distributed.get_world_size() == 1:
            _raise_client_state_problem(problem)
            return tag
        if mode == "ignore":
            problem, tag = distributed.broadcast_object((problem, tag), src=0)
            _raise_client_state_problem(problem)
            return tag
        gathered = distributed.all_gather_object((tag, problem))
        _raise_client_state_problem(gathered[0][1])
        tags = [t for t, _ in gathered]
        if len(set(tags)) == 1:
            return tag
        message = f"save_checkpoint: the ranks passed different tags {tags}"
        if mode == "fail":
            from shardkit.checkpoint import CheckpointError
            raise CheckpointError(message + "; each rank would write into its own directory "
                                  "(checkpoint.tag_validation='Fail'); nothing was written")
        if distributed.get_rank() == 0:
            logger.warning("%s; every rank saves under rank 0's tag %r "
                           "(checkpoint.tag_validation='Warn')", message, tags[0])
        return tags[0]

    def destroy(self) -> None:
        """DeepSpeed's end-of-training call: finish a pending asynchronous save. The wrappers
        hold no other resources (no hooks or threads outlive the engine). No communication."""
        self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> Optional[str]:
        """Wait for this engine's asynchronous save, if one is under way; return its directory
        (``None`` when there was none) or raise its error. Must be called on every rank."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        return pending.wait() if pending is not None else None

    # -- DeepSpeed's memory controls, called between training and generation (RLHF loops)
    def empty_partition_cache(self) -> None:
        """Free the parameters stage 3 holds gathered outside a step (DeepSpeed's call after
        generation): units a direct call under ``no_grad`` gathered (HF ``generate()`` on an
        encoder-decoder), and units kept since a forward that no backward followed. The next
        forward gathers them again. Stages 0-2 hold no gathered copies: nothing to free. Memory:
        each such unit's full parameters go (storage released). Local, no communication; call it
        on every rank between steps (during a backward it is a RuntimeError)."""
        if self.composition.stage == 3 and hasattr(self.wrapped, "reshard"):
            self.wrapped.reshard()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move this rank's optimizer state to host memory until :meth:`reload_states`
        (DeepSpeed's call before an RLHF generation phase, whose memory it gives back; also
        reachable as ``engine.optimizer.offload_states``, where OpenRLHF calls it).

        ``include`` takes DeepSpeed's state names (``OffloadStateTypeEnum`` members or their
        strings; ``None``: all). What each means here:

        - ``"optim_states"``: the optimizer's state tensors (Adam's two moments, ``8Ψ/N``
          bytes at stages 1-3, ``8Ψ`` at stage 0) move to host memory; ``step()`` is refused
          until :meth:`reload_states`, on every rank as long as any rank holds its state
          offloaded. Forwards still run.
        - ``"hp_params"`` / ``"lp_params"``: shardkit keeps one copy of the weights, the fp32
          parameters, which are both DeepSpeed's master and compute weights; those in host
          memory already (a CPU run) stay, and on an accelerator naming them is a ValueError
          (they are not moved: use ``zero_optimization.offload_param`` at stage 3, or leave
          them out of ``include``). With ``include=None`` the states that cannot move stay,
          with a warning naming them, and the optimizer state moves.
        - ``"lp_grads"``: ``step()`` frees the gradients, so between steps there are none; held
          on an accelerator (mid-accumulation) they are a ValueError.
        - ``"contiguous_grad_buffer"``: stage 3 holds no gradient buffer between steps; at
          stages 0-2 torch DDP's and ShardedDataParallel's reduce buckets stay allocated, so
          on an accelerator naming it there is a ValueError.

        ``device`` must be ``"cpu"`` (``"none"`` only warns, as in DeepSpeed; ``"nvme"`` is
        refused). Every argument is checked before anything moves. Memory: the moved state's
        device bytes are released (pinned host copies when ``pin_memory`` and CUDA). Local, no
        communication; call it on every rank, between steps."""
        self._refuse_without_optimizer("offload_states()")
        states = _offload_request(include, device, pin_memory, non_blocking)
        if states is None:
            logger.warning("engine.offload_states(device='none'): nothing was moved")
            return
        if include is None:  # DeepSpeed's "everything": what shardkit can move, and a word
            stuck = self._unmovable_states(states)
            if stuck:
                logger.warning("engine.offload_states(): %s stay on the device (see "
                               "ShardedEngine.offload_states); the optimizer state moves", stuck)
        else:
            self._refuse_unmovable_states(states)
        self.empty_partition_cache()
        if "optim_states" in states:
            self._offload_optimizer_state(pin_memory, non_blocking)

    def _unmovable_states(self, states: tuple) -> list:
        """The states of ``states`` that would stay on the accelerator (see
        :meth:`offload_states`). Local."""
        on_device = [p for p in self.wrapped.parameters() if p.device.type != "cpu"]
        stuck = [name for name in ("hp_params", "lp_params") if name in states and on_device]
        if "lp_grads" in states and any(p.grad is not None for p in on_device):
            stuck.append("lp_grads")
        if "contiguous_grad_buffer" in states and on_device and self.composition.stage < 3:
            stuck.append("contiguous_grad_buffer")
        return stuck

    def _refuse_unmovable_states(self, states: tuple) -> None:
        """A ValueError naming each state in ``states`` that would stay on the accelerator
        (see :meth:`offload_states`). Local; the same on every rank of a run whose ranks hold
        the same kind of device."""
        stuck = self._unmovable_states(states)
        if stuck:
            on_device = next(p for p in self.wrapped.parameters() if p.device.type != "cpu")
            raise ValueError(
                f"engine.offload_states(include={list(states)!r}): {stuck} cannot be moved off "
                f"{on_device.device}: shardkit's fp32 parameters are both the master and the "
                f"compute weights (no separate copy to offload), gradients are held only until "
                f"step(), and at stage {self.composition.stage} the gradient reduction's buckets "
                f"stay allocated; offload include=['optim_states'] (zero_optimization."
                f"offload_param moves stage 3's parameter shards to the CPU for good)")

    def _offload_optimizer_state(self, pin_memory: bool, non_blocking: bool) -> None:
        """Replace each optimizer state tensor by a host copy, remembering where it came from.
        Leaves ``_offloaded_optimizer_state`` a dict on every rank (empty on a rank whose
        shard holds no state yet), so that ``step()`` is refused on all ranks or none."""
        moved = self._offloaded_optimizer_state or {}
        copied = False
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor) and moved.get(id(value), (None,))[0] \
                        is not value:
                    host = _to_host(value, pin_memory, non_blocking)
                    state[key] = host
                    moved[id(host)] = (host, value.device)
                    copied = copied or host is not value
        if copied:
            _release_flat_state_buffers(self.optimizer)
        self._offloaded_optimizer_state = moved

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move the optimizer state :meth:`offload_states` moved back to the device it came
        from (a state since replaced, by ``load_checkpoint``, stays as loaded), and allow
        ``engine.step()`` again. Without a preceding offload: nothing to do. Memory: the
        state's device bytes again. Local, no communication; call it on every rank."""
        _check_flag("reload_states", "non_blocking", non_blocking)
        moved, self._offloaded_optimizer_state = self._offloaded_optimizer_state, None
        if moved is None:
            return
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                host, origin = moved.get(id(value), (None, None))
                if host is value:
                    state[key] = value.to(origin, non_blocking=non_blocking)

    def _agree_on_step(self, call: str = "engine.step()",
                       carry: Optional[dict] = None) -> dict:
        """Before a boundary step (``engine.step()`` or ``engine.optimizer.step()``), the
        ranks agree that every one of them is stepping, and none holds its optimizer state
        offloaded; otherwise a RuntimeError on every rank, before any collective of the step.

        A step taken on some ranks only (``optimizer.step()`` behind ``if rank == 0`` or a
        rank-local check of the loss) left the others waiting forever in their next forward's
        or backward's collectives, or, where the optimizer's step is local, training on
        weights that no longer match. The ranks that did not step meet this agreement at their
        next reducing training forward, or any forward at stage 3, or the backward of a loss
        computed without the engine's forward, or a checkpoint save or load
        (:meth:`_agree_on_step_skipped`), so both sides learn it from the one exchange the step
        makes anyway. ``step()`` between :meth:`offload_states` and :meth:`reload_states`
        would update state that is not where the parameters are (on a GPU, a device mismatch
        inside the optimizer; on a CPU run, a script that forgets the reload would break on a
        GPU).

        ``carry``: ``{call: arguments}`` of OSS's agreements (its ``clip_grad_norm`` and
        ``step``) whose rows this exchange carries (:meth:`_oss_calls_to_carry`). Returns
        ``{call: (rows, arguments)}`` for those every rank carried, for
        ``OSS.agreed_in_advance`` to check as the call would (after this agreement's own
        refusals, which win); the others' calls agree as usual.

        Communication: in a world of several ranks, one all-gather of six int64s a rank (a
        control message ``CommCounter`` does not count)."""
        offloaded = self._offloaded_optimizer_state is not None
        carry = carry or {}
        rows = self._step_agreement_rows(call, [_STEPPING, int(offloaded)], self._oss_rows(carry))
        self._awaiting_step = False  # settled on every rank, whatever the rows say
        rows, carried = _split_carried_rows(rows)
        self._refuse_steps_on_some_ranks(call, rows)
        ranks = [rank for rank, (_, flag) in enumerate(rows) if flag]
        if ranks:
            where = "" if ranks == list(range(distributed.get_world_size())) \
                else f" on rank(s) {ranks} (not on the others)"
            raise RuntimeError(f"{call}: the optimizer state was moved off the device by "
                               f"engine.offload_states(){where}; call engine.reload_states() "
                               f"on every rank before the next step (no rank stepped)")
        return {name: (carried[name], carry[name]) for name in carry if name in carried}

    def _oss_calls_to_carry(self) -> dict:
        """``{call: arguments}`` of the OSS agreements the step agreement can carry for this
        ``engine.step()``: its ``clip_grad_norm`` (with the ``max_norm`` it clips with) and its
        ``step``. None unless the optimizer is OSS over the whole world in rank order (the
        step agreement's ranks: with tensor parallelism OSS spans the data-parallel group
        only), in a world of several ranks; the step only where no code but torch's and
        shardkit's runs in ``optimizer.step()`` (:func:`_step_runs_no_foreign_code`: a step
        pre-hook of the script's could change the hyper-parameters after the rows were made,
        and OSS would then raise on this rank alone). Local."""
        optimizer = self.optimizer
        world = distributed.get_world_size()
        if not isinstance(optimizer, OSS) or world < 2 or \
                distributed.group_ranks(optimizer.group) != list(range(world)):
            return {}
        calls = {}
        max_norm = self._clip_max_norm()
        if max_norm is not None and _is_oss_clip(self.composition.clip_grad_norm, optimizer):
            calls["clip_grad_norm"] = {"max_norm": max_norm}
        if _step_runs_no_foreign_code(optimizer):
            calls["step"] = {}
        return calls

    def _oss_rows(self, carry: dict) -> list:
        """This rank's OSS rows for the step agreement: ``OSS.agreement_row`` of each call
        of :data:`_CARRIED_OSS_CALLS` in ``carry``, ``_NOT_CARRIED`` twice for the others."""
        row = []
        for call in _CARRIED_OSS_CALLS:
            row += self.optimizer.agreement_row(call, **carry[call]) if call in carry \
                else [_NOT_CARRIED, _NOT_CARRIED]
        return row

    def _agree_on_step_skipped_at_forward(self) -> bool:
        """The other side of :meth:`_agree_on_step` for a rank that did not step: at a
        forward that starts a new reducing training pass (grad enabled, training mode, at the
        accumulation boundary, reducing) after the backward of an earlier one that this rank
        has not stepped for, and at any forward at stage 3, whose forwards gather the
        parameters on every rank. Returns whether this forward starts a reducing training
        pass. Nothing is sent in the usual loop (one step after each backward), nor for the
        second forward of a loss of two, nor for a forward that no backward follows (a
        rank-local forward that forgot ``torch.no_grad()``)."""
        if self.optimizer is None:
            return False
        reducing = self.is_gradient_accumulation_boundary() and self._no_sync_depth == 0 \
            and self.require_backward_grad_sync
        training = torch.is_grad_enabled() and self.module.training and reducing
        if training or self.composition.stage == 3:
            self._agree_on_step_skipped("engine forward")
        return training

    def _await_step_after_backward_of(self, output) -> None:
        """Mark this rank as owing a step once a backward reaches ``output`` (a reducing
        training forward's: ``engine.backward(loss)`` or the script's own ``loss.backward()``),
        not at the forward itself: a forward that no backward follows on some ranks only
        would otherwise make those ranks alone join the agreement at their next forward, and
        wait there forever. A gradient hook on each output tensor that needs a gradient (on
        a view's base), found in any container :func:`~shardkit.utils.nested.tensors_in`
        walks (it holds only a weak reference to the engine); a leaf output is armed instead
        (:meth:`_arm_leaf_output`). No communication."""
        owner = weakref.ref(self)

        def note_backward(_grad):
            engine = owner()
            if engine is not None:
                engine._awaiting_step = True
        for tensor in tensors_in(output):
            if not tensor.requires_grad:
                continue
            # a view's own hook is lost when the script modifies it in place (torch rebuilds
            # its grad_fn from its base's), its base's is not
            hooked = tensor if tensor._base is None else tensor._base
            if hooked.grad_fn is None:
                self._arm_leaf_output(hooked)
            else:
                hooked.register_hook(note_backward)

    def _arm_leaf_output(self, leaf: torch.Tensor) -> None:
        """A leaf returned by the forward as is (a parameter, such as the log-variances of
        a multi-task loss's weighting) lives as long as the model, so a hook a forward would
        pile up on it, one more call in every backward: one hook a leaf for the engine,
        armed by each reducing training forward that returns it, disarmed when it fires."""
        armed = self._armed_leaf_outputs.get(leaf)
        if armed is None:
            armed = self._armed_leaf_outputs[leaf] = [False]
            owner = weakref.ref(self)

            def note_backward(_grad):
                engine = owner()
                if armed[0] and engine is not None:
                    armed[0] = False
                    engine._awaiting_step = True
            leaf.register_hook(note_backward)
        armed[0] = True

    def _agree_on_step_skipped(self, call: str, keeps_step_owed: bool = False) -> None:
        """When the backward of a reducing training pass ran here since the ranks last agreed
        on a step: join the agreement as a rank that is not stepping. Every rank passing here
        together (a script that backwards without stepping, or backwards twice) agrees, and
        goes on; a rank that stepped meanwhile makes every rank raise. ``keeps_step_owed``
        (a checkpoint save or load, a gather of the weights): the backward is still owed its
        step after the ranks agreed, so that a rank stepping later on its own still meets the
        others' agreement at their next forward (a forward clears it: its own backward owes
        the next one). Communication: none unless a pass is pending, then one all-gather of
        six int64s a rank."""
        if not self._awaiting_step:
            return
        rows = self._step_agreement_rows(call, [_NOT_STEPPING, 0])
        self._awaiting_step = False  # settled on every rank when some stepped: they raise
        self._refuse_steps_on_some_ranks(call, _split_carried_rows(rows)[0])
        self._awaiting_step = keeps_step_owed

    @staticmethod
    def _step_agreement_rows(call: str, row: list, oss_rows: Optional[list] = None) -> list:
        """Every rank's ``row`` followed by its ``oss_rows`` (:meth:`_oss_rows`; default:
        none carried), over the world: the engine's ranks are the world's (``initialize``
        refuses an ``mpu`` whose tensor- and data-parallel groups do not cover it), and with
        tensor parallelism each rank's tensor-parallel partners must agree too, which its
        data-parallel group alone would not tell it."""
        if oss_rows is None:
            oss_rows = [_NOT_CARRIED] * (2 * len(_CARRIED_OSS_CALLS))
        row = list(row) + list(oss_rows)
        if distributed.get_world_size() < 2:
            return [row]
        return distributed.gather_control_rows(call, row)

    @staticmethod
    def _refuse_steps_on_some_ranks(call: str, rows: list) -> None:
        stepping = [rank for rank, (kind, _) in enumerate(rows) if kind == _STEPPING]
        if not stepping or len(stepping) == len(rows):
            return
        others = [rank for rank in range(len(rows)) if rank not in stepping]
        raise RuntimeError(
            f"{call}: rank(s) {stepping} are stepping the optimizer (engine.step() or "
            f"engine.optimizer.step()) while rank(s) {others} went on without stepping (to "
            f"their next forward or backward, a checkpoint save or load, or a gather of the "
            f"full weights); every rank must step after each accumulation boundary, or none (a "
            f"step behind a rank-local condition, such as `if rank == 0` or a check of this "
            f"rank's loss, would leave the ranks' weights different): no rank stepped. Under "
            f"fp16, engine.step() itself skips the update on every rank when any rank's "
            f"gradients overflowed: call it everywhere. To skip a step everywhere, agree on the "
            f"condition first (e.g. all-reduce the flag). A forward with gradients on, in "
            f"training mode, between backward and step on some ranks only (a preview or log) "
            f"counts as going on: run it under torch.no_grad()")

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Restore model, optimizer, scheduler, loss scaler, counters and RNG from a checkpoint
        written at any world size and ZeRO stage. Returns ``(path, client_state)``, or
        ``(None, None)`` when ``load_dir`` holds no checkpoint. Must be called on every rank.

        The arguments are DeepSpeed's, in its order. ``load_module_strict=False`` has torch's
        ``strict=False`` meaning (Hugging Face's Trainer passes it to resume a PEFT model): the
        model's tensors the checkpoint lacks keep their values, the checkpoint's tensors the
        model lacks are ignored, shapes must still match; the optimizer state loads when the
        saving optimizer stepped the parameters this one steps (by name; buffers and frozen
        parameters may differ), else it is refused (``load_optimizer_states=False`` loads the
        rest). A ``custom_load_fn`` (DeepSpeed's hook that loads the module's weights in place
        of ``load_state_dict``) is refused with a ``ValueError`` before anything is read.

        ``load_module_only=True`` is DeepSpeed's warm start: the weights only; the step
        counters (``global_steps``, ``skipped_steps``), the loss scale, the scheduler and this
        process's RNG stay as they are (a fine-tuning run starts at step 0).
        Without an optimizer (a forward-only engine) the optimizer state is never read: a
        training run's checkpoint gives a reference model its weights.
        Memory, on each rank's CPU while loading: stages 0-2, the full fp32 weights and the
        optimizer state this rank's optimizer keeps (stages 1-2: its OSS share; stage 0: the
        whole); stage 3, only this rank's row blocks of both (``1/N``)."""
        from shardkit.checkpoint.engine_state import load_engine_checkpoint
        if not isinstance(load_module_strict, bool):
            raise ValueError(f"engine.load_checkpoint(load_module_strict="
                             f"{load_module_strict!r}): expected True or False")
        if custom_load_fn is not None:
            raise ValueError(
                "engine.load_checkpoint(custom_load_fn=...): not supported; write the "
                "checkpoint's weights with `python -m shardkit consolidate DIR model.pt` and "
                "load them into the model with your function before shardkit.initialize")
        self._agree_on_step_skipped("engine.load_checkpoint()", keeps_step_owed=True)
        self.wait_for_checkpoint()
        tag = None if tag is None else str(tag)
        load_dir, tag = checkpoint_location(load_dir, tag, self.model_parallel)
        kept = self._training_position() if load_module_only else None
        result = load_engine_checkpoint(self, load_dir, tag,
                                        load_optimizer_states=load_optimizer_states
                                        and not load_module_only and self.optimizer is not None,
                                        load_lr_scheduler_states=load_lr_scheduler_states
                                        and not load_module_only, strict=load_module_strict,
                                        load_rng_state=not load_module_only)
        if kept is not None:
            self._restore_training_position(kept)
        self._publish_loss_scale()
        self._weights_version += 1
        return result

    def _training_position(self) -> dict:
        """Where this run stands apart from its weights: step counters, loss scaler, RNG.
        A few numbers plus the RNG states; no communication."""
        from shardkit.checkpoint.engine_state import rng_state
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps, "rng": rng_state(),
                "resized_at": (self._samples_before_resize, self._steps_before_resize),
                "loss_scaler": None if self.loss_scaler is None
                else self.loss_scaler.state_dict()}

    def _restore_training_position(self, kept: dict) -> None:
        """Undo what a checkpoint load changed besides the weights (see
        :meth:`_training_position`). No communication."""
        from shardkit.checkpoint.engine_state import set_rng_state
        self.global_steps = kept["global_steps"]
        self.skipped_steps = kept["skipped_steps"]
        self.micro_steps = kept["micro_steps"]
        self._samples_before_resize, self._steps_before_resize = kept["resized_at"]
        set_rng_state(kept["rng"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(kept["loss_scaler"])


# DeepSpeed's OffloadStateTypeEnum values (what each means here: ShardedEngine.offload_states)
OFFLOAD_STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads",
                       "contiguous_grad_buffer")


def _check_flag(call: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"engine.{call}({name}={value!r}): expected True or False")


def _enum_value(value):
    """A DeepSpeed ``str`` enum member (``OffloadDeviceEnum.cpu``) or a plain string, as the
    string."""
    return getattr(value, "value", value)


def _offload_request(include, device, pin_memory, non_blocking) -> Optional[tuple]:
    """The states ``offload_states`` is asked to move (``None``: ``device='none'``, nothing
    to move), every argument checked before anything moves."""
    _check_flag("offload_states", "pin_memory", pin_memory)
    _check_flag("offload_states", "non_blocking", non_blocking)
    device = _enum_value(device)
    if device == "nvme":
        raise ValueError("engine.offload_states(device='nvme'): NVMe is not supported for "
                         "offloading states (as in DeepSpeed); use device='cpu'")
    if device not in ("cpu", "none"):
        raise ValueError(f"engine.offload_states(device={device!r}): valid devices are "
                         f"'cpu' (or OffloadDeviceEnum.cpu) and 'none'")
    if include is None:
        names = OFFLOAD_STATE_TYPES
    elif isinstance(include, (str, bytes)) or not hasattr(include, "__iter__"):
        raise ValueError(f"engine.offload_states(include={include!r}): expected None or a "
                         f"collection of state names, e.g. ['optim_states']")
    else:
        names = tuple(str(_enum_value(name)) for name in include)
    unknown = [n for n in names if n not in OFFLOAD_STATE_TYPES]
    if unknown:
        raise ValueError(f"engine.offload_states(include={list(names)!r}): unknown state(s) "
                         f"{unknown}; DeepSpeed's names are {list(OFFLOAD_STATE_TYPES)}")
    return None if device == "none" else names


def _release_flat_state_buffers(optimizer) -> None:
    """Drop the flat buffers of a :class:`~shardkit.optim.fused.FusedAdamW` (also DeepSpeed's
    ``FusedAdam``, and the one inside OSS) whose ``state`` was just replaced by host copies.
    Its ``state[p]`` tensors are views into those buffers: without this, the buffers keep the
    whole device state alive while it is "offloaded". Its next step rebuilds them from
    ``state`` (the tensors :meth:`ShardedEngine.reload_states` put back), as after a
    ``load_state_dict``. Local."""
    from shardkit.optim.fused import FusedAdamW
    inner = getattr(optimizer, "optim", optimizer)  # OSS: the local shard's optimizer
    if isinstance(inner, FusedAdamW):
        inner._flat.clear()


def _to_host(tensor: torch.Tensor, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    """``tensor`` in host memory (itself when it is there already), pinned when asked and
    CUDA can pin."""
    if tensor.device.type == "cpu":
        return tensor
    pin = pin_memory and torch.cuda.is_available()
    host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
    host.copy_(tensor, non_blocking=non_blocking)
    return host


class NoOptimizer:
    """What the checkpoint writer sees of a forward-only engine's optimizer: no param groups,
    no state (see :meth:`ShardedEngine._optimizer_state_for_checkpoint`)."""

    def __init__(self):
        self.param_groups: list = []
        self.state: dict = {}


_DDP_READY_TWICE = "Expected to mark a variable ready only once"


def _sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """A dense gradient itself; a sparse one's coalesced values (repeated indices summed, as
    they are added to the weight)."""
    return grad.coalesce().values() if grad.is_sparse else grad


def _explained_backward_error(error: RuntimeError, zero) -> RuntimeError:
    """torch DDP's "marked ready twice", in the config's terms where the config caused it:
    stages 0-1 with ``ignore_unused_parameters`` build DDP with ``find_unused_parameters``,
    which marks the parameters of a reentrant activation checkpoint unused after the forward
    (they are not in its graph yet) and fails when their recomputed gradients arrive. Every
    rank runs the same backward, so every rank raises it. Any other error comes back as is."""
    if _DDP_READY_TWICE not in str(error) or zero.stage > 1 \
            or not zero.ignore_unused_parameters:
        return error
    return RuntimeError(
        f"engine.backward: zero_optimization.stage={zero.stage} with ignore_unused_parameters="
        f"true (the default) runs torch DDP with find_unused_parameters, which cannot run a "
        f"reentrant activation checkpoint (torch.utils.checkpoint(use_reentrant=True), Hugging "
        f"Face's gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': "
        f"True}})) nor a parameter used outside the forward. Valid: \"ignore_unused_parameters"
        f"\": false in zero_optimization (every trainable parameter must then get a gradient "
        f"each step), checkpointing with use_reentrant=False, or stage 2 or 3. torch DDP "
        f"said: {str(error).splitlines()[0][:200]}")


def _client_state_problem(client_state) -> Optional[str]:
    """Why ``client_state`` would not load back from a checkpoint (read with
    ``torch.load(weights_only=True)``), naming the first key that fails; ``None`` when it
    would. A trial save and load in memory: one serialized copy of ``client_state``."""
    if client_state is None:
        return None
    if not isinstance(client_state, dict):
        return f"client_state must be a dict, not {type(client_state).__name__}"
    if _load_back_error(client_state) is None:
        return None
    for key, value in client_state.items():
        error = _load_back_error({key: value})
        if error is not None:
            return f"client_state[{key!r}] ({type(value).__name__}): {error}"
    return f"client_state: {_load_back_error(client_state)}"


def _load_back_error(obj) -> Optional[str]:
    """``None`` when ``obj`` survives ``torch.save`` then ``torch.load(weights_only=True)``,
    else what stopped it (the class the safe loader refuses, when it names one)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return None
    except Exception as error:  # pickling errors and the safe loader's refusal alike
        refused = re.search(r"GLOBAL ([\w.]+)", str(error))
        if refused:
            return f"the checkpoint loader would refuse {refused.group(1)}"
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"


def _raise_client_state_problem(problem: Optional[str]) -> None:
    if problem is not None:
        raise TypeError(
            f"engine.save_checkpoint: {problem}; checkpoints load with "
            f"torch.load(weights_only=True), so client_state may hold tensors, numbers, "
            f"strings, bools, None and lists/tuples/dicts of them (e.g. vars(args) for an "
            f"argparse.Namespace, float(x) for a NumPy scalar); nothing was written")


def _loss_scaler(cfg: EngineConfig):
    p = cfg.precision
    if p.dtype != "fp16":
        return None
    if p.static_loss_scale > 0:
        return StaticLossScaler(p.static_loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** p.initial_scale_power,
                             scale_window=p.loss_scale_window, hysteresis=p.hysteresis,
                             min_scale=p.min_loss_scale,
                             raise_error_at_min_scale=p.raise_error_at_min_scale,
                             consecutive_hysteresis=p.consecutive_hysteresis)


# ----------------------------------------------------------------------------- initialize


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``, as scripts read it: the engine calls :meth:`start`
    at the first forward of each optimizer step and :meth:`stop` at its ``step()``;
    :meth:`avg_samples_per_sec` is the samples of the measured optimizer steps (``batch_size``
    each, the engine's ``train_batch_size`` at the time) over the wall time measured;
    ``update_epoch_count()`` counts epochs (``epoch_count``, DeepSpeed-Chat ticks it). A
    forward outside training (evaluation between two steps) counts in the step's time, as the
    timer starts at the first forward after a step. ``stop(report_speed=...)`` is accepted for
    DeepSpeed's signature and ignored (nothing is logged). Host clock only: no device
    synchronisation, no communication."""

    def __init__(self, batch_size: int = 1):
        self.batch_size = batch_size
        self.epoch_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self.total_samples = 0
        self._started: Optional[float] = None

    def update_epoch_count(self) -> None:
        self.epoch_count += 1

    def start(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if self._started is None or not global_step:
            return
        self.total_elapsed_time += time.perf_counter() - self._started
        self.global_step_count += 1
        self.total_samples += self.batch_size
        self._started = None

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the measured optimizer steps (0.0 before the first)."""
        if self.total_elapsed_time <= 0:
            return 0.0
        return self.total_samples / self.total_elapsed_time


def initialize(model: nn.Module, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, config=None, config_params=None, args=None, mpu=None,
               dist_init_required=None, collate_fn=None, peer_timeout_s=None, resume_from=None,
               wrap_policy=None, distributed_port=None, param_init_fn=None):
    """Compose shardkit's wrappers from a DeepSpeed config.

    Args:
        model: the ``nn.Module`` to train (on its target device).
        optimizer: a torch optimizer or ``callable(params) -> optimizer``; exclusive with a
            config ``optimizer`` section. Neither: a forward-only engine (module docstring),
            returned with ``optimizer`` and ``lr_scheduler`` ``None``.
        model_parameters: parameters or param groups for a config-built optimizer (default:
            every trainable parameter), at every stage (FSDP shards the same parameter objects
            in place).
        training_data: a ``torch.utils.data.Dataset``; a ``DataLoader`` with a
            ``DistributedSampler`` and the micro-batch size is returned for it
            (:meth:`ShardedEngine.deepspeed_io`; also ``engine.training_dataloader``).
        lr_scheduler: a scheduler or ``callable(optimizer) -> scheduler``; exclusive with a
            config ``scheduler`` section.
        config: a dict or the path of a JSON file (``config_params`` is an alias; without
            either, ``args.deepspeed_config`` is used as DeepSpeed does; both is an error).
        args, dist_init_required, collate_fn: DeepSpeed's.
        mpu: DeepSpeed's model-parallel unit for a model built from
            ``shardkit.nn.model_parallel`` layers (or Megatron-style ones marking their split
            weights ``tensor_model_parallel``): any object with the methods of
            :data:`shardkit.model_parallel_unit.MPU_METHODS`, e.g. the module
            ``shardkit.nn.model_parallel.initialize`` after
            ``initialize_model_parallel(tp)``. ``None`` with such a model uses the groups its
            layers were built with. The stage's wrappers then run over the data-parallel group
            only (initial weights broadcast from its rank 0, never across tensor-parallel
            ranks, which hold other slices); ``train_batch_size`` counts data-parallel ranks;
            the dataloader gives every tensor-parallel rank of a replica the same batch;
            ``gradient_clipping`` uses the unsplit model's norm (each slice and each
            replicated weight counted once); the fp16/bf16 skip decision is agreed over every
            rank; checkpoints keep each tensor-parallel rank's slices in ``TAG/mp_rank_XX``.
            It costs nothing beyond the layers' own collectives and, per step, one all-reduce
            of one element over the tensor-parallel group for the norm (the overflow flag is
            all-reduced over the world, as without ``mpu``). Pipeline-parallel sizes above 1,
            an ``mpu`` missing a method or disagreeing with the layers' groups are a
            :class:`~shardkit.config.ConfigError` before any collective.
        distributed_port: DeepSpeed's: the rendezvous port (``MASTER_PORT``) when this call
            starts the process group under a launcher that did not set one.
        peer_timeout_s: seconds without a peer's heartbeat before every surviving rank exits
            naming the lost one (:func:`shardkit.fault.watch_peers`; default
            ``SHARDKIT_PEER_TIMEOUT`` or 60; 0 turns the watchdog off).
        resume_from: a checkpoint directory: when it holds a complete checkpoint (its
            ``latest``), the engine loads it before returning (model, optimizer, scheduler,
            counters, RNG), so a job restarted by ``torchrun --max-restarts`` continues where
            the last complete save left off; ``engine.global_steps`` says where. Nothing is
            loaded when the directory or its ``latest`` does not exist yet.
        wrap_policy: stage 3: the ``auto_wrap`` policy choosing the FSDP units (default
            :func:`shardkit.recipes.default_wrap_policy`: HF's ``_no_split_modules``, else the
            repeated transformer blocks, else by parameter count).
        param_init_fn: stage 3, a model built under ``torch.device("meta")``: FSDP's
            ``param_init_fn`` (``callable(module)`` that materializes a module holding meta
            tensors), for modules without ``reset_parameters()`` (Hugging Face's RMSNorm,
            rotary embeddings); ``None``: each such module's ``reset_parameters()``. Every
            rank then takes rank 0's values. At stages 0-2 a ValueError.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``; ``dataloader`` is ``None`` without
        ``training_data``.

    Everything about the config and the arguments is checked before any wrapper's
    collective, and the ranks then agree on it: one small object all-gather over the world
    (each rank's verdict, its config's keys, fingerprints of its model and optimizer; none in
    a world of 1). So a refusal only some ranks reach (the llama-recipes pattern: the model on
    the meta device on every rank but rank 0, at stages 0-2; sparse embeddings on one rank)
    is raised on every rank, naming the refusing ranks and the first one's reason, and a
    config, model or optimizer that differs between ranks is a ValueError naming the first
    difference, instead of some ranks waiting in a collective. Costs: those of the stage's
    wrappers (module docstring), and that exchange.

    .. warning:: collective: call it on every rank, with the same config.
    """
    if distributed_port is not None and (isinstance(distributed_port, bool) or not isinstance(
            distributed_port, int) or not 0 < distributed_port < 65536):
        raise ConfigError(f"initialize(distributed_port={distributed_port!r}): expected a port "
                          f"number in 1-65535")
    # Every check below reads this rank's model, optimizer and config only; a refusal is
    # kept until the ranks have agreed (one exchange, after the process group exists), so
    # that a refusal only some ranks reach (a model on meta on all ranks but rank 0, sparse
    # embeddings or a config that differ on one rank) is raised on every rank.
    refusal = parallel = cfg = recipe = None
    try:
        config = _config_source(config, config_params, args)
        parallel = model_parallel_groups(model, mpu) if isinstance(model, nn.Module) else None
        world = parallel.data_size if parallel is not None else _data_parallel_world_size()
        cfg = load_config(config, world)
        _check_arguments(model, optimizer, lr_scheduler, cfg)
        _check_sparse_modules(model, cfg, optimizer)
        refuse_meta_tensors(model, cfg.zero.stage,
                            f"initialize: zero_optimization.stage={cfg.zero.stage}")
        if training_data is not None:
            _check_dataset(training_data, "initialize(training_data=")
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(f"initialize(resume_from={resume_from!r}): expected a directory "
                            f"path")
    except Exception as error:
        refusal = error
    if refusal is not None and not distributed.is_initialized() and "RANK" not in os.environ:
        raise refusal  # one process and no group: no rank to tell
    try:
        ensure_process_group(distributed_port)
    except Exception:
        if refusal is not None:
            raise refusal
        raise
    from shardkit import fault
    fault.watch_peers(peer_timeout_s)
    if refusal is None:
        try:
            recipe = _optimizer_recipe(cfg, optimizer, model_parameters, model)
            _check_config_scheduler(cfg, recipe)
            _checks_of_compose(model, recipe, cfg, wrap_policy, param_init_fn)
        except Exception as error:
            refusal = error
    compared = {} if refusal is not None else {
        **_flat_config(cfg.raw), "optimizer": optimizer_fingerprint(recipe),
        **({"model": model_fingerprint(model)} if parallel is None else {})}
    # tensor-parallel ranks hold other slices of the model: each rank's model is compared with
    # those of the ranks at the same tensor-parallel rank (its data-parallel replicas) only
    among = None if parallel is None or refusal is not None else (
        f"tensor-parallel rank {parallel.tensor_ranks.index(distributed.get_rank())}",
        {"model": model_fingerprint(model)})
    agree_on_refusal(refusal, None, "initialize", compared,
                     "call initialize with the same model, optimizer and config on every rank",
                     among=among)
    if distributed.get_rank() == 0:
        _ensure_log_handler()
        for note in cfg.warnings:
            logger.warning(note)
    section = cfg.raw.get("comms_logger")
    if isinstance(section, dict) and section.get("enabled"):
        # DeepSpeed's engine configures deepspeed.comm from it, and only when enabled (a
        # disabled section leaves a logger the script configured as it was); the section's
        # unwritten switches take DeepSpeed's defaults, not what an earlier configure() set
        from shardkit.deepspeed_compat import comm
        comm.configure(enabled=True, prof_all=section.get("prof_all", True),
                       prof_ops=list(section.get("prof_ops", [])),
                       verbose=section.get("verbose", False), debug=section.get("debug", False))
    if recipe is not None and cfg.precision.dtype != "fp32":
        cast = _keep_fp32_master_weights(model, recipe, cfg.zero.stage, wrap_policy)
        if cast and distributed.get_rank() == 0:
            logger.warning("%s training: %d 16-bit parameters and buffers of the model were cast "
                           "to fp32 master weights (the forward still runs in %s under autocast), "
                           "as DeepSpeed keeps fp32 master weights; stepping 16-bit weights "
                           "would lose small updates", cfg.precision.dtype, cast,
                           cfg.precision.dtype)
    if cfg.zero.stage < 3 and cfg.zero.offload_optimizer_device == "cpu" \
            and next(model.parameters()).is_cuda and distributed.get_rank() == 0:
        logger.warning("zero_optimization.offload_optimizer: CPU offload is implemented at "
                       "stage 3 only (FSDP move_params_to_cpu); at stage %d the optimizer "
                       "state stays on the GPU", cfg.zero.stage)
    left_out = _left_out_of_optimizer(model, recipe)
    if left_out and cfg.zero.stage == 1 and cfg.zero.reduce_to_owners \
            and distributed.get_rank() == 0:
        logger.warning("zero_optimization.reduce_scatter at stage 1: the optimizer leaves the "
                       "trainable parameter(s) %s out (they get gradients and are never "
                       "stepped), so gradients are all-reduced by torch DDP (3Ψ(N-1)/N a step) "
                       "rather than averaged onto their owners; set requires_grad=False on "
                       "them to keep the owners' reduction", _shown(left_out))
    state_names = _state_names_of(model)
    trainable, frozen = _names_by_trainability(model)  # before wrapping renames them
    # the tensor-parallel split of each key, read unwrapped (stage 3 then refuses the model's
    # own state_dict()) for the checkpoints' layout file
    tp_specs = None if parallel is None else _tp_split_specs(model)
    composition = compose_from_config(model, recipe, cfg, wrap_policy,
                                      None if parallel is None else parallel.data_group,
                                      param_init_fn, agree_across_ranks=False)
    scheduler = _build_scheduler(cfg, lr_scheduler, composition.optimizer)
    engine = ShardedEngine(model, composition, cfg, scheduler, state_names, trainable, frozen,
                           parallel)
    engine.tp_split_specs = tp_specs
    # DeepSpeed's optimizer_name() names the client's optimizer class when it passed one
    engine.client_optimizer_name = None if cfg.optimizer is not None or recipe is None \
        else recipe.cls.__name__
    # DeepSpeed's: deepspeed_io's default; in __dict__, so that a callable nn.Module is not
    # registered as a submodule of the engine (and deepspeed_io's default still finds it)
    engine.__dict__["collate_fn"] = collate_fn
    loader = None if training_data is None else engine.deepspeed_io(training_data)
    engine.training_dataloader = loader
    if resume_from is not None:
        _resume(engine, os.fspath(resume_from))
    return engine, composition.optimizer, loader, scheduler


def _check_lr_kwargs(scheduler, lr_kwargs: dict) -> None:
    """``engine.step(lr_kwargs=...)``: a ValueError naming the scheduler's ``step`` parameters
    when it would not take them (an unknown keyword, or one it requires missing: torch's
    ``ReduceLROnPlateau`` needs ``lr_kwargs={"metrics": ...}``), raised at an accumulation
    boundary before the optimizer steps (the scheduler's own TypeError came after the
    optimizer had stepped, so calling ``step()`` again stepped it twice). Local: every rank
    must pass the same keywords (a rank refused alone leaves the others waiting in the
    step's collectives)."""
    import inspect
    try:
        signature = inspect.signature(scheduler.step)
    except (TypeError, ValueError):  # no signature to read: let the call itself decide
        return
    try:
        signature.bind(**lr_kwargs)
    except TypeError as error:
        raise ValueError(f"engine.step(lr_kwargs={lr_kwargs!r}): {type(scheduler).__name__}."
                         f"step({', '.join(signature.parameters)}) does not take them "
                         f"({error})") from None


def _keep_fp32_master_weights(model: nn.Module, recipe: OptimizerRecipe, stage: int,
                              wrap_policy: Optional[Callable] = None) -> int:
    """fp16/bf16 training of a model whose weights are 16-bit (``from_pretrained(torch_dtype=
    torch.bfloat16)``, ``model.half()``): its fp16/bf16 parameters (the same ``Parameter``
    objects), their gradients, its fp16/bf16 buffers and any state the optimizer already holds
    for those parameters become fp32, so that the master weights and the optimizer state are
    fp32 and the forward runs in 16 bits under autocast, exactly as for an fp32 model
    (DeepSpeed keeps fp32 master weights whatever the model's dtype). Stepping the 16-bit
    weights themselves loses every update below half a unit in the last place (bf16 Adam at
    lr 1e-4 barely moves) and Adam's eps underflows in fp16 (the weights became inf).
    Frozen parameters (``requires_grad=False``: a LoRA base model) stay 16-bit, as in
    DeepSpeed (whose fp32 masters are the optimizer's); unfreeze before ``initialize``. At
    stage 3 those in an FSDP unit that also holds fp32 parameters become fp32 too: a unit holds
    one dtype (its shards keep ``1/N`` of them, so they cost ``2·Ψ/N`` more bytes per rank);
    units of frozen 16-bit parameters only keep them 16-bit.
    Returns how many tensors were cast (0 for a model holding FSDP units the user wrapped:
    their shards are left as they are). Memory: those tensors double. Local."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return 0
    half = (torch.float16, torch.bfloat16)
    state = recipe.instance.state if recipe.instance is not None else {}
    cast = 0
    with torch.no_grad():
        for param in model.parameters():
            if param.dtype not in half or not param.requires_grad:
                continue  # a frozen weight is never stepped: fp32 would only double it
            grad, param.grad = param.grad, None
            param.data = param.data.float()
            if grad is not None:
                param.grad = grad.float()
            for key, value in (state.get(param) or {}).items():
                if isinstance(value, torch.Tensor) and value.dtype in half:
                    state[param][key] = value.float()
            cast += 1
        if stage == 3:
            cast += _one_dtype_per_unit(model, wrap_policy)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.dtype in half:
                    module._buffers[name] = buffer.float()
                    cast += 1
    return cast


def _one_dtype_per_unit(model: nn.Module, wrap_policy: Optional[Callable]) -> int:
    """Stage 3: the 16-bit (frozen) parameters of each FSDP unit that the wrap policy will
    build and that also holds fp32 ones (fp32 master weights, or adapters kept in fp32 as
    PEFT does) become fp32: a unit holds one dtype. A unit of 16-bit parameters only (a
    frozen encoder) keeps them 16-bit. The units are found by a dry run of ``auto_wrap``
    with the same policy (nothing is wrapped). Returns how many were cast. Local."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.wrap.auto_wrap import planned_units
    from shardkit.recipes import block_wrap_policy
    policy = wrap_policy or block_wrap_policy(model)
    half, cast = (torch.float16, torch.bfloat16), 0
    for _, own in planned_units(model, policy, FullyShardedDataParallel):
        if len({p.dtype for p in own}) < 2:
            continue
        for param in own:
            if param.dtype in half:
                param.data = param.data.float()
                cast += 1
    return cast


def _tp_split_specs(model: nn.Module) -> dict:
    from shardkit.nn.model_parallel.full_state import split_specs
    return split_specs(model)


def _config_source(config, config_params, args):
    """The one config given: ``config``, its alias ``config_params``, or DeepSpeed's
    ``args.deepspeed_config`` (``--deepspeed_config``). Two of them is a :class:`ConfigError`,
    as in DeepSpeed: which one the run follows would otherwise be a silent choice."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize: config and config_params are aliases; pass only one")
    given = config if config is not None else config_params
    from_args = _config_from_args(args)
    if given is not None and from_args is not None:
        raise ConfigError(
            f"initialize: a config was given both as args.deepspeed_config={from_args!r} "
            f"(--deepspeed_config) and as config=...; pass only one (drop the command-line "
            f"flag or the config argument)")
    if given is None and isinstance(from_args, (str, os.PathLike)) \
            and not os.path.isfile(from_args):
        flag = "deepspeed_config" if getattr(args, "deepspeed_config", None) is not None \
            else "deepscale_config"
        raise ConfigError(f"initialize: args.{flag}={os.fspath(from_args)!r} (--{flag}): no "
                          f"such file; pass the path of a JSON config file")
    return given if given is not None else from_args


def _config_from_args(args):
    """``args.deepspeed_config``, or DeepSpeed's deprecated ``args.deepscale_config`` (read with
    a warning, as DeepSpeed does; both set is a :class:`ConfigError`)."""
    if args is None:
        return None
    current = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is None:
        return current
    if current is not None:
        raise ConfigError(f"initialize: args has both deepspeed_config={current!r} and the "
                          f"deprecated deepscale_config={old!r}; pass only --deepspeed_config")
    logger.warning("args.deepscale_config (--deepscale_config) is deprecated, as in DeepSpeed; "
                   "use --deepspeed_config")
    return old


def _resume(engine: ShardedEngine, load_dir: str) -> None:
    """Load ``load_dir``'s latest checkpoint if it has one (a first start has none: quiet)."""
    from shardkit.checkpoint import read_latest_tag
    if read_latest_tag(load_dir) is None:
        if distributed.get_rank() == 0:
            logger.info("resume_from=%s: no checkpoint yet; starting from step 0", load_dir)
        return
    path, _ = engine.load_checkpoint(load_dir)
    if distributed.get_rank() == 0:
        logger.info("resumed from %s at step %d", path, engine.global_steps)


def _ensure_log_handler() -> None:
    """Rank 0 prints the progress lines (as DeepSpeed does) unless logging is configured."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[shardkit] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _data_parallel_world_size() -> int:
    if distributed.is_initialized():
        return distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _build_scheduler(cfg: EngineConfig, lr_scheduler, optimizer):
    if cfg.scheduler is not None:
        return cfg.scheduler.build(optimizer)
    if lr_scheduler is not None and not _is_scheduler_instance(lr_scheduler):
        built = lr_scheduler(optimizer)
        if not callable(getattr(built, "step", None)):
            raise TypeError(f"initialize(lr_scheduler=<callable>): the callable must return a "
                            f"scheduler (an object with step()) built on the optimizer it is "
                            f"given, it returned {type(built).__name__}")
        return built
    return lr_scheduler


def _data_loader(dataset, cfg: EngineConfig, collate_fn,
                 parallel: Optional[ModelParallelGroups] = None, batch_size: Optional[int] = None,
                 shuffle: bool = True, sampler=None, pin_memory: bool = False,
                 num_workers: int = 0):
    """The micro-batch loader over this rank's share of ``dataset``: split over the
    data-parallel ranks (a ``DistributedSampler``, shuffled with its seed unless ``shuffle``
    is false; ``sampler`` replaces it), so the tensor-parallel ranks of one replica read the
    same samples. ``batch_size``: default the config's micro-batch size."""
    from torch.utils.data import DataLoader, DistributedSampler
    replicas, index = ((distributed.get_world_size(), distributed.get_rank()) if parallel is None
                       else (parallel.data_size, parallel.data_rank))
    if sampler is None:
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=index, shuffle=shuffle)
    return DataLoader(dataset, batch_size=batch_size or cfg.train_micro_batch_size_per_gpu,
                      sampler=sampler, collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last,
                      pin_memory=pin_memory, num_workers=num_workers)


def _check_dataset(dataset, where: str, sampler=None) -> None:
    """A ValueError (``where`` names the argument) unless ``dataset`` can be split over the
    data-parallel ranks by a sampler: a map-style ``Dataset`` or a sequence of samples (not an
    ``IterableDataset``: torch's ``DataLoader`` refuses any sampler with one). Local."""
    from torch.utils.data import Dataset, IterableDataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(f"{where}<{type(dataset).__name__}>): an IterableDataset cannot be "
                         f"split over the data-parallel ranks by a sampler (torch's DataLoader "
                         f"takes no sampler with one, data_sampler= included); give each rank "
                         f"its own share (e.g. from engine.global_rank) and build a "
                         f"DataLoader over it")
    elif not isinstance(dataset, Dataset) and not (hasattr(dataset, "__len__")
                                                   and hasattr(dataset, "__getitem__")):
        raise ValueError(f"{where}<{type(dataset).__name__}>): expected a "
                         f"torch.utils.data.Dataset (or a sequence of samples)")


# DeepSpeed's deepspeed_io routes (deepspeed.runtime.constants.ROUTE_*): "eval" and "predict"
# read the data in order, "train" and "encode" shuffled
_IO_ROUTES = ("train", "eval", "predict", "encode")


def _state_names_of(model: torch.nn.Module) -> list:
    """The keys of ``model.state_dict()`` without gathering: FSDP units the user built inside
    ``model`` (outermost ones, held by plain modules) give a full state dict by default, one
    all-gather per unit and the full model in memory; under ``LOCAL_STATE_DICT`` they give
    their shards under the same keys. Local."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.data_parallel.fsdp_state_dict_type import StateDictType
    if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return list(model.state_dict().keys())
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        return list(model.state_dict().keys())
