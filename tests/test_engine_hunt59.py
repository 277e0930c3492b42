"""DeepSpeed-user corners of ``shardkit.initialize``'s engine found by a bug hunt.

``save_16bit_model`` of a model whose module keeps extra state (``get_extra_state()``, as
torch's ``state_dict`` carries it under ``<module>._extra_state``): the file is written with
that state as it is, and a state that cannot be written raises on every rank instead of on
rank 0 alone (the others waited for rank 0's verdict forever).

Config keys DeepSpeed reads that were "unknown config key" errors: ``bf16``'s low-precision
ZeRO switches (DeepSpeedExamples' bf16_master_weight configs) and ``zero_optimization``'s
performance switches; accepted at the values shardkit runs with, refused otherwise naming the
key.

One world of 2 gloo ranks for the module (the config checks need none).
"""

import os

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


class _Versioned(nn.Linear):
    """A linear layer with extra state (its format version), as quantized or fp8 layers keep."""

    extra = {"version": 3}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.loaded_extra = state


def _model():
    torch.manual_seed(0)
    return nn.Sequential(_Versioned(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _config(stage: int, precision) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if precision is not None:
        config[precision] = {"enabled": True}
    return config


def _save_16bit(stage: int, precision, save_dir: str, unpicklable: bool = False):
    model = _model()
    if unpicklable:  # a lambda cannot be pickled by torch.save
        model[0].extra = {"hook": lambda x: x}
    engine, *_ = shardkit.initialize(model=model, config=_config(stage, precision))
    gen = torch.Generator().manual_seed(distributed.get_rank())
    engine.backward(engine(torch.randn(2, 4, generator=gen)).float().pow(2).mean())
    engine.step()
    try:
        engine.save_16bit_model(save_dir, "model.bin")
    except RuntimeError as error:
        return f"RuntimeError: {error}"
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("stage,precision", [(0, None), (3, "bf16")])
def test_save_16bit_model_keeps_extra_state(world2, tmp_path, stage, precision):
    # fp32: rank 0 failed on the extra state ('dict' object has no attribute 'detach') while
    # rank 1 waited for its verdict; bf16: every rank failed ('dict' object has no attribute
    # 'is_floating_point'). DeepSpeed writes the module's state_dict as it is.
    states = world2.run(_save_16bit, stage, precision, str(tmp_path))
    saved = torch.load(os.path.join(tmp_path, "model.bin"), weights_only=True)
    assert saved["0._extra_state"] == {"version": 3}
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    for key, value in states[0].items():
        if key.endswith("_extra_state"):
            continue
        assert saved[key].dtype == dtype
        assert torch.equal(saved[key], value.to(dtype))
    fresh = _model()
    fresh.load_state_dict(saved)
    assert fresh[0].loaded_extra == {"version": 3}


def test_save_16bit_model_unwritable_state_raises_on_every_rank(world2, tmp_path):
    # rank 0's pickling error escaped on rank 0 only: rank 1 hung in the verdict's broadcast
    outcomes = world2.run(_save_16bit, 0, None, str(tmp_path), unpicklable=True)
    for outcome in outcomes:
        assert isinstance(outcome, str) and "could not write" in outcome
        assert "pickle" in outcome.lower() or "lambda" in outcome.lower()
    assert os.listdir(tmp_path) == []  # no partial file, no temporary


def _load(**sections):
    return load_config({"train_batch_size": 8, **sections}, 4)


def test_bf16_low_precision_switches_accepted_off_and_refused_on():
    # both were "unknown config key 'bf16.bf16_master_weights_and_grads'", also when false
    config = _load(bf16={"enabled": True, "bf16_master_weights_and_grads": False,
                         "bf16_optimizer_states": False})
    assert config.precision.dtype == "bf16"
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        with pytest.raises(ConfigError, match=rf"bf16\.{key}=True is not supported.*fp32"):
            _load(bf16={"enabled": True, key: True})


def test_zero_performance_switches_of_deepspeed_are_accepted():
    # each was "unknown config key 'zero_optimization.<key>'"; DeepSpeed reads them all
    switches = {"use_multi_rank_bucket_allreduce": False,
                "stage3_module_granularity_threshold": 5000,
                "use_all_reduce_for_fetch_params": True,  # stage3_ alias, either name
                "allgather_sequential": True, "override_module_apply": True,
                "enable_sanity_checks": False, "legacy_stage1": False,
                "cpu_offload_use_pin_memory": None, "mics_shard_size": -1,
                "mics_hierarchical_params_gather": False, "zeropp_loco_param": None}
    checked = _load(zero_optimization={"stage": 3, **switches}).checked["zero_optimization"]
    assert checked["stage3_module_granularity_threshold"] == 5000
    assert checked["stage3_use_all_reduce_for_fetch_params"] is True
    assert checked["stage3_allgather_sequential"] is True
    with pytest.raises(ConfigError, match="both 'allgather_sequential' and "
                                          "'stage3_allgather_sequential'"):
        _load(zero_optimization={"stage": 3, "allgather_sequential": True,
                                 "stage3_allgather_sequential": True})


@pytest.mark.parametrize("key,value", [("mics_shard_size", 8),
                                       ("zeropp_loco_param", {"err_beta": 0.8, "reset_T": 1024}),
                                       ("mics_hierarchical_params_gather", True)])
def test_zero_features_not_provided_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key}=.* is not supported"):
        _load(zero_optimization={"stage": 3, key: value})
