"""One benchmark runner: shardkit's wrappers against torch's, measured in the same run.

``python -m benchmarks.run [--quick] [--repeats 3] [--steps 2] [--out benchmarks/results]``

Starts one world of 2 gloo ranks (one thread each) with :class:`shardkit.testing.World` and,
``repeats`` times, runs every configuration of :mod:`benchmarks.common` on every workload in
turn (the order rotates each round, so drift on a shared machine spreads over all rows). Each
measurement builds the model afresh, trains ``warmup`` untimed steps and ``steps`` timed ones
(ranks start each step together). A row's time is the median over rounds of its mean step time
on the slowest rank.

Writes ``bench.md`` (a Markdown table: ms/step, ratio to the paired torch baseline and to torch
DDP, per-rank model-state bytes, traffic per step), ``bench.json`` and ``bench.png`` into
``--out`` (``benchmarks/results`` by default; ``out/bench-quick`` with ``--quick``), headed by
the git commit measured. Nothing here is a test: timings are ratios, never assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Optional

import torch

from benchmarks.common import CONFIG_BY_NAME, CONFIGS, measure, workloads
from shardkit.testing import World, WorldError
from shardkit.utils.barchart import BarGroup, write_bar_chart

WORLD_SIZE = 2


def available(config) -> Optional[str]:
    """None when ``config``'s imports work, else why not."""
    import importlib
    for need in config.needs:
        module, attr = need.split(":")
        try:
            getattr(importlib.import_module(module), attr)
        except Exception as e:  # a wrapper still being written: skip the row, say why
            return f"{module}.{attr} does not import ({type(e).__name__})"
    return None


def run_rounds(world: World, names: list, workload_names: list, args) -> dict:
    """``{(workload, config): [per-round per-rank results] or {"error": ...}}``."""
    results: dict = {}
    jobs = [(w, c) for w in workload_names for c in names]
    for round_index in range(args.repeats):
        shift = round_index % len(jobs)
        for workload_name, name in jobs[shift:] + jobs[:shift]:
            key = (workload_name, name)
            if isinstance(results.get(key), dict):
                continue  # failed before: do not try again
            start = time.time()
            try:
                per_rank = world.run(measure, name, workload_name, args.quick, args.warmup,
                                     args.steps)
            except WorldError as e:
                last = [ln for ln in str(e).splitlines() if ln.strip()][-1].strip()
                results[key] = {"error": last[:200]}
                print(f"  round {round_index + 1}: {workload_name:<4} {name:<24} FAILED: "
                      f"{last[:120]}", flush=True)
                continue
            results.setdefault(key, []).append(per_rank)
            ms = 1e3 * max(statistics.mean(r["step_times_s"]) for r in per_rank)
            print(f"  round {round_index + 1}: {workload_name:<4} {name:<24} {ms:9.1f} ms/step "
                  f"({time.time() - start:.0f} s)", flush=True)
    return results


def summarize_row(workload, config, rounds) -> dict:
    """One row's figures from its rounds."""
    step_ms = statistics.median(
        1e3 * max(statistics.mean(r["step_times_s"]) for r in per_rank) for per_rank in rounds)
    last = rounds[-1]
    params = max(r["params"] for r in last)
    n = WORLD_SIZE
    if config.stage == "pipe":  # boundary activations forward, their gradients back
        formula = workload.global_batch * workload.boundary_numel * 4
    else:
        formula = config.comm_factor * params * (n - 1) / n * 4
    return {"workload": workload.name, "config": config.name, "label": config.label,
            "stage": config.stage, "library": config.library, "baseline": config.baseline,
            "ms_per_step": step_ms, "rounds": len(rounds),
            "model_state_bytes": max(r["model_state_bytes"] for r in last),
            "comm_bytes_per_step_counted": (max(r["comm_bytes_per_step"] for r in last)
                                            if config.library == "shardkit" else None),
            "comm_bytes_per_step_formula": formula, "params_per_rank": params,
            "final_loss": next((r["loss"] for r in last if r["loss"] is not None), None)}


def add_ratios(rows: list) -> None:
    """Each row's time over its paired torch baseline and over torch DDP, same workload."""
    by_key = {(r["workload"], r["config"]): r for r in rows if "ms_per_step" in r}
    for r in rows:
        if "ms_per_step" not in r:
            continue
        base = by_key.get((r["workload"], r["baseline"])) if r["baseline"] else None
        ddp = by_key.get((r["workload"], "torch_ddp"))
        r["ratio_to_baseline"] = r["ms_per_step"] / base["ms_per_step"] if base else None
        r["ratio_to_ddp"] = r["ms_per_step"] / ddp["ms_per_step"] if ddp else None


def _mb(n) -> str:
    if n is None:
        return "—"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def render_markdown(meta: dict, rows: list) -> str:
    """The results table as Markdown, headed by what was measured where."""
    lines = [f"# shardkit benchmarks ({'quick' if meta['quick'] else 'reference workloads'})",
             "",
             f"Commit `{meta['git_commit']}`, {meta['date']}; {meta['machine']}; torch "
             f"{meta['torch']}; world {WORLD_SIZE} (gloo, 1 thread per rank); fp32 AdamW; "
             f"{meta['repeats']} interleaved rounds × ({meta['warmup']} warm-up + "
             f"{meta['steps']} timed steps); time = median over rounds of the slowest rank's "
             f"mean step.",
             "",
             "| workload | stage | configuration | ms/step | × torch pair | × torch DDP | "
             "model states / rank | traffic / step (counted) | traffic / step (formula) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "ms_per_step" not in r:
            lines.append(f"| {r['workload']} | {r['stage']} | {r['label']} | "
                         f"{r['status']}: {r['reason']} | | | | | |")
            continue
        lines.append(f"| {r['workload']} | {r['stage']} | {r['label']} | "
                     f"{r['ms_per_step']:.1f} | {_ratio(r['ratio_to_baseline'])} | "
                     f"{_ratio(r['ratio_to_ddp'])} | {_mb(r['model_state_bytes'])} | "
                     f"{_mb(r['comm_bytes_per_step_counted'])} | "
                     f"{_mb(r['comm_bytes_per_step_formula'])} |")
    lines += ["", "× torch pair: shardkit OSS vs ZeroRedundancyOptimizer (both under DDP), "
              "ShardedDDP vs `fully_shard(reshard_after_forward=False)`, FSDP vs `fully_shard`, "
              "1F1B vs `torch.distributed.pipelining.Schedule1F1B`. Below 1 is faster. "
              "Traffic: shardkit rows counted by `CommCounter`; torch's collectives bypass it, "
              "so only the formula is shown for them (stage 1 under DDP: 3Ψ(N-1)/N elements, "
              "stage 2: 2Ψ(N-1)/N, stage 3: 3Ψ(N-1)/N, pipeline: boundary activations)."]
    for w in meta["workloads"]:
        lines.append(f"- `{w}`: {meta['workloads'][w]}")
    return "\n".join(lines) + "\n"


def draw_chart(meta: dict, measured: list, path: str) -> str:
    """ms/step and per-rank model states of every measured row, as a PNG at ``path``."""
    groups = [BarGroup(f"{r['workload']} {r['label']}",
                       {"ms per step": r["ms_per_step"],
                        "model states per rank (MB)": r["model_state_bytes"] / 1e6})
              for r in measured]
    return write_bar_chart(path, f"shardkit vs torch, world {WORLD_SIZE}, commit "
                                 f"{meta['git_commit']}", groups)


def git_commit() -> str:
    """The short commit hash of the checkout measured, marked when shardkit/ has uncommitted
    edits (the working tree is what ran)."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "shardkit")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit} + uncommitted edits in shardkit/" if dirty else commit


def parse_args(argv):
    """The runner's options; bad names or counts exit 2 with argparse's message."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split(
        "\n")[0])
    p.add_argument("--quick", action="store_true", help="small models, one round")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per measurement")
    p.add_argument("--steps", type=int, default=2, help="timed steps per measurement")
    p.add_argument("--workloads", default="gpt,mlp", help="comma-separated: gpt, mlp")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="comma-separated configuration names")
    p.add_argument("--out", default=None, help="output folder")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.out = args.out or ("out/bench-quick" if args.quick else "benchmarks/results")
    bad = [c for c in args.configs.split(",") if c not in CONFIG_BY_NAME]
    bad_w = [w for w in args.workloads.split(",") if w not in workloads(args.quick)]
    if bad or bad_w or args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"unknown configs {bad} (valid: {', '.join(CONFIG_BY_NAME)}) or workloads "
                f"{bad_w} (valid: gpt, mlp), or a non-positive --repeats/--steps")
    return args


def main(argv=None) -> int:
    """Measure every live configuration, write bench.md/.json/.png, print the table."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    loads = workloads(args.quick)
    workload_names = args.workloads.split(",")
    configs = [CONFIG_BY_NAME[c] for c in args.configs.split(",")]
    skipped = {c.name: why for c in configs if (why := available(c))}
    live = [c.name for c in configs if c.name not in skipped]
    print(f"benchmarks: world {WORLD_SIZE}, workloads {workload_names}, {args.repeats} rounds; "
          f"live: {', '.join(live)}" + (f"; skipped: {skipped}" if skipped else ""), flush=True)
    with World(WORLD_SIZE, timeout=900) as world:
        results = run_rounds(world, live, workload_names, args)
    rows = []
    for w in workload_names:
        for c in configs:
            got = results.get((w, c.name))
            if c.name in skipped or isinstance(got, dict) or not got:
                reason = skipped.get(c.name) or (got or {}).get("error", "not run")
                rows.append({"workload": w, "config": c.name, "label": c.label,
                             "stage": c.stage, "status": "unavailable" if c.name in skipped
                             else "failed", "reason": reason})
            else:
                rows.append(summarize_row(loads[w], c, got))
    add_ratios(rows)
    meta = {"git_commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                              time.gmtime()),
            "machine": f"{platform.machine()} Linux, {os.cpu_count()} CPU cores",
            "torch": torch.__version__, "quick": args.quick, "repeats": args.repeats,
            "warmup": args.warmup, "steps": args.steps,
            "workloads": {w: loads[w].description for w in workload_names}}
    os.makedirs(args.out, exist_ok=True)
    table = render_markdown(meta, rows)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    measured = [r for r in rows if "ms_per_step" in r]
    if measured:
        print(draw_chart(meta, measured, os.path.join(args.out, "bench.png")))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
