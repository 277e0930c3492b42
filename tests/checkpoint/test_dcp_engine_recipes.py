"""Review of the dcp-over-engine checkpoint path, and asynchronous saves at the end of a script.

- ``get_state_dict(engine, engine.optimizer)`` over a fresh engine with gradient accumulation
  whose optimizer is a subclass with its own ``step`` (calling ``super().step()``): the zero-lr
  step that makes the optimizer's state runs none of its step hooks (the engine's guard, a
  user's global and per-instance ones), which all run on the real steps afterwards;
- ``set_state_dict(..., broadcast_from_rank0=True)`` over an engine at stage 0 (torch's
  functions serve it), with rank 0's full state dicts and ``{}`` elsewhere, resumes exactly;
- torch's dcp recipe over a model with tensor-parallel layers split over several ranks is
  refused on every rank (each rank's slice came under the same name: dcp wrote one rank's);
- an asynchronous ``engine.save_checkpoint`` followed by the usual last line: with
  ``shardkit.distributed.destroy()`` the save is published (or its failure raised, exit status
  1); with ``torch.distributed.destroy_process_group()`` it cannot finish, and leaves no hidden
  full-size staging directory behind.

One world of 2 gloo ranks for the first two; the last starts 2-rank jobs as plain processes.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

import shardkit
from shardkit import distributed
from shardkit.testing import free_port, world_fixture

world2 = world_fixture(2, timeout=90)


class _AdamWWithOwnStep(torch.optim.AdamW):
    """A user's optimizer class whose ``step`` adds to AdamW's (counts its calls)."""

    def step(self, closure=None):
        self.own_steps = getattr(self, "own_steps", 0) + 1
        return super().step(closure)


def _fresh_engine_state_without_hooks() -> dict:
    from shardkit.checkpoint import get_state_dict
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # AdamW's own step is hook-wrapped too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = _AdamWWithOwnStep(model.parameters(), lr=1e-2)
    engine, *_ = shardkit.initialize(
        model=model, optimizer=optimizer,
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 0}, "steps_per_print": 10000})
    calls = {"global pre": 0, "global post": 0, "own pre": 0, "own post": 0}

    def counting(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    handles = [register_optimizer_step_pre_hook(counting("global pre")),
               register_optimizer_step_post_hook(counting("global post")),
               optimizer.register_step_pre_hook(counting("own pre")),
               optimizer.register_step_post_hook(counting("own post"))]
    try:
        _, osd = get_state_dict(engine, engine.optimizer)  # a fresh optimizer: state made here
        during = dict(calls)
        state_keys = sorted(osd["state"])
        weights = [p.detach().clone() for p in model.parameters()]
        unchanged = all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
        for _ in range(2):  # one real step: two micro-batches
            engine.backward(F.mse_loss(engine(torch.randn(2, 4)), torch.randn(2, 2)))
            engine.step()
    finally:
        for handle in handles:
            handle.remove()
    return {"during": during, "after": dict(calls), "keys": state_keys, "unchanged": unchanged,
            "own_steps": optimizer.own_steps}


def test_optimizer_state_for_dcp_runs_no_step_hook_of_a_subclass_step(world2):
    # Before: the subclass's super().step() went through AdamW's hook-running wrapper, so the
    # engine's guard refused the setup step ("engine.optimizer.step() was called directly with
    # gradient_accumulation_steps=2") and user hooks counted it.
    for got in world2.run(_fresh_engine_state_without_hooks):
        assert got["during"] == dict.fromkeys(got["during"], 0), got
        assert got["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"] and got["unchanged"]
        # torch runs each hook twice a step for such a subclass (its wrapper and AdamW's)
        assert got["after"] == dict.fromkeys(got["after"], 2) and got["own_steps"] == 2, got


def _stage0_engine(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    engine, *_ = shardkit.initialize(
        model=model, model_parameters=model.parameters(),
        lr_scheduler=lambda optim: torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5),
        config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 0}, "steps_per_print": 10000,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
    return engine


def _train_one_step(engine, step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step + 10 * distributed.get_rank())
    for _ in range(2):
        engine.backward(F.mse_loss(engine(torch.randn(2, 4, generator=gen)),
                                   torch.randn(2, 2, generator=gen)))
        engine.step()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _broadcast_from_rank0_resumes() -> list:
    import copy

    from shardkit.checkpoint import StateDictOptions, get_state_dict, set_state_dict
    engine = _stage0_engine(0)
    _train_one_step(engine, 0)
    msd, osd = get_state_dict(engine, engine.optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    msd, osd = copy.deepcopy((msd, osd))  # as read from a file: no tensor shared with engine
    sizes = (len(msd), len(osd))
    resumed = _stage0_engine(7)
    set_state_dict(resumed, resumed.optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    want, got = _train_one_step(engine, 1), _train_one_step(resumed, 1)
    return [sizes] + [(got[k] - want[k]).abs().max().item() for k in want]


def test_broadcast_from_rank0_over_a_stage0_engine(world2):
    # Before: torch's set_state_dict took the empty model_state_dict of rank 1 for "optimizer
    # only" and skipped the model there, while rank 0 broadcast the model's tensors: a hang.
    results = world2.run(_broadcast_from_rank0_resumes)
    assert results[0][0] == (4, 2) and results[1][0] == (0, 0), results
    assert [got[1:] for got in results] == [[0.0] * 4] * 2, results


def _tensor_parallel_engine_refused() -> list:
    from shardkit.checkpoint import StateDictOptions, get_state_dict, set_state_dict
    from shardkit.nn import model_parallel as mp
    mp.initialize_model_parallel(2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(mp.ColumnParallelLinear(4, 6, gather_output=False), nn.Tanh(),
                              mp.RowParallelLinear(6, 2, input_is_parallel=True))
        engine, *_ = shardkit.initialize(
            model=model, model_parameters=model.parameters(), mpu=mp.initialize,
            config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
                    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})
        errors = []
        for call in (lambda: get_state_dict(engine, engine.optimizer),
                     lambda: get_state_dict(model, engine.optimizer,
                                            options=StateDictOptions(full_state_dict=True)),
                     lambda: set_state_dict(engine, engine.optimizer, model_state_dict={},
                                            optim_state_dict={})):
            try:
                call()
                errors.append("accepted")
            except ValueError as error:
                errors.append(str(error))
        return errors
    finally:
        mp.destroy_model_parallel()


def test_dcp_recipe_refuses_tensor_parallel_slices(world2):
    # Before: each rank's (3, 4) slice of "0.weight" came as a plain tensor under that name;
    # dcp.save wrote rank 0's and dcp.load put it into rank 1's slice too, silently.
    for errors in world2.run(_tensor_parallel_engine_refused):
        for error in errors:
            assert "tensor-parallel layers split over 2 ranks (['0', '2'])" in error, error
            assert "engine.save_checkpoint" in error, error


SCRIPT = r'''
import sys
import torch
import torch.distributed as dist
import torch.nn as nn
import shardkit
from shardkit import distributed

save_dir, last_line = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8))
engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
engine.backward(engine(torch.randn(2, 64)).sum())
engine.step()
engine.save_checkpoint(save_dir, tag="last", async_save=True)
if last_line == "shardkit":
    distributed.destroy()
else:
    dist.destroy_process_group()
'''


def _run_job(tmp_path, save_dir: str, last_line: str) -> tuple:
    """A 2-rank job of SCRIPT (plain processes, rank 0 hosting the store): (exit statuses,
    stderr of both)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), save_dir, last_line],
                              env=dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                       OMP_NUM_THREADS="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        errors = [proc.communicate(timeout=120)[1] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return [proc.returncode for proc in procs], "".join(errors)


@pytest.mark.parametrize("last_line", ["shardkit", "torch"])
def test_async_save_at_the_end_of_a_script(tmp_path, last_line):
    # Before: either last line destroyed the process groups under the background commit; the
    # failure was only printed at exit (status 0), no 'latest', a full-size DIR/.tmp-last left.
    save_dir = str(tmp_path / "ckpt")
    codes, errors = _run_job(tmp_path, save_dir, last_line)
    listing = sorted(os.listdir(save_dir))
    # shardkit's destroy() and, since the checkpoint hunt of session 60, torch's own
    # destroy_process_group() wait for the save: published
    assert codes == [0, 0] and "failed" not in errors, errors[-3000:]
    assert {"last", "latest"} <= set(listing), listing
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "last"
    # a save that fails in the background: the teardown raises it (exit status 1)
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    codes, errors = _run_job(tmp_path, str(not_a_dir), last_line)
    assert codes == [1, 1] and errors.count("CheckpointError") >= 2, errors[-3000:]
