"""Review of the checkpoint changes of d7653e9, as a user meets them:

- torch's ``destroy_process_group(group.WORLD)`` destroys every group, as the no-argument
  call does, but did not wait for the asynchronous save: the save failed under the destroyed
  checkpoint group, the job ended with status 0 and no checkpoint;
- ``torch.distributed.destroy_process_group`` and its ``distributed_c10d`` original became two
  different wrappers, so ``pickle`` refused the function ("not the same object");
- the removal of what killed saves left deleted any directory whose name starts with ``.tmp-``
  or ``.old-`` (a user's ``.tmp-cache`` with their own files), and the staging directory of
  another save of the same process still under way (a synchronous save's, removed by an
  asynchronous save's cleanup; an asynchronous save's, when the other save named the
  directory another way, relative vs absolute): that save then failed.

- a rank left when rank 0 died after publishing (``latest`` already naming the new
  checkpoint) raised a ``CheckpointError`` saying "'latest' still names the previous
  checkpoint".

Two 2-rank jobs as plain processes (they destroy their process group or lose a rank), one
world of 2 ranks.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed as skdist
from shardkit.checkpoint import sharded
from shardkit.testing import World, free_port

SCRIPT = r'''
import os
import pickle
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import shardkit
from shardkit.checkpoint import sharded

save_dir, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
engine.backward(engine(torch.randn(2, 16)).sum())
engine.step()
write, write_latest = sharded._write_rank_file, sharded.write_latest_tag


def slow_write(path, shard):  # the destroy surely comes while the save is under way
    time.sleep(2)
    write(path, shard)


def rank0_dies_once_latest_is_written(directory, tag):
    write_latest(directory, tag)
    if dist.get_rank() == 0:
        os._exit(9)


if mode == "destroy group.WORLD":
    sharded._write_rank_file = slow_write
    engine.save_checkpoint(save_dir, tag="last", async_save=True)
    destroy = pickle.loads(pickle.dumps(dist.destroy_process_group))
    print(f"same function: {destroy is dist.distributed_c10d.destroy_process_group}",
          flush=True)
    destroy(dist.group.WORLD)
else:  # rank 0 dies after publishing, before the last agreement
    engine.save_checkpoint(save_dir, tag="first")
    sharded.write_latest_tag = rank0_dies_once_latest_is_written
    try:
        engine.save_checkpoint(save_dir, tag="last")
    except shardkit.checkpoint.CheckpointError as error:
        print(f"CheckpointError: {error}", flush=True)
        os._exit(3)
'''


def _run_job(tmp_path, save_dir: str, mode: str) -> tuple:
    """A 2-rank job of SCRIPT (plain processes): (exit statuses, stdout, both ranks' output)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), save_dir, mode],
                              env=dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                       OMP_NUM_THREADS="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    report = "".join(out + err for out, err in outputs)[-3000:]
    return [proc.returncode for proc in procs], [out for out, _ in outputs], report


def test_torch_destroy_of_group_world_waits_for_the_async_save(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    codes, outputs, report = _run_job(tmp_path, save_dir, "destroy group.WORLD")
    assert codes == [0, 0], report
    assert all("same function: True" in out for out in outputs), report
    assert "failed" not in report, report
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "last"
    assert os.path.isfile(os.path.join(save_dir, "last", "metadata.json"))


def test_a_rank_left_when_rank_0_died_after_publishing_does_not_deny_it(tmp_path):
    # Before: rank 1 said "'latest' still names the previous checkpoint" while it named "last".
    save_dir = str(tmp_path / "ckpt")
    codes, outputs, report = _run_job(tmp_path, save_dir, "rank 0 dies after publishing")
    assert codes == [9, 3], report
    with open(os.path.join(save_dir, "latest")) as f:
        assert f.read().strip() == "last"
    assert "CheckpointError" in outputs[1] and "may have published it" in outputs[1] \
        and "still names the previous" not in outputs[1], report


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout=120) as w:
        yield w


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}}})
    engine.backward(engine(torch.randn(1, 6)).sum())
    engine.step()
    return engine


def _wait_for_dir(path: str) -> None:
    deadline = time.time() + 20
    while not os.path.isdir(path) and time.time() < deadline:
        time.sleep(0.05)


def _user_dirs_and_saves_under_way_survive_the_cleanup(save_dir: str) -> dict:
    """Rank 0 puts a user's own ``.tmp-cache`` and ``.old-b`` (beside checkpoint "b") and a
    killed save's ``.tmp-x`` into ``save_dir``. Then two engines save into it at once, the
    cleanup of one coming while the other writes into its staging directory: an asynchronous
    save whose cleanup waits for a synchronous one's ``.tmp-c``; a synchronous save while an
    asynchronous one, which named the directory relatively, writes into ``.tmp-d``."""
    first, second = _engine(), _engine()
    second.save_checkpoint(save_dir, tag="b")
    if skdist.get_rank() == 0:
        for name, file in ((".tmp-cache", "notes.txt"), (".old-b", "mine.txt"),
                           (".tmp-x", "rank_00000.pt")):
            os.makedirs(os.path.join(save_dir, name))
            with open(os.path.join(save_dir, name, file), "w") as f:
                f.write("only copy")
    skdist.barrier()
    write, make_staging = sharded._write_rank_file, sharded._make_staging

    def slow_write(path, shard):  # the other save's cleanup comes meanwhile
        if ".tmp-c" in path or ".tmp-d" in path:
            time.sleep(2)
        write(path, shard)

    def make_staging_once_c_is_staged(directory, staging, whole_world):
        if staging.endswith(".tmp-a"):
            _wait_for_dir(os.path.join(save_dir, ".tmp-c"))
        make_staging(directory, staging, whole_world)

    sharded._write_rank_file = slow_write
    sharded._make_staging = make_staging_once_c_is_staged
    try:
        first.save_checkpoint(save_dir, tag="a", async_save=True)
        second.save_checkpoint(save_dir, tag="c")
        first.wait_for_checkpoint()
        first.save_checkpoint(os.path.relpath(save_dir), tag="d", async_save=True)
        if skdist.get_rank() == 0:
            _wait_for_dir(os.path.join(save_dir, ".tmp-d"))
        second.save_checkpoint(os.path.abspath(save_dir), tag="e")
        first.wait_for_checkpoint()
    finally:
        sharded._write_rank_file, sharded._make_staging = write, make_staging
    skdist.barrier()
    return {"listing": sorted(os.listdir(save_dir)),
            "user_files": sorted(os.listdir(os.path.join(save_dir, ".tmp-cache"))
                                 + os.listdir(os.path.join(save_dir, ".old-b")))}


def test_cleanup_keeps_user_directories_and_saves_under_way(world2, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    for r in world2.run(_user_dirs_and_saves_under_way_survive_the_cleanup, save_dir):
        assert r["listing"] == [".old-b", ".tmp-cache", "a", "b", "c", "d", "e", "latest",
                                "zero_to_fp32.py"], r
        assert r["user_files"] == ["mine.txt", "notes.txt"], r


def test_abandoned_saves_names_only_what_saves_write(tmp_path):
    for name, files in ((".tmp-t", ["rank_00000.pt", "rank_00001.pt.sha256", "engine.pt"]),
                        (".tmp-u", []), (".tmp-", ["rank_00000.pt"]),
                        (".tmp-v", ["rank_00000.pt", "README"]), (".old-t", ["metadata.json"]),
                        ("t", ["metadata.json"])):
        os.makedirs(tmp_path / name)
        for file in files:
            (tmp_path / name / file).write_text("x")
    os.makedirs(tmp_path / ".tmp-w" / "sub")
    assert [os.path.basename(p) for p in sharded.abandoned_saves(str(tmp_path))] == \
        [".old-t", ".tmp-t", ".tmp-u"]
