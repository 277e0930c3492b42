"""Who is writing a staging directory: the owner marker of a save under way.

Every staging directory (``DIR/.tmp-TAG``) is born holding :data:`OWNER_FILE`, which names the
process that created it (rank 0 of the saving group): its host, the boot of that host's kernel,
its PID namespace, its PID and the start time of that PID; and :data:`LOCK_FILE`, on which that
process holds an exclusive ``flock`` until its save ends. The owner also refreshes the marker's
modification time every :data:`REFRESH_S` seconds while the save runs. A later cleanup removes a
staging directory only when that process provably no longer runs:

- same kernel (boot) and PID namespace: the PID is gone or is now another process (a different
  start time);
- same kernel, another PID namespace (another container, or this one restarted under the same
  host name): the lock is free (the kernel drops a process's locks when it ends);
- otherwise (another machine, whatever its host name; a kernel that could not lock the file):
  the marker went unrefreshed for its lease (``lease_s``, :data:`LEASE_S`), however long ago
  that save started, measured by the filesystem's own clock (a probe file's stamp), so machines
  whose clocks disagree judge a network filesystem's markers alike.

So a live save is never taken for abandoned (a save stopped for longer than the lease, e.g. a
suspended job, is the exception the lease accepts), and a dead one is abandoned at the latest
one lease after it died, never refused for good. Markers of an older shardkit (no lease) keep
that version's rule: provably ended only on the same host and kernel, or on that host after a
reboot.

The directory appears with its marker in one step: it is built under a private name and renamed
into place, so no moment exists at which another job sees a staging directory without its owner.
Linux only for the PID proof (``/proc``); elsewhere the lease decides.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from typing import Optional

try:
    import fcntl
except ImportError:  # not POSIX: no locks, the lease decides
    fcntl = None

__all__ = ["OWNER_FILE", "LOCK_FILE", "REFRESH_S", "LEASE_S", "this_process", "is_this_process",
           "create_owned_dir", "release_owned_dir", "is_private_name", "read_owner",
           "owner_is_gone", "describe_owner"]

OWNER_FILE = "save_owner.json"
LOCK_FILE = "save_owner.lock"
REFRESH_S = 20.0  # how often an owner refreshes its marker's modification time
LEASE_S = 600.0  # how long a marker may go unrefreshed before its owner counts as ended
_PRIVATE_SUFFIX = re.compile(r"\.new-[0-9a-f]{12}$")
_IDENTITY = ("host", "boot_id", "pid_namespace", "pid", "start_ticks")

# This process's owned directories (resolved path -> the descriptor holding its lock, or None
# where the filesystem could not lock), refreshed by one daemon thread until released.
_owned: dict = {}
_owned_lock = threading.Lock()
_refresher: Optional[threading.Thread] = None


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat`` field 22),
    ``None`` when there is no such process or no ``/proc``."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> Optional[int]:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def this_process() -> dict:
    """This process, as :data:`OWNER_FILE` records it (plain JSON values)."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id":
            _read_text("/proc/sys/kernel/random/boot_id"), "pid_namespace": _pid_namespace(),
            "pid": pid, "start_ticks": _start_ticks(pid)}


def is_this_process(owner: Optional[dict]) -> bool:
    """Whether marker content ``owner`` names this process (whatever else it records)."""
    me = this_process()
    return bool(owner) and all(owner.get(key) == me[key] for key in _IDENTITY)


def create_owned_dir(path: str) -> None:
    """Create directory ``path`` holding this process's owner marker and lock, atomically:
    built as a sibling under a private name, then renamed to ``path``. The lock is held, and
    the marker refreshed, until :func:`release_owned_dir`. Raises ``OSError`` when ``path``
    exists and is not empty (another save created it meanwhile)."""
    private = f"{path}.new-{uuid.uuid4().hex[:12]}"  # see is_private_name
    os.makedirs(private)
    lock_fd = None
    try:
        lock_fd = _hold_lock(os.path.join(private, LOCK_FILE))  # before the marker promises it
        marker = dict(this_process(), locked=lock_fd is not None, lease_s=LEASE_S)
        with open(os.path.join(private, OWNER_FILE), "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(private, path)
    except BaseException:
        if lock_fd is not None:
            os.close(lock_fd)
        _remove_private(private)
        raise
    with _owned_lock:
        _owned[os.path.realpath(path)] = lock_fd
    _start_refresher()


def _hold_lock(path: str) -> Optional[int]:
    """Create ``path`` and hold an exclusive ``flock`` on it: the descriptor, or ``None`` where
    the filesystem cannot lock (then only the lease tells that the owner ended)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    if fcntl is None:
        os.close(fd)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def release_owned_dir(path: str) -> None:
    """The save that created ``path`` (:func:`create_owned_dir`) ended: stop refreshing its
    marker and drop its lock. Nothing happens for a directory this process does not own."""
    with _owned_lock:
        lock_fd = _owned.pop(os.path.realpath(path), None)
    if lock_fd is not None:
        os.close(lock_fd)


def _start_refresher() -> None:
    global _refresher
    with _owned_lock:
        if _refresher is None or not _refresher.is_alive():
            _refresher = threading.Thread(target=_refresh_markers, daemon=True,
                                          name="shardkit-save-owner-refresh")
            _refresher.start()


def _refresh_markers() -> None:
    """Every :data:`REFRESH_S` seconds, touch the marker of each directory this process owns
    (one that was renamed or removed meanwhile is skipped: a touch never creates)."""
    while True:
        time.sleep(REFRESH_S)
        _touch_owned_markers()


def _touch_owned_markers() -> None:
    with _owned_lock:
        paths = list(_owned)
    for path in paths:
        try:
            os.utime(os.path.join(path, OWNER_FILE))
        except OSError:
            pass


def _forget_owned_in_child() -> None:
    """After ``fork``, in the child: it owns none of its parent's directories. It closes its
    copies of their lock descriptors (a ``flock`` is dropped only once every copy is closed:
    a child outliving its killed parent would otherwise keep the dead save's lock held, and
    its staging directory never removable) and takes a fresh registry lock (the refresher
    may have held it at the fork)."""
    global _owned_lock, _refresher
    for lock_fd in _owned.values():
        if lock_fd is not None:
            try:
                os.close(lock_fd)  # the parent's copy keeps its lock
            except OSError:
                pass
    _owned.clear()
    _owned_lock = threading.Lock()
    _refresher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_owned_in_child)


def is_private_name(name: str) -> bool:
    """Whether ``name`` is one under which :func:`create_owned_dir` builds a directory before
    renaming it into place. Such a directory belongs to a creation under way (possibly of this
    process, and for a moment without its marker) unless its marker names an owner that
    provably ended."""
    return bool(_PRIVATE_SUFFIX.search(name))


def _remove_private(private: str) -> None:
    for name in (OWNER_FILE, LOCK_FILE):
        try:
            os.remove(os.path.join(private, name))
        except OSError:
            pass
    try:
        os.rmdir(private)
    except OSError:
        pass


def read_owner(directory: str) -> Optional[dict]:
    """The owner marker of ``directory``: ``None`` when it has none; ``{}`` when it is there but
    unreadable (then no one can prove its owner gone)."""
    file = os.path.join(directory, OWNER_FILE)
    if not os.path.lexists(file):
        return None
    try:
        with open(file) as f:
            owner = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return owner if isinstance(owner, dict) else {}


def owner_is_gone(owner: dict, directory: str) -> bool:
    """Whether the process ``owner`` (the content of ``directory``'s marker) provably no longer
    runs (the rules of this module's docstring)."""
    me = this_process()
    if me["boot_id"] and owner.get("boot_id") == me["boot_id"]:  # the same kernel
        if owner.get("pid_namespace") == me["pid_namespace"] and _is_pid(owner.get("pid")):
            now = _start_ticks(owner["pid"])
            ticks = owner.get("start_ticks")
            return now is None or (isinstance(ticks, int) and now != ticks)
        if owner.get("locked") is True:
            free = _lock_is_free(os.path.join(directory, LOCK_FILE))
            if free is not None:
                return free
    lease = _lease_of(owner)
    if lease is not None:
        age = _marker_age(directory)
        return age is not None and age > lease
    return _ended_by_reboot(owner, me)  # a marker of an older shardkit


def _is_pid(pid) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0


def _lease_of(owner: dict) -> Optional[float]:
    lease = owner.get("lease_s")
    if isinstance(lease, (int, float)) and not isinstance(lease, bool) and lease > 0:
        return float(lease)
    return None


def _lock_is_free(path: str) -> Optional[bool]:
    """Whether no process holds ``path``'s ``flock`` (``None`` when that cannot be told: no
    such file, or a filesystem that cannot lock). Meaningful on the owner's kernel only: a
    network filesystem may keep each machine's locks to itself."""
    if fcntl is None:
        return None
    fd = _open_for_locking(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)  # drops the lock taken, if any


def _open_for_locking(path: str) -> Optional[int]:
    """A descriptor of ``path`` to try its ``flock`` with: opened for writing where allowed
    (NFS emulates ``flock`` with byte-range locks, whose exclusive form needs a descriptor
    open for writing), else read-only; ``None`` when it cannot be opened."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    for mode in (os.O_RDWR, os.O_RDONLY):
        try:
            return os.open(path, mode | flags)
        except OSError:
            continue
    return None


def _marker_age(directory: str) -> Optional[float]:
    """Seconds since the marker of ``directory`` was last refreshed (``None``: no marker),
    by the clock of the filesystem that holds it (:func:`_filesystem_now`)."""
    try:
        refreshed = os.stat(os.path.join(directory, OWNER_FILE)).st_mtime
    except OSError:
        return None
    return _filesystem_now(os.path.dirname(os.path.abspath(directory))) - refreshed


def _filesystem_now(directory: str) -> float:
    """The current time by the clock that stamps files in ``directory``: the modification time
    of a probe file created, touched and removed there; this machine's clock where no file can
    be made.

    The owner's refreshes are stamped by the file server's clock on a network filesystem (a
    touch without explicit times asks the server to stamp it), while this process may run on
    another machine whose clock is minutes off: measured against the local clock, a live
    owner's fresh marker would look a lease old, or a dead one's young for too long."""
    probe = os.path.join(directory, f".shardkit-clock-{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError:
        return time.time()
    try:
        os.close(fd)
        os.utime(probe)
        return os.stat(probe).st_mtime
    except OSError:
        return time.time()
    finally:
        try:
            os.remove(probe)
        except OSError:
            pass


def _ended_by_reboot(owner: dict, me: dict) -> bool:
    """The rule for markers without a lease: this host, rebooted since the marker was made."""
    return bool(owner.get("host")) and owner.get("host") == me["host"] and bool(me["boot_id"]) \
        and bool(owner.get("boot_id")) and owner.get("boot_id") != me["boot_id"]


def describe_owner(owner: Optional[dict], directory: Optional[str] = None) -> str:
    """``"pid 123 on host h"`` (for messages); with ``directory`` (the marker's), also when a
    leased marker was last refreshed and when its owner will count as ended without it."""
    if not owner:
        return "an unknown process"
    described = f"pid {owner.get('pid')} on host {owner.get('host')}"
    if is_this_process(owner):
        return f"this process, {described}: another of its saves, e.g. of another engine"
    lease = _lease_of(owner)
    age = _marker_age(directory) if directory is not None else None
    if lease is not None and age is not None:
        described += (f", its marker refreshed {max(age, 0.0):.0f} s ago: it counts as ended "
                      f"once unrefreshed for {lease:g} s")
    return described
