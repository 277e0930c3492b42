"""DeepSpeed-style engine, hunted as a DeepSpeed user.

- ``engine.offload_states()`` on some ranks only (an RLHF script that reloads on rank 0 alone,
  or offloads behind ``if rank == 0``): ``engine.step()`` refused the step on the offloaded
  ranks only, so at stages 1-3 the others waited forever inside the step's collectives, and
  at stage 0 they stepped alone. Now every rank refuses, naming the offloaded ranks, before
  any collective; ``engine.optimizer.step()`` called by the script too.

One world of 2 gloo ranks for the module.
"""

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _engine(stage: int, **extra):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, **extra}
    engine, *_ = shardkit.initialize(model=_model(), config=config)
    return engine


def _backward(engine, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + distributed.get_rank())
    engine.backward(engine(torch.randn(2, 8, generator=gen)).pow(2).mean())


# ----------------------------------------------------------------------------- offload states


def _error(call) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _offload_on_rank0_only(stage: int) -> dict:
    engine = _engine(stage, gradient_clipping=1.0)
    _backward(engine, 0)
    engine.step()
    if distributed.get_rank() == 0:
        engine.offload_states()
    _backward(engine, 1)
    before = [p.detach().clone() for p in engine.module.parameters()]
    refused = _error(engine.step)
    direct = _error(engine.optimizer.step)  # the script's own step (nanoGPT's loop)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.reload_states()  # a no-op on rank 1: nothing was offloaded there
    engine.step()  # the refused step, now on every rank
    return {"refused": refused, "direct": direct, "unchanged": unchanged,
            "steps": engine.global_steps,
            "params": [p.detach().clone() for p in engine.module.parameters()]}


@pytest.mark.parametrize("stage", [0, 2])
def test_step_is_refused_on_every_rank_when_one_rank_offloaded(world2, stage):
    # was: stage 2: rank 1 hung inside the step's collectives; stage 0: rank 1 stepped alone
    outs = world2.run(_offload_on_rank0_only, stage)
    for out in outs:
        for text, call in ((out["refused"], "engine.step()"),
                           (out["direct"], "engine.optimizer.step()")):
            assert text.startswith(f"{call}: the optimizer state was moved off the device by "
                                   f"engine.offload_states() on rank(s) [0]"), text
        assert out["unchanged"] and out["steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(outs[0]["params"], outs[1]["params"]))


# ----------------------------------------------------------------------------- config source


def test_missing_config_file_from_args_names_the_command_line_flag(tmp_path):
    # was: "config='.../ds_confg.json': no such file": the script passed no config=, only
    # --deepspeed_config (DeepSpeed's args.deepspeed_config)
    from types import SimpleNamespace
    from shardkit.config import ConfigError
    missing = str(tmp_path / "ds_confg.json")
    with pytest.raises(ConfigError) as error:
        shardkit.initialize(args=SimpleNamespace(deepspeed_config=missing), model=_model())
    assert str(error.value).startswith(
        f"initialize: args.deepspeed_config={missing!r} (--deepspeed_config): no such file")
