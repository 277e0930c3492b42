"""Meta-device materialization for
:class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel` (its
``param_init_fn`` argument): a unit built around modules holding meta tensors gives them real
storage on its device and initialises them (``param_init_fn(m)`` in torch FSDP1's order, or
each module's ``reset_parameters()``), keeping tensor objects and ties. Memory: the unit's
full parameters, before they are sharded. Local: the ranks then agree on the outcome in the
unit's construction check."""

from __future__ import annotations

import collections
from typing import Optional

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.fsdp_arguments import IgnoredStates, meta_init_device
from shardkit.nn.data_parallel.fsdp_unit_modules import _is_unit


def _modules_to_materialize(module: nn.Module, ignored: IgnoredStates
                            ) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for ``module`` and the submodules reachable from it without
    entering an FSDP unit or an ignored module (torch FSDP1 leaves those as they are),
    breadth-first (parents before children, torch FSDP's order)."""
    found, queue, seen = [], collections.deque([("", module)]), {id(module)}
    while queue:
        name, m = queue.popleft()
        found.append((name, m))
        for child_name, child in m.named_children():
            if id(child) not in seen and not _is_unit(child) \
                    and not ignored.has_module(child):
                seen.add(id(child))
                queue.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def _meta_tensors_of(m: nn.Module) -> list[tuple[dict, str, torch.Tensor]]:
    """``(m._parameters or m._buffers, name, tensor)`` for ``m``'s own tensors on meta."""
    return [(holder, key, t) for holder in (m._parameters, m._buffers)
            for key, t in holder.items() if t is not None and t.is_meta]


def _materialize_meta_unit(module: nn.Module, param_init_fn, compute_device,
                           ignored: IgnoredStates) -> None:
    """Give the unit's own modules that hold meta tensors real ones (see the ``param_init_fn``
    argument): ``param_init_fn(m)``, or storage on the unit's device and
    ``m.reset_parameters()``. Shared tensors stay shared and keep their objects. Nothing
    happens (not even a device look-up) when no tensor is on meta. Local."""
    modules = _modules_to_materialize(module, ignored)
    holders: dict[int, tuple[torch.Tensor, list]] = {}
    for _, m in modules:
        for holder, key, t in _meta_tensors_of(m):
            holders.setdefault(id(t), (t, []))[1].append((holder, key))
    if not holders:
        return
    device = None
    if param_init_fn is None:
        _refuse_meta_without_reset(modules, module)
        device = meta_init_device(compute_device, module)
    with torch.no_grad():
        for _, m in modules:
            if not _meta_tensors_of(m):  # none of its own, or materialized through another
                continue
            if param_init_fn is not None:
                param_init_fn(m)
                continue
            for _, key, t in _meta_tensors_of(m):
                _fill_in_place(holders[id(t)], torch.empty_like(t, device=device))
            m.reset_parameters()
        if param_init_fn is not None:  # then the parents of what it left on meta
            for _, m in modules:
                if _materializes_children(m, ignored):
                    below = _modules_to_materialize(m, ignored)[1:]
                    before = {id(d): _real_tensors_of(d) for _, d in below}
                    param_init_fn(m)
                    # torch FSDP1 calls param_init_fn on every module below m after m: a module
                    # whose tensors m's call replaced (a recursive to_empty) gets it again, as
                    # there, instead of keeping uninitialised memory
                    for _, d in below:
                        if _replaced(before[id(d)], d):
                            param_init_fn(d)
    for original, places in holders.values():
        _keep_tie(original, places)
    for name, m in modules:
        left = _meta_tensors_of(m)
        if left:
            raise ValueError(
                f"FullyShardedDataParallel(param_init_fn={param_init_fn!r}): "
                f"{_described(name, m, module)} still holds {_listed(left)} on the meta device "
                f"after param_init_fn ran on it; it must materialize every parameter and buffer "
                f"of the module it is given (e.g. module.to_empty(device=..., recurse=False), "
                f"then initialise them)")


def _real_tensors_of(m: nn.Module) -> list:
    """``(holder, key, tensor, data_ptr)`` of ``m``'s own tensors off ``meta`` (the tensors
    themselves are kept, so that a new one cannot reuse a freed one's id or storage). Local."""
    return [(holder, key, t, t.data_ptr()) for holder in (m._parameters, m._buffers)
            for key, t in holder.items() if t is not None and not t.is_meta]


def _replaced(before: list, m: nn.Module) -> bool:
    """Whether a call since ``before = _real_tensors_of(m)`` replaced one of ``m``'s real
    tensors or gave it new storage (``to_empty``, with or without swap_tensors). Local."""
    return any(holder.get(key) is not t or t.data_ptr() != ptr
               for holder, key, t, ptr in before)


def _materializes_children(m: nn.Module, ignored: IgnoredStates) -> bool:
    """Whether ``param_init_fn(m)`` runs in the second pass: ``m`` holds no meta tensor of its
    own, a module below it in the unit still does after the first pass (``param_init_fn`` left
    it on meta), and no inner FSDP unit lies below ``m``. torch FSDP1 calls ``param_init_fn``
    on every module of the unit, parents first, so a function that materializes and
    initialises a whole model from its root (``if isinstance(m, Net): m.to_empty(...);
    m.init_weights()``) works there; it works here too. Never over an inner unit: a recursive
    ``to_empty`` there would replace its shards with uninitialised memory (torch's does).
    Local."""
    if _meta_tensors_of(m):
        return False
    meta = False
    stack = [c for c in m.children() if not ignored.has_module(c)]
    while stack:
        current = stack.pop()
        if _is_unit(current):
            return False
        meta = meta or bool(_meta_tensors_of(current))
        stack.extend(c for c in current.children() if not ignored.has_module(c))
    return meta


def _outcome(error: Optional[Exception]) -> str:
    """What a rank tells the others about materializing its meta tensors (the same ``"ok"``
    whether it had none or materialized them)."""
    return "ok" if error is None else f"failed ({type(error).__name__}: {error})"


def _refuse_meta_without_reset(modules: list, unit_module: nn.Module) -> None:
    """Before anything is materialized: a module that holds a meta tensor no module before it
    holds (which would materialize it) and has no ``reset_parameters()`` is a ValueError."""
    claimed = set()
    for name, m in modules:
        own = [entry for entry in _meta_tensors_of(m) if id(entry[2]) not in claimed]
        if not callable(getattr(m, "reset_parameters", None)) and own:
            raise ValueError(
                f"FullyShardedDataParallel: {_described(name, m, unit_module)} holds "
                f"{_listed(own)} on the meta device and has no reset_parameters() to "
                f"initialise them; pass param_init_fn=<callable(module)> that materializes "
                f"such a module (e.g. module.to_empty(device=..., recurse=False), then fill "
                f"its tensors), give {type(m).__name__} a reset_parameters(), or build it "
                f"off the meta device")
        claimed.update(id(t) for _, _, t in own)


def _described(name: str, m: nn.Module, unit_module: nn.Module) -> str:
    if not name:
        return f"the wrapped {type(m).__name__}"
    return f"{name!r} ({type(m).__name__}) in the wrapped {type(unit_module).__name__}"


def _listed(tensors: list) -> str:
    kinds = [("parameter" if isinstance(t, nn.Parameter) else "buffer") + f" {key!r}"
             for _, key, t in tensors]
    return ", ".join(kinds)


def _fill_in_place(entry: tuple, fresh: torch.Tensor) -> bool:
    """Make the tensor ``entry[0]`` hold ``fresh``'s storage, keeping the object (and so ties,
    attributes and an optimizer's references): True. Where torch cannot swap the two (a weak
    reference to one), every holder in ``entry[1]`` gets ``fresh`` instead: False."""
    original, places = entry
    if isinstance(original, nn.Parameter) and not isinstance(fresh, nn.Parameter):
        fresh = nn.Parameter(fresh, requires_grad=original.requires_grad)
    fresh.__dict__.update(original.__dict__)
    try:
        torch.utils.swap_tensors(original, fresh)
    except (RuntimeError, TypeError):
        for holder, key in places:
            holder[key] = fresh
        return False
    return True


def _keep_tie(original: torch.Tensor, places: list) -> None:
    """After ``param_init_fn`` (which may replace tensors, as ``to_empty`` does): the holders
    of one meta tensor hold one materialized tensor again, the last holder's, in the original
    object where torch can swap it. Holders still on meta are left for the check that
    follows."""
    held = [holder[key] for holder, key in places]
    if all(t is original for t in held) or any(t is None or t.is_meta for t in held):
        return
    chosen = held[-1]
    if chosen is original or _fill_in_place((original, places), chosen):
        for holder, key in places:
            holder[key] = original
