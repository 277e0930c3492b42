"""Topology from torchrun's LOCAL_WORLD_SIZE / GROUP_RANK: which ranks share a node, the
intra-node and inter-node groups, and CommCounter's split of bytes between groups inside one
node and groups that span nodes (same ring convention). A world of 4 labelled as 2 nodes x 2
ranks; tests/cluster/ runs the same on real separate nodes."""

import pytest
import torch

from shardkit import distributed as skd
from shardkit.distributed import CommCounter
from shardkit.testing import World, patched_environ


@pytest.fixture(scope="module")
def nodes2x2():
    with World(4, ranks_per_node=2) as w:
        yield w


def _topology():
    intra, inter = skd.node_groups()
    return {"per_node": skd.ranks_per_node(), "nodes": [skd.node_of(r) for r in range(4)],
            "intra": skd.group_ranks(intra), "inter": skd.group_ranks(inter),
            "spans": [skd.spans_nodes(None), skd.spans_nodes(intra), skd.spans_nodes(inter)],
            "same_again": skd.node_groups() == (intra, inter)}


def test_node_layout_and_groups(nodes2x2):
    results = nodes2x2.run(_topology)
    for rank, r in enumerate(results):
        node = rank // 2
        assert r["per_node"] == 2 and r["nodes"] == [0, 0, 1, 1]
        assert r["intra"] == [2 * node, 2 * node + 1]
        assert r["inter"] == [rank % 2, rank % 2 + 2]
        assert r["spans"] == [True, False, True]
        assert r["same_again"]


def _counted_split():
    intra, inter = skd.node_groups()
    t = torch.ones(1000)  # 4000 bytes
    out = {}
    for name, group in (("world", None), ("intra", intra), ("inter", inter)):
        with CommCounter() as comm:
            skd.all_reduce(t, group=group)
            if group is not None:  # the two-rank groups also gather 8000 bytes
                skd.all_gather_into_tensor(torch.empty(2000), t, group=group)
        out[name] = (comm.bytes, comm.intra_node_bytes, comm.inter_node_bytes,
                     comm.inter_node_elements)
    with CommCounter() as comm:  # a send on the world group spans, whoever the peer is
        peer = skd.get_rank() ^ 1
        if skd.get_rank() % 2 == 0:
            skd.send(torch.ones(10), peer)
        else:
            skd.recv(torch.empty(10), peer)
    out["send"] = (comm.bytes, comm.inter_node_bytes)
    return out


def test_comm_counter_splits_by_group_topology(nodes2x2):
    for rank, r in enumerate(nodes2x2.run(_counted_split)):
        assert r["world"] == (6000.0, 0.0, 6000.0, 1500.0)  # all-reduce 2*3/4*4000
        # n=2 groups: all-reduce 2*1/2*4000 plus all-gather 1/2*8000
        assert r["intra"] == (8000.0, 8000.0, 0.0, 0.0)
        assert r["inter"] == (8000.0, 0.0, 8000.0, 2000.0)
        assert r["send"] == ((40.0, 40.0) if rank % 2 == 0 else (0.0, 0.0))


def _bad_local_world_size():
    with patched_environ(LOCAL_WORLD_SIZE="3"):
        try:
            skd.ranks_per_node()
        except RuntimeError as err:
            return str(err)


def test_uneven_nodes_are_a_clear_error(nodes2x2):
    for msg in nodes2x2.run(_bad_local_world_size):
        assert "LOCAL_WORLD_SIZE=3 does not divide the world size 4" in msg


def test_one_node_by_default():
    assert World(2).ranks_per_node == 2
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        World(4, ranks_per_node=3)


def _cyclic_topology():
    """Node groups when the launcher numbers ranks round-robin over the nodes (srun's cyclic
    distribution): ranks 0 and 2 on node 0, ranks 1 and 3 on node 1."""
    rank = skd.get_rank()
    saved = (getattr(skd, "_layout", None), skd._node_groups)
    skd._layout = skd._node_groups = None
    try:
        with patched_environ(GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2)):
            intra, inter = skd.node_groups()
            return {"intra": skd.group_ranks(intra), "inter": skd.group_ranks(inter),
                    "nodes": [skd.node_of(r) for r in range(4)],
                    "spans": [skd.spans_nodes(intra), skd.spans_nodes(inter)]}
    finally:
        skd._layout, skd._node_groups = saved
        skd._spanning.clear()


def test_node_groups_follow_group_rank_not_rank_order(nodes2x2):
    # before: ranks 1 and 2 raised "not numbered node by node" while ranks 0 and 3 waited in
    # new_group for them (a hang); without GROUP_RANK the "intra-node" group crossed nodes
    for rank, r in enumerate(nodes2x2.run(_cyclic_topology)):
        assert r["nodes"] == [0, 1, 0, 1]
        assert r["intra"] == [rank % 2, rank % 2 + 2]
        assert r["inter"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["spans"] == [False, True]


def test_layout_from_group_rank_then_host_then_rank_order():
    layout = skd.layout_from_identities
    assert layout([(1, "a"), (0, "a"), (1, "a"), (0, "a")], 2) == [1, 0, 1, 0]
    assert layout([(None, "b"), (None, "a"), (None, "b"), (None, "a")], 2) == [0, 1, 0, 1]
    assert layout([(None, "h")] * 4, 2) == [0, 0, 1, 1]
    assert layout([(None, "h")] * 4, 4) == [0, 0, 0, 0]


def _uneven_layout():
    saved = skd._layout
    skd._layout = (skd._layout[0], [0, 0, 0, 1])
    try:
        skd.ranks_per_node()
    except RuntimeError as err:
        return str(err)
    finally:
        skd._layout = saved


def test_uneven_nodes_from_group_rank_are_the_same_error_on_every_rank(nodes2x2):
    for msg in nodes2x2.run(_uneven_layout):
        assert "node 0: ranks [0, 1, 2], node 1: ranks [3]" in msg
        assert "the same number of ranks on every node" in msg
