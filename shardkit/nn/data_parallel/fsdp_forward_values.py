"""What a :class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel` unit does
to the values passing through its forward: the inputs cast to the compute dtype (or widened to
fp32 inside ``summon_full_params``), tensors inside dataclasses and plain objects included, and
an output that views the gathered parameters copied before they are freed. Local: no
communication; one walk over the inputs or the output per call."""

from __future__ import annotations

import copy
import dataclasses
import enum
import sys
from collections.abc import Mapping

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from shardkit.utils.nested import tensors_in


def _copy_what_aliases(output, shard, module: nn.Module):
    """``output`` with each tensor that is a view of the unit's gathered parameters (a forward
    that returns ``self.table[:n]``) replaced by a copy, since the gathered storage is about to
    be freed (the view would read released memory). The same object when nothing aliases it
    (the common case: one storage pointer compared per output tensor)."""
    if not shard.gathered:
        return output
    ptr = shard.full.untyped_storage().data_ptr()

    def aliases(t) -> bool:
        # only strided tensors have a storage to compare (a sparse or mkldnn output raised
        # NotImplementedError here); a nested tensor is a copy already
        return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested \
            and t.device == shard.full.device and t.untyped_storage().data_ptr() == ptr

    if not any(aliases(t) for t in tensors_in(output)):
        return output
    output = tree_map(lambda t: t.clone() if aliases(t) else t, output)
    if any(aliases(t) for t in tensors_in(output)):
        raise RuntimeError(f"FullyShardedDataParallel: {type(module).__name__}.forward returned "
                           f"a view of the unit's parameters inside a container that cannot be "
                           f"rebuilt; return a copy (.clone()): the gathered parameters are "
                           f"freed after forward")
    return output


_PLAIN_VALUES = (int, float, complex, bool, str, bytes, torch.dtype, torch.device,
                 type(None), type(Ellipsis), slice, enum.Enum)


def _tensors_in_objects(output) -> tuple[list, bool]:
    """The tensors :func:`~shardkit.utils.nested.tensors_in` does not reach: those held in
    the attributes (``vars()``) of the objects in a forward's output (a
    ``torch.distributions.Normal``'s ``loc`` and ``scale``, a transformers ``Cache``'s keys
    and values, a class of one's own), however nested; and whether some object could not be
    looked into (no ``__dict__``: a C extension's object, an ``nn.Module``), which may hold
    tensors computed from the unit's parameters out of FSDP's sight. Plain values (numbers,
    strings, enums, numpy arrays of numbers) hold none. Local; one walk over the output."""
    found: list = []
    opaque = False
    seen: set = set()
    stack = [(output, False)]
    while stack:
        item, inside = stack.pop()
        if isinstance(item, torch.Tensor):
            if inside:
                found.append(item)
            continue
        if isinstance(item, (type,) + _PLAIN_VALUES) or _is_numpy_value(item) or \
                id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Mapping):
            stack.extend((v, inside) for v in item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((v, inside) for v in item)
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            stack.extend((getattr(item, f.name), inside) for f in dataclasses.fields(item))
        elif isinstance(item, nn.Module) or not hasattr(item, "__dict__"):
            opaque = True
        else:
            stack.extend((v, True) for v in vars(item).values())
    return found, opaque


def _is_numpy_value(item) -> bool:
    np = sys.modules.get("numpy")  # never imported for this
    return np is not None and isinstance(item, (np.generic, np.ndarray)) and \
        getattr(item, "dtype", None) != object


def _map_tensors(fn, value):
    """``tree_map(fn, value)`` that also reaches the tensors in dataclass instances (a batch
    object ``Batch(x=..., mask=...)`` passed to forward), which torch's pytree takes for
    leaves: FairScale and torch FSDP1 cast a forward's inputs inside dataclasses too. A
    dataclass whose values ``fn`` left alone is returned as it is; otherwise a shallow copy
    holding the new values (the caller's object is not changed, and its ``__init__`` /
    ``__post_init__`` do not run again). Local."""
    def leaf(item):
        if isinstance(item, torch.Tensor):
            return fn(item)
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            return _dataclass_mapped(item, lambda v: _map_tensors(fn, v))
        return item

    return tree_map(leaf, value)


def _dataclass_mapped(obj, fn):
    """``obj`` with each field's value replaced by ``fn(value)``, as a shallow copy (frozen
    dataclasses too); ``obj`` itself when no value is a new object. Fields not set (an
    ``init=False`` field without a default) are left out."""
    unset = object()
    changed = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, unset)
        if value is not unset:
            mapped = fn(value)
            if mapped is not value:
                changed[field.name] = mapped
    if not changed:
        return obj
    result = copy.copy(obj)
    for name, value in changed.items():
        object.__setattr__(result, name, value)
    return result


def _widen_to_fp32(t):
    if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _cast_floating(t, dtype):
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t
