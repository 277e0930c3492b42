"""Engine checkpoints reshard across world sizes and ZeRO stages, commit atomically, and
consolidate into a plain state_dict.

The reference is one uninterrupted run at world 2, stage 3: it saves after 3 steps and goes on
for 5 more. The checkpoint is then loaded at world 1 stage 0 and at world 4 stage 1, and the
next 5 steps must give the same parameters (same global batches; gradient accumulation makes up
the difference in world size). A stage-3 load keeps only its own rows of what it reads: checked
from checkpoints of stages 0, 1 and 3 at world sizes 1, 2 and 4 into stage 3 at 2 and 4.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.checkpoint import read_latest_tag
from shardkit.checkpoint.resharding import ParamLayout, shard_rows
from shardkit.checkpoint.sharded import CheckpointError, file_digest, read_checkpoint
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.testing import world_fixture
from shardkit.utils.memory import tensor_storage_bytes
from tests.utils.compare import max_diff

TINY = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=8)
# rows that 2 and 4 ranks do not divide (61, 7, 3 x 30): FSDP pads its last row blocks
UNEVEN = GPTConfig(vocab_size=61, n_layer=1, n_head=2, d_model=30, seq_len=7)
GLOBAL_BATCH, MICRO = 8, 2
STEPS_BEFORE, STEPS_AFTER = 3, 5


world1 = world_fixture(1)


world2 = world_fixture(2)


world4 = world_fixture(4)


def _config(stage):
    # eps 1e-6: see tests/test_engine.py (AdamW amplifies rounding noise of zero gradients).
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.05, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-6}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 6,
                                                         "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}}


def _train_steps(engine, first_step, steps, cfg=TINY):
    """Run ``steps`` optimizer steps on the global batches ``first_step, ...``; return the full
    fp32 parameters after each step (collective at stage 3)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    per_rank = GLOBAL_BATCH // world
    history = []
    for step in range(first_step, first_step + steps):
        idx, tgt = synthetic_batch(cfg, GLOBAL_BATCH, step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for x, y in zip(idx[mine].split(MICRO), tgt[mine].split(MICRO)):
            logits = engine(x)
            engine.backward(F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1)))
            engine.step()
        history.append(_full_state(engine))
    return history


def _full_state(engine):
    if engine.zero_stage == 3:
        return {k: v.clone() for k, v in engine.wrapped.state_dict().items()}
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _reference_run(save_dir):
    engine, _, _, _ = shardkit.initialize(model=GPT(TINY, seed=0), config=_config(3))
    _train_steps(engine, 0, STEPS_BEFORE)
    at_save = _full_state(engine)
    with distributed.CommCounter() as comm:
        path = engine.save_checkpoint(save_dir, client_state={"epoch": 7})
    after = _train_steps(engine, STEPS_BEFORE, STEPS_AFTER)
    return {"path": path, "at_save": at_save, "after": after, "lr": engine.get_lr(),
            "save_comm": comm.calls_by_op} if distributed.get_rank() == 0 else None


def _resumed_run(save_dir, stage):
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    engine, _, _, scheduler = shardkit.initialize(model=GPT(TINY, seed=99), config=_config(stage))
    path, client_state = engine.load_checkpoint(save_dir)
    resumed_at = (engine.global_steps, scheduler.last_batch_iteration)
    after = _train_steps(engine, STEPS_BEFORE, STEPS_AFTER)
    return {"path": path, "client_state": client_state, "resumed_at": resumed_at,
            "after": after, "lr": engine.get_lr(), "gas": engine.gradient_accumulation_steps()}


def test_stage3_world2_checkpoint_resumes_at_world1_stage0_and_world4_stage1(
        world1, world2, world4, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    reference = world2.run(_reference_run, save_dir)[0]
    assert reference["path"] == os.path.join(save_dir, f"global_step{STEPS_BEFORE}")
    assert read_latest_tag(save_dir) == f"global_step{STEPS_BEFORE}"
    # Saving gathers nothing: the tags compared across ranks (checkpoint.tag_validation,
    # "Warn" by default), then three one-element agreement all-reduces and one barrier
    assert reference["save_comm"] == {"all_gather": 1, "barrier": 1, "all_reduce": 3}
    # Stage 3 writes each rank's own row blocks (parameters and Adam state): two similar files.
    files = [torch.load(os.path.join(reference["path"], f"rank_0000{r}.pt"), weights_only=True)
             for r in range(2)]
    numels = [sum(t.numel() for t in f["row_blocks"].values()) for f in files]
    assert min(numels) == max(numels) > 0
    assert all(set(f["optim"]) == set(f["row_blocks"]) for f in files)

    for world, stage, gas in ((world1, 0, 4), (world4, 1, 1), (world1, 3, 4)):
        results = world.run(_resumed_run, save_dir, stage)
        for r in results:
            assert r["path"] == reference["path"] and r["client_state"] == {"epoch": 7}
            assert r["resumed_at"] == (STEPS_BEFORE, STEPS_BEFORE - 1) and r["gas"] == gas
            assert r["lr"] == pytest.approx(reference["lr"])
        diffs = [max_diff(got, want)
                 for got, want in zip(results[0]["after"], reference["after"])]
        assert max(diffs) <= 1e-5, (world.world_size, stage, diffs)

    # python -m shardkit consolidate DIR OUT.pt: a plain state_dict of the unwrapped model
    out = str(tmp_path / "model.pt")
    from shardkit.__main__ import main
    assert main(["consolidate", save_dir, out]) == 0
    plain = GPT(TINY, seed=5)
    plain.load_state_dict(torch.load(out))
    assert max_diff(plain.state_dict(), reference["at_save"]) == 0.0
    # an output that cannot be written is a one-line error and leaves no file behind
    assert main(["consolidate", save_dir, str(tmp_path / "no_such_dir" / "model.pt")]) == 2
    assert not (tmp_path / "no_such_dir").exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "model.pt"]


def _warm_start_and_longer_schedule(save_dir):
    """DeepSpeed's two ways back into a checkpoint with a new config: ``load_module_only``
    (fine-tuning: the weights, nothing of the run's position) and a full load into a longer
    schedule (the iteration is restored, the schedule is the new config's)."""
    world = distributed.get_world_size()

    def config(total):
        return {"train_batch_size": 2 * world, "steps_per_print": 1000,
                "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 1},
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "scheduler": {"type": "WarmupDecayLR", "params": {
                    "total_num_steps": total, "warmup_max_lr": 0.1, "warmup_num_steps": 2,
                    "warmup_type": "linear"}},
                "zero_optimization": {"stage": 2}}

    torch.manual_seed(0)
    engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config(10))
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    engine.save_checkpoint(save_dir)
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}

    warm, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config(10))
    scale = warm.loss_scale
    warm.load_checkpoint(save_dir, load_module_only=True, load_module_strict=True)
    # load_module_strict=False (HF Trainer's PEFT resume): a model with one more tensor keeps
    # it, takes the rest; its optimizer state cannot be matched and is refused by name
    torch.manual_seed(1)
    bigger = torch.nn.Linear(4, 2)
    bigger.register_parameter("adapter", torch.nn.Parameter(torch.ones(2)))
    partial, *_ = shardkit.initialize(model=bigger, config=config(10))
    try:
        partial.load_checkpoint(save_dir, None, False)
        not_strict = "accepted"
    except CheckpointError as error:
        not_strict = str(error)
    partial.load_checkpoint(save_dir, None, False, load_optimizer_states=False)
    kept = {"adapter": partial.module.adapter.detach().tolist(),
            "weights": max(max_diff({k: v for k, v in partial.module.state_dict().items()
                                     if k != "adapter"}, saved), 0.0)}
    longer, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config(20))
    longer.load_checkpoint(save_dir)
    longer.backward(longer(torch.randn(2, 4)).square().mean())
    longer.step()
    return {"weights": max_diff(warm.module.state_dict(), saved),
            "warm": (warm.global_steps, warm.skipped_steps, warm.micro_steps,
                     warm.lr_scheduler.last_batch_iteration, warm.loss_scale == scale),
            "longer_lr": longer.get_lr()[0], "longer_steps": longer.global_steps,
            "not_strict": not_strict, "partial": kept}


def test_load_module_only_is_a_warm_start_and_a_resumed_schedule_is_the_new_configs(
        world2, tmp_path):
    for r in world2.run(_warm_start_and_longer_schedule, str(tmp_path / "ckpt")):
        assert r["weights"] == 0.0, r
        # DeepSpeed: load_module_only leaves global_steps, skipped_steps, the loss scale and
        # the scheduler where a new run starts
        assert r["warm"] == (0, 0, 0, -1, True), r
        assert "load_optimizer_states=False" in r["not_strict"], r
        assert "'adapter'" in r["not_strict"], r
        assert r["partial"] == {"adapter": [1.0, 1.0], "weights": 0.0}, r
        # iteration 4 of WarmupDecayLR(total 20, warmup 2): 0.1 * (20 - 4) / 18, not the saved
        # schedule's 0.1 * (10 - 4) / 8
        assert r["longer_steps"] == 5 and r["longer_lr"] == pytest.approx(0.1 * 16 / 18), r


def _unloadable_client_state(save_dir):
    """A DeepSpeed script's habit, ``client_state={"args": args}``: the checkpoint would be
    written but never load (weights_only=True), so the save refuses it on every rank first."""
    import argparse
    engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config={
        "train_batch_size": 2 * distributed.get_world_size(),
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        engine.save_checkpoint(save_dir, client_state={"step": 3,
                                                       "args": argparse.Namespace(lr=0.1)})
        refused = "accepted"
    except TypeError as error:
        refused = str(error)
    written = sorted(os.listdir(save_dir)) if os.path.isdir(save_dir) else []
    engine.save_checkpoint(save_dir, client_state={"step": 3, "args": {"lr": 0.1}})
    return refused, written, engine.load_checkpoint(save_dir)[1]


def test_client_state_that_would_not_load_back_is_refused_before_writing(world2, tmp_path):
    for refused, written, loaded in world2.run(_unloadable_client_state, str(tmp_path / "c")):
        assert "client_state['args'] (Namespace)" in refused, refused
        assert "argparse.Namespace" in refused and "nothing was written" in refused, refused
        assert written == [], written
        assert loaded == {"step": 3, "args": {"lr": 0.1}}


def _resume_without_optimizer_state(save_dir, schedule):
    """``load_checkpoint(load_optimizer_states=False)`` (a new optimizer setting, DeepSpeed's
    way): right after the load, and at every step after it, the optimizer holds the lr (and
    OneCycle's beta1) of the uninterrupted run, not those a fresh schedule starts from."""
    world = distributed.get_world_size()
    config = {"train_batch_size": 2 * world, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}},
              "scheduler": schedule, "zero_optimization": {"stage": 1}}

    def batch(step):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(2 * world, 4, generator=gen)
        return x[2 * distributed.get_rank():][:2]

    def run(engine, steps):
        lrs = []
        for step in steps:
            engine.backward(engine(batch(step)).square().mean())
            engine.step()
            lrs.append((engine.get_lr(), engine.get_mom()))
        return lrs

    torch.manual_seed(0)
    engine, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config)
    run(engine, range(3))
    engine.save_checkpoint(save_dir)
    before = (engine.get_lr(), engine.get_mom())
    after = run(engine, range(3, 6))
    resumed, *_ = shardkit.initialize(model=torch.nn.Linear(4, 2), config=config)
    resumed.load_checkpoint(save_dir, load_optimizer_states=False)
    loaded = (resumed.get_lr(), resumed.get_mom())
    return before, loaded, after, run(resumed, range(3, 6))


@pytest.mark.parametrize("schedule", [
    {"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 2}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                                    "cycle_first_step_size": 2, "cycle_min_mom": 0.8,
                                    "cycle_max_mom": 0.9}}])
def test_resume_without_optimizer_state_continues_the_schedule(world2, tmp_path, schedule):
    for before, loaded, after, resumed_after in world2.run(
            _resume_without_optimizer_state, str(tmp_path / schedule["type"]), schedule):
        assert loaded == before  # not the fresh schedule's 0 (cosine) or cycle_min_lr
        assert resumed_after == after


def _load_keeps_this_ranks_optimizer_share(save_dir, save_stage):
    """At stages 1-2 a rank keeps only its OSS share of the optimizer state while it reads the
    checkpoint (not every rank's), whatever stage wrote it; training then goes on exactly as
    the uninterrupted run does."""
    from shardkit.checkpoint import engine_state
    world = distributed.get_world_size()
    config = {"train_batch_size": 4 * world, "train_micro_batch_size_per_gpu": 2,
              "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}}

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                                   torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def run(engine, steps):
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(4 * world, 4, generator=gen)[4 * distributed.get_rank():][:4]
            for micro in x.split(2):
                engine.backward(engine(micro).square().mean())
                engine.step()
        return _full_state(engine)

    saver, *_ = shardkit.initialize(model=net(), config={
        **config, "zero_optimization": {"stage": save_stage}})
    run(saver, range(2))
    saver.save_checkpoint(save_dir)
    uninterrupted = run(saver, range(2, 4))
    engine, *_ = shardkit.initialize(model=net(), config={**config,
                                                          "zero_optimization": {"stage": 2}})
    held, read = [], engine_state.read_checkpoint

    def recording_read(*args, **kwargs):
        ckpt = read(*args, **kwargs)
        held.append(sorted(ckpt.optim))
        return ckpt

    engine_state.read_checkpoint = recording_read
    try:
        engine.load_checkpoint(save_dir)
    finally:
        engine_state.read_checkpoint = read
    owned = sorted(n for n, p in engine.module.named_parameters()
                   if engine.optimizer.param_to_rank[p] == distributed.get_rank())
    return held, owned, max_diff(run(engine, range(2, 4)), uninterrupted)


@pytest.mark.parametrize("save_stage", [2, 3])
def test_stage2_load_holds_only_this_ranks_optimizer_state(world2, tmp_path, save_stage):
    results = world2.run(_load_keeps_this_ranks_optimizer_share, str(tmp_path / "c"),
                         save_stage)
    for held, owned, diff in results:
        assert held == [owned], (held, owned)
        assert diff <= 1e-6, diff
    assert sorted(results[0][1] + results[1][1]) == sorted(
        f"{i}.{kind}" for i in (0, 2, 4) for kind in ("weight", "bias"))


def _uneven_saved_run(save_dir, stage):
    """Train UNEVEN 3 steps at ``stage``, save, train 2 more; rank 0 returns those 2 steps."""
    engine, *_ = shardkit.initialize(model=GPT(UNEVEN, seed=0), config=_config(stage))
    _train_steps(engine, 0, 3, UNEVEN)
    engine.save_checkpoint(save_dir)
    after = _train_steps(engine, 3, 2, UNEVEN)
    return after if distributed.get_rank() == 0 else None


def _tensor_bytes(*dicts):
    return tensor_storage_bytes(t for d in dicts for v in d.values()
                                for t in (v.values() if isinstance(v, dict) else [v]))


def _stage3_load_of_own_rows(save_dir):
    """Load ``save_dir`` into a fresh stage-3 engine. Returns the bytes of the tensors the read
    kept and of the whole checkpoint, the largest difference between what was loaded and what
    the full checkpoint's rows for this rank are (today's merge-then-slice), and 2 more steps."""
    from shardkit.checkpoint import engine_state
    torch.manual_seed(123)
    engine, *_ = shardkit.initialize(model=GPT(UNEVEN, seed=99), config=_config(3))
    held, read = [], engine_state.read_checkpoint

    def recording_read(*args, **kwargs):
        ckpt = read(*args, **kwargs)
        held.append(_tensor_bytes(ckpt.params, ckpt.optim))
        return ckpt

    engine_state.read_checkpoint = recording_read
    try:
        path, _ = engine.load_checkpoint(save_dir)
    finally:
        engine_state.read_checkpoint = read
    full = read_checkpoint(path)
    meta = engine.wrapped.local_metadata_dict()
    rank, diff = meta["rank"], 0.0
    for name, p in engine.wrapped.named_parameters():
        layout = ParamLayout(torch.Size(meta["shapes"][name]), meta["world_size"])
        diff = max(diff, max_diff([p], [shard_rows(full.params[name], layout, rank)]))
        for key, value in engine.optimizer.state[p].items():
            saved = full.optim[name][key]
            if value.dim():
                saved = shard_rows(saved, layout, rank)
            diff = max(diff, max_diff([value], [saved]))
    return {"held": held[0], "full": _tensor_bytes(full.params, full.optim), "diff": diff,
            "after": _train_steps(engine, 3, 2, UNEVEN)}


def test_stage3_load_keeps_only_this_ranks_rows_from_any_saved_stage_and_world(
        world1, world2, world4, tmp_path):
    for saver, stage in ((world1, 0), (world4, 1), (world2, 3)):
        save_dir = str(tmp_path / f"w{saver.world_size}s{stage}")
        uninterrupted = saver.run(_uneven_saved_run, save_dir, stage)[0]
        for loader in (world2, world4):
            results = loader.run(_stage3_load_of_own_rows, save_dir)
            n = loader.world_size
            for r in results:
                # bit for bit what merging every file and cutting this rank's rows gives
                assert r["diff"] == 0.0, (saver.world_size, stage, n, r["diff"])
                # 1/N of the weights and Adam state, plus the padding of the last blocks
                assert r["held"] <= r["full"] / n * 1.1, (saver.world_size, stage, n,
                                                          r["held"], r["full"])
            diffs = [max_diff(got, want)
                     for got, want in zip(results[0]["after"], uninterrupted)]
            assert max(diffs) <= 1e-5, (saver.world_size, stage, n, diffs)

    # Adam state of another shape than its parameter's rows is refused while reading (before
    # the ranks agree, so on every rank, nothing loaded), naming the tensor and the key
    save_dir = str(tmp_path / "w2s3")
    path = os.path.join(save_dir, read_latest_tag(save_dir))
    rank_file = os.path.join(path, "rank_00001.pt")
    shard = torch.load(rank_file, weights_only=True)
    shard["optim"]["pos_emb.weight"]["exp_avg"] = shard["optim"]["pos_emb.weight"][
        "exp_avg"].flatten()
    torch.save(shard, rank_file)
    with open(os.path.join(path, "metadata.json")) as f:
        metadata = json.load(f)
    metadata["files"]["rank_00001.pt"] = file_digest(rank_file)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(metadata, f)
    layouts = {name: ParamLayout(torch.Size(shape), 4)
               for name, shape in metadata["row_sharded"].items()}
    with pytest.raises(CheckpointError, match=r"'exp_avg' of pos_emb.weight has shape \(120,\)"):
        read_checkpoint(path, keep_rows=lambda name: (layouts[name], 1))


def _scheduler_switched_on_resume(save_dir):
    """A resumed run configured with another scheduler: torch's StepLR cannot take WarmupLR's
    state (its load copies every saved attribute: a hybrid of both), so the load is refused on
    every rank before anything changes; ``load_lr_scheduler_states=False`` starts the new one
    fresh; shardkit's DeepSpeed schedules take the saved position from any (DeepSpeed's rule)."""
    world = distributed.get_world_size()

    def engine_with(schedule):
        torch.manual_seed(distributed.get_rank())  # other weights than the saved ones
        return shardkit.initialize(model=torch.nn.Linear(4, 2), config={
            "train_batch_size": world, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "scheduler": schedule})[0]

    saved = engine_with({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1,
                                                        "warmup_num_steps": 10}})
    for _ in range(3):
        saved.backward(saved(torch.ones(1, 4)).sum())
        saved.step()
    saved.save_checkpoint(save_dir)
    step_lr = engine_with({"type": "StepLR", "params": {"step_size": 2}})
    weight_before = step_lr.module.weight.detach().clone()
    try:
        step_lr.load_checkpoint(save_dir)
        refusal = None
    except CheckpointError as error:
        refusal = str(error)
    untouched = torch.equal(step_lr.module.weight, weight_before)
    step_lr.load_checkpoint(save_dir, load_lr_scheduler_states=False)
    fresh = (type(step_lr.lr_scheduler).__name__, step_lr.lr_scheduler.last_epoch,
             sorted(vars(step_lr.lr_scheduler)) == sorted(vars(engine_with(
                 {"type": "StepLR", "params": {"step_size": 2}}).lr_scheduler)))
    cosine = engine_with({"type": "WarmupCosineLR",
                          "params": {"total_num_steps": 20, "warmup_num_steps": 10}})
    cosine.load_checkpoint(save_dir)
    return refusal, untouched, fresh, cosine.lr_scheduler.last_batch_iteration


def test_a_torch_scheduler_refuses_another_schedulers_state(world2, tmp_path):
    for refusal, untouched, fresh, cosine_position in world2.run(
            _scheduler_switched_on_resume, str(tmp_path)):
        assert "saved by WarmupLR" in refusal and "StepLR" in refusal
        assert "load_lr_scheduler_states=False" in refusal and untouched
        assert fresh == ("StepLR", 0, True)
        assert cosine_position == 2


def _composite_or_positionless_scheduler_state(save_dir):
    """SequentialLR / ChainedScheduler load each saved inner state into the inner scheduler at
    its index: other inner classes (LinearLR's state into ConstantLR, StepLR's into
    ExponentialLR) became a hybrid, a longer saved list an IndexError after the weights were
    loaded; a script's own scheduler's state without a position made WarmupLR raise KeyError
    after the weights were loaded. Each is refused before anything loads."""
    from torch.optim import lr_scheduler as torch_lr

    class CountingSchedule:  # a script's own scheduler: step() and state_dict() only
        def __init__(self, optimizer):
            self.optimizer, self.count = optimizer, 0

        def step(self):
            self.count += 1

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):
            self.count = state["count"]

    def sequential(optimizer, first, then):
        return torch_lr.SequentialLR(optimizer, [first(optimizer), then(optimizer)], [3])

    def linear_then_step(optimizer):
        return sequential(optimizer, lambda o: torch_lr.LinearLR(o, 0.1, total_iters=3),
                          lambda o: torch_lr.StepLR(o, 2))

    def constant_then_exponential(optimizer):
        return sequential(optimizer, lambda o: torch_lr.ConstantLR(o, 0.5, total_iters=3),
                          lambda o: torch_lr.ExponentialLR(o, 0.5))

    def warmup(optimizer):
        from shardkit.optim.lr_scheduler import WarmupLR
        return WarmupLR(optimizer, warmup_max_lr=0.1)

    def engine_with(schedule):
        torch.manual_seed(distributed.get_rank())
        model = torch.nn.Linear(4, 2)
        return shardkit.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            lr_scheduler=schedule, config={"train_batch_size": distributed.get_world_size(),
                                           "steps_per_print": 1000})[0]

    def counting(optimizer):
        return CountingSchedule(optimizer)

    outcomes = []
    for saved_with, loaded_with in ((linear_then_step, constant_then_exponential),
                                    (counting, warmup)):
        saved = engine_with(saved_with)
        for _ in range(4):
            saved.backward(saved(torch.ones(1, 4)).sum())
            saved.step()
        path = os.path.join(save_dir, saved_with.__name__)
        saved.save_checkpoint(path)
        engine = engine_with(loaded_with)
        weight_before = engine.module.weight.detach().clone()
        try:
            engine.load_checkpoint(path)
            refusal = "accepted"
        except CheckpointError as error:
            refusal = str(error)
        outcomes.append((refusal, torch.equal(engine.module.weight, weight_before)))
    return outcomes


def test_composite_and_positionless_scheduler_states_are_refused(world2, tmp_path):
    for (composite, untouched), (positionless, untouched_too) in world2.run(
            _composite_or_positionless_scheduler_state, str(tmp_path)):
        assert "saved by SequentialLR(LinearLR, StepLR)" in composite, composite
        assert "is SequentialLR(ConstantLR, ExponentialLR)" in composite and untouched
        assert "saved by CountingSchedule and holds no position" in positionless, positionless
        assert untouched_too


def _load_slips(save_dir):
    """What ``load_checkpoint`` says for the easy slips: one tag's own directory, a directory
    whose ``latest`` file is gone, and ``tag="latest"``."""
    import logging
    engine, _, _, _ = shardkit.initialize(model=GPT(TINY, seed=0), config=_config(1))
    _train_steps(engine, 0, 1)
    engine.save_checkpoint(save_dir, tag="global_step1")
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("shardkit").addHandler(handler)
    try:
        out = {"tag_dir": (engine.load_checkpoint(os.path.join(save_dir, "global_step1")),
                           messages[-1])}
        try:
            engine.load_checkpoint(save_dir, tag="latest")
        except CheckpointError as error:
            out["tag_latest"] = str(error)
        os.remove(os.path.join(save_dir, "latest"))
        out["no_latest"] = (engine.load_checkpoint(save_dir), messages[-1])
    finally:
        logging.getLogger("shardkit").removeHandler(handler)
    return out


def test_load_checkpoint_slips_say_what_to_pass(world1, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    out = world1.run(_load_slips, save_dir)[0]
    loaded, message = out["tag_dir"]
    assert loaded == (None, None)
    assert f"pass {str(tmp_path / 'ckpt')!r} with tag='global_step1'" in message, message
    assert "leave tag=None" in out["tag_latest"] and "does not exist" not in out["tag_latest"]
    loaded, message = out["no_latest"]
    assert loaded == (None, None) and "pass tag=" in message and "global_step1" in message


def test_a_broken_agreement_is_summarised_at_a_word_boundary():
    from shardkit.checkpoint.sharded import _first_words
    long = RuntimeError("peer " + "word " * 100 + "\nsecond line")
    cut = _first_words(long)
    assert len(cut) <= 304 and cut.endswith("word ...") and "second" not in cut
    assert _first_words(RuntimeError("short one\nmore")) == "short one"
    token = _first_words(RuntimeError("Timeout: " + "a" * 400))  # no space near the cut
    assert token.startswith("Timeout: aaaa") and len(token) == 304, token
