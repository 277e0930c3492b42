"""The simulated-cluster launcher: runs torchrun on every node, reports the worst exit status,
gives each node its own address, host name and /dev/shm, and leaves nothing behind on any exit
path (a failing command, SIGTERM to the launcher)."""

import io
import os
import signal
import subprocess
import sys
import time

import pytest

from shardkit import cluster
from shardkit.testing import cluster_unavailable_reason, run_cluster

_REASON = cluster_unavailable_reason()
needs_cluster = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

# one shell line per rank: what it can see of its node (shm: files in /dev/shm other than the
# node's own marks: a fresh tmpfs has none), then an exit status chosen by rank
_PROBE = ("echo probe rank=$RANK group=$GROUP_RANK lws=$LOCAL_WORLD_SIZE host=$(hostname) "
          "if=$GLOO_SOCKET_IFNAME shm=$(ls /dev/shm | grep -vc ^mark-); touch /dev/shm/mark-$RANK; "
          "[ $RANK -eq 3 ] && exit 3; exit 0")


def test_parse_link_rate():
    assert cluster.parse_link_rate("1gbit") == 10**9
    assert cluster.parse_link_rate("500mbit") == 5 * 10**8
    assert cluster.parse_link_rate("none") is None
    with pytest.raises(ValueError, match="link_rate='fast'"):
        cluster.parse_link_rate("fast")


def test_unavailable_reason_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    assert "needs tc on PATH" in cluster.cluster_unavailable_reason()
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: "/bin/x")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert "needs root" in cluster.cluster_unavailable_reason()


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="nodes=0"):
        run_cluster(["x.py"], nodes=0)
    with pytest.raises(ValueError, match="nproc_per_node=0"):
        run_cluster(["x.py"], nproc_per_node=0)
    with pytest.raises(ValueError, match="command"):
        run_cluster([])
    for bad in (0, -5):  # before: a negative timeout ended the launch at once, status 124
        with pytest.raises(ValueError, match=f"timeout={bad}: must be a number of seconds > 0"):
            run_cluster(["x.py"], timeout=bad)


@needs_cluster
def test_nodes_are_separate_and_worst_status_returned_and_nothing_left():
    out = io.StringIO()
    rc = run_cluster(["--no-python", "sh", "-c", _PROBE], nodes=2, nproc_per_node=2,
                     link_rate="1gbit", timeout=120, out=out)
    lines = [line for line in out.getvalue().splitlines() if " probe " in line]
    # rank 3 failed: its node's torchrun exits 1 (naming exit code 3), node 0's would hang at
    # torchrun's exit barrier and is stopped; the worst status wins
    assert rc == 1, out.getvalue()
    assert "exitcode  : 3" in out.getvalue()
    assert sorted(lines) == sorted([
        "[node 0] probe rank=0 group=0 lws=2 host=node0 if=node0 shm=0",
        "[node 0] probe rank=1 group=0 lws=2 host=node0 if=node0 shm=0",
        "[node 1] probe rank=2 group=1 lws=2 host=node1 if=node1 shm=0",
        "[node 1] probe rank=3 group=1 lws=2 host=node1 if=node1 shm=0",
    ]), out.getvalue()
    assert cluster.leftovers(os.getpid()) == []
    assert not any(name.startswith("mark-") for name in os.listdir("/dev/shm"))


def _start_sleeping_cluster(nodes=3):
    """A launcher process whose nodes all run `sleep`; returns it once every node sleeps."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardkit", "cluster", "--nodes", str(nodes), "--link-rate",
         "none", "--", "--no-python", "sleep", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    deadline = time.time() + 60
    while time.time() < deadline and launcher.poll() is None:
        if _count_sleeping(cluster.leftovers(launcher.pid)) == nodes:
            return launcher
        time.sleep(0.2)
    launcher.terminate()  # the launcher removes what it built
    launcher.wait(30)
    raise AssertionError(f"the nodes did not start (launcher status {launcher.returncode})")


def _count_sleeping(found: list) -> int:
    count = 0
    for item in found:
        if item.startswith("process"):
            try:
                with open(f"/proc/{item.split()[1]}/comm") as f:
                    count += f.read().strip() == "sleep"
            except OSError:  # it ended since it was listed
                pass
    return count


@needs_cluster
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                        (signal.SIGINT, 130)])
def test_signal_to_launcher_removes_everything(sig, status):
    launcher = _start_sleeping_cluster()
    try:
        assert any(f.startswith("namespace") for f in cluster.leftovers(launcher.pid))
        launcher.send_signal(sig)
        assert launcher.wait(60) == status
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert cluster.leftovers(launcher.pid) == []


@needs_cluster
def test_what_a_killed_launcher_left_is_removed_by_the_next():
    launcher = _start_sleeping_cluster(nodes=2)
    launcher.kill()  # SIGKILL: no clean-up runs
    launcher.wait()
    assert cluster.leftovers(launcher.pid) != []
    removed = cluster.remove_stale()  # what every launch does first
    assert cluster.leftovers(launcher.pid) == []
    prefix = cluster.name_prefix(launcher.pid)
    assert {f"{prefix}n0", f"{prefix}n1"} <= set(removed)


# node 1's ranks fail at once; node 0's ranks report a few seconds later (as ranks waiting for
# shardkit.fault's verdict on a lost peer do), longer than the launcher's 5 s grace
# node 1 fails at once; on node 0, rank 0 reports after 8 s and succeeds, rank 1 reports after
# 10 s and fails (if both failed, node 0's torchrun would stop the second one as soon as it saw
# the first exit, which under load came before the second had printed)
_LATE_REPORT = ("if [ $GROUP_RANK -eq 1 ]; then exit 3; fi; "
                "if [ $LOCAL_RANK -eq 0 ]; then sleep 8; echo reported rank=$RANK; exit 0; fi; "
                "sleep 10; echo reported rank=$RANK; exit 75")


@needs_cluster
def test_nodes_whose_ranks_still_run_may_report_after_another_node_fails():
    # before: node 0 was stopped 5 s after node 1 failed, and its ranks' report was lost
    out = io.StringIO()
    rc = run_cluster(["--no-python", "sh", "-c", _LATE_REPORT], nodes=2, nproc_per_node=2,
                     link_rate="none", timeout=120, out=out)
    assert rc == 1, out.getvalue()
    assert "[node 0] reported rank=0" in out.getvalue(), out.getvalue()
    assert "[node 0] reported rank=1" in out.getvalue(), out.getvalue()
    assert "exitcode  : 75" in out.getvalue(), out.getvalue()
    assert cluster.leftovers(os.getpid()) == []


def test_launch_without_the_tools_is_a_clear_error(monkeypatch):
    # before: FileNotFoundError "No such file or directory: 'ip'" from the first `ip netns list`
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "ip" else "/bin/x")
    with pytest.raises(RuntimeError, match="needs ip on PATH"):
        run_cluster(["x.py"], nodes=2)


# one write per line (text and newline together): two ranks of a node share one pipe, and a
# print's separate write of its newline let a peer's line land in between (seen once in CI)
_GROUPS_BY_HOST = """
import os, socket
from shardkit import distributed as d
d.init_distributed()
intra, inter = d.node_groups()
hosts = d.all_gather_object(socket.gethostname())
line = (f"topo rank={d.get_rank()} host={hosts[d.get_rank()]} "
        f"intra={[hosts[r] for r in d.group_ranks(intra)]} "
        f"inter={[hosts[r] for r in d.group_ranks(inter)]}\\n")
os.write(1, line.encode())
d.destroy()
"""


@needs_cluster
def test_node_groups_follow_the_hosts_when_ranks_are_numbered_round_robin():
    # srun --distribution=cyclic numbering: ranks 0 and 2 on node0, 1 and 3 on node1. Before,
    # ranks 1 and 2 raised and ranks 0 and 3 waited for them (a hang), or, without
    # GROUP_RANK, the "intra-node" group [0, 1] crossed the link
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, SHARDKIT_TEST_CODE=_GROUPS_BY_HOST)
    cyclic = 'export RANK=$((LOCAL_RANK * GROUP_WORLD_SIZE + GROUP_RANK)); '
    for drop in ("", "unset GROUP_RANK; "):
        out = io.StringIO()
        rc = run_cluster(["--no-python", "sh", "-c", cyclic + drop + 'exec "$0" -c '
                          '"$SHARDKIT_TEST_CODE"', sys.executable], nodes=2, nproc_per_node=2,
                         link_rate="none", env=env, timeout=180, out=out)
        lines = sorted(line.split("] ", 1)[1] for line in out.getvalue().splitlines()
                       if "] topo " in line)
        assert rc == 0 and lines == [
            "topo rank=0 host=node0 intra=['node0', 'node0'] inter=['node0', 'node1']",
            "topo rank=1 host=node1 intra=['node1', 'node1'] inter=['node0', 'node1']",
            "topo rank=2 host=node0 intra=['node0', 'node0'] inter=['node0', 'node1']",
            "topo rank=3 host=node1 intra=['node1', 'node1'] inter=['node0', 'node1']",
        ], (drop, out.getvalue()[-3000:])


@needs_cluster
def test_one_node_cluster_runs():
    # before: `ip link add node0 type dummy` failed ("Unknown device type") on kernels without
    # the dummy module, so --nodes 1 never started
    out = io.StringIO()
    rc = run_cluster(["--no-python", "sh", "-c", "echo one rank=$RANK host=$(hostname)"],
                     nodes=1, nproc_per_node=1, link_rate="none", timeout=60, out=out)
    assert rc == 0 and "[node 0] one rank=0 host=node0" in out.getvalue(), out.getvalue()
    assert cluster.leftovers(os.getpid()) == []
