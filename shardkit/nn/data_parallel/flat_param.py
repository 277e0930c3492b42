"""The sharding mechanism of one FullyShardedDataParallel unit.

A :class:`FlatParamShard` owns the parameters of one unit. Each parameter is cut on dim 0 into
``N`` equal row blocks (the last padded with zero rows); this rank's block stays the *same*
``nn.Parameter`` object, whose ``.data`` becomes a view into one flat shard buffer, so an
optimizer built before or after wrapping steps exactly the values that are trained.

For compute, the unit's shards are all-gathered by one operation of the wrapper's transport
(:meth:`shardkit.transport.Transport.all_gather_chunks`) into one flat leaf tensor ``full``
(compute dtype): each rank's row block of every parameter lands in place (the process-group
transport sends straight into ``full`` on gloo, and gathers rank-major and unpacks on NCCL). The
module sees views of ``full`` in place of its parameters. Backward hands the unit the full
gradient of each parameter as autograd produced it (no flat ``full.grad``: joining them would copy
the unit's whole gradient); one transport operation
(:meth:`shardkit.transport.Transport.reduce_scatter_chunks`) reduce-scatters them, divided by
``N``, into the shards' ``.grad`` (the process-group transport sends each rank its chunks
straight from those gradients on gloo, and packs rank-major with ``pack_rank_major`` on NCCL);
the wrapper finishes it once the next unit's reduce-scatter is issued.

Hybrid sharding adds a ``replicate_group``: the shards are identical on its ranks, and after the
reduce-scatter the gradient shard is all-reduced over it (gradients are pre-divided by
``N x replicas``). hpZ adds an ``hpz_group`` (a node-sized block of ``group``): when the
forward gather is freed, each rank keeps its rows of a ``hpz``-way secondary partition, and the
backward gather is an all-gather over ``hpz_group`` only.

Memory per unit: the flat shard (``Ψ_u/N`` + padding, master dtype) always; ``full`` (``Ψ_u``,
compute dtype) only between gather and free; a transport may hold a rank-major scratch buffer
until the gather completes; the per-parameter gradients (``Ψ_u``, compute dtype), or the
transport's packed copy of them, until the reduce-scatter completes; with hpZ, the secondary
partition (``Ψ_u/h``, compute dtype) from the forward free to the backward gather.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.autograd.graph import GradientEdge, get_gradient_edge

from shardkit import distributed as skdist
from shardkit.checkpoint.resharding import ParamLayout, shard_rows, unshard_rows
from shardkit.collective_check import CollectiveMismatchError
from shardkit.kernels import pack_rank_major, unpack_rank_major
from shardkit.transport import CommHandle, Transport
from shardkit.utils.weak_hooks import weakly_bound

__all__ = ["ParamLayout", "FlatParamShard", "GatheredParamBytes", "gathered_param_bytes",
           "gathered_param_edges", "shard_rows", "unshard_rows"]


class GatheredParamBytes:
    """Process-wide count of bytes held by gathered (unsharded) parameters.

    ``live`` is what is gathered now (full buffers plus all-gather scratch in flight), ``peak``
    the high-water mark since :meth:`reset_peak`, ``prefetched`` how many gathers were already
    in flight when their unit needed them. Tests use it to check that only one or two units are
    ever gathered at once and that prefetching happens.
    """

    def __init__(self):
        self.live = 0
        self.peak = 0
        self.prefetched = 0

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more as gathered, raising ``peak`` if ``live`` passes it."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def sub(self, nbytes: int) -> None:
        """Count ``nbytes`` as released."""
        self.live -= nbytes

    def reset_peak(self) -> None:
        """Start a new high-water mark from what is gathered now."""
        self.peak = self.live


_GATHERED = GatheredParamBytes()


def gathered_param_bytes() -> GatheredParamBytes:
    """The process-wide :class:`GatheredParamBytes` counter."""
    return _GATHERED


def outside_autocast(method):
    """Run ``method`` with the caller's autocast turned off.

    A unit's own tensor work (packing shards for the all-gather, casting and packing
    gradients for the reduce-scatter, unpacking, writing back) runs inside the user's forward,
    and inside backward when ``loss.backward()`` is called in the autocast block, as
    FairScale's tests do. Autocast must not reach it: it would retype ``torch.cat`` and the
    arithmetic on the packed buffers, and on CPU it refuses a 16-bit dtype other than its
    own ("Unexpected floating ScalarType in at::autocast::prioritize": fp16 units under
    ``torch.autocast("cpu")``'s bf16). Costs two flag reads when autocast is off."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not on:
            return method(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return method(*args, **kwargs)
    return run


def check_one_dtype(params, locations: Optional[list] = None) -> None:
    """ValueError unless the unit's ``params`` share one dtype (one flat buffer), naming a few
    parameters of each dtype where their ``locations`` (per parameter, its ``(module, name)``
    places) are given. Local."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) < 2:
        return
    found = sorted(str(d) for d in dtypes)
    if locations is not None:
        found = [f"{d} ({_first_locations(params, locations, d)})" for d in sorted(
            dtypes, key=str)]
    raise ValueError(f"FullyShardedDataParallel: one unit's parameters must share a "
                     f"dtype; found {', '.join(found)}. Wrap the differently-typed "
                     f"submodules as their own units (shardkit.nn.wrap.split_dtypes_policy "
                     f"does it over a wrap policy), or cast them to one dtype")


def _first_locations(params, locations: list, dtype: torch.dtype, most: int = 3) -> str:
    """The places of the first ``most`` of ``params`` of ``dtype``, for error messages."""
    of_dtype = [_where(where) for p, where in zip(params, locations) if p.dtype == dtype]
    more = f" and {len(of_dtype) - most} more" if len(of_dtype) > most else ""
    return "; ".join(of_dtype[:most]) + more


def _read_all_zero(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether it holds only zeros (an empty one does). Local; one device sync
    for all of them."""
    if not tensors:
        return []
    flags = [~t.detach().reshape(-1).any() for t in tensors]
    return torch.stack([f.to(flags[0].device) for f in flags]).tolist()


def _show_as_grad(p: nn.Parameter, full: torch.Tensor) -> torch.Tensor:
    """Make ``full`` (the parameter's local gradient in its full shape, maybe in the compute
    dtype or on the compute device) ``p.grad``, although ``p`` holds only its shard: torch's
    shape, dtype and device check on ``.grad`` is passed with a shard-shaped placeholder
    whose ``.data`` is then swapped (torch FSDP1 does the same inside ``no_sync``)."""
    p.grad = torch.empty_like(p)
    p.grad.data = full
    return p.grad


# the units whose last backward ran inside ``no_sync`` (see seal_held_grads); the optimizer
# step pre-hook below is registered once, the first time a unit holds such gradients
_HOLDING_GRADS: "weakref.WeakSet[FlatParamShard]" = weakref.WeakSet()
_STEP_HOOK: list = []


def _watch_optimizer_steps_over_held_grads(shard: "FlatParamShard") -> None:
    _HOLDING_GRADS.add(shard)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_pre_hook(
            _refuse_a_step_over_held_grads))


def _refuse_a_step_over_held_grads(optimizer, args, kwargs) -> None:
    """Every ``torch.optim.Optimizer.step`` (``GradScaler.step`` and OSS's inner step too),
    before it changes anything: a ``RuntimeError`` when the optimizer holds a parameter whose
    gradient a backward inside ``no_sync`` accumulated and no synchronising backward has
    reduced yet.

    Note: in one process a step between the micro-batches of an accumulation cycle steps
    with what was accumulated so far. Here (as in torch FSDP1) that gradient is the local,
    unreduced one, shown in ``.grad`` in the parameter's full shape while the parameter holds
    its shard: a step cannot use it. Every rank ran the same backwards, so every rank raises.
    Costs a set lookup when no unit holds such gradients; otherwise one pass over the
    optimizer's parameters and one device sync per holding unit (a ``.grad`` zeroed in
    place since, ``optimizer.zero_grad(set_to_none=False)``, discards it)."""
    for shard in list(_HOLDING_GRADS):
        if shard._sealed is None or shard._grad_pieces is None:
            _HOLDING_GRADS.discard(shard)
    if not _HOLDING_GRADS:
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for shard in sorted(_HOLDING_GRADS, key=lambda unit: unit.label[0]):
        held = [i for i in shard.params_with_held_grads() if id(shard.params[i]) in stepped]
        if held:
            raise RuntimeError(
                f"FullyShardedDataParallel: {type(optimizer).__name__}.step() was called while "
                f"unit {shard.label[1]!r} holds gradients accumulated inside no_sync() that no "
                f"synchronising backward has reduced yet (of {_where(shard.locations[held[0]])}"
                f"{f' and {len(held) - 1} more' if len(held) > 1 else ''}): .grad holds "
                f"this rank's unreduced gradient in the parameter's full shape until then, "
                f"which a step of the shard cannot use. Run the last backward of the accumulation "
                f"cycle outside no_sync() (or with require_backward_grad_sync = True) before "
                f"stepping, or call optimizer.zero_grad() / model.zero_grad() to discard them")


class FlatParamShard:
    """The parameters of one unit: their flat shard, the gather into compute views, and the
    reduce-scatter of their gradients.

    Args:
        params: the unit's distinct parameters (each appears once, even if tied).
        locations: for each parameter, the ``(module, attribute)`` pairs that hold it.
        group: process group to shard over; ``world_size``/``rank`` are read from it.
        compute_dtype / reduce_dtype: dtypes of the gathered parameters and of the
            reduce-scatter (from the unit's
            :class:`~shardkit.nn.data_parallel.MixedPrecisionPolicy`).
        compute_device / storage_device: where compute happens and where the shard lives
            (they differ only under CPU offload with a GPU).
        on_grad_ready: called with this object once backward has produced the unit's gradients.
        transport: what carries the all-gathers and reduce-scatters.
        replicate_group: ranks holding the same shard (hybrid sharding, NO_SHARD): gradient
            shards are all-reduced over it after the reduce-scatter. ``None``: no replicas.
        hpz_group: hpZ's secondary partition group (a block of ``group``, e.g. one node):
            the backward gather runs over it from the rows kept at the forward free.
        reduce_group: the group over ``group``'s ranks that carries the reduce-scatter
            (default ``group``).
    """

    def __init__(self, params: Sequence[nn.Parameter], locations: Sequence[list],
                 group, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 compute_device: torch.device, storage_device: torch.device,
                 on_grad_ready: Callable[["FlatParamShard"], None], transport: Transport,
                 replicate_group=None, hpz_group=None, reduce_group=None):
        self.params = list(params)
        self.locations = [list(locs) for locs in locations]
        self.group = group
        self.reduce_group = group if reduce_group is None else reduce_group
        self.transport = transport
        self.world_size = skdist.get_world_size(group)
        self.rank = skdist.get_rank(group)
        self.replicate_group = replicate_group
        self.replicas = 1 if replicate_group is None else skdist.get_world_size(replicate_group)
        self.hpz_group = hpz_group
        # gradients are divided by ``predivide`` before the reduce-scatter and by
        # ``postdivide`` after; together by N x replicas, the mean over the data-parallel ranks
        self.predivide, self.postdivide = float(self.world_size * self.replicas), 1.0
        check_one_dtype(self.params)
        self.master_dtype = self.params[0].dtype if self.params else torch.float32
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.compute_device = compute_device
        self.storage_device = storage_device
        self.layouts = [ParamLayout(p.shape, self.world_size) for p in self.params]
        self.chunk_numels = [lay.chunk_numel for lay in self.layouts]
        self.numels = [lay.numel for lay in self.layouts]
        self.shard_numel = sum(self.chunk_numels)
        self._secondary = None  # hpZ: this rank's rows of the hpz-way partition, or None
        if hpz_group is not None:
            self.hpz_layouts = [ParamLayout(p.shape, skdist.get_world_size(hpz_group))
                                for p in self.params]
            self.hpz_rank = skdist.get_rank(hpz_group)
        self.flat_shard = self._shard_into_flat_buffer()
        self._on_grad_ready = on_grad_ready
        self.exposed_in_task = -1  # see expose()
        # the autograd nodes of the splits of ``full`` made by forwards, held weakly (they die
        # with their graph): see forward_views_in_this_backward
        self._forward_splits: list = []
        self._grad_pieces: Optional[list] = None  # backward's gradient, one tensor per parameter
        # this backward's gradients of the parameters with the user's tensor hooks, held until
        # every use of the unit delivered (see run_tensor_hooks)
        self._hooked_pieces: Optional[list] = None
        self._used: Optional[list] = None  # per parameter: whether a gradient reached it here
        # per parameter: whether its held gradient is a tensor of the unit's own (made by a
        # sum or a copy here), not autograd's, which may also be another tensor's gradient
        self._owned: Optional[list] = None
        # per parameter, as a backward inside no_sync left the held gradients: the ``.grad``
        # showing it (weakly), the ``.grad`` it replaced and the shown one's version (see
        # seal_held_grads)
        self._sealed: Optional[list] = None
        # per parameter, the ``.grad`` of earlier steps that seal_held_grads folded into the
        # held gradient (see _fold_kept_grad), kept to restore should the cycle be dropped
        self._kept_folded: Optional[list] = None
        self._reducing_used: Optional[list] = None  # the same, for the reduce in flight
        # (tag, name) of the unit, set by the root: see _check_every_rank_reduced_this
        self.label: tuple[int, str] = (1, "a unit")
        self.full = self._make_full_leaf()
        # Note: one autograd split of ``full`` per forward; each hands its gradients over, and
        # also feeds this one-element leaf, whose gradient autograd accumulates once every split
        # of the unit on the backward's path has run: only then is the unit's gradient whole
        # (a module called twice before one backward) and its reduce-scatter due.
        self._uses = torch.zeros(1, device=compute_device, requires_grad=True)
        self._uses.register_post_accumulate_grad_hook(weakly_bound(self._every_use_delivered))
        self.gathered = False
        self._pending_gather = None
        self._pending_reduce = None
        # torch FSDP1's communication hook (see set_comm_hook): None, the transport reduces
        self.comm_hook: Optional[Callable] = None
        self.comm_hook_state = None
        self._hook_all_reduces = False  # NO_SHARD: hook(state, grad), all-reduced in place
        self._exposed = False
        self.exposed_with_grad = False  # the exposed views have autograd history (expose)
        self._kept_from: Optional[int] = None  # fingerprint of the shard a kept ``full`` is of
        # read outside the unit's forward, with gradients, by a parent in the root's forward:
        # the unit stays gathered until freed (its backward), see FullyShardedDataParallel
        # ._read_in_the_roots_forward
        self.held_for_a_read = False

    # ------------------------------------------------------------------ construction

    def _shard_into_flat_buffer(self) -> torch.Tensor:
        """Copy this rank's rows of every parameter into one flat buffer and re-point each
        parameter's ``.data`` at its slice (the full tensors are released)."""
        pin = self.storage_device.type == "cpu" and torch.cuda.is_available()
        flat = torch.zeros(self.shard_numel, dtype=self.master_dtype, device=self.storage_device,
                           pin_memory=pin)
        for p, lay, view in zip(self.params, self.layouts, self.shard_views(flat)):
            with torch.no_grad():
                view.copy_(shard_rows(p.detach(), lay, self.rank))
            p.data = view
        return flat

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat shard-sized buffer, one per parameter, in shard shape."""
        pieces = flat.split(self.chunk_numels)
        return [piece.view(lay.shard_shape) for piece, lay in zip(pieces, self.layouts)]

    def _make_full_leaf(self) -> torch.Tensor:
        full = torch.empty(sum(self.numels), dtype=self.compute_dtype, device=self.compute_device)
        full.untyped_storage().resize_(0)
        full.requires_grad_(True)
        return full

    @property
    def full_bytes(self) -> int:
        """Bytes of the gathered parameters (``full``): every parameter's unpadded elements in
        the compute dtype."""
        return sum(self.numels) * self.full.element_size()

    @property
    def local_numel(self) -> int:
        """Elements of real (unpadded) parameter data in this rank's shard."""
        return sum(max(0, min(lay.chunk_numel, lay.numel - self.rank * lay.chunk_numel))
                   for lay in self.layouts)

    @property
    def padded_numel(self) -> int:
        """Elements all-gathered or reduce-scattered per collective: ``N x shard``."""
        return self.shard_numel * self.world_size

    # ------------------------------------------------------------------ all-gather

    def refuse_parameters_no_longer_registered(self) -> None:
        """A RuntimeError when a module of the unit no longer holds, where the unit found it,
        the parameter the unit shards (removed, re-registered, or swapped for another tensor
        by ``torch.func.functional_call``): the unit would compute with its own. Local."""
        for p, lay, locs in zip(self.params, self.layouts, self.locations):
            for module, name in locs:
                if module._parameters.get(name) is not p:
                    raise RuntimeError(removed_after_wrapping(module, name, lay))

    def _readopt_shards(self) -> None:
        """Keep the invariant 'each parameter views the flat shard' even if a user replaced a
        parameter's ``.data`` (e.g. ``load_state_dict(assign=True)``): copy it back in."""
        self.refuse_parameters_no_longer_registered()
        for p, view, lay, locs in zip(self.params, self.shard_views(self.flat_shard),
                                      self.layouts, self.locations):
            if p.data.data_ptr() != view.data_ptr() or p.data.shape != view.shape:
                if p.data.numel() != view.numel():
                    raise RuntimeError(_resized_after_wrapping(p, lay, locs))
                with torch.no_grad():
                    view.copy_(p.data.reshape(view.shape))
                p.data = view

    @outside_autocast
    def start_gather(self, prefetch: bool = False, from_secondary: bool = False) -> None:
        """Issue the unit's all-gather asynchronously (no-op when gathered or in flight).

        Wire: ``(N-1) x shard`` elements of the compute dtype, one transport operation
        straight into ``full``. With ``from_secondary`` and a kept hpZ partition: the
        ``(h-1)/h x Ψ_u`` elements of an all-gather over ``hpz_group`` instead, always exact
        in the compute dtype (the transport's :meth:`~shardkit.transport.Transport.lossless`),
        so backward sees the forward's weights even where the forward gather was quantized.
        """
        if self.gathered or self._pending_gather is not None:
            return
        if from_secondary and self._secondary is not None:
            send, self._secondary = self._secondary, None
            chunks = send.split([lay.chunk_numel for lay in self.hpz_layouts])
            # the secondary holds the weights the forward computed with: move them unchanged
            transport, group = self.transport.lossless(), self.hpz_group
        else:
            self._secondary = None
            self._readopt_shards()
            send = self.flat_shard.to(self.compute_device, self.compute_dtype, non_blocking=True)
            chunks, group = send.split(self.chunk_numels), self.group
            transport = self.transport
        self._allocate_full()
        try:
            handle = transport.all_gather_chunks(self.full.data.split(self.numels), chunks,
                                                 group)
        except CollectiveMismatchError as error:  # raised on every rank, before the gather
            raise CollectiveMismatchError(_gather_out_of_step(self.label[1], error)) from error
        self._pending_gather = (handle, send, prefetch)

    def _allocate_full(self) -> None:
        self.full.untyped_storage().resize_(self.full_bytes)
        _GATHERED.add(self.full_bytes)
        # a unit dropped while gathered (a model discarded after a forward) counts off too
        self._uncount = weakref.finalize(self.full, _GATHERED.sub, self.full_bytes)

    @outside_autocast
    def finish_gather(self) -> None:
        """Wait for (or issue and wait for) the all-gather; ``full`` then holds the unit."""
        if self.gathered:
            return
        if self._pending_gather is None:
            self.start_gather()
        handle, _send, prefetched = self._pending_gather
        _GATHERED.prefetched += int(prefetched)
        self._pending_gather = None
        handle.wait()
        self.gathered = True

    def expose(self) -> None:
        """Make every location of every parameter read as a view of ``full`` (the module's
        ``self.weight`` inside forward). Frozen parameters get detached views, so autograd
        computes no gradient for them."""
        trainable = [p.requires_grad for p in self.params]
        self.full.requires_grad_(any(trainable))
        pieces = _PiecesOfFull.apply(self.full, self._uses, self, *self._params_for_the_graph()) \
            if any(trainable) else self.full.detach().split(self.numels)
        if pieces[0].grad_fn is not None and torch._C._current_graph_task_id() == -1:
            self._forward_splits = [ref for ref in self._forward_splits if ref() is not None]
            self._forward_splits.append(weakref.ref(pieces[0].grad_fn))
        for p_trains, piece, lay, locs in zip(trainable, pieces, self.layouts, self.locations):
            view = piece.view(lay.shape) if p_trains else piece.detach().view(lay.shape)
            for module, name in locs:
                module.__dict__[name] = view
        self._exposed = True
        self.exposed_with_grad = any(trainable) and torch.is_grad_enabled()
        # the autograd graph task these views were made in (-1: outside any backward, a
        # forward); a reentrant checkpoint's backward is a task of its own (see
        # FullyShardedDataParallel._on_grad_ready)
        self.exposed_in_task = torch._C._current_graph_task_id()

    def forward_views_in_this_backward(self) -> bool:
        """Called inside a backward: whether it will run the backward of a split of ``full``
        that a forward made, i.e. whether the graph it runs used this unit's parameters
        directly (not only through a reentrant activation checkpoint inside the unit, whose
        recomputation reads them again in a backward of its own). Local, no communication."""
        nodes = [node for node in (ref() for ref in self._forward_splits) if node is not None]
        return any(torch._C._will_engine_execute_node(node) for node in nodes)

    def _params_for_the_graph(self) -> list:
        """The trainable parameters :class:`_PiecesOfFull` takes as inputs: not those with a
        tensor hook of the user's (``register_hook``, ``register_post_accumulate_grad_hook``),
        which autograd would call with ``None`` at the parameter's (empty) accumulation; this
        unit calls them itself: tensor hooks with the local full gradient before the
        reduce-scatter (:meth:`run_tensor_hooks`), post-accumulate-grad hooks with the reduced
        shard."""
        return [p for p in self.params if p.requires_grad and not _has_tensor_hooks(p)]

    def hide(self) -> None:
        """Undo :meth:`expose`: the attributes read as the (sharded) parameters again."""
        if not self._exposed:
            return
        for locs in self.locations:
            for module, name in locs:
                module.__dict__.pop(name, None)
        self._exposed = False

    def remember_source(self) -> None:
        """Note which shard values ``full`` was gathered from, for a unit that stays gathered
        after its forward (see :meth:`source_changed`). One pass over the shard, no
        communication."""
        self._kept_from = _fingerprint(self.flat_shard)

    @property
    def kept_from_forward(self) -> bool:
        """Gathered, and kept so since a forward (not freed by a backward yet)."""
        return self.gathered and self._kept_from is not None

    def source_changed(self) -> bool:
        """Whether this rank's shard changed since :meth:`remember_source` (an optimizer step
        after a forward that no backward followed): the kept ``full`` is then stale."""
        return _fingerprint(self.flat_shard) != self._kept_from

    @outside_autocast
    def free_full(self, keep_secondary: bool = False) -> None:
        """Release the gathered parameters (storage resized to 0: memory really goes down).

        ``keep_secondary`` (hpZ only, after a forward that backward will follow): first copy
        this rank's rows of the ``hpz``-way partition out of ``full`` (``Ψ_u/h`` elements, no
        communication). Otherwise any kept partition is dropped."""
        self.hide()
        if self._pending_gather is not None:  # a prefetch nobody consumed
            handle, _send, _prefetched = self._pending_gather
            handle.wait()
            self._pending_gather = None
            self.gathered = True  # it landed in full: released below
        self._secondary = None
        if keep_secondary and self.hpz_group is not None and self.gathered:
            pieces = self.full.detach().split(self.numels)
            self._secondary = torch.cat([shard_rows(piece, lay, self.hpz_rank).reshape(-1)
                                         for piece, lay in zip(pieces, self.hpz_layouts)])
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self._uncount()  # _GATHERED.sub, once
            self.gathered = False
        self._kept_from = None
        self.held_for_a_read = False

    # ------------------------------------------------------------------ reduce-scatter

    def has_full_grad(self) -> bool:
        """Whether the unit holds full-size gradients not yet reduce-scattered (from backward,
        accumulated inside ``no_sync``). Local."""
        return self._grad_pieces is not None

    def receive_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Backward's gradient of every parameter of the unit (``None``: none reached it), added
        to what an earlier backward inside ``no_sync`` left, after the user's tensor hooks
        (:meth:`run_tensor_hooks`); then ``on_grad_ready``."""
        self.add_grads(self.hold_for_tensor_hooks(list(grads)))
        self.run_tensor_hooks()
        self._on_grad_ready(self)

    def drop_unreduced_grads(self) -> None:
        """Forget the gradients held for a later reduce-scatter (accumulated inside
        ``no_sync``); a ``.grad`` still showing one goes back to what it was before the cycle
        (zeros of the shard if it was ``None``). Local."""
        folded = self._kept_folded or [None] * len(self.params)
        for i, shown in self._still_shown():
            kept = self._sealed[i][1]
            self._restore_grad(i, folded[i] if kept is None else kept)
        if self._sealed is None and self._grad_pieces is not None:
            # mid-backward (taken back, not sealed again): a folded .grad reads None now
            for p, kept in zip(self.params, folded):
                if kept is not None and p.grad is None:
                    p.grad = kept
        self._grad_pieces, self._used, self._hooked_pieces = None, None, None
        self._owned, self._sealed, self._kept_folded = None, None, None

    def seal_held_grads(self) -> None:
        """At the end of a backward inside ``no_sync``, which leaves the unit's gradients held
        for a later reduce-scatter: show each held gradient of a trainable parameter as its
        ``.grad``, in the parameter's full shape (the local, unreduced gradient: what torch
        FSDP1 shows inside ``no_sync``), the ``.grad`` it had kept aside.

        Note: in one process the accumulated gradient is in ``.grad``, so what the user does
        to ``.grad`` between micro-batches reaches it: ``optimizer.zero_grad()`` (either
        way), ``p.grad.data.zero_()``, a scaling (``mul_``, a GradScaler-style unscale,
        ``clip_grad_norm_``). Shown zeros of the shard before, a scaling never reached the held
        gradient (it was reduced unscaled), and telling a zeroing from it read every
        ``.grad`` (a device sync per unit per micro-batch). Now ``.grad`` is the held
        gradient's storage, so every in-place change reaches it without a read, and a
        ``.grad`` set to ``None`` drops it, and one replaced by a tensor of the parameter's
        full shape replaces it (:meth:`_adopt_replaced_grad`).
        A ``.grad`` the cycle began with (the reduced gradient of earlier steps, without
        ``zero_grad`` in between) is folded into the shown one where that is exact
        (:meth:`_fold_kept_grad`), so a scaling or a reassignment between micro-batches reaches
        it too, as in one process; otherwise it is kept aside and added after the
        reduce-scatter, which a change in place cannot reach (see
        :meth:`_settle_grads_kept_aside`).
        Memory: none (the held gradient is shown, not copied, unless autograd's tensor may
        be shared). Registers the optimizer step check (see
        :func:`_refuse_a_step_over_held_grads`). Local."""
        if self._grad_pieces is None:
            return
        self._take_back_held_grads()
        self._sealed = []
        folds = self._folds_kept_grads()
        for i, (p, used, lay) in enumerate(zip(self.params, self._used, self.layouts)):
            kept = p.grad
            # a kept .grad is folded on every rank holding one, also where no gradient reached
            # the parameter in this cycle: replicas of its rows must all fold it, or the
            # all-reduce over them counts it a fraction of a time (see _fold_kept_grad)
            fold = folds and kept is not None
            if not ((used or fold) and p.requires_grad):
                self._sealed.append(None)
                continue
            if not self._owned[i]:  # the user's in-place changes must reach this one only
                self._grad_pieces[i] = self._grad_pieces[i].clone(
                    memory_format=torch.contiguous_format)
                self._owned[i] = True
            if fold:
                self._fold_kept_grad(i, kept)
                self._used[i] = True  # it holds the kept .grad: reduced and shown from now on
                kept = None  # inside the held gradient now: .grad reads None when taken back
            shown = _show_as_grad(p, self._grad_pieces[i].view(lay.shape))
            self._sealed.append((weakref.ref(shown), kept, shown._version))
        _watch_optimizer_steps_over_held_grads(self)

    def _folds_kept_grads(self) -> bool:
        """Whether a ``.grad`` kept from before the cycle can ride the reduce-scatter
        unchanged: the held gradients, the reduction and the shards share one dtype and the
        transport does not quantize."""
        return self.compute_dtype == self.master_dtype == self.reduce_dtype and \
            self.transport.lossless() is self.transport

    def _fold_kept_grad(self, i: int, kept: torch.Tensor) -> None:
        """Add the ``.grad`` parameter ``i`` had before the cycle (this rank's reduced shard)
        into the rows of the held, full-shape gradient that this rank's shard covers, times
        ``predivide x postdivide / replicas``: the reduce-scatter divides by that and sums over
        the ``replicas`` ranks holding the same shard, so it comes out as the shard itself,
        added to the mean of this cycle's gradients (one process's ``.grad``). What the user
        then does to the shown ``.grad`` (a scaling, ``p.grad = p.grad * f`` where the shapes
        allow it) reaches it as in one process. At world size 1 the shown ``.grad`` is then
        exactly one process's. Local; no device sync."""
        self._kept_folded = self._kept_folded or [None] * len(self.params)
        if self._kept_folded[i] is None:
            self._kept_folded[i] = kept
        lay = self.layouts[i]
        start, count = lay.real_rows(self.rank)
        if count == 0:
            return  # this rank's block is padding only: its shard holds nothing
        held = self._grad_pieces[i].view(lay.rows, lay.row_numel)
        rows = kept.detach().reshape(-1, lay.row_numel)[:count].to(held.device, held.dtype)
        held[start:start + count].add_(rows, alpha=self.predivide * self.postdivide /
                                       self.replicas)

    def _still_shown(self) -> list:
        """``(index, shown .grad)`` of each parameter whose ``.grad`` still shows its held
        gradient (not set to ``None`` nor replaced since :meth:`seal_held_grads`). Local."""
        if self._sealed is None or self._grad_pieces is None:
            return []
        out = []
        for i, (p, mark) in enumerate(zip(self.params, self._sealed)):
            shown = None if mark is None else mark[0]()
            if shown is not None and p.grad is shown:
                out.append((i, shown))
        return out

    def _restore_grad(self, i: int, kept: Optional[torch.Tensor]) -> None:
        """Give parameter ``i`` back a ``.grad`` of its shard: ``kept`` (the one a
        :meth:`seal_held_grads` kept aside), or zeros where it had none."""
        p = self.params[i]
        p.grad = None
        p.grad = torch.zeros_like(p) if kept is None else kept

    def _discard_held(self, i: int) -> None:
        self._grad_pieces[i] = torch.zeros_like(self._grad_pieces[i])
        self._used[i], self._owned[i] = False, True
        if self._kept_folded is not None:
            self._kept_folded[i] = None  # discarded with the held gradient it was folded into

    def holds_unreduced_grads(self) -> bool:
        """Whether gradients that backwards inside ``no_sync`` accumulated wait here for a
        reduce-scatter and were not discarded since (see :meth:`params_with_held_grads`).
        Local; one device sync when some ``.grad`` still shows a held gradient."""
        if self._grad_pieces is None:
            return False
        return self._sealed is None or bool(self.params_with_held_grads())

    def params_with_held_grads(self) -> list[int]:
        """Indices of the parameters whose ``.grad`` still shows the gradient a backward
        inside ``no_sync`` holds (unreduced) and holds something but zeros. One shown but
        zeroed since (``optimizer.zero_grad(set_to_none=False)``, ``p.grad.data.zero_()``)
        is discarded: its ``.grad`` becomes zeros of its shard, as in one process. For the
        refusals of a step, a norm, a summon. Local; one device sync."""
        if self._sealed is None or self._grad_pieces is None:
            return []
        shown = self._still_shown()
        gone = {i for i, mark in enumerate(self._sealed) if mark is not None} - \
            {i for i, _ in shown}
        for i in gone:
            kept = self._sealed[i][1]
            self._sealed[i] = None
            if self._adopt_replaced_grad(i, kept):  # shown again, still held
                lay = self.layouts[i]
                again = _show_as_grad(self.params[i], self._grad_pieces[i].view(lay.shape))
                self._sealed[i] = (weakref.ref(again), kept, again._version)
        shown = self._still_shown()
        zeroed = _read_all_zero([g for _, g in shown])
        held = []
        for (i, _), zero in zip(shown, zeroed):
            if not zero:
                held.append(i)
                continue
            kept = self._sealed[i][1]
            if kept is not None:
                kept.zero_()
            self._restore_grad(i, kept)
            self._discard_held(i)
            self._sealed[i] = None
        return held

    def _take_back_held_grads(self) -> None:
        """Before a backward adds to the held gradients, or they are reduced: each ``.grad``
        still showing one goes back to what it was before (the held gradient keeps every
        in-place change the user made through it); one set to ``None`` since
        :meth:`seal_held_grads` (``optimizer.zero_grad()``) drops it, one replaced by a
        full-shape tensor gives it its values (:meth:`_adopt_replaced_grad`). Local; no device
        sync unless a ``.grad`` kept aside must be settled."""
        sealed = self._sealed
        if sealed is None or self._grad_pieces is None:
            self._sealed = None
            return
        shown = dict(self._still_shown())
        self._sealed = None
        changed = []
        for i, mark in enumerate(sealed):
            if mark is None:
                continue
            kept = mark[1]
            if i not in shown:  # cleared (or replaced in a shape it cannot take): dropped
                if self._adopt_replaced_grad(i, kept):
                    self._put_back(i, kept)
                continue
            p = self.params[i]
            p.grad = None
            p.grad = kept
            if kept is not None and shown[i]._version != mark[2]:
                changed.append((i, shown[i], kept))
        if changed:
            self._settle_grads_kept_aside(changed)

    def _adopt_replaced_grad(self, i: int, kept: Optional[torch.Tensor]) -> bool:
        """Parameter ``i``'s ``.grad`` no longer shows its held gradient: ``None``
        (``optimizer.zero_grad()``) drops the held gradient; a tensor of the parameter's full
        shape (``p.grad = p.grad * f`` between micro-batches, where torch takes that shape:
        ``NO_SHARD``, or one rank) replaces it, as it replaces the accumulated ``.grad`` in one
        process (before, it was dropped too: the cycle's earlier micro-batches were lost
        silently). A ``.grad`` kept aside from before the cycle (``kept``) is zeroed with a
        zero replacement; another replacement cannot reach it and warns
        (:meth:`_settle_grads_kept_aside`). Returns whether the held gradient was kept.
        Local; one device sync when ``kept`` must be settled."""
        lay = self.layouts[i]
        replacement = self.params[i].grad
        if replacement is None or tuple(replacement.shape) != tuple(lay.shape):
            self._discard_held(i)
            return False
        self._grad_pieces[i].view(lay.shape).copy_(replacement.detach())
        if kept is not None:
            self._settle_grads_kept_aside([(i, replacement, kept)])
        return True

    def _put_back(self, i: int, kept: Optional[torch.Tensor]) -> None:
        """Give parameter ``i`` back the ``.grad`` it had before the cycle (``None``: none)."""
        p = self.params[i]
        p.grad = None
        p.grad = kept

    def _settle_grads_kept_aside(self, changed: list) -> None:
        """``(index, shown, kept)`` of the parameters whose shown ``.grad`` was changed in
        place while a ``.grad`` from before the cycle was kept aside: a zeroing zeroes the
        kept one too (``optimizer.zero_grad(set_to_none=False)``); a scaling cannot reach a
        kept one that holds values, which warns. Local; one device sync."""
        zero = _read_all_zero([shown for _, shown, _ in changed] +
                              [kept for _, _, kept in changed])
        shown_zero, kept_zero = zero[:len(changed)], zero[len(changed):]
        missed = []
        for (i, _, kept), cleared, empty in zip(changed, shown_zero, kept_zero):
            if cleared:
                kept.zero_()
            elif not empty:
                missed.append(i)
        if missed:
            warnings.warn(_kept_grads_changed_in_place(self, missed), stacklevel=3)

    def hold_for_tensor_hooks(self, grads: list) -> list:
        """Take out of one use's ``grads`` those of parameters with tensor hooks of the user's
        (``p.register_hook``) and hold them, summed over the uses, for :meth:`run_tensor_hooks`;
        the others are returned (``None`` in the held places). Local."""
        hooked = [_has_backward_hooks(p) and g is not None for p, g in zip(self.params, grads)]
        if not any(hooked):
            return grads
        if self._hooked_pieces is None:
            self._hooked_pieces = [None] * len(self.params)
        for i, held in enumerate(hooked):
            if held:
                known = self._hooked_pieces[i]
                self._hooked_pieces[i] = grads[i] if known is None else known + grads[i]
        return [None if held else g for held, g in zip(hooked, grads)]

    @outside_autocast
    def run_tensor_hooks(self) -> None:
        """Call the user's tensor hooks (``p.register_hook``) of each parameter whose gradient
        :meth:`hold_for_tensor_hooks` held, once per backward, with this rank's whole gradient
        of the parameter in its full shape (every use of the unit summed, compute dtype), before
        the reduce-scatter: what they see under torch DDP (the local gradient, before the
        all-reduce). A hook's return value, if not ``None``, replaces the gradient, as in
        autograd. Autograd itself never calls them: the module computes with views of the
        gathered ``full``, not with the parameter. Local."""
        held, self._hooked_pieces = self._hooked_pieces, None
        if held is None:
            return
        out = []
        for p, lay, g in zip(self.params, self.layouts, held):
            if g is not None:
                g = g.view(lay.shape)
                for hook in list(p._backward_hooks.values()):
                    result = hook(g)
                    if result is not None:
                        if not isinstance(result, torch.Tensor) or result.shape != g.shape:
                            raise RuntimeError(  # autograd's check, in its words
                                f"hook {getattr(hook, '__name__', hook)!r} has changed the "
                                f"size of value: expected a tensor of shape "
                                f"{tuple(g.shape)}, got {_shape_of(result)}")
                        g = result
                g = g.reshape(-1).to(self.compute_dtype)  # a hook's fp32 result under bf16
            out.append(g)
        self.add_grads(out)

    @outside_autocast
    def abandon_reduce(self) -> None:
        """Wait for a reduce-scatter still in flight (every rank issued it) and drop its
        result, with any held gradients: what a backward that raised left behind. Local
        apart from that wait."""
        if self._pending_reduce is not None:
            handle, _, side_handle = self._pending_reduce
            handle.wait()
            if side_handle is not None:
                side_handle.wait()
        self._pending_reduce, self._reducing_used = None, None
        self.drop_unreduced_grads()

    @outside_autocast
    def add_grads(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Add one use's gradients (``None``: none reached that parameter) to what the unit
        holds, without declaring them complete."""
        self._take_back_held_grads()
        if self._grad_pieces is None:
            self._used = [g is not None for g in grads]
            self._owned = [g is None for g in grads]
            grads = [torch.zeros(n, dtype=self.compute_dtype, device=self.compute_device)
                     if g is None else g for g, n in zip(grads, self.numels)]
        else:
            # a slot no gradient reached yet holds zeros: take the new gradient (no sum)
            merged = [held if g is None else (held + g if used else g)
                      for held, g, used in zip(self._grad_pieces, grads, self._used)]
            self._owned = [own if g is None else used
                           for own, g, used in zip(self._owned, grads, self._used)]
            self._used = [u or g is not None for u, g in zip(self._used, grads)]
            grads = merged
        self._grad_pieces = grads

    def _every_use_delivered(self, uses: torch.Tensor) -> None:
        uses.grad = None
        self.run_tensor_hooks()
        if self._grad_pieces is not None:
            self._on_grad_ready(self)

    def set_divide_factors(self, pre: float, post: float) -> None:
        """Divide gradients by ``pre`` before the reduce-scatter and by ``post`` after (the
        default, ``N x replicas`` and 1, gives the mean). Local."""
        self.predivide, self.postdivide = float(pre), float(post)

    @outside_autocast
    def start_reduce(self) -> None:
        """Reduce-scatter the unit's gradients (divided by ``predivide``, by default ``N x
        replicas``, in the reduce dtype) into this rank's shard, async. They live until the
        operation completes (a transport may send straight from them).

        Wire: ``(N-1)/N x N x (shard + P + 2)`` elements of the reduce dtype, one transport
        reduce-scatter, ``P`` the unit's parameter count: each rank also sends every peer
        which parameters a gradient reached here (see :meth:`finish_reduce`), whether its
        gradients hold an inf or NaN (see :meth:`_spread_non_finite`), and one element
        naming the unit (see :meth:`_check_every_rank_reduced_this`). Through a transport that
        quantizes gradients (qgZ) those ``P + 2`` elements per rank go in a second, small
        reduce-scatter of the lossless transport. With replicas, :meth:`replicate_reduce`
        adds an all-reduce of the result over ``replicate_group``
        (``2(R-1)/R x (shard + P + 2)``). Compute: one min/max pass over the local gradients.

        A reduce-scatter still in flight (a split backward's earlier weight pass, see
        :func:`gathered_param_edges`) is finished into ``.grad`` first.
        """
        if self._pending_reduce is not None:
            self.finish_reduce()
        self._take_back_held_grads()
        grads, self._grad_pieces = self._grad_pieces, None
        used, self._used = self._used, None
        self._owned, self._kept_folded = None, None
        self._reducing_used = [True] * len(self.params) if used is None else used
        side = self._side_values(self._reducing_used, grads).repeat(self.world_size)
        if self.comm_hook is not None:
            self._reduce_through_comm_hook(grads, side)
            return
        chunk_numels, side_handle = list(self.chunk_numels), None
        if self._side_values_ride_the_reduce_scatter():
            grads, chunk_numels = list(grads) + [side], chunk_numels + [side.numel() //
                                                                        self.world_size]
        else:
            side_handle = self._reduce_side_values_apart(side)
        handle = self.transport.reduce_scatter_chunks(
            grads, chunk_numels, self.reduce_group, scale=1.0 / self.predivide,
            dtype=self.reduce_dtype)
        self._pending_reduce = (handle, False, side_handle)

    def _reduce_side_values_apart(self, side: torch.Tensor):
        """The handle of the ``P + 2`` side values' own reduce-scatter, through the lossless
        transport (where the gradients go through a quantizing transport or a communication
        hook). Wire: ``(N-1)/N x N x (P + 2)`` elements."""
        return self.transport.lossless().reduce_scatter_chunks(
            [side], [side.numel() // self.world_size], self.reduce_group,
            scale=1.0 / self.predivide, dtype=self.reduce_dtype)

    def set_comm_hook(self, state, hook: Callable, all_reduces: bool) -> None:
        """Reduce the unit's gradients with torch FSDP1's communication ``hook`` from now on:
        ``hook(state, grad, output)`` reduce-scatters the rank-major padded flat gradient
        ``grad`` (``N x shard`` elements) into ``output`` (``shard`` elements); with
        ``all_reduces`` (NO_SHARD) ``hook(state, grad)`` all-reduces ``grad`` in place. The
        hook divides as it likes (torch's default hooks by ``state``'s pre/post factors): the
        unit's divide factors no longer apply. Local."""
        self.comm_hook, self.comm_hook_state, self._hook_all_reduces = hook, state, all_reduces

    def _reduce_through_comm_hook(self, grads: Sequence[torch.Tensor],
                                  side: torch.Tensor) -> None:
        """:meth:`start_reduce` with a communication hook: the side values go first, in a
        reduce-scatter of their own through the lossless transport (all-reduced over the
        replicas under NO_SHARD), then the hook runs on the packed gradients, synchronously
        as under torch's FSDP1. Wire: the hook's, plus ``(N-1)/N x N x (P + 2)`` elements.
        Memory: the packed gradient (``N x shard`` elements, torch's padded flat gradient)
        while the hook runs, then ``output``; the per-parameter gradients are freed on
        return."""
        side_handle = self._reduce_side_values_apart(side)
        if self.replicate_group is not None:
            side_handle = self.transport.lossless().all_reduce(side_handle.wait(),
                                                               self.replicate_group)
        reduced = self._run_comm_hook(grads)
        # True: nothing left for replicate_reduce (the hook did all the reduction)
        self._pending_reduce = (CommHandle((), lambda: reduced), True, side_handle)

    def _run_comm_hook(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Pack the gradients (zero padded, rank-major, in the reduce dtype; in their own
        dtype for torch's low-precision hooks, which cast themselves, as torch FSDP1 hands
        them over), run the hook and return what it left: ``output``, or under NO_SHARD the
        reduced gradient. Read after the call: torch's hooks rebind ``.data`` (a cast)."""
        dtype = grads[0].dtype if _is_low_precision_hook(self.comm_hook) else self.reduce_dtype
        padded = pack_rank_major(list(grads), self.world_size, dtype=dtype,
                                 chunk_numels=self.chunk_numels)
        if self._hook_all_reduces:
            self.comm_hook(self.comm_hook_state, padded)
            return padded
        output = torch.empty(self.shard_numel, dtype=dtype, device=padded.device)
        self.comm_hook(self.comm_hook_state, padded, output)
        return output

    def _side_values_ride_the_reduce_scatter(self) -> bool:
        """Whether the ``P + 2`` side values travel inside the gradients' reduce-scatter: not
        through a transport that quantizes gradients (``QuantizedTransport(gradients=True)``):
        sharing a block with gradients, they would set its scale and round those to zero."""
        return self.transport.lossless() is self.transport or \
            not getattr(self.transport, "gradients", True)

    def _side_values(self, used: list, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """What each rank sends every peer beside its gradients, times ``predivide`` (so that,
        reduced, it reads as a sum over ranks): per parameter 1 where a gradient reached it on
        this rank, else 0 (reduced: the number of ranks where one did); 0, or NaN when this
        rank's gradients of the unit hold an inf or NaN (reduced: NaN when any rank's do);
        then the unit's tag (reduced: the sum of the tags the ranks sent)."""
        like = grads[0]
        tag = self.label[0] * self.predivide
        values = [self.predivide if u else 0.0 for u in used] + [0.0, tag]
        side = torch.tensor(values, dtype=self.reduce_dtype, device=like.device)
        extremes = [torch.stack(torch.aminmax(g.reshape(-1))) for g in grads if g.numel()]
        if extremes:
            # the extremes are finite exactly when every element is (a sum could overflow);
            # x 0 turns them into 0, or NaN for inf / NaN, without a host sync
            side[-2] = (torch.cat(extremes) * 0).sum().to(self.reduce_dtype)
        return side

    def _check_every_rank_reduced_this(self, side: torch.Tensor) -> None:
        """Raise unless every rank's part of the reduce-scatter just completed came from this
        unit: the tags summed in ``side`` (each rank's unit's, 1 to :meth:`tag_count` by position
        in the model) must be ``N x replicas`` times this unit's. Otherwise the ranks'
        collectives are out of step, typically because a unit's forward ran on some ranks only,
        and the gradients are a mix of different units' (no error came before: units of equal
        size pair up). No verdict between units :meth:`tag_count` positions apart, where fewer
        than 2 tags fit (a bf16 reduction over more than 128 ranks), nor on an accelerator (the
        read would synchronise with the host once per unit). Costs one read of ``side``'s last
        element."""
        tag, name = self.label
        ranks = self.world_size * self.replicas
        if tag == 0:
            return  # no tag fits the reduction's exact range: no verdict
        mean_tag = float(side[-1]) / ranks
        if abs(mean_tag - tag) < 0.25:
            return
        raise RuntimeError(
            f"FullyShardedDataParallel: the ranks' gradient reduce-scatters are out of step: "
            f"this rank reduced unit {name!r} while another rank reduced a different unit "
            f"(the mean of the units' tags is {mean_tag:.2f}, this unit's is {tag}). Every rank "
            f"must run the same FSDP units in each forward; a branch that runs a whole unit "
            f"on some ranks only (a conditional submodule) leaves their collectives unmatched. "
            f"Run the unit on every rank (e.g. with an empty batch, or multiply its output by "
            f"zero), or move the branch inside a unit (its parameters may then go unused on "
            f"some ranks). The process group is now out of step: end the job")

    def tag_count(self) -> int:
        """How many distinct unit tags this unit's reduce-scatter carries exactly: the sum of
        ``N x replicas`` tags must stay an exact integer in the reduce dtype (up to 4096 in
        fp32 below 256 ranks; 2048 / N in fp16, 256 / N in bf16). Alike on every rank."""
        exact = _EXACT_INTEGERS.get(self.reduce_dtype, _EXACT_INTEGERS_OTHERWISE)
        return min(_MAX_TAGS, exact // (self.world_size * self.replicas))

    @outside_autocast
    def replicate_reduce(self) -> None:
        """With replicas: wait for the reduce-scatter and issue the all-reduce of its result
        over ``replicate_group`` (async; no-op otherwise or when already issued)."""
        if self.replicate_group is None or self._pending_reduce is None \
                or self._pending_reduce[1]:
            return
        handle, _, side_handle = self._pending_reduce
        replicated = self.transport.all_reduce(handle.wait(), self.replicate_group)
        if side_handle is not None:
            side_handle = self.transport.lossless().all_reduce(side_handle.wait(),
                                                               self.replicate_group)
        self._pending_reduce = (replicated, True, side_handle)

    def _used_anywhere(self, side: torch.Tensor, used_here: list) -> list[bool]:
        """Per parameter: whether a gradient reached it on any rank of the reduce (and
        replicate) group, read from the counts in the reduced side values."""
        if all(used_here):  # nothing to learn: spare the read of the counts (a device sync)
            return used_here
        counts = side[:-2].tolist()
        return [here or c > 0 for here, c in zip(used_here, counts)]

    def _reduction_can_overflow(self) -> bool:
        """Whether the reduce-scatter itself can make an inf that no rank's gradients held
        (so the side flag misses it): in fp16, from gradients of a wider dtype (cast down),
        or with ``predivide`` below the number of ranks (a sum outgrows its addends)."""
        if self.comm_hook is not None:
            return True  # the hook's communication is its own (a compressing cast, say)
        if self.reduce_dtype != torch.float16:
            return False
        return self.compute_dtype != torch.float16 or \
            self.predivide < self.world_size * self.replicas

    def _overflow_in_reduction(self, reduced: torch.Tensor) -> torch.Tensor:
        """0, or NaN on every rank when any rank's reduced shard holds an inf or NaN: one
        all-reduce of one element over the reduce group (only where
        :meth:`_reduction_can_overflow`)."""
        flag = torch.zeros((), dtype=torch.float32, device=reduced.device)
        if reduced.numel():  # x 0: 0, or NaN for an inf / NaN, without a host sync
            flag = (torch.stack(torch.aminmax(reduced)) * 0).sum().float()
        skdist.all_reduce(flag, group=self.reduce_group)
        return flag

    def _spread_non_finite(self, views: list, flag: torch.Tensor) -> None:
        """Make an inf or NaN that any rank's gradients of the unit held visible on every
        rank: ``flag`` (reduced side value) is NaN then, and is added to the first element of
        each gradient view (0 otherwise). Without this, an overflow lands in the shard of the
        rank owning its rows only, and ``torch.amp.GradScaler``, which checks this rank's
        gradients, would skip the step there and step it on the others, moving their loss
        scales apart. Where the gradient shards live on CPU (offloaded ones too) the flag is
        read first and nothing is written when it is 0; on an accelerator the adds run
        unconditionally (no host sync)."""
        if not views:
            return
        flag = flag.to(views[0].device)
        if flag.device.type == "cpu" and not torch.isnan(flag):
            return
        for view in views:
            if view.numel():
                view[:1].add_(flag.to(view.dtype))

    @outside_autocast
    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter (and the replicas' all-reduce) and add the result to
        the trainable shards' ``.grad``.

        Note: a parameter that no gradient reached on any rank (a branch every rank skipped)
        keeps its ``.grad`` as it was (``None`` after ``zero_grad``), as in one process, so a
        stateful optimizer skips it instead of applying momentum or weight decay to a zero
        gradient. One that a gradient reached on some rank gets its reduced shard on every
        rank, zeros included (this rank skipped the branch, and owns rows no other rank's
        gradient touched, or only padding), as in one process: every rank's optimizer then
        steps it alike (decay, moments). The use counts of :meth:`start_reduce` tell the two
        apart (under qgZ they come through the lossless transport). (torch's FSDP1 gives zeros
        in both cases.) An inf or NaN in any rank's gradients of the unit reaches every rank's
        shard (:meth:`_spread_non_finite`), so a loss scaler skips the step everywhere; so does
        one that an fp16 reduce-scatter made itself (gradients wider than fp16, or
        ``predivide`` below the number of ranks): one more all-reduce of one element per unit
        then, in those configurations only.

        Hooks the user registered with ``p.register_post_accumulate_grad_hook`` (an optimizer
        step inside backward) run once the reduced shard is in ``p.grad``, as under torch's
        FSDP2; not inside ``no_sync``, where no reduced gradient arrives."""
        if self._pending_reduce is None:
            return
        self.replicate_reduce()
        handle, _, side_handle = self._pending_reduce
        out = handle.wait()
        side = out[self.shard_numel:] if side_handle is None else side_handle.wait()
        self._pending_reduce = None
        used_here, self._reducing_used = self._reducing_used, None
        if side.device.type == "cpu":
            # Note: on an accelerator, reading the tag would cost a host sync per unit per step
            self._check_every_rank_reduced_this(side)
        used = self._used_anywhere(side, used_here)
        # a copy of its own (fused with any cast): .grad must not keep the side values' buffer
        grad_shard = out[:self.shard_numel].to(self.storage_device, self.master_dtype,
                                               copy=out.numel() > self.shard_numel)
        if self.postdivide != 1.0 and self.comm_hook is None:
            grad_shard.div_(self.postdivide)
        stepped = [(p, view) for p, view, used_somewhere
                   in zip(self.params, self.shard_views(grad_shard), used)
                   if p.requires_grad and used_somewhere]
        flag = side[-2]
        if self._reduction_can_overflow():
            flag = flag + self._overflow_in_reduction(out[:self.shard_numel]).to(flag.device)
        self._spread_non_finite([view for _, view in stepped], flag)
        for p, view in stepped:
            if p.grad is None:
                p.grad = view
            else:
                p.grad.add_(view)
            _run_post_accumulate_grad_hooks(p)

    # ------------------------------------------------------------------ full master copies

    @outside_autocast
    def gather_master(self) -> list[torch.Tensor]:
        """Every parameter unsharded in the master dtype on the storage device (new tensors).

        Wire: one all-gather of ``N x shard`` master-dtype elements.
        """
        self._readopt_shards()
        out = torch.empty(self.padded_numel, dtype=self.master_dtype,
                          device=self.compute_device)
        self.transport.all_gather(out, self.flat_shard.to(self.compute_device), self.group).wait()
        out = out.to(self.storage_device)
        fulls = [torch.empty(lay.shape, dtype=self.master_dtype, device=out.device)
                 for lay in self.layouts]
        unpack_rank_major(out, self.world_size, fulls, chunk_numels=self.chunk_numels)
        return fulls

    @outside_autocast
    def gather_master_grads(self) -> list[Optional[torch.Tensor]]:
        """Every parameter's gradient unsharded from the ranks' ``.grad`` shards (new tensors,
        master dtype, storage device), ``None`` for a parameter no rank has a ``.grad`` of; a
        rank without one where another has it counts zeros for its rows.

        Wire: one all-gather of ``N x (shard + P)`` master-dtype elements (``P`` flags tell
        which parameters have a ``.grad`` on each rank)."""
        count = len(self.params)
        send = torch.zeros(self.shard_numel + count, dtype=self.master_dtype,
                           device=self.compute_device)
        for i, (p, view) in enumerate(zip(self.params,
                                          self.shard_views(send[:self.shard_numel]))):
            if p.grad is not None:
                view.copy_(p.grad.reshape(view.shape))
                send[self.shard_numel + i] = 1
        out = torch.empty(self.world_size * send.numel(), dtype=self.master_dtype,
                          device=self.compute_device)
        self.transport.all_gather(out, send, self.group).wait()
        rows = out.view(self.world_size, -1).to(self.storage_device)
        has_grad = (rows[:, self.shard_numel:] != 0).any(dim=0).tolist()
        fulls, start = [], 0
        for lay, numel, present in zip(self.layouts, self.chunk_numels, has_grad):
            blocks = list(rows[:, start:start + numel])
            fulls.append(unshard_rows(blocks, lay) if present else None)
            start += numel
        return fulls

    @outside_autocast
    def write_back(self, fulls: Sequence[torch.Tensor]) -> None:
        """Copy this rank's rows of full-size tensors into the shards (no communication)."""
        with torch.no_grad():
            for lay, full, view in zip(self.layouts, fulls, self.shard_views(self.flat_shard)):
                view.copy_(shard_rows(full.detach().to(view.dtype), lay, self.rank))

    def model_state_tensors(self):
        """``(category, tensor)`` pairs held outside ``module.parameters()``."""
        yield "params", self.full
        for grad in self._grad_pieces or ():
            yield "grads", grad
        for grad in self._hooked_pieces or ():
            if grad is not None:
                yield "grads", grad
        if self._secondary is not None:
            yield "params", self._secondary


class _PiecesOfFull(torch.autograd.Function):
    """``full.split(numels)`` whose backward hands the per-parameter gradients to the unit
    (:meth:`FlatParamShard.add_grads`) instead of joining them into one flat ``full.grad``:
    the reduce-scatter sends each straight from where autograd left it, so no pass copies the
    unit's whole gradient (``torch.split``'s backward is a ``cat``).

    The unit's trainable parameters (but those with tensor hooks) are inputs too (unread, given
    no gradient): they are then in the graph, so ``loss.backward(inputs=params)`` reaches this
    node, and a parameter left out of ``inputs`` gets no gradient, as in one process."""

    @staticmethod
    def forward(ctx, full, uses, shard, *params):
        # Note: weakly: the views this node outputs sit in the modules (``self.weight``), and a
        # reference from the node (C++) back to the unit is a cycle the garbage collector
        # cannot see, which kept a model discarded after a forward alive for good
        ctx.shard, ctx.params_given = weakref.ref(shard), len(params)
        ctx.in_graph = {id(p) for p in params}
        ctx.set_materialize_grads(False)
        return full.split(shard.numels)

    @staticmethod
    def backward(ctx, *grads):
        shard = ctx.shard()
        if shard is None:  # the model is gone: nothing to hand the gradients to
            return (None,) * (3 + ctx.params_given)
        late = [i for i, p in enumerate(shard.params)
                if id(p) in ctx.in_graph and _has_backward_hooks(p)]
        if late:  # autograd also calls them, with None, at the parameter's empty accumulation
            raise RuntimeError(
                f"FullyShardedDataParallel: a tensor hook (register_hook) was registered on "
                f"{_where(shard.locations[late[0]])} of unit {shard.label[1]!r} after the "
                f"forward this "
                f"backward runs through; FSDP calls such hooks itself with the local full "
                f"gradient only when they exist at the forward. Register the hook before the "
                f"forward (once, e.g. right after wrapping)")
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            refuse_gradients_of_gradients(shard.label[1])
        wanted = _params_this_backward_wants(shard, ctx.in_graph)
        zeros_only = _ZEROS_ONLY.get(ctx, ())  # views only a zero output gradient reached
        shard.add_grads(shard.hold_for_tensor_hooks(
            [None if g is None or not want or i in zeros_only else g.reshape(-1)
             for i, (g, want) in enumerate(zip(grads, wanted))]))
        # the unit's hook on ``uses`` follows (unless ``inputs=`` leaves it out: then the
        # root's end of backward reduces what the unit holds)
        return (None, torch.zeros_like(shard._uses), None) + (None,) * ctx.params_given


def refuse_gradients_of_gradients(unit: str) -> None:
    """Raise the error of a backward with ``create_graph=True`` that reaches the parameters of
    ``unit`` (torch FSDP refuses it too, as "FSDP does not support gradients of gradients"):
    the reduce-scatter that averages their gradients over the ranks is not differentiable, so
    the graph of ``.grad`` would stop at this rank's local gradient. Before, the reduction
    failed deep inside the transport ("a leaf Variable that requires grad is being used in an
    in-place operation"), after some units had been reduced."""
    raise RuntimeError(
        f"FullyShardedDataParallel: a backward with create_graph=True reached the parameters "
        f"of unit {unit!r}; gradients of gradients of sharded parameters are not supported "
        f"(as in torch's FSDP): the reduce-scatter of their gradients is not differentiable. "
        f"Call backward() without create_graph; for a gradient penalty take "
        f"torch.autograd.grad(out, inputs, create_graph=True) with respect to the inputs and "
        f"add the penalty to the loss (supported)")


def _is_low_precision_hook(hook: Callable) -> bool:
    """Whether ``hook`` is one of torch's fp16 / bf16 compress hooks, which take the gradient
    in the compute dtype and cast it themselves (torch FSDP1's ``_low_precision_hook_enabled``)."""
    try:
        from torch.distributed.algorithms._comm_hooks import LOW_PRECISION_HOOKS
    except ImportError:  # a torch without them
        return False
    return hook in LOW_PRECISION_HOOKS


def _has_tensor_hooks(p: nn.Parameter) -> bool:
    return _has_backward_hooks(p) or bool(getattr(p, "_post_accumulate_grad_hooks", None))


def _where(locations: list) -> str:
    return ", ".join(f"{type(m).__name__}.{name}" for m, name in locations) or "a parameter"


def _shape_of(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def _has_backward_hooks(p: nn.Parameter) -> bool:
    """Whether ``p`` has tensor hooks of the user's (``p.register_hook``)."""
    return bool(getattr(p, "_backward_hooks", None))


def _params_this_backward_wants(shard: FlatParamShard, in_graph: set) -> list:
    """Per parameter of ``shard``: whether the running backward computes its gradient (False
    for a parameter of ``in_graph`` that ``backward(inputs=...)`` leaves out; frozen ones are
    never read)."""
    try:
        return [id(p) not in in_graph
                or torch._C._will_engine_execute_node(get_gradient_edge(p).node)
                for p in shard.params]
    except RuntimeError as error:  # torch: not answerable for leaves inside autograd.grad()
        if "autograd.grad" not in str(error):
            raise
        raise RuntimeError(
            "FullyShardedDataParallel: torch.autograd.grad(..., inputs=...) with a wrapped "
            "unit's parameters among the inputs is not supported: each rank holds only its "
            "row shard of a parameter, and its gradient is reduce-scattered over the ranks "
            "into .grad. Use loss.backward() (or loss.backward(inputs=params)) and read "
            "p.grad, this rank's rows of the mean gradient") from None


def _run_post_accumulate_grad_hooks(p: nn.Parameter) -> None:
    """Call ``p``'s post-accumulate-grad hooks: autograd never reaches the sharded parameter
    itself (the module computes with views of ``full``), so it would not call them."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    for hook in list((hooks or {}).values()):
        hook(p)


def _resized_after_wrapping(p: nn.Parameter, layout, locations: list) -> str:
    """What went wrong when a sharded parameter's ``.data`` was replaced by one of another
    size (Hugging Face's ``resize_token_embeddings`` on the wrapped model does that): its
    rows were never gathered, so nothing sensible can be copied back."""
    where = ", ".join(f"{type(m).__name__}.{attr}" for m, attr in locations) or "a parameter"
    return (f"FullyShardedDataParallel: {where} was replaced by a tensor of shape "
            f"{tuple(p.data.shape)} after wrapping; FSDP sharded it with shape "
            f"{tuple(layout.shape)}. Change a parameter's size (e.g. Hugging Face's "
            f"resize_token_embeddings) before wrapping the model in FSDP")


# what to do instead of swapping tensors into a wrapped model (removed_after_wrapping and
# FullyShardedDataParallel.__setattr__ both say it)
SWAPPED_TENSOR_ADVICE = (
    "torch.func.functional_call and torch.nn.utils.stateless swap tensors in this way, and an "
    "FSDP unit computes with the parameters it gathers, never with tensors passed that way: "
    "call them on a model that is not wrapped (e.g. a copy loaded with the full state_dict()); "
    "to change the weights, use load_state_dict() or summon_full_params(writeback=True)")


def removed_after_wrapping(module: nn.Module, name: str, layout) -> str:
    """What went wrong when a sharded parameter is no longer registered where FSDP found it
    (``torch.nn.utils.prune`` on a wrapped module re-registers ``weight`` as ``weight_orig``,
    with a mask of the row shard's shape; ``module.weight = nn.Parameter(...)``)."""
    now = module._parameters.get(name)
    if now is not None and not isinstance(now, nn.Parameter):
        return (f"FullyShardedDataParallel: {type(module).__name__}.{name} (shape "
                f"{tuple(layout.shape)}) holds a tensor swapped in for the parameter FSDP "
                f"shards. {SWAPPED_TENSOR_ADVICE}")
    what = ("removed (torch.nn.utils.prune re-registers it as "
            f"{name}_orig, with a mask of this rank's row shard; torch.nn.utils.parametrize as "
            f"parametrizations.{name}.original; or deleted)" if now is None
            else "replaced by another parameter (torch.func.functional_call swaps in the "
                 "tensors it is given: FSDP cannot compute with them)")
    return (f"FullyShardedDataParallel: {type(module).__name__}.{name} (shape "
            f"{tuple(layout.shape)}) was {what} after wrapping; FSDP shards the parameter it "
            f"found when the unit was built. Prune, replace or re-register parameters before "
            f"wrapping the model in FSDP (a pruned module trains under FSDP: the mask is a "
            f"buffer, the pruning hook sees the gathered weight)")


_BITS_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_TAGS = 4096  # units are tagged 1 to tag_count() by position (see FlatParamShard.label)
# sums of tags below these come through a reduction in that dtype exactly (fp32: 2**24 with
# room for the rounding of the pre- and post-division); see FlatParamShard.tag_count
_EXACT_INTEGERS = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}
_EXACT_INTEGERS_OTHERWISE = 2 ** 20


def _fingerprint(flat: torch.Tensor) -> int:
    """The sum, wrapping around, of ``flat``'s bit patterns as integers: any change to one
    element changes it (two changes cancel with odds of about 2**-32); one pass, fast on CPU
    where a float64 sum is not."""
    bits = flat.detach().reshape(-1).view(_BITS_OF_SIZE[flat.element_size()])
    total = torch.int64 if bits.dtype == torch.int64 else torch.int32
    return int(bits.sum(dtype=total))


def _kept_grads_changed_in_place(shard: FlatParamShard, missed: list) -> str:
    """The warning for a ``.grad`` scaled in place between backwards inside ``no_sync`` while
    the reduced gradient of earlier steps was kept aside (see
    :meth:`FlatParamShard._settle_grads_kept_aside`)."""
    more = f" and {len(missed) - 1} more" if len(missed) > 1 else ""
    return (f"FullyShardedDataParallel: .grad of {_where(shard.locations[missed[0]])}{more} "
            f"in unit {shard.label[1]!r} was changed in place (not zeroed) between backwards "
            f"inside no_sync() while it also held the reduced gradient of earlier steps "
            f"(the cycle began without zero_grad()): the change reached this cycle's "
            f"gradient, not that earlier one, which is added back unchanged after the "
            f"reduce-scatter. Call optimizer.zero_grad() before the cycle, or scale the loss")


def _gather_out_of_step(unit: str, error: Exception) -> str:
    """The collective debug mode's mismatch, seen at a unit's gather, with what it means for
    FSDP and how to fix it."""
    return (f"FullyShardedDataParallel: the ranks' parameter all-gathers are out of step at "
            f"unit {unit!r}: every rank must run the same FSDP units in each forward, and a "
            f"unit whose forward runs on some ranks only (a mixture-of-experts expert that "
            f"received no tokens on a rank, a conditional submodule) leaves them unmatched. "
            f"Make the module that chooses (the whole MoE layer or transformer block) the "
            f"unit instead, e.g. auto_wrap(model, no_split_modules_policy(model)) or "
            f"transformer_auto_wrap_policy({{Block}}); with a size-based policy add the "
            f"experts' class to exclude_wrap_modules. {error}")


# pieces node -> output indices whose gradient, in the running backward, comes only from zeros
# fed for outputs no later stage used (see :func:`zeros_only_views`)
_ZEROS_ONLY: dict = {}


@contextlib.contextmanager
def zeros_only_views(roots: Sequence[torch.Tensor], real: Sequence[torch.Tensor]):
    """Inside the block, a plain backward from ``roots`` hands the units ``None`` (not
    reached) for the parameter views that only the roots outside ``real`` reach (they were
    given zero gradients so that every replica runs the same graph, hence the same gathers and
    reduce-scatters, in the same order): ``.grad`` stays ``None`` where no replica reached the
    parameter, as in one process. Walks the graph twice; local."""
    reached = set(gathered_param_edges(real))
    marked = {}
    for edge, (shard, index) in gathered_param_edges(roots).items():
        if edge not in reached:
            pieces = next(child for child, i in edge.node.next_functions
                          if child is not None and getattr(type(child), "_forward_cls", None)
                          is _PiecesOfFull)
            marked.setdefault(pieces, set()).add(index)
    _ZEROS_ONLY.update(marked)
    try:
        yield
    finally:
        for pieces in marked:
            _ZEROS_ONLY.pop(pieces, None)


def gathered_param_edges(roots: Sequence[torch.Tensor]) -> dict:
    """``{GradientEdge: (shard, index)}`` for every trainable parameter whose gathered view the
    autograd graph below ``roots`` used: the edge is the output of the ``view`` that gave the
    module parameter ``index`` of the unit's split of ``full`` (:class:`_PiecesOfFull`); its
    gradient is that parameter's whole gradient for this graph. A split backward
    (:mod:`shardkit.nn.pipe.split_backward`) asks autograd for these edges in its W pass, so the
    split's backward (which would reduce-scatter) never runs, and hands the gradients to
    :meth:`FlatParamShard.receive_grads` itself. Each parameter's own view node is named, not
    the split's outputs: autograd decides per node what to compute, and a W pass asking for one
    output of the split would also compute every path leading to the others (the input path,
    through weights already freed). Walks the graph once; no communication."""
    found: dict = {}
    stack = [get_gradient_edge(r).node for r in roots if r.requires_grad]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for child, index in node.next_functions:
            if child is None:
                continue
            shard = child.shard() if getattr(type(child), "_forward_cls", None) \
                is _PiecesOfFull else None  # the node holds its unit weakly
            if shard is not None and shard.params[index].requires_grad:
                found[GradientEdge(node, 0)] = (shard, index)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return found
