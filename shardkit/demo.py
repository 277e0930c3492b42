"""The main job: what each wrapper saves and costs, side by side, in one command.

``python -m shardkit demo [--world-size 2] [--steps 100] [--model small|reference] [--out DIR]``
launches ``world-size`` CPU processes with ``torchrun`` (one launch that runs every
configuration in turn) and trains a GPT on the synthetic next-token task
(:func:`shardkit.models.synthetic_batch`) with, in order:

=================  =====  =====================================================================
run                stage  what it is
=================  =====  =====================================================================
``ddp``            0      torch DistributedDataParallel (gradients are counted through a comm
                          hook that all-reduces with :func:`shardkit.distributed.all_reduce`)
``oss``            1      :class:`shardkit.optim.OSS` around AdamW, under torch DDP
``sharded_ddp``    2      :class:`shardkit.nn.data_parallel.ShardedDataParallel` + OSS
``fsdp``           3      :class:`shardkit.nn.data_parallel.FullyShardedDataParallel`, one
                          unit per transformer ``Block``
``fsdp_offload``   3      the same with ``move_params_to_cpu=True``
``pipeline``       --     a ``world-size``-stage 1F1B pipeline (``shardkit.nn.pipe``)
=================  =====  =====================================================================

Every data-parallel run sees the same global batch split over the ranks, from the same seed, in
fp32, so their final losses agree. Rank 0 draws a progress bar per run; the launcher then prints
a table -- per-rank model-state bytes measured from storages
(:func:`shardkit.utils.memory.model_state_bytes`) beside the ZeRO formula for the measured Ψ and
N, peak RSS per rank, step time and its ratio to DDP, bytes communicated per step
(:class:`shardkit.distributed.CommCounter`) beside the formula, and the final loss -- and writes
the same figures to ``DIR/demo.json`` and a bar chart (matplotlib) to ``DIR/demo.png``.

A run whose wrapper does not import yet is listed as skipped; a run that fails is reported
with the last line of its error (full log in ``DIR/launch.log``) and the others still run.

Costs: ``world-size`` processes of one thread each; the small model (0.5M parameters) trains
the six runs in well under two minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from shardkit import distributed
from shardkit.models import GPT, Block, GPTConfig, reference_gpt_config, synthetic_batch
from shardkit.nn.wrap import transformer_auto_wrap_policy
from shardkit.plan import (FP32_ADAMW, pipeline_comm_elements, zero_comm_elements_per_step,
                           zero_model_state_bytes)
from shardkit.recipes import (TrainingSetup, adamw, compose, compose_pipeline, count_params,
                              gpt_as_sequential, pipeline_chunks, token_cross_entropy)
from shardkit.utils.memory import model_state_bytes

__all__ = ["MODELS", "RUNS", "RunSpec", "small_gpt", "reference_gpt", "main"]

MODELS = {
    "small": GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32),
    "reference": reference_gpt_config(),
}
LEARNING_RATE = 1e-3
PROCESSES_PER_CORE = 2


def small_gpt() -> "GPT":
    """The demo's default model (vocab 512, 2 layers, d 128, seq 32; ~0.53M parameters)."""
    return GPT(MODELS["small"])


def reference_gpt() -> "GPT":
    """The benchmarks' reference GPT (vocab 8192, 6 layers, d 512, seq 128; ~27M parameters)."""
    return GPT(MODELS["reference"])


@dataclass(frozen=True)
class RunSpec:
    """One row of the demo: which ZeRO stage (the arguments of :func:`shardkit.recipes.compose`),
    which imports it needs."""

    name: str
    label: str
    stage: Optional[int]          # None: not data parallel (the pipeline)
    needs: tuple = ()             # "module:attribute" that must import for the run to be live
    min_world_size: int = 1
    offload: bool = False         # stage 3: shards and optimizer state in CPU memory


_FSDP_NEEDS = ("shardkit.nn.data_parallel:FullyShardedDataParallel", "shardkit.nn.wrap:auto_wrap",
               "shardkit.nn.wrap:enable_wrap", "shardkit.nn.wrap:transformer_auto_wrap_policy")
RUNS = (
    RunSpec("ddp", "torch DDP", 0),
    RunSpec("oss", "OSS + DDP", 1, ("shardkit.optim:OSS",)),
    RunSpec("sharded_ddp", "ShardedDDP + OSS", 2,
            ("shardkit.optim:OSS", "shardkit.nn.data_parallel:ShardedDataParallel")),
    RunSpec("fsdp", "FSDP", 3, _FSDP_NEEDS),
    RunSpec("fsdp_offload", "FSDP + CPU offload", 3, _FSDP_NEEDS, offload=True),
    RunSpec("pipeline", "1F1B pipeline", None,
            ("shardkit.nn.pipe:PipelineStage", "shardkit.nn.pipe:Schedule1F1B",
             "shardkit.nn.pipe:split_sequential"), min_world_size=2),
)
RUN_BY_NAME = {r.name: r for r in RUNS}
RUN_ALIASES = {"0": "ddp", "1": "oss", "2": "sharded_ddp", "3": "fsdp", "offload": "fsdp_offload",
               "pipe": "pipeline"}


class DemoError(ValueError):
    """Bad input to the demo; the message names the argument, the value and what is valid."""


# ============================================================================ the training side
# Everything below up to the launcher runs inside the torchrun workers.


def build_setup(name: str, cfg: GPTConfig, seed: int, global_batch: int) -> TrainingSetup:
    """Model, wrap, optimizer: the :class:`TrainingSetup` of run ``name``, built by
    :func:`shardkit.recipes.compose` (FSDP units: the GPT's ``Block``)."""
    if name not in RUN_BY_NAME:
        raise DemoError(f"unknown run {name!r}; valid runs are {', '.join(RUN_BY_NAME)}")
    spec, model = RUN_BY_NAME[name], GPT(cfg, seed)
    if spec.stage is None:
        chunks = pipeline_chunks(global_batch, distributed.get_world_size())
        return compose_pipeline(gpt_as_sequential(model), token_cross_entropy,
                                adamw(LEARNING_RATE), chunks)
    extra = {"wrap_policy": transformer_auto_wrap_policy({Block}),
             "offload": spec.offload} if spec.stage == 3 else {}
    composition = compose(model, spec.stage, adamw(LEARNING_RATE), **extra)
    return composition.training_setup(token_cross_entropy)


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (``resource.getrusage``), in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def draw_progress(label: str, step: int, total: int, loss: float, ms: float) -> None:
    """Redraw rank 0's progress bar for the current run on one terminal line (away from a
    terminal, as in logs, only the finished bar is printed); ``ms`` is the step time so far
    as :func:`mean_step_time` counts it."""
    if step < total and not sys.stdout.isatty():
        return
    width = 30
    done = int(width * step / total)
    print(f"\r  {label:<20}[{'#' * done}{'-' * (width - done)}] {step:>4}/{total} "
          f"loss {loss:7.4f}  {ms:7.1f} ms/step", end="", flush=True)


def mean_step_time(step_times: list) -> float:
    """The mean step time the demo reports, in seconds: the first step pays one-off set-up
    costs, so it is left out once there are others. Rank 0's progress bar shows this figure
    as it grows and the table shows it for the slowest rank, so the two agree."""
    timed = step_times[1:] or step_times
    return sum(timed) / len(timed)


def train_and_measure(spec: RunSpec, cfg: GPTConfig, steps: int, global_batch: int,
                      seed: int) -> dict:
    """Train run ``spec`` for ``steps`` steps on this rank and measure it; returns this rank's
    figures (the loss is the global-batch loss, the same on every rank)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    gc.collect()
    rss_reset = reset_peak_rss()
    rss_at_start = peak_rss_bytes()
    setup = build_setup(spec.name, cfg, seed, global_batch)
    local = global_batch // world if setup.data_parallel else global_batch
    lo = rank * local if setup.data_parallel else 0
    losses, step_times, comm_bytes = [], [], []
    for step in range(steps):
        idx, target = synthetic_batch(cfg, global_batch, step)
        idx, target = idx[lo:lo + local], target[lo:lo + local]
        start = time.perf_counter()
        with distributed.CommCounter() as comm:
            loss = setup.train_step(idx, target)
        step_times.append(time.perf_counter() - start)
        comm_bytes.append(comm.bytes)
        if step == steps - 1:  # after the step, before the next zero_grad
            memory = model_state_bytes(setup.module, setup.optimizer).as_dict()
        losses.append(_global_loss(loss, spec, world))
        if rank == 0:
            draw_progress(spec.label, step + 1, steps, losses[-1],
                          1e3 * mean_step_time(step_times))
    if rank == 0:
        print(flush=True)
    figures = {"rank": rank, "model_state_bytes": memory, "params": setup.params,
               "peak_rss_bytes": peak_rss_bytes(), "rss_at_start_bytes": rss_at_start,
               "peak_rss_scope": "run" if rss_reset else "process",
               "step_time_s": mean_step_time(step_times),
               "comm_bytes_per_step": comm_bytes[-1], "losses": losses}
    del setup
    gc.collect()
    return figures


def _global_loss(loss, spec: RunSpec, world: int) -> float:
    """The global-batch loss on every rank (communication outside the counted step)."""
    if spec.stage is None:  # pipeline: the last stage has it
        box = torch.zeros(1) if loss is None else loss.reshape(1).float()
        distributed.broadcast(box, src=world - 1)
        return box.item()
    box = loss.reshape(1).float().clone()
    distributed.all_reduce(box)
    return box.item() / world


def run_worker(args) -> int:
    """Body of each torchrun worker: every requested run in turn, results to ``--out``."""
    torch.set_num_threads(1)
    distributed.init_distributed(timeout_s=args.timeout)
    rank = distributed.get_rank()
    cfg = MODELS[args.model]
    runs_dir = os.path.join(args.out, "runs")
    for name in args.runs.split(","):
        try:
            figures = train_and_measure(RUN_BY_NAME[name], cfg, args.steps, args.batch,
                                        args.seed)
        except BaseException:
            with open(os.path.join(runs_dir, f"{name}.rank{rank}.error"), "w") as f:
                f.write(traceback.format_exc())
            raise
        per_rank = distributed.all_gather_object(figures)
        if rank == 0:
            with open(os.path.join(runs_dir, f"{name}.json"), "w") as f:
                json.dump(per_rank, f)
        distributed.barrier()
    distributed.destroy()
    return 0


# ============================================================================ the launcher side


@dataclass(frozen=True)
class DemoRequest:
    """Validated demo options."""

    world_size: int
    steps: int
    model: str
    batch: int
    runs: tuple
    out: str
    seed: int
    timeout: float


def parse_runs(text: str) -> tuple:
    """``"ddp,oss,3"`` -> run names (aliases: 0-3 for the stages, offload, pipe)."""
    names = []
    for part in str(text).split(","):
        name = RUN_ALIASES.get(part.strip(), part.strip())
        if name not in RUN_BY_NAME:
            raise DemoError(f"--runs: {part.strip()!r} is not a known run or stage; valid are "
                            f"{', '.join(RUN_BY_NAME)} or stages 0, 1, 2, 3")
        if name not in names:
            names.append(name)
    return tuple(names)


def validate(args) -> DemoRequest:
    """Check every option before launching anything; a :class:`DemoError` says what is wrong."""
    cores = os.cpu_count() or 1
    limit = PROCESSES_PER_CORE * cores
    if args.world_size < 1:
        raise DemoError(f"--world-size {args.world_size} must be at least 1")
    if args.world_size > limit:
        raise DemoError(f"--world-size {args.world_size} is larger than this machine allows: "
                        f"it has {cores} CPU core(s) and the demo runs at most "
                        f"{PROCESSES_PER_CORE} processes per core, so at most {limit}")
    if args.model not in MODELS:
        raise DemoError(f"--model {args.model!r} is unknown; valid models are "
                        f"{', '.join(MODELS)}")
    if args.steps < 1:
        raise DemoError(f"--steps {args.steps} must be at least 1")
    if args.batch < 1 or args.batch % args.world_size:
        raise DemoError(f"--batch {args.batch} (the global batch) must be a positive multiple "
                        f"of --world-size {args.world_size}")
    if not -2**63 <= args.seed < 2**64:  # torch.Generator.manual_seed's range
        raise DemoError(f"--seed {args.seed} is out of range; valid seeds are integers from "
                        f"-2**63 to 2**64 - 1")
    if not 0 < args.timeout < float("inf"):
        raise DemoError(f"--timeout {args.timeout} must be a positive, finite number of seconds")
    out = args.out or os.path.join("out", time.strftime("demo-%Y%m%d-%H%M%S"))
    _check_writable_folder(out)
    return DemoRequest(args.world_size, args.steps, args.model, args.batch,
                       parse_runs(args.runs), out, args.seed, args.timeout)


def _check_writable_folder(out: str) -> None:
    """``--out`` must be a folder, or a path whose nearest existing ancestor is a folder this
    user can write (it is created at launch); checked without creating anything."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise DemoError(f"--out {out!r} is a file, not a folder; give a folder for the figures")
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise DemoError(f"--out {out!r} cannot be created: {path!r} is not a folder this user "
                        f"can write; give a folder this user can write")


def unavailable_reason(spec: RunSpec, world_size: int, cfg: GPTConfig) -> Optional[str]:
    """Why ``spec`` cannot run here (its wrapper does not import, too few ranks), or None."""
    if world_size < spec.min_world_size:
        return f"needs at least {spec.min_world_size} ranks"
    layers = cfg.n_layer + 3  # embeddings, blocks, final norm, head
    if spec.stage is None and world_size > layers:
        return f"a {world_size}-stage pipeline needs {world_size} layers; the model has {layers}"
    for need in spec.needs:
        module, attr = need.split(":")
        try:
            getattr(importlib.import_module(module), attr)
        except Exception as e:  # a wrapper still being written: report, do not crash
            return f"{module}.{attr} does not import yet ({type(e).__name__})"
    return None


def launch_workers(req: DemoRequest, names: list, log) -> int:
    """One torchrun launch running ``names`` in turn; returns its exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={req.world_size}", "-m", "shardkit.demo", "--worker",
           f"--world-size={req.world_size}", f"--steps={req.steps}", f"--batch={req.batch}",
           f"--model={req.model}", f"--runs={','.join(names)}", f"--out={req.out}",
           f"--seed={req.seed}", f"--timeout={req.timeout}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stderr=log, start_new_session=True)
    try:
        return proc.wait(timeout=req.timeout * (len(names) + 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise


def run_all(req: DemoRequest, names: list) -> dict:
    """Launch the workers, relaunching after a failed run for the runs left; returns
    ``{name: per-rank figures}`` or ``{name: {"error": ...}}``."""
    runs_dir = os.path.join(req.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    for fname in os.listdir(runs_dir):  # an --out folder used before: start clean
        if fname.split(".")[0] in names:
            os.remove(os.path.join(runs_dir, fname))
    results: dict = {}
    pending = list(names)
    with open(os.path.join(req.out, "launch.log"), "ab") as log:
        while pending:
            code = launch_workers(req, pending, log)
            for name in list(pending):
                path = os.path.join(runs_dir, f"{name}.json")
                if not os.path.exists(path):
                    break
                with open(path) as f:
                    results[name] = json.load(f)
                pending.remove(name)
            if pending and code == 0:
                code = 1
            if pending:  # the first unfinished run failed; go on with the rest
                failed = pending.pop(0)
                results[failed] = {"error": _error_summary(runs_dir, failed, code)}
                print(f"\n  {RUN_BY_NAME[failed].label}: failed ({results[failed]['error']}); "
                      f"full log in {os.path.join(req.out, 'launch.log')}", flush=True)
    return results


_SECONDARY_ERRORS = ("Connection closed by peer", "remote worker", "Connection reset",
                     "Timed out", "timed out")


def _error_summary(runs_dir: str, name: str, code: int) -> str:
    """The last line of the rank error that caused the failure: a rank whose peer crashed
    reports a broken connection, so errors that are only that come last."""
    found = []
    for fname in sorted(os.listdir(runs_dir)):
        if fname.startswith(f"{name}.rank") and fname.endswith(".error"):
            with open(os.path.join(runs_dir, fname)) as f:
                lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
            if lines:
                secondary = any(marker in lines[-1] for marker in _SECONDARY_ERRORS)
                found.append((secondary, f"{fname.split('.')[1]}: {lines[-1][:300]}"))
    if found:
        return min(found)[1]
    return "timed out" if code == -9 else f"workers exited with code {code}"


def formula_figures(spec: RunSpec, params: int, world: int, rank: int,
                    cfg: GPTConfig, global_batch: int) -> tuple:
    """(model-state bytes, communicated bytes per step) for this rank by :mod:`shardkit.plan`'s
    formulas (fp32: 4 bytes per element on the wire)."""
    if spec.stage is None:  # pipeline: a whole (W+G+K) copy of its own stage
        boundary = global_batch * cfg.seq_len * cfg.d_model  # activations per step
        return zero_model_state_bytes(params, 1, 0, FP32_ADAMW), \
            pipeline_comm_elements(boundary, rank, world,
                                   chunks=pipeline_chunks(global_batch, world)) * 4
    state = zero_model_state_bytes(params, world, spec.stage, FP32_ADAMW)
    root = root_params(cfg) if spec.stage == 3 else 0
    return state, zero_comm_elements_per_step(params, world, spec.stage, root_params=root) * 4


@functools.lru_cache(maxsize=None)
def root_params(cfg: GPTConfig) -> int:
    """Parameters of the GPT outside its ``Block`` units (FSDP's root unit: embeddings, final
    norm, head; a tied weight once)."""
    model = GPT(cfg)
    return count_params(model.parameters()) - sum(count_params(b.parameters())
                                                  for b in model.blocks)


def summarize(req: DemoRequest, results: dict, skipped: dict) -> dict:
    """The demo's report as plain data (what ``demo.json`` holds)."""
    cfg = MODELS[req.model]
    rows = []
    for spec in RUNS:
        if spec.name not in req.runs:
            continue
        row = {"name": spec.name, "label": spec.label, "stage": spec.stage}
        if spec.name in skipped:
            rows.append(dict(row, status="skipped", reason=skipped[spec.name]))
            continue
        per_rank = results.get(spec.name, {"error": "not run"})
        if "error" in per_rank:
            rows.append(dict(row, status="failed", reason=per_rank["error"]))
            continue
        formulas = [formula_figures(spec, r["params"], req.world_size, r["rank"], cfg,
                                    req.batch) for r in per_rank]
        rows.append(dict(
            row, status="ok", params_per_rank=[r["params"] for r in per_rank],
            model_state_bytes=[r["model_state_bytes"] for r in per_rank],
            model_state_formula_bytes=[f[0] for f in formulas],
            peak_rss_bytes=[r["peak_rss_bytes"] for r in per_rank],
            rss_at_start_bytes=[r["rss_at_start_bytes"] for r in per_rank],
            peak_rss_scope=per_rank[0]["peak_rss_scope"],
            step_time_s=max(r["step_time_s"] for r in per_rank),
            comm_bytes_per_step=[r["comm_bytes_per_step"] for r in per_rank],
            comm_formula_bytes_per_step=[f[1] for f in formulas],
            losses=per_rank[0]["losses"], final_loss=per_rank[0]["losses"][-1]))
    ddp = next((r for r in rows if r["name"] == "ddp" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok":
            r["step_time_ratio_to_ddp"] = r["step_time_s"] / ddp["step_time_s"] if ddp else None
    dp_losses = [r["final_loss"] for r in rows if r["status"] == "ok" and r["stage"] is not None]
    return {"command": "python -m shardkit demo", "world_size": req.world_size,
            "model": req.model, "model_config": asdict(cfg), "steps": req.steps,
            "global_batch": req.batch, "seed": req.seed, "precision": "fp32",
            "optimizer": "AdamW", "git_commit": git_commit(),
            "final_loss_spread_data_parallel": (max(dp_losses) - min(dp_losses))
            if dp_losses else None,
            "runs": rows}


def git_commit() -> Optional[str]:
    """The commit of the shardkit checkout this runs from, or None outside a git checkout."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def render_table(report: dict) -> str:
    """The text table the demo prints (per-rank figures: the largest over ranks)."""
    head = (f"{'run':<20}{'stage':>5}{'model states':>15}{'formula':>12}{'meas/f':>8}"
            f"{'peak RSS':>11}{'ms/step':>9}{'x DDP':>7}{'comm/step':>12}{'formula':>12}"
            f"{'final loss':>12}")
    lines = [f"{report['world_size']} ranks, model {report['model']}, {report['steps']} steps, "
             f"global batch {report['global_batch']}, fp32 AdamW "
             f"(per-rank columns: the largest rank)", head, "-" * len(head)]
    for r in report["runs"]:
        stage = "-" if r["stage"] is None else str(r["stage"])
        if r["status"] != "ok":
            lines.append(f"{r['label']:<20}{stage:>5}  {r['status']}: {r['reason']}")
            continue
        states = max(m["total"] for m in r["model_state_bytes"])
        formula = max(r["model_state_formula_bytes"])
        ratio = r["step_time_ratio_to_ddp"]
        lines.append(
            f"{r['label']:<20}{stage:>5}{_mb(states):>15}{_mb(formula):>12}"
            f"{states / formula:>8.3f}{_mb(max(r['peak_rss_bytes'])):>11}"
            f"{1e3 * r['step_time_s']:>9.1f}{'' if ratio is None else f'{ratio:.2f}':>7}"
            f"{_mb(max(r['comm_bytes_per_step'])):>12}"
            f"{_mb(max(r['comm_formula_bytes_per_step'])):>12}{r['final_loss']:>12.6f}")
    lines += ["model-state formulas (DESIGN.md; fp32 AdamW: W=G=4, K=8 bytes): stage 0 16Ψ, "
              "1 8Ψ+8Ψ/N, 2 4Ψ+12Ψ/N, 3 16Ψ/N; pipeline 16Ψ of its stage",
              "traffic formulas (elements per step): stages 0 and 2 2Ψ(N-1)/N; stage 1 under "
              "DDP 3Ψ(N-1)/N (all-reduce + OSS re-sync); stage 3 3Ψ(N-1)/N less one gather of "
              "the root unit; pipeline: boundary activations and their gradients "
              "(shardkit.plan)"]
    spread = report["final_loss_spread_data_parallel"]
    if spread is not None:
        lines.append(f"final loss across data-parallel runs: largest difference {spread:.3g}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options (validated afterwards by :func:`validate`)."""
    p = argparse.ArgumentParser(prog="python -m shardkit demo",
                                description="Train a GPT with each shardkit wrapper and torch "
                                            "DDP on CPU; compare memory, time and traffic.")
    p.add_argument("--world-size", type=int, default=2,
                   help="processes, e.g. 1, 2 or 4 (default 2; at most 2 per CPU core)")
    p.add_argument("--steps", type=int, default=100, help="training steps per run (default 100)")
    p.add_argument("--model", default="small", help=f"one of {', '.join(MODELS)} (default small)")
    p.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    p.add_argument("--runs", default=",".join(r.name for r in RUNS),
                   help="comma-separated runs or stages (default: all)")
    p.add_argument("--out", default=None, help="output folder (default out/demo-<timestamp>)")
    p.add_argument("--seed", type=int, default=0, help="model seed (default 0)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a run may take before it is reported as failed (default 300)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list] = None) -> int:
    """Entry point of ``python -m shardkit demo``; exit code 2 on bad input."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return run_worker(args)
    try:
        req = validate(args)
        skipped = {n: why for n in req.runs
                   if (why := unavailable_reason(RUN_BY_NAME[n], req.world_size,
                                                 MODELS[req.model]))}
        try:  # the one side effect before the launch, so that a bad --out fails here
            os.makedirs(req.out, exist_ok=True)
        except OSError as e:
            raise DemoError(f"--out {req.out!r} cannot be created ({e.strerror or e}); give a "
                            f"folder this user can write") from None
    except DemoError as e:
        print(f"python -m shardkit demo: {e}", file=sys.stderr)
        return 2
    live = [n for n in req.runs if n not in skipped]
    print(f"shardkit demo: {req.world_size} ranks, model {req.model}, {req.steps} steps; "
          f"runs {', '.join(live) or '(none)'}; output in {req.out}", flush=True)
    for name, why in skipped.items():
        print(f"  {RUN_BY_NAME[name].label}: skipped ({why})")
    os.makedirs(req.out, exist_ok=True)
    results = run_all(req, live) if live else {}
    report = summarize(req, results, skipped)
    with open(os.path.join(req.out, "demo.json"), "w") as f:
        json.dump(report, f, indent=2)
    print()
    print(render_table(report))
    print(write_chart(report, os.path.join(req.out, "demo.png")))
    print(f"figures: {os.path.join(req.out, 'demo.json')}")
    return 0 if all(r["status"] != "failed" for r in report["runs"]) else 1


def write_chart(report: dict, path: str) -> str:
    """Bar chart of per-rank model states (measured and formula), traffic and step time, drawn
    by matplotlib (its figures also in ``demo.chart.json``); returns a line saying where it
    went, or why there is none."""
    from shardkit.utils.charts import BarGroup, ChartError, write_bar_chart
    ok = [r for r in report["runs"] if r["status"] == "ok"]
    if not ok:
        return "chart: nothing to draw"
    groups = [BarGroup(r["label"], {
        "model states, measured (MB)": max(m["total"] for m in r["model_state_bytes"]) / 1e6,
        "model states, formula (MB)": max(r["model_state_formula_bytes"]) / 1e6,
        "comm per step (MB)": max(r["comm_bytes_per_step"]) / 1e6,
        "step time (ms)": 1e3 * r["step_time_s"]}) for r in ok]
    title = (f"shardkit demo: {report['world_size']} ranks, model {report['model']} "
             f"(per rank)")
    try:
        return write_bar_chart(path, title, groups)
    except ChartError as e:
        return f"chart: not drawn ({e})"


if __name__ == "__main__":
    sys.exit(main())
