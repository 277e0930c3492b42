"""What :class:`CommCounter` counts: the records of the collectives issued inside a block.

The mechanism that issues collectives (:mod:`shardkit.distributed`) reports each op here, just
before issuing it, through :func:`add_record`, and a transport that moves bytes outside the
process group (shared memory) through :func:`add_collective`; this module knows nothing of
process groups. The
byte convention (ring algorithms, rooted ops averaged over the ranks) is in
:mod:`shardkit.distributed`'s docstring and in :data:`WIRE_FACTOR`. Costs nothing on the wire;
one small record per collective per active counter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["CommCounter", "CommRecord", "CallList", "WIRE_FACTOR", "element_size", "counting",
           "add_record", "add_collective"]


@dataclass(frozen=True)
class CommRecord:
    """One collective as seen by :class:`CommCounter`."""

    op: str
    numel: int
    dtype: torch.dtype
    bytes: float
    group_size: int
    # the op's group has ranks on more than one node (None: unknown to this rank, see
    # shardkit.distributed.NodeNumberingUnknown)
    spans_nodes: Optional[bool] = False


class CallList(list):
    """The records of a :class:`CommCounter`; compares with an ``int`` as its length."""

    def __eq__(self, other):
        return len(self) == other if isinstance(other, int) else list.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __lt__(self, other):
        return len(self) < other if isinstance(other, int) else list.__lt__(self, other)

    def __le__(self, other):
        return len(self) <= other if isinstance(other, int) else list.__le__(self, other)

    def __gt__(self, other):
        return len(self) > other if isinstance(other, int) else list.__gt__(self, other)

    def __ge__(self, other):
        return len(self) >= other if isinstance(other, int) else list.__ge__(self, other)

    def __int__(self):
        return len(self)

    __hash__ = None


_active_counters: list["CommCounter"] = []
_counter_lock = threading.Lock()


class CommCounter:
    """Count the bytes this rank puts on the wire for collectives issued inside the block.

    Usage::

        with CommCounter() as comm:
            loss = model(x).sum(); loss.backward(); optimizer.step()
        print(comm.bytes, comm.by_op, len(comm.calls))

    Attributes:
        bytes: total bytes under the ring convention of this module's docstring.
        by_op: ``{op name: bytes}``.
        calls: list of :class:`CommRecord`, one per collective (an ``int`` compares with its
            length); ``calls_by_op`` gives ``{op name: count}``.

    Per link: ``intra_node_bytes`` counts ops on groups whose ranks share one node,
    ``inter_node_bytes`` ops on groups that span nodes, both under the same convention and
    classified by the op's group (a send on a spanning group counts as spanning even when its
    peer shares the node); a group spans nodes when its ranks run on more than one node of
    the layout :func:`shardkit.distributed.init_distributed` gathers (``GROUP_RANK`` or host
    name, whatever order the launcher numbered the ranks in; see
    :func:`shardkit.distributed.spans_nodes`).

    Counters nest: an op issued inside two counters is recorded once in each, and once in a
    counter entered again inside its own block (``with comm:`` in a helper). Asynchronous
    ops are recorded once, when issued. Costs nothing on the wire.
    """

    def __init__(self):
        self.calls: CallList = CallList()

    @property
    def bytes(self) -> float:
        """Bus bytes of every recorded call, summed."""
        return sum(r.bytes for r in self.calls)

    @property
    def by_op(self) -> dict[str, float]:
        """Bus bytes per operation name (``all_gather``, ``reduce_scatter``, ...)."""
        out: dict[str, float] = {}
        for r in self.calls:
            out[r.op] = out.get(r.op, 0.0) + r.bytes
        return out

    @property
    def calls_by_op(self) -> dict[str, int]:
        """Number of recorded calls per operation name."""
        out: dict[str, int] = {}
        for r in self.calls:
            out[r.op] = out.get(r.op, 0) + 1
        return out

    @property
    def elements(self) -> float:
        """Elements on the wire: bytes of each record divided by its element size. Quantized
        ops are ``uint8`` records, so there one element is one byte (codes and scales): with
        them in the count, compare :attr:`bytes` instead."""
        return sum(r.bytes / element_size(r.dtype) for r in self.calls if r.numel)

    @property
    def inter_node_bytes(self) -> float:
        """Bytes of the ops on groups that span nodes (all of them on one node: 0). Raises
        RuntimeError where this rank could not tell which ops spanned nodes."""
        return sum(r.bytes for r in self._calls_split_by_node() if r.spans_nodes)

    @property
    def intra_node_bytes(self) -> float:
        """Bytes of the ops on groups inside one node (raises as :attr:`inter_node_bytes`)."""
        return sum(r.bytes for r in self._calls_split_by_node() if not r.spans_nodes)

    @property
    def inter_node_elements(self) -> float:
        """Elements of the ops on groups that span nodes (quantized ops: bytes, as in
        :attr:`elements`; raises as :attr:`inter_node_bytes`)."""
        return sum(r.bytes / element_size(r.dtype) for r in self._calls_split_by_node()
                   if r.numel and r.spans_nodes)

    def _calls_split_by_node(self) -> list:
        """The records, once each is known to span nodes or not; else a RuntimeError saying
        why (a world made by torch under a launcher other than torchrun, its nodes never
        gathered)."""
        unknown = [r.op for r in self.calls if r.spans_nodes is None]
        if unknown:
            raise RuntimeError(
                f"CommCounter: which of {len(unknown)} recorded op(s) ({sorted(set(unknown))}) "
                f"spanned nodes is unknown on this rank: GROUP_RANK was set by a launcher "
                f"other than torchrun, which may not number the ranks node by node, and the "
                f"node of every rank was not gathered; call "
                f"shardkit.distributed.node_groups() (or init_distributed()) on every rank "
                f"before counting (bytes and by_op are right as they are)")
        return list(self.calls)

    def reset(self) -> None:
        """Forget every recorded call (the counter keeps counting)."""
        self.calls = CallList()

    def __enter__(self) -> "CommCounter":
        with _counter_lock:
            _active_counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _counter_lock:
            _active_counters.remove(self)

    def __repr__(self) -> str:
        return f"CommCounter(bytes={self.bytes:.0f}, calls={len(self.calls)}, by_op={self.by_op})"


def element_size(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


WIRE_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
}


def counting() -> bool:
    """True while at least one :class:`CommCounter` is active (recording can be skipped)."""
    return bool(_active_counters)


def add_collective(op: str, nbytes: int, dtype: torch.dtype, group_size: int,
                   spans_nodes: Optional[bool] = False) -> None:
    """Record, in every active counter, the collective ``op`` of a tensor whose full logical
    size is ``nbytes`` bytes of ``dtype`` (all-gather output, reduce-scatter, all-to-all and
    reduce input, broadcast tensor) on a group of ``group_size`` ranks, under
    :data:`WIRE_FACTOR`'s convention: the bytes the process group's collective is counted
    for, so that a transport moving the same bytes another way (shared memory) records the
    same number on every rank, fractions of a byte included. Nothing is sent here."""
    if not counting():
        return
    record = CommRecord(op=op, numel=nbytes // element_size(dtype), dtype=dtype,
                        bytes=WIRE_FACTOR[op](group_size) * nbytes, group_size=group_size,
                        spans_nodes=spans_nodes)
    add_record(record)


def add_record(record: CommRecord) -> None:
    """Append ``record`` to every active counter, once to each (a counter entered again
    inside its own block is still one counter)."""
    with _counter_lock:
        for counter in dict.fromkeys(_active_counters):
            counter.calls.append(record)
