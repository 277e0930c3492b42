"""What the collective debug mode costs (``SHARDKIT_DEBUG_COLLECTIVES=1``).

    python -m benchmarks.bench_collective_check [--rounds 5] [--out PATH]

World of 2 gloo ranks (one thread each). Measured with the mode off and on, in alternation
(rounds of: off, on), so that load from other jobs hits both alike:
- one ``all_reduce`` of 1 KiB and of 4 MiB (mean over 50 and 10 calls);
- one training step of a small GPT (vocab 512, 2 layers, d 128, seq 32, batch 8) under
  ``shardkit.initialize`` at ZeRO stage 3 (FSDP: many all-gathers and reduce-scatters per step).
Each figure is the median over rounds of the slowest rank's mean. Writes
``benchmarks/results/collective_check.md``. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

import shardkit
from benchmarks.common import write_report
from shardkit import distributed
from shardkit.collective_check import set_debug_collectives
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.testing import World

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "collective_check.md")
SMALL = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32)


def _time(fn, calls: int) -> float:
    distributed.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    distributed.barrier()
    return (time.perf_counter() - start) / calls


def _measure(rounds: int) -> dict:
    small, large = torch.ones(256), torch.ones(1 << 20)
    engine, _, _, _ = shardkit.initialize(model=GPT(SMALL, seed=0), config={
        "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3}, "steps_per_print": 10 ** 6})
    rank, world = distributed.get_rank(), distributed.get_world_size()
    idx, tgt = synthetic_batch(SMALL, 8, 0)
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)

    def train_step():
        logits = engine(idx[mine])
        engine.backward(F.cross_entropy(logits.reshape(-1, SMALL.vocab_size),
                                        tgt[mine].reshape(-1)))
        engine.step()

    with distributed.CommCounter() as comm:
        train_step()
    collectives = len(comm.calls)
    cases = {"all_reduce 1 KiB": (lambda: distributed.all_reduce(small), 50),
             "all_reduce 4 MiB": (lambda: distributed.all_reduce(large), 10),
             f"stage-3 GPT step ({collectives} collectives)": (train_step, 3)}
    times = {(name, mode): [] for name in cases for mode in ("off", "on")}
    for _ in range(rounds):
        for mode in ("off", "on"):
            set_debug_collectives(mode == "on")
            for name, (fn, calls) in cases.items():
                times[(name, mode)].append(_time(fn, calls))
    set_debug_collectives(False)
    return {k: v for k, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with World(2, timeout=600) as world:
        per_rank = world.run(_measure, args.rounds)
    names = list(dict.fromkeys(name for name, _ in per_rank[0]))
    rows = []
    for name in names:
        med = {}
        for mode in ("off", "on"):
            slowest = [max(r[(name, mode)][i] for r in per_rank) for i in range(args.rounds)]
            med[mode] = statistics.median(slowest)
        rows.append(f"| {name} | {med['off'] * 1e3:.3f} | {med['on'] * 1e3:.3f} | "
                    f"{med['on'] / med['off']:.2f}x | {(med['on'] - med['off']) * 1e3:+.3f} |")
    text = "\n".join([
        "# Collective debug mode: cost", "",
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()} "
        f"{platform.system()}, {os.cpu_count()} CPU cores (shared); torch {torch.__version__}; "
        f"world 2 (gloo, 1 thread per rank); median over {args.rounds} rounds of the slowest "
        f"rank's mean.", "",
        "| what | off (ms) | on (ms) | on / off | added (ms) |",
        "|---|---:|---:|---:|---:|", *rows, "",
        "On: before each collective the ranks all-gather a 512-byte fingerprint (one small "
        "synchronous collective) and walk the stack for the call site. Off (the default): one "
        "boolean test per collective.", ""])
    write_report(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
