"""Topology from torchrun's LOCAL_WORLD_SIZE / GROUP_RANK: which ranks share a node, the
intra-node and inter-node groups, and CommCounter's split of bytes between groups inside one
node and groups that span nodes (same ring convention). A world of 4 labelled as 2 nodes x 2
ranks; tests/cluster/ runs the same on real separate nodes."""

import pytest
import torch

from shardkit import distributed as skd, topology
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
    saved = (getattr(topology, "_layout", None), topology._node_groups)
    topology._layout = topology._node_groups = None
    try:
        with patched_environ(GROUP_RANK=str(rank % 2), LOCAL_RANK=str(rank // 2)):
            intra, inter = skd.node_groups()
            return {"intra": skd.group_ranks(intra), "inter": skd.group_ranks(inter),
                    "nodes": [skd.node_of(r) for r in range(4)],
                    "spans": [skd.spans_nodes(intra), skd.spans_nodes(inter)]}
    finally:
        topology._layout, topology._node_groups = saved
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
    saved = topology._layout
    topology._layout = (topology._layout[0], [0, 0, 0, 1])
    try:
        skd.ranks_per_node()
    except RuntimeError as err:
        return str(err)
    finally:
        topology._layout = saved


def test_uneven_nodes_from_group_rank_are_the_same_error_on_every_rank(nodes2x2):
    for msg in nodes2x2.run(_uneven_layout):
        assert "node 0: ranks [0, 1, 2], node 1: ranks [3]" in msg
        assert "the same number of ranks on every node" in msg


def _numbered(cyclic: bool) -> dict:
    """Every multi-node path with ranks 0 and 2 on node 0, 1 and 3 on node 1 (srun's cyclic
    distribution) or node by node (torchrun's): the node groups of the hierarchical quantized
    reduce, of QuantizedTransport (ZeRO++'s qgZ), of HYBRID_SHARD and of hpZ over an explicit
    group; CommCounter's inter-node bytes; the values they compute."""
    import torch.distributed as dist
    import torch.nn as nn

    from shardkit.models import MLP
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
    from shardkit.quantized_comm import (hierarchical_wire_bytes, node_groups,
                                         quantized_reduce_scatter_hierarchical)
    from shardkit.quantized_transport import QuantizedTransport

    rank = skd.get_rank()
    saved = (topology._layout, topology._node_groups)
    topology._layout = topology._node_groups = None
    skd._spanning.clear()
    node, local = (rank % 2, rank // 2) if cyclic else (rank // 2, rank % 2)
    out = {}
    try:
        with patched_environ(GROUP_RANK=str(node), LOCAL_RANK=str(local)):
            skd.discover_node_layout()
            gen = torch.Generator().manual_seed(rank)
            grads = torch.randn(4 * 1000, generator=gen) * (rank + 1)
            exact = torch.empty(1000)
            skd.reduce_scatter_tensor(exact, grads.clone())
            intra, inter = node_groups()
            out["groups"] = (skd.group_ranks(intra), skd.group_ranks(inter))
            with CommCounter() as comm:
                got = quantized_reduce_scatter_hierarchical(grads, intra, inter, bits=8)
            out["hier"] = (got, exact, comm.intra_node_bytes, comm.inter_node_bytes,
                           hierarchical_wire_bytes(1000, 2, 2, bits=8))
            if cyclic:  # blocks of consecutive ranks are not the nodes: an error, not a send
                blocks = node_groups(ranks_per_node=2)
                with CommCounter() as comm, pytest.raises(ValueError) as info:
                    quantized_reduce_scatter_hierarchical(grads, *blocks, bits=8)
                out["wrong_groups"] = (str(info.value), len(comm.calls))
            transport = QuantizedTransport(weights=False, gradient_bits=8)
            transport.prepare(None)
            with CommCounter() as comm:
                got = transport.reduce_scatter(grads, None).wait()
            out["transport"] = (got, comm.intra_node_bytes, comm.inter_node_bytes,
                                transport.describe(None))

            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
            for name, kwargs in (("hybrid", {"sharding_strategy": "HYBRID_SHARD"}),
                                 ("hpz", {"hpz_partition_size": 2,
                                          "process_group": dist.group.WORLD})):
                model = FSDP(auto_wrap(MLP(16, 2, seed=1),
                                       transformer_auto_wrap_policy({nn.Linear}), **kwargs),
                             **kwargs)
                optim = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(2):  # the second step is counted
                    with CommCounter() as comm:
                        model(x).pow(2).mean().backward()
                        optim.step()
                        optim.zero_grad()
                psi = sum(u.unit_numel for u in model.sharded_units())
                out[name] = (comm.inter_node_elements, psi, model.state_dict())
    finally:
        topology._layout, topology._node_groups = saved
        skd._spanning.clear()
    return out


def test_every_multi_node_path_follows_the_gathered_layout(nodes2x2):
    # before: with ranks numbered round-robin, quantized_comm.node_groups() and
    # QuantizedTransport cut ranks [0, 1] as a "node" (it spans both nodes): CommCounter put
    # 2080 bytes per rank on inter-node groups instead of 1040 (the formula), and an explicit
    # hpZ group paired ranks across the nodes
    by_numbering = {cyclic: nodes2x2.run(_numbered, cyclic) for cyclic in (False, True)}
    for cyclic, results in by_numbering.items():
        for rank, r in enumerate(results):
            node, local = (rank % 2, rank // 2) if cyclic else (rank // 2, rank % 2)
            mates = [node, node + 2] if cyclic else [2 * node, 2 * node + 1]
            column = [2 * local, 2 * local + 1] if cyclic else [local, local + 2]
            assert r["groups"] == (mates, column), (cyclic, rank, r["groups"])

            got, exact, intra_bytes, inter_bytes, (intra_formula, inter_formula) = r["hier"]
            # int8 blocks: well within 2% of the largest value; the wrong segment is ~100% off
            assert (got - exact).abs().max() <= 0.02 * exact.abs().max(), (cyclic, rank)
            assert (intra_bytes, inter_bytes) == (intra_formula, inter_formula)
            got, intra_bytes, inter_bytes, described = r["transport"]
            assert "qgZ int8 hierarchical 2 x 2" in described, described
            assert (got - exact).abs().max() <= 0.02 * exact.abs().max(), (cyclic, rank)
            assert (intra_bytes, inter_bytes) == (intra_formula, inter_formula)

            for name, formula in (("hybrid", lambda m: 2 * (m / 2) * (2 - 1) / 2),
                                  ("hpz", lambda m: 2 * m * (4 - 1) / 4)):
                inter_elements, psi, _ = r[name]
                assert inter_elements == pytest.approx(formula(psi), rel=0.05), (
                    cyclic, rank, name, inter_elements, formula(psi))
        if cyclic:
            for rank, r in enumerate(results):
                message, calls = r["wrong_groups"]
                assert calls == 0 and "pass the groups of shardkit.quantized_comm.node_groups()" \
                    in message and f"node with ranks {[rank % 2, rank % 2 + 2]}" in message, r
    for rank in range(4):  # the same training whatever the numbering
        for name in ("hybrid", "hpz"):
            node_major, cyclic = (by_numbering[n][rank][name][2] for n in (False, True))
            for key in node_major:
                assert torch.allclose(node_major[key], cyclic[key], atol=1e-6), (rank, name, key)


def _uneven_layout_for_the_multi_node_paths():
    """Nodes of 3 and 1 ranks: quantized_comm.node_groups() raises on every rank before
    creating a group; QuantizedTransport warns on every rank and reduces flat."""
    import warnings

    from shardkit.quantized_comm import node_groups
    from shardkit.quantized_transport import QuantizedTransport

    saved = topology._layout
    topology._layout = (topology._layout[0], [0, 0, 0, 1])
    try:
        with CommCounter() as comm, pytest.raises(ValueError) as info:
            node_groups()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            transport = QuantizedTransport(weights=False)
            transport.prepare(None)
        return str(info.value), len(comm.calls), [str(w.message) for w in caught], \
            transport.describe(None)
    finally:
        topology._layout = saved


def test_uneven_nodes_are_an_error_before_any_group_or_a_flat_fallback(nodes2x2):
    for message, calls, warned, described in nodes2x2.run(_uneven_layout_for_the_multi_node_paths):
        assert "node_groups: the ranks sit on nodes of unequal sizes (ranks [0, 1, 2] on node " \
            "0, ranks [3] on node 1" in message and calls == 0, message
        assert len(warned) == 1 and "falls back to one flat all-to-all" in warned[0], warned
        assert "qgZ int4 flat" in described, described
