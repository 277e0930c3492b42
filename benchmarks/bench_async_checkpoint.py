"""How long a checkpoint save blocks the training loop: synchronous vs ``async_save=True``.

    python -m benchmarks.bench_async_checkpoint [--rounds 3] [--stage 3] [--quick] [--out PATH]

World of 2 gloo ranks (one thread each), the reference GPT (~27M parameters, fp32 AdamW, global
batch 8) under ``shardkit.initialize`` at ZeRO stage ``--stage``; each round saves once
synchronously and once asynchronously (``tmpfs`` or disk under ``$TMPDIR``). Reported per round,
slowest rank:
- sync save: the time ``save_checkpoint`` takes (the loop is blocked all along);
- async stall: the time ``save_checkpoint(async_save=True)`` takes (host copies) plus the time
  the next ``wait_for_checkpoint`` still blocks after ``--steps`` training steps;
- step time while the background write runs, beside a step without one (the writer competes for
  the same CPU cores).
Writes ``benchmarks/results/async_checkpoint.md``. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

import shardkit
from benchmarks.common import write_report
from shardkit import distributed
from shardkit.models import GPT, GPTConfig, reference_gpt_config, synthetic_batch
from shardkit.testing import World

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "async_checkpoint.md")
GLOBAL_BATCH = 8


def _measure(save_root: str, rounds: int, steps: int, stage: int, quick: bool) -> dict:
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32) if quick \
        else reference_gpt_config()
    engine, _, _, _ = shardkit.initialize(model=GPT(cfg, seed=0), config={
        "train_batch_size": GLOBAL_BATCH, "steps_per_print": 10 ** 6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage}}, peer_timeout_s=0)
    rank, world = distributed.get_rank(), distributed.get_world_size()
    per_rank = GLOBAL_BATCH // world

    def step():
        idx, tgt = synthetic_batch(cfg, GLOBAL_BATCH, engine.global_steps)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        logits = engine(idx[mine])
        engine.backward(F.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                        tgt[mine].reshape(-1)))
        engine.step()

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    step()  # warm-up: optimizer state exists
    out = {"sync": [], "async_call": [], "async_wait": [], "step_plain": [], "step_during": []}
    for r in range(rounds):
        distributed.barrier()
        out["step_plain"].append(timed(step)[0])
        distributed.barrier()
        out["sync"].append(timed(lambda: engine.save_checkpoint(save_root, tag=f"s{r}"))[0])
        distributed.barrier()
        out["async_call"].append(timed(lambda: engine.save_checkpoint(
            save_root, tag=f"a{r}", async_save=True))[0])
        for _ in range(steps):
            out["step_during"].append(timed(step)[0])
        out["async_wait"].append(timed(engine.wait_for_checkpoint)[0])
    file = os.path.join(save_root, "a0", f"rank_{rank:05d}.pt")
    out["rank_file_mb"] = os.path.getsize(file) / 2 ** 20
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    save_root = tempfile.mkdtemp(prefix="shardkit-async-bench-")
    try:
        with World(2, timeout=900) as world:
            per_rank = world.run(_measure, save_root, args.rounds, args.steps, args.stage,
                                 args.quick)
    finally:
        shutil.rmtree(save_root, ignore_errors=True)

    def slowest(key, i):
        return max(r[key][i] for r in per_rank)

    rows, ratios = [], []
    for i in range(args.rounds):
        sync = slowest("sync", i)
        stall = max(r["async_call"][i] + r["async_wait"][i] for r in per_rank)
        ratios.append(stall / sync)
        rows.append(f"| {i + 1} | {sync:.3f} | {slowest('async_call', i):.3f} | "
                    f"{slowest('async_wait', i):.3f} | {stall:.3f} | {stall / sync:.2f}x |")
    plain = statistics.median(max(r["step_plain"][i] for r in per_rank)
                              for i in range(args.rounds))
    during = statistics.median(max(r["step_during"][i] for r in per_rank)
                               for i in range(args.rounds * args.steps))
    model = "small GPT (--quick)" if args.quick else "reference GPT (27.4M parameters)"
    text = "\n".join([
        "# Checkpoint save: training-loop stall, synchronous vs async_save=True", "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()} "
        f"{platform.system()}, {os.cpu_count()} CPU cores (shared); torch {torch.__version__}; "
        f"world 2 (gloo, 1 thread per rank); {model}, fp32 AdamW, ZeRO stage {args.stage}; "
        f"rank file {per_rank[0]['rank_file_mb']:.0f} MiB per rank; {args.steps} training "
        f"steps between the async save and the wait; seconds, slowest rank.", "",
        "| round | sync save | async call (host copy) | wait after steps | async stall | "
        "stall / sync |",
        "|---:|---:|---:|---:|---:|---:|", *rows, "",
        f"Median stall / sync: **{statistics.median(ratios):.2f}x** (target <= 0.2x). "
        f"Training step: {plain:.3f} s without a background write, {during:.3f} s while one "
        f"runs (the writer shares the CPU cores).", ""])
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
