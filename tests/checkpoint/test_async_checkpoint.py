"""Asynchronous checkpoint saves: the checkpoint holds the state at the call, training goes on
while it is written, the next save or load waits for it, and a failure in the background write
is raised on every rank at that wait while ``latest`` keeps naming the previous checkpoint."""

import os

import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.checkpoint import CheckpointError, consolidate_checkpoint, read_latest_tag
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.testing import world_fixture

TINY = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=8)

world2 = world_fixture(2)


def _engine(stage):
    engine, _, _, _ = shardkit.initialize(model=GPT(TINY, seed=0), config={
        "train_batch_size": 4, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage}})
    return engine


def _train(engine, steps):
    rank = distributed.get_rank()
    for _ in range(steps):
        idx, tgt = synthetic_batch(TINY, 4, engine.global_steps)
        x, y = idx[rank * 2:(rank + 1) * 2], tgt[rank * 2:(rank + 1) * 2]
        engine.backward(F.cross_entropy(engine(x).reshape(-1, TINY.vocab_size), y.reshape(-1)))
        engine.step()


def _snapshot(engine):
    return {k: v.detach().clone() for k, v in engine.module_state_dict().items()}


def _async_round_trip(save_dir, stage, debug):
    from shardkit.collective_check import set_debug_collectives
    set_debug_collectives(debug)  # the background commit is checked on its own group
    try:
        return _async_round_trip_body(save_dir, stage)
    finally:
        set_debug_collectives(False)


def _async_round_trip_body(save_dir, stage):
    engine = _engine(stage)
    _train(engine, 2)
    at_save = _snapshot(engine)
    path = engine.save_checkpoint(save_dir, tag="a", async_save=True)
    _train(engine, 2)  # goes on while the background thread writes "a"
    written = engine.wait_for_checkpoint()
    saved = consolidate_checkpoint(save_dir)
    drift = max(float((saved[k] - at_save[k]).abs().max()) for k in at_save)
    # load waits for a save still under way, and reads the state of that save
    engine.save_checkpoint(save_dir, tag="b", async_save=True)
    at_b = _snapshot(engine)
    _train(engine, 1)
    loaded, _ = engine.load_checkpoint(save_dir)
    back = max(float((v - at_b[k]).abs().max()) for k, v in _snapshot(engine).items())
    return {"path": path, "written": written, "drift": drift, "loaded": loaded, "back": back,
            "latest": read_latest_tag(save_dir), "global_steps": engine.global_steps}


def test_async_save_holds_the_state_at_the_call_and_load_waits(world2, tmp_path):
    for stage, debug in ((1, False), (3, False), (3, True)):
        save_dir = str(tmp_path / f"stage{stage}-{debug}")
        for r in world2.run(_async_round_trip, save_dir, stage, debug):
            assert r["path"] == r["written"] == os.path.join(save_dir, "a")
            assert r["drift"] == 0.0, stage
            assert r["loaded"] == os.path.join(save_dir, "b") and r["latest"] == "b"
            assert r["back"] == 0.0 and r["global_steps"] == 4


def _failed_async_save(save_dir):
    from shardkit.checkpoint import sharded
    engine = _engine(2)
    _train(engine, 1)
    engine.save_checkpoint(save_dir, tag="good", async_save=True)
    engine.wait_for_checkpoint()
    original = sharded._write_rank_file

    def crash_on_rank1(path, shard):
        if distributed.get_rank() == 1:
            raise OSError("No space left on device")
        original(path, shard)

    sharded._write_rank_file = crash_on_rank1
    try:
        engine.save_checkpoint(save_dir, tag="bad", async_save=True)  # returns at once
        _train(engine, 1)
        error = None
        try:
            engine.save_checkpoint(save_dir, tag="next", async_save=True)  # waits for "bad"
        except CheckpointError as e:
            error = str(e)
    finally:
        sharded._write_rank_file = original
    return {"error": error, "latest": read_latest_tag(save_dir),
            "listing": sorted(os.listdir(save_dir))}


def test_failed_background_write_raises_at_the_next_save_and_keeps_latest(world2, tmp_path):
    for r in world2.run(_failed_async_save, str(tmp_path / "ckpt")):
        assert r["error"] is not None and "'latest' still names the previous" in r["error"]
        assert r["latest"] == "good" and r["listing"] == ["good", "latest", "zero_to_fp32.py"]


def _async_on_one_rank(save_dir, validation):
    """``async_save`` that differs between ranks (a flag read on some ranks only): the
    asynchronous rank waited in the background writer's group creation, which the other never
    joined, until the process-group timeout, then blamed a dead peer."""
    engine, _, _, _ = shardkit.initialize(model=GPT(TINY, seed=0), config={
        "train_batch_size": 4, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 1}, "checkpoint": {"tag_validation": validation}})
    _train(engine, 1)
    try:
        engine.save_checkpoint(save_dir, tag="t", async_save=distributed.get_rank() == 1)
        engine.wait_for_checkpoint()
        error = None
    except CheckpointError as e:
        error = str(e)
    # the world is still usable: a save that agrees goes through
    engine.save_checkpoint(save_dir, tag="after")
    return error, sorted(os.listdir(save_dir))


def test_async_save_differing_between_ranks_is_refused_on_every_rank(world2, tmp_path):
    for validation in ("Fail", "Ignore"):
        save_dir = str(tmp_path / validation)
        for error, listing in world2.run(_async_on_one_rank, save_dir, validation):
            assert "async_save=True on rank(s) [1] and False on rank(s) [0]" in error
            assert listing == ["after", "latest", "zero_to_fp32.py"]
