"""``nn.Module``'s load walk as FSDP runs it: every module's load pre-hooks, version
conversions and ``_load_from_state_dict`` run once over stand-in tensors
(:class:`_StandIn`) that record the values instead of copying them, so that keys and shapes
are judged (on every rank) before anything is written; then the records are applied and the
load post-hooks run. Also the error lines of a refused load. Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`; local.
"""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from shardkit import distributed as skdist
from shardkit.checkpoint.dtensor_state import is_dtensor, rows_from_value
from shardkit.nn.data_parallel.fsdp_state_names import _own_walk, _reported
from shardkit.utils.call_stack import frames_running


_SHAPE_ONLY = {torch.ops.aten.zeros_like, torch.ops.aten.ones_like, torch.ops.aten.empty_like,
               torch.ops.aten.full_like, torch.ops.aten.new_zeros, torch.ops.aten.new_ones,
               torch.ops.aten.new_empty, torch.ops.aten.new_full}


class _StandIn(torch.Tensor):
    """What a load finds in a module's ``_parameters`` / ``_buffers`` while FSDP runs
    ``nn.Module``'s load over its units (:func:`_load_walk`): a tensor with the shape the
    dict's value must have (a sharded parameter's full shape) and no storage, whose ``copy_``
    hands the value, after every load pre-hook and version conversion of the modules, to
    ``sink`` (so does its ``module_load``, which torch calls instead when
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` is set: no process-wide
    setting is changed by the walk). Any other use of its data fails."""

    @staticmethod
    def __new__(cls, shape, dtype, sink, name: str = "", sharded: bool = False):
        stand_in = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype,
                                                       device=sink.args[0].device)
        stand_in._sink = sink
        stand_in._real = sink.args[0]
        stand_in._name = name
        stand_in._sharded = sharded  # a sharded parameter's rows: not the value it stands for
        return stand_in

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and isinstance(args[0], _StandIn):
            args[0]._sink(args[1])
            return args[0]
        if func is torch.Tensor.module_load and isinstance(args[0], _StandIn):
            # torch.__future__'s swap_module_params_on_conversion on: nn.Module's load asks
            # the module's tensor for the value to swap in; the value is handed to ``sink``
            # (as by copy_) and a fresh stand-in is swapped in, which the walk's end discards
            # (the setting, process-wide, is left as the user set it)
            if (kwargs or {}).get("assign", args[2] if len(args) > 2 else False):
                raise RuntimeError("load_state_dict(assign=True) is not supported by "
                                   "FullyShardedDataParallel: its parameters stay views of "
                                   "their shards")
            stand_in = args[0]
            stand_in._sink(args[1])
            return _StandIn(stand_in.shape, stand_in.dtype, stand_in._sink, stand_in._name,
                            stand_in._sharded)
        if func is torch.Tensor.resize_ and isinstance(args[0], _StandIn):
            # a module sizing a buffer for the value it is given (torch's FakeQuantize and
            # observers call resize_ before the copy): to its own size, a no-op
            sizes = args[1:] if len(args) > 2 or isinstance(args[1], int) else args[1]
            if torch.Size(sizes) == args[0].shape:
                return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """A read of the module's tensor (a load pre-hook filling a missing key from the
        module's current value, a conversion computing with it) reads the tensor the module
        holds (its value before this load), where it has the shape the module shows: a
        buffer, a parameter no unit shards, a summoned one, a shard under LOCAL_STATE_DICT.
        A write, or a read of a sharded parameter (its full value is spread over the ranks),
        is a clear RuntimeError."""
        if func.overloadpacket in _SHAPE_ONLY and isinstance(args[0], _StandIn):
            # zeros_like(module.bias), module.weight.new_zeros(...): only the shape, dtype and
            # device of the template are read (a stride-0 stub of them, no memory)
            stub = torch.empty((), dtype=args[0].dtype, device=args[0].device).expand(
                args[0].shape)
            return func(stub, *args[1:], **(kwargs or {}))
        stand_ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                     if isinstance(a, _StandIn)]
        sharded = [a._name for a in stand_ins if a._sharded]
        if func._schema.is_mutable or sharded:
            reason = "changes it" if func._schema.is_mutable else \
                f"reads {sharded[0]}, a parameter FSDP shards (this rank holds some of its rows)"
            raise RuntimeError(f"{func} {reason} while FullyShardedDataParallel's load_state_dict"
                               f" walks the modules' loads: there a load pre-hook or "
                               f"_load_from_state_dict may read the current values of buffers "
                               f"and of parameters not sharded, and the shape, dtype and device "
                               f"of any; copy_ is the load itself (to read a sharded parameter's "
                               f"full value, load inside summon_full_params())")
        unwrapped = torch.utils._pytree.tree_map_only(_StandIn, lambda a: a._real, (args, kwargs))
        return func(*unwrapped[0], **(unwrapped[1] or {}))


@contextlib.contextmanager
def _standing_in(root: nn.Module, prefix: str, sharded: dict, problems: list, records: list):
    """Inside: every parameter and persistent buffer of ``root``'s modules is a
    :class:`_StandIn` (a sharded parameter with its full shape, the others with theirs); its
    ``copy_`` checks the value (a DTensor's rows against this rank's shard, a ``ValueError``'s
    text appended to ``problems``) and appends ``(real tensor, shard entry or None, what,
    value)`` to ``records``, copying nothing; a module's ``set_extra_state`` appends
    ``(module, state)`` instead of setting it. :func:`_apply_records` then loads them in that
    order. Everything is put back on exit. Local."""
    swapped, shadowed = [], []
    try:
        for path, module in root.named_modules(prefix=prefix[:-1]):
            stores = [(module._parameters, ()),
                      (module._buffers, module._non_persistent_buffers_set)]
            for store, skipped in stores:
                for name, real in list(store.items()):
                    if real is None or name in skipped:
                        continue
                    entry = sharded.get(id(real)) if store is module._parameters else None
                    shape = torch.Size(entry[0].shape) if entry is not None else real.shape
                    what = f"size mismatch for {_reported(path + '.' + name if path else name)}"
                    sink = functools.partial(_take_value, real, entry, problems, records, what)
                    swapped.append((store, name, real))
                    store[name] = _StandIn(shape, real.dtype, sink, _reported(
                        path + '.' + name if path else name),
                        entry is not None and not entry[1]._summoned)
            if type(module).set_extra_state is not nn.Module.set_extra_state:
                shadowed.append((module, module.__dict__.get("set_extra_state")))
                module.__dict__["set_extra_state"] = functools.partial(
                    _record_extra_state, module, records)
        yield
    finally:
        for store, name, real in reversed(swapped):
            store[name] = real
        for module, before in shadowed:
            if before is None:
                module.__dict__.pop("set_extra_state", None)
            else:
                module.__dict__["set_extra_state"] = before


def _record_extra_state(module: nn.Module, records: list, state) -> None:
    """A module's ``set_extra_state`` while a load is walked: recorded, set later."""
    records.append((module, state))


def _take_value(real: torch.Tensor, entry, problems: list, records: list, what: str,
                value) -> None:
    """:class:`_StandIn`'s ``copy_`` (see :func:`_standing_in`); ``entry`` is
    ``(layout, unit, shard view)`` of a sharded parameter, ``None`` for another tensor. The
    value itself is recorded (a reference: the dict's tensor or what a hook made of it), not
    its rows: those are cut one block at a time when it is applied."""
    if isinstance(value, _StandIn):  # a conversion handing a module's own value on
        if value._real is real:  # (BatchNorm's num_batches_tracked): nothing to copy
            return
        value = value._real  # read when applied, after the copies recorded before it
    if entry is not None and is_dtensor(value):
        layout, unit, view = entry
        try:
            rows_from_value(value, layout, unit.rank, what, current=view)
        except ValueError as error:
            problems.append(str(error))
            return
    records.append((real, entry, what, value))


def _apply_records(records: list) -> None:
    """Load what a walk (:func:`_load_walk`) recorded, in the order the modules gave it, as
    their ``_load_from_state_dict`` would have: each sharded parameter takes this rank's rows
    of its value (one block at a time; inside ``summon_full_params`` the parameter holds the
    full value, so the full value, written back on exit as the summon says), the other
    tensors the value (a DTensor's local tensor), each module's extra state is set. No hook
    runs here. Local."""
    with torch.no_grad():
        for record in records:
            if len(record) == 2:
                module, state = record
                module.set_extra_state(state)
                continue
            real, entry, what, value = record
            if entry is not None and not entry[1]._summoned:
                layout, unit, view = entry
                value = rows_from_value(value, layout, unit.rank, what, current=view)
            elif is_dtensor(value):
                value = value.to_local()
            real.copy_(value)


def _load_walk(root: nn.Module, state_dict, prefix: str, metadata: Optional[dict],
               sharded: dict, problems: list) -> tuple:
    """``nn.Module.load_state_dict``'s walk over ``root`` (given under ``prefix``): each
    module's ``_load_from_state_dict`` (its load pre-hooks and version conversions, e.g. an
    old BatchNorm's missing ``num_batches_tracked``, then the copy) on its part of a copy of
    ``state_dict`` (module paths with FSDP's wrapper prefixes), the versions from ``metadata``
    (by module path), under :func:`_standing_in`: nothing is copied, the values are recorded
    (problems with a DTensor's rows appended to ``problems``). Each module's pre-hooks and
    ``_load_from_state_dict`` run once, here. Returns ``(missing, unexpected, error lines,
    the modules in the order torch runs their load post-hooks, the records for
    :func:`_apply_records`)``; the post-hooks are not run. Local."""
    missing, unexpected, errors, order, records = [], [], [], [], []

    def load(module, local, path):
        local_metadata = {} if metadata is None else metadata.get(path[:-1], {})
        module._load_from_state_dict(local, path, local_metadata, True, missing, unexpected,
                                     errors)
        for name, child in module._modules.items():
            if child is not None:
                inner = path + name + "."
                load(child, {k: v for k, v in local.items() if k.startswith(inner)}, inner)
        order.append(module)

    for module in root.modules():  # left by a walk that stopped (see _SkipLoad)
        if isinstance(module.__dict__.get("_load_from_state_dict"), _SkipLoad):
            del module.__dict__["_load_from_state_dict"]
    with _own_walk(), _standing_in(root, prefix, sharded, problems, records):
        load(root, OrderedDict(state_dict), prefix)
    return missing, unexpected, errors, order, records


def _metadata_of_torch_load() -> Optional[dict]:
    """The ``_metadata`` (module versions by module path) of the dict that the innermost
    ``nn.Module.load_state_dict`` on the call stack loads (its walk hands each module its own
    entry only: a unit reached from a plain parent finds the versions of the modules inside
    it here); ``None`` outside one or without versions. Local."""
    frames = frames_running(nn.Module.load_state_dict.__code__)
    if not frames:
        return None
    metadata = frames[0].f_locals.get("metadata")
    return metadata if isinstance(metadata, dict) else None


def _run_load_post_hooks(modules: list, missing: list, unexpected: list) -> None:
    """The load post-hooks of ``modules`` (in that order), as ``nn.Module.load_state_dict``
    runs them: each may change the missing / unexpected lists in place."""
    keys = _IncompatibleKeys(missing, unexpected)
    for module in modules:
        for hook in list(module._load_state_dict_post_hooks.values()):
            if hook(module, keys) is not None:
                raise AssertionError("Hooks registered with ``register_load_state_dict_post_"
                                     "hook`` are not expected to return new values, if "
                                     "incompatible_keys need to be modified, it should be "
                                     "done inplace.")


def _finish_load(owner: nn.Module, records: list, order: list, missing: list, unexpected: list,
                 errors: list, strict: bool, kind: str = "",
                 what: str = "state_dict") -> _IncompatibleKeys:
    """After a checked walk: write its ``records``, run the load post-hooks of ``order``, and
    return torch's incompatible keys under the original names (a problem a post-hook made is
    torch's ``RuntimeError`` for loading ``what``; ``kind`` follows the owner's class name in
    it). Local."""
    _apply_records(records)
    _run_load_post_hooks(order, missing, unexpected)
    problems = _load_problems(missing, unexpected, errors, strict)
    if problems:  # a post-hook's doing
        raise RuntimeError(f"Error(s) in loading {what} for {type(owner).__name__}{kind}:"
                           f"\n\t" + "\n\t".join(problems))
    return _IncompatibleKeys([_reported(k) for k in missing], [_reported(k) for k in unexpected])


def _key_lines(missing: list, unexpected: list) -> list:
    """torch's strict-load lines for these (already reported) keys."""
    return [f"{what} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + "."
            for what, keys in (("Missing", missing), ("Unexpected", unexpected)) if keys]


def _lines_of_every_rank(mine: list, every: list, shown: int = 8) -> list:
    """The lines of a load refused on every rank: this rank's problems, then those of each
    other rank that failed (``every``: ``(global rank, problems)`` of every rank), the ranks
    whose problems are this rank's own named once; at most ``shown`` other ranks listed."""
    me = skdist.get_rank()
    same = [r for r, theirs in sorted(every) if r != me and theirs and theirs == mine]
    other = [(r, theirs) for r, theirs in sorted(every) if r != me and theirs and theirs != mine]
    lines = list(mine) if mine else [
        f"the state dict given on another rank of the group does not match (this rank's "
        f"does; failed on rank(s) {[r for r, _ in other]})"]
    if same:
        lines.append(f"(the same on rank(s) {same})")
    for r, theirs in other[:shown]:
        lines += [f"on rank {r}: {line}" for line in theirs]
    if len(other) > shown:
        lines.append(f"... and on {len(other) - shown} more rank(s)")
    return lines


def _load_problems(missing: list, unexpected: list, errors: list, strict: bool) -> list:
    """torch's load error lines (missing/unexpected keys with ``strict``, then the others)
    under the names :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.state_dict` gives."""
    lines = _key_lines([_reported(k) for k in missing],
                       [_reported(k) for k in unexpected]) if strict else []
    return lines + [_reported(line) for line in errors]


class _SkipLoad:
    """A module's ``_load_from_state_dict`` while a plain parent's walk goes on into a unit
    that has loaded the module already: the calls at the ``prefixes`` that walk reaches it
    under are skipped (then the class's method is back); any other call (a walk that stopped
    left this behind, and the module is loaded on its own) removes it and loads."""

    def __init__(self, module: nn.Module, prefixes: list):
        self.module, self.prefixes = module, list(prefixes)

    def __call__(self, state_dict, prefix, *args, **kwargs) -> None:
        skip = prefix in self.prefixes
        if skip:
            self.prefixes.remove(prefix)
        if (not skip or not self.prefixes) and \
                self.module.__dict__.get("_load_from_state_dict") is self:
            del self.module.__dict__["_load_from_state_dict"]
        if not skip:
            self.module._load_from_state_dict(state_dict, prefix, *args, **kwargs)
