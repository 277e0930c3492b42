"""Who is writing a staging directory: the owner marker of a save under way.

Every staging directory (``DIR/.tmp-TAG``) is born holding :data:`OWNER_FILE`, which names the
process that created it (rank 0 of the saving group): its host, the boot of that host's kernel,
its PID namespace, its PID and the start time of that PID. A later cleanup removes a staging
directory only when that process provably no longer runs: the same host, boot and PID namespace
(so the PID is comparable), and the PID either gone or now another process (a different start
time). A save of another job on the same host, or of any job on another host (whose processes
cannot be looked at from here), is never taken for abandoned.

The directory appears with its marker in one step: it is built under a private name and renamed
into place, so no moment exists at which another job sees a staging directory without its owner.
Linux only for the proof (``/proc``); elsewhere a marked directory is never provably abandoned.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from typing import Optional

__all__ = ["OWNER_FILE", "this_process", "create_owned_dir", "is_private_name", "read_owner",
           "owner_is_gone", "describe_owner"]

OWNER_FILE = "save_owner.json"
_PRIVATE_SUFFIX = re.compile(r"\.new-[0-9a-f]{12}$")


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


def create_owned_dir(path: str) -> None:
    """Create directory ``path`` holding this process's owner marker, atomically: built as a
    sibling under a private name, then renamed to ``path``. Raises ``OSError`` when ``path``
    exists and is not empty (another save created it meanwhile)."""
    private = f"{path}.new-{uuid.uuid4().hex[:12]}"  # see is_private_name
    os.makedirs(private)
    try:
        with open(os.path.join(private, OWNER_FILE), "w") as f:
            json.dump(this_process(), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(private, path)
    except BaseException:
        _remove_private(private)
        raise


def is_private_name(name: str) -> bool:
    """Whether ``name`` is one under which :func:`create_owned_dir` builds a directory before
    renaming it into place. Such a directory belongs to a creation under way (possibly of this
    process, and for a moment without its marker) unless its marker names an owner that
    provably ended."""
    return bool(_PRIVATE_SUFFIX.search(name))


def _remove_private(private: str) -> None:
    try:
        os.remove(os.path.join(private, OWNER_FILE))
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


def owner_is_gone(owner: dict) -> bool:
    """Whether the process ``owner`` (a marker's content) provably no longer runs."""
    me = this_process()
    pid, ticks = owner.get("pid"), owner.get("start_ticks")
    if not owner.get("host") or owner.get("host") != me["host"] or not me["boot_id"]:
        return False  # another machine (or an unreadable marker): it cannot be looked at
    if owner.get("boot_id") != me["boot_id"]:
        return bool(owner.get("boot_id"))  # the host rebooted since: every process of then ended
    if owner.get("pid_namespace") != me["pid_namespace"] or not isinstance(pid, int) \
            or isinstance(pid, bool) or pid <= 0:
        return False  # another container on this kernel: its PIDs are not ours
    now = _start_ticks(pid)
    return now is None or (isinstance(ticks, int) and now != ticks)


def describe_owner(owner: Optional[dict]) -> str:
    """``"pid 123 on host h"`` (for messages)."""
    if not owner:
        return "an unknown process"
    return f"pid {owner.get('pid')} on host {owner.get('host')}"
