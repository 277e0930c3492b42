"""Compressed gradient all-reduce hooks for torch's DistributedDataParallel.

For people who keep torch DDP for the gradients and use shardkit for the rest (e.g. DDP + OSS,
ZeRO-1): register one of these with ``ddp.register_comm_hook(state, hook)``. They go through
:mod:`shardkit.distributed`, so :class:`~shardkit.distributed.CommCounter` counts what they
really send, and the gradients come back averaged in the bucket's own dtype::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, bf16_allreduce_hook)          # or fp16_allreduce_hook
    ddp.register_comm_hook(QuantizedHookState(bits=8), quantized_allreduce_hook)
    optimizer = OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=1e-3)

Wire per rank per step (``Ψ`` gradient elements, ``N`` ranks): fp32 DDP ``2Ψ(N-1)/N x 4``
bytes; ``fp16/bf16_allreduce_hook`` half of it; ``quantized_allreduce_hook`` about
``bits/32 + 1/block`` of it (a quantized reduce-scatter and a quantized all-gather).
"""

import threading
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit import distributed as skdist
from shardkit.kernels import DEFAULT_BLOCK, pack_rank_major
from shardkit.quantized_comm import quantized_all_gather, quantized_reduce_scatter

__all__ = ["counted_allreduce_hook", "fp16_allreduce_hook", "bf16_allreduce_hook",
           "QuantizedHookState", "quantized_allreduce_hook", "reduce_to_owners_hook",
           "OwnersHookState", "allreduce_hook_for",
           "step_oss_in_ddp_backward"]


def counted_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """fp32 averaging like torch's default hook, but through :func:`shardkit.distributed.
    all_reduce`, so that :class:`CommCounter` sees DDP's traffic (torch's own hook bypasses
    shardkit). Wire: ``2(N-1)/N`` of the bucket's bytes."""
    buffer = bucket.buffer()
    buffer.div_(skdist.get_world_size(process_group))
    work = skdist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    n = skdist.get_world_size(process_group)
    # divide and cast in one pass (dividing first keeps fp16 sums away from overflow)
    compressed = pack_rank_major([buffer], 1, scale=1.0 / n, dtype=dtype)
    work = skdist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def fp16_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket as fp16 (``state`` is the process group or ``None``).

    Wire: ``2(N-1)/N`` of the bucket's elements x 2 bytes. Memory: one fp16 copy of the bucket.
    Precision: fp16's 11-bit mantissa and its range (values are divided by ``N`` before the
    cast; sums beyond 65504 overflow to inf, which a GradScaler then skips).
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket as bf16 (``state`` is the process group or ``None``).

    Wire: ``2(N-1)/N`` of the bucket's elements x 2 bytes. Memory: one bf16 copy of the bucket.
    Precision: bf16's 8-bit mantissa (relative error about 2^-9 per rounding), fp32's range.
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


def allreduce_hook_for(dtype: Optional[torch.dtype]):
    """The averaging DDP hook that sends ``dtype`` (``None`` or fp32:
    :func:`counted_allreduce_hook`; fp16 / bf16: their hooks); a ValueError for any other
    dtype. Costs are the chosen hook's: a 16-bit one sends half the fp32 bytes and holds a
    16-bit copy of each bucket while it is in flight."""
    hooks = {None: counted_allreduce_hook, torch.float32: counted_allreduce_hook,
             torch.float16: fp16_allreduce_hook, torch.bfloat16: bf16_allreduce_hook}
    if dtype not in hooks:
        raise ValueError(f"allreduce_hook_for({dtype}): gradients travel in fp32, fp16 or bf16")
    return hooks[dtype]


@dataclass(frozen=True)
class QuantizedHookState:
    """The ``state`` of :func:`quantized_allreduce_hook`: its process group and quantization."""

    process_group: Optional[object] = None
    bits: int = 8
    block: int = DEFAULT_BLOCK


def quantized_allreduce_hook(state: Optional[QuantizedHookState], bucket
                             ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket with block-wise int8/int4 transfers (a quantized
    reduce-scatter summing in fp32, then a quantized all-gather of the averaged shards).

    Wire: ``2(N-1)/N x N x segment bytes`` with segments of ``ceil(numel / N)`` elements, about
    ``bits/32 + 1/block`` of fp32 DDP's bytes. Error: each gradient element within half a block
    scale per other rank of the reduce (a rank's own share is summed exactly), plus half a
    block scale of the averaged shard (see
    :mod:`shardkit.quantized_comm`). Memory: the quantized buffers (about ``bits/32`` of the
    bucket each) and one fp32 shard. The hook finishes its transfers before returning (no
    overlap with the rest of backward).
    """
    state = state if isinstance(state, QuantizedHookState) else QuantizedHookState(state)
    buffer = bucket.buffer()
    group = state.process_group
    n = skdist.get_world_size(group)
    shard = quantized_reduce_scatter([buffer], group, bits=state.bits, block=state.block,
                                     op="mean")
    quantized_all_gather([buffer], shard, group, bits=state.bits, block=state.block,
                         chunk_numels=[-(-buffer.numel() // n)])
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


@dataclass(frozen=True)
class OwnersHookState:
    """The ``state`` of :func:`reduce_to_owners_hook` when the gradients travel in 16 bits:
    the OSS optimizer and the wire ``dtype`` (``torch.bfloat16`` / ``torch.float16``; ``None``:
    the bucket's own dtype). Costs are the hook's, with its packed copy and its wire in
    ``dtype``: half the fp32 bytes in 16 bits."""

    optimizer: object
    dtype: Optional[torch.dtype] = None


def reduce_to_owners_hook(optimizer, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook for torch DDP + OSS: each bucket's gradients are averaged onto the ranks
    that own them in ``optimizer`` (an :class:`~shardkit.optim.OSS`, given as the hook's
    ``state``) instead of onto every rank. OSS steps only what a rank owns, so training is the
    same, and stage 1 then moves stage 2's bytes: ``(N-1)/N`` of the gradients here plus OSS's
    parameter sync (``2Ψ(N-1)/N`` a step, as DDP alone; ``3Ψ(N-1)/N`` with the all-reduce)::

        ddp = DistributedDataParallel(model)
        optimizer = OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        ddp.register_comm_hook(optimizer, reduce_to_owners_hook)
        # or, gradients sent and summed in bf16 (divided by N first), half the bytes:
        ddp.register_comm_hook(OwnersHookState(optimizer, torch.bfloat16), reduce_to_owners_hook)

    After backward a rank's gradients of parameters it does not own are zero (not this rank's
    contribution, not the average): clip with ``optimizer.clip_grad_norm``, which reads owned
    gradients only, and read other gradients on their owner. The reduction runs on OSS's
    transport (``comm=``: on gloo, sends of each owner's share straight to it). Memory: a
    packed copy of the bucket while in flight, plus what the transport receives. Wire per
    bucket: the bytes of the other ranks' shares (no padding).
    """
    wire = None
    if isinstance(optimizer, OwnersHookState):
        optimizer, wire = optimizer.optimizer, optimizer.dtype
    group = optimizer.group
    n, rank = skdist.get_world_size(group), skdist.get_rank(group)
    buffer = bucket.buffer()
    slices = _slices_by_owner(optimizer.partition, bucket)
    segments = []
    for owned in slices:
        sources = [buffer[offset:offset + numel] for offset, numel in owned]
        segments.append(pack_rank_major(sources, 1, scale=1.0 / n, dtype=wire or buffer.dtype)
                        if sources else None)
    handle = optimizer.comm.reduce_to_owners(segments, group)

    def land(fut) -> torch.Tensor:
        summed = fut.value()
        buffer.zero_()
        start = 0
        for offset, numel in slices[rank]:
            if numel:  # a rank owning only zero-element parameters receives nothing (None)
                buffer[offset:offset + numel].copy_(summed[start:start + numel])
                start += numel
        return buffer

    return handle.as_future().then(land)


def step_oss_in_ddp_backward(ddp, optimizer) -> None:
    """Register on torch DDP ``ddp`` a comm hook that reduces each gradient onto its owner in
    ``optimizer`` (an :class:`~shardkit.optim.OSS`, as :func:`reduce_to_owners_hook`) and, as
    soon as every gradient of one of OSS's sync buckets has landed, steps that bucket and
    starts its all-gather, on a thread that waits for the transfers, while backward goes on.
    The next forward waits for the sync module by module (``ddp.module``'s ``state_dict()``
    for all of it); ``optimizer.step()`` then has nothing left to do::

        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        optimizer = OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        step_oss_in_ddp_backward(ddp, optimizer)

    Needs ``gradient_as_bucket_view=True`` (the step reads the gradients in DDP's buckets)
    and an optimizer that updates each parameter alone; gradients cannot be clipped before the
    update and accumulation must use ``ddp.no_sync()``. Creates a process group over the same
    ranks for the all-gathers (:func:`shardkit.distributed.group_of_same_ranks`). Wire and
    memory: :func:`reduce_to_owners_hook`'s plus OSS's parameter sync, ``2Ψ(N-1)/N`` a step.
    """
    if not getattr(ddp, "gradient_as_bucket_view", False):
        raise ValueError("step_oss_in_ddp_backward(ddp=...): build DistributedDataParallel with "
                         "gradient_as_bucket_view=True; the step reads the gradients in DDP's "
                         "buckets as soon as they are reduced")
    optimizer._check_steps_per_parameter("step_oss_in_ddp_backward")
    if skdist.get_world_size(optimizer.group) > 1:
        optimizer._prepare_step_in_backward(skdist.group_of_same_ranks(optimizer.group),
                                            ddp.module)
    ddp.register_comm_hook(_StepWhenReduced(optimizer), _reduce_to_owners_and_step_hook)


class _StepWhenReduced:
    """The state of :func:`_reduce_to_owners_and_step_hook`: how many gradients of each OSS
    sync bucket have landed in this backward, and the bucket each parameter is in."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._planned_for = None
        self._bucket_of: dict = {}
        self._sizes: list[int] = []
        self._landed: list[int] = []
        self._lock = threading.Lock()

    def begin_backward(self) -> None:
        if self._planned_for is not self.optimizer.partition:
            buckets = self.optimizer._sync_bucket_params()
            self._bucket_of = {id(p): i for i, params in enumerate(buckets) for p in params}
            self._sizes = [len(params) for params in buckets]
            self._planned_for = self.optimizer.partition
        self._landed = [0] * len(self._sizes)
        if self._sizes:
            self.optimizer._begin_step_in_backward()

    def gradients_landed(self, params) -> None:
        # Note: transfers land in the order DDP issued its buckets (one watcher thread), so the
        # steps and the all-gathers they start come in the same order on every rank.
        with self._lock:
            ready = []
            for p in params:
                index = self._bucket_of.get(id(p))
                if index is not None:
                    self._landed[index] += 1
                    if self._landed[index] == self._sizes[index]:
                        ready.append(index)
            for index in sorted(ready):
                self.optimizer._step_bucket_in_backward(index)


def _reduce_to_owners_and_step_hook(state: _StepWhenReduced, bucket):
    if bucket.index() == 0:
        state.begin_backward()
    params = bucket.parameters()
    reduced = reduce_to_owners_hook(state.optimizer, bucket)

    def step_what_is_complete(fut) -> torch.Tensor:
        buffer = fut.value()
        state.gradients_landed(params)
        return buffer

    return reduced.then(step_what_is_complete)


def _slices_by_owner(partition, bucket) -> list[list[tuple[int, int]]]:
    """Per rank, ``(offset, numel)`` in the bucket's buffer of each gradient it owns."""
    buffer = bucket.buffer()
    slices: list[list[tuple[int, int]]] = [[] for _ in range(partition.world_size)]
    base, size = buffer.data_ptr(), buffer.element_size()
    for p, grad in zip(bucket.parameters(), bucket.gradients()):
        if p not in partition:
            raise ValueError(f"reduce_to_owners_hook: a DDP parameter of shape "
                             f"{tuple(p.shape)} is not in the OSS optimizer given as the hook's "
                             f"state; build OSS over ddp.parameters()")
        offset = (grad.data_ptr() - base) // size
        slices[partition.owner(p)].append((offset, grad.numel()))
    return slices
