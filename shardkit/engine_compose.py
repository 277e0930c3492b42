"""The config's choices turned into :func:`shardkit.recipes.compose`'s arguments
(:func:`compose_from_config`), and what compose would refuse for them, raised by
:func:`shardkit.initialize` before any collective (:func:`_checks_of_compose`). The wrappers'
memory and communication are the stage's (:mod:`shardkit.engine`'s table); these functions
themselves are local.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch
import torch.nn as nn

from shardkit.config import ConfigError, EngineConfig
from shardkit.optim.local_step import is_named_parameter
from shardkit.recipes import Composition, OptimizerRecipe, check_composable, compose


# the config's names of the 16-bit dtypes (precision and communication_data_type)
_HALF_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# the config's dtype names (precision, communication_data_type) -> torch dtypes
_DTYPE_OF_NAME = {**_HALF_DTYPES, "fp32": torch.float32}


def compose_from_config(model: nn.Module, recipe: Optional[OptimizerRecipe], cfg: EngineConfig,
                        wrap_policy: Optional[Callable] = None,
                        process_group=None, param_init_fn: Optional[Callable] = None,
                        agree_across_ranks: bool = True) -> Composition:
    """The stage's wrappers, built by :func:`shardkit.recipes.compose` from the config's
    choices, over ``process_group`` (the data-parallel group; ``None``: the world). DeepSpeed
    counts ``reduce_bucket_size`` in elements; ShardedDataParallel's bucket is in bytes of the
    (fp32) gradients, so the size is converted here, once. ``agree_across_ranks``: compose's
    (``False`` when the caller's ranks have agreed already, as :func:`~shardkit.initialize`
    does)."""
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
    _refuse_parameters_outside_model(model, recipe)
    left_out = _left_out_of_optimizer(model, recipe)
    if zero.stage < 3:  # 16-bit weights, fp32 masters in the optimizer (shards)
        kwargs["master_weights"] = cfg.precision.dtype != "fp32"
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
    if zero.stage == 3 and cfg.precision.dtype != "fp32":
        kwargs["mixed_precision"] = _stage3_mixed_precision(cfg)
    elif cfg.communication_dtype is not None:
        kwargs["reduce_dtype"] = _DTYPE_OF_NAME[cfg.communication_dtype]
    return kwargs


def _stage3_mixed_precision(cfg: EngineConfig):
    """Stage 3 under ``fp16``/``bf16``: FSDP's policy, as DeepSpeed's ZeRO-3 (16-bit
    parameters gathered and computed in, gradients reduce-scattered in
    ``communication_data_type``, by default the 16-bit dtype) while the fp32 shards stay the
    masters the optimizer steps. Buffers keep their dtypes, as DeepSpeed's (``initialize``
    casts BatchNorm statistics to the 16-bit dtype first,
    :func:`~shardkit.engine_master_weights._batchnorm_statistics_in`). Local."""
    from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
    reduce = _DTYPE_OF_NAME.get(cfg.communication_dtype)
    return MixedPrecisionPolicy(param_dtype=_HALF_DTYPES[cfg.precision.dtype],
                                reduce_dtype=reduce, keep_buffer_dtypes=True)


def _optimizer_params(recipe: OptimizerRecipe) -> Optional[list]:
    """The tensors the optimizer built from ``recipe`` steps, in its groups' order; ``None``
    for "every trainable parameter of the model". Local."""
    groups = recipe.instance.param_groups if recipe.instance is not None \
        else recipe.param_groups
    if groups is None:
        return None
    tensors = []
    for group in groups:
        params = group["params"] if isinstance(group, Mapping) else group
        params = [params] if isinstance(params, torch.Tensor) else params
        # torch's optimizers also take (name, parameter) pairs (model.named_parameters());
        # _optimizer_recipe puts a flat list of them into one group
        tensors.extend(p[1] if is_named_parameter(p) else p for p in params)
    return tensors


def _refuse_parameters_outside_model(model: nn.Module,
                                     recipe: Optional[OptimizerRecipe]) -> None:
    """A ConfigError when the optimizer (or ``model_parameters=``) holds tensors that are not
    parameters of ``model``: no stage averages their gradients (the wrappers reduce the
    model's), so the optimizer would step another model's tensors with one rank's gradients,
    or nothing at all, while the model never trains. Local."""
    tensors = [] if recipe is None else (_optimizer_params(recipe) or [])
    own = {id(p) for p in model.parameters()}
    foreign = [i for i, t in enumerate(tensors) if id(t) not in own]
    if not foreign:
        return
    shapes = [tuple(tensors[i].shape) for i in foreign]
    raise ConfigError(
        f"initialize: the optimizer (or model_parameters=...) holds {len(foreign)} of "
        f"{len(tensors)} tensors that are not parameters of model (shapes {_shown(shapes)}); "
        f"their gradients would never be averaged over the ranks, and a model whose "
        f"parameters the optimizer does not hold never trains. Build the optimizer over "
        f"model.parameters() (register any other trained tensor on the model first)")


def _left_out_of_optimizer(model: nn.Module, recipe: Optional[OptimizerRecipe]) -> list[str]:
    """Names of ``model``'s trainable parameters that the optimizer built from ``recipe`` does
    not step (``model_parameters=...`` or a passed optimizer covering only some of them, as
    DeepSpeed allows: the others get gradients and are never updated); ``[]`` when it steps
    them all or there is no optimizer. Local."""
    tensors = None if recipe is None else _optimizer_params(recipe)
    if tensors is None:  # no optimizer, or every trainable parameter
        return []
    stepped = {id(t) for t in tensors}
    return [name for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in stepped]


def _refuse_sequence_parallel_at_stage3(model: nn.Module) -> None:
    """Stage 3 cannot sum the gradients of sequence-parallel parameters over the
    tensor-parallel group (FSDP flattens them into its shards, whose gradients it reduces over
    the data-parallel group only): a ConfigError naming them, rather than partial gradients.
    Local."""
    from shardkit.nn.model_parallel.sequence_parallel import sequence_parallel_parameters
    marked_ids = {id(p) for p in sequence_parallel_parameters(model)}
    marked = [name for name, p in model.named_parameters() if id(p) in marked_ids]
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
