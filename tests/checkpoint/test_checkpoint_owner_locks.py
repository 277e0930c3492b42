"""Review of the staging owners' locks and leases, as a user meets the gaps:

- a save refused because another save of the same process (another engine's) was writing the
  same tag kept that save's staging directory, but dropped its lock and stopped refreshing
  its marker: another container on this kernel then took the live save for ended at once
  (and another machine after the lease), and removed its staging directory under it;
- a child forked while a save ran (a worker pool, a data loader) kept its copy of the lock
  descriptor: the lock stayed held after the parent released it or died, so a dead save's
  staging directory was never removable while the child lived;
- at the end of the process, a save queued behind one given up by an earlier wait (which it
  can never get past) was waited for the whole bound.

Local checks, and one world of 1 process.
"""

import os
import subprocess
import sys
import threading
import time
import warnings

import pytest

from shardkit.checkpoint import CheckpointError, async_save, save_owner, sharded
from shardkit.testing import run_in_world

needs_flock = pytest.mark.skipif(save_owner.fcntl is None or not hasattr(os, "fork"),
                                 reason="POSIX locks and fork")

TRY_LOCK = """
import fcntl, sys
fd = open(sys.argv[1])
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("held")
"""


def _lock_state(directory: str) -> str:
    """``"held"`` or ``"free"``: ``directory``'s owner lock, as another process sees it."""
    lock = os.path.join(directory, save_owner.LOCK_FILE)
    return subprocess.run([sys.executable, "-c", TRY_LOCK, lock], capture_output=True,
                          text=True, check=True).stdout.strip()


def _refused_save_beside_a_save_under_way(save_dir: str) -> dict:
    """Rank 0 of a world of 1: a commit of tag ``t`` is under way (its staging directory made);
    a second save of ``t`` by this process is refused. What the first save still owns."""
    staging = sharded.staging_dir(save_dir, "t")
    with sharded._staging_in_use(staging):
        sharded._make_staging(save_dir, staging, True)
        try:
            with pytest.raises(CheckpointError, match="another save of tag 't'"):
                sharded.commit_checkpoint(save_dir, "t", None, {"world_size": 1}, {})
            marker = os.path.join(staging, save_owner.OWNER_FILE)
            os.utime(marker, (1.0, 1.0))
            save_owner._touch_owned_markers()
            return {"lock": _lock_state(staging), "refreshed": os.stat(marker).st_mtime > 1.0,
                    "kept": os.path.isdir(staging)}
        finally:
            sharded.remove_own_staging(staging)


def test_refused_save_leaves_the_save_under_way_locked_and_refreshed(tmp_path):
    state = run_in_world(1, _refused_save_beside_a_save_under_way, str(tmp_path))[0]
    # before: {'lock': 'free', 'refreshed': False, 'kept': True}
    assert state == {"lock": "held", "refreshed": True, "kept": True}


@needs_flock
def test_forked_child_keeps_no_lock_of_its_parent(tmp_path):
    path = str(tmp_path / ".tmp-a")
    save_owner.create_owned_dir(path)
    go_on_read, go_on_write = os.pipe()
    with warnings.catch_warnings():  # the refresher thread runs: a fork warns of it
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # a worker forked mid-save, outliving its parent's save
        try:
            os.close(go_on_write)
            os.read(go_on_read, 1)
        finally:
            os._exit(0 if not save_owner._owned else 3)
    os.close(go_on_read)
    try:
        assert _lock_state(path) == "held"
        save_owner.release_owned_dir(path)  # the save ended (or its process died)
        assert _lock_state(path) == "free"  # before: still held, by the child's copy
    finally:
        save_owner.release_owned_dir(path)
        os.write(go_on_write, b"x")
        os.close(go_on_write)
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child owns no directory


def test_exit_gives_up_at_once_a_save_queued_behind_one_given_up(monkeypatch, capsys):
    monkeypatch.setattr(async_save, "_wait_bound", lambda: 3.0)
    release = threading.Event()

    def stuck_writer():
        release.wait(60)

    stuck = async_save.AsyncSave("/ckpt/stuck", stuck_writer)
    queued = None
    try:
        with pytest.raises(CheckpointError, match="did not finish"):
            stuck.wait(timeout_s=0.1)
        queued = async_save.AsyncSave("/ckpt/queued", lambda: "written")
        start = time.monotonic()
        async_save._wait_all_at_exit()
        assert time.monotonic() - start < 1.5  # before: the whole bound (3 s) for 'queued'
        assert "save to /ckpt/queued failed" in capsys.readouterr().err
    finally:
        release.set()
        for save in (stuck, queued):
            if save is not None:
                save._thread.join(10)
                async_save._pending.discard(save)
