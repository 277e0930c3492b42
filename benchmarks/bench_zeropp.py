"""FSDP with ZeRO++'s compressed communication (qwZ + qgZ) against fp32 communication, world 2,
gloo on CPU: step time (ratio in one run), bytes per step, and a loss curve.

    python -m benchmarks.bench_zeropp [--rounds 3] [--steps 2] [--curve-steps 300]
                                      [--curve-model small|reference] [--out PATH]

Timing: the reference GPT (vocab 8192, 6 layers, d 512, seq 128), one FSDP unit per Block plus
the root, AdamW; both configurations built once per rank, warmed up, timed in interleaved
rounds (``benchmarks.common.time_interleaved``), medians over rounds, rank 0's clock. Bytes: one
forward + backward under ``CommCounter`` (rank 0). The two ranks share one host, so the link is
loopback: the table also gives the time those bytes would take on a 1 Gbit/s link (arithmetic,
not a measurement; this machine has no simulated slow link).

Loss curve: ``--curve-steps`` steps of both configurations from the same seed on the same
batches, plotted with matplotlib into ``benchmarks/results/zeropp_loss.png``. The default
curve model is a small GPT (vocab 512, 2 layers, d 128, seq 32), because 2 x 300 steps of the
reference GPT do not fit the few minutes a benchmark may take on the shared 2-core machine;
``--curve-model reference`` runs the reference GPT.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from shardkit import distributed as skdist
from shardkit.models import GPT, Block, GPTConfig, reference_gpt_config, synthetic_batch
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from shardkit.testing import World

from benchmarks.common import time_interleaved, write_report

WORLD_SIZE = 2
LR = 1e-3
TIMING_BATCH = 8
CURVE_BATCH = 16
CONFIGS = {"fp32 comm": {}, "qwZ+qgZ": {"quantize_weights": True, "quantize_gradients": True}}
CURVE_MODELS = {"small": GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32),
                "reference": reference_gpt_config()}
RESULTS = os.path.join(os.path.dirname(__file__), "results")


class Trainer:
    """One FSDP-wrapped GPT and its optimizer; ``step(i, rank)`` trains on batch ``i``."""

    def __init__(self, cfg: GPTConfig, batch: int, **fsdp_kwargs):
        self.cfg, self.batch = cfg, batch
        with enable_wrap(wrapper_cls=FSDP, **fsdp_kwargs):
            self.model = FSDP(auto_wrap(GPT(cfg, seed=0), transformer_auto_wrap_policy({Block})),
                              **fsdp_kwargs)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def forward_backward(self, i: int, rank: int) -> torch.Tensor:
        idx, target = synthetic_batch(self.cfg, self.batch, i)
        per = self.batch // WORLD_SIZE
        loss = self.model.loss(idx[rank * per:(rank + 1) * per],
                               target[rank * per:(rank + 1) * per])
        loss.backward()
        return loss.detach()

    def step(self, i: int, rank: int) -> torch.Tensor:
        loss = self.forward_backward(i, rank)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss


def _time_and_count(rounds: int, steps: int) -> dict:
    rank = skdist.get_rank()
    trainers = {name: Trainer(reference_gpt_config(), TIMING_BATCH, **kw)
                for name, kw in CONFIGS.items()}
    times, next_step = time_interleaved(trainers, rounds, steps)
    traffic = {}
    for name, trainer in trainers.items():
        with skdist.CommCounter() as comm:
            trainer.forward_backward(next_step, rank)
        trainer.optimizer.zero_grad()
        traffic[name] = comm.by_op
    psi = sum(p.numel() for p in GPT(reference_gpt_config(), seed=0).parameters())
    described = {name: t.model.comm.describe() for name, t in trainers.items()}
    return {"times": times, "traffic": traffic, "psi": psi, "described": described}


def _loss_curve(model_key: str, steps: int) -> dict:
    rank = skdist.get_rank()
    curves = {}
    for name, kw in CONFIGS.items():
        trainer = Trainer(CURVE_MODELS[model_key], CURVE_BATCH, **kw)
        losses = []
        for i in range(steps):
            loss = trainer.step(i, rank).reshape(1).clone()
            skdist.all_reduce(loss)
            losses.append(loss.item() / WORLD_SIZE)
        curves[name] = losses
    return curves


def _plot(curves: dict, title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _report(timing: dict, curves: dict, args) -> str:
    times = {k: statistics.median(v) for k, v in timing["times"].items()}
    base = "fp32 comm"
    lines = ["# FSDP with qwZ + qgZ (ZeRO++) vs fp32 communication (world 2, gloo, CPU)", "",
             f"`python -m benchmarks.bench_zeropp --rounds {args.rounds} --steps {args.steps} "
             f"--curve-steps {args.curve_steps} --curve-model {args.curve_model}`, torch "
             f"{torch.__version__}, {os.cpu_count()} CPU cores shared with other jobs, one "
             f"thread per rank. Reference GPT, Ψ = {timing['psi']:,}, global batch "
             f"{TIMING_BATCH}, reshard_after_forward=True, {args.rounds} interleaved rounds of "
             f"{args.steps} steps after 2 warm-up steps; medians over rounds, rank 0's clock.",
             "", "| configuration | transport | median step (s) | x fp32 comm | "
             "bytes/step/rank (MB) | x fp32 comm bytes | those bytes at 1 Gbit/s (s) |",
             "|---|---|---|---|---|---|---|"]
    base_bytes = sum(timing["traffic"][base].values())
    for name in CONFIGS:
        nbytes = sum(timing["traffic"][name].values())
        lines.append(f"| {name} | {timing['described'][name]} | {times[name]:.3f} | "
                     f"{times[name] / times[base]:.2f} | {nbytes / 1e6:.1f} | "
                     f"{nbytes / base_bytes:.3f} | {nbytes * 8 / 1e9:.3f} |")
    lines += ["", "Bytes by op (rank 0, one forward + backward): " + "; ".join(
        f"{name}: " + ", ".join(f"{op} {b / 1e6:.2f} MB" for op, b in by_op.items())
        for name, by_op in timing["traffic"].items()),
        "Per-round times (s): " + "; ".join(
            f"{k}: " + ", ".join(f"{t:.3f}" for t in v) for k, v in timing["times"].items()), ""]
    cfg = CURVE_MODELS[args.curve_model]
    fp32, quant = curves[base], curves["qwZ+qgZ"]
    tail = max(1, len(fp32) // 10)
    mean_fp32 = sum(fp32[-tail:]) / tail
    mean_quant = sum(quant[-tail:]) / tail
    lines += [f"## Loss curve ({args.curve_model} GPT: vocab {cfg.vocab_size}, {cfg.n_layer} "
              f"layers, d {cfg.d_model}, seq {cfg.seq_len}; global batch {CURVE_BATCH}, AdamW "
              f"lr {LR}, {len(fp32)} steps)", "",
              f"Loss at step 1: fp32 comm {fp32[0]:.4f}, qwZ+qgZ {quant[0]:.4f}; final: fp32 "
              f"comm {fp32[-1]:.4f}, qwZ+qgZ {quant[-1]:.4f} "
              f"({(quant[-1] - fp32[-1]) / fp32[-1] * 100:+.2f}%); mean of the last {tail} "
              f"steps: {mean_fp32:.4f} vs {mean_quant:.4f} "
              f"({(mean_quant - mean_fp32) / mean_fp32 * 100:+.2f}%). Largest relative "
              f"difference at any step: "
              f"{max(abs(q - f) / f for q, f in zip(quant, fp32)) * 100:.2f}%.", "",
              "![loss curves](zeropp_loss.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--curve-steps", type=int, default=300)
    parser.add_argument("--curve-model", choices=sorted(CURVE_MODELS), default="small")
    parser.add_argument("--out", default=os.path.join(RESULTS, "zeropp.md"))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.curve_steps < 1:
        parser.error("--rounds, --steps and --curve-steps must be at least 1")
    with World(WORLD_SIZE, timeout=3600) as world:
        timing = world.run(_time_and_count, args.rounds, args.steps)[0]
        curves = world.run(_loss_curve, args.curve_model, args.curve_steps)[0]
    plot_path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "zeropp_loss.png")
    _plot(curves, f"FSDP world 2, {args.curve_model} GPT: fp32 communication vs qwZ + qgZ",
          plot_path)
    write_report(_report(timing, curves, args), args.out)


if __name__ == "__main__":
    main()
