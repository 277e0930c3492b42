"""Round-robin rank placement (srun's cyclic distribution: node = rank % nodes, GROUP_RANK set
accordingly) on a world whose node layout was not gathered (a world made by torch's own
``init_process_group``): every rank derives the same nodes for a sub-group, from the nodes
gathered over it, instead of guessing ``rank // LOCAL_WORLD_SIZE`` on the ranks whose
GROUP_RANK happens to match that guess.

From a review:

Review of daf48fa (round-robin node maps; dead ranks named): torchrun's own node-by-node
numbering on a world made by torch's ``init_process_group`` keeps its intra-/inter-node split,
and a broken link names only the exited ranks of the failing op's group.
"""

import ast
import contextlib
import os
import signal
import time

import pytest
import torch

from shardkit import distributed as skd, topology
from shardkit.distributed import CommCounter
from shardkit.testing import World, node_and_local_rank, patched_environ


@pytest.fixture(scope="module")
def round_robin4():
    with World(4, ranks_per_node=2, placement="round_robin") as w:
        yield w


@contextlib.contextmanager
def _layout_not_gathered():
    """Inside, the rank knows nothing of the other ranks' nodes, as after torch's own
    ``init_process_group`` (shardkit's ``init_distributed`` gathered them)."""
    saved = topology._layout
    topology._layout = None
    skd._spanning.clear()
    try:
        yield
    finally:
        topology._layout = saved
        skd._spanning.clear()
        for cache in skd._GROUP_CACHES:  # the nodes gathered over sub-groups in the block
            cache.forget()


def _what_each_rank_knows() -> dict:
    """Before anything is gathered: node_of and spans_nodes of two pairs; then, after the
    nodes of each pair are gathered over it (as hpZ and qgZ do), the pairs' nodes and
    CommCounter's split of an all-reduce on each."""
    rank = skd.get_rank()
    out = {"env": (rank, int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])),
           "init_layout": list(skd._layout[1])}
    with _layout_not_gathered():
        pairs = [skd.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
        mine = [group for group in pairs if rank in skd.group_ranks(group)]
        with pytest.raises(skd.NodeNumberingUnknown) as info:
            skd.node_of(rank ^ 1)
        out["node_of"] = str(info.value)
        out["spans_before"] = [skd.spans_nodes_if_known(group) for group in mine]
        with CommCounter() as comm:
            skd.all_reduce(torch.ones(10), group=mine[0])  # its pair: [0, 1] or [2, 3]
        try:
            out["split_before"] = comm.inter_node_bytes
        except RuntimeError as error:
            out["split_before"] = str(error)
        out["world_spans"] = skd.spans_nodes(None)  # 4 ranks cannot fit on a node of 2
        for group in mine:
            ranks = skd.group_ranks(group)
            nodes = skd.group_ranks_by_node(ranks, group)
            with CommCounter() as comm:
                skd.all_reduce(torch.ones(10), group=group)  # 2 * 1/2 * 40 bytes
            out[tuple(ranks)] = (nodes, comm.intra_node_bytes, comm.inter_node_bytes)
    return out


def test_round_robin_sub_groups_split_alike_on_every_rank(round_robin4):
    # before: rank 0 (GROUP_RANK 0 = 0 // 2) counted the all-reduce on [0, 1] (two nodes) as
    # intra-node and the one on [0, 2] (one node) as inter-node; ranks 1 and 2 could not say
    for rank, r in enumerate(round_robin4.run(_what_each_rank_knows)):
        assert r["env"] == (rank, rank % 2, rank // 2) == (rank, *node_and_local_rank(
            rank, 4, 2, "round_robin"))
        assert r["init_layout"] == [0, 1, 0, 1]
        assert "node_groups()" in r["node_of"] and "GROUP_RANK" in r["node_of"], r["node_of"]
        assert r["spans_before"] == [None, None], r["spans_before"]
        assert "GROUP_RANK was set by a launcher other than torchrun" in r["split_before"] \
            and "node_groups()" in r["split_before"], r["split_before"]
        assert r["world_spans"] is True
        pair, column = (rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2)
        assert r[pair] == ([[pair[0]], [pair[1]]], 0.0, 40.0), (rank, r[pair])
        assert r[column] == ([list(column)], 40.0, 0.0), (rank, r[column])


def test_world_refuses_an_unknown_placement():
    with pytest.raises(ValueError, match="placement='cyclic'"):
        World(4, ranks_per_node=2, placement="cyclic")


def _hierarchical_over_a_sub_group() -> tuple:
    """Two data-parallel groups of 4 ranks, each on 2 nodes of 2 (round-robin over the world's
    2 nodes of 4): the hierarchical quantized reduce-scatter over each against the exact
    one."""
    from shardkit.quantized_comm import node_groups, quantized_reduce_scatter_hierarchical

    rank = skd.get_rank()
    with _layout_not_gathered():
        groups = [skd.new_group([0, 1, 2, 3]), skd.new_group([4, 5, 6, 7])]
        group = groups[rank // 4]
        grads = torch.randn(4 * 256, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        exact = torch.empty(256)
        skd.reduce_scatter_tensor(exact, grads.clone(), group=group)
        intra, inter = node_groups(group=group)
        got = quantized_reduce_scatter_hierarchical(grads, intra, inter, bits=8, group=group)
        error = float((got - exact).abs().max() / exact.abs().max())
        return skd.group_ranks(intra), skd.group_ranks(inter), error


def test_hierarchical_reduce_over_a_round_robin_sub_group_gets_its_own_segment():
    # before: ranks 1, 2, 5 and 6 got another rank's segment (errors of 120-170%), silently
    with World(8, ranks_per_node=4, placement="round_robin") as world:
        results = world.run(_hierarchical_over_a_sub_group)
    for rank, (intra, inter, error) in enumerate(results):
        base = rank - rank % 4
        assert intra == [base + rank % 2, base + rank % 2 + 2], (rank, intra)
        assert inter == [rank - rank % 2, rank - rank % 2 + 1], (rank, inter)
        assert error < 0.03, (rank, error)  # int8 blocks


def _local_world_size_that_is_not_a_number() -> str:
    with patched_environ(LOCAL_WORLD_SIZE="two"), pytest.raises(RuntimeError) as info:
        skd.ranks_per_node()
    return str(info.value)


def test_a_local_world_size_that_is_not_a_number_is_named(round_robin4):
    # before: "invalid literal for int() with base 10: 'two'", naming no variable
    for message in round_robin4.run(_local_world_size_that_is_not_a_number):
        assert "LOCAL_WORLD_SIZE='two' is not an integer" in message, message


def _ops_after_rank1_is_killed() -> dict:
    """Rank 1 is killed (SIGKILL) after a first all-reduce; rank 0 then issues a plain
    all-reduce and an operation of each network transport: what each raises."""
    import signal

    from shardkit.quantized_transport import QuantizedTransport
    from shardkit.transport import ProcessGroupTransport

    transports = {"default": ProcessGroupTransport(), "quantized": QuantizedTransport()}
    for transport in transports.values():
        transport.prepare(None)
    skd.all_reduce(torch.ones(4))
    if skd.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    calls = {"all_reduce": lambda: skd.all_reduce(torch.ones(4)),
             **{name: lambda t=t: t.all_gather(torch.empty(512), torch.ones(256), None).wait()
                for name, t in transports.items()}}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except RuntimeError as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def test_a_killed_rank_is_named_by_its_peers_error():
    # before: "Connection reset by peer" (or "closed by peer") from gloo, naming no rank
    with World(2, failure_grace_s=60) as world, pytest.raises(Exception) as info:
        world.run(_ops_after_rank1_is_killed)
    report = str(info.value)
    assert "rank 1 exited with code -9" in report, report
    said = ast.literal_eval(report.split("--- rank 0 returned:\n", 1)[1].split("\n--- ", 1)[0])
    assert set(said) == {"all_reduce", "default", "quantized"}, said
    for name, message in said.items():
        assert message.startswith("CollectiveError: "), (name, message)
        assert "global rank(s) [1] (pid(s) [" in message, (name, message)
        assert "on this host) exited" in message, (name, message)


def _nodes_and_split_of_pairs() -> dict:
    """node_of every rank, and CommCounter's split of an all-reduce on this rank's pairs (one
    inside a node, one across the two), with nothing gathered."""
    rank = skd.get_rank()
    out = {}
    with _layout_not_gathered():
        pairs = [skd.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
        out["node_of"] = [skd.node_of(r) for r in range(4)]
        for group in pairs:
            if rank in skd.group_ranks(group):
                with CommCounter() as comm:
                    skd.all_reduce(torch.ones(10), group=group)  # 2 * 1/2 * 40 bytes
                out[tuple(skd.group_ranks(group))] = (comm.intra_node_bytes,
                                                      comm.inter_node_bytes)
    return out


def test_torchrun_numbering_on_a_world_made_by_torch_splits_sub_groups_as_before():
    # before the fix: NodeNumberingUnknown from node_of and a RuntimeError from CommCounter's
    # intra_node_bytes on every rank, although torchrun numbers the ranks node by node
    with World(4, ranks_per_node=2, env={"TORCHELASTIC_RUN_ID": "rev63"}) as world:
        results = world.run(_nodes_and_split_of_pairs)
    for rank, r in enumerate(results):
        assert r["node_of"] == [0, 0, 1, 1], (rank, r)
        inside, across = (rank - rank % 2, rank - rank % 2 + 1), (rank % 2, rank % 2 + 2)
        assert r[inside] == (40.0, 0.0) and r[across] == (0.0, 40.0), (rank, r)


def _pair_timed_out_after_another_rank_died() -> str:
    """Rank 2 is killed; rank 0 then times out on an all-reduce over the pair [0, 1] that
    rank 1 (alive) never joins: what rank 0's error says."""
    pair = skd.new_group([0, 1], timeout_s=3)
    skd.all_reduce(torch.ones(4))
    rank = skd.get_rank()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 20
    while rank == 0 and not skd.exited_peers_on_this_host() and time.monotonic() < deadline:
        time.sleep(0.05)  # rank 2 has exited before rank 0's pair op starts
    if rank == 1:
        time.sleep(6)
        return "stayed out"
    try:
        skd.all_reduce(torch.ones(4), group=pair)
        return "no error"
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"


def test_a_broken_link_names_no_exited_rank_outside_the_ops_group():
    # before the fix: "global rank(s) [2] ... exited", rank 2 being no member of the pair
    with World(3, failure_grace_s=60) as world, pytest.raises(Exception) as info:
        world.run(_pair_timed_out_after_another_rank_died)
    report = str(info.value)
    assert "rank 2 exited with code -9" in report, report
    said = report.split("--- rank 0 returned:\n", 1)[1].split("\n--- ", 1)[0]
    assert said.startswith("'CollectiveError: all_reduce over process group") or \
        said.startswith('"CollectiveError: all_reduce over process group'), said
    assert "on rank 0 of 2" in said and "exited" not in said, said
