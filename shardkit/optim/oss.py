"""OSS: optimizer state sharding (ZeRO stage 1), FairScale's ``OSS`` with a one-line swap.

Each data-parallel rank owns whole parameters, keeps the optimizer state of those only, steps
those only, and then every rank receives the updated parameters bucket by bucket. OSS itself
only ties the concerns together; each lives in its own module:

- who owns what (and moving state when that changes): :mod:`shardkit.optim.partition`;
- the flat-bucket parameter sync through the ``comm=`` transport: :mod:`shardkit.optim.param_sync`;
- the local optimizer, the fused-kernel choice and the step: :mod:`shardkit.optim.local_step`;
- full state dicts (consolidate, load): :mod:`shardkit.checkpoint.optimizer_state`;
- argument checks: :mod:`shardkit.optim.oss_arguments`; clipping: :mod:`shardkit.utils.grad_norm`.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
import zlib
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch.distributed.algorithms.join import Join, Joinable

from shardkit import distributed
from shardkit.checkpoint.optimizer_state import (check_full_state_dict,
                                                 checked_elementwise_state,
                                                 consolidate_optimizer_state, load_into_optimizer,
                                                 state_by_param)
from shardkit.optim import oss_arguments as args
from shardkit.optim.local_step import (agreed_closure, all_fp32, build_local_optimizer,
                                       choose_fused, rebuilt_from_class,
                                       refuse_parameters_held_outside_groups, runs_on_whole_model,
                                       steps_each_parameter_alone, step_only, whole_step,
                                       with_fused_choice, without_fused_choice)
from shardkit.optim.master_weights import MasterWeights
from shardkit.optim.oss_join import OSSJoinHook
from shardkit.optim.param_sync import ParamSync, _is_dense, broadcast_wire_dtype
from shardkit.optim.partition import ParameterPartition, plan_ownership, send_state_to_new_owners
from shardkit.transport import resolve_transport
from shardkit.utils.grad_norm import (check_clip_arguments, clip_grad_norm_across_ranks,
                                      count_once_over_tensor_parallel)

__all__ = ["OSS"]

# Why loss scaling cannot follow a step begun in backward (OSS.step's and ShardedGradScaler's
# refusals share it).
STEPPED_WITH_SCALED_GRADS = ("the last backward already stepped the parameters with the scaled "
                             "gradients (ShardedDataParallel(step_in_backward=True)), so they "
                             "can be neither unscaled nor skipped on inf/nan; build "
                             "ShardedDataParallel with step_in_backward=False to use loss "
                             "scaling")

# The collective OSS methods, by what each rank says it is in when the ranks compare their
# param groups (OSS._agree_on_param_groups)
_AGREEING_METHODS = ("OSS.step", "OSS.add_param_group", "OSS.refresh_trainable",
                     "OSS.clip_grad_norm", "OSS.consolidate_state_dict")
# one kind for all of them: ranks in different OSS calls get OSS's own message, naming the calls
OSS_AGREEMENT = distributed.control_kind(
    "an OSS call's agreement (" + ", ".join(_AGREEING_METHODS) + ")")


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers its memory without gaps or overlaps, in any dimension order
    (contiguous, ``channels_last``, ``.t()``; see the sync's ``_is_dense``); an empty one
    lays nothing out."""
    return tensor.numel() == 0 or _is_dense(tensor)


def _same_memory_order(tensor: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether ``tensor`` is dense and lays its elements out in memory as ``like`` does
    (strides of size-one dimensions aside)."""
    return (tensor.layout == torch.strided and tensor.shape == like.shape and _dense(tensor)
            and all(size == 1 or a == b
                    for size, a, b in zip(like.shape, tensor.stride(), like.stride())))


class OSS(torch.optim.Optimizer, Joinable):
    """Wrap a torch optimizer so that each rank holds and steps only its share of the state.

    Two constructors, like FairScale's::

        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)   # FairScale's form
        optimizer = OSS(torch.optim.AdamW(model.parameters(), lr=1e-3))         # one-line swap

    Use it beside ``DistributedDataParallel`` (every rank holds the full reduced gradients) or
    ``ShardedDataParallel`` (only owners hold them); the training loop does not change.

    Args:
        params: parameters or param-group dicts (per-group hyper-parameters are honoured), or an
            existing ``torch.optim.Optimizer`` whose type, defaults, param groups and state are
            taken over (then ``optim`` and ``defaults`` must not be given). Its param-group
            dicts become OSS's own (the same objects), so a learning rate changed through it,
            or by a scheduler built on it, is the one OSS steps with; do not step it yourself.
            A torch or shardkit optimizer is built again from its class on each shard; any
            other class (a subclass whose constructor keeps its own arguments) is copied
            instead, its constructor not called again (see ``local_step.rebuilt_from_class``);
            one that also holds its parameters outside its groups is refused (a TypeError).
        optim: the ``torch.optim.Optimizer`` subclass run on the local shard (default SGD,
            as in FairScale). As in FairScale, anything called as
            ``optim(param_groups, **defaults)`` also works: ``functools.partial`` of an
            optimizer class (its keywords join ``defaults``), or a factory function returning
            an optimizer over the param groups it is given (then OSS does not choose torch's
            fused kernel for it, and an LBFGS must be given as the class).
        group: the data-parallel process group (default: the whole world).
        broadcast_buffer_size: FairScale's argument, accepted in its place (the fourth) and
            ignored with a DeprecationWarning (shardkit sizes its sync buckets itself; see
            ``bucket_numel``); an int. A bool or dtype in the fourth place is
            ``broadcast_fp16`` (the order of shardkit's DESIGN.md).
        broadcast_fp16: send the updated parameters in fp16 (``True``) or in the dtype given
            (``torch.bfloat16``: fp32's range, a coarser mantissa); halves the sync, the other
            ranks' copies of a parameter are then rounded, the owner's stays exact.
        force_broadcast_object: FairScale's argument, accepted in its place (the sixth) and
            ignored with a DeprecationWarning; a bool.
        bucket_numel: target elements per rank in one sync bucket (default: a 16 MiB fp32
            bucket in all, see :func:`~shardkit.optim.partition.default_bucket_numel`).
        comm: the :class:`~shardkit.transport.Transport` that carries the parameter sync
            (default: the process group's own collectives; not in FairScale's signature).
        **defaults: the optimizer's hyper-parameters (``lr=...``).

    Attributes:
        optim: the local optimizer, over the parameters this rank owns only.
        partition: the :class:`ParameterPartition` of the trainable parameters (public and
            immutable: ``ShardedDataParallel`` reads it). ``param_to_rank`` is its dict view.
        fused: whether OSS chose torch's fused kernel for the local step (see below).
        group, rank, world_size, global_rank: the data-parallel group and this rank's place.

    Costs (Ψ trainable parameters, N ranks, K optimizer bytes per parameter): optimizer state
    ``KΨ/N`` per rank (plus at most one parameter's worth of imbalance); parameters and
    gradients stay full, the parameters living in the flat sync buffers (``Ψ`` plus at most 3%
    of padding, none where one parameter outweighs the others' shares: see
    :mod:`shardkit.optim.param_sync`; the caller's parameters become views of them, in this
    process's own memory); with ``broadcast_fp16``, during :meth:`step`, the 16-bit copies of
    at most two buckets. Communication per :meth:`step`: ``Ψ(N-1)/N`` elements (fp32, or fp16
    / bf16 with ``broadcast_fp16``), one all-gather per bucket, after one all-gather of 16
    int64s a rank checking that every rank steps the same param groups (see :meth:`step`).
    :meth:`clip_grad_norm`: one all-reduce of one element (one more over the tensor-parallel
    group for a model with tensor-parallel layers), after the same agreement as :meth:`step`
    (a rank that clips, or consolidates, while the others do something else is an error on
    every rank). Construction, :meth:`add_param_group` and :meth:`refresh_trainable`: one
    small all-gather of the trainable parameters' indices and shapes (every rank must agree).
    LBFGS is the exception: its history and line search span the whole flattened model, so
    every rank holds all of its state (``2·history_size·Ψ`` elements, not sharded) and steps
    every parameter; see :meth:`step`.

    Implementation: for ``SGD``, ``Adam``, ``AdamW`` and ``Adagrad`` given with ``fused`` and
    ``foreach`` unset, over fp32 parameters, the local step runs torch's own fused kernel (the
    same update computed in another order: within rounding of torch's default loop, a few ulps
    per step carried into later steps, about 1e-7 after 200 steps on CPU, not bit-identical;
    parameters cast to another dtype later go back to torch's default loop at the next step);
    :attr:`fused` says so, while ``param_groups`` and consolidated state dicts keep the
    caller's ``fused=None``, as a plain torch optimizer's would. Pass ``fused=False`` (or set
    it in a group) to keep torch's default loop, bit for bit (see
    :mod:`shardkit.optim.local_step`). Each rank's parameters are its own: in-place writes,
    ``model.to(dtype)`` and ``p.data = ...`` behave as in plain PyTorch (OSS re-lays its
    buckets out from the current values at the next step).

    .. warning:: ``step``, ``clip_grad_norm``, ``consolidate_state_dict``, ``add_param_group``
       and ``refresh_trainable`` are collective: call them on every rank of ``group``.
    """

    def __init__(self, params, optim: Union[type, Callable] = torch.optim.SGD, group=None,
                 broadcast_buffer_size=args.NOT_GIVEN,
                 broadcast_fp16: Union[bool, torch.dtype] = False,
                 force_broadcast_object=args.NOT_GIVEN, *,
                 bucket_numel: Optional[int] = None, comm=None, **defaults):
        # FairScale's positional order: its no-op arguments keep their places, so that
        # OSS(params, SGD, group, 2**20, True) means there what it meant in FairScale; a bool or
        # dtype fourth is broadcast_fp16 (DESIGN.md's order)
        broadcast_buffer_size, broadcast_fp16 = args.place_broadcast_fp16(broadcast_buffer_size,
                                                                          broadcast_fp16)
        args.check_deprecated_fairscale_arguments(broadcast_buffer_size, force_broadcast_object,
                                                  defaults)
        args.drop_deprecated_fairscale_kwargs(defaults)
        args.refuse_zero_redundancy_kwargs(defaults)
        existing = params if isinstance(params, torch.optim.Optimizer) else None
        self._optim_is_factory = False
        # the optimizer taken over, when each local optimizer is a copy of it
        self._template: Optional[torch.optim.Optimizer] = None
        # the optimizer taken over, for the LR schedulers a user built on it (see step)
        self._taken_over = weakref.ref(existing) if existing is not None else None
        if existing is not None:
            args.check_takeover_arguments(existing, optim, defaults, isinstance(existing, OSS))
            optim, groups = type(existing), args.groups_of(existing)
            ctor_kwargs = args.constructor_kwargs(optim, existing.defaults)
            self._template = None if rebuilt_from_class(optim) else existing
            if self._template is not None and not runs_on_whole_model(optim):
                refuse_parameters_held_outside_groups(existing, "OSS(existing_optimizer)")
        else:
            optim, bound, self._optim_is_factory = args.resolve_optimizer(optim)
            defaults = {**bound, **defaults}
            groups = args.normalize_param_groups(params)
            ctor_kwargs = dict(defaults) if self._optim_is_factory else \
                args.without_fixed_defaults(optim, defaults)
        broadcast_wire_dtype(broadcast_fp16)  # a clear error for a bad value, before any op
        if bucket_numel is not None and (not isinstance(bucket_numel, int) or bucket_numel < 1):
            raise ValueError(f"OSS(bucket_numel={bucket_numel!r}): must be a positive int or None")
        self.comm = resolve_transport(comm, "OSS")
        distributed.require_initialized("OSS")
        distributed.check_group(group, "OSS")
        self.group = group
        self.rank = distributed.get_rank(group)
        if self.rank < 0:
            raise ValueError(f"OSS(group=...): global rank {distributed.get_rank()} is not a "
                             f"member of the given process group")
        self.world_size = distributed.get_world_size(group)
        self.global_rank = distributed.get_global_rank(group, self.rank)
        self._broadcast_fp16 = broadcast_fp16
        self.bucket_numel = bucket_numel
        self._optim_class, self._optim_kwargs = optim, ctor_kwargs
        # a factory builds what it builds: no fused-kernel choice is written into it
        self._step_refusals: dict = {}  # optimizer settings -> the kinds of step it refuses
        self.fused = (not self._optim_is_factory and choose_fused(optim, ctor_kwargs, groups)
                      and self._fused_carries_nan_as_loop(
                          [{**ctor_kwargs, **g} for g in groups]))
        # LBFGS: run over every parameter on every rank (see local_step.runs_on_whole_model)
        self._whole_model = runs_on_whole_model(optim)
        # the sync layout (version, number of groups) the fused choice last read dtypes and
        # devices from, and each group's devices then (see _settle_fused_choice)
        self._fused_layout_checked: Optional[tuple] = None
        # each stepped parameter's (address, strides) when its state was last laid out as it
        # is (see _lay_state_out_as_parameters)
        self._state_laid_out_for: Optional[tuple] = None
        self._group_devices: list[set] = []
        self._ready = False
        self._stepped_in_backward: Optional[set] = None  # buckets stepped by ShardedDDP's backward
        self._found_inf_agreed = False  # ShardedGradScaler combined this step's inf/nan flags
        self._agreed_in_advance: dict = {}  # method -> settings digest (agreed_in_advance)
        self._consolidated: Optional[dict] = None
        self._parked_state: dict = {}  # state of frozen parameters last owned here
        # frozen parameters partitioned for the gradient they held (stepped as torch steps
        # them); one made trainable again needs a refresh all the same (ShardedDDP's hooks)
        self._frozen_members: set = set()
        self._lent_grads: dict = {}  # frozen parameter -> id of the gradient copy lent here
        args.check_no_shared_storage(groups, self.world_size)
        # local (no collective), so that bad hyper-parameters fail before any collective starts
        self._plan = plan_ownership(_trainable(groups), self.world_size, bucket_numel)
        self.optim = self._build_local_optimizer(groups)
        frozen_with_gradient = args.check_same_model_on_every_rank(
            groups, group, settings=args.optimizer_settings(optim, ctor_kwargs, groups),
            refusal=args.tensor_parallel_refusal(groups, group))
        if any(frozen_with_gradient):  # rare: known only now, after the agreement
            self._frozen_members = _items_of(groups, frozen_with_gradient)
            self._plan = self._plan_stepped(groups, frozen_with_gradient)
            self.optim = self._build_local_optimizer(groups)
        self.comm.prepare(group)
        super().__init__(groups, without_fused_choice(dict(self.optim.defaults), self.fused))
        self._sync = ParamSync(self._plan, self.rank, group, broadcast_fp16, self.comm)
        Joinable.__init__(self)
        self._ready = True
        if existing is not None:
            self.load_state_dict(existing.state_dict())

    # ------------------------------------------------------------------ public views

    @property
    def partition(self) -> ParameterPartition:
        """The current immutable ownership of the parameters OSS steps: the trainable ones, and
        the frozen ones that held a gradient when it was made (see :meth:`refresh_trainable`);
        replaced, never mutated, by :meth:`add_param_group` and :meth:`refresh_trainable`."""
        return self._plan.partition

    @property
    def param_to_rank(self) -> dict:
        """``{parameter: owning rank}`` for every parameter of :attr:`partition`."""
        return self.partition.param_to_rank

    @property
    def broadcast_fp16(self) -> Union[bool, torch.dtype]:
        """The dtype the parameter sync sends fp32 parameters in (the constructor's argument).
        Assignable between steps, as in FairScale (Lightning sets it after building OSS): the
        next sync uses it; a bad value is a ValueError naming it."""
        return self._broadcast_fp16

    @broadcast_fp16.setter
    def broadcast_fp16(self, value: Union[bool, torch.dtype]) -> None:
        broadcast_wire_dtype(value)
        self._broadcast_fp16 = value
        if getattr(self, "_sync", None) is not None:
            self._sync.set_wire(value)

    @property
    def num_buckets(self) -> int:
        """How many flat buckets one :meth:`step` re-syncs."""
        return self._sync.num_buckets

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
    def sync_in_flight(self) -> int:
        """How many bucket all-gathers of the last step are still running (only with
        :meth:`overlap_sync_with`; :meth:`wait_for_sync` finishes them)."""
        return self._sync.in_flight

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
        return [[{**_hyper(g), **_names_of(g, owned), "params": owned}
                 for g, owned in zip(self.param_groups, self._owned_per_group(r))]
                for r in range(self.world_size)]

    @property
    def per_device_params(self) -> dict:
        """``{device: [[params owned by rank r on that device] for r in ranks]}``."""
        out: dict = {}
        for p in self.partition.all_params():
            rows = out.setdefault(p.device, [[] for _ in range(self.world_size)])
            rows[self.partition.owner(p)].append(p)
        return out

    @property
    def backend(self) -> str:
        """The process group's backend (``"gloo"``, ``"nccl"``), FairScale's attribute."""
        return distributed.backend_of(self.group)

    # FairScale's private names, which its users' code and tests read
    @property
    def _per_device_params(self) -> dict:
        return self.per_device_params

    @property
    def _param_to_rank(self) -> dict:
        return self.param_to_rank

    @property
    def _local_params(self) -> list[torch.Tensor]:
        """The parameters this rank owns that have a gradient."""
        return [p for p in self._owned_params() if p.grad is not None]

    # ------------------------------------------------------------------ training

    def __getstate__(self):
        # Note: torch's Optimizer.__getstate__ keeps only defaults, state and param_groups, so
        # a copy lost the partition, the process group and the inner optimizer and failed at
        # its first step with an AttributeError far from the cause. pickle, torch.save of the
        # optimizer object and copy.deepcopy (of it, or of a wrapper holding it) all come here.
        raise TypeError(
            "OSS cannot be pickled or copied (pickle, torch.save(optimizer), copy.deepcopy, or "
            "a copy of a ShardedDataParallel holding it): it holds this rank's shard of the "
            "state, its partition and its process group. Save optimizer.state_dict() "
            "(consolidate_state_dict() first for the whole state, or "
            "state_dict(all_ranks=True)), and build a new OSS over the copied model's "
            "parameters to load it into")

    def _mark_taken_over_optimizer_stepped(self) -> None:
        """Tell torch's LR schedulers built on the optimizer OSS took over that a step came:
        they wrap that optimizer's ``step``, which OSS never calls, and would warn that
        ``lr_scheduler.step()`` came before ``optimizer.step()`` (the flag their wrapper sets).
        Local."""
        taken_over = self._taken_over() if self._taken_over is not None else None
        if taken_over is not None:
            taken_over._opt_called = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None, **kwargs):
        """Step the owned parameters that have a gradient, then re-sync every parameter from
        its owner. ``closure`` and the keyword arguments go to the local optimizer's ``step``,
        as in FairScale. LBFGS (whose curvature and line search span the whole flattened
        model) is not sharded: every rank holds its state and steps every parameter with the
        same gradients, so it steps exactly as one process would; its closure's loss is
        averaged over the ranks (one all-reduce of one element per parameter and one more per
        call, which also checks that every rank holds every reduced gradient, as under DDP), so
        every rank calls the closure equally often. The loss returned is then that average.

        Without a closure, an optimizer that updates each parameter alone (SGD, Adam, AdamW,
        ...) is stepped bucket by bucket, each bucket's all-gather overlapping the stepping of
        the next; any other optimizer, or a closure, steps whole and then syncs every bucket.

        Called by a ``GradScaler`` (torch's or :class:`~shardkit.optim.ShardedGradScaler`),
        ``step`` runs on every rank even on inf/nan and decides with the other ranks: one
        all-reduce of one element (none with ``ShardedGradScaler``, whose check already spans
        the ranks) tells whether any rank found inf/nan; then every rank skips, or unscales the
        gradients the scaler left scaled and steps. Under torch's scaler, where ranks disagree
        (a shard that overflowed on its owner only, as under ``ShardedDataParallel``), or where
        a rank holds no gradient at all, OSS also writes the agreed finding into the calling
        ``torch.amp.GradScaler.step``'s record, so that every rank's ``update()`` backs off (or
        grows) alike; a scaler whose ``step`` is not torch's then raises a RuntimeError on every
        rank naming ``ShardedGradScaler``.

        A gradient the optimizer refuses (Adam over ``nn.Embedding(sparse=True)``, a dense one
        under ``SparseAdam``) is a RuntimeError on every rank that holds it (under DDP, all),
        before any collective; so are settings that can step no parameter like one of the
        partition (``capturable=True`` on CPU), on every rank. A rank that holds no gradient
        for that parameter cannot tell without a collective of its own (one per step), so
        where gradients are not reduced at all (no DDP or ShardedDataParallel, the parameter
        used in the owner's batch only) it waits in the parameter sync until the collective
        times out; under DDP (with or without ``reduce_to_owners_hook``, which refuses sparse
        gradients) and ``ShardedDataParallel`` (which reduces them densely) every rank decides
        alike.

        Every rank first checks that the ranks step the same param groups with the same
        hyper-parameters (:meth:`_agree_on_param_groups`): a learning rate set on some ranks
        only (each parameter would step with its owner's), or ``add_param_group`` /
        ``refresh_trainable`` called on some ranks only while the others step (they hung), is
        an error on every rank before any parameter is stepped.

        Communication: ``Ψ(N-1)/N`` elements in all, one all-gather per bucket, and the
        agreement: one all-gather of 16 int64s a rank (a control message, not counted by
        ``CommCounter``; see :meth:`_agree_on_param_groups`).
        """
        Join.notify_join_context(self)  # inside Join([...]): this rank has not joined yet
        self._mark_taken_over_optimizer_stepped()
        found_inf_agreed, self._found_inf_agreed = self._found_inf_agreed, False
        if self._stepped_in_backward is not None:
            return self._finish_step_begun_in_backward(closure, kwargs)
        self._check_trainable_covered()
        self._sync.wait()
        try:
            self._agree_on_param_groups("OSS.step")
        except (RuntimeError, ValueError):
            self._forget_scaler_handoff()
            raise
        sparse_gradients = self._check_gradients_steppable()
        if "found_inf" in self.__dict__ and self._skip_scaled_step(found_inf_agreed):
            return None
        self._consolidated = None
        self._sync.rebind_if_moved()
        self._settle_fused_choice(sparse_gradients)
        self._push_hyperparameters()
        loss = None
        if closure is None and self._sync.buckets and steps_each_parameter_alone(self.optim):
            self._sync.step_and_sync(lambda params: step_only(self.optim, params, kwargs))
        else:
            if self._whole_model:
                closure = self._closure_on_every_rank(closure)
            loss = whole_step(self.optim, closure, kwargs)
            self._sync.sync_all()
        self._pull_hyperparameters()
        return loss

    def _check_gradients_steppable(self, caller: str = "OSS.step",
                                   with_gradients: bool = True) -> bool:
        """Raise a RuntimeError, before any collective, when the optimizer would refuse to step
        a partitioned parameter on its owner: a sparse gradient Adam, AdamW... refuse
        (``nn.Embedding(sparse=True)``), a dense one ``SparseAdam`` refuses, or settings that
        step no parameter like it (``capturable=True`` on CPU). Every rank decides alike (see
        :func:`.oss_arguments.gradient_step_problem`); only the owner's step raised before, and
        the other ranks waited in the parameter sync until the collective timed out. Local:
        one look at each parameter's gradient, and a cached trial step the first time some
        optimizer settings meet some kind of parameter. LBFGS is stepped whole on every rank,
        where a refusal is every rank's anyway. ``with_gradients=False``: the gradients are not
        looked at (each parameter is taken as holding none). Returns whether a partitioned
        parameter holds a sparse gradient (False for LBFGS, which is not checked)."""
        if self._whole_model:
            return False
        optim_cls = type(self.optim)
        sparse = False
        for g, group in enumerate(self.param_groups):
            hyper = _hyper(group, names=False)
            for (*_, layout), (i, p) in _first_of_each_kind(group["params"], self.partition,
                                                            with_gradients).items():
                sparse = sparse or layout == "sparse"
                name = f" ({group['param_names'][i]!r})" if "param_names" in group else ""
                problem = args.gradient_step_problem(
                    caller, optim_cls, hyper, p, f"parameter {i}{name} of param group {g}",
                    layout, self._step_refusals)
                if problem:
                    self._forget_scaler_handoff()
                    raise RuntimeError(problem)
        return sparse

    def _closure_on_every_rank(self, closure: Optional[Callable]) -> Callable:
        """The closure an optimizer run over the whole model (LBFGS) gets: every rank evaluates
        it at the same parameters and sees the same (averaged) loss, so the ranks step alike."""
        name = args.optimizer_name(self._optim_class)
        if not callable(closure):
            raise ValueError(f"OSS.step(closure={closure!r}): {name} re-evaluates the model "
                             f"during its step and needs a closure (a callable that clears the "
                             f"gradients, runs forward and backward and returns the loss)")
        params = [p for g in self.optim.param_groups for p in g["params"]]
        return agreed_closure(closure, params, self.group, self.world_size,
                              f"OSS(optim={name}).step")

    # ------------------------------------------------------------------ loss scaling

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # Note: with this True, torch's GradScaler.step() calls step() even when this rank found
        # inf/nan, handing it the scale and this rank's flag as the ``grad_scale`` / ``found_inf``
        # attributes. Every rank then enters step() and the ranks decide together; otherwise a
        # rank whose shard overflowed would skip the parameter sync the other ranks wait in.
        return True

    def _found_inf_agreed_over(self, group) -> None:
        """Told by ShardedGradScaler that it combined this step's inf/nan flags over ``group``
        (None: the world): the next :meth:`step` need not combine them again if ``group``
        holds every rank of this OSS."""
        held = distributed.group_ranks(group)
        self._found_inf_agreed = set(distributed.group_ranks(self.group)) <= set(held)

    def _skip_scaled_step(self, found_inf_agreed: bool) -> bool:
        """For a step called by a GradScaler: True if every rank skips it (some rank found
        inf/nan); otherwise unscale the gradients the scaler left scaled and return False."""
        ranks_with_inf = self._count_ranks_that_found_inf(found_inf_agreed)
        # torch's scaler recorded this rank's own finding (or none: no gradient held here);
        # ShardedGradScaler's record is already every rank's (and never empty)
        recorded = found_inf_agreed or ranks_with_inf == self.world_size or \
            self._record_in_calling_torch_scaler(found_inf_anywhere=ranks_with_inf > 0)
        if 0 < ranks_with_inf < self.world_size and not recorded:
            self._forget_scaler_handoff()
            raise RuntimeError(
                f"OSS.step: the GradScaler found inf/nan gradients on {ranks_with_inf} of "
                f"{self.world_size} ranks only: torch.amp.GradScaler checks the gradients this "
                f"rank holds (under ShardedDataParallel or DDP's reduce_to_owners_hook, only "
                f"the ones it owns, the others' are zero or None), and this scaler's step() "
                f"is not torch.amp.GradScaler.step, whose record OSS corrects, so its update() "
                f"would back the loss scale off on those ranks only and the ranks would train "
                f"with different scales. No rank stepped. Use shardkit.optim.ShardedGradScaler "
                f"(the same arguments as torch.amp.GradScaler), whose check spans every rank")
        if ranks_with_inf:
            return True
        grad_scale = self.__dict__.get("grad_scale")
        if grad_scale is not None:  # torch's scaler leaves unscaling to an optimizer like this
            grad_of = self._stepped_grad_reader()
            if grad_of is None:
                _unscale_grads([p for g in self.param_groups for p in g["params"]], grad_scale)
            else:
                inv_scale = grad_scale.double().reciprocal().float()
                for p in self._owned_params():
                    if p.grad is not None:
                        grad_of(p).mul_(inv_scale.to(p.grad.device))
        return False

    def _record_in_calling_torch_scaler(self, found_inf_anywhere: bool) -> bool:
        """:func:`_record_in_calling_torch_scaler`, raising (on every rank alike: the same
        torch everywhere) a RuntimeError that names ShardedGradScaler, with nothing stepped,
        when this torch's ``GradScaler.step`` keeps its record under other names."""
        try:
            return _record_in_calling_torch_scaler(self, found_inf_anywhere)
        except _UnknownScalerRecord as unknown:
            if self.world_size == 1:
                return False  # one rank: torch's own record is the only finding
            self._forget_scaler_handoff()
            raise RuntimeError(
                f"OSS.step: torch.amp.GradScaler.step is stepping this OSS, but this torch "
                f"({torch.__version__}) keeps its inf/nan record under other names than OSS "
                f"knows ({unknown}), so OSS cannot write into it what every rank found "
                f"(torch's scaler checks only the gradients this rank holds: the ranks would "
                f"skip steps and move the loss scale differently). No rank stepped. Use "
                f"shardkit.optim.ShardedGradScaler (the same arguments as "
                f"torch.amp.GradScaler), whose check spans every rank") from None

    def _forget_scaler_handoff(self) -> None:
        """Drop the ``grad_scale`` / ``found_inf`` a GradScaler set for this step, before
        ``step`` raises: the scaler deletes them only if ``step`` returns."""
        for name in ("grad_scale", "found_inf"):
            self.__dict__.pop(name, None)

    def _count_ranks_that_found_inf(self, found_inf_agreed: bool) -> int:
        """How many ranks of the group found inf/nan: one all-reduce of one element, unless the
        flags are already the same on every rank."""
        found_inf = self.__dict__["found_inf"]
        # torch's scaler hands the int 0 when this rank holds no gradient at all
        device = found_inf.device if torch.is_tensor(found_inf) else self._default_device
        found_here = torch.as_tensor(found_inf, device=device).gt(0).to(torch.float32)
        if found_inf_agreed or self.world_size == 1:
            return self.world_size if found_here.item() else 0
        distributed.all_reduce(found_here, group=self.group)
        return int(found_here.item())

    def _agree_on_param_groups(self, method: str, added: Sequence[dict] = (),
                               arguments: Optional[dict] = None) -> None:
        """Raise on every rank, changing nothing, unless every rank of the group is in the same
        collective ``method`` (one of ``_AGREEING_METHODS``) with the same param groups: their
        number, sizes and hyper-parameters (and the same new groups ``added``), and the same
        ``arguments`` (``{name: value}`` of the call: ``clip_grad_norm``'s ``max_norm``, a
        ``recipient_rank``). A RuntimeError names the ranks in each method (``add_param_group``
        or ``clip_grad_norm`` on some ranks only, which left the others hanging in the next
        collective, or mixed another rank's partial norm into theirs); a ValueError names the
        first hyper-parameter or argument that differs and its values (a learning rate set on
        some ranks only: each parameter stepped with its owner's, silently).

        Communication: one all-gather of 16 int64s a rank, the method and a crc32 of the
        settings (a control message that :class:`~shardkit.distributed.CommCounter` does not
        count; no pickling); on a difference, one object all-gather of the hyper-parameters.
        Local work: a ``repr`` of every group's hyper-parameters. Nothing at world size 1, nor
        inside :meth:`agreed_in_advance` for ``method`` (its caller gathered the rows).

        Note: a rank that calls a collective method more often than the others (``clip_grad_norm``
        twice on rank 0 alone) still waits for them in its extra call: nothing can answer it."""
        if self.world_size == 1:
            return
        settings = self._agreement_settings(method, added, arguments)
        row = _agreement_row(method, settings)
        agreed = self._agreed_in_advance.pop(method, None)
        if agreed is not None:  # the caller gathered the rows already (agreed_in_advance)
            if agreed == row[1]:
                return
            raise RuntimeError(
                f"{method}: the param groups' hyper-parameters or the call's arguments changed "
                f"on this rank (rank {self.rank}) after OSS.agreed_in_advance agreed on them; "
                f"inside that block, call {method.split('.')[1]} as agreed and change no "
                f"setting. Nothing was changed, clipped or stepped")
        every = distributed.gather_control_rows(f"{method}'s agreement", row, self.group,
                                                kind=OSS_AGREEMENT)
        self._check_agreement_rows(method, every, settings)

    def _agreement_settings(self, method: str, added: Sequence[dict] = (),
                            arguments: Optional[dict] = None) -> dict:
        """``{name: repr}`` of what the ranks must agree on in ``method``: the param groups
        (with ``added``) and the call's ``arguments``. Local."""
        settings = args.param_group_settings(list(self.param_groups) + list(added))
        settings.update({f"{method}({name}=...)": repr(value)
                         for name, value in (arguments or {}).items()})
        return settings

    def _check_agreement_rows(self, method: str, every: list, settings: dict) -> None:
        """Raise on every rank (each holds the same ``every``, the group's rows of
        :func:`_agreement_row`) unless they name one method and one digest of the settings."""
        methods = [_AGREEING_METHODS[code] for code, _ in every]
        if len(set(methods)) > 1:
            where = "; ".join(f"rank(s) {[r for r, m in enumerate(methods) if m == name]} in "
                              f"{name}" for name in _AGREEING_METHODS if name in methods)
            raise RuntimeError(
                f"{method}: the ranks of the group are not in the same OSS call ({where}); "
                f"step, clip_grad_norm, consolidate_state_dict, add_param_group and "
                f"refresh_trainable are collective: call each on every rank, in the same "
                f"order. Nothing was changed, clipped or stepped")
        if len({d for _, d in every}) > 1:
            distributed.raise_on_disagreement(
                settings, self.group, method,
                "set hyper-parameters (a learning rate, a scheduler's step), add param groups "
                "and pass the arguments of collective calls identically on every rank; "
                "nothing was changed, clipped or stepped")
            # only rows gathered in advance can get here: a rank's row not made from the
            # settings it passes now (every rank still raises, as every rank saw the rows)
            raise ValueError(
                f"{method}: the rows' settings digests differ ({[d for _, d in every]} per "
                f"group rank) although every rank's param groups and arguments agree now: some "
                f"rank's row was not made by agreement_row with the arguments it passes to "
                f"agreed_in_advance; nothing was changed, clipped or stepped")

    # ------------------------------------------------------------------ agreement in advance
    # For a caller that already makes one control exchange per step (the DeepSpeed-style
    # engine's step agreement): it gathers OSS's rows with its own, in one all-gather, and
    # OSS's step and clip then skip their own.

    def agreement_row(self, call: str, **arguments) -> list[int]:
        """This rank's row (two ints) of the agreement that ``call`` (``"step"`` or
        ``"clip_grad_norm"``, with that call's arguments: ``max_norm``, ``norm_type``) makes
        before any collective, for a caller that gathers every rank's row over :attr:`group`
        itself and passes them to :meth:`agreed_in_advance`. Local, no communication."""
        method, settings = self._in_advance_settings("OSS.agreement_row", call, arguments)
        return _agreement_row(method, settings)

    @contextlib.contextmanager
    def agreed_in_advance(self, call: str, rows: Sequence[Sequence[int]], **arguments):
        """Within this block, the next ``call`` (``"step"`` or ``"clip_grad_norm"``) skips the
        control all-gather it makes before any collective, its rows being ``rows``: every
        rank's :meth:`agreement_row` for the same ``call`` and ``arguments``, in group-rank
        order, gathered by the caller over :attr:`group` (with its own control exchange).

        The rows are checked here as the call would check them: a rank in another call, or
        with other hyper-parameters or arguments, is the same error on every rank, before the
        block runs. Inside the block, only the caller's own code may run (no user code) and
        the agreed settings must not change: the call compares them with its row and raises on
        this rank if they did (the other ranks, past their agreement, cannot be told). One
        call only: a second one in the block agrees as usual. Local, no communication (an
        object all-gather where the rows differ in settings, to name the difference)."""
        method, settings = self._in_advance_settings("OSS.agreed_in_advance", call, arguments)
        every = [list(row) for row in rows]
        mine = _agreement_row(method, settings)
        if method in self._agreed_in_advance:
            raise RuntimeError(f"OSS.agreed_in_advance({call!r}): already inside such a block")
        _check_rows_shape(every, self.world_size)
        # before this rank's own row: where the rows' settings differ, every rank (this one
        # too) must join the object all-gather that names the difference, or they hang there
        if self.world_size > 1:
            self._check_agreement_rows(method, every, settings)
        if every[self.rank] != mine:
            raise ValueError(f"OSS.agreed_in_advance(rows=...): row {self.rank} is "
                             f"{every[self.rank]}, not this rank's agreement_row({call!r}) "
                             f"{mine}; gather the rows over OSS.group with the same arguments")
        self._agreed_in_advance[method] = mine[1]
        try:
            yield
        finally:
            self._agreed_in_advance.pop(method, None)

    def _in_advance_settings(self, caller: str, call: str, arguments: dict) -> tuple:
        """``(method, settings)`` of an agreement made in advance for ``call``, with its
        arguments checked and normalised as the call itself does."""
        if call == "step":
            if arguments:
                raise ValueError(f"{caller}('step', {', '.join(arguments)}=...): step's "
                                 f"agreement takes no arguments")
            return "OSS.step", self._agreement_settings("OSS.step")
        if call == "clip_grad_norm":
            unknown = set(arguments) - {"max_norm", "norm_type"}
            if unknown or "max_norm" not in arguments:
                raise ValueError(f"{caller}('clip_grad_norm', ...): expected max_norm= and "
                                 f"optionally norm_type=, got {sorted(arguments)}")
            max_norm, norm_type = check_clip_arguments(
                "OSS.clip_grad_norm", arguments["max_norm"], arguments.get("norm_type", 2.0))
            return "OSS.clip_grad_norm", self._agreement_settings(
                "OSS.clip_grad_norm", arguments={"max_norm": max_norm, "norm_type": norm_type})
        raise ValueError(f"{caller}(call={call!r}): must be 'step' or 'clip_grad_norm'")

    def _settle_fused_choice(self, sparse_gradients: bool) -> None:
        """Turn OSS's own choice of the fused kernel off, for good, where it would no longer
        step as the caller's optimizer does: parameters cast to 16 bits after construction,
        sparse gradients (``nn.Embedding(sparse=True)``, ``sparse_gradients``: seen by
        :meth:`_check_gradients_steppable` this step), which torch's fused kernels refuse, or
        settings under which the kernel carries a NaN otherwise than torch's default loop
        (``amsgrad=True`` set in a group since, or in a group added since; see
        :func:`.oss_arguments.fused_kernel_carries_nan_as_loop`).

        Where it stays on, each stepped parameter's state is first laid out in memory as the
        parameter is (:meth:`_lay_state_out_as_parameters`): the kernel walks a parameter, its
        gradient and its state element by element in memory order.

        Per step, with nothing changed, one dictionary look-up per group (the settings' trial,
        cached) and no look at any parameter: the dtypes and devices are read from the sync
        buckets, only when they were laid out again (every parameter lives in one of them, and
        ``model.half()`` or ``p.data = ...`` re-lays them out at the step), or after state was
        loaded or handed over. A world of one lays no bucket out, so there every step looks at
        each stepped parameter's dtype, device and state layout."""
        if not self.fused:
            return
        layout = (self._sync.layout_version, len(self.param_groups))
        if layout != self._fused_layout_checked or not self._sync.buckets:
            self._fused_layout_checked = layout
            self._group_devices = [{p.device for p in g["params"]} for g in self.param_groups]
            if not self._stepped_params_all_fp32() or not self._fused_kernel_pairs_elements():
                self.fused = False
                return
            self._lay_state_out_as_parameters()
        if sparse_gradients or not self._fused_carries_nan_as_loop(self.param_groups,
                                                                   self._group_devices):
            self.fused = False

    def _lay_state_out_as_parameters(self) -> None:
        """Give each state tensor of a stepped parameter (Adam's ``exp_avg``, SGD's
        ``momentum_buffer``...) that parameter's memory layout where it has another one (same
        values, a copy). torch's fused kernel pairs a parameter's elements with its state's in
        memory order, so a state laid out otherwise (made before ``p.data = w.t()`` or
        ``model.to(memory_format=torch.channels_last)``, or loaded from a state dict saved
        contiguous, as a consolidated one is) updated each element from another element's
        state: silently wrong steps where torch's default loop, which OSS stands in for, is
        right. Local: where no stepped parameter got new storage or strides since the last look
        and no state was loaded since, one look at each one's address and strides; otherwise a
        look at each one's state too, and a copy only where the layouts differ."""
        stepped = [p for group in self.optim.param_groups for p in group["params"]]
        layouts = tuple((p.data_ptr(), p.stride()) for p in stepped)
        if layouts == self._state_laid_out_for:
            return
        self._state_laid_out_for = layouts
        for p in stepped:
            state = self.optim.state.get(p)
            if not state:
                continue
            layout = p.stride()
            for key, value in state.items():
                if (torch.is_tensor(value) and value.stride() != layout
                        and value.shape == p.shape and value.dim() > 0):
                    relaid = torch.empty_like(p, dtype=value.dtype, device=value.device)
                    # (empty_like keeps p's strides where p is dense, as a parameter is)
                    if relaid.stride() != value.stride():
                        # the same tensor object on new storage: a reference the caller (or
                        # the engine's state offload) holds to it stays the state stepped
                        value.set_(relaid.copy_(value))

    def _fused_kernel_pairs_elements(self) -> bool:
        """Whether torch's fused kernel would pair each element of every stepped parameter
        with the same element of its gradient: it walks both linearly in memory, so a
        parameter that is not dense (``p.data = big[:, ::2]``: it would also write into
        ``big``'s other columns) or a gradient laid out otherwise than its parameter (kept by
        ``zero_grad(set_to_none=False)`` across ``p.data = w.t()``) steps wrong elements, where
        torch's default loop is right. Only a world of one can hold such a parameter (the sync
        buckets lay the parameters out dense, their gradients alike), and there every step
        looks: one look at each stepped parameter's and gradient's strides."""
        for group in self.optim.param_groups:
            for p in group["params"]:
                grad = p.grad
                if p.is_contiguous() and (grad is None or grad.is_contiguous()):
                    continue  # the common case, in two calls
                if not _dense(p) or (grad is not None and not _same_memory_order(grad, p)):
                    return False
        return True

    def _stepped_params_all_fp32(self) -> bool:
        """Whether every parameter this rank steps is fp32: read from the sync buckets where
        there are some, from the local optimizer's parameters at world size 1 (no bucket)."""
        if self._sync.buckets:
            return self._sync.all_fp32()
        return all_fp32([p for g in self.optim.param_groups for p in g["params"]])

    def _fused_carries_nan_as_loop(self, groups: list[dict],
                                   devices: Optional[list[set]] = None) -> bool:
        """Whether torch's fused kernel carries a NaN gradient through a step as the default
        loop would, for every group's settings on every device its parameters are on
        (``devices[i]``: group ``i``'s, when known already). Local."""
        for i, group in enumerate(groups):
            hyper = without_fused_choice(_hyper(group, names=False), True)
            on = devices[i] if devices is not None else {p.device for p in group["params"]}
            for device in on:
                if not args.fused_kernel_carries_nan_as_loop(self._optim_class, hyper, device,
                                                             self._step_refusals):
                    return False
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of every group (owned or not)."""
        super().zero_grad(set_to_none=set_to_none)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       filter_params_fn: Optional[Callable] = None) -> torch.Tensor:
        """Clip the gradients so that their global norm is at most ``max_norm``; return the norm.

        Each rank measures the gradients of the parameters it owns, so the result is right both
        when every rank holds the full reduced gradients (DDP) and when only the owners do
        (ShardedDDP); one all-reduce of one element, after the ranks agree that they all clip,
        with the same ``max_norm`` and ``norm_type`` and param groups (the agreement of
        :meth:`step`: one all-gather of 16 int64s a rank; clipping on some ranks only mixed
        one rank's partial norm into another's collective, or hung). Every gradient this rank
        holds is scaled
        (under DDP, also those of parameters other ranks own: ``p.grad`` then reads as after
        torch's ``clip_grad_norm_``; FairScale scaled the owned ones only), a pass over them
        with no communication. ``filter_params_fn`` (FairScale's argument) receives the list
        of this rank's owned parameters and returns the ones to measure; as in FairScale and
        Megatron-LM, every gradient is scaled all the same (a filter that measures replicated
        weights on one tensor-parallel rank only must not leave them unclipped on the others).
        Sparse gradients (``nn.Embedding(sparse=True)``) count by their coalesced values and
        are scaled too (one host sync). Under a :class:`~shardkit.optim.MasterWeights` local
        optimizer (16-bit parameters, fp32 masters) the owned gradients are widened to fp32
        first and those are measured and scaled, which the step reads; the 16-bit ``p.grad``
        are left as they are.

        Tensor parallelism (OSS over the data-parallel group of a model built from
        ``shardkit.nn.model_parallel`` layers): read from the parameters' marks, split weights
        count on every tensor-parallel rank and replicated ones (LayerNorms, row-parallel
        biases) on tensor-parallel rank 0 only, and the norm is also summed over the
        tensor-parallel group: one more all-reduce of one element, only when such layers are
        present. Every rank then gets the norm of the unsplit model and clips by the same
        factor. A pipeline stage's OSS measures that stage only (sum the stages with
        :func:`shardkit.nn.model_parallel.clip_grad_norm`). An OSS group holding two ranks of
        one tensor-parallel group raises ``ValueError`` before any collective.
        """
        max_norm, norm_type = check_clip_arguments("OSS.clip_grad_norm", max_norm, norm_type)
        if self._stepped_in_backward is not None:
            raise RuntimeError("OSS.clip_grad_norm: the last backward already stepped the "
                               "parameters (ShardedDataParallel(step_in_backward=True)), so "
                               "there is nothing left to clip; build ShardedDataParallel with "
                               "step_in_backward=False to clip gradients before the step")
        if filter_params_fn is not None and not callable(filter_params_fn):
            raise TypeError(f"OSS.clip_grad_norm(filter_params_fn={filter_params_fn!r}): expected "
                            f"a callable taking and returning a list of parameters, or None")
        # before the norm's all-reduce: a rank clipping alone waited there while the others'
        # next collective (a step's agreement, another clip) answered it with other numbers
        self._agree_on_param_groups("OSS.clip_grad_norm",
                                    arguments={"max_norm": max_norm, "norm_type": norm_type})
        owned = self._owned_params()
        every_param = [p for group in self.param_groups for p in group["params"]]
        owned_ids = {id(p) for p in owned}
        # (frozen parameters outside the partition are neither measured nor stepped: left as
        # they are, unless the whole model is stepped)
        others = [p for p in every_param if id(p) not in owned_ids and p.grad is not None
                  and (p in self.partition or self._whole_model)]
        measured = owned if filter_params_fn is None else list(filter_params_fn(owned))
        measured = [p for p in measured if p.grad is not None]
        counted, also_over = count_once_over_tensor_parallel(
            every_param, measured, "OSS.clip_grad_norm", data_groups=(self.group,))
        grad_of = self._stepped_grad_reader()
        if grad_of is not None:  # fp32 masters: their gradients are what the step reads
            return clip_grad_norm_across_ranks(
                [grad_of(p) for p in owned if p.grad is not None], max_norm, norm_type,
                self.group, device=self._default_device,
                measured=[grad_of(p) for p in counted], also_over=also_over)
        # Note: the gradients this rank holds for parameters others own (all of them under
        # DDP) are scaled too, by the same factor on every rank, so that p.grad reads after
        # clipping as after torch's clip_grad_norm_ (FairScale scaled the owned ones only);
        # an optimizer run over the whole model (LBFGS) reads them all in its step
        scaled = [p for p in owned if p.grad is not None] + others
        return clip_grad_norm_across_ranks([p.grad for p in scaled], max_norm, norm_type,
                                           self.group, device=self._default_device,
                                           measured=[p.grad for p in counted],
                                           also_over=also_over)

    def _stepped_grad_reader(self) -> Optional[Callable]:
        """Under a :class:`~shardkit.optim.master_weights.MasterWeights` local optimizer, the
        16-bit gradients widened to fp32 (:meth:`~shardkit.optim.master_weights.MasterWeights.
        prepare_master_grads`) and a function from a parameter to its fp32 gradient: clipping
        scales those, in fp32, and the step reads them. ``None`` for any other optimizer."""
        if not isinstance(self.optim, MasterWeights):
            return None
        self.optim.prepare_master_grads()
        return self.optim.master_grad_of

    # ------------------------------------------------------------------ param groups

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (hyper-parameters default to the optimizer's defaults) and
        re-partition. Collective once OSS is built; moved optimizer state follows its parameter.
        Called on some ranks only (the others stepping, or adding another group), it is an
        error on every rank, with nothing changed: the param groups' agreement of :meth:`step`
        (one all-gather of 16 int64s a rank), then the trainable parameters' all-gather.
        """
        if not self._ready:  # torch's Optimizer.__init__ adding the initial groups
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"OSS.add_param_group(param_group=<{type(param_group).__name__}>): "
                            f"expected a dict with a 'params' key (and optional "
                            f"hyper-parameters such as 'lr')")
        new = args.normalize_param_groups([param_group])[0]
        named = "param_names" in self.param_groups[0]
        if ("param_names" in new) != named:
            raise ValueError(f"OSS.add_param_group: the new group's parameters are given "
                             f"{'without' if named else 'with'} names and the optimizer's "
                             f"{'with' if named else 'without'} (torch's rule: every group "
                             f"named, e.g. from named_parameters(), or none)")
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for i, p in enumerate(new["params"]):
            if id(p) in known:
                raise ValueError(f"OSS.add_param_group: parameter {i} (shape {tuple(p.shape)}) "
                                 f"is already in another param group; each parameter may be in "
                                 f"one group only")
        # the optimizer's own checks (LBFGS takes one param group only) before anything changes
        # or any collective starts: a trial over the groups' hyper-parameters, no parameters
        self._build_local_optimizer([{**_hyper(g), "params": []}
                                     for g in self.param_groups + [new]],
                                    caller="OSS.add_param_group")
        self._agree_on_param_groups("OSS.add_param_group", [new])
        frozen_with_gradient = self._check_every_rank_agrees(self.param_groups + [new],
                                                             "OSS.add_param_group")
        super().add_param_group(new)
        self._repartition(frozen_with_gradient)

    def refresh_trainable(self) -> None:
        """Re-partition after ``requires_grad`` changed on some parameters (every rank alike).
        Communication: one small all-gather of the trainable parameters' indices and shapes
        (ranks that froze different parameters get a ValueError on every rank, not a hang or
        a silent mix-up of parameters), after the param groups' agreement of :meth:`step`
        (a rank in another OSS call, or with other hyper-parameters, is an error on every
        rank); when ownership changes, moved state is also sent to its new owner.

        A frozen parameter that still holds a gradient on some rank (a tensor, e.g. zeroed by
        ``zero_grad(set_to_none=False)``) stays in the partition and is stepped, as a torch
        optimizer steps every parameter that has a gradient (weight decay and momentum still
        move it); once its gradient is ``None`` on every rank, the next refresh drops it (a
        frozen parameter without a gradient costs no optimizer state)."""
        self._sync.wait()
        self._agree_on_param_groups("OSS.refresh_trainable")
        self._repartition(self._check_every_rank_agrees(self.param_groups,
                                                        "OSS.refresh_trainable"))

    # ------------------------------------------------------------------ state dicts

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Gather the full optimizer state on ``recipient_rank`` (a rank of ``group``; ``-1``: on
        every rank), one shard at a time, on CPU; :meth:`state_dict` then returns it until the
        next :meth:`step` or :meth:`load_state_dict`.

        Hooks registered with ``register_state_dict_pre_hook`` run here, on every rank,
        before the state is gathered (this is where the dict is built).

        Communication: each rank's state once (``KΨ/N`` bytes per rank) plus small metadata,
        after the agreement of :meth:`step` (every rank in this call, with the same
        ``recipient_rank`` and param groups: an error on every rank otherwise, not a hang).
        """
        self._sync.wait()
        # Note: a bool is refused, not read as rank 0 or 1 (True, meant as "every rank" as in
        # state_dict(all_ranks=True), hung in the gather)
        if isinstance(recipient_rank, bool) or not isinstance(recipient_rank, int) \
                or not -1 <= recipient_rank < self.world_size:
            raise ValueError(f"OSS.consolidate_state_dict(recipient_rank={recipient_rank!r}): "
                             f"must be a rank of the group in [0, {self.world_size}) or -1 "
                             f"(every rank)")
        self._agree_on_param_groups("OSS.consolidate_state_dict",
                                    arguments={"recipient_rank": recipient_rank})
        for pre_hook in list(self._optimizer_state_dict_pre_hooks.values()):
            pre_hook(self)
        self._consolidated = None
        index_of = {id(p): i for i, p in
                    enumerate(p for g in self.param_groups for p in g["params"])}
        held = self._held_state()
        if self._whole_model and self.rank != 0:  # every rank holds the same state: send one
            held = {}
        local = {index_of[id(p)]: s for p, s in held.items()}
        groups = [{**_hyper(g), "params": [index_of[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        self._consolidated = consolidate_optimizer_state(local, groups, self.rank,
                                                         self.world_size, self.group,
                                                         recipient_rank)

    def state_dict(self, all_ranks: bool = False) -> dict:
        """The full optimizer state in torch's format (global parameter indices; loadable into
        a plain single-process optimizer of the same type), after :meth:`consolidate_state_dict`:
        the state gathered then, with the param groups' hyper-parameters as they are now (as
        torch and FairScale read them; a scheduler may have stepped since).
        ``all_ranks=True`` (FairScale's argument) consolidates on every rank first: then it is
        collective, and costs what ``consolidate_state_dict(-1)`` does. Hooks registered
        with ``register_state_dict_post_hook`` run on what is returned, as in torch (each
        call gets its own copy of the dict, its param groups and each parameter's state dict,
        so a hook that replaces or adds entries there does not change the consolidated
        state; tensors are shared, so an in-place tensor op does).
        """
        if not isinstance(all_ranks, bool):
            raise ValueError(f"OSS.state_dict(all_ranks={all_ranks!r}): must be True or False")
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                f"OSS.state_dict() on rank {self.rank}: no consolidated state here. Call "
                f"optimizer.consolidate_state_dict(recipient_rank) on every rank first (after the "
                f"last step), then state_dict() on the recipient (or recipient_rank=-1 for all)")
        # the hyper-parameters as they are now, as torch and FairScale give them: a scheduler
        # may have stepped, or a learning rate been set, since consolidate_state_dict
        current = {**self._consolidated,
                   "param_groups": [{**_hyper(g), "params": saved["params"]} for g, saved in
                                    zip(self.param_groups, self._consolidated["param_groups"])]}
        post_hooks = list(self._optimizer_state_dict_post_hooks.values())
        if not post_hooks:
            return current
        state_dict = {**current,
                      "state": {k: dict(s) for k, s in current["state"].items()}}
        for post_hook in post_hooks:
            returned = post_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full torch-format optimizer state dict, saved at any world size or by a plain
        torch optimizer; keep only the state of the parameters this rank owns. No communication.

        Checked first, for every parameter on every rank (:meth:`check_state_dict`), so that
        a bad dict raises the same ``ValueError`` everywhere and changes nothing: its groups
        and sizes, and, for torch's and shardkit's optimizers, each parameter's state keys
        (one the optimizer does not keep, or one its step reads that is missing).

        As in torch, hooks registered with ``register_load_state_dict_pre_hook`` first get
        (a shallow copy of) ``state_dict`` and may return a replacement, and those registered
        with ``register_load_state_dict_post_hook`` run once it is loaded.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        saved_groups, found = self._checked_state(state_dict)
        self._consolidated = None
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(_hyper(saved))
        local = {id(p) for g in self.optim.param_groups for p in g["params"]}
        self._load_local_state({p: s for p, (_, s) in found.items() if id(p) in local})
        # state of parameters frozen here: parked on one rank, picked by index
        self._parked_state = {p: s for p, (key, s) in found.items()
                              if id(p) not in local and p not in self.partition
                              and key % self.world_size == self.rank}
        for post_hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            post_hook(self)

    def check_state_dict(self, state_dict: dict, labels: Optional[list] = None) -> None:
        """Raise the ``ValueError`` :meth:`load_state_dict` would raise for ``state_dict``
        (its shape against the param groups, each state tensor's size, each parameter's state
        keys against those the optimizer keeps), changing nothing. ``labels``: what to call the
        parameter saved at index ``i`` in messages (``labels[i]``, e.g. its name; default
        ``i``). For a caller that holds only part of a state dict and must agree with the
        other ranks before loading (an engine checkpoint). Local, no communication."""
        self._checked_state(state_dict, labels)

    def _checked_state(self, state_dict: dict, labels: Optional[list] = None) -> tuple:
        """``(saved param groups, {param: (saved index, state)})`` of a checked full state dict
        (:meth:`check_state_dict`). Every parameter's saved state is checked on every rank,
        owned or not, so that every rank raises the same ValueError before anything changes.
        Local; one tiny trial step per kind of parameter (the keys' check)."""
        caller = "OSS.load_state_dict"
        saved_groups = check_full_state_dict(caller, state_dict, self.param_groups)
        found = {p: (key, checked_elementwise_state(caller, p, key, s))
                 for p, (key, s) in state_by_param(state_dict, self.param_groups).items()}
        if self._whole_model:  # LBFGS: one state over the whole model, not per parameter
            return saved_groups, found
        known: dict = {}
        for group, saved in zip(self.param_groups, saved_groups):
            hyper = self._local_hyper({**group, **_hyper(saved)})
            for p in group["params"]:
                if p not in found:
                    continue
                index, state = found[p]
                label = labels[index] if labels is not None and index < len(labels) \
                    else index
                problem = args.state_key_problem(caller, type(self.optim), hyper, p, label,
                                                 state, known)
                if problem:
                    raise ValueError(problem)
        return saved_groups, found

    # ------------------------------------------------------------------ overlapped sync

    def overlap_sync_with(self, module: torch.nn.Module) -> None:
        """Let the parameter sync of each :meth:`step` run on while ``module``'s next forward
        starts: each submodule waits, in a forward pre-hook, only for the buckets that hold its
        own parameters, the way FSDP prefetches (layers unfrozen or added to the optimizer
        later included). ``state_dict()`` and ``load_state_dict()`` of ``module`` or of any
        submodule (``ddp.module.state_dict()``) and every OSS method that reads or writes
        parameters wait for the whole sync first; so does :meth:`wait_for_sync`, which code
        that reads parameters outside ``module``'s forward must call first (a metric on ``p``
        directly, ``copy.deepcopy(model)``, ``model.to(...)`` / ``model.double()``, building
        ``DistributedDataParallel``: a conversion or copy made while the sync is in flight
        keeps the stale values). A submodule attached to ``module`` after this call has no
        hook: call ``overlap_sync_with(module)`` again (only the new submodules get hooks).
        Each hook costs a look-up of its own parameters per forward; the hooks hold the
        optimizer weakly (they do nothing once it is gone) and pickle as no-ops.
        Costs nothing on the wire (the same all-gathers, later); the buckets' buffers are the
        parameters' own storage, so it holds no extra memory. Local, no collective.

        .. warning:: a module whose forward reads another module's parameters without calling
           that module must be covered by ``overlap_sync_with`` on a module that owns them
           directly, or read them after :meth:`wait_for_sync`.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"OSS.overlap_sync_with(module={module!r}): expected an nn.Module")
        self._sync.overlap_with(module)

    def wait_for_sync(self) -> None:
        """Finish every bucket sync still in flight (a no-op unless :meth:`overlap_sync_with`
        is in use)."""
        self._sync.wait()

    # ------------------------------------------------------------------ Join (uneven inputs)

    def join_hook(self, **kwargs) -> OSSJoinHook:
        """For ``torch.distributed.algorithms.join.Join([ddp, optimizer])``, as torch's
        ``ZeroRedundancyOptimizer``: a rank that has run out of batches shadows the others'
        steps (:class:`~shardkit.optim.oss_join.OSSJoinHook`). Takes no keyword arguments."""
        return OSSJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """The device of the parameters (``Join``'s counting all-reduce runs there)."""
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    @property
    def join_process_group(self):
        """The group the parameters are sharded over (the default group's object when none
        was given, as DDP's ``process_group``: ``Join`` compares them)."""
        return self.group if self.group is not None else torch.distributed.group.WORLD

    # ------------------------------------------------------------------ step in backward
    # Called by ShardedDataParallel(step_in_backward=True), not by users: the parameters of a
    # sync bucket are stepped, and their all-gather started, as soon as backward has reduced
    # their gradients; the user's step() then only completes what backward left.

    def _check_steps_per_parameter(self, what: str) -> None:
        if not steps_each_parameter_alone(self.optim):
            raise ValueError(f"{what}: the optimizer {type(self.optim).__name__} does not "
                             f"update each parameter on its own, so it cannot be stepped bucket "
                             f"by bucket; use SGD, Adam, AdamW or Adagrad, or leave it off")

    def _prepare_step_in_backward(self, sync_group, module: torch.nn.Module) -> None:
        self.comm.prepare(sync_group)
        self._sync.use_group(sync_group)
        self.overlap_sync_with(module)

    def _sync_bucket_params(self) -> list[list[torch.Tensor]]:
        return [self._sync.params_of_bucket(i) for i in range(len(self._sync.buckets))]

    def _begin_step_in_backward(self) -> None:
        self._check_trainable_covered()
        # the step begins here (every rank alike, before this backward reduces anything): the
        # ranks agree on the hyper-parameters it pushes, as OSS.step does
        self._agree_on_param_groups("OSS.step")
        # before this backward reduces anything the gradients are not final: only settings
        # that step no parameter at all are told here (every rank alike)
        self._check_gradients_steppable("ShardedDataParallel(step_in_backward=True) stepping OSS",
                                        with_gradients=False)
        self._consolidated = None
        self._sync.rebind_if_moved()  # first: the fused choice reads the buckets' dtypes
        # (no gradient read yet: ShardedDataParallel reduces sparse ones densely)
        self._settle_fused_choice(sparse_gradients=False)
        self._push_hyperparameters()
        self._stepped_in_backward = set()

    @torch.no_grad()
    def _step_bucket_in_backward(self, index: int) -> None:
        self._sync.step_bucket(index, self._step_only)
        self._stepped_in_backward.add(index)

    def _step_only(self, params: list) -> None:
        step_only(self.optim, params, {})

    def _refuse_loss_scaling(self) -> None:
        if "found_inf" not in self.__dict__:
            return
        self._forget_scaler_handoff()
        raise RuntimeError("OSS.step: called by a GradScaler, but " + STEPPED_WITH_SCALED_GRADS)

    def _finish_step_begun_in_backward(self, closure, kwargs):
        self._refuse_loss_scaling()
        if closure is not None or kwargs:
            raise ValueError("OSS.step: backward already stepped the parameters "
                             "(ShardedDataParallel(step_in_backward=True)); a closure or step "
                             "arguments cannot be honoured, call optimizer.step() bare")
        done, self._stepped_in_backward = self._stepped_in_backward, None
        for index in range(len(self._sync.buckets)):
            if index not in done:
                self._sync.step_bucket(index, self._step_only)
        self._pull_hyperparameters()
        return None

    # ------------------------------------------------------------------ mechanism

    def _build_local_optimizer(self, groups: list[dict],
                               caller: Optional[str] = None) -> torch.optim.Optimizer:
        owned = {id(p) for params in self.partition.params_of(self.rank) for p in params}
        if self._whole_model:  # every parameter, frozen ones too, as the plain optimizer has
            owned = {id(p) for g in groups for p in g["params"]}
        try:
            built = build_local_optimizer(self._optim_class, self._optim_kwargs, groups, owned,
                                          self.fused, self._template)
        except (ValueError, TypeError) as error:  # torch's check of a hyper-parameter
            kind = ValueError if isinstance(error, ValueError) else TypeError
            raise kind(f"{caller or 'OSS'}(optim={args.optimizer_name(self._optim_class)}): "
                       f"the optimizer refused its arguments: {error}") from error
        if self._optim_is_factory:
            args.check_built_optimizer(self._optim_class, built, caller or "OSS")
        return built

    def _load_local_state(self, state: dict) -> None:
        """Give the local optimizer ``{owned param: state}`` and the public hyper-parameters.
        The next step checks the fused kernel's choice again (:meth:`_settle_fused_choice`:
        loaded state keeps the layout it was saved in)."""
        load_into_optimizer(self.optim, state, [self._local_hyper(g) for g in self.param_groups])
        self._fused_layout_checked = self._state_laid_out_for = None

    def _hand_over_state(self, state: dict) -> None:
        """Give the rebuilt local optimizer the state ``{owned param: state}`` it carries on
        with after a re-partition, as it was held: loaded as :meth:`_load_local_state` does,
        then each tensor torch's ``load_state_dict`` cast to its parameter's dtype put back as
        it was. A re-partition is no checkpoint load, and a torch optimizer keeps its state in
        the dtype it was made in (fp32 momentum of a model cast to fp64 later stays fp32);
        cast, the next steps differed from one process. Local."""
        self._load_local_state(state)
        for p, held in state.items():
            loaded = self.optim.state.get(p)
            if loaded is None:
                continue
            for key, value in held.items():
                now = loaded.get(key)
                if (torch.is_tensor(value) and torch.is_tensor(now) and now.dtype != value.dtype
                        and now.shape == value.shape and now.device == value.device):
                    loaded[key] = value

    def _held_state(self) -> dict:
        """``{param: state}`` this rank really holds: its local optimizer's parameters' and the
        parked state of frozen ones.

        Note: the local optimizer's ``state`` is torch's defaultdict, so a user who reads
        ``optimizer.state[p]`` for a parameter another rank owns (logging every parameter's
        ``exp_avg``) adds an empty entry here. Sent on a re-partition, it overwrote the
        owner's real state (Adam restarted from step 0 after ``refresh_trainable``)."""
        local = {id(p) for g in self.optim.param_groups for p in g["params"]}
        return {**self._parked_state,
                **{p: s for p, s in self.optim.state.items() if id(p) in local}}

    def _owned_per_group(self, rank: int) -> list[list[torch.Tensor]]:
        return [[p for p in g["params"] if p in self.partition and self.partition.owner(p) == rank]
                for g in self.param_groups]

    def _owned_params(self) -> list[torch.Tensor]:
        return [p for params in self._owned_per_group(self.rank) for p in params]

    @property
    def _default_device(self) -> torch.device:
        """The device of the first parameter of any group (FairScale's property of the same
        name); a group may be empty (Hugging Face's weight-decay groups can be), CPU if all are."""
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return first.device if first is not None else torch.device("cpu")

    def _check_trainable_covered(self) -> None:
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad and (p not in self.partition or p in self._frozen_members):
                    raise RuntimeError(
                        f"OSS.step: parameter {i} of param group {g} (shape {tuple(p.shape)}) "
                        f"became trainable after the partition was made; call "
                        f"optimizer.refresh_trainable() on every rank after changing "
                        f"requires_grad")

    def _local_hyper(self, group: dict) -> dict:
        """A public group's hyper-parameters as the local optimizer runs them (with OSS's
        fused-kernel choice written in where the group leaves the implementation to torch)."""
        # Note: no param_names: the local groups name their own (owned) parameters only
        return with_fused_choice(_hyper(group, names=False), self.fused)

    def _push_hyperparameters(self) -> None:
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update(self._local_hyper(group))

    def _pull_hyperparameters(self) -> None:
        for group, local in zip(self.param_groups, self.optim.param_groups):
            group.update(without_fused_choice(_hyper(local, names=False), self.fused))

    def _check_every_rank_agrees(self, groups: list[dict], caller: str) -> list[set]:
        """Before re-partitioning: every rank must see the same trainable parameters, or each
        would compute another partition (a hang in the state exchange, or one parameter's
        values synced into another). Nothing is changed when they differ. Returns, per group,
        the indices of the frozen parameters that hold a gradient on some rank."""
        self._sync.wait()
        return args.check_same_model_on_every_rank(
            groups, self.group, caller,
            advice="change requires_grad, and add param groups, identically",
            refusal=args.tensor_parallel_refusal(groups, self.group))

    def _plan_stepped(self, groups: list[dict], frozen_with_gradient: list[set]):
        """The ownership plan of the parameters a torch optimizer over ``groups`` would step:
        the trainable ones and the frozen ones in ``frozen_with_gradient`` (per group, item
        indices agreed by every rank). Local."""
        stepped = [[p for i, p in enumerate(g["params"]) if p.requires_grad or i in held]
                   for g, held in zip(groups, frozen_with_gradient)]
        return plan_ownership(stepped, self.world_size, self.bucket_numel)

    def _repartition(self, frozen_with_gradient: list[set]) -> None:
        """Re-plan the ownership (:meth:`_plan_stepped`), moving the optimizer state of the
        parameters that change owner."""
        self._sync.wait()
        # recorded even when the plan stays: a member made trainable again is no longer one
        self._frozen_members = _items_of(self.param_groups, frozen_with_gradient)
        plan = self._plan_stepped(self.param_groups, frozen_with_gradient)
        self._return_lent_gradients(plan.partition)
        if plan.same_as(self._plan):
            return
        held = self._held_state()
        new = plan.partition
        if self._whole_model:  # every rank keeps the whole state: nothing moves
            self._plan = plan
            self._sync.relayout(plan)
            self.optim = self._build_local_optimizer(self.param_groups)
            self._hand_over_state(held)
            self._consolidated = None
            return
        arriving = send_state_to_new_owners(new, held, self.rank, self.group)
        self._lend_frozen_gradients(new)
        kept = {p: s for p, s in held.items() if p in new and new.owner(p) == self.rank}
        # Note: the state of a parameter that left the partition (frozen) stays parked on its
        # last owner, so that it resumes where it stopped once trainable again, as in torch.
        self._parked_state = {p: s for p, s in held.items() if p not in new}
        self._plan = plan
        self._sync.relayout(plan)
        self.optim = self._build_local_optimizer(self.param_groups)
        self._hand_over_state({**kept, **arriving})
        self._consolidated = None

    def _lend_frozen_gradients(self, new: ParameterPartition) -> None:
        """Give a frozen parameter that holds a gradient (stepped, as torch steps it) and
        changes owner a copy of that gradient on its new owner, where that rank holds none:
        under ShardedDDP only the owner holds it. The copy is lent (:meth:`_return_lent_
        gradients`); the old owner keeps its own, which ShardedDDP carries into the reduction
        once the parameter trains again. Before :attr:`_plan` changes.

        Communication, only where such parameters exist (the same on every rank): one object
        all-gather of the wanted indices, one of the gradients (CPU copies of them alone)."""
        old = self._plan.partition
        # in the partition's order: alike on every rank
        moving = [p for p in new.all_params() if p in self._frozen_members and p in old]
        if not moving:
            return
        wanted = [i for i, p in enumerate(moving)
                  if new.owner(p) == self.rank != old.owner(p) and p.grad is None]
        asked = {i for ask in distributed.all_gather_object(wanted, group=self.group)
                 for i in ask}
        sent = {i: moving[i].grad.detach().to("cpu", copy=True).contiguous() for i in asked
                if old.owner(moving[i]) == self.rank and moving[i].grad is not None}
        for given in distributed.all_gather_object(sent, group=self.group):
            for i, grad in given.items():
                if i in wanted:
                    p = moving[i]
                    p.grad = grad.to(p.device)
                    self._lent_grads[p] = id(p.grad)

    def _return_lent_gradients(self, new: ParameterPartition) -> None:
        """Drop the lent copies (:meth:`_lend_frozen_gradients`) of parameters that train
        again, hold no gradient anymore, or leave this rank: the old owner's own gradient,
        carried by ShardedDDP, counts once in the next reduction (the copy would count it a
        second time). A copy the user replaced (another tensor) is theirs. Local."""
        for p, grad_id in list(self._lent_grads.items()):
            if p in self._frozen_members and p in new and new.owner(p) == self.rank:
                continue
            del self._lent_grads[p]
            if p.grad is not None and id(p.grad) == grad_id:
                p.grad = None


def _agreement_row(method: str, settings: dict) -> list[int]:
    """``[method code, crc32 of the settings]``: one rank's row of an OSS agreement."""
    return [_AGREEING_METHODS.index(method), zlib.crc32(repr(sorted(settings.items())).encode())]


def _check_rows_shape(every: list, world_size: int) -> None:
    """Raise a ValueError (on every rank alike: every rank holds the same rows) unless
    ``every`` holds ``world_size`` rows of two ints naming an OSS agreement's method. Local."""
    if len(every) != world_size or any(len(row) != 2 for row in every):
        raise ValueError(f"OSS.agreed_in_advance(rows=...): expected {world_size} rows of 2 "
                         f"ints (every rank's agreement_row, in group-rank order), got "
                         f"{[len(row) for row in every]} ints in each of {len(every)} rows")
    codes = range(len(_AGREEING_METHODS))
    if any(int(code) not in codes for code, _ in every):
        raise ValueError(f"OSS.agreed_in_advance(rows=...): the rows {every} are not OSS "
                         f"agreement rows (a row's first int names the call, one of "
                         f"{list(codes)}); pass every rank's agreement_row, in group-rank order")


# The private names of torch.amp.GradScaler.step that _record_in_calling_torch_scaler reads:
# its local variables holding the optimizer and its per-optimizer record, the record's key of
# the per-device inf/nan flags, and the scaler's scale attribute.
_TORCH_STEP_OPTIMIZER = "optimizer"
_TORCH_STEP_RECORD = "optimizer_state"
_TORCH_RECORD_FLAGS = "found_inf_per_device"
_TORCH_SCALER_SCALE = "_scale"


class _UnknownScalerRecord(LookupError):
    """torch's ``GradScaler.step`` frame was found, but not the record OSS writes into."""


def _record_in_calling_torch_scaler(optimizer: OSS, found_inf_anywhere: bool) -> bool:
    """Make the ``torch.amp.GradScaler.step`` call that is stepping ``optimizer`` (a
    subclass's too, unless it overrides ``step``) record what every rank agreed: inf/nan found
    when ``found_inf_anywhere``, and a flag at all where this rank held no gradient. Return
    whether there was such a call; raise :class:`_UnknownScalerRecord` (naming what is
    missing) when there is one but its record is not under the names above (another torch).

    Why: torch's scaler checks only the gradients this rank holds. Where another rank's owned
    shard overflowed it recorded "finite" here, and its ``update()`` grew this rank's scale
    while the other ranks backed theirs off; where this rank holds no gradient of the
    optimizer (a rank owning no parameter) it recorded nothing, and its ``update()`` raised
    while the others went on into the next collective. The flags ``update()`` reads are
    reachable from that call only (the ``found_inf`` it hands ``step`` is a sum, a new tensor),
    so they are looked up in its frame. Local."""
    frame = _torch_scaler_step_frame(optimizer, sys._getframe(1))
    try:
        if frame is None:
            return False
        flags, scale = _scaler_record_of(frame)
        if not flags:
            flags[scale.device] = torch.zeros((), dtype=torch.float32, device=scale.device)
        if found_inf_anywhere:
            for flag in flags.values():
                flag.fill_(1.0)
        return True
    finally:
        del frame  # no reference cycle through the frames


def _torch_scaler_step_frame(optimizer: OSS, frame):
    """The frame, from ``frame`` outwards, of ``torch.amp.GradScaler.step`` stepping
    ``optimizer``, or None (:class:`_UnknownScalerRecord` where such a frame has no local
    variable of that name, or ``step`` is no plain function)."""
    step_code = getattr(getattr(torch.amp.GradScaler, "step", None), "__code__", None)
    if step_code is None:
        raise _UnknownScalerRecord("no plain function GradScaler.step")
    while frame is not None:
        if frame.f_code is step_code:
            if _TORCH_STEP_OPTIMIZER not in frame.f_locals:
                raise _UnknownScalerRecord(f"no local {_TORCH_STEP_OPTIMIZER!r} in "
                                           f"GradScaler.step")
            if frame.f_locals[_TORCH_STEP_OPTIMIZER] is optimizer:
                return frame
        frame = frame.f_back
    return None


def _scaler_record_of(frame) -> tuple[dict, torch.Tensor]:
    """``(per-device inf/nan flags, scale)`` of a ``GradScaler.step`` frame, or
    :class:`_UnknownScalerRecord` naming the first private name not found as expected."""
    local = frame.f_locals
    record = local.get(_TORCH_STEP_RECORD)
    if not isinstance(record, dict):
        raise _UnknownScalerRecord(f"no dict {_TORCH_STEP_RECORD!r} in GradScaler.step")
    flags = record.get(_TORCH_RECORD_FLAGS)
    if not isinstance(flags, dict) or not all(torch.is_tensor(f) for f in flags.values()):
        raise _UnknownScalerRecord(f"no dict of tensors {_TORCH_STEP_RECORD}"
                                   f"[{_TORCH_RECORD_FLAGS!r}] in GradScaler.step")
    scale = getattr(local.get("self"), _TORCH_SCALER_SCALE, None)
    if not torch.is_tensor(scale):
        raise _UnknownScalerRecord(f"no tensor GradScaler.{_TORCH_SCALER_SCALE}")
    return flags, scale


def _unscale_grads(params: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """Divide every gradient of ``params`` by ``grad_scale`` in place, with the reciprocal
    torch's GradScaler uses (computed in fp64), so the result is the same to the last bit."""
    inv_scale = grad_scale.double().reciprocal().float()
    for p in params:
        if p.grad is not None:
            p.grad.mul_(inv_scale.to(p.grad.device))


def _hyper(group: dict, names: bool = True) -> dict:
    return {k: v for k, v in group.items()
            if k != "params" and (names or k != "param_names")}


def _names_of(group: dict, params: list) -> dict:
    """``{"param_names": ...}`` of ``params`` (a subset of ``group``'s), if the group is named."""
    if "param_names" not in group:
        return {}
    name_of = {id(p): n for p, n in zip(group["params"], group["param_names"])}
    return {"param_names": [name_of[id(p)] for p in params]}


def _first_of_each_kind(params: list, partition: ParameterPartition,
                        with_gradients: bool = True) -> dict:
    """``{(dim, dtype, device, gradient layout): (index, parameter)}``: the first parameter of
    ``params`` in ``partition`` of each kind an optimizer may step differently (layout:
    ``"sparse"``, ``"dense"`` or ``None`` without a gradient, or for every parameter when not
    ``with_gradients``)."""
    kinds: dict = {}
    for i, p in enumerate(params):
        if p in partition:
            layout = None if not with_gradients or p.grad is None else \
                "sparse" if p.grad.is_sparse else "dense"
            kinds.setdefault((p.dim(), p.dtype, p.device, layout), (i, p))
    return kinds


def _items_of(groups: list[dict], indices: list[set]) -> set:
    """The parameters at ``indices`` (per group, item indices) of ``groups``."""
    return {p for g, held in zip(groups, indices) for i, p in enumerate(g["params"]) if i in held}


def _trainable(groups: Iterable[dict]) -> list[list[torch.Tensor]]:
    return [[p for p in g["params"] if p.requires_grad] for g in groups]
