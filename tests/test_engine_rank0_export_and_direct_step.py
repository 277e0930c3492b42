"""DeepSpeed-style engine: ``save_16bit_model`` on rank 0 alone, and one control exchange for a
script's own ``engine.optimizer.step()``.

``if rank == 0: engine.save_16bit_model(dir)`` is how many DeepSpeed scripts export the model
(at ZeRO stages 0-2 DeepSpeed's call makes no collective). Here rank 0 then waited forever in
the broadcast of its write's outcome (gloo: until the timeout), and between backward and step
it met the others' step agreement instead. At stages 0-2 without tensor parallelism the call
now makes no collective: rank 0 writes and posts the outcome on the store, where ranks that
call it too read it (a failure to write still raises on each of them).

A script that calls ``engine.optimizer.step()`` itself at stages 1-2 paid two control
all-gathers a step (the engine's step agreement, then OSS's own on its param groups), where
``engine.step()`` pays one; the engine's agreement now carries OSS's rows for the direct step
too, with the same training.

From a review:

``engine.save_16bit_model`` called on every rank at ZeRO stages 0-2: each rank's call must
report the outcome of rank 0's write for that same call, when the same weights are saved to the
same file again.

Rank 0 posts its outcome on the store and the other ranks read it there. The key named the
engine, its weights version and the file only, so a second save of those before the next step
read the first one's outcome: a retry after a failed write (the directory fixed meanwhile)
raised the old error on rank 1 while rank 0 wrote and went on; a write failing after an earlier
success returned True on rank 1 while rank 0 raised; and new weights loaded with
``load_module_state_dict`` had rank 1 return, and read the file, before rank 0 had written
them. Each rank's n-th call for a file at a weights version now reads rank 0's n-th write.

One world of 2 gloo ranks for the module.
"""

import os
import time

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.testing import CountedControlGathers, world_fixture

world2 = world_fixture(2, timeout=90)

_STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + distributed.get_rank())
    return torch.randn(2, 8, generator=gen)


def _engine(stage: int, precision=None):
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    if precision is not None:
        config[precision] = {"enabled": True}
    return shardkit.initialize(model=_model(), config=config)[0]


def _train_step(engine, step: int, save_before_step=None) -> None:
    engine.backward(engine(_batch(step)).float().pow(2).mean())
    if save_before_step is not None:
        save_before_step()
    engine.step()


def _save_on_rank0_only(stage: int, directory: str) -> dict:
    """Rank 0 alone exports after a step and between a backward and its step; every rank
    trains on. Returns what rank 0 wrote and each rank's weights after each export."""
    engine = _engine(stage, "bf16")
    rank0 = distributed.get_rank() == 0
    after_step = os.path.join(directory, "after_step")
    mid_window = os.path.join(directory, "mid_window")
    _train_step(engine, 0)
    if rank0:
        assert engine.save_16bit_model(after_step)
    weights_after_step = {k: v.clone() for k, v in engine.module_state_dict().items()}
    save_mid_window = (lambda: engine.save_16bit_model(mid_window)) if rank0 else None
    _train_step(engine, 1, save_before_step=save_mid_window)
    _train_step(engine, 2)
    distributed.barrier()
    written = {name: torch.load(os.path.join(directory, name, "pytorch_model.bin"))
               for name in ("after_step", "mid_window")}
    return {"written": written,
            "weights_after_step": weights_after_step,
            "final": {k: v.clone() for k, v in engine.module_state_dict().items()},
            "steps": engine.global_steps}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_save_16bit_model_on_rank0_alone_at_stages_0_to_2(world2, tmp_path, stage):
    # was: rank 0 waited in the outcome's broadcast for ranks that never called (a hang)
    outs = world2.run(_save_on_rank0_only, stage, str(tmp_path))
    for out in outs:
        assert out["steps"] == _STEPS
        written = out["written"]
        for key, value in out["weights_after_step"].items():
            # mid-window: the weights as the step before left them, as after that step
            for name in ("after_step", "mid_window"):
                assert written[name][key].dtype == torch.bfloat16
                assert torch.equal(written[name][key], value.to(torch.bfloat16)), (name, key)
    for key, value in outs[0]["final"].items():  # the ranks trained on alike
        assert torch.equal(value, outs[1]["final"][key]), key
    assert sorted(os.listdir(tmp_path)) == ["after_step", "mid_window"]


def _every_rank_saves_twice(directory: str) -> list:
    """Every rank exports to one file, then to an unwritable place: rank 0's outcome of each
    reaches every rank (the second as an error), at stage 2."""
    engine = _engine(2)
    _train_step(engine, 0)
    outcomes = [engine.save_16bit_model(directory, "model.bin")]
    blocked = os.path.join(directory, "model.bin")  # a file where a directory should be
    try:
        engine.save_16bit_model(os.path.join(blocked, "sub"))
        outcomes.append("no error")
    except RuntimeError as error:
        outcomes.append(str(error))
    outcomes.append(os.path.exists(os.path.join(directory, "model.bin")))
    return outcomes


def test_save_16bit_model_on_every_rank_still_reports_rank0s_outcome(world2, tmp_path):
    for written, failure, present in world2.run(_every_rank_saves_twice, str(tmp_path)):
        assert written is True and present  # written by rank 0 before any rank returned
        assert failure.startswith("engine.save_16bit_model: rank 0 could not write"), failure


def _direct_steps_saving_each(directory: str) -> list:
    """A loop of the script's own ``loss.backward()`` and ``engine.optimizer.step()`` that
    exports to one file after each step, every rank calling, rank 0 late to the call: each
    rank then reads the file back. Whether it held the weights of that step, per step."""
    engine = _engine(1)
    current = []
    for step in range(_STEPS):
        engine(_batch(step)).pow(2).mean().backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        if distributed.get_rank() == 0:
            time.sleep(0.3)  # the others reach the save first
        engine.save_16bit_model(directory)
        written = torch.load(os.path.join(directory, "pytorch_model.bin"))
        current.append(all(torch.equal(written[k], v)
                           for k, v in engine.module_state_dict().items()))
        distributed.barrier()  # every rank has read it before rank 0 replaces it
    return current


def test_save_16bit_model_outcome_is_of_this_save(world2, tmp_path):
    # every rank returns only once rank 0 has written these weights, not on the outcome
    # rank 0 posted for the same file one step earlier
    for current in world2.run(_direct_steps_saving_each, str(tmp_path)):
        assert current == [True] * _STEPS, current


def _train_with(stage: int, direct: bool) -> dict:
    """``_STEPS`` steps through the script's own ``loss.backward()`` and
    ``engine.optimizer.step()`` (``direct``), or through the engine's; the control gathers
    of each step and the final weights."""
    engine = _engine(stage)
    optimizer = engine.optimizer
    gathers = []
    for step in range(_STEPS):
        with CountedControlGathers() as counted:
            loss = engine(_batch(step)).pow(2).mean()
            if direct:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            else:
                engine.backward(loss)
                engine.step()
        # (at stage 2, ShardedDataParallel's own agreement on the trainable set is not counted)
        gathers.append([n for n in counted.names if not n.startswith("ShardedDataParallel")])
    return {"gathers": gathers, "weights": [p.detach().clone() for p in engine.parameters()]}


@pytest.mark.parametrize("stage", [1, 2])
def test_direct_optimizer_step_makes_one_control_exchange(world2, stage):
    # was: ["engine.optimizer.step()", "OSS.step's agreement"] every step
    direct = world2.run(_train_with, stage, True)
    through_engine = world2.run(_train_with, stage, False)
    for out, reference in zip(direct, through_engine):
        assert out["gathers"] == [["engine.optimizer.step()"]] * _STEPS, out["gathers"]
        for a, b in zip(out["weights"], reference["weights"]):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def _engine_rev():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    return shardkit.initialize(model=model, config=config)[0]


def _outcome(save) -> str:
    try:
        save()
        return "written"
    except RuntimeError as error:
        return str(error).split(":")[1].strip()  # "rank 0 could not write <path>"


def _on_rank0(action) -> None:
    """``action`` on rank 0 while the others wait (a barrier either side)."""
    distributed.barrier()
    if distributed.get_rank() == 0:
        action()
    distributed.barrier()


def _save_the_same_weights_again(directory: str) -> dict:
    """Every rank saves the same weights to the same file twice, with the filesystem changed
    on rank 0 in between, and (``reloaded``) after new weights were loaded, rank 0 late."""
    engine = _engine_rev()
    retried = os.path.join(directory, "retried")  # a file first: the write fails, then fixed
    _on_rank0(lambda: open(retried, "w").close())
    retry = [_outcome(lambda: engine.save_16bit_model(retried))]
    _on_rank0(lambda: os.remove(retried))
    retry.append(_outcome(lambda: engine.save_16bit_model(retried)))

    blocked = os.path.join(directory, "blocked")  # written, then made a file: the write fails
    block = [_outcome(lambda: engine.save_16bit_model(blocked))]
    _on_rank0(lambda: (os.remove(os.path.join(blocked, "pytorch_model.bin")),
                       os.rmdir(blocked), open(blocked, "w").close()))
    block.append(_outcome(lambda: engine.save_16bit_model(blocked)))

    reloaded = os.path.join(directory, "reloaded")
    engine.save_16bit_model(reloaded)
    distributed.barrier()
    engine.load_module_state_dict(
        {"module": {k: v + 1 for k, v in engine.module_state_dict().items()}})
    if distributed.get_rank() == 0:
        time.sleep(0.5)  # the others reach the save first
    engine.save_16bit_model(reloaded)
    written = torch.load(os.path.join(reloaded, "pytorch_model.bin"))
    distributed.barrier()  # every rank has read the file

    # a directory named on each rank (a time stamp): rank 0's outcome, read at once
    stamped = os.path.join(directory, f"stamp{distributed.get_rank()}")
    stamp = _outcome(lambda: engine.save_16bit_model(stamped))
    distributed.barrier()
    return {"retry": retry, "block": block, "stamp": stamp,
            "reloaded": all(torch.equal(written[k], v)
                            for k, v in engine.module_state_dict().items())}


def test_each_save_of_the_same_file_reports_its_own_write(world2, tmp_path):
    outs = world2.run(_save_the_same_weights_again, str(tmp_path))
    for rank, out in enumerate(outs):
        # was on rank 1: the first call's outcome again (an error, then True), and new
        # weights read back before rank 0 had written them
        assert out["retry"] == [
            f"rank 0 could not write {tmp_path}/retried/pytorch_model.bin", "written"], rank
        assert out["block"] == [
            "written", f"rank 0 could not write {tmp_path}/blocked/pytorch_model.bin"], rank
        assert out["reloaded"], rank
        assert out["stamp"] == "written", rank  # was (path in the key): waited the timeout
    assert os.path.exists(tmp_path / "stamp0" / "pytorch_model.bin")
