"""ShardedDataParallel's argument checks: each bad input raises a clear error naming the
argument and what would be valid, before any collective starts. No communication."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.utils.wrapped_attributes import wrapper_inside


def as_oss_list(sharded_optimizer) -> list:
    """The OSS optimizers given (one or a list); TypeError for anything that is not OSS."""
    from shardkit.optim.oss import OSS

    optimizers = (list(sharded_optimizer) if isinstance(sharded_optimizer, (list, tuple))
                  else [sharded_optimizer])
    if not optimizers:
        raise ValueError("ShardedDataParallel(sharded_optimizer=[]): give at least one OSS")
    for i, o in enumerate(optimizers):
        if not isinstance(o, OSS):
            where = "sharded_optimizer" if len(optimizers) == 1 else f"sharded_optimizer[{i}]"
            raise TypeError(f"ShardedDataParallel({where}=<{type(o).__module__}."
                            f"{type(o).__name__}>): expected shardkit.optim.OSS (wrap it: "
                            f"OSS(optimizer)); gradient sharding needs the OSS partition")
        if isinstance(o.optim, torch.optim.SparseAdam):
            where = "sharded_optimizer" if len(optimizers) == 1 else f"sharded_optimizer[{i}]"
            raise ValueError(f"ShardedDataParallel({where}=OSS(optim=SparseAdam)): SparseAdam "
                             f"takes sparse gradients only, and ShardedDataParallel reduces "
                             f"every gradient densely (a sparse one reaches its owner dense); "
                             f"use OSS under DistributedDataParallel for SparseAdam, or a "
                             f"dense optimizer (Adam, AdamW)")
    return optimizers


def check_not_data_parallel(module: nn.Module) -> None:
    """ValueError when ``module`` is, or holds, a data-parallel wrapper (ShardedDataParallel,
    FullyShardedDataParallel, torch DDP): the outer wrapper would average gradients that the
    inner one already reduced (an inner ShardedDataParallel: wrong updates and more traffic),
    or average different ranks' FSDP shards with each other. Local; no communication."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
    from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel

    found = wrapper_inside(module, (ShardedDataParallel, FullyShardedDataParallel,
                                    nn.parallel.DistributedDataParallel))
    if found is not None:
        where, inner = found
        raise ValueError(f"ShardedDataParallel(module=...): {where} is already a "
                         f"{type(inner).__name__}; its gradients are reduced there. Wrap "
                         f"the plain module once, with one data-parallel wrapper")


def device_types(module: nn.Module) -> list[str]:
    """The device type of the module's parameters; ``ValueError`` when they mix types."""
    types = sorted({p.device.type for p in module.parameters()})
    if len(types) > 1:
        raise ValueError(f"ShardedDataParallel(module=...): the parameters are on devices of "
                         f"several types {types}; put the whole module on one device type")
    return types


def check_reduce_buffer_size(size) -> None:
    """ValueError unless ``reduce_buffer_size`` is an int of bytes >= 0."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"ShardedDataParallel(reduce_buffer_size={size!r}): expected an int of "
                         f"bytes >= 0 (0: one parameter per bucket)")


def max_inflight_bytes_from(value, reduce_buffer_size: int, largest_grad_bytes: int = 0) -> int:
    """``max_inflight_bytes`` checked and resolved: ``None`` (the default) is two of the
    largest bucket, ``2 * max(reduce_buffer_size, largest_grad_bytes)`` (a parameter larger
    than ``reduce_buffer_size`` is a bucket of its own; with ``reduce_buffer_size=0`` small
    parameters' reductions then still overlap); otherwise an int of bytes >= 0. ValueError
    naming the argument otherwise (local, before any collective)."""
    if value is None:
        return 2 * max(reduce_buffer_size, largest_grad_bytes)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ShardedDataParallel(max_inflight_bytes={value!r}): must be None (two "
                         f"of the largest bucket) or an int >= 0 (bytes; 0 keeps one bucket in "
                         f"flight at most)")
    return value


def check_bool_flags(**flags) -> None:
    """TypeError naming the first flag that is not ``True`` or ``False`` (a string such as
    ``"no"`` would otherwise read as true and silently turn the option on)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"ShardedDataParallel({name}={value!r}): expected True or False")


def comm_dtype_from(reduce_fp16) -> Optional[torch.dtype]:
    """The dtype gradients travel in from ``reduce_fp16`` (``None``: the parameters' own)."""
    if reduce_fp16 is False or reduce_fp16 is None:
        return None
    if reduce_fp16 is True:
        return torch.float16
    if reduce_fp16 in (torch.float16, torch.bfloat16, torch.float32):
        return reduce_fp16
    raise ValueError(f"ShardedDataParallel(reduce_fp16={reduce_fp16!r}): expected a bool, "
                     f"torch.float16, torch.bfloat16 or torch.float32")


def common_group(process_group, optimizers):
    """The one process group of the optimizers (and of ``process_group`` if given)."""
    ranks = [skdist.group_ranks(o.group) for o in optimizers]
    for i, r in enumerate(ranks[1:], start=1):
        if r != ranks[0]:
            raise ValueError(f"ShardedDataParallel: sharded_optimizer[{i}] works over ranks {r}, "
                             f"sharded_optimizer[0] over {ranks[0]}; all must share one group")
    if process_group is None:
        return optimizers[0].group
    given = skdist.group_ranks(process_group)
    if given != ranks[0]:
        raise ValueError(f"ShardedDataParallel(process_group=<ranks {given}>): the optimizer's "
                         f"group has ranks {ranks[0]}; pass the optimizer's group (or None)")
    return process_group


def check_same_wrapping_on_every_rank(module: nn.Module, group, **settings) -> None:
    """One small all-gather at construction: every rank must wrap the same module (parameter
    and buffer names, shapes, dtypes) with the same ``settings`` (the arguments that shape the
    collectives: bucket size, communication dtype, buffer broadcasts, ...). Otherwise the ranks
    issue collectives of different sizes, and gloo aborts every process ("Received data size
    doesn't match expected size"). The ValueError names the first difference between rank 0
    and the first rank that differs from it, the same text on every rank. Communication: the
    names, shapes and settings of every rank, once."""
    mine = {name: repr(value) for name, value in settings.items()}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        mine[f"module.{name}"] = f"{tuple(t.shape)} {t.dtype}"
    skdist.raise_on_disagreement(mine, group, "ShardedDataParallel",
                                 "every rank must wrap the same module with the same arguments")


def check_optimizer_params_in_module(module: nn.Module, optimizers) -> None:
    """ValueError for an optimizer parameter outside ``module`` or in two optimizers (at
    construction and at every re-plan, which may follow ``OSS.add_param_group``). Local."""
    in_module = {id(p) for p in module.parameters()}
    seen: dict = {}
    for i, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                if id(p) not in in_module:
                    raise ValueError(
                        f"ShardedDataParallel: sharded_optimizer[{i}].param_groups[{g}]['params']"
                        f"[{k}] (shape {tuple(p.shape)}) is not a parameter of the wrapped module "
                        f"(its gradient would never be averaged); build the optimizer over "
                        f"module.parameters(), registering such a parameter on the module first "
                        f"(two ShardedDataParallel wrappers, a generator and a discriminator, "
                        f"need one OSS each, or one wrapper around a module holding both)")
                if id(p) in seen and seen[id(p)] != i:
                    raise ValueError(
                        f"ShardedDataParallel: a parameter of shape {tuple(p.shape)} is in "
                        f"sharded_optimizer[{seen[id(p)]}] and sharded_optimizer[{i}]; each "
                        f"parameter may belong to one optimizer only")
                seen[id(p)] = i


def in_param_groups(p: torch.Tensor, optimizer) -> bool:
    """Whether ``p`` is in one of ``optimizer``'s param groups."""
    return any(q is p for group in optimizer.param_groups for q in group["params"])


def param_names(module: nn.Module, params: Sequence[torch.Tensor]) -> list[str]:
    """The names in ``module`` of ``params`` (for error messages)."""
    wanted = {id(p) for p in params}
    return [name for name, p in module.named_parameters() if id(p) in wanted]
