"""A simulated multi-node cluster on one Linux machine, for tests and benchmarks.

Each *node* is a network namespace with its own address, its own loopback, its own host name
(``node<i>``, also in its ``/etc/hosts``), its own process ids and its own private tmpfs on
``/dev/shm``; the nodes are joined by a veth pair (two nodes) or by a bridge that lives
in a separate "switch" namespace (more nodes), and every link can be rate-limited with a ``tbf``
queueing discipline on both directions. On each node the launcher starts
``python -m torch.distributed.run --nnodes K --node-rank i --rdzv-backend static
--master-addr <node 0> --master-port P ...`` with ``GLOO_SOCKET_IFNAME`` set to the node's
interface, so gloo's traffic between nodes crosses the slow link and nothing else does::

    python -m shardkit cluster --nodes 2 --nproc-per-node 2 --link-rate 1gbit train.py --steps 5
    bash scripts/cluster.sh --nodes 2 --link-rate 10gbit -- -m mypackage.train --steps 5

or from Python (the test suite's way)::

    from shardkit.testing import run_cluster, cluster_unavailable_reason
    rc = run_cluster(["train.py"], nodes=2, nproc_per_node=2, link_rate="1gbit")

Each node's output lines are prefixed with ``[node i]``; the launcher returns the worst exit code
of the nodes. Every namespace, link and mount it made is removed on every exit path (normal
end, a failing command, SIGINT/SIGTERM to the launcher): killing what still runs inside a
namespace and deleting the namespace removes its links, and each node's ``/dev/shm`` lives in a
mount namespace of its own that ends with its last process. Names carry the launcher's pid, so
parallel launches do not collide, and a later launch removes what a launcher killed by SIGKILL
left behind.

Why a static rendezvous: torchrun's c10d rendezvous does not recognise a namespace address as its
own host; the static one (``--master-addr`` and ``--node-rank``) needs no such guess.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip``, ``tc`` and ``unshare``;
:func:`cluster_unavailable_reason` says why not where they are missing. Costs: one torchrun per
node (about a second of start-up each) and nothing on the host's own network.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Optional, Sequence

__all__ = ["SimulatedCluster", "run_cluster", "cluster_unavailable_reason", "parse_link_rate",
           "leftovers", "remove_stale", "name_prefix", "main"]

_PREFIX = "shardkit"              # namespace names: name_prefix(launcher pid) + role
_SUBNET = "10.213.0"              # each launch has its own network stacks, so one subnet serves all
_MASTER_PORT = 29500              # free by construction inside node 0's fresh namespace
_ETC_NETNS = "/etc/netns"         # per-namespace /etc files, mounted by `ip netns exec`
_GRACE_S = 5.0                    # between SIGTERM and SIGKILL at shutdown
_PEER_TIMEOUT_S = 70.0            # shardkit.fault.DEFAULT_TIMEOUT_S (60 s) and a margin
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


# ----------------------------------------------------------------------------- checks


def parse_link_rate(text: Optional[str]) -> Optional[int]:
    """``"1gbit"``, ``"10gbit"``, ``"500mbit"`` -> bits per second; ``None``/``"none"`` -> None
    (no limit). Raises ValueError naming the value and the valid forms."""
    if text is None or str(text).lower() in ("none", "0", ""):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", str(text).strip().lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"link_rate={text!r}: expected a positive rate such as '1gbit', "
                         f"'10gbit' or '500mbit' (units {sorted(_RATE_UNITS)}), or 'none'")
    return int(float(match.group(1)) * _RATE_UNITS[match.group(2)])


def cluster_unavailable_reason() -> Optional[str]:
    """Why this machine cannot build a simulated cluster (not root, a tool missing, namespaces
    refused), or ``None`` when it can. Tries to create and delete one namespace."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"the simulated cluster needs {', '.join(missing)} on PATH (iproute2, util-linux)"
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces, tc, mounts)"
    probe = f"{name_prefix(os.getpid())}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _validate(nodes: int, nproc_per_node: int) -> None:
    if not isinstance(nodes, int) or not 1 <= nodes <= 250:
        raise ValueError(f"nodes={nodes!r}: must be an int in [1, 250]")
    if not isinstance(nproc_per_node, int) or nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node!r}: must be an int >= 1")


# ----------------------------------------------------------------------------- the network


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def _tc_limit(namespace: str, device: str, rate_bps: int) -> None:
    # burst: 1 ms at the rate, at least two 64 KiB GSO segments (a smaller burst drops them)
    burst = max(rate_bps // 8 // 1000, 128 * 1024)
    cmd = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
           "rate", str(rate_bps), "burst", str(burst), "latency", "100ms"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _pid_namespace() -> str:
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        return "0"


def name_prefix(pid: int) -> str:
    """How the names of launcher ``pid``'s namespaces begin: ``shardkit-<pid namespace>-<pid>-``
    (the pid namespace, so that a launcher never mistakes one in another pid namespace, whose
    pid it cannot see, for a dead one)."""
    return f"{_PREFIX}-{_pid_namespace()}-{pid}-"


def _owned_namespaces(pid: Optional[int] = None) -> list[str]:
    """Namespaces named by this module for launchers of this pid namespace (of launcher
    ``pid``, or of any)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    head = name_prefix(pid) if pid is not None else f"{_PREFIX}-{_pid_namespace()}-"
    return [n for n in names if n.startswith(head)]


def leftovers(pid: int) -> list[str]:
    """What a launcher with pid ``pid`` left behind: its namespaces, processes still inside them
    (a node's ``/dev/shm`` tmpfs lives in a mount namespace that ends with its last process),
    mounts on this host naming them (``/run/netns/...``) and ``/etc/netns`` entries. Empty
    after a clean exit."""
    found = []
    for namespace in _owned_namespaces(pid):
        found.append(f"namespace {namespace}")
        found += [f"process {p} in {namespace}" for p in _namespace_pids(namespace)]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if name_prefix(pid) in line]
    if os.path.isdir(_ETC_NETNS):
        found += [f"{_ETC_NETNS}/{name}" for name in os.listdir(_ETC_NETNS)
                  if name.startswith(name_prefix(pid))]
    return found


def remove_stale() -> list[str]:
    """Delete the namespaces of launchers that no longer run (killed by SIGKILL); returns them."""
    removed = []
    for namespace in _owned_namespaces():
        match = re.match(rf"{_PREFIX}-\d+-(\d+)-", namespace)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _empty_and_delete(namespace)
            removed.append(namespace)
    return removed


def _empty_and_delete(namespace: str) -> None:
    """SIGKILL every process inside ``namespace`` (repeat: a dying parent may still fork), then
    delete it; its veth ends go with it."""
    for _ in range(20):
        pids = _namespace_pids(namespace)
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    shutil.rmtree(os.path.join(_ETC_NETNS, namespace), ignore_errors=True)


class SimulatedCluster:
    """``nodes`` network namespaces on one machine, linked at ``link_rate`` (see the module doc).

    Args:
        nodes: number of nodes (1-250).
        link_rate: each node's link rate in both directions (``"1gbit"``; ``None``/``"none"``:
            unlimited, the speed of the host's veth, several GB/s).

    Use as a context manager: entering builds the namespaces, leaving kills what runs inside
    them and removes them. :meth:`popen` starts a process on a node.
    """

    def __init__(self, nodes: int, link_rate: Optional[str] = "1gbit"):
        _validate(nodes, 1)
        self.nodes = nodes
        self.rate_bps = parse_link_rate(link_rate)
        self.pid = os.getpid()
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def namespace(self, node: int) -> str:
        """The name of ``node``'s network namespace (unique to this process)."""
        return f"{name_prefix(self.pid)}n{node}"

    def address(self, node: int) -> str:
        """``node``'s IPv4 address on the simulated network (``10.213.0.<node + 1>``)."""
        return f"{_SUBNET}.{node + 1}"

    def interface(self, node: int) -> str:
        """``node``'s network interface inside its namespace, also its host name (``node<i>``)."""
        return f"node{node}"

    # -- life cycle
    def __enter__(self) -> "SimulatedCluster":
        reason = cluster_unavailable_reason()
        if reason:  # before any tool runs: a missing `ip` would be a bare FileNotFoundError
            raise RuntimeError(f"SimulatedCluster: {reason}")
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _write_hosts(self) -> None:
        """``/etc/netns/<namespace>/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``)
        names every node, so that gloo and c10d resolve peer addresses without DNS."""
        lines = ["127.0.0.1 localhost", "::1 localhost"] + [
            f"{prefix}{self.address(i)} {self.interface(i)}" for prefix in ("", "::ffff:")
            for i in range(self.nodes)]
        for node in range(self.nodes):
            folder = os.path.join(_ETC_NETNS, self.namespace(node))
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")

    def _build(self) -> None:
        for node in range(self.nodes):
            self._add_namespace(self.namespace(node))
        self._write_hosts()
        if self.nodes == 2:  # one cable
            _ip("-n", self.namespace(0), "link", "add", self.interface(0), "type", "veth",
                "peer", "name", self.interface(1), "netns", self.namespace(1))
        elif self.nodes > 2:  # a switch: a bridge in a namespace of its own
            switch = f"{name_prefix(self.pid)}sw"
            self._add_namespace(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "up")
            for node in range(self.nodes):
                port = f"port{node}"
                _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name",
                    self.interface(node), "netns", self.namespace(node))
                _ip("-n", switch, "link", "set", port, "master", "br0")
                _ip("-n", switch, "link", "set", port, "up")
                if self.rate_bps:  # the switch's side limits the traffic into the node
                    _tc_limit(switch, port, self.rate_bps)
        if self.nodes == 1:  # a veth whose other end stays inside (no `dummy` module needed)
            _ip("-n", self.namespace(0), "link", "add", self.interface(0), "type", "veth",
                "peer", "name", "unused0")
            _ip("-n", self.namespace(0), "link", "set", "unused0", "up")
        for node in range(self.nodes):
            ns, dev = self.namespace(node), self.interface(node)
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            if self.rate_bps and self.nodes > 1:
                _tc_limit(ns, dev, self.rate_bps)

    def popen(self, node: int, argv: Sequence[str], env: Optional[dict] = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` on ``node``: in its network namespace, in a mount namespace of its own
        with a fresh tmpfs on ``/dev/shm``, in a pid namespace of its own (``argv`` is its
        pid 1: when it ends, everything it started ends), with host name ``node<i>``, in a new
        session (so the whole tree can be
        signalled). The process is killed by :meth:`close` if still running."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node={node}: valid nodes are 0..{self.nodes - 1}")
        wrapper = ["ip", "netns", "exec", self.namespace(node),
                   "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
                   "--kill-child", "--propagation", "private", "--",
                   "sh", "-c", f'mount -t tmpfs -o mode=1777 shm /dev/shm && '
                   f'hostname {self.interface(node)} && exec "$@"', "node"]
        proc = subprocess.Popen(wrapper + list(argv), env=env, start_new_session=True,
                                **popen_kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop every process started on the nodes (SIGTERM, then SIGKILL after a grace period)
        and delete the namespaces. Idempotent; safe to call from any exit path."""
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            _signal_group(p, signal.SIGTERM)
        deadline = time.time() + _GRACE_S
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
        for name in reversed(self._made):
            _empty_and_delete(name)
        for p in self._procs:
            try:
                p.wait(_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        self._made, self._procs = [], []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------- torchrun on it


def torchrun_argv(cluster: SimulatedCluster, node: int, nproc_per_node: int,
                  command: Sequence[str]) -> list[str]:
    """The torchrun command line for ``node``: a static rendezvous at node 0's address."""
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(cluster.nodes), "--node-rank", str(node),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "static",
            "--master-addr", cluster.address(0), "--master-port", str(_MASTER_PORT),
            *command]


def _pump(stream: IO[bytes], label: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out.write(f"{label} {line}\n")
            out.flush()
    stream.close()


def _exit_status(code: Optional[int]) -> int:
    if code is None:
        return 124
    return 128 - code if code < 0 else code


def run_cluster(command: Sequence[str], nodes: int = 2, nproc_per_node: int = 1,
                link_rate: Optional[str] = "1gbit", env: Optional[dict] = None,
                timeout: Optional[float] = None, out: Optional[IO[str]] = None) -> int:
    """Run ``command`` (what follows torchrun's options: ``["train.py", "--lr", "1e-3"]``,
    ``["-m", "pkg.mod"]`` or ``["--no-python", "prog"]``) on a simulated cluster of ``nodes``
    nodes with ``nproc_per_node`` ranks each; returns the worst exit status of the nodes (124
    when ``timeout`` seconds pass first; 128+N for a node ended by signal N).

    Output goes to ``out`` (default stdout), each line prefixed with ``[node i]``. SIGINT and
    SIGTERM to this process stop the nodes and remove the cluster before it exits.
    """
    _validate(nodes, nproc_per_node)
    if timeout is not None and (isinstance(timeout, bool) or not (
            isinstance(timeout, (int, float)) and timeout > 0)):
        raise ValueError(f"timeout={timeout!r}: must be a number of seconds > 0, or None")
    if not command:
        raise ValueError("command=[]: give the script (and its arguments) to run on every node")
    out = out or sys.stdout
    base_env = dict(os.environ if env is None else env)
    with _StopSignals() as stop:
        with SimulatedCluster(nodes, link_rate) as cluster:
            lock = threading.Lock()
            procs, pumps = [], []
            for node in range(nodes):
                if stop.received:
                    break
                node_env = dict(base_env, GLOO_SOCKET_IFNAME=cluster.interface(node),
                                TP_SOCKET_IFNAME=cluster.interface(node))
                proc = cluster.popen(node, torchrun_argv(cluster, node, nproc_per_node, command),
                                     env=node_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
                pump = threading.Thread(target=_pump, daemon=True,
                                        args=(proc.stdout, f"[node {node}]", out, lock))
                pump.start()
                procs.append(proc)
                pumps.append(pump)
            codes = _wait_all(procs, timeout, stop, _peer_timeout_from(base_env))
            if not stop.received:
                for pump in pumps:
                    pump.join(2.0)
        stop.raise_if_received()  # after the cluster is gone
        return max(codes)


def _wait_all(procs: list, timeout: Optional[float], stop: "_StopSignals",
              peer_timeout_s: float = _PEER_TIMEOUT_S) -> list[int]:
    """Wait for every node and return its exit status. Once a node fails, the others get
    ``_GRACE_S`` to fail or finish on their own (torchrun's agents would otherwise wait for the
    failed node at their exit barrier), or, while their ranks still run, up to
    ``peer_timeout_s`` more (so that ranks waiting for :mod:`shardkit.fault`'s verdict can
    report the lost rank); then they are stopped and reported as 0, so that the status is the
    failing node's own; after ``timeout`` the unfinished report 124. Returns at once when
    ``stop`` has received a signal."""
    deadline = None if timeout is None else time.time() + timeout
    failed_at = None
    while any(p.poll() is None for p in procs) and not stop.received:
        now = time.time()
        if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
            failed_at = now
        if deadline is not None and now > deadline:
            break
        if failed_at is not None and now > failed_at + _GRACE_S and (
                now > failed_at + _GRACE_S + peer_timeout_s
                or not any(_runs_ranks(p) for p in procs if p.poll() is None)):
            break
        time.sleep(0.1)
    codes = [p.poll() for p in procs]
    stopped_after_failure = failed_at is not None and (deadline is None or time.time() <= deadline)
    unfinished = 0 if stopped_after_failure else 124
    return [unfinished if c is None else _exit_status(c) for c in codes]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except (OSError, ValueError):  # gone, or a kernel without the children file
        return []


def _runs_ranks(node: subprocess.Popen) -> bool:
    """Whether ``node``'s torchrun (the child of its ``unshare``) still has worker processes,
    as opposed to waiting alone at its exit barrier."""
    return any(_children(agent) for agent in _children(node.pid))


def _peer_timeout_from(env: dict) -> float:
    """How long ranks may wait for the peer watchdog's verdict: ``SHARDKIT_PEER_TIMEOUT`` as
    the ranks will see it, else :data:`shardkit.fault.DEFAULT_TIMEOUT_S`, plus a margin."""
    try:
        return float(env.get("SHARDKIT_PEER_TIMEOUT", _PEER_TIMEOUT_S - 10.0)) + 10.0
    except ValueError:
        return _PEER_TIMEOUT_S


class _StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM to the launcher are only recorded:
    the wait loop sees them and the cluster is taken down in the normal flow of the code, then
    :meth:`raise_if_received` raises KeyboardInterrupt (SIGINT) or SystemExit(143) (SIGTERM).
    An exception raised from inside a signal handler could land in ``subprocess``'s own
    bookkeeping (between taking and releasing a ``Popen``'s wait lock) and leave a node that
    can no longer be waited for. A second signal while the first is handled raises at once."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.received is not None:  # the user insists
            raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(128 + signum)
        self.received = signum

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def raise_if_received(self) -> None:
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is not None:
            raise SystemExit(128 + self.received)


# ----------------------------------------------------------------------------- command line


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m shardkit cluster [--nodes K] [--nproc-per-node N] [--link-rate R]
    [--timeout S] [--] COMMAND...``; returns the worst exit status of the nodes."""
    parser = argparse.ArgumentParser(
        prog="python -m shardkit cluster",
        description="Run a torchrun job on a simulated cluster of network namespaces.")
    parser.add_argument("--nodes", type=int, default=2,
                        help="simulated nodes, each a network namespace (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="torchrun processes on each node (default 1)")
    parser.add_argument("--link-rate", default="1gbit",
                        help="per-node link rate, e.g. 1gbit, 10gbit, 500mbit, or none "
                             "(default 1gbit)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds; exit 124 after (default: none)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="script and arguments (or -m module ...) for torchrun")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give a command to run on every node (e.g. `train.py --steps 5`)")
    try:
        parse_link_rate(args.link_rate)
        _validate(args.nodes, args.nproc_per_node)
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError(f"--timeout={args.timeout:g}: must be a number of seconds > 0")
    except ValueError as err:
        parser.error(str(err))
    reason = cluster_unavailable_reason()
    if reason:
        print(f"python -m shardkit cluster: {reason}", file=sys.stderr)
        return 1
    try:
        return run_cluster(command, nodes=args.nodes, nproc_per_node=args.nproc_per_node,
                           link_rate=args.link_rate, timeout=args.timeout)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
