"""DESIGN.md's "Public API" block, checked name by name: every documented name is importable
from its documented path and accepts the documented arguments with the documented defaults."""

import importlib
import inspect

import pytest
import torch

# (import path, {argument: documented default}); ``inspect.Parameter.empty``: required
_EMPTY = inspect.Parameter.empty
DOCUMENTED_SIGNATURES = [
    ("shardkit.distributed.init_distributed", {"backend": None}),
    ("shardkit.optim.OSS", {"params": _EMPTY, "optim": torch.optim.SGD, "group": None,
                            "broadcast_fp16": False}),
    ("shardkit.optim.DynamicLossScaler", {"init_scale": 2 ** 32, "scale_window": 1000,
                                          "hysteresis": 2, "min_scale": 1,
                                          "raise_error_at_min_scale": False}),
    ("shardkit.nn.data_parallel.ShardedDataParallel", {
        "module": _EMPTY, "sharded_optimizer": _EMPTY, "process_group": None,
        "broadcast_buffers": True, "sync_models_at_startup": True, "reduce_buffer_size": 2 ** 23,
        "auto_refresh_trainable": True, "reduce_fp16": False}),
    ("shardkit.nn.data_parallel.FullyShardedDataParallel", {
        "module": _EMPTY, "process_group": None, "mixed_precision": False,
        "fp32_reduce_scatter": False, "flatten_parameters": True, "move_params_to_cpu": False,
        "compute_dtype": None, "buffer_dtype": None}),
    ("shardkit.nn.Pipe", {"devices": None, "chunks": 1, "checkpoint": "except_last"}),
    ("shardkit.nn.pipe.PipelineStage", {"module": _EMPTY, "stage_index": _EMPTY,
                                        "num_stages": _EMPTY, "group": None}),
    # chunks may instead come as torch's n_microbatches=: a default, still the 2nd argument
    ("shardkit.nn.pipe.ScheduleGPipe", {"stage": _EMPTY, "chunks": None}),
    ("shardkit.nn.pipe.Schedule1F1B", {"stage": _EMPTY, "chunks": None}),
    ("shardkit.nn.model_parallel.initialize.initialize_model_parallel",
     {"model_parallel_size": _EMPTY, "pipeline_length": 1}),
    ("shardkit.nn.model_parallel.layers.ColumnParallelLinear", {"bias": True,
                                                                "gather_output": True}),
    ("shardkit.nn.model_parallel.layers.RowParallelLinear", {"bias": True,
                                                             "input_is_parallel": False}),
    ("shardkit.nn.checkpoint.checkpoint_wrapper", {"module": _EMPTY, "offload_to_cpu": False}),
    ("shardkit.initialize", {"model": _EMPTY, "optimizer": None, "model_parameters": None,
                             "training_data": None, "lr_scheduler": None, "config": None,
                             "config_params": None}),
]


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path,defaults", DOCUMENTED_SIGNATURES,
                         ids=[p for p, _ in DOCUMENTED_SIGNATURES])
def test_documented_arguments_and_defaults(path, defaults):
    parameters = inspect.signature(_resolve(path)).parameters
    for name, default in defaults.items():
        assert name in parameters, f"{path} lacks the documented argument {name!r}"
        assert parameters[name].default == default, (
            f"{path}({name}=...) defaults to {parameters[name].default!r}, documented {default!r}")


def test_fsdp_reshards_after_forward_by_default():
    """DESIGN.md documents ``reshard_after_forward=True``; the signature's ``None`` must mean
    it (FULL_SHARD) unless a sharding strategy says otherwise."""
    from shardkit.nn.data_parallel.sharding_strategy import resolve_sharding_strategy
    _, reshard = resolve_sharding_strategy(None, None)
    assert reshard is True


@pytest.mark.parametrize("path", [
    "shardkit.distributed.CommCounter", "shardkit.optim.FusedAdamW",
    "shardkit.optim.ShardedGradScaler", "shardkit.nn.wrap.auto_wrap",
    "shardkit.nn.wrap.enable_wrap", "shardkit.nn.wrap.wrap",
    "shardkit.nn.wrap.default_auto_wrap_policy", "shardkit.nn.wrap.transformer_auto_wrap_policy",
    "shardkit.nn.pipe.split_sequential", "shardkit.nn.pipe.skip.skippable",
    "shardkit.nn.pipe.skip.stash", "shardkit.nn.pipe.skip.pop", "shardkit.nn.pipe.skip.Namespace",
    "shardkit.nn.pipe.skip.verify_skippables", "shardkit.nn.pipe.is_checkpointing",
    "shardkit.nn.pipe.is_recomputing", "shardkit.nn.model_parallel.layers.VocabParallelEmbedding",
    "shardkit.nn.model_parallel.layers.ParallelEmbedding",
    "shardkit.nn.model_parallel.cross_entropy.vocab_parallel_cross_entropy",
    "shardkit.nn.model_parallel.mappings.copy_to_model_parallel_region",
    "shardkit.nn.model_parallel.mappings.reduce_from_model_parallel_region",
    "shardkit.nn.model_parallel.mappings.scatter_to_model_parallel_region",
    "shardkit.nn.model_parallel.mappings.gather_from_model_parallel_region",
    "shardkit.nn.model_parallel.random.model_parallel_manual_seed",
    "shardkit.nn.model_parallel.random.get_model_parallel_rng_tracker",
    "shardkit.nn.model_parallel.initialize.destroy_model_parallel",
    "shardkit.nn.model_parallel.initialize.get_pipeline_parallel_group",
    "shardkit.nn.checkpoint.disable_checkpointing", "shardkit.nn.checkpoint.is_checkpointing",
    "shardkit.nn.checkpoint.is_recomputing", "shardkit.__version__",
])
def test_documented_name_is_importable(path):
    assert _resolve(path) is not None


def test_documented_methods_exist():
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS
    documented = {
        OSS: ["step", "zero_grad", "partition_parameters", "clip_grad_norm",
              "consolidate_state_dict", "state_dict", "load_state_dict", "add_param_group",
              "refresh_trainable", "param_to_rank"],
        ShardedDataParallel: ["no_sync", "refresh_trainable", "zero_grad"],
        FullyShardedDataParallel: ["state_dict", "local_state_dict", "load_state_dict",
                                   "load_local_state_dict", "clip_grad_norm_",
                                   "summon_full_params", "no_sync",
                                   "gather_full_optim_state_dict",
                                   "get_shard_from_optim_state_dict"],
    }
    for cls, names in documented.items():
        missing = [n for n in names if not hasattr(cls, n)]
        assert not missing, f"{cls.__name__} lacks {missing}"
