"""One benchmark runner: shardkit's wrappers against torch's, measured in the same run.

``python -m benchmarks.run [--quick] [--repeats 12] [--warmup 3] [--steps 1] [--out DIR]``

Starts one world of 2 gloo ranks (one thread each) with :class:`shardkit.testing.World` and,
per workload, builds every configuration of :mod:`benchmarks.common` side by side (each its own
model from the same seed), trains each ``warmup`` untimed steps, then runs ``repeats`` rounds:
in each round every configuration trains ``steps`` timed steps back to back, in an order that
rotates every round, in a window that every rank starts together and that closes once any
parameter sync still in flight has landed; a step lasts as long as its slowest rank's window
divided by the steps. (:func:`benchmarks.common.measure_side_by_side`.)
A row's time is the median over rounds; its ratios are the medians over rounds of the round's
time over the baseline's time in the same round (torch DDP, and the paired torch wrapper).
Defaults: 12 rounds x 1 timed step after 3 warm-up steps, i.e. 12 timed steps per
configuration; about 8 minutes on the slower 2-core VM for both reference workloads, with every GPT
configuration in memory at once (about 5 GB per rank). A round of the GPT lasts about 20 s,
so a row and its baseline are paired seconds apart: when each row was built and timed on its
own, a round spanned minutes, and the per-round ratios on the shared 2-core VM scattered by
+-0.2 with load that drifted in between (`bench_slower_vm_3.md`).

shardkit rows run on the default transport (the process group's collectives: gloo sockets on
CPU), like torch's; OSS + DDP, ShardedDDP + OSS and FSDP run again with
``comm=SharedMemoryTransport()`` as separate rows with their own ratios. Every row names its
transport.

Writes ``bench.md`` (a Markdown table: transport, ms/step, ratios, per-rank model-state bytes
beside the ZeRO formula, traffic per step counted by ``CommCounter`` beside the formula),
``bench.json`` and ``bench.png`` into ``--out`` (``benchmarks/results`` by default;
``out/bench-quick`` with ``--quick``), headed by the git commit measured. Nothing here is a
test: timings are ratios, never assertions.
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

from benchmarks.common import CONFIG_BY_NAME, CONFIGS, measure_side_by_side, workloads
from shardkit.testing import World, WorldError, import_only_torch_in_the_fork_server
from shardkit.utils.charts import BarGroup, write_bar_chart

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


def run_workloads(world: World, names: list, workload_names: list, args) -> dict:
    """``{(workload, config): per-rank results, or {"error": ...}}``: one side-by-side
    measurement per workload (a configuration that fails to build marks its own row; a
    failure while training marks every row of that workload)."""
    results: dict = {}
    for workload_name in workload_names:
        start = time.time()
        try:
            per_rank = world.run(measure_side_by_side, names, workload_name, args.quick,
                                 args.warmup, args.repeats, args.steps)
        except WorldError as e:
            last = [ln for ln in str(e).splitlines() if ln.strip()][-1].strip()
            print(f"  {workload_name}: FAILED: {last[:160]}", flush=True)
            for name in names:
                results[(workload_name, name)] = {"error": last[:200]}
            continue
        for name in names:
            if "error" in per_rank[0][name]:
                results[(workload_name, name)] = per_rank[0][name]
                print(f"  {workload_name:<4} {name:<24} FAILED: {per_rank[0][name]['error']}",
                      flush=True)
                continue
            results[(workload_name, name)] = [r[name] for r in per_rank]
            print(f"  {workload_name:<4} {name:<24} "
                  f"{statistics.median(round_ms(results[(workload_name, name)])):9.1f} ms/step "
                  f"(median)  {per_rank[0][name]['transport']}", flush=True)
        print(f"  {workload_name}: {time.time() - start:.0f} s", flush=True)
    return results


def round_ms(per_rank: list) -> list:
    """Per round, milliseconds per step of the slowest rank (the step ends when all are done)."""
    return [1e3 * max(ts) for ts in zip(*(r["round_times_s"] for r in per_rank))]


def summarize_row(workload, config, per_rank) -> dict:
    """One row's figures from every rank's results (formulas and bytes: the largest over
    ranks)."""
    counted = max(r["comm_bytes_per_step"] for r in per_rank)
    formula = max(r["comm_formula_bytes"] for r in per_rank)
    rounds = round_ms(per_rank)
    return {"workload": workload.name, "config": config.name, "label": config.label,
            "stage": config.stage, "library": config.library, "baseline": config.baseline,
            "transport": per_rank[0]["transport"], "transport_kind": config.transport,
            "transport_bytes": max(r["transport_bytes"] for r in per_rank),
            "round_ms": rounds, "ms_per_step": statistics.median(rounds),
            "rounds": len(rounds),
            "model_state_bytes": max(r["model_state_bytes"] for r in per_rank),
            "model_state_formula_bytes": max(r["model_state_formula_bytes"] for r in per_rank),
            "comm_bytes_per_step_counted": counted if config.library == "shardkit" else None,
            "comm_by_op": per_rank[0]["comm_by_op"] if config.library == "shardkit" else None,
            "comm_bytes_per_step_formula": formula,
            "params_per_rank": max(r["params"] for r in per_rank),
            "padded_params": max(r["padded_params"] for r in per_rank),
            "final_loss": next((r["loss"] for r in per_rank if r["loss"] is not None), None)}


def _paired_ratio(row: dict, base: Optional[dict]) -> Optional[float]:
    """Median over rounds of the row's round time over ``base``'s in the same round."""
    if base is None or len(base["round_ms"]) != len(row["round_ms"]):
        return None
    return statistics.median(t / b for t, b in zip(row["round_ms"], base["round_ms"]))


def add_ratios(rows: list) -> None:
    """Each row's time over its paired torch baseline and over torch DDP, same workload, as
    the median over rounds of the per-round ratios."""
    by_key = {(r["workload"], r["config"]): r for r in rows if "ms_per_step" in r}
    for r in rows:
        if "ms_per_step" not in r:
            continue
        base = by_key.get((r["workload"], r["baseline"])) if r["baseline"] else None
        r["ratio_to_baseline"] = _paired_ratio(r, base)
        r["ratio_to_ddp"] = _paired_ratio(r, by_key.get((r["workload"], "torch_ddp")))


def _mb(n) -> str:
    if n is None:
        return "—"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _ratio(x) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _transport_cell(r: dict) -> str:
    extra = f"; {_mb(r['transport_bytes'])} of shared-memory slots" if r["transport_bytes"] else ""
    return r["transport"] + extra


def _traffic_cell(r: dict) -> str:
    counted = r["comm_bytes_per_step_counted"]
    if counted is None:
        return "—"
    formula = r["comm_bytes_per_step_formula"]
    return f"{_mb(counted)} ({counted / formula:.3f})" if formula else _mb(counted)


def render_markdown(meta: dict, rows: list) -> str:
    """The results table as Markdown, headed by what was measured where."""
    lines = [f"# shardkit benchmarks ({'quick' if meta['quick'] else 'reference workloads'})",
             "",
             f"`{meta['command']}` at commit `{meta['git_commit']}`, {meta['date']}; "
             f"{meta['machine']}; torch {meta['torch']}; world {WORLD_SIZE} (gloo, 1 thread per "
             f"rank); fp32 AdamW; per workload every configuration built side by side, "
             f"{meta['warmup']} warm-up steps each, then {meta['repeats']} interleaved rounds "
             f"(each: {meta['steps']} timed step(s) of every configuration, order rotating, "
             f"in-flight syncs included); a step lasts as long as the slowest rank; ms/step = "
             f"median over rounds; ratios = median over rounds of the per-round ratio. Wall "
             f"time {meta['wall_s'] / 60:.1f} min.",
             "",
             "| workload | stage | configuration | transport | ms/step | × torch pair | "
             "× torch DDP | model states / rank | ZeRO formula | traffic / step (counted, "
             "÷ formula) | traffic / step (formula) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "ms_per_step" not in r:
            lines.append(f"| {r['workload']} | {r['stage']} | {r['label']} | | "
                         f"{r['status']}: {r['reason']} | | | | | | |")
            continue
        lines.append(f"| {r['workload']} | {r['stage']} | {r['label']} | "
                     f"{_transport_cell(r)} | {r['ms_per_step']:.1f} | "
                     f"{_ratio(r['ratio_to_baseline'])} | {_ratio(r['ratio_to_ddp'])} | "
                     f"{_mb(r['model_state_bytes'])} | {_mb(r['model_state_formula_bytes'])} | "
                     f"{_traffic_cell(r)} | {_mb(r['comm_bytes_per_step_formula'])} |")
    lines += ["",
              "Transport: what carried the row's collectives (`comm.describe()` of the "
              "wrappers; torch's wrappers and both pipelines use the process group). Rows "
              "marked *shared memory* opt in with one `SharedMemoryTransport()` passed as "
              "`comm=` to the configuration's shardkit wrappers (OSS's parameter sync under "
              "torch DDP, whose gradient all-reduce stays on gloo; ShardedDDP and OSS; every "
              "FSDP unit); its fixed slots are reported beside it, not in the model states.",
              "",
              "Optimizer: every row builds `torch.optim.AdamW` with the same hyper-parameters and "
              "leaves `fused`/`foreach` unset. torch's rows and both pipelines run torch's "
              "default implementation (on CPU, its per-tensor loop); shardkit's OSS (stages 1-2) "
              "and its stage-3 composition choose torch's own fused AdamW kernel for the shards "
              "(within rounding of torch's loop, not bit-identical), which is part of what those rows measure.",
              "",
              "× torch pair: shardkit OSS vs ZeroRedundancyOptimizer (both under DDP), "
              "ShardedDDP vs `fully_shard(reshard_after_forward=False)`, FSDP vs `fully_shard`, "
              "1F1B vs `torch.distributed.pipelining.Schedule1F1B`. Below 1 is faster.",
              "",
              "Model states: parameters + gradients + AdamW state per rank from tensor storages "
              "(shardkit: `model_state_bytes`; torch: local shards), beside the ZeRO formula "
              "(stage 0: 16Ψ, 1: 8Ψ + 8Ψ/N, 2: 4Ψ + 12Ψ/N, 3 and both `fully_shard` rows: "
              "16Ψ/N, pipeline: 16Ψ of the stage; bytes).",
              "",
              "Traffic per rank and step, in bytes, with the ring factor (N-1)/N: DDP 2Ψ; "
              "ZeroRedundancyOptimizer 2Ψ + Ψ; OSS + DDP 2Ψ + Ψ'; ShardedDDP + OSS Ψ + Ψ' "
              "(`fully_shard` without resharding: 2Ψ); ZeRO-3 2Ψ'_root + 3(Ψ' − Ψ'_root) (the "
              "root unit stays gathered from forward into backward); pipeline: the boundary "
              "activations and their gradients. Ψ' is Ψ as the wrapper lays it out (padding "
              "included: OSS's flat buffers, FSDP's padded units). shardkit rows are counted "
              "by `CommCounter` on the last step (÷ formula in brackets); torch's collectives "
              "bypass it, so only the formula is shown for them."]
    for w in meta["workloads"]:
        lines.append(f"- `{w}`: {meta['workloads'][w]}")
    return "\n".join(lines) + "\n"


def draw_chart(meta: dict, measured: list, path: str) -> str:
    """ms/step and per-rank model states of every measured row, as a PNG at ``path`` drawn by
    matplotlib (a benchmark dependency), its figures beside it in ``bench.chart.json``."""
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
    p.add_argument("--quick", action="store_true",
                   help="small models, 2 rounds of 1 timed step after 1 warm-up (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 12; quick 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps per configuration (default 3; quick 1)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per configuration and round (default 1)")
    p.add_argument("--workloads", default="gpt,mlp", help="comma-separated: gpt, mlp")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS),
                   help="comma-separated configuration names")
    p.add_argument("--out", default=None, help="output folder")
    args = p.parse_args(argv)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else 1
    args.out = args.out or ("out/bench-quick" if args.quick else "benchmarks/results")
    bad = [c for c in args.configs.split(",") if c not in CONFIG_BY_NAME]
    bad_w = [w for w in args.workloads.split(",") if w not in workloads(args.quick)]
    if bad:
        p.error(f"--configs: unknown {bad} (valid: {', '.join(CONFIG_BY_NAME)})")
    if bad_w:
        p.error(f"--workloads: unknown {bad_w} (valid: gpt, mlp)")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"--repeats {args.repeats} / --steps {args.steps} / --warmup {args.warmup}: "
                f"rounds and timed steps must be >= 1, warm-up steps >= 0")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out}: a file is there; give a folder (it is created if missing)")
    return args


def main(argv=None) -> int:
    """Measure every live configuration, write bench.md/.json/.png, print the table."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    started = time.time()
    loads = workloads(args.quick)
    workload_names = args.workloads.split(",")
    configs = [CONFIG_BY_NAME[c] for c in args.configs.split(",")]
    skipped = {c.name: why for c in configs if (why := available(c))}
    live = [c.name for c in configs if c.name not in skipped]
    print(f"benchmarks: world {WORLD_SIZE}, workloads {workload_names}, {args.repeats} rounds; "
          f"live: {', '.join(live)}" + (f"; skipped: {skipped}" if skipped else ""), flush=True)
    import_only_torch_in_the_fork_server()  # ranks import shardkit as under torchrun
    with World(WORLD_SIZE, timeout=900) as world:
        results = run_workloads(world, live, workload_names, args)
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
            "machine": f"{platform.machine()} Linux, {len(os.sched_getaffinity(0))} CPU cores",
            "torch": torch.__version__, "quick": args.quick, "repeats": args.repeats,
            "warmup": args.warmup, "steps": args.steps, "wall_s": time.time() - started,
            "command": " ".join(["python -m benchmarks.run", *argv]),
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
