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

From a review:

DeepSpeed-style engine: the step owed by a backward survives a checkpoint save or load, and
a gather of the full weights joins the step agreement (review of 0532024).

A script that saves (or loads) between ``engine.backward`` and ``engine.step()`` on every rank
settled the step agreement there, and the save forgot that the backward was still owed its
step: when one rank then skipped its step on its own (a check of its loss) and went on to its
next forward while the others stepped, nothing met the stepping ranks' agreement; gloo aborted
the process (NCCL waits forever), where before 0532024 both sides raised at that forward.
``engine._zero3_consolidated_16bit_state_dict()`` (what Hugging Face Accelerate calls at stage
3) and ``engine.module_state_dict()`` gather the weights at stage 3 without joining the
agreement, with the same result after a step taken on some ranks only.

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


def _loss_rev(engine, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(10 * step + distributed.get_rank())
    return engine(torch.randn(2, 4, generator=gen)).float().pow(2).mean()


def _full_weights(engine) -> list:
    return [v.float().clone() for v in engine.module_state_dict().values()]


class _ControlGathers:
    """Counts the step agreement's gathers (control messages CommCounter leaves out)."""

    def __enter__(self):
        self.calls, self._real = [], distributed.gather_control_rows

        def counted(what, row, group=None, **kwargs):
            if not what.startswith("ShardedDataParallel"):  # its own trainable-set agreement
                self.calls.append(what)
            return self._real(what, row, group, **kwargs)
        distributed.gather_control_rows = counted
        return self

    def __exit__(self, *exc):
        distributed.gather_control_rows = self._real


def _mid_window(engine, call: str, directory: str) -> None:
    if call == "save_checkpoint":
        engine.save_checkpoint(os.path.join(directory, "mid"))
    elif call == "load_checkpoint":
        engine.load_checkpoint(os.path.join(directory, "start"))
    else:
        engine.save_16bit_model(os.path.join(directory, "mid16"))


def _local_skip_after_a_mid_window_call(stage: int, call: str, directory: str) -> dict:
    """Every rank runs a backward and ``call`` before stepping (they agree there and go on);
    then rank 0 skips its step on its own and goes on to its next forward, while rank 1
    steps. Then every rank steps."""
    engine = _fp16_engine(stage)
    engine.backward(_loss_rev(engine, 0))
    engine.step()
    engine.save_checkpoint(os.path.join(directory, "start"))
    engine.backward(_loss_rev(engine, 1))
    _mid_window(engine, call, directory)
    if distributed.get_rank() == 0:
        error = _outcome(lambda: engine.backward(_loss_rev(engine, 2)))
    else:
        error = _outcome(engine.step)
    distributed.barrier()
    engine.step()  # now on every rank
    return {"error": error, "steps": engine.global_steps, "weights": _full_weights(engine)}


@pytest.mark.parametrize("stage,call", [(0, "save_checkpoint"), (2, "load_checkpoint"),
                                        (3, "save_16bit_model")])
def test_a_mid_window_save_or_load_keeps_the_step_owed(world2, tmp_path, stage, call):
    # was: the save settled the agreement for good; rank 0's forward did not join rank 1's
    # step agreement and gloo aborted the ranks
    outs = world2.run(_local_skip_after_a_mid_window_call, stage, call, str(tmp_path))
    assert outs[0]["error"].startswith("engine forward: rank(s) [1] are stepping"), outs[0]
    assert outs[1]["error"].startswith("engine.step(): rank(s) [1] are stepping"), outs[1]
    for out in outs:
        assert "rank(s) [0] went on without stepping" in out["error"], out["error"]
        assert out["steps"] == 2, out  # the refused step was not taken, the later one was
    for a, b in zip(outs[0]["weights"], outs[1]["weights"]):
        assert torch.equal(a, b)


def _gather_of_the_weights_after_a_local_skip(how: str, directory: str) -> dict:
    """Stage 3: rank 0 gathers the full weights instead of stepping, rank 1 steps; then
    every rank steps and gathers (no agreement owed: no control gather)."""
    engine = _fp16_engine(3)
    engine.backward(_loss_rev(engine, 0))
    gather = getattr(engine, how)
    error = _outcome(gather) if distributed.get_rank() == 0 else _outcome(engine.step)
    distributed.barrier()
    engine.step()
    engine.backward(_loss_rev(engine, 1))
    engine.step()
    with _ControlGathers() as control:
        state = engine._zero3_consolidated_16bit_state_dict()
        engine.save_16bit_model(directory)
        engine.save_checkpoint(directory)
        full = engine.module_state_dict()
    return {"error": error, "control": control.calls, "state": state,
            "full": {k: v.clone() for k, v in full.items()}}


@pytest.mark.parametrize("how", ["_zero3_consolidated_16bit_state_dict", "module_state_dict"])
def test_a_stage3_gather_of_the_weights_joins_the_step_agreement(world2, tmp_path, how):
    # was: rank 0's gather met rank 1's step agreement: a hang (gloo: until the timeout)
    outs = world2.run(_gather_of_the_weights_after_a_local_skip, how, str(tmp_path))
    assert outs[0]["error"].startswith(f"engine.{how}(): rank(s) [1] are stepping"), outs[0]
    assert outs[1]["error"].startswith("engine.step(): rank(s) [1] are stepping"), outs[1]
    assert "or a gather of the full weights" in outs[0]["error"]
    for out in outs:
        assert out["control"] == [], out["control"]  # nothing owed: no agreement on saves
    assert outs[1]["state"] is None and set(outs[0]["state"]) == set(outs[0]["full"])
    for key, value in outs[0]["state"].items():
        assert value.dtype == torch.float16
        assert torch.equal(value, outs[0]["full"][key].half())
        assert torch.equal(outs[0]["full"][key], outs[1]["full"][key])
