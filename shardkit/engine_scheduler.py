"""The learning-rate scheduler of :func:`shardkit.initialize`: the checks of a config
``scheduler`` section and of ``lr_scheduler=`` before any collective, building it over the
composed optimizer, and the step's ``lr_kwargs``. Local: no communication; memory: a one-element
stand-in optimizer per param group while checking.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Mapping

import torch

from shardkit.config import ConfigError, EngineConfig, TORCH_SCHEDULER_TYPES
from shardkit.recipes import OptimizerRecipe


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


def _note_step_taken_for(lr_scheduler) -> None:
    """At stages 1-2 OSS steps for the optimizer a torch scheduler was built on (it shares that
    optimizer's param groups), so that optimizer's own ``step`` never runs; mark it stepped
    the way torch's scheduler checks, or its first ``step`` warns that it came before any
    optimizer step."""
    optimizer = getattr(lr_scheduler, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer._opt_called = True
