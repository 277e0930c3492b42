"""ZeRO++'s compressed communication as a :class:`~shardkit.transport.Transport` plugin.

:class:`QuantizedTransport` changes two operations of the transport interface and hands every
other one to an inner transport (the process group's own collectives by default):

* ``all_gather_chunks`` (FSDP's forward and backward weight gathers), **qwZ**: this rank's shard
  is quantized to int8 blocks with one fp32 scale per block, the uint8 buffer is all-gathered
  through the inner transport, and every rank's rows are dequantized into the output tensors
  (the compute dtype). Every rank, this one included, computes with the same dequantized
  weights; the fp32 master shard is never touched. With hpZ, FSDP's backward gather from the
  node's secondary partition (which holds those dequantized weights) goes through
  :meth:`lossless`, the inner transport, in the compute dtype: quantizing them again, in other
  blocks, would give backward other weights than the forward used.
* ``reduce_scatter`` / ``reduce_scatter_chunks`` (FSDP's gradient reduce-scatter), **qgZ**: each
  peer's segment of the rank-major gradients is quantized to int4 blocks (straight from the
  per-parameter gradients: no packed fp32 copy) and sent to it; each rank dequantizes what it
  receives and sums it in fp32 with its own segment, which never leaves the rank and stays
  exact. When the group spans several nodes (the nodes its ranks really run on, gathered by
  :func:`shardkit.distributed.init_distributed` from ``GROUP_RANK`` or the host name, whatever
  order the launcher numbered the ranks in; or consecutive blocks of an explicit
  ``ranks_per_node``) the reduction is hierarchical: all-to-all inside the node, dequantize
  and sum, requantize, all-to-all across nodes, dequantize and sum, so the inter-node links
  carry ``1/n`` of what a flat exchange would (``n`` ranks per node). ``reduce_scatter``
  returns the fp32 *sum* (the interface's contract); ``reduce_scatter_chunks`` multiplies that
  sum by the ``scale`` FSDP asks for (``1/N``).

``all_gather`` stays exact (delegated): FSDP uses it for master-weight gathers
(``state_dict``, ``summon_full_params``, optimizer-state gathers), which must be lossless.
``all_gather_segments``, ``reduce_to_owners``, ``broadcast``, ``all_reduce`` and
``all_to_all`` are delegated too, so OSS and ShardedDataParallel behave exactly as with the
inner transport.

Bytes per rank per operation (``N`` ranks, ``S`` elements per rank's segment, block ``B``,
``CommCounter`` records them as ``uint8``): ``(N-1) x ceil(S/B) x (B x bits/8 + 4)``, about
``(N-1) S (bits/8 + 4/B)``: 0.254x of fp32 for int8 and 0.129x for int4 at ``B = 256``. So an
FSDP step with ``reshard_after_forward=True`` (two gathers and one reduce-scatter per unit)
moves about ``(2 x 0.254 + 0.129) / 3 = 0.21x`` of the fp32 bytes with both on, ``0.50x`` with
qwZ only and ``0.71x`` with qgZ only (plus one block of padding per segment). Hierarchical
qgZ: ``(n-1) x k x segment bytes`` inside the node and ``(k-1) x segment bytes`` across nodes
(``k`` nodes).

Memory: the quantized send buffer and the gathered / exchanged quantized buffer of each
operation in flight (about 1/4 (int8) or 1/8 (int4) of the fp32 sizes), plus the fp32 result
of a reduce-scatter (and ``k x S`` fp32 partial sums when hierarchical, plus one more copy of
the quantized send buffer when the ranks are not numbered node by node). Nothing is held
between operations except the node groups (process groups, created once per group in
:meth:`QuantizedTransport.prepare`).

Error: each gathered weight is within half its block's scale (``absmax / 127``) of the exact
value; each reduced gradient within the sum of the other ranks' half scales (``absmax / 7 / 2``,
int4; flat exchange), about twice the sum over all ranks when hierarchical. Inf or nan values
are sent as a block that dequantizes to nan (a loss-scaled step sees the overflow and skips).

Small operations: each rank's segment is padded to whole blocks, so a segment of fewer than
about ``block`` elements sends more bytes quantized than exact; it still runs quantized, with a
one-time warning.

Where an operation cannot be quantized (values that are not fp32 / bf16 / fp16, e.g. fp64), or
the node layout does not allow the hierarchical reduction, the transport falls back (to the
inner transport, or to the flat exchange) and warns once per process and reason.
"""

from __future__ import annotations

import functools
import numbers
import os
from typing import Optional

import torch

from shardkit import distributed as skdist
from shardkit.kernels import (DEFAULT_BLOCK, QuantLayout, dequantize_sum, dequantize_unpack,
                              quant_layout, quantize_pack)
from shardkit.quantized_comm import (_create_node_groups, issue_reduce_scatter,
                                     node_send_order, pack_for_nodes)
from shardkit.transport import (CommHandle, Transport, exchange_equal_chunks,
                                resolve_transport, warn_once)

__all__ = ["QuantizedTransport", "quantized_transport_for"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (group ranks, its ranks by node) -> (intra, inter, order) or None
_NODE_GROUPS = skdist.GroupCache()
_SHARED: dict = {}  # see quantized_transport_for


def _warn_if_no_saving(op: str, layout: QuantLayout, dtype: torch.dtype) -> None:
    """Each segment is padded to whole blocks, each block adds a scale: a tiny unit's quantized
    bytes can exceed its exact ones. It still runs quantized (the same path on every size);
    this says so once per process and operation."""
    if layout.ratio(dtype) > 1.0:
        warn_once(f"no-saving-{op}", f"QuantizedTransport: a quantized {op} of "
                  f"{layout.segment_numel} {dtype} elements per rank sends "
                  f"{layout.ratio(dtype):.2f}x the bytes of the exact values (segments are "
                  f"padded to whole blocks of {layout.block}, plus one scale per block); "
                  f"units this small gain nothing from quantization")


def _check_bits(name: str, value, valid) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in valid:
        raise ValueError(f"QuantizedTransport({name}={value!r}): valid values are {list(valid)}")
    return int(value)  # numpy integers too (a numpy array's element, a config parsed by numpy)


def _check_block(block) -> int:
    """``QuantizedTransport(block=...)``: elements per scale, a power of two from 8 to 8192
    (what :class:`~shardkit.kernels.QuantLayout` accepts). Local, no communication."""
    if isinstance(block, bool) or not isinstance(block, int) or not 8 <= block <= 8192 \
            or block & (block - 1):
        raise ValueError(f"QuantizedTransport(block={block!r}): valid values are the powers of "
                         f"two from 8 to 8192 (elements per fp32 scale; default {DEFAULT_BLOCK})")
    return block


class QuantizedTransport(Transport):
    """Quantized weight all-gather (qwZ) and gradient reduce-scatter (qgZ) over ``inner``.

    Args:
        inner: the transport that carries the bytes of the all-gathers and every delegated
            operation (default: a :class:`~shardkit.transport.ProcessGroupTransport`). The qgZ
            all-to-alls use the process group's own collective.
        weights: quantize ``all_gather_chunks`` (qwZ). gradients: quantize ``reduce_scatter``
            (qgZ). At least one must be true.
        weight_bits: 8 (ZeRO++) or 4. gradient_bits: 4 (ZeRO++) or 8.
        block: elements per scale (a power of two from 8 to 8192).
        ranks_per_node: ``None`` (default): the nodes the ranks really run on (the layout
            :func:`shardkit.distributed.init_distributed` gathers; without it, one node unless
            ``LOCAL_WORLD_SIZE`` is set, and then :meth:`prepare` gathers it). An int: nodes of
            that many consecutive global ranks. A group whose ranks lie on more than one
            node, with the same number on each, reduces hierarchically.

    Memory and communication: see the module docstring. Stateless between operations apart
    from the node groups, which :meth:`prepare` creates once per process group (a collective:
    every rank of the group calls it, as every wrapper does at construction).
    """

    name = "quantized"

    def __init__(self, inner: Optional[Transport] = None, *, weights: bool = True,
                 gradients: bool = True, weight_bits: int = 8, gradient_bits: int = 4,
                 block: int = DEFAULT_BLOCK, ranks_per_node: Optional[int] = None):
        if inner is not None and isinstance(inner, QuantizedTransport):
            raise ValueError("QuantizedTransport(inner=...): the inner transport is already a "
                             "QuantizedTransport; quantizing twice is never wanted")
        self.inner = resolve_transport(inner, "QuantizedTransport")
        for name, value in (("weights", weights), ("gradients", gradients)):
            if not isinstance(value, bool):
                raise ValueError(f"QuantizedTransport({name}={value!r}): must be True or False")
        if not (weights or gradients):
            raise ValueError("QuantizedTransport(weights=False, gradients=False): nothing to "
                             "quantize; use the inner transport itself")
        self.weights, self.gradients = weights, gradients
        self.weight_bits = _check_bits("weight_bits", weight_bits, (8, 4))
        self.gradient_bits = _check_bits("gradient_bits", gradient_bits, (4, 8))
        self.block = _check_block(block)
        if ranks_per_node is not None and (isinstance(ranks_per_node, bool)
                                           or not isinstance(ranks_per_node, int)
                                           or ranks_per_node < 1):
            raise ValueError(f"QuantizedTransport(ranks_per_node={ranks_per_node!r}): must be "
                             f"a positive int (consecutive ranks on each node) or None (the "
                             f"nodes the ranks run on)")
        self.ranks_per_node = ranks_per_node
        # the global ranks of each prepared group -> its ranks by node (None: one node), as
        # prepare() found them: the steps look the node groups up by these
        self._prepared_nodes: dict = {}

    # ------------------------------------------------------------------ set-up

    def prepare(self, group) -> None:
        """The inner transport's set-up, and the node groups of ``group`` when qgZ reduces
        hierarchically (once per group per process: for the world ``k + n`` process groups on
        every rank; for a sub-group this rank's node and column, created by their members after
        one small object all-gather over ``group``; the first time it may gather the nodes of
        ``group``'s ranks over ``group``, see
        :func:`shardkit.distributed.group_ranks_by_node`). Collective over ``group``."""
        self.inner.prepare(group)
        if self.gradients:
            self._node_groups(group, create=True)

    def _nodes(self, ranks: list, create: bool, group=None) -> Optional[list]:
        """The global ``ranks`` (those of ``group``) by node (see ``ranks_per_node``), or
        ``None``: one node, and nothing to gather (no layout, no ``LOCAL_WORLD_SIZE``). Without
        a gathered layout the nodes are gathered over ``group`` only (``create``: in
        :meth:`prepare`), not over the world, whose other data-parallel groups may be busy."""
        rpn = self.ranks_per_node
        if rpn is not None:
            by_node: dict = {}
            for rank in ranks:
                by_node.setdefault(rank // rpn, []).append(rank)
            return list(by_node.values())
        if not skdist.node_layout_known() and not os.environ.get("LOCAL_WORLD_SIZE"):
            return None
        nodes = skdist.group_ranks_by_node(ranks, group, gather=create)
        if nodes is None:
            raise RuntimeError("QuantizedTransport: prepare(group) was not called for this "
                               "process group; every wrapper calls it at construction")
        return nodes

    def _nodes_as_prepared(self, ranks: list, create: bool, group) -> Optional[list]:
        """:meth:`_nodes` as :meth:`prepare` found them for these ``ranks`` (``create``: find
        them now). Not worked out again at the steps: a node layout gathered after the wrapper
        was built (a world-wide ``node_groups()``) may group the ranks otherwise (without
        ``LOCAL_WORLD_SIZE`` nothing was gathered, one node; on one host without GROUP_RANK,
        ``LOCAL_WORLD_SIZE`` blocks), and the node groups made for the old grouping would no
        longer be found."""
        key = tuple(ranks)
        if create or key not in self._prepared_nodes:
            members = self._nodes(ranks, create, group)
            if create:
                self._prepared_nodes[key] = members
            return members
        return self._prepared_nodes[key]

    def _node_groups(self, group, create: bool = False):
        """``(intra, inter, send order)`` for ``group`` (see
        :func:`~shardkit.quantized_comm.node_send_order`), or ``None`` where the reduction is
        flat."""
        n_ranks = skdist.get_world_size(group)
        if n_ranks == 1:
            return None
        ranks = skdist.group_ranks(group) if group is not None else list(range(n_ranks))
        members = self._nodes_as_prepared(ranks, create, group)
        if members is None:
            return None
        key = (tuple(ranks), tuple(tuple(node) for node in members))
        cached = _NODE_GROUPS.current()
        if key in cached:
            return cached[key]
        if not create:
            raise RuntimeError("QuantizedTransport: prepare(group) was not called for this "
                               "process group; every wrapper calls it at construction")
        result = None
        if len({len(node) for node in members}) > 1:
            # the same layout on every rank: every rank warns and falls back alike
            source = (f"ranks_per_node={self.ranks_per_node}" if self.ranks_per_node
                      else "nodes from GROUP_RANK or the host name")
            warn_once(f"layout{key}", f"QuantizedTransport: the group's ranks sit on nodes of "
                      f"unequal sizes ({members}; {source}); qgZ falls back to one flat "
                      f"all-to-all over the group")
        elif len(members) > 1 and len(members[0]) > 1:  # one rank per node: flat is inter-node
            intra, inter = _create_node_groups(members, ranks, group, self.ranks_per_node)
            result = (intra, inter, node_send_order(members, ranks))
        cached[key] = result
        return result

    def describe(self, group=None) -> str:
        """What is quantized (bits; qgZ flat or hierarchical ``n x k``) and the block, over the
        inner transport's description. Local."""
        parts = []
        if self.weights:
            parts.append(f"qwZ int{self.weight_bits}")
        if self.gradients:
            try:
                groups = self._node_groups(group)
            except (RuntimeError, ValueError):  # not prepared, or no process group yet
                groups = None
            shape = "flat" if groups is None else (
                f"hierarchical {skdist.get_world_size(groups[0])} x "
                f"{skdist.get_world_size(groups[1])}")
            parts.append(f"qgZ int{self.gradient_bits} {shape}")
        return f"quantized ({', '.join(parts)}, block {self.block}) over " \
               f"{self.inner.describe(group)}"

    def footprint_tensors(self):
        """The inner transport's (this one holds no buffers between operations)."""
        return self.inner.footprint_tensors()

    def lossless(self) -> Transport:
        """The inner transport's lossless one (no quantization)."""
        return self.inner.lossless()

    def close(self) -> None:
        """Close the inner transport (the node groups stay, as process groups do)."""
        self.inner.close()

    # ------------------------------------------------------------------ qwZ

    def all_gather_chunks(self, fulls, chunks, group) -> CommHandle:
        """qwZ: quantize this rank's ``chunks`` (one int8 segment), all-gather the bytes through
        the inner transport, dequantize every rank's rows into ``fulls`` (cut at their ends).
        Wire: ``(N-1) x segment bytes`` of uint8. Exact (delegated) when ``weights`` is off,
        for one rank, or for non-float values (with a one-time warning)."""
        n = skdist.get_world_size(group)
        if not self.weights or n == 1 or not chunks:
            return self.inner.all_gather_chunks(fulls, chunks, group)
        dtypes = {t.dtype for t in list(fulls) + list(chunks)}
        if not dtypes <= set(_FLOAT_DTYPES) or len({t.dtype for t in fulls}) != 1:
            warn_once(f"gather{sorted(map(str, dtypes))}",
                      f"QuantizedTransport: all_gather_chunks of {sorted(map(str, dtypes))} "
                      f"values is not quantized (qwZ needs one of "
                      f"{[str(d) for d in _FLOAT_DTYPES]}); sent exactly by "
                      f"{self.inner.describe(group)}")
            return self.inner.all_gather_chunks(fulls, chunks, group)
        numels = [c.numel() for c in chunks]
        if sum(numels) == 0:
            return self.inner.all_gather_chunks(fulls, chunks, group)
        own = QuantLayout(1, tuple(numels), self.weight_bits, self.block)
        full = QuantLayout(n, tuple(numels), self.weight_bits, self.block)
        _warn_if_no_saving("all_gather", full, chunks[0].dtype)
        send = quantize_pack([c.reshape(-1) for c in chunks], own, check_finite=False)
        received = torch.empty(full.total_bytes, dtype=torch.uint8, device=send.device)
        handle = self.inner.all_gather(received, send, group)

        def finish():
            handle.wait()
            dequantize_unpack(received, full, list(fulls))
        return CommHandle((), finish)

    def all_gather(self, output, input, group) -> CommHandle:
        """Exact (delegated): FSDP gathers master weights with it for checkpoints."""
        return self.inner.all_gather(output, input, group)

    def all_gather_segments(self, output, sizes, group) -> CommHandle:
        """Exact (delegated): OSS's parameter sync."""
        return self.inner.all_gather_segments(output, sizes, group)

    # ------------------------------------------------------------------ qgZ

    def reduce_scatter(self, input, group) -> CommHandle:
        """qgZ: the fp32 sum over ranks of this rank's segment of the rank-major ``input``
        (``wait`` returns a new fp32 tensor of ``input.numel() / N`` elements; no division:
        FSDP pre-divides by ``N``). Int4 blocks through one all-to-all, or hierarchically
        (intra-node all-to-all issued now, the cross-node one inside ``wait``). Exact
        (delegated) when ``gradients`` is off, for one rank, or for non-float values (with a
        one-time warning)."""
        n = skdist.get_world_size(group)
        if not self.gradients or n == 1:
            return self.inner.reduce_scatter(input, group)
        if input.numel() % n:
            raise ValueError(f"reduce_scatter: input has {input.numel()} elements, not divisible "
                             f"by world size {n}")
        if input.dtype not in _FLOAT_DTYPES:
            warn_once(f"reduce{input.dtype}",
                      f"QuantizedTransport: reduce_scatter of {input.dtype} values is not "
                      f"quantized (qgZ needs one of {[str(d) for d in _FLOAT_DTYPES]}); "
                      f"reduced exactly by {self.inner.describe(group)}")
            return self.inner.reduce_scatter(input, group)
        segment = input.numel() // n
        if segment == 0:
            return self.inner.reduce_scatter(input, group)
        layout = QuantLayout(n, (segment,), self.gradient_bits, self.block)
        _warn_if_no_saving("reduce_scatter", layout, input.dtype)
        groups = self._node_groups(group)
        flat = input.reshape(-1)
        if groups is None:
            works, finish = issue_reduce_scatter([flat], layout, group,
                                                 counted_as="reduce_scatter")
            return self._exchange_handle(works, finish, "reduce_scatter", group)
        intra, inter, order = groups
        per_node, nodes = skdist.get_world_size(intra), skdist.get_world_size(inter)
        send = pack_for_nodes([flat], layout, per_node, order)
        # every rank derives the layout alike; the exchanges' tags carry it, so that ranks
        # that disagree on it wait for the timeout rather than read each other's bytes
        code = ("qgZ", self.gradient_bits, self.block, segment)
        inside = exchange_equal_chunks(torch.empty_like(send), send, intra,
                                       counted_as="reduce_scatter", layout=code)

        def across_nodes():
            partials = dequantize_sum(inside.wait(), layout, sources=per_node)  # nodes x S fp32
            across = QuantLayout(nodes, (segment,), self.gradient_bits, self.block)
            send2 = quantize_pack([partials], across, check_finite=False)
            received2 = exchange_equal_chunks(torch.empty_like(send2), send2, inter,
                                              counted_as="reduce_scatter", layout=code).wait()
            return dequantize_sum(received2, across, sources=nodes)
        return CommHandle((), across_nodes)

    def reduce_scatter_chunks(self, tensors, chunk_numels, group, *, scale=1.0, dtype=None):
        """qgZ straight from the gradients (FSDP's reduce-scatter): each peer's chunks are
        quantized from ``tensors`` (no packed fp32 copy), this rank's own chunks are summed in
        exactly, and ``scale`` is applied to the fp32 sum; ``wait`` returns that fp32 sum.
        Wire: ``(N-1) x segment bytes`` of uint8, as :meth:`reduce_scatter`. Where the
        reduction is hierarchical, not quantized, or the values are not one float dtype: the
        packed path (``pack_rank_major``, then :meth:`reduce_scatter`)."""
        n = skdist.get_world_size(group)
        dtypes = {t.dtype for t in tensors}
        if (not self.gradients or n == 1 or not tensors or len(dtypes) != 1
                or not dtypes <= set(_FLOAT_DTYPES) or self._node_groups(group) is not None):
            return super().reduce_scatter_chunks(tensors, chunk_numels, group, scale=scale,
                                                 dtype=dtype)
        layout = quant_layout([t.numel() for t in tensors], n, bits=self.gradient_bits,
                              block=self.block, chunk_numels=chunk_numels)
        if layout.segment_numel == 0:
            return super().reduce_scatter_chunks(tensors, chunk_numels, group, scale=scale,
                                                 dtype=dtype)
        _warn_if_no_saving("reduce_scatter", layout, tensors[0].dtype)
        works, finish = issue_reduce_scatter(list(tensors), layout, group, multiplier=scale,
                                             counted_as="reduce_scatter")
        return self._exchange_handle(works, finish, "reduce_scatter_chunks", group)

    def _exchange_handle(self, works, finish, name: str, group) -> CommHandle:
        """The handle of a qgZ exchange's sends and receives: a broken link or a timeout
        (ranks that disagree on the layout) raises CollectiveError naming ``name``."""
        handle = CommHandle(works, finish, completes_when_waited=True)
        handle.describe = functools.partial(skdist.operation_words, name, group,
                                            self.describe(group))
        return handle

    # ------------------------------------------------------------------ delegated, exact

    def reduce_to_owners(self, segments, group) -> CommHandle:
        """Exact (delegated): gradients reduced to their OSS owners (ShardedDataParallel,
        ``reduce_to_owners_hook``)."""
        return self.inner.reduce_to_owners(segments, group)

    def broadcast(self, tensor, src, group) -> CommHandle:
        """Exact (delegated)."""
        return self.inner.broadcast(tensor, src, group)

    def all_reduce(self, tensor, group, op=skdist.ReduceOp.SUM) -> CommHandle:
        """Exact (delegated): e.g. FSDP's all-reduce of the reduced shards over replicas."""
        return self.inner.all_reduce(tensor, group, op)

    def all_to_all(self, output, input, group) -> CommHandle:
        """Exact (delegated)."""
        return self.inner.all_to_all(output, input, group)


def quantized_transport_for(comm, weights: bool, gradients: bool,
                            what: str = "FullyShardedDataParallel") -> Transport:
    """The transport a wrapper uses for ``comm=`` plus ``quantize_weights`` /
    ``quantize_gradients``: ``comm`` itself (resolved) when both are off; else one shared
    :class:`QuantizedTransport` over ``comm`` per (``comm``, options), so the units of a model
    share it. ``comm`` that is already a :class:`QuantizedTransport` is an error when an option
    is on (set the options on that transport instead)."""
    for name, value in (("quantize_weights", weights), ("quantize_gradients", gradients)):
        if not isinstance(value, bool):
            raise ValueError(f"{what}({name}={value!r}): must be True or False")
    inner = resolve_transport(comm, what)
    if not (weights or gradients):
        return inner
    if isinstance(inner, QuantizedTransport):
        raise ValueError(f"{what}(comm={inner.describe()}, quantize_weights={weights}, "
                         f"quantize_gradients={gradients}): comm is already a "
                         f"QuantizedTransport; configure quantization on it, or pass a "
                         f"non-quantized comm with the quantize_* options")
    key = (id(inner), weights, gradients)  # the nodes are read per group, in prepare
    shared = _SHARED.get(key)
    if shared is None or shared.inner is not inner:
        shared = QuantizedTransport(inner, weights=weights, gradients=gradients)
        _SHARED[key] = shared
    return shared
