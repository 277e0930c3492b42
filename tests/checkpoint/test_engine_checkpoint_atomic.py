"""Engine checkpoints commit atomically: a save that fails on one rank, or a process killed
while writing, leaves ``latest`` at the previous complete checkpoint; bad requests are clear;
the loss scaler, scheduler, counters and RNG come back exactly."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import torch

import shardkit
from shardkit import distributed
from shardkit.checkpoint import CheckpointError, consolidate_checkpoint, read_latest_tag
from shardkit.testing import world_fixture


world1 = world_fixture(1)


world2 = world_fixture(2)


# ----------------------------------------------------------------------------- atomicity


def _failed_save(save_dir):
    from shardkit.checkpoint import sharded
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 4), config={
        "train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}})
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(save_dir, tag="good")
    good = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()

    original = sharded._write_rank_file

    def crash_on_rank1(path, shard):
        if distributed.get_rank() == 1:
            with open(path, "wb") as f:
                f.write(b"half a file")
            raise OSError("No space left on device")
        original(path, shard)

    sharded._write_rank_file = crash_on_rank1
    try:
        engine.save_checkpoint(save_dir, tag="bad")
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        sharded._write_rank_file = original
    path, _ = engine.load_checkpoint(save_dir)
    restored = max(float((v - good[k]).abs().max()) for k, v in engine.module.state_dict().items())
    return {"error": error, "latest": read_latest_tag(save_dir), "loaded": path,
            "restored_diff": restored, "listing": sorted(os.listdir(save_dir))}


def test_failed_save_on_one_rank_raises_everywhere_and_keeps_latest(world2, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    for r in world2.run(_failed_save, save_dir):
        assert r["error"] is not None and "'latest' still names the previous" in r["error"]
        assert r["latest"] == "good" and r["loaded"] == os.path.join(save_dir, "good")
        assert r["restored_diff"] == 0.0
        assert r["listing"] == ["good", "latest", "zero_to_fp32.py"]
    assert "No space left on device" in world2.run(_failed_save, str(tmp_path / "b"))[1]["error"]


def _save_into(save_dir):
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 4), config={
        "train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 1}})
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except CheckpointError as e:
        return str(e)
    return None


def test_save_dir_rank0_cannot_create_fails_on_every_rank(world2, tmp_path):
    # rank 0 creates the staging directory; when it cannot (a file in the way, a read-only or
    # full disk), every rank raises instead of waiting at a barrier rank 0 never reaches
    in_the_way = tmp_path / "a_file"
    in_the_way.write_text("not a directory")
    errors = world2.run(_save_into, str(in_the_way))
    assert all(e is not None and "creating" in e and "'latest' still names" in e
               for e in errors), errors
    assert "FileExistsError" in errors[0] and "on another rank" in errors[1]
    assert in_the_way.read_text() == "not a directory"


def _rank0_fails_building_its_part(save_dir, async_save):
    """A user scheduler whose state_dict() raises on rank 0 only (rank 0 alone builds the
    engine payload): before the fix the other ranks waited in the commit's first all-reduce
    for a rank that had already raised."""
    class SchedulerFailingOnRank0(torch.optim.lr_scheduler.LambdaLR):
        failing = False

        def state_dict(self):
            if self.failing and distributed.get_rank() == 0:
                raise RuntimeError("scheduler state unavailable")
            return super().state_dict()

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = SchedulerFailingOnRank0(optimizer, lambda step: 1.0)
    engine, _, _, _ = shardkit.initialize(model=model, optimizer=optimizer,
                                          lr_scheduler=scheduler,
                                          config={"train_batch_size": 4,
                                                  "zero_optimization": {"stage": 1}})
    engine.save_checkpoint(save_dir, tag="good")
    scheduler.failing = True
    try:
        engine.save_checkpoint(save_dir, tag="bad", async_save=async_save)
        engine.wait_for_checkpoint()
        error = None
    except CheckpointError as e:
        error = str(e)
    return {"error": error, "latest": read_latest_tag(save_dir),
            "listing": sorted(os.listdir(save_dir))}


def test_failure_building_rank0s_part_raises_on_every_rank(world2, tmp_path):
    for async_save in (False, True):
        save_dir = str(tmp_path / f"ckpt-{async_save}")
        rank0, rank1 = world2.run(_rank0_fails_building_its_part, save_dir, async_save)
        assert "scheduler state unavailable" in rank0["error"], rank0
        assert "on another rank" in rank1["error"], rank1
        for r in (rank0, rank1):
            assert "'latest' still names the previous" in r["error"]
            assert r["latest"] == "good", r
            assert r["listing"] == ["good", "latest", "zero_to_fp32.py"], r


def _numpy_learning_rate(save_dir):
    """A schedule computed with NumPy (``np.cos``) puts ``np.float64`` learning rates into the
    param groups and the scheduler state; the checkpoint must still load (weights_only)."""
    import numpy as np
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: np.cos(0.1 * step))
    engine, _, _, _ = shardkit.initialize(model=model, optimizer=optimizer,
                                          lr_scheduler=scheduler,
                                          config={"train_batch_size": 4})
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    engine.save_checkpoint(save_dir, tag="cos")
    lr = engine.get_lr()[0]
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.load_checkpoint(save_dir, tag="cos")
    return lr, engine.get_lr()[0], scheduler.last_epoch


def _unloadable_scheduler_state(save_dir):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class SchedulerWithAnObject(torch.optim.lr_scheduler.LambdaLR):
        def state_dict(self):
            return {**super().state_dict(), "owner": self}

    engine, _, _, _ = shardkit.initialize(
        model=model, optimizer=optimizer,
        lr_scheduler=SchedulerWithAnObject(optimizer, lambda step: 1.0),
        config={"train_batch_size": 4})
    try:
        engine.save_checkpoint(save_dir, tag="t")
    except CheckpointError as e:
        return str(e), sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    return None, sorted(os.listdir(save_dir))


def test_scheduler_state_must_load_back(world2, tmp_path):
    results = world2.run(_numpy_learning_rate, str(tmp_path / "np"))
    for saved_lr, loaded_lr, last_epoch in results:
        assert loaded_lr == saved_lr == 0.1 * float(np.cos(0.2)) and last_epoch == 2
    rank0, rank1 = world2.run(_unloadable_scheduler_state, str(tmp_path / "obj"))
    assert "the scheduler state (dict) would not load back" in rank0[0], rank0
    assert "SchedulerWithAnObject" in rank0[0] and "nothing was written" in rank0[0]
    assert "on another rank" in rank1[0]
    assert rank0[1] == rank1[1] == [], rank0


KILLED_MID_SAVE = textwrap.dedent("""
    import os, signal, sys, torch, shardkit
    from shardkit.checkpoint import sharded
    save_dir = sys.argv[1]
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 4), config={
        "train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.backward(engine(torch.ones(2, 4)).sum()); engine.step()
    engine.save_checkpoint(save_dir, tag="first")
    def killed_while_writing(path, shard):
        with open(path, "wb") as f:
            f.write(b"partial")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    sharded._write_rank_file = killed_while_writing
    engine.backward(engine(torch.ones(2, 4)).sum()); engine.step()
    engine.save_checkpoint(save_dir, tag="second")
""")


def test_process_killed_mid_save_leaves_latest_at_previous(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, save_dir], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert read_latest_tag(save_dir) == "first"
    state = consolidate_checkpoint(save_dir)
    assert set(state) == {"weight", "bias"}
    # The interrupted save is only a staging directory; the next save replaces it.
    assert "second" not in os.listdir(save_dir)


# ----------------------------------------------------------------------------- bad input


def _bad_loads(save_dir):
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(3, 3), config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    out = {"empty": engine.load_checkpoint(save_dir + "/nothing-here")}
    engine.save_checkpoint(save_dir, tag="lin")
    for name, call in {
        "bad tag": lambda: engine.save_checkpoint(save_dir, tag="../escape"),
        # 'latest' is read stripped (as DeepSpeed reads it): "lin " would resume from "lin"
        "spaced tag": lambda: engine.save_checkpoint(save_dir, tag="lin "),
        "newline tag": lambda: engine.save_checkpoint(save_dir, tag="x\n"),
        "missing tag": lambda: engine.load_checkpoint(save_dir, tag="nope"),
    }.items():
        try:
            call()
        except CheckpointError as e:
            out[name] = str(e)
    other, _, _, _ = shardkit.initialize(model=torch.nn.Linear(3, 5), config={
        "train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        other.load_checkpoint(save_dir)
    except Exception as e:  # shape mismatch from load_state_dict
        out["other model"] = f"{type(e).__name__}: {e}"
    out["latest"], out["listing"] = read_latest_tag(save_dir), sorted(os.listdir(save_dir))
    # a tag with a space, as earlier versions saved it, still converts by its name
    import shutil
    from shardkit.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    shutil.copytree(os.path.join(save_dir, "lin"), os.path.join(save_dir, "old "))
    out["old spaced tag"] = sorted(get_fp32_state_dict_from_zero_checkpoint(save_dir, "old "))
    return out


def test_bad_checkpoint_requests_are_clear(world1, tmp_path):
    out = world1.run(_bad_loads, str(tmp_path / "ckpt"))[0]
    assert out["empty"] == (None, None)
    assert "tag='../escape'" in out["bad tag"]
    # before: saved, and a resume from 'latest' loaded the older "lin" silently
    assert "tag='lin '" in out["spaced tag"] and "whitespace" in out["spaced tag"], out
    assert "tag='x\\n'" in out["newline tag"], out
    assert out["latest"] == "lin" and out["listing"] == ["latest", "lin", "zero_to_fp32.py"]
    assert out["old spaced tag"] == ["bias", "weight"], out
    assert "nope does not exist" in out["missing tag"] and "['lin']" in out["missing tag"]
    assert "size mismatch" in out["other model"]


def _mismatched_loads(save_dir, stage):
    """Save an AdamW engine at ``stage``; load it into a wider model (only the last bias has
    the saved shape) and into an SGD engine. Return each error and whether anything changed."""
    def engine_of(width, optimizer):
        torch.manual_seed(width)
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(),
                                    torch.nn.Linear(width, 2))
        engine, *_ = shardkit.initialize(model=model, config={
            "train_batch_size": 2, "zero_optimization": {"stage": stage},
            "optimizer": {"type": optimizer, "params": {"lr": 0.1}}})
        engine.backward(engine(torch.ones(1, 4)).sum())
        engine.step()
        return engine

    engine_of(6, "AdamW").save_checkpoint(save_dir, tag="t")
    out = {}
    for name, width, optimizer in (("wider", 8, "AdamW"), ("sgd", 6, "SGD")):
        engine = engine_of(width, optimizer)
        before = [t.clone() for t in engine.wrapped.local_state_dict().values()] \
            if stage == 3 else [t.clone() for t in engine.module.state_dict().values()]
        try:
            engine.load_checkpoint(save_dir, tag="t")
            out[name] = "loaded"
        except CheckpointError as e:
            out[name] = str(e)
        after = engine.wrapped.local_state_dict().values() if stage == 3 else \
            engine.module.state_dict().values()
        out[name + " changed"] = any(not torch.equal(a, b) for a, b in zip(before, after))
        engine.step()  # still usable: no rank is left in a collective
    return out


def test_checkpoint_of_another_shape_or_optimizer_is_refused_before_anything_changes(
        world2, tmp_path):
    for stage in (0, 3):
        for out in world2.run(_mismatched_loads, str(tmp_path / f"s{stage}"), stage):
            assert "size mismatch" in out["wider"], out
            assert "0.weight: (6, 4) in the checkpoint, (8, 4) in the model" in out["wider"]
            assert "saved by AdamW, this engine's optimizer is SGD" in out["sgd"], out
            assert "load_optimizer_states=False" in out["sgd"]
            assert not out["wider changed"] and not out["sgd changed"], (stage, out)


def _fp16_state_round_trip(save_dir):
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
              "fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}}
    torch.manual_seed(0)
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 4), config=config)
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 4)).float().pow(2).sum() * 1e3)
        engine.step()
    engine.save_checkpoint(save_dir)
    saved = (engine.loss_scaler.state_dict(), engine.lr_scheduler.state_dict(),
             engine.global_steps, engine.skipped_steps)
    draw_after_save = torch.rand(3)

    fresh, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 4), config=config)
    torch.manual_seed(1234)
    fresh.load_checkpoint(save_dir)
    draw_after_load = torch.rand(3)
    loaded = (fresh.loss_scaler.state_dict(), fresh.lr_scheduler.state_dict(),
              fresh.global_steps, fresh.skipped_steps)
    return {"same_state": saved == loaded, "scale": saved[0]["cur_scale"],
            "skipped": saved[3], "same_rng": bool(torch.equal(draw_after_save, draw_after_load))}


def test_loss_scaler_scheduler_counters_and_rng_round_trip(world1, tmp_path):
    r = world1.run(_fp16_state_round_trip, str(tmp_path / "ckpt"))[0]
    assert r["skipped"] >= 1 and r["scale"] < 2.0 ** 20  # the scaler really moved
    assert r["same_state"] and r["same_rng"]


def _load_seen_differently(save_dir, stage):
    """Rank 1 reads a directory without the checkpoint, then one with a damaged rank file (a
    directory that is not shared by the nodes): every rank must raise, and train on after."""
    import shutil
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 4), config={
        "train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage}})
    engine.save_checkpoint(save_dir, tag="t")
    rank = distributed.get_rank()
    if rank == 0:
        shutil.copytree(save_dir, save_dir + "-damaged")
        with open(os.path.join(save_dir + "-damaged", "t", "rank_00000.pt"), "r+b") as f:
            f.truncate(64)
    distributed.barrier()
    out = {}
    for case, other in (("missing", save_dir + "-nowhere"), ("damaged", save_dir + "-damaged")):
        try:
            engine.load_checkpoint(save_dir if rank == 0 else other)
            out[case] = None
        except CheckpointError as e:
            out[case] = str(e)
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()  # no rank was left inside a collective
    return out


def test_load_that_fails_or_finds_nothing_on_one_rank_raises_on_every_rank(world2, tmp_path):
    for stage in (1, 3):
        rank0, rank1 = world2.run(_load_seen_differently, str(tmp_path / f"s{stage}"), stage)
        assert "1 of 2 ranks found a checkpoint there, this one" in rank0["missing"]
        assert "not this one" in rank1["missing"] and "shared" in rank1["missing"]
        assert "failed on 1 other rank(s)" in rank0["damaged"]
        assert "rank_00000.pt: 64 bytes" in rank1["damaged"]


def _agreement_on_an_nccl_group(save_dir):
    """The save's agreement all-reduces use this process's CUDA device under NCCL (whose
    process groups reduce CUDA tensors only); gloo's backend is swapped for the name only."""
    from shardkit.checkpoint import sharded
    devices = []
    real_any_rank, real_backend = distributed.any_rank, distributed.backend_of
    real_current = torch.cuda.current_device

    def recording_any_rank(flag, group=None, device=None):
        devices.append(str(device))
        return real_any_rank(flag, group)

    distributed.any_rank = recording_any_rank
    distributed.backend_of = lambda group=None: "nccl"
    torch.cuda.current_device = lambda: 0
    try:
        sharded.commit_checkpoint(save_dir, "t", sharded.RankShard(), {
            "format": sharded.FORMAT, "world_size": 1, "param_names": []}, {})
    finally:
        distributed.any_rank, distributed.backend_of = real_any_rank, real_backend
        torch.cuda.current_device = real_current
    return devices


def test_save_agreement_uses_the_cuda_device_under_nccl(world1, tmp_path):
    assert world1.run(_agreement_on_an_nccl_group, str(tmp_path / "ckpt"))[0] == ["cuda:0"] * 3
