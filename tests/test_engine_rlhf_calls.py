"""DeepSpeed engine calls RLHF and Hugging Face scripts make between training and generation,
and DeepSpeed's cosine schedule when training is shorter than its warm-up.

- ``engine.empty_partition_cache()`` (DeepSpeed-Chat after generation): stage 3 frees the units
  a generation left gathered; stages 0-2 hold none.
- ``engine.offload_states(...)`` / ``engine.reload_states()``: the optimizer state moves to host
  memory and back, training afterwards matches training that never offloaded, ``step()`` in
  between is refused, and the states shardkit does not hold are refused by name.
- ``WarmupCosineLR`` with ``total_num_steps < warmup_num_steps``: DeepSpeed warns and runs the
  full warm-up, then holds ``cos_min_ratio``; shardkit refused it (constructor and config).
- ``zero_optimization``'s bucket sizes and stage-3 thresholds given as ``"auto"`` (OpenRLHF's
  configs): DeepSpeed takes its defaults; shardkit refused the config.

Its review found:

Review of the engine's RLHF memory calls (``offload_states`` / ``reload_states``) and of
``engine.config`` read as DeepSpeed's dict.

- ``offload_states()`` with DeepSpeed's ``FusedAdam`` (shardkit's ``FusedAdamW``, OpenRLHF's
  optimizer), alone at stage 3 or inside OSS at stages 1-2: its ``state[p]`` tensors are views
  into flat buffers, so replacing them by host copies left the buffers, hence the whole
  device state, alive; nothing was freed.
- ``pickle.dumps(engine.optimizer)`` of an optimizer whose ``__getstate__`` keeps its
  ``__dict__``: the ``offload_states`` / ``reload_states`` set on it were closures, which do
  not pickle; and ``engine.optimizer.step()`` between the two calls was not refused (only
  ``engine.step()`` was).
- ``for key in engine.config`` / ``dict(engine.config)``: DeepSpeed's ``engine.config`` is a
  dict; shardkit's ``__getitem__`` without ``__iter__`` made both a bare ``KeyError: 0``.

One world of 2 gloo ranks for the module.
"""

import copy
import enum
import gc
import math
import pickle
import weakref

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError, load_config
from shardkit.optim.lr_scheduler import WarmupCosineLR
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), _Block(), _Block(), nn.Linear(16, 2))


def _engine(stage: int, optimizer: bool = True):
    from shardkit.nn.wrap import transformer_auto_wrap_policy
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    if optimizer:
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.01}}
    policy = transformer_auto_wrap_policy({_Block}) if stage == 3 else None
    engine, *_ = shardkit.initialize(model=_model(), config=config, wrap_policy=policy)
    return engine


def _train(engine, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + distributed.get_rank())
        engine.backward(engine(torch.randn(2, 8, generator=gen)).pow(2).mean())
        engine.step()


def _live_gathered_bytes() -> int:
    from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
    return gathered_param_bytes().live


# ----------------------------------------------------------------------------- partition cache


def _empty_partition_cache(stage: int) -> dict:
    engine = _engine(stage)
    _train(engine, range(1))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = engine(x)
        start = _live_gathered_bytes()
        engine.module[1].lin(torch.randn(2, 16))  # a direct call (HF generate's encoder)
        held = _live_gathered_bytes() - start
        engine.empty_partition_cache()
        freed = _live_gathered_bytes() - start
        after = engine(x)
    _train(engine, range(1, 2))  # trains on after the cache was emptied
    return {"held": held, "freed": freed, "same": torch.equal(before, after)}


@pytest.mark.parametrize("stage", [1, 3])
def test_empty_partition_cache_frees_the_units_a_generation_gathered(world2, stage):
    # was: AttributeError ('ShardedEngine' object has no attribute 'empty_partition_cache')
    for out in world2.run(_empty_partition_cache, stage):
        assert out["freed"] == 0 and out["same"]
        if stage == 3:  # the direct call gathered its unit; stages 0-2 hold no gathered copy
            assert out["held"] > 0


# ----------------------------------------------------------------------------- offload states


class _OffloadStateTypeEnum(str, enum.Enum):  # DeepSpeed's enums are str Enums like these
    optim_states = "optim_states"
    contiguous_grad_buffer = "contiguous_grad_buffer"
    hp_params = "hp_params"


class _OffloadDeviceEnum(str, enum.Enum):
    cpu = "cpu"


def _state_tensors(engine) -> dict:
    return {(i, k): v.clone() for i, s in enumerate(engine.optimizer.state.values())
            for k, v in s.items() if isinstance(v, torch.Tensor)}


def _offload_round_trip(stage: int, save_dir: str) -> dict:
    offloaded, plain = _engine(stage), _engine(stage)
    _train(offloaded, range(2))
    _train(plain, range(2))
    saved = _state_tensors(offloaded)
    offloaded.offload_states(include=[_OffloadStateTypeEnum.optim_states], pin_memory=False)
    offloaded.offload_states()  # twice: nothing moves twice
    with torch.no_grad():  # generation runs while the optimizer state is away
        offloaded(torch.randn(2, 8))
    offloaded.save_checkpoint(save_dir)  # a checkpoint of the offloaded state
    refused = None
    try:
        offloaded.step()
    except RuntimeError as error:
        refused = str(error)
    where = {str(v.device) for v in _state_tensors(offloaded).values()}
    offloaded.reload_states()
    kept = all(torch.equal(saved[key], value)
               for key, value in _state_tensors(offloaded).items())
    resumed = _engine(stage)
    resumed.load_checkpoint(save_dir)
    for engine in (offloaded, plain, resumed):
        _train(engine, range(2, 4))
    same = all(torch.equal(a, b) and torch.equal(a, c)
               for a, b, c in zip(offloaded.module_state_dict().values(),
                                  plain.module_state_dict().values(),
                                  resumed.module_state_dict().values()))
    return {"refused": refused, "where": where, "kept": kept, "same": same,
            "count": len(saved)}


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_and_reload_states_keep_training_identical(world2, tmp_path, stage):
    # was: AttributeError (no offload_states / reload_states on the engine)
    for out in world2.run(_offload_round_trip, stage, str(tmp_path)):
        assert out["count"] > 0 and out["where"] == {"cpu"}
        assert "reload_states()" in out["refused"]
        assert out["kept"] and out["same"]


def _offload_refusals() -> dict:
    engine = _engine(2)
    _train(engine, range(1))
    out = {}
    for label, kwargs in {"unknown": {"include": ["adam_moments"]},
                          "a string": {"include": "optim_states"},
                          "nvme": {"device": "nvme"}, "cuda": {"device": "cuda"},
                          "pin": {"pin_memory": "yes"}}.items():
        with pytest.raises(ValueError) as error:
            engine.offload_states(**kwargs)
        out[label] = str(error.value)
    engine.offload_states(device="none")  # DeepSpeed warns and moves nothing
    engine.offload_states(include=[])  # nothing asked for
    _train(engine, range(1, 2))  # so stepping is still allowed
    fresh = _engine(1)  # no optimizer state yet on any rank: step() is refused all the same
    fresh.offload_states()
    with pytest.raises(RuntimeError, match="reload_states"):
        _train(fresh, range(1))
    fresh.reload_states()
    _train(fresh, range(1))
    with pytest.raises(RuntimeError) as error:
        _engine(3, optimizer=False).offload_states()
    out["no optimizer"] = str(error.value)
    return out


def _openrlhf_sleep(stage: int) -> dict:
    """OpenRLHF's sleep mode: read the config, offload through the optimizer, empty the
    partition cache, reload through the engine."""
    engine = _engine(stage)
    _train(engine, range(1))
    plain = _engine(stage)
    _train(plain, range(1))
    adam_offload = engine.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    engine.optimizer.offload_states(
        include=[_OffloadStateTypeEnum.optim_states, _OffloadStateTypeEnum.contiguous_grad_buffer,
                 _OffloadStateTypeEnum.hp_params],
        device=_OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
    engine.empty_partition_cache()
    refused = False
    try:
        engine.step()
    except RuntimeError:
        refused = True
    engine.reload_states(non_blocking=True)
    for e in (engine, plain):
        _train(e, range(1, 3))
    same = all(torch.equal(a, b) for a, b in zip(engine.module_state_dict().values(),
                                                 plain.module_state_dict().values()))
    return {"adam_offload": adam_offload, "refused": refused, "same": same}


@pytest.mark.parametrize("stage", [2, 3])
def test_openrlhf_sleep_mode_runs(world2, stage):
    # was: TypeError ('EngineConfig' object is not subscriptable), then AttributeError (no
    # offload_states on the optimizer)
    for out in world2.run(_openrlhf_sleep, stage):
        assert out == {"adam_offload": False, "refused": True, "same": True}


def test_offload_states_refuses_what_it_cannot_move(world2):
    out = world2.run(_offload_refusals)[0]
    assert "unknown state(s) ['adam_moments']" in out["unknown"]
    assert "include='optim_states'" in out["a string"]
    assert "NVMe" in out["nvme"] and "device='cuda'" in out["cuda"]
    assert "pin_memory='yes'" in out["pin"]
    assert "no optimizer" in out["no optimizer"]


# ----------------------------------------------------------------------------- WarmupCosineLR


def _deepspeed_cosine_ratio(i: int, total: int, warmup: int, warmup_min: float,
                            cos_min: float) -> float:
    """DeepSpeed's ``WarmupCosineLR.get_lr_ratio`` (log warm-up), written out."""
    warmup = max(2, warmup)
    if i < warmup:
        return warmup_min + math.log(i + 1) / math.log(warmup) * (1 - warmup_min)
    progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))
    return max(0.0, cos_min + (1 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)


def test_warmup_cosine_lr_shorter_than_its_warmup_runs_as_in_deepspeed(caplog):
    # was: ValueError (constructor) and ConfigError (config) for total_num_steps < warmup
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    with caplog.at_level("WARNING", logger="shardkit"):
        sched = WarmupCosineLR(opt, total_num_steps=5, warmup_num_steps=10,
                               warmup_min_ratio=0.1, cos_min_ratio=0.2)
    assert "total_num_steps 5 is less than warmup_num_steps 10" in caplog.text
    lrs = []
    for _ in range(14):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    expected = [0.5 * _deepspeed_cosine_ratio(i, 5, 10, 0.1, 0.2) for i in range(14)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[-1] == pytest.approx(0.5 * 0.2)
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 5, "warmup_num_steps": 10}}}, 1)
    assert cfg.scheduler.kwargs["total_num_steps"] == 5


# ----------------------------------------------------------------------------- "auto" knobs


def test_zero_tuning_knobs_given_as_auto_take_deepspeeds_defaults():
    # was: ConfigError naming each key. OpenRLHF's get_train_ds_config passes these "auto"
    # values straight to deepspeed.initialize, whose zero_optimization model drops them.
    zero = {"stage": 3, "sub_group_size": "auto", "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto",
            "offload_optimizer": {"device": "none", "pin_memory": True}}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
              "bf16": {"enabled": True}, "gradient_clipping": 1.0}
    cfg = load_config(config, 2)
    assert cfg.zero.stage == 3 and cfg.zero.reduce_bucket_numel is None  # the default
    assert cfg.checked["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e7
    assert any("'reduce_bucket_size'" in note and "DeepSpeed's default" in note
               for note in cfg.warnings)
    assert zero["reduce_bucket_size"] == "auto"  # the caller's dict is left as it was
    # an "auto" that would change what is trained is still refused, by name
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage'"):
        load_config({**config, "zero_optimization": {**zero, "stage": "auto"}}, 2)


def _fused_adam_engine(stage: int):
    from shardkit.nn.wrap import transformer_auto_wrap_policy
    from shardkit.ops.adam import FusedAdam
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _Block(), _Block(), nn.Linear(16, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    policy = transformer_auto_wrap_policy({_Block}) if stage == 3 else None
    engine, *_ = shardkit.initialize(model=model, optimizer=FusedAdam(model.parameters(), lr=0.01),
                                     config=config, wrap_policy=policy)
    return engine


def _device_state_refs(optimizer) -> list:
    """Weak references to each state tensor and to the buffer it views into, if any."""
    tensors = [v for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1]
    return [weakref.ref(t) for t in tensors] + \
        [weakref.ref(t._base) for t in tensors if t._base is not None]


def _offload_with_fused_adam(stage: int) -> dict:
    import shardkit.engine_offload as engine_module

    # a CPU run has no device to leave: copy as a GPU run's device-to-host copy would, so
    # that what keeps the "device" state alive is seen
    to_host = engine_module._to_host
    engine_module._to_host = lambda tensor, pin_memory, non_blocking: tensor.clone()
    try:
        offloaded, plain = _fused_adam_engine(stage), _fused_adam_engine(stage)
        _train(offloaded, range(2))
        _train(plain, range(2))
        refs = _device_state_refs(offloaded.optimizer)
        offloaded.offload_states(include=["optim_states"])
        gc.collect()
        still_alive = sum(ref() is not None for ref in refs)
        offloaded.reload_states()
    finally:
        engine_module._to_host = to_host
    for engine in (offloaded, plain):
        _train(engine, range(2, 4))
    same = all(torch.equal(a, b) for a, b in zip(offloaded.module_state_dict().values(),
                                                 plain.module_state_dict().values()))
    return {"refs": len(refs), "still_alive": still_alive, "same": same}


def test_offload_states_frees_fused_adams_flat_buffers(world2):
    # was: every state view and its flat buffer stayed alive (FusedAdamW._flat held them):
    # offload_states moved the state to the host and freed no device memory
    for stage in (1, 3):
        for out in world2.run(_offload_with_fused_adam, stage):
            assert out["refs"] > 0, (stage, out)
            assert out["still_alive"] == 0 and out["same"], (stage, out)


class _DictStateSGD(torch.optim.SGD):
    """An optimizer that pickles its whole ``__dict__`` (as some third-party ones do)."""

    def __getstate__(self):
        return dict(self.__dict__)


def _copies_of_the_optimizer() -> dict:
    model = nn.Linear(4, 4)
    optimizer = _DictStateSGD(model.parameters(), lr=0.1)
    engine, *_ = shardkit.initialize(model=model, optimizer=optimizer,
                                     config={"train_micro_batch_size_per_gpu": 1})
    out = {}
    for label, copied in (("pickle", pickle.loads(pickle.dumps(engine.optimizer))),
                          ("deepcopy", copy.deepcopy(engine.optimizer))):
        try:  # a copy is not the engine's optimizer: refused, not forwarded to the engine
            copied.offload_states()
        except RuntimeError as error:
            out[label] = str(error)
    engine.optimizer.offload_states()  # the engine's own still forwards
    engine.backward(engine(torch.ones(1, 4)).sum())
    try:  # stepping the optimizer itself is refused as engine.step() is
        engine.optimizer.step()
    except RuntimeError as error:
        out["direct step"] = str(error)
    engine.optimizer.reload_states()
    engine.optimizer.step()
    return out


def test_optimizer_carrying_offload_calls_pickles_and_refuses_its_step(world2):
    # was: AttributeError: Can't pickle local object '_forwarded_to_engine.<locals>.forwarded'
    # and: optimizer.step() between offload_states and reload_states went through (on a GPU
    # torch's AdamW counts the step on its host step tensors, then fails on the moments)
    for out in world2.run(_copies_of_the_optimizer):
        assert set(out) == {"pickle", "deepcopy", "direct step"}, out
        assert "engine.offload_states()" in out["pickle"], out
        assert "engine.offload_states()" in out["deepcopy"], out
        assert "engine.reload_states()" in out["direct step"], out


def test_engine_config_iterates_as_deepspeeds_dict():
    # was: KeyError: 0 (iteration fell back to __getitem__(0)) for list() and dict()
    cfg = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                       "bf16": {"enabled": True}}, 2)
    as_dict = dict(cfg)
    assert list(cfg) == list(as_dict) and "zero_optimization" in as_dict
    assert as_dict["train_batch_size"] == 12 and as_dict["bf16"]["enabled"] is True
    assert dict(cfg.items()) == as_dict and cfg.keys() == cfg.checked.keys()
