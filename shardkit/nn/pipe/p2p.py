"""Asynchronous point-to-point exchange of activations and gradients between adjacent stages.

Shapes are sent once: the first time micro-batch ``i`` goes forward, a small int64 header
describing its tensors (dtype, requires_grad, shape) precedes the data; afterwards both sides
reuse the cached description, so the receiver can post its receive before the sender is ready
(the data lands while the receiver computes). Gradients need no header: a stage knows the
shapes of its own outputs. All traffic goes through :mod:`shardkit.distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from shardkit import distributed as dist

__all__ = ["TensorMeta", "ActivationMeta", "ActivationSender", "ActivationReceiver",
           "GradientSender", "GradientReceiver", "PendingSends", "send_tensors"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one activation: dtype, shape, and whether it needs a
    gradient sent back."""

    dtype: torch.dtype
    shape: tuple
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(t.dtype, tuple(t.shape), t.requires_grad)


@dataclass(frozen=True)
class ActivationMeta:
    """The tensors of one micro-batch's activation, and whether they travel as a tuple."""

    tensors: tuple
    packed: bool

    def encode(self) -> torch.Tensor:
        values = [int(self.packed), len(self.tensors)]
        for m in self.tensors:
            values += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        return torch.tensor(values, dtype=torch.int64)

    @staticmethod
    def decode(values: list) -> "ActivationMeta":
        packed, count, pos, tensors = bool(values[0]), values[1], 2, []
        for _ in range(count):
            dtype, requires_grad, ndim = _DTYPES[values[pos]], bool(values[pos + 1]), values[pos + 2]
            tensors.append(TensorMeta(dtype, tuple(values[pos + 3:pos + 3 + ndim]), requires_grad))
            pos += 3 + ndim
        return ActivationMeta(tuple(tensors), packed)


def send_tensors(tensors, peer: int, group) -> list:
    """Start sending ``tensors`` to global rank ``peer``; returns the work handles."""
    return [dist.isend(t, peer, group=group) for t in tensors]


class PendingSends:
    """Sends in flight, each with the tensor it reads (kept alive until the send completes)."""

    def __init__(self):
        self.items: list = []

    def add(self, works: list, tensors: list) -> None:
        # drop finished sends first, so a long step does not keep every buffer it ever sent
        self.items = [(w, t) for w, t in self.items if not w.is_completed()]
        self.items.extend(zip(works, tensors))

    def wait(self) -> None:
        """Wait until every send started so far has completed."""
        for work, _ in self.items:
            work.wait()
        self.items = []


def _check_sendable(tensors: tuple) -> None:
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline activations of dtype {t.dtype} cannot be sent; "
                            f"supported dtypes are {[str(d) for d in _DTYPES]}")


class ActivationSender:
    """Sends this stage's outputs to the next stage (the header only the first time)."""

    def __init__(self, peer: int, group):
        self.peer = peer
        self.group = group
        self.metas: dict[int, ActivationMeta] = {}
        self.pending = PendingSends()

    def send(self, index: int, tensors: tuple, packed: bool) -> None:
        meta = ActivationMeta(tuple(TensorMeta.of(t) for t in tensors), packed)
        cached = self.metas.get(index)
        if cached is None:
            _check_sendable(tensors)
            header = meta.encode()
            length = torch.tensor([header.numel()], dtype=torch.int64)
            self.pending.add(send_tensors([length, header], self.peer, self.group),
                             [length, header])
            self.metas[index] = meta
        elif cached != meta:
            raise ValueError(f"micro-batch {index}: the activation changed from {cached} to "
                             f"{meta}; shapes are exchanged once, so keep the batch size and "
                             f"shapes fixed (or build a new schedule and stage)")
        data = [t.detach().contiguous() for t in tensors]
        self.pending.add(send_tensors(data, self.peer, self.group), data)

    def wait(self) -> None:
        """Wait until every send started so far has completed."""
        self.pending.wait()


class ActivationReceiver:
    """Receives the previous stage's outputs; posts receives ahead once shapes are known."""

    def __init__(self, peer: int, group):
        self.peer = peer
        self.group = group
        self.metas: dict[int, ActivationMeta] = {}
        self.posted: dict[int, tuple] = {}

    def post(self, index: int) -> None:
        """Start receiving micro-batch ``index`` if its shapes are known and it is not posted."""
        meta = self.metas.get(index)
        if meta is None or index in self.posted:
            return
        buffers = [torch.empty(m.shape, dtype=m.dtype) for m in meta.tensors]
        works = [dist.irecv(b, self.peer, group=self.group) for b in buffers]
        self.posted[index] = (buffers, works)

    def take(self, index: int) -> tuple[tuple, bool]:
        """Micro-batch ``index``'s activation (waiting for it) and whether it is a tuple."""
        if index not in self.metas:
            self.metas[index] = self._receive_meta()
        self.post(index)
        buffers, works = self.posted.pop(index)
        for work in works:
            work.wait()
        meta = self.metas[index]
        for b, m in zip(buffers, meta.tensors):
            b.requires_grad_(m.requires_grad)
        return tuple(buffers), meta.packed

    def _receive_meta(self) -> ActivationMeta:
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, self.peer, group=self.group)
        header = torch.empty(int(length.item()), dtype=torch.int64)
        dist.recv(header, self.peer, group=self.group)
        return ActivationMeta.decode(header.tolist())


class GradientSender:
    """Sends the gradients of this stage's inputs back to the previous stage."""

    def __init__(self, peer: int, group):
        self.peer = peer
        self.group = group
        self.pending = PendingSends()

    def send(self, grads: list) -> None:
        data = [g.contiguous() for g in grads]
        self.pending.add(send_tensors(data, self.peer, self.group), data)

    def wait(self) -> None:
        """Wait until every send started so far has completed."""
        self.pending.wait()


class GradientReceiver:
    """Receives the gradients of this stage's outputs from the next stage."""

    def __init__(self, peer: int, group):
        self.peer = peer
        self.group = group
        self.posted: dict[int, tuple] = {}

    def post(self, index: int, like: list) -> None:
        """Start receiving the gradients of micro-batch ``index``, shaped like ``like``."""
        if index in self.posted:
            return
        buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        works = [dist.irecv(b, self.peer, group=self.group) for b in buffers]
        self.posted[index] = (buffers, works)

    def take(self, index: int, like: Optional[list] = None) -> list:
        """The gradients of micro-batch ``index`` (waiting for them)."""
        if index not in self.posted:
            self.post(index, like)
        buffers, works = self.posted.pop(index)
        for work in works:
            work.wait()
        return buffers
