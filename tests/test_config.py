"""Config validation: every bad key or value is named with its dotted path; batch triple."""

import json

import pytest

from shardkit.config import ConfigError, load_config, resolve_batch_sizes

SEED_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                             "total_num_steps": 5000}},
    "zero_optimization": {"stage": 2,
                          "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 32, "hysteresis": 2, "min_loss_scale": 1},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
}


def test_seed_config_resolves():
    cfg = load_config(SEED_CONFIG, data_parallel_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.zero.stage == 2 and cfg.zero.offload_optimizer_device == "cpu"
    assert cfg.zero.offload_param_device == "none"  # below stage 3: ignored, with a note
    assert any("only applies at stage 3" in w for w in cfg.warnings)
    assert cfg.precision.dtype == "fp16" and cfg.precision.initial_scale_power == 32
    assert cfg.optimizer.torch_class == "AdamW" and cfg.optimizer.kwargs["lr"] == 0.001
    assert cfg.scheduler.kwargs["total_num_steps"] == 5000
    assert cfg.gradient_clipping == 1.0


def test_json_file_and_defaults(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    cfg = load_config(str(path), data_parallel_size=4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (12, 1)
    assert cfg.zero.stage == 0 and cfg.precision.dtype == "fp32" and cfg.steps_per_print == 10


def test_deepspeed_adam_is_adamw_unless_adam_w_mode_false():
    base = {"train_batch_size": 2}
    adam = load_config({**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}, 1)
    plain = load_config({**base, "optimizer": {"type": "adam",
                                               "params": {"adam_w_mode": False}}}, 1)
    sgd = load_config({**base, "optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}, 1)
    assert adam.optimizer.torch_class == "AdamW" and plain.optimizer.torch_class == "Adam"
    assert sgd.optimizer.kwargs["momentum"] == 0.9


def test_adam_weight_decay_defaults_are_deepspeeds():
    # DeepSpeed's Adam/AdamW (FusedAdam, DeepSpeedCPUAdam) default to no weight decay; only
    # torch_adam=true builds torch.optim.AdamW, whose default is 0.01.
    base = {"train_batch_size": 2}
    for kind in ("AdamW", "Adam"):
        plain = load_config({**base, "optimizer": {"type": kind, "params": {"lr": 1e-3}}}, 1)
        torch_adam = load_config({**base, "optimizer": {"type": kind, "params": {
            "lr": 1e-3, "torch_adam": True}}}, 1)
        assert plain.optimizer.kwargs["weight_decay"] == 0.0, kind
        assert torch_adam.optimizer.kwargs["weight_decay"] == 0.01, kind


def test_warmup_lr_without_max_lr_warms_up_to_the_optimizer_lr():
    # DeepSpeed's WarmupLR takes each group's optimizer lr when warmup_max_lr is absent (or
    # null); WarmupDecayLR keeps its 0.001.
    base = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}
    for params in ({"warmup_num_steps": 10}, {"warmup_max_lr": None}):
        cfg = load_config({**base, "scheduler": {"type": "WarmupLR", "params": params}}, 1)
        assert cfg.scheduler.kwargs["warmup_max_lr"] is None, params
    decay = load_config({**base, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 100}}}, 1)
    assert decay.scheduler.kwargs["warmup_max_lr"] == 0.001


@pytest.mark.parametrize("train, micro, gas, world, expected", [
    (32, 4, None, 2, (32, 4, 4)),
    (32, None, 2, 4, (32, 4, 2)),
    (None, 4, 2, 2, (16, 4, 2)),
    (8, None, None, 2, (8, 4, 1)),
    (None, 5, None, 3, (15, 5, 1)),
    (24, 3, 2, 4, (24, 3, 2)),
])
def test_batch_triple(train, micro, gas, world, expected):
    assert resolve_batch_sizes(train, micro, gas, world) == expected


@pytest.mark.parametrize("config, needles", [
    ({"train_batch_size": 8, "zero_optimisation": {"stage": 1}},
     ["'zero_optimisation'", "did you mean 'zero_optimization'"]),
    # without a close match the sentence still ends before the list of valid keys
    ({"train_batch_size": 8, "xyzzy": 1}, ["unknown config key 'xyzzy'. Valid keys: ["]),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"learning_rate": 1}}},
     ["unknown config key 'optimizer.params.learning_rate'. Valid keys under "]),
    ({"train_batch_size": 8, "zero_optimization": {"stgae": 1}},
     ["'zero_optimization.stgae'", "did you mean 'zero_optimization.stage'"]),
    ({"train_batch_size": 8, "zero_optimization": {"offload_param": {"devise": "cpu"}}},
     ["zero_optimization.offload_param.devise", "'zero_optimization.offload_param.device'"]),
    ({"train_batch_size": 8, "fp16": {"enabled": True, "initial_scale_powr": 8}},
     ["fp16.initial_scale_powr", "fp16.initial_scale_power"]),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1, "beta": 1}}},
     ["optimizer.params.beta", "did you mean 'optimizer.params.betas'"]),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 4}},
     ["zero_optimization.stage=4", "<= 3"]),
    ({"train_batch_size": 8, "zero_optimization": {"stage": "2"}},
     ["zero_optimization.stage='2'", "wrong type str"]),
    ({"train_batch_size": 8, "zero_optimization": {"stage": True}},
     ["zero_optimization.stage=True"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 1}, ["inconsistent batch sizes", "= 8",
                                          "set train_batch_size=8, or give two of the three"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
     ["train_batch_size=10 is not divisible", "= 8", "multiples of 8 (e.g. 8 or 16)"]),
    ({"train_batch_size": 6, "gradient_accumulation_steps": 4},
     ["train_batch_size=6 is not divisible", "multiples of 8 (e.g. 8)"]),
    ({"gradient_accumulation_steps": 2}, ["train_micro_batch_size_per_gpu are both missing"]),
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": -0.1}}},
     ["optimizer.params.lr=-0.1", ">= 0"]),
    ({"train_batch_size": 8, "optimizer": {"type": "Adamm"}},
     ["optimizer.type='Adamm'", "did you mean 'Adam'"]),
    ({"train_batch_size": 8, "optimizer": {"params": {"lr": 1}}}, ["optimizer.type is missing"]),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
     ["scheduler.params.total_num_steps is required"]),
    ({"train_batch_size": 8, "scheduler": {"type": "WarmupLR",
                                           "params": {"warmup_type": "cosine"}}},
     ["scheduler.params.warmup_type='cosine'"]),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     ["fp16.enabled and bf16.enabled"]),
    ({"train_batch_size": 8, "gradient_clipping": float("nan")}, ["gradient_clipping=nan"]),
    ({"train_batch_size": 8, "fp16": "on"}, ["fp16: expected a JSON object"]),
    ({"train_batch_size": 8, "bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
     ["'bfloat16' and 'bf16'"]),
    ({"train_batch_size": 8, "bfloat16": {"enable": True}}, ["bf16.enable"]),
    # DeepSpeed sections shardkit accepts only switched off: on, each names what to use instead
    ({"train_batch_size": 8, "activation_checkpointing": {"contiguous_memory_optimization": True,
                                                          "number_checkpoints": 2}},
     ["activation_checkpointing.contiguous_memory_optimization=true needs",
      "partition_activations=true"]),
    ({"train_batch_size": 8, "tensorboard": {"enabled": True, "output_path": "runs"}},
     ["tensorboard.enabled=True is not supported", "TensorBoard"]),
    ({"train_batch_size": 8, "flops_profiler": {"enabled": True}}, ["torch.profiler"]),
    ({"train_batch_size": 8, "wandb": {"enabled": False, "projekt": "x"}},
     ["wandb.projekt", "did you mean 'wandb.project'"]),
    ({"train_batch_size": 8, "communication_data_type": "int8"},
     ["communication_data_type='int8' is not a valid choice", "'bf16'"]),
    ({"train_batch_size": 8, "communication_data_type": "bf16",
      "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
     ["communication_data_type='bf16' with zero_optimization.zero_quantized_gradients"]),
    ({"train_batch_size": 8, "data_types": {"grad_accum_dtype": "bf16"}},
     ["data_types.grad_accum_dtype='bf16' is not supported"]),
    # stages 0-2 under bf16/fp16 accumulate the 16-bit gradients: fp32 was accepted and ignored
    ({"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
      "data_types": {"grad_accum_dtype": "fp32"}},
     ["data_types.grad_accum_dtype='fp32' is not supported with bf16 at "
      "zero_optimization.stage=1", "accumulate the gradients in bf16", "stage 3"]),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "zero_optimization": {"stage": 2},
      "data_types": {"grad_accum_dtype": "float32"}},
     ["grad_accum_dtype='float32' is not supported with fp16 at zero_optimization.stage=2"]),
    ({"train_batch_size": 8, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
      "data_types": {"grad_accum_dtype": "bf16"}},
     ["grad_accum_dtype='bf16' is not supported", "accumulate in fp32 here"]),
    ({"train_batch_size": 8, "amp": {"enabled": True, "opt_level": "O1"}},
     ["amp.enabled=True is not supported"]),
    # DeepSpeed refuses max_grad_norm as an optimizer parameter and points at gradient_clipping
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
     ["optimizer.params.max_grad_norm=1.0", '"gradient_clipping"']),
])
def test_bad_config_is_named(config, needles):
    with pytest.raises(ConfigError) as info:
        load_config(config, data_parallel_size=2)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "nope.json"), 1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad), 1)
    with pytest.raises(ConfigError, match="no config given"):
        load_config(None, 1)


def test_zero_hpz_partition_size():
    base = {"train_batch_size": 8}
    cfg = load_config({**base, "zero_optimization": {"stage": 3,
                                                     "zero_hpz_partition_size": 2}}, 4)
    assert cfg.zero.hpz_partition_size == 2 and not cfg.warnings
    assert load_config(base, 4).zero.hpz_partition_size == 1
    below = load_config({**base, "zero_optimization": {"stage": 2,
                                                       "zero_hpz_partition_size": 2}}, 4)
    assert below.zero.hpz_partition_size == 1
    assert any("zero_hpz_partition_size only applies at stage 3" in w for w in below.warnings)
    with pytest.raises(ConfigError, match="zero_hpz_partition_size=3 must divide the "
                                          "data-parallel size 4"):
        load_config({**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
                    4)
    with pytest.raises(ConfigError, match="zero_optimization.zero_hpz_partition_size=0"):
        load_config({**base, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}},
                    4)


def test_deepspeed_older_bfloat16_section_is_read_as_bf16():
    cfg = load_config({"train_batch_size": 8, "bfloat16": {"enabled": True}}, 2)
    assert cfg.precision.dtype == "bf16"
    assert load_config({"train_batch_size": 8, "bfloat16": {"enabled": False}},
                       2).precision.dtype == "fp32"


def test_reduce_scatter_picks_reduce_to_owners_at_stage_1():
    """DeepSpeed's default reduce_scatter=true averages stage 1's gradients onto their owners
    (2Ψ(N-1)/N a step); false keeps the all-reduce; other stages are unaffected."""
    base = {"train_batch_size": 8}
    stage1 = {**base, "zero_optimization": {"stage": 1}}
    assert load_config(stage1, 2).zero.reduce_to_owners
    off = {**base, "zero_optimization": {"stage": 1, "reduce_scatter": False}}
    assert not load_config(off, 2).zero.reduce_to_owners
    for stage in (0, 2, 3):
        assert not load_config({**base, "zero_optimization": {"stage": stage}},
                               2).zero.reduce_to_owners


def test_deepspeed_sections_switched_off_are_accepted():
    """Sections of real DeepSpeed configs that change nothing while off load as they are."""
    config = {**SEED_CONFIG, "wall_clock_breakdown": False,
              "activation_checkpointing": {"partition_activations": False,
                                           "cpu_checkpointing": False,
                                           "contiguous_memory_optimization": False,
                                           "number_checkpoints": None,
                                           "synchronize_checkpoint_boundary": False,
                                           "profile": False},
              "tensorboard": {"enabled": False, "output_path": "runs/", "job_name": "x"},
              "wandb": {"enabled": False, "project": "p"},
              "csv_monitor": {"enabled": False},
              "comms_logger": {"enabled": False, "verbose": False, "prof_ops": []},
              "flops_profiler": {"enabled": False, "profile_step": 1, "output_file": None},
              "amp": {"enabled": False}, "communication_data_type": "fp32",
              "data_types": {"grad_accum_dtype": None}, "zero_force_ds_cpu_optimizer": False}
    plain = load_config(SEED_CONFIG, data_parallel_size=2)
    cfg = load_config(config, data_parallel_size=2)
    assert (cfg.zero, cfg.precision, cfg.optimizer, cfg.scheduler) == (
        plain.zero, plain.precision, plain.optimizer, plain.scheduler)


@pytest.mark.parametrize("precision, stage, name", [
    ("fp32", 0, "fp32"), ("fp32", 3, "float32"), ("bf16", 3, "fp32"), ("bf16", 0, "bf16"),
    ("bf16", 2, "bfloat16"), ("fp16", 1, "fp16"), ("fp16", 2, "half"), ("bf16", 1, None)])
def test_grad_accum_dtype_naming_what_the_engine_accumulates_in(precision, stage, name):
    # (the dtype the gradients of a 16-bit model at stages 0-2 accumulate in; fp32 elsewhere)
    config = {"train_batch_size": 8, "zero_optimization": {"stage": stage},
              "data_types": {"grad_accum_dtype": name}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    assert load_config(config, data_parallel_size=2).precision.dtype == precision


@pytest.mark.parametrize("value, dtype", [(None, None), ("fp32", "fp32"), ("float32", "fp32"),
                                          ("FP16", "fp16"), ("bfloat16", "bf16"),
                                          ("bf16", "bf16")])
def test_communication_data_type(value, dtype):
    cfg = load_config({"train_batch_size": 8, "communication_data_type": value},
                      data_parallel_size=2)
    assert cfg.communication_dtype == dtype


def test_bf16_section_keys_and_overflow_check():
    # DeepSpeed's bf16 section: check_grad_overflow (default true: skip inf/nan steps) and
    # immediate_grad_update (accepted, no effect here); fp16 always checks
    base = {"train_batch_size": 2}
    on = load_config({**base, "bf16": {"enabled": True, "immediate_grad_update": True}}, 1)
    off = load_config({**base, "bf16": {"enabled": True, "check_grad_overflow": False}}, 1)
    fp16 = load_config({**base, "fp16": {"enabled": True}}, 1)
    fp32 = load_config(base, 1)
    assert (on.precision.check_grad_overflow, off.precision.check_grad_overflow) == (True, False)
    assert fp16.precision.check_grad_overflow and not fp32.precision.check_grad_overflow


def test_one_cycle_scheduler_section():
    # DeepSpeed's OneCycle: cycle_min_lr and cycle_max_lr are required, the rest default
    base = {"train_batch_size": 2}
    cfg = load_config({**base, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 100,
        "cycle_second_step_size": None, "decay_step_size": 10}}}, 1)
    assert cfg.scheduler.type == "OneCycle"
    assert cfg.scheduler.kwargs["cycle_max_lr"] == 1e-3
    assert cfg.scheduler.kwargs["cycle_momentum"] is True
    with pytest.raises(ConfigError, match="scheduler.params.cycle_max_lr is required"):
        load_config({**base, "scheduler": {"type": "OneCycle",
                                           "params": {"cycle_min_lr": 1e-4}}}, 1)
    with pytest.raises(ConfigError, match="cycle_first_step_size=0 is out of range"):
        load_config({**base, "scheduler": {"type": "OneCycle", "params": {
            "cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_step_size": 0}}}, 1)
    with pytest.raises(ConfigError, match=r"cycle_max_mom=1.5 is out of range.*\[0, 1\)"):
        load_config({**base, "scheduler": {"type": "OneCycle", "params": {
            "cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_max_mom": 1.5}}}, 1)


def test_breakdown_switches_say_they_print_nothing():
    # DeepSpeed prints timing / memory breakdowns for these; shardkit accepts them and says
    # once (rank 0 logs cfg.warnings at initialize) that no breakdown will come
    cfg = load_config({"train_batch_size": 2, "wall_clock_breakdown": True,
                       "memory_breakdown": False}, 1)
    assert len(cfg.warnings) == 1 and "wall_clock_breakdown=true has no effect" in cfg.warnings[0]
    assert load_config({"train_batch_size": 2, "wall_clock_breakdown": False}, 1).warnings == ()


def test_more_deepspeed_keys_at_their_defaults_or_off_are_accepted():
    """Keys DeepSpeed reads (its constants.py, config.py, zero/config.py) at their defaults or
    switched off: a config DeepSpeed takes is not refused as naming an unknown key."""
    more = {"progressive_layer_drop": {"enabled": False, "theta": 0.5, "gamma": 0.001},
            "eigenvalue": {"enabled": False, "max_iter": 50},
            "timers": {"throughput": {"enabled": True, "synchronized": False}},
            "compile": {"deepcompile": False, "offload_activation": False},
            "nebula": {"enabled": False, "persistent_time_interval": 10},
            "managed_gradient_accumulation": True, "disable_allgather": False,
            "graph_harvesting": False, "seq_parallel_communication_data_type": "fp32",
            "use_data_before_expert_parallelism": False, "log_level": "info",
            "vocabulary_size": 50257,
            "zero_optimization": {"stage": 3, "zenflow": None,
                                  "leaf_module": {"classes": ["MixtralSparseMoeBlock"]}}}
    plain = load_config({**SEED_CONFIG, "zero_optimization": {"stage": 3}}, 2)
    cfg = load_config({**SEED_CONFIG, **more}, 2)
    assert (cfg.zero, cfg.precision, cfg.optimizer, cfg.scheduler) == (
        plain.zero, plain.precision, plain.optimizer, plain.scheduler)


@pytest.mark.parametrize("key, value, needle", [
    ("progressive_layer_drop", {"enabled": True},
     "progressive_layer_drop.enabled=True is not supported"),
    ("compile", {"deepcompile": True}, "compile.deepcompile=True is not supported"),
    ("managed_gradient_accumulation", False, "managed_gradient_accumulation=False is not "
                                             "supported"),
    ("zero_optimization", {"stage": 3, "zenflow": {"topk_ratio": 0.1}},
     "zero_optimization.zenflow="),
    ("use_data_before_expert_parallelism", True, "shardkit has no expert-parallel groups"),
])
def test_deepspeed_features_switched_on_are_refused_by_name(key, value, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        load_config({**SEED_CONFIG, key: value}, 2)


@pytest.mark.parametrize("nulls, expected", [
    ({"train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": None}, (8, 4, 1)),
    ({"train_batch_size": None, "train_micro_batch_size_per_gpu": 2}, (8, 2, 2)),
    ({"gradient_accumulation_steps": None, "train_micro_batch_size_per_gpu": 2}, (8, 2, 2)),
])
def test_a_null_batch_key_counts_as_not_given(nulls, expected):
    # DeepSpeed reads each with param_dict.get(key, None): null is the same as absent
    full = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2 if "train_batch_size" in nulls else 1}
    config = {**SEED_CONFIG, **full, **nulls}
    cfg = load_config(config, 2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_zero_warmup_steps_are_refused_as_deepspeed_does(scheduler):
    params = {"warmup_num_steps": 0, "total_num_steps": 10}
    if scheduler == "WarmupLR":
        del params["total_num_steps"]
    with pytest.raises(ConfigError, match="scheduler.params.warmup_num_steps=0"):
        load_config({**SEED_CONFIG, "scheduler": {"type": scheduler, "params": params}}, 2)


def test_offload_optimizer_ratio_is_a_fraction():
    # DeepSpeed's partial offload: accepted in [0, 1] (the whole state is offloaded here);
    # before, 5.0 or a negative share were accepted too
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}
    assert load_config({**SEED_CONFIG, "zero_optimization": zero}, 2).zero.stage == 2
    for bad in (5.0, -0.5, float("nan")):
        with pytest.raises(ConfigError, match="ratio=.*a number in \\[0, 1\\]"):
            load_config({**SEED_CONFIG, "zero_optimization": {
                "stage": 2, "offload_optimizer": {"device": "cpu", "ratio": bad}}}, 2)
