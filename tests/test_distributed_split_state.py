"""The state that ``shardkit.distributed`` serves from the modules it was split into (the
gathered node layout, the node groups, the gathered process ids): an assignment through
``shardkit.distributed``, as code written before the split resets the layout, reaches the code
that reads it, and a later read sees the module's own value again."""

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from shardkit import distributed as skd
from shardkit.testing import patched_environ, world_fixture

world2 = world_fixture(2)


def _a_pid_that_exited() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _state_assigned_through_distributed() -> dict:
    """Each piece of state set through ``shardkit.distributed`` (and reset the same way), and
    what the topology and broken-link code answer with it."""
    world, rank = dist.group.WORLD, skd.get_rank()
    out = {}
    saved = skd._layout, skd._node_groups, skd._processes
    try:
        skd._layout = (world, [1, 0])  # one rank per node, the nodes numbered backwards
        skd._spanning.clear()
        with patched_environ(LOCAL_WORLD_SIZE="1"):
            out["nodes"] = [skd.node_of(r) for r in range(2)]
            out["spans"] = skd.spans_nodes()
        skd._layout = None  # forgotten: the next question gathers it again
        out["regathered"] = skd.discover_node_layout()
        out["read_back_is_current"] = skd._layout[0] is world

        intra = skd.new_group([0, 1])
        skd._node_groups = (world, (intra, None))
        out["node_groups"] = skd.group_ranks(skd.node_groups()[0])

        dead = _a_pid_that_exited()
        me = skd._this_process()
        skd._processes = (world, [me[:2] + (dead if r != rank else os.getpid(),)
                                  for r in range(2)])
        out["exited"] = skd.exited_peers_on_this_host()
        out["dead"] = dead
    finally:
        skd._layout, skd._node_groups, skd._processes = saved
        skd._spanning.clear()
    out["restored"] = skd._layout is saved[0] and skd.node_of(1) == 0
    return out


def test_state_assigned_through_distributed_reaches_the_code(world2):
    for rank, got in enumerate(world2.run(_state_assigned_through_distributed)):
        assert got["nodes"] == [1, 0] and got["spans"], got
        assert got["regathered"] == [0, 0] and got["read_back_is_current"], got
        assert got["node_groups"] == [0, 1], got
        assert got["exited"] == [(1 - rank, got["dead"])], got
        assert got["restored"], got


def test_monkeypatch_through_distributed_is_undone_in_the_owning_module(monkeypatch):
    from shardkit import topology
    layout = (object(), [3])
    monkeypatch.setattr(skd, "_layout", layout)
    assert topology._layout is layout and skd._layout is layout
    monkeypatch.undo()
    assert topology._layout is None and skd._layout is None
    skd.some_new_name = 1  # other names are set on the module as usual
    try:
        assert vars(skd)["some_new_name"] == 1
    finally:
        del skd.some_new_name
    with pytest.raises(AttributeError, match="no attribute '_no_such_state'"):
        skd._no_such_state
