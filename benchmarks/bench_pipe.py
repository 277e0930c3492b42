"""Pipeline throughput: shardkit's schedules against torch.distributed.pipelining's, same run.

Two workloads, 2 pipeline ranks (gloo, one thread each):
    mlp  16 x (Linear(1024, 1024) + GELU), 8 micro-batches of 8 rows
    gpt  the reference GPT (vocab 8192, 6 layers, d 512, seq 128) cut between blocks
         (shardkit.recipes.gpt_as_sequential), 4 micro-batches of 1 sequence

Schedules, each beside torch's schedule of the same kind: GPipe (mlp only), 1F1B, interleaved
1F1B (2 stages per rank), ZB-H1 (torch: ScheduleInterleavedZeroBubble with one stage per rank)
and ZBV (torch: ScheduleZBVZeroBubble). Every configuration runs the same steps (forward,
backward, SGD step); rounds are interleaved so machine load hits all of them alike; ratios are
taken within a round and their median reported. Reported: samples/s, speed-up over one process running the
same micro-batches with gradient accumulation, shardkit against torch's same schedule and against
shardkit's 1F1B, and for shardkit's schedules the measured idle fraction (1 - compute time / step
time, averaged over the ranks) beside the schedule's formula.

    python -m benchmarks.bench_pipe [--steps 4] [--rounds 2] [--workloads mlp,gpt]

Writes ``benchmarks/results/pipe.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import write_report

STAGES = 2
RESULTS = os.path.join(os.path.dirname(__file__), "results", "pipe.md")
LOAD_AT_START = float("nan")


@dataclass(frozen=True)
class PipeWorkload:
    """Layers to cut into stages, the batch, the loss and the micro-batch count."""

    name: str
    description: str
    chunks: int


WORKLOADS = {
    "mlp": PipeWorkload("mlp", "16 x (Linear(1024, 1024) + GELU), 8 micro-batches of 8 rows", 8),
    "gpt": PipeWorkload("gpt", "reference GPT (vocab 8192, 6 blocks, d 512, seq 128), "
                               "4 micro-batches of 1 sequence", 4),
}


def _layers(workload: str) -> nn.Sequential:
    torch.manual_seed(0)
    if workload == "mlp":
        layers = []
        for _ in range(16):
            layers += [nn.Linear(1024, 1024), nn.GELU()]
        return nn.Sequential(*layers)
    from shardkit.models import GPT, reference_gpt_config
    from shardkit.recipes import gpt_as_sequential

    return gpt_as_sequential(GPT(reference_gpt_config(), seed=0))


def _batch(workload: str):
    if workload == "mlp":
        g = torch.Generator().manual_seed(0)
        return torch.randn(64, 1024, generator=g), torch.randn(64, 1024, generator=g)
    from shardkit.models import reference_gpt_config, synthetic_batch

    return synthetic_batch(reference_gpt_config(), WORKLOADS["gpt"].chunks, 0)


def _loss_fn(workload: str):
    from shardkit.recipes import token_cross_entropy

    return F.mse_loss if workload == "mlp" else token_cross_entropy


# schedule kind -> (stages per rank, placement, shardkit class, torch class, idle formula)
KINDS = {
    "GPipe": (1, "loop", "ScheduleGPipe", "ScheduleGPipe", "(p-1)/(m+p-1)"),
    "1F1B": (1, "loop", "Schedule1F1B", "Schedule1F1B", "(p-1)/(m+p-1)"),
    "Interleaved1F1B": (2, "loop", "ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B",
                        "(p-1)/(v*m+p-1)"),
    "ZB-H1": (1, "loop", "ScheduleZeroBubble", "ScheduleInterleavedZeroBubble",
              "(p-1)/(3m+p-1)"),
    "ZBV": (2, "v", "ScheduleZBV", "ScheduleZBVZeroBubble", "dry run"),
}


def formula_idle(kind: str, p: int, m: int) -> float:
    """The schedule's idle fraction with F = B = W (a full backward = 2 F)."""
    from shardkit.nn.pipe.plan import zbv_plan

    v = KINDS[kind][0]
    if kind in ("GPipe", "1F1B", "Interleaved1F1B"):
        return (p - 1) / (v * m + p - 1)
    if kind == "ZB-H1":
        return (p - 1) / (3 * m + p - 1)
    return zbv_plan(p, m).dry_run().idle_fraction


def _my_stage_indices(num_stages: int, placement: str, rank: int) -> list:
    from shardkit.nn.pipe.stage import stage_rank

    return [s for s in range(num_stages)
            if stage_rank(s, num_stages, STAGES, placement) == rank]


def _parts(workload: str, num_stages: int) -> list:
    layers = _layers(workload)
    n = len(layers)
    balance = [n // num_stages + (1 if k < n % num_stages else 0) for k in range(num_stages)]
    from shardkit.nn.pipe import split_sequential

    return split_sequential(layers, balance)


def _time_steps(step, steps: int, warmup: int = 2) -> tuple:
    """Wall-clock seconds per step (from a barrier before the first timed step to one after
    the last) and this process's CPU seconds per step (all its threads)."""
    from shardkit import distributed as dist

    for _ in range(warmup):
        step()
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    cpu = time.process_time() - cpu_start
    dist.barrier()
    return (time.perf_counter() - start) / steps, cpu / steps


def _single_process(workload: str, steps: int):
    """Rank 0 runs the whole model over the micro-batches with gradient accumulation."""
    from shardkit import distributed as dist

    if dist.get_rank() != 0:
        _time_steps(lambda: None, steps, warmup=0)
        return None
    model, (x, y), loss_fn = _layers(workload), _batch(workload), _loss_fn(workload)
    chunks = WORKLOADS[workload].chunks
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(model(xs), ys) / chunks).backward()
        opt.step()

    return (*_time_steps(step, steps), None)


def _shardkit(workload: str, kind: str, steps: int, **kwargs):
    from shardkit import distributed as dist
    from shardkit.nn import pipe

    rank = dist.get_rank()
    per_rank, placement, cls_name, _, _ = KINDS[kind]
    num_stages = STAGES * per_rank
    parts = _parts(workload, num_stages)
    stages = [pipe.PipelineStage(parts[s], s, num_stages, placement=placement)
              for s in _my_stage_indices(num_stages, placement, rank)]
    cls = getattr(pipe, cls_name)
    arg = stages[0] if cls_name in ("ScheduleGPipe", "Schedule1F1B") else stages
    schedule = cls(arg, WORKLOADS[workload].chunks, _loss_fn(workload), **kwargs)
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=1e-3)
    x, y = _batch(workload)
    busy = []

    def step():
        opt.zero_grad()
        schedule.step(x, target=y)
        opt.step()
        busy.append(schedule.busy_seconds)

    wall, cpu = _time_steps(step, steps)
    return wall, cpu, statistics.mean(busy[1:])


def _torch(workload: str, kind: str, steps: int):
    from torch.distributed import pipelining

    from shardkit import distributed as dist

    rank = dist.get_rank()
    per_rank, placement, _, cls_name, _ = KINDS[kind]
    num_stages = STAGES * per_rank
    parts = _parts(workload, num_stages)
    mine = _my_stage_indices(num_stages, placement, rank)
    stages = [pipelining.PipelineStage(parts[s], s, num_stages, torch.device("cpu"))
              for s in mine]
    cls = getattr(pipelining, cls_name)
    arg = stages[0] if cls_name in ("ScheduleGPipe", "Schedule1F1B") else stages
    schedule = cls(arg, WORKLOADS[workload].chunks, loss_fn=_loss_fn(workload))
    opt = torch.optim.SGD([p for s in mine for p in parts[s].parameters()], lr=1e-3)
    x, y = _batch(workload)

    def step():
        opt.zero_grad()
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y, "losses": []} if num_stages - 1 in mine else {}
        schedule.step(*args, **kwargs)
        opt.step()

    return (*_time_steps(step, steps), None)


SINGLE = "single process, grad accumulation"


def configs(workload: str) -> dict:
    """name -> (function, args, kwargs, torch row it compares with, kind)."""
    out = {SINGLE: (_single_process, (workload,), {}, None, None)}
    kinds = [k for k in KINDS if workload == "mlp" or k != "GPipe"]
    for kind in kinds:
        out[f"shardkit {kind}"] = (_shardkit, (workload, kind), {}, f"torch {kind}", kind)
        if kind == "GPipe":
            out["shardkit GPipe, per-micro-batch weight grads"] = (
                _shardkit, (workload, kind), {"batch_weight_grads": False}, "torch GPipe", kind)
    for kind in kinds:
        out[f"torch {kind}"] = (_torch, (workload, kind), {}, None, kind)
    return out


def _run_config(workload: str, name: str, steps: int):
    fn, args, kwargs, _, _ = configs(workload)[name]
    return fn(*args, steps, **kwargs)


def measure(workload_names: list, steps: int, rounds: int) -> dict:
    from shardkit.testing import World

    results = {}
    with World(STAGES, threads=1, timeout=1800) as world:
        for workload in workload_names:
            names = list(configs(workload))
            seconds = {n: [] for n in names}
            cpu = {n: [] for n in names}
            idle = {n: [] for n in names}
            for _ in range(rounds):
                for name in names:
                    try:
                        per_rank = [r for r in world.run(_run_config, workload, name, steps)
                                    if r is not None]
                    except Exception as error:  # a torch schedule that cannot run this case
                        seconds[name].append(float("nan"))
                        cpu[name].append(float("nan"))
                        idle[name].append(f"failed: {str(error).splitlines()[-1][:80]}")
                        continue
                    wall = max(w for w, _, _ in per_rank)
                    seconds[name].append(wall)
                    cpu[name].append(max(c for _, c, _ in per_rank))
                    busy = [b for _, _, b in per_rank if b is not None]
                    idle[name].append(1 - statistics.mean(busy) / wall if busy else None)
            results[workload] = (seconds, cpu, idle)
    return results


def _best(values):
    finite = [v for v in values if v == v]
    return min(finite) if finite else float("nan")


def _paired(reference: list, mine: list) -> str:
    """Median over rounds of ``reference / mine`` within one round (both ran back to back, so
    machine load hits them alike), as ``"1.23x"``."""
    ratios = [r / m for r, m in zip(reference, mine) if r == r and m == m]
    return f"{statistics.median(ratios):.2f}x" if ratios else ""


def report(results: dict, steps: int, rounds: int) -> str:
    lines = [
        "# Pipeline throughput (benchmarks/bench_pipe.py)",
        "",
        f"{STAGES} pipeline ranks (gloo, 1 thread each); forward + backward + SGD step. "
        f"{rounds} interleaved rounds of {steps} steps after 2 warm-up steps (ZBV re-plans from "
        f"measured costs there); s/step is each configuration's best round, the ratios are the "
        f"median over rounds of the ratio within a round. Load average at the start: "
        f"{LOAD_AT_START:.1f}, at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.",
    ]
    for workload, (seconds, cpu, idle) in results.items():
        spec = WORKLOADS[workload]
        table = configs(workload)
        best = {name: _best(values) for name, values in seconds.items()}
        batch = _batch(workload)[0].shape[0]
        single = best[SINGLE]
        lines += [
            "", f"## {workload}: {spec.description}", "",
            "| configuration | s/step (best) | samples/s | speed-up vs single | vs torch, same "
            "schedule (median of rounds) | vs shardkit 1F1B (median of rounds) | CPU s/step, busiest rank | idle fraction (measured) "
            "| idle fraction (formula, F=B=W) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, value in best.items():
            _, _, _, torch_name, kind = table[name]
            vs_torch = _paired(seconds[torch_name], seconds[name]) if torch_name else ""
            vs_1f1b = (_paired(seconds["shardkit 1F1B"], seconds[name])
                       if name.startswith("shardkit") else "")
            measured = [i for i in idle[name] if isinstance(i, float)]
            failed = [i for i in idle[name] if isinstance(i, str)]
            idle_text = f"{min(measured):.2f}" if measured else (failed[0] if failed else "")
            formula = ""
            if kind and name.startswith("shardkit"):
                formula = (f"{formula_idle(kind, STAGES, spec.chunks):.2f} "
                           f"({KINDS[kind][4]})")
            lines.append(f"| {name} | {value:.3f} | {batch / value:.1f} | {single / value:.2f} | "
                         f"{vs_torch} | {vs_1f1b} | {_best(cpu[name]):.3f} | {idle_text} | "
                         f"{formula} |")
    lines += [
        "",
        "Idle fraction (measured): 1 - (seconds in forward, backward and W) / (step seconds), "
        "mean over ranks, of the round with the least idle; it includes the optimizer step and "
        "the Python around the actions, so it sits above the formula even for a perfect "
        "schedule. The formula assumes F = B = W; on CPU a block's B and W differ, and ZB-H1's "
        "gain over 1F1B depends on W filling the cool-down.",
        "",
        "Wall-clock figures depend on what else the machine runs: when the load average exceeds "
        "the CPU count each process gets only a share of a core and the ratios say little about "
        "the schedules; CPU seconds per step of the busiest rank measure each implementation's "
        "own work (communication threads included) and are steadier.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="mlp,gpt")
    args = parser.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; valid: {sorted(WORKLOADS)}")
    global LOAD_AT_START
    LOAD_AT_START = os.getloadavg()[0]
    results = measure(names, args.steps, args.rounds)
    write_report(report(results, args.steps, args.rounds), RESULTS)


if __name__ == "__main__":
    main()
