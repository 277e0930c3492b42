"""The refusals a :class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel`
unit makes when it is built, before any collective: a module wrapped twice or holding another
data-parallel wrapper, a BatchNorm that would meet statistics of another dtype, an
``nn.Embedding(max_norm=...)`` that would write into the temporary gathered weight. Each is a
ValueError naming the argument and the way out, raised alike on every rank. Local."""

from __future__ import annotations

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.fsdp_arguments import IgnoredStates
from shardkit.nn.data_parallel.fsdp_unit_modules import (_WRAPPED_MODULES, _is_unit,
                                                         _named_unit_modules, _unit_modules)
from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
from shardkit.utils.wrapped_attributes import wrapper_inside


def _check_wrappable(module) -> None:
    if _is_unit(module):
        raise ValueError("FullyShardedDataParallel(module): module is already a "
                         "FullyShardedDataParallel; wrap each module once (use the existing "
                         "instance). auto_wrap returns the root already wrapped when its "
                         "policy selects the root (a size policy on a model of at least "
                         "min_num_params, as FairScale's FSDP(auto_wrap(model)) benchmark): "
                         "use that result as the root")
    if not isinstance(module, nn.Module):
        raise ValueError(f"FullyShardedDataParallel(module={type(module).__name__}): expected "
                         f"a torch.nn.Module")
    if module in _WRAPPED_MODULES:
        raise ValueError(f"FullyShardedDataParallel: this {type(module).__name__} is already "
                         f"wrapped by another FullyShardedDataParallel; wrap each module once "
                         f"(use that instance, or build a fresh module)")


def _refuse_other_data_parallel(module: nn.Module, ignored: IgnoredStates) -> None:
    """A ShardedDataParallel or torch DDP inside the unit would reduce gradients of parameters
    that FSDP flattens and shards itself. Inner FSDP units are fine (nesting), and so is one
    inside an ignored module (``ignored_modules``: its own scheme syncs it). Local."""
    from shardkit.nn.data_parallel.sharded_ddp import ShardedDataParallel

    kinds = (ShardedDataParallel, nn.parallel.DistributedDataParallel)
    if ignored:
        found = next(((f"module.{name}" if name else "module", m)
                      for name, m in _named_unit_modules(module, ignored)
                      if isinstance(m, kinds)), None)
    else:
        found = wrapper_inside(module, kinds)
    if found is not None:
        where, inner = found
        raise ValueError(f"FullyShardedDataParallel(module=...): {where} is already a "
                         f"{type(inner).__name__}, which reduces gradients itself; wrap the "
                         f"plain module (FSDP reduces its gradients)")


def _refuse_batchnorm_with_other_buffer_dtype(module: nn.Module, policy: MixedPrecisionPolicy,
                                              ignored: IgnoredStates) -> None:
    """With ``buffer_dtype`` other than the compute dtype (the parameters' own dtype without
    mixed precision), a BatchNorm whose weight this unit gathers would meet running statistics
    of another dtype, which torch's ``batch_norm`` refuses at the first forward ("expected
    scalar type Float but found BFloat16"): say so here, with the ways out. Local, before any
    collective."""
    cast = policy.buffer_cast_dtype()
    params = [p for p in module.parameters() if p.is_floating_point()]
    compute = policy.compute_dtype(params[0].dtype if params else torch.float32)
    if cast == compute or (cast is None and not policy.keep_buffer_dtypes):
        return
    for m in _unit_modules(module, ignored):
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None \
                and m.running_mean is not None:
            buffers = cast or m.running_mean.dtype  # torch's policy: buffers keep their dtype
            if buffers == compute:
                continue
            if policy.keep_buffer_dtypes:  # torch's MixedPrecision(buffer_dtype=None)
                call = (f"FullyShardedDataParallel(mixed_precision=MixedPrecision(param_dtype="
                        f"{policy.param_dtype}, buffer_dtype=None))")
                torch_way = (f"give this FSDP an auto_wrap_policy (torch's way: each BatchNorm "
                             f"gets a full-precision unit of its own), or pass MixedPrecision("
                             f"..., buffer_dtype={compute})")
            else:
                call = (f"FullyShardedDataParallel(compute_dtype={policy.param_dtype}, "
                        f"buffer_dtype={policy.buffer_dtype})")
                torch_way = "leave buffer_dtype unset"
            raise ValueError(
                f"{call}: this unit holds a {type(m).__name__}, whose weight would be gathered "
                f"in {compute} beside running statistics in {buffers}, which torch's "
                f"batch_norm refuses. Give the BatchNorm layers their own full-precision units "
                f"first (model = auto_wrap_bn(model), FairScale's way), or {torch_way} "
                f"(statistics in {compute})")


def _refuse_embedding_max_norm(module: nn.Module,
                               ignored: IgnoredStates) -> None:
    """An ``nn.Embedding(max_norm=...)`` renormalises the looked-up rows of its weight in place
    during forward. In a unit that weight is a view of the gathered (temporary) full
    parameter: autograd refuses the in-place write ("a view ... has been modified inplace"),
    and were it allowed, the write would be dropped at reshard, not reach the shard. Say so
    here, with the ways out. Local, before any collective."""
    for name, m in _named_unit_modules(module, ignored):
        if isinstance(m, nn.Embedding) and m.max_norm is not None:
            raise ValueError(
                f"FullyShardedDataParallel: {name or 'the module'} is nn.Embedding(max_norm="
                f"{m.max_norm}), which renormalises rows of its weight in place in forward; "
                f"under FSDP that weight is a temporary gathered copy, so the write cannot "
                f"reach the shard. Build the embedding with max_norm=None (and, if you need "
                f"the bound, renormalise the rows yourself under torch.no_grad() in "
                f"summon_full_params(), or clamp the looked-up vectors' norms in forward)")
