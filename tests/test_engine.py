"""shardkit.initialize: every ZeRO stage against single-process training and the same wrappers
composed by hand; fp16 dynamic loss scaling; bad configs fail on every rank, before any traffic.

All bodies run in one world of 2 gloo ranks.
"""

import contextlib
import os
import logging

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.config import ConfigError
from shardkit.models import GPT, Block, GPTConfig, synthetic_batch
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes
from tests.utils.compare import max_diff
from tests.utils.master_weights import fp32_weights, master_dtype

TINY = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=8)
# Note: eps 1e-6, not AdamW's 1e-8. The key bias of attention has an exactly-zero true gradient
# (softmax ignores a shift of every score), so its gradient is pure fp32 rounding noise, which
# AdamW with eps 1e-8 turns into +-lr steps: even one process summing the batch in 8 chunks
# instead of 1 drifts by 1e-4 in 10 steps. eps 1e-6 keeps that noise below 2e-6.
LR, WD, EPS, CLIP = 3e-3, 0.01, 1e-6, 0.05
MICRO, GAS = 2, 4
STEPS = 10


world2 = world_fixture(2)


def _config(stage, **extra):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "gradient_clipping": CLIP, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
            "zero_optimization": {"stage": stage}, **extra}


def _lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _micro_batches(step, rank, world):
    """This rank's GAS micro-batches of the global batch of ``step``."""
    idx, tgt = synthetic_batch(TINY, MICRO * GAS * world, step)
    per_rank = MICRO * GAS
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return list(zip(idx[mine].split(MICRO), tgt[mine].split(MICRO)))


# ----------------------------------------------------------------------------- hand-composed


def _hand_composed(stage, model):
    """The same wrappers as the stage plan, composed by hand (what a FairScale user writes)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    if stage == 0:  # with shardkit's averaging hook, so that CommCounter counts it too
        from shardkit.comm_hooks import counted_allreduce_hook
        ddp = DDP(model)
        ddp.register_comm_hook(None, counted_allreduce_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
        return ddp, opt, ddp.no_sync, lambda: torch.nn.utils.clip_grad_norm_(
            model.parameters(), CLIP)
    from shardkit.optim import OSS
    if stage in (1, 2):
        oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=LR, weight_decay=WD, eps=EPS)
        if stage == 1:  # DeepSpeed's reduce_scatter=true: gradients onto their owners only
            from shardkit.comm_hooks import reduce_to_owners_hook
            wrapped = DDP(model)
            wrapped.register_comm_hook(oss, reduce_to_owners_hook)
            return wrapped, oss, wrapped.no_sync, lambda: oss.clip_grad_norm(CLIP)
        from shardkit.nn.data_parallel import ShardedDataParallel
        wrapped = ShardedDataParallel(model, oss)
        # stage 2 reduces every micro-batch to the owners (DeepSpeed's ZeRO-2): no no_sync
        return wrapped, oss, contextlib.nullcontext, lambda: oss.clip_grad_norm(CLIP)
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
    fsdp = FSDP(auto_wrap(model, auto_wrap_policy=transformer_auto_wrap_policy({Block})))
    # stage 3 steps with torch's fused kernel, as OSS does for stages 1-2 (its rounding differs
    # from the default loop's in the last bit on some CPUs, e.g. AVX2)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR, weight_decay=WD, eps=EPS, fused=True)
    # stage 3 reduce-scatters every micro-batch into the shards (DeepSpeed's ZeRO-3): no no_sync
    return fsdp, opt, contextlib.nullcontext, lambda: fsdp.clip_grad_norm_(CLIP)


def _full_params(stage, wrapped, module):
    if stage == 3:
        return {k: v.clone() for k, v in wrapped.state_dict().items()}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _parity(stage):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    engine, optimizer, _, _ = shardkit.initialize(model=GPT(TINY, seed=0), config=_config(stage))
    assert engine.zero_stage == stage and engine.gradient_accumulation_steps() == GAS
    assert engine.train_batch_size() == MICRO * GAS * world

    hand_model = GPT(TINY, seed=0)
    hand, hand_opt, hand_no_sync, hand_clip = _hand_composed(stage, hand_model)

    oracle = GPT(TINY, seed=0)
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=LR, weight_decay=WD, eps=EPS)

    engine_comm, hand_comm = distributed.CommCounter(), distributed.CommCounter()
    vs_oracle, vs_hand, boundaries, norms = [], [], [], []
    assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
    for step in range(STEPS):
        idx, tgt = synthetic_batch(TINY, MICRO * GAS * world, step)
        oracle.loss(idx, tgt).backward()
        oracle_norm = float(torch.nn.utils.clip_grad_norm_(oracle.parameters(), CLIP))
        oracle_opt.step()
        oracle_opt.zero_grad()

        for m, (x, y) in enumerate(_micro_batches(step, rank, world)):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            with engine_comm:
                engine.backward(_lm_loss(engine(x), y))
                engine.step()

            sync = contextlib.nullcontext() if m == GAS - 1 else hand_no_sync()
            with hand_comm, sync:
                (_lm_loss(hand(x), y) / GAS).backward()
        with hand_comm:
            hand_clip()
            hand_opt.step()
            hand_opt.zero_grad()

        norms.append((engine.get_global_grad_norm(), oracle_norm, engine.was_step_applied()))
        got = _full_params(stage, engine.wrapped, engine.module)
        vs_oracle.append(max_diff(got, oracle.state_dict()))
        vs_hand.append(max_diff(got, _full_params(stage, hand, hand_model)))
    memory = model_state_bytes(module=engine.wrapped, optimizer=engine.optimizer)
    return {"vs_oracle": vs_oracle, "vs_hand": vs_hand, "global_steps": engine.global_steps,
            "boundaries": boundaries[:GAS], "optimizer": type(optimizer).__name__,
            "comm": (engine_comm.bytes, len(engine_comm.calls)),
            "hand_comm": (hand_comm.bytes, len(hand_comm.calls)), "norms": norms,
            "samples": engine.global_samples, "clipping": engine.gradient_clipping(),
            "ranks": (engine.global_rank, engine.world_size, str(engine.device)),
            "memory": memory.as_dict(), "numel": sum(p.numel() for p in oracle.parameters())}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_single_process_and_hand_composed(world2, stage):
    results = world2.run(_parity, stage)
    for r in results:
        assert r["global_steps"] == STEPS
        assert r["boundaries"] == [False] * (GAS - 1) + [True]
        assert max(r["vs_oracle"]) <= 1e-5, r["vs_oracle"]
        assert max(r["vs_hand"]) <= 1e-6, r["vs_hand"]
        # The engine adds no traffic to what its wrappers need (fp32: no overflow flag).
        assert r["comm"] == r["hand_comm"]
        # DeepSpeed's accessors: the pre-clipping global norm of each step, as the oracle's
        for got, want, applied in r["norms"]:
            assert applied and got == pytest.approx(want, rel=1e-4), r["norms"]
        assert r["samples"] == STEPS * MICRO * GAS * len(results) and r["clipping"] == CLIP
    assert [r["ranks"] for r in results] == [(0, 2, "cpu"), (1, 2, "cpu")]
    assert results[0]["optimizer"] == ("OSS" if stage in (1, 2) else "AdamW")

    # Per-rank memory after a step (grads freed): AdamW keeps 8 bytes per parameter.
    numel, world = results[0]["numel"], len(results)
    optim = [r["memory"]["optimizer"] for r in results]
    params = [r["memory"]["params"] for r in results]
    if stage == 0:
        assert min(optim) >= 8 * numel and min(params) == 4 * numel
    else:  # optimizer state split over the ranks (whole parameters at 1-2: a little uneven)
        assert 8 * numel <= sum(optim) <= 8 * numel + 64 * numel / 100
        assert max(optim) <= 0.65 * 8 * numel
    if stage == 3:  # parameters sharded too (rows padded to a multiple of the world size)
        assert max(params) <= 4 * numel / world * 1.1
    elif stage in (1, 2):
        assert min(params) == 4 * numel


# ----------------------------------------------------------------------------- fp16


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fp16_dynamic(stage):
    rank = distributed.get_rank()
    records = _Records()
    log = logging.getLogger("shardkit")
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(10, 10)
        config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                  "steps_per_print": 10,
                  "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                  "zero_optimization": {"stage": stage},
                  "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 32,
                           "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}
        engine, _, _, _ = shardkit.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(7)
        target_map = torch.randn(10, 10, generator=gen)
        losses, scales, applied = [], [], []
        for step in range(40):
            x = torch.randn(16, 10, generator=gen)[rank * 8:(rank + 1) * 8]
            loss = F.mse_loss(engine(x).float(), x @ target_map)
            engine.backward(loss)
            scales.append(engine.loss_scale)
            engine.step()
            losses.append(loss.item())
            applied.append(engine.was_step_applied())
        weight_dtype = next(engine.module.parameters()).dtype
        stepped_dtype = master_dtype(engine)
    finally:
        log.removeHandler(records)
    return {"losses": losses, "scales": scales, "skipped": engine.skipped_steps,
            "final_scale": engine.loss_scale, "log": records.messages,
            "weight_dtype": str(weight_dtype), "master_dtype": str(stepped_dtype),
            "applied": applied}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_fp16_dynamic_scaling_skips_then_trains(world2, stage):
    results = world2.run(_fp16_dynamic, stage)
    r0 = results[0]
    # stages 0-2: fp16 weights, fp32 masters in the optimizer; stage 3: FSDP's fp32 shards
    assert r0["weight_dtype"] == ("torch.float32" if stage == 3 else "torch.float16")
    assert r0["master_dtype"] == "torch.float32"
    assert len({r["skipped"] for r in results}) == 1  # the skip decision is collective
    # Hysteresis 2: the first overflow keeps 2**32, the second halves it.
    assert r0["scales"][:3] == [2.0 ** 32, 2.0 ** 32, 2.0 ** 31]
    assert r0["skipped"] >= 3 and r0["final_scale"] < 2.0 ** 32
    assert r0["applied"].count(False) == r0["skipped"]  # was_step_applied says which
    overflow_lines = [m for m in r0["log"] if "overflowed" in m]
    assert len(overflow_lines) == r0["skipped"]
    assert not any("overflowed" in m for m in results[1]["log"])  # rank 0 logs
    progress = [m for m in r0["log"] if m.startswith("step=")]
    assert progress and all(k in progress[0] for k in ("loss=", "lr=", "loss_scale=",
                                                       "samples/s="))
    trained = r0["losses"][r0["skipped"]:]
    assert sum(trained[-5:]) / 5 < 0.5 * trained[0], r0["losses"]


def _fp16_one_rank_overflows(stage):
    """fp16 with dynamic loss scaling against one process with torch's GradScaler (hysteresis
    1 = GradScaler's rule, loss_scale_window = growth_interval); rank 1's second micro-batch
    of step 2 and rank 0's first of step 5 overflow (a huge input), on that rank only. The
    weights compared are the fp32 ones the optimizer steps (at stage 0 the masters of the fp16
    weights)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    micro, gas, poisoned = 2, 2, {(2, 1, 1), (5, 0, 0)}

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 4))

    def inputs(step, x):
        chunks = list(x.split(micro))
        for at, (r, m) in enumerate((r, m) for r in range(world) for m in range(gas)):
            if (step, r, m) in poisoned:
                chunks[at] = chunks[at].clone().index_fill_(1, torch.tensor([0]), 1e6)
        return chunks

    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
              "steps_per_print": 1000, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
                       "hysteresis": 1}}
    engine, _, _, _ = shardkit.initialize(model=net(), config=config)
    oracle = net()
    if stage < 3:  # initialize cast the weights to fp16 (DeepSpeed's module.half()) and the
        # masters start from them: the oracle starts from the same rounded values (from the
        # fp32 ones, the masters sat 1.2e-4 off from step 0 on)
        with torch.no_grad():
            for p in oracle.parameters():
                p.copy_(p.half().float())
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    ours, torchs, diffs = [], [], []
    for step in range(8):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(micro * gas * world, 8, generator=gen), \
            torch.randn(micro * gas * world, 4, generator=gen)
        chunks = inputs(step, x)
        with torch.autocast("cpu", dtype=torch.float16):
            out = oracle(torch.cat(chunks))
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        scaler.step(oracle_opt)
        scaler.update()
        oracle_opt.zero_grad()
        torchs.append(scaler.get_scale())
        for m in range(gas):
            at = rank * gas + m
            out = engine(chunks[at])
            engine.backward(F.mse_loss(out.float(), y[at * micro:(at + 1) * micro]))
            engine.step()
        ours.append(engine.loss_scale)
        diffs.append(max_diff(fp32_weights(engine), oracle.state_dict()))  # the fp32 masters
    return {"ours": ours, "torch": torchs, "skipped": engine.skipped_steps,
            "diff": max(diffs)}


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_overflow_on_one_rank_matches_torch_grad_scaler(world2, stage):
    results = world2.run(_fp16_one_rank_overflows, stage)
    for r in results:
        assert r["ours"] == r["torch"]  # the same scale after every step, growth included
        assert r["skipped"] == 2  # both overflowing steps, on both ranks
        assert r["diff"] < 1e-4, r["diff"]


def _save_16bit_model(stage, out_dir):
    """DeepSpeed's save_16bit_model: every rank calls it, rank 0 writes the full model in the
    compute dtype under the original names; frozen parameters can be left out."""
    model = GPT(TINY, seed=0)  # at stage 3 its blocks are units of their own
    model.blocks[0].ln1.weight.requires_grad_(False)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    config = {"train_batch_size": 8, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = shardkit.initialize(model=model, config=config)
    x, y = next(iter(_micro_batches(0, distributed.get_rank(), 2)))
    engine.backward(_lm_loss(engine(x), y))
    engine.step()
    assert engine.save_16bit_model(out_dir, f"model{stage}.bin")
    engine.save_16bit_model(out_dir, f"trainable{stage}.bin", exclude_frozen_parameters=True)
    distributed.barrier()
    blocked = os.path.join(out_dir, f"file{stage}")
    open(blocked, "w").close()  # a file where the directory should be: rank 0 cannot write
    try:
        engine.save_16bit_model(os.path.join(blocked, "sub"))
        failure = None
    except RuntimeError as error:
        failure = str(error)
    full = torch.load(os.path.join(out_dir, f"model{stage}.bin"))
    trainable = torch.load(os.path.join(out_dir, f"trainable{stage}.bin"))
    return {"keys": sorted(full) == sorted(reference),
            "dtypes": sorted({str(v.dtype) for v in full.values() if v.is_floating_point()}),
            "same": all(torch.equal(full[k], v.to(torch.bfloat16)) for k, v in reference.items()),
            "dropped": sorted(set(full) - set(trainable)),
            "leftovers": sorted(f for f in os.listdir(out_dir) if ".tmp" in f),
            "failure": failure}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_save_16bit_model(world2, stage, tmp_path):
    for r in world2.run(_save_16bit_model, stage, str(tmp_path)):
        assert r["keys"] and r["dtypes"] == ["torch.bfloat16"] and r["same"], r
        assert r["dropped"] == ["blocks.0.ln1.weight"] and r["leftovers"] == [], r
        # rank 0's failure reaches every rank as an error, not a hang
        assert r["failure"] and "rank 0 could not write" in r["failure"], r


def _bf16_trains():
    torch.manual_seed(0)
    config = {"train_batch_size": 8, "bf16": {"enabled": True},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 1), config=config)
    x = torch.randn(4, 4)
    losses = []
    for _ in range(10):
        loss = F.mse_loss(engine(x).float(), x.sum(1, keepdim=True))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.loss_scaler is None


def test_bf16_trains_without_loss_scaler(world2):
    for losses, no_scaler in world2.run(_bf16_trains):
        assert no_scaler and losses[-1] < losses[0]


def _bf16_inf_gradient(stage, check):
    """One rank's loss is inf on step 1 of 3: with ``bf16.check_grad_overflow`` (DeepSpeed's
    default) every rank skips that step, scheduler included; without it the weights take it."""
    world, rank = distributed.get_world_size(), distributed.get_rank()
    config = {"train_batch_size": 2 * world, "bf16": {"enabled": True,
                                                      "check_grad_overflow": check},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05,
                                                           "warmup_num_steps": 4}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = shardkit.initialize(model=_mlp(), config=config)
    torch.manual_seed(rank)
    applied = []
    for step in range(3):
        loss = F.mse_loss(engine(torch.randn(2, 4)).float(), torch.randn(2, 2))
        engine.backward(loss * float("inf") if step == 1 and rank == world - 1 else loss)
        engine.step()
        applied.append(engine.was_step_applied())
    finite = all(bool(torch.isfinite(v).all())
                 for v in _full_params(stage, engine.wrapped, engine.module).values())
    return {"applied": applied, "finite": finite, "skipped": engine.skipped_steps,
            "steps": engine.global_steps, "iteration": engine.lr_scheduler.last_batch_iteration}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_skips_a_step_with_inf_gradients(world2, stage):
    for r in world2.run(_bf16_inf_gradient, stage, True):
        assert r == {"applied": [True, False, True], "finite": True, "skipped": 1, "steps": 3,
                     "iteration": 1}, r
    for r in world2.run(_bf16_inf_gradient, stage, False):  # DeepSpeed's off switch
        assert r["applied"] == [True] * 3 and not r["finite"] and r["skipped"] == 0, r


def _accessors_and_manual_boundary(stage):
    """DeepSpeed's remaining accessors, ``no_sync()`` and a boundary decided by hand: two
    micro-batches then a step, with GAS 4, equal the oracle stepping on those two."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "steps_per_print": 7, "fp16": {"enabled": False},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
              "zero_optimization": {"stage": stage}}
    torch.manual_seed(0)
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 1), config=config)
    torch.manual_seed(0)
    oracle = torch.nn.Linear(4, 1)
    xs = torch.randn(world, 2, 2, 4)  # rank, micro-batch, rows, features
    accessors = (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.zero_optimization(),
                 engine.get_batch_info(), engine.get_mom(), engine.steps_per_print(),
                 engine.dp_world_size)
    counter = distributed.CommCounter()
    boundaries = []
    for m, flag in enumerate((False, True)):
        engine.set_gradient_accumulation_boundary(flag)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        with counter:
            engine.backward(engine(xs[rank, m]).pow(2).mean())
            engine.step()
        if m == 0:
            silent = counter.bytes
    (oracle(xs.reshape(-1, 2, 4)).pow(2).mean((1, 2)).sum() / 4 / world).backward()
    with torch.no_grad():
        for p in oracle.parameters():
            p -= 0.1 * p.grad
    got = dict(engine.module.named_parameters())
    diff = max((got[k].detach() - v.detach()).abs().max().item()
               for k, v in oracle.named_parameters())
    engine.set_gradient_accumulation_boundary(None)
    counting = engine.is_gradient_accumulation_boundary()  # micro_steps 2: (2 + 1) % 4
    with counter, engine.no_sync():
        engine.backward(engine(xs[rank, 0]).sum())
    # this rank's own gradient of sum(x w^T + b) / GAS, not the ranks' average
    local = (engine.module.weight.grad - xs[rank, 0].sum(0) / 4).abs().max().item()
    try:
        engine.set_gradient_accumulation_boundary(1)
        bad = None
    except ValueError as error:
        bad = str(error)
    return {"accessors": accessors, "boundaries": boundaries, "silent": silent,
            "reduced": counter.bytes, "steps": engine.global_steps, "diff": diff,
            "counting": counting, "bad": bad, "local": local}


def _deepspeed_config_accessors_and_batch_setters():
    """DeepSpeed's config accessors report the config with DeepSpeed's defaults; the batch-size
    setters change the accumulation (or micro-batch) as DeepSpeed does and global_samples
    counts each step at the batch it ran with."""
    world = distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3},
              "zero_optimization": {"stage": 2, "overlap_comm": True,
                                    "offload_optimizer": {"device": "cpu"}}}
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 1), config=config)
    report = {
        "names": (engine.optimizer_name(), engine.optimizer_params(), engine.scheduler_name(),
                  engine.scheduler_params()),
        "zero": (engine.zero_optimization_partition_gradients(),
                 engine.zero_optimization_partition_weights(), engine.zero_overlap_comm(),
                 engine.zero_contiguous_gradients(), engine.zero_reduce_bucket_size(),
                 engine.zero_cpu_offload(), engine.zero_offload_optimizer()["device"],
                 engine.zero_offload_param()),
        "scale": (engine.dynamic_loss_scale(), engine.initial_dynamic_scale(),
                  engine.dynamic_loss_scale_args()["delayed_shift"]),
        "misc": (engine.gradient_predivide_factor(), engine.postscale_gradients(),
                 engine.wall_clock_breakdown(), engine.amp_enabled(),
                 engine.sparse_gradients_enabled())}

    def one_step():
        for _ in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 4)
                                   .half()).float().pow(2).mean())
            engine.step()

    one_step()
    engine.set_train_batch_size(8 * world)  # accumulation 2 -> 4
    one_step()
    engine.set_train_micro_batch_size(1)  # accumulation stays 4
    one_step()
    report["after"] = (engine.get_batch_info(), engine.global_steps, engine.global_samples)
    engine.backward(engine(torch.randn(1, 4).half()).float().sum())
    engine.step()  # one micro-batch into an accumulation of 4
    errors = []
    for call in (lambda: engine.set_train_batch_size(4 * world),
                 lambda: engine.set_train_batch_size(3)):
        try:
            call()
            errors.append("accepted")
        except ValueError as error:
            errors.append(str(error))
    report["errors"] = errors
    return report


def test_deepspeed_config_accessors_and_batch_setters(world2):
    for r in world2.run(_deepspeed_config_accessors_and_batch_setters):
        assert r["names"] == ("AdamW", {"lr": 0.01}, "WarmupLR", {"warmup_num_steps": 5}), r
        assert r["zero"] == (True, False, True, True, int(5e8), True, "cpu", None), r
        assert r["scale"] == (True, 256.0, 3), r
        assert r["misc"] == (1.0, True, False, False, False), r
        # steps at 8, 16 and 8 samples (2 ranks): 32 in all
        assert r["after"] == ((8, 1, 4), 3, 32), r
        assert "called after 1 of 4 micro-batches" in r["errors"][0], r
        assert "must be a positive multiple of micro-batch 1 x data-parallel ranks 2" \
            in r["errors"][1], r


@pytest.mark.parametrize("stage", [0, 1])
def test_accessors_no_sync_and_a_boundary_set_by_hand(world2, stage):
    for r in world2.run(_accessors_and_manual_boundary, stage):
        assert r["accessors"] == (False, False, stage > 0, (16, 2, 4), [0.9], 7, 2)
        assert r["boundaries"] == [False, True] and r["steps"] == 1
        # only the boundary backward reduced
        assert r["silent"] == 0 and r["reduced"] > 0
        assert r["local"] <= 1e-6  # no_sync(): the rank's own gradient
        assert r["diff"] <= 1e-6
        assert r["counting"] is False
        assert "set_gradient_accumulation_boundary(1): expected True, False or None" in r["bad"]


def _communication_dtype(stage):
    """``communication_data_type``: the same training within bf16's rounding, and the gradient
    reduction's bytes halved at every stage (the parameter all-gathers stay fp32)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    out = {}
    for dtype in (None, "bf16"):
        engine, _, _, _ = shardkit.initialize(model=GPT(TINY, seed=0), config=_config(
            stage, communication_data_type=dtype))
        counter = distributed.CommCounter()
        for step in range(2):
            for x, y in _micro_batches(step, rank, world):
                with counter:
                    engine.backward(_lm_loss(engine(x), y))
                    engine.step()
        out[dtype] = (_full_params(stage, engine.wrapped, engine.module), dict(counter.by_op))
    return {"diff": max_diff(out[None][0], out["bf16"][0]), "fp32": out[None][1],
            "bf16": out["bf16"][1]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_data_type_halves_gradient_bytes(world2, stage):
    for r in world2.run(_communication_dtype, stage):
        # AdamW normalises each step to about lr (3e-3): bf16 rounding moves a weight by less
        # than one step, a little only where a gradient is near zero (but it does move: > 0);
        # stages 2-3 round each micro-batch's gradient (GAS reductions a step, as DeepSpeed's
        # ZeRO-2 and ZeRO-3), so up to a step more over the two steps
        assert 0 < r["diff"] <= (2 * LR if stage >= 2 else LR), r["diff"]
        grads = {0: "all_reduce", 1: "reduce", 2: "reduce", 3: "reduce_scatter"}[stage]
        assert r["bf16"][grads] == pytest.approx(r["fp32"][grads] / 2, rel=0.01), r
        assert r["bf16"][grads] > 0, r
        assert r["bf16"].get("all_gather") == r["fp32"].get("all_gather")


# ----------------------------------------------------------------------------- user objects


def _user_optimizer_and_scheduler(stage):
    from shardkit.optim import WarmupLR
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    engine, optimizer, loader, scheduler = shardkit.initialize(
        model=model, optimizer=opt, training_data=dataset,
        lr_scheduler=lambda o: WarmupLR(o, warmup_max_lr=0.1, warmup_num_steps=4),
        config={"train_batch_size": 8, "zero_optimization": {"stage": stage}})
    for x, y in loader:
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    return {"optimizer": type(optimizer).__name__, "scheduler_on": scheduler.optimizer is optimizer,
            "batches": len(loader), "batch": loader.batch_size, "steps": engine.global_steps,
            "lr_iteration": scheduler.last_batch_iteration}


@pytest.mark.parametrize("stage, optimizer", [(1, "OSS"), (3, "SGD")])
def test_user_optimizer_scheduler_and_dataloader(world2, stage, optimizer):
    # Stage 1 wraps the user's SGD in OSS; stage 3 rebuilds an SGD over FSDP's shards.
    for r in world2.run(_user_optimizer_and_scheduler, stage):
        assert r == {"optimizer": optimizer, "scheduler_on": True, "batches": 4, "batch": 4,
                     "steps": 4, "lr_iteration": 3}


def _decay_groups(model, decay):
    """HF scripts' two groups: weight decay on the weights, none on the biases."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
             "weight_decay": decay},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
             "weight_decay": 0.0}]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train_beside_reference(engine, reference, ref_opt, batches, ref_sched=None):
    """Step ``engine`` on this rank's share of each global batch and ``reference`` on the whole
    batch."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    for x, y in batches:
        local = len(x) // world
        mine = slice(local * rank, local * (rank + 1))
        engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        if ref_sched is not None:
            ref_sched.step()


def _scheduler_on_own_optimizer(stage):
    """DeepSpeed's most common form: the script builds its optimizer (two param groups) and a
    torch scheduler on it, passes both, and later changes the learning rate through its own
    optimizer. Then the config-built optimizer over ``model_parameters`` groups."""
    import warnings
    world = distributed.get_world_size()
    torch.manual_seed(1)
    batches = [(torch.randn(4 * world, 4), torch.randn(4 * world, 2)) for _ in range(3)]
    config = {"train_batch_size": 4 * world, "zero_optimization": {"stage": stage}}

    model, reference = _mlp(), _mlp()
    opt = torch.optim.AdamW(_decay_groups(model, 0.5), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    ref_opt = torch.optim.AdamW(_decay_groups(reference, 0.5), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, scheduler = shardkit.initialize(
            model=model, optimizer=opt, lr_scheduler=sched, config=config)
        _train_beside_reference(engine, reference, ref_opt, batches,
                                torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s))
    trained = _full_params(stage, engine.wrapped, model)
    norms = (engine.get_global_grad_norm(),
             float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])))
    for group in opt.param_groups:  # the script's own handle, as DeepSpeed scripts do
        group["lr"] = 0.0
        group["weight_decay"] = 0.0
    _train_beside_reference(engine, _mlp(), torch.optim.SGD(_mlp().parameters()), batches[:1])
    after = _full_params(stage, engine.wrapped, model)

    from_config, grouped = _mlp(), _mlp()
    built, *_ = shardkit.initialize(
        model=from_config, model_parameters=_decay_groups(from_config, 0.5),
        config={**config, "optimizer": {"type": "AdamW", "params": {"lr": 0.05,
                                                                    "weight_decay": 0.5}}})
    _train_beside_reference(built, grouped,
                            torch.optim.AdamW(_decay_groups(grouped, 0.5), lr=0.05), batches)
    return {"diff": max_diff(trained, reference.state_dict()),
            "groups diff": max_diff(_full_params(stage, built.wrapped, from_config),
                                    grouped.state_dict()),
            "grad norm": norms,
            "same scheduler": scheduler is sched, "lr": scheduler.get_last_lr(),
            "moved by lr 0": max_diff(after, trained),
            "scheduler warnings": [str(w.message) for w in caught
                                   if "lr_scheduler" in str(w.message)]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_scheduler_built_on_the_passed_optimizer(world2, stage):
    for r in world2.run(_scheduler_on_own_optimizer, stage):
        assert r["same scheduler"] and r["scheduler warnings"] == [], r
        assert r["lr"] == [0.05 * 0.5 ** 4] * 2, r  # four engine steps stepped the scheduler
        assert r["diff"] < 1e-5, r  # the schedule reached the stepping optimizer
        assert r["moved by lr 0"] == 0.0, r  # and so did a rate set on the script's handle
        assert r["groups diff"] < 1e-5, r  # model_parameters groups kept at every stage
        # No gradient_clipping in the config: DeepSpeed still reports the norm at ZeRO stages
        # 1-3 (stage 0 in fp32 measures nothing it does not need).
        norm, reference_norm = r["grad norm"]
        if stage == 0:
            assert norm is None, r
        else:
            assert norm == pytest.approx(reference_norm, rel=1e-5), r


def _used_optimizer_continues_at_stage3(optimizer_class):
    """An optimizer that holds state when given to initialize (a step taken before, or
    Adagrad's sum from its constructor): stage 3 cuts it to FSDP's rows, as the parameters are
    cut, and training goes on as in one process (it was refused: "already holds state")."""
    world = distributed.get_world_size()
    torch.manual_seed(3)
    batches = [(torch.randn(4 * world, 4), torch.randn(4 * world, 2)) for _ in range(4)]
    model, reference = _mlp(), _mlp()
    optimizer, ref_opt = (optimizer_class(m.parameters(), lr=0.1) for m in (model, reference))
    for m, o in ((model, optimizer), (reference, ref_opt)):  # one step before initialize
        torch.nn.functional.mse_loss(m(batches[0][0]), batches[0][1]).backward()
        o.step()
        o.zero_grad()
    engine, *_ = shardkit.initialize(model=model, optimizer=optimizer, config={
        "train_batch_size": 4 * world, "zero_optimization": {"stage": 3}})
    _train_beside_reference(engine, reference, ref_opt, batches[1:])
    full = engine.module_state_dict()
    state_numel = sum(v.numel() for st in optimizer.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0)
    full_numel = sum(v.numel() for st in ref_opt.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    worst = max((full[n] - p).abs().max().item() for n, p in reference.named_parameters())
    return worst, state_numel, full_numel


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.Adagrad])
def test_stage3_takes_an_optimizer_that_holds_state(world2, optimizer_class):
    for worst, state_numel, full_numel in world2.run(_used_optimizer_continues_at_stage3,
                                                     optimizer_class):
        assert worst < 1e-6, worst
        assert state_numel <= full_numel // 2 + 16, (state_numel, full_numel)  # rows only


def _stage3_with_state_of_a_0dim_parameter():
    """Adagrad's constructor state for a 0-dim parameter (CLIP's logit scale): FSDP makes that
    parameter a 1-row shard, but its state stays 0-dim like a step count, so it cannot be cut;
    refused on every rank before any collective (it failed in the first step: "output with
    shape [] doesn't match the broadcast shape [1]")."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    model.register_parameter("logit_scale", torch.nn.Parameter(torch.tensor(2.0)))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)
    with distributed.CommCounter() as comm:
        try:
            shardkit.initialize(model=model, optimizer=optimizer, config={
                "train_batch_size": 2 * distributed.get_world_size(),
                "zero_optimization": {"stage": 3}})
            error = "accepted"
        except ConfigError as e:
            error = str(e)
    return error, len(comm.calls)


def test_stage3_refuses_state_of_a_0dim_parameter(world2):
    for error, calls in world2.run(_stage3_with_state_of_a_0dim_parameter):
        assert "holds state ['step', 'sum'] for a 0-dim parameter" in error, error
        assert "callable" in error and calls == 0, (error, calls)


def _eager_state_optimizer_from_a_callable(stage):
    """Adagrad builds its state in its constructor: given as a callable, it trains at every
    stage like one process (stage 3 used to refuse it: "already holds state")."""
    world = distributed.get_world_size()
    torch.manual_seed(2)
    batches = [(torch.randn(4 * world, 4), torch.randn(4 * world, 2)) for _ in range(3)]
    model, reference = _mlp(), _mlp()
    engine, optimizer, _, _ = shardkit.initialize(
        model=model, optimizer=lambda params: torch.optim.Adagrad(params, lr=0.1),
        config={"train_batch_size": 4 * world, "zero_optimization": {"stage": stage}})
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    _train_beside_reference(engine, reference, ref_opt, batches)
    full = engine.module_state_dict()
    return max((full[n] - p).abs().max().item() for n, p in reference.named_parameters())


@pytest.mark.parametrize("stage", [1, 3])
def test_an_optimizer_with_eager_state_from_a_callable(world2, stage):
    for worst in world2.run(_eager_state_optimizer_from_a_callable, stage):
        assert worst < 1e-6, worst


class _WithUnusedHead(torch.nn.Module):
    """A model whose forward leaves a parameter unused (a pooler, a second head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        self.tag = "custom attribute"

    def forward(self, x):
        return self.used(x)


def _deepspeed_script_habits(stage, tmp):
    """What DeepSpeed's tutorials do: unused parameters, attributes of the model read through
    the engine, a partial last batch, numeric checkpoint tags, DeepSpeed's oldest ZeRO switch."""
    dataset = torch.utils.data.TensorDataset(torch.randn(38, 8), torch.randn(38, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD",
                                                                 "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "checkpoint": {"tag_validation": "Fail"}}
    engine, _, loader, _ = shardkit.initialize(model=_WithUnusedHead(), training_data=dataset,
                                               config=config, distributed_port=29511)
    sizes = []
    for x, y in loader:
        sizes.append(len(x))
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    path = engine.save_checkpoint(tmp, tag=3)  # an epoch number, as DeepSpeed's examples do
    loaded, _ = engine.load_checkpoint(tmp, tag=3)
    try:
        engine.save_checkpoint(tmp, tag=f"rank{distributed.get_rank()}")
        mismatched = "accepted"
    except Exception as error:  # CheckpointError on every rank, before anything is written
        mismatched = str(error)
    old_switch, *_ = shardkit.initialize(model=torch.nn.Linear(2, 2), config={
        "train_batch_size": 2 * distributed.get_world_size(), "zero_optimization": True,
        "optimizer": {"type": "SGD"}})
    return {"sizes": sizes, "steps": engine.global_steps, "tag": engine.tag,
            "path": os.path.basename(path), "loaded": os.path.basename(loaded),
            "mismatched": mismatched, "written": sorted(os.listdir(tmp)),
            "old_switch_stage": old_switch.zero_optimization_stage()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_script_habits(world2, stage, tmp_path):
    for r in world2.run(_deepspeed_script_habits, stage, str(tmp_path)):
        # 38 samples, 2 ranks, micro-batch 4: DeepSpeed keeps the last partial batch
        assert r["sizes"] == [4, 4, 4, 4, 3] and r["steps"] == 5, r
        assert r["tag"] == "custom attribute", r
        assert r["path"] == r["loaded"] == "3", r
        assert "different tags" in r["mismatched"], r
        assert r["written"] == ["3", "latest", "zero_to_fp32.py"], r
        assert r["old_switch_stage"] == 1, r


def _backward_and_step_arguments(stage):
    """DeepSpeed's ``backward(loss, scale_wrt_gas=...)`` and ``step(lr_kwargs=...)``: a loss
    the script divided itself (Hugging Face's Trainer) trains like the engine's own division,
    backward returns the loss divided as the gradients were, lr_kwargs reach the scheduler."""
    world = distributed.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05,
                                                           "warmup_num_steps": 10}},
              "zero_optimization": {"stage": stage}}
    engines = [shardkit.initialize(model=_mlp(), config=config)[0] for _ in range(2)]
    torch.manual_seed(3)
    returned = []
    for step in range(3):
        for micro in range(2):
            x, y = torch.randn(2, 4), torch.randn(2, 2)
            loss = F.mse_loss(engines[0](x), y)
            by_engine = engines[0].backward(loss)
            by_script = engines[1].backward(F.mse_loss(engines[1](x), y) / 2, scale_wrt_gas=False)
            returned.append((float(by_engine), float(loss) / 2, float(by_script)))
            engines[0].step()
            # the last step jumps the scheduler (after the optimizer step: same weights)
            engines[1].step(lr_kwargs={"last_batch_iteration": 7} if step == 2 else None)
    return {"diff": max_diff(_full_params(stage, engines[0].wrapped, engines[0].module),
                             _full_params(stage, engines[1].wrapped, engines[1].module)),
            "moved": max_diff(_full_params(stage, engines[0].wrapped, engines[0].module),
                              _mlp().state_dict()),
            "returned": returned, "world": world,
            "iterations": [e.lr_scheduler.last_batch_iteration for e in engines]}


@pytest.mark.parametrize("stage", [0, 2])
def test_backward_scale_wrt_gas_and_step_lr_kwargs(world2, stage):
    for r in world2.run(_backward_and_step_arguments, stage):
        assert r["diff"] == 0.0 and r["moved"] > 1e-3, r
        for by_engine, expected, by_script in r["returned"]:  # DeepSpeed: loss / GAS
            assert by_engine == pytest.approx(expected) == pytest.approx(by_script), r
        assert r["iterations"] == [2, 7], r


def _host_reads_in_backward(stage):
    """Which scalar reads to the host (``item``, ``float``: a device sync each on CUDA)
    ``engine.backward`` makes on micro-batches that print no log line."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = shardkit.initialize(model=_mlp(), config=config)
    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "__float__")}

    def counted(name):
        def read(tensor, *args, **kwargs):
            reads.append(name)
            return originals[name](tensor, *args, **kwargs)
        return read

    for micro in range(6):
        loss = F.mse_loss(engine(torch.randn(2, 4)), torch.randn(2, 2))
        if micro < 2:  # the wrappers' first backward sets up once (stage 2 agrees on a plan)
            engine.backward(loss)
            engine.step()
            continue
        for name in originals:
            setattr(torch.Tensor, name, counted(name))
        try:
            engine.backward(loss)
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
        engine.step()
    return reads


@pytest.mark.parametrize("stage", [0, 2])
def test_backward_reads_nothing_back_to_the_host(world2, stage):
    # The progress line's loss is summed on the device and read when a line is printed
    # (was: float(loss) on every micro-batch, a CUDA sync each).
    for reads in world2.run(_host_reads_in_backward, stage):
        assert reads == [], reads


# ----------------------------------------------------------------------------- bad input

BAD_CONFIGS = {
    "unknown key": ({"train_batch_size": 8, "zero_optimization": {"stgae": 2},
                     "optimizer": {"type": "SGD"}}, "did you mean 'zero_optimization.stage'"),
    "stage 4": ({"train_batch_size": 8, "zero_optimization": {"stage": 4},
                 "optimizer": {"type": "SGD"}}, "zero_optimization.stage=4"),
    "inconsistent batch": ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3,
                            "gradient_accumulation_steps": 1, "optimizer": {"type": "SGD"}},
                           "inconsistent batch sizes"),
    "negative lr": ({"train_batch_size": 8, "optimizer": {"type": "AdamW",
                                                          "params": {"lr": -1e-3}}},
                    "optimizer.params.lr=-0.001"),
    # without an optimizer initialize builds a forward-only engine; a scheduler has nothing
    # to drive there (tests/test_engine_without_optimizer.py)
    "scheduler without optimizer": ({"train_batch_size": 8,
                                     "scheduler": {"type": "WarmupLR", "params": {}}},
                                    "was given without an optimizer"),
    # one lr per param group, and Linear's parameters make one group: refused before the
    # wrappers' first broadcast, naming the key (was a ValueError from WarmupLR after it)
    "scheduler list": ({"train_batch_size": 8, "optimizer": {"type": "SGD"},
                        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [0.1, 0.2]}}},
                       "scheduler.params.warmup_max_lr=[0.1, 0.2]: one value per optimizer "
                       "param group is needed and the optimizer has 1 group(s)"),
}


def _bad_configs():
    out = {}
    with distributed.CommCounter() as comm:
        for name, (config, _) in BAD_CONFIGS.items():
            try:
                shardkit.initialize(model=torch.nn.Linear(2, 2), config=config)
            except ConfigError as e:
                out[name] = str(e)
        try:
            model = torch.nn.Linear(2, 2)
            shardkit.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                                config={"train_batch_size": 8, "optimizer": {"type": "SGD"}})
        except ConfigError as e:
            out["two optimizers"] = str(e)
        try:
            model = torch.nn.Linear(2, 2)
            opt = torch.optim.SGD(model.parameters(), 0.1)
            elsewhere = torch.optim.SGD(model.parameters(), 0.1)
            shardkit.initialize(model=model, optimizer=opt,
                                lr_scheduler=torch.optim.lr_scheduler.StepLR(elsewhere, 1),
                                config={"train_batch_size": 8, "zero_optimization": {"stage": 1}})
        except ConfigError as e:
            out["scheduler instance"] = str(e)
        try:
            shardkit.initialize(model=torch.nn.Linear(2, 2), distributed_port="29500",
                                config={"train_batch_size": 8, "optimizer": {"type": "SGD"}})
        except ConfigError as e:
            out["port"] = str(e)
    out["collectives"] = len(comm.calls)
    return out


def test_bad_configs_raise_on_every_rank_without_traffic(world2):
    results = world2.run(_bad_configs)
    assert results[0] == results[1]
    for name, (_, needle) in BAD_CONFIGS.items():
        assert needle in results[0].get(name, ""), (name, results[0].get(name))
    assert "exactly one" in results[0]["two optimizers"]
    assert "not attached to the optimizer passed" in results[0]["scheduler instance"]
    assert "distributed_port='29500'" in results[0]["port"]
    assert results[0]["collectives"] == 0


def test_a_config_given_twice_is_refused_before_any_process_group():
    """DeepSpeed refuses ``args.deepspeed_config`` together with ``config=...``: the run would
    otherwise follow one of two configs silently. Raised before any collective (no world)."""
    import argparse
    args = argparse.Namespace(deepspeed_config="ds_config.json", local_rank=0)
    with pytest.raises(ConfigError, match=r"args.deepspeed_config='ds_config.json'.*config="):
        shardkit.initialize(model=torch.nn.Linear(2, 2), args=args,
                            config={"train_batch_size": 2})
    with pytest.raises(ConfigError, match="config and config_params are aliases"):
        shardkit.initialize(model=torch.nn.Linear(2, 2), config={}, config_params={})
