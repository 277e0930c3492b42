"""Review of the engine's RLHF memory calls (``offload_states`` / ``reload_states``) and of
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
import gc
import pickle
import weakref

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.config import load_config
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


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


def _train(engine, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(100 * step + distributed.get_rank())
        engine.backward(engine(torch.randn(2, 8, generator=gen)).pow(2).mean())
        engine.step()


def _device_state_refs(optimizer) -> list:
    """Weak references to each state tensor and to the buffer it views into, if any."""
    tensors = [v for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1]
    return [weakref.ref(t) for t in tensors] + \
        [weakref.ref(t._base) for t in tensors if t._base is not None]


def _offload_with_fused_adam(stage: int) -> dict:
    import shardkit.engine as engine_module

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
