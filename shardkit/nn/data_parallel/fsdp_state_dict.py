"""FullyShardedDataParallel's state dicts: full (original keys, unpadded), local (this rank's
padded rows, FairScale's ``local_state_dict``) and the optimizer state unsharded or cut back to
this rank's rows. A mixin of :class:`~shardkit.nn.data_parallel.FullyShardedDataParallel`; the
formats and the resharding are in :mod:`shardkit.checkpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import re
import threading
import zlib
from collections import OrderedDict
from copy import deepcopy
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from shardkit import distributed as skdist
from shardkit.checkpoint.dtensor_state import (is_dtensor, refuse_in_dcp, rows_as_dtensor,
                                               rows_from_value)
from shardkit.checkpoint.fsdp_state import (consolidate_shard_weights, copied_part,
                                            gather_full_optimizer_state, local_metadata,
                                            reshard_local_state_dicts,
                                            shard_full_optimizer_state)
from shardkit.checkpoint.optimizer_state import (ELEMENTWISE_STATE, FACTORED_STATE,
                                                 per_element)
from shardkit.nn.data_parallel.flat_param import ParamLayout
from shardkit.nn.data_parallel.fsdp_state_dict_type import (DEFAULT_SETTINGS, StateDictType,
                                                            get_state_dict_type,
                                                            set_state_dict_type,
                                                            state_dict_type)
from shardkit.utils.call_stack import frames_running

__all__ = ["FSDPStateDictMixin", "add_wrapper_prefix", "clean_name", "show_original_names",
           "state_dict_key"]

_WRAPPED_PREFIX = "_fsdp_wrapped_module."


def _without_level(text: str, level: str) -> str:
    """``text`` (a dotted name, or an error line holding some) without the module levels
    called exactly ``level``: ``level.`` where no other letter, digit or ``_`` of a name comes
    before it, as a wrapper's state-dict hook drops its prefix (a module called
    ``my_fsdp_wrapped_module`` keeps its name). Local."""
    return re.sub(r"(?<!\w)" + re.escape(level + "."), "", text)


def clean_name(name: str) -> str:
    """A parameter or buffer name without FSDP's wrapper prefixes (the unwrapped model's key)."""
    return _without_level(name, _WRAPPED_PREFIX[:-1])


class _OriginalNames:
    """Put before the class of a model whose submodules became FSDP units while the model
    itself stayed the user's object (the stage-3 engine's ``engine.module``):
    ``named_parameters`` and ``named_buffers`` give the names the model had before wrapping,
    as the root FSDP's own do, so code written for DeepSpeed's stage 3 (which keeps the module
    tree) keys its saved weights by them. The values are unchanged (this rank's shards)."""

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield clean_name(name), p

    def named_buffers(self, *args, **kwargs):
        for name, b in super().named_buffers(*args, **kwargs):
            yield clean_name(name), b

    def get_parameter(self, target: str) -> nn.Parameter:
        return super().get_parameter(self._wrapped_name(target, super().named_parameters))

    def get_buffer(self, target: str) -> torch.Tensor:
        """Also for a buffer of a unit's own module (``blocks.0.mask``): ``nn.Module``'s
        lookup would stop at the unit, whose ``_buffers`` do not hold it."""
        return super().get_buffer(self._wrapped_name(target, super().named_buffers))

    @staticmethod
    def _wrapped_name(target: str, named) -> str:
        """The module path of ``target`` (a name this class gives) with FSDP's levels."""
        if _WRAPPED_PREFIX in target:
            return target
        return next((name for name, _ in named(remove_duplicate=False)
                     if clean_name(name) == target), target)


_ORIGINAL_NAMES_CLASSES: dict = {}


def show_original_names(model: nn.Module) -> None:
    """Make ``model.named_parameters()``/``named_buffers()`` drop FSDP's wrapper prefixes, by
    giving ``model`` a subclass of its own class (torch's ``fully_shard`` changes the class
    the same way). The subclass keeps the class's name, so ``isinstance``, ``repr`` and Hugging
    Face's ``architectures`` entry are as before. Local, no memory beyond the class."""
    cls = type(model)
    if issubclass(cls, _OriginalNames):
        return
    if cls not in _ORIGINAL_NAMES_CLASSES:
        _ORIGINAL_NAMES_CLASSES[cls] = type(cls.__name__, (_OriginalNames, cls),
                                            {"__module__": cls.__module__,
                                             "__qualname__": cls.__qualname__})
    model.__class__ = _ORIGINAL_NAMES_CLASSES[cls]


class _StructuralKeys(threading.local):
    """How deep this thread is in :func:`_structural_state_dict` (0: not inside)."""

    depth = 0


_structural_keys = _StructuralKeys()


@contextlib.contextmanager
def _own_walk():
    """Inside: nn.Module's recursion reaching a unit is FSDP's own (its structural walk or its
    own ``load_state_dict``), not a plain parent's. Local."""
    _structural_keys.depth += 1
    try:
        yield
    finally:
        _structural_keys.depth -= 1


def _structural_state_dict(module: nn.Module, keep_vars: bool = False) -> OrderedDict:
    """``nn.Module.state_dict`` of ``module`` keyed by module paths, inner units' wrapper
    prefixes included (what ``nn.Module.load_state_dict`` matches against). Local."""
    with _own_walk():
        return nn.Module.state_dict(module, keep_vars=keep_vars)


# torch's ``checkpoint_wrapper`` (CheckpointWrapper) holds its module under this name and
# drops it from the keys of any state dict walked through it (its state-dict hook)
_TORCH_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def _parameters_by_key(module: nn.Module) -> dict:
    """``{key: parameter}`` of ``module`` under the keys :func:`_structural_state_dict` gives
    its parameters: module paths, with torch's ``checkpoint_wrapper`` level dropped as its
    state-dict hook drops it (the path with it is kept too).

    Note: matched by the paths alone, the parameters of a block wrapped by torch's
    ``checkpoint_wrapper`` (inside a unit or around one) were found under no key, so the full
    and sharded state dicts held this rank's padded rows under their names, silently (a
    ``torch.save`` of a wrong model; a DCP checkpoint of one rank's rows as if replicated).
    Local."""
    keyed = {}
    for name, param in nn.Module.named_parameters(module, remove_duplicate=False):
        keyed[name] = param
        keyed.setdefault(_without_level(name, _TORCH_CHECKPOINT_PREFIX[:-1]), param)
    return keyed


def state_dict_key(name: str) -> str:
    """The key the parameter or buffer ``name`` (a module path) has in the state dicts: no
    FSDP wrapper level, no torch ``checkpoint_wrapper`` level (its hook drops it). Also the
    key of its state in the name-keyed optimizer state dicts, as torch FSDP1 keys them, so
    that a dict saved with activation checkpointing loads without it and the other way
    round, and the name in :meth:`~FSDPStateDictMixin.local_metadata_dict`. Local."""
    return _without_level(clean_name(name), _TORCH_CHECKPOINT_PREFIX[:-1])


def _state_dict_keys(model) -> dict:
    """``{id(param): state_dict_key(name)}`` for the parameters of ``model``. Local."""
    return {id(p): state_dict_key(n) for n, p in model.named_parameters()}


def _drop_wrapper_prefixes(destination: OrderedDict, prefix: str) -> None:
    """Rename, in place and in order, the keys (and ``_metadata`` entries) under ``prefix`` to
    their names without FSDP's wrapper prefixes: a plain module's ``state_dict()`` that reaches
    a unit (Hugging Face's ``save_pretrained`` inside ``summon_full_params``) then has the
    unwrapped model's keys, as under torch's FSDP. The unit's keys are the last ones added."""
    mine = [k for k in destination if k.startswith(prefix)]
    if not any(_WRAPPED_PREFIX in k for k in mine):
        return
    for key in mine:
        destination[clean_name(key)] = destination.pop(key)
    metadata = getattr(destination, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if _WRAPPED_PREFIX in k + "."]:
            metadata[clean_name(key + ".")[:-1]] = metadata.pop(key)  # the wrapped module's


def _clean_metadata(raw: dict, prefix: str) -> OrderedDict:
    """The ``_metadata`` (module versions, as ``nn.Module.state_dict`` keeps it beside the
    tensors) of the structural dict ``raw`` under the original module names with ``prefix``:
    a unit's wrapped module's entry wins over the unit's own. Local."""
    metadata = OrderedDict()
    for key, value in getattr(raw, "_metadata", {}).items():
        name = prefix + key if key else prefix[:-1]
        metadata[clean_name(name + ".")[:-1]] = value
    return metadata


def add_wrapper_prefix(state_dict, prefix: str, *_) -> None:
    """A ``load_state_dict`` pre-hook of every unit, the inverse of
    :func:`_drop_wrapper_prefixes`: keys under ``prefix`` without the unit's wrapper prefix
    (a plain module's ``load_state_dict`` reaching the unit with the unwrapped model's keys) are
    renamed to the module path that ``nn.Module`` loads from. Keys that already have it (FSDP's
    own ``load_state_dict``) are left alone. Local."""
    inner = prefix + _WRAPPED_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


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


class FSDPStateDictMixin:
    """State-dict methods of FullyShardedDataParallel (needs its ``summon_full_params``,
    ``sharded_units``, ``world_size``, ``rank``, ``process_group``, ``replicate_group`` and
    ``_comm_device``). Costs are stated per method."""

    _state_dict_settings = DEFAULT_SETTINGS  # torch FSDP1's state_dict_type (per unit)
    state_dict_type = staticmethod(state_dict_type)
    set_state_dict_type = staticmethod(set_state_dict_type)
    get_state_dict_type = staticmethod(get_state_dict_type)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full state dict: original keys, unpadded fp32 parameters (buffers in their
        original dtype), loadable into the unwrapped module. All ranks must call it. With
        ``state_dict_device`` the tensors are moved there; with ``state_dict_on_rank_0_only``
        only rank 0 of the group (and of the replicas) gets them, the others an empty dict.

        The dict is built one unit at a time: each unit is gathered, its parameters are kept
        (moved to ``state_dict_device``) where the dict is returned, and its gathered copy is
        released before the next unit is gathered, as FairScale does.

        Under ``FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)`` it is
        :meth:`local_state_dict` instead (its shards refused by torch.distributed.checkpoint
        with a clear error, which would otherwise take them for replicated tensors); under
        ``SHARDED_STATE_DICT`` it is :meth:`sharded_state_dict`. A ``FullStateDictConfig`` adds
        its ``offload_to_cpu`` (CPU tensors) and ``rank0_only`` to the constructor's options.

        **Reached from a plain parent.** When a module that is not an FSDP unit holds this unit
        (``model.encoder = FSDP(model.encoder)``, torch's ``checkpoint_wrapper(FSDP(model))``,
        a trainer's wrapper), the parent's ``state_dict()`` reaches this method through
        ``nn.Module``'s recursion (``destination=``, ``prefix=``); as in torch FSDP1 and
        FairScale, the unit then writes what its ``state_dict_type`` gives into the parent's
        dict, under the parent's prefix and the original names (no ``_fsdp_wrapped_module.``):
        ``FULL_STATE_DICT`` (the default) the full unpadded tensors of this unit and its inner
        units, gathered one unit at a time, with ``FullStateDictConfig``'s ``offload_to_cpu``
        and ``rank0_only`` (other ranks: the unit's keys are left out, the parent's own stay,
        as in torch); ``SHARDED_STATE_DICT`` the DTensors of :meth:`sharded_state_dict`;
        ``LOCAL_STATE_DICT`` this rank's padded rows (refused by torch.distributed.checkpoint).
        With ``keep_vars=True`` the sharded parameters are full detached tensors too, as in
        torch FSDP1 (the shards themselves are ``local_state_dict(keep_vars=True)``); the
        other parameters are the module's own ``Parameter`` objects and the buffers are as
        without it (the module's own, in their original dtype). So every rank must call
        the parent's ``state_dict()``: a rank calling it alone waits in the first all-gather
        (not detectable without a collective, as in torch). Memory and communication are those
        of this method: one unit gathered at a time and one all-gather per unit (FULL), none
        beyond views (SHARDED, LOCAL). An inner unit (one with an enclosing unit, e.g. a block
        of the ZeRO stage-3 engine's model) gives its shards as before, without communication.

        Every kind carries ``_metadata`` (the modules' versions) under the original module
        names, as ``nn.Module.state_dict`` does, and FSDP's own loads hand it on, so a module's
        ``_load_from_state_dict`` that converts older formats sees the saved version (also
        where a plain parent's ``nn.Module.load_state_dict`` reaches a unit).

        Memory: one unit gathered at a time, plus the dict where it is returned (the full model,
        on ``state_dict_device``). Communication: one all-gather per unit.
        """
        if args or destination is not None:  # nn.Module's recursion into this unit
            given_destination, given_prefix, given_keep_vars = _state_dict_arguments(
                "state_dict", args, destination, prefix, keep_vars)
            if self._reached_from_plain_parent() and self._state_dict_settings.state_dict_type \
                    is not StateDictType.LOCAL_STATE_DICT:
                if given_destination is None:
                    given_destination = OrderedDict()
                    given_destination._metadata = OrderedDict()
                return self._state_dict_into_parent(given_destination, given_prefix,
                                                    given_keep_vars)
            result = super().state_dict(*args, destination=destination, prefix=prefix,
                                        keep_vars=keep_vars)
            if not _structural_keys.depth:
                _drop_wrapper_prefixes(result, prefix)
                if not self._summoned and not given_keep_vars:
                    self._mark_own_shards_for_dcp(result, given_prefix)
            return result
        config = self._state_dict_settings.state_dict_config
        kind = self._state_dict_settings.state_dict_type
        if kind is StateDictType.LOCAL_STATE_DICT:
            return self._local_state_dict_for_dcp(prefix, config.offload_to_cpu)
        if kind is StateDictType.SHARDED_STATE_DICT:
            return self.sharded_state_dict(prefix=prefix)
        return self._full_state(prefix)[0]

    def _full_state(self, prefix: str, keep_vars: bool = False) -> tuple:
        """``(full state dict or {} where rank0_only leaves it out, the structural dict)``:
        :meth:`state_dict` under ``FULL_STATE_DICT``. With ``keep_vars`` the parameters that are
        not sharded are the module's own and the buffers are not detached. One all-gather per
        unit."""
        config = self._state_dict_settings.state_dict_config
        rank0_only = self.state_dict_on_rank_0_only or getattr(config, "rank0_only", False)
        keep = not rank0_only or self._is_first_rank()
        with self._buffers_in_original_dtype():
            raw = _structural_state_dict(self, keep_vars=True)  # shard views; buffers as saved
        values = self._full_params_unit_by_unit(raw, keep)
        if not keep:
            return OrderedDict(), raw
        full = OrderedDict((prefix + clean_name(k), self._on_state_dict_device(
            values[k] if k in values else v if keep_vars else _detached(v)))
            for k, v in raw.items())
        full._metadata = _clean_metadata(raw, prefix)
        return full, raw

    def _reached_from_plain_parent(self) -> bool:
        """Whether nn.Module's recursion reached this unit from a module that is not a unit:
        outside FSDP's own walks, not summoned, and no unit built around it. Local."""
        return not _structural_keys.depth and not self._summoned and self._outermost() is self

    def _state_dict_into_parent(self, destination: dict, prefix: str, keep_vars: bool) -> dict:
        """:meth:`state_dict`'s part when a plain parent's ``state_dict()`` reaches this unit:
        what its ``state_dict_type`` gives (FULL or SHARDED) written into ``destination`` under
        ``prefix``, with the modules' ``_metadata`` (versions) under the original names."""
        if self._state_dict_settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            values, raw = self._sharded_state(prefix)
        else:
            values, raw = self._full_state(prefix, keep_vars)
        destination.update(values)
        metadata = getattr(destination, "_metadata", None)
        for key, value in (getattr(raw, "_metadata", {}).items() if metadata is not None
                           else ()):
            name = prefix + key if key else prefix[:-1]
            metadata[clean_name(name + ".")[:-1]] = value  # the wrapped module's wins
        return destination

    def _full_params_unit_by_unit(self, raw: dict, keep: bool) -> dict:
        """``{state-dict key: full parameter}`` for the parameter keys of ``raw``, each unit
        summoned alone (``{}`` where ``keep`` is false: the gathers still run, collectively).
        Communication: one all-gather per unit."""
        params = _parameters_by_key(self)
        keys_of: dict = {}
        for key in raw:
            if key in params:
                keys_of.setdefault(id(params[key]), []).append(key)
        values = {}
        for unit in self.sharded_units():
            with unit.summon_full_params(recurse=False, writeback=False):
                for p in (unit._shard.params if keep and unit._shard is not None else ()):
                    for key in keys_of.get(id(p), ()):
                        values[key] = self._on_state_dict_device(p.detach())
        return values

    def _on_state_dict_device(self, value):
        device = self.state_dict_device
        if self._state_dict_settings.state_dict_config.offload_to_cpu:
            device = torch.device("cpu")
        return value.to(device) if device is not None and torch.is_tensor(value) else value

    def _is_first_rank(self) -> bool:
        replica = 0 if self.replicate_group is None else skdist.get_rank(self.replicate_group)
        return self.rank == 0 and replica == 0

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a full state dict (e.g. from the unwrapped model or :meth:`state_dict`): each
        rank keeps its rows. It takes what the unwrapped model takes: the modules' load
        pre-hooks (``register_load_state_dict_pre_hook``, e.g. renaming a checkpoint's old keys)
        and version conversions (``_metadata``: an old BatchNorm's missing
        ``num_batches_tracked``) run before the keys are judged. ``nn.Module``'s load walk
        runs once, as in torch (each pre-hook and ``_load_from_state_dict`` once, so a hook
        may convert the dict's tensors in place), copying nothing: it records the values the
        modules would copy (references, no copies) and checks keys and shapes; a mismatch
        (with ``strict``, a missing or unexpected key) on any rank raises on every rank, naming
        the keys as :meth:`state_dict` has them, and loads nothing. Then each rank copies its
        rows of the recorded values, sets the recorded extra states and runs the load
        post-hooks; with ``strict=False`` the returned missing/unexpected keys use the names of
        :meth:`state_dict` too. All ranks must call it. Communication: a one-element
        all-reduce; memory: one block of this rank's rows at a time (no full parameter is
        gathered)."""
        if assign:
            raise ValueError("FullyShardedDataParallel.load_state_dict(assign=True) is not "
                             "supported: parameters must stay views of their shards")
        if self._state_dict_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            return self._load_local(state_dict, None, strict)
        if self._state_dict_settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            return self.load_sharded_state_dict(state_dict, strict=strict)
        missing, unexpected, errors, order, records = self._walk_agreed(
            lambda: self._checked_walk(self._to_wrapped_keys(state_dict), self._shard_entries(),
                                       strict), "state_dict", "")
        return _finish_load(self, records, order, missing, unexpected, errors, strict)

    def _checked_walk(self, wrapped: dict, sharded: dict, strict: bool) -> tuple:
        """``(problems, _load_walk's result)`` for ``wrapped`` (module paths). Local."""
        rows: list = []
        walked = _load_walk(self, wrapped, "", getattr(wrapped, "_metadata", None), sharded,
                            rows)
        return _load_problems(*walked[:3], strict) + rows, walked

    def _walk_agreed(self, check, what: str, kind: str, own_errors=(),
                     collective: bool = True) -> tuple:
        """``check()``'s walk (it returns ``(problems, walk)``, see :meth:`_checked_walk`) once
        every rank of the group and of its replicas found no problem; else the same
        RuntimeError on every rank, naming the ranks that failed and their problems, nothing
        written on any rank (:meth:`_refuse_mismatch_on_every_rank`). An exception of
        ``check`` (a pre-hook's, a dict that is not one) is this rank's problem, so no rank is
        left waiting; one in ``own_errors`` (filled by ``check``: an argument's error) is
        raised as itself on its rank, after the agreement; the agreed error of a rank whose
        ``check`` raised has that exception as its ``__cause__``. ``collective=False``: this
        rank's problems only, no communication (a LOCAL load, local in FairScale and torch
        FSDP1). Communication: a one-element all-reduce (per group)."""
        if not collective:  # as before: this rank's dict, this rank's error
            problems, walked = check()
            if problems:
                raise RuntimeError(f"Error(s) in loading {what} for {type(self).__name__}"
                                   f"{kind[:-1] + '; ' if kind else ' ('}nothing was loaded):"
                                   f"\n\t" + "\n\t".join(problems))
            return walked
        own = cause = None
        try:
            problems, walked = check()
        except Exception as error:  # e.g. a pre-hook's: raised on every rank, not only here
            cause = error
            own = error if any(error is e for e in own_errors) else None
            problems, walked = [f"checking the {what} (the modules' load walk, pre-hooks "
                                f"included) raised {type(error).__name__}: {error}"], None
        try:
            self._refuse_mismatch_on_every_rank(problems, what, kind)
        except RuntimeError as agreed:
            if own is not None:
                raise own from agreed
            if cause is not None:  # keep the hook's traceback on the rank that raised it
                raise agreed from cause
            raise
        return walked

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        """nn.Module's load of this unit. Reached from a plain parent's ``load_state_dict``
        (see :meth:`state_dict`) under ``FULL_STATE_DICT`` or ``SHARDED_STATE_DICT``, the unit
        loads its part of the dict (full tensors, or DTensors) itself, as ``nn.Module`` would
        load it into the unwrapped modules: each module's load pre-hooks and version
        conversions run on the full values, then each sharded parameter takes this rank's rows
        of what they left. Keys are reported as torch reports them, under the original names:
        a size mismatch, a missing or an unexpected key (``nn.Module.load_state_dict``'s
        ``RuntimeError`` with ``strict``, the returned keys otherwise), the mismatching tensor
        left as it was. Under ``LOCAL_STATE_DICT`` the values are this rank's shards, loaded
        as given, the keys reported the same way. The modules inside the unit see their saved
        ``_metadata`` versions, read from the dict of the ``nn.Module.load_state_dict`` that
        reached the unit (its walk hands the unit its own entry only); reached by another
        loader (one that walks the modules itself), only the unit and its wrapped module see
        theirs, the others none, which torch's modules read as their oldest format (a
        BatchNorm then fills in a missing ``num_batches_tracked``). No communication (each
        rank cuts its own rows), so every rank loads what it is given; memory: one block per
        parameter."""
        if self._reached_from_plain_parent():
            if local_metadata.get("assign_to_params_buffers", False):
                raise ValueError("load_state_dict(assign=True) of a module holding a "
                                 "FullyShardedDataParallel unit is not supported: its "
                                 "parameters must stay views of their shards")
            self._load_from_plain_parent(state_dict, prefix, local_metadata, missing_keys,
                                         unexpected_keys, error_msgs)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def _load_from_plain_parent(self, state_dict, prefix: str, local_metadata: dict,
                                missing_keys: list, unexpected_keys: list,
                                error_msgs: list) -> None:
        """:meth:`_load_from_state_dict`'s part when a plain parent's load reaches this unit:
        ``nn.Module``'s walk over the unit's modules (:func:`_load_walk`, each pre-hook once)
        records their values, which are then copied (what fits, as torch's walk copies); the
        parent's walk, which goes on into the same modules, then skips their loads (each
        module's ``_load_from_state_dict`` once per visit) and runs their load post-hooks.
        Local."""
        kind = self._state_dict_settings.state_dict_type
        sharded = {} if kind is StateDictType.LOCAL_STATE_DICT else \
            self._sharded_params("load_state_dict") if kind is StateDictType.SHARDED_STATE_DICT \
            else self._shard_entries()
        rows: list = []
        versions = {prefix[:-1]: local_metadata, prefix + _WRAPPED_PREFIX[:-1]: local_metadata}
        saved = _metadata_of_torch_load()
        for path, _ in self.named_modules(prefix=prefix[:-1]) if saved else ():
            found = saved.get(path, saved.get(clean_name(path + ".")[:-1]))
            if isinstance(found, dict):
                versions.setdefault(path, found)
        missing, unexpected, errors, _, records = _load_walk(self, state_dict, prefix, versions,
                                                             sharded, rows)
        _apply_records(records)  # what fits is copied, as nn.Module's own walk does
        missing_keys.extend(_reported(k) for k in missing)
        unexpected_keys.extend(_reported(k) for k in unexpected)
        error_msgs.extend(_reported(line) for line in errors + rows)
        visits: dict = {}

        def visit(module, path):
            for name, child in module._modules.items():
                if child is not None:
                    inner = path + name + "."
                    visits.setdefault(id(child), (child, []))[1].append(inner)
                    visit(child, inner)
        visit(self, prefix)  # the modules the parent's walk goes on into, with their prefixes
        for module, prefixes in visits.values():
            module.__dict__["_load_from_state_dict"] = _SkipLoad(module, prefixes)

    def _fqn_modifiers(self) -> dict:
        """torch's ``torch.distributed.checkpoint.state_dict`` hook (``StateDictOptions.
        dsd_fqn_modifiers``): the names under this unit (``{name: "_fsdp_wrapped_module"}``) sit
        one level down, so torch's FQNs are the unwrapped model's, as :meth:`state_dict`'s
        keys. torch's functions call it while checking their arguments: the optimizers they
        were given are then marked (:func:`~shardkit.checkpoint.torch_state_dict.
        mark_optimizers_of_torch_call`), so that ``dcp.save`` refuses their state, this rank's
        rows, instead of writing one rank's rows as if replicated. Local."""
        from shardkit.checkpoint.torch_state_dict import mark_optimizers_of_torch_call
        mark_optimizers_of_torch_call()
        inner = self._fsdp_wrapped_module
        hidden = _WRAPPED_PREFIX[:-1]
        names = [*inner._modules, *inner._parameters, *inner._buffers]
        return {name: hidden for name in names} or {"": hidden}

    def full_shapes(self) -> dict:
        """The full (unsharded) shape of every tensor of :meth:`state_dict`, by its key:
        sharded parameters from their layouts, the others (ignored: ``ignored_modules`` /
        ``ignored_states``) and buffers as held. No communication, no gather."""
        shapes = self._sharded_shapes()
        for name, p in self.named_parameters(remove_duplicate=False):
            shapes.setdefault(state_dict_key(name), tuple(p.shape))
        for name, buf in self.named_buffers():
            shapes.setdefault(state_dict_key(name), tuple(buf.shape))
        return shapes

    def _sharded_shapes(self) -> dict:
        """``{key: full shape}`` of the parameters that units shard. Local."""
        layouts = self._param_layouts()
        return {state_dict_key(name): tuple(layouts[id(p)].shape)
                for name, p in self.named_parameters(remove_duplicate=False)
                if id(p) in layouts}

    def _refuse_mismatch_on_every_rank(self, problems: list[str], what: str = "state_dict",
                                       kind: str = "") -> None:
        """torch's RuntimeError, raised on every rank of the group and of its replicas before
        anything is written on any rank (torch's own load first copies the tensors that fit),
        also when only some ranks were given a mismatching dict (``{}`` where a ``rank0_only``
        dict was not loaded, one rank's file of another model): the error lists this rank's
        problems and names each other rank that failed with its own (global ranks). ``what``
        and ``kind`` as in :func:`_finish_load`. Communication: a one-element all-reduce over
        the group (and one over the replicas); on failure, an object all-gather of the
        problems."""
        groups = [self.process_group] + ([self.replicate_group]
                                         if self.replicate_group is not None else [])
        failed = bool(problems)
        for group in groups:
            failed = skdist.any_rank(failed, group, device=self._comm_device())
        if not failed:
            return
        every = [(skdist.get_rank(), list(problems))]
        for group in groups:
            every = [entry for part in skdist.all_gather_object(
                every, group=group, counted=False, operation="load_state_dict's agreement")
                for entry in part]
        raise RuntimeError(f"Error(s) in loading {what} for {type(self).__name__}"
                           f"{kind[:-1] + '; ' if kind else ' ('}nothing was loaded):\n\t"
                           + "\n\t".join(_lines_of_every_rank(problems, every)))

    def _to_wrapped_keys(self, state_dict, metadata=None) -> OrderedDict:
        """``state_dict`` (original keys) under the module paths ``nn.Module`` loads from; its
        ``_metadata`` (or ``metadata``: module versions under the original names) goes along
        under those paths, so that a module's ``_load_from_state_dict`` sees the version it
        was saved with, as in the unwrapped model. Local."""
        raw = _structural_state_dict(self, keep_vars=True)
        wrapped = {clean_name(k): k for k in raw}
        result = OrderedDict((wrapped.get(k, k), v) for k, v in state_dict.items())
        metadata = getattr(state_dict, "_metadata", None) if metadata is None else metadata
        if isinstance(metadata, dict):
            result._metadata = OrderedDict(
                (path, metadata[name]) for path, name in
                ((path, clean_name(path + ".")[:-1]) for path in getattr(raw, "_metadata", {}))
                if name in metadata)
        return result

    @contextlib.contextmanager
    def _buffers_in_original_dtype(self):
        changed = []
        for unit in self.sharded_units():
            for module, name, dtype in unit._buffer_dtypes:
                buf = module._buffers[name]
                changed.append((module, name, buf))
                module._buffers[name] = buf.to(dtype)
        try:
            yield
        finally:
            for module, name, buf in changed:
                module._buffers[name] = buf

    # ------------------------------------------------------------------ sharded state dicts

    def _sharded_params(self, call: str) -> dict:
        """``{id(param): (layout, unit, shard view)}`` of every sharded parameter (the view of
        the flat shard, also while the unit is gathered), after refusing units
        whose parameters are not copied to as many ranks as the root's (experts: the same
        name holds different values on different ranks, which a DTensor cannot say; a
        NO_SHARD unit inside a FULL_SHARD one is a 1-rank cut of a replicated tensor, which
        dcp writes once). Local: the same answer on every rank."""
        foreign = self._params_holding_rank_own_values()
        if foreign:
            raise ValueError(f"FSDP.{call} under StateDictType.SHARDED_STATE_DICT: the "
                             f"parameters {foreign[:3]} are sharded over other ranks than this "
                             f"model's group (experts: each rank holds its own values under the "
                             f"same name), which a DTensor of the model cannot describe; save "
                             f"them with LOCAL_STATE_DICT (local_state_dict with "
                             f"local_metadata_dict, one torch.save file per rank)")
        return self._shard_entries()

    def _shard_entries(self) -> dict:
        """``{id(param): (layout, unit, shard view)}`` of every sharded parameter of this unit
        and the units inside it. Local."""
        return {id(p): (lay, u, view) for u in self.sharded_units() if u._shard is not None
                for p, lay, view in zip(u._shard.params, u._shard.layouts,
                                        u._shard.shard_views(u._shard.flat_shard))}

    def sharded_state_dict(self, prefix: str = "") -> OrderedDict:
        """torch FSDP1's ``SHARDED_STATE_DICT`` (what :meth:`state_dict` returns under
        ``FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)``), for
        ``torch.distributed.checkpoint``: the keys of :meth:`state_dict` (original names), each
        parameter a DTensor of its full shape with ``Shard(0)`` placement over its unit's shard
        group (a 1-D mesh; replicas of hybrid sharding hold equal chunks, which dcp writes once),
        whose local tensor is a view of this rank's real rows (padding dropped; with
        ``ShardedStateDictConfig(offload_to_cpu=True)`` a CPU copy); buffers as plain
        (replicated) tensors in their original dtype. dcp reshards such a checkpoint for any
        world size on load. A 0-dim parameter (no rows to cut) is a plain tensor.

        Memory: this rank's rows only, no full parameter is ever built (views; CPU copies with
        ``offload_to_cpu``). Communication: none (a broadcast of each 0-dim parameter over its
        unit's group, if any); dcp's own for save and load. All ranks must call it."""
        return self._sharded_state(prefix)[0]

    def _sharded_state(self, prefix: str) -> tuple:
        """``(sharded_state_dict(prefix), the structural dict)``."""
        sharded = self._sharded_params("state_dict")
        offload = self._state_dict_settings.state_dict_config.offload_to_cpu
        with self._buffers_in_original_dtype():
            raw = _structural_state_dict(self, keep_vars=True)
        params = _parameters_by_key(self)
        out = OrderedDict()
        for key, value in raw.items():
            p = params.get(key)
            entry = sharded.get(id(p)) if p is not None else None
            if entry is None:
                value = _detached(value)
                out[prefix + clean_name(key)] = value.cpu() if offload and \
                    torch.is_tensor(value) else value
                continue
            layout, unit, shard = entry
            out[prefix + clean_name(key)] = _as_shards(shard.detach(), layout, unit, offload)
        out._metadata = _clean_metadata(raw, prefix)
        return out, raw

    def load_sharded_state_dict(self, state_dict, strict: bool = True):
        """Load a dict shaped like :meth:`sharded_state_dict` (e.g. filled by
        ``torch.distributed.checkpoint.load`` at any world size): each parameter's DTensor
        holds this rank's rows, copied into the shard (plain full-shape tensors are cut too);
        buffers are copied. The modules' load pre-hooks and version conversions run first, as
        in the unwrapped model (see :meth:`load_state_dict`). Keys (with ``strict``), full
        shapes and each DTensor's rows are checked first, while ``nn.Module``'s load walk
        (run once: each pre-hook once) records the values and copies nothing: a mismatch on
        any rank (also one rank's dict only) raises torch's ``RuntimeError`` on every rank of
        the group and its replicas, naming the keys and the ranks that failed, and nothing
        is loaded on any rank. Then the recorded values are copied and the load post-hooks
        run. Returns torch's missing/unexpected keys. All ranks must call it.

        Memory: one block of this rank's rows at a time (twice: checked, then copied).
        Communication: a one-element all-reduce (the ranks' agreement)."""
        self._refuse_sharded_load_while_summoned()
        sharded = self._sharded_params("load_state_dict")
        missing, unexpected, errors, order, records = self._walk_agreed(
            lambda: self._checked_walk(self._to_wrapped_keys(
                state_dict, getattr(state_dict, "_metadata", None)), sharded, strict),
            "state_dict", " (SHARDED_STATE_DICT)")
        return _finish_load(self, records, order, missing, unexpected, errors, strict,
                            " (SHARDED_STATE_DICT)")

    def _mark_own_shards_for_dcp(self, destination: OrderedDict, prefix: str) -> None:
        """This unit reached from a plain module's ``state_dict()`` under
        ``LOCAL_STATE_DICT``, or an inner unit reached from a plain module inside its enclosing
        unit (``root.module.block.state_dict()``), gives its shards under the original keys;
        each is marked so that torch.distributed.checkpoint refuses it on every rank instead of
        saving one rank's rows as if replicated (:func:`refuse_in_dcp`). Local."""
        if self._shard is None or self._shard.world_size == 1:
            return
        own = {id(p) for p in self._shard.params}
        for name, p in _parameters_by_key(self).items():
            key = prefix + clean_name(name)
            if id(p) in own and isinstance(destination.get(key), torch.Tensor):
                destination[key] = refuse_in_dcp(
                    destination[key], key, "an FSDP unit's shards reached from a plain "
                    "module's state_dict() (LOCAL_STATE_DICT, or a unit inside another: "
                    "call state_dict() on the outermost FSDP unit or a module holding it)")

    def _refuse_sharded_load_while_summoned(self) -> None:
        """Inside ``summon_full_params`` the parameters hold full values (written back over
        the shards on exit): a ``SHARDED_STATE_DICT`` load there is refused, on every rank
        alike (summoning is collective) and before anything is copied. Local."""
        if any(u._summoned for u in self.sharded_units()):
            raise RuntimeError("FSDP.load_state_dict under StateDictType.SHARDED_STATE_DICT "
                               "inside summon_full_params(): the parameters are gathered "
                               "there, not this rank's shards (nothing was loaded); load "
                               "after the summon_full_params block")

    def _local_state_dict_for_dcp(self, prefix: str, offload: bool) -> OrderedDict:
        """:meth:`local_state_dict` (plain tensors, this rank's padded rows: FairScale's
        contract, for ``torch.save`` one file per rank) with each sharded parameter's value
        marked so that torch.distributed.checkpoint refuses it, on every rank and before
        anything is written or loaded, naming ``SHARDED_STATE_DICT``
        (:func:`~shardkit.checkpoint.dtensor_state.refuse_in_dcp`); without the mark dcp takes
        it for a replicated tensor and silently loads one rank's rows everywhere. No
        communication."""
        sharded = {id(p) for u in self.sharded_units() if u._shard is not None
                   for p in u._shard.params}
        params = {clean_name(n): p for n, p in _parameters_by_key(self).items()}
        out = OrderedDict()
        local = self.local_state_dict()
        out._metadata = OrderedDict((prefix + k if k else prefix[:-1], v)
                                    for k, v in local._metadata.items())
        for key, value in local.items():
            value = value.cpu() if offload and torch.is_tensor(value) else value
            out[prefix + key] = refuse_in_dcp(value, key) \
                if id(params.get(key)) in sharded else value
        return out

    # ------------------------------------------------------------------ local state dicts

    def _param_layouts(self, gathered_state_only: bool = False) -> dict[int, ParamLayout]:
        """``id(param) -> layout`` of every sharded parameter (with ``gathered_state_only``,
        not of units built with ``no_broadcast_optim_state``)."""
        return {id(p): lay for u in self.sharded_units() if u._shard is not None
                and not (gathered_state_only and u.no_broadcast_optim_state)
                for p, lay in zip(u._shard.params, u._shard.layouts)}

    def local_state_dict(self, *args, destination=None, prefix: str = "",
                         keep_vars: bool = False) -> OrderedDict:
        """This rank's shards (padded rows, cloned) and the buffers in their original dtype (as
        :meth:`state_dict` and FairScale give them, also under mixed precision), under the
        original keys; a module's extra state (``get_extra_state``) as it gives it. Save
        :meth:`local_metadata_dict` beside it to reshard or consolidate. No communication;
        memory: one shard copy.

        ``nn.Module.state_dict``'s arguments are taken, as FairScale forwards them (also
        positionally: ``destination, prefix, keep_vars``), so a subclass whose ``state_dict``
        returns ``local_state_dict(*args, **kwargs)`` works inside a plain module's
        ``state_dict()``: keys get ``prefix``, ``destination`` is filled and returned, and
        ``keep_vars=True`` gives the shards themselves (not cloned)."""
        destination, prefix, keep_vars = _state_dict_arguments(
            "local_state_dict", args, destination, prefix, keep_vars)
        with self._buffers_in_original_dtype():
            local = _structural_state_dict(self, keep_vars=keep_vars)
        if destination is None:
            destination = OrderedDict()
            destination._metadata = OrderedDict()
        if isinstance(getattr(destination, "_metadata", None), dict):
            destination._metadata.update(_clean_metadata(local, prefix))
        for k, v in local.items():
            # a module's extra state (get_extra_state) is passed on as nn.Module gives it
            destination[prefix + clean_name(k)] = v.clone() if torch.is_tensor(v) and \
                not keep_vars else v
        return destination

    def local_metadata_dict(self) -> dict:
        """World size, rank, each sharded parameter's full shape and the buffer keys: what
        :meth:`consolidate_shard_weights` and :meth:`load_local_state_dict` need besides the
        tensors (plain Python values; the layout differs from FairScale's, the use is the same);
        also how units of another strategy than this root's (NO_SHARD, hybrid) cut their
        parameters, so that those consolidate and reshard too. No communication."""
        buffers = [state_dict_key(name) for name, _ in self.named_buffers()]
        # ignored parameters are whole on every rank: kept like the buffers, from one rank
        shapes = {k: v for k, v in self._sharded_shapes().items() if k not in buffers}
        replica = 0 if self.replicate_group is None else skdist.get_rank(self.replicate_group)
        return local_metadata(self.world_size, self.rank, shapes, buffers, replica=replica,
                              own_group_params=self._params_holding_rank_own_values(),
                              cuts=self._cuts_unlike_the_root(replica))

    def _cuts_unlike_the_root(self, replica: int) -> dict:
        """``{key: (shards, shard, replica)}`` of the parameters whose unit cuts them otherwise
        than this root (``self.world_size``, ``self.rank``, ``replica``): units of another
        sharding strategy (a NO_SHARD unit keeps the whole tensor on every rank, one block and
        as many copies as ranks) or over other groups. No communication."""
        root = (self.world_size, self.rank, replica)
        cut_of = {}
        for u in self.sharded_units():
            if u._shard is None:
                continue
            copy = 0 if u.replicate_group is None else skdist.get_rank(u.replicate_group)
            for p, layout in zip(u._shard.params, u._shard.layouts):
                cut = (layout.world_size, skdist.get_rank(u.process_group), copy)
                if cut != root:
                    cut_of[id(p)] = cut
        return {state_dict_key(name): cut_of[id(p)]
                for name, p in self.named_parameters(remove_duplicate=False) if id(p) in cut_of}

    def _params_holding_rank_own_values(self) -> list[str]:
        """Names of the parameters whose values differ between the model's ranks (experts:
        units over a group of their own, not replicated on the other ranks). A unit whose
        parameters are copied to as many ranks as the model's (its shard group times its
        replicas: a NO_SHARD or HYBRID_SHARD unit inside a FULL_SHARD one) holds the same
        values everywhere and is not one of them, although its groups differ from the
        model's. A unit over as many ranks but other ones (experts over one axis of a grid
        whose other axis the model is over) is one of them. No communication."""
        own = {id(p) for u in self.sharded_units() if u.params
               for p in u.params if not _copied_like(u, self)}
        return [state_dict_key(name) for name, p in self.named_parameters(remove_duplicate=False)
                if id(p) in own]

    consolidate_shard_weights = staticmethod(consolidate_shard_weights)

    def load_local_state_dict(self, state_dict, metadata=None) -> None:
        """Load :meth:`local_state_dict` output. Pass this rank's own dict when the world size
        is unchanged, or the list of every rank's dicts with ``metadata=`` the list of their
        :meth:`local_metadata_dict` (any world size, any sharding strategy: replicas' copies of
        a shard are skipped) to reshard: each rank re-slices its rows. The modules' load
        pre-hooks and version conversions run as in the unwrapped model (see
        :meth:`load_state_dict`); keys and shard shapes are checked before
        anything is written on that rank (a mismatch loads nothing there). No communication,
        as in FairScale and torch FSDP1: a rank may reload its own shards alone; a dict bad
        on one rank raises on that rank only."""
        self._load_local(state_dict, metadata, strict=True)

    def _load_local(self, state_dict, metadata, strict: bool):
        """:meth:`load_local_state_dict`, with ``strict`` as ``load_state_dict`` takes it under
        ``LOCAL_STATE_DICT``; returns torch's missing/unexpected keys (original names)."""
        arguments: list = []  # their errors are raised as they are (ValueError, TypeError)

        def check():
            try:
                local = reshard_local_state_dicts(state_dict, metadata, self.world_size,
                                                  self.rank, target=self.local_metadata_dict())
            except (TypeError, ValueError) as error:
                arguments.append(error)
                raise
            first = state_dict[0] if isinstance(state_dict, (list, tuple)) and state_dict \
                else state_dict
            wrapped = self._to_wrapped_keys(local, getattr(first, "_metadata", None))
            return self._local_mismatch(local, wrapped, strict)

        missing, unexpected, errors, order, records = self._walk_agreed(
            check, "local_state_dict", "", own_errors=arguments, collective=False)
        return _finish_load(self, records, order, missing, unexpected, errors, strict,
                            what="local_state_dict")

    def _local_mismatch(self, local: dict, wrapped: dict, strict: bool) -> tuple:
        """``(problems, _load_walk's result)`` of a local load: torch's strict-load lines under
        :meth:`local_state_dict`'s keys (not FSDP's wrapped names) and each shard of another
        shape, found while the modules' load walk (their pre-hooks and conversions included)
        records the values and copies nothing: torch's own load first copies every tensor
        that fits, so a dict of another model used to leave this one half overwritten. Local."""
        mine = {clean_name(k): v for k, v in _structural_state_dict(self, keep_vars=True).items()}
        full = self.full_shapes()
        sizes = [f"size mismatch for {k}: the dict's shard has shape {tuple(v.shape)}, this "
                 f"rank's shard of it (full shape {tuple(full.get(k, mine[k].shape))}) has "
                 f"{tuple(mine[k].shape)}"
                 for k, v in local.items() if k in mine and torch.is_tensor(v)
                 and torch.is_tensor(mine[k]) and tuple(v.shape) != tuple(mine[k].shape)
                 # get_extra_state: set_extra_state takes it unchecked, as torch's load does
                 and not k.endswith("_extra_state")]
        walked = _load_walk(self, wrapped, "", getattr(wrapped, "_metadata", None), {}, [])
        missing, unexpected, errors = walked[:3]
        problems = _load_problems(missing, unexpected, [] if sizes else errors, strict)
        if sizes or any(line.startswith("size mismatch") for line in errors):
            sizes.append("a local state dict loads only at the world size that saved it; to "
                         "reshard, pass the list of every rank's dicts and "
                         "metadata=[their local_metadata_dict()]")
        return problems + sizes, walked

    # ------------------------------------------------------------------ optimizer state

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer,
                                     recipient_rank: int = 0) -> Optional[dict]:
        """The optimizer's state with every shard-shaped tensor unsharded to the full parameter
        shape, in torch's format (loadable into a single-process optimizer over the unwrapped
        model), plus ``"param_names"``. Returned on ``recipient_rank``, ``None`` elsewhere.
        Each unit's state is gathered over the group that unit is sharded over. Units with
        ``no_broadcast_optim_state=True`` (given, or set by FairScale's rule for a nested unit
        alone in a world of one, e.g. an expert) are not gathered: their parameters' state is
        the recipient's own, listed under ``"uncollected_local_ids"`` for the caller to fill in.

        Communication: the ranks' recipients compared (one all-gather of two integers a rank,
        not counted), then one gather per state tensor to the recipient (``Ψ·K/4`` elements
        in all). Memory: the full optimizer state on the recipient only (one tensor at a time
        arrives); the other ranks send their shards and keep nothing. Ranks naming different
        recipients (each its own, to have the dict everywhere, which FairScale's all-gather
        allowed) get one all-gather per state tensor instead, and the full state on every
        rank. A ``recipient_rank`` or ``optim`` refused on some ranks only raises on every rank
        of the group, before any state moves. All ranks must call it.
        """
        call = "gather_full_optim_state_dict"
        problem = None
        try:  # checked here, so that a rank alone refusing its arguments leaves none waiting
            if not isinstance(recipient_rank, int) or not 0 <= recipient_rank < self.world_size:
                raise ValueError(f"{call}(recipient_rank={recipient_rank!r}): valid ranks are "
                                 f"0..{self.world_size - 1}")
            _check_gatherable(self, optim, call)
        except (TypeError, ValueError) as error:
            problem = error
        full = self._gathered_optim_state(optim, call,
                                          self._agreed_recipient(recipient_rank, problem, call),
                                          agreed=True)
        return full if self.rank == recipient_rank else None

    def _agree_gatherable(self, optim: torch.optim.Optimizer, call: str,
                          keyed_by_names: bool = False) -> None:
        """:func:`_check_gatherable` on every rank of the group: an optimizer refused on some
        ranks only (another model's, LBFGS) raises there, and a ValueError naming those ranks
        on the others, before any state moves (they waited in the gather). With
        ``keyed_by_names``, an optimizer holding parameters outside the model (whose state
        cannot be keyed by a name, :func:`_optimizer_names`) is refused the same way. One
        all-gather of one integer a rank over the group (a control message, not counted)."""
        problem = None
        try:
            if keyed_by_names:
                _optimizer_names(self, optim, call, "FULL_STATE_DICT")
            _check_gatherable(self, optim, call)
        except (TypeError, ValueError) as error:
            problem = error
        skdist._agree_on_call(f"FSDP.{call}", problem, [], self.process_group,
                              self._comm_device(), outcome="nothing was gathered")

    def _agreed_recipient(self, recipient_rank: int, problem: Optional[BaseException],
                          call: str) -> Optional[int]:
        """The global rank of ``recipient_rank`` (a rank of this unit's group) where every rank
        of the group names it, else ``None`` (every rank is to gather). ``problem`` (what this
        rank found wrong with its arguments) is raised here, and every other rank of the group
        raises a ValueError naming the ranks that had one. One all-gather of two integers a
        rank over the group (a control message, not counted)."""
        named = skdist._agree_on_call(f"FSDP.{call}", problem, [recipient_rank],
                                      self.process_group, self._comm_device(),
                                      outcome="nothing was gathered")
        if len({rank for rank, in named}) > 1:
            return None
        return skdist.get_global_rank(self.process_group, recipient_rank)

    def _gathered_optim_state(self, optim: torch.optim.Optimizer, call: str,
                              recipient: Optional[int], take_part: bool = True,
                              agreed: bool = False) -> Optional[dict]:
        """:meth:`gather_full_optim_state_dict`'s dict on the global rank ``recipient`` (on
        every rank with ``None``: one all-gather per state tensor), ``None`` elsewhere;
        without ``take_part`` (a replica whose groups do not hold the recipient), only the
        checks. Unless the caller's ranks ``agreed`` on them already, the checks end in an
        agreement over the group (:meth:`_agree_gatherable`)."""
        if agreed:
            _check_gatherable(self, optim, call)
        else:
            self._agree_gatherable(optim, call)
        if not take_part:
            return None
        self._mark_units_in_their_own_world()
        ordered = [p for g in optim.param_groups for p in g["params"]]
        names = _state_dict_keys(self)
        gathered = self._param_layouts(gathered_state_only=True)
        full = gather_full_optimizer_state(optim.state_dict(), ordered, gathered,
                                           [names.get(id(p)) for p in ordered],
                                           self.process_group, self._comm_device(),
                                           param_groups=self._param_unit_attr("process_group"),
                                           recipient=recipient)
        if full is None:
            return None
        sharded = self._param_layouts()
        full["uncollected_local_ids"] = [i for i, p in enumerate(ordered)
                                         if id(p) in sharded and id(p) not in gathered]
        return full

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict) -> dict:
        """This rank's part of a full optimizer state dict (from
        :meth:`gather_full_optim_state_dict`, any world size, torch FSDP1's name-keyed
        ``FSDP.optim_state_dict``, or a single-process optimizer over the unwrapped model):
        every full-shape tensor is cut to this rank's rows. Load the result with
        ``optim.load_state_dict``. No communication."""
        return self._shard_of_full(_keyed_by_ids(full_optim_state_dict,
                                                 "get_shard_from_optim_state_dict"))

    def _shard_of_full(self, full: dict, take=copied_part) -> dict:
        """:meth:`get_shard_from_optim_state_dict` of an id-keyed dict, each value kept as
        ``take(value, cut)`` gives it (see :func:`shard_optimizer_state`)."""
        if isinstance(full.get("param_names"), list):  # also a dict saved with the levels
            full = dict(full, param_names=[state_dict_key(n) if isinstance(n, str) else n
                                           for n in full["param_names"]])
        return shard_full_optimizer_state(full, [(state_dict_key(n), p) for n, p
                                                 in self.named_parameters()],
                                          self._param_layouts(), self.rank,
                                          param_ranks=self._param_unit_attr("rank"), take=take)

    # torch FSDP1's optimizer-state functions (static: ``FSDP.optim_state_dict(model, optim)``)

    @staticmethod
    def full_optim_state_dict(model, optim: torch.optim.Optimizer, optim_input=None,
                              rank0_only: bool = True, group=None) -> dict:
        """torch FSDP1's name for :meth:`gather_full_optim_state_dict` (parameter ids as keys):
        the full state on rank 0 (the model's first rank: ``{}`` elsewhere, also on the other
        replicas' rank 0 under hybrid sharding or NO_SHARD, as torch FSDP1's) or, with
        ``rank0_only=False``, on every rank. ``optim_input`` and ``group`` must be left unset
        (the model's own group is used). ``rank0_only=True`` is refused for a model with
        parameters sharded over other groups (experts: the other ranks' state would be
        dropped). All ranks must call it.
        Communication: one gather per state tensor to rank 0 (``rank0_only=False``: one
        all-gather). Memory: the full state where it is returned; the other ranks keep
        nothing beyond their shards."""
        model = _as_root(model, "full_optim_state_dict")
        _refuse_torch_only_arguments("full_optim_state_dict", optim_input=optim_input,
                                     group=group)
        if not isinstance(rank0_only, bool):
            raise ValueError(f"full_optim_state_dict(rank0_only={rank0_only!r}): must be True "
                             f"or False")
        if rank0_only:
            _refuse_experts_on_one_rank(model, "full_optim_state_dict(rank0_only=True)")
        if rank0_only:
            return model._rank0_only_optim_state(optim, "full_optim_state_dict")
        return model._gathered_optim_state(optim, "full_optim_state_dict", None)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict: dict, model, optim_input=None,
                                    optim=None) -> dict:
        """torch FSDP1's name for :meth:`get_shard_from_optim_state_dict`; given ``optim``, a
        dict keyed by names is matched to its parameters by name (as torch does), whatever
        order its param groups list them in. No communication."""
        model = _as_root(model, "shard_full_optim_state_dict")
        _refuse_torch_only_arguments("shard_full_optim_state_dict", optim_input=optim_input)
        if optim is not None:
            _check_optimizer_of(model, optim, "shard_full_optim_state_dict")
            full_optim_state_dict = _in_optimizer_order(model, optim, _keyed_by_ids(
                full_optim_state_dict, "shard_full_optim_state_dict"))
        return model.get_shard_from_optim_state_dict(full_optim_state_dict)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict: Optional[dict], model,
                                      optim_input=None, optim=None, group=None) -> dict:
        """torch FSDP1's: the full optimizer state dict given on the first rank (rank 0 of the
        group and of the replicas; e.g. :meth:`full_optim_state_dict`'s, loaded there alone)
        is sent to every rank, which returns its part for ``optim.load_state_dict`` (given
        ``optim``, a dict keyed by names is matched to its parameters by name). The
        argument is ignored on the other ranks (``None`` there). A dict that is not a full
        optimizer state dict raises the same ``ValueError`` on every rank; so does a model
        with parameters sharded over other groups (experts), before any collective, and an
        ``optim`` refused on some ranks only (another model's) raises there and a ValueError
        naming them on the others, before the dict is sent. All ranks of the
        model's group and replicas must call it. Communication: one all-gather of one integer a
        rank over the replicas and one over the group (not counted), the full dict's skeleton
        by one object broadcast and its large tensors one broadcast each (and the same across the
        replicas), each rank cutting its rows from each as it arrives. Memory: this rank's
        part plus one full tensor in flight."""
        model = _as_root(model, "scatter_full_optim_state_dict")
        _refuse_torch_only_arguments("scatter_full_optim_state_dict", optim_input=optim_input,
                                     group=group)
        _refuse_experts_on_one_rank(model, "scatter_full_optim_state_dict")
        problem = None
        try:
            if optim is not None:
                _check_optimizer_of(model, optim, "scatter_full_optim_state_dict")
        except (TypeError, ValueError) as error:
            problem = error
        # one rank's optimizer refused there alone left the others waiting in the broadcast
        _agree_over_group_and_replicas(model, "scatter_full_optim_state_dict", problem)
        sent = _from_first_rank(model, full_optim_state_dict, "scatter_full_optim_state_dict",
                                "full_optim_state_dict")
        if sent.kind == "error":
            raise ValueError(sent.value)
        try:  # the cuts planned on stand-ins, then the tensors received one at a time
            mine = model._shard_of_full(_in_optimizer_order(model, optim, sent.value),
                                        take=sent.tensors.take)
        except Exception:
            sent.tensors.fill(None)  # the other ranks are sending: receive before raising
            raise
        sent.tensors.fill(mine)
        return mine

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict: dict, optim_state_key_type, model,
                               optim_input=None, optim=None) -> dict:
        """torch FSDP1's: ``optim_state_dict`` (full: from :meth:`full_optim_state_dict`, or a
        plain optimizer's ``state_dict()``) keyed the other way, ``optim_state_key_type``
        (:class:`~shardkit.nn.data_parallel.fsdp_state_dict_type.OptimStateKeyType` or torch's)
        ``PARAM_NAME`` (by the unwrapped model's parameter names) or ``PARAM_ID`` (by index, as
        ``optim.load_state_dict`` takes it). The indices are the order of ``optim``'s param
        groups when it is given, else of ``model.parameters()``; ``model`` may be the FSDP
        model or the unwrapped one. A dict already keyed that way is returned as it is; else a
        new dict with ``state`` and ``param_groups`` (names in the dict's order; ids sorted, as
        torch's, since ``optim.load_state_dict`` pairs them with its parameters by position),
        the tensors not copied. ``optim_input`` must be left unset. Local."""
        _refuse_torch_only_arguments("rekey_optim_state_dict", optim_input=optim_input)
        key_type = getattr(optim_state_key_type, "name", optim_state_key_type)
        if key_type not in ("PARAM_NAME", "PARAM_ID"):
            raise ValueError(f"FSDP.rekey_optim_state_dict(optim_state_key_type="
                             f"{optim_state_key_type!r}): expected OptimStateKeyType.PARAM_NAME "
                             f"or OptimStateKeyType.PARAM_ID")
        if not isinstance(optim_state_dict, dict) or not isinstance(
                optim_state_dict.get("state"), dict) or not isinstance(
                optim_state_dict.get("param_groups"), list):
            raise ValueError("FSDP.rekey_optim_state_dict(optim_state_dict=...): expected an "
                             "optimizer state dict (a dict with 'state' and 'param_groups')")
        flat = [k for g in optim_state_dict["param_groups"] for k in g.get("params", ())]
        keys = flat + list(optim_state_dict["state"])
        by_name = [isinstance(k, str) for k in keys]
        by_id = [isinstance(k, int) and not isinstance(k, bool) for k in keys]
        if not (all(by_name) or all(by_id)):
            raise ValueError(f"FSDP.rekey_optim_state_dict: the dict's parameter keys mix "
                             f"names and ids, or are neither ({keys[:6]}...)")
        if (key_type == "PARAM_NAME") == all(by_name) and keys:
            return optim_state_dict
        if optim is not None:
            _check_optimizer_of(model, optim, "rekey_optim_state_dict")
            params = [p for g in optim.param_groups for p in g["params"]]
        else:
            params = list(model.parameters())
        known = _state_dict_keys(model)
        outside = [i for i, p in enumerate(params) if id(p) not in known]
        if outside:
            raise ValueError(f"FSDP.rekey_optim_state_dict: the optimizer's parameters "
                             f"{outside[:5]} (in param-group order) are not parameters of the "
                             f"model; pass the model the optimizer was built over")
        names = [known[id(p)] for p in params]
        to_key = dict(enumerate(names)) if key_type == "PARAM_NAME" else \
            {n: i for i, n in enumerate(names)}
        unknown = [k for k in keys if k not in to_key]
        if unknown:
            raise ValueError(f"FSDP.rekey_optim_state_dict: the dict's parameters "
                             f"{unknown[:5]} are not among the {len(names)} "
                             f"{'indices' if key_type == 'PARAM_NAME' else 'names'} of "
                             f"{'the optimizer' if optim is not None else 'model.parameters()'}")

        def listed(group):  # ids sorted, as torch's: optim.load_state_dict matches positions
            keyed = [to_key[k] for k in group.get("params", ())]
            return keyed if key_type == "PARAM_NAME" else sorted(keyed)
        return {"state": {to_key[k]: v for k, v in optim_state_dict["state"].items()},
                "param_groups": [dict(g, params=listed(g))
                                 for g in optim_state_dict["param_groups"]]}

    @staticmethod
    def optim_state_dict(model, optim: torch.optim.Optimizer, optim_state_dict=None,
                         group=None) -> dict:
        """torch FSDP1's optimizer state under :meth:`state_dict_type`: ``FULL_STATE_DICT``
        gives the full state keyed by parameter names (``{}`` off rank 0 with a
        ``FullOptimStateDictConfig(rank0_only=True)``, refused for a model with experts, whose
        state differs between groups), ``LOCAL_STATE_DICT`` this rank's
        ``optim.state_dict()``, ``SHARDED_STATE_DICT`` the state keyed by parameter names with
        each per-element tensor (``exp_avg``...) a ``Shard(0)`` DTensor of this rank's rows, as
        the parameters in :meth:`sharded_state_dict` (for torch.distributed.checkpoint; on the
        loading side give a fresh optimizer its state first, e.g. with
        :func:`shardkit.checkpoint.dtensor_state.init_optimizer_state`, so that ``dcp.load``
        has tensors to fill: a fresh optimizer's dict that reaches
        :meth:`optim_state_dict_to_load` still empty is refused there, not loaded as no
        state). Load any of them with :meth:`optim_state_dict_to_load`. All ranks must call it;
        costs as :meth:`full_optim_state_dict` (full: with ``rank0_only``, the full state on
        rank 0 alone) or nothing (local, sharded: views of the state, no full tensor)."""
        model = _as_root(model, "optim_state_dict")
        _refuse_torch_only_arguments("optim_state_dict", optim_state_dict=optim_state_dict,
                                     group=group)
        settings = model._state_dict_settings
        if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
            return mark_rank_local_state(optim, optim.state_dict(),
                                         "FSDP.optim_state_dict under LOCAL_STATE_DICT",
                                         shard_shaped_only=True)
        if settings.state_dict_type is StateDictType.SHARDED_STATE_DICT:
            return _sharded_optim_state(model, optim)
        rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
        if rank0_only:
            _refuse_experts_on_one_rank(model, "optim_state_dict (FULL_STATE_DICT, rank0_only)")
        # the names too are checked on every rank before any state moves: a rank alone
        # refusing its optimizer left the others waiting in the gather
        model._agree_gatherable(optim, "optim_state_dict", keyed_by_names=True)
        full = model._rank0_only_optim_state(optim, "optim_state_dict", agreed=True) \
            if rank0_only else \
            model._gathered_optim_state(optim, "optim_state_dict", None, agreed=True)
        return _keyed_by_names(full) if full else {}

    @staticmethod
    def optim_state_dict_to_load(model, optim: torch.optim.Optimizer, optim_state_dict: dict,
                                 is_named_optimizer: bool = False, load_directly: bool = False,
                                 group=None) -> dict:
        """What ``optim.load_state_dict`` takes for :meth:`optim_state_dict` output (full,
        keyed by names, from any world size, matched to ``optim``'s parameters by name whatever
        order its param groups list them in: this rank's rows are cut out; local: as given,
        once its per-element state is checked to have this rank's shard shapes; sharded:
        each DTensor's rows, e.g. after ``torch.distributed.checkpoint.load`` at any world
        size, become this rank's padded shard);
        with ``load_directly=True`` it is loaded into ``optim`` and ``None`` returned. Under
        ``FULL_STATE_DICT`` with ``FullOptimStateDictConfig(rank0_only=True)``, as in torch
        FSDP1, only the first rank (rank 0 of the group and of the replicas) needs the dict
        (e.g. loaded there alone): it is sent to the other ranks, whose argument (``{}``,
        ``None``) is ignored (refused, before any collective, for a model with parameters
        sharded over other groups, experts: one rank's dict cannot hold every group's). A
        dict that does not fit (another model's or optimizer's, another rank's shapes, param
        groups that differ, ``{}`` where every rank must give the dict) or whose parameters
        have other state keys on some ranks than on others (one rank's file from another
        checkpoint) raises the same ``ValueError`` on every rank
        of the group and of its replicas, naming each rank that failed and its problem (ranks
        whose state keys differ from the others': where no majority of the ranks agrees, each
        side), before anything is loaded (collective, as torch FSDP1's). Communication: a
        three-element all-reduce per group; on failure, an object all-gather of the problems;
        with ``rank0_only``, the full dict from rank 0 beforehand, its skeleton by one object
        broadcast and its large tensors one broadcast each, each rank cutting its rows from
        each as it arrives (memory: this rank's part plus one full tensor in flight, as torch
        FSDP1's)."""
        model = _as_root(model, "optim_state_dict_to_load")
        _refuse_torch_only_arguments("optim_state_dict_to_load", group=group,
                                     is_named_optimizer=is_named_optimizer or None)
        settings = model._state_dict_settings
        kind = settings.state_dict_type
        mine = cause = keys = sent = None
        if kind is StateDictType.FULL_STATE_DICT and \
                getattr(settings.optim_state_dict_config, "rank0_only", False):
            _refuse_experts_on_one_rank(model, "optim_state_dict_to_load (FULL_STATE_DICT, "
                                               "rank0_only)")
            sent = _from_first_rank(model, optim_state_dict, "optim_state_dict_to_load",
                                    "optim_state_dict")
        try:
            if sent is None:  # (under rank0_only the first rank checks it before sending)
                _refuse_state_never_received(optim_state_dict)
            if kind is StateDictType.LOCAL_STATE_DICT:
                _refuse_other_shards(model, optim, optim_state_dict)
                mine = optim_state_dict
            elif kind is StateDictType.SHARDED_STATE_DICT:
                mine = _sharded_optim_state_to_load(model, optim, optim_state_dict)
            elif sent is not None and sent.kind == "error":  # the first rank's dict's failure
                if model._is_first_rank():                   # (the others have none to check)
                    raise ValueError(sent.value)
            elif sent is not None:  # the cuts planned on stand-ins; the tensors arrive below
                mine = model._shard_of_full(_in_optimizer_order(model, optim, sent.value),
                                            take=sent.tensors.take)
            else:
                mine = model.get_shard_from_optim_state_dict(_in_optimizer_order(
                    model, optim, _keyed_by_ids(optim_state_dict)))
            if mine is not None:
                _check_loadable_groups(optim, mine)
                keys = _state_keys(model, optim, mine)
        except Exception as error:  # any local failure (e.g. AttributeError of a malformed
            cause = error           # entry) must reach the agreement, or the others hang
            mine = None
        if sent is not None and sent.tensors is not None:  # on every rank, also a failed one
            sent.tensors.fill(mine)
        _agree_on_optim_load(model, optim, keys, cause, kind, sent is not None)
        if load_directly:
            optim.load_state_dict(mine)
            return None
        return mine

    @staticmethod
    def sharded_optim_state_dict(model, optim: torch.optim.Optimizer, group=None) -> dict:
        """torch FSDP1's older name for :meth:`optim_state_dict` under ``SHARDED_STATE_DICT``,
        whatever the model's :meth:`state_dict_type` settings: the state keyed by parameter
        names, each per-element tensor a ``Shard(0)`` DTensor of this rank's rows (torch's
        gives ShardedTensors; torch.distributed.checkpoint saves and reshards both), for a
        model state dict taken under ``SHARDED_STATE_DICT``. Load it with
        :meth:`flatten_sharded_optim_state_dict`. ``group`` must be left unset. All ranks must
        call it; no copy of the state, no communication beyond the ranks' agreement on the
        optimizer."""
        _refuse_torch_only_arguments("sharded_optim_state_dict", group=group)
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return FSDPStateDictMixin.optim_state_dict(model, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict, model,
                                         optim: torch.optim.Optimizer) -> dict:
        """torch FSDP1's older name for :meth:`optim_state_dict_to_load` under
        ``SHARDED_STATE_DICT``, whatever the model's settings: the dict for
        ``optim.load_state_dict`` from :meth:`sharded_optim_state_dict`'s (e.g. filled by
        ``torch.distributed.checkpoint.load`` at any world size). A dict that does not fit
        raises the same ``ValueError`` on every rank, nothing loaded. Collective."""
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return FSDPStateDictMixin.optim_state_dict_to_load(model, optim,
                                                               sharded_optim_state_dict)

    def _rank0_only_optim_state(self, optim: torch.optim.Optimizer, call: str,
                                agreed: bool = False) -> dict:
        """``rank0_only``'s full optimizer state: on the model's first rank (rank 0 of its group
        in the first replica, the rank the loads take the dict from, as torch FSDP1's global
        rank 0), ``{}`` elsewhere. The other replicas (hybrid sharding, NO_SHARD), whose
        state is the same, gather nothing. Parameters over other groups (experts) are
        refused before (:func:`_refuse_experts_on_one_rank`). ``agreed``: the caller's ranks
        agreed on the optimizer already (:meth:`_agree_gatherable`)."""
        replica = 0 if self.replicate_group is None else skdist.get_rank(self.replicate_group)
        full = self._gathered_optim_state(optim, call,
                                          skdist.get_global_rank(self.process_group, 0),
                                          take_part=replica == 0, agreed=agreed)
        return {} if full is None else full

    def _param_unit_attr(self, attr: str) -> dict:
        """``id(param) -> getattr(unit, attr)`` for every sharded parameter, from the unit that
        shards it (units may shard over different groups, e.g. experts)."""
        return {id(p): getattr(u, attr) for u in self.sharded_units() for p in u.params}

    def _mark_units_in_their_own_world(self) -> None:
        """FairScale's rule: a nested unit sharded over a group of one rank while this unit's
        group is larger (an expert alone on its rank) holds state no other rank shares, so
        gathering it would only cost memory: it gets ``no_broadcast_optim_state=True``."""
        for unit in self.sharded_units():
            if unit.world_size == 1 < self.world_size and unit.replicate_group is None:
                unit.no_broadcast_optim_state = True


class _PlainRoot:
    """A plain module holding FSDP units (``model.encoder = FSDP(model.encoder)``, torch's
    ``checkpoint_wrapper(FSDP(model))``) seen as one FSDP root by the optimizer-state functions
    (``FSDP.optim_state_dict(model, optim)`` and the others take such a model in torch FSDP1):
    its parameter names are the module's (without FSDP's wrapper prefixes), its units are
    every unit inside, and its group, replicas, rank and settings are those its outermost units
    share. The mixin's optimizer-state methods run on it unchanged. Local."""

    def __init__(self, module: nn.Module, roots: list):
        self._module, self._roots = module, roots
        first = roots[0]
        self.process_group, self.replicate_group = first.process_group, first.replicate_group
        self.rank, self.world_size = first.rank, first.world_size
        self._state_dict_settings = first._state_dict_settings

    def sharded_units(self) -> list:
        return [u for root in self._roots for u in root.sharded_units()]

    def named_parameters(self, *args, **kwargs):
        for name, param in self._module.named_parameters(*args, **kwargs):
            yield clean_name(name), param

    def parameters(self, *args, **kwargs):
        return self._module.parameters(*args, **kwargs)

    def _comm_device(self) -> torch.device:
        return self._roots[0]._comm_device()


# the mixin's own, on the plain root's units
for _method in ("_is_first_rank", "_rank0_only_optim_state", "_gathered_optim_state",
                "_agreed_recipient", "_agree_gatherable",
                "gather_full_optim_state_dict", "_shard_of_full",
                "get_shard_from_optim_state_dict", "_param_layouts", "_param_unit_attr",
                "_mark_units_in_their_own_world", "_sharded_params",
                "_shard_entries", "_params_holding_rank_own_values"):
    setattr(_PlainRoot, _method, getattr(FSDPStateDictMixin, _method))


def _as_root(model, call: str):
    """``model`` itself when it is an FSDP unit, else a :class:`_PlainRoot` over the outermost
    units it holds, which must share their group and replicas, or at least copy their
    parameters to the same ranks (:func:`_copied_like`; a NO_SHARD unit beside FULL_SHARD
    ones: the model's group is then the widest unit's); a clear error otherwise (no unit,
    units over different groups), before any collective. Local."""
    if isinstance(model, FSDPStateDictMixin):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"FSDP.{call}(model={type(model).__name__}): expected the "
                        f"FullyShardedDataParallel model, or a module holding its units")
    units = [m for m in model.modules() if isinstance(m, FSDPStateDictMixin)]
    inner = {id(u) for unit in units for u in unit.sharded_units() if u is not unit}
    roots = [u for u in units if id(u) not in inner]
    if not roots:
        raise ValueError(f"FSDP.{call}(model={type(model).__name__}): the model holds no "
                         f"FullyShardedDataParallel unit; pass the wrapped model")
    ranks = {(tuple(skdist.group_ranks(r.process_group)),
              tuple(skdist.group_ranks(r.replicate_group)) if r.replicate_group is not None
              else None) for r in roots}
    widest = max(roots, key=lambda r: r.world_size)
    if len(ranks) > 1 and all(_copied_like(r, widest) for r in roots):
        # the same values on the same ranks: the model's group is the widest unit's
        roots = sorted(roots, key=lambda r: -r.world_size)
    elif len(ranks) > 1:
        raise ValueError(f"FSDP.{call}(model={type(model).__name__}): its outermost "
                         f"FullyShardedDataParallel units are sharded over different groups "
                         f"({sorted(ranks, key=str)[:3]}); pass each unit with the optimizer "
                         f"over its parameters")
    return _PlainRoot(model, roots)


def _state_dict_arguments(call: str, args: tuple, destination, prefix, keep_vars) -> tuple:
    """``(destination, prefix, keep_vars)`` from ``nn.Module.state_dict``'s deprecated
    positional form or its keywords, checked. Local."""
    if len(args) > 3:
        raise TypeError(f"{call}() takes at most 3 positional arguments (destination, prefix, "
                        f"keep_vars), got {len(args)}")
    given = dict(zip(("destination", "prefix", "keep_vars"), args))
    destination = given.get("destination", destination)
    prefix = given.get("prefix", prefix)
    keep_vars = given.get("keep_vars", keep_vars)
    if destination is not None and not isinstance(destination, dict):
        raise TypeError(f"{call}(destination={type(destination).__name__}): expected a dict "
                        f"(an OrderedDict) or None")
    if not isinstance(prefix, str):
        raise TypeError(f"{call}(prefix={prefix!r}): expected a str")
    if not isinstance(keep_vars, bool):
        raise TypeError(f"{call}(keep_vars={keep_vars!r}): expected True or False")
    return destination, prefix, keep_vars


def _check_optimizer_of(model, optim, call: str) -> None:
    """A clear error, on every rank alike and before any collective, for something that is
    not a torch optimizer, or an optimizer none of whose parameters belong to ``model`` (built
    over another model: its state would be returned as if it were this model's). Parameters
    outside the model beside some of its own are allowed: their state is kept whole. Local."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(f"{call}(optim={type(optim).__name__}): expected the torch.optim."
                        f"Optimizer built over this model's parameters (for a saved state "
                        f"dict, use get_shard_from_optim_state_dict)")
    ordered = [p for g in optim.param_groups for p in g["params"]]
    mine = {id(p) for p in model.parameters()}
    if ordered and not any(id(p) in mine for p in ordered):
        raise ValueError(f"{call}(optim={type(optim).__name__}): none of the optimizer's "
                         f"{len(ordered)} parameters belongs to this FullyShardedDataParallel "
                         f"model; pass the optimizer built over this model's "
                         f"parameters")


def _check_gatherable(model, optim, call: str) -> None:
    """:func:`_check_optimizer_of`, a TypeError for LBFGS, whose state cannot be unsharded,
    and :func:`_refuse_rank_local_state`. Local."""
    _check_optimizer_of(model, optim, call)
    if isinstance(optim, torch.optim.LBFGS):  # its state is over the flattened shard
        raise TypeError(f"{call}: LBFGS keeps one state over the "
                        "flattened parameters, here this rank's shards, not one per "
                        "parameter; FullyShardedDataParallel does not support LBFGS (use "
                        "DistributedDataParallel with OSS, which runs it on the whole model)")
    _refuse_rank_local_state(model, optim, call)


def _refuse_rank_local_state(model, optim, call: str) -> None:
    """A ValueError (the same on every rank: shard shapes are padded alike) when the optimizer
    holds :func:`rank_local_state`: a full optimizer state dict would carry the receiving
    rank's copy alone, which every rank then loads (wrong numbers at any world size, a size
    mismatch at the next ``step()`` at another one). Local."""
    found = rank_local_state(optim)
    if not found:
        return
    names = _state_dict_keys(model)
    ordered = [p for g in optim.param_groups for p in g["params"]]
    listed = [f"{names.get(id(ordered[index]), index)} {key!r} {shape} (shard {shard})"
              for index, key, shape, shard in found[:3]]
    raise ValueError(
        f"{call}: the optimizer's state of {len(found)} tensor(s) of parameters sharded by "
        f"FullyShardedDataParallel is shaped neither as the parameter nor as its shard (or is "
        f"a factored moment, {'/'.join(sorted(FACTORED_STATE))}), e.g. "
        f"{listed} (Adafactor's factored moments): each rank computes it from its own rows, so "
        f"a full optimizer state dict cannot hold it. Save each rank's state with "
        f"StateDictType.LOCAL_STATE_DICT (it loads at this world size only), or use an "
        f"optimizer with per-element state (Adam, SGD) or OSS, which steps whole parameters")


def _refuse_other_shards(model, optim: torch.optim.Optimizer, osd) -> None:
    """A ValueError when a local optimizer state dict holds per-element state whose shape is
    not this rank's shard of its parameter (saved at another world size or by another model):
    torch's ``load_state_dict`` takes it and the next ``step()`` fails on a size mismatch.
    Local, no copy."""
    ordered = [p for g in optim.param_groups for p in g["params"]]
    names = _state_dict_keys(model)
    problems = []
    for index, entry in (osd.get("state", {}) if isinstance(osd, dict) else {}).items():
        p = ordered[index] if isinstance(index, int) and 0 <= index < len(ordered) else None
        for key, value in (entry.items() if p is not None else ()):
            if key in ELEMENTWISE_STATE and torch.is_tensor(value) \
                    and tuple(value.shape) != tuple(p.shape):
                problems.append(f"{names.get(id(p), index)} {key!r} {tuple(value.shape)} "
                                f"(this rank's shard: {tuple(p.shape)})")
                break
    if problems:
        raise ValueError(
            f"FSDP.optim_state_dict_to_load (LOCAL_STATE_DICT): the state of {len(problems)} "
            f"parameter(s) does not have this rank's shard shapes, e.g. {problems[:2]}; a local "
            f"optimizer state dict loads only at the world size that saved it: to reshard, "
            f"pass every rank's dicts with their local_metadata_dict() to "
            f"shardkit.checkpoint.reshard_local_optim_state_dicts")


def _optimizer_names(model, optim, call: str, kind: str = "SHARDED_STATE_DICT") -> list:
    """The clean name of each of the optimizer's parameters, in its order; a ValueError for
    one that is not the model's (under ``FULL_STATE_DICT`` several such would all be keyed
    ``None``, one's state kept for all). Local."""
    _check_optimizer_of(model, optim, call)
    names = _state_dict_keys(model)
    ordered = [p for g in optim.param_groups for p in g["params"]]
    outside = [i for i, p in enumerate(ordered) if id(p) not in names]
    if outside:
        raise ValueError(f"FSDP.{call} ({kind}): the optimizer's parameters "
                         f"{outside[:5]} (in param-group order) are not parameters of this "
                         f"model; their state cannot be keyed by a parameter name (keep them "
                         f"in an optimizer of their own, or use FSDP.full_optim_state_dict / "
                         f"shard_full_optim_state_dict, keyed by the optimizer's ids)")
    return [names[id(p)] for p in ordered]


def _optimizer_names_agreed(model, optim, call: str) -> list:
    """:func:`_optimizer_names` on every rank of the model's group before a collective: an
    optimizer refused on some ranks only raises there, and a ValueError naming those ranks on
    the others (they waited in the broadcast of a 0-dim parameter's state). One all-gather of
    one integer a rank over the group (a control message, not counted)."""
    names, problem = None, None
    try:
        names = _optimizer_names(model, optim, call)
    except (TypeError, ValueError) as error:
        problem = error
    skdist._agree_on_call(f"FSDP.{call}", problem, [], model.process_group,
                          model._comm_device(), outcome="nothing was sent")
    return names


def shard_shapes(params) -> dict:
    """``{id(param): padded shard shape}`` for the parameters among ``params`` that an FSDP unit
    shards over several ranks (and the other parameters of those units): their optimizer
    state holds this rank's rows only. Local; one pass per unit met."""
    from shardkit.nn.data_parallel.fully_sharded import unit_holding
    shapes: dict = {}
    seen: set = set()
    for param in params:
        if id(param) in shapes or id(param) in seen:
            continue
        seen.add(id(param))
        shard = getattr(unit_holding(param), "_shard", None)
        if shard is not None and shard.world_size > 1:
            shapes.update((id(q), tuple(lay.shard_shape))
                          for q, lay in zip(shard.params, shard.layouts))
    return shapes


def rank_local_state(optim: torch.optim.Optimizer) -> list[tuple]:
    """``(index, key, shape, shard shape)`` of each tensor of one dimension or more in the
    optimizer's state of a parameter sharded over several ranks that is not shaped as its shard
    or is one of :data:`FACTORED_STATE` (``index``: the parameter's position in param-group
    order), such as Adafactor's factored ``row_var`` (rows, 1) and ``col_var`` (1, cols):
    computed from this rank's rows only, so neither a full tensor nor a row-sharded DTensor
    describes it, and it has the same shape and key on every rank. Local, no copy."""
    ordered = [p for g in optim.param_groups for p in g["params"]]
    shapes = shard_shapes(ordered)
    found = []
    for index, param in enumerate(ordered):
        shape = shapes.get(id(param))
        state = optim.state.get(param, {}) if shape is not None else {}
        found.extend((index, key, tuple(value.shape), shape) for key, value in state.items()
                     if torch.is_tensor(value) and value.dim() > 0
                     and (tuple(value.shape) != shape or key in FACTORED_STATE))
    return found


def rank_local_shape(shape: tuple, shard: tuple) -> str:
    """How the shape of a :func:`rank_local_state` tensor tells it from per-element state, for
    a message: ``shape`` is not the shard's, or it is (a (1, 1) shard) and only its key (one
    of :data:`FACTORED_STATE`) does."""
    if shape != shard:
        return f"shape {shape}, neither the parameter's nor its shard's"
    return (f"shape {shape}, its shard's, but it is a factored moment "
            f"({'/'.join(sorted(FACTORED_STATE))}) over this rank's rows")


def mark_rank_local_state(optim: torch.optim.Optimizer, osd: dict, source: str,
                          shard_shaped_only: bool) -> dict:
    """``osd`` (``optim.state_dict()``) with each per-element state tensor of a parameter
    sharded over several ranks (this rank's padded rows, under the same key on every rank)
    replaced by an alias (``detach``: no copy) marked by
    :func:`~shardkit.checkpoint.dtensor_state.refuse_in_dcp` (its message naming ``source``),
    so that torch.distributed.checkpoint refuses it on every rank instead of saving one rank's
    rows as if replicated; with ``shard_shaped_only``, only tensors shaped like the shard.
    ``torch.save`` and ``optim.load_state_dict`` take it as before; the optimizer's own tensors
    are not marked. Local."""
    ordered = [p for g in optim.param_groups for p in g["params"]]
    shapes = shard_shapes(ordered)
    state = osd.get("state", {})
    for index, entry in list(state.items()):
        param = ordered[index] if isinstance(index, int) and 0 <= index < len(ordered) else None
        shape = shapes.get(id(param)) if param is not None else None
        if shape is None:
            continue
        state[index] = {  # a new dict: optim.state_dict() gives the live ones
            key: refuse_in_dcp(value.detach(), f"state {key!r} of parameter {index}", source)
            if per_element(key, value) and (not shard_shaped_only
                                            or tuple(value.shape) == shape) else value
            for key, value in entry.items()}
    return osd


def _sharded_optim_state(model, optim: torch.optim.Optimizer) -> dict:
    """:meth:`FSDPStateDictMixin.optim_state_dict` under ``SHARDED_STATE_DICT``: keyed by
    names, per-element state of sharded parameters as DTensors of this rank's rows (0-dim ones
    broadcast over their unit's group), the rest as given. No copy of a shard. The ranks
    first agree on the optimizer (one all-gather of one integer a rank, not counted): an
    optimizer refused on one rank only left the others waiting in the broadcast of a 0-dim
    parameter's state, or, without one, returning a dict that ``dcp.save`` then hung on."""
    sharded = model._sharded_params("optim_state_dict")  # alike on every rank
    names = _optimizer_names_agreed(model, optim, "optim_state_dict")
    ordered = [p for g in optim.param_groups for p in g["params"]]
    offload = model._state_dict_settings.state_dict_config.offload_to_cpu
    osd = optim.state_dict()
    rank_local = {(index, key) for index, key, _, _ in rank_local_state(optim)}
    state = _StateOfAFreshOptimizer() if _has_no_state_yet(optim) else {}
    for index in sorted(osd["state"]):
        p = ordered[index]
        entry = sharded.get(id(p))
        values = {}
        for key, value in osd["state"][index].items():
            if (index, key) in rank_local:  # checked first: a (1, 1) shard's col_var
                value = _refused_in_dcp_as_rank_local(value, f"{names[index]}.{key}",
                                                      tuple(entry[0].shard_shape))
            elif entry is not None and per_element(key, value) and \
                    tuple(value.shape) == tuple(entry[0].shard_shape):
                value = _as_shards(value, entry[0], entry[1], offload)
            values[key] = value
        state[names[index]] = values
    groups, start = [], 0
    for g in osd["param_groups"]:
        groups.append(dict(g, params=names[start:start + len(g["params"])]))
        start += len(g["params"])
    return {"state": state, "param_groups": groups}


def _refused_in_dcp_as_rank_local(value: torch.Tensor, name: str, shard: tuple) -> torch.Tensor:
    """An alias of ``value`` (a :func:`rank_local_state` tensor, e.g. Adafactor's ``row_var``
    of this rank's rows; ``shard``: its parameter's shard shape) that
    torch.distributed.checkpoint refuses on every rank before anything is written or loaded:
    as a plain tensor under the same key on every rank, dcp would take it for a replicated one,
    write one rank's copy and load it on every rank. ``torch.save`` and
    ``optim_state_dict_to_load`` take it as before. Local, no copy."""
    return refuse_in_dcp(
        value.detach(), name, "FSDP.optim_state_dict under SHARDED_STATE_DICT",
        reason=f"it has {rank_local_shape(tuple(value.shape), shard)} (e.g. Adafactor's "
               f"factored moments): each rank computes it from its own rows, "
               f"so no DTensor describes it and dcp would save one rank's copy for all. Save "
               f"each rank's state with StateDictType.LOCAL_STATE_DICT and torch.save (it "
               f"loads at this world size only), or use an optimizer with per-element state "
               f"(Adam, SGD)")


def _sharded_optim_state_to_load(model, optim: torch.optim.Optimizer, osd) -> dict:
    """The inverse of :func:`_sharded_optim_state`: ``optim.load_state_dict``'s dict with each
    per-element DTensor (or full-shape plain tensor) turned into this rank's padded rows (a
    plain tensor in this rank's padded shard shape is kept; any other shape is refused). The
    dict's parameter names must be the optimizer's, in its order. A ValueError naming the
    parameter and the state key otherwise (nothing is loaded). Local; memory: one copy of
    this rank's state."""
    names = _optimizer_names(model, optim, "optim_state_dict_to_load")
    ided = _keyed_by_ids(osd)
    given = ided.get("param_names", [])
    if given and list(given) != names:
        raise ValueError(f"FSDP.optim_state_dict_to_load (SHARDED_STATE_DICT): the dict's "
                         f"parameters {list(given)[:4]}... are not this optimizer's "
                         f"{names[:4]}... (same names in the same param-group order); pass "
                         f"FSDP.optim_state_dict(model, optim) of this model, e.g. filled by "
                         f"torch.distributed.checkpoint.load")
    sharded = model._sharded_params("optim_state_dict_to_load")
    ordered = [p for g in optim.param_groups for p in g["params"]]
    state = {}
    for index, entry in ided["state"].items():
        layout_unit = sharded.get(id(ordered[index])) if isinstance(index, int) and \
            0 <= index < len(ordered) else None
        values = {}
        for key, value in entry.items():
            if layout_unit is not None and torch.is_tensor(value) and per_element(key, value) \
                    and (is_dtensor(value) or tuple(value.shape) == tuple(layout_unit[0].shape)):
                value = rows_from_value(value, layout_unit[0], layout_unit[1].rank,
                                        f"FSDP.optim_state_dict_to_load: state {key!r} of "
                                        f"{names[index]}")
            elif is_dtensor(value):
                value = value.to_local()
            elif layout_unit is not None and torch.is_tensor(value) and key in ELEMENTWISE_STATE \
                    and value.dim() > 0 \
                    and tuple(value.shape) != tuple(layout_unit[0].shard_shape):
                # only the known per-element moments: other tensors (Adafactor's row_var
                # (rows, 1) / col_var (1, cols)) are rank-local state kept as saved
                raise ValueError(f"FSDP.optim_state_dict_to_load (SHARDED_STATE_DICT): state "
                                 f"{key!r} of {names[index]} has shape {tuple(value.shape)}; "
                                 f"expected a DTensor, the full shape "
                                 f"{tuple(layout_unit[0].shape)} or this rank's shard "
                                 f"{tuple(layout_unit[0].shard_shape)}")
            values[key] = value
        state[index] = values
    return {"state": state, "param_groups": ided["param_groups"]}


class _StateOfAFreshOptimizer(dict):
    """The ``"state"`` of :func:`_sharded_optim_state` for an optimizer that holds no state
    yet (before its first ``step()``): empty, and marked so that
    :func:`_refuse_state_never_received` can tell it reached ``optim_state_dict_to_load``
    still empty, e.g. after a ``dcp.load`` that had no tensor to load any state into."""

    def __reduce__(self):  # saved unmarked, as an OrderedDict: torch.load(weights_only=True)
        return OrderedDict, (), None, None, iter(self.items())  # takes it (not this class)

    # a copy (copy.copy, copy.deepcopy of the whole dict) is the same unfilled state: marked
    def __copy__(self):
        return _StateOfAFreshOptimizer(self)

    def __deepcopy__(self, memo):
        return _StateOfAFreshOptimizer(deepcopy(dict(self), memo))


def _has_no_state_yet(optim: torch.optim.Optimizer) -> bool:
    """Whether ``optim`` has trainable parameters but no state for any of them, and would
    have some after a step: torch's and shardkit's optimizers only (torch's SGD without
    momentum keeps no tensor: nothing to lose; a user's class may keep none either, and would
    otherwise be refused for good). Local."""
    groups = optim.param_groups
    if not type(optim).__module__.startswith(("torch.optim", "shardkit.")):
        return False
    if isinstance(optim, torch.optim.SGD) and all(not g.get("momentum") for g in groups):
        return False
    trainable = any(p.requires_grad for g in groups for p in g["params"])
    return trainable and not any(optim.state.get(p) for g in groups for p in g["params"])


def _refuse_state_never_received(osd) -> None:
    """A ValueError when ``osd`` is the dict :func:`_sharded_optim_state` gave for a fresh
    optimizer and its state is still empty. ``dcp.load`` fills only the tensors a dict holds:
    into a fresh optimizer's dict it loads the param groups and none of the checkpoint's
    state (``exp_avg``...), so loading it silently restarted the moments and step counts.
    torch FSDP1 loses them the same way; its ``get_state_dict`` and shardkit's (and
    :func:`~shardkit.checkpoint.dtensor_state.init_optimizer_state`) give the optimizer its
    state tensors first. Local; the caller's agreement raises it on every rank."""
    state = osd.get("state") if isinstance(osd, dict) else None
    if isinstance(state, _StateOfAFreshOptimizer) and not state:
        raise ValueError(
            "the dict is FSDP.optim_state_dict(model, optim) of an optimizer that had no state "
            "yet (before its first step), and it still holds no state: torch.distributed."
            "checkpoint.load fills only the tensors a dict holds, so none of the checkpoint's "
            "optimizer state (exp_avg, step...) was loaded. Call shardkit.checkpoint."
            "init_optimizer_state(optim) before FSDP.optim_state_dict(model, optim) on the "
            "loading side (or use shardkit.checkpoint.get_state_dict / set_state_dict, which "
            "do it); a checkpoint saved before the optimizer's first step holds no optimizer "
            "state: skip this load")


def _check_loadable_groups(optim: torch.optim.Optimizer, osd) -> None:
    """torch's ``load_state_dict`` checks of the param groups (their number, each one's
    size), made before the ranks agree, as a ValueError naming what differs. Local."""
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list) \
            or not isinstance(osd.get("state"), dict):
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups'")
    saved = [len(g.get("params", ())) if isinstance(g, dict) else None
             for g in osd["param_groups"]]
    mine = [len(g["params"]) for g in optim.param_groups]
    if saved != mine:
        raise ValueError(f"the dict's param groups hold {saved} parameters, this optimizer's "
                         f"{mine}; build the optimizer's param groups as when it was saved")


def _state_keys(model, optim: torch.optim.Optimizer, osd: dict) -> list:
    """``(name, state keys)`` in ``osd`` (``optim.load_state_dict``'s id-keyed dict) of each
    parameter sharded over the model's own group: alike on every rank for the dicts one run
    saved (units over other groups, e.g. experts, may differ). Local."""
    names = _state_dict_keys(model)
    groups = model._param_unit_attr("process_group")
    ordered = [p for g in optim.param_groups for p in g["params"]]

    def keys_of(i, entry):
        if entry is not None and not isinstance(entry, dict):
            raise ValueError(f"the state of parameter {i} is a {type(entry).__name__}, "
                             f"expected a dict of state keys")
        return sorted(map(str, entry or {}))
    return [(names.get(id(p), str(i)), keys_of(i, osd["state"].get(i)))
            for i, p in enumerate(ordered) if groups.get(id(p)) is model.process_group]


def _agree_on_optim_load(model, optim: torch.optim.Optimizer, keys: Optional[list],
                         cause: Optional[BaseException], kind,
                         sent_from_first: bool = False) -> None:
    """:meth:`FSDPStateDictMixin.optim_state_dict_to_load`'s agreement: returns when no rank
    of the model's group and replicas failed (``cause``) and the ranks' dicts give the same
    parameters state (same keys); else the same ValueError on every rank, naming the ranks
    that failed and their problems (this rank's own error as its ``__cause__``; ranks with
    the same problem on one line; ``sent_from_first``: the dict was the first rank's, sent to
    every rank). Communication: a three-element all-reduce per group; on failure, an object
    all-gather."""
    groups = [model.process_group] + ([model.replicate_group]
                                      if model.replicate_group is not None else [])
    signature = zlib.crc32(repr(keys).encode()) if keys is not None else 0
    votes = torch.tensor([int(cause is not None), signature, -signature], dtype=torch.int64,
                         device=model._comm_device())
    for group in groups:
        skdist.all_reduce(votes, op=torch.distributed.ReduceOp.MAX, group=group)
    failed, high, low = votes.tolist()
    if not failed and high == -low:
        return
    problem = f"{type(cause).__name__}: {cause}" if cause is not None else None
    ordered = [p for g in optim.param_groups for p in g["params"]]
    held = {"state": {i: optim.state[p] for i, p in enumerate(ordered) if p in optim.state}}
    every = [(skdist.get_rank(), problem, keys, _state_keys(model, optim, held))]
    for group in groups:
        every = [entry for part in skdist.all_gather_object(
            every, group=group, counted=False, operation="optim_state_dict_to_load's agreement")
            for entry in part]
    every.sort(key=lambda e: e[0])
    failing: dict = {}  # a problem several ranks share (a rank0_only dict's) is told once
    for r, p, _, _ in every:
        if p is not None:
            failing.setdefault(p, []).append(r)
    lines = [f"on rank {ranks[0]}: {p}" if len(ranks) == 1 else f"on ranks {ranks}: {p}"
             for p, ranks in failing.items()]
    blamed = sum(map(len, failing.values()))
    if lines and sent_from_first:
        lines.append("(rank0_only: every rank cut its rows from the dict given on the first "
                     "rank, the others' were ignored)")
    if not lines:  # every rank's dict fits, but they give different parameters state
        hint = ("give every rank the same full dict" if kind is StateDictType.FULL_STATE_DICT
                else "each rank must load the dict it saved in one run")
        lines, blamed = _state_disagreement(every, hint)
    raise ValueError(f"FSDP.optim_state_dict_to_load ({getattr(kind, 'name', kind)}): the "
                     f"optimizer state dict "
                     f"{f'does not fit on {blamed} rank(s)' if blamed else 'differs between ranks'}"
                     f", nothing was loaded on any rank:\n\t" + "\n\t".join(lines)) from cause


def _state_disagreement(every: list, hint: str) -> tuple:
    """``(lines, number of ranks blamed)`` for ranks whose dicts fit but give a parameter
    different state keys (``every``: ``(rank, None, [(name, keys)], [(name, the optimizer's
    own keys)])`` of every rank, in rank order), at the first parameter they differ on. The
    keys most ranks give are taken as right; without a majority (two ranks), those the
    optimizer already holds for the parameter, else those of the ranks that give it some
    state; failing all, each side is named and no rank blamed. Local."""
    own = dict(every[0][3])
    sizes = {len(theirs) for _, _, theirs, _ in every}
    if len(sizes) > 1:
        return [f"the ranks' dicts give state for different numbers of parameters "
                f"({[len(theirs) for _, _, theirs, _ in every]} on ranks "
                f"{[r for r, _, _, _ in every]}); {hint}"], 0
    for position, (name, _) in enumerate(every[0][2]):
        sides: dict = {}
        for r, _, theirs, _ in every:
            sides.setdefault(tuple(theirs[position][1]), []).append(r)
        if len(sides) == 1:
            continue
        counts = sorted((len(ranks) for ranks in sides.values()), reverse=True)
        right = None
        if counts[0] > counts[1]:
            right = max(sides, key=lambda k: len(sides[k]))
        elif own.get(name) and tuple(own[name]) in sides:
            right = tuple(own[name])
        elif len(sides) == 2 and () in sides:
            right = next(k for k in sides if k)
        if right is None:
            told = "; ".join(f"{list(k)} on rank(s) {ranks}" for k, ranks in sides.items())
            return [f"parameter {name} has state {told} (the ranks were given different "
                    f"dicts); {hint}"], 0
        wrong = [(ranks, k) for k, ranks in sides.items() if k != right]
        return [f"on rank {r}: parameter {name} has state {list(k)}, on rank(s) "
                f"{sides[right]} {list(right)}; {hint}" for ranks, k in wrong for r in ranks], \
            sum(len(ranks) for ranks, _ in wrong)
    return [f"the ranks' dicts differ; {hint}"], 0


def _refuse_torch_only_arguments(call: str, **given) -> None:
    """torch FSDP1 arguments with no meaning here: a ValueError unless left unset."""
    for name, value in given.items():
        if value is not None:
            raise ValueError(f"FSDP.{call}({name}=...): not supported by shardkit's FSDP (the "
                             f"model's own process group and its optimizer's param groups are "
                             f"used); leave it unset")


def _ranks_holding_a_copy(unit) -> int:
    """How many ranks hold (a row block of) each of ``unit``'s parameters: its shard group's
    size times its replicas' (NO_SHARD: 1 x every rank). Local."""
    replicas = 1 if unit.replicate_group is None else \
        skdist.get_world_size(unit.replicate_group)
    return skdist.get_world_size(unit.process_group) * replicas


def _ranks_known_to_hold_a_copy(unit) -> set:
    """The global ranks of ``unit``'s shard group and of its replicas: those of the ranks
    holding its parameters that this rank can name (all of them unless both groups have
    several ranks). Local."""
    ranks = set(skdist.group_ranks(unit.process_group))
    if unit.replicate_group is not None:
        ranks |= set(skdist.group_ranks(unit.replicate_group))
    return ranks


def _copied_like(unit, model) -> bool:
    """Whether ``unit``'s parameters are held by the very ranks that hold ``model`` (so they
    have the same values on all of them, as the model's own): as many ranks
    (:func:`_ranks_holding_a_copy`), and, unless that is every rank, none this rank can name
    outside the model's. A unit over as many ranks but other ones (model over ``[0, 1]``,
    unit over ``[0, 2]``) holds other values on the model's other ranks. Where the model's
    ranks cannot all be named here (hybrid over part of the world), the unit is taken for
    one of its own unless its groups are the model's. Local: alike on every rank of a grid."""
    span = _ranks_holding_a_copy(model)
    if _ranks_holding_a_copy(unit) != span:
        return False
    if span == skdist.get_world_size():
        return True
    return _ranks_known_to_hold_a_copy(unit) <= _ranks_known_to_hold_a_copy(model)


def _refuse_experts_on_one_rank(model, call: str) -> None:
    """A ValueError, on every rank alike and before any collective, where a full optimizer
    state dict kept or given on the first rank alone (``rank0_only``, scatter) would stand for
    every rank while parameters sharded over other groups (experts) hold different state on
    other ranks under the same names: their state would be dropped (saving) or rank 0's
    loaded everywhere (loading). Local."""
    foreign = model._params_holding_rank_own_values()
    if foreign:
        raise ValueError(f"FSDP.{call}: the parameters {foreign[:3]} are sharded over other "
                         f"ranks than the model's group (experts: each group holds its own "
                         f"values under the same name), so one rank's full optimizer state "
                         f"dict cannot stand for every rank; give every rank its own full dict "
                         f"(FullOptimStateDictConfig(rank0_only=False), one file per rank) or "
                         f"use LOCAL_STATE_DICT")


def _agree_over_group_and_replicas(model, call: str, problem) -> None:
    """``problem`` (what this rank found wrong with its arguments, or ``None``) raised here,
    and a ValueError naming the ranks that had one on every other rank of the model's group
    and of its replicas, before anything is sent. Agreed over the replicas, then over the
    group, a rank told of a problem in the first carrying it into the second, so that every
    rank of the grid raises. One all-gather of one integer a rank over each (control
    messages, not counted)."""
    groups = ([model.replicate_group] if model.replicate_group is not None else []) + \
        [model.process_group]
    for group in groups:
        try:
            skdist._agree_on_call(f"FSDP.{call}", problem, [], group, model._comm_device(),
                                  outcome="nothing was sent")
        except (TypeError, ValueError) as error:
            problem = error
    if problem is not None:
        raise problem


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


def _in_optimizer_order(model, optim: Optional[torch.optim.Optimizer], ided: dict) -> dict:
    """``ided`` (:func:`_keyed_by_ids` of a dict keyed by names) renumbered so that each param
    group lists its parameters in ``optim``'s order for that group, as ``optim.load_state_dict``
    matches them by position: a dict keyed by names may list a group's names in any order
    (torch's ``rekey_optim_state_dict`` sorts them), and torch FSDP1 matches them by name.
    Unchanged without ``optim`` or ``"param_names"``, or where a group's names are not
    exactly those of the optimizer's group (then the usual checks judge it). Local."""
    names = ided.get("param_names") if isinstance(ided, dict) else None
    if optim is None or names is None or len(ided["param_groups"]) != len(optim.param_groups):
        return ided
    known = _state_dict_keys(model)
    every = [known.get(id(p)) for own in optim.param_groups for p in own["params"]]
    same_names = None not in every and sorted(map(str, names)) == sorted(every)
    renumbered, start = {}, 0
    for index, (group, own) in enumerate(zip(ided["param_groups"], optim.param_groups)):
        mine = [known.get(id(p)) for p in own["params"]]
        theirs = [names[i] for i in group["params"]]
        if None in mine or len(set(mine)) != len(mine) or sorted(map(str, theirs)) != \
                sorted(mine):
            if same_names and len(set(every)) == len(every):  # same parameters, other groups
                raise ValueError(f"the dict's param group {index} lists "
                                 f"{sorted(map(str, theirs))[:5]}, the optimizer's "
                                 f"{sorted(mine)[:5]}: its parameters are in other param "
                                 f"groups than when it was saved; build the optimizer's param "
                                 f"groups as then")
            return ided
        position = {n: start + j for j, n in enumerate(mine)}
        renumbered.update((i, position[names[i]]) for i in group["params"])
        start += len(mine)
    if all(i == j for i, j in renumbered.items()):
        return ided
    ordered = list(names)
    for i, j in renumbered.items():
        ordered[j] = names[i]
    return dict(ided, state={renumbered[i]: v for i, v in ided["state"].items()},
                param_groups=[dict(g, params=sorted(renumbered[i] for i in g["params"]))
                              for g in ided["param_groups"]],
                param_names=ordered)


def _keyed_by_names(full: dict) -> dict:
    """An id-keyed full optimizer state dict with ``"param_names"`` as torch FSDP1's
    ``optim_state_dict`` keys it: state and param groups by parameter name."""
    names = full["param_names"]
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in full["param_groups"]]
    return {"state": {names[i]: entry for i, entry in full["state"].items()},
            "param_groups": groups}


def _keyed_by_ids(osd: dict, caller: str = "optim_state_dict_to_load") -> dict:
    """The inverse of :func:`_keyed_by_names` (a dict keyed by ids passes unchanged)."""
    if not isinstance(osd, dict) or "param_groups" not in osd or "state" not in osd:
        raise ValueError(f"FSDP.{caller}(...): expected a full optimizer state dict (a dict "
                         f"with 'state' and 'param_groups': from gather_full_optim_state_dict, "
                         f"FSDP.optim_state_dict or a torch optimizer), e.g. loaded from the "
                         f"saved checkpoint")
    flat = [n for g in osd["param_groups"] for n in g["params"]]
    if not all(isinstance(n, str) for n in flat):
        named = [n for n in flat if isinstance(n, str)]
        if named:
            others = [n for n in flat if not isinstance(n, str)]
            raise ValueError(f"FSDP.{caller}(...): the dict's param groups mix parameter "
                             f"names and other keys ({others[:3]} beside {named[:3]}); expected "
                             f"all names (FSDP.optim_state_dict) or all ids (optim.state_dict())")
        return osd
    index = {n: i for i, n in enumerate(flat)}
    unlisted = sorted(str(n) for n in osd["state"] if n not in index)
    if unlisted:
        raise ValueError(f"FSDP.{caller}(...): the state of {unlisted[:5]} is in no param "
                         f"group of the dict (its param groups list {flat[:5]}...); pass the "
                         f"dict FSDP.optim_state_dict returned, unchanged")
    groups, start = [], 0
    for g in osd["param_groups"]:
        groups.append(dict(g, params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    return {"state": {index[n]: entry for n, entry in osd["state"].items()},
            "param_groups": groups, "param_names": [state_dict_key(n) for n in flat]}


def _as_shards(shard: torch.Tensor, layout: ParamLayout, unit, offload: bool):
    """One parameter's (or its optimizer state's) padded block as
    :meth:`~FSDPStateDictMixin.sharded_state_dict` gives it: a ``Shard(0)`` DTensor of this
    rank's real rows; a 0-dim one (only the group's first rank holds it) as a plain tensor,
    broadcast over the unit's group (all ranks must call it then)."""
    if len(layout.shape):
        return rows_as_dtensor(shard.cpu() if offload else shard, layout, unit.rank,
                               unit.process_group)
    value = shard.reshape(()).clone()
    skdist.broadcast(value, src=skdist.get_global_rank(unit.process_group, 0),
                     group=unit.process_group)
    return value.cpu() if offload else value


def _reported(name: str) -> str:
    """A key as torch FSDP1 reports it in load errors: without the unit's wrapper prefix nor
    torch's ``checkpoint_wrapper`` one (whose hooks drop it from state dicts)."""
    return state_dict_key(name)


def _detached(value):
    """A state-dict value as ``keep_vars=False`` gives it (extra state stays as it is)."""
    return value.detach() if torch.is_tensor(value) else value


def _load_problems(missing: list, unexpected: list, errors: list, strict: bool) -> list:
    """torch's load error lines (missing/unexpected keys with ``strict``, then the others)
    under the names :meth:`FSDPStateDictMixin.state_dict` gives."""
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
