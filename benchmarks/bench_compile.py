"""Eager against ``block.compile()`` (Inductor) step time for each shardkit wrapper, world 2,
gloo on CPU.

    python -m benchmarks.bench_compile [--rounds 3] [--steps 4] [--out PATH]

A small GPT; in the compiled rows every Block is compiled in place before wrapping (FSDP: one
unit per Block). Each configuration is warmed up 3 steps (the compile happens there), then
timed in interleaved rounds (order rotating); a round's time is the slowest rank's. The table
gives the median step time and the compiled/eager ratio per wrapper (median of per-round
ratios). Compile time itself is not in the step time; it is printed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from shardkit.models import GPT, Block, GPTConfig, synthetic_batch
from shardkit.nn.wrap import transformer_auto_wrap_policy
from shardkit.recipes import adamw, compose
from shardkit.testing import World

from benchmarks.common import median_ratio, slowest_rank, time_interleaved, write_report

CFG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=64)
BATCH_PER_RANK = 8
WRAPPERS = ("fsdp", "sharded_ddp", "oss_ddp")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "compile.md")


class _Trainer:
    """One wrapper, eager or with compiled blocks; ``step(i, rank)`` trains one step."""

    def __init__(self, wrapper: str, compiled: bool):
        model = GPT(CFG, seed=0)
        if compiled:
            for block in model.blocks:
                block.compile()
        stage = {"oss_ddp": 1, "sharded_ddp": 2, "fsdp": 3}[wrapper]
        policy = {"wrap_policy": transformer_auto_wrap_policy({Block})} if stage == 3 else {}
        composition = compose(model, stage, adamw(1e-4), count_ddp_comm=False, **policy)
        self.model, self.opt = composition.wrapped, composition.optimizer
        self.first_step_s = None

    def step(self, i: int, rank: int) -> None:
        start = time.perf_counter()
        x, y = synthetic_batch(CFG, 2 * BATCH_PER_RANK, i)
        x, y = x[rank::2], y[rank::2]
        F.cross_entropy(self.model(x).flatten(0, 1), y.flatten()).backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - start


def _measure(rounds: int, steps: int):
    torch.manual_seed(0)
    trainers = {f"{w}/{'compiled' if c else 'eager'}": _Trainer(w, c)
                for w in WRAPPERS for c in (False, True)}
    times, _ = time_interleaved(trainers, rounds, steps)
    return times, {name: t.first_step_s for name, t in trainers.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_compile")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with World(2, threads=1) as world:
        results = world.run(_measure, args.rounds, args.steps)
    times = slowest_rank([r[0] for r in results])
    first = {k: max(r[1][k] for r in results) for k in results[0][1]}
    lines = ["# Eager vs compiled blocks per wrapper (world 2, gloo, CPU, Inductor)", "",
             f"GPT d_model={CFG.d_model} n_layer={CFG.n_layer} seq_len={CFG.seq_len}, "
             f"{BATCH_PER_RANK} sequences per rank, torch {torch.__version__}; "
             f"{args.rounds} rounds x {args.steps} steps after 3 warm-up steps.", "",
             "| wrapper | eager ms/step | compiled ms/step | compiled / eager | first step s "
             "(compiles unless Dynamo already holds the graph) |", "|---|---|---|---|---|"]
    for w in WRAPPERS:
        eager, comp = times[f"{w}/eager"], times[f"{w}/compiled"]
        lines.append(f"| {w} | {1e3 * statistics.median(eager):.1f} | "
                     f"{1e3 * statistics.median(comp):.1f} | {median_ratio(comp, eager):.2f} | "
                     f"{first[f'{w}/compiled']:.1f} |")
    write_report("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
