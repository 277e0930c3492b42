"""The fault matrix: a rank SIGKILLed in forward, backward, the optimizer step or a checkpoint
write, under DDP + OSS, ShardedDDP, FSDP, a 1F1B pipeline and ``shardkit.initialize``.

Every survivor must exit with status ``PEER_LOST_EXIT_CODE`` and a message naming the lost rank
(the peer watchdog of :mod:`shardkit.fault`, here with a 4 s timeout), and the checkpoint saved
before the fault must still be ``latest`` and load. Ranks are plain processes forked from the
fork server of :func:`shardkit.testing.process_context` (torch imported), so a case costs a few
seconds."""

import os
import signal
import sys
import time

import pytest
import torch
import torch.nn as nn

from shardkit.testing import free_port, process_context

PEER_TIMEOUT_S = 4.0  # 2 s saw healthy ranks starved that long on a loaded 2-core VM
WRAPPERS = ("ddp_oss", "sharded_ddp", "fsdp", "pipeline", "initialize")
PHASES = ("forward", "backward", "optimizer_step", "checkpoint_write")
VICTIM_STEP = 1
STALL_PG_TIMEOUT_S = 10.0  # the process-group timeout of the stalling case
STALL_S = 40.0  # how long its victim stalls: longer than the case's guard can wait


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


class _Build:
    """What a case trains: ``step(i)`` runs one step, ``save(dir, tag)`` writes a checkpoint,
    ``first_layer`` and ``optimizer`` are where the kill hooks go."""

    def __init__(self, wrapper, rank, world):
        from shardkit.optim import OSS
        self.rank, self.world, self.wrapper = rank, world, wrapper
        model = _model()
        self.first_layer = model[0]
        self.loss_fn = nn.functional.mse_loss
        self.engine = None
        if wrapper == "ddp_oss":
            self.optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
            self.model = nn.parallel.DistributedDataParallel(model)
        elif wrapper == "sharded_ddp":
            from shardkit.nn.data_parallel import ShardedDataParallel
            self.optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
            self.model = ShardedDataParallel(model, self.optimizer)
        elif wrapper == "fsdp":
            from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
            self.model = FSDP(model)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        elif wrapper == "pipeline":
            from shardkit.nn.pipe import PipelineStage, Schedule1F1B, split_sequential
            parts = split_sequential(model, [2, 3] if world == 2 else [1] * world)
            self.model = parts[rank]
            self.first_layer = self.model[0]
            stage = PipelineStage(self.model, rank, world)
            self.schedule = Schedule1F1B(stage, 2, self.loss_fn)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        else:
            import shardkit
            self.engine, self.optimizer, _, _ = shardkit.initialize(model=model, config={
                "train_batch_size": 4 * world, "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}},
                peer_timeout_s=PEER_TIMEOUT_S)

    def step(self, i):
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)
        if self.wrapper == "pipeline":
            self.schedule.step(x, target=y)
            self.optimizer.step()
            self.optimizer.zero_grad()
        elif self.engine is not None:
            self.engine.backward(self.loss_fn(self.engine(x), y))
            self.engine.step()
        else:
            self.loss_fn(self.model(x), y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()

    def save(self, save_dir, tag):
        if self.engine is not None:
            return self.engine.save_checkpoint(save_dir, tag=tag)
        from shardkit.checkpoint.sharded import FORMAT, RankShard, commit_checkpoint
        state = self.model.local_state_dict() if self.wrapper == "fsdp" else \
            self.model.state_dict()
        params = {f"rank{self.rank}.{k}": v.detach().clone() for k, v in state.items()
                  if isinstance(v, torch.Tensor)}
        metadata = {"format": FORMAT, "tag": tag, "world_size": self.world,
                    "param_names": sorted(params)} if self.rank == 0 else None
        return commit_checkpoint(save_dir, tag, RankShard(params=params), metadata, {})

    def arm(self, phase):
        """Make the next step (or save) SIGKILL this process at ``phase``."""
        if phase == "forward":
            self.first_layer.register_forward_pre_hook(lambda *a: _die())
        elif phase == "raises":  # a bug in user code on this rank, not a kill
            def bad_batch(*args):
                raise ValueError("bad batch on this rank")
            self.first_layer.register_forward_pre_hook(bad_batch)
        elif phase == "backward":
            def kill_in_backward(module, inputs, out):
                out.register_hook(lambda grad: _die())
            self.first_layer.register_forward_hook(kill_in_backward)
        elif phase == "optimizer_step":
            inner = getattr(self.optimizer, "optim", self.optimizer)
            inner.register_step_pre_hook(lambda *a: _die())
        else:
            from shardkit.checkpoint import sharded

            def killed_while_writing(path, shard):
                with open(path, "wb") as f:
                    f.write(b"half a rank file")
                _die()
            sharded._write_rank_file = killed_while_writing


def _rank_main(wrapper, phase, victim, rank, world, port, save_dir, log_path):
    log = open(log_path, "w")
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from shardkit import distributed, fault
    # the stalling case needs a process-group timeout shorter than the stall
    distributed.init_distributed(backend="gloo",
                                 timeout_s=STALL_PG_TIMEOUT_S if phase == "stalls" else 60)
    fault.watch_peers(PEER_TIMEOUT_S)
    try:
        build = _Build(wrapper, rank, world)
        build.step(0)
        build.save(save_dir, "before")
        if rank == victim:
            build.arm(phase)
        if phase == "checkpoint_write":
            build.step(VICTIM_STEP)
            build.save(save_dir, "after")
        elif phase == "async_checkpoint_write":  # killed in the background writer thread
            build.step(VICTIM_STEP)
            build.engine.save_checkpoint(save_dir, tag="after", async_save=True)
            build.step(VICTIM_STEP + 1)
        elif phase in ("leaves_early", "stalls") and rank == victim:
            build.step(VICTIM_STEP)
            if phase == "leaves_early":  # its loop ends a step early; its script ends
                fault.stop_watching()  # what the watchdog's atexit hook does
                os._exit(0)
            time.sleep(STALL_S)  # longer than the process-group timeout
            build.step(VICTIM_STEP + 1)
            sys.stderr.write("the stalled rank was not told\n")
            os._exit(0)
        else:
            for i in range(VICTIM_STEP, VICTIM_STEP + 3):
                build.step(i)
        build.save(save_dir, "end")
        sys.stderr.write("finished without noticing the fault\n")
    except BaseException as e:
        # What Python does with a script's uncaught exception: shardkit.fault's excepthook
        # waits for the watchdog to name the lost rank (it ends the process) when the error
        # looks like a communication failure, else prints the traceback at once.
        sys.excepthook(type(e), e, e.__traceback__)
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


class _Case:
    """One launched case: its rank processes, their logs and the checkpoint directory."""

    def __init__(self, tmp_path, wrapper, phase, world=2, victim=1):
        ctx = process_context()
        self.world, self.victim = world, victim
        self.save_dir = str(tmp_path / "ckpt")
        port = free_port()
        self.logs = [str(tmp_path / f"rank{r}.log") for r in range(world)]
        self.procs = [ctx.Process(target=_rank_main, args=(wrapper, phase, victim, r, world,
                                                           port, self.save_dir, self.logs[r]))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.deadline = time.time() + 60  # a guard; survivors leave after about PEER_TIMEOUT_S

    def exited(self) -> bool:
        """Every rank has ended, or the guard has run out."""
        return time.time() > self.deadline or not any(p.is_alive() for p in self.procs)

    def finish(self) -> "_Case":
        """Wait for every rank (killing what outlives the guard)."""
        for p in self.procs:
            p.join(max(0.1, self.deadline - time.time()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()
        self.codes = [p.exitcode for p in self.procs]
        self.outputs = [open(f).read() for f in self.logs]
        return self

    def check(self) -> None:
        from shardkit.checkpoint import consolidate_checkpoint, read_latest_tag
        from shardkit.fault import PEER_LOST_EXIT_CODE
        codes, outputs, victim = self.codes, self.outputs, self.victim
        assert codes[victim] == -signal.SIGKILL, (codes, outputs)
        for r in range(self.world):
            if r == victim:
                continue
            assert codes[r] == PEER_LOST_EXIT_CODE, (r, codes, outputs[r])
            assert f"rank {victim} of {self.world} is lost" in outputs[r], outputs[r]
        assert read_latest_tag(self.save_dir) == "before"
        assert consolidate_checkpoint(self.save_dir)  # loads, checksums verified


# Cases run side by side, up to this many rank processes at a time: most of a case is its
# survivors waiting PEER_TIMEOUT_S for the watchdog, which many cases can do together (each case
# is a world of its own). A new case starts as soon as one finishes, not batch by batch.
CONCURRENT_RANKS = 8

# test name -> the (wrapper, phase, world, victim) of one of its cases, from its parameters
_CASE_OF = {
    "test_rank_killed_world2": lambda p: (p["wrapper"], p["phase"], 2, 1),
    "test_rank_killed_during_async_checkpoint_write":
        lambda p: ("initialize", "async_checkpoint_write", 2, 1),
    "test_rank_killed_world4": lambda p: (p["wrapper"], p["phase"], 4, p["victim"]),
    "test_rank_stopping_on_an_exception_is_named_at_once":
        lambda p: (p["wrapper"], "raises", 2, 1),
    "test_rank_leaving_the_loop_early_is_named_at_once":
        lambda p: (p["wrapper"], "leaves_early", 2, 1),
    "test_rank_stalled_past_the_group_timeout_is_told":
        lambda p: ("ddp_oss", "stalls", 2, 1),
}


def _key_of(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return _CASE_OF[item.originalname](params)


@pytest.fixture(scope="module")
def launched_cases(request, tmp_path_factory):
    """Every selected case of this module's kill tests, run ``CONCURRENT_RANKS`` rank processes
    at a time: ``{(wrapper, phase, world, victim): finished _Case}``."""
    wanted = [_key_of(item) for item in request.session.items
              if item.module.__name__ == __name__
              and getattr(item, "originalname", None) in _CASE_OF]
    # The stalling case lasts longest (STALL_S): it starts first and the others run beside it.
    # Its ranks only sleep or wait in a collective, so they are not counted in CONCURRENT_RANKS.
    pending = sorted(dict.fromkeys(wanted), key=lambda key: key[1] != "stalls")
    running, done = {}, {}
    try:
        while pending or running:
            busy = sum(key[2] for key in running if key[1] != "stalls")
            while pending and (not running or busy + pending[0][2] <= CONCURRENT_RANKS):
                key = pending.pop(0)
                w, p, n, v = key
                running[key] = _Case(tmp_path_factory.mktemp(f"{w}-{p}-{n}-{v}"), w, p, n, v)
                busy += n if p != "stalls" else 0
            for key, case in list(running.items()):
                if case.exited():
                    done[key] = running.pop(key).finish()
            time.sleep(0.05)
    finally:  # on an error here, leave no rank behind
        for case in running.values():
            case.deadline = 0.0
            case.finish()
    return done


def _case(launched_cases, tmp_path, wrapper, phase, world=2, victim=1) -> _Case:
    case = launched_cases.get((wrapper, phase, world, victim))
    if case is None:  # selected in a way the fixture did not see: run it alone
        case = _Case(tmp_path, wrapper, phase, world, victim).finish()
    return case


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_rank_killed_world2(launched_cases, tmp_path, wrapper, phase):
    _case(launched_cases, tmp_path, wrapper, phase).check()


def test_rank_killed_during_async_checkpoint_write(launched_cases, tmp_path):
    _case(launched_cases, tmp_path, "initialize", "async_checkpoint_write").check()


@pytest.mark.parametrize("wrapper,phase,victim", [("fsdp", "backward", 2),
                                                  ("initialize", "checkpoint_write", 3),
                                                  ("ddp_oss", "optimizer_step", 0)])
def test_rank_killed_world4(launched_cases, tmp_path, wrapper, phase, victim):
    _case(launched_cases, tmp_path, wrapper, phase, world=4, victim=victim).check()


@pytest.mark.parametrize("wrapper", ["fsdp", "initialize"])
def test_rank_stopping_on_an_exception_is_named_at_once(launched_cases, tmp_path, wrapper):
    """The victim raises instead of dying: it exits 1 with its traceback, and every survivor
    names it and its error within a beat, rather than waiting PEER_TIMEOUT_S to report an
    anonymous "connection closed" (or taking it for finished)."""
    from shardkit.fault import PEER_LOST_EXIT_CODE
    case = _case(launched_cases, tmp_path, wrapper, "raises")
    assert case.codes[1] == 1 and "ValueError: bad batch" in case.outputs[1], case.outputs[1]
    assert case.codes[0] == PEER_LOST_EXIT_CODE, (case.codes, case.outputs[0])
    assert "rank 1 of 2 is lost: it stopped on an uncaught ValueError: bad batch on this " \
           "rank" in case.outputs[0], case.outputs[0]


@pytest.mark.parametrize("wrapper", ["ddp_oss", "sharded_ddp"])
def test_rank_leaving_the_loop_early_is_named_at_once(launched_cases, tmp_path, wrapper):
    """The victim runs one step fewer and its script ends (it marks itself done). The survivor,
    inside a collective with it, used to wait out the peer timeout and then print only gloo's
    anonymous "Connection closed by peer" (the finished rank is no longer watched)."""
    case = _case(launched_cases, tmp_path, wrapper, "leaves_early")
    assert case.codes == [1, 0], (case.codes, case.outputs)
    assert "rank(s) 1 of 2 finished (marked done" in case.outputs[0], case.outputs[0]
    assert "different numbers of steps or collectives" in case.outputs[0], case.outputs[0]


def test_rank_stalled_past_the_group_timeout_is_told(launched_cases, tmp_path):
    """The victim sleeps past the process-group timeout (it still beats, so it is not lost).
    The survivor's collective times out: it says no peer died and marks that it gave up; the
    stalled rank is not stopped mid-work (it may be a legitimate rank-0 save), but its next
    collective fails naming the rank that gave up, with that rank's timeout."""
    case = _case(launched_cases, tmp_path, "ddp_oss", "stalls")
    assert case.codes == [1, 1], (case.codes, case.outputs)
    assert "a collective failed and no peer was lost within 4 s" in case.outputs[0], \
        case.outputs[0]
    assert "rank 0 of 2 stopped after its own collective failed" in case.outputs[1], \
        case.outputs[1]
    assert "Timed out" in case.outputs[1], case.outputs[1]
    assert "not told" not in case.outputs[1]


def _watchdog_across_a_new_default_group():
    """watch_peers(), then torch's destroy_process_group() and a new init_distributed() on a
    fresh port; a few beats later the ranks still run, and watch_peers() watches anew."""
    import torch.distributed as dist
    from shardkit import distributed as skdist
    from shardkit import fault
    first = fault.watch_peers(timeout_s=1.0)
    port = skdist.broadcast_object(free_port() if skdist.get_rank() == 0 else None, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    skdist.init_distributed(backend="gloo")
    time.sleep(3 * first.timeout_s)  # time enough for the old store's end to be noticed
    second = fault.watch_peers(timeout_s=1.0)
    out = (first.group_gone(), second is not first, second._thread.is_alive())
    fault.stop_watching()
    return out


def test_a_new_default_group_retires_the_watchdog_instead_of_stopping_the_job():
    """The watchdog used to take the destroyed group's store for a lost rank 0 and stop every
    rank of a healthy job (exit status 75)."""
    from shardkit.testing import World
    with World(2, timeout=60) as world:
        assert world.run(_watchdog_across_a_new_default_group) == [(True, True, True)] * 2


def test_watch_peers_bad_input_is_clear(monkeypatch):
    from shardkit import fault
    with pytest.raises(ValueError, match=r"watch_peers\(timeout_s=-1.0\): must be >= 0"):
        fault.watch_peers(-1)
    assert fault.watch_peers(0) is None  # off
    with pytest.raises(RuntimeError, match="process group is not initialised"):
        fault.watch_peers(5)
    monkeypatch.setenv("SHARDKIT_PEER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SHARDKIT_PEER_TIMEOUT='soon'"):
        fault.watch_peers()
    # these used to reach the watchdog: a timedelta error (nan, inf), or a 1 s timeout (True)
    for never in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"must be >= 0 and finite, in seconds"):
            fault.watch_peers(never)
    with pytest.raises(TypeError, match=r"watch_peers\(timeout_s=True\): expected a number"):
        fault.watch_peers(True)
    monkeypatch.setenv("SHARDKIT_PEER_TIMEOUT", "inf")
    with pytest.raises(ValueError, match="SHARDKIT_PEER_TIMEOUT='inf': expected a finite"):
        fault.watch_peers()


def test_communication_errors_are_told_from_bugs():
    from shardkit.fault import looks_like_communication_error as comm
    assert comm(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset "
                             "by peer"))
    assert comm(RuntimeError("shared-memory collective 4 on rank 0: rank(s) [1] exited before "
                             "they could arrive"))
    assert not comm(ValueError("mat1 and mat2 shapes cannot be multiplied"))
    assert not comm(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    # a collective mismatch is explained on every rank at once; a user path holding "store"
    # or "peer" used to make the hook wait out the peer timeout for a verdict that never came
    from shardkit.collective_check import CollectiveMismatchError
    from shardkit.fault import _chain_has_comm_error
    mismatch = CollectiveMismatchError("collective mismatch in the group of ranks [0, 1]:\n  "
                                       "rank 0: all_reduce(shape=[1]) #3 at /srv/datastore/"
                                       "peer_train.py:9 in main")
    assert not comm(mismatch)
    try:
        raise CollectiveMismatchError("FullyShardedDataParallel: out of step") from mismatch
    except CollectiveMismatchError as outer:
        assert not _chain_has_comm_error(outer)
    # only a backend's own error gets the "finished peer" / "no peer lost" diagnosis: a user's
    # upload failing after a peer's normal exit used to blame that peer for leaving early
    assert not _chain_has_comm_error(ConnectionResetError(104, "Connection reset by peer"),
                                     strict=True)
    assert not _chain_has_comm_error(RuntimeError("missing from the feature store"), strict=True)
    assert _chain_has_comm_error(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection "
                                              "closed by peer"), strict=True)


def test_several_silent_peers_name_the_longest_silent_and_list_the_others():
    """A node's launcher stops its other ranks when one dies: all fall silent within a beat.
    Before, the lowest silent rank was named and the others not mentioned."""
    from shardkit.fault import PeerWatchdog

    class Fake:
        timeout_s = 10.0

        def _declare(self, rank, why):
            self.declared = (rank, why)

    fake = Fake()
    PeerWatchdog._declare_silent(fake, [2, 3], {2: (b"7", 10.5), 3: (b"6", 9.5)}, 21.0)
    assert fake.declared[0] == 3
    assert "no heartbeat for 11.5 s (timeout 10 s); also silent: rank(s) [2]" in fake.declared[1]
