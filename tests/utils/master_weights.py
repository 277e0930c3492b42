"""What tests read of an engine's fp32 weights whatever its precision and stage.

With ``fp16``/``bf16`` at ZeRO stages 0-2 the model's weights are 16-bit and the fp32 master
weights are the optimizer's (``shardkit.optim.MasterWeights``; at stages 1-2 on each parameter's
OSS owner); at stage 3 and in fp32 the parameters are the fp32 weights. Tests that compare
training against one fp32 process compare these.
"""

import torch

from shardkit.optim.master_weights import master_weights_of
from shardkit.utils.tensor_fragment import safe_get_full_fp32_param


def fp32_weights(engine) -> dict:
    """``{name: full fp32 value}`` of every parameter of ``engine.module`` (the fp32 master of
    a 16-bit weight), on every rank. Collective at stages 1-3: every rank must call it."""
    return {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}


def masters_of(engine):
    """The engine's ``MasterWeights`` (at stages 1-2 OSS's local one), or ``None``."""
    return master_weights_of(engine.optimizer)


def master_dtype(engine) -> torch.dtype:
    """The dtype the optimizer steps: the masters' under ``MasterWeights``, else the
    parameters' own. Local."""
    masters = masters_of(engine)
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    if masters is None:
        return params[0].dtype
    held = next(p for p in params if masters.holds(p))
    return masters.master_weight_of(held).dtype
