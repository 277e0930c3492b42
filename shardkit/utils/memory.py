"""Per-rank model-state accounting measured from tensor storages.

:func:`model_state_bytes` answers "how many bytes of parameters, gradients and optimizer state
does this rank really hold?" by walking the module and the optimizer and summing the sizes of
the distinct storages behind those tensors. A storage shared by several tensors (tied weights,
views into one flat buffer) is counted once, in the first category that reaches it; a sparse
tensor (an embedding's sparse gradient) counts its index and value storages, a tensor on the
``meta`` device nothing (it holds no memory). Wrappers
that hold model state outside ``module.parameters()`` (gradient buckets, flat parameter
buffers) report it through a ``model_state_tensors()`` method yielding ``(category, tensor)``
pairs, which this function picks up on the module and every submodule. Buffers a wrapper's
transport holds for the life of the process (e.g. the slots of
:class:`~shardkit.shm_transport.SharedMemoryTransport`) are reported apart, as ``transport``:
they are not model state, but they are memory the wrapper costs.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["ModelStateBytes", "model_state_bytes", "tensor_storage_bytes", "live_tensors",
           "live_storage_bytes", "LiveStorageTracker"]

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
        """Every field and ``total``, by name."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "transport": self.transport,
                "total": self.total}


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _storage_keys(t: torch.Tensor) -> list:
    """``(device, data pointer, bytes)`` of each storage that holds ``t``'s data: one for a
    dense tensor; its index and value tensors' for a sparse one (a sparse gradient, say); its
    inner tensors' for a wrapper subclass that has no storage of its own (``DTensor``: its
    local shard); none for a ``meta`` tensor, which holds no memory."""
    if t.device.type == "meta":
        return []
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is not None:
        return [key for name in parts for key in _storage_keys(getattr(t, name)())]
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]  # DTensor also names its device mesh
        return [key for x in inner if isinstance(x, torch.Tensor) for key in _storage_keys(x)]
    s = t.untyped_storage()
    return [(t.device, s.data_ptr(), s.nbytes())]


def tensor_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each storage counted once; sparse
    tensors by their index and value storages, ``meta`` tensors as 0)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for key in _storage_keys(t):
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


def _transport_tensors(module, optimizers: list) -> Iterator[torch.Tensor]:
    """The buffers held by the transports (``comm``) of the wrappers in ``module`` and of
    ``optimizers``, each transport once."""
    holders = list(module.modules()) if module is not None else []
    holders.extend(optimizers)
    seen = set()
    for holder in holders:
        comm = getattr(holder, "__dict__", {}).get("comm")
        if comm is None or id(comm) in seen or not hasattr(comm, "footprint_tensors"):
            continue
        seen.add(id(comm))
        yield from comm.footprint_tensors()


def _held_optimizers(module: Optional[torch.nn.Module]) -> list:
    """The optimizers that ``module`` or a submodule holds as its ``optimizer`` attribute (the
    engine of :func:`shardkit.initialize` holds the one it steps)."""
    if module is None:
        return []
    return [m.__dict__["optimizer"] for m in module.modules()
            if isinstance(m.__dict__.get("optimizer"), torch.optim.Optimizer)]


def model_state_bytes(module: Optional[torch.nn.Module] = None,
                      optimizer: Optional[torch.optim.Optimizer] = None) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state this rank holds, per storage.

    Args:
        module: the (possibly wrapped) model; its parameters, their ``.grad`` and whatever its
            submodules report through ``model_state_tensors()``. An engine of
            :func:`shardkit.initialize` counts with the optimizer it holds (its
            ``optimizer``), as DeepSpeed's engine owns its optimizer: ``model_state_bytes(
            engine)`` is the rank's whole model state.
        optimizer: its ``state`` tensors (for ``OSS``: the local shard's state), plus the
            ``params`` of its param groups and their grads not already seen through the module.

    Costs no communication; touches no tensor data.
    """
    pairs: list[tuple[str, torch.Tensor]] = []
    if module is not None:
        pairs.extend(_module_tensors(module))
    optimizers = list({id(o): o for o in [optimizer, *_held_optimizers(module)]
                       if o is not None}.values())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                pairs.append(("params", p))
                if p.grad is not None:
                    pairs.append(("grads", p.grad))
        pairs.extend(("optimizer", t) for t in _optimizer_tensors(optimizer))
    pairs.extend(("transport", t) for t in _transport_tensors(module, optimizers))
    totals = dict.fromkeys(CATEGORIES + ("transport",), 0)
    seen = set()
    for category, t in pairs:
        for key in _storage_keys(t):
            if key[2] == 0 or key in seen:
                continue
            seen.add(key)
            totals[category] += key[2]
    return ModelStateBytes(**totals)


def live_tensors() -> list[torch.Tensor]:
    """Every tensor the Python garbage collector can reach now (after a full collection).

    Tensors held only by C++ (what autograd saved for a backward, a storage a tensor hook's
    closure keeps) are not Python objects; :class:`LiveStorageTracker` also sees those.
    """
    gc.collect()
    found = []
    for obj in gc.get_objects():
        try:
            if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":
                found.append(obj)
        except Exception:  # an object whose __class__ lookup fails (half-torn-down proxies)
            continue
    return found


def live_storage_bytes() -> int:
    """Bytes of the distinct storages behind every tensor Python can reach (see
    :func:`live_tensors`)."""
    return tensor_storage_bytes(live_tensors())


class LiveStorageTracker:
    """Weak references to every storage alive when it starts and every storage an operator
    creates while it is active, so that :meth:`live_bytes` counts the bytes still alive
    (including storages only C++ holds: autograd's saved tensors, hooks' captures) without
    keeping any of them alive.

    Used as a context manager (a ``TorchDispatchMode`` sees each operator's outputs)::

        with LiveStorageTracker(sample_every_op=True) as tracker:
            train_step()
        tracker.peak_bytes, tracker.live_bytes()

    ``sample_every_op``: measure after every operator and keep the largest value in
    :attr:`peak_bytes` (slow: use it for one step); :meth:`sample` records a value on demand
    (from module hooks, say). :attr:`peak_phase` is the :attr:`phase` label the caller had set
    when the peak was seen. Storages resized in place (FSDP frees a gathered unit with
    ``resize_(0)``) are counted at their current size.
    """

    def __init__(self, sample_every_op: bool = False):
        self.sample_every_op = sample_every_op
        self.peak_bytes = 0
        self.phase: Optional[str] = None  # a label the caller sets ("forward", "step", ...)
        self.peak_phase: Optional[str] = None  # the label in force when the peak was seen
        self._refs: dict = {}
        self._mode = None

    # ------------------------------------------------------------------ registry
    def _register(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        cdata = storage._weak_ref()
        if cdata in self._refs:
            torch.UntypedStorage._free_weak_ref(cdata)
            return
        self._refs[cdata] = True

    def _release(self, cdata) -> None:
        del self._refs[cdata]
        torch.UntypedStorage._free_weak_ref(cdata)

    def live_bytes(self) -> int:
        """Bytes of the tracked storages still alive (storages that died are dropped)."""
        total = 0
        for cdata in list(self._refs):
            if torch.UntypedStorage._expired(cdata):
                self._release(cdata)
                continue
            total += torch.UntypedStorage._new_with_weak_ptr(cdata).nbytes()
        return total

    def sample(self) -> int:
        """Measure now, fold the value into :attr:`peak_bytes` and return it."""
        now = self.live_bytes()
        if now > self.peak_bytes:
            self.peak_bytes, self.peak_phase = now, self.phase
        return now

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now (:meth:`live_bytes`, one pass over the
        tracked storages), under the current ``phase``."""
        self.peak_bytes, self.peak_phase = self.live_bytes(), self.phase

    # ------------------------------------------------------------------ mode
    def __enter__(self) -> "LiveStorageTracker":
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    tracker._register(t)
                if tracker.sample_every_op:
                    tracker.sample()
                return out

        for t in live_tensors():
            self._register(t)
        self.peak_bytes = self.live_bytes()
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    def close(self) -> None:
        """Drop every weak reference (the tracker measures nothing afterwards)."""
        for cdata in list(self._refs):
            self._release(cdata)
