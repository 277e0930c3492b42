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
