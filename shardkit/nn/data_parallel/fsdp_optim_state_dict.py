"""FullyShardedDataParallel's optimizer state dicts: gathered to full tensors
(``gather_full_optim_state_dict``, torch FSDP1's ``full_optim_state_dict`` /
``optim_state_dict`` under ``FULL_STATE_DICT``), cut back to this rank's rows
(``get_shard_from_optim_state_dict``, ``shard_full_optim_state_dict``,
``scatter_full_optim_state_dict``, ``optim_state_dict_to_load``), rekeyed, and sharded for
torch.distributed.checkpoint; also for a plain module holding units (:class:`_PlainRoot`). A
mixin of :class:`~shardkit.nn.data_parallel.fsdp_state_dict.FSDPStateDictMixin`; the formats
are in :mod:`shardkit.checkpoint`. Split out of
:mod:`shardkit.nn.data_parallel.fsdp_state_dict`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.checkpoint.fsdp_state import (copied_part, gather_full_optimizer_state,
                                            shard_full_optimizer_state)
from shardkit.nn.data_parallel.fsdp_optim_state_agreement import (_agree_on_optim_load,
                                                                  _agree_over_group_and_replicas,
                                                                  _check_loadable_groups,
                                                                  _state_keys)
from shardkit.nn.data_parallel.fsdp_optim_state_checks import (_check_gatherable,
                                                               _check_optimizer_of,
                                                               _extra_entries,
                                                               _optimizer_names,
                                                               _refuse_experts_on_one_rank,
                                                               _refuse_other_shards,
                                                               _refuse_torch_only_arguments,
                                                               _torch_optimizer_in)
from shardkit.nn.data_parallel.fsdp_optim_state_from_first_rank import _from_first_rank
from shardkit.nn.data_parallel.fsdp_optim_state_keys import (_in_optimizer_order,
                                                             _keyed_by_ids, _keyed_by_names)
from shardkit.nn.data_parallel.fsdp_optim_state_rank_local import mark_rank_local_state
from shardkit.nn.data_parallel.fsdp_optim_state_sharded import (_refuse_state_never_received,
                                                                _sharded_optim_state,
                                                                _sharded_optim_state_to_load)
from shardkit.nn.data_parallel.fsdp_state_dict_type import StateDictType, state_dict_type
from shardkit.nn.data_parallel.fsdp_state_names import (_state_dict_keys, clean_name,
                                                        state_dict_key)
from shardkit.nn.data_parallel.fsdp_state_units import FSDPStateUnitsMixin, _copied_like


class FSDPOptimStateDictMixin(FSDPStateUnitsMixin):
    """Optimizer-state methods of FullyShardedDataParallel (needs its ``sharded_units``,
    ``world_size``, ``rank``, ``process_group``, ``replicate_group``, ``_comm_device`` and
    ``_state_dict_settings``). Costs are stated per method."""

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

        As FairScale's, ``optim`` may also be a training framework's wrapper that holds the
        torch optimizer as ``.optimizer`` (fairseq's ``FairseqOptimizer`` and fp16 optimizers):
        the wrapper's ``state_dict()`` is gathered, and its own top-level entries (fairseq's
        ``loss_scale``) are kept, as :meth:`get_shard_from_optim_state_dict` keeps them.
        """
        call = "gather_full_optim_state_dict"
        problem = None
        inner = _torch_optimizer_in(optim)
        try:  # checked here, so that a rank alone refusing its arguments leaves none waiting
            if not isinstance(recipient_rank, int) or not 0 <= recipient_rank < self.world_size:
                raise ValueError(f"{call}(recipient_rank={recipient_rank!r}): valid ranks are "
                                 f"0..{self.world_size - 1}")
            _check_gatherable(self, inner, call)
        except (TypeError, ValueError) as error:
            problem = error
        recipient = self._agreed_recipient(recipient_rank, problem, call)
        full = self._gathered_optim_state(inner, call, recipient, agreed=True, source=optim)
        if recipient is not None:  # the dict is there alone (None elsewhere)
            return full
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
        """The global rank of ``recipient_rank`` (a rank of this unit's group: each replica's
        own, or, where a nested unit's group spans the replicas, the first replica's,
        :meth:`_global_rank_in_first_replica`) where every rank of the group names it, else
        ``None`` (every rank is to gather). ``problem`` (what this rank found wrong
        with its arguments) is raised here, and every other rank of the group raises a
        ValueError naming the ranks that had one. One all-gather of two integers a rank over
        the group, and one over the replicas (control messages, not counted)."""
        spans = self._units_span_replicas()  # then decided alike over the replicas too
        try:
            named = skdist._agree_on_call(f"FSDP.{call}", problem, [recipient_rank],
                                          self.process_group, self._comm_device(),
                                          outcome="nothing was gathered")
        except (TypeError, ValueError):
            if spans:  # the other replicas learn of it in their agreement below
                self._global_rank_in_first_replica(0, failed=True)
            raise
        differs = len({rank for rank, in named}) > 1
        if spans:
            return self._global_rank_in_first_replica(recipient_rank, differs)
        return None if differs else skdist.get_global_rank(self.process_group, recipient_rank)

    def _units_span_replicas(self) -> bool:
        """Whether some nested unit's group holds ranks outside this unit's group (a
        FULL_SHARD unit under a NO_SHARD or hybrid root), so that gathering its rows needs
        the other replicas. Local."""
        own = set(skdist.group_ranks(self.process_group))
        return any(not set(skdist.group_ranks(u.process_group)) <= own
                   for u in self.sharded_units())

    def _global_rank_in_first_replica(self, group_rank: int, differs: bool = False,
                                      failed: bool = False) -> Optional[int]:
        """The global rank of rank ``group_rank`` of this unit's group in the first replica
        (hybrid sharding, NO_SHARD: the group of the replica group's rank 0), the same on every
        rank of the model: the one rank that receives a gathered optimizer state, over the
        root's group and over every nested unit's group (a FULL_SHARD unit under a NO_SHARD
        or hybrid root spans the replicas). Without replicas, the group's own. ``None`` on
        every rank when some replica's ranks named different recipients (``differs`` there):
        every rank then gathers. ``failed``: this rank's group refused its arguments (the caller
        raises that); the other replicas then raise a ValueError naming the ranks.
        Communication: with replicas, one control all-gather of three integers a rank over
        them."""
        own = skdist.get_global_rank(self.process_group, group_rank)
        if self.replicate_group is None:
            return None if differs else own
        rows = skdist.gather_control_rows("FSDP (the first replica's recipient)",
                                          [int(differs), own, int(failed)], self.replicate_group)
        refused = [skdist.group_ranks(self.replicate_group)[r]
                   for r, (*_, bad) in enumerate(rows) if bad]
        if refused and not failed:
            raise ValueError(f"FSDP: the ranks {refused} (other replicas) were given arguments "
                             f"that do not fit (their error says which); nothing was gathered")
        return None if any(flag for flag, *_ in rows) else rows[0][1]

    def _gathered_optim_state(self, optim: torch.optim.Optimizer, call: str,
                              recipient: Optional[int], agreed: bool = False,
                              source=None) -> Optional[dict]:
        """:meth:`gather_full_optim_state_dict`'s dict on the global rank ``recipient`` (on
        every rank with ``None``: one all-gather per state tensor), ``None`` elsewhere; each
        parameter's rows are gathered over its unit's group where that group holds
        ``recipient`` (a replica's own rows, the same as the first replica's, are not).
        Unless the caller's ranks ``agreed`` on them already, the checks end in an agreement
        over the group (:meth:`_agree_gatherable`). ``source``: the object whose
        ``state_dict()`` is gathered (a wrapper of ``optim``; default ``optim``), its own
        top-level entries kept."""
        if agreed:
            _check_gatherable(self, optim, call)
        else:
            self._agree_gatherable(optim, call)
        self._mark_units_in_their_own_world()
        ordered = [p for g in optim.param_groups for p in g["params"]]
        names = _state_dict_keys(self)
        gathered = self._param_layouts(gathered_state_only=True)
        saved = (optim if source is None else source).state_dict()
        full = gather_full_optimizer_state(saved, ordered, gathered,
                                           [names.get(id(p)) for p in ordered],
                                           self.process_group, self._comm_device(),
                                           param_groups=self._param_unit_attr("process_group"),
                                           recipient=recipient)
        if full is None:
            return None
        sharded = self._param_layouts()
        full["uncollected_local_ids"] = [i for i, p in enumerate(ordered)
                                         if id(p) in sharded and id(p) not in gathered]
        full.update(_extra_entries(saved))
        return full

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict) -> dict:
        """This rank's part of a full optimizer state dict (from
        :meth:`gather_full_optim_state_dict`, any world size, torch FSDP1's name-keyed
        ``FSDP.optim_state_dict``, or a single-process optimizer over the unwrapped model):
        every full-shape tensor is cut to this rank's rows; top-level entries of the dict's own
        (fairseq's ``loss_scale``) are kept, as in FairScale. Load the result with
        ``optim.load_state_dict``. No communication."""
        shard = self._shard_of_full(_keyed_by_ids(full_optim_state_dict,
                                                  "get_shard_from_optim_state_dict"))
        shard.update(_extra_entries(full_optim_state_dict))
        return shard

    def _shard_of_full(self, full: dict, take=copied_part) -> dict:
        """:meth:`get_shard_from_optim_state_dict` of an id-keyed dict, each value kept as
        ``take(value, cut)`` gives it (see
        :func:`~shardkit.checkpoint.fsdp_state.shard_optimizer_state`)."""
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
        the parameters in
        :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.sharded_state_dict` (for
        torch.distributed.checkpoint; on the loading side give a fresh optimizer its state first,
        e.g. with :func:`shardkit.checkpoint.dtensor_state.init_optimizer_state`, so that
        ``dcp.load`` has tensors to fill: a fresh optimizer's dict that reaches
        :meth:`optim_state_dict_to_load` still empty is refused there, not loaded as no state). Load
        any of them with :meth:`optim_state_dict_to_load`. All ranks must call it; costs as
        :meth:`full_optim_state_dict` (full: with ``rank0_only``, the full state on rank 0 alone) or
        nothing (local, sharded: views of the state, no full tensor)."""
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
            return FSDPOptimStateDictMixin.optim_state_dict(model, optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict: dict, model,
                                         optim: torch.optim.Optimizer) -> dict:
        """torch FSDP1's older name for :meth:`optim_state_dict_to_load` under
        ``SHARDED_STATE_DICT``, whatever the model's settings: the dict for
        ``optim.load_state_dict`` from :meth:`sharded_optim_state_dict`'s (e.g. filled by
        ``torch.distributed.checkpoint.load`` at any world size). A dict that does not fit
        raises the same ``ValueError`` on every rank, nothing loaded. Collective."""
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return FSDPOptimStateDictMixin.optim_state_dict_to_load(model, optim,
                                                                    sharded_optim_state_dict)

    def _rank0_only_optim_state(self, optim: torch.optim.Optimizer, call: str,
                                agreed: bool = False) -> dict:
        """``rank0_only``'s full optimizer state: on the model's first rank (rank 0 of its group
        in the first replica, the rank the loads take the dict from, as torch FSDP1's global
        rank 0), ``{}`` elsewhere. The other replicas (hybrid sharding, NO_SHARD), whose
        state is the same, gather nothing of the root's group; a nested unit whose group spans
        the replicas (FULL_SHARD under a NO_SHARD or hybrid root) gathers over it. Parameters
        over other groups (experts) are refused before (:func:`_refuse_experts_on_one_rank`).
        ``agreed``: the caller's ranks agreed on the optimizer already
        (:meth:`_agree_gatherable`)."""
        full = self._gathered_optim_state(optim, call, self._global_rank_in_first_replica(0),
                                          agreed=agreed)
        return {} if full is None else full

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
                "_agreed_recipient", "_global_rank_in_first_replica", "_units_span_replicas",
                "_agree_gatherable",
                "gather_full_optim_state_dict", "_shard_of_full",
                "get_shard_from_optim_state_dict", "_param_layouts", "_param_unit_attr",
                "_mark_units_in_their_own_world", "_sharded_params",
                "_shard_entries", "_params_holding_rank_own_values"):
    setattr(_PlainRoot, _method, getattr(FSDPOptimStateDictMixin, _method))


def _as_root(model, call: str):
    """``model`` itself when it is an FSDP unit, else a :class:`_PlainRoot` over the outermost
    units it holds, which must share their group and replicas, or at least copy their
    parameters to the same ranks (:func:`_copied_like`; a NO_SHARD unit beside FULL_SHARD
    ones: the model's group is then the widest unit's); a clear error otherwise (no unit,
    units over different groups), before any collective. Local."""
    if isinstance(model, FSDPOptimStateDictMixin):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"FSDP.{call}(model={type(model).__name__}): expected the "
                        f"FullyShardedDataParallel model, or a module holding its units")
    units = [m for m in model.modules() if isinstance(m, FSDPOptimStateDictMixin)]
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
