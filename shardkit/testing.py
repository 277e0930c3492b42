"""Multi-process test helpers: a reusable world of N gloo processes, and reference models.

Starting processes dominates test time on a small machine, so a :class:`World` starts its ranks
once and runs many test bodies inside them::

    @pytest.fixture(scope="module")
    def world2():
        with World(2) as w:
            yield w

    def _check_sum(scale):            # module-level, so the ranks can import it
        t = torch.ones(3) * scale
        shardkit.distributed.all_reduce(t)
        return t.tolist()

    def test_sum(world2):
        assert world2.run(_check_sum, 2.0) == [[4.0] * 3] * 2

``World.run(fn, *args)`` calls ``fn`` on every rank and returns the per-rank results. If a rank
raises, or the ranks do not finish within ``timeout``, it raises :class:`WorldError` carrying
every rank's traceback (hung ranks dump their stacks), tears the world down, and the next
``run`` starts a fresh one. No test ever hangs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import tempfile
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

# re-exported
from shardkit.cluster import SimulatedCluster, cluster_unavailable_reason, run_cluster
from shardkit.models import GPT, GPTConfig, MLP, Block, reference_gpt_config  # re-exported

__all__ = ["World", "WorldError", "free_port", "patched_environ", "world_fixture",
           "node_and_local_rank", "GPT",
           "GPTConfig", "MLP", "Block",
           "reference_gpt_config", "run_in_world", "SimulatedCluster", "cluster_unavailable_reason",
           "run_cluster", "process_context", "import_only_torch_in_the_fork_server",
           "CountedControlGathers"]

_DEFAULT_TIMEOUT = float(os.environ.get("SHARDKIT_TEST_TIMEOUT", "240"))
# seconds the other ranks get to finish once one has failed (World's failure_grace_s)
_FAILURE_GRACE_S = 5.0


class WorldError(AssertionError):
    """A test body failed or timed out on one or more ranks; the message holds every traceback."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CountedControlGathers:
    """Within the block, the names of the control all-gathers (``shardkit.distributed``'s
    agreements: ``_gather_rows``) this rank makes, in ``names``; ``count`` is how many. For
    tests that check how many exchanges a step costs. Local."""

    def __enter__(self):
        from shardkit import distributed
        self.names, self._original = [], distributed._gather_rows

        def counted(what, *args, **kwargs):
            self.names.append(what)
            return self._original(what, *args, **kwargs)
        distributed._gather_rows = counted
        return self

    @property
    def count(self) -> int:
        """How many control all-gathers were counted so far."""
        return len(self.names)

    def __exit__(self, *_):
        from shardkit import distributed
        distributed._gather_rows = self._original


@contextlib.contextmanager
def patched_environ(**values: Optional[str]):
    """Set environment variables for the block (``None`` removes one) and restore every one of
    them afterwards, as it was. For test bodies that run inside a :class:`World`'s ranks, where
    pytest's ``monkeypatch`` does not reach."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# What the fork server imports (why: process_context). torch and torch._dynamo read a few of
# their settings (TORCH_LOGS, TORCHDYNAMO_*) from the environment at import: a rank sees those
# as the fork server read them; triton's are read when used, and shardkit's one
# (SHARDKIT_DEBUG_COLLECTIVES) again by each rank (_worker). shardkit's wrappers, and the torch
# modules they and the tests use, are about 0.5 s of imports a rank would otherwise repeat.
# Triton kernels are not among them: they are defined when first used.
_TORCH_ONLY = ("torch", "torch._dynamo")
_PRELOAD = [*_TORCH_ONLY, "torch.distributed.checkpoint", "torch.distributed.pipelining",
            "torch.distributed.algorithms.ddp_comm_hooks", "shardkit.distributed",
            "shardkit.nn.data_parallel.fully_sharded", "shardkit.nn.data_parallel.sharded_ddp",
            "shardkit.optim.oss", "shardkit.engine", "shardkit.nn.pipe", "shardkit.fault"]


def import_only_torch_in_the_fork_server() -> None:
    """Make the fork server of :func:`process_context` import only torch and ``torch._dynamo``
    (not shardkit's wrappers), so each rank imports shardkit itself, into its own memory, as a
    process started by torchrun does. For benchmarks that must time steps as real launches run
    them; tests keep the default (about 0.5 s less per rank start). Call it before the first
    :class:`World` of the process starts: the fork server starts once."""
    _PRELOAD[:] = _TORCH_ONLY


def process_context():
    """The multiprocessing context that test ranks start from.

    A fork server that has imported ``_PRELOAD``, where the platform has one: each
    rank is a fork of a clean process in which no op has run (so no intra-op thread pool
    exists), and starting a world costs a fraction of a second instead of one torch import per
    rank (about 5 s on a small machine, and 2.5 s more for ``torch._dynamo``, which torch's DDP
    and shardkit's wrappers import when first built). Elsewhere it is ``spawn``. Either way a
    rank sees the environment the parent had when the world started (see :class:`World`), not
    the fork server's.

    Cost: the fork server lives as long as the calling process and holds what it imported
    (about 400 MB resident with torch, ``torch._dynamo`` and shardkit's wrappers on CPU); the
    ranks share those pages copy-on-write. No communication."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def node_and_local_rank(rank: int, world_size: int, per_node: int,
                        placement: str = "block") -> tuple[int, int]:
    """``(GROUP_RANK, LOCAL_RANK)`` of global ``rank`` on nodes of ``per_node`` ranks:
    ``"block"`` numbers the ranks node by node, as torchrun does; ``"round_robin"`` deals them
    over the nodes in turn, as srun's cyclic distribution does (rank 1 on the second node)."""
    if placement == "round_robin":
        nodes = world_size // per_node
        return rank % nodes, rank // nodes
    return rank // per_node, rank % per_node


def _worker(rank: int, world_size: int, port: int, tasks, results, stack_file: str,
            threads: int, env: dict, per_node: int, placement: str = "block") -> None:
    os.environ.clear()  # the parent's environment at start(), as a spawned process would get
    os.environ.update(env)
    node, local = node_and_local_rank(rank, world_size, per_node, placement)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(per_node),
                       "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    dump = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    import torch

    torch.set_num_threads(threads)
    from shardkit import collective_check, distributed
    collective_check.set_debug_collectives(collective_check.enabled_by_environment())

    try:
        distributed.init_distributed(backend="gloo", timeout_s=_DEFAULT_TIMEOUT)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            out = fn(*args, **kwargs)
            results.put((rank, True, out))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
    distributed.destroy()


_PLACEMENTS = ("block", "round_robin")


class World:
    """``world_size`` gloo processes started once and reused for many test bodies.

    Args:
        world_size: number of ranks (>= 1).
        timeout: seconds a single :meth:`run` may take before it fails with every rank's stack.
        threads: torch intra-op threads per rank (1 keeps a 2-core machine responsive).
        env: extra environment variables for the ranks (e.g. ``{"TRITON_INTERPRET": "1"}``).
        ranks_per_node: label the ranks as torchrun would on nodes of this many ranks
            (``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``), so that topology-aware code
            and ``CommCounter``'s per-link split see several nodes; every rank still runs on
            this machine (:func:`run_cluster` gives real separate nodes). Default: one node.
        placement: how the ranks are numbered over those nodes: ``"block"`` (torchrun's node
            by node, the default) or ``"round_robin"`` (srun's cyclic distribution: node
            ``rank % nodes``), see :func:`node_and_local_rank`.
        failure_grace_s: once a rank has failed in a :meth:`run`, how many more seconds the
            others get to finish (and report their results or errors) before they are taken
            for hung, their stacks dumped and the world torn down (a positive number; default
            5). Raise it when a test body's other ranks do long work that does not wait on the
            failed rank; lower it to fail faster.
    """

    def __init__(self, world_size: int, timeout: float = _DEFAULT_TIMEOUT, threads: int = 1,
                 env: Optional[dict] = None, ranks_per_node: Optional[int] = None,
                 failure_grace_s: float = _FAILURE_GRACE_S, placement: str = "block"):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"World(world_size={world_size!r}): must be an int >= 1")
        if isinstance(failure_grace_s, bool) or not isinstance(failure_grace_s, (int, float)) \
                or not 0 < failure_grace_s < math.inf:
            raise ValueError(f"World(failure_grace_s={failure_grace_s!r}): must be a positive, "
                             f"finite number of seconds (default {_FAILURE_GRACE_S})")
        per_node = world_size if ranks_per_node is None else ranks_per_node
        if not isinstance(per_node, int) or per_node < 1 or world_size % per_node:
            raise ValueError(f"World(ranks_per_node={ranks_per_node!r}): must be an int >= 1 "
                             f"that divides world_size={world_size}")
        if placement not in _PLACEMENTS:
            raise ValueError(f"World(placement={placement!r}): must be one of {_PLACEMENTS}")
        self.ranks_per_node = per_node
        self.placement = placement
        self.world_size = world_size
        self.timeout = timeout
        self.threads = threads
        self.env = dict(env or {})
        self.failure_grace_s = float(failure_grace_s)
        self._procs: list = []

    # -- life cycle
    def start(self) -> "World":
        """Start the ranks (from :func:`process_context`) and return the world; they set
        up their gloo process group while the first :meth:`run` is sent."""
        ctx = process_context()
        env = {**os.environ, **self.env}
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._stack_dir = tempfile.mkdtemp(prefix="shardkit-world-")
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world_size, port, self._tasks[r], self._results,
                              self._stack_file(r), self.threads, env, self.ranks_per_node,
                              self.placement))
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        return self

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.txt")

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove their stack-dump folder."""
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        deadline = time.time() + 10
        for p in self._procs:
            p.join(max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join(5)
        self._procs = []
        stack_dir = getattr(self, "_stack_dir", None)
        if stack_dir is not None:
            shutil.rmtree(stack_dir, ignore_errors=True)
            self._stack_dir = None

    def __enter__(self) -> "World":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running
    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by the ranks (a module-level function). Raises
        :class:`WorldError` with every failing or hung rank's traceback, and a TypeError at
        once, sending nothing, when ``fn`` or its arguments cannot be pickled (the queues'
        feeder thread would only print the error, and every rank would wait out the timeout).
        """
        try:
            ForkingPickler.dumps((fn, args, kwargs))
        except Exception as error:  # noqa: BLE001 - whatever pickling raised, named here
            raise TypeError(f"World.run({getattr(fn, '__qualname__', fn)!r}, ...): the function "
                            f"or its arguments cannot be sent to the ranks ({error}); pass a "
                            f"module-level function and picklable arguments") from error
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self.start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.time() + self.timeout
        while len(results) + len(failures) < self.world_size and time.time() < deadline:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if not p.is_alive() and r not in results and r not in failures:
                        failures[r] = f"rank {r} exited with code {p.exitcode}"
            else:
                (results if ok else failures)[rank] = value
            if failures:  # the others may be waiting on the failed rank: a short grace period
                deadline = min(deadline, time.time() + self.failure_grace_s)
        if len(results) == self.world_size:
            return [results[r] for r in range(self.world_size)]
        self._fail(fn, results, failures)

    def _fail(self, fn, results, failures) -> None:
        hung = [r for r in range(self.world_size) if r not in results and r not in failures]
        for r in hung:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except (ProcessLookupError, OSError):
                pass
        time.sleep(0.5 if hung else 0)
        parts = []
        for r in sorted(results):  # what the surviving ranks returned (e.g. an error they caught)
            parts.append(f"--- rank {r} returned:\n{results[r]!r}")
        for r in sorted(failures):
            parts.append(f"--- rank {r} raised:\n{failures[r]}")
        for r in hung:
            try:
                with open(self._stack_file(r)) as f:
                    stack = f.read().strip()
            except OSError:
                stack = "(no stack dump)"
            parts.append(f"--- rank {r} did not finish (hung or waiting on a failed rank); "
                         f"its stack:\n{stack}")
        for r in hung:  # stuck in a collective or a sleep: they would not see close()'s request
            self._procs[r].kill()
        self.close()
        name = getattr(fn, "__qualname__", repr(fn))
        raise WorldError(f"{name} failed in a world of {self.world_size}:\n" + "\n".join(parts))


def run_in_world(world_size: int, fn: Callable, *args, timeout: float = _DEFAULT_TIMEOUT,
                 **kwargs) -> list[Any]:
    """Start a world, run ``fn`` on every rank once, stop the world; returns per-rank results."""
    with World(world_size, timeout=timeout) as w:
        return w.run(fn, *args, **kwargs)


def world_fixture(world_size: int, name: Optional[str] = None, **world_kwargs):
    """A module-scoped pytest fixture named ``name`` (default ``world<N>``) yielding a started
    :class:`World`: ``world2 = world_fixture(2)`` in a test module gives its tests one shared
    world of 2 ranks."""
    import pytest

    @pytest.fixture(scope="module", name=name or f"world{world_size}")
    def world():
        with World(world_size, **world_kwargs) as w:
            yield w

    return world
