"""FSDP with ZeRO++'s compressed communication (qwZ + qgZ) against fp32 communication, gloo on
CPU: step time and bytes per step (world 2), and a loss curve (2 nodes x 2 ranks).

    python -m benchmarks.bench_zeropp [--rounds 3] [--steps 2] [--curve-steps 300]
                                      [--curve-model reference|small] [--curve-batch 4]
                                      [--curve-seq-len 32] [--nodes 2] [--ranks-per-node 2]
                                      [--out PATH]

Timing (skipped with ``--rounds 0``): the reference GPT (vocab 8192, 6 layers, d 512, seq 128),
world 2, one FSDP unit per Block plus the root, AdamW; both configurations built once per rank,
warmed up, timed in interleaved rounds (``benchmarks.common.time_interleaved``), medians over
rounds, rank 0's clock. Bytes: one forward + backward under ``CommCounter`` (rank 0). The two
ranks share one host, so the link is loopback: the table also gives the time those bytes would
take on a 1 Gbit/s link (arithmetic; ``benchmarks.bench_cluster`` measures real slow links).
Written to ``--out`` (default ``benchmarks/results/zeropp.md``).

Loss curve (skipped with ``--curve-steps 0``): ``--curve-steps`` steps of both configurations
from the same seed on the same batches, on ``--nodes`` x ``--ranks-per-node`` local ranks
labelled as torchrun labels nodes (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), so qgZ reduces
hierarchically (all-to-all inside the node, then across) and ``CommCounter`` splits the bytes
per link. The default model is the reference GPT itself (27.4M parameters, position table for
128 tokens) trained on ``--curve-seq-len`` tokens per sequence, global batch ``--curve-batch``,
so that 2 x 300 steps fit the shared 2-core machine. Written beside ``--out``:
``zeropp_loss.md`` (the figures), ``zeropp_loss.json`` (every step's loss and time) and
``zeropp_loss.png`` (matplotlib, figures in ``zeropp_loss.chart.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from shardkit import distributed as skdist
from shardkit.models import GPT, Block, GPTConfig, reference_gpt_config, synthetic_batch
from shardkit.nn.wrap import transformer_auto_wrap_policy
from shardkit.recipes import adamw, compose
from shardkit.testing import World

from benchmarks.common import time_interleaved, write_report

TIMING_WORLD = 2
LR = 1e-3
TIMING_BATCH = 8
CONFIGS = {"fp32 comm": {}, "qwZ+qgZ": {"quantize_weights": True, "quantize_gradients": True}}
BASE = "fp32 comm"
CURVE_MODELS = {"small": GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32),
                "reference": reference_gpt_config()}
RESULTS = os.path.join(os.path.dirname(__file__), "results")


class Trainer:
    """One FSDP-wrapped GPT and its optimizer; ``step(i, rank)`` trains on this rank's slice of
    global batch ``i`` (``batch`` sequences of ``seq_len`` tokens, at most the model's)."""

    def __init__(self, cfg: GPTConfig, batch: int, seq_len: int = 0, **fsdp_kwargs):
        self.cfg, self.batch = cfg, batch
        self.data_cfg = dataclasses.replace(cfg, seq_len=seq_len or cfg.seq_len)
        self.world = skdist.get_world_size()
        composition = compose(GPT(cfg, seed=0), 3, adamw(LR),
                              wrap_policy=transformer_auto_wrap_policy({Block}), **fsdp_kwargs)
        self.model, self.optimizer = composition.wrapped, composition.optimizer

    def forward_backward(self, i: int, rank: int) -> torch.Tensor:
        idx, target = synthetic_batch(self.data_cfg, self.batch, i)
        per = self.batch // self.world
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


def _loss_curve(model_key: str, steps: int, batch: int, seq_len: int) -> dict:
    """Both configurations one after the other on the same batches: per step the loss averaged
    over ranks and the step time (this rank's clock), plus the first step's bytes per link."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    out = {}
    for name, kw in CONFIGS.items():
        trainer = Trainer(CURVE_MODELS[model_key], batch, seq_len, **kw)
        losses, seconds, links = [], [], None
        for i in range(steps):
            start = time.perf_counter()
            with skdist.CommCounter() as comm:
                loss = trainer.step(i, rank).reshape(1).clone()
            seconds.append(time.perf_counter() - start)
            if links is None:
                links = {"intra_node_bytes": comm.intra_node_bytes,
                         "inter_node_bytes": comm.inter_node_bytes}
            skdist.all_reduce(loss)
            losses.append(loss.item() / world)
            if rank == 0 and (i + 1) % 25 == 0:
                print(f"{name}: step {i + 1}/{steps}, loss {losses[-1]:.4f}, "
                      f"{seconds[-1]:.2f} s/step", file=sys.stderr, flush=True)
        out[name] = {"loss": losses, "seconds": seconds, "links": links,
                     "transport": trainer.model.comm.describe(),
                     "psi": sum(p.numel() for p in GPT(CURVE_MODELS[model_key]).parameters())}
        del trainer
    return out


def _plot(curves: dict, title: str, path: str) -> None:
    from shardkit.utils.charts import write_line_chart
    write_line_chart(path, title, curves, "step", "training loss (mean over ranks)")


def _timing_report(timing: dict, args) -> str:
    times = {k: statistics.median(v) for k, v in timing["times"].items()}
    lines = ["# FSDP with qwZ + qgZ (ZeRO++) vs fp32 communication (world 2, gloo, CPU)", "",
             f"`python -m benchmarks.bench_zeropp --rounds {args.rounds} --steps {args.steps}`, "
             f"torch {torch.__version__}, {os.cpu_count()} CPU cores shared with other jobs, one "
             f"thread per rank. Reference GPT, Ψ = {timing['psi']:,}, global batch "
             f"{TIMING_BATCH}, reshard_after_forward=True, {args.rounds} interleaved rounds of "
             f"{args.steps} steps after 2 warm-up steps; medians over rounds, rank 0's clock.",
             "", "| configuration | transport | median step (s) | x fp32 comm | "
             "bytes/step/rank (MB) | x fp32 comm bytes | those bytes at 1 Gbit/s (s) |",
             "|---|---|---|---|---|---|---|"]
    base_bytes = sum(timing["traffic"][BASE].values())
    for name in CONFIGS:
        nbytes = sum(timing["traffic"][name].values())
        lines.append(f"| {name} | {timing['described'][name]} | {times[name]:.3f} | "
                     f"{times[name] / times[BASE]:.2f} | {nbytes / 1e6:.1f} | "
                     f"{nbytes / base_bytes:.3f} | {nbytes * 8 / 1e9:.3f} |")
    lines += ["", "Bytes by op (rank 0, one forward + backward): " + "; ".join(
        f"{name}: " + ", ".join(f"{op} {b / 1e6:.2f} MB" for op, b in by_op.items())
        for name, by_op in timing["traffic"].items()),
        "Per-round times (s): " + "; ".join(
            f"{k}: " + ", ".join(f"{t:.3f}" for t in v) for k, v in timing["times"].items()), "",
        "The loss curve (2 nodes x 2 ranks, qwZ + qgZ against fp32 communication) is in "
        "[zeropp_loss.md](zeropp_loss.md).", ""]
    return "\n".join(lines)


def _curve_summary(curves: dict) -> dict:
    fp32, quant = curves[BASE]["loss"], curves["qwZ+qgZ"]["loss"]
    tail = max(1, len(fp32) // 10)
    mean_fp32, mean_quant = sum(fp32[-tail:]) / tail, sum(quant[-tail:]) / tail
    return {"final_fp32": fp32[-1], "final_quantized": quant[-1],
            "final_rel_diff": (quant[-1] - fp32[-1]) / fp32[-1], "tail_steps": tail,
            "tail_mean_fp32": mean_fp32, "tail_mean_quantized": mean_quant,
            "tail_rel_diff": (mean_quant - mean_fp32) / mean_fp32,
            "max_step_rel_diff": max(abs(q - f) / f for q, f in zip(quant, fp32))}


def _curve_report(curves: dict, summary: dict, args, command: str) -> str:
    cfg = CURVE_MODELS[args.curve_model]
    seq = args.curve_seq_len or cfg.seq_len
    steps = len(curves[BASE]["loss"])
    lines = [f"# Loss curve: FSDP qwZ + qgZ vs fp32 communication, {args.nodes} nodes x "
             f"{args.ranks_per_node} ranks", "",
             f"`{command}`, torch {torch.__version__}, {os.cpu_count()} CPU cores shared with "
             f"other jobs, one thread per rank. {args.nodes * args.ranks_per_node} local gloo "
             f"ranks labelled {args.nodes} nodes x {args.ranks_per_node} "
             f"(LOCAL_WORLD_SIZE={args.ranks_per_node}, GROUP_RANK = rank // "
             f"{args.ranks_per_node}: the topology code and CommCounter see {args.nodes} nodes; "
             f"the links are this machine's loopback). {args.curve_model} GPT (vocab "
             f"{cfg.vocab_size}, {cfg.n_layer} layers, d {cfg.d_model}, Ψ = "
             f"{curves[BASE]['psi']:,}), sequences of {seq} tokens, global batch "
             f"{args.curve_batch}, AdamW lr {LR}, FSDP FULL_SHARD with one unit per Block, "
             f"{steps} steps of each configuration from the same seed on the same batches.", "",
             "| configuration | transport | loss at step 1 | final loss | mean of the last "
             f"{summary['tail_steps']} | intra-node MB/step/rank | inter-node MB/step/rank | "
             "median step (s) |", "|---|---|---|---|---|---|---|---|"]
    for name, c in curves.items():
        tail = c["loss"][-summary["tail_steps"]:]
        lines.append(f"| {name} | {c['transport']} | {c['loss'][0]:.4f} | {c['loss'][-1]:.4f} "
                     f"| {sum(tail) / len(tail):.4f} | {c['links']['intra_node_bytes'] / 1e6:.2f}"
                     f" | {c['links']['inter_node_bytes'] / 1e6:.2f} | "
                     f"{statistics.median(c['seconds']):.3f} |")
    lines += ["", f"Final loss qwZ+qgZ vs fp32 communication: "
              f"{summary['final_rel_diff'] * 100:+.2f}% (target: within 2%); mean of the last "
              f"{summary['tail_steps']} steps: {summary['tail_rel_diff'] * 100:+.2f}%; largest "
              f"relative difference at any step: {summary['max_step_rel_diff'] * 100:.2f}%. "
              "Every step's loss and time: [zeropp_loss.json](zeropp_loss.json).", "",
              "![loss curves](zeropp_loss.png)", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (0: no timing)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--curve-steps", type=int, default=300, help="0: no loss curve")
    parser.add_argument("--curve-model", choices=sorted(CURVE_MODELS), default="reference")
    parser.add_argument("--curve-batch", type=int, default=4)
    parser.add_argument("--curve-seq-len", type=int, default=32,
                        help="tokens per sequence (at most the model's 128; 0: the model's)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(RESULTS, "zeropp.md"))
    args = parser.parse_args(argv)
    world = args.nodes * args.ranks_per_node
    if args.rounds < 0 or args.steps < 1 or args.curve_steps < 0:
        parser.error("--rounds and --curve-steps must be >= 0, --steps >= 1")
    if args.nodes < 1 or args.ranks_per_node < 1 or args.curve_batch % world:
        parser.error(f"--curve-batch {args.curve_batch} must be a multiple of the "
                     f"{args.nodes} x {args.ranks_per_node} ranks")
    if not 0 <= args.curve_seq_len <= CURVE_MODELS[args.curve_model].seq_len:
        parser.error(f"--curve-seq-len {args.curve_seq_len} must be between 0 and the model's "
                     f"{CURVE_MODELS[args.curve_model].seq_len}")
    folder = os.path.dirname(os.path.abspath(args.out))
    if args.rounds:
        with World(TIMING_WORLD, timeout=3600) as w:
            timing = w.run(_time_and_count, args.rounds, args.steps)[0]
        write_report(_timing_report(timing, args), args.out)
    if args.curve_steps:
        with World(world, timeout=7200, ranks_per_node=args.ranks_per_node) as w:
            curves = w.run(_loss_curve, args.curve_model, args.curve_steps, args.curve_batch,
                           args.curve_seq_len)[0]
        summary = _curve_summary(curves)
        command = ("python -m benchmarks.bench_zeropp --rounds 0 --curve-steps "
                   f"{args.curve_steps} --curve-model {args.curve_model} --curve-batch "
                   f"{args.curve_batch} --curve-seq-len {args.curve_seq_len} --nodes "
                   f"{args.nodes} --ranks-per-node {args.ranks_per_node}")
        with open(os.path.join(folder, "zeropp_loss.json"), "w") as f:
            json.dump({"command": command, "summary": summary, "runs": curves}, f, indent=1)
        _plot({name: c["loss"] for name, c in curves.items()},
              f"FSDP {args.nodes} nodes x {args.ranks_per_node} ranks, {args.curve_model} GPT: "
              f"fp32 communication vs qwZ + qgZ", os.path.join(folder, "zeropp_loss.png"))
        write_report(_curve_report(curves, summary, args, command),
                     os.path.join(folder, "zeropp_loss.md"))


if __name__ == "__main__":
    main()
