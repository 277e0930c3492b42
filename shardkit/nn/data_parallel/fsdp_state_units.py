"""Which units shard which parameters, as the state-dict paths of
:class:`~shardkit.nn.data_parallel.FullyShardedDataParallel` see them: the layouts and shard
views of the sharded parameters, the ranks that hold a copy of a unit's parameters (to tell
experts, whose values differ between ranks, from replicated parameters), and a shard as the
DTensor a sharded state dict holds. Shared by the model and the optimizer state dicts (and by
the plain-module root of :mod:`.fsdp_optim_state_dict`). Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`.
"""

from __future__ import annotations

import torch

from shardkit import distributed as skdist
from shardkit.checkpoint.dtensor_state import rows_as_dtensor
from shardkit.nn.data_parallel.flat_param import ParamLayout
from shardkit.nn.data_parallel.fsdp_state_names import state_dict_key


class FSDPStateUnitsMixin:
    """The units and shards behind FullyShardedDataParallel's state dicts (needs its
    ``sharded_units``, ``rank``, ``process_group`` and ``replicate_group``). No communication."""

    def _is_first_rank(self) -> bool:
        replica = 0 if self.replicate_group is None else skdist.get_rank(self.replicate_group)
        return self.rank == 0 and replica == 0

    def _param_layouts(self, gathered_state_only: bool = False) -> dict[int, ParamLayout]:
        """``id(param) -> layout`` of every sharded parameter (with ``gathered_state_only``,
        not of units built with ``no_broadcast_optim_state``)."""
        return {id(p): lay for u in self.sharded_units() if u._shard is not None
                and not (gathered_state_only and u.no_broadcast_optim_state)
                for p, lay in zip(u._shard.params, u._shard.layouts)}

    def _param_unit_attr(self, attr: str) -> dict:
        """``id(param) -> getattr(unit, attr)`` for every sharded parameter, from the unit that
        shards it (units may shard over different groups, e.g. experts)."""
        return {id(p): getattr(u, attr) for u in self.sharded_units() for p in u.params}

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


def _as_shards(shard: torch.Tensor, layout: ParamLayout, unit, offload: bool):
    """One parameter's (or its optimizer state's) padded block as
    :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.sharded_state_dict` gives it: a
    ``Shard(0)`` DTensor of this rank's real rows; a 0-dim one (only the group's first rank holds
    it) as a plain tensor, broadcast over the unit's group (all ranks must call it then)."""
    if len(layout.shape):
        return rows_as_dtensor(shard.cpu() if offload else shard, layout, unit.rank,
                               unit.process_group)
    value = shard.reshape(()).clone()
    skdist.broadcast(value, src=skdist.get_global_rank(unit.process_group, 0),
                     group=unit.process_group)
    return value.cpu() if offload else value
