"""What the benchmark runner measures: the reference workloads, the torch baselines beside
shardkit's recipes, and the measurement on a rank (every configuration of a workload side by side,
stepped in interleaved rounds: :func:`measure_side_by_side`).

Workloads (``benchmarks/run.py``; ``--quick`` shrinks them):
    gpt  the reference GPT (vocab 8192, 6 layers, d 512, seq 128; ~27M parameters), batch 8
    mlp  MLP 16x1024 (16 x Linear(1024, 1024) + GELU; ~16.8M parameters), batch 64

Configurations, each a :class:`Config` with a ``setup(workload, model, comm)``:
    torch: DDP, DDP + ZeroRedundancyOptimizer, FSDP2 ``fully_shard`` with and without
           resharding after forward, ``torch.distributed.pipelining`` 1F1B;
    shardkit: OSS + DDP, ShardedDDP + OSS, FSDP, 1F1B pipeline (:func:`shardkit.recipes.compose`
           and :func:`~shardkit.recipes.compose_pipeline`), on the
           default transport (the process group's own collectives: gloo on CPU), and OSS + DDP,
           ShardedDDP + OSS and FSDP again with ``comm=SharedMemoryTransport()`` (opt-in; one
           instance shared by the wrappers of a configuration), as separate rows.
Every row records the transport that carried its bytes (``Transport.describe``). torch's
collectives bypass :mod:`shardkit.distributed`, so torch rows report the formula traffic and
shardkit rows the counted one beside it. The formulas are :mod:`shardkit.plan`'s.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed, plan, recipes
from shardkit.models import GPT, MLP, Block, GPTConfig, reference_gpt_config, synthetic_batch
from shardkit.nn.wrap import transformer_auto_wrap_policy
from shardkit.recipes import TrainingSetup, adamw, compose, count_params
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


def _plain_step(model: nn.Module, opt, loss_fn: Callable) -> Callable:
    """zero grads, forward, loss, backward, step (the torch baselines' training step)."""
    def step(inputs, target):
        opt.zero_grad()
        loss = loss_fn(model(inputs), target)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def setup_torch_ddp(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """torch DDP (native all-reduce) + AdamW: stage 0 of :func:`shardkit.recipes.compose`."""
    composition = compose(model, 0, adamw(LEARNING_RATE), count_ddp_comm=False)
    return composition.training_setup(w.loss_fn)


def setup_torch_zero(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """torch DDP + ``ZeroRedundancyOptimizer(AdamW)`` (torch's ZeRO-1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    psi = count_params(model.parameters())
    ddp = recipes.torch_ddp(model, count_comm=False)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=LEARNING_RATE)
    return TrainingSetup(ddp, opt, _plain_step(ddp, opt, w.loss_fn), psi)


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
    return TrainingSetup(model, opt, _plain_step(model, opt, w.loss_fn), psi)


def setup_torch_fsdp2(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """torch FSDP2 ``fully_shard`` per unit and at the root (ZeRO-3)."""
    return _setup_fsdp2(w, model, reshard_after_forward=True)


def setup_torch_fsdp2_no_reshard(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """torch FSDP2 with ``reshard_after_forward=False`` (ZeRO-2-like: gathered weights kept
    from forward to backward)."""
    return _setup_fsdp2(w, model, reshard_after_forward=False)


def setup_torch_pipeline(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
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


def setup_shardkit_oss(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """shardkit OSS(AdamW, comm=comm) under torch DDP: stage 1 of
    :func:`shardkit.recipes.compose` (DDP's all-reduce counted through shardkit). The parameter
    sync is not overlapped with the next forward: on one host the sync and the forward share the
    same cores and overlapping them measured slower (GPT 1.00x against 0.92x torch DDP); the
    cluster benchmark, where the link is the bottleneck, overlaps it."""
    return compose(model, 1, adamw(LEARNING_RATE), comm=comm).training_setup(w.loss_fn)


def setup_shardkit_sharded(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """shardkit ShardedDDP + OSS on one transport: stage 2 of :func:`shardkit.recipes.compose`
    (sync not overlapped, as for OSS)."""
    return compose(model, 2, adamw(LEARNING_RATE), comm=comm).training_setup(w.loss_fn)


def setup_shardkit_fsdp(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """shardkit FSDP, one unit per workload unit class: stage 3 of
    :func:`shardkit.recipes.compose`."""
    policy = transformer_auto_wrap_policy(set(w.unit_classes))
    composition = compose(model, 3, adamw(LEARNING_RATE), wrap_policy=policy, comm=comm)
    return composition.training_setup(w.loss_fn)


def setup_shardkit_pipeline(w: Workload, model: nn.Module, comm=None) -> TrainingSetup:
    """shardkit 1F1B over world-size stages (:func:`shardkit.recipes.compose_pipeline`)."""
    chunks = recipes.pipeline_chunks(w.global_batch, distributed.get_world_size())
    return recipes.compose_pipeline(w.as_layers(model), w.loss_fn, adamw(LEARNING_RATE), chunks)


# ----------------------------------------------------------------------------- formulas


@dataclass(frozen=True)
class Sizes:
    """Element counts a row's formulas use: ``psi`` the parameters (this rank's stage for a
    pipeline), ``padded`` the same as the wrapper lays them out (its flat buffers' padding
    included; ``psi`` for torch), ``root`` the parameters outside every unit (gathered once
    per step by ZeRO-3 wrappers, which keep the root unsharded from forward into backward),
    ``boundary`` the elements one pipeline boundary carries per step, ``chunks`` its
    micro-batches per step (each gradient message carries one presence flag)."""

    psi: int
    padded: int
    root: int
    boundary: int
    chunks: int = 1


def _zero(stage: int, padded: bool = True):
    def elements(s: Sizes, rank: int, world: int) -> float:
        return plan.zero_comm_elements_per_step(s.psi, world, stage,
                                                s.padded if padded else s.psi,
                                                s.root if stage == 3 else 0)
    return elements


# Elements each rank puts on the wire per step, by shardkit.plan's formulas.
TRAFFIC = {
    "all_reduce": _zero(0),                                   # DDP
    "all_reduce+broadcast": _zero(1, padded=False),           # ZeroRedundancyOptimizer in DDP
    "all_reduce+all_gather": _zero(1),                        # OSS in DDP
    "reduce+all_gather": _zero(2),                            # ShardedDDP + OSS, FSDP2 no reshard
    "zero3": _zero(3),                                        # gather fwd + bwd, reduce-scatter
    "pipeline": lambda s, rank, world: plan.pipeline_comm_elements(s.boundary, rank, world,
                                                                   chunks=s.chunks),
}

# Per-rank model-state bytes (fp32 AdamW), by shardkit.plan's formulas.
STATES = {
    "zero0": lambda psi, n: plan.zero_model_state_bytes(psi, n, 0, plan.FP32_ADAMW),
    "zero1": lambda psi, n: plan.zero_model_state_bytes(psi, n, 1, plan.FP32_ADAMW),
    "zero2": lambda psi, n: plan.zero_model_state_bytes(psi, n, 2, plan.FP32_ADAMW),
    "zero3": lambda psi, n: plan.zero_model_state_bytes(psi, n, 3, plan.FP32_ADAMW),
    "stage": lambda psi, n: plan.zero_model_state_bytes(psi, 1, 0, plan.FP32_ADAMW),  # own Ψ
}


@dataclass(frozen=True)
class Config:
    """One measured configuration; ``baseline`` names the torch config it is compared with,
    ``transport`` is ``"default"`` or ``"shared_memory"`` (a fresh
    :class:`~shardkit.shm_transport.SharedMemoryTransport` per measurement, closed after it),
    ``traffic``/``states`` name its formulas in :data:`TRAFFIC` and :data:`STATES`."""

    name: str
    label: str
    stage: str
    library: str                  # "torch" or "shardkit"
    setup: Callable
    traffic: str
    states: str
    baseline: Optional[str] = None
    needs: tuple = field(default=())
    transport: str = "default"
    ddp_inside: bool = False      # torch DDP all-reduces the gradients (over the process group)


_OSS = ("shardkit.optim:OSS",)
_SHARDED = _OSS + ("shardkit.nn.data_parallel:ShardedDataParallel",)
_FSDP = ("shardkit.nn.data_parallel:FullyShardedDataParallel", "shardkit.nn.wrap:auto_wrap")
_SHM = ("shardkit.shm_transport:SharedMemoryTransport",)
_PIPE = ("shardkit.nn.pipe:PipelineStage", "shardkit.nn.pipe:Schedule1F1B")

CONFIGS = (
    Config("torch_ddp", "torch DDP", "0", "torch", setup_torch_ddp, "all_reduce", "zero0",
           ddp_inside=True),
    Config("torch_zero", "torch DDP + ZeroRedundancyOptimizer", "1", "torch", setup_torch_zero,
           "all_reduce+broadcast", "zero1", ddp_inside=True),
    Config("shardkit_oss", "shardkit OSS + DDP", "1", "shardkit",
           setup_shardkit_oss,
           "all_reduce+all_gather", "zero1", "torch_zero", _OSS, ddp_inside=True),
    Config("shardkit_oss_shm", "shardkit OSS + DDP, shared memory", "1",
           "shardkit",
           setup_shardkit_oss, "all_reduce+all_gather", "zero1", "torch_zero", _OSS + _SHM,
           "shared_memory", ddp_inside=True),
    Config("torch_fsdp2_no_reshard", "torch fully_shard (no reshard)", "2", "torch",
           setup_torch_fsdp2_no_reshard, "reduce+all_gather", "zero3"),
    Config("shardkit_sharded", "shardkit ShardedDDP + OSS", "2", "shardkit",
           setup_shardkit_sharded, "reduce+all_gather", "zero2", "torch_fsdp2_no_reshard",
           _SHARDED),
    Config("shardkit_sharded_shm", "shardkit ShardedDDP + OSS, shared memory",
           "2", "shardkit",
           setup_shardkit_sharded, "reduce+all_gather", "zero2", "torch_fsdp2_no_reshard",
           _SHARDED + _SHM, "shared_memory"),
    Config("torch_fsdp2", "torch fully_shard", "3", "torch", setup_torch_fsdp2, "zero3",
           "zero3"),
    Config("shardkit_fsdp", "shardkit FSDP", "3", "shardkit", setup_shardkit_fsdp, "zero3",
           "zero3", "torch_fsdp2", _FSDP),
    Config("shardkit_fsdp_shm", "shardkit FSDP, shared memory", "3", "shardkit",
           setup_shardkit_fsdp, "zero3", "zero3", "torch_fsdp2", _FSDP + _SHM,
           "shared_memory"),
    Config("torch_pipelining", "torch.distributed.pipelining 1F1B", "pipe", "torch",
           setup_torch_pipeline, "pipeline", "stage"),
    Config("shardkit_pipeline", "shardkit 1F1B pipeline", "pipe", "shardkit",
           setup_shardkit_pipeline, "pipeline", "stage", "torch_pipelining", _PIPE),
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


def make_transport(kind: str):
    """``None`` (the wrappers' default: the process group's collectives) or a fresh
    :class:`~shardkit.shm_transport.SharedMemoryTransport` (12 MiB of slots at world 2)."""
    if kind == "default":
        return None
    if kind == "shared_memory":
        from shardkit.shm_transport import SharedMemoryTransport
        return SharedMemoryTransport()
    raise ValueError(f"transport {kind!r}: expected 'default' or 'shared_memory'")


def describe_transport(config: Config, setup: TrainingSetup) -> str:
    """What carried this row's bytes, in words, from the wrappers' own ``comm.describe()``
    (torch's wrappers and shardkit's pipeline use the process group directly)."""
    from shardkit.transport import Transport
    group_words = f"process group ({distributed.backend_of()})"
    found = []
    for owner in (setup.optimizer, setup.module):
        comm = getattr(owner, "comm", None)
        if isinstance(comm, Transport) and comm not in found:
            found.append(comm)
    if not found:
        return group_words
    words = " + ".join(c.describe() for c in found)
    if config.ddp_inside and words != group_words:
        words += f"; DDP's all-reduce: {group_words}"
    return words


def root_params(workload: Workload, model: nn.Module) -> int:
    """Parameters of ``model`` (unwrapped) outside every instance of the unit classes."""
    in_units = sum(count_params(m.parameters()) for m in model.modules()
                   if isinstance(m, tuple(workload.unit_classes)))
    return count_params(model.parameters()) - in_units


def _sizes(workload: Workload, root: int, setup: TrainingSetup, config: Config,
           states: dict) -> Sizes:
    """The :class:`Sizes` of one built configuration; ``root`` from :func:`root_params`."""
    psi, padded = setup.params, setup.params
    if config.library == "shardkit" and config.stage == "3":
        units = setup.module.sharded_units()  # outermost (the root) first
        padded = sum(u.padded_numel for u in units)
        root = units[0].padded_numel
    elif config.library == "shardkit" and config.stage in ("1", "2"):
        padded = states["params"] // 4  # OSS's flat buffers are the parameters' storage
    return Sizes(psi, padded, root, workload.global_batch * workload.boundary_numel,
                 recipes.pipeline_chunks(workload.global_batch, distributed.get_world_size()))


@dataclass
class _Row:
    """One configuration built by :func:`measure_side_by_side`, and what it measured."""

    config: Config
    setup: TrainingSetup
    comm: object                  # the opt-in transport, closed after the run; None: default
    root: int                     # parameters outside the unit classes (ZeRO-3's formula)
    rows: slice                   # this rank's share of the global batch
    round_times_s: list = field(default_factory=list)
    counter: object = None        # the CommCounter of the last step
    loss: object = None

    def train(self, inputs, target) -> None:
        with distributed.CommCounter() as counter:
            self.loss = self.setup.train_step(inputs[self.rows], target[self.rows])
        self.counter = counter


def _build_row(config: Config, workload: Workload, seed: int) -> _Row:
    comm = make_transport(config.transport)
    try:
        model = workload.build(seed)
        root = root_params(workload, model)
        setup = config.setup(workload, model, comm)
    except BaseException:
        if comm is not None:
            comm.close()
        raise
    rank, world = distributed.get_rank(), distributed.get_world_size()
    per_rank = workload.global_batch // world if setup.data_parallel else workload.global_batch
    lo = rank * per_rank if setup.data_parallel else 0
    return _Row(config, setup, comm, root, slice(lo, lo + per_rank))


def _results_of(row: _Row, workload: Workload) -> dict:
    """This rank's figures of one measured row (see :func:`measure_side_by_side`)."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    setup, config = row.setup, row.config
    transport_bytes = 0
    if config.library == "shardkit":
        measured = model_state_bytes(setup.module, setup.optimizer)
        states, transport_bytes = measured.as_dict(), measured.transport
        state_total = measured.total
    else:
        state_total, states = local_model_state_bytes(setup.module, setup.optimizer), {}
    sizes = _sizes(workload, row.root, setup, config, states)
    counted = row.counter
    return {
        "rank": rank, "round_times_s": list(row.round_times_s),
        "transport": describe_transport(config, setup),
        "transport_bytes": transport_bytes, "model_state_bytes": state_total,
        "model_state_formula_bytes": STATES[config.states](setup.params, world),
        "comm_bytes_per_step": counted.bytes if counted is not None else 0.0,
        "comm_by_op": dict(counted.by_op) if counted is not None else {},
        "comm_formula_bytes": TRAFFIC[config.traffic](sizes, rank, world) * 4,
        "params": setup.params, "padded_params": sizes.padded,
        "loss": None if row.loss is None else float(row.loss)}


def measure_side_by_side(config_names: list, workload_name: str, quick: bool, warmup: int,
                         rounds: int, steps: int, seed: int = 0) -> dict:
    """Build every configuration of ``config_names`` on the workload side by side (each its own
    model, from the same seed), train each ``warmup`` untimed steps, then time ``rounds``
    rounds: in each, every configuration trains ``steps`` steps back to back, in an order
    that rotates every round, in a window that every rank starts together and that closes
    once any parameter sync left in flight has landed (overlap is credited only where it
    really overlaps the next step's work). Every configuration sees the same batches.

    Returns, on this rank, ``{config: {"round_times_s": [seconds per step, one per round],
    "transport", model-state bytes (measured and the ZeRO formula), traffic per step
    (counted on the last step, and the formula), "loss", ...}}``. Pairing the rows round by
    round (seconds apart, not minutes) is what keeps their ratios steady on a shared machine.
    A configuration that raises while being built is ``{"error": ...}`` and the others run on.
    (Names, not objects, cross the process boundary: workloads hold lambdas.)"""
    workload = workloads(quick)[workload_name]
    gc.collect()
    rows: list = []
    failed: dict = {}  # a configuration that raised while being built (on every rank alike)
    try:
        for name in config_names:
            try:
                rows.append(_build_row(CONFIG_BY_NAME[name], workload, seed))
            except Exception as e:  # noqa: BLE001 - the row reports it; the others run on
                failed[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        batches = [workload.batch(step) for step in range(warmup + rounds * steps)]
        for row in rows:
            for inputs, target in batches[:warmup]:
                distributed.barrier()
                row.train(inputs, target)
            finish_pending_sync(row.setup.optimizer)
        timed = iter(batches[warmup:])
        for r in range(rounds):
            round_batches = [next(timed) for _ in range(steps)]
            for row in rows[r % len(rows):] + rows[:r % len(rows)]:
                distributed.barrier()  # every rank starts the window together
                start = time.perf_counter()
                for inputs, target in round_batches:
                    row.train(inputs, target)
                finish_pending_sync(row.setup.optimizer)
                row.round_times_s.append((time.perf_counter() - start) / steps)
        return {**failed, **{row.config.name: _results_of(row, workload) for row in rows}}
    finally:
        for row in rows:
            if row.comm is not None:
                row.comm.close()
        del rows
        gc.collect()


def finish_pending_sync(optimizer) -> None:
    """Wait for a parameter sync still in flight (OSS's ``overlap_sync_with``), so that a timed
    window includes it."""
    wait = getattr(optimizer, "wait_for_sync", None)
    if wait is not None:
        wait()


def time_interleaved(trainers: dict, rounds: int, steps: int, warmup: int = 3) -> tuple[dict, int]:
    """Time each trainer's ``step(step_index, rank)`` in interleaved rounds (the order rotates
    every round, a barrier around each measurement, so every rank's clock spans the slowest
    rank's steps). Returns ``({name: [seconds per step, one per round]}, next step index)``;
    every trainer first runs ``warmup`` untimed steps."""
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
            finish_pending_sync(getattr(trainers[name], "optimizer", None))
            distributed.barrier()
            start = time.perf_counter()
            for s in range(steps):
                trainers[name].step(step + s, rank)
            finish_pending_sync(getattr(trainers[name], "optimizer", None))
            distributed.barrier()
            times[name].append((time.perf_counter() - start) / steps)
        step += steps
    return times, step


def slowest_rank(per_rank_times: list) -> dict:
    """``{name: [per-round seconds]}`` from every rank's :func:`time_interleaved` times: per
    round, the slowest rank's."""
    return {name: [max(ts) for ts in zip(*(times[name] for times in per_rank_times))]
            for name in per_rank_times[0]}


def median_ratio(times: list, base: list) -> float:
    """Median over rounds of ``times[i] / base[i]`` (paired by round: drift cancels)."""
    return statistics.median(t / b for t, b in zip(times, base))


def link_tx_bytes() -> Optional[int]:
    """Bytes this node's cluster interface has sent so far (kernel counter, TCP/IP headers
    included), or None outside the simulated cluster (no ``GLOO_SOCKET_IFNAME``)."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def cluster_env(**extra: str) -> dict:
    """The environment for a benchmark's ranks on the simulated cluster: this one, with the
    repository first on ``PYTHONPATH`` (the ranks run ``python -m benchmarks...`` from the
    nodes' own working directory) and ``extra`` variables."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)


def write_report(text: str, path: str) -> None:
    """Write a benchmark's Markdown report to ``path`` (creating its folder) and print it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    print(text)
