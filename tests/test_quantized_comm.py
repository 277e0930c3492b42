"""Quantized collectives (qwZ all-gather, qgZ reduce-scatter, flat and hierarchical) in one world
of 4 gloo ranks: results against the exact fp32 collective within the bound the block scales
imply, and CommCounter's uint8 bytes against the formula. World-2 checks run on the two node
groups {0, 1} and {2, 3}; the hierarchical ones treat the world as 2 nodes x 2 ranks."""

import math

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.kernels import pack_rank_major
from shardkit.quantized_comm import (hierarchical_wire_bytes, node_groups,
                                     quantized_all_gather, quantized_reduce_scatter,
                                     quantized_reduce_scatter_hierarchical, wire_bytes)
from shardkit.testing import world_fixture

world4 = world_fixture(4)
QMAX = {8: 127, 4: 7}
SIZES = [1000, 7, 0, 333, 2048]
_GROUPS = {}


def groups():
    """This rank's node group (2 ranks), cross-node group (2 ranks) and a group of itself."""
    if not _GROUPS:
        rank = skdist.get_rank()
        for name, lists in (("node", [[0, 1], [2, 3]]), ("across", [[0, 2], [1, 3]]),
                            ("self", [[0], [1], [2], [3]])):
            for ranks in lists:
                group = skdist.new_group(ranks)
                if rank in ranks:
                    _GROUPS[name] = (group, ranks)
    return _GROUPS


def gradients(rank, seed, dtype=torch.float32):
    """Rank ``rank``'s gradients: varied magnitudes, some all-zero stretches."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    tensors = []
    for i, n in enumerate(SIZES):
        t = torch.randn(n, generator=gen) * 10.0 ** ((i + rank) % 3 - 1)
        t[n // 2:n // 2 + 300] = 0
        tensors.append(t.to(dtype))
    return tensors


def half_scales(segment, bits, block):
    """Per element: half the scale (absmax / qmax) of its block in ``segment`` (fp32)."""
    padded = torch.nn.functional.pad(segment, (0, -segment.numel() % block))
    scales = padded.view(-1, block).abs().amax(-1) / QMAX[bits]
    return scales.repeat_interleave(block)[:segment.numel()] / 2


def segment_of(tensors, world, index):
    return pack_rank_major([t.float() for t in tensors], world).view(world, -1)[index]


def segment_bytes(numel, bits, block):
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + 4 * blocks


def exact_reduce_scatter(tensors, group):
    n = skdist.get_world_size(group)
    packed = pack_rank_major([t.float() for t in tensors], n)
    out = torch.empty(packed.numel() // n)
    skdist.reduce_scatter_tensor(out, packed, group=group)
    return out


def _check_flat_reduce_scatter(bits, op, block, dtype):
    """World 4 (default group) and world 2 (each node group)."""
    rank = skdist.get_rank()
    mine = gradients(rank, seed=bits, dtype=dtype)
    node_group, node_ranks = groups()["node"]
    results = []
    for group, ranks in ((None, [0, 1, 2, 3]), (node_group, node_ranks)):
        n, me = len(ranks), ranks.index(rank)
        with skdist.CommCounter() as comm:
            got = quantized_reduce_scatter(mine, group, bits=bits, block=block, op=op)
        exact = exact_reduce_scatter(mine, group)
        divide = n if op == "mean" else 1
        bound = sum(half_scales(segment_of(gradients(r, bits, dtype), n, me), bits, block)
                    for r in ranks) / divide
        err = (got - exact / divide).abs()
        assert (err <= bound * (1 + 1e-5) + 1e-6).all(), (err - bound).max()
        assert err.max() > 0, "the transfer really was quantized"
        seg = got.numel()
        assert [(c.op, c.dtype) for c in comm.calls] == [("all_to_all", torch.uint8)]
        assert comm.bytes == (n - 1) / n * n * segment_bytes(seg, bits, block)
        assert comm.bytes == wire_bytes(seg, n, bits=bits, block=block)
        with skdist.CommCounter() as fp32:
            exact_reduce_scatter(mine, group)
        results.append((comm.bytes / fp32.bytes, seg))
    return results


@pytest.mark.parametrize("bits,op,block,dtype", [(4, "mean", 256, torch.float32),
                                                 (8, "sum", 64, torch.bfloat16)])
def test_flat_reduce_scatter_within_bound_and_counted(world4, bits, op, block, dtype):
    ratios = world4.run(_check_flat_reduce_scatter, bits, op, block, dtype)
    for ratio, seg in (r for per_rank in ratios for r in per_rank):
        padding = 1 + block / seg  # the last block of a segment is padded
        assert ratio <= (bits / 32 + 1 / block) * padding, (ratio, seg)


def _check_all_gather(bits, out_dtype):
    rank = skdist.get_rank()
    node_group, node_ranks = groups()["node"]
    results = []
    for group, ranks in ((None, [0, 1, 2, 3]), (node_group, node_ranks)):
        n = len(ranks)
        shards = {r: torch.randn(777, generator=torch.Generator().manual_seed(r)) * (r + 1)
                  for r in ranks}
        out = torch.empty(n * 777, dtype=out_dtype)
        with skdist.CommCounter() as comm:
            assert quantized_all_gather(out, shards[rank], group, bits=bits) is out
        exact = torch.cat([shards[r] for r in ranks])
        bound = torch.cat([half_scales(shards[r], bits, 256) for r in ranks])
        rounding = exact.abs() * (2.0 ** -8 if out_dtype == torch.bfloat16 else 0)
        assert ((out.float() - exact).abs() <= bound * (1 + 1e-5) + rounding).all()
        assert [(c.op, c.dtype) for c in comm.calls] == [("all_gather", torch.uint8)]
        assert comm.bytes == (n - 1) / n * n * segment_bytes(777, bits, 256)

        # into per-parameter tensors: the shard is chunk `rank` of three tensors, side by side
        chunks = [300, 77, 400]
        params = [torch.empty(n * c - 5 * (i == 1)) for i, c in enumerate(chunks)]
        pending = quantized_all_gather(params, shards[rank], group, bits=bits,
                                       chunk_numels=chunks, async_op=True)
        assert pending.wait() is None
        offsets = [0, 300, 377]
        for t, c, o in zip(params, chunks, offsets):
            want = torch.cat([out.float()[i * 777 + o:i * 777 + o + c] for i in range(n)])
            if out_dtype == torch.float32:
                assert torch.equal(t, want[:t.numel()]), "same values as the flat gather"
        results.append(comm.bytes)
    return results


@pytest.mark.parametrize("bits,out_dtype", [(8, torch.float32), (4, torch.bfloat16)])
def test_all_gather_within_bound_and_counted(world4, bits, out_dtype):
    world4.run(_check_all_gather, bits, out_dtype)


def _check_hierarchical(bits, op):
    rank = skdist.get_rank()
    g = groups()
    (node_group, _), (across_group, _), (self_group, _) = g["node"], g["across"], g["self"]
    mine = gradients(rank, seed=7 + bits)
    with skdist.CommCounter() as comm:
        got = quantized_reduce_scatter_hierarchical(mine, node_group, across_group, bits=bits,
                                                    op=op)
    exact = exact_reduce_scatter(mine, None)
    divide = 4 if op == "mean" else 1
    qmax = QMAX[bits]
    # each rank's half scale, and the requantized node sums' (<= their ranks' scales x (1 + 1/2q))
    bound = sum(half_scales(segment_of(gradients(r, 7 + bits), 4, rank), bits, 256)
                for r in range(4)) * (2 + 1 / (2 * qmax)) / divide
    err = (got - exact / divide).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()
    seg = got.numel()
    assert [(c.op, c.dtype, c.group_size) for c in comm.calls] == [
        ("all_to_all", torch.uint8, 2)] * 2
    intra, across = (c.bytes for c in comm.calls)
    assert intra == 1 / 2 * 4 * segment_bytes(seg, bits, 256), "n=2 peers, N=4 segments"
    assert across == 1 / 2 * 2 * segment_bytes(seg, bits, 256), "k=2 nodes, k segments"
    assert (intra, across) == hierarchical_wire_bytes(seg, 2, 2, bits=bits)
    flat = wire_bytes(seg, 4, bits=bits)
    assert across <= flat / 2, "the links between nodes carry k/N of a flat all-to-all or less"

    # the same through node_groups (node-major numbering, as torchrun gives)
    node_g, across_g = node_groups(2)
    again = quantized_reduce_scatter_hierarchical(mine, node_g, across_g, bits=bits, op=op)
    assert torch.equal(again, got)

    # one node: the hierarchical call is the flat one over the node group, bit for bit
    one_node = quantized_reduce_scatter_hierarchical(mine, node_group, self_group, bits=bits,
                                                     op=op)
    flat = quantized_reduce_scatter(mine, node_group, bits=bits, op=op)
    assert torch.equal(one_node, flat)
    return float(err.max() / (exact.abs().max() / divide))


@pytest.mark.parametrize("bits,op", [(4, "mean"), (8, "sum")])
def test_hierarchical_reduce_scatter_within_bound_and_counted(world4, bits, op):
    world4.run(_check_hierarchical, bits, op)


def _check_errors_and_nonfinite():
    rank = skdist.get_rank()
    messages = []
    for call in (lambda: quantized_reduce_scatter([torch.randn(8)], bits=3),
                 lambda: quantized_reduce_scatter([torch.randn(8)], op="max"),
                 lambda: quantized_reduce_scatter([torch.randn(8)], out=torch.empty(3)),
                 lambda: quantized_all_gather(torch.empty(10), torch.randn(4)),
                 lambda: quantized_all_gather([torch.empty(8)], torch.randn(4),
                                              chunk_numels=[3]),
                 lambda: quantized_all_gather(torch.empty(16, dtype=torch.int32),
                                              torch.randn(4)),
                 lambda: node_groups(3),
                 lambda: quantized_reduce_scatter_hierarchical(
                     [torch.randn(8)], groups()["node"][0], groups()["across"][0],
                     group=groups()["node"][0]),
                 # a float number of bits (was taken: float byte counts, a TypeError later)
                 lambda: quantized_reduce_scatter([torch.randn(8)], bits=8.0),
                 # nothing to reduce (was an IndexError), a list of ranks for a group (was
                 # "'list' object has no attribute 'size'")
                 lambda: quantized_reduce_scatter([]),
                 lambda: quantized_reduce_scatter([torch.randn(8)], [0, 1]),
                 lambda: quantized_reduce_scatter_hierarchical(
                     [torch.randn(8)], groups()["node"][0], [0, 2])):
        with skdist.CommCounter() as comm:
            with pytest.raises((ValueError, TypeError)) as info:
                call()
        assert comm.calls == 0, "raised before any collective"
        messages.append(str(info.value))

    grads = [torch.ones(64) * (rank + 1)]
    if rank == 0:
        grads[0][17] = math.inf  # element 17: rank 1's segment (16 each), block [0, 8)
    got = quantized_reduce_scatter(grads, bits=8, block=8)
    if rank == 1:
        assert got[:8].isnan().all() and torch.isfinite(got[8:]).all()
    else:
        assert (got - 10).abs().max() < 1e-5, "other blocks are unaffected"
    return messages


def test_bad_input_raises_before_sending_and_inf_arrives_as_nan(world4):
    messages = world4.run(_check_errors_and_nonfinite)[0]
    assert "bits=3" in messages[0] and "op='max'" in messages[1]
    assert "the reduced shard needs 2 contiguous elements" in messages[2]
    assert "must be one tensor of world size 4 x shard's 4 = 16" in messages[3]
    assert "chunk_numels sum to 3" in messages[4] and "output[0] is torch.int32" in messages[5]
    assert "ranks_per_node=3; it must be a positive divisor of the group's 4 ranks" in messages[6]
    assert "group holds 2 ranks, but intra_group x inter_group hold 2 x 2" in messages[7]
    assert "bits=8.0; valid values are [4, 8]" in messages[8]
    assert "quantized_reduce_scatter(tensors=list of []): must be a tensor or a non-empty" \
        in messages[9]
    assert "quantized_reduce_scatter(group=[0, 1]): must be a torch.distributed " \
        "ProcessGroup" in messages[10]
    assert "quantized_reduce_scatter_hierarchical(inter_group=[0, 2])" in messages[11]
