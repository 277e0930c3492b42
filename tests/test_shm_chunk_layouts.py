"""Shared-memory collectives of chunked tensors (FSDP's weight gathers and gradient
reduce-scatters) whose ranks cut the same bytes differently.

Before: ``SharedMemoryTransport.all_gather_chunks`` and ``reduce_scatter_chunks`` ran as one
plain all-gather or reduce-scatter of the packed bytes, whose header carries only the op, the
byte count and the dtype. Ranks that cut the same number of bytes into other chunks (other
parameter shapes on one rank, or a plain all-gather against a chunked one) exchanged them and
returned wrong values, silently; the process group's transport tags these exchanges with the
layout, so they never match. Now the chunk layout is in the header and every rank raises a
DivergedCollectivesError naming both calls. And a gather's chunks were unpacked into the full
tensors only by ``wait()``: a dropped handle left them unfilled (the process group fills them).

One world of 2 gloo ranks.
"""

import torch

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90, failure_grace_s=20)


def _call(transport, what: str, n: int):
    """Issue the call named ``what`` over 8 float32 elements per rank; return its handle."""
    kind, cut = what.split(":")
    sizes = [int(c) for c in cut.split(",")]
    if kind == "all_gather":
        return transport.all_gather(torch.empty(n * sizes[0]), torch.ones(sizes[0]), None)
    if kind == "all_gather_chunks":
        return transport.all_gather_chunks([torch.zeros(n * c) for c in sizes],
                                           [torch.ones(c) for c in sizes], None)
    if kind == "reduce_scatter":
        return transport.reduce_scatter(torch.ones(n * sizes[0]), None)
    return transport.reduce_scatter_chunks([torch.ones(n * c) for c in sizes], sizes, None)


_DIVERGED = [("all_gather_chunks:4,4", "all_gather_chunks:8"),
             ("all_gather_chunks:3,5", "all_gather:8"),
             ("reduce_scatter_chunks:4,4", "reduce_scatter_chunks:8"),
             ("reduce_scatter_chunks:2,6", "reduce_scatter:8")]


def _chunked_calls_that_cut_the_bytes_differently() -> list:
    from shardkit.shm_transport import DivergedCollectivesError, SharedMemoryTransport
    rank, n = skdist.get_rank(), skdist.get_world_size()
    seen = []
    for pair in _DIVERGED:
        transport = SharedMemoryTransport(part_bytes=4096, timeout_s=30)
        transport.prepare(None)
        try:
            _call(transport, pair[rank], n).wait()
            seen.append("no error")
        except DivergedCollectivesError as error:
            seen.append(pair[rank].split(":")[0] in str(error)
                        and pair[1 - rank].split(":")[0] in str(error))
        finally:
            transport.close()
    return seen


def _chunked_calls_that_agree() -> list:
    """The same calls on both ranks still move exact values (values differ by rank); a gather
    whose handle is dropped still fills its tensors, as on the process group."""
    from shardkit.shm_transport import SharedMemoryTransport
    rank = skdist.get_rank()
    transport = SharedMemoryTransport(part_bytes=4096, timeout_s=30)
    transport.prepare(None)
    try:
        fulls = [torch.zeros(2 * 3 - 1), torch.zeros(2 * 1500)]
        chunks = [torch.full((3,), rank + 1.0), torch.arange(1500.0) + rank]
        transport.all_gather_chunks(fulls, chunks, None).wait()
        tensors = [torch.arange(5.0) * (rank + 1), torch.ones(3000) * (rank + 1)]
        summed = transport.reduce_scatter_chunks(tensors, [3, 1500], None, scale=0.5).wait()
        dropped = [torch.zeros(4)]
        transport.all_gather_chunks(dropped, [torch.full((2,), rank + 1.0)], None)
        transport.all_reduce(torch.ones(1), None).wait()  # runs after the dropped gather
    finally:
        transport.close()
    exact_fulls = [torch.tensor([1.0, 1, 1, 2, 2]),
                   torch.cat([torch.arange(1500.0), torch.arange(1500.0) + 1])]
    padded = torch.cat([torch.arange(5.0), torch.zeros(1)]) * 1.5
    exact_summed = torch.cat([padded[3 * rank:3 * rank + 3], torch.full((1500,), 1.5)])
    return [all(torch.equal(f, e) for f, e in zip(fulls, exact_fulls)),
            torch.equal(summed, exact_summed), dropped[0].tolist()]


def test_chunked_shared_memory_calls_of_other_layouts_raise_naming_both(world2):
    """Before: every rank returned, with the peer's bytes in the wrong places."""
    assert world2.run(_chunked_calls_that_cut_the_bytes_differently) == [[True] * 4] * 2


def test_chunked_shared_memory_calls_that_agree_move_exact_values(world2):
    """Before: the dropped gather's tensor stayed zeros (it was unpacked only by wait())."""
    assert world2.run(_chunked_calls_that_agree) == [[True, True, [1.0, 1.0, 2.0, 2.0]]] * 2
