"""Review of the checkpoint owner markers (review 61), as a user meets the gaps:

- two asynchronous saves of one process in flight at once (two engines, e.g. an actor and a
  critic, each saving its own tag into one directory): the second save's cleanup of what
  killed saves left removed the first one's staging directory while it was being created
  under its private name (``.tmp-TAG.new-XXXX``, this process's marker, or none yet), and the
  first save failed; at a world of 2 the two writer threads' commits also interleaved their
  collectives on the one checkpoint group, in a different order on each rank (a hang).

A world of 2 gloo ranks and local checks.
"""

import json
import os
import subprocess
import time
import warnings

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed as skdist
from shardkit.checkpoint import async_save, save_owner, sharded
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90)

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/ns"), reason="Linux /proc")


def _dir_with_marker(path: str, owner) -> None:
    os.makedirs(path)
    if owner is not None:
        with open(os.path.join(path, save_owner.OWNER_FILE), "w") as f:
            json.dump(owner, f)


def _dead_owner() -> dict:
    process = subprocess.Popen(["sleep", "30"])
    owner = dict(save_owner.this_process(), pid=process.pid,
                 start_ticks=save_owner._start_ticks(process.pid))
    process.kill()
    process.wait()
    return owner


@needs_proc
def test_cleanup_keeps_staging_directories_being_created(tmp_path):
    """Directories :func:`create_owned_dir` is building under their private names (this
    process's, holding its marker; another process's, before its marker is written) are not
    what a killed save left; one whose owner ended is."""
    save_dir = str(tmp_path)
    mine = os.path.join(save_dir, ".tmp-a.new-0123456789ab")
    unmarked = os.path.join(save_dir, ".tmp-b.new-0123456789ab")
    dead = os.path.join(save_dir, ".tmp-c.new-0123456789ab")
    _dir_with_marker(mine, save_owner.this_process())
    _dir_with_marker(unmarked, None)
    _dir_with_marker(dead, _dead_owner())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded._make_staging(save_dir, os.path.join(save_dir, ".tmp-new"), True)
    assert sorted(os.listdir(save_dir)) == [".tmp-a.new-0123456789ab",
                                            ".tmp-b.new-0123456789ab", ".tmp-new"]
    assert any("removed .tmp-c.new-0123456789ab" in str(w.message) for w in caught)


def test_async_saves_of_one_process_write_one_after_the_other():
    """A save started while another is under way writes (and commits) once that one ended, so
    both issue their collectives in the same order on every rank."""
    spans = {}

    def write(name, seconds):
        def run():
            start = time.monotonic()
            time.sleep(seconds)
            spans[name] = (start, time.monotonic())
            return name
        return run

    first = async_save.AsyncSave("/nowhere/a", write("a", 0.3))
    second = async_save.AsyncSave("/nowhere/b", write("b", 0.0))
    assert async_save.wait_for_pending_saves(timeout_s=20) == ["/nowhere/a", "/nowhere/b"]
    assert first.done() and second.done()
    assert spans["b"][0] >= spans["a"][1], spans


def _engine(stage: int, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    return shardkit.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage}})[0]


def _train_step(engine, seed: int) -> None:
    torch.manual_seed(seed + skdist.get_rank())
    engine.backward(engine(torch.randn(2, 6)).pow(2).mean())
    engine.step()


def _outputs(engine) -> torch.Tensor:
    torch.manual_seed(123)
    with torch.no_grad():
        return engine(torch.randn(4, 6))


def _two_engines_save_async(save_dir: str) -> dict:
    """Two engines save tags ``actor`` and ``critic`` asynchronously into one directory, both
    in flight at once; then fresh engines load them back."""
    actor, critic = _engine(1, 0), _engine(2, 1)
    _train_step(actor, 10)
    _train_step(critic, 20)
    actor.save_checkpoint(save_dir, tag="actor", async_save=True)
    critic.save_checkpoint(save_dir, tag="critic", async_save=True)
    actor.wait_for_checkpoint()
    critic.wait_for_checkpoint()
    skdist.barrier()
    reloaded = {}
    for tag, stage, engine in (("actor", 1, actor), ("critic", 2, critic)):
        fresh = _engine(stage, 7)
        fresh.load_checkpoint(save_dir, tag=tag)
        reloaded[tag] = torch.equal(_outputs(fresh), _outputs(engine))
    return {"listing": sorted(os.listdir(save_dir)), "reloaded": reloaded}


def test_two_engines_saving_asynchronously_at_once(world2, tmp_path):
    for result in world2.run(_two_engines_save_async, str(tmp_path / "ckpt")):
        assert result["listing"] == ["actor", "critic", "latest", "zero_to_fp32.py"], result
        assert result["reloaded"] == {"actor": True, "critic": True}, result
