"""FullyShardedDataParallel's state dicts: full (original keys, unpadded), local (this rank's
padded rows, FairScale's ``local_state_dict``) and the optimizer state unsharded or cut back to
this rank's rows. A mixin of :class:`~shardkit.nn.data_parallel.FullyShardedDataParallel`; the
formats and the resharding are in :mod:`shardkit.checkpoint`.

This module holds the model state dicts (full, sharded, local; saved and loaded, also when a
plain parent module reaches a unit). The rest is split by concept: key names
(:mod:`.fsdp_state_names`), the load walk (:mod:`.fsdp_state_load_walk`), the units behind the
shards (:mod:`.fsdp_state_units`) and the optimizer state dicts (:mod:`.fsdp_optim_state_dict`
and its ``fsdp_optim_state_*`` helpers); their public names are re-exported here.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import torch

from shardkit import distributed as skdist
from shardkit.checkpoint.dtensor_state import refuse_in_dcp
from shardkit.checkpoint.fsdp_state import (consolidate_shard_weights, local_metadata,
                                            reshard_local_state_dicts)
from shardkit.nn.data_parallel.fsdp_optim_state_dict import FSDPOptimStateDictMixin
from shardkit.nn.data_parallel.fsdp_optim_state_rank_local import (  # noqa: F401 - re-exported
    mark_rank_local_state, rank_local_shape, rank_local_state, shard_shapes)
from shardkit.nn.data_parallel.fsdp_state_dict_type import (DEFAULT_SETTINGS, StateDictType,
                                                            get_state_dict_type,
                                                            set_state_dict_type,
                                                            state_dict_type)
from shardkit.nn.data_parallel.fsdp_state_load_walk import (_apply_records, _finish_load,
                                                            _lines_of_every_rank, _load_problems,
                                                            _load_walk, _metadata_of_torch_load,
                                                            _SkipLoad)
from shardkit.nn.data_parallel.fsdp_state_names import (_WRAPPED_PREFIX, _clean_metadata,
                                                        _detached, _drop_wrapper_prefixes,
                                                        _parameters_by_key, _reported,
                                                        _structural_keys,
                                                        _structural_state_dict,
                                                        add_wrapper_prefix, clean_name,
                                                        show_original_names, state_dict_key)
from shardkit.nn.data_parallel.fsdp_state_units import _as_shards

__all__ = ["FSDPStateDictMixin", "add_wrapper_prefix", "clean_name", "show_original_names",
           "state_dict_key"]


class FSDPStateDictMixin(FSDPOptimStateDictMixin):
    """State-dict methods of FullyShardedDataParallel (needs its ``summon_full_params``,
    ``sharded_units``, ``world_size``, ``rank``, ``process_group``, ``replicate_group`` and
    ``_comm_device``). Costs are stated per method.

    The model state dicts are defined here; the optimizer state dicts come from
    :class:`~.fsdp_optim_state_dict.FSDPOptimStateDictMixin`, the lookups of units and shards both
    use from :class:`~.fsdp_state_units.FSDPStateUnitsMixin`."""

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

        **Subclasses.** An inner unit's ``state_dict`` override that calls
        ``super().state_dict()`` without arguments while the enclosing unit builds its dict (as
        fairseq's FSDP subclass does on every rank but 0, to take part in FairScale's
        collectives) gets this unit's own dict without communication: the enclosing unit
        gathers every unit itself, once.

        Memory: one unit gathered at a time, plus the dict where it is returned (the full model,
        on ``state_dict_device``). Communication: one all-gather per unit.
        """
        # nn.Module's recursion into this unit; or a call without arguments made while an
        # enclosing unit builds its dict (a subclass's override calling super().state_dict()
        # only for its collectives, as fairseq's does on ranks but 0): that unit gathers this
        # one itself, so a gather here would pair with another unit's on the other ranks
        if args or destination is not None or _structural_keys.depth:
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

    consolidate_shard_weights = staticmethod(consolidate_shard_weights)

    def load_local_state_dict(self, state_dict, metadata=None, strict: bool = True):
        """Load :meth:`local_state_dict` output. Pass this rank's own dict when the world size
        is unchanged, or the list of every rank's dicts with ``metadata=`` the list of their
        :meth:`local_metadata_dict` (any world size, any sharding strategy: replicas' copies of
        a shard are skipped) to reshard: each rank re-slices its rows. The modules' load
        pre-hooks and version conversions run as in the unwrapped model (see
        :meth:`load_state_dict`); keys and shard shapes are checked before
        anything is written on that rank (a mismatch loads nothing there). ``strict`` as
        FairScale's (also its second positional argument, a bool): with ``False`` missing and
        unexpected keys are returned instead of raised. Returns torch's missing/unexpected keys
        (original names), as FairScale does. No communication,
        as in FairScale and torch FSDP1: a rank may reload its own shards alone; a dict bad
        on one rank raises on that rank only."""
        if isinstance(metadata, bool):  # FairScale's load_local_state_dict(state_dict, strict)
            metadata, strict = None, metadata
        return self._load_local(state_dict, metadata, strict=bool(strict))

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
