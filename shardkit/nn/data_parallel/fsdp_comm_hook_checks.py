"""The checks :meth:`FullyShardedDataParallel.register_comm_hook
<shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel.register_comm_hook>` runs on
every unit before registering a hook: the strategies and options under which torch FSDP1
refuses one (or qgZ would be bypassed), and a hook that cannot take the arguments the unit's
strategy hands it. Local: they read only the wrapping, so every rank refuses alike."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

from shardkit.nn.data_parallel.sharding_strategy import ShardingStrategy

if TYPE_CHECKING:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel


class _RefusedCommHook(RuntimeError, AssertionError):
    """A ``register_comm_hook`` call torch FSDP1 refuses with an AssertionError: either
    ``except`` clause catches it."""


def _check_comm_hook_allowed(call: str, unit: FullyShardedDataParallel) -> None:
    """Refuse a communication hook on ``unit`` where torch FSDP1 does (hybrid strategies, a
    hook already registered) or where it would bypass the unit's own choice (qgZ)."""
    if unit.sharding_strategy.is_hybrid:
        raise _RefusedCommHook(
            f"{call}(): unit {type(unit.module).__name__} uses sharding_strategy="
            f"{unit.sharding_strategy.name}; communication hooks are not supported for the "
            f"hybrid strategies (as in torch FSDP1); use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD, "
            f"or for compressed gradients mixed_precision=MixedPrecision("
            f"reduce_dtype=torch.float16)")
    if unit._comm_hook is not None:
        raise _RefusedCommHook(f"{call}(): a communication hook is already registered "
                               f"({unit._comm_hook!r}); register one hook, once")
    if unit.quantize_gradients:
        raise ValueError(f"{call}(): unit {type(unit.module).__name__} was built with "
                         f"quantize_gradients=True (qgZ), whose compressed reduce-scatter a "
                         f"hook would replace; wrap without quantize_gradients to use a hook")


def _check_comm_hook_arity(call: str, unit: FullyShardedDataParallel, state: object,
                           hook: Callable) -> None:
    """Refuse a ``hook`` that cannot take the arguments ``unit``'s strategy hands it:
    ``hook(state, grad)`` under NO_SHARD, ``hook(state, grad, output)`` otherwise. Without
    this, torch's ``allreduce_hook`` registered on a FULL_SHARD model fails in the middle of
    the first backward, after the unit's first collective, with a bare TypeError. A hook
    whose signature Python cannot read (a builtin) is let through."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return
    no_shard = unit.sharding_strategy is ShardingStrategy.NO_SHARD
    args = (state, None) if no_shard else (state, None, None)
    try:
        signature.bind(*args)
    except TypeError as error:
        expected = "hook(state, grad)" if no_shard else "hook(state, grad, output)"
        other = ("a reduce-scatter hook such as reduce_scatter_hook needs a sharded strategy"
                 if no_shard else "an all-reduce hook such as allreduce_hook needs NO_SHARD")
        name = getattr(hook, "__qualname__", repr(hook))
        raise ValueError(
            f"{call}(hook={name}): unit {type(unit.module).__name__} uses sharding_strategy="
            f"{unit.sharding_strategy.name}, which calls {expected}, and the hook's signature "
            f"{signature} does not take that ({error}); {other}") from None
