"""What crosses a stage boundary: activation descriptions and sends in flight.

Shapes are sent once: the first time micro-batch ``i`` goes forward, a small int64 header
(:class:`ActivationMeta`: dtype, requires_grad, shape of each tensor) precedes the data;
afterwards both sides reuse the cached description, so the receiver can post its receive before
the sender is ready (the data lands while the receiver computes). Gradients need no header: a
stage knows the shapes of its own outputs. The tagged links that use these live in
:mod:`shardkit.nn.pipe.plan_schedules`; all traffic goes through :mod:`shardkit.distributed`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


__all__ = ["TensorMeta", "ActivationMeta", "PendingSends", "check_sendable"]

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
            dtype, requires_grad = _DTYPES[values[pos]], bool(values[pos + 1])
            ndim = values[pos + 2]
            tensors.append(TensorMeta(dtype, tuple(values[pos + 3:pos + 3 + ndim]), requires_grad))
            pos += 3 + ndim
        return ActivationMeta(tuple(tensors), packed)


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


def check_sendable(tensors: tuple) -> None:
    """Raise TypeError when a tensor's dtype cannot be described in a header."""
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline activations of dtype {t.dtype} cannot be sent; "
                            f"supported dtypes are {[str(d) for d in _DTYPES]}")
