"""FSDP state dicts: the full state dict equals the single-process model's and loads into the
unwrapped model; a world-2 local checkpoint plus the gathered optimizer state, reloaded at world
1 and 4, continues training exactly like uninterrupted single-process training."""

import os

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.models import GPT
from shardkit.testing import World
from tests.nn.fsdp_common import TINY, build_gpt, make_optimizer, max_diff, train_step, wrap_gpt

SAVE_AT, TOTAL = 3, 6


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp_ckpt"))


def _reference(steps):
    model = build_gpt()
    optim = make_optimizer(model)
    for step in range(steps):
        train_step(model, optim, step, local=False)
    return model, optim


def _train_and_save(directory):
    """World 2: train, compare the full state dict and optimizer state with the oracle, save
    the local checkpoint; then keep training to check save had no side effect."""
    reference, ref_optim = _reference(SAVE_AT)
    model = wrap_gpt(build_gpt())
    optim = make_optimizer(model)
    for step in range(SAVE_AT):
        train_step(model, optim, step)
    full = model.state_dict()
    plain = GPT(TINY, seed=99)
    plain.load_state_dict(full)  # strict: the original keys, unpadded shapes
    rank = skdist.get_rank()
    torch.save(model.local_state_dict(), os.path.join(directory, f"local_{rank}.pt"))
    full_osd = model.gather_full_optim_state_dict(optim, recipient_rank=0)
    optim_diff = 0.0
    if rank == 0:
        torch.save(full_osd, os.path.join(directory, "optim.pt"))
        ref_state = ref_optim.state_dict()["state"]
        for index, entry in ref_state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                optim_diff = max(optim_diff,
                                 (full_osd["state"][index][key] - entry[key]).abs().max().item())
        ref_optim.load_state_dict(full_osd)  # a single-process optimizer accepts it
    else:
        assert full_osd is None
    for step in range(SAVE_AT, TOTAL):
        train_step(model, optim, step)
    final_reference, _ = _reference(TOTAL)
    # load_state_dict (full) round trip into a fresh wrapped model
    fresh = wrap_gpt(build_gpt(freeze=()))
    fresh.load_state_dict(final_reference.state_dict())
    return {"full_vs_reference": max_diff(full, reference.state_dict()),
            "plain_vs_reference": max_diff(plain.state_dict(), reference.state_dict()),
            "optim_vs_reference": optim_diff,
            "continued_vs_reference": max_diff(model.state_dict(), final_reference.state_dict()),
            "load_round_trip": max_diff(fresh.state_dict(), final_reference.state_dict())}


def _resume(directory):
    """Any world size: reshard the world-2 local checkpoint, load the optimizer shard, train on."""
    model = wrap_gpt(build_gpt())
    locals_ = [torch.load(os.path.join(directory, f"local_{r}.pt")) for r in range(2)]
    model.load_local_state_dict(locals_)
    optim = make_optimizer(model)
    full_osd = torch.load(os.path.join(directory, "optim.pt"))
    optim.load_state_dict(model.get_shard_from_optim_state_dict(full_osd))
    for step in range(SAVE_AT, TOTAL):
        train_step(model, optim, step)
    final_reference, _ = _reference(TOTAL)
    resumed = max_diff(model.state_dict(), final_reference.state_dict())
    own = None
    if skdist.get_world_size() == 2:  # a rank's own dict reloads without the others
        model.load_local_state_dict(locals_[skdist.get_rank()])
        own = max_diff(model.state_dict(), _reference(SAVE_AT)[0].state_dict())
    return {"resumed_vs_reference": resumed, "own_reload": own}


def test_full_state_dict_and_local_checkpoint_world2(checkpoint_dir):
    with World(2) as world:
        results = world.run(_train_and_save, checkpoint_dir)
        for r in results:
            assert all(v <= 1e-5 for v in r.values()), r
        resumed = world.run(_resume, checkpoint_dir)
    for r in resumed:
        assert r["resumed_vs_reference"] <= 1e-5 and r["own_reload"] <= 1e-5, r


@pytest.mark.parametrize("world_size", [1, 4])
def test_local_checkpoint_reshards(checkpoint_dir, world_size):
    if not os.path.exists(os.path.join(checkpoint_dir, "optim.pt")):
        pytest.skip("needs the world-2 checkpoint of the previous test")
    with World(world_size) as world:
        results = world.run(_resume, checkpoint_dir)
    for r in results:
        assert r["resumed_vs_reference"] <= 1e-5, r
