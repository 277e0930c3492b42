"""``torch.save`` into a file whose failed writes keep their reason.

torch's zip writer reports a write the file system refused (a full disk, a quota, a file size
limit, an I/O error) as ``RuntimeError("[enforce fail at inline_container.cc:...] . unexpected
pos 704 vs 598")``: the ``errno`` is lost, whether ``torch.save`` is given a path or a Python
file object, so a user whose checkpoint disk filled up is told nothing about the disk.
:func:`save_torch_file` writes through :class:`_ReasonKeepingFile` instead (``os.write``, the
same bytes, the same zip layout) and raises the ``OSError`` itself, naming the file:
``[Errno 28] No space left on device: '.../rank_00001.pt'``.

Costs: one ``fsync``; the small records torch hands over (zip headers, padding, small
tensors) are gathered into writes of about 1 MiB (one system call each rather than several
per tensor: a state dict of many small tensors saves as fast as ``torch.save(path)``), the
large ones are written as they come, without a copy.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["save_torch_file"]

_GATHERED_BYTES = 1 << 20  # small records are gathered up to this size before one os.write


class _ReasonKeepingFile:
    """The write side of an open file descriptor, as ``torch.save`` uses a file object; the
    ``OSError`` of a refused write is kept in :attr:`error` (torch replaces it with its own
    RuntimeError). Records smaller than ``_GATHERED_BYTES`` are held until :meth:`flush`."""

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.error: Optional[OSError] = None
        self._pending = bytearray()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if len(self._pending) + size <= _GATHERED_BYTES:
            self._pending += view
            return size
        self.flush()
        if size < _GATHERED_BYTES:
            self._pending += view
        else:
            self._write_all(view)
        return size

    def flush(self) -> None:
        """Write the gathered small records (torch calls it once the archive is complete)."""
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._write_all(memoryview(pending))

    def _write_all(self, view: memoryview) -> None:
        done = 0
        try:
            while done < len(view):  # os.write may write less than asked (large buffers)
                done += os.write(self.fd, view[done:])
        except OSError as error:
            self.error = OSError(error.errno, error.strerror, self.path)
            raise self.error from None


def save_torch_file(obj, path: str) -> None:
    """``torch.save(obj, path)`` and ``fsync``; a write the file system refuses raises its
    ``OSError`` (``errno`` and ``strerror``, ``filename=path``), not torch's RuntimeError.
    The file is created with the permissions ``torch.save`` gives it (``0o666`` less the
    umask). A failed write leaves the partial file for the caller to remove (it writes to a
    temporary name)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    target = _ReasonKeepingFile(fd, path)
    try:
        try:
            torch.save(obj, target)
            target.flush()
        except Exception as error:
            if target.error is not None:
                raise target.error from error
            raise
        os.fsync(fd)
    finally:
        os.close(fd)
