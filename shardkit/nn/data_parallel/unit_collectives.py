"""The two collectives of a FullyShardedDataParallel unit, behind one small interface.

:func:`all_gather_shards` fills a rank-major buffer with every rank's shard;
:func:`reduce_scatter_packed` sums a rank-major buffer over ranks and leaves this rank's
segment. Both are asynchronous and return a :class:`PendingCollective`. Everything goes through
:mod:`shardkit.distributed`, so ``CommCounter`` sees it.

Note: algorithm per device. On CUDA (NCCL) these are ``all_gather_into_tensor`` and
``reduce_scatter_tensor``. On CPU (gloo), measured here at world 2: gloo's all-gather takes 2-4x
longer than exchanging the same bytes point to point (12 MiB: 15.5 ms vs 5.8 ms; 32 MiB: 100 ms
vs 29 ms), and its reduce-scatter runs mostly synchronously in the calling thread and costs as
much as an all-reduce. So on CPU the gather is one batch of sends/receives (each rank sends its
shard to every peer: ``(N-1)`` shards, the ring all-gather's bytes), received straight into the
unit's full parameters (:func:`all_gather_into_params`: no scratch buffer, no unpacking copy),
and the reduce-scatter is one ``all_to_all_single`` (``(N-1)/N`` of the buffer, the ring
reduce-scatter's bytes) followed by a local sum of the ``N`` parts of this rank's segment.
When every rank of the group is on this machine, both go through a ring of host shared-memory
slots instead (:mod:`shardkit.shm_ring`: no socket copies or protocol work; counted as the same
collectives), see :func:`shared_memory_ring`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from shardkit import distributed as skdist
from shardkit import shm_ring

__all__ = ["PendingCollective", "all_gather_shards", "all_gather_into_params",
           "gathers_into_params", "reduce_scatter_packed", "shared_memory_ring"]


class PendingCollective:
    """Work handles of one issued collective; :meth:`wait` finishes it and returns its result."""

    def __init__(self, works: Sequence, finish: Callable[[], Optional[torch.Tensor]]):
        self._works = [w for w in works if w is not None]
        self._finish = finish

    def wait(self) -> Optional[torch.Tensor]:
        for work in self._works:
            work.wait()
        self._works = []
        return self._finish()


def _exchange_on_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


def all_gather_shards(output: torch.Tensor, shard: torch.Tensor, group) -> PendingCollective:
    """Gather every rank's ``shard`` into ``output`` (``N x shard``, rank-major), async.

    Wire per rank: ``(N-1) x shard`` bytes. Memory: none beyond ``output``.
    """
    n, rank = skdist.get_world_size(group), skdist.get_rank(group)
    if not _exchange_on_cpu(output) or n == 1:
        work = skdist.all_gather_into_tensor(output, shard, group=group, async_op=True)
        return PendingCollective([work], lambda: output)
    segments = output.view(n, -1)
    segments[rank].copy_(shard)
    ops = []
    for peer in range(n):
        if peer != rank:
            global_peer = skdist.get_global_rank(group, peer)
            ops.append(skdist.P2POp("send", shard, global_peer, group))
            ops.append(skdist.P2POp("recv", segments[peer], global_peer, group))
    return PendingCollective(skdist.batch_isend_irecv(ops), lambda: output)


def gathers_into_params(device: torch.device) -> bool:
    """True where :func:`all_gather_into_params` is the faster gather (CPU: no scratch buffer
    and no unpacking copy); elsewhere gather rank-major with :func:`all_gather_shards`."""
    return device.type == "cpu"


def all_gather_into_params(fulls: Sequence[torch.Tensor], chunks: Sequence[torch.Tensor],
                           group) -> PendingCollective:
    """Fill each flat full parameter ``fulls[i]`` with every rank's rows, async: rank ``r``'s
    rows are elements ``[r*c_i, (r+1)*c_i)`` (``c_i = chunks[i].numel()``, the last rank's cut
    at ``fulls[i].numel()``), so each rank sends the valid part of its chunk of every parameter
    straight into the peers' full tensors, one batch of sends/receives for the unit, and copies
    its own. Wire per rank: ``(N-1) x`` its valid shard elements (no padding is sent).
    Memory: none beyond ``fulls``."""
    n, rank = skdist.get_world_size(group), skdist.get_rank(group)
    peers = [(r, skdist.get_global_rank(group, r)) for r in range(n) if r != rank]
    ops = []
    for full, chunk in zip(fulls, chunks):
        c = chunk.numel()
        for r in range(n):
            lo, hi = r * c, min((r + 1) * c, full.numel())
            if hi <= lo:
                continue
            if r == rank:
                full[lo:hi].copy_(chunk[:hi - lo])
                for _, global_peer in peers:
                    ops.append(skdist.P2POp("send", chunk[:hi - lo], global_peer, group))
            else:
                global_src = skdist.get_global_rank(group, r)
                ops.append(skdist.P2POp("recv", full[lo:hi], global_src, group))
    return PendingCollective(skdist.batch_isend_irecv(ops), lambda: None)


def shared_memory_ring(device: torch.device, nbytes: int, group):
    """The shared-memory ring (:class:`shardkit.shm_ring.ShmRing`) that carries a CPU
    collective of ``nbytes`` (gathered output, or ``N`` x the reduce-scatter input) for
    ``group``, or ``None`` (not CPU, or a rank that cannot share). Collective on first use."""
    if device.type != "cpu":
        return None
    return shm_ring.ring_for(group, nbytes)


def reduce_scatter_packed(packed: torch.Tensor, group) -> PendingCollective:
    """Sum the rank-major ``packed`` buffer over ranks; :meth:`PendingCollective.wait` returns
    this rank's segment (``packed.numel() / N`` elements), async.

    Wire per rank: ``(N-1)/N`` of ``packed``. Memory: one more buffer of ``packed``'s size on
    CPU (the received parts), one segment on CUDA.
    """
    n = skdist.get_world_size(group)
    segment = packed.numel() // n
    if not _exchange_on_cpu(packed):
        out = torch.empty(segment, dtype=packed.dtype, device=packed.device)
        work = skdist.reduce_scatter_tensor(out, packed, group=group, async_op=True)
        return PendingCollective([work], lambda: out)
    ring = shared_memory_ring(packed.device, n * packed.numel() * packed.element_size(), group)
    if ring is not None:
        op = ring.reduce_scatter(packed)
        return PendingCollective([], op.wait)
    received = torch.empty_like(packed)
    work = skdist.all_to_all_single(received, packed, group=group, async_op=True)
    return PendingCollective([work], lambda: received.view(n, segment).sum(0))
