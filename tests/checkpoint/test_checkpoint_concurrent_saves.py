"""Checkpoint gaps of review 61, as a user meets them:

- a second job saving into the same directory had its staging directory ``.tmp-TAG`` removed
  under it by the first job's cleanup of what killed saves left (and a save of the same tag
  removed it too): staging directories now carry an owner marker, and only those whose owner
  provably ended are removed; a live one of the same tag is an error naming its owner;
- tensor-parallel saves never removed what killed saves left in the tag directories
  (``TAG/.tmp-mp_rank_XX``, ``TAG/.old-mp_rank_XX``);
- torch's ``destroy_process_group()`` waited without a word, and without bound on a rank stuck
  in the writer, for an asynchronous save: it now names the save and its tag, and gives up
  after the checkpoint group's timeout;
- FSDP's local metadata carried ``cuts`` under format version 1, and a dict of a newer
  version was read as if it were of this one.

A world of 2 gloo ranks, one 2-rank job as plain processes, and local checks.

review

Review of the checkpoint owner markers, as a user meets the gaps:

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
import shutil
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed as skdist
from shardkit.checkpoint import CheckpointError, fsdp_state, sharded, async_save, save_owner
from shardkit.nn import model_parallel as mp
from shardkit.testing import free_port, world_fixture

world2 = world_fixture(2)

OWNER_FILE = "save_owner.json"


def _read(path):
    with open(path) as f:
        return f.read().strip()


def _owner(pid: int) -> dict:
    """The owner marker a save by process ``pid`` of this host writes."""
    stat = _read(f"/proc/{pid}/stat")
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": os.stat("/proc/self/ns/pid").st_ino, "pid": pid,
            "start_ticks": int(stat.rsplit(")", 1)[1].split()[19])}


def _dead_owner() -> dict:
    process = subprocess.Popen(["sleep", "30"])
    owner = _owner(process.pid)
    process.kill()
    process.wait()
    return owner


def _staging(path: str, owner: dict) -> None:
    """A staging directory of a save by ``owner``, holding a rank file."""
    os.makedirs(path)
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        json.dump(owner, f)
    with open(os.path.join(path, "rank_00000.pt"), "w") as f:
        f.write("a rank's part")


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/ns"), reason="Linux /proc")


@needs_proc
def test_cleanup_removes_only_saves_whose_owner_ended(tmp_path):
    """Another job (a live process of this host) is writing ``.tmp-live``; a killed job left
    ``.tmp-dead``. A save of tag ``new`` keeps the first and removes the second; a save of tag
    ``live`` is refused, naming the other job, and leaves its files."""
    save_dir = str(tmp_path)
    other_job = subprocess.Popen(["sleep", "60"])
    try:
        _staging(os.path.join(save_dir, ".tmp-live"), _owner(other_job.pid))
        _staging(os.path.join(save_dir, ".tmp-dead"), _dead_owner())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sharded._make_staging(save_dir, os.path.join(save_dir, ".tmp-new"), True)
        assert sorted(os.listdir(save_dir)) == [".tmp-live", ".tmp-new"]
        assert any("removed .tmp-dead" in str(w.message) for w in caught)
        assert os.path.join(save_dir, ".tmp-live") not in sharded.abandoned_saves(save_dir)
        with pytest.raises(CheckpointError, match=f"another save of tag 'live'.*pid "
                                                  f"{other_job.pid}"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # .tmp-new, made above, counts as left behind
            sharded._make_staging(save_dir, os.path.join(save_dir, ".tmp-live"), True)
        assert sorted(os.listdir(os.path.join(save_dir, ".tmp-live"))) == [
            "rank_00000.pt", OWNER_FILE]
    finally:
        other_job.kill()
        other_job.wait()
    # once the other job has ended, its staging directory is a leftover like any other
    assert os.path.join(save_dir, ".tmp-live") in sharded.abandoned_saves(save_dir)


def _tensor_parallel_saves(save_dir: str, other_job: int) -> dict:
    """Save tag ``a`` with a tensor-parallel engine (2 tensor-parallel ranks); plant what
    killed saves of ``a`` left (both parts' staging directories, part 0's retired copy) and
    ``.tmp-x``, a save of the live process ``other_job``; then save tag ``b``."""
    torch.manual_seed(0)
    mp.initialize_model_parallel(2)
    try:
        mp.model_parallel_cuda_manual_seed(1)
        engine = shardkit.initialize(model=nn.Linear(4, 4), config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, mpu=mp.initialize)[0]
        engine.save_checkpoint(save_dir, tag="a")
        tag_dir = os.path.join(save_dir, "a")
        if skdist.get_rank() == 0:
            _staging(os.path.join(tag_dir, ".tmp-mp_rank_00"), _dead_owner())
            _staging(os.path.join(tag_dir, ".tmp-mp_rank_01"), _dead_owner())
            shutil.copytree(os.path.join(tag_dir, "mp_rank_00"),
                            os.path.join(tag_dir, ".old-mp_rank_00"))
            _staging(os.path.join(tag_dir, ".tmp-x"), _owner(other_job))
        skdist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.save_checkpoint(save_dir, tag="b")
        return {"a": sorted(os.listdir(tag_dir)),
                "b": sorted(os.listdir(os.path.join(save_dir, "b"))),
                "owner files": [os.path.join(d, f) for d, _, files in os.walk(save_dir)
                                for f in files if f == OWNER_FILE and ".tmp-x" not in d]}
    finally:
        mp.destroy_model_parallel()


@needs_proc
def test_tensor_parallel_save_removes_what_killed_saves_left(world2, tmp_path):
    for listing in world2.run(_tensor_parallel_saves, str(tmp_path / "ckpt"), os.getpid()):
        assert listing["a"] == [".tmp-x", "mp_rank_00", "mp_rank_01", "tensor_parallel.json"], \
            listing
        assert listing["b"] == ["mp_rank_00", "mp_rank_01", "tensor_parallel.json"], listing
        assert listing["owner files"] == [], listing  # published parts carry no marker


STUCK_WRITER_JOB = r'''
import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import shardkit
import shardkit.distributed
from shardkit.checkpoint import CheckpointError, sharded

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=4))
model = nn.Linear(4, 4)
engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
    "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
if dist.get_rank() == 1:  # this rank's writer never returns (a hung filesystem)
    sharded._write_rank_file = lambda path, shard: time.sleep(600)
engine.save_checkpoint(sys.argv[1], tag="last", async_save=True)
start = time.monotonic()
try:
    if sys.argv[2] == "torch":
        dist.destroy_process_group()
    else:
        shardkit.distributed.destroy()
except CheckpointError as error:
    print(f"raised after {time.monotonic() - start:.0f} s: {error}", flush=True)
'''


DESTROYS = ("torch", "shardkit")


def _start_stuck_writer_job(folder, destroy: str) -> list:
    """The two rank processes of ``STUCK_WRITER_JOB`` in ``folder``, ending with ``destroy``'s
    destroy call; rank r writes its output to ``folder/rank{r}.out`` and ``.err``."""
    script = folder / "job.py"
    script.write_text(STUCK_WRITER_JOB)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(shardkit.__file__)))
    port = str(free_port())
    procs = []
    for rank in range(2):
        with open(folder / f"rank{rank}.out", "w") as out, \
                open(folder / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(folder / "ckpt"), destroy], stdout=out,
                stderr=err, env=dict(env, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                                     MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
    return procs


@pytest.fixture(scope="module")
def stuck_writer_jobs(tmp_path_factory):
    """Both destroy calls' jobs, run side by side (most of each is waiting out its timeouts):
    ``{destroy: (folder, [(stdout, stderr) of each rank] or None if they still wait)}``."""
    folders = {destroy: tmp_path_factory.mktemp(f"stuck-{destroy}") for destroy in DESTROYS}
    jobs = {destroy: _start_stuck_writer_job(folders[destroy], destroy) for destroy in DESTROYS}
    deadline = time.monotonic() + 120  # the jobs run at once: each has 120 s
    outputs = {}
    for destroy, procs in jobs.items():
        folder = folders[destroy]
        try:  # before: rank 1 waited for its writer forever
            for proc in procs:
                proc.wait(timeout=max(1, deadline - time.monotonic()))
            outputs[destroy] = [(_read(folder / f"rank{r}.out"), _read(folder / f"rank{r}.err"))
                                for r in range(2)]
        except subprocess.TimeoutExpired:
            outputs[destroy] = None
            for p in procs:
                p.kill()
                p.wait()
    return {destroy: (folders[destroy], outputs[destroy]) for destroy in DESTROYS}


@pytest.mark.parametrize("destroy", DESTROYS)
def test_torch_destroy_names_the_stuck_save_and_gives_up(stuck_writer_jobs, destroy):
    """torch's destroy_process_group (wrapped) and shardkit.distributed.destroy() alike: before,
    the latter waited for a stuck writer without bound."""
    folder, outputs = stuck_writer_jobs[destroy]
    if outputs is None:
        pytest.fail("destroy_process_group() still waits for the stuck save")
    out, err = outputs[1]
    assert "waiting (at most 6 s in all) for the asynchronous checkpoint save of tag 'last'" \
        in err, err
    assert "raised after" in out and "tag 'last'" in out and "did not finish" in out, (out, err)
    assert "raised after" in outputs[0][0], outputs[0]  # rank 0: the agreement timed out
    assert not os.path.exists(folder / "ckpt" / "latest")


def _local_dicts(fmt=None, cuts=True):
    """Both ranks' local weights and metadata of a 3x2 parameter in a world of 2."""
    full = torch.arange(6.0).reshape(3, 2)
    blocks = [full[:2].clone(), torch.cat([full[2:], torch.zeros(1, 2)])]
    metas = [fsdp_state.local_metadata(2, r, {"w": (3, 2)}, []) for r in range(2)]
    for meta in metas:
        if fmt is not None:
            meta["format"] = fmt
        if not cuts:
            del meta["cuts"]
    return full, [{"w": b} for b in blocks], metas


def test_local_format_versions():
    assert fsdp_state.LOCAL_FORMAT == "shardkit-fsdp-local/2"
    full, weights, metas = _local_dicts("shardkit-fsdp-local/1", cuts=False)  # as v1 wrote
    assert torch.equal(fsdp_state.consolidate_shard_weights(weights, metas)["w"], full)
    _, weights, metas = _local_dicts("shardkit-fsdp-local/3")
    for call in (lambda: fsdp_state.consolidate_shard_weights(weights, metas),
                 lambda: fsdp_state.reshard_local_state_dicts(weights[0], metas[0], 2, 0)):
        with pytest.raises(ValueError, match=r"'shardkit-fsdp-local/3'; this shardkit reads "
                                             r"shardkit-fsdp-local/1, shardkit-fsdp-local/2; it "
                                             r"was written by a newer shardkit"):
            call()


needs_proc_rev = pytest.mark.skipif(not os.path.isdir("/proc/self/ns"), reason="Linux /proc")


def _dir_with_marker(path: str, owner) -> None:
    os.makedirs(path)
    if owner is not None:
        with open(os.path.join(path, save_owner.OWNER_FILE), "w") as f:
            json.dump(owner, f)


def _dead_owner_rev() -> dict:
    process = subprocess.Popen(["sleep", "30"])
    owner = dict(save_owner.this_process(), pid=process.pid,
                 start_ticks=save_owner._start_ticks(process.pid))
    process.kill()
    process.wait()
    return owner


@needs_proc_rev
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
    _dir_with_marker(dead, _dead_owner_rev())
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
