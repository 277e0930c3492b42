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
bytes; ``fp16/bf16_allreduce_hook`` half of it; ``fp32_allreduce_hook`` the fp32 figure for a
16-bit model too (its gradients summed in fp32); ``quantized_allreduce_hook`` about
``bits/32 + 1/block`` of it (a quantized reduce-scatter and a quantized all-gather).
"""

import numbers
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import distributed as skdist
from shardkit.kernels import DEFAULT_BLOCK, pack_rank_major
from shardkit.kernels.quantize import QMAX
from shardkit.quantized_comm import quantized_all_gather, quantized_reduce_scatter

__all__ = ["counted_allreduce_hook", "fp16_allreduce_hook", "bf16_allreduce_hook",
           "fp32_allreduce_hook",
           "QuantizedHookState", "quantized_allreduce_hook", "reduce_to_owners_hook",
           "OwnersHookState", "allreduce_hook_for",
           "step_oss_in_ddp_backward"]


def counted_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """fp32 averaging like torch's default hook, but through
    :func:`shardkit.distributed.all_reduce`, so that :class:`~shardkit.distributed.CommCounter`
    sees DDP's traffic (torch's own hook bypasses shardkit). Wire: ``2(N-1)/N`` of the bucket's
    bytes."""
    _check_group_state("counted_allreduce_hook", process_group)
    buffer = bucket.buffer()
    n = skdist.get_world_size(process_group)
    buffer.div_(n)
    if buffer.is_sparse:  # (nn.Embedding(sparse=True)): gloo/NCCL all-gather indices and values
        indices, values = buffer._indices(), buffer._values()
        sent = indices.numel() * indices.element_size() + values.numel() * values.element_size()
        skdist._record("all_gather", n * sent, process_group, dtype=torch.uint8)
        work = torch.distributed.all_reduce(buffer, group=process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    work = skdist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype: torch.dtype, process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    hook = f"{_WIRE_NAMES[dtype]}_allreduce_hook"
    _check_group_state(hook, process_group)
    buffer = bucket.buffer()
    _refuse_sparse(hook, buffer)
    n = skdist.get_world_size(process_group)
    # divide and cast in one pass (dividing first keeps fp16 sums away from overflow)
    compressed = pack_rank_major([buffer], 1, scale=1.0 / n, dtype=dtype)
    work = skdist.all_reduce(compressed, group=process_group, async_op=True)

    def decompress(fut) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


_HALF_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_WIRE_NAMES = {**_HALF_NAMES, torch.float32: "fp32"}


def _state_hint(state) -> str:
    """Where a state given to the wrong hook belongs, for the error message. By class, not by
    name: another library's ``OSS`` (FairScale's) is no state of shardkit's hooks, and a
    subclass of shardkit's OSS is one."""
    from shardkit.optim import OSS  # here: shardkit.optim imports more than this module needs
    hooks_of_states = ((OSS, "reduce_to_owners_hook (or step_oss_in_ddp_backward(ddp, "
                             "optimizer))"),
                       (OwnersHookState, "reduce_to_owners_hook"),
                       (QuantizedHookState, "quantized_allreduce_hook"))
    hook = next((hook for kind, hook in hooks_of_states if isinstance(state, kind)), None)
    name = type(state).__name__
    article = "an" if name[0] in "AEIOU" else "a"
    return f"; {article} {name} is the state of {hook}" if hook else ""


def _refuse_sparse(hook: str, buffer: torch.Tensor) -> None:
    """A compressing hook packs a dense bucket; DDP hands it a sparse gradient
    (``nn.Embedding(sparse=True)``) as one sparse tensor. A ValueError naming the hook and what
    does work, before any transfer (it was "reshape is not implemented for sparse tensors").
    Local: ranks built alike refuse together."""
    if buffer.is_sparse:
        raise ValueError(f"{hook}: DDP gave the hook a bucket of sparse gradients "
                         f"(nn.Embedding(sparse=True) or EmbeddingBag(sparse=True)), which it "
                         f"cannot compress; build the embedding with sparse=False, or register "
                         f"counted_allreduce_hook (or no hook: DDP's own all-reduce), which "
                         f"average sparse gradients. Nothing was sent")


def _check_group_state(hook: str, state, also: str = "") -> None:
    """The ``state`` of an averaging hook is a process group or ``None`` (as for torch's
    default hooks): a TypeError naming the hook and what was given otherwise, the same on every
    rank and before any transfer (an OSS handed to ``fp16_allreduce_hook`` failed deep inside
    with "'OSS' object has no attribute 'size'"). Local."""
    try:
        skdist.check_group(state, hook, "state")
    except TypeError:
        raise TypeError(f"{hook}: ddp.register_comm_hook(state, {hook}) takes {also}a process "
                        f"group or None (the default group) as state, got a "
                        f"{type(state).__module__}.{type(state).__qualname__}"
                        f"{_state_hint(state)}") from None


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


def fp32_allreduce_hook(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket in fp32 (``state`` is the process group or ``None``):
    a bucket of 16-bit gradients (a model in bf16 / fp16) is widened, each value divided by
    ``N``, summed in fp32 and rounded back once, as DeepSpeed reduces under
    ``"communication_data_type": "fp32"``; an fp32 or fp64 bucket goes as
    :func:`counted_allreduce_hook` sends it.

    Wire: ``2(N-1)/N`` of the bucket's elements x 4 bytes (twice a 16-bit bucket's own).
    Memory: one fp32 copy of a 16-bit bucket while it is in flight."""
    if bucket.buffer().dtype in _HALF_NAMES:
        return _compress_hook(torch.float32, process_group, bucket)
    return counted_allreduce_hook(process_group, bucket)


def allreduce_hook_for(dtype: Optional[torch.dtype]):
    """The averaging DDP hook that sends ``dtype`` (``None``: :func:`counted_allreduce_hook`,
    each bucket in its own dtype; fp32: :func:`fp32_allreduce_hook`, which widens 16-bit
    buckets; fp16 / bf16: their hooks); a ValueError for any other dtype. Costs are the chosen
    hook's: a 16-bit one sends half the fp32 bytes and holds a 16-bit copy of each bucket while
    it is in flight."""
    hooks = {None: counted_allreduce_hook, torch.float32: fp32_allreduce_hook,
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

    def __post_init__(self):
        """A ValueError (TypeError for the group) naming the field, at construction: before,
        bad bits or block surfaced from inside DDP's backward as "bits=3; valid values...",
        naming neither this state nor the hook."""
        skdist.check_group(self.process_group, "QuantizedHookState", "process_group")
        if isinstance(self.bits, bool) or not isinstance(self.bits, numbers.Integral) \
                or self.bits not in QMAX:
            raise ValueError(f"QuantizedHookState(bits={self.bits!r}): valid values are "
                             f"{sorted(QMAX)}")
        object.__setattr__(self, "bits", int(self.bits))  # a numpy integer as a Python int
        if isinstance(self.block, bool) or not isinstance(self.block, int) \
                or not 8 <= self.block <= 8192 or self.block & (self.block - 1):
            raise ValueError(f"QuantizedHookState(block={self.block!r}): valid values are the "
                             f"powers of two from 8 to 8192 (elements per scale; default "
                             f"{DEFAULT_BLOCK})")


def quantized_allreduce_hook(state: Optional[QuantizedHookState], bucket
                             ) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket with block-wise int8/int4 transfers (a quantized
    reduce-scatter summing in fp32, then a quantized all-gather of the averaged shards).

    Wire: ``2(N-1)/N x N x segment bytes`` with segments of ``ceil(numel / N)`` elements, about
    ``bits/32 + 1/block`` of fp32 DDP's bytes. Error: each gradient element within half a block
    scale per other rank of the reduce (a rank's own share is summed exactly), plus half a
    block scale of the averaged shard (see
    :mod:`shardkit.quantized_comm`). Memory: the quantized buffers (about ``bits/32`` of the
    bucket each) and one fp32 shard, plus a record of each bucket agreed on, kept while its
    first parameter and the registered state live. The hook finishes its transfers before
    returning (no overlap with the rest of backward). The first time it meets a bucket (the
    first backward, and once more after DDP rebuilds its buckets) its two collectives first
    agree with every rank on bits, block and sizes (a ValueError on every rank if they
    differ; one small all-gather of int64s each, not counted by ``CommCounter``); afterwards
    no agreement (every rank gets the same buckets from DDP). A bucket is met afresh by each
    registered state: a second DDP over the same parameters, registered with a new
    ``QuantizedHookState``, agrees again (its bits or block may differ between ranks).
    """
    if not isinstance(state, QuantizedHookState):
        _check_group_state("quantized_allreduce_hook", state, also="a QuantizedHookState, ")
    registered = state if isinstance(state, QuantizedHookState) else _DEFAULT_QUANTIZED_STATE
    state = state if isinstance(state, QuantizedHookState) else QuantizedHookState(state)
    buffer = bucket.buffer()
    _refuse_sparse("quantized_allreduce_hook", buffer)
    group = state.process_group
    n = skdist.get_world_size(group)
    check = not _quantized_layout_agreed(registered, state, bucket)
    shard = quantized_reduce_scatter([buffer], group, bits=state.bits, block=state.block,
                                     op="mean", check_ranks=check)
    quantized_all_gather([buffer], shard, group, bits=state.bits, block=state.block,
                         chunk_numels=[-(-buffer.numel() // n)], check_ranks=check)
    if check:
        _remember_quantized_layout(registered, state, bucket)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


# Per registered state (held weakly), per DDP parameter (the first of a bucket, held weakly):
# the (group, bucket index, elements, bits, block) that quantized_allreduce_hook's collectives
# agreed on with every rank
_AGREED_QUANTIZED = WeakIdKeyDictionary()
_AGREED_QUANTIZED_LOCK = threading.Lock()
# stands for every state given as a process group or None: its bits and block are the defaults
# on every rank, so such hooks may share a record
_DEFAULT_QUANTIZED_STATE = QuantizedHookState()


def _quantized_bucket_key(state: QuantizedHookState, bucket) -> tuple:
    """``(first parameter, layout)`` of a bucket for :func:`_quantized_layout_agreed`."""
    params = bucket.parameters()
    layout = (skdist.resolved_group(state.process_group), bucket.index(),
              bucket.buffer().numel(), state.bits, state.block)
    return (params[0] if params else None), layout


def _quantized_layout_agreed(registered: QuantizedHookState, state: QuantizedHookState,
                             bucket) -> bool:
    """Whether every rank already agreed on this bucket's layout (bucket index, elements, bits,
    block) in an earlier call of :func:`quantized_allreduce_hook` for the same parameters and
    the same registered state.

    torch DDP gives every rank the same buckets: it checks the parameters' shapes across ranks
    when it is built, and when it rebuilds its buckets after the first iteration it broadcasts
    rank 0's assignment to the others. So the quantized collectives' agreement (one small
    all-gather each, see :mod:`shardkit.quantized_comm`) runs only the first time a model's
    bucket is seen, which still catches bits or block that differ between ranks; afterwards
    none. Keyed by the parameters (a new model, or one rebuilt alike on every rank, agrees
    afresh on every rank), not by the process group alone: a layout agreed for an earlier
    model on some ranks only would have the ranks decide differently whether to agree. And by
    the registered state: a second DDP over the same parameters whose state asks for bits
    that differ between ranks would otherwise skip the agreement on the ranks whose bits the
    first DDP used and run it on the others (one collective against another: a hang)."""
    param, layout = _quantized_bucket_key(state, bucket)
    with _AGREED_QUANTIZED_LOCK:
        agreed = _AGREED_QUANTIZED.get(registered)
        return param is not None and agreed is not None and layout in agreed.get(param, ())


def _remember_quantized_layout(registered: QuantizedHookState, state: QuantizedHookState,
                               bucket) -> None:
    param, layout = _quantized_bucket_key(state, bucket)
    if param is not None:
        with _AGREED_QUANTIZED_LOCK:
            by_param = _AGREED_QUANTIZED.setdefault(registered, WeakIdKeyDictionary())
            by_param.setdefault(param, set()).add(layout)


@dataclass(frozen=True)
class OwnersHookState:
    """The ``state`` of :func:`reduce_to_owners_hook` when the gradients travel in 16 bits:
    the OSS optimizer and the wire ``dtype`` (``torch.bfloat16`` / ``torch.float16``, or a wider
    ``torch.float32`` / ``torch.float64``; ``None``:
    the bucket's own dtype). Costs are the hook's, with its packed copy and its wire in
    ``dtype``: half the fp32 bytes in 16 bits."""

    optimizer: object
    dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        """A TypeError / ValueError naming the field, at construction (before, a plain torch
        optimizer or a dtype given as a string failed inside DDP's backward with an
        AttributeError)."""
        _check_oss("OwnersHookState(optimizer=...)", self.optimizer)
        if self.dtype is not None and self.dtype not in _OWNERS_WIRE_DTYPES:
            raise ValueError(f"OwnersHookState(dtype={self.dtype!r}): valid values are None "
                             f"(the bucket's own dtype), torch.float64, torch.float32, "
                             f"torch.bfloat16 and torch.float16")


_OWNERS_WIRE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _check_oss(where: str, optimizer) -> None:
    """A TypeError unless ``optimizer`` is a :class:`~shardkit.optim.OSS` (the hooks that
    reduce onto owners read its partition and group). Local."""
    from shardkit.optim import OSS  # here: shardkit.optim imports more than this module needs
    if not isinstance(optimizer, OSS):
        given = "None" if optimizer is None else \
            f"a {type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise TypeError(f"{where}: expected a shardkit.optim.OSS (the owners are its "
                        f"partition's), got {given}{_state_hint(optimizer)}; wrap the "
                        f"optimizer: OSS(ddp.parameters(), optim=torch.optim.AdamW, ...) or "
                        f"OSS(existing_optimizer)")


def _owners_state(state) -> tuple:
    """``(OSS, wire dtype or None)`` from :func:`reduce_to_owners_hook`'s state (an OSS or an
    :class:`OwnersHookState`); a TypeError naming the hook for any other state, on every rank
    alike and before any transfer (a plain torch optimizer failed inside DDP's backward with
    "'SGD' object has no attribute 'group'")."""
    if isinstance(state, OwnersHookState):
        return state.optimizer, state.dtype
    _check_oss("reduce_to_owners_hook: ddp.register_comm_hook(state, reduce_to_owners_hook) "
               "takes an OwnersHookState(OSS, dtype) or an OSS as state", state)
    return state, None


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

    Several reduced backwards without zeroing in between (accumulation without ``no_sync``,
    or gradients kept across a step) add up as under DDP's all-reduce: the owner's gradient
    reads its earlier average plus the new one. Only the owner holds the earlier average, so
    it carries it: the first time autograd accumulates into such a gradient again (a pre-hook
    on the parameter's gradient accumulator; with no new local gradient, when the bucket is
    reduced) it is multiplied by ``N`` in place, and the reduction's division by ``N`` gives
    it back whole: ``carried + mean(new)``. Whatever the owner's ``.grad`` holds then counts
    as carried, so ``zero_grad()`` (to zero or to None) between backwards starts afresh (a
    tensor put in an owner's ``.grad`` by hand counts as held by the owner only; DDP's
    all-reduce would average it over the ranks). No extra memory and no extra collective:
    one in-place multiply of the owner's reduced gradients (``Ψ/N`` elements) per backward
    that follows a reduction without the gradients set to None, and a Python pre-hook call
    per parameter per backward. Until that next reduction, an owner's gradient read after
    such a backward inside ``no_sync`` reads ``N x carried + local``. With a 16-bit ``dtype``
    the carried part travels in it too, as it does under DDP's 16-bit hooks. (In an fp16
    model that product overflows once a carried gradient passes 65504 / N: accumulate fp16
    micro-batches inside ``ddp.no_sync()``, as ``shardkit.initialize`` does.)
    """
    return _reduce_to_owners(optimizer, bucket, tell_owners_what_was_used=False)


def _reduce_to_owners(optimizer, bucket, tell_owners_what_was_used: bool):
    """:func:`reduce_to_owners_hook`; with ``tell_owners_what_was_used`` each rank also sends,
    beside each owner's share, one element per parameter of that share: whether the parameter
    has a gradient on this rank. An owner whose ``.grad`` of a parameter is still ``None`` (it
    did not use it: DDP with ``find_unused_parameters`` or ``static_graph``) then gets DDP's
    bucket view there when another rank used it, as DDP gives it only once backward ends, and
    keeps ``None`` when no rank did, as DDP does."""
    optimizer, wire = _owners_state(optimizer)
    group = optimizer.group
    n, rank = skdist.get_world_size(group), skdist.get_rank(group)
    _agree_on_bucket_layout(optimizer, bucket, n)
    _check_reducible_to_owners(optimizer, bucket, n)
    buffer = bucket.buffer()
    layout = _layout_by_owner(optimizer.partition, bucket)
    carry = _carry_of(optimizer, n) if n > 1 else None
    if carry is not None:
        carry.watch([p for p, *_ in layout])
        carry.scale_unaccumulated(layout, buffer)
    slices: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    shares: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for p, owner, offset, numel in layout:
        slices[owner].append((offset, numel))
        shares[owner].append(p)
    segments = []
    for owned, params in zip(slices, shares):
        sources = [buffer[offset:offset + numel] for offset, numel in owned]
        if sources and tell_owners_what_was_used:
            sources.append(torch.tensor([float(q.grad is not None) for q in params],
                                        dtype=buffer.dtype, device=buffer.device))
        segments.append(pack_rank_major(sources, 1, scale=1.0 / n, dtype=wire or buffer.dtype)
                        if sources else None)
    handle = optimizer.comm.reduce_to_owners(segments, group)
    landed = [p for p, owner, _, numel in layout if owner == rank and numel]

    def land(fut) -> torch.Tensor:
        summed = fut.value()
        buffer.zero_()
        start = 0
        for offset, numel in slices[rank]:
            if numel:  # a rank owning only zero-element parameters receives nothing (None)
                buffer[offset:offset + numel].copy_(summed[start:start + numel])
                start += numel
        if tell_owners_what_was_used and slices[rank]:
            used_somewhere = summed[start:start + len(slices[rank])].ne(0).tolist()
            _give_used_gradients(bucket, shares[rank], used_somewhere)
        if carry is not None:
            carry.arm(landed)
        return buffer

    return handle.as_future().then(land)


def _give_used_gradients(bucket, owned: list, used_somewhere: list) -> None:
    """Set ``.grad`` to DDP's bucket view for each owned parameter without one that some rank
    used (the view DDP sets when its backward ends, filled now with the reduced average)."""
    views = {id(p): g for p, g in zip(bucket.parameters(), bucket.gradients())}
    for p, used in zip(owned, used_somewhere):
        if used and p.grad is None:
            p.grad = views[id(p)]


class _Carry:
    """Per OSS optimizer: the parameters whose gradient holds an average this rank's hook
    landed (as their owner) and that no backward has accumulated into since. The next
    accumulation into one of them first multiplies its gradient by ``N`` (see
    :func:`reduce_to_owners_hook`). Holds each watched parameter's gradient accumulator, as
    DDP does, so that its pre-hook stays registered (and so the parameters, as OSS does)."""

    def __init__(self, n: int):
        self.n = n
        self._armed: dict[int, torch.Tensor] = {}  # keyed by id: tensors compare elementwise
        self._accumulators: dict[int, object] = {}
        self._lock = threading.Lock()

    def watch(self, params) -> None:
        for p in params:
            if id(p) not in self._accumulators:
                with torch.enable_grad():  # backward runs with grad mode off
                    accumulator = p.view_as(p).grad_fn.next_functions[0][0]
                accumulator.register_prehook(self._before_accumulating(p))
                self._accumulators[id(p)] = accumulator

    def _before_accumulating(self, p: torch.Tensor):
        # Note: the accumulator outlives this object where DDP holds it; the pre-hook then
        # finds its carry gone and does nothing.
        carry, armed, key = weakref.ref(self), self._armed, id(p)

        def prehook(grad_outputs):
            if key in armed:  # a read under the GIL; the pop below decides
                live = carry()
                if live is not None:
                    live._scale_if_armed(p)
            return None
        return prehook

    def _disarm(self, p: torch.Tensor) -> bool:
        with self._lock:
            return self._armed.pop(id(p), None) is not None

    def _scale_if_armed(self, p: torch.Tensor) -> None:
        if self._disarm(p) and p.grad is not None:
            with torch.no_grad():
                p.grad.mul_(self.n)

    def scale_unaccumulated(self, layout, buffer: torch.Tensor) -> None:
        """Before a reduction: a carried gradient nothing accumulated into this backward (the
        parameter unused, find_unused_parameters) sits in the bucket as it is; scale it there."""
        if not self._armed:
            return
        carried = [(offset, numel) for p, _, offset, numel in layout if self._disarm(p)]
        with torch.no_grad():
            for offset, numel in carried:
                buffer[offset:offset + numel].mul_(self.n)

    def arm(self, params) -> None:
        with self._lock:
            for p in params:
                self._armed[id(p)] = p


_CARRIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CARRIES_LOCK = threading.Lock()


def _carry_of(optimizer, n: int) -> _Carry:
    with _CARRIES_LOCK:
        carry = _CARRIES.get(optimizer)
        if carry is None or carry.n != n:
            carry = _CARRIES[optimizer] = _Carry(n)
        return carry


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
    update and accumulation must use ``ddp.no_sync()``: a second backward outside it before
    ``optimizer.step()`` raises a RuntimeError on every rank before its first reduction (it
    would step again). Creates a process group over the same ranks for the all-gathers
    (:func:`shardkit.distributed.group_of_same_ranks`). Wire and memory:
    :func:`reduce_to_owners_hook`'s plus OSS's parameter sync, ``2Ψ(N-1)/N`` a step. With
    ``find_unused_parameters`` or ``static_graph`` (parameters a rank may not use) each share
    also carries one element per parameter, whether the sender used it, so that an owner that
    did not use a parameter steps it on the others' gradients, and one that no rank used is
    left unstepped, as torch DDP leaves its ``.grad`` ``None``.
    """
    _check_oss("step_oss_in_ddp_backward(optimizer=...)", optimizer)
    if not getattr(ddp, "gradient_as_bucket_view", False):
        raise ValueError("step_oss_in_ddp_backward(ddp=...): build DistributedDataParallel with "
                         "gradient_as_bucket_view=True; the step reads the gradients in DDP's "
                         "buckets as soon as they are reduced")
    optimizer._check_steps_per_parameter("step_oss_in_ddp_backward")
    if skdist.get_world_size(optimizer.group) > 1:
        optimizer._prepare_step_in_backward(skdist.group_of_same_ranks(optimizer.group),
                                            ddp.module)
    # with parameters a rank may not use, DDP gives such a rank their .grad only once backward
    # ends, after the step here: the owners are told which parameters some rank used
    may_leave_unused = bool(getattr(ddp, "find_unused_parameters", False)
                            or getattr(ddp, "static_graph", False))
    ddp.register_comm_hook(_StepWhenReduced(optimizer, may_leave_unused),
                           _reduce_to_owners_and_step_hook)


class _StepWhenReduced:
    """The state of :func:`_reduce_to_owners_and_step_hook`: how many gradients of each OSS
    sync bucket have landed in this backward, and the bucket each parameter is in."""

    def __init__(self, optimizer, may_leave_unused: bool = False):
        self.optimizer = optimizer
        self.may_leave_unused = may_leave_unused
        self._planned_for = None
        self._bucket_of: dict = {}
        self._sizes: list[int] = []
        self._landed: list[int] = []
        self._lock = threading.Lock()

    def begin_backward(self) -> None:
        if self.optimizer._stepped_in_backward is not None:
            # every rank, at DDP's first bucket, before this backward's first reduction
            raise RuntimeError(
                "step_oss_in_ddp_backward: this backward would reduce the gradients again, but "
                "the last reduced backward already stepped the parameters and "
                "optimizer.step() has not been called since; a second step would apply the "
                "first backward's gradients twice. Call optimizer.step() (and zero_grad()) "
                "after each backward outside no_sync(), and accumulate micro-batches inside "
                "ddp.no_sync()")
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
    reduced = _reduce_to_owners(state.optimizer, bucket,
                                tell_owners_what_was_used=state.may_leave_unused)

    def step_what_is_complete(fut) -> torch.Tensor:
        buffer = fut.value()
        state.gradients_landed(params)
        return buffer

    return reduced.then(step_what_is_complete)


# Per OSS optimizer: the bucket layouts (index, sparse, elements, dtype) every rank of its group
# was found to hold alike (see _agree_on_bucket_layout)
_AGREED_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _agree_on_bucket_layout(optimizer, bucket, world_size: int) -> None:
    """The first time this rank's hook sees a bucket layout (its index, whether it is sparse,
    its elements and dtype): check, with every rank of the OSS group, that they hold the same.
    A ValueError on every rank otherwise, before any transfer: a sparse bucket on some ranks
    only (``nn.Embedding(sparse=True)`` built so on some ranks, which refused alone while the
    others hung in their reduction), or buckets that differ (models built differently).

    Communication: one small object all-gather per new layout (a control message that
    ``CommCounter`` does not count): once per bucket at the first backward, and again after
    torch DDP rebuilds its buckets (once, after the first iteration); nothing afterwards."""
    if world_size == 1:
        return
    buffer = bucket.buffer()
    layout = (bucket.index(), buffer.is_sparse, 0 if buffer.is_sparse else buffer.numel(),
              str(buffer.dtype))
    with _CARRIES_LOCK:
        agreed = _AGREED_LAYOUTS.setdefault(optimizer, set())
    if layout in agreed:
        return
    every = skdist.all_gather_object(layout, optimizer.group, counted=False,
                                     operation="reduce_to_owners_hook's bucket check")
    sparse = [r for r, theirs in enumerate(every) if theirs[1]]
    if sparse:
        raise ValueError(f"reduce_to_owners_hook: DDP gave the hook a bucket of sparse "
                         f"gradients on group rank(s) {sparse} of {world_size} "
                         f"(nn.Embedding(sparse=True) or EmbeddingBag(sparse=True)), which "
                         f"cannot be split by owner; build the embedding with sparse=False (on "
                         f"every rank alike), or use ShardedDataParallel (which reduces sparse "
                         f"gradients densely onto their owners) or DDP's own all-reduce. "
                         f"Nothing was sent")
    if len(set(every)) > 1:
        raise ValueError(f"reduce_to_owners_hook: the ranks' DDP buckets differ (bucket "
                         f"index, sparse, elements, dtype by group rank: {every}): the model "
                         f"was built differently on some ranks (nn.Embedding(sparse=True) on "
                         f"some ranks only gets a bucket of its own there); build it alike on "
                         f"every rank. Nothing was sent")
    agreed.add(layout)


def _check_reducible_to_owners(optimizer, bucket, world_size: int) -> None:
    """Refuse, on every rank alike and before any transfer, what cannot be reduced onto owners:
    over several ranks, an optimizer stepped over the whole model on every rank
    (``OSS(optim=torch.optim.LBFGS)``: each rank's LBFGS would read zeros for the gradients it
    does not own, and take another step than one process does, silently), and a sparse bucket
    (``nn.Embedding(sparse=True)``: DDP hands it to the hook as one sparse tensor, which has no
    per-parameter offsets)."""
    if world_size > 1 and getattr(optimizer, "_whole_model", False):
        raise ValueError(f"reduce_to_owners_hook: the OSS given as the hook's state runs "
                         f"{type(optimizer.optim).__name__} over the whole model on every rank "
                         f"(not sharded), which needs every averaged gradient on every rank; "
                         f"reduced onto owners, the other ranks' gradients read zero and "
                         f"each rank would step differently. Register no comm hook (DDP's "
                         f"all-reduce) or "
                         f"shardkit.comm_hooks.counted_allreduce_hook (shardkit.initialize at "
                         f"ZeRO stage 1: zero_optimization.reduce_scatter=false), or use a "
                         f"per-parameter optimizer (SGD, Adam, AdamW...)")
    if bucket.buffer().is_sparse:
        raise ValueError("reduce_to_owners_hook: DDP gave the hook a bucket of sparse gradients "
                         "(nn.Embedding(sparse=True) or EmbeddingBag(sparse=True)), which cannot "
                         "be split by owner; build the embedding with sparse=False, or use "
                         "ShardedDataParallel (which reduces sparse gradients densely onto their "
                         "owners) or DDP's own all-reduce")


def _layout_by_owner(partition, bucket) -> list[tuple[torch.Tensor, int, int, int]]:
    """``(param, owner, offset, numel)`` of each gradient in the bucket's buffer."""
    buffer = bucket.buffer()
    layout = []
    base, size = buffer.data_ptr(), buffer.element_size()
    for p, grad in zip(bucket.parameters(), bucket.gradients()):
        if p not in partition:
            raise ValueError(f"reduce_to_owners_hook: a DDP parameter of shape "
                             f"{tuple(p.shape)} is not in the OSS optimizer given as the hook's "
                             f"state; build OSS over ddp.parameters()")
        offset = (grad.data_ptr() - base) // size
        layout.append((p, partition.owner(p), offset, grad.numel()))
    return layout
