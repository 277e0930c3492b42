"""What crosses a stage boundary: activation descriptions, the step state, and the tagged links.

Shapes are sent when they are new: the first time micro-batch ``i`` goes forward, a small int64
header (:class:`ActivationMeta`: dtype, requires_grad, shape of each tensor) precedes the data;
afterwards both sides reuse the cached description, so the receiver can post its receive before
the sender is ready (the data lands while the receiver computes). Gradients need no header: a
stage knows the shapes of its own outputs.

Whether the cached descriptions still hold is decided by the rank of the first stage, the only
one that sees the batch, and passed down the ranks every step as a :class:`StepState` (see
:class:`TaggedLinks`): the batch is as before, new (every rank drops its cache and the headers
go again, as in the first step) or unusable (every rank raises the same error), and whether the
step records for backward. So no cache depends on a grad mode or a batch size one rank alone
knows. All traffic goes through :mod:`shardkit.distributed`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit import distributed as dist

__all__ = ["TensorMeta", "ActivationMeta", "StepState", "batch_signature", "PendingSends",
           "TaggedLinks", "check_sendable"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
ACTIVATION, GRADIENT, HEADER, LEAD = 0, 1, 2, 3  # message kinds, part of every tag
MAX_TENSORS = 16
LEAD_WINDOW = 4  # micro-batches a receiver posts before it knows the step state


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


@dataclass(frozen=True)
class StepState:
    """What every rank learns from the first stage's rank before a step: ``batch`` is ``SAME``
    (the previous step's shapes, dtypes and grad mode: the cached headers hold), ``NEW`` (the
    headers are sent again) or ``BAD`` (it cannot be split: every rank raises), and ``grad``
    whether the step records for backward. Travels as ``BITS`` zeros and ones of any dtype."""

    batch: int
    grad: bool

    SAME, NEW, BAD = 0, 1, 2
    BITS = 3

    def bits(self, dtype: torch.dtype) -> torch.Tensor:
        return _bits(2 * self.batch + int(self.grad), dtype)

    @staticmethod
    def from_bits(bits: torch.Tensor) -> "StepState":
        value = sum(1 << i for i, b in enumerate(bits.tolist()) if b)
        return StepState(value // 2, bool(value % 2))


@functools.lru_cache(maxsize=None)
def _bits(value: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([(value >> i) & 1 for i in range(StepState.BITS)], dtype=dtype)


def batch_signature(inputs: tuple, grad: bool) -> tuple:
    """What the first stage's output headers follow from: the dtype, shape and requires_grad of
    each input tensor, and the grad mode (under ``torch.no_grad()`` no output requires grad)."""
    return grad, tuple((t.dtype, tuple(t.shape), t.requires_grad) if isinstance(t, torch.Tensor)
                       else type(t) for t in inputs)


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


class TaggedLinks:
    """Tagged point-to-point messages between one rank's stages and their neighbours: every tag
    names (kind, stage boundary, micro-batch, tensor), so two stages of one rank talking to the
    same neighbour never mix their messages.

    Note: the :class:`StepState` rides on boundary ``r``, from group rank ``r`` to ``r + 1``
    (stage ``r`` runs on group rank ``r`` under every placement): its first ``LEAD_WINDOW``
    micro-batches form the "lead" window, and micro-batch 0's first tensor carries
    ``StepState.BITS`` more elements, so passing the state costs no message of its own (one
    tiny message more per step cost several percent of a small pipeline's step on CPU). A
    receiver posts the window with the cached shapes before it knows the state (posting late
    costs as much again), so for a new or bad batch the sender fills the window with zeros of
    those shapes; the step's data then follows as in the first step (header, then data).
    """

    def __init__(self, group, num_stages: int, chunks: int):
        self.group, self.num_stages, self.chunks = group, num_stages, chunks
        self.metas: dict = {}      # (boundary, micro-batch) -> ActivationMeta
        self.posted: dict = {}     # (kind, boundary, micro-batch) -> (buffers, works)
        self.pending = PendingSends()
        self.lead: Optional[tuple] = None  # this step's (boundary, StepState) to send on

    def _tag(self, kind: int, boundary: int, index: int, tensor: int = 0) -> int:
        return ((kind * self.num_stages + boundary) * self.chunks + index) * MAX_TENSORS + tensor

    def _send(self, kind, boundary, index, tensors, peer) -> None:
        data = [t.detach().contiguous() for t in tensors]
        with self._reporting("send", kind, boundary, index, peer):
            works = [dist.isend(t, peer, group=self.group,
                                tag=self._tag(kind, boundary, index, n))
                     for n, t in enumerate(data)]
        self.pending.add(works, data)

    def _reporting(self, verb: str, kind: int, boundary: int, index: int, peer: int):
        """A broken link (a neighbour that died) becomes a CollectiveError naming the message."""
        what = {ACTIVATION: f"stage {boundary}'s output", HEADER: f"stage {boundary}'s output "
                f"header", GRADIENT: f"the gradient of stage {boundary}'s output",
                LEAD: f"stage {boundary}'s output with the step state"}[kind]
        way = "to" if verb == "send" else "from"
        return dist.reporting_broken_links(
            f"pipeline {verb} of {what} (micro-batch {index}) {way} rank {peer}", self.group)

    def _wait(self, works: list, kind: int, boundary: int, index: int, peer: int) -> None:
        with self._reporting("receive", kind, boundary, index, peer):
            for work in works:
                work.wait()

    def _lead_metas(self, boundary: int) -> Optional[list]:
        metas = [self.metas.get((boundary, i)) for i in range(min(self.chunks, LEAD_WINDOW))]
        return None if None in metas else metas

    def take_lead(self, boundary: int, peer: int) -> Optional[StepState]:
        """Post the lead window of ``boundary`` (micro-batches ``0 .. LEAD_WINDOW - 1``) with
        the cached shapes, wait for micro-batch 0 and return the state it carries; for a batch
        as before the window's receives serve :meth:`take_activation`, otherwise they held
        zeros. ``None`` while nothing is cached (the first step)."""
        metas = self._lead_metas(boundary)
        if metas is None:
            return None
        window = [self._post_lead(boundary, i, meta, peer) for i, meta in enumerate(metas)]
        self._wait(window[0][1], LEAD, boundary, 0, peer)
        state = StepState.from_bits(window[0][2])
        for index, (buffers, works, _) in enumerate(window):
            if state.batch == StepState.SAME:  # micro-batch 0 is in: nothing left to wait for
                self.posted[(ACTIVATION, boundary, index)] = (buffers, works if index else [])
            elif index:
                self._wait(works, LEAD, boundary, index, peer)
        return state

    def _post_lead(self, boundary: int, index: int, meta: ActivationMeta, peer: int) -> tuple:
        """Post one micro-batch of the lead window: (buffers, works, the state's bits), the
        bits right after micro-batch 0's first tensor."""
        first = meta.tensors[0]
        numel = math.prod(first.shape)
        flat = torch.empty(numel + (StepState.BITS if index == 0 else 0), dtype=first.dtype)
        buffers = [flat[:numel].view(first.shape)] + [torch.empty(m.shape, dtype=m.dtype)
                                                      for m in meta.tensors[1:]]
        with self._reporting("receive", LEAD, boundary, index, peer):
            works = [dist.irecv(b, peer, group=self.group,
                                tag=self._tag(LEAD, boundary, index, n))
                     for n, b in enumerate([flat, *buffers[1:]])]
        return buffers, works, flat[numel:]

    def start_lead(self, boundary: int, state: StepState, peer: int) -> None:
        """Pass ``state`` on over ``boundary`` to ``peer`` if it expects a lead window (the
        window's shapes are cached): zeros at once for a new or bad batch, else the outputs
        as they come (:meth:`send_activation`)."""
        self.lead = None
        metas = self._lead_metas(boundary)
        if metas is None:
            return
        if state.batch == StepState.SAME:
            self.lead = (boundary, state)
            return
        for index, meta in enumerate(metas):
            zeros = [torch.zeros(m.shape, dtype=m.dtype) for m in meta.tensors]
            self._send_lead(boundary, index, zeros, state, peer)

    def _send_lead(self, boundary, index, tensors, state: StepState, peer) -> None:
        if index == 0:
            bits = state.bits(tensors[0].dtype)
            tensors = [torch.cat([tensors[0].detach().reshape(-1), bits]), *tensors[1:]]
        self._send(LEAD, boundary, index, tensors, peer)

    def send_activation(self, boundary, index, tensors, packed, peer) -> None:
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"a stage output has {len(tensors)} tensors; at most "
                             f"{MAX_TENSORS} can cross a stage boundary")
        meta = ActivationMeta(tuple(TensorMeta.of(t) for t in tensors), packed)
        known = self.metas.get((boundary, index))
        if known is None:
            check_sendable(tensors)
            header = meta.encode()
            self._send(HEADER, boundary, index,
                       [torch.tensor([header.numel()], dtype=torch.int64), header], peer)
            self.metas[(boundary, index)] = meta
        elif known != meta:
            raise ValueError(f"stage {boundary}, micro-batch {index}: the output changed from "
                             f"{known} to {meta} although the batch's shapes and the grad mode "
                             f"did not; a stage's output shapes must follow from those")
        if self.lead is not None and boundary == self.lead[0] and index < LEAD_WINDOW:
            self._send_lead(boundary, index, tensors, self.lead[1], peer)
        else:
            self._send(ACTIVATION, boundary, index, tensors, peer)

    def _post(self, kind, boundary, index, likes, peer) -> None:
        key = (kind, boundary, index)
        if key in self.posted:
            return
        buffers = [torch.empty(m.shape, dtype=m.dtype) for m in likes]
        with self._reporting("receive", kind, boundary, index, peer):
            works = [dist.irecv(b, peer, group=self.group,
                                tag=self._tag(kind, boundary, index, n))
                     for n, b in enumerate(buffers)]
        self.posted[key] = (buffers, works)

    def post_activation(self, boundary, index, peer) -> None:
        meta = self.metas.get((boundary, index))
        if meta is not None:
            self._post(ACTIVATION, boundary, index, meta.tensors, peer)

    def take_activation(self, boundary, index, peer) -> tuple:
        if (boundary, index) not in self.metas:
            length = torch.empty(1, dtype=torch.int64)
            with self._reporting("receive", HEADER, boundary, index, peer):
                dist.recv(length, peer, group=self.group,
                          tag=self._tag(HEADER, boundary, index, 0))
                header = torch.empty(int(length.item()), dtype=torch.int64)
                dist.recv(header, peer, group=self.group,
                          tag=self._tag(HEADER, boundary, index, 1))
            self.metas[(boundary, index)] = ActivationMeta.decode(header.tolist())
        meta = self.metas[(boundary, index)]
        self._post(ACTIVATION, boundary, index, meta.tensors, peer)
        buffers, works = self.posted.pop((ACTIVATION, boundary, index))
        self._wait(works, ACTIVATION, boundary, index, peer)
        for b, m in zip(buffers, meta.tensors):
            b.requires_grad_(m.requires_grad)
        return tuple(buffers), meta.packed

    def send_gradient(self, boundary, index, grads, peer) -> None:
        self._send(GRADIENT, boundary, index, grads, peer)

    def post_gradient(self, boundary, index, roots, peer) -> None:
        self._post(GRADIENT, boundary, index, [TensorMeta.of(r) for r in roots], peer)

    def take_gradient(self, boundary, index, roots, peer) -> list:
        self.post_gradient(boundary, index, roots, peer)
        buffers, works = self.posted.pop((GRADIENT, boundary, index))
        self._wait(works, GRADIENT, boundary, index, peer)
        return buffers


def check_sendable(tensors: tuple) -> None:
    """Raise TypeError when a tensor's dtype cannot be described in a header."""
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"pipeline activations of dtype {t.dtype} cannot be sent; "
                            f"supported dtypes are {[str(d) for d in _DTYPES]}")
