"""The validated DeepSpeed-style configuration behind :func:`shardkit.initialize`.

:func:`load_config` reads a dict or a JSON file, checks every key against :data:`SCHEMA`
(unknown keys at any depth, wrong types and out-of-range values are errors naming the dotted
path and, for unknown keys, the closest valid key), fills DeepSpeed's defaults, resolves the
batch-size triple with the data-parallel world size, and returns a frozen :class:`EngineConfig`.
It is a pure function of its inputs: it issues no collectives, so every rank raises the same
error at the same point and none is left waiting.

Keys that change behaviour:
    train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
    optimizer.{type (Adam, AdamW, SGD, Adagrad with torch.optim.Adagrad's names, and, as
    DeepSpeed's getattr(torch.optim, type) fallback, RMSprop, Adamax, NAdam, RAdam, Adadelta,
    ASGD, Rprop and Adafactor (stages 0-2), their params checked against the constructor;
    DeepSpeed's Lamb, 1-bit/0-1 optimizers, Lion, mup's Mu* and Muon are refused by name:
    pass such an optimizer object instead), params}, scheduler.{type (WarmupLR,
    WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, and, as DeepSpeed's
    getattr(torch.optim.lr_scheduler, type) fallback, StepLR, MultiStepLR, ConstantLR,
    LinearLR, ExponentialLR, PolynomialLR, CosineAnnealingLR, CosineAnnealingWarmRestarts,
    CyclicLR, OneCycleLR and ReduceLROnPlateau, their params and the JSON types of their values
    checked against the constructor), params}, gradient_clipping,
    steps_per_print,
    gradient_allreduce_op ("mean", the default, or "sum": gradients summed over the
    data-parallel ranks; stages 0-2),
    zero_optimization.{stage, reduce_bucket_size (elements, as in DeepSpeed), reduce_scatter
    (stage 1, default true as in DeepSpeed: each gradient is averaged onto its owner only, so
    stage 1 moves 2Ψ(N-1)/N a step; false, or an optimizer leaving some trainable parameters
    out: torch DDP's all-reduce, 3Ψ(N-1)/N),
    offload_param.device (stage 3), offload_optimizer.device, zero_quantized_weights and
    zero_quantized_gradients (stage 3: FSDP's quantize_weights / quantize_gradients, ZeRO++),
    zero_hpz_partition_size (stage 3: FSDP's hpz_partition_size), ignore_unused_parameters
    (stages 0-1, default true as in DeepSpeed: torch DDP with find_unused_parameters, so a
    forward may leave parameters unused)}, communication_data_type
    ("fp16"/"bf16": gradients reduced in 16 bits at every stage), fp16.{enabled, loss_scale,
    initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis, min_loss_scale,
    raise_error_at_min_scale}, bf16.{enabled, check_grad_overflow (default true as in
    DeepSpeed: a step whose gradients hold inf/nan is skipped, scheduler included)},
    dataloader_drop_last (default false: the training_data loader keeps a last, smaller
    micro-batch), checkpoint.tag_validation ("Warn", the default, "Fail" or "Ignore": whether
    save_checkpoint compares the ranks' tags),
    activation_checkpointing.{partition_activations, contiguous_memory_optimization (needs
    partition_activations and number_checkpoints), cpu_checkpointing, number_checkpoints,
    synchronize_checkpoint_boundary, profile}: checked here and kept as
    EngineConfig.activation_checkpointing; as in DeepSpeed, the engine does not apply them:
    shardkit.checkpointing.configure(mpu, deepspeed_config=<this config, or engine.config>)
    does, and shardkit.checkpointing.checkpoint(fn, *args) uses them.
Keys accepted for compatibility with DeepSpeed configs, validated, without effect here:
    the other zero_optimization tuning knobs (allgather_bucket_size, overlap_comm,
    contiguous_gradients, reduce_scatter at stages 2-3, stage3_* ..., memory_efficient_linear:
    DeepSpeed's stage-3 linear saving less for backward, same values),
    zero_optimization.zero_quantized_nontrainable_weights when false (true, int8 frozen
    weights, would change the forward: refused), the hybrid_engine section (enabled, max_out_tokens,
    inference_tp_size, release_inference_cache, pin_parameters, tp_gather_partition_size,
    enable_cuda_graph: DeepSpeed's RLHF generation speed-up; training is the same, and when
    enabled a note says engine.generate is the model's own generate, without DeepSpeed's
    inference kernels or tensor-parallel generation), offload *.pin_memory /
    buffer_*, offload_optimizer.ratio (the whole state is offloaded), fp16.auto_cast,
    bf16.immediate_grad_update, wall_clock_breakdown and
    memory_breakdown (when true, a note says no breakdown is printed), prescale_gradients,
    gradient_predivide_factor,
    zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer, dump_state,
    zero_optimization.log_trace_cache_warnings, offload_*.nvme_path (while the device is not
    "nvme", which is refused naming NVMe: CPU offload is provided), the aio section (NVMe I/O
    tuning), optimizer.legacy_fusion, compression_training (DeepSpeed compresses only a model
    passed through init_compression, not provided here; a note says so when a technique is
    enabled); data_types.grad_accum_dtype when
    it names the dtype the engine accumulates gradients in (fp16/bf16 at stages 0-2 under
    that precision, else fp32); sparse_gradients at stage 0 (torch DDP reduces sparse
    embedding gradients) or when false; fp16.fp16_master_weights_and_grads when false; and,
    while
    switched off, the sections amp,
    tensorboard, wandb, csv_monitor, flops_profiler, data_efficiency,
    curriculum_learning, elasticity and autotuning, and checkpoint.load_universal,
    use_node_local_storage and parallel_write.pipeline_stage, progressive_layer_drop,
    eigenvalue, compile (DeepCompile), nebula, disable_allgather and
    use_data_before_expert_parallelism; zero_optimization.zenflow while null;
    managed_gradient_accumulation when true; timers, graph_harvesting,
    seq_parallel_communication_data_type, log_level, vocabulary_size and
    zero_optimization.leaf_module (speed, logging and fetching only). A value these do not
    accept is an error that names what to use instead. train_batch_size,
    train_micro_batch_size_per_gpu and gradient_accumulation_steps may be null (as absent).
    comms_logger is read by ``initialize`` (``shardkit.comm.configure``: counts and bus bytes
    per op, no latencies).
Hugging Face's ``"auto"`` placeholders (its Trainer fills them in before DeepSpeed reads
the config) are refused in one ConfigError naming every such key, except at
zero_optimization's bucket sizes and stage-3 thresholds, where DeepSpeed reads ``"auto"`` as
the default (OpenRLHF's configs rely on it) and so does shardkit.
DeepSpeed's older section name ``bfloat16`` is read as ``bf16``, and its oldest form
``"zero_optimization": true`` as stage 1 (``false``: stage 0).
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

__all__ = ["ConfigError", "EngineConfig", "OptimizerSpec", "SchedulerSpec", "ZeroConfig",
           "PrecisionConfig", "ActivationCheckpointingConfig", "activation_checkpointing_config",
           "load_config", "resolve_batch_sizes", "SCHEMA"]


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key path."""


# ----------------------------------------------------------------------------- schema as data


@dataclass(frozen=True)
class Field:
    """One leaf of the schema: accepted Python types, default, and an optional range check
    returning a description of what is valid when the value is not."""

    types: tuple
    default: Any = None
    check: Optional[Callable[[Any], bool]] = None
    valid: str = ""
    choices: tuple = ()
    refusal: str = ""  # what a failed check says, when not "out of range" / "not a valid choice"


def _int(default=None, minimum=None, maximum=None) -> Field:
    lo = "" if minimum is None else f">= {minimum}"
    hi = "" if maximum is None else f"<= {maximum}"
    return Field((int,), default,
                 lambda v: (minimum is None or v >= minimum) and (maximum is None or v <= maximum),
                 "an integer " + " and ".join(x for x in (lo, hi) if x))


def _num(default=None, minimum=None, strict=False) -> Field:
    def ok(v):
        if not math.isfinite(v):
            return False
        return minimum is None or (v > minimum if strict else v >= minimum)
    bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum}"
    return Field((int, float), default, ok, f"a finite number{bound}")


def _bool(default=False) -> Field:
    return Field((bool,), default)


def _choice(default, *choices, case_insensitive=False) -> Field:
    folded = {c.lower() for c in choices}
    return Field((str,), default,
                 (lambda v: v.lower() in folded) if case_insensitive else (lambda v: v in choices),
                 f"one of {list(choices)}", tuple(choices))


def _betas() -> Field:
    return Field((list, tuple), (0.9, 0.999),
                 lambda v: len(v) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1
                                               for b in v),
                 "a pair of numbers in [0, 1)")


def _nullable(spec: Field) -> Field:
    """``spec`` that also accepts ``null`` (its default then applies)."""
    valid = spec.valid or " or ".join(t.__name__ for t in spec.types)  # a bare type: its name
    return Field(spec.types + (type(None),), spec.default,
                 lambda v: v is None or spec.check is None or spec.check(v), f"{valid} or null")


def _num_or_list(default, nullable: bool = False) -> Field:
    """A learning rate: a number >= 0 or one per param group; ``nullable``: ``null`` too
    (each group's own lr)."""
    null = (type(None),) if nullable else ()
    return Field((int, float, list) + null, default,
                 lambda v: v is None or all(isinstance(x, (int, float)) and x >= 0
                                            for x in (v if isinstance(v, list) else [v])),
                 "a number >= 0 or a list of them (one per param group)"
                 + (", or null (each param group's own lr)" if nullable else ""))


_ADAM_PARAMS = {
    "lr": _num(1e-3, 0), "betas": _betas(), "eps": _num(1e-8, 0, strict=True),
    "weight_decay": _num(0.0, 0), "amsgrad": _bool(), "bias_correction": _bool(True),
    "adam_w_mode": _bool(True), "torch_adam": _bool(), "fused": _bool(),
}
_SGD_PARAMS = {
    "lr": _num(1e-3, 0), "momentum": _num(0.0, 0), "dampening": _num(0.0, 0),
    "weight_decay": _num(0.0, 0), "nesterov": _bool(),
}
# torch.optim.Adagrad's names and defaults (DeepSpeed passes params to it as written; its CPU
# Adagrad, used with offload_optimizer, is the same update with lr_decay and
# initial_accumulator_value 0)
_ADAGRAD_PARAMS = {
    "lr": _num(1e-2, 0), "lr_decay": _num(0.0, 0), "weight_decay": _num(0.0, 0),
    "initial_accumulator_value": _num(0.0, 0), "eps": _num(1e-10, 0), "maximize": _bool(),
}
OPTIMIZER_PARAMS = {"adam": _ADAM_PARAMS, "adamw": _ADAM_PARAMS, "sgd": _SGD_PARAMS,
                    "adagrad": _ADAGRAD_PARAMS}
# DeepSpeed builds any other name as getattr(torch.optim, type)(params, **params): these
# torch.optim classes are built the same way, their params checked against the constructor.
# Each updates every element on its own, so ZeRO's shards step exactly as the whole tensor
# does; Adafactor factors 2-D moments over whole rows and columns, so it runs at stages 0-2
# (whole parameters) only.
TORCH_OPTIMIZER_TYPES = ("RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop",
                         "Adafactor")
OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Adagrad") + TORCH_OPTIMIZER_TYPES
# DeepSpeed's optimizer names shardkit does not build, with what each is
_NOT_PROVIDED_OPTIMIZERS = {
    "lamb": "DeepSpeed's FusedLamb, a CUDA kernel",
    "onebitadam": "DeepSpeed's 1-bit Adam, with compressed communication",
    "zerooneadam": "DeepSpeed's 0/1 Adam, with compressed communication",
    "onebitlamb": "DeepSpeed's 1-bit LAMB, with compressed communication",
    "lion": "DeepSpeed's FusedLion / CPU Lion; torch has no Lion",
    "muadam": "the mup package's MuAdam",
    "muadamw": "the mup package's MuAdamW",
    "musgd": "the mup package's MuSGD",
    "muon": "DeepSpeed's MuonWithAuxAdam: Muon on parameters marked use_muon, Adam on the rest",
    "lbfgs": "torch.optim.LBFGS, whose step needs a closure that engine.step() does not pass",
    "sparseadam": "torch.optim.SparseAdam, which needs every gradient sparse",
}

_WARMUP = {
    "warmup_min_lr": _num_or_list(0.0), "warmup_max_lr": _num_or_list(0.001),
    "warmup_num_steps": _int(1000, 1), "warmup_type": _choice("log", "log", "linear"),
    "last_batch_iteration": _int(-1, -1),
}
SCHEDULER_PARAMS = {
    # DeepSpeed's WarmupLR warms up to each param group's own lr unless warmup_max_lr is
    # given; its WarmupDecayLR keeps 0.001
    "WarmupLR": {**_WARMUP, "warmup_max_lr": _num_or_list(None, nullable=True)},
    "WarmupDecayLR": {**_WARMUP, "total_num_steps": _int(None, 1)},
    "WarmupCosineLR": {
        "total_num_steps": _int(None, 1), "warmup_min_ratio": _num(0.0, 0),
        "warmup_num_steps": _int(1000, 1), "cos_min_ratio": _num(0.0001, 0),
        "warmup_type": _choice("log", "log", "linear"), "last_batch_iteration": _int(-1, -1),
    },
    "OneCycle": {
        # a number, or one per param group (DeepSpeed's "float or list")
        "cycle_min_lr": _num_or_list(None), "cycle_max_lr": _num_or_list(None),
        "decay_lr_rate": _num(0.0, 0), "cycle_first_step_size": _int(2000, 1),
        # 0: no falling half (DeepSpeed accepts it)
        "cycle_second_step_size": _nullable(_int(None, 0)),
        "cycle_first_stair_count": _int(0, 0),
        "cycle_second_stair_count": _nullable(_int(None, 0)),
        "decay_step_size": _int(0, 0), "cycle_momentum": _bool(True),
        "cycle_min_mom": _num_or_list(0.8), "cycle_max_mom": _num_or_list(0.9),
        "decay_mom_rate": _num(0.0, 0), "last_batch_iteration": _int(-1, -1),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": _num_or_list(0.001), "lr_range_test_step_size": _int(2000, 1),
        "lr_range_test_step_rate": _num(1.0, 0), "lr_range_test_staircase": _bool(),
        "last_batch_iteration": _int(-1, -1),
    },
}
REQUIRED_SCHEDULER_PARAMS = {"WarmupDecayLR": ("total_num_steps",),
                             "WarmupCosineLR": ("total_num_steps",),
                             "OneCycle": ("cycle_min_lr", "cycle_max_lr")}
# DeepSpeed builds any other scheduler.type as torch.optim.lr_scheduler.<type>(optimizer,
# **params) (its engine's _scheduler_from_config): the torch schedulers a JSON config can
# describe. Their params are checked against the constructor here, and their values by
# building one beside the optimizer in initialize, before any collective.
TORCH_SCHEDULER_TYPES = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
                         "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts",
                         "CyclicLR", "OneCycleLR", "ReduceLROnPlateau")
SCHEDULER_TYPES = tuple(SCHEDULER_PARAMS) + TORCH_SCHEDULER_TYPES
# torch schedulers built from Python objects, which a JSON config cannot hold
_SCHEDULERS_OF_OBJECTS = {"LambdaLR": "a function of the step",
                          "MultiplicativeLR": "a function of the step",
                          "SequentialLR": "other scheduler objects",
                          "ChainedScheduler": "other scheduler objects"}


def _off(feature: str, instead: str) -> Field:
    """A DeepSpeed switch shardkit accepts only when off: ``True`` is an error naming what
    to use instead (never silently ignored)."""
    return Field((bool,), False, lambda v: v is False,
                 f"false (shardkit does not implement DeepSpeed's {feature}; {instead})",
                 refusal="is not supported")


def _str(default=None) -> Field:
    return Field((str,), default)


def _monitor(feature: str, instead: str, **extra: Field) -> dict:
    """A DeepSpeed monitoring section: validated, accepted while ``enabled`` is false."""
    return {"enabled": _off(feature, instead), **extra}


# communication_data_type's names (DeepSpeed's and torch's) -> the engine's dtype names
_COMM_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16",
                "bf16": "bf16", "bfloat16": "bf16"}

# DeepSpeed's DtypeEnum names of the dtypes data_types.grad_accum_dtype may name
_ACCUM_DTYPES = {**_COMM_DTYPES, "torch.float32": "fp32", "float": "fp32",
                 "torch.float16": "fp16", "half": "fp16", "torch.bfloat16": "bf16",
                 "bfloat": "bf16"}

_LOG_INSTEAD = "log from the training loop (engine.get_lr(), the loss), or remove the section"

# device "nvme" is refused by _refuse_nvme (before this schema) naming what to use; nvme_path
# is accepted while the device is "cpu" or "none" (DeepSpeed reads it for NVMe only)
_OFFLOAD_COMMON = {"device": _choice("none", "none", "cpu"), "pin_memory": _bool(),
                   "buffer_count": _int(4, 1), "fast_init": _bool(),
                   # DeepSpeed's share of the optimizer state offloaded: the whole state is
                   # here (the same values; more host memory where it is below 1)
                   "ratio": Field((int, float), 1.0,
                                  lambda v: math.isfinite(v) and 0 <= v <= 1,
                                  "a number in [0, 1]"),
                   "nvme_path": Field((str, type(None)), None)}
# DeepSpeed's NVMe pipelining switches of offload_optimizer: tuning only, no effect on CPU offload
_OFFLOAD_PIPELINE = {"pipeline_read": _bool(), "pipeline_write": _bool()}

SCHEMA: dict = {
    # null: not given (DeepSpeed's get_scalar_param), derived from the other two
    "train_batch_size": _nullable(_int(None, 1)),
    "train_micro_batch_size_per_gpu": _nullable(_int(None, 1)),
    "gradient_accumulation_steps": _nullable(_int(None, 1)),
    # checked by _optimizer_spec: one of OPTIMIZER_TYPES (any case), and a clear refusal of
    # DeepSpeed's names shardkit does not build
    "optimizer": {"type": _str(), "params": "per optimizer type",
                  "legacy_fusion": _bool()},  # DeepSpeed's old fused fp16 optimizer switch
    # checked by _scheduler_spec: one of SCHEDULER_TYPES
    "scheduler": {"type": _str(), "params": "per scheduler type"},
    "zero_optimization": {
        "stage": _int(0, 0, 3),
        "offload_optimizer": {**_OFFLOAD_COMMON, **_OFFLOAD_PIPELINE},
        "offload_param": {**_OFFLOAD_COMMON, "buffer_size": _num(1e8, 0),
                          "max_in_cpu": _num(1e9, 0)},
        "reduce_bucket_size": _num(None, 0, strict=True),
        "allgather_bucket_size": _num(5e8, 0, strict=True),
        "allgather_partitions": _bool(True), "reduce_scatter": _bool(True),
        "overlap_comm": _bool(), "contiguous_gradients": _bool(True),
        "round_robin_gradients": _bool(), "sub_group_size": _num(1e9, 0, strict=True),
        "stage3_max_live_parameters": _num(1e9, 0), "stage3_max_reuse_distance": _num(1e9, 0),
        "stage3_prefetch_bucket_size": _num(5e7, 0),
        "stage3_param_persistence_threshold": _num(1e5, 0),
        "stage3_gather_16bit_weights_on_model_save": _bool(),
        "stage3_gather_fp16_weights_on_model_save": _bool(),
        "elastic_checkpoint": _bool(), "ignore_unused_parameters": _bool(True),
        "load_from_fp32_weights": _bool(True), "cpu_offload": _bool(),
        "cpu_offload_param": _bool(),  # DeepSpeed's deprecated offload_param.device='cpu'
        "stage3_model_persistence_threshold": _num(None, 0),
        "pipeline_loading_checkpoint": _off("zero_optimization.pipeline_loading_checkpoint",
                                            "load a pipeline's checkpoint with "
                                            "engine.load_checkpoint"),
        "zero_quantized_weights": _bool(), "zero_quantized_gradients": _bool(),
        "zero_hpz_partition_size": _int(1, 1),
        "log_trace_cache_warnings": _bool(),  # logging only
        # DeepSpeed's performance switches of its own reduction and gathering code (how
        # buckets are combined or fetched, module-hook granularity, debug checks): the values
        # computed are the same; shardkit's wrappers bucket and gather their own way
        "use_multi_rank_bucket_allreduce": _bool(True),
        "stage3_module_granularity_threshold": _int(0, 0),
        "stage3_use_all_reduce_for_fetch_params": _bool(),
        "stage3_allgather_sequential": _bool(),
        "override_module_apply": _bool(True), "enable_sanity_checks": _bool(),
        "legacy_stage1": _bool(),
        "cpu_offload_use_pin_memory": _nullable(_bool()),  # deprecated offload_*.pin_memory
        # MiCS (parameters sharded within groups of mics_shard_size ranks) and LoCo-ZeRO++
        # (error feedback on quantized gradients): accepted while off
        "mics_shard_size": Field((int,), -1, lambda v: v == -1,
                                 "-1 (shardkit does not implement DeepSpeed's MiCS; "
                                 "zero_hpz_partition_size keeps a copy of the parameters "
                                 "within each node instead)", refusal="is not supported"),
        "mics_hierarchical_params_gather": _off("zero_optimization."
                                                "mics_hierarchical_params_gather",
                                                "MiCS is not provided"),
        "zeropp_loco_param": Field((dict, type(None)), None, lambda v: v is None,
                                   "null (shardkit does not implement LoCo-ZeRO++'s error "
                                   "feedback; zero_quantized_gradients quantizes without it)",
                                   refusal="is not supported"),
        # DeepSpeed's stage-3 linear that saves less for backward: same values and gradients
        "memory_efficient_linear": _bool(True),
        # ZeRO++'s int8 copy of frozen weights (DeepSpeed-Chat's mixed-precision LoRA): the
        # forward would read quantized base weights, so training would change; refused when on
        "zero_quantized_nontrainable_weights": _off(
            "zero_optimization.zero_quantized_nontrainable_weights (frozen weights kept in "
            "int8)", "frozen weights stay in the model's dtype; zero_quantized_weights "
            "quantizes only the stage-3 all-gathers"),
        # ZenFlow (DeepSpeed's offloaded optimizer stepping the important columns first and
        # the rest later, asynchronously): changes the update, accepted only while absent
        "zenflow": Field((dict, type(None)), None, lambda v: v is None,
                         "null (shardkit does not implement DeepSpeed's ZenFlow; "
                         "offload_optimizer steps every parameter each step)",
                         refusal="is not supported"),
        # stage-3 modules whose parameters DeepSpeed gathers at once, without per-submodule
        # hooks (mixture-of-experts blocks): how it fetches, not what is computed; shardkit
        # gathers per FSDP unit
        "leaf_module": {key: Field((list, str), [])
                        for key in ("classes", "names", "name_suffixes")},
    },
    "fp16": {
        "enabled": _bool(), "auto_cast": _bool(), "loss_scale": _num(0.0, 0),
        "initial_scale_power": _int(16, 0, 127), "loss_scale_window": _int(1000, 1),
        "hysteresis": _int(2, 1), "consecutive_hysteresis": _bool(),
        "min_loss_scale": _num(1.0, 0, strict=True), "raise_error_at_min_scale": _bool(),
        "fp16_master_weights_and_grads": _off("fp16.fp16_master_weights_and_grads",
                                              "master weights and gradients stay fp32"),
    },
    "bf16": {"enabled": _bool(), "check_grad_overflow": _bool(True),
             "immediate_grad_update": _bool(),
             # DeepSpeed's low-precision ZeRO options (its bf16_master_weight example)
             "bf16_master_weights_and_grads": _off("bf16.bf16_master_weights_and_grads",
                                                   "master weights and gradients stay fp32; "
                                                   "stage 3 shards them over the ranks"),
             "bf16_optimizer_states": _off("bf16.bf16_optimizer_states",
                                           "optimizer states stay fp32; stages 1-3 shard them "
                                           "over the ranks")},
    # DeepSpeed's torch.autocast switch over fp32 weights: shardkit's "bf16" / "fp16" sections
    # already run the forward that way, so the section is accepted while off
    "torch_autocast": {"enabled": _off("torch_autocast section",
                                       'use "bf16": {"enabled": true} (or "fp16"), which '
                                       'runs the forward under torch.autocast over fp32 weights'),
                       "dtype": _str(), "lower_precision_safe_modules": Field((list,), [])},
    "gradient_clipping": _num(0.0, 0),
    "steps_per_print": _int(10, 1),
    "wall_clock_breakdown": _bool(), "memory_breakdown": _bool(), "dump_state": _bool(),
    "prescale_gradients": _bool(), "gradient_predivide_factor": _num(1.0, 0, strict=True),
    # how the data-parallel gradients are combined: averaged ("mean", the default) or summed
    "gradient_allreduce_op": _choice("mean", "mean", "sum", case_insensitive=True),
    "zero_allow_untested_optimizer": _bool(),
    # the training_data loader keeps a last, smaller micro-batch unless this is true
    "dataloader_drop_last": _bool(),
    # DeepSpeed's sparse all-reduce of sparse embedding gradients: torch DDP's, at stage 0
    "sparse_gradients": _bool(),
    # whether every rank passed the same tag to save_checkpoint: warn, fail, or do not check
    "checkpoint": {"tag_validation": _choice("Warn", "Ignore", "Warn", "Fail",
                                             case_insensitive=True),
                   # shardkit's checkpoints load at any world size as they are: DeepSpeed's
                   # universal format (made by its ds_to_universal converter) is not needed
                   "load_universal": _off("checkpoint.load_universal (its converted universal "
                                          "checkpoints)", "shardkit's own checkpoints load at "
                                          "any world size without conversion"),
                   "use_node_local_storage": _off("checkpoint.use_node_local_storage (a "
                                                  "checkpoint split over the nodes' own disks)",
                                                  "save to a directory every rank can read"),
                   "parallel_write": {"pipeline_stage": _off(
                       "checkpoint.parallel_write.pipeline_stage", "every rank writes its own "
                       "shard files already")}},
    "zero_force_ds_cpu_optimizer": _bool(True),
    # the dtype gradients are reduced in (None: fp32, the engine's gradient dtype)
    "communication_data_type": Field((str, type(None)), None,
                                     lambda v: v is None or v.lower() in _COMM_DTYPES,
                                     f"one of {sorted(_COMM_DTYPES)} or null",
                                     choices=tuple(_COMM_DTYPES)),
    # the dtype the engine accumulates gradients in is fixed by precision and stage: checked
    # against it in load_config (_check_grad_accum_dtype)
    "data_types": {"grad_accum_dtype": Field(
        (str, type(None)), None, lambda v: v is None or v.lower() in _ACCUM_DTYPES,
        f"one of {sorted(_ACCUM_DTYPES)} or null", refusal="is not a valid dtype name")},
    # DeepSpeed sections with no effect on training, accepted while switched off
    "amp": {"enabled": _off("apex AMP section", 'use "fp16" or "bf16" instead'),
            "opt_level": _str()},
    # DeepSpeed's deepspeed.checkpointing options, read by shardkit.checkpointing.configure
    # (cross-checks in activation_checkpointing_config)
    "activation_checkpointing": {
        "partition_activations": _bool(), "contiguous_memory_optimization": _bool(),
        "cpu_checkpointing": _bool(),
        "number_checkpoints": Field((int, type(None)), None, lambda v: v is None or v >= 1,
                                    "a positive integer or null"),
        "synchronize_checkpoint_boundary": _bool(), "profile": _bool(),
    },
    # DeepSpeed's RLHF generation engine (inference kernels and tensor-parallel generation
    # inside engine.generate): training is unchanged by it; see _hybrid_engine_notes
    "hybrid_engine": {"enabled": _bool(), "max_out_tokens": _int(512, 1),
                      "inference_tp_size": _int(1, 1), "release_inference_cache": _bool(),
                      "pin_parameters": _bool(True), "tp_gather_partition_size": _int(8, 1),
                      "enable_cuda_graph": _bool()},
    "tensorboard": _monitor("TensorBoard monitor", _LOG_INSTEAD, output_path=_str(""),
                            job_name=_str("")),
    "wandb": _monitor("Weights & Biases monitor", _LOG_INSTEAD, group=_str(), team=_str(),
                      project=_str("deepspeed")),
    "csv_monitor": _monitor("CSV monitor", _LOG_INSTEAD, output_path=_str(""),
                            job_name=_str("")),
    # read by initialize: shardkit.comm.configure (counts and bus bytes per op, no latencies)
    "comms_logger": {"enabled": _bool(), "verbose": _bool(), "prof_all": _bool(True),
                     "debug": _bool(), "prof_ops": Field((list,), [])},
    "flops_profiler": _monitor("FLOPS profiler", "use torch.profiler", profile_step=_int(1, 1),
                               module_depth=_int(-1, -1), top_modules=_int(1, 1),
                               detailed=_bool(True), output_file=Field((str, type(None)))),
    # DeepSpeed's async-I/O tuning for NVMe offload, which shardkit refuses: no effect
    "aio": {"block_size": _int(1048576, 1), "queue_depth": _int(8, 1),
            "intra_op_parallelism": _int(1, 1), "thread_count": _int(1, 1),
            "single_submit": _bool(), "overlap_events": _bool(True), "use_gds": _bool()},
    # DeepSpeed's curriculum data sampling and random-LTD: the inner sections are read only
    # while data_efficiency.enabled is true (refused), so they pass unchecked while it is off
    "data_efficiency": {"enabled": _off("data_efficiency (curriculum data sampling, "
                                        "random-LTD)", "order or trim the data in your own "
                                        "loader, or remove the section"),
                        "seed": _int(1234), "data_sampling": "read only when enabled",
                        "data_routing": "read only when enabled"},
    # DeepSpeed's older curriculum switch: with it on, its engine passes a curriculum_seqlen
    # to the model's forward
    "curriculum_learning": {"enabled": _off("curriculum_learning (legacy curriculum "
                                            "sequence lengths)", "trim the sequences in your "
                                            "own loader, or remove the section"),
                            **{key: "read only when enabled" for key in (
                                "curriculum_type", "min_difficulty", "max_difficulty",
                                "schedule_type", "schedule_config")}},
    # DeepSpeed compresses only a model passed through deepspeed.compression's init_compression
    # (not provided here); on any other model its engine trains uncompressed, as shardkit does
    "compression_training": Field((dict,), {}),
    # DeepSpeed's autotuner runs from its launcher (`deepspeed --autotuning`), never from
    # inside the engine: its section is accepted while off, the tuning keys unread
    "autotuning": {"enabled": _off("autotuning", "choose micro-batch sizes and ZeRO stage by "
                                   "hand, e.g. with python -m shardkit plan"),
                   **{key: "read only when enabled" for key in (
                       "fast", "results_dir", "exps_dir", "overwrite", "start_profile_step",
                       "end_profile_step", "metric_path", "metric", "model_info",
                       "model_info_path", "tuner_type", "tuner_early_stopping",
                       "tuner_num_trials", "arg_mappings", "max_train_batch_size",
                       "min_train_batch_size", "max_train_micro_batch_size_per_gpu",
                       "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes",
                       "mp_size")}},
    # DeepSpeed's progressive layer drop (its engine passes each step's keep probability to
    # the model's forward) and its Hessian eigenvalue estimate that drives it: while off
    "progressive_layer_drop": {"enabled": _off("progressive_layer_drop", "drop layers in your "
                                               "model's forward, or remove the section"),
                               "theta": _num(1.0, 0), "gamma": _num(0.001, 0)},
    "eigenvalue": {"enabled": _off("eigenvalue (Hessian eigenvalue estimation)",
                                   "remove the section"),
                   "verbose": _bool(), "max_iter": _int(100, 1), "tol": _num(1e-2, 0),
                   "stability": _num(1e-6, 0), "gas_boundary_resolution": _int(1, 1),
                   "layer_name": _str("bert.encoder.layer"), "layer_num": _int(0, 0)},
    # DeepSpeed's DeepCompile (its compiler passes over the whole training step): while off;
    # its options are read only when it is on
    "compile": {"deepcompile": _off("compile.deepcompile", "torch.compile the model (its "
                                    "wrapped blocks compile as they are)"),
                **{key: "read only when enabled" for key in (
                    "free_activation", "free_activation_threshold", "offload_activation",
                    "offload_activation_pin_memory", "offload_opt_states", "double_buffer",
                    "symmetric_memory", "debug_log", "offload_parameters",
                    "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
                    "sync_after_allgather", "keep_int_input_tensors",
                    "keep_all_input_tensors", "passes")}},
    # Azure's Nebula checkpoint service: while off
    "nebula": {"enabled": _off("nebula (Azure's checkpoint service)", "save with "
                               "engine.save_checkpoint"),
               **{key: "read only when enabled" for key in (
                   "enable_nebula_load", "nebula_load_path", "persistent_storage_path",
                   "persistent_time_interval", "num_of_version_in_retention")}},
    # DeepSpeed's throughput timer (a log line every steps_per_print steps): no effect here
    "timers": {"throughput": {"enabled": _bool(True), "synchronized": _bool(True)}},
    # false lets a script accumulate gradients its own way past DeepSpeed's engine; the engine
    # here always accumulates over gradient_accumulation_steps
    "managed_gradient_accumulation": Field(
        (bool,), True, lambda v: v is True,
        "true (shardkit's engine always accumulates gradients over "
        "gradient_accumulation_steps itself)", refusal="is not supported"),
    "disable_allgather": _off("disable_allgather", "OSS gathers the updated parameters after "
                              "each step"),
    # DeepSpeed's CUDA-graph capture of its ZeRO gradient copies: speed only, no effect here
    "graph_harvesting": _bool(),
    # the dtype of DeepSpeed's Ulysses sequence-parallel all-to-alls: no effect here
    # (shardkit's sequence parallelism communicates in the activations' dtype)
    "seq_parallel_communication_data_type": _nullable(_choice("fp32", *_COMM_DTYPES)),
    # how DeepSpeed lays out its expert- and data-parallel groups (mixture of experts)
    "use_data_before_expert_parallelism": _off("use_data_before_expert_parallelism",
                                               "shardkit has no expert-parallel groups"),
    # DeepSpeed's logger level, and the vocabulary size its profiling reads: no effect here
    "log_level": Field((str, int, type(None)), None),
    "vocabulary_size": _nullable(_int(None, 1)),
    # DeepSpeed's elastic batch size (chosen from the GPU count): accepted while off
    "elasticity": {"enabled": _off("elasticity (batch size chosen from the GPU count)",
                                   "set train_batch_size or train_micro_batch_size_per_gpu for "
                                   "the world size you launch"),
                   "max_train_batch_size": _int(2000, 1),
                   "micro_batch_sizes": Field((list,), [2, 4, 6]),
                   "min_gpus": _int(1, 1), "max_gpus": _int(10000, 1), "min_time": _int(0, 0),
                   "version": _num(0.2, 0), "prefer_larger_batch": _bool(True),
                   "ignore_non_elastic_batch_info": _bool(), "num_gpus_per_node": _int(1, 1),
                   "model_parallel_size": _int(1, 1)},
}


# ----------------------------------------------------------------------------- result types


@dataclass(frozen=True)
class OptimizerSpec:
    """Which torch optimizer to build (``torch_class`` names ``torch.optim.<cls>``) and its
    keyword arguments, translated from DeepSpeed's names."""

    type: str
    torch_class: str
    kwargs: Mapping[str, Any]


@dataclass(frozen=True)
class SchedulerSpec:
    """A scheduler class name, :mod:`shardkit.optim.lr_scheduler`'s (DeepSpeed's schedules) or
    one of :data:`TORCH_SCHEDULER_TYPES` (``torch.optim.lr_scheduler``'s), and its keyword
    arguments."""

    type: str
    kwargs: Mapping[str, Any]

    def build(self, optimizer):
        """The scheduler over ``optimizer``, as DeepSpeed builds it from the config."""
        import torch

        from shardkit.optim import lr_scheduler as deepspeed_schedules
        module = torch.optim.lr_scheduler if self.type in TORCH_SCHEDULER_TYPES \
            else deepspeed_schedules
        return getattr(module, self.type)(optimizer, **self.kwargs)


@dataclass(frozen=True)
class ZeroConfig:
    """The ZeRO stage and the knobs that change what is built."""

    stage: int = 0
    # zero_optimization.reduce_bucket_size, in DeepSpeed's unit (elements); None: the
    # wrapper's own default. Converted to ShardedDataParallel's bytes where it is built.
    reduce_bucket_numel: Optional[int] = None
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    quantized_weights: bool = False  # ZeRO++ qwZ (stage 3)
    quantized_gradients: bool = False  # ZeRO++ qgZ (stage 3)
    hpz_partition_size: int = 1  # ZeRO++ hpZ (stage 3): backward gathers in blocks this size
    # zero_optimization.reduce_scatter (stage 1): average each gradient onto its OSS owner only
    # (DeepSpeed's "reduce instead of allreduce"), not onto every rank
    reduce_to_owners: bool = False
    # zero_optimization.ignore_unused_parameters: stages 0-1 build torch DDP with
    # find_unused_parameters, so a forward may leave parameters unused (stages 2-3 always may)
    ignore_unused_parameters: bool = True


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision: ``dtype`` is ``"fp32"``, ``"fp16"`` or ``"bf16"``. Loss scaling
    applies to fp16 only: ``static_loss_scale > 0`` fixes the scale, 0 makes it dynamic.
    ``check_grad_overflow``: skip a step whose gradients hold inf/nan (fp16 always;
    bf16 as its ``check_grad_overflow`` says)."""

    dtype: str = "fp32"
    static_loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    raise_error_at_min_scale: bool = False
    check_grad_overflow: bool = False


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing`` section, checked: what
    :func:`shardkit.checkpointing.configure` applies (DeepSpeed's names and defaults)."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: Optional[int] = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """Everything :func:`shardkit.initialize` needs, validated and with defaults filled in."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    optimizer: Optional[OptimizerSpec] = None
    scheduler: Optional[SchedulerSpec] = None
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    gradient_clipping: float = 0.0
    steps_per_print: int = 10
    # communication_data_type: "fp16" / "bf16" reduce the gradients in 16 bits, "fp32" in fp32
    # (16-bit gradients widened for the sum); None: in the gradients' own dtype
    communication_dtype: Optional[str] = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    # every section and key of SCHEMA, checked, with DeepSpeed's defaults filled in (what the
    # engine's DeepSpeed accessors, e.g. zero_overlap_comm(), report)
    checked: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple = ()
    dataloader_drop_last: bool = False
    checkpoint_tag_validation: str = "warn"  # "warn", "ignore" or "fail"
    # gradient_allreduce_op: "mean" (averaged over the data-parallel ranks) or "sum"
    gradient_allreduce_op: str = "mean"
    # the activation_checkpointing section, for shardkit.checkpointing.configure
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)

    # DeepSpeed's engine.config is the config dict: scripts index it (OpenRLHF reads
    # engine.config["zero_optimization"]["offload_optimizer"]["device"])
    def __getitem__(self, key: str):
        """The checked section or value ``key``, DeepSpeed's defaults filled in, the batch sizes
        as resolved (``KeyError`` for a key the config schema does not have)."""
        if key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                   "gradient_accumulation_steps"):
            return getattr(self, key)
        return self.checked[key]

    def get(self, key: str, default=None):
        """``self[key]``, or ``default`` for a key the config schema does not have."""
        return self[key] if key in self else default

    def __contains__(self, key) -> bool:
        return key in self.checked

    # without these, Python's old sequence protocol makes ``for key in engine.config`` and
    # ``dict(engine.config)`` call ``self[0]``: a bare ``KeyError: 0``
    def __iter__(self):
        """The top-level keys, as iterating DeepSpeed's config dict gives."""
        return iter(self.checked)

    def keys(self):
        """The top-level keys (so ``dict(engine.config)`` is the checked config as a dict)."""
        return self.checked.keys()

    def items(self):
        """``(key, self[key])`` for each top-level key."""
        return [(key, self[key]) for key in self]


# ----------------------------------------------------------------------------- validation


def load_config(config: Union[str, os.PathLike, Mapping, None],
                data_parallel_size: int) -> EngineConfig:
    """Validate ``config`` (a dict or a JSON file path) and resolve it for ``data_parallel_size``.

    Raises :class:`ConfigError` naming the dotted key path, the value and what would be valid.
    Pure: no collectives, no global state.
    """
    raw, auto_notes = _tuning_autos_as_defaults(_with_current_names(_read(config)))
    _refuse_auto_values(raw)
    checked = _check_section(raw, SCHEMA, "")
    train, micro, gas = resolve_batch_sizes(checked["train_batch_size"],
                                            checked["train_micro_batch_size_per_gpu"],
                                            checked["gradient_accumulation_steps"],
                                            data_parallel_size)
    zero, notes = _zero_config(checked["zero_optimization"])
    notes += _breakdown_notes(checked) + _compression_notes(checked["compression_training"])
    notes += _hybrid_engine_notes(checked["hybrid_engine"]) + auto_notes
    if data_parallel_size % zero.hpz_partition_size:
        raise ConfigError(f"zero_optimization.zero_hpz_partition_size={zero.hpz_partition_size} "
                          f"must divide the data-parallel size {data_parallel_size} (use the "
                          f"ranks per node)")
    precision = _precision_config(checked["fp16"], checked["bf16"])
    _check_grad_accum_dtype(checked["data_types"]["grad_accum_dtype"], precision.dtype,
                            zero.stage)
    activation = _activation_checkpointing_checked(checked["activation_checkpointing"])
    comm_dtype = _communication_dtype(checked["communication_data_type"], zero)
    allreduce_op = checked["gradient_allreduce_op"].lower()
    if checked["sparse_gradients"] and zero.stage != 0:
        raise ConfigError(f"sparse_gradients=true needs zero_optimization.stage=0 (torch DDP "
                          f"reduces the sparse gradients of embeddings built with sparse=True); "
                          f"stage {zero.stage} reduces gradients dense: set sparse_gradients "
                          f"false and build the embeddings with sparse=False")
    if allreduce_op == "sum" and zero.stage == 3:  # DeepSpeed refuses it there too
        raise ConfigError("gradient_allreduce_op='sum' is not supported with "
                          "zero_optimization.stage=3; use 'mean' (the default) or stages 0-2")
    optimizer = _optimizer_spec(raw.get("optimizer"))
    if optimizer is not None and optimizer.torch_class == "Adafactor" and zero.stage == 3:
        raise ConfigError("optimizer.type='Adafactor' needs zero_optimization.stage 0-2: it "
                          "factors each 2-D moment over whole rows and columns, and stage 3 "
                          "shards every parameter's rows over the ranks, so its step would not "
                          "match one process's; use stage 2 (or an elementwise optimizer)")
    return EngineConfig(
        train_batch_size=train, train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas, data_parallel_size=data_parallel_size,
        optimizer=optimizer,
        scheduler=_scheduler_spec(raw.get("scheduler")),
        zero=zero, precision=precision,
        gradient_clipping=float(checked["gradient_clipping"]),
        steps_per_print=checked["steps_per_print"], communication_dtype=comm_dtype, raw=raw,
        checked=checked, warnings=tuple(notes),
        dataloader_drop_last=checked["dataloader_drop_last"],
        checkpoint_tag_validation=checked["checkpoint"]["tag_validation"].lower(),
        gradient_allreduce_op=allreduce_op, activation_checkpointing=activation)


def _auto_paths(node, schema, path: str) -> list[str]:
    """Dotted paths of the ``"auto"`` values in ``node`` where the schema takes no string
    (a ``params`` section, checked by its owner, takes none either; the parts read only when
    a section is enabled, and ``compression_training``, are not read here)."""
    if isinstance(schema, Field) and dict in schema.types or \
            isinstance(schema, str) and schema.startswith("read only"):
        return []
    if isinstance(node, Mapping):
        found = []
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(schema, dict) and key not in schema:
                continue  # an unknown key: named by its own error, not as an "auto"
            inner = schema.get(key) if isinstance(schema, dict) else None
            found += _auto_paths(value, inner, where)
        return found
    takes_str = isinstance(schema, Field) and str in schema.types
    return [path] if isinstance(node, str) and node.lower() == "auto" and not takes_str else []


# zero_optimization's bucket sizes and stage-3 thresholds: tuning only (the values computed do
# not depend on them). DeepSpeed reads the section through a non-strict pydantic model that
# drops "auto" values, so each takes its default; OpenRLHF's configs pass them that way.
_ZERO_TUNING_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance",
                     "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_model_persistence_threshold", "stage3_module_granularity_threshold")


def _tuning_autos_as_defaults(raw: dict) -> tuple[dict, list[str]]:
    """``raw`` without the ``"auto"`` values of :data:`_ZERO_TUNING_KEYS` (so they take
    DeepSpeed's defaults, as in DeepSpeed), and a note naming them. Every other ``"auto"`` is
    still refused by :func:`_refuse_auto_values`: a batch size, a learning rate or a switch
    given as ``"auto"`` would change what is trained."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, Mapping):
        return raw, []
    autos = [key for key in _ZERO_TUNING_KEYS
             if isinstance(zero.get(key), str) and zero[key].lower() == "auto"]
    if not autos:
        return raw, []
    kept = {key: value for key, value in zero.items() if key not in autos}
    note = (f"zero_optimization {autos}: \"auto\" reads as DeepSpeed's default (tuning "
            f"knobs; DeepSpeed drops \"auto\" there too)")
    return {**raw, "zero_optimization": kept}, [note]


def _refuse_auto_values(raw: dict) -> None:
    """Hugging Face's Trainer writes ``"auto"`` in DeepSpeed configs and fills each one in from
    its own arguments before DeepSpeed reads the config; passed to :func:`load_config` as it
    is, every such key is named in one error (DeepSpeed fails on the first with a TypeError)."""
    autos = _auto_paths(raw, SCHEMA, "")
    if autos:
        raise ConfigError(f"config values \"auto\" at {autos}: \"auto\" is a placeholder that "
                          f"Hugging Face's Trainer fills in from its TrainingArguments before "
                          f"DeepSpeed reads the config; shardkit.initialize reads the config "
                          f"itself, so give the value of each (e.g. train_micro_batch_size_per_"
                          f"gpu: your per-device batch size, optimizer.params.lr: your learning "
                          f"rate), or delete the key for its default")


def activation_checkpointing_config(config) -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of ``config`` (a DeepSpeed config dict, a JSON
    file path, or an :class:`EngineConfig`), checked; DeepSpeed's defaults when it is absent.

    Only that section is read (the rest is :func:`load_config`'s business), so a full training
    config works as it is. Raises :class:`ConfigError` naming the key: an unknown key (with the
    closest valid one), a wrong type, ``number_checkpoints`` below 1,
    ``contiguous_memory_optimization`` without ``partition_activations`` or without
    ``number_checkpoints``. Pure: no collectives.
    """
    if isinstance(config, EngineConfig):
        return config.activation_checkpointing
    raw = _read(config)
    section = raw.get("activation_checkpointing", {})
    checked = _check_section(section, SCHEMA["activation_checkpointing"],
                             "activation_checkpointing")
    return _activation_checkpointing_checked(checked)


def _activation_checkpointing_checked(checked: dict) -> ActivationCheckpointingConfig:
    """The cross-key rules DeepSpeed asserts in ``configure``, as ConfigErrors."""
    where = "activation_checkpointing"
    if checked["contiguous_memory_optimization"]:
        if not checked["partition_activations"]:
            raise ConfigError(f"{where}.contiguous_memory_optimization=true needs "
                              f"{where}.partition_activations=true (the contiguous buffers hold "
                              f"the partitioned inputs); set partition_activations true or "
                              f"contiguous_memory_optimization false")
        if checked["number_checkpoints"] is None:
            raise ConfigError(f"{where}.contiguous_memory_optimization=true needs "
                              f"{where}.number_checkpoints (a positive integer: the checkpoints "
                              f"one forward stores, which sizes the buffers)")
    return ActivationCheckpointingConfig(**checked)


def _communication_dtype(value: Optional[str], zero: ZeroConfig) -> Optional[str]:
    """``"fp16"`` / ``"bf16"`` / ``"fp32"`` from ``communication_data_type`` (any of its
    spellings), ``None`` when absent."""
    dtype = None if value is None else _COMM_DTYPES[value.lower()]
    if dtype not in (None, "fp32") and zero.stage == 3 and zero.quantized_gradients:
        raise ConfigError(f"communication_data_type={value!r} with zero_optimization."
                          f"zero_quantized_gradients=true: qgZ already sends int4 gradients; "
                          f"drop one of the two")
    return dtype


def _read(config) -> dict:
    if config is None:
        raise ConfigError("initialize: no config given; pass config=<dict or path to a JSON "
                          "file> (config_params= is accepted as an alias)")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise ConfigError(f"config={path!r}: no such file; pass a dict or the path of a "
                              f"JSON file")
        try:
            with open(path) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config={path!r} is not valid JSON: {e}") from None
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a dict or a JSON file path, not "
                          f"{type(config).__name__}")
    return dict(config)


# DeepSpeed's older spellings it still reads, with the current key they mean
_OLD_NAMES = {"bfloat16": "bf16"}

# zero_optimization keys DeepSpeed reads under two names (its field name and the stage3_ alias);
# the schema has the stage3_ one
_ZERO_ALIASES = {name: f"stage3_{name}" for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential")}


def _zero_with_current_names(zero) -> object:
    """``zero_optimization`` with DeepSpeed's field names renamed to their ``stage3_`` aliases
    (``prefetch_bucket_size`` -> ``stage3_prefetch_bucket_size``, as DeepSpeed's pydantic
    config reads either) and ``offload_param`` / ``offload_optimizer`` set to ``null`` dropped
    (DeepSpeed: not configured). Both names of one key is an error naming them."""
    if not isinstance(zero, Mapping):
        return zero
    out = dict(zero)
    _rename_keys(out, _ZERO_ALIASES, lambda name, alias: (
        f"zero_optimization has both {name!r} and {alias!r} (two names DeepSpeed reads for one "
        f"setting); keep one"))
    for section in ("offload_param", "offload_optimizer"):
        if section in out and out[section] is None:
            del out[section]
        _refuse_nvme(out.get(section), f"zero_optimization.{section}")
    return out


def _refuse_nvme(section, path: str) -> None:
    """DeepSpeed's ZeRO-Infinity offload to NVMe: a clear refusal naming what shardkit offers
    (CPU offload), not the schema's generic not-a-valid-choice."""
    if isinstance(section, Mapping) and isinstance(section.get("device"), str) \
            and section["device"].lower() == "nvme":
        where = section.get("nvme_path")
        raise ConfigError(
            f"{path}.device='nvme'{f' (nvme_path={where!r})' if where else ''}: offload to "
            f"NVMe (DeepSpeed's ZeRO-Infinity swapping) is not provided by shardkit; "
            f"device='cpu' is (stage 3: parameters and optimizer state kept in CPU memory), "
            f"or 'none'")


def _with_current_names(raw: dict) -> dict:
    """``raw`` with DeepSpeed's older top-level spellings renamed (``bfloat16`` -> ``bf16``);
    both spellings at once is an error."""
    out = dict(raw)
    if isinstance(out.get("zero_optimization"), bool):  # DeepSpeed's oldest form: on = stage 1
        out["zero_optimization"] = {"stage": 1 if out["zero_optimization"] else 0}
    if "zero_optimization" in out:
        out["zero_optimization"] = _zero_with_current_names(out["zero_optimization"])
    _rename_keys(out, _OLD_NAMES, lambda old, new: (
        f"config has both {old!r} and {new!r} (DeepSpeed's older and current names of one "
        f"section); keep {new!r}"))
    return out


def _rename_keys(out: dict, names: Mapping, both_given) -> None:
    """Rename in place each key of ``names`` found in ``out`` to its value; a ConfigError with
    ``both_given(old, new)`` when both spellings are there."""
    for old, new in names.items():
        if old in out:
            if new in out:
                raise ConfigError(both_given(old, new))
            out[new] = out.pop(old)


def _check_section(section, schema: dict, path: str) -> dict:
    """Check one nested section; return its values with defaults filled in."""
    if not isinstance(section, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a JSON object (dict), got "
                          f"{type(section).__name__} {section!r}")
    for key in section:
        if key not in schema:
            raise ConfigError(_unknown_key_message(key, schema, path))
    out = {}
    for key, spec in schema.items():
        where = f"{path}.{key}" if path else key
        if isinstance(spec, dict):
            out[key] = _check_section(section.get(key, {}), spec, where)
        elif isinstance(spec, Field):
            out[key] = _check_value(section[key], spec, where) if key in section else spec.default
        else:  # sub-schema chosen by a sibling ("params" by "type"): checked by its owner
            out[key] = section.get(key)
    return out


def _check_value(value, spec: Field, path: str):
    is_bool = isinstance(value, bool)
    type_ok = isinstance(value, spec.types) and (bool in spec.types or not is_bool)
    valid = spec.valid or " or ".join(t.__name__ for t in spec.types)
    if not type_ok:
        raise ConfigError(f"{path}={value!r}: wrong type {type(value).__name__}; expected "
                          f"{valid}")
    if spec.check is not None and not spec.check(value):
        close = difflib.get_close_matches(str(value), spec.choices, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        what = spec.refusal or ("is not a valid choice" if spec.choices else "is out of range")
        raise ConfigError(f"{path}={value!r} {what}{hint}; valid values: {valid}")
    return value


def _unknown_key_message(key, schema: dict, path: str) -> str:
    where = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(str(key), list(schema), n=1, cutoff=0.5)
    hint = f"; did you mean {(path + '.' if path else '') + close[0]!r}?" if close else "."
    return (f"unknown config key {where!r}{hint} Valid keys"
            f"{' under ' + repr(path) if path else ''}: {sorted(schema)}")


def resolve_batch_sizes(train: Optional[int], micro: Optional[int], gas: Optional[int],
                        world: int) -> tuple[int, int, int]:
    """DeepSpeed's rule ``train_batch_size = micro × gradient_accumulation_steps × world``:
    any two determine the third; one alone sets ``gradient_accumulation_steps=1``."""
    if train is None and micro is None:
        raise ConfigError("train_batch_size and train_micro_batch_size_per_gpu are both missing; "
                          "give at least one of them")
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world:
            raise ConfigError(
                f"inconsistent batch sizes: train_batch_size={train} != "
                f"train_micro_batch_size_per_gpu={micro} x gradient_accumulation_steps={gas} x "
                f"data-parallel world size={world} = {micro * gas * world}; set "
                f"train_batch_size={micro * gas * world}, or give two of the three and the third "
                f"is derived")
        return train, micro, gas
    if train is not None and micro is not None:
        return train, micro, _exact_quotient(train, micro * world, "gradient_accumulation_steps",
                                             f"train_micro_batch_size_per_gpu={micro} x world "
                                             f"size={world}", train)
    if train is not None:
        gas = gas or 1
        return train, _exact_quotient(train, gas * world, "train_micro_batch_size_per_gpu",
                                      f"gradient_accumulation_steps={gas} x world size={world}",
                                      train), gas
    gas = gas or 1
    return micro * gas * world, micro, gas


def _exact_quotient(train: int, divisor: int, derived: str, divisor_desc: str,
                    value: int) -> int:
    if value % divisor:
        below = train - train % divisor  # the nearest valid sizes around the one given
        nearest = " or ".join(str(n) for n in sorted({max(divisor, below), below + divisor}))
        raise ConfigError(f"inconsistent batch sizes: train_batch_size={train} is not divisible "
                          f"by {divisor_desc} = {divisor}, so {derived} would not be an integer; "
                          f"valid train_batch_size values are multiples of {divisor} (e.g. "
                          f"{nearest})")
    return value // divisor


def _optimizer_spec(section) -> Optional[OptimizerSpec]:
    if section is None:
        return None
    if section.get("type") is None:
        raise ConfigError(f"optimizer.type is missing; valid types: {list(OPTIMIZER_TYPES)}")
    name = section["type"]
    kind = name.lower()
    if kind in _NOT_PROVIDED_OPTIMIZERS:
        raise ConfigError(
            f"optimizer.type={name!r} ({_NOT_PROVIDED_OPTIMIZERS[kind]}) is not provided by "
            f"shardkit; build the optimizer yourself (e.g. your own {name} implementation) and "
            f"pass it as initialize(optimizer=<the object, or a callable params -> optimizer>), "
            f"deleting the config's 'optimizer' section; types shardkit builds from the config: "
            f"{list(OPTIMIZER_TYPES)}")
    canonical = {t.lower(): t for t in OPTIMIZER_TYPES}
    if kind not in canonical:
        close = difflib.get_close_matches(name, OPTIMIZER_TYPES, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"optimizer.type={name!r} is not a valid choice{hint}; valid values: "
                          f"one of {list(OPTIMIZER_TYPES)} (any case)")
    if isinstance(section.get("params"), Mapping) and "max_grad_norm" in section["params"]:
        # DeepSpeed refuses it too; difflib would point at an unrelated key
        raise ConfigError(f"optimizer.params.max_grad_norm={section['params']['max_grad_norm']!r}"
                          f" is not an optimizer parameter; clip with the top-level "
                          f"\"gradient_clipping\": <max norm> instead")
    if canonical[kind] in TORCH_OPTIMIZER_TYPES:
        return _torch_optimizer_spec(name, canonical[kind], section.get("params", {}))
    params = _check_section(section.get("params", {}), OPTIMIZER_PARAMS[kind], "optimizer.params")
    given = set(section.get("params", {}))
    if kind == "sgd":
        kwargs = {k: params[k] for k in ("lr", "momentum", "dampening", "weight_decay",
                                         "nesterov")}
        if kwargs["nesterov"] and (kwargs["momentum"] <= 0 or kwargs["dampening"] != 0):
            raise ConfigError("optimizer.params.nesterov=true needs momentum > 0 and "
                              "dampening = 0")
        return OptimizerSpec("SGD", "SGD", kwargs)
    if kind == "adagrad":
        return OptimizerSpec(name, "Adagrad", params)
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    decoupled = kind == "adamw" or params["adam_w_mode"]
    if not params["bias_correction"]:
        raise ConfigError("optimizer.params.bias_correction=false is not supported; torch's "
                          "Adam/AdamW always correct the bias (remove the key or set it true)")
    kwargs = {"lr": params["lr"], "betas": tuple(params["betas"]), "eps": params["eps"],
              "weight_decay": params["weight_decay"], "amsgrad": params["amsgrad"]}
    if decoupled and params["torch_adam"] and "weight_decay" not in given:
        # DeepSpeed builds torch.optim.AdamW here, whose default is 0.01; its usual path
        # (FusedAdam, DeepSpeedCPUAdam) defaults to 0, as the schema does
        kwargs["weight_decay"] = 0.01
    return OptimizerSpec(section["type"], "AdamW" if decoupled else "Adam", kwargs)


def _torch_optimizer_spec(name: str, cls_name: str, params) -> OptimizerSpec:
    """DeepSpeed's fallback, ``getattr(torch.optim, type)(params, **params)``: the keys are
    checked against the constructor's arguments and the values by building the class once
    over a one-element tensor (torch's own range checks), so a bad value is a ConfigError
    here, before any collective."""
    import torch
    cls = getattr(torch.optim, cls_name)
    _constructor_arguments("optimizer", name, params, cls, f"torch.optim.{cls_name}")
    kwargs = dict(params)
    if "betas" in kwargs and isinstance(kwargs["betas"], list):
        kwargs["betas"] = tuple(kwargs["betas"])
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (ValueError, TypeError, RuntimeError) as error:
        raise ConfigError(f"optimizer.params={dict(params)!r} for optimizer.type={name!r}: "
                          f"torch.optim.{cls_name} refuses them: {error}") from None
    return OptimizerSpec(name, cls_name, kwargs)


def _scheduler_spec(section) -> Optional[SchedulerSpec]:
    if section is None:
        return None
    kind = section.get("type")
    if kind is None:
        raise ConfigError(f"scheduler.type is missing; valid types: {list(SCHEDULER_TYPES)}")
    if kind in _SCHEDULERS_OF_OBJECTS:
        raise ConfigError(f"scheduler.type={kind!r}: torch.optim.lr_scheduler.{kind} is built "
                          f"from {_SCHEDULERS_OF_OBJECTS[kind]}, which a JSON config cannot "
                          f"hold; delete the config's 'scheduler' section and pass "
                          f"initialize(lr_scheduler=lambda optimizer: {kind}(optimizer, ...))")
    if kind not in SCHEDULER_TYPES:
        close = difflib.get_close_matches(str(kind), SCHEDULER_TYPES, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"scheduler.type={kind!r} is not a valid choice{hint}; valid values: "
                          f"one of {list(SCHEDULER_PARAMS)} (DeepSpeed's) or "
                          f"{list(TORCH_SCHEDULER_TYPES)} (torch.optim.lr_scheduler's)")
    if kind in TORCH_SCHEDULER_TYPES:
        return _torch_scheduler_spec(kind, section.get("params", {}))
    given = section.get("params", {})
    params = _check_section(given, SCHEDULER_PARAMS[kind], "scheduler.params")
    for key in REQUIRED_SCHEDULER_PARAMS.get(kind, ()):
        if key not in given:
            raise ConfigError(f"scheduler.params.{key} is required for scheduler.type={kind!r}")
    if kind == "WarmupCosineLR":
        for key in ("warmup_min_ratio", "cos_min_ratio"):
            if params[key] > 1:
                raise ConfigError(f"scheduler.params.{key}={params[key]!r} is out of range; "
                                  f"valid values: a number in [0, 1]")
        # total_num_steps <= warmup_num_steps is accepted as DeepSpeed accepts it (no decay
        # window: the lr drops to cos_min_ratio after the warm-up); WarmupCosineLR warns
    if kind == "OneCycle":
        for key in ("cycle_min_mom", "cycle_max_mom"):  # Adam's beta1
            values = params[key] if isinstance(params[key], list) else [params[key]]
            if not all(v < 1 for v in values):
                raise ConfigError(f"scheduler.params.{key}={params[key]!r} is out of range; "
                                  f"valid values: a number in [0, 1) (it becomes Adam's beta1)")
    return SchedulerSpec(kind, params)


def _torch_scheduler_spec(kind: str, params) -> SchedulerSpec:
    """DeepSpeed's fallback, ``getattr(torch.optim.lr_scheduler, type)(optimizer, **params)``:
    the keys are checked against the constructor's arguments here, and each value's JSON type
    against the argument's annotation (torch compares or multiplies most values only at some
    later step: ``gamma: "0.5"`` failed mid-training, ``milestones: ["2"]`` never decayed);
    the values are checked by ``initialize``, which builds the scheduler once beside the
    optimizer before any collective (torch's own checks need the optimizer's param groups)."""
    import torch
    arguments = _constructor_arguments("scheduler", kind, params,
                                       getattr(torch.optim.lr_scheduler, kind),
                                       f"torch.optim.lr_scheduler.{kind}")
    for key, value in params.items():
        _check_torch_argument(kind, key, value, arguments[key].annotation)
    return SchedulerSpec(kind, dict(params))


def _constructor_arguments(section: str, kind: str, params, cls, shown: str) -> dict:
    """The arguments of ``cls``'s constructor after its first (the parameters, the optimizer)
    by name, once every key of the config's ``<section>.params`` is one of them: else a
    :class:`ConfigError` naming the key, the closest argument and all of them."""
    import inspect
    if not isinstance(params, Mapping):
        raise ConfigError(f"{section}.params: expected a JSON object (dict), got "
                          f"{type(params).__name__} {params!r}")
    arguments = dict(list(inspect.signature(cls.__init__).parameters.items())[2:])
    accepted = list(arguments)
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.5)
            hint = f"; did you mean '{section}.params.{close[0]}'?" if close else "."
            raise ConfigError(f"unknown config key '{section}.params.{key}' for {section}.type="
                              f"{kind!r}{hint} Valid keys: the arguments of {shown}: {accepted}")
    return arguments


def _check_torch_argument(kind: str, key: str, value, annotation) -> None:
    """A :class:`ConfigError` naming ``scheduler.params.<key>`` when the JSON ``value`` cannot be
    the torch scheduler's argument annotated ``annotation`` (torch's text, e.g. ``"float |
    list[float]"``): a number where a number is expected (an int or a float alike, as torch
    computes with either; a bool is no number), a bool for a bool, one of a ``Literal``'s
    strings, a list of such for a ``list``/``Iterable``, null for ``None``; a function
    (``Callable``) cannot come from JSON. An annotation this does not read accepts anything:
    torch's own checks decide."""
    if not isinstance(annotation, str) or _fits_annotation(value, annotation):
        return
    if "Callable" in annotation:
        raise ConfigError(f"scheduler.params.{key}={value!r} for scheduler.type={kind!r}: torch."
                          f"optim.lr_scheduler.{kind} takes a function there, which a JSON config "
                          f"cannot hold; delete the config's 'scheduler' section and pass "
                          f"initialize(lr_scheduler=lambda optimizer: {kind}(optimizer, ...))")
    raise ConfigError(f"scheduler.params.{key}={value!r} is not valid for scheduler.type="
                      f"{kind!r}: a {type(value).__name__}, where torch.optim.lr_scheduler."
                      f"{kind} expects {annotation} (int and float: a JSON number)")


def _fits_annotation(value, annotation: str) -> bool:
    """Whether the JSON ``value`` fits the annotation text ``annotation`` (see
    :func:`_check_torch_argument`); an unread form fits anything."""
    annotation = annotation.strip()
    options = _split_top_level(annotation, "|")
    if len(options) > 1:
        return any(_fits_annotation(value, option) for option in options)
    outer, _, inner = annotation.partition("[")
    inner = inner[:-1] if inner.endswith("]") else inner
    if outer in ("int", "float"):
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if outer in ("bool", "str"):
        return isinstance(value, bool if outer == "bool" else str)
    if outer == "None":
        return value is None
    if outer in ("Union", "Optional"):
        options = _split_top_level(inner, ",") + (["None"] if outer == "Optional" else [])
        return any(_fits_annotation(value, option) for option in options)
    if outer in ("list", "List", "Iterable", "Sequence"):
        return isinstance(value, (list, tuple)) and all(_fits_annotation(v, inner)
                                                        for v in value)
    if outer == "Literal":
        import ast
        return value in ast.literal_eval(f"[{inner}]")
    if outer.startswith("Callable"):
        return value is None
    return True


def _split_top_level(text: str, separator: str) -> list[str]:
    """``text`` split at each ``separator`` outside brackets (``"a[b, c], d"`` at ``","``:
    ``["a[b, c]", " d"]``)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return parts + [text[start:]]


def _breakdown_notes(checked: dict) -> list[str]:
    """DeepSpeed's timing and memory printouts, switched on: accepted, but they print nothing
    here, so rank 0 says so once rather than leave the user waiting for the lines."""
    instead = {"wall_clock_breakdown": "time the loop or use torch.profiler",
               "memory_breakdown": "use shardkit.utils.memory.model_state_bytes"}
    return [f"{key}=true has no effect in shardkit (no breakdown is printed); {hint}"
            for key, hint in instead.items() if checked[key]]


def _hybrid_engine_notes(section: dict) -> list[str]:
    """``hybrid_engine.enabled``: DeepSpeed then swaps in its hybrid engine, whose training
    path is the ordinary engine's and whose ``generate`` runs the model through inference
    kernels (tensor-parallel over ``inference_tp_size`` ranks). The training is the same here;
    ``engine.generate(...)`` is the model's own ``generate`` (the engine forwards it; at stage
    3 each FSDP unit is gathered per forward), so rank 0 says so once."""
    if not section["enabled"]:
        return []
    return ["hybrid_engine.enabled=true: training is unchanged; engine.generate(...) runs the "
            "model's own generate() (no DeepSpeed inference kernels, no inference_tp_size "
            "split, no CUDA graphs), so generation is slower than DeepSpeed's but gives the "
            "model's own outputs"]


def _compression_notes(section: dict) -> list[str]:
    """A ``compression_training`` technique switched on: DeepSpeed applies it only to a model
    passed through ``deepspeed.compression.compress.init_compression``, which shardkit does not
    provide, so rank 0 says the model trains uncompressed."""
    def any_enabled(node) -> bool:
        if isinstance(node, Mapping):
            return node.get("enabled") is True or any(any_enabled(v) for v in node.values())
        return False
    if not any_enabled(section):
        return []
    return ["compression_training has no effect in shardkit: DeepSpeed compresses only a model "
            "passed through deepspeed.compression's init_compression, which shardkit does not "
            "provide; the model trains uncompressed"]


def _zero_config(section: dict) -> tuple[ZeroConfig, list[str]]:
    notes = []
    stage = section["stage"]
    param_device = "cpu" if section["cpu_offload_param"] else section["offload_param"]["device"]
    if section["cpu_offload_param"]:
        notes.append("zero_optimization.cpu_offload_param is deprecated in DeepSpeed; treated "
                     "as offload_param.device='cpu'")
    if section["cpu_offload"]:
        notes.append("zero_optimization.cpu_offload is deprecated in DeepSpeed; treated as "
                     "offload_optimizer.device='cpu'")
    if param_device != "none" and stage < 3:
        notes.append(f"zero_optimization.offload_param only applies at stage 3; ignored at "
                     f"stage {stage}")
        param_device = "none"
    optim_device = "cpu" if section["cpu_offload"] else section["offload_optimizer"]["device"]
    bucket = section["reduce_bucket_size"]
    quantized = {key: section[f"zero_{key}"] for key in ("quantized_weights",
                                                         "quantized_gradients")}
    for key, on in list(quantized.items()):
        if on and stage < 3:
            notes.append(f"zero_optimization.zero_{key} only applies at stage 3 (FSDP's "
                         f"quantized collectives); ignored at stage {stage}")
            quantized[key] = False
    hpz = section["zero_hpz_partition_size"]
    if hpz > 1 and stage < 3:
        notes.append(f"zero_optimization.zero_hpz_partition_size only applies at stage 3; "
                     f"ignored at stage {stage}")
        hpz = 1
    return ZeroConfig(stage=stage, reduce_bucket_numel=None if bucket is None else int(bucket),
                      offload_optimizer_device=optim_device,
                      offload_param_device=param_device, hpz_partition_size=hpz,
                      reduce_to_owners=stage == 1 and section["reduce_scatter"],
                      ignore_unused_parameters=section["ignore_unused_parameters"],
                      **quantized), notes


def accumulation_dtype_name(dtype: str, stage: int) -> str:
    """The dtype (``"fp32"``, ``"fp16"``, ``"bf16"``) the engine accumulates gradients in for
    the precision ``dtype`` at ZeRO ``stage``: the 16-bit dtype at stages 0-2 (16-bit gradients,
    fp32 masters in the optimizer), fp32 otherwise (stage 3's gradient shards are fp32)."""
    return dtype if dtype != "fp32" and stage < 3 else "fp32"


def _check_grad_accum_dtype(name: Optional[str], dtype: str, stage: int) -> None:
    """``data_types.grad_accum_dtype`` must name the dtype the engine accumulates gradients
    in, which precision and stage fix: the model's 16-bit dtype at stages 0-2 under fp16/bf16
    (16-bit weights and gradients, fp32 masters in the optimizer), fp32 otherwise (fp32
    training, stage 3's fp32 shards). DeepSpeed's ZeRO optimizers accumulate in whichever
    dtype it names; a ConfigError here, rather than accumulating in another one unsaid."""
    if name is None:
        return
    accumulated = accumulation_dtype_name(dtype, stage)
    if _ACCUM_DTYPES[name.lower()] == accumulated:
        return
    if accumulated != "fp32":
        raise ConfigError(
            f"data_types.grad_accum_dtype={name!r} is not supported with {dtype} at "
            f"zero_optimization.stage={stage}: stages 0-2 keep the model's weights and gradients "
            f"in {dtype} and accumulate the gradients in {dtype} (fp32 master weights in the "
            f"optimizer); remove the key (or set {dtype!r}) to train so, as DeepSpeed does "
            f"without it, or use zero_optimization.stage 3, whose gradient shards are fp32")
    why = "fp32 training" if dtype == "fp32" else f"{dtype} at ZeRO stage 3: fp32 shards"
    raise ConfigError(f"data_types.grad_accum_dtype={name!r} is not supported: gradients "
                      f"accumulate in fp32 here ({why}); remove the key or set 'fp32'")


def _precision_config(fp16: dict, bf16: dict) -> PrecisionConfig:
    if fp16["enabled"] and bf16["enabled"]:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one")
    if not fp16["enabled"]:
        if bf16["enabled"]:
            return PrecisionConfig(dtype="bf16", check_grad_overflow=bf16["check_grad_overflow"])
        return PrecisionConfig(dtype="fp32")
    if not fp16["loss_scale"] and 2.0 ** fp16["initial_scale_power"] < fp16["min_loss_scale"]:
        # the dynamic scale would start below its own floor (DynamicLossScaler refuses it)
        raise ConfigError(f"fp16.initial_scale_power={fp16['initial_scale_power']} starts the "
                          f"loss scale at {2.0 ** fp16['initial_scale_power']:g}, below "
                          f"fp16.min_loss_scale={fp16['min_loss_scale']!r}; raise "
                          f"initial_scale_power or lower min_loss_scale (2 ** initial_scale_power "
                          f">= min_loss_scale)")
    return PrecisionConfig(
        dtype="fp16", check_grad_overflow=True, static_loss_scale=float(fp16["loss_scale"]),
        initial_scale_power=fp16["initial_scale_power"],
        loss_scale_window=fp16["loss_scale_window"], hysteresis=fp16["hysteresis"],
        consecutive_hysteresis=fp16["consecutive_hysteresis"],
        min_loss_scale=float(fp16["min_loss_scale"]),
        raise_error_at_min_scale=fp16["raise_error_at_min_scale"])
