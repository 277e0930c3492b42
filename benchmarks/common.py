"""What the benchmark runner measures: the reference workloads, the torch baselines beside
shardkit's recipes, and one training measurement on a rank.

Workloads (``benchmarks/run.py``; ``--quick`` shrinks them):
    gpt  the reference GPT (vocab 8192, 6 layers, d 512, seq 128; ~27M parameters), batch 8
    mlp  MLP 16x1024 (16 x Linear(1024, 1024) + GELU; ~16.8M parameters), batch 64

Configurations, each a :class:`Config` with a ``setup(workload, model)``:
    torch: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 ``fully_shard`` with and without
           resharding after forward, ``torch.distributed.pipelining`` 1F1B;
    shardkit: OSS + DDP, ShardedDDP + OSS, FSDP, 1F1B pipeline (:mod:`shardkit.recipes`).
torch's collectives bypass :mod:`shardkit.distributed`, so torch rows report the formula
traffic and shardkit rows the counted one.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed, recipes
from shardkit.models import GPT, MLP, Block, GPTConfig, reference_gpt_config, synthetic_batch
from shardkit.recipes import TrainingSetup, count_params
from shardkit.utils.memory import model_state_bytes

LEARNING_RATE = 1e-3


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A model and its data: ``build(seed)`` the model, ``batch(step)`` the global batch."""

    name: str
    description: str
    build: Callable
    batch: Callable
    loss_fn: Callable
    unit_classes: frozenset          # what FSDP wraps as units
    as_layers: Callable              # the model as an nn.Sequential, for pipelines
    global_batch: int
    boundary_numel: int              # elements per sample between two pipeline stages


def _mlp_batch(width: int, global_batch: int):
    def batch(step: int):
        gen = torch.Generator().manual_seed(1000 + step)
        return (torch.randn(global_batch, width, generator=gen),
                torch.randn(global_batch, width, generator=gen))
    return batch


def gpt_workload(cfg: GPTConfig, global_batch: int, description: str) -> Workload:
    """A GPT on the synthetic next-token task."""
    return Workload("gpt", description, lambda seed: GPT(cfg, seed),
                    lambda step: synthetic_batch(cfg, global_batch, step),
                    recipes.token_cross_entropy, frozenset({Block}), recipes.gpt_as_sequential,
                    global_batch, cfg.seq_len * cfg.d_model)


def mlp_workload(width: int, depth: int, global_batch: int, description: str) -> Workload:
    """An MLP regressing random targets (mean squared error)."""
    return Workload("mlp", description, lambda seed: MLP(width, depth, seed=seed),
                    _mlp_batch(width, global_batch), F.mse_loss, frozenset({nn.Linear}),
                    lambda model: nn.Sequential(*model), global_batch, width)


def workloads(quick: bool) -> dict:
    """The reference workloads, or small stand-ins with ``quick``."""
    if quick:
        small = GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, seq_len=32)
        return {"gpt": gpt_workload(small, 8, "GPT small (0.5M params, quick)"),
                "mlp": mlp_workload(256, 4, 32, "MLP 4x256 (quick)")}
    return {"gpt": gpt_workload(reference_gpt_config(), 8,
                                "GPT reference (vocab 8192, 6 layers, d 512, seq 128)"),
            "mlp": mlp_workload(1024, 16, 64, "MLP 16x1024")}


# ----------------------------------------------------------------------------- torch baselines


def setup_torch_ddp(w: Workload, model: nn.Module) -> TrainingSetup:
    """torch DDP (native all-reduce) + AdamW."""
    return recipes.setup_ddp(model, w.loss_fn, LEARNING_RATE, count_comm=False)


def setup_torch_zero(w: Workload, model: nn.Module) -> TrainingSetup:
    """torch DDP + ``ZeroRedundancyOptimizer(AdamW)`` (torch's ZeRO-1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    psi = count_params(model.parameters())
    ddp = recipes.torch_ddp(model, count_comm=False)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=LEARNING_RATE)
    return TrainingSetup(ddp, opt, recipes.data_parallel_step(ddp, opt, w.loss_fn), psi)


def _setup_fsdp2(w: Workload, model: nn.Module, reshard_after_forward: bool) -> TrainingSetup:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    psi = count_params(model.parameters())
    mesh = init_device_mesh("cpu", (distributed.get_world_size(),))
    for module in list(model.modules()):
        if isinstance(module, tuple(w.unit_classes)):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    return TrainingSetup(model, opt, recipes.data_parallel_step(model, opt, w.loss_fn), psi)


def setup_torch_fsdp2(w: Workload, model: nn.Module) -> TrainingSetup:
    """torch FSDP2 ``fully_shard`` per unit and at the root (ZeRO-3)."""
    return _setup_fsdp2(w, model, reshard_after_forward=True)


def setup_torch_fsdp2_no_reshard(w: Workload, model: nn.Module) -> TrainingSetup:
    """torch FSDP2 with ``reshard_after_forward=False`` (ZeRO-2-like: gathered weights kept
    from forward to backward)."""
    return _setup_fsdp2(w, model, reshard_after_forward=False)


def setup_torch_pipeline(w: Workload, model: nn.Module) -> TrainingSetup:
    """``torch.distributed.pipelining`` Schedule1F1B over world-size stages, same balance."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    rank, stages = distributed.get_rank(), distributed.get_world_size()
    layers = list(w.as_layers(model))
    balance = recipes.balance_by_params(layers, stages)
    start = sum(balance[:rank])
    part = nn.Sequential(*layers[start:start + balance[rank]])
    schedule = Schedule1F1B(PipelineStage(part, rank, stages, torch.device("cpu")),
                            recipes.pipeline_chunks(w.global_batch, stages), loss_fn=w.loss_fn)
    opt = torch.optim.AdamW(part.parameters(), lr=LEARNING_RATE)

    def step(inputs, target):
        opt.zero_grad()
        losses: list = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == stages - 1:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        opt.step()
        return torch.stack(losses).mean().detach() if losses else None
    return TrainingSetup(part, opt, step, count_params(part.parameters()), data_parallel=False)


# ----------------------------------------------------------------------------- shardkit rows


def setup_shardkit_oss(w: Workload, model: nn.Module) -> TrainingSetup:
    """shardkit OSS(AdamW) under torch DDP (:func:`shardkit.recipes.setup_oss`)."""
    return recipes.setup_oss(model, w.loss_fn, LEARNING_RATE)


def setup_shardkit_sharded(w: Workload, model: nn.Module) -> TrainingSetup:
    """shardkit ShardedDDP + OSS (:func:`shardkit.recipes.setup_sharded`)."""
    return recipes.setup_sharded(model, w.loss_fn, LEARNING_RATE)


def setup_shardkit_fsdp(w: Workload, model: nn.Module) -> TrainingSetup:
    """shardkit FSDP, one unit per workload unit class (:func:`shardkit.recipes.setup_fsdp`)."""
    return recipes.setup_fsdp(model, w.loss_fn, LEARNING_RATE, set(w.unit_classes))


def setup_shardkit_pipeline(w: Workload, model: nn.Module) -> TrainingSetup:
    """shardkit 1F1B over world-size stages (:func:`shardkit.recipes.setup_pipeline`)."""
    chunks = recipes.pipeline_chunks(w.global_batch, distributed.get_world_size())
    return recipes.setup_pipeline(w.as_layers(model), w.loss_fn, LEARNING_RATE, chunks)


@dataclass(frozen=True)
class Config:
    """One measured configuration; ``baseline`` names the torch config it is compared with."""

    name: str
    label: str
    stage: str
    library: str                  # "torch" or "shardkit"
    setup: Callable
    baseline: Optional[str] = None
    needs: tuple = field(default=())
    comm_factor: float = 2.0       # formula traffic: comm_factor * Ψ (N-1)/N elements


CONFIGS = (
    Config("torch_ddp", "torch DDP", "0", "torch", setup_torch_ddp),
    Config("torch_zero", "torch DDP + ZeroRedundancyOptimizer", "1", "torch", setup_torch_zero,
           comm_factor=3.0),
    Config("shardkit_oss", "shardkit OSS + DDP", "1", "shardkit", setup_shardkit_oss,
           "torch_zero", ("shardkit.optim:OSS",), 3.0),
    Config("torch_fsdp2_no_reshard", "torch fully_shard (no reshard)", "2", "torch",
           setup_torch_fsdp2_no_reshard, comm_factor=2.0),
    Config("shardkit_sharded", "shardkit ShardedDDP + OSS", "2", "shardkit",
           setup_shardkit_sharded, "torch_fsdp2_no_reshard",
           ("shardkit.optim:OSS", "shardkit.nn.data_parallel:ShardedDataParallel")),
    Config("torch_fsdp2", "torch fully_shard", "3", "torch", setup_torch_fsdp2, comm_factor=3.0),
    Config("shardkit_fsdp", "shardkit FSDP", "3", "shardkit", setup_shardkit_fsdp,
           "torch_fsdp2", ("shardkit.nn.data_parallel:FullyShardedDataParallel",
                           "shardkit.nn.wrap:auto_wrap"), 3.0),
    Config("torch_pipelining", "torch.distributed.pipelining 1F1B", "pipe", "torch",
           setup_torch_pipeline, comm_factor=0.0),
    Config("shardkit_pipeline", "shardkit 1F1B pipeline", "pipe", "shardkit",
           setup_shardkit_pipeline, "torch_pipelining",
           ("shardkit.nn.pipe:PipelineStage", "shardkit.nn.pipe:Schedule1F1B"), 0.0),
)
CONFIG_BY_NAME = {c.name: c for c in CONFIGS}


# ----------------------------------------------------------------------------- measuring


def local_model_state_bytes(module: nn.Module, optimizer) -> int:
    """Model-state bytes this rank holds, for torch wrappers too: DTensors count their local
    shard, ZeroRedundancyOptimizer its local optimizer's state. Each storage counts once."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    tensors = []
    for p in module.parameters():
        tensors.append(local(p))
        if p.grad is not None:
            tensors.append(local(p.grad))
    inner = getattr(optimizer, "optim", optimizer)
    stack = [inner.state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(local(item))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key[1] and key not in seen:
            seen.add(key)
            total += key[1]
    return total


def measure(config_name: str, workload_name: str, quick: bool, warmup: int, steps: int,
            seed: int = 0) -> dict:
    """Build ``config_name`` on the workload, train ``warmup`` + ``steps`` steps on this rank,
    and return its step times, model-state bytes, counted traffic per step and final loss.
    (Names, not objects, cross the process boundary: workloads hold lambdas.)"""
    config = CONFIG_BY_NAME[config_name]
    workload = workloads(quick)[workload_name]
    rank, world = distributed.get_rank(), distributed.get_world_size()
    gc.collect()
    setup = config.setup(workload, workload.build(seed))
    per_rank = workload.global_batch // world if setup.data_parallel else workload.global_batch
    lo = rank * per_rank if setup.data_parallel else 0
    times, comm_bytes, loss = [], 0.0, None
    for step in range(warmup + steps):
        inputs, target = workload.batch(step)
        distributed.barrier()  # every rank starts the step together
        start = time.perf_counter()
        with distributed.CommCounter() as comm:
            loss = setup.train_step(inputs[lo:lo + per_rank], target[lo:lo + per_rank])
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
        comm_bytes = comm.bytes
    if config.library == "shardkit":
        states = model_state_bytes(setup.module, setup.optimizer).total
    else:
        states = local_model_state_bytes(setup.module, setup.optimizer)
    result = {"rank": rank, "step_times_s": times, "model_state_bytes": states,
              "comm_bytes_per_step": comm_bytes, "params": setup.params,
              "loss": None if loss is None else float(loss)}
    del setup
    gc.collect()
    return result


def time_interleaved(trainers: dict, rounds: int, steps: int, warmup: int = 2) -> tuple[dict, int]:
    """Time each trainer's ``step(step_index, rank)`` in interleaved rounds (the order rotates
    every round, a barrier around each measurement). Returns ``({name: [seconds per step, one
    per round]}, next step index)``; every trainer first runs ``warmup`` untimed steps."""
    rank = distributed.get_rank()
    names = list(trainers)
    step = 0
    for trainer in trainers.values():  # allocator, optimizer state, recorded orders, gloo buffers
        for _ in range(warmup):
            trainer.step(step, rank)
            step += 1
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            distributed.barrier()
            start = time.perf_counter()
            for s in range(steps):
                trainers[name].step(step + s, rank)
            distributed.barrier()
            times[name].append((time.perf_counter() - start) / steps)
        step += steps
    return times, step


def write_report(text: str, path: str) -> None:
    """Write a benchmark's Markdown report to ``path`` (creating its folder) and print it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)
