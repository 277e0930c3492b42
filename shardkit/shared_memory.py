"""Host shared memory between the ranks of a process group that live on one machine.

On CPU, gloo moves tensors between processes of one machine through TCP loopback: every byte is
copied by the kernel, about 2 GB/s here, and the copy competes with training for the same
cores. When every rank of a group can map the same file in ``/dev/shm``, a buffer can instead
live *once* in memory, mapped by every rank: a rank writes its own segment in place, and after
a barrier every other rank reads it with no copy at all. OSS uses this for its parameter
re-synchronisation on CPU (see :mod:`shardkit.optim.param_sync`).

Set-up is collective (three small object collectives): rank 0 of the group creates the files
(space reserved with ``posix_fallocate``, so a full ``/dev/shm`` is an error here, not a
``SIGBUS`` later) and a probe file holding a random token; every other rank maps the files only
if it reads the same token (a rank on another machine, or in a container with its own
``/dev/shm``, does not see the file), and the group agrees on the answer. The files are unlinked
as soon as every rank has mapped them: nothing is left in ``/dev/shm`` after a crash, and the
memory is released when the last rank drops its tensors.

Memory: the buffers' bytes once per machine (each rank's storage accounting still sees the whole
buffer). Communication: none after set-up; synchronisation is the caller's (barriers).
"""

from __future__ import annotations

import os
import secrets
from typing import Optional, Sequence

import torch

from shardkit import distributed

__all__ = ["SHM_DIR", "open_shared_buffers"]

SHM_DIR = "/dev/shm"
_FREE_SPACE_FACTOR = 2  # leave /dev/shm at least this many times the request free


def open_shared_buffers(numels: Sequence[int], dtype: torch.dtype,
                        group=None) -> Optional[list[torch.Tensor]]:
    """One zero-filled CPU tensor per entry of ``numels``, mapped by every rank of ``group``.

    Collective over ``group``. Returns ``None`` on every rank when any rank cannot share
    (no ``/dev/shm``, too little room in it, a rank on another machine); the caller then uses
    a collective instead. Every rank must pass the same ``numels`` and ``dtype``.
    """
    if not numels:
        return []
    nbytes = [n * torch.empty((), dtype=dtype).element_size() for n in numels]
    leader = distributed.get_global_rank(group, 0)
    is_leader = distributed.get_rank(group) == 0
    offer = _create_files(nbytes) if is_leader else None
    offer = distributed.broadcast_object(offer, src=leader, group=group)
    if offer is None:
        return None
    token, paths = offer
    tensors = (_try_map(paths, numels, dtype) if is_leader
               else _map_files(paths, token, numels, dtype))
    everyone = distributed.all_gather_object(tensors is not None, group=group)
    if is_leader:
        _unlink(paths + [_probe_path(paths)])
    if not all(everyone):
        return None
    return tensors


def _create_files(nbytes: Sequence[int]) -> Optional[tuple[str, list[str]]]:
    """On the group's rank 0: the token and the reserved files, or ``None`` if it cannot."""
    if not os.path.isdir(SHM_DIR):
        return None
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return None
    if stats.f_bavail * stats.f_frsize < _FREE_SPACE_FACTOR * sum(nbytes):
        return None
    token = secrets.token_hex(16)
    prefix = os.path.join(SHM_DIR, f"shardkit-{os.getpid()}-{token[:12]}")
    paths = [f"{prefix}-{k}" for k in range(len(nbytes))]
    created = []
    try:
        for path, size in zip(paths, nbytes):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created.append(path)
            try:
                os.posix_fallocate(fd, 0, max(1, size))
            finally:
                os.close(fd)
        probe = _probe_path(paths)
        with open(probe, "x") as f:
            f.write(token)
        created.append(probe)
    except OSError:
        _unlink(created)
        return None
    return token, paths


def _probe_path(paths: Sequence[str]) -> str:
    return paths[0] + "-probe"


def _map_files(paths: Sequence[str], token: str, numels: Sequence[int],
               dtype: torch.dtype) -> Optional[list[torch.Tensor]]:
    """On the other ranks: map the files if the probe shows this is the leader's ``/dev/shm``."""
    try:
        with open(_probe_path(paths)) as f:
            if f.read() != token:
                return None
        # torch.from_file creates a missing file: check first, so nothing is created here
        if not all(os.path.exists(p) for p in paths):
            return None
    except OSError:
        return None
    return _try_map(paths, numels, dtype)


def _try_map(paths: Sequence[str], numels: Sequence[int],
             dtype: torch.dtype) -> Optional[list[torch.Tensor]]:
    try:
        return [torch.from_file(p, shared=True, size=n, dtype=dtype)
                for p, n in zip(paths, numels)]
    except (OSError, RuntimeError):
        return None


def _unlink(paths: Sequence[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
