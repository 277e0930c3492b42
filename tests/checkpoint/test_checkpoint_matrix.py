"""Checkpoints move between wrappers, world sizes and formats: the fixed combinations of a
randomized matrix (model with a frozen parameter, tied weights, a buffer and a 0-dim parameter;
two param groups; saved at one world size, loaded at another), each checked against the run
that never stopped, step by step; and the mismatched loads that matrix found, which must fail
with a clear error before anything changes.

One world per world size (1, 2, 4), started once for the module.
"""


import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel.fsdp_state_dict_type import (FullOptimStateDictConfig,
                                                            FullStateDictConfig, StateDictType)
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from shardkit.utils import safe_set_full_fp32_param
from tests.utils.compare import max_diff
from tests.utils.master_weights import fp32_weights

GLOBAL_BATCH, STEPS_BEFORE, STEPS_AFTER = 8, 2, 2
# fp32 on CPU: the loaded run and the uninterrupted one reduce the same numbers in the same
# order only at the same world size; across sizes the sums round differently (~1e-8 here)
TOL = 1e-6

world1 = world_fixture(1)


world2 = world_fixture(2)


world4 = world_fixture(4)


class Net(nn.Module):
    """Everything a checkpoint must carry: a frozen weight, a weight tied between two layers,
    a buffer, a 0-dim parameter; ``extra=True`` adds one more parameter (another model)."""

    def __init__(self, seed: int, extra: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.inp = nn.Linear(6, 5)
        self.mid = nn.Linear(5, 5)
        self.out = nn.Linear(5, 5)
        self.out.weight = self.mid.weight
        self.temperature = nn.Parameter(torch.tensor(0.0))
        if extra:
            self.gain = nn.Parameter(torch.ones(5))
        self.register_buffer("scale", torch.rand(5, generator=gen) + 0.5)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.inp.weight.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x)) * self.scale
        h = torch.tanh(self.mid(h)) * self.temperature.exp()
        if hasattr(self, "gain"):
            h = h * self.gain
        return self.out(h)


def _param_groups(module):
    """Weights in one group, the rest (biases, the 0-dim parameter) with another lr and decay."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if not n.endswith("weight")], "lr": 5e-3,
             "weight_decay": 0.0}]


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 5,
                                                                    generator=gen)


def _train(module, optimizer, first, steps, full_state):
    """``steps`` steps on the global batches ``first, ...`` (this rank's slice of each);
    returns the full state after each step."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    history = []
    for step in range(first, first + steps):
        x, y = _batch(step)
        optimizer.zero_grad()
        F.mse_loss(module(x[mine]), y[mine]).backward()
        optimizer.step()
        history.append({k: v.detach().clone() for k, v in full_state().items()})
    return history


def _fsdp(seed, extra=False):
    model = FSDP(Net(seed, extra))
    return model, torch.optim.AdamW(_param_groups(model), lr=1e-2, weight_decay=0.1)


# ------------------------------------------------------ FSDP: torch-format full checkpoint


def _save_torch_fsdp_format(path):
    """torch FSDP1's full checkpoint: FULL_STATE_DICT, rank 0 only, the optimizer state keyed
    by parameter names (``FSDP.optim_state_dict``)."""
    model, optimizer = _fsdp(0)
    _train(model, optimizer, 0, STEPS_BEFORE, model.state_dict)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)}
    if distributed.get_rank() == 0:
        torch.save(state, path)
    distributed.barrier()
    return _train(model, optimizer, STEPS_BEFORE, STEPS_AFTER, model.state_dict)


def _resume_through_fairscale_path(path):
    """Load it at another world size through FairScale's ``get_shard_from_optim_state_dict``,
    and refuse the same kind of dict of another model before the optimizer changes."""
    saved = torch.load(path, weights_only=True)
    other, other_optimizer = _fsdp(3, extra=True)
    _train(other, other_optimizer, 0, 1, other.state_dict)
    with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
        others = FSDP.optim_state_dict(other, other_optimizer)

    model, optimizer = _fsdp(99)
    model.load_state_dict(saved["model"])
    try:
        optimizer.load_state_dict(model.get_shard_from_optim_state_dict(others))
        refusal = "accepted"
    except ValueError as error:
        refusal = str(error)
    untouched = not optimizer.state
    optimizer.load_state_dict(model.get_shard_from_optim_state_dict(saved["optim"]))
    after = _train(model, optimizer, STEPS_BEFORE, STEPS_AFTER, model.state_dict)
    return {"after": after, "refusal": refusal, "untouched": untouched}


def test_torch_fsdp_optim_state_dict_loads_through_get_shard_at_any_world_size(
        world1, world2, world4, tmp_path):
    # Before: get_shard_from_optim_state_dict(FSDP.optim_state_dict(...)) raised
    # "ValueError: invalid literal for int() with base 10: 'mid.weight'" (the dict is keyed by
    # names), though torch optimizers, OSS and optim_state_dict_to_load take it.
    path = str(tmp_path / "full.pt")
    reference = world2.run(_save_torch_fsdp_format, path)[0]
    for world in (world4, world1):
        for r in world.run(_resume_through_fairscale_path, path):
            assert "gain" in r["refusal"] and "this model does not have" in r["refusal"], r
            assert r["untouched"], r
            diffs = [max_diff(got, want) for got, want in zip(r["after"], reference)]
            assert max(diffs) <= TOL, (world.world_size, diffs)


# ------------------------------------------------------ FSDP: local state dicts


def _local_dict_of_another_model():
    """A local state dict of another model (one more parameter; or other shapes) is refused
    under state_dict()'s keys, and nothing of this model's shards is overwritten."""
    model, _ = _fsdp(0)
    before = {k: v.clone() for k, v in model.local_state_dict().items()}
    results = {}
    wider = FSDP(nn.Sequential(nn.Linear(6, 9)))
    for what, fn in (("extra", lambda: model.load_local_state_dict(
                          _fsdp(1, extra=True)[0].local_state_dict())),
                     ("shape", lambda: FSDP(nn.Sequential(nn.Linear(6, 8))).load_local_state_dict(
                         wider.local_state_dict()))):
        try:
            fn()
            results[what] = "accepted"
        except RuntimeError as error:
            results[what] = str(error)
    after = model.local_state_dict()
    results["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
    return results


def test_local_state_dict_of_another_model_changes_nothing(world2):
    # Before: torch's strict load copied every tensor that fit and then raised naming
    # "_fsdp_wrapped_module.gain": every local tensor of the model had been overwritten.
    for r in world2.run(_local_dict_of_another_model):
        assert r["changed"] == [], r
        assert "(nothing was loaded)" in r["extra"] and '"gain"' in r["extra"], r
        assert "_fsdp_wrapped_module" not in r["extra"], r
        assert "size mismatch for 0.weight" in r["shape"] and "full shape (8, 6)" in r["shape"]


def _save_local_type(path):
    """torch FSDP1's LOCAL_STATE_DICT: each rank saves its shards and its optimizer's state."""
    model, optimizer = _fsdp(0)
    _train(model, optimizer, 0, 1, model.state_dict)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        torch.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optimizer)},
                   f"{path}.{distributed.get_rank()}")
    distributed.barrier()


def _local_type_at_another_world(path):
    """Those per-rank dicts given to a world of another size, as torch FSDP1 code does it."""
    saved = torch.load(f"{path}.{distributed.get_rank() % 2}", weights_only=True)
    model, optimizer = _fsdp(1)
    before = {k: v.clone() for k, v in model.local_state_dict().items()}
    errors = {}
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        for what, fn in (("model", lambda: model.load_state_dict(saved["model"])),
                         ("optim", lambda: FSDP.optim_state_dict_to_load(
                             model, optimizer, saved["optim"], load_directly=True))):
            try:
                fn()
                errors[what] = "accepted"
            except (RuntimeError, ValueError) as error:
                errors[what] = str(error)
    after = model.local_state_dict()
    errors["changed"] = [k for k in before if not torch.equal(before[k], after[k])]
    errors["optimizer_untouched"] = not optimizer.state
    return errors


def test_local_type_dicts_at_another_world_size_say_how_to_reshard(world2, world4, tmp_path):
    # Before, at world 4 from world 2: the model's load copied the tensors that fit and named
    # the shard sizes only; the optimizer's was accepted and the next step() failed with
    # "RuntimeError: The size of tensor a (3) must match the size of tensor b (2)".
    path = str(tmp_path / "local")
    world2.run(_save_local_type, path)
    for r in world4.run(_local_type_at_another_world, path):
        assert r["changed"] == [] and r["optimizer_untouched"], r
        assert "full shape (5, 5)" in r["model"] and "metadata=" in r["model"], r
        assert "mid.weight 'exp_avg' (3, 5) (this rank's shard: (2, 5))" in r["optim"], r
        assert "reshard_local_optim_state_dicts" in r["optim"], r


# ------------------------------------------------------ wrappers across world sizes


def _wrapped(kind, seed):
    """(module that runs the step, optimizer, full-state function) for one wrapper."""
    model = Net(seed)
    if kind == "fsdp":
        return (*_fsdp(seed), None)
    groups = _param_groups(model)
    if kind == "ddp":
        optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
        return torch.nn.parallel.DistributedDataParallel(model), optimizer, model.state_dict
    optimizer = OSS(groups, optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    from shardkit.nn.data_parallel import ShardedDataParallel
    return ShardedDataParallel(model, optimizer), optimizer, model.state_dict


def _save_full(kind, path):
    """Train, save the full (torch-format) model and optimizer state the wrapper's way, go on."""
    module, optimizer, full_state = _wrapped(kind, 0)
    full_state = full_state or module.state_dict
    _train(module, optimizer, 0, STEPS_BEFORE, full_state)
    state = {"model": full_state()}
    if kind == "fsdp":
        state["optim"] = module.gather_full_optim_state_dict(optimizer)
    elif kind == "sdp":
        optimizer.consolidate_state_dict(recipient_rank=0)
        state["optim"] = optimizer.state_dict() if distributed.get_rank() == 0 else None
    else:
        state["optim"] = optimizer.state_dict()
    if distributed.get_rank() == 0:
        torch.save(state, path)
    distributed.barrier()
    return _train(module, optimizer, STEPS_BEFORE, STEPS_AFTER, full_state)


def _load_full(kind, path):
    saved = torch.load(path, weights_only=True)
    module, optimizer, full_state = _wrapped(kind, 99)
    full_state = full_state or module.state_dict
    if kind == "fsdp":
        module.load_state_dict(saved["model"])
        optimizer.load_state_dict(module.get_shard_from_optim_state_dict(saved["optim"]))
    else:
        module.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
    return _train(module, optimizer, STEPS_BEFORE, STEPS_AFTER, full_state)


# (saving wrapper, its world, loading wrapper, its world): ZeRO-3 -> 2, 2 -> 3, 0 -> 3, 3 -> 0
WRAPPER_CASES = [("fsdp", 4, "sdp", 2), ("sdp", 2, "fsdp", 4), ("ddp", 1, "fsdp", 2),
                 ("fsdp", 2, "ddp", 1)]


def test_full_checkpoints_move_between_wrappers_and_world_sizes(
        world1, world2, world4, tmp_path):
    worlds = {1: world1, 2: world2, 4: world4}
    for i, (saver, n, loader, m) in enumerate(WRAPPER_CASES):
        path = str(tmp_path / f"{i}.pt")
        reference = worlds[n].run(_save_full, saver, path)[0]
        for r in worlds[m].run(_load_full, loader, path):
            diffs = [max_diff(got, want) for got, want in zip(r, reference)]
            assert max(diffs) <= TOL, (saver, n, loader, m, diffs)


# ------------------------------------------------------ the engine, every stage


def _engine(stage, seed, rounded=False):
    """``rounded``: the model's weights rounded to fp16 first (those a checkpoint saved at
    stages 0-2 holds: 16-bit weights, fp32 masters taken from them)."""
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 2,
              "steps_per_print": 10000, "zero_optimization": {"stage": stage},
              "fp16": {"enabled": True, "initial_scale_power": 18, "hysteresis": 1,
                       "loss_scale_window": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 5,
                                                           "warmup_type": "linear"}}}
    model = Net(seed)
    if rounded:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.half().float())
    engine, *_ = shardkit.initialize(model=model, model_parameters=_param_groups(model),
                                     config=config)
    return engine


def _engine_steps(engine, first, steps):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    history = []
    for step in range(first, first + steps):
        x, y = _batch(step)
        for xb, yb in zip(x[mine].split(2), y[mine].split(2)):
            engine.backward(F.mse_loss(engine(xb).float(), yb))
            engine.step()
        if engine.zero_stage == 3:
            state = engine.wrapped.state_dict()
        else:  # 16-bit weights: the fp32 masters are the weights trained
            state = {**engine.module.state_dict(), **fp32_weights(engine)}
        history.append({"state": {k: v.detach().float().clone() for k, v in state.items()},
                        "counters": (engine.global_steps, engine.skipped_steps,
                                     engine.loss_scale, engine.get_lr())})
    return history


def _engine_save(save_dir, stage, before=False, start_as=None):
    """The steps after the save (``before``: the steps before it, and those after).
    ``start_as``: the stage whose initial weights to start from (the model's fp32 ones at
    stage 3; at stages 0-2, where ``initialize`` takes the fp32 masters from the 16-bit
    weights as DeepSpeed does, those rounded to fp16)."""
    start_as = stage if start_as is None else start_as
    engine = _engine(stage, 0, rounded=start_as < 3)
    if start_as == 3 and stage < 3:  # the fp32 masters set to the exact fp32 weights
        for param, value in zip(engine.module.parameters(), Net(0).parameters()):
            if param.requires_grad:
                safe_set_full_fp32_param(param, value.detach())
    history = _engine_steps(engine, 0, STEPS_BEFORE)
    engine.save_checkpoint(save_dir, async_save=True)
    engine.wait_for_checkpoint()
    after = _engine_steps(engine, STEPS_BEFORE, STEPS_AFTER)
    return (history, after) if before else after


def _engine_load(save_dir, stage):
    engine = _engine(stage, 99)
    engine.load_checkpoint(save_dir)
    return _engine_steps(engine, STEPS_BEFORE, STEPS_AFTER)


def test_fp16_engine_resumes_its_skips_scale_and_schedule_at_another_stage(
        world2, world4, tmp_path):
    # initial scale 2**18 overflows fp16 here: steps are skipped and the scale halves before
    # the save (every step before it: the weights saved are the initial ones), alike at the
    # saving and the loading stage. After it the gradients' precision decides the overflows:
    # 16-bit at stages 0-2 (16-bit weights), fp32 at stage 3, so the resumed run must skip,
    # scale, schedule and train exactly as the uninterrupted run at the loading stage does
    # from the same fp32 weights. Same world size: the overflow depends on the accumulation
    # steps (the loss is divided by them before it is scaled), which the world size changes.
    for world, s, t in ((world2, 3, 1), (world4, 2, 3)):
        save_dir = str(tmp_path / f"s{s}")
        saved_before, saved_after = world.run(_engine_save, save_dir, s, True)[0]
        before, reference = world.run(_engine_save, str(tmp_path / f"t{t}"), t, True, s)[0]
        assert [b["counters"] for b in saved_before] == [b["counters"] for b in before]
        assert all(b["counters"][1] == b["counters"][0] for b in before), before
        for run in (saved_after, reference):
            skipped = [step["counters"][1] for step in run]
            assert 0 < before[-1]["counters"][1] <= skipped[0], skipped
            assert skipped[-1] < run[-1]["counters"][0], skipped
        for r in world.run(_engine_load, save_dir, t):
            for got, want in zip(r, reference):
                assert got["counters"] == want["counters"], (s, t)
                assert max_diff(got["state"], want["state"]) <= TOL, (s, t)


# ------------------------------------------------------ the engine, ranks that disagree


def _load_where_ranks_disagree(save_dir):
    """Two checkpoints (tags a and b); rank 1 asks for another tag than rank 0, then reads a
    node-local copy whose ``latest`` names the other one. Returns, per attempt, the error and
    whether anything of the engine changed."""
    import shutil
    engine = _engine(0, 0)
    _engine_steps(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="a")
    _engine_steps(engine, 1, 1)
    engine.save_checkpoint(save_dir, tag="b")
    rank = distributed.get_rank()
    local = f"{save_dir}-node{rank}"
    if rank == 1:
        shutil.copytree(save_dir, local)
        with open(f"{local}/latest", "w") as f:
            f.write("a")
    distributed.barrier()
    fresh = _engine(0, 99)
    before = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    results = {}
    for what, load_dir, tag in (("tag", save_dir, "ab"[rank]),
                                ("latest", local if rank == 1 else save_dir, None)):
        try:
            fresh.load_checkpoint(load_dir, tag=tag)
            results[what] = "loaded"
        except shardkit.checkpoint.CheckpointError as error:
            results[what] = str(error)
    results["unchanged"] = max_diff(fresh.module.state_dict(), before) == 0 \
        and fresh.global_steps == 0
    return results


def test_ranks_that_resolve_different_checkpoints_load_nothing(world2, tmp_path):
    # Before: rank 0 loaded tag a (global step 1) and rank 1 tag b (step 2), each its own
    # weights and counters, silently: the replicas then trained apart.
    for rank, r in enumerate(world2.run(_load_where_ranks_disagree, str(tmp_path / "ckpt"))):
        assert r["unchanged"], r
        for what in ("tag", "latest"):
            assert "the ranks resolved different checkpoints" in r[what], (what, r)
        assert f"tag {'ab'[rank]!r} at global step {1 + rank}" in r["tag"], r
        assert f"tag {'ba'[rank]!r}" in r["latest"], r


# ------------------------------------------------------ zero_to_fp32 into a used directory


def _two_tags(save_dir):
    """Tag a, then tag b one fp32 SGD step later."""
    model = Net(0)
    engine, *_ = shardkit.initialize(model=model, config={
        "train_batch_size": GLOBAL_BATCH, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.save_checkpoint(save_dir, tag="a")
    x, y = _batch(0)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(save_dir, tag="b")


def test_failed_sharded_conversion_leaves_the_earlier_one_whole(world1, tmp_path, monkeypatch):
    # Before: the disk filled up while the second shard of tag b was written over tag a's
    # conversion: b's first shard, a's other shards and a's index loaded as one model.
    import json
    import os
    from shardkit.utils import zero_to_fp32
    save_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    world1.run(_two_tags, save_dir)
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="a")
    assert max_diff(want, zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
        save_dir, tag="b")) > 0
    first = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
        save_dir, out, max_shard_size=100, tag="a")
    assert len(first) > 3, first  # an index and at least three shards
    write, calls = zero_to_fp32._write_file, []

    def disk_full_at_the_second_shard(tensors, path, safe):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        write(tensors, path, safe)

    monkeypatch.setattr(zero_to_fp32, "_write_file", disk_full_at_the_second_shard)
    try:
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(save_dir, out,
                                                                max_shard_size=100, tag="b")
        raise AssertionError("the conversion did not fail")
    except OSError:
        pass
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in first)
    with open(os.path.join(out, "pytorch_model.bin.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    got = {}
    for file in sorted(files):
        got.update(torch.load(os.path.join(out, file), weights_only=True))
    assert set(got) == set(want) and max_diff(got, want) == 0


# ------------------------------------------------------ a module's extra state


class _Counting(nn.Linear):
    """A layer with ``get_extra_state`` (a dict, not a tensor): how many forwards it ran."""

    def __init__(self):
        super().__init__(6, 5)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


def _extra_state_round_trip(save_dir):
    """Saved at stage 1, loaded at stages 0 and 2: the weights and the extra state."""
    config = {"train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}

    def build(stage, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(_Counting(), nn.Tanh(), nn.Linear(5, 5))
        return shardkit.initialize(model=model, config={
            **config, "zero_optimization": {"stage": stage}})[0], model

    engine, model = build(1, 0)
    x, y = _batch(0)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    engine.save_checkpoint(save_dir)
    results = []
    for stage in (0, 2):
        other, other_model = build(stage, 1)
        try:
            other.load_checkpoint(save_dir)
        except Exception as error:  # noqa: BLE001 - reported to the test
            results.append(f"{type(error).__name__}: {error}")
            continue
        tensors = [(k, v) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)]
        got = other_model.state_dict()
        results.append((other_model[0].calls, max_diff({k: got[k] for k, _ in tensors},
                                                       dict(tensors))))
    return results


def test_module_extra_state_loads_at_every_stage_and_converts(world2, tmp_path):
    # Before: load_checkpoint at stages 0-2 raised "AttributeError: 'dict' object has no
    # attribute 'shape'" on every rank for a model with get_extra_state (saving worked), and
    # convert_zero_checkpoint_to_fp32_state_dict / `python -m shardkit consolidate` raised
    # "'dict' object has no attribute 'numel'".
    import os
    from shardkit.checkpoint.consolidate import main as consolidate
    from shardkit.utils import zero_to_fp32
    save_dir = str(tmp_path / "ckpt")
    for r in world2.run(_extra_state_round_trip, save_dir):
        assert r == [(1, 0.0), (1, 0.0)], r
    want = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert want["0._extra_state"] == {"calls": 1}
    for kwargs in ({}, {"max_shard_size": 64}):
        out = str(tmp_path / f"hf{len(kwargs)}")
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(save_dir, out, **kwargs)
        got = {}
        for file in os.listdir(out):
            if file.endswith(".bin"):
                got.update(torch.load(os.path.join(out, file), weights_only=True))
        assert got.keys() == want.keys() and got["0._extra_state"] == {"calls": 1}, kwargs
    try:
        zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "st"),
                                                                safe_serialization=True)
        refusal = "accepted"
    except ValueError as error:
        refusal = str(error)
    assert "['0._extra_state']" in refusal and not os.path.exists(tmp_path / "st"), refusal
    assert consolidate([save_dir, str(tmp_path / "model.pt")]) == 0
    model = nn.Sequential(_Counting(), nn.Tanh(), nn.Linear(5, 5))
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    assert model[0].calls == 1


def _samples_after_a_batch_size_change(save_dir):
    """Two steps at batch 8, one at 16 (set_train_batch_size), saved; loaded into a fresh
    engine (batch 8), then one more step; and a warm start (load_module_only) of a fresh one."""
    engine = _engine(1, 0)
    _engine_steps(engine, 0, 2)
    engine.set_train_batch_size(2 * GLOBAL_BATCH)
    x, y = _batch(2)
    for _ in range(engine.gradient_accumulation_steps()):
        engine.backward(F.mse_loss(engine(x[:2]).float(), y[:2]))
        engine.step()
    saved = engine.global_samples
    engine.save_checkpoint(save_dir)
    resumed = _engine(1, 99)
    resumed.load_checkpoint(save_dir)
    loaded = resumed.global_samples
    _engine_steps(resumed, 3, 1)
    warm = _engine(1, 99)
    warm.load_checkpoint(save_dir, load_module_only=True)
    return saved, loaded, resumed.global_samples, warm.global_samples


def test_global_samples_resume_as_saved_after_a_batch_size_change(world2, tmp_path):
    # Before: the loaded engine counted every saved step at its own batch size (24, not 32),
    # where DeepSpeed restores the checkpoint's global_samples.
    for r in world2.run(_samples_after_a_batch_size_change, str(tmp_path / "ckpt")):
        assert r == (32, 32, 40, 0), r


def _load_where_16_bit_codes_collide(save_dir):
    """Tags global_step21000 and global_step146000 (a save every 500 steps) share the low 16
    bits of their identity's crc32; rank 1 asks for the other one."""
    engine = _engine(0, 0)
    for steps in (21000, 146000):
        engine.global_steps = steps
        engine.save_checkpoint(save_dir)
    fresh = _engine(0, 99)
    try:
        fresh.load_checkpoint(save_dir, tag=["global_step146000", "global_step21000"][
            distributed.get_rank()])
        return "loaded"
    except shardkit.checkpoint.CheckpointError as error:
        return str(error)


def test_ranks_whose_checkpoints_share_16_bits_of_code_load_nothing(world2, tmp_path):
    # Before: a 16-bit code: both ranks loaded, each its own checkpoint (1 pair in 65536).
    for r in world2.run(_load_where_16_bit_codes_collide, str(tmp_path / "ckpt")):
        assert "the ranks resolved different checkpoints" in r, r


class _Serialized(_Counting):
    """``get_extra_state`` as Transformer Engine's: a uint8 tensor whose length varies."""

    def get_extra_state(self):
        return torch.zeros(self.calls, dtype=torch.uint8)

    def set_extra_state(self, state):
        self.calls = state.numel()


def _tensor_extra_state_at_stage_3(save_dir):
    def build(stage, seed):
        torch.manual_seed(seed)
        model = nn.Sequential(_Serialized(), nn.Tanh(), nn.Linear(5, 5))
        return shardkit.initialize(model=model, config={
            "train_batch_size": GLOBAL_BATCH, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}})[0], model
    engine, _ = build(3, 0)
    x, y = _batch(0)
    engine.backward(F.mse_loss(engine(x[:4]), y[:4]))
    engine.step()
    engine.save_checkpoint(save_dir)
    calls = []
    for stage in (3, 1):
        other, model = build(stage, 1)
        other.load_checkpoint(save_dir)
        calls.append(model[0].calls)
    return calls


def test_tensor_extra_state_of_another_length_loads_at_stage_3(world2, tmp_path):
    # Before: FSDP's local load refused "size mismatch for 0._extra_state" (its length is
    # the serialized state's, not a shape to check; torch's load_state_dict does not).
    for r in world2.run(_tensor_extra_state_at_stage_3, str(tmp_path / "ckpt")):
        assert r == [1, 1], r
