"""What crosses a stage boundary: activation descriptions, the step state, the verdict, and the
tagged links.

Shapes are sent when they are new: the first time micro-batch ``i`` goes forward, a small int64
header (:class:`ActivationMeta`: dtype, requires_grad, shape of each tensor, and the batch's rows,
which later stages check their keyword tensors and target against) precedes the data;
afterwards both sides reuse the cached description, so the receiver can post its receive before
the sender is ready (the data lands while the receiver computes). Gradients need no header: a
stage knows the shapes of the outputs it sent. Each gradient tensor comes with a presence flag
(``GRADIENT_FLAGS`` element on the message's tail): a stage whose backward did not reach one of
its inputs (the stage ignored or detached it) sends zeros flagged absent, and the stage before
leaves that output out of its backward, as one process's backward never reaches it.

Whether the cached descriptions still hold is decided by the rank of the first stage, the only
one that sees the batch, and passed down the ranks every step as a :class:`StepState` (see
:class:`TaggedLinks`): the batch is as before, new (every rank drops its cache and the headers
go again, as in the first step) or unusable (every rank raises the same error), and whether the
step records for backward. So no cache depends on a grad mode or a batch size one rank alone
knows. With one stage per rank, a stage whose output shapes change with the data (same batch)
turns "as before" into "new" for the ranks after it, on micro-batch 0.

What only a later stage can see (a target it cannot use, an output that no longer matches the
shapes it announced, an exception in a stage's forward, backward or ``loss_fn``) travels as the
step's *verdict*: one element riding on the last message across each boundary, each way, and, at
the end of a training step, through group rank 0 (:meth:`TaggedLinks.settle`). A rank that
finds such a problem stops computing and goes on sending what its neighbours expect (zeros of
the announced shapes, or a ``VOID`` header where none were announced yet), so every rank runs
its whole step, learns the verdict on the way, and raises the same error at the end; the cached
headers are then dropped everywhere, so the next step announces its shapes again. All traffic
goes through :mod:`shardkit.distributed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from shardkit import distributed as dist

__all__ = ["TensorMeta", "ActivationMeta", "StepState", "batch_signature", "PendingSends",
           "TaggedLinks", "output_tensors", "describe", "VERDICT_ELEMENTS", "SETTLE_ELEMENTS",
           "GRADIENT_FLAGS", "VOID"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
ACTIVATION, GRADIENT, HEADER, LEAD, VERDICT, SETTLE, TIE = range(7)  # kinds, part of tags
MAX_TENSORS = 16
LEAD_WINDOW = 4  # micro-batches a receiver posts before it knows the step state
VERDICT_ELEMENTS = 1  # the verdict's elements on the last message across a boundary, each way
GRADIENT_FLAGS = 1  # elements per gradient tensor saying whether it is present (1) or absent (0)
SETTLE_ELEMENTS = 1  # float32 elements of a training step's final verdict, to and from rank 0


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one activation: dtype, shape, and whether it needs a
    gradient sent back."""

    dtype: torch.dtype
    shape: tuple
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        """``t``'s description."""
        return TensorMeta(t.dtype, tuple(t.shape), t.requires_grad)


@dataclass(frozen=True)
class ActivationMeta:
    """The tensors of one micro-batch's activation, and whether they travel as a tuple."""

    tensors: tuple
    packed: bool
    void: bool = False  # no output: the stage failed this step (see ``VOID``)
    # the batch's rows at the first stage (0: unknown), so that later stages can check their
    # keyword tensors and target against the batch's split (see ``TaggedLinks.batch_rows``)
    batch_rows: int = 0

    def encode(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The header: int64 values on ``device`` (the links' device; CPU by default)."""
        values = [2 if self.void else int(self.packed), len(self.tensors), self.batch_rows]
        for m in self.tensors:
            values += [_DTYPES.index(m.dtype), int(m.requires_grad), len(m.shape), *m.shape]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @staticmethod
    def decode(values: list) -> "ActivationMeta":
        """The description a header holds (:meth:`encode`'s values, as a list of ints)."""
        packed, void, count, pos, tensors = values[0] == 1, values[0] == 2, values[1], 3, []
        for _ in range(count):
            dtype, requires_grad = _DTYPES[values[pos]], bool(values[pos + 1])
            ndim = values[pos + 2]
            tensors.append(TensorMeta(dtype, tuple(values[pos + 3:pos + 3 + ndim]), requires_grad))
            pos += 3 + ndim
        return ActivationMeta(tuple(tensors), packed, void, values[2])


# What a stage sends for a micro-batch it has no output for, when no shapes were announced yet
# (a stage whose forward raised, or that learnt the step failed): one byte the receiver ignores.
VOID = ActivationMeta((TensorMeta(torch.uint8, (1,), False),), False, void=True)


def describe(meta: ActivationMeta) -> str:
    """``meta`` in words: ``"float32 (2, 8) requiring grad"``, or a tuple of such."""
    parts = [f"{str(m.dtype).replace('torch.', '')} {m.shape}"
             + (" requiring grad" if m.requires_grad else "") for m in meta.tensors]
    return f"a tuple of [{', '.join(parts)}]" if meta.packed else ", ".join(parts)


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

    def values(self) -> list:
        """The state as ``BITS`` zeros and ones (least significant first)."""
        value = 2 * self.batch + int(self.grad)
        return [(value >> i) & 1 for i in range(self.BITS)]

    @staticmethod
    def from_bits(bits: torch.Tensor) -> "StepState":
        """The state :meth:`values` gave, read from a tensor of those bits (one host read)."""
        value = sum(1 << i for i, b in enumerate(bits.tolist()) if b)
        return StepState(value // 2, bool(value % 2))


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
        """Keep each of ``tensors`` alive until its send in ``works`` completes (the sends
        already completed are forgotten)."""
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

    Note: the verdict (``failed``: this rank knows that some stage found a problem in the step)
    rides as ``VERDICT_ELEMENTS`` more elements on the first tensor of the last message across
    each boundary each way (``carriers``: the micro-batch of the stage's last F, and of the next
    stage's last B or BW, from the plan); a gradient message without tensors (no_grad steps,
    inputs that need no gradient) is replaced by a one-byte message. A stage's last send in
    each direction comes after its last receive from that side, so the verdict reaches every
    rank by the end of its action list, whichever stage found the problem.

    Note: every gradient message's tail starts with one presence flag per tensor
    (``GRADIENT_FLAGS`` elements each, 1 present, 0 absent: sent as zeros), before the verdict
    where the message carries it; :meth:`take_gradient` gives ``None`` for an absent one.

    Note: every tensor the links create (receive buffers, zeros, headers, tails, the verdict
    and settle messages) lives on ``device``, the device of this rank's stages (CPU by
    default): NCCL sends and receives CUDA tensors only.
    """

    def __init__(self, group, num_stages: int, chunks: int, reannounce: bool = False,
                 device=None):
        self.group, self.num_stages, self.chunks = group, num_stages, chunks
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.reannounce = reannounce  # a rank may turn SAME into NEW (one stage per rank)
        self.metas: dict = {}      # (boundary, micro-batch) -> ActivationMeta
        self.posted: dict = {}     # (kind, boundary, micro-batch) -> (buffers, works, verdict)
        self.pending = PendingSends()
        self.lead: Optional[tuple] = None  # this step's (boundary, StepState) to send on
        self.carriers: dict = {}   # (ACTIVATION or GRADIENT, boundary) -> micro-batch
        self.failed = False        # the verdict as this rank knows it
        # the batch's rows: set by the first stage's rank, learnt elsewhere from the headers
        # (sent again whenever the batch's shapes change); None until known this step
        self.batch_rows: Optional[int] = None

    def _tag(self, kind: int, boundary: int, index: int, tensor: int = 0) -> int:
        return ((kind * self.num_stages + boundary) * self.chunks + index) * MAX_TENSORS + tensor

    def _carries(self, way: int, boundary: int, index: int) -> bool:
        return self.carriers.get((way, boundary)) == index

    def _verdict(self, way: int, boundary: int, index: int) -> list:
        return [int(self.failed)] if self._carries(way, boundary, index) else []

    def _learn(self, verdict: Optional[torch.Tensor]) -> None:
        if verdict is not None and bool(verdict[-1]):
            self.failed = True

    def _send(self, kind, boundary, index, tensors, peer, tail: list = ()) -> None:
        """Send ``tensors``, ``tail`` (small ints) appended to the first one."""
        data = [t.detach().contiguous() for t in tensors]
        if tail:
            data[0] = torch.cat([data[0].reshape(-1), torch.tensor(tail, dtype=data[0].dtype,
                                                                   device=self.device)])
        with self._reporting("send", kind, boundary, index, peer):
            works = [dist.isend(t, peer, group=self.group,
                                tag=self._tag(kind, boundary, index, n))
                     for n, t in enumerate(data)]
        self.pending.add(works, data)

    def _receive(self, kind, boundary, index, likes: list, extra: int, peer) -> tuple:
        """Post the receives of one message shaped like ``likes`` (TensorMeta) with ``extra``
        elements after the first tensor: (buffers, works, those extra elements)."""
        first = likes[0]
        numel = math.prod(first.shape)
        flat = torch.empty(numel + extra, dtype=first.dtype, device=self.device)
        buffers = [flat[:numel].view(first.shape)] + [
            torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in likes[1:]]
        with self._reporting("receive", kind, boundary, index, peer):
            works = [dist.irecv(b, peer, group=self.group,
                                tag=self._tag(kind, boundary, index, n))
                     for n, b in enumerate([flat, *buffers[1:]])]
        return buffers, works, flat[numel:]

    def _zeros(self, meta: TensorMeta) -> torch.Tensor:
        """Zeros of ``meta``'s shape and dtype on the links' device."""
        return torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)

    def _reporting(self, verb: str, kind: int, boundary: int, index: int, peer: int):
        """A broken link (a neighbour that died) becomes a CollectiveError naming the message."""
        what = {ACTIVATION: f"stage {boundary}'s output", HEADER: f"stage {boundary}'s output "
                f"header", GRADIENT: f"the gradient of stage {boundary}'s output",
                LEAD: f"stage {boundary}'s output with the step state",
                VERDICT: f"the step's verdict from stage {boundary + 1}",
                SETTLE: "the training step's final verdict"}[kind]
        way = "to" if verb == "send" else "from"
        return dist.reporting_broken_links(
            f"pipeline {verb} of {what} (micro-batch {index}) {way} rank {peer}", self.group)

    def _wait(self, works: list, kind: int, boundary: int, index: int, peer: int) -> None:
        with self._reporting("receive", kind, boundary, index, peer):
            for work in works:
                work.wait()

    # ------------------------------------------------------------------ the lead window
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
        window = [self._receive(LEAD, boundary, i, meta.tensors, self._lead_extra(boundary, i),
                                peer) for i, meta in enumerate(metas)]
        self._wait(window[0][1], LEAD, boundary, 0, peer)
        state = StepState.from_bits(window[0][2][:StepState.BITS])
        for index, (buffers, works, tail) in enumerate(window):
            if state.batch == StepState.SAME:  # micro-batch 0 is in: nothing left to wait for
                verdict = tail if self._carries(ACTIVATION, boundary, index) else None
                self.posted[(ACTIVATION, boundary, index)] = (buffers, works if index else [],
                                                              verdict)
            elif index:
                self._wait(works, LEAD, boundary, index, peer)
        return state

    def _lead_extra(self, boundary: int, index: int) -> int:
        return (StepState.BITS if index == 0 else 0) + \
            len(self._verdict(ACTIVATION, boundary, index))

    def start_lead(self, boundary: int, state: StepState, peer: int) -> None:
        """Pass ``state`` on over ``boundary`` to ``peer`` if it expects a lead window (the
        window's shapes are cached): zeros at once for a new or bad batch, else the outputs
        as they come (:meth:`send_activation`)."""
        self.lead = None
        if self._lead_metas(boundary) is None:
            return
        if state.batch == StepState.SAME:
            self.lead = (boundary, state)
            return
        self._send_zero_window(boundary, state, peer)

    def _send_zero_window(self, boundary: int, state: StepState, peer: int) -> None:
        for index, meta in enumerate(self._lead_metas(boundary)):
            zeros = [self._zeros(m) for m in meta.tensors]
            self._send_lead(boundary, index, zeros, state, peer)

    def _send_lead(self, boundary, index, tensors, state: StepState, peer) -> None:
        tail = (state.values() if index == 0 else []) + self._verdict(ACTIVATION, boundary, index)
        self._send(LEAD, boundary, index, tensors, peer, tail)

    def _reannounce(self, boundary: int, index: int, peer: int) -> bool:
        """Turn this step's SAME into NEW over ``boundary`` when micro-batch 0's output changed
        (one stage per rank; the lead window not sent yet): zeros fill the window the next
        rank posted, its headers go again. Whether it did."""
        if not (self.reannounce and index == 0 and self.lead is not None
                and self.lead[0] == boundary):
            return False
        self._send_zero_window(boundary, StepState(StepState.NEW, self.lead[1].grad), peer)
        self.lead = None
        for key in [k for k in self.metas if k[0] == boundary]:
            del self.metas[key]
        return True

    # ------------------------------------------------------------------ activations
    def send_activation(self, boundary, index, tensors, packed, peer) -> Optional[str]:
        """Send one micro-batch's output over ``boundary`` (its header first when new). An
        output that no longer matches the shapes announced for it (and cannot be announced
        again) goes as zeros of the announced shapes, so the next stage gets what it posted;
        the problem is returned for the step's verdict."""
        meta = ActivationMeta(tuple(TensorMeta.of(t) for t in tensors), packed,
                              batch_rows=self.batch_rows or 0)
        known = self.metas.get((boundary, index))
        if known is not None and known != meta:
            if not self._reannounce(boundary, index, peer):
                # failed before the zeros go: they may carry the step's verdict (the last
                # micro-batch), the only way a forward-only step tells the next rank
                self.failed = True
                self._send_data(boundary, index, [self._zeros(m) for m in known.tensors],
                                peer)
                return self._changed_output(boundary, index, known, meta)
            known = None
        if known is None:
            self._announce(boundary, index, meta, peer)
        self._send_data(boundary, index, tensors, peer)
        return None

    def send_no_output(self, boundary, index, peer) -> None:
        """Send what the next stage expects for micro-batch ``index`` when this stage has no
        output for it (the step failed here or earlier): zeros of the announced shapes, else a
        ``VOID`` header and its one byte, which tell the receiver the step failed."""
        known = self.metas.get((boundary, index))
        if known is None:
            self._announce(boundary, index, VOID, peer)
            known = VOID
        self._send_data(boundary, index, [self._zeros(m) for m in known.tensors], peer)

    def _announce(self, boundary, index, meta: ActivationMeta, peer) -> None:
        """Send ``meta`` as micro-batch ``index``'s header over ``boundary`` (its length, then
        the int64 description) and cache it on this side, as the receiver does."""
        header = meta.encode(self.device)
        length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
        self._send(HEADER, boundary, index, [length, header], peer)
        self.metas[(boundary, index)] = meta

    def _send_data(self, boundary, index, tensors, peer) -> None:
        if self.lead is not None and boundary == self.lead[0] and index < LEAD_WINDOW:
            self._send_lead(boundary, index, tensors, self.lead[1], peer)
        else:
            self._send(ACTIVATION, boundary, index, tensors, peer,
                       self._verdict(ACTIVATION, boundary, index))

    def _changed_output(self, boundary, index, known, meta) -> str:
        why = ("a stage's output shapes may change from one step to the next only together "
               "with micro-batch 0's (the new shapes are announced on micro-batch 0)"
               if self.reannounce else
               "with several stages per rank a stage's output shapes must follow from the "
               "batch's shapes and the grad mode (schedules with one stage per rank announce "
               "output shapes that change with the data)")
        return (f"stage {boundary}, micro-batch {index}: expected an output of {describe(known)} "
                f"(announced to stage {boundary + 1} on an earlier step; the batch's shapes and "
                f"the grad mode are unchanged), found {describe(meta)}; {why}")

    def post_activation(self, boundary, index, peer) -> None:
        """Post the receive of micro-batch ``index``'s output over ``boundary`` early, if its
        shapes are cached (else :meth:`take_activation` receives the header first)."""
        meta = self.metas.get((boundary, index))
        if meta is not None:
            self._post_activation(boundary, index, meta, peer)

    def _post_activation(self, boundary, index, meta: ActivationMeta, peer) -> None:
        key = (ACTIVATION, boundary, index)
        if key in self.posted:
            return
        carries = self._carries(ACTIVATION, boundary, index)
        buffers, works, tail = self._receive(ACTIVATION, boundary, index, meta.tensors,
                                             int(carries), peer)
        self.posted[key] = (buffers, works, tail if carries else None)

    def take_activation(self, boundary, index, peer) -> tuple:
        """The output :meth:`send_activation` sent, as ``(tensors, packed)`` (its header
        received first when new); blocks until it has arrived."""
        if (boundary, index) not in self.metas:
            length = torch.empty(1, dtype=torch.int64, device=self.device)
            with self._reporting("receive", HEADER, boundary, index, peer):
                dist.recv(length, peer, group=self.group,
                          tag=self._tag(HEADER, boundary, index, 0))
                header = torch.empty(int(length.item()), dtype=torch.int64,
                                     device=self.device)
                dist.recv(header, peer, group=self.group,
                          tag=self._tag(HEADER, boundary, index, 1))
            self.metas[(boundary, index)] = ActivationMeta.decode(header.tolist())
            self.batch_rows = self.metas[(boundary, index)].batch_rows or self.batch_rows
        meta = self.metas[(boundary, index)]
        if meta.void:  # the stage before had no output: the step failed there
            self.failed = True
        self._post_activation(boundary, index, meta, peer)
        buffers, works, verdict = self.posted.pop((ACTIVATION, boundary, index))
        self._wait(works, ACTIVATION, boundary, index, peer)
        self._learn(verdict)
        for b, m in zip(buffers, meta.tensors):
            b.requires_grad_(m.requires_grad)
        return tuple(buffers), meta.packed

    def tie_tag(self, boundary: int, index: int) -> int:
        """The tag of the ``index``-th weight tied between stage ``boundary`` and a later
        stage on another rank (:mod:`~shardkit.nn.pipe.ties`; at most ``MAX_TENSORS``)."""
        return self._tag(TIE, boundary, 0, index)

    # ------------------------------------------------------------------ the final verdict
    def settle(self, ranks: list) -> None:
        """End a training step's verdict (``ranks``: the group's global ranks, this rank's
        place in them given by ``group``): every other rank tells group rank 0 what it knows,
        and rank 0, which runs stage 0 and so ends the step with its last backward, tells each
        the outcome (``SETTLE_ELEMENTS`` float32 each way between rank 0 and every other rank,
        per training step). Needed because a stage's backward
        (or W) that raises comes after its last message downstream; rank 0 waits for nothing
        it would not have waited for anyway, the others for one message."""
        me, first = dist.get_rank(self.group), ranks[0]
        tag = self._tag(SETTLE, 0, 0)
        if me == 0:
            heard = [self._settle_flag(0.0) for _ in ranks[1:]]
            for peer, flag in zip(ranks[1:], heard):
                with self._reporting("receive", SETTLE, 0, 0, peer):
                    work = dist.irecv(flag, peer, group=self.group, tag=tag)
                self._wait([work], SETTLE, 0, 0, peer)
                self._learn(flag)
            outcome = self._settle_flag(float(self.failed))
            for peer in ranks[1:]:
                self._send(SETTLE, 0, 0, [outcome], peer)
            return
        self._send(SETTLE, 0, 0, [self._settle_flag(float(self.failed))], first)
        outcome = self._settle_flag(0.0)
        with self._reporting("receive", SETTLE, 0, 0, first):
            work = dist.irecv(outcome, first, group=self.group, tag=tag)
        self._wait([work], SETTLE, 0, 0, first)
        self._learn(outcome)

    def _settle_flag(self, value: float) -> torch.Tensor:
        """A settle message (``SETTLE_ELEMENTS`` float32) holding ``value``."""
        return torch.full((SETTLE_ELEMENTS,), value, device=self.device)

    # ------------------------------------------------------------------ gradients
    def send_gradient(self, boundary, index, grads, peer) -> None:
        """Send the gradients of micro-batch ``index``'s output back over ``boundary``: one
        entry per output tensor sent requiring grad, ``None`` where this stage's backward gave
        it no gradient (it was not used, or detached). Each tensor goes with a presence flag
        (``GRADIENT_FLAGS`` elements per tensor on the message's tail, before the verdict), an
        absent one as zeros of its shape, so the receiver leaves out what one process's
        backward would never reach."""
        verdict = self._verdict(GRADIENT, boundary, index)
        if grads:
            likes = [m for m in self.metas[(boundary, index)].tensors if m.requires_grad]
            flags = [int(g is not None) for g in grads]
            data = [g if g is not None else self._zeros(m) for g, m in zip(grads, likes)]
            self._send(GRADIENT, boundary, index, data, peer, flags + verdict)
        elif verdict:
            self._send(VERDICT, boundary, index,
                       [torch.tensor(verdict, dtype=torch.uint8, device=self.device)], peer)

    def post_gradient(self, boundary, index, peer) -> None:
        """Post the receive of the gradient of micro-batch ``index``'s output over ``boundary``:
        one tensor for each output tensor sent requiring grad, in the shapes sent, and their
        presence flags."""
        key = (GRADIENT, boundary, index)
        if key in self.posted:
            return
        likes = [m for m in self.metas[(boundary, index)].tensors if m.requires_grad]
        carries = self._carries(GRADIENT, boundary, index)
        if likes:
            buffers, works, tail = self._receive(GRADIENT, boundary, index, likes,
                                                 GRADIENT_FLAGS * len(likes) + int(carries),
                                                 peer)
        elif carries:
            buffers = []
            _, works, tail = self._receive(VERDICT, boundary, index,
                                           [TensorMeta(torch.uint8, (0,), False)], 1, peer)
        else:
            buffers, works, tail = [], [], None
        self.posted[key] = (buffers, works, tail)

    def take_gradient(self, boundary, index, peer) -> list:
        """The gradients :meth:`send_gradient` sent, ``None`` where absent."""
        self.post_gradient(boundary, index, peer)
        buffers, works, tail = self.posted.pop((GRADIENT, boundary, index))
        self._wait(works, GRADIENT, boundary, index, peer)
        flags = tail[:GRADIENT_FLAGS * len(buffers)].tolist() if buffers else []
        self._learn(tail if self._carries(GRADIENT, boundary, index) else None)
        return [b if flag else None for b, flag in zip(buffers, flags)]


def output_tensors(output) -> tuple[Optional[tuple], Optional[str]]:
    """A stage's output as the tensors to send, or ``None`` and what makes it unsendable: a
    tensor or a tuple/list of at most ``MAX_TENSORS`` tensors of the dtypes a header names."""
    tensors = (output,) if isinstance(output, torch.Tensor) else \
        tuple(output) if isinstance(output, (tuple, list)) else None
    if tensors is None or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None, (f"its output ({type(output).__name__}) cannot cross a stage boundary: "
                      f"return a tensor or a tuple of tensors")
    if len(tensors) > MAX_TENSORS:
        return None, (f"its output has {len(tensors)} tensors; at most {MAX_TENSORS} can cross "
                      f"a stage boundary")
    for t in tensors:
        if t.dtype not in _DTYPES:
            return None, (f"its output holds a tensor of dtype {t.dtype}, which cannot cross a "
                          f"stage boundary; supported dtypes are {[str(d) for d in _DTYPES]}")
    return tensors, None
