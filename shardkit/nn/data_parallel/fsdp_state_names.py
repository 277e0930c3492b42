"""How FSDP's state-dict keys are named: a parameter's or buffer's key without FSDP's wrapper
level (``_fsdp_wrapped_module.``) nor torch's ``checkpoint_wrapper`` one, the structural walk
(``nn.Module.state_dict`` under the module paths) and the hooks that rename keys between the
two, and :func:`show_original_names` for a model whose submodules became units. Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`; all local (no communication).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict

import torch
import torch.nn as nn


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
        return super().get_parameter(wrapped_name(target, super().named_parameters))

    def get_buffer(self, target: str) -> torch.Tensor:
        """Also for a buffer of a unit's own module (``blocks.0.mask``): ``nn.Module``'s
        lookup would stop at the unit, whose ``_buffers`` do not hold it."""
        return super().get_buffer(wrapped_name(target, super().named_buffers))


def wrapped_name(target: str, named) -> str:
    """The module path of ``target`` (a name without FSDP's levels, as FSDP's and
    :func:`show_original_names`' ``named_parameters`` / ``named_buffers`` give it) with those
    levels, found in ``named`` (``nn.Module``'s own ``named_parameters`` / ``named_buffers``
    of the model); ``target`` itself when it has them or names nothing. Local."""
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
    round, and the name in
    :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.local_metadata_dict`. Local."""
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


def _reported(name: str) -> str:
    """A key as torch FSDP1 reports it in load errors: without the unit's wrapper prefix nor
    torch's ``checkpoint_wrapper`` one (whose hooks drop it from state dicts)."""
    return state_dict_key(name)


def _detached(value):
    """A state-dict value as ``keep_vars=False`` gives it (extra state stays as it is)."""
    return value.detach() if torch.is_tensor(value) else value
