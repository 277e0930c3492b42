"""The weights' dtype of fp16/bf16 training under :func:`shardkit.initialize`. Stages 0-2
(:func:`_keep_16bit_weights`): the model's floating parameters become 16-bit and the optimizer
keeps fp32 master copies of the parameters it steps (:class:`shardkit.optim.MasterWeights`; at
stages 1-2 each rank's OSS shard, for the parameters it owns), DeepSpeed's layout and
DESIGN.md's mixed-precision column. Stage 3 (:func:`_keep_fp32_master_weights`): a model passed
with 16-bit weights gets its trainable 16-bit parameters, their gradients and optimizer state,
and its 16-bit buffers cast to fp32, which FSDP shards and steps as the masters (one dtype per
FSDP unit), gathering and computing them in 16 bits (:mod:`shardkit.engine_compose`'s
mixed-precision policy). Local; memory: the cast tensors halve or double.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from shardkit.recipes import OptimizerRecipe


def _keep_16bit_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Stages 0-2 with fp16/bf16: every floating parameter of ``model`` that is not ``dtype``
    (fp32 weights, or bf16 ones under an fp16 config) becomes ``dtype``, the same ``Parameter``
    objects, their gradients with them; buffers keep their dtype (autocast reads fp32 running
    statistics as it does for an fp32 model). The fp32 master weights are then the optimizer's
    (:class:`shardkit.optim.MasterWeights`): ``2 + 2`` bytes of weight and gradient per
    parameter on every rank and ``12`` bytes of master and Adam moments per stepped one (at
    stages 1-2 per owned one), where fp32 weights cost ``4 + 4`` and ``8``. A forward-only
    engine's model is cast too, as DeepSpeed halves the module. The weights and biases of
    BatchNorm (with fp32 running statistics), LayerNorm and GroupNorm layers stay fp32 where
    they are (:func:`_normalization_weights_kept_fp32`). Under fp16 the weights of
    embeddings built with ``sparse=True`` stay as they are: torch sums sparse gradients
    (accumulation, DDP's all-reduce) with no fp16 kernel on CPU ("cadd_sparse" not implemented
    for 'Half'); ``MasterWeights`` steps them in place. Returns how many parameters were cast.
    Local; memory: the cast parameters halve."""
    cast = 0
    kept = _sparse_embedding_weights(model) if dtype == torch.float16 else set()
    fp32_kept = _normalization_weights_kept_fp32(model)
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point() or param.dtype == dtype or id(param) in kept \
                    or (id(param) in fp32_kept and param.dtype == torch.float32):
                continue
            grad, param.grad = param.grad, None
            param.data = param.data.to(dtype)
            if grad is not None:
                param.grad = grad.to(dtype)
            cast += 1
    return cast


def _normalization_weights_kept_fp32(model: nn.Module) -> set:
    """``id``s of the affine parameters of the model's normalization layers that stay fp32
    (Apex's ``keep_batchnorm_fp32``), whose kernels take a 16-bit input beside fp32 weights but
    refuse 16-bit weights beside an fp32 operand: BatchNorm layers with fp32 running
    statistics (buffers keep their dtype: "expected scalar type BFloat16 but found Float"), and
    ``nn.LayerNorm`` / ``nn.GroupNorm``, which CPU autocast leaves to the input's dtype, so an
    fp32 activation (a 16-bit embedding plus an fp32 position-table buffer, promoted) failed
    with "mixed dtype (CPU): expect parameter to have scalar type of Float" (CUDA autocast runs
    them in fp32). ``MasterWeights`` steps them in place."""
    def kept(m: nn.Module) -> bool:
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return isinstance(m.running_mean, torch.Tensor) \
                and m.running_mean.dtype == torch.float32
        return isinstance(m, (nn.LayerNorm, nn.GroupNorm))
    return {id(p) for m in model.modules() if kept(m) for p in m.parameters(recurse=False)}


def _sparse_embedding_weights(model: nn.Module) -> set:
    """``id``s of the weights of the model's ``nn.Embedding`` / ``nn.EmbeddingBag`` built with
    ``sparse=True`` (their gradients are sparse)."""
    return {id(m.weight) for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse}


def _keep_fp32_master_weights(model: nn.Module, recipe: OptimizerRecipe, stage: int,
                              wrap_policy: Optional[Callable] = None) -> int:
    """fp16/bf16 training of a model whose weights are 16-bit (``from_pretrained(torch_dtype=
    torch.bfloat16)``, ``model.half()``): its fp16/bf16 parameters (the same ``Parameter``
    objects), their gradients, its fp16/bf16 buffers and any state the optimizer already holds
    for those parameters become fp32, so that the master weights and the optimizer state are
    fp32 and the forward runs in 16 bits (FSDP's mixed-precision gathers), exactly as for an
    fp32 model (DeepSpeed keeps fp32 master weights whatever the model's dtype). Stepping the 16-bit
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


def _batchnorm_statistics_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Stage 3 under fp16/bf16: the floating running statistics of the model's BatchNorm
    layers become ``dtype``, the dtype FSDP gathers their weights in, since torch's
    ``batch_norm`` refuses 16-bit weights beside fp32 statistics (DeepSpeed's ``module.half()``
    cast them too). Every other buffer keeps its dtype (DeepSpeed's rule: an fp32 rotary table
    or scale stays exact, in checkpoints too). A model holding FSDP units the user wrapped is
    left as it is (their own policy rules them). Returns how many were cast. Local; memory:
    the statistics halve."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return 0
    cast = 0
    for module in model.modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for name in ("running_mean", "running_var"):
            buffer = module._buffers.get(name)
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                module._buffers[name] = buffer.to(dtype)
                cast += 1
    return cast
