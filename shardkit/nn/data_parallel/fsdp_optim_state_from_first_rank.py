"""A full optimizer state dict given on the model's first rank alone (``rank0_only``,
``scatter_full_optim_state_dict``) sent to every rank: its skeleton (structure and small
tensors) in one object broadcast, then its large tensors one broadcast each, every rank
cutting its rows out of each as it arrives. Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`.
"""

from __future__ import annotations

import pickle
from typing import NamedTuple, Optional

import torch

from shardkit import distributed as skdist
from shardkit.checkpoint.fsdp_state import copied_part
from shardkit.nn.data_parallel.fsdp_optim_state_keys import _keyed_by_ids
from shardkit.nn.data_parallel.fsdp_optim_state_sharded import _refuse_state_never_received


def _from_first_rank(model, osd, caller: str, argument: str) -> "_FirstRanksDict":
    """The full optimizer state dict ``osd`` given on the model's first rank (rank 0 of its
    group and of the replicas), as every rank of the group and replicas holds it before its
    large tensors arrive: keyed by ids, each state tensor of at least :data:`_PICKLED_NUMEL`
    elements a stand-in that :class:`_StreamedTensors` brings later, one at a time; or the
    text of why it is not such a dict (checked on that rank, before it is sent). ``osd`` is
    ignored on the other ranks, as torch FSDP1 ignores it under ``rank0_only``.
    Communication: over the replicas, then over the group, one object broadcast of the
    dict's skeleton (its structure and its small tensors). Memory: the skeleton."""
    payload, own = None, []
    if model._is_first_rank():
        try:
            if osd is None:
                raise ValueError(f"FSDP.{caller}({argument}=None) on rank 0: rank 0 must pass "
                                 f"the full optimizer state dict (e.g. torch.load of the saved "
                                 f"file); the other ranks may pass None or {{}}")
            _refuse_state_never_received(osd)
            payload = _sendable(("ok", _without_large_tensors(_keyed_by_ids(osd, caller),
                                                              own)))
        except Exception as error:  # sent, so that no rank waits for a dict never sent
            payload = _as_error(error)
    hops = []  # (group, its source, whether this rank sends) where the dict travels
    replicas = [model.replicate_group] if model.replicate_group is not None else []
    for group in replicas + [model.process_group]:
        src, sending = skdist.get_global_rank(group, 0), skdist.get_rank(group) == 0
        payload = skdist.broadcast_object(payload if sending else None, src=src, group=group)
        if _is_dict_sent(payload):
            hops.append((group, src, sending))
    if not _is_dict_sent(payload):
        return _FirstRanksDict("error", payload[1], None)
    tensors = _StreamedTensors(own, hops, model._comm_device())
    return _FirstRanksDict("ok", tensors.with_stand_ins(payload[1]), tensors)


def _is_dict_sent(payload) -> bool:
    return isinstance(payload, tuple) and len(payload) == 2 and payload[0] == "ok"


class _FirstRanksDict(NamedTuple):
    """:func:`_from_first_rank`'s answer: ``kind`` ``"ok"``, ``value`` the dict (with
    stand-ins) and ``tensors`` what brings its large tensors; or ``"error"`` and its text."""

    kind: str
    value: object
    tensors: Optional["_StreamedTensors"]


# tensors of fewer elements travel inside the pickled skeleton (a step count, a small bias's
# moments), so that a model of many small parameters costs few collectives
_PICKLED_NUMEL = 1 << 16


class _Sent(NamedTuple):
    """Where a large tensor of a state dict stood in its pickled skeleton."""

    index: int
    shape: tuple
    dtype: torch.dtype
    on_cpu: bool


def _without_large_tensors(ided: dict, large: list) -> dict:
    """``ided`` with each tensor of its state entries of at least :data:`_PICKLED_NUMEL`
    elements replaced by a :class:`_Sent` (the tensor appended to ``large``)."""
    def strip(value):
        if torch.is_tensor(value) and value.numel() >= _PICKLED_NUMEL:
            large.append(value)
            return _Sent(len(large) - 1, tuple(value.shape), value.dtype,
                         value.device.type == "cpu")
        return value
    state = {i: {k: strip(v) for k, v in entry.items()} if isinstance(entry, dict) else entry
             for i, entry in ided["state"].items()}
    return dict(ided, state=state)


class _Pending(NamedTuple):
    """The part (``cut``: ``(layout, rank)``, or ``None`` for the whole) a rank keeps of the
    large tensor ``index``, which has not arrived yet."""

    index: int
    cut: Optional[tuple]


class _StreamedTensors:
    """The first rank's large state tensors, received on every rank one at a time.

    While they travel, a meta tensor of each one's shape and dtype stands in the dict
    (:meth:`with_stand_ins`), so that the dict's checks and the matching of its entries to
    this rank's parameters run on shapes alone; :meth:`take` (the ``take`` of
    :func:`~shardkit.checkpoint.fsdp_state.shard_optimizer_state`) records the part of each a
    rank keeps, and :meth:`fill` then broadcasts them in the first rank's order (over the
    replicas, then over the group), each rank cutting its part out of each tensor as it
    arrives and dropping the rest.

    Note: every rank broadcasts every tensor, in that order, whatever it keeps (also a rank
    whose own checks failed): the order comes from the skeleton all ranks share, so no rank
    waits on a broadcast another skips. Memory: this rank's parts plus one full tensor in
    flight (as torch FSDP1's), where the whole dict used to arrive before any was cut."""

    def __init__(self, own: list, hops: list, device: torch.device):
        self._own, self._hops, self._device = own, hops, device
        self._sent: list = []
        self._index: dict = {}

    def with_stand_ins(self, skeleton: dict) -> dict:
        """``skeleton`` with each :class:`_Sent` of its state a meta tensor standing in."""
        def stand_in(value):
            if not isinstance(value, _Sent):
                return value
            tensor = torch.empty(value.shape, dtype=value.dtype, device="meta")
            self._index[id(tensor)] = len(self._sent)
            self._sent.append(value)
            return tensor
        state = {i: {k: stand_in(v) for k, v in entry.items()} if isinstance(entry, dict)
                 else entry for i, entry in skeleton["state"].items()}
        return dict(skeleton, state=state)

    def take(self, value, cut: Optional[tuple]):
        """A :class:`_Pending` for a stand-in, else :func:`copied_part`."""
        index = self._index.get(id(value)) if torch.is_tensor(value) else None
        return copied_part(value, cut) if index is None else _Pending(index, cut)

    def fill(self, part: Optional[dict]) -> None:
        """Receive every tensor (all ranks must call it; ``part`` ``None`` on a rank that
        keeps nothing) and put in place of each :class:`_Pending` of ``part``'s state its
        part of the tensor."""
        wanted: dict = {}
        for entry in (part or {}).get("state", {}).values():
            for key, value in entry.items():
                if isinstance(value, _Pending):
                    wanted.setdefault(value.index, []).append((entry, key, value.cut))
        for index in range(len(self._sent)):
            tensor = self._received(index)
            for entry, key, cut in wanted.pop(index, ()):
                entry[key] = copied_part(tensor, cut)
            del tensor

    def _received(self, index: int) -> torch.Tensor:
        """Tensor ``index``, after this rank passed it on (or received it) on each hop."""
        sent = self._sent[index]
        tensor = self._own[sent.index] if self._own else None
        for group, src, sending in self._hops:
            if sending:
                skdist.broadcast(tensor.detach().to(self._device).contiguous(), src=src,
                                 group=group)
            else:
                landing = torch.empty(sent.shape, dtype=sent.dtype, device=self._device)
                skdist.broadcast(landing, src=src, group=group)
                tensor = landing.cpu() if sent.on_cpu else landing
        return tensor


def _as_error(error: BaseException) -> tuple:
    """``("error", text)`` for a problem found on the sending rank (a ValueError's own text,
    else its type and text), sent in place of the dict."""
    return ("error", str(error) if isinstance(error, ValueError)
            else f"{type(error).__name__}: {error}")


def _sendable(skeleton):
    """``skeleton``, or :func:`_as_error` of why it cannot be pickled (a lambda in a param
    group): found here, on the sender, rather than inside the broadcast that the other ranks
    would wait in. One pickling pass of the skeleton into nothing (its large tensors travel
    apart and are not pickled)."""
    try:
        pickle.Pickler(_Discarded()).dump(skeleton)
    except Exception as error:
        return _as_error(error)
    return skeleton


class _Discarded:
    """A file that keeps nothing: pickling into it checks that an object can be sent, without
    holding its bytes."""

    @staticmethod
    def write(data) -> int:
        return len(data)
