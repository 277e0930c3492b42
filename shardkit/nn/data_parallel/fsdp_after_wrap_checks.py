"""The refusals of changes made to a model after
:class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel` wrapped it: a
parameter registered (or tied) inside a unit after wrapping, a unit's parameter held by a
module outside every unit, ``.to()`` / ``to_empty()`` that would replace the shards, and a
wrapped module's own ``state_dict()`` returning row shards under the full names. Each raises
on every rank alike, before any collective. Local."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.flat_param import FlatParamShard, removed_after_wrapping
from shardkit.nn.data_parallel.fsdp_arguments import IgnoredStates
from shardkit.nn.data_parallel.fsdp_state_dict import clean_name
from shardkit.nn.data_parallel.fsdp_unit_modules import (_is_unit, _named_unit_modules,
                                                         unit_holding)
from shardkit.nn.data_parallel.training_state import TrainingState
from shardkit.utils.call_stack import frames_running

if TYPE_CHECKING:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel


def _plain_modules_running_around(root: FullyShardedDataParallel) -> list:
    """The modules whose forward is running around ``root``'s, outermost last, found on the
    Python call stack (``nn.Module._call_impl`` frames); the FSDP units among them and their
    contents excluded. Local; one walk over the stack."""
    found: list = []
    for frame in frames_running(getattr(nn.Module._call_impl, "__code__", None)):
        m = frame.f_locals.get("self")
        if isinstance(m, nn.Module) and not _is_unit(m) \
                and all(m is not f for f in found):
            found.append(m)
    return found


def _refuse_parameters_held_outside(root: FullyShardedDataParallel) -> None:
    """At a root's first forward: a ``RuntimeError`` when a module outside every unit, in the
    plain module whose forward calls the root, holds one of the units' parameters (a weight
    tied to a module outside the unit: ``parent.head.weight = parent.child.weight`` with only
    ``parent.child`` wrapped). That module would compute with this rank's row block (a shape
    error, or, for a parameter of one row, zero padding on every rank but 0, silently), and
    its gradient would never be reduced. Every rank has the same modules, so every rank raises,
    before any collective. Local; one walk over the outermost caller's modules."""
    callers = _plain_modules_running_around(root)
    if not callers:
        return
    sharded = {}
    for unit in root.sharded_units():
        if unit._shard is not None:
            for p, lay in zip(unit._shard.params, unit._shard.layouts):
                sharded[id(p)] = (unit, lay)
    inside = {id(m) for m in root.modules()}
    outer = callers[-1]
    for name, m in outer.named_modules():
        if id(m) in inside:
            continue
        for attr, p in m._parameters.items():
            if p is None or id(p) not in sharded:
                continue
            unit, lay = sharded[id(p)]
            where = f"{name}.{attr}" if name else attr
            raise RuntimeError(
                f"FullyShardedDataParallel: {type(outer).__name__}.{where} "
                f"({type(m).__name__}, outside every FSDP unit) is a parameter of shape "
                f"{tuple(lay.shape)} that the unit around {type(unit.module).__name__} shards: "
                f"outside the unit it holds this rank's rows {tuple(p.shape)} (wrong values, "
                f"and a gradient never reduced). A parameter tied between modules must stay "
                f"inside one unit: wrap the module holding every use of it "
                f"({type(outer).__name__}, or the lowest module holding both) with "
                f"FullyShardedDataParallel, without wrapping {type(unit.module).__name__} on its "
                f"own, or untie the parameter")


# where shardkit.zero.register_external_parameter records, on a module, the parameters of
# other modules its forward uses (DeepSpeed's hint)
EXTERNAL_PARAMETERS = "_shardkit_external_parameters"


def _refuse_external_parameters_of_other_units(root: FullyShardedDataParallel) -> None:
    """At a root's first forward: a ``RuntimeError`` when a module's forward is registered
    (``shardkit.zero.register_external_parameter``, before that forward) to use a parameter
    that another unit shards, one that does not enclose the module's (an enclosing unit's
    parameters stay gathered through the forwards of the units inside it). A unit gathers its
    own parameters for its forward only, so that module would
    compute with this rank's row block (zero padding on every rank but 0 for a one-row
    parameter, silently) and the gradient would miss its reduction. Every rank has the same
    modules, so every rank raises, before any collective. Local; one walk over the units'
    modules."""
    for unit in root.sharded_units():
        for name, module in _named_unit_modules(unit.module, IgnoredStates()):
            for param in getattr(module, EXTERNAL_PARAMETERS, ()):
                owner = unit_holding(param)
                if owner is None or any(m is unit for m in owner.modules()):
                    continue  # its own, or an enclosing unit's: gathered for this forward
                where = ".".join(filter(None, [_unit_name(root, unit), clean_name(name)]))
                held = ".".join(filter(None, [_unit_name(root, owner),
                                              _parameter_name(owner, param)]))
                raise RuntimeError(
                    f"FullyShardedDataParallel: {where or '(the root)'} "
                    f"({type(module).__name__}) was registered to use {held}, a parameter "
                    f"of the unit around {type(owner.module).__name__} "
                    f"(register_external_parameter); a unit "
                    f"gathers its parameters for its own forward only, so this module would "
                    f"compute with this rank's rows of it (wrong values, and a gradient never "
                    f"reduced). Put both modules in one unit: wrap the lowest module holding "
                    f"both, without wrapping either on its own (a wrap policy or "
                    f"_no_split_modules naming their parent)")


def _parameter_name(unit, param: torch.Tensor) -> str:
    """``param``'s name inside ``unit``'s module (module path and attribute). Local."""
    for name, module in _named_unit_modules(unit.module, IgnoredStates()):
        for attr, p in module._parameters.items():
            if p is param:
                return clean_name(f"{name}.{attr}" if name else attr)
    return "a parameter"


def _unit_name(root: FullyShardedDataParallel, unit) -> str:
    """``unit``'s module path in ``root`` without FSDP's levels. Local."""
    return next((clean_name(n) for n, m in root.named_modules() if m is unit), "")


def _parameter_registered_after_wrapping(unit: FullyShardedDataParallel) -> Optional[tuple]:
    """``(name, module, attribute)`` of the first parameter held by ``unit`` itself or by a
    module of ``unit`` (not inside an inner unit or an ignored module) where the unit did not
    record it when it was built (neither as its own nor as an ignored one), else ``None``.
    Local."""
    shard = unit._shard
    recorded = set() if shard is None else \
        {(id(m), attr) for places in shard.locations for m, attr in places}
    recorded.update((id(m), attr) for m, attr in unit._ignored_param_places)
    ignored = IgnoredStates(tuple(unit._ignored_modules), tuple(unit._ignored_params))
    # the unit itself first: a parameter set on the wrapper (``fsdp_model.scale = ...``)
    holders = [("", unit), *_named_unit_modules(unit.module, ignored)]
    for name, m in holders:
        for attr, p in m._parameters.items():
            if p is not None and (id(m), attr) not in recorded and not ignored.has_param(p):
                return name, m, attr
    return None


def _registered_after_wrapping(root: FullyShardedDataParallel, unit: FullyShardedDataParallel,
                               name: str, module: nn.Module, attr: str) -> str:
    """The error for a parameter :func:`_parameter_registered_after_wrapping` found."""
    p = module._parameters[attr]
    owner = unit_holding(p)
    if owner is not None:  # a unit's parameter moved (prune's weight_orig) or tied anew
        index = next(i for i, q in enumerate(owner._shard.params) if q is p)
        for holder, key in owner._shard.locations[index]:
            if holder._parameters.get(key) is not p:
                return removed_after_wrapping(holder, key, owner._shard.layouts[index])
    where = ".".join(part for part in (_unit_name(root, unit), name, attr) if part)
    if owner is not None:
        return (f"FullyShardedDataParallel: {where} ({type(module).__name__}.{attr}) was set "
                f"after wrapping to a parameter that an FSDP unit shards (this rank's rows, "
                f"shape {tuple(p.shape)}): it would compute with those rows and its gradient "
                f"there would never be reduced. Tie parameters before wrapping, inside the "
                f"module that one unit wraps")
    return (f"FullyShardedDataParallel: {where} ({type(module).__name__}.{attr}, shape "
            f"{tuple(p.shape)}) was registered after wrapping, inside the unit around "
            f"{type(unit.module).__name__}, which shards only the parameters it found when it "
            f"was built: this one would stay whole on every rank and train on this rank's "
            f"gradient alone, never reduced, so the ranks' copies would drift apart. Register "
            f"parameters before wrapping the model in FSDP (add adapters or heads, then wrap), "
            f"or pass the module holding it in ignored_modules and synchronise it yourself")


_TO_EMPTY_AFTER_WRAPPING = (
    "FullyShardedDataParallel: to_empty() after wrapping would replace the parameter shards "
    "with uninitialised memory. A unit materializes a module built on the meta device when it "
    "is wrapped: pass the meta module to FullyShardedDataParallel (or auto_wrap) as it is, "
    "and each unit gives its meta tensors storage on its compute device and calls each "
    "module's reset_parameters(), or param_init_fn=<callable(module)> for your own "
    "initialisation (torch FSDP's argument); then drop the to_empty() call (FSDP2's flow). "
    "To re-initialise a wrapped model, use model.apply(init_fn) (runs on the full "
    "parameters) or reset_parameters() with allow_reset_parameters=True")


def _refuse_changing_shards(shard: FlatParamShard, fn) -> None:
    """Raise unless ``fn`` (what ``nn.Module._apply`` applies to every tensor) keeps the
    shard's dtype and device; it is tried on an empty slice of the shard."""
    given = shard.flat_shard[:0]
    probe = fn(given)
    if not isinstance(probe, torch.Tensor) or probe is given:  # .to()/.float() that change nothing
        return
    before = (shard.flat_shard.dtype, shard.flat_shard.device)
    if (probe.dtype, probe.device) == before:
        # a new tensor of the same kind (to_empty's empty_like, a clone): it would replace
        # the shard with other memory, whatever the function is called
        raise RuntimeError(_TO_EMPTY_AFTER_WRAPPING)
    if before[1].type == "meta":  # not made by this class (it materializes when wrapping)
        raise RuntimeError(_TO_EMPTY_AFTER_WRAPPING.replace("to_empty()", f"moving to "
                                                            f"{probe.device}", 1))
    raise RuntimeError(
        f"FullyShardedDataParallel: .to() / .half() / .cuda() (nn.Module._apply) after wrapping "
        f"would turn the parameter shards from {before[0]} on {before[1]} into {probe.dtype} on "
        f"{probe.device}; a wrapped unit keeps the dtype and device its module had when wrapped "
        f"(shards, gathers, optimizer state). Cast or move the module before wrapping it; for "
        f"low-precision compute pass compute_dtype=torch.bfloat16 (or mixed_precision=...)")


def _refusing_shards_as_full_state(unit: "FullyShardedDataParallel"):
    """A ``state_dict`` pre-hook for the module ``unit`` wraps: called on that module itself
    (empty prefix; FSDP's own ``state_dict``/``local_state_dict`` reach it with a prefix) while
    its parameters are row shards, it raises instead of returning shards under the full names
    (Hugging Face's ``fsdp_model.save_pretrained(dir)`` would write a checkpoint of shards)."""
    unit_ref = weakref.ref(unit)

    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        fsdp = unit_ref()
        if prefix or fsdp is None or fsdp._summoned or fsdp._shard is None \
                or fsdp._shard.world_size == 1 or fsdp.training_state != TrainingState.IDLE \
                or getattr(module, "_zero3_placeholder_state_dict", False):  # the engine's
            return
        raise RuntimeError(
            f"{type(module).__name__}.state_dict(): its parameters are FullyShardedDataParallel "
            f"row shards here, not the model's weights. Call state_dict() on the FSDP wrapper "
            f"(full values under the model's names, on every rank), e.g. "
            f"model.save_pretrained(dir, state_dict=fsdp_model.state_dict())")
    return hook
