"""DeepSpeed's ``deepspeed.zero`` names for ``import shardkit as deepspeed`` scripts:
:class:`GatheredParameters` (full values of ZeRO-3 parameters inside a block) and
:class:`Init` (a context around model construction).

shardkit shards at :func:`shardkit.initialize` (stage 3: FSDP cuts each parameter into row
blocks in place), not while the model is built, so :class:`Init` builds the model whole: it is
accepted so scripts run, and says once what that costs (the full fp32 model, ``4Ψ`` bytes, on
every rank until ``initialize``). ``enabled=False`` is silent.

:class:`ZeroParamStatus` stands for ``deepspeed.runtime.zero.partition_parameters.
ZeroParamStatus``, and :func:`expose_ds_attributes` gives stage-3 parameters DeepSpeed's
``ds_id`` / ``ds_status`` / ``ds_shape`` / ``ds_numel``, which scripts test to pick the
parameters to gather (DeepSpeed-Chat's ``save_zero_three_model`` and ``moving_average``);
:func:`placeholder_state_dict` gives the stage-3 engine's model DeepSpeed's ``state_dict()``
(empty placeholders for the sharded parameters, no communication).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import distributed

logger = logging.getLogger("shardkit")

__all__ = ["GatheredParameters", "Init", "register_external_parameter",
           "unregister_external_parameter", "ZeroParamStatus", "expose_ds_attributes",
           "placeholder_state_dict"]


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``: whether a
    ZeRO-3 parameter holds its full value (``AVAILABLE``, inside :class:`GatheredParameters`)
    or only this rank's rows (``NOT_AVAILABLE``). ``INFLIGHT`` is never set here (FSDP's
    gathers finish before a parameter is seen)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_DS_IDS = itertools.count()


def expose_ds_attributes(module: torch.nn.Module) -> int:
    """Give each FSDP-sharded parameter of ``module`` DeepSpeed's ZeRO-3 attributes, which
    DeepSpeed scripts test to find sharded parameters (DeepSpeed-Chat's
    ``save_zero_three_model`` and ``moving_average`` gather exactly the parameters with
    ``ds_id`` whose ``ds_status`` is ``NOT_AVAILABLE``): ``ds_id`` (an int unique in the
    process), ``ds_shape`` / ``ds_numel`` (the full parameter's shape and element count) and
    ``ds_status`` (``ZeroParamStatus.NOT_AVAILABLE``; :class:`GatheredParameters` sets
    ``AVAILABLE`` inside its block). Parameters FSDP does not shard are left without them,
    as DeepSpeed's stages 0-2 leave them. Idempotent; returns how many parameters carry the
    attributes. Local: a walk of the parameters, no communication."""
    from shardkit.utils.tensor_fragment import _unit_of
    marked = 0
    for param in module.parameters():
        unit, index = _unit_of(param)
        if unit is None:
            continue
        if not hasattr(param, "ds_id"):
            layout = unit._shard.layouts[index]
            param.ds_id = next(_DS_IDS)
            param.ds_shape = tuple(layout.shape)
            param.ds_numel = layout.numel
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        marked += 1
    return marked


def placeholder_state_dict(module: torch.nn.Module, root=None) -> None:
    """Make ``module.state_dict()`` (the stage-3 engine's model) behave as under DeepSpeed's
    ZeRO-3: each parameter that holds only this rank's rows (``ds_status`` ``NOT_AVAILABLE``)
    is an empty placeholder (``torch.empty(0)``, its dtype), buffers and the parameters
    inside :class:`GatheredParameters` keep their values, and a warning says so once per
    process. DeepSpeed-Chat's ``save_hf_format`` calls it on rank 0 alone at every stage, then
    ``save_zero_three_model`` overwrites the weights file with the gathered values; without
    this the first call stopped rank 0 while the others waited in the second's gathers. Full
    values come from ``engine.module_state_dict()``, ``save_16bit_model`` or
    :class:`GatheredParameters`; ``root`` (the FSDP root around ``module``): the parameters of
    its units inside ``summon_full_params()`` keep their values. Local: no communication, and
    no memory beyond the dict. (The units inside ``module`` have ``root`` built around them, so
    ``module.state_dict()`` reaches them as inner units, which give their shards without a
    gather; only an outermost unit held by a plain module gathers, as in torch FSDP1.)"""
    module._zero3_placeholder_state_dict = True  # read by FSDP's refusal of row shards
    # the FSDP root around it: the parameters of its units inside summon_full_params() hold
    # their full values, which state_dict() then gives (as before the placeholders)
    module._zero3_fsdp_root = None if root is None else weakref.ref(root)
    module.register_state_dict_post_hook(_empty_placeholders)


def _summoned_parameters(module: torch.nn.Module) -> set:
    """``id`` of each parameter of ``module``'s FSDP units that are inside
    ``summon_full_params()`` now. Local."""
    ref = module.__dict__.get("_zero3_fsdp_root")
    root = ref() if ref is not None else None
    if not hasattr(root, "sharded_units"):
        return set()
    return {id(p) for unit in root.sharded_units()
            if unit._summoned and unit._shard is not None for p in unit._shard.params}


def _empty_placeholders(module, state_dict, prefix, local_metadata) -> None:
    if prefix:  # reached from a wrapper's own state dict (FSDP's local and full ones)
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    summoned = _summoned_parameters(module)
    emptied = 0
    for key in list(state_dict):
        param = params.get(key)
        if param is not None and getattr(param, "ds_status", None) is \
                ZeroParamStatus.NOT_AVAILABLE and id(param) not in summoned:
            state_dict[key] = torch.empty(0, dtype=param.dtype, device=param.device)
            emptied += 1
    global _PLACEHOLDERS_NOTED
    if emptied and not _PLACEHOLDERS_NOTED:
        _PLACEHOLDERS_NOTED = True
        logger.warning(
            "state_dict() of a ZeRO stage-3 model: %d sharded parameters are empty "
            "placeholders, as in DeepSpeed; for their values use engine.module_state_dict(), "
            "engine.save_16bit_model() or deepspeed.zero.GatheredParameters", emptied)


_PLACEHOLDERS_NOTED = False

_INIT_NOTED = False


class Init:
    """DeepSpeed's ``deepspeed.zero.Init(module=None, data_parallel_group=None, ...,
    config_dict_or_path=None, enabled=True, dtype=None, ...)``: every argument is accepted
    (DeepSpeed's keywords) and none changes what is built.

    The model is built unpartitioned: each rank holds all ``Ψ`` parameters (``4Ψ`` bytes in
    fp32) from construction until ``shardkit.initialize`` at stage 3 shards them (one
    broadcast of the model from rank 0, ``sync_module_states``). A model that does not fit
    whole in one rank's memory therefore cannot be built this way; build it on the ``meta``
    device instead (``with torch.device("meta"): model = Model()``) and pass it to
    ``shardkit.initialize`` at stage 3 (or to ``FullyShardedDataParallel`` / ``auto_wrap``):
    each FSDP unit materializes its own modules as it is wrapped (each module's
    ``reset_parameters()``, or FSDP's ``param_init_fn``) and takes rank 0's values, so a rank
    holds one unit's full parameters beside the shards already made; stages 0-2 refuse a meta
    model (they keep it whole). Initial values then differ from an eagerly built model's
    under the same seed (see ``param_init_fn``). Logged once per process (info level, the
    ``shardkit`` logger) when enabled. Usable as a context or a decorator. No
    communication."""

    def __init__(self, module: Optional[torch.nn.Module] = None, *args, enabled: bool = True,
                 **kwargs: Any):
        if not isinstance(enabled, bool):
            raise ValueError(f"zero.Init(enabled={enabled!r}): expected True or False")
        if module is not None and not isinstance(module, torch.nn.Module):
            raise ValueError(f"zero.Init(module={module!r}): expected an nn.Module or None")
        self.enabled = enabled
        self.module = module
        if enabled and module is not None:
            self._note()

    def __enter__(self) -> "Init":
        if self.enabled:
            self._note()
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __call__(self, fn):
        def run(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return run

    @staticmethod
    def _note() -> None:
        global _INIT_NOTED
        if _INIT_NOTED:
            return
        _INIT_NOTED = True
        logger.info("shardkit.zero.Init: the model is built unpartitioned (all parameters on "
                    "every rank, 4 bytes each in fp32); shardkit.initialize shards it at ZeRO "
                    "stage 3. DeepSpeed partitions during construction instead; for a "
                    "model too large for one rank, build it on the meta device and pass it "
                    "to shardkit.initialize at stage 3 (materialized unit by unit)")


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's hint that ``module``'s forward uses ``parameter`` of another module,
    recorded on ``module``. At stage 3 an FSDP unit gathers its own parameters for its own
    forward: where ``module`` and the module holding ``parameter`` end up in different units,
    the root's first forward raises a RuntimeError naming both (that use would read this
    rank's rows), rather than computing wrong values; inside one unit (or below stage 3)
    nothing more is needed. Local."""
    from shardkit.nn.data_parallel.fsdp_after_wrap_checks import EXTERNAL_PARAMETERS
    if not isinstance(parameter, torch.Tensor):
        raise TypeError(f"register_external_parameter(parameter={type(parameter).__name__}): "
                        f"expected a parameter (a tensor) of another module")
    registered = module.__dict__.setdefault(EXTERNAL_PARAMETERS, [])
    if not any(p is parameter for p in registered):
        registered.append(parameter)


def unregister_external_parameter(module: torch.nn.Module,
                                  parameter: torch.nn.Parameter) -> None:
    """Undo :func:`register_external_parameter` for ``parameter`` (nothing when it was not
    registered). Local."""
    from shardkit.nn.data_parallel.fsdp_after_wrap_checks import EXTERNAL_PARAMETERS
    registered = module.__dict__.get(EXTERNAL_PARAMETERS, [])
    registered[:] = [p for p in registered if p is not parameter]


class GatheredParameters:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters(params, modifier_rank=None,
    fwd_module=None, enabled=True)``: inside the block, ZeRO-3-sharded parameters among
    ``params`` (one parameter or an iterable) hold their full fp32 values.

    ``modifier_rank=None``: on exit each rank keeps its own rows of the values ``params`` hold
    then (no communication), so an edit that every rank makes alike persists, as it does at
    stages 0-2 (DeepSpeed-Chat's ``moving_average`` into a stage-3 EMA model, whose edits
    DeepSpeed drops silently); an edit made on some ranks only leaves the model inconsistent,
    as at stages 0-2: use ``modifier_rank`` for those.
    ``modifier_rank=r`` (a rank of the parameters' data-parallel group): on exit the values of
    ``params`` on rank ``r`` are broadcast and each rank keeps its rows of them, so ``r``'s
    edits reach every rank and the others' are dropped. Edits to other parameters of the same
    FSDP unit, and every edit when the block raises, are dropped.

    Parameters that are not sharded (stages 0-2, tensors of no engine, a frozen model outside
    FSDP) are left alone, as DeepSpeed leaves them: at stages 0-2 the block does nothing, and
    an edit must then be made on every rank. ``enabled=False`` does nothing. ``fwd_module`` is
    accepted (DeepSpeed registers external parameters with it; FSDP needs no such hint).
    A forward run inside the block under fp16 / bf16 at stage 3 needs every parameter of the
    model passed (``engine.module.parameters()``, as for generation): units summoned in fp32
    would meet units gathered in the 16-bit dtype (a RuntimeError says so).

    Inside a unit's forward (a module's ``forward`` or a forward hook) ``module.weight`` reads
    as a view of the unit's gathered copy; passing it counts as passing the parameter, and
    ``module.weight`` is the parameter again inside the block. Its edits reach the shards on
    exit, but the forward under way keeps computing with the values it gathered (DeepSpeed's
    computes with the edit); the next forward sees it.

    Blocks nest: an inner block on parameters an outer one holds writes its edits back (with
    its own ``modifier_rank``) on exit and leaves them full, and ``ds_status`` ``AVAILABLE``,
    until the outer block closes; an inner block that raises puts back the values they held
    when it was entered (memory: a copy of them), so the outer block's exit does not keep its
    edits. The same object may be entered again inside its own block.

    Memory: the full fp32 value of each FSDP unit that holds one of ``params`` (a unit is
    gathered whole; :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.summon_full_params`
    with ``recurse=False``). Communication: one all-gather per such unit on entry, and with
    ``modifier_rank`` one broadcast of each sharded parameter on exit. Every rank of the group
    must enter it with the same parameters (as in DeepSpeed). Bad arguments raise on every
    rank before any collective.
    """

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None,
                 enabled: bool = True):
        if not isinstance(enabled, bool):
            raise ValueError(f"GatheredParameters(enabled={enabled!r}): expected True or False")
        if modifier_rank is not None and (isinstance(modifier_rank, bool)
                                          or not isinstance(modifier_rank, int)
                                          or modifier_rank < 0):
            raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank!r}): expected "
                             f"None or a rank of the data-parallel group (an int >= 0)")
        self.params = _as_param_list(params)
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self.enabled = enabled
        self._sharded: list = []
        # one (exit stack, values held before entering) per open entry of this object, the
        # innermost last: the same object may be entered again inside its own block
        self._open: list = []

    def __enter__(self):
        if not self.enabled:
            return self
        self._sharded = _sharded_locations(self.params)
        units = []
        for loc in self._sharded:
            if not any(u is loc.unit for u in units):
                units.append(loc.unit)
        if self.modifier_rank is not None:
            _check_modifier(self.modifier_rank, units)
        held_before = _values_held_by_outer_blocks(self._sharded)
        stack = contextlib.ExitStack()
        try:
            for unit in units:
                # edits are written back here, for the given parameters only (__exit__)
                stack.enter_context(unit.summon_full_params(recurse=False, writeback=False))
        except BaseException:
            stack.close()
            raise
        self._open.append((stack, held_before))
        _mark_gathered(self._sharded)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._open:
            return False
        stack, held_before = self._open.pop()
        _mark_released(self._sharded)
        with stack:  # leaving it re-points every parameter at its (updated) rows
            if exc_type is not None:
                _restore_values(held_before)
            else:
                from shardkit.utils.tensor_fragment import write_rows
                for loc in self._sharded:
                    shard = loc.shard
                    full = loc.param.data
                    if self.modifier_rank is not None:
                        src = distributed.get_global_rank(shard.group, self.modifier_rank)
                        distributed.broadcast(full, src=src, group=shard.group)
                    write_rows(loc, shard.shard_views(shard.flat_shard)[loc.index], full)
        return False


def _values_held_by_outer_blocks(locations: list) -> list:
    """``(parameter, copy of its full value)`` for each located parameter that already holds
    its full value when a block is entered (its unit summoned by an outer block or
    ``summon_full_params``): the outer block writes that value back on its exit, so a block
    that raises must put it back to drop its own edits. Local; memory: a copy of those."""
    held = []
    for loc in locations:
        rows = loc.shard.shard_views(loc.shard.flat_shard)[loc.index]
        if loc.unit._summoned and loc.param.data.data_ptr() != rows.data_ptr():
            held.append((loc.param, loc.param.data.clone()))
    return held


def _restore_values(held: list) -> None:
    with torch.no_grad():
        for param, value in held:
            param.data.copy_(value)


# how many open GatheredParameters blocks list each parameter: an inner block on the same
# parameter leaves it full (its unit stays summoned by the outer one), so it must stay AVAILABLE
_OPEN_BLOCKS = WeakIdKeyDictionary()


def _mark_gathered(locations: list) -> None:
    """One more open block holds each located parameter: ``ds_status`` ``AVAILABLE``."""
    for loc in locations:
        _OPEN_BLOCKS[loc.param] = _OPEN_BLOCKS.get(loc.param, 0) + 1
        if hasattr(loc.param, "ds_status"):
            loc.param.ds_status = ZeroParamStatus.AVAILABLE


def _mark_released(locations: list) -> None:
    """One block fewer holds each located parameter; ``ds_status`` goes back to
    ``NOT_AVAILABLE`` when the outermost one closes."""
    for loc in locations:
        left = _OPEN_BLOCKS.get(loc.param, 1) - 1
        if left > 0:
            _OPEN_BLOCKS[loc.param] = left
            continue
        _OPEN_BLOCKS.pop(loc.param, None)
        if hasattr(loc.param, "ds_status"):
            loc.param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _as_param_list(params) -> list:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    if isinstance(params, dict):
        raise ValueError("GatheredParameters(params=...): expected a parameter or an iterable "
                         "of parameters (e.g. module.parameters()), got a dict")
    try:
        items = list(params)
    except TypeError:
        raise ValueError(f"GatheredParameters(params=...): expected a parameter or an iterable "
                         f"of parameters, got {type(params).__name__}") from None
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise ValueError(f"GatheredParameters(params=...): expected parameters, got an "
                             f"item of type {type(item).__name__}")
    return items


def _sharded_locations(params: Iterable) -> list:
    """The :class:`~shardkit.utils.tensor_fragment.ParamLocation` of each FSDP-sharded
    parameter among ``params`` (others skipped), each parameter once. Local."""
    from shardkit.utils.tensor_fragment import locate_parameter
    found, seen = [], set()
    for p in params:
        if not isinstance(p, torch.nn.Parameter):
            p = _parameter_shown_as(p)
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        try:
            loc = locate_parameter(p, "GatheredParameters")
        except ValueError:
            continue  # not a parameter shardkit shards: left alone, as in DeepSpeed
        if loc.unit is not None:
            found.append(loc)
    return found


def _parameter_shown_as(tensor: torch.Tensor) -> Optional[torch.nn.Parameter]:
    """The sharded parameter that ``tensor`` stands for inside its FSDP unit's forward, else
    ``None``. While a unit runs its forward, ``module.weight`` reads as a view of the unit's
    gathered compute copy, not as the parameter, so a DeepSpeed script that passes
    ``self.weight`` to :class:`GatheredParameters` from a forward or a forward hook passes that
    view; its edits must reach the parameter's shard as they would outside the forward. Local:
    a walk over the live units' parameters, only for tensors that are not parameters."""
    from shardkit.nn.data_parallel.fsdp_unit_modules import _UNIT_OF
    units = {id(u): u for u in (entry[1]() for entry in list(_UNIT_OF.values()))
             if u is not None}
    for unit in units.values():
        shard = unit._shard
        if shard is None or not shard._exposed:
            continue
        for param, places in zip(shard.params, shard.locations):
            if any(module.__dict__.get(name) is tensor for module, name in places):
                return param
    return None


def _check_modifier(rank: int, units: list) -> None:
    for unit in units:
        shard = unit._shard
        size = distributed.get_world_size(shard.group)
        if rank >= size:
            raise ValueError(f"GatheredParameters(modifier_rank={rank}): the parameters' "
                             f"data-parallel group has {size} ranks (0-{size - 1})")
        if shard.replicate_group is not None:
            raise ValueError(f"GatheredParameters(modifier_rank={rank}): not supported for "
                             f"hybrid-sharded units (the replicas would need a second "
                             f"broadcast); edit inside FullyShardedDataParallel."
                             f"summon_full_params on every rank instead")
