"""The simulated-cluster launcher: runs torchrun on every node, reports the worst exit status,
gives each node its own address, host name and /dev/shm, and leaves nothing behind on any exit
path (a failing command, SIGTERM to the launcher)."""

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from shardkit import cluster
from shardkit.testing import cluster_unavailable_reason, run_cluster
from tests.utils import side_by_side

_REASON = cluster_unavailable_reason()
needs_cluster = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each launch below mostly waits (torchrun start-ups, a node's ranks that sleep, the launcher's
# grace after a failure), so the module-scoped ``launched`` fixture runs every selected one side
# by side, a bounded number at a time (tests.utils.side_by_side); each test checks what its
# launch observed, or runs it alone when the fixture did not launch it. A launch through
# run_cluster() runs in a process of its own (_RUN_CLUSTER): the cluster's names carry the
# launcher's pid, so launches from one process could not run at once.

_RUN_CLUSTER = """
import io, json, os, sys
sys.path.insert(0, sys.argv[2])
from shardkit import cluster
kwargs = json.loads(sys.argv[1])
out = io.StringIO()
rc = cluster.run_cluster(out=out, **kwargs)
print(json.dumps({"rc": rc, "out": out.getvalue(), "leftovers": cluster.leftovers(os.getpid())}))
"""


def _run_cluster_alone(environ, command, **kwargs):
    """``run_cluster(command, out=StringIO(), **kwargs)`` in a process of its own (whose
    environment is ``environ``): ``{"rc": its status, "out": its output, "leftovers":
    cluster.leftovers() of that process once run_cluster returned}``."""
    proc = subprocess.run([sys.executable, "-c", _RUN_CLUSTER, json.dumps(dict(
        kwargs, command=command)), _ROOT], env=environ, capture_output=True, text=True,
        timeout=kwargs.get("timeout", 120) + 60)
    assert proc.returncode == 0 and proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


# one shell line per rank: what it can see of its node (shm: files in /dev/shm other than the
# node's own marks: a fresh tmpfs has none), then an exit status chosen by rank. The marks are
# named for this run only: the host's /dev/shm is checked for them alone, not for another
# job's files
_MARK = f"shardkit-test-mark-{uuid.uuid4().hex[:12]}-"
_PROBE = ("echo probe rank=$RANK group=$GROUP_RANK lws=$LOCAL_WORLD_SIZE host=$(hostname) "
          f"if=$GLOO_SOCKET_IFNAME shm=$(ls /dev/shm | grep -vc ^{_MARK}); "
          f"touch /dev/shm/{_MARK}$RANK; [ $RANK -eq 3 ] && exit 3; exit 0")


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


def _probe_scenario(environ):
    return _run_cluster_alone(environ, ["--no-python", "sh", "-c", _PROBE], nodes=2,
                              nproc_per_node=2, link_rate="1gbit", timeout=120)


@needs_cluster
def test_nodes_are_separate_and_worst_status_returned_and_nothing_left(launched):
    got = side_by_side.result(launched, "probe", lambda: _probe_scenario(dict(os.environ)))
    rc, out = got["rc"], got["out"]
    lines = [line for line in out.splitlines() if " probe " in line]
    # rank 3 failed: its node's torchrun exits 1 (naming exit code 3), node 0's would hang at
    # torchrun's exit barrier and is stopped; the worst status wins
    assert rc == 1, out
    assert "exitcode  : 3" in out
    assert sorted(lines) == sorted([
        "[node 0] probe rank=0 group=0 lws=2 host=node0 if=node0 shm=0",
        "[node 0] probe rank=1 group=0 lws=2 host=node0 if=node0 shm=0",
        "[node 1] probe rank=2 group=1 lws=2 host=node1 if=node1 shm=0",
        "[node 1] probe rank=3 group=1 lws=2 host=node1 if=node1 shm=0",
    ]), out
    assert got["leftovers"] == []  # of the process that called run_cluster
    assert not any(name.startswith(_MARK) for name in os.listdir("/dev/shm"))


def _start_sleeping_cluster(environ, nodes=3):
    """A launcher process whose nodes all run `sleep`; returns it once every node sleeps."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardkit", "cluster", "--nodes", str(nodes), "--link-rate",
         "none", "--", "--no-python", "sleep", "120"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(environ))
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


def _signal_scenario(sig, environ):
    launcher = _start_sleeping_cluster(environ)
    try:
        got = {"while_running": cluster.leftovers(launcher.pid)}
        launcher.send_signal(sig)
        got["status"] = launcher.wait(60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    got["after"] = cluster.leftovers(launcher.pid)
    return got


@needs_cluster
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 128 + signal.SIGTERM),
                                        (signal.SIGINT, 130)])
def test_signal_to_launcher_removes_everything(launched, sig, status):
    got = side_by_side.result(launched, f"signal{int(sig)}",
                              lambda: _signal_scenario(sig, dict(os.environ)))
    assert any(f.startswith("namespace") for f in got["while_running"])
    assert got["status"] == status
    assert got["after"] == []


def _killed_launcher_scenario(environ):
    """Runs alone (no other launch starts meanwhile: each launch's remove_stale() would remove
    what the killed launcher left before it is looked at)."""
    launcher = _start_sleeping_cluster(environ, nodes=2)
    launcher.kill()  # SIGKILL: no clean-up runs
    launcher.wait()
    got = {"pid": launcher.pid, "after_kill": cluster.leftovers(launcher.pid)}
    got["removed"] = cluster.remove_stale()  # what every launch does first
    got["after_removal"] = cluster.leftovers(launcher.pid)
    return got


@needs_cluster
def test_what_a_killed_launcher_left_is_removed_by_the_next(launched):
    got = side_by_side.result(launched, "killed_launcher",
                              lambda: _killed_launcher_scenario(dict(os.environ)))
    assert got["after_kill"] != []
    assert got["after_removal"] == []
    prefix = cluster.name_prefix(got["pid"])
    assert {f"{prefix}n0", f"{prefix}n1"} <= set(got["removed"])


# node 1's ranks fail at once; node 0's ranks report a few seconds later (as ranks waiting for
# shardkit.fault's verdict on a lost peer do), longer than the launcher's 5 s grace
# node 1 fails at once; on node 0, rank 0 reports after 8 s and succeeds, rank 1 reports after
# 10 s and fails (if both failed, node 0's torchrun would stop the second one as soon as it saw
# the first exit, which under load came before the second had printed)
_LATE_REPORT = ("if [ $GROUP_RANK -eq 1 ]; then exit 3; fi; "
                "if [ $LOCAL_RANK -eq 0 ]; then sleep 8; echo reported rank=$RANK; exit 0; fi; "
                "sleep 10; echo reported rank=$RANK; exit 75")


def _late_report_scenario(environ):
    return _run_cluster_alone(environ, ["--no-python", "sh", "-c", _LATE_REPORT], nodes=2,
                              nproc_per_node=2, link_rate="none", timeout=120)


@needs_cluster
def test_nodes_whose_ranks_still_run_may_report_after_another_node_fails(launched):
    # before: node 0 was stopped 5 s after node 1 failed, and its ranks' report was lost
    got = side_by_side.result(launched, "late_report",
                              lambda: _late_report_scenario(dict(os.environ)))
    rc, out = got["rc"], got["out"]
    assert rc == 1, out
    assert "[node 0] reported rank=0" in out, out
    assert "[node 0] reported rank=1" in out, out
    assert "exitcode  : 75" in out, out
    assert got["leftovers"] == []  # of the process that called run_cluster


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


_DROPS = {"groups": "", "groups_without_group_rank": "unset GROUP_RANK; "}


def _groups_scenario(drop, environ):
    env = dict(environ, PYTHONPATH=_ROOT, SHARDKIT_TEST_CODE=_GROUPS_BY_HOST)
    cyclic = 'export RANK=$((LOCAL_RANK * GROUP_WORLD_SIZE + GROUP_RANK)); '
    return _run_cluster_alone(environ, ["--no-python", "sh", "-c", cyclic + drop + 'exec "$0" -c '
                                        '"$SHARDKIT_TEST_CODE"', sys.executable], nodes=2,
                              nproc_per_node=2, link_rate="none", env=env, timeout=180)


@needs_cluster
def test_node_groups_follow_the_hosts_when_ranks_are_numbered_round_robin(launched):
    # srun --distribution=cyclic numbering: ranks 0 and 2 on node0, 1 and 3 on node1. Before,
    # ranks 1 and 2 raised and ranks 0 and 3 waited for them (a hang), or, without
    # GROUP_RANK, the "intra-node" group [0, 1] crossed the link
    for name, drop in _DROPS.items():
        got = side_by_side.result(launched, name,
                                  lambda: _groups_scenario(drop, dict(os.environ)))
        rc, out = got["rc"], got["out"]
        lines = sorted(line.split("] ", 1)[1] for line in out.splitlines()
                       if "] topo " in line)
        assert rc == 0 and lines == [
            "topo rank=0 host=node0 intra=['node0', 'node0'] inter=['node0', 'node1']",
            "topo rank=1 host=node1 intra=['node1', 'node1'] inter=['node0', 'node1']",
            "topo rank=2 host=node0 intra=['node0', 'node0'] inter=['node0', 'node1']",
            "topo rank=3 host=node1 intra=['node1', 'node1'] inter=['node0', 'node1']",
        ], (drop, out[-3000:])


def _one_node_scenario(environ):
    return _run_cluster_alone(environ, ["--no-python", "sh", "-c",
                                        "echo one rank=$RANK host=$(hostname)"],
                              nodes=1, nproc_per_node=1, link_rate="none", timeout=60)


@needs_cluster
def test_one_node_cluster_runs(launched):
    # before: `ip link add node0 type dummy` failed ("Unknown device type") on kernels without
    # the dummy module, so --nodes 1 never started
    got = side_by_side.result(launched, "one_node", lambda: _one_node_scenario(dict(os.environ)))
    rc, out = got["rc"], got["out"]
    assert rc == 0 and "[node 0] one rank=0 host=node0" in out, out
    assert got["leftovers"] == []  # of the process that called run_cluster


# name: (weight: processes that import torch at once, scenario(environment)), the longest
# waits first; the killed launcher runs alone (its weight is the capacity), before the others
_CAPACITY = 10
_SCENARIOS = {
    "killed_launcher": (_CAPACITY, _killed_launcher_scenario),
    "late_report": (2, _late_report_scenario),
    "probe": (2, _probe_scenario),
    **{name: (6, functools.partial(_groups_scenario, drop)) for name, drop in _DROPS.items()},
    f"signal{int(signal.SIGTERM)}": (3, functools.partial(_signal_scenario, signal.SIGTERM)),
    f"signal{int(signal.SIGINT)}": (3, functools.partial(_signal_scenario, signal.SIGINT)),
    "one_node": (1, _one_node_scenario),
}
_SCENARIOS_OF_TEST = {
    "test_nodes_are_separate_and_worst_status_returned_and_nothing_left": ["probe"],
    "test_signal_to_launcher_removes_everything": lambda p: [f"signal{int(p['sig'])}"],
    "test_what_a_killed_launcher_left_is_removed_by_the_next": ["killed_launcher"],
    "test_nodes_whose_ranks_still_run_may_report_after_another_node_fails": ["late_report"],
    "test_node_groups_follow_the_hosts_when_ranks_are_numbered_round_robin": list(_DROPS),
    "test_one_node_cluster_runs": ["one_node"],
}


@pytest.fixture(scope="module")
def launched(request):
    """Every launch (``_SCENARIOS``) that this module's selected tests need, started at once,
    at most ``_CAPACITY`` weight at a time."""
    wanted = side_by_side.selected_names(request, __name__, _SCENARIOS_OF_TEST)
    if _REASON is not None or not wanted:
        yield None
        return
    environ = dict(os.environ)
    launched = side_by_side.SideBySide(
        {name: (weight, functools.partial(scenario, environ))
         for name, (weight, scenario) in _SCENARIOS.items() if name in wanted},
        _CAPACITY).start()
    yield launched
    launched.wait_all()
