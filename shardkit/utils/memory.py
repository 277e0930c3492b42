"""Per-rank model-state accounting measured from tensor storages.

:func:`model_state_bytes` answers "how many bytes of parameters, gradients and optimizer state
does this rank really hold?" by walking the module and the optimizer and summing the sizes of
the distinct storages behind those tensors. A storage shared by several tensors (tied weights,
views into one flat buffer) is counted once, in the first category that reaches it. Wrappers
that hold model state outside ``module.parameters()`` (gradient buckets, flat parameter
buffers) report it through a ``model_state_tensors()`` method yielding ``(category, tensor)``
pairs, which this function picks up on the module and every submodule. Buffers a wrapper's
transport holds for the life of the process (e.g. the slots of
:class:`~shardkit.shm_transport.SharedMemoryTransport`) are reported apart, as ``transport``:
they are not model state, but they are memory the wrapper costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

__all__ = ["ModelStateBytes", "model_state_bytes", "tensor_storage_bytes"]

CATEGORIES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes held by this rank: parameters, gradients, optimizer state and their total."""

    params: int
    grads: int
    optimizer: int
    transport: int = 0

    @property
    def total(self) -> int:
        """Model states: parameters, gradients and optimizer state (not ``transport``)."""
        return self.params + self.grads + self.optimizer

    def __getitem__(self, key: str) -> int:
        return getattr(self, key)

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "transport": self.transport,
                "total": self.total}


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return (t.device, s.data_ptr(), s.nbytes())


def tensor_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage counted once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key[2] and key not in seen:
                seen[key] = key[2]
    return sum(seen.values())


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    stack = [optimizer.state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def _module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for m in module.modules():
        report = getattr(m, "model_state_tensors", None)
        if callable(report):
            yield from report()
    for p in module.parameters():
        yield "params", p
        if p.grad is not None:
            yield "grads", p.grad


def _transport_tensors(module, optimizer) -> Iterator[torch.Tensor]:
    """The buffers held by the transports (``comm``) of the wrappers in ``module`` and of
    ``optimizer``, each transport once."""
    holders = list(module.modules()) if module is not None else []
    holders.append(optimizer)
    seen = set()
    for holder in holders:
        comm = getattr(holder, "__dict__", {}).get("comm")
        if comm is None or id(comm) in seen or not hasattr(comm, "footprint_tensors"):
            continue
        seen.add(id(comm))
        yield from comm.footprint_tensors()


def model_state_bytes(module: Optional[torch.nn.Module] = None,
                      optimizer: Optional[torch.optim.Optimizer] = None) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds, per storage.

    Args:
        module: the (possibly wrapped) model; its parameters, their ``.grad`` and whatever its
            submodules report through ``model_state_tensors()``.
        optimizer: its ``state`` tensors (for ``OSS``: the local shard's state), plus the
            ``params`` of its param groups and their grads not already seen through the module.

    Costs no communication; touches no tensor data.
    """
    pairs: list[tuple[str, torch.Tensor]] = []
    if module is not None:
        pairs.extend(_module_tensors(module))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                pairs.append(("params", p))
                if p.grad is not None:
                    pairs.append(("grads", p.grad))
        pairs.extend(("optimizer", t) for t in _optimizer_tensors(optimizer))
    pairs.extend(("transport", t) for t in _transport_tensors(module, optimizer))
    totals = dict.fromkeys(CATEGORIES + ("transport",), 0)
    seen = set()
    for category, t in pairs:
        key = _storage_key(t)
        if key[2] == 0 or key in seen:
            continue
        seen.add(key)
        totals[category] += key[2]
    return ModelStateBytes(**totals)
