"""ShardedDataParallel + OSS against torch DDP and FSDP2 (``fully_shard`` with
``reshard_after_forward=False``, the SHARD_GRAD_OP analogue), world 2, gloo on CPU.

    python -m benchmarks.bench_sharded_ddp [--rounds 3] [--steps 4] [--workloads gpt,mlp]

Every configuration is built once per rank, warmed up 3 steps, then timed in interleaved rounds
(the order rotates every round) so that the machine's noise spreads over all of them; a round's
time is the slowest rank's. The table gives each row's transport, the median step time, its
ratio to torch DDP measured in the same run (median over rounds of the per-round ratio), and
the per-rank model-state bytes (``model_state_bytes`` after backward, gradients alive) against
DDP's. shardkit runs on its default transport (the process group's collectives: gloo, like
torch) and, as a separate row, with one ``SharedMemoryTransport()`` passed to both OSS and
ShardedDDP. A micro-benchmark times the two ways of reducing a bucket onto owners over gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.models import GPT, MLP, reference_gpt_config, synthetic_batch
from shardkit.recipes import adamw, compose
from shardkit.testing import World

from benchmarks.common import (make_transport, median_ratio, slowest_rank, time_interleaved,
                               write_report)
from shardkit.utils.memory import model_state_bytes, tensor_storage_bytes

WORLD_SIZE = 2
LR = 1e-4
# shardkit_shm: the same wrappers with comm=SharedMemoryTransport() (opt-in).
CONFIGS = ("torch_ddp", "torch_fsdp2_no_reshard", "shardkit", "shardkit_shm")
DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "results", "sharded_ddp.md")


# ---------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A model factory and a per-rank batch maker (``batch(step, rank) -> (inputs, target)``)."""

    name: str
    make_model: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    blocks: Callable[[nn.Module], list]      # the units FSDP2 shards one by one


def _gpt_workload(batch_per_rank: int) -> Workload:
    cfg = reference_gpt_config()
    return Workload(
        name=f"reference GPT (~27M params, batch {batch_per_rank}/rank x seq {cfg.seq_len})",
        make_model=lambda: GPT(cfg, seed=0),
        batch=lambda step, rank: synthetic_batch(cfg, batch_per_rank, step * WORLD_SIZE + rank),
        loss=lambda out, target: F.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 target.reshape(-1)),
        blocks=lambda m: list(m.blocks))


def _mlp_workload(batch_per_rank: int) -> Workload:
    def batch(step, rank):
        gen = torch.Generator().manual_seed(step * WORLD_SIZE + rank)
        return (torch.randn(batch_per_rank, 1024, generator=gen),
                torch.randn(batch_per_rank, 1024, generator=gen))

    return Workload(
        name=f"MLP 16x1024 (~16.8M params, batch {batch_per_rank}/rank)",
        make_model=lambda: MLP(width=1024, depth=16, seed=0),
        batch=batch,
        loss=F.mse_loss,
        blocks=lambda m: [layer for layer in m if isinstance(layer, nn.Linear)])


WORKLOADS = {"gpt": lambda: _gpt_workload(4), "mlp": lambda: _mlp_workload(64)}


# ---------------------------------------------------------------------- configurations


@dataclass
class Trainer:
    """One wrapped model with its optimizer; ``step`` runs zero_grad, forward, backward, step."""

    module: nn.Module
    optimizer: torch.optim.Optimizer
    workload: Workload
    kind: str
    comm: object = None           # shardkit's transport (None for torch's wrappers)

    def transport(self) -> str:
        """What carries this configuration's collectives, in words."""
        if self.comm is not None:
            return self.comm.describe()
        return f"process group ({skdist.backend_of()})"

    def forward_backward(self, step: int, rank: int) -> None:
        inputs, target = self.workload.batch(step, rank)
        self.workload.loss(self.module(inputs), target).backward()

    def step(self, step: int, rank: int) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(step, rank)
        self.optimizer.step()

    def state_bytes(self) -> dict:
        if self.kind == "torch_fsdp2_no_reshard":
            return _dtensor_state_bytes(self.module, self.optimizer)
        return model_state_bytes(self.module, self.optimizer).as_dict()


def _build(kind: str, workload: Workload) -> Trainer:
    model = workload.make_model()
    if kind == "torch_ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        return Trainer(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=LR), workload, kind)
    if kind == "torch_fsdp2_no_reshard":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for block in workload.blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR), workload, kind)
    comm = make_transport("shared_memory" if kind == "shardkit_shm" else "default")
    # stage 2 of recipes.compose: OSS and ShardedDataParallel on the same transport instance
    composition = compose(model, 2, adamw(LR), comm=comm)
    return Trainer(composition.wrapped, composition.optimizer, workload, kind,
                   composition.wrapped.comm)


def _dtensor_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """FSDP2 keeps DTensors: count the local shards' storages."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in module.parameters()]
    grads = [local(p.grad) for p in module.parameters() if p.grad is not None]
    states = [local(v) for s in optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor)]
    out = {"params": tensor_storage_bytes(params), "grads": tensor_storage_bytes(grads),
           "optimizer": tensor_storage_bytes(states)}
    out["total"] = sum(out.values())
    return out


# ---------------------------------------------------------------------- what each rank runs


def _time_workload(workload_key: str, rounds: int, steps: int) -> dict:
    torch.manual_seed(0)
    rank = skdist.get_rank()
    workload = WORKLOADS[workload_key]()
    trainers = {kind: _build(kind, workload) for kind in CONFIGS}
    times, step = time_interleaved(trainers, rounds, steps)
    states, wire = {}, {}
    for kind, trainer in trainers.items():
        trainer.optimizer.zero_grad(set_to_none=True)
        with skdist.CommCounter() as comm:
            trainer.forward_backward(step, rank)
            states[kind] = trainer.state_bytes()
            trainer.optimizer.step()
        wire[kind] = comm.bytes if kind.startswith("shardkit") else None
    transports = {kind: trainer.transport() for kind, trainer in trainers.items()}
    for trainer in trainers.values():
        if trainer.comm is not None:
            trainer.comm.close()
    params = sum(p.numel() for p in workload.make_model().parameters())
    return dict(name=workload.name, psi=params, times=times, states=states, wire=wire,
                transports=transports)


def _time_reductions(numel: int, repeats: int) -> dict:
    """Wall time over gloo of moving one bucket of ``numel`` fp32 onto its owners: a
    reduce-scatter, one (asynchronous) reduce per owner, and an all-reduce for scale; the
    three interleaved ``repeats`` times. Returns ``{method: (median s, min s)}``."""
    n = skdist.get_world_size()
    buf = torch.randn(numel)
    out = torch.empty(numel // n)

    def reduce_scatter():
        skdist.reduce_scatter_tensor(out, buf)

    def reduce_per_owner():
        handles = [skdist.reduce(chunk, dst=r, async_op=True)
                   for r, chunk in enumerate(buf.view(n, -1))]
        for h in handles:
            h.wait()

    def all_reduce():
        skdist.all_reduce(buf)

    methods = {"reduce_scatter": reduce_scatter, "reduce per owner": reduce_per_owner,
               "all_reduce": all_reduce}
    samples = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            skdist.barrier()
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: (statistics.median(v), min(v)) for name, v in samples.items()}


# ---------------------------------------------------------------------- report


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 20:.1f}"


def _workload_table(result: dict) -> list[str]:
    times = result["times"]
    medians = {k: statistics.median(v) for k, v in times.items()}
    fastest = {k: min(v) for k, v in times.items()}
    base_bytes = result["states"]["torch_ddp"]["total"]
    psi, n = result["psi"], WORLD_SIZE
    lines = [f"### {result['name']}", "",
             "| configuration | transport | median step (s) | x DDP (median of rounds) | "
             "x DDP (best round) | model states / rank (MiB) | x DDP bytes | grads (MiB) | "
             "wire / step (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind in CONFIGS:
        s = result["states"][kind]
        wire = result["wire"][kind]
        lines.append(f"| {kind} | {result['transports'][kind]} | {medians[kind]:.3f} | "
                     f"{median_ratio(times[kind], times['torch_ddp']):.2f}"
                     f" | {fastest[kind] / fastest['torch_ddp']:.2f} | {_mib(s['total'])} | "
                     f"{s['total'] / base_bytes:.3f} | {_mib(s['grads'])} | "
                     f"{_mib(wire) if wire is not None else '-'} |")
    formula = (4 * psi + 12 * psi / n) / (16 * psi)
    lines += ["", f"Ψ = {psi:,}; stage-2 formula at N={n}: {formula:.3f} x DDP bytes; "
                  f"2Ψ(N-1)/N fp32 = {_mib(2 * psi * (n - 1) / n * 4)} MiB on the wire "
                  f"(wire column: shardkit's CommCounter, DESIGN convention). "
                  f"Per-round step times (s): " +
              "; ".join(f"{k}: " + ", ".join(f"{t:.3f}" for t in v)
                        for k, v in result["times"].items()), ""]
    return lines


def _report(results: list[dict], micro: dict, micro_numel: int, args) -> str:
    lines = ["# ShardedDataParallel + OSS vs torch DDP and FSDP2 (world 2, gloo, CPU)", "",
             f"`python -m benchmarks.bench_sharded_ddp --rounds {args.rounds} --steps "
             f"{args.steps}`, torch {torch.__version__}, {os.cpu_count()} CPU cores, one "
             f"thread per rank, AdamW lr {LR}. Every configuration is built once per rank, "
             f"warmed up 3 steps, then timed in {args.rounds} interleaved rounds of "
             f"{args.steps} steps (zero_grad + forward + backward + step), each round the "
             f"slowest rank's time; median and best round, ratios to DDP as the median over "
             f"rounds of the per-round ratio. shardkit: the default transport (the process "
             f"group's collectives, gloo here, as for torch's rows) and, in the `shardkit_shm` "
             f"row, one `SharedMemoryTransport()` passed as `comm=` to OSS and ShardedDDP. "
             f"Model-state bytes: `model_state_bytes` after a backward "
             f"(gradients alive, optimizer state present); torch DDP's own reducer buckets "
             f"(another Ψ·4 bytes) are not visible to it and not counted. FSDP2: local "
             f"shards at rest after backward (its unsharded parameters live only between "
             f"forward and the end of backward).", "",
             "Targets (issues 5 and 13): step time ≤ 1.0 x DDP on the GPT over gloo (the "
             "default transport), model-state bytes ≤ 0.64 x DDP.", ""]
    for result in results:
        lines += _workload_table(result)
    lines += [f"### Reducing one {micro_numel * 4 / 2 ** 20:.0f} MiB fp32 bucket onto its owners "
              f"over gloo (20 interleaved repeats)", "",
              "| method | median (ms) | best (ms) | x all_reduce (median) |", "|---|---|---|---|"]
    for name, (median, best) in micro.items():
        lines.append(f"| {name} | {median * 1e3:.1f} | {best * 1e3:.1f} | "
                     f"{median / micro['all_reduce'][0]:.2f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--workloads", default="gpt,mlp")
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    micro_numel = 8 * 2 ** 20 // 4 * WORLD_SIZE
    results = []
    with World(WORLD_SIZE, timeout=3600) as world:
        micro = world.run(_time_reductions, micro_numel, 20)[0]
        for key in args.workloads.split(","):
            per_rank = world.run(_time_workload, key, args.rounds, args.steps)
            results.append({**per_rank[0], "times": slowest_rank([r["times"] for r in per_rank])})
            print("\n".join(_workload_table(results[-1])), flush=True)
    report = _report(results, micro, micro_numel, args)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
