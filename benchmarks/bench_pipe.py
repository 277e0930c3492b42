"""Pipeline throughput: shardkit's schedules against torch.distributed.pipelining's, same run.

Two workloads, 2 pipeline ranks (gloo, one thread each):
    mlp  16 x (Linear(1024, 1024) + GELU), 8 micro-batches of 8 rows
    gpt  the reference GPT (vocab 8192, 6 layers, d 512, seq 128) cut between blocks
         (shardkit.recipes.gpt_as_sequential), 4 micro-batches of 1 sequence

Schedules, each beside torch's schedule of the same kind: GPipe (mlp only), 1F1B, interleaved
1F1B (2 stages per rank), ZB-H1 (torch: ScheduleInterleavedZeroBubble with one stage per rank)
and ZBV (torch: ScheduleZBVZeroBubble). Every configuration runs the same steps (forward,
backward, SGD step); rounds are interleaved so machine load hits all of them alike; ratios are
taken within a round and their median reported. Reported: samples/s, speed-up over one process
running the same micro-batches with gradient accumulation, shardkit against torch's same
schedule and against shardkit's 1F1B, and for shardkit's schedules the measured idle fraction
(1 - compute time / step time, averaged over the ranks) beside the schedule's formula.

    python -m benchmarks.bench_pipe [--steps 4] [--rounds 2] [--workloads mlp,gpt] [--out PATH]
    python -m benchmarks.bench_pipe --cluster 1gbit [--steps 4] [--rounds 2] [--out PATH]

Two launches of the same measurement. Without ``--cluster`` the 2 ranks are processes on this
machine started by :class:`shardkit.testing.World` (default report ``benchmarks/results/pipe.md``).
With ``--cluster RATE`` they are 2 nodes x 1 rank of the simulated cluster (network namespaces
joined by a veth link limited to RATE each way, torchrun on each node; needs root, see
:mod:`shardkit.cluster`): every rank runs this module's hidden ``--rank-side JSON`` entry, rank 0
writes the results there, and the launching side renders the report (default
``benchmarks/results/pipe_cluster_<RATE>.md``, its figures in the JSON beside it). Both launches
run :func:`measure` (the same configurations in the same interleaved rounds) and :func:`report`;
they differ only in how a function is run on every rank (``World.run``, or
:func:`run_on_this_rank`: the call, then an all-gather of the results) and how the results come
back. On the cluster the report adds the bytes the busier node's interface sent per step (kernel
counter, TCP/IP headers included) and how busy that keeps the link. A configuration that
raises on any rank (a torch schedule that cannot run the case) is reported as failed, on either
launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.common import cluster_env, link_tx_bytes, write_report

STAGES = 2
RESULTS = os.path.join(os.path.dirname(__file__), "results", "pipe.md")


def default_out(cluster_rate: Optional[str]) -> str:
    """Where the report goes by default: ``pipe.md`` for the local launch,
    ``pipe_cluster_<rate>.md`` for the simulated cluster at ``cluster_rate``."""
    if cluster_rate is None:
        return RESULTS
    return os.path.join(os.path.dirname(RESULTS), f"pipe_cluster_{cluster_rate}.md")


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
    the last), this process's CPU seconds per step (all its threads) and the bytes this node's
    link interface sent per step (None off the cluster)."""
    from shardkit import distributed as dist

    for _ in range(warmup):
        step()
    dist.barrier()
    tx_start = link_tx_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    cpu = time.process_time() - cpu_start
    dist.barrier()
    wall = (time.perf_counter() - start) / steps
    tx_end = link_tx_bytes()
    tx = None if tx_start is None or tx_end is None else (tx_end - tx_start) / steps
    return wall, cpu / steps, tx


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

    wall, cpu, tx = _time_steps(step, steps)
    return wall, cpu, None, tx


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

    wall, cpu, tx = _time_steps(step, steps)
    return wall, cpu, statistics.mean(busy[1:]), tx


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

    wall, cpu, tx = _time_steps(step, steps)
    return wall, cpu, None, tx


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


class RankFailure(RuntimeError):
    """A configuration raised on some rank; the message ends with the last failing rank's
    exception line (as :class:`shardkit.testing.WorldError`'s does)."""


def run_on_this_rank(fn: Callable, *args) -> list:
    """Call ``fn(*args)`` on this rank and return every rank's result in rank order (one
    all-gather of the results): what ``World.run`` gives the local launch, for ranks started by
    torchrun. Every rank must call it with the same function. If ``fn`` raised on any rank,
    every rank raises :class:`RankFailure` with the tracebacks, so that all of them take the
    same path. (A rank that fails while its peer waits on it leaves the peer waiting until the
    process group's timeout; the launch then fails as a whole.)"""
    from shardkit import distributed as dist

    try:
        mine = (True, fn(*args))
    except Exception:
        mine = (False, traceback.format_exc())
    everyone = dist.all_gather_object(mine)
    failed = [f"--- rank {r} raised:\n{value}" for r, (ok, value) in enumerate(everyone)
              if not ok]
    if failed:
        raise RankFailure("\n".join(failed).rstrip())
    return [value for _, value in everyone]


def measure(run: Callable, workload_names: list, steps: int, rounds: int) -> dict:
    """Every configuration of every workload, ``rounds`` interleaved rounds of ``steps`` timed
    steps each. ``run(fn, *args)`` calls ``fn`` on every rank and returns the results in rank
    order (``World.run``, or :func:`run_on_this_rank` on every torchrun rank).

    Returns ``{workload: {"seconds", "cpu", "idle", "link_tx": {configuration: [per round]}}}``:
    the slowest rank's wall-clock and CPU seconds per step, the idle fraction (a float, None
    where the schedule does not count busy time, or ``"failed: ..."``) and the bytes per step
    the busier node's link interface sent (None off the cluster).
    """
    results = {}
    for workload in workload_names:
        names = list(configs(workload))
        table = {key: {n: [] for n in names} for key in ("seconds", "cpu", "idle", "link_tx")}
        for _ in range(rounds):
            for name in names:
                try:
                    per_rank = [r for r in run(_run_config, workload, name, steps)
                                if r is not None]
                except Exception as error:  # a torch schedule that cannot run this case
                    table["seconds"][name].append(float("nan"))
                    table["cpu"][name].append(float("nan"))
                    table["idle"][name].append(f"failed: {str(error).splitlines()[-1][:80]}")
                    table["link_tx"][name].append(None)
                    continue
                wall = max(w for w, _, _, _ in per_rank)
                table["seconds"][name].append(wall)
                table["cpu"][name].append(max(c for _, c, _, _ in per_rank))
                busy = [b for _, _, b, _ in per_rank if b is not None]
                table["idle"][name].append(1 - statistics.mean(busy) / wall if busy else None)
                tx = [t for _, _, _, t in per_rank]
                table["link_tx"][name].append(None if None in tx else max(tx))
        results[workload] = table
    return results


def measure_local(workload_names: list, steps: int, rounds: int) -> dict:
    """:func:`measure` on 2 processes of this machine (:class:`shardkit.testing.World`)."""
    from shardkit.testing import World

    with World(STAGES, threads=1, timeout=1800) as world:
        return measure(world.run, workload_names, steps, rounds)


def _best(values):
    finite = [v for v in values if v == v]
    return min(finite) if finite else float("nan")


def _paired(reference: list, mine: list) -> str:
    """Median over rounds of ``reference / mine`` within one round (both ran back to back, so
    machine load hits them alike), as ``"1.23x"``."""
    ratios = [r / m for r, m in zip(reference, mine) if r == r and m == m]
    return f"{statistics.median(ratios):.2f}x" if ratios else ""


def launch_description(launch: dict) -> str:
    """One sentence saying how the ranks were started, from :func:`report`'s ``launch``."""
    if launch["kind"] == "local":
        return (f"Launch: local, {STAGES} processes on this machine started by "
                f"`shardkit.testing.World` (no link between them but the host's loopback).")
    hosts = ", ".join(launch.get("hosts") or [])
    return (f"Launch: simulated cluster, {STAGES} nodes x 1 rank (network namespaces"
            f"{' ' + hosts if hosts else ''}; torchrun on each node, static rendezvous), joined "
            f"by a veth link limited to {launch['link_rate']} each way (`tc tbf`); gloo over TCP "
            f"across that link. Both nodes share this machine's CPUs.")


def _link_cells(tx_per_round: list, step_s: float, rate_bps: Optional[int]) -> str:
    measured = [t for t in tx_per_round if t is not None]
    if not measured:
        return " — | — |"
    tx = statistics.median(measured)
    busy = f"{tx * 8 / rate_bps / step_s:.1%}" if rate_bps and step_s == step_s else "—"
    return f" {tx / 1e6:.2f} | {busy} |"


def report(results: dict, steps: int, rounds: int, launch: dict) -> str:
    """The Markdown report of :func:`measure`'s ``results``. ``launch``: ``kind`` ("local" or
    "cluster"), ``link_rate`` (cluster), ``load_start`` / ``load_end`` (load average when the
    measurement began and ended), ``cpus``, and ``hosts`` (the ranks' host names, cluster)."""
    from shardkit.cluster import parse_link_rate

    on_cluster = launch["kind"] == "cluster"
    rate_bps = parse_link_rate(launch.get("link_rate")) if on_cluster else None
    lines = [
        "# Pipeline throughput (benchmarks/bench_pipe.py)"
        + (f", simulated cluster at {launch['link_rate']}" if on_cluster else ""),
        "",
        launch_description(launch),
        "",
        f"{STAGES} pipeline ranks (gloo, 1 thread each); forward + backward + SGD step. "
        f"{rounds} interleaved rounds of {steps} steps after 2 warm-up steps (ZBV re-plans from "
        f"measured costs there); s/step is each configuration's best round, the ratios are the "
        f"median over rounds of the ratio within a round. Load average at the start: "
        f"{launch['load_start']:.1f}, at the end: {launch['load_end']:.1f} on "
        f"{launch['cpus']} CPUs.",
    ]
    link_head = (" link MB sent / step (busier node) | link busy |" if on_cluster else "")
    for workload, table in results.items():
        seconds, cpu, idle = table["seconds"], table["cpu"], table["idle"]
        spec = WORKLOADS[workload]
        rows = configs(workload)
        best = {name: _best(values) for name, values in seconds.items()}
        batch = _batch(workload)[0].shape[0]
        single = best[SINGLE]
        lines += [
            "", f"## {workload}: {spec.description}", "",
            "| configuration | s/step (best) | samples/s | speed-up vs single | vs torch, same "
            "schedule (median of rounds) | vs shardkit 1F1B (median of rounds) | CPU s/step, "
            "busiest rank | idle fraction (measured) | idle fraction (formula, F=B=W) |"
            + link_head,
            "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if on_cluster else ""),
        ]
        for name, value in best.items():
            _, _, _, torch_name, kind = rows[name]
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
            link = _link_cells(table["link_tx"][name], value, rate_bps) if on_cluster else ""
            lines.append(f"| {name} | {value:.3f} | {batch / value:.1f} | {single / value:.2f} | "
                         f"{vs_torch} | {vs_1f1b} | {_best(cpu[name]):.3f} | {idle_text} | "
                         f"{formula} |{link}")
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
    if on_cluster:
        lines += [
            "",
            "Link: the bytes the busier node's interface sent per timed step (kernel counter, "
            "median over rounds, TCP/IP headers and the barriers included); link busy = those "
            "bytes x 8 / rate / step time, the share of the step one direction of the link "
            "is serialising data.",
        ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- launches


def rank_main(out_path: str, workload_names: list, steps: int, rounds: int) -> int:
    """What every torchrun rank runs on the cluster: :func:`measure` with
    :func:`run_on_this_rank`; rank 0 writes the results, host names and end load as JSON."""
    from shardkit import distributed as dist

    # a rank left waiting on a failed peer gives up after 10 minutes, failing the launch
    dist.init_distributed(backend="gloo", timeout_s=600)
    torch.set_num_threads(1)
    results = measure(run_on_this_rank, workload_names, steps, rounds)
    hosts = dist.all_gather_object(os.uname().nodename)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"results": results, "hosts": hosts, "load_end": os.getloadavg()[0]}, f)
    dist.destroy()
    return 0


def measure_on_cluster(workload_names: list, steps: int, rounds: int, rate: str) -> dict:
    """Run :func:`rank_main` on a fresh simulated 2-node cluster (1 rank per node) linked at
    ``rate``; returns rank 0's JSON. Raises RuntimeError when the launch fails."""
    from shardkit.cluster import run_cluster

    env = cluster_env()
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = os.path.join(tmp, "raw.json")
        rc = run_cluster(["-m", "benchmarks.bench_pipe", "--rank-side", raw_path,
                          "--workloads", ",".join(workload_names), "--steps", str(steps),
                          "--rounds", str(rounds)],
                         nodes=STAGES, nproc_per_node=1, link_rate=rate, env=env)
        if rc != 0:
            raise RuntimeError(f"bench_pipe: the cluster run at {rate} failed with status {rc}")
        with open(raw_path) as f:
            return json.load(f)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring); fills ``out`` from :func:`default_out`
    and turns ``workloads`` into a list, rejecting unknown names and bad rates."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="mlp,gpt")
    parser.add_argument("--cluster", metavar="RATE", default=None,
                        help="run on the simulated 2-node cluster, link limited to RATE "
                             "(e.g. 1gbit, 10gbit, none); needs root")
    parser.add_argument("--out", default=None,
                        help="report path (default: results/pipe.md, or "
                             "results/pipe_cluster_RATE.md with --cluster)")
    parser.add_argument("--rank-side", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; valid: {sorted(WORKLOADS)}")
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)}: must be >= 1")
    if args.cluster is not None:
        from shardkit.cluster import parse_link_rate
        try:
            parse_link_rate(args.cluster)
        except ValueError as error:
            parser.error(f"--cluster: {error}")
    if args.out is None:
        args.out = default_out(args.cluster)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_side:
        return rank_main(args.rank_side, args.workloads, args.steps, args.rounds)
    launch = {"kind": "local" if args.cluster is None else "cluster",
              "link_rate": args.cluster, "load_start": os.getloadavg()[0],
              "cpus": os.cpu_count()}
    if args.cluster is None:
        results = measure_local(args.workloads, args.steps, args.rounds)
        launch["load_end"] = os.getloadavg()[0]
    else:
        from shardkit.cluster import cluster_unavailable_reason
        reason = cluster_unavailable_reason()
        if reason:
            print(f"bench_pipe: {reason}", file=sys.stderr)
            return 1
        try:
            raw = measure_on_cluster(args.workloads, args.steps, args.rounds, args.cluster)
        except RuntimeError as error:
            print(error, file=sys.stderr)
            return 1
        results = raw["results"]
        launch.update(hosts=raw["hosts"], load_end=raw["load_end"])
    write_report(report(results, args.steps, args.rounds, launch), args.out)
    if args.cluster is not None:  # the figures beside the report
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump({"launch": launch, "steps": args.steps, "rounds": args.rounds,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
