"""The checks of :func:`shardkit.initialize`'s arguments against each other and the config
(model, optimizer, scheduler, sparse embeddings, forward only): the same error on every rank,
before any wrapper exists or any collective starts. Local: no communication, no memory.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardkit.config import ConfigError, EngineConfig
from shardkit.engine_scheduler import _check_builds_from_the_optimizer, _is_scheduler_instance
from shardkit.recipes import why_not_steppable_on_shards


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
