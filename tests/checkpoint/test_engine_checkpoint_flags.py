"""engine.save_checkpoint / load_checkpoint switches that are not True or False (a string read
from a command line or an environment variable, ``"False"`` or ``"no"``) are a ValueError
naming the argument on every rank, before anything is read, written or changed: a truthy
``load_optimizer_states="False"`` silently loaded the saved optimizer state the caller had
asked to leave out, and ``save_latest="no"`` moved ``latest``. One world of 2 gloo ranks.
"""

import os

import torch

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture

world2 = world_fixture(2)

LOAD_FLAGS = ("load_optimizer_states", "load_lr_scheduler_states", "load_module_only")
SAVE_FLAGS = ("save_latest", "async_save")


def _engine(lr):
    torch.manual_seed(0)
    engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 3), config={
        "train_batch_size": 2 * distributed.get_world_size(), "steps_per_print": 10 ** 6,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": lr}}})
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    return engine


def _state(engine):
    weights = [p.detach().clone() for p in engine.module.parameters()]
    lrs = [g["lr"] for g in engine.optimizer.param_groups]
    return weights, lrs, engine.global_steps


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


def _bad_flags(save_dir):
    """Each switch given a string: the error on this rank, and whether anything changed (the
    engine, or the files under ``save_dir``)."""
    saved = _engine(0.1)
    saved.save_checkpoint(save_dir, tag="first")
    engine = _engine(0.5)
    out = {}
    for flag in LOAD_FLAGS:
        before = _state(engine)
        try:
            engine.load_checkpoint(save_dir, **{flag: "False"})
            out[flag] = "loaded"
        except ValueError as e:
            out[flag] = str(e)
        out[flag + " changed"] = not _same(before, _state(engine))
    for flag in SAVE_FLAGS:
        files = sorted(os.listdir(save_dir))
        try:
            saved.save_checkpoint(save_dir, tag=f"bad_{flag}", **{flag: "no"})
            out[flag] = "saved"
        except ValueError as e:
            out[flag] = str(e)
        out[flag + " changed"] = sorted(os.listdir(save_dir)) != files
    engine.load_checkpoint(save_dir, load_optimizer_states=False)  # still usable, in step
    out["lrs after a real load_optimizer_states=False"] = _state(engine)[1]
    return out


def test_checkpoint_switches_that_are_not_bools_are_refused_on_every_rank(world2, tmp_path):
    for out in world2.run(_bad_flags, str(tmp_path / "ckpt")):
        for flag in LOAD_FLAGS:
            assert f"load_checkpoint({flag}='False'): expected True or False" in out[flag], out
            assert not out[flag + " changed"], (flag, out)
        for flag in SAVE_FLAGS:
            assert f"save_checkpoint({flag}='no'): expected True or False" in out[flag], out
            assert not out[flag + " changed"], (flag, out)
        assert out["lrs after a real load_optimizer_states=False"] == [0.5], out
