"""FSDP state dicts: the full state dict equals the single-process model's and loads into the
unwrapped model; a world-2 local checkpoint plus the gathered optimizer state, reloaded at world
1 and 4, continues training exactly like uninterrupted single-process training."""

import os

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.models import GPT
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import World
from tests.nn.fsdp_common import (EPS, LR, TINY, build_gpt, make_optimizer, max_diff, train_step,
                                  wrap_gpt)

SAVE_AT, TOTAL = 3, 6


@pytest.fixture(scope="module")
def saved_world2(tmp_path_factory):
    """The world-2 checkpoint every test here reads, written (and resumed at world 2) once by
    whichever test asks first, so no test depends on another having run."""
    directory = str(tmp_path_factory.mktemp("fsdp_ckpt"))
    with World(2) as world:
        saved = world.run(_train_and_save, directory)
        resumed = world.run(_resume, directory)
    return directory, saved, resumed


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
    local = model.local_state_dict()
    tensors_only = all(isinstance(v, torch.Tensor) for v in local.values())
    local = {k: v.cpu() for k, v in local.items()}  # FairScale users' idiom must work
    torch.save(local, os.path.join(directory, f"local_{rank}.pt"))
    torch.save(model.local_metadata_dict(), os.path.join(directory, f"meta_{rank}.pt"))
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
    return {"local_is_tensors_only": 0.0 if tensors_only else 1.0,
            "full_vs_reference": max_diff(full, reference.state_dict()),
            "plain_vs_reference": max_diff(plain.state_dict(), reference.state_dict()),
            "optim_vs_reference": optim_diff,
            "continued_vs_reference": max_diff(model.state_dict(), final_reference.state_dict()),
            "load_round_trip": max_diff(fresh.state_dict(), final_reference.state_dict())}


def _resume(directory):
    """Any world size: reshard the world-2 local checkpoint, load the optimizer shard, train on."""
    model = wrap_gpt(build_gpt())
    locals_, metas = _saved_locals(directory)
    model.load_local_state_dict(locals_, metadata=metas)
    optim = make_optimizer(model)
    full_osd = torch.load(os.path.join(directory, "optim.pt"))
    optim.load_state_dict(model.get_shard_from_optim_state_dict(full_osd))
    for step in range(SAVE_AT, TOTAL):
        train_step(model, optim, step)
    final_reference, _ = _reference(TOTAL)
    resumed = max_diff(model.state_dict(), final_reference.state_dict())
    own = None
    if skdist.get_world_size() == 2:  # a rank's own dict reloads without the others
        saved_at = _reference(SAVE_AT)[0].state_dict()
        model.load_local_state_dict(locals_[skdist.get_rank()])
        own = max_diff(model.state_dict(), saved_at)
        # a dict written before local_metadata_dict() existed carried it inside; it still loads
        old_format = dict(locals_[skdist.get_rank()], _shardkit_fsdp_meta=metas[skdist.get_rank()])
        train_step(model, optim, TOTAL)
        model.load_local_state_dict(old_format)
        own = max(own, max_diff(model.state_dict(), saved_at))
    return {"resumed_vs_reference": resumed, "own_reload": own,
            "from_grouped_single_process": _resume_from_grouped_plain_optimizer()}


def _decay_groups(model):
    """nanoGPT's groups: decay on matrices, none on vectors (torch then numbers the state
    matrices first, not in the model's order)."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def _resume_from_grouped_plain_optimizer():
    """A single-process optimizer's state dict (no parameter names, grouped) sharded into FSDP
    at this world size: training goes on as the single process would."""
    def run(model, steps, optim=None, local=False):
        optim = optim or torch.optim.AdamW(_decay_groups(model), lr=LR, eps=EPS)
        for step in steps:
            train_step(model, optim, step, local=local)
        return optim
    reference = build_gpt(freeze=())
    ref_optim = run(reference, range(SAVE_AT))
    plain_osd = ref_optim.state_dict()
    model = wrap_gpt(build_gpt(freeze=()))
    model.load_state_dict(reference.state_dict())
    optim = torch.optim.AdamW(_decay_groups(model), lr=LR, eps=EPS)
    optim.load_state_dict(model.get_shard_from_optim_state_dict(plain_osd))
    run(model, range(SAVE_AT, TOTAL), optim, local=True)
    run(reference, range(SAVE_AT, TOTAL), ref_optim)
    return max_diff(model.state_dict(), reference.state_dict())


def _saved_locals(directory):
    return ([torch.load(os.path.join(directory, f"local_{r}.pt")) for r in range(2)],
            [torch.load(os.path.join(directory, f"meta_{r}.pt")) for r in range(2)])


def test_full_state_dict_and_local_checkpoint_world2(saved_world2):
    checkpoint_dir, results, resumed = saved_world2
    for r in results:
        assert all(v <= 1e-5 for v in r.values()), r
    for r in resumed:
        assert r["resumed_vs_reference"] <= 1e-5 and r["own_reload"] <= 1e-5, r
        assert r["from_grouped_single_process"] <= 1e-5, r
    _check_offline_consolidation(checkpoint_dir)


def _check_offline_consolidation(directory):
    """FairScale's static consolidate_shard_weights: every rank's pair (in any order), no
    process group, gives the full state dict of the model as it was saved."""
    weights, metas = _saved_locals(directory)
    reference = _reference(SAVE_AT)[0].state_dict()
    full = FSDP.consolidate_shard_weights(weights[::-1], metas[::-1])
    assert set(full) == set(reference)
    assert all(full[k].shape == reference[k].shape for k in reference)
    assert max_diff(full, reference) <= 1e-5
    assert metas[1]["world_size"] == 2 and metas[1]["rank"] == 1
    assert list(metas[0]["shapes"]["pos_emb.weight"]) == [TINY.seq_len, TINY.d_model]
    # strict: a parameter named by the metadata must be in every rank's weights
    dropped = [dict(w) for w in weights]
    del dropped[1]["pos_emb.weight"]
    with pytest.raises(KeyError, match="pos_emb.weight"):
        FSDP.consolidate_shard_weights(dropped, metas)
    partial = FSDP.consolidate_shard_weights(dropped, metas, strict=False)
    assert "pos_emb.weight" not in partial and set(partial) == set(reference) - {"pos_emb.weight"}
    without_buffers = FSDP.consolidate_shard_weights(weights, metas, with_module_buffers=False)
    assert set(without_buffers) == set(metas[0]["shapes"])
    with pytest.raises(ValueError, match="ranks \\[0, 0\\]"):
        FSDP.consolidate_shard_weights([weights[0]] * 2, [metas[0]] * 2)


@pytest.mark.parametrize("world_size", [1, 4])
def test_local_checkpoint_reshards(saved_world2, world_size):
    checkpoint_dir = saved_world2[0]
    with World(world_size) as world:
        results = world.run(_resume, checkpoint_dir)
    for r in results:
        assert r["resumed_vs_reference"] <= 1e-5, r
