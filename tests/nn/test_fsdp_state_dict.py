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
    torch.save(optim.state_dict(), os.path.join(directory, f"optim_{rank}.pt"))  # row blocks
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
            "from_grouped_single_process": _resume_from_grouped_plain_optimizer(),
            **_resume_from_local_optimizer_states(directory)}


def _resume_from_local_optimizer_states(directory):
    """FairScale users' local checkpoint: each rank saved its local_state_dict() and its
    optimizer's own state_dict() (row blocks). At another world size both halves reshard."""
    from shardkit.checkpoint import reshard_local_optim_state_dicts
    locals_, metas = _saved_locals(directory)
    saved = [torch.load(os.path.join(directory, f"optim_{r}.pt"), weights_only=True)
             for r in range(2)]
    model = wrap_gpt(build_gpt())
    model.load_local_state_dict(locals_, metadata=metas)
    optim = make_optimizer(model)
    optim.load_state_dict(reshard_local_optim_state_dicts(saved, metas, model, optim))
    for step in range(SAVE_AT, TOTAL):
        train_step(model, optim, step)
    final_reference, _ = _reference(TOTAL)
    full = model.gather_full_optim_state_dict(optim, recipient_rank=0)
    steps = {float(e["step"]) for e in full["state"].values()} if full is not None else None
    other_groups = torch.optim.AdamW([next(model.parameters())], lr=LR)
    try:
        reshard_local_optim_state_dicts(saved, metas, model, other_groups)
        groups_error = None
    except ValueError as e:
        groups_error = str(e)
    return {"from_local_optim_vs_reference": max_diff(model.state_dict(),
                                                      final_reference.state_dict()),
            "from_local_optim_steps": steps, "local_optim_groups_error": groups_error}


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
        assert r["from_local_optim_vs_reference"] <= 1e-5, r
        assert "parameters per param group" in r["local_optim_groups_error"], r
    assert results[0]["from_local_optim_steps"] == {float(TOTAL)}


def test_world1_local_dict_reshards_to_every_rank_of_a_larger_world():
    # a world of one saves one local dict: it is the whole model, so every rank of a larger
    # world reshards it (FairScale users pass [dict] or the dict itself with its metadata)
    from shardkit.checkpoint.fsdp_state import local_metadata, reshard_local_state_dicts
    full = torch.arange(15.0).reshape(5, 3)
    saved = {"w": full.clone(), "buf": torch.ones(2)}
    meta = local_metadata(1, 0, {"w": [5, 3]}, ["buf"])
    for given, metadata in (([saved], [meta]), (saved, meta)):
        rows = [reshard_local_state_dicts(given, metadata, world_size=2, rank=r)["w"]
                for r in range(2)]
        assert [tuple(r.shape) for r in rows] == [(3, 3), (3, 3)]  # ceil(5/2) rows, padded
        assert torch.equal(torch.cat(rows)[:5], full)
    with pytest.raises(ValueError, match="rank 1 of a world of 2; this is rank 0 of 4"):
        reshard_local_state_dicts(saved, local_metadata(2, 1, {"w": [5, 3]}, ["buf"]), 4, 0)


def _load_another_models_state_dict():
    model = wrap_gpt(build_gpt())
    before = model.state_dict()
    other = {k: v + 1 for k, v in before.items() if not k.startswith("blocks.1.")}
    other["extra.weight"] = torch.zeros(3)
    try:
        model.load_state_dict(other)
        strict_error = None
    except RuntimeError as e:
        strict_error = str(e)
    unchanged = max_diff(model.state_dict(), before)
    result = model.load_state_dict(other, strict=False)
    # a rank-0-only state dict loaded as given: rank 1 has {}; every rank must raise, not hang
    try:
        model.load_state_dict(before if skdist.get_rank() == 0 else {})
        rank0_only_error = None
    except RuntimeError as e:
        rank0_only_error = str(e)
    return {"strict_error": strict_error, "unchanged": unchanged,
            "rank0_only_error": rank0_only_error,
            "missing": result.missing_keys, "unexpected": result.unexpected_keys,
            "expected_missing": sorted(k for k in before if k.startswith("blocks.1."))}


def test_key_mismatch_names_state_dict_keys_and_loads_nothing():
    # the keys a user sees are state_dict()'s (no "_fsdp_wrapped_module." prefixes), and a
    # strict load that fails leaves every weight as it was (torch's would copy the matching ones)
    with World(2) as world:
        results = world.run(_load_another_models_state_dict)
    for r in results:
        assert "nothing was loaded" in r["strict_error"], r["strict_error"]
        assert '"blocks.1.ln1.weight"' in r["strict_error"]
        assert 'Unexpected key(s) in state_dict: "extra.weight"' in r["strict_error"]
        assert "_fsdp_wrapped_module" not in r["strict_error"]
        assert r["unchanged"] == 0.0
        assert sorted(r["missing"]) == r["expected_missing"]
        assert r["unexpected"] == ["extra.weight"]
    assert "given on another rank of the group does not match" in results[0]["rank0_only_error"]
    assert 'Missing key(s) in state_dict: "tok_emb.weight"' in results[1]["rank0_only_error"]


def _state_dict_one_unit_at_a_time():
    from shardkit.nn.data_parallel.flat_param import FlatParamShard as FlatShard
    model = wrap_gpt(build_gpt(), state_dict_on_rank_0_only=True,
                     state_dict_device=torch.device("cpu"))
    units = model.sharded_units()
    summoned_at_gathers = []
    original = FlatShard.gather_master

    def recording_gather(shard):
        summoned_at_gathers.append(sum(u._summoned for u in units))
        return original(shard)

    FlatShard.gather_master = recording_gather
    try:
        full = model.state_dict()
    finally:
        FlatShard.gather_master = original
    expected = build_gpt().state_dict()
    return {"summoned": summoned_at_gathers, "units": len(units),
            "keys": list(full), "expected_keys": list(expected),
            "diff": max_diff(full, expected) if full else None}


def test_full_state_dict_gathers_one_unit_at_a_time():
    # FairScale's memory: one unit gathered at a time (not the whole model on every rank), and
    # with state_dict_on_rank_0_only only rank 0 keeps the result
    with World(2) as world:
        rank0, rank1 = world.run(_state_dict_one_unit_at_a_time)
    for r in (rank0, rank1):
        assert r["units"] > 2 and r["summoned"] == [1] * r["units"], r["summoned"]
    assert rank0["keys"] == rank0["expected_keys"] and rank0["diff"] == 0.0
    assert rank1["keys"] == []
