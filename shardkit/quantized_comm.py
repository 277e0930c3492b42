"""Quantized collectives: ZeRO++'s qwZ (int8 weight all-gather) and qgZ (int4/int8 gradient
reduce-scatter, flat or hierarchical), built on :mod:`shardkit.kernels.quantize` and issued
through :mod:`shardkit.distributed`, so :class:`~shardkit.distributed.CommCounter` counts the
compressed ``uint8`` bytes that really move.

Every function takes the values in the rank-major layout of :mod:`shardkit.kernels.packing`
(``tensors`` cut into ``world_size`` chunks of ``chunk_numels[i]`` elements, or one flat
rank-major buffer), so an FSDP unit's flat shard and per-parameter gradients go in unchanged.

Bytes per quantized segment of ``S`` elements with blocks of ``B``: ``ceil(S/B)·B·bits/8`` of
codes plus ``ceil(S/B)`` scales (4 bytes; 2 with ``scale_dtype=torch.bfloat16``), i.e. about
``S·(bits/8 + 4/B)`` against ``4·S`` in fp32 (0.27x for int8, 0.14x for int4 at ``B = 256``).

Error: each element comes back within half its block's scale (``absmax / qmax``) per
quantization it went through; sums run in fp32. Inf or nan input is not an error here: its
block arrives as nan on every receiver (a loss-scaled step then skips), never a nan scale.

.. warning:: every function is a collective: call it on every rank of the group(s), with the
   same sizes and arguments. Arguments are checked before anything is sent.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional, Sequence, Union

import torch

from shardkit import collective_check
from shardkit import distributed as skdist
from shardkit.kernels import (DEFAULT_BLOCK, QuantLayout, dequantize_sum, dequantize_unpack,
                              quant_layout, quantize_pack)
from shardkit.kernels.packing import chunk_of_rank
from shardkit.transport import operation_tag

_LAYOUT_AGREEMENT = skdist.control_kind("a quantized collective's layout agreement")

__all__ = ["quantized_all_gather", "quantized_reduce_scatter",
           "quantized_reduce_scatter_hierarchical", "issue_reduce_scatter",
           "PendingQuantized", "node_groups", "node_send_order", "pack_for_nodes",
           "wire_bytes", "hierarchical_wire_bytes"]

_OPS = ("sum", "mean")
# (intra, inter, group) object ids -> the objects, for pairs of groups every rank of the group
# found valid, with their send order (see _agreed_send_order)
_AGREED_GROUP_PAIRS = skdist.GroupCache()
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PendingQuantized:
    """An issued quantized collective; :meth:`wait` finishes the transfer, dequantizes and
    returns the result tensor (``None`` for an all-gather into a list of tensors)."""

    def __init__(self, works, finish):
        self._works = list(works) if isinstance(works, (list, tuple)) else [works]
        self._finish = finish

    def wait(self) -> Optional[torch.Tensor]:
        """Block until the transfer completes, then dequantize into the output: the result
        (see the class). No communication of its own."""
        for work in self._works:
            if work is not None:
                work.wait()
        self._works = []
        return self._finish()


def _as_list(tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"op={op!r}; valid values are {list(_OPS)}")


def _checked_tensors(what: str, tensors) -> list[torch.Tensor]:
    """``tensors`` as a non-empty list of tensors, else a ValueError naming ``what``. Local."""
    listed = _as_list(tensors)
    if not listed or not all(isinstance(t, torch.Tensor) for t in listed):
        raise ValueError(f"{what}(tensors={_shown(tensors)}): must be a tensor or a non-empty "
                         f"sequence of tensors (the gradients, or one flat rank-major buffer)")
    return listed


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {[type(v).__name__ for v in value][:4]}"
    return repr(value)


_SCALE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _agreed_layout(what: str, build: Callable[[], QuantLayout], groups: Sequence,
                   op: Optional[str], check_ranks: bool) -> QuantLayout:
    """The :class:`QuantLayout` that ``build`` (the call's local argument checks) returns, once
    every rank agrees on it: with ``check_ranks``, one all-gather of 16 int64s a rank over each
    of ``groups`` in turn (control messages :class:`~shardkit.distributed.CommCounter` does
    not count; a node's group then its column's for the hierarchical reduce, where each
    gather carries whether the ranks agreed so far). A rank whose arguments fail raises its
    own error and every other rank a ValueError naming it; ranks whose bits, block, scale
    dtype, sizes (the size of every chunk, not only their sum and count) or ``op`` differ all
    raise a ValueError naming them, before any byte is sent (gloo aborted one process and gave
    the other sums of the wrong bytes, silently).
    The agreement is synchronous, also for ``async_op=True`` calls (on GPUs a host sync).
    ``check_ranks=False``: for callers whose arguments every rank derives alike, no
    agreement."""
    try:
        layout, problem = build(), None
    except (TypeError, ValueError) as error:
        layout, problem = None, error
    groups = [g for g in groups if skdist.get_world_size(g) > 1] if check_ranks else []
    facts = [-1] * 7 if problem is not None else [
        layout.bits, layout.block, _SCALE_CODES[layout.scale_dtype], layout.segment_numel,
        len(layout.chunk_numels), _OPS.index(op) if op is not None else -1,
        _chunk_digest(layout.chunk_numels)]
    ok, verdict = problem is None, None
    for group in groups:
        rows = skdist.gather_control_rows(what, [int(ok), *facts], group,
                                          kind=_LAYOUT_AGREEMENT)
        ranks = skdist.group_ranks(group)
        failed = [ranks[r] for r, (fine, *_) in enumerate(rows) if not fine]
        if failed and verdict is None:
            verdict = (f"{what}: rank(s) {failed} were given arguments that do not fit, or "
                       f"disagree with other ranks (their error says which); nothing was sent")
        elif any(row[1:] != rows[0][1:] for row in rows) and verdict is None:
            verdict = (f"{what}: the ranks' calls differ ({_described_rows(rows, ranks)}"
                       f"{_described_chunks(rows, layout)}); every rank must pass the same "
                       f"sizes, bits, block, scale_dtype and op; nothing was sent")
        ok = ok and verdict is None
    if problem is not None:
        raise problem
    if verdict is not None:
        raise ValueError(verdict)
    return layout


def _described_rows(rows: list, ranks: Sequence[int]) -> str:
    """Each rank's quantization and sizes, from the agreement's ``rows`` (global ``ranks``)."""
    scale_names = {code: str(dtype) for dtype, code in _SCALE_CODES.items()}
    return "; ".join(
        f"rank {rank}: bits={bits}, block={block}, scale_dtype={scale_names[scale]}, "
        f"{numel} elements per rank in {chunks} chunk(s)"
        + (f", op={_OPS[op]!r}" if op >= 0 else "")
        for rank, (_, bits, block, scale, numel, chunks, op, _digest) in zip(ranks, rows))


def _chunk_digest(chunk_numels: Sequence[int]) -> int:
    """A number that differs, but for a 2**-32 chance, between two different lists of chunk
    sizes (the same on every process: not Python's salted ``hash``). Two ranks whose chunks
    have the same sum and count but other sizes (tensors passed in another order) would
    otherwise agree, and each would read the other's bytes at the wrong offsets. Local."""
    return zlib.crc32(",".join(map(str, chunk_numels)).encode())


def _described_chunks(rows: list, layout: Optional[QuantLayout]) -> str:
    """Where the ranks' chunk sizes differ (and nothing else tells it): this rank's sizes,
    for the agreement's error message; else nothing."""
    if len({row[-1] for row in rows}) == 1:
        return ""
    mine = "none (its arguments failed)" if layout is None else list(layout.chunk_numels)
    return f"; the sizes of the chunks differ between ranks, this rank's being {mine}"


def _check_groups(what: str, **groups) -> None:
    """Each group a ProcessGroup holding this rank (or None where allowed), else a clear
    TypeError / ValueError naming ``what(argument=...)`` before anything is sent. Local."""
    for argument, group in groups.items():
        skdist.check_group(group, what, argument)
        skdist.check_member(group, what, argument)


def quantized_all_gather(output: Union[torch.Tensor, Sequence[torch.Tensor]],
                         shard: torch.Tensor, group=None, *, bits: int = 8,
                         block: int = DEFAULT_BLOCK, scale_dtype: torch.dtype = torch.float32,
                         chunk_numels: Optional[Sequence[int]] = None,
                         async_op: bool = False, check_ranks: bool = True):
    """All-gather every rank's ``shard`` as int8 (or int4) blocks plus scales (qwZ) and
    dequantize into ``output``.

    Args:
        output: one tensor of ``world_size x shard.numel()`` elements (filled rank-major, as
            ``all_gather_into_tensor`` would), or the per-parameter tensors of the rank-major
            layout (then ``chunk_numels``, summing to ``shard.numel()``, says how the shard is
            cut; padding is dropped). Any of fp32 / bf16 / fp16: the compute dtype.
        shard: this rank's flat shard (fp32 / bf16 / fp16; the master copy stays untouched).
        bits, block, scale_dtype: the quantization (see :mod:`shardkit.kernels.quantize`).
        async_op: return a :class:`PendingQuantized` instead of waiting.
        check_ranks: first agree with every rank on the quantization and sizes (see below);
            ``False`` for a caller whose arguments every rank derives alike.

    Before it (``check_ranks``), one all-gather of 16 int64s a rank (not counted) compares
    every rank's call: arguments that fail on one rank, or sizes, bits, block or scale dtype
    that differ between ranks, raise a ValueError on every rank before anything is sent.
    Wire per rank: ``(N-1)/N x N x segment bytes`` of uint8 (one all-gather), about
    ``bits/32 + 1/B`` of the fp32 all-gather. Memory: the quantized shard and the gathered
    quantized buffer (``N x segment bytes``) until dequantized; no full-precision temporary on
    Triton. Returns ``output`` (a tensor) or ``None`` (a list), or the pending handle.
    """
    _check_groups("quantized_all_gather", group=group)
    outs = _as_list(output)
    n = skdist.get_world_size(group)
    flat_shard = shard.reshape(-1)
    full = _agreed_layout("quantized_all_gather",
                          lambda: _gather_layout(outs, flat_shard, shard, n, bits, block,
                                                 scale_dtype, chunk_numels),
                          [group], None, check_ranks)
    own = QuantLayout(1, (flat_shard.numel(),), bits, block, scale_dtype)
    send = quantize_pack([flat_shard], own, check_finite=False)
    received = torch.empty(full.total_bytes, dtype=torch.uint8, device=send.device)
    work = skdist.all_gather_into_tensor(received, send, group=group, async_op=True)

    def finish():
        dequantize_unpack(received, full, outs)
        return output if isinstance(output, torch.Tensor) else None

    pending = PendingQuantized(work, finish)
    return pending if async_op else pending.wait()


def _gather_layout(outs: list, flat_shard: torch.Tensor, shard: torch.Tensor, n: int, bits: int,
                   block: int, scale_dtype: torch.dtype,
                   chunk_numels: Optional[Sequence[int]]) -> QuantLayout:
    """:func:`quantized_all_gather`'s layout for ``n`` ranks, once its arguments are checked
    (a ValueError naming the one that does not fit). Local."""
    if chunk_numels is None:
        if len(outs) != 1 or outs[0].numel() != n * flat_shard.numel():
            raise ValueError(f"quantized_all_gather: output holds "
                             f"{[t.numel() for t in outs]} elements; without chunk_numels it "
                             f"must be one tensor of world size {n} x shard's "
                             f"{flat_shard.numel()} = {n * flat_shard.numel()}")
        chunks = [flat_shard.numel()]
    elif not outs:
        raise ValueError("quantized_all_gather: output is an empty list")
    else:
        chunks = [int(c) for c in chunk_numels]
        if sum(chunks) != flat_shard.numel():
            raise ValueError(f"quantized_all_gather: chunk_numels sum to {sum(chunks)}; the "
                             f"shard has {flat_shard.numel()} elements")
    for i, t in enumerate(outs):
        if t.dtype != outs[0].dtype or t.dtype not in _VALUE_DTYPES or t.device != shard.device:
            raise ValueError(f"quantized_all_gather: output[{i}] is {t.dtype} on {t.device}; "
                             f"all outputs must share one of {list(_VALUE_DTYPES)} and the "
                             f"shard's device {shard.device}")
    return quant_layout([t.numel() for t in outs], n, bits=bits, block=block,
                        scale_dtype=scale_dtype, chunk_numels=chunks)


def quantized_reduce_scatter(tensors: Union[torch.Tensor, Sequence[torch.Tensor]], group=None,
                             *, bits: int = 4, block: int = DEFAULT_BLOCK,
                             scale_dtype: torch.dtype = torch.float32,
                             chunk_numels: Optional[Sequence[int]] = None, op: str = "sum",
                             out: Optional[torch.Tensor] = None, async_op: bool = False,
                             check_ranks: bool = True):
    """Reduce-scatter with quantized transfers (qgZ, one level): each peer's segment is
    quantized and sent to it, every received segment is dequantized and summed in fp32 with
    this rank's own segment, which never leaves the rank and stays exact.

    Args:
        tensors: the gradients (one dtype: fp32 / bf16 / fp16), or one flat rank-major buffer of
            ``N x S`` elements (e.g. what ``pack_rank_major`` returns).
        bits: 4 (ZeRO++'s qgZ) or 8. block, scale_dtype: see :mod:`shardkit.kernels.quantize`.
        chunk_numels: elements per rank of each tensor (default ``ceil(numel / N)``).
        op: ``"sum"`` or ``"mean"`` (divide by ``N`` after the fp32 sum).
        out: fp32 (or bf16 / fp16) tensor of ``S = sum(chunk_numels)`` elements for the result.
        async_op: return a :class:`PendingQuantized` instead of waiting.
        check_ranks: first agree with every rank on the call, as
            :func:`quantized_all_gather` does (``op`` too).

    Returns this rank's reduced shard (``S`` elements; chunk ``rank`` of every tensor, side by
    side, as in ``reduce_scatter_tensor`` of the packed buffer). Wire per rank: ``(N-1) x
    segment bytes`` of uint8 (what an all-to-all of the quantized buffer moves), recorded as one
    ``all_to_all``. Memory: two quantized buffers of ``N-1`` segments, one fp32 segment and the
    result. Error: within the sum of the other ``N-1`` ranks' half scales.
    """
    _check_groups("quantized_reduce_scatter", group=group)
    n = skdist.get_world_size(group)
    tensors, layout = _agreed_reduce_layout("quantized_reduce_scatter", tensors, n, [group],
                                            bits=bits, block=block, scale_dtype=scale_dtype,
                                            chunk_numels=chunk_numels, op=op,
                                            check_ranks=check_ranks)
    out = _result_buffer(out, layout.segment_numel, tensors[0].device)
    works, finish = issue_reduce_scatter(tensors, layout, group,
                                         multiplier=1.0 / n if op == "mean" else 1.0, out=out)
    pending = PendingQuantized(works, finish)
    return pending if async_op else pending.wait()


def _agreed_reduce_layout(what: str, tensors, n: int, groups: Sequence, *, bits: int,
                          block: int, scale_dtype: torch.dtype,
                          chunk_numels: Optional[Sequence[int]], op: str,
                          check_ranks: bool) -> tuple:
    """``(tensors as a list, their QuantLayout for n ranks)`` for a quantized reduce-scatter,
    its arguments checked here and agreed on by every rank of ``groups`` (see
    :func:`_agreed_layout`)."""
    listed: list = []

    def build() -> QuantLayout:
        _check_op(op)
        listed.extend(_checked_tensors(what, tensors))
        return quant_layout([t.numel() for t in listed], n, bits=bits, block=block,
                            scale_dtype=scale_dtype, chunk_numels=chunk_numels)
    layout = _agreed_layout(what, build, groups, op, check_ranks)
    return listed, layout


def issue_reduce_scatter(tensors: Sequence[torch.Tensor], layout: QuantLayout, group, *,
                         multiplier: float = 1.0, out: Optional[torch.Tensor] = None,
                         counted_as: str = "all_to_all"):
    """The one-level qgZ exchange, issued: returns ``(works, finish)``; ``finish()`` (after the
    works are waited for) returns ``multiplier x`` the fp32 sum of this rank's segment over the
    ranks (in ``out`` when given). ``layout`` cuts ``tensors`` for the group's ``N`` ranks.

    Only the ``N-1`` peers' segments are quantized (straight from ``tensors``, the rank-major
    packing fused into the quantization) and sent, one message to each peer: this rank's own
    segment is added exactly, so half of the quantize and dequantize work disappears at
    ``N = 2`` and the error bound loses one term. Recorded once as ``counted_as`` with the bytes
    sent. Callers check the arguments (see :func:`quantized_reduce_scatter`)."""
    n, rank = skdist.get_world_size(group), skdist.get_rank(group)
    chunks = layout.chunk_numels
    one = QuantLayout(1, chunks, layout.bits, layout.block, layout.scale_dtype)
    peers = [r for r in range(n) if r != rank]
    size = one.total_bytes
    device = tensors[0].device
    # the tag and the debug mode's shape carry the layout: ranks that disagree on it wait for
    # the group's timeout (or are named by SHARDKIT_DEBUG_COLLECTIVES=1) instead of one
    # dequantizing the other's shorter message and its uninitialised rest, and gloo aborting
    # the other on a longer one
    code = ("qgZ", layout.bits, layout.block, tuple(chunks))
    tag = operation_tag(counted_as, torch.uint8, (n * size,), code)
    send = torch.empty(len(peers) * size, dtype=torch.uint8, device=device)
    received = torch.empty_like(send)
    ops = []
    for k, r in enumerate(peers):
        piece = slice(k * size, (k + 1) * size)
        quantize_pack(_chunks_of_rank(tensors, chunks, r), one, out=send[piece],
                      check_finite=False)
        peer = skdist.get_global_rank(group, r)
        ops += [skdist.P2POp("send", send[piece], peer, group, tag),
                skdist.P2POp("recv", received[piece], peer, group, tag)]
    with collective_check.checking_layout(code):
        works = skdist.batch_isend_irecv(ops, counted_as=counted_as, logical_shape=(n * size,))

    def finish() -> torch.Tensor:
        if peers:
            total = dequantize_sum(received, QuantLayout(len(peers), chunks, layout.bits,
                                                         layout.block, layout.scale_dtype),
                                   sources=len(peers))
        else:
            total = torch.zeros(one.segment_numel, dtype=torch.float32,
                                device=device)  # fp32, as dequantize_sum gives it
        offset = 0
        for own, c in zip(_chunks_of_rank(tensors, chunks, rank), chunks):
            total[offset:offset + own.numel()].add_(own)
            offset += c
        if multiplier != 1.0:
            total.mul_(multiplier)
        if out is None:
            return total
        return out.copy_(total)
    return works, finish


def _chunks_of_rank(tensors: Sequence[torch.Tensor], chunks: Sequence[int],
                    rank: int) -> list[torch.Tensor]:
    """Chunk ``rank`` of every (flattened) tensor (see :func:`chunk_of_rank`)."""
    return [chunk_of_rank(t.reshape(-1), rank, c) for t, c in zip(tensors, chunks)]


def _result_buffer(out: Optional[torch.Tensor], numel: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if (out.numel() != numel or not out.is_contiguous() or out.dtype not in _VALUE_DTYPES
            or out.device != device):
        raise ValueError(f"out is a {tuple(out.shape)} {out.dtype} tensor on {out.device} "
                         f"(contiguous: {out.is_contiguous()}); the reduced shard needs {numel} "
                         f"contiguous elements of one of {list(_VALUE_DTYPES)} on {device}")
    return out


def quantized_reduce_scatter_hierarchical(tensors: Union[torch.Tensor, Sequence[torch.Tensor]],
                                          intra_group, inter_group, *, bits: int = 4,
                                          block: int = DEFAULT_BLOCK,
                                          scale_dtype: torch.dtype = torch.float32,
                                          chunk_numels: Optional[Sequence[int]] = None,
                                          op: str = "sum",
                                          out: Optional[torch.Tensor] = None,
                                          group=None, check_ranks: bool = True
                                          ) -> torch.Tensor:
    """ZeRO++'s hierarchical qgZ over ``n`` ranks per node (``intra_group``) and ``k`` nodes
    (``inter_group``: the ranks of the same local index on every node).

    Quantize -> all-to-all inside the node -> dequantize and sum in fp32 (now each rank holds
    its node's partial sums for the ``k`` ranks of its local index) -> requantize -> all-to-all
    across nodes -> dequantize and sum (and divide by ``N = n k`` for ``op="mean"``).

    The values are cut for the ``N`` ranks of ``group`` (default: the default group) in its
    rank order, as ``reduce_scatter_tensor`` would cut them, and this rank gets its own segment
    whatever order the launcher numbered the ranks in: when the gathered node layout (see
    :func:`shardkit.distributed.ranks_by_node`) puts ``group``'s ranks on ``k`` nodes of ``n``,
    the groups must be those nodes and their columns (what :func:`node_groups` returns), and
    the segments are sent in that order (one extra copy of the quantized send buffer when the
    numbering is not node-major). Otherwise the groups define the nodes and the numbering is
    taken as node-major: this rank gets segment ``inter_rank * n + intra_rank``.
    With one node (``k = 1``) or one rank per node (``n = 1``) it is one all-to-all, exactly
    :func:`quantized_reduce_scatter` over the other group.

    Wire per rank: ``(n-1)/n x N x segment bytes`` inside the node and ``(k-1)/k x k x segment
    bytes`` across nodes (``N/n = k`` times less than a flat quantized all-to-all would put on
    the inter-node links). Error: within the sum of every rank's half scale plus, per node, the
    half scale of the requantized partial sum (at most about twice the flat bound).
    Memory: the quantized buffers (``N x segment bytes``, twice) and ``k x S`` fp32 partials.
    Before it (``check_ranks``), one all-gather of 16 int64s a rank inside the node, then one
    across nodes (not counted), compare every rank's call as :func:`quantized_reduce_scatter`
    does. Returns this rank's reduced shard (``S`` elements, ``out`` if given).
    """
    what = "quantized_reduce_scatter_hierarchical"
    _check_groups(what, intra_group=intra_group, inter_group=inter_group, group=group)
    order = _agreed_send_order(intra_group, inter_group, group)
    n, k = skdist.get_world_size(intra_group), skdist.get_world_size(inter_group)
    world = n * k
    tensors, layout = _agreed_reduce_layout(what, tensors, world, [intra_group, inter_group],
                                            bits=bits, block=block, scale_dtype=scale_dtype,
                                            chunk_numels=chunk_numels, op=op,
                                            check_ranks=check_ranks)
    if k == 1 or n == 1:
        return quantized_reduce_scatter(tensors, intra_group if k == 1 else inter_group,
                                        bits=bits, block=block, scale_dtype=scale_dtype,
                                        op=op, out=out, chunk_numels=chunk_numels,
                                        check_ranks=False)
    out = _result_buffer(out, layout.segment_numel, tensors[0].device)
    send = pack_for_nodes(tensors, layout, n, order)
    received = torch.empty_like(send)
    skdist.all_to_all_single(received, send, group=intra_group)
    partials = dequantize_sum(received, layout, sources=n)  # k x S, fp32
    del send, received
    across = QuantLayout(k, (layout.segment_numel,), bits, block, scale_dtype)
    send = quantize_pack([partials], across, check_finite=False)
    received = torch.empty_like(send)
    skdist.all_to_all_single(received, send, group=inter_group)
    return dequantize_sum(received, across, sources=k,
                          multiplier=1.0 / world if op == "mean" else 1.0, out=out)


def _agreed_send_order(intra_group, inter_group, group) -> Optional[list[int]]:
    """The checks of the groups (:func:`_check_orthogonal`, :func:`_order_of_given_groups`) on
    every rank of ``group`` (the ranks the values are cut for; ``None``: the world), agreed the
    first time a pair of groups is used, and the send order they give: a rank given wrong
    groups raises its own error and the others a ValueError quoting it, instead of waiting in
    the first all-to-all for a rank that left. Collective over ``group`` once per pair (one
    small object all-gather, a control message ``CommCounter`` does not count); a dictionary
    lookup after."""
    # nodes gathered later (the world's, or the group's by node_groups(group=...)) may change
    # the order
    nodes_known = skdist.node_layout_known() or (group is not None and skdist.group_ranks_by_node(
        skdist.group_ranks(group), group, gather=False) is not None)
    key = (id(intra_group), id(inter_group), id(skdist.resolved_group(group)), nodes_known)
    agreed = _AGREED_GROUP_PAIRS.current()
    held = agreed.get(key)
    if held is not None and held[0] is intra_group and held[1] is inter_group:
        return held[2]
    refusal = order = None
    try:
        _check_orthogonal(intra_group, inter_group)
        if skdist.get_world_size(intra_group) > 1 and skdist.get_world_size(inter_group) > 1:
            order = _order_of_given_groups(intra_group, inter_group, group)
    except ValueError as error:
        refusal = error
    verdicts = skdist.all_gather_object(None if refusal is None else str(refusal), group=group,
                                        counted=False, operation="the groups' check")
    if refusal is not None:
        raise refusal
    other = next((v for v in verdicts if v is not None), None)
    if other is not None:
        what = "quantized_reduce_scatter_hierarchical: "
        raise ValueError(f"{what}another rank refused its groups, so no rank sends: "
                         f"{other.removeprefix(what)}")
    agreed[key] = (intra_group, inter_group, order, skdist.resolved_group(group))
    return order


def _check_orthogonal(intra_group, inter_group) -> None:
    """``intra_group`` and ``inter_group`` must cross at this rank only (a node and the column
    of this rank's local index), and their ``n x k`` ranks fit in the world; else a ValueError
    naming the groups, before anything is sent. Other groups (the world as ``inter_group``, two
    overlapping nodes) cut the values for ``n x k`` ranks that do not exist and gave every
    rank a wrong sum of the wrong size, silently. Local."""
    me = skdist.get_rank()
    intra, inter = skdist.group_ranks(intra_group), skdist.group_ranks(inter_group)
    world = skdist.get_world_size()
    shared = sorted(set(intra) & set(inter))
    if shared != [me] or len(intra) * len(inter) > world:
        raise ValueError(f"quantized_reduce_scatter_hierarchical: on rank {me} intra_group holds "
                         f"ranks {intra} and inter_group {inter}; they must share only this "
                         f"rank (shared: {shared}) and hold n x k <= {world} ranks of the world "
                         f"(here {len(intra)} x {len(inter)}): a node's ranks and the ranks of "
                         f"this rank's local index on every node, as "
                         f"shardkit.quantized_comm.node_groups() returns them")


def node_send_order(members: Sequence[Sequence[int]],
                    ranks: Sequence[int]) -> Optional[list[int]]:
    """Where each segment goes in the send buffer of the hierarchical reduce over the nodes
    ``members`` (global ranks, ascending, ``k`` nodes of ``n``) of the group whose global ranks
    are ``ranks`` (in group-rank order): slot ``j * k + q`` holds the segment of the rank with
    node-local index ``j`` that is rank ``q`` of its cross-node group. Returns, per slot, the
    group rank of that segment; ``None`` where this is the node-major order that
    ``quantize_pack(node_size=n)`` writes directly. Local; no communication."""
    n, k = len(members[0]), len(members)
    index = {rank: i for i, rank in enumerate(ranks)}
    order = []
    for local in range(n):
        order += [index[rank] for rank in sorted(node[local] for node in members)]
    if all(slot == (r % n) * k + r // n for r, slot in
           sorted((r, slot) for slot, r in enumerate(order))):
        return None
    return order


def pack_for_nodes(tensors: Sequence[torch.Tensor], layout: QuantLayout, per_node: int,
                   order: Optional[list[int]]) -> torch.Tensor:
    """Quantize ``tensors`` (rank-major for ``layout.world_size`` ranks) into the send buffer of
    the hierarchical reduce: the kernel's node-major slots when ``order`` is ``None``, else the
    slots of :func:`node_send_order` (one more copy of the quantized buffer). No
    communication."""
    if order is None:
        return quantize_pack(tensors, layout, node_size=per_node, check_finite=False)
    packed = quantize_pack(tensors, layout, check_finite=False)
    slots = torch.tensor(order, device=packed.device)
    return packed.view(layout.world_size, layout.segment_bytes).index_select(0, slots).reshape(-1)


def _order_of_given_groups(intra_group, inter_group, group) -> Optional[list[int]]:
    """:func:`node_send_order` for :func:`quantized_reduce_scatter_hierarchical`: from the
    gathered layout when it puts ``group``'s ranks on as many equal nodes as the groups say
    (then the groups must be those nodes), else node-major (``None``). Local; raises
    ValueError before anything is sent."""
    intra, inter = skdist.group_ranks(intra_group), skdist.group_ranks(inter_group)
    n, k = len(intra), len(inter)
    ranks = (skdist.group_ranks(group) if group is not None
             else list(range(skdist.get_world_size())))
    if len(ranks) != n * k:
        if group is not None:
            raise ValueError(f"quantized_reduce_scatter_hierarchical: group holds "
                             f"{len(ranks)} ranks, but intra_group x inter_group hold {n} x "
                             f"{k}; group is the group the values are cut for")
        return None  # a part of the world: the groups define the nodes, node-major
    members = skdist.group_ranks_by_node(ranks, group, gather=False)
    if members is None:  # nothing gathered (not by node_groups() either): node-major
        return None
    if len(members) != k or any(len(node) != n for node in members):
        return None  # the groups are nodes of their own (e.g. labelled on one host)
    me = skdist.get_rank()
    mine = next(node for node in members if me in node)
    column = sorted(node[mine.index(me)] for node in members)
    if intra != mine or inter != column:
        raise ValueError(f"quantized_reduce_scatter_hierarchical: intra_group holds ranks "
                         f"{intra} and inter_group {inter}, but rank {me} runs on a node with "
                         f"ranks {mine} (GROUP_RANK, or the host name), across nodes {column}; "
                         f"pass the groups of shardkit.quantized_comm.node_groups()")
    return node_send_order(members, ranks)


def wire_bytes(numel_per_rank: int, group_size: int, *, bits: int, block: int = DEFAULT_BLOCK,
               scale_dtype: torch.dtype = torch.float32) -> float:
    """Bytes one rank puts on the wire (CommCounter's convention) for one quantized all-gather
    or one flat quantized reduce-scatter of ``group_size`` segments of ``numel_per_rank``
    elements: ``(n-1)/n x n x segment bytes``. For the planner and for tests."""
    layout = QuantLayout(group_size, (numel_per_rank,), bits, block, scale_dtype)
    return (group_size - 1) / group_size * layout.total_bytes


def hierarchical_wire_bytes(numel_per_rank: int, ranks_per_node: int, nodes: int, *, bits: int,
                            block: int = DEFAULT_BLOCK,
                            scale_dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """``(inside the node, across nodes)`` bytes one rank puts on the wire (CommCounter's
    convention) for :func:`quantized_reduce_scatter_hierarchical` with ``n = ranks_per_node``
    and ``k = nodes``: ``(n-1)/n x n k x segment bytes`` and ``(k-1)/k x k x segment bytes``."""
    n, k = ranks_per_node, nodes
    if k == 1 or n == 1:
        flat = wire_bytes(numel_per_rank, n * k, bits=bits, block=block, scale_dtype=scale_dtype)
        return (flat, 0.0) if k == 1 else (0.0, flat)
    segment = QuantLayout(1, (numel_per_rank,), bits, block, scale_dtype).segment_bytes
    return (n - 1) / n * n * k * segment, (k - 1) / k * k * segment


def node_groups(ranks_per_node: Optional[int] = None, group=None):
    """This rank's ``(intra_group, inter_group)`` for the hierarchical reduce over the ranks of
    ``group`` (default: all): ``intra_group`` holds the ranks on this rank's node,
    ``inter_group`` the ranks with this rank's local index on every node.

    Nodes are where the ranks really run (their ``GROUP_RANK`` or host, gathered by
    :func:`shardkit.distributed.init_distributed`), whatever order the launcher numbered them
    in; an explicit ``ranks_per_node`` instead cuts the ranks into consecutive blocks of that
    many (node-major numbering taken as given). Over the world it creates ``k + n`` process
    groups (``k`` nodes of ``n``) on every rank; over a sub-group (each rank passing its own
    data-parallel group, several side by side) each member creates its own node's and column's
    groups with the other members, after one small object all-gather over ``group``, and a rank
    outside ``group`` gets ``(None, None)``. No tensor traffic (and one small object all-gather
    over ``group`` the first time if the layout was not gathered yet).

    Raises ValueError, on every rank and before any group is created, when ``ranks_per_node``
    does not divide the group or the group's ranks sit on nodes of unequal sizes.

    .. warning:: a collective: call it on every rank of ``group`` (default: the world), once
       (groups are costly).
    """
    ranks = skdist.group_ranks(group) if group is not None else list(
        range(skdist.get_world_size()))
    if ranks_per_node is None:
        members = skdist.group_ranks_by_node(ranks, group)
        skdist.check_equal_nodes(members, "node_groups")
        return _create_node_groups(members, ranks, group, None)
    if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
            or ranks_per_node < 1 or len(ranks) % ranks_per_node):
        raise ValueError(f"node_groups: ranks_per_node={ranks_per_node!r}; it must be a "
                         f"positive divisor of the group's {len(ranks)} ranks, or None (the "
                         f"nodes the ranks run on)")
    members = [ranks[i:i + ranks_per_node] for i in range(0, len(ranks), ranks_per_node)]
    return _create_node_groups(members, ranks, group, ranks_per_node)


def _create_node_groups(members: list, ranks: list, group, per_node: Optional[int]) -> tuple:
    """This rank's ``(intra, inter)`` process groups over the nodes ``members`` (global ranks,
    equal sizes) of ``group``, whose global ranks are ``ranks``; ``per_node``: the caller's
    ``ranks_per_node`` (``None``: the nodes the ranks run on). ``(None, None)`` on a rank
    outside ``group``.

    Over the whole world every rank creates every node's and every column's group (as torch's
    ``new_group`` requires). Over a sub-group (several data-parallel groups side by side, each
    rank building over its own) each rank creates only its own node's group, then its own
    column's, among their members, once the sub-group's ranks agree on their count of
    registered groups (torch names such a group from its ranks and that count); creating the
    sub-group's groups as if for the world paired different ranks' ``new_group`` calls, and
    the ranks hung. Collective over ``group``; no tensor traffic."""
    if len(ranks) == skdist.get_world_size():
        return skdist.groups_of_nodes(ranks, None if per_node is None else len(members[0]))
    me = skdist.get_rank()
    if me not in ranks:  # the members create their groups among themselves
        return None, None
    node = next(node for node in members if me in node)
    column = sorted(other[node.index(me)] for other in members)
    intra, inter = skdist.new_groups_among_members([sorted(node), column], group)
    return intra, inter
