"""Where a training step's time goes: forward, backward and optimizer step, per rank.

    python -m benchmarks.bench_phases [--workload gpt] [--configs torch_ddp,shardkit_oss]
                                      [--steps 8] [--warmup 3] [--quick] [--out PATH]

World of 2 gloo ranks (one thread each), one reference workload of :mod:`benchmarks.common`,
the named configurations of its ``CONFIGS`` built side by side (each its own model from the
same seed), each trained ``warmup`` untimed steps, then ``steps`` timed ones, one
configuration after the other. Every step starts with a barrier and is timed in three parts on
each rank: ``zero_grad`` and forward with the loss, ``backward`` (under DDP: the gradient
all-reduce that it overlaps and the wait for it), and ``optimizer.step`` (under OSS: the
sharded step and the parameter all-gather). A row gives the medians of one rank, so the ranks
can be compared (an allocator that page-faults on one rank and not on the other shows here).
Meant for explaining the ratios of :mod:`benchmarks.run`, not for ratios of its own: the
configurations are not interleaved. Writes a Markdown table to ``--out`` (default
``benchmarks/results/phases.md``). Timings are never asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from benchmarks.common import CONFIG_BY_NAME, make_transport, workloads, write_report
from shardkit import distributed
from shardkit.testing import World

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "phases.md")
PHASES = ("forward", "backward", "step", "total")


def _time_phases(setup, workload, steps: int, warmup: int) -> dict:
    """Medians (s) over ``steps`` timed steps of each phase of ``setup`` on this rank."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    per_rank = workload.global_batch // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    times: dict = {phase: [] for phase in PHASES}
    model, optimizer = setup.module, setup.optimizer
    for step in range(warmup + steps):
        inputs, target = workload.batch(step)
        distributed.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = workload.loss_fn(model(inputs[rows]), target[rows])
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        optimizer.step()
        getattr(optimizer, "wait_for_sync", lambda: None)()
        end = time.perf_counter()
        if step >= warmup:
            for phase, seconds in zip(PHASES, (forward_done - start, backward_done - forward_done,
                                               end - backward_done, end - start)):
                times[phase].append(seconds)
    return {phase: statistics.median(values) for phase, values in times.items()}


def measure(workload_name: str, config_names: list, steps: int, warmup: int,
            quick: bool = False) -> dict:
    """On this rank: ``{config: {phase: median seconds}}`` (``quick``: the small stand-in
    workloads)."""
    workload = workloads(quick)[workload_name]
    out = {}
    for name in config_names:
        config = CONFIG_BY_NAME[name]
        comm = make_transport(config.transport)
        try:
            setup = config.setup(workload, workload.build(0), comm)
            out[name] = _time_phases(setup, workload, steps, warmup)
        finally:
            if comm is not None:
                comm.close()
    return out


def markdown(per_rank: list, args) -> str:
    lines = [
        "# Phases of a training step", "",
        f"`python -m benchmarks.bench_phases --workload {args.workload} --configs "
        f"{args.configs} --steps {args.steps} --warmup {args.warmup}"
        f"{' --quick' if args.quick else ''}`, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()}, "
        f"{os.cpu_count()} CPU cores; torch {torch.__version__}; world 2 (gloo, 1 thread per "
        f"rank). Medians over the timed steps, per rank, in ms; configurations run one after "
        f"the other (not interleaved).", "",
        "| configuration | rank | forward | backward | step | total |",
        "|---|---:|---:|---:|---:|---:|"]
    for name in args.configs.split(","):
        for rank, results in enumerate(per_rank):
            ms = [f"{1e3 * results[name][phase]:.1f}" for phase in PHASES]
            lines.append(f"| {CONFIG_BY_NAME[name].label} | {rank} | " + " | ".join(ms) + " |")
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="gpt", choices=("gpt", "mlp"))
    parser.add_argument("--configs", default="torch_ddp,shardkit_oss",
                        help="comma-separated names from benchmarks.common.CONFIGS")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small stand-in workloads")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    valid = [name for name, config in CONFIG_BY_NAME.items() if config.stage != "pipe"]
    unknown = [n for n in args.configs.split(",") if n not in valid]
    if unknown:
        parser.error(f"--configs: {unknown} not timed here; valid (data-parallel "
                     f"configurations): {', '.join(valid)}")
    with World(2, timeout=1800, threads=1) as world:
        per_rank = world.run(measure, args.workload, args.configs.split(","), args.steps,
                             args.warmup, args.quick)
    write_report(markdown(per_rank, args), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
