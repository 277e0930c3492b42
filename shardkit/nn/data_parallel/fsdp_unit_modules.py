"""Which modules, parameters and buffers a
:class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel` unit owns: the walk
over a unit's modules that stops at inner units and ignored modules, the parameters it collects
(with every place that holds each), and the process-wide registry of sharded parameters and
wrapped modules behind :func:`unit_holding` and the "already sharded" checks. Local: no
communication."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Iterator, Optional

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.fsdp_arguments import IgnoredStates
from shardkit.nn.data_parallel.fsdp_state_dict import clean_name

if TYPE_CHECKING:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel

_MANAGED_PARAMS: dict[int, weakref.ref] = {}  # id -> parameter, for "already sharded" checks
_UNIT_OF: dict[int, tuple] = {}  # id -> (parameter, its unit), both weakly: see unit_holding
_WRAPPED_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def unit_holding(param: torch.Tensor) -> Optional[FullyShardedDataParallel]:
    """The live FSDP unit whose shard holds ``param`` (a sharded parameter), else ``None``.
    Local; a dictionary lookup."""
    entry = _UNIT_OF.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _ignored_param_places(module: nn.Module, ignored: IgnoredStates) -> list:
    """``(module, name)`` of each ignored parameter held by a module of the unit wrapping
    ``module`` (a parameter passed in ``ignored_states``; those of ignored modules are not
    looked at). Local."""
    return [(m, attr) for m in _unit_modules(module, ignored)
            for attr, p in m._parameters.items() if p is not None and ignored.has_param(p)]


def _unit_buffers_described(module: nn.Module) -> list:
    """Name, shape and dtype of each buffer ``sync_module_states`` broadcasts for the unit
    (:func:`~shardkit.nn.data_parallel.fully_sharded._sync_unit_states`: those of ignored modules
    too, as torch FSDP1 does), which every rank must hold alike: ranks may ignore different modules
    (each its own experts, as torch allows), but a broadcast of other sizes would abort gloo.
    Local."""
    return [f"{clean_name(name)} {tuple(b.shape)} {b.dtype}"
            for prefix, m in _named_unit_modules(module, IgnoredStates())
            for key, b in m._buffers.items() if b is not None
            for name in [f"{prefix}.{key}" if prefix else key]]


def unit_class() -> type:
    """:class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel`, imported
    when first asked for: that module imports this one to build its units, so importing the
    class at the top here would be a cycle. Local."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
    return FullyShardedDataParallel


def _is_unit(module) -> bool:
    return isinstance(module, unit_class())


def _unit_modules(module: nn.Module,
                  ignored: IgnoredStates) -> Iterator[nn.Module]:
    """``module`` and its submodules, not descending into inner FSDP units (nor, given
    ``ignored``, into ignored modules)."""
    for _, m in _named_unit_modules(module, ignored):
        yield m


def _named_unit_modules(module: nn.Module, ignored: IgnoredStates
                        ) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for ``module`` (name ``""``) and its submodules, not
    descending into inner FSDP units nor into the modules ``ignored`` holds; a module reached
    twice is yielded once."""
    unit_type = unit_class()
    stack = [("", module)]
    seen = set()
    while stack:
        name, m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield name, m
        stack.extend(reversed([(f"{name}.{child}" if name else child, c)
                               for child, c in m.named_children()
                               if not isinstance(c, unit_type)
                               and not ignored.has_module(c)]))


def _inner_units(module: nn.Module) -> list[FullyShardedDataParallel]:
    unit_type = unit_class()
    return [m for m in module.modules() if isinstance(m, unit_type)]


def _is_managed(p: nn.Parameter) -> bool:
    ref = _MANAGED_PARAMS.get(id(p))
    return ref is not None and ref() is p


def _collect_unit_params(module: nn.Module, ignored: IgnoredStates):
    """The unit's distinct parameters (not the ignored ones) and, for each, every
    (module, name) that holds it."""
    params: list[nn.Parameter] = []
    locations: dict[int, list] = {}
    for m in _unit_modules(module, ignored):
        for name, p in m._parameters.items():
            if p is None or ignored.has_param(p):
                continue
            if _is_managed(p):
                raise ValueError(
                    f"FullyShardedDataParallel: parameter {name!r} of a {type(m).__name__} is "
                    f"already sharded by another FullyShardedDataParallel unit (a parameter "
                    f"shared across units, or a module wrapped twice). Wrap the lowest module "
                    f"that contains every use of the parameter as one unit")
            if p.grad is not None:
                raise ValueError(
                    f"FullyShardedDataParallel: parameter {name!r} of a {type(m).__name__} "
                    f"already has a .grad (shape {tuple(p.grad.shape)}), which cannot follow "
                    f"the parameter into its shard; call model.zero_grad(set_to_none=True) "
                    f"before wrapping")
            if id(p) not in locations:
                params.append(p)
                locations[id(p)] = []
            locations[id(p)].append((m, name))
    return params, [locations[id(p)] for p in params]


def _holders_inside(module: nn.Module, locations: list) -> list:
    """The submodules of ``module`` (not ``module`` itself, whose forward the unit's own hooks
    cover) that hold one of the unit's parameters, each once."""
    holders = {id(m): m for locs in locations for m, _ in locs if m is not module}
    return list(holders.values())


def _module_name_in(unit: FullyShardedDataParallel, module: nn.Module) -> str:
    """``module``'s name inside ``unit``'s wrapped module, quoted, for error messages."""
    name = next((n for n, m in unit.module.named_modules(remove_duplicate=False)
                 if m is module), None)
    return "a submodule" if name is None else f"submodule {name!r}"


def _cast_unit_buffers(module: nn.Module, dtype: Optional[torch.dtype],
                       ignored: IgnoredStates) -> list:
    """Cast the unit's floating buffers (not those of ignored modules, as in torch FSDP1) to
    ``dtype``; return (module, name, original dtype)."""
    changed = []
    if dtype is None:
        return changed
    for m in _unit_modules(module, ignored):
        for name, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                changed.append((m, name, buf.dtype))
                m._buffers[name] = buf.to(dtype)
    return changed
