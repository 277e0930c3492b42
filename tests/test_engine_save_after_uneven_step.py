"""DeepSpeed-style engine: a step skipped on some ranks, then a checkpoint save or load.

A fp16 script that checks its own loss and skips ``engine.step()`` when it is not finite
(``if not torch.isfinite(loss): continue``) skips on the overflowing rank only; the next
``engine.save_checkpoint(...)`` then met the other ranks' step agreement with the save's own
collectives: gloo aborted the process on a size mismatch (NCCL waits forever), at every
stage. Now a rank that owes a step joins the step agreement at ``save_checkpoint``,
``load_checkpoint`` and ``save_16bit_model`` (as it does at its next forward or backward),
so every rank raises a RuntimeError naming both sides, nothing is written, and once every rank
calls ``engine.step()`` (which skips an overflowed step on every rank itself) the save works.
A save after a backward that every rank leaves unstepped still saves.

One world of 2 gloo ranks for the module.
"""

import os

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _fp16_engine(stage: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "fp16": {"enabled": True, "initial_scale_power": 4},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    return shardkit.initialize(model=model, config=config)[0]


def _loss(engine, step: int, overflow: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + distributed.get_rank())
    x = torch.randn(2, 4, generator=gen)
    loss = engine(x).float().pow(2).mean()
    return loss * float("inf") if overflow else loss


def _outcome(call) -> str:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return "ok"


def _weights(engine) -> list:
    return [p.detach().clone() for p in engine.module.parameters()]


def _collective_after_a_local_skip(stage: int, call: str, directory: str) -> dict:
    """One step everywhere, then rank 0's loss overflows and rank 0 alone skips
    ``engine.step()`` (its script's own check of the loss) and goes on to ``call``, while
    rank 1 steps. Then both step (the overflow skips the update on both) and save."""
    engine = _fp16_engine(stage)
    engine.backward(_loss(engine, 0, overflow=False))
    engine.step()
    loss = _loss(engine, 1, overflow=distributed.get_rank() == 0)
    engine.backward(loss)
    before = _weights(engine)
    if torch.isfinite(loss):
        error = _outcome(engine.step)
    elif call == "save_checkpoint":
        error = _outcome(lambda: engine.save_checkpoint(directory))
    elif call == "load_checkpoint":
        error = _outcome(lambda: engine.load_checkpoint(directory))
    else:
        error = _outcome(lambda: engine.save_16bit_model(directory))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    written = sorted(os.listdir(directory))
    distributed.barrier()  # every rank has looked before any rank saves below
    engine.step()  # now on every rank: the overflow is agreed, the step skipped everywhere
    saved = engine.save_checkpoint(directory, client_state={"seen": 7})
    _, client_state = engine.load_checkpoint(directory)
    return {"error": error, "unchanged": unchanged, "written": written,
            "saved": os.path.basename(saved), "client_state": client_state,
            "applied": engine.was_step_applied(), "skipped": engine.skipped_steps}


@pytest.mark.parametrize("stage,call", [(1, "save_checkpoint"), (2, "save_checkpoint"),
                                        (3, "save_checkpoint"), (0, "load_checkpoint"),
                                        (3, "save_16bit_model")])
def test_a_step_skipped_on_one_rank_then_a_save_is_an_error_on_every_rank(
        world2, tmp_path, stage, call):
    # was: rank 0's save and rank 1's step agreement met; gloo aborted rank 0 (NCCL: a hang)
    outs = world2.run(_collective_after_a_local_skip, stage, call, str(tmp_path))
    texts = [out["error"] for out in outs]
    assert texts[0].startswith(f"engine.{call}(): rank(s) [1] are stepping"), texts
    assert texts[1].startswith("engine.step(): rank(s) [1] are stepping"), texts
    for out in outs:
        assert "rank(s) [0] went on without stepping" in out["error"], out["error"]
        assert "no rank stepped" in out["error"] and "fp16" in out["error"], out["error"]
        assert out["unchanged"] and out["written"] == [], out
        # then every rank steps: the overflow skips the update everywhere; the save works
        assert out["saved"] == "global_step2" and out["client_state"] == {"seen": 7}, out
        assert not out["applied"] and out["skipped"] == 1, out


def _save_after_a_backward_left_unstepped_everywhere(directory: str) -> dict:
    """Every rank runs a backward and saves before stepping (a script saving mid-window):
    the ranks agree at the save and go on; the step after it steps on every rank."""
    engine = _fp16_engine(2)
    engine.backward(_loss(engine, 0, overflow=False))
    saved = engine.save_checkpoint(directory)
    before = _weights(engine)
    engine.step()
    moved = not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    return {"saved": os.path.basename(saved), "moved": moved,
            "weights": [p.detach() for p in engine.module.parameters()]}


def test_a_save_between_backward_and_step_on_every_rank_still_saves(world2, tmp_path):
    outs = world2.run(_save_after_a_backward_left_unstepped_everywhere, str(tmp_path))
    for out in outs:
        assert out["saved"] == "global_step0" and out["moved"], out
    for a, b in zip(outs[0]["weights"], outs[1]["weights"]):
        assert torch.equal(a, b)
