"""OSS: optimizer state sharding (ZeRO stage 1), FairScale's ``OSS`` with a one-line swap.

Each data-parallel rank owns whole parameters (a :class:`ParameterPartition` balanced by size),
keeps the optimizer state of those only, steps those only, and then every rank receives the
updated parameters bucket by bucket: the parameters live in flat buffers of equal per-rank
segments, re-synchronised by one in-place all-gather per bucket through the optimizer's
transport (:mod:`shardkit.transport`; the process group's own collectives by default),
overlapped with the stepping of the next bucket (see :mod:`shardkit.optim.param_sync`).
"""

from __future__ import annotations

import inspect
import warnings
from typing import Callable, Iterable, Optional, Union

import torch

from shardkit import distributed
from shardkit.optim.param_sync import (FlatParamBucket, OwnershipPlan, broadcast_wire_dtype,
                                       build_buckets, plan_ownership)
from shardkit.optim.partition import ParameterPartition
from shardkit.transport import resolve_transport

__all__ = ["OSS"]

# Optimizers whose step treats each parameter independently (state per parameter, nothing
# shared across the group). Only these are stepped bucket by bucket, so that the re-sync of
# one bucket overlaps the optimizer work of the next; any other optimizer steps in one call.
_PER_PARAMETER_OPTIMIZERS = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Adadelta,
})
# torch optimizers with a fused multi-tensor kernel on CPU and CUDA (same update as the default
# implementation, up to rounding in the last bit); OSS uses it when the caller left the choice
# of implementation (``fused`` and ``foreach``) to torch.
_FUSED_OPTIMIZERS = frozenset({torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                               torch.optim.Adagrad})
_IMPLEMENTATION_KEYS = ("fused", "foreach")
# FairScale OSS arguments that no longer do anything there either; accepted and ignored.
_DEPRECATED_FAIRSCALE_KWARGS = ("broadcast_buffer_size", "force_broadcast_object")


class OSS(torch.optim.Optimizer):
    """Wrap a torch optimizer so that each rank holds and steps only its share of the state.

    Two constructors, like FairScale's::

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)   # FairScale's form
        optimizer = OSS(torch.optim.AdamW(model.parameters(), lr=1e-3))         # one-line swap

    Use it beside ``DistributedDataParallel`` (every rank holds the full reduced gradients) or
    ``ShardedDataParallel`` (only owners hold them); the training loop does not change.

    Args:
        params: parameters or param-group dicts (per-group hyper-parameters are honoured), or an
            existing ``torch.optim.Optimizer`` whose type, defaults, param groups and state are
            taken over (then ``optim`` and ``defaults`` must not be given).
        optim: the ``torch.optim.Optimizer`` subclass run on the local shard (default SGD,
            as in FairScale).
        group: the data-parallel process group (default: the whole world).
        broadcast_fp16: send the updated parameters in fp16 (``True``) or in the dtype given
            (``torch.bfloat16``: fp32's range, a coarser mantissa); halves the sync, the other
            ranks' copies of a parameter are then rounded, the owner's stays exact.
        bucket_numel: target elements per rank in one sync bucket (default: a 16 MiB fp32
            bucket in all, see :func:`~shardkit.optim.param_sync.default_bucket_numel`).
        comm: the :class:`~shardkit.transport.Transport` that carries the parameter sync
            (default: the process group's own collectives; not in FairScale's signature).
        **defaults: the optimizer's hyper-parameters (``lr=...``).

    Attributes:
        optim: the local optimizer, over the parameters this rank owns only.
        partition: the :class:`ParameterPartition` of the trainable parameters (public and
            immutable: ``ShardedDataParallel`` reads it). ``param_to_rank`` is its dict view.
        group, rank, world_size, global_rank: the data-parallel group and this rank's place.

    Costs (Ψ trainable parameters, N ranks, K optimizer bytes per parameter): optimizer state
    ``KΨ/N`` per rank (plus at most one parameter's worth of imbalance); parameters and
    gradients stay full, the parameters living in the flat sync buffers (``Ψ`` plus ~1% of
    padding on real models; the caller's parameters become views of them, in this process's own
    memory). Communication per :meth:`step`: ``Ψ(N-1)/N`` elements (fp32, or fp16 / bf16 with
    ``broadcast_fp16``), one all-gather per bucket. :meth:`clip_grad_norm`: one all-reduce of
    one element. Construction: one small all-gather of the parameter shapes.

    Implementation: for ``SGD``, ``Adam``, ``AdamW`` and ``Adagrad`` given with ``fused`` and
    ``foreach`` unset, the local optimizer is built with ``fused=True`` (torch's own fused kernel,
    the same update up to the last bit; pass ``fused=False`` to keep the default loop).
    Each rank's parameters are its own: in-place writes, ``model.to(dtype)`` and
    ``p.data = ...`` behave as in plain PyTorch (OSS re-lays its buckets out from the current
    values at the next step).

    .. warning:: ``step``, ``clip_grad_norm``, ``consolidate_state_dict``, ``add_param_group``
       and ``refresh_trainable`` are collective: call them on every rank of ``group``.
    """

    def __init__(self, params, optim: type = torch.optim.SGD, group=None,
                 broadcast_fp16: Union[bool, torch.dtype] = False,
                 bucket_numel: Optional[int] = None, comm=None, **defaults):
        _drop_deprecated_fairscale_kwargs(defaults)
        existing = params if isinstance(params, torch.optim.Optimizer) else None
        if existing is not None:
            _check_takeover_arguments(existing, optim, defaults)
            optim, groups = type(existing), _groups_of(existing)
            ctor_kwargs = _constructor_kwargs(optim, existing.defaults)
        else:
            _check_optimizer_class(optim)
            groups = _normalize_param_groups(params)
            ctor_kwargs = dict(defaults)
        broadcast_wire_dtype(broadcast_fp16)  # a clear error for a bad value, before any op
        if bucket_numel is not None and (not isinstance(bucket_numel, int) or bucket_numel < 1):
            raise ValueError(f"OSS(bucket_numel={bucket_numel!r}): must be a positive int or None")
        self.comm = resolve_transport(comm, "OSS")
        distributed.require_initialized("OSS")
        self.group = group
        self.rank = distributed.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"OSS(group=...): global rank {distributed.get_rank()} is not a "
                             f"member of the given process group")
        self.world_size = distributed.get_world_size(group)
        self.global_rank = distributed.get_global_rank(group, self.rank)
        self.broadcast_fp16 = broadcast_fp16
        self.bucket_numel = bucket_numel
        self._optim_class, self._optim_kwargs = optim, ctor_kwargs
        self._implementation_asked = {k: ctor_kwargs.get(k) for k in _IMPLEMENTATION_KEYS
                                      if k in inspect.signature(optim.__init__).parameters}
        self._fused_here = False  # whether OSS chose torch's fused kernel for the local step
        self._ready = False
        self._consolidated: Optional[dict] = None
        self._parked_state: dict = {}  # state of frozen parameters last owned here
        _check_same_model_on_every_rank(groups, group)
        self.comm.prepare(group)

        self._plan = plan_ownership(_trainable(groups), self.world_size, bucket_numel)
        self.optim = self._make_local_optimizer(groups, self._plan.partition)
        # the public defaults say what the caller asked for, not the fused kernel OSS chose
        super().__init__(groups, {**self.optim.defaults, **self._implementation_asked})
        self._defer_sync = False  # see overlap_sync_with
        self._buckets = self._build_buckets(self._plan)
        self._ready = True
        if existing is not None:
            self.load_state_dict(existing.state_dict())

    # ------------------------------------------------------------------ public views

    @property
    def partition(self) -> ParameterPartition:
        """The current immutable ownership of the trainable parameters (replaced, never mutated,
        by :meth:`add_param_group` and :meth:`refresh_trainable`)."""
        return self._plan.partition

    @property
    def param_to_rank(self) -> dict:
        """``{parameter: owning rank}`` for every trainable parameter."""
        return self.partition.param_to_rank

    @property
    def num_buckets(self) -> int:
        """How many flat buckets one :meth:`step` re-syncs."""
        return sum(len(buckets) for buckets in self._buckets)

    @property
    def collectives_per_step(self) -> int:
        """Collectives one :meth:`step` issues to re-sync the parameters: one all-gather per
        bucket."""
        return self.num_buckets

    @property
    def sync_transport(self) -> str:
        """What carries the parameter sync, in words (e.g. ``"process group (gloo)"``)."""
        return self.comm.describe(self.group)

    @property
    def state(self):
        """The local shard's optimizer state (what this rank really holds)."""
        local = self.__dict__.get("optim")
        return local.state if local is not None else self.__dict__.get("_unused_state", {})

    @state.setter
    def state(self, value):  # torch's Optimizer.__init__ assigns an empty dict; OSS keeps none
        self.__dict__["_unused_state"] = value

    def partition_parameters(self) -> list[list[dict]]:
        """Per rank, its param groups (hyper-parameters and the parameters it owns), FairScale's
        layout. Costs nothing."""
        return [[{**_hyper(g), "params": owned} for g, owned in zip(self.param_groups,
                                                                   self._owned_per_group(r))]
                for r in range(self.world_size)]

    @property
    def per_device_params(self) -> dict:
        """``{device: [[params owned by rank r on that device] for r in ranks]}``."""
        out: dict = {}
        for p in self.partition.all_params():
            rows = out.setdefault(p.device, [[] for _ in range(self.world_size)])
            rows[self.partition.owner(p)].append(p)
        return out

    # ------------------------------------------------------------------ training

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, **kwargs):
        """Step the owned parameters that have a gradient, then re-sync every parameter from
        its owner. ``closure`` and the keyword arguments go to the local optimizer's ``step``,
        as in FairScale (so LBFGS works; an optimizer that calls the closure several times
        does so on every rank, which must then run the same number of forward passes).

        Communication: ``Ψ(N-1)/N`` elements in all, one all-gather per bucket.
        """
        self._check_trainable_covered()
        self.wait_for_sync()
        loss = None
        self._consolidated = None
        self._push_hyperparameters()
        self._rebind_moved_parameters()
        if closure is not None:
            loss = self.optim.step(closure=closure, **kwargs)
            self._sync_all_buckets()
        elif self._buckets and type(self.optim) in _PER_PARAMETER_OPTIMIZERS:
            self._step_and_sync_bucket_by_bucket(kwargs)
        else:
            loss = self.optim.step(**kwargs)
            self._sync_all_buckets()
        self._pull_hyperparameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of every group (owned or not)."""
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients so that their global norm is at most ``max_norm``; return the norm.

        Each rank measures the gradients of the parameters it owns, so the result is right both
        when every rank holds the full reduced gradients (DDP) and when only the owners do
        (ShardedDDP); one all-reduce of one element. Only the owned gradients (the ones the
        step reads) are scaled.
        """
        max_norm, norm_type = _check_norm_arguments(max_norm, norm_type)
        grads = [p.grad for p in self._owned_params() if p.grad is not None]
        device = grads[0].device if grads else self._default_device()
        if norm_type == float("inf"):
            local = (torch.stack([g.detach().abs().max().float() for g in grads]).max()
                     if grads else torch.zeros((), device=device))
            distributed.all_reduce(local, op=distributed.ReduceOp.MAX, group=self.group)
            total = local
        else:
            local = (torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type)
                                  ** norm_type for g in grads]).sum()
                     if grads else torch.zeros((), device=device))
            distributed.all_reduce(local, group=self.group)
            total = local ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    # ------------------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (hyper-parameters default to the optimizer's defaults) and
        re-partition. Collective once OSS is built; moved optimizer state follows its parameter.
        """
        if not self._ready:  # torch's Optimizer.__init__ adding the initial groups
            super().add_param_group(param_group)
            return
        new = _normalize_param_groups([param_group])[0]
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for i, p in enumerate(new["params"]):
            if id(p) in known:
                raise ValueError(f"OSS.add_param_group: parameter {i} (shape {tuple(p.shape)}) "
                                 f"is already in another param group; each parameter may be in "
                                 f"one group only")
        super().add_param_group(new)
        self._repartition()

    def refresh_trainable(self) -> None:
        """Re-partition after ``requires_grad`` changed on some parameters (every rank alike).
        Costs nothing when ownership does not change; else moved state is sent to its new owner."""
        self._repartition()

    # ------------------------------------------------------------------ state dicts

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the full optimizer state on ``recipient_rank`` (a rank of ``group``; ``-1``: on
        every rank), one shard at a time, on CPU; :meth:`state_dict` then returns it until the
        next :meth:`step` or :meth:`load_state_dict`.

        Communication: each rank's state once (``KΨ/N`` bytes per rank) plus small metadata.
        """
        self.wait_for_sync()
        if not isinstance(recipient_rank, int) or not -1 <= recipient_rank < self.world_size:
            raise ValueError(f"OSS.consolidate_state_dict(recipient_rank={recipient_rank!r}): "
                             f"must be a rank of the group in [0, {self.world_size}) or -1 "
                             f"(every rank)")
        self._consolidated = None
        index_of = self._global_index()
        local = {index_of[id(p)]: s for p, s in {**self._parked_state, **self.optim.state}.items()}
        state: dict = {}
        for r in range(self.world_size):
            shard = self._shard_from(r, local, recipient_rank)
            if shard is not None:
                state.update(shard)
        if recipient_rank in (-1, self.rank):
            self._consolidated = {
                "state": {i: state[i] for i in sorted(state)},
                "param_groups": [{**_hyper(g), "params": [index_of[id(p)] for p in g["params"]]}
                                 for g in self.param_groups],
            }

    def state_dict(self) -> dict:
        """The full optimizer state in torch's format (global parameter indices; loadable into
        a plain single-process optimizer of the same type), after :meth:`consolidate_state_dict`.
        """
        if self._consolidated is None:
            raise RuntimeError(
                f"OSS.state_dict() on rank {self.rank}: no consolidated state here. Call "
                f"optimizer.consolidate_state_dict(recipient_rank) on every rank first (after the "
                f"last step), then state_dict() on the recipient (or recipient_rank=-1 for all)")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full torch-format optimizer state dict, saved at any world size or by a plain
        torch optimizer; keep only the state of the parameters this rank owns. No communication.
        """
        saved_groups = _check_full_state_dict(state_dict, self.param_groups)
        self._consolidated = None
        id_to_param = {}
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(_hyper(saved))
            id_to_param.update(zip(saved["params"], group["params"]))
        owned = {id(p) for p in self._owned_params()}
        self._load_local_state({p: value for key, value in state_dict["state"].items()
                                if (p := id_to_param.get(key)) is not None and id(p) in owned})
        # state of parameters frozen here: parked on one rank, picked by index
        self._parked_state = {p: value for key, value in state_dict["state"].items()
                              if (p := id_to_param.get(key)) is not None
                              and p not in self.partition and key % self.world_size == self.rank}

    def _load_local_state(self, state: dict) -> None:
        """Give the local optimizer ``{owned param: state}`` through its own load_state_dict
        (which casts to each parameter's device and dtype, and lets flat-state optimizers
        rebuild their buffers)."""
        local_index = {id(p): i for i, p in
                       enumerate(p for g in self.optim.param_groups for p in g["params"])}
        local_groups = [{**self._local_hyper(g), "params": [local_index[id(p)]
                                                            for p in lg["params"]]}
                        for g, lg in zip(self.param_groups, self.optim.param_groups)]
        self.optim.load_state_dict({"state": {local_index[id(p)]: s for p, s in state.items()},
                                    "param_groups": local_groups})

    # ------------------------------------------------------------------ mechanism

    def _make_local_optimizer(self, groups: list[dict], partition: ParameterPartition):
        owned_ids = {id(p) for params in partition.params_of(self.rank) for p in params}
        local_groups = [{**_hyper(g), "params": [p for p in g["params"] if id(p) in owned_ids]}
                        for g in groups]
        kwargs = dict(self._optim_kwargs)
        self._fused_here = _can_fuse(self._optim_class, kwargs, local_groups)
        if self._fused_here:
            kwargs["fused"] = True
            local_groups = [{**self._local_hyper(g), "params": g["params"]} for g in local_groups]
        return self._optim_class(local_groups, **kwargs)

    def _local_hyper(self, group: dict) -> dict:
        """A public group's hyper-parameters as the local optimizer gets them (with the fused
        kernel OSS chose, where it chose one)."""
        hyper = _hyper(group)
        if self._fused_here:
            hyper.update(fused=True, foreach=None)
        return hyper

    def _owned_per_group(self, rank: int) -> list[list[torch.Tensor]]:
        return [[p for p in g["params"] if p in self.partition and self.partition.owner(p) == rank]
                for g in self.param_groups]

    def _owned_params(self) -> list[torch.Tensor]:
        return [p for params in self._owned_per_group(self.rank) for p in params]

    def _global_index(self) -> dict:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _default_device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    def _check_trainable_covered(self) -> None:
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p not in self.partition:
                    raise RuntimeError(
                        f"OSS.step: parameter {i} of param group {g} (shape {tuple(p.shape)}) "
                        f"became trainable after the partition was made; call "
                        f"optimizer.refresh_trainable() on every rank after changing "
                        f"requires_grad")

    def _push_hyperparameters(self) -> None:
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update(self._local_hyper(group))

    def _pull_hyperparameters(self) -> None:
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update({k: v for k, v in _hyper(local).items()
                          if not (self._fused_here and k in _IMPLEMENTATION_KEYS)})

    def _rebind_moved_parameters(self) -> None:
        # Something replaced a parameter's storage (model.to(...), p.data = ...): rebuild the
        # flat buffers from the current values, in their current dtype and device. Purely
        # local: every rank sees the same layout.
        if any(not b.is_bound() for buckets in self._buckets for b in buckets):
            self._buckets = self._build_buckets(self._plan)

    # ------------------------------------------------------------------ overlapped sync

    def overlap_sync_with(self, module: torch.nn.Module) -> None:
        """Let the parameter sync of each :meth:`step` run on while ``module``'s next forward
        starts: each submodule waits, in a forward pre-hook, only for the buckets that hold its
        own parameters, the way FSDP prefetches. ``module.state_dict()``,
        ``module.load_state_dict()`` and every OSS method that reads or writes parameters wait
        for the whole sync first; so does :meth:`wait_for_sync`, which code that reads
        parameters outside ``module``'s forward (a metric on ``p`` directly) must call.
        Costs nothing on the wire (the same all-gathers, later); the buckets' buffers are the
        parameters' own storage, so it holds no extra memory. Local, no collective.

        .. warning:: a module whose forward reads another module's parameters without calling
           that module must be covered by ``overlap_sync_with`` on a module that owns them
           directly, or read them after :meth:`wait_for_sync`.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"OSS.overlap_sync_with(module={module!r}): expected an nn.Module")
        known = {id(p) for p in self.partition.all_params()}
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if id(p) in known]
            if own:
                sub.register_forward_pre_hook(self._waiter_for(own))
        module.register_state_dict_pre_hook(lambda *args, **kwargs: self.wait_for_sync())
        module.register_load_state_dict_pre_hook(lambda *args, **kwargs: self.wait_for_sync())
        self._defer_sync = True

    def wait_for_sync(self) -> None:
        """Finish every bucket sync still in flight (a no-op unless :meth:`overlap_sync_with`
        is in use)."""
        pending, self._pending_sync = self.__dict__.get("_pending_sync", []), []
        for b in pending:
            b.finish_gather()

    def _waiter_for(self, params: list[torch.Tensor]):
        wanted = {id(p) for p in params}

        def wait_for_own_buckets(_module, _args):
            pending = self.__dict__.get("_pending_sync", [])
            if not pending:
                return
            keep = []
            for b in pending:
                if any(id(p) in wanted for p, _ in b.slots):
                    b.finish_gather()
                else:
                    keep.append(b)
            self._pending_sync = keep
        return wait_for_own_buckets

    def _sync_all_buckets(self) -> None:
        every = [b for buckets in self._buckets for b in buckets]
        for b in every:
            b.start_gather()
        for b in every:
            b.finish_gather()

    def _build_buckets(self, plan: OwnershipPlan) -> list:
        """The flat buckets of ``plan`` in this rank's own memory. Purely local."""
        return build_buckets(plan, self.rank, self.group, self.broadcast_fp16, self.comm)

    def _step_and_sync_bucket_by_bucket(self, step_kwargs: dict) -> None:
        # Note: stepping bucket k hides the other owned gradients (grad=None makes torch's
        # per-parameter optimizers skip a parameter), so the all-gather of bucket k runs while
        # bucket k+1 is being stepped. The result is exactly one step over all owned params.
        in_flight: list[FlatParamBucket] = []
        for buckets in self._buckets:
            self._step_only([p for b in buckets for p in b.owned_params], step_kwargs)
            for b in buckets:
                b.start_gather()
                in_flight.append(b)
        if self._defer_sync:  # the next forward waits per module (overlap_sync_with)
            self._pending_sync = in_flight
            return
        for b in in_flight:
            b.finish_gather()

    def _step_only(self, params: list[torch.Tensor], step_kwargs: dict) -> None:
        keep = {id(p) for p in params}
        hidden = [(p, p.grad) for g in self.optim.param_groups for p in g["params"]
                  if id(p) not in keep and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            self.optim.step(**step_kwargs)
        finally:
            for p, grad in hidden:
                p.grad = grad

    def _repartition(self) -> None:
        self.wait_for_sync()
        for buckets in self._buckets:  # nothing may still be writing into the old buffers
            for b in buckets:
                b.finish_gather()
        plan = plan_ownership(_trainable(self.param_groups), self.world_size, self.bucket_numel)
        if _same_plan(plan, self._plan):
            return
        held = {**self._parked_state, **self.optim.state}
        arriving = self._send_state_to_new_owners(plan.partition, held)
        new = plan.partition
        kept = {p: s for p, s in held.items() if p in new and new.owner(p) == self.rank}
        # Note: the state of a parameter that left the partition (frozen) stays parked on its
        # last owner, so that it resumes where it stopped once trainable again, as in torch.
        self._parked_state = {p: s for p, s in held.items() if p not in new}
        for buckets in self._buckets:
            for b in buckets:
                b.unbind()
        self._plan = plan
        self.optim = self._make_local_optimizer(self.param_groups, new)
        self._load_local_state({**kept, **arriving})
        self._buckets = self._build_buckets(plan)
        self._consolidated = None

    def _send_state_to_new_owners(self, new: ParameterPartition, held: dict) -> dict:
        """Each rank in turn broadcasts the state it holds for parameters that ``new`` gives to
        another rank; returns ``{param: state}`` arriving here. ``N`` small broadcasts, only
        when the partition changed."""
        params = new.all_params()
        arriving = {}
        for r in range(self.world_size):
            mine = None
            if r == self.rank:
                mine = {i: held[p] for i, p in enumerate(params)
                        if new.owner(p) != r and p in held}
            got = distributed.broadcast_object(
                mine, src=distributed.get_global_rank(self.group, r), group=self.group)
            arriving.update({params[i]: st for i, st in got.items()
                             if new.owner(params[i]) == self.rank})
        return arriving

    def _shard_from(self, r: int, local: dict, recipient: int) -> Optional[dict]:
        """Bring rank ``r``'s state ``{global index: {key: value}}`` to the recipient (or to all
        with ``recipient == -1``), as CPU tensors; ``None`` elsewhere."""
        src = distributed.get_global_rank(self.group, r)
        tensors, meta = [], None
        if r == self.rank:
            meta = []
            for i, s in local.items():
                for key, value in s.items():
                    if torch.is_tensor(value):
                        meta.append((i, key, tuple(value.shape), value.dtype, value.device.type))
                        tensors.append(value)
                    else:
                        meta.append((i, key, None, value, None))
        meta = distributed.broadcast_object(meta, src=src, group=self.group)
        wanted = recipient in (-1, self.rank)
        flats = _flat_by_kind(meta, tensors if r == self.rank else None)
        for (dtype, device_type), (flat, numel) in flats.items():
            if flat is None:
                device = "cuda" if device_type == "cuda" else "cpu"
                flat = torch.empty(numel, dtype=dtype, device=device) if wanted else None
            flats[(dtype, device_type)] = (flat, numel)
            if recipient == -1:
                distributed.broadcast(flat, src=src, group=self.group)
            elif r != recipient:
                dst = distributed.get_global_rank(self.group, recipient)
                if self.rank == r:
                    distributed.send(flat, dst=dst, group=self.group)
                elif self.rank == recipient:
                    distributed.recv(flat, src=src, group=self.group)
        if not wanted:
            return None
        return _unflatten_state(meta, {k: v[0] for k, v in flats.items()})


# ---------------------------------------------------------------------- argument checks


def _check_optimizer_class(optim) -> None:
    if not (isinstance(optim, type) and issubclass(optim, torch.optim.Optimizer)):
        raise TypeError(f"OSS(optim={optim!r}): must be a torch.optim.Optimizer subclass such as "
                        f"torch.optim.AdamW or torch.optim.SGD (the class, not an instance)")


def _can_fuse(optim_class: type, kwargs: dict, groups: list[dict]) -> bool:
    """Whether the local optimizer may use torch's fused kernel: a torch optimizer that has one,
    ``fused`` and ``foreach`` left unset (``None``), not differentiable, and floating-point
    parameters on CPU or CUDA."""
    if optim_class not in _FUSED_OPTIMIZERS or kwargs.get("differentiable"):
        return False
    if kwargs.get("fused") is not None or kwargs.get("foreach") is not None:
        return False
    if any(g.get("fused") is not None or g.get("foreach") is not None for g in groups):
        return False
    params = [p for g in groups for p in g["params"]]
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def _drop_deprecated_fairscale_kwargs(defaults: dict) -> None:
    for name in _DEPRECATED_FAIRSCALE_KWARGS:
        if name in defaults:
            defaults.pop(name)
            warnings.warn(f"OSS({name}=...) is accepted for FairScale compatibility and ignored: "
                          f"shardkit syncs parameters in flat buckets", DeprecationWarning,
                          stacklevel=3)
    if "sync_op" in defaults:
        raise TypeError("OSS(sync_op=...) was removed: the parameter sync goes through the "
                        "transport given as comm= (default: the process group's collectives; "
                        "shardkit.shm_transport.SharedMemoryTransport() for ranks on one host)")


def _check_takeover_arguments(existing, optim, defaults) -> None:
    if isinstance(existing, OSS):
        raise TypeError("OSS(existing_optimizer): it is already an OSS; wrap a plain "
                        "torch.optim.Optimizer")
    if optim is not torch.optim.SGD or defaults:
        raise TypeError(f"OSS(existing_optimizer, ...): optim and hyper-parameters are taken from "
                        f"the {type(existing).__name__} given; do not pass optim={optim!r} or "
                        f"{sorted(defaults)} (pass a process group as group=...)")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"OSS({name}={value!r}): must be True or False")


def _check_norm_arguments(max_norm, norm_type) -> tuple[float, float]:
    try:
        max_norm, norm_type = float(max_norm), float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"OSS.clip_grad_norm(max_norm={max_norm!r}, norm_type={norm_type!r}): "
                        f"both must be numbers") from None
    if not max_norm > 0:
        raise ValueError(f"OSS.clip_grad_norm(max_norm={max_norm}): must be > 0")
    if not norm_type > 0:
        raise ValueError(f"OSS.clip_grad_norm(norm_type={norm_type}): must be > 0 or inf")
    return max_norm, norm_type


def _normalize_param_groups(params) -> list[dict]:
    """``params`` as a list of group dicts with a ``params`` list, checked: tensors only, each
    parameter in one group only, at least one parameter."""
    if isinstance(params, torch.Tensor):
        raise TypeError("OSS(params=...): got a single tensor; pass an iterable of parameters "
                        "or of param-group dicts (e.g. model.parameters())")
    items = list(params)
    if not items:
        raise ValueError("OSS(params=[]): got an empty parameter list")
    if not all(isinstance(x, dict) for x in items):
        items = [{"params": items}]
    groups, seen = [], {}
    for g, item in enumerate(items):
        if "params" not in item:
            raise ValueError(f"OSS: param group {g} has no 'params' key")
        ps = item["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        for i, p in enumerate(ps):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"OSS: param group {g} item {i} is a {type(p).__name__}; expected "
                                f"a torch.Tensor (named parameters are not supported)")
            if not p.is_leaf:
                raise ValueError(f"OSS: param group {g} item {i} is not a leaf tensor; an "
                                 f"optimizer can only update leaf tensors")
            if id(p) in seen:
                raise ValueError(f"OSS: a parameter (shape {tuple(p.shape)}) is in param group "
                                 f"{seen[id(p)][0]} (item {seen[id(p)][1]}) and again in group "
                                 f"{g} (item {i}); each parameter may be in one group only")
            seen[id(p)] = (g, i)
        groups.append({**item, "params": ps})
    return groups


def _check_full_state_dict(state_dict, param_groups) -> list[dict]:
    if not isinstance(state_dict, dict) or "state" not in state_dict \
            or "param_groups" not in state_dict:
        raise ValueError("OSS.load_state_dict: expected a full torch optimizer state dict with "
                         "'state' and 'param_groups' (from OSS.state_dict() after "
                         "consolidate_state_dict, or a plain torch optimizer's state_dict())")
    saved = state_dict["param_groups"]
    if len(saved) != len(param_groups):
        raise ValueError(f"OSS.load_state_dict: the state dict has {len(saved)} param groups, "
                         f"this optimizer {len(param_groups)}")
    for g, (s, mine) in enumerate(zip(saved, param_groups)):
        if len(s["params"]) != len(mine["params"]):
            raise ValueError(f"OSS.load_state_dict: param group {g} of the state dict has "
                             f"{len(s['params'])} parameters, this optimizer's has "
                             f"{len(mine['params'])}; the model or its param groups differ")
    return saved


def _check_same_model_on_every_rank(groups: list[dict], group) -> None:
    """One small all-gather: every rank must partition the same shapes, or the sync would
    corrupt parameters."""
    mine = [[tuple(p.shape) for p in g["params"] if p.requires_grad] for g in groups]
    every = distributed.all_gather_object(mine, group=group)
    for r, theirs in enumerate(every):
        if theirs != mine:
            raise ValueError(f"OSS: rank {r} of the group has different trainable parameters "
                             f"(param group lengths {[len(t) for t in theirs]}) from rank "
                             f"{distributed.get_rank(group)} ({[len(m) for m in mine]}); every "
                             f"rank must build OSS over the same model")


# ---------------------------------------------------------------------- small helpers


def _same_plan(a: OwnershipPlan, b: OwnershipPlan) -> bool:
    ids = lambda plan: [[id(p) for p in ps] for ps in plan.partition.param_groups]  # noqa: E731
    return (ids(a) == ids(b) and a.partition.owners == b.partition.owners
            and a.bucket_of == b.bucket_of)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _trainable(groups: Iterable[dict]) -> list[list[torch.Tensor]]:
    return [[p for p in g["params"] if p.requires_grad] for g in groups]


def _groups_of(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{**g} for g in optimizer.param_groups]


def _constructor_kwargs(optim: type, defaults: dict) -> dict:
    """The defaults the optimizer's constructor accepts (some defaults, such as AdamW's
    ``decoupled_weight_decay``, are not constructor arguments)."""
    sig = inspect.signature(optim.__init__)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in sig.parameters and k != "params"}


def _flat_by_kind(meta: list, tensors: Optional[list]) -> dict:
    """Per (dtype, device type): one flat tensor of the shard's state (``None`` where this
    rank is not the sender) and its element count."""
    out: dict = {}
    it = iter(tensors) if tensors is not None else None
    parts: dict = {}
    for _, _, shape, dtype, device_type in meta:
        if shape is None:
            continue
        numel = 1
        for d in shape:
            numel *= d
        key = (dtype, device_type)
        out[key] = (None, out.get(key, (None, 0))[1] + numel)
        if it is not None:
            parts.setdefault(key, []).append(next(it).detach().reshape(-1))
    if tensors is not None:
        out = {k: (torch.cat(parts[k]) if parts.get(k) else
                   torch.empty(0, dtype=k[0]), n) for k, (_, n) in out.items()}
    return out


def _unflatten_state(meta: list, flats: dict) -> dict:
    offsets = dict.fromkeys(flats, 0)
    state: dict = {}
    for i, key, shape, dtype_or_value, device_type in meta:
        if shape is None:
            state.setdefault(i, {})[key] = dtype_or_value
            continue
        kind = (dtype_or_value, device_type)
        numel = 1
        for d in shape:
            numel *= d
        start = offsets[kind]
        offsets[kind] = start + numel
        state.setdefault(i, {})[key] = flats[kind][start:start + numel].view(shape).to(
            "cpu", copy=True)
    return state
