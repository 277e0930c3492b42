"""One recipe per wrapper: a model in, a :class:`TrainingSetup` out, ready to train.

The demo (``python -m shardkit demo``) and the benchmark runner (``benchmarks/run.py``) train
the same models with every wrapper; these functions are the wrapping they share, each a few
lines a newcomer can copy: model, wrap, optimizer, step. All run inside an initialised process
group (torchrun or :class:`shardkit.testing.World`), with AdamW.

=====================  =====  =================================  ================================
recipe                 stage  per-rank model states (fp32 Adam)  wire per step (elements)
=====================  =====  =================================  ================================
:func:`setup_ddp`      0      16Ψ                                2Ψ(N-1)/N
:func:`setup_oss`      1      8Ψ + 8Ψ/N                          2Ψ(N-1)/N + Ψ(N-1)/N all-gather
:func:`setup_sharded`  2      4Ψ + 12Ψ/N (+ one bucket)          2Ψ(N-1)/N
:func:`setup_fsdp`     3      16Ψ/N (+ the unit computing)       3Ψ(N-1)/N
:func:`setup_pipeline` --     16Ψ_stage                          boundary activations and grads
=====================  =====  =================================  ================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.models import GPT

__all__ = ["TrainingSetup", "setup_ddp", "setup_oss", "setup_sharded", "setup_fsdp",
           "setup_pipeline", "gpt_as_sequential", "balance_by_params", "pipeline_chunks",
           "token_cross_entropy", "count_params"]


@dataclass
class TrainingSetup:
    """A wrapped model ready to train.

    ``train_step(inputs, target)`` zeroes the gradients, runs forward, backward and the
    optimizer step, and returns this rank's loss (None on pipeline stages that have none).
    ``module``/``optimizer`` are what :func:`shardkit.utils.memory.model_state_bytes` walks;
    ``params`` is the Ψ this rank's formula uses (the whole model's for data parallelism, the
    stage's for a pipeline); ``data_parallel`` says whether each rank takes a slice of the batch.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    train_step: Callable
    params: int
    data_parallel: bool = True


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[batch, seq, vocab]`` logits against ``[batch, seq]`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def count_params(params: Iterable[torch.Tensor]) -> int:
    """Elements of the distinct tensors in ``params`` (a tied weight counts once)."""
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def data_parallel_step(model: nn.Module, optimizer, loss_fn: Callable,
                       zero_grad: Optional[Callable] = None) -> Callable:
    """The plain training step: zero grads, forward, loss, backward, optimizer step."""
    zero_grad = zero_grad or optimizer.zero_grad

    def step(inputs, target):
        zero_grad()
        loss = loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def counted_allreduce_hook(process_group, bucket):
    """DDP comm hook averaging the bucket with :func:`shardkit.distributed.all_reduce`, so that
    :class:`CommCounter` sees DDP's traffic (torch's own hook bypasses shardkit)."""
    buffer = bucket.buffer()
    buffer.div_(distributed.get_world_size(process_group))
    work = distributed.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def torch_ddp(model: nn.Module, count_comm: bool = True) -> nn.Module:
    """Wrap in torch DDP with gradients as views of its buckets (so the bucket storage is the
    gradient storage and model_state_bytes counts what DDP really holds)."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if count_comm:
        ddp.register_comm_hook(None, counted_allreduce_hook)
    return ddp


def setup_ddp(model: nn.Module, loss_fn: Callable, lr: float,
              count_comm: bool = True) -> TrainingSetup:
    """Stage 0: torch DDP + AdamW (traffic counted through shardkit unless ``count_comm`` is
    False, which leaves torch's native all-reduce)."""
    psi = count_params(model.parameters())
    ddp = torch_ddp(model, count_comm)
    opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
    return TrainingSetup(ddp, opt, data_parallel_step(ddp, opt, loss_fn), psi)


def setup_oss(model: nn.Module, loss_fn: Callable, lr: float, comm=None) -> TrainingSetup:
    """Stage 1: :class:`shardkit.optim.OSS` around AdamW, under torch DDP; ``comm`` is OSS's
    transport for the parameter sync (default: the process group's collectives; DDP's
    gradient all-reduce is torch's either way)."""
    from shardkit.optim import OSS
    psi = count_params(model.parameters())
    ddp = torch_ddp(model)
    opt = OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=lr, comm=comm)
    return TrainingSetup(ddp, opt, data_parallel_step(ddp, opt, loss_fn), psi)


def setup_sharded(model: nn.Module, loss_fn: Callable, lr: float, comm=None) -> TrainingSetup:
    """Stage 2: :class:`ShardedDataParallel` + OSS(AdamW), both on the one transport ``comm``
    (default: the process group's collectives)."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS
    psi = count_params(model.parameters())
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=lr, comm=comm)
    sdp = ShardedDataParallel(model, opt, comm=comm)

    def zero_grad():
        sdp.zero_grad()
        opt.zero_grad()
    return TrainingSetup(sdp, opt, data_parallel_step(sdp, opt, loss_fn, zero_grad), psi)


def setup_fsdp(model: nn.Module, loss_fn: Callable, lr: float, unit_classes: set,
               offload: bool = False, comm=None) -> TrainingSetup:
    """Stage 3: :class:`FullyShardedDataParallel`, one unit per instance of ``unit_classes``
    (e.g. ``{Block}``) plus the root; ``offload`` keeps shards in CPU memory; ``comm`` is every
    unit's transport (default: the process group's collectives)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
    psi = count_params(model.parameters())
    with enable_wrap(wrapper_cls=FSDP, move_params_to_cpu=offload, comm=comm):
        model = auto_wrap(model, auto_wrap_policy=transformer_auto_wrap_policy(unit_classes))
    fsdp = FSDP(model, move_params_to_cpu=offload, comm=comm)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=lr)

    def zero_grad():
        fsdp.zero_grad()
        opt.zero_grad()
    return TrainingSetup(fsdp, opt, data_parallel_step(fsdp, opt, loss_fn, zero_grad), psi)


class Embeddings(nn.Module):
    """A GPT's token + position embedding as one module (the first pipeline layer)."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding):
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


def gpt_as_sequential(gpt: GPT) -> nn.Sequential:
    """The GPT as an ``nn.Sequential`` (embeddings, blocks, final norm, head) sharing its
    parameters, so that a pipeline can split it."""
    return nn.Sequential(Embeddings(gpt.tok_emb, gpt.pos_emb), *gpt.blocks, gpt.ln_f, gpt.head)


def balance_by_params(layers, stages: int) -> list[int]:
    """Split ``layers`` into ``stages`` contiguous non-empty runs of about equal parameters."""
    if stages > len(layers):
        raise ValueError(f"a {stages}-stage pipeline needs at least {stages} layers; the model "
                         f"has {len(layers)}")
    sizes = [count_params(layer.parameters()) for layer in layers]
    total, balance, start = sum(sizes), [], 0
    for stage in range(stages):
        stages_after = stages - stage - 1
        end = start + 1
        target = total * (stage + 1) / stages
        while (end < len(layers) - stages_after
               and sum(sizes[:end]) + sizes[end] / 2 <= target):
            end += 1
        if stages_after == 0:
            end = len(layers)
        balance.append(end - start)
        start = end
    return balance


def pipeline_chunks(global_batch: int, stages: int) -> int:
    """Micro-batches per step: the largest divisor of the batch up to twice the stages."""
    return max(c for c in range(1, min(global_batch, 2 * stages) + 1) if global_batch % c == 0)


def setup_pipeline(layers: nn.Sequential, loss_fn: Callable, lr: float,
                   chunks: int) -> TrainingSetup:
    """A world-size-stage 1F1B pipeline (``shardkit.nn.pipe``) over ``layers``, balanced by
    parameters; every rank trains its own stage with AdamW. ``train_step`` takes the whole
    batch (the first stage reads the inputs, the last the targets)."""
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, split_sequential
    rank, stages = distributed.get_rank(), distributed.get_world_size()
    part = split_sequential(layers, balance_by_params(list(layers), stages))[rank]
    schedule = Schedule1F1B(PipelineStage(part, rank, stages), chunks, loss_fn)
    opt = torch.optim.AdamW(part.parameters(), lr=lr)

    def step(inputs, target):
        opt.zero_grad()
        first = (inputs,) if rank == 0 else ()
        loss = schedule.step(*first, target=target if rank == stages - 1 else None)
        opt.step()
        return None if loss is None else loss.detach()
    return TrainingSetup(part, opt, step, count_params(part.parameters()), data_parallel=False)
