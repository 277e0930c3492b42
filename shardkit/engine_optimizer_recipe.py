"""How :func:`shardkit.initialize` gets the optimizer it composes: an
:class:`~shardkit.recipes.OptimizerRecipe` from the config's ``optimizer`` section, a passed
optimizer or a ``callable(params)`` (at stage 3 one that built state is rebuilt over FSDP's
shards). Local: no communication; memory: an optimizer the callable builds, until the recipe
replaces it.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from shardkit.config import ConfigError, EngineConfig
from shardkit.optim.local_step import is_named_parameter
from shardkit.recipes import OptimizerRecipe, why_not_on_row_shards


def _optimizer_recipe(cfg: EngineConfig, optimizer, model_parameters,
                      model) -> Optional[OptimizerRecipe]:
    """How to build the optimizer; ``None`` without one (a forward-only engine)."""
    if cfg.optimizer is None and optimizer is None:
        return None
    if cfg.optimizer is not None:
        if model_parameters is not None:
            model_parameters = list(model_parameters)
            if model_parameters and all(is_named_parameter(p) for p in model_parameters):
                # model.named_parameters(): one group of (name, parameter) pairs, as torch's
                # optimizers read such a list
                model_parameters = [{"params": model_parameters}]
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
    (:func:`~shardkit.engine_arguments._check_arguments`): a torch optimizer, and at stage 3 one
    that can step FSDP's row shards (state it built already is no reason to refuse: it is
    rebuilt over the shards, see :func:`_recipe_rebuilt_on_shards`). The same
    :class:`ConfigError` on every rank, before any wrapper exists or any collective starts.
    Local."""
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
