"""ShardedDataParallel: gradient sharding (ZeRO stage 2) for modules trained with OSS.

During backward, each gradient is packed into a bucket once autograd has accumulated it (and
run its post-accumulate-grad hooks: the bucket a gradient completes leaves as the next one
arrives); a full bucket is reduced straight onto the ranks that own its parameters (the
ownership of the OSS optimizers' public :class:`~shardkit.optim.partition.ParameterPartition`),
and every rank drops the gradients it does not own right away. Each rank therefore holds only
its share of the gradients, OSS steps that share, and OSS re-synchronises the parameters.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
import zlib
from collections import deque
from typing import Iterator, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import sharded_ddp_arguments as args
from shardkit.nn.data_parallel.gradient_bucket import (BucketLayout, BucketReduction,
                                                       ReduceToOwners, plan_buckets)
from shardkit.nn.data_parallel.sync_batchnorm import (refuse_training_sync_batchnorm,
                                                      sync_batchnorm_layers)
from shardkit.transport import resolve_transport
from shardkit.utils.swapped_tensors import reattach_hook_dicts, swapped_since, tensor_mark
from shardkit.utils.weak_hooks import weakly_bound
from shardkit.utils.wrapped_attributes import attribute_through

__all__ = ["ShardedDataParallel"]

# Bytes of packed buckets whose reduction may be in flight at once during backward; beyond that
# the oldest is waited for. A byte budget, not a bucket count: many small buckets may be in
# flight without blocking backward, while the transient memory stays bounded. ``None`` (the
# default) is two of the largest bucket (reduce_buffer_size, or a parameter larger than it):
# the peak during backward then stays at the rank's share of the gradients plus about two
# buckets (it was 64 MiB, which let every bucket of a small model stay in flight on the rank
# ahead, holding about all of the model's gradients).
DEFAULT_MAX_INFLIGHT_BYTES = None


class ShardedDataParallel(nn.Module):
    """Data parallelism with sharded gradients (ZeRO-2), to be used with one or more ``OSS``.

    Args:
        module: the model; every rank wraps the same architecture. A module on the CPU
            holding a ``torch.nn.SyncBatchNorm`` in training mode is a ValueError (torch's
            SyncBatchNorm trains on CUDA/XPU tensors only): keep ``nn.BatchNorm*d`` there.
            One in eval mode is accepted, and refused at forward if it is training by then.
        sharded_optimizer: an :class:`~shardkit.optim.OSS`, or a list of them, over parameters of
            ``module``; together they must cover every trainable parameter.
        process_group: the data-parallel group (default: the optimizers' group; if given, it must
            contain the same ranks as theirs).
        broadcast_buffers: broadcast rank 0's module buffers at the start of forward (by
            ``comm``), as torch DDP: skipped when the previous forward ran inside
            :meth:`no_sync` or without grad, so once per accumulation window. The first
            forward after a reducing backward broadcasts even under ``torch.no_grad()`` or
            in evaluation mode (every rank then evaluates with rank 0's statistics), so with
            a module that holds buffers a forward one rank runs alone goes through
            ``ddp.module(...)``, as under torch DDP: through the wrapper it waits for the
            other ranks' broadcast.
        sync_models_at_startup: broadcast rank 0's parameters and buffers at wrap time (by
            ``comm``, like every collective of this wrapper).
        reduce_buffer_size: bucket size in bytes (in the communication dtype); ``0`` reduces
            each parameter on its own.
        auto_refresh_trainable: notice at forward when ``requires_grad`` changed (or the
            dtype or device of a trainable parameter, ``ddp.double()``, or an OSS
            re-partitioned) and re-plan the buckets; otherwise call :meth:`refresh_trainable`.
            The ranks agree on it: the first forward in training mode with grad enabled
            after each reduction (and a forward that finds a change) all-gathers one control
            row per rank (a wait for the device on CUDA), so a change made between steps on some
            ranks only raises the same ValueError on every rank (naming the parameter) instead
            of hanging them. So does the start of each reducing backward (before any bucket
            is sent) and :meth:`reduce`, one element per rank more: a change inside an
            accumulation window (after a :meth:`no_sync` backward) on some ranks only raises
            on every rank too; made on every rank at the same forward, it is re-planned there,
            except that freezing a parameter that holds a gradient accumulated in the window
            is a ValueError (that gradient would be neither reduced nor stepped).
            Every rank must therefore run that forward: a forward that one rank runs alone
            (validation, logging) belongs under ``torch.no_grad()`` or ``module.eval()``
            (and on ``ddp.module`` where ``broadcast_buffers`` has buffers to broadcast).
            A forward in evaluation mode runs no agreement: a ``requires_grad`` change it
            finds is re-planned at the next agreement (a training forward, or the start of a
            reducing backward when training in evaluation mode), by every rank together.
        warn_on_trainable_params_changed: with ``auto_refresh_trainable=False``, warn once per
            change when forward finds the buckets planned for other trainable parameters.
        reduce_fp16: gradients travel in fp16 (``True``) or in the dtype given
            (``torch.bfloat16``); owners receive them back in the parameters' dtype.
        comm: the :class:`~shardkit.transport.Transport` that reduces the buckets (default: the
            process group's own collectives; not in FairScale's signature).
        max_inflight_bytes: bytes of packed buckets whose reduction may be in flight while
            backward goes on; past it backward waits for the oldest (reductions that have
            arrived are finished, and their buffers freed, at the next gradient without
            waiting). ``None`` (default): two of the largest bucket, ``2 * max(
            reduce_buffer_size, largest gradient)``; ``0``: one.
            Not in FairScale's signature.
        step_in_backward: step the optimizers during backward: as soon as the gradients of
            one of OSS's sync buckets are reduced, its owner steps it and starts its
            all-gather, which the next forward waits for module by module; ``optimizer.step()``
            then has nothing left to do. Hides the step and most of the parameter sync behind
            backward on a slow link. Needs an optimizer that updates each parameter alone (SGD,
            Adam, AdamW, Adagrad); gradients cannot be clipped or inspected before the update,
            and accumulation must use :meth:`no_sync`. Creates one more process group over
            the same ranks (the all-gathers' own) at construction: with the whole world, every
            rank constructs it together; with a sub-group, only its members do, and they must
            have created as many process groups before it. Not in FairScale's signature.

    Attributes that torch DDP code reads are there: ``module``, ``process_group``,
    ``broadcast_buffers``, ``device_type``, ``is_multi_device_module``, ``device_ids`` and
    ``output_device`` (the device index for a module on one accelerator, else ``None``),
    ``dim``, ``require_backward_grad_sync`` (``False`` inside :meth:`no_sync`),
    ``bucket_bytes_cap``; and FairScale's: ``sharded_optimizers`` (the list of OSS
    instances), ``reduce_fp16``, ``reduce_buffer_size``, ``auto_refresh_trainable``; other
    unknown attributes are looked up on the wrapped module.
    A gradient that itself requires grad (``backward(create_graph=True)``) raises
    ``RuntimeError`` before it is reduced: double backward through the reduction is not
    supported (inside :meth:`no_sync` it is fine). So does a gradient accumulated twice into
    one parameter in one backward (used inside a reentrant checkpoint and outside it), as torch
    DDP does: its bucket may already be reduced (inside :meth:`no_sync`, then :meth:`reduce`,
    it is fine). Sparse gradients (``nn.Embedding(sparse=True)``) are reduced densely: the
    owner receives a dense gradient (the same update for SGD; an OSS over ``SparseAdam``,
    which takes sparse gradients only, is refused at construction).

    Cost per rank (Ψ parameters, N ranks; DESIGN.md stage 2): gradient bytes after backward
    4Ψ/N in fp32, the rank's owned share (whole parameters, so up to one parameter more) plus
    one flag per owned parameter. During backward, beyond the activations (B: the largest
    bucket, ``reduce_buffer_size`` or one parameter larger than it): the reduced gradients
    this rank owns so far (up to 4Ψ/N), the local gradients of the next buckets (about one
    bucket once the order is settled), the packed buckets in flight (up to
    ``max_inflight_bytes``, two buckets by default, and at least one, plus the one being
    packed, whose gradients are freed one owner's segment at a time as they are copied) and
    the transport's receive buffers for them (gloo: ``N-1`` copies of this rank's segment of
    each). A reduction that has arrived is finished at the next gradient, freeing its buffers.
    Measured (tests/nn/test_sharded_ddp_peak_memory.py; GPT and MLP, 2 and 4 gloo ranks) the
    peak stays below the backward's own activation peak plus 4Ψ/N plus 0.6 B at 2 ranks and
    2.7 B at 4. A model in one bucket (the default 8 MiB bucket for a small model) peaks at
    its packed bucket plus the receive buffers, 4Ψ + 4Ψ(N-1)/N. Also a set of the parameters
    whose gradient has arrived (one id each).
    Communication per step: the gradient reduction, (N-1)/N·Ψ elements in the DESIGN
    convention (plus the padding of reduce-scattered buckets, at most ``balance_tolerance``),
    plus OSS's parameter sync, (N-1)/N·Ψ: 2Ψ(N-1)/N together. ``broadcast_buffers`` adds the
    module's buffers once per step (at the first forward after a reducing one, as torch DDP);
    one control row per rank (128 bytes, not counted by ``CommCounter``) all-gathered at the
    first forward of a step and at the start of a reducing backward
    (``auto_refresh_trainable``), and per :meth:`reduce`, plus the ``requires_grad`` flags
    when one changed.

    Usage::

        model = MyModel()
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        model = ShardedDataParallel(model, optimizer)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            loss.backward()                 # owners now hold reduced grads, others None
            optimizer.clip_grad_norm(1.0)   # optional: the global norm over every rank
            optimizer.step()
            optimizer.zero_grad()

    Clip with ``optimizer.clip_grad_norm`` (as in FairScale), not
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``: each rank holds only the
    gradients it owns, so torch's function measures a different partial norm on each rank
    and clips each rank's share by another factor (it cannot be intercepted to refuse it).

    ``no_sync()`` is decided when backward starts: backward passes that start inside it
    accumulate locally and the first one outside reduces the sum; or, as in FairScale, the
    last backward also runs inside ``no_sync()`` and :meth:`reduce` then reduces the sum.
    Gradients accumulated across
    backward passes without zeroing stay correct (the owner's reduced gradient is carried:
    set aside while the next reduction runs and added to its result, so fp16 sums stay finite).
    Buckets are first planned in reverse registration order, then, after the first reduced
    backward, re-planned once in the order rank 0's gradients really arrived (as torch DDP
    does); a bucket that completes early waits for the ones planned before it.

    Construction checks, in one small all-gather, that every rank wraps the same module with
    the same arguments (a ValueError on every rank otherwise).

    .. warning:: Construction, :meth:`refresh_trainable`, forward (with ``broadcast_buffers``,
        or a step's first with grad enabled and ``auto_refresh_trainable``), backward and
        :meth:`reduce` issue collectives: call them on every rank of the group.
    """

    def __init__(self, module: nn.Module, sharded_optimizer, process_group=None,
                 broadcast_buffers: bool = True, sync_models_at_startup: bool = True,
                 reduce_buffer_size: int = 2 ** 23, auto_refresh_trainable: bool = True,
                 reduce_fp16: Union[bool, torch.dtype] = False, comm=None,
                 max_inflight_bytes: Optional[int] = DEFAULT_MAX_INFLIGHT_BYTES,
                 step_in_backward: bool = False, warn_on_trainable_params_changed: bool = True):
        super().__init__()
        skdist.require_initialized("ShardedDataParallel")
        skdist.check_group(process_group, "ShardedDataParallel", "process_group")
        if not isinstance(module, nn.Module):
            raise TypeError(f"ShardedDataParallel(module=...): expected an nn.Module, got "
                            f"{type(module).__name__}")
        args.check_not_data_parallel(module)
        optimizers = args.as_oss_list(sharded_optimizer)
        args.check_reduce_buffer_size(reduce_buffer_size)
        args.check_bool_flags(broadcast_buffers=broadcast_buffers,
                              sync_models_at_startup=sync_models_at_startup,
                              auto_refresh_trainable=auto_refresh_trainable,
                              warn_on_trainable_params_changed=warn_on_trainable_params_changed)
        self._comm_dtype = args.comm_dtype_from(reduce_fp16)
        largest = max((p.numel() * (p.element_size() if self._comm_dtype is None else
                                    self._comm_dtype.itemsize)
                       for p in module.parameters() if p.requires_grad), default=0)
        self.max_inflight_bytes = args.max_inflight_bytes_from(max_inflight_bytes,
                                                               reduce_buffer_size, largest)
        self.reduce_fp16 = reduce_fp16
        self.comm = resolve_transport(comm, "ShardedDataParallel")
        self.process_group = args.common_group(process_group, optimizers)
        args.check_optimizer_params_in_module(module, optimizers)

        device_types = args.device_types(module)
        refuse_training_sync_batchnorm(module.named_modules(), "ShardedDataParallel(module=...)",
                                       torch.device(device_types[0] if device_types else "cpu"))
        self.module = module
        self.sharded_optimizers = optimizers
        # Attributes torch DDP exposes and training frameworks read (FairScale sets them too).
        self.device_type = device_types[0] if device_types else "cpu"
        self.is_multi_device_module = len({p.device for p in module.parameters()}) > 1
        single = next(module.parameters(), None)
        on_one_accelerator = (single is not None and not self.is_multi_device_module
                              and single.device.type != "cpu")
        self.device_ids = [single.device.index] if on_one_accelerator else None
        self.output_device = single.device.index if on_one_accelerator else None
        self.dim = 0
        self.find_unused_parameters = True   # unused parameters are handled, nothing to set
        self.require_forward_param_sync = True
        self.gradient_as_bucket_view = False
        self.static_graph = False
        self.rank = skdist.get_rank(self.process_group)
        self.world_size = skdist.get_world_size(self.process_group)
        self.broadcast_buffers = broadcast_buffers
        self.auto_refresh_trainable = auto_refresh_trainable
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        self._warned_for: Optional[tuple] = None  # the plan signature last warned about
        self.reduce_buffer_size = reduce_buffer_size

        self._hooked: dict = {}               # param -> _ParamHooks (its two hook handles)
        weakref.finalize(self, _remove_hooks, self._hooked)  # the wrapper dropped
        self._hooks_released = False          # a newer wrapper took this one's hooks
        self._buckets: list[BucketLayout] = []
        self._bucket_of: dict = {}            # param -> bucket index
        # (requires_grad flags, trainable dtypes and devices, trainable parameters,
        # partitions) of the plan, and a digest of what every rank must plan alike
        self._planned_with: tuple = ((), (), (), ())
        self._planned_fingerprint = 0
        self._planned_names: dict = {}        # name -> the trainable parameter planned under it
        self._sync_enabled = True
        self._window_open = False             # a grad-enabled forward ran since the last reduction
        self._accumulated_locally = False     # a no_sync() backward ran since the last reduction
        self._backward_active = False
        self._syncing = False
        self._ready_count: list[int] = []
        self._arrived: set = set()            # ids of the params whose gradient this backward had
        self._next_launch = 0
        self._in_flight: deque[BucketReduction] = deque()
        # param -> (id, tensor_mark) of the reduced grad this wrapper gave it: not a weak
        # reference, which swap_tensors refuses (.to() under swap mode with live gradients)
        self._carried: dict = {}
        # param -> the carried gradient set aside while a reduction runs (added to its result)
        self._held: dict = {}
        self._trainable: list = []            # trainable params, registration order
        self._owner_of: dict = {}
        self._observed: Optional[list] = None  # grads' arrival order, until the order is settled
        self._check_step_in_backward(step_in_backward)
        self._owners_of(self._trainable_params())  # every trainable parameter has an owner
        # the last local check is above: the ranks now compare what they were given
        args.check_same_wrapping_on_every_rank(
            module, self.process_group, broadcast_buffers=broadcast_buffers,
            sync_models_at_startup=sync_models_at_startup, reduce_buffer_size=reduce_buffer_size,
            reduce_fp16=reduce_fp16, comm=type(self.comm).__name__,
            max_inflight_bytes=max_inflight_bytes, step_in_backward=step_in_backward)
        self.comm.prepare(self.process_group)
        self.step_in_backward = self._prepare_step_in_backward(step_in_backward)
        self._steps_after: list[list] = []    # reduce bucket -> (optimizer, sync bucket)s

        self._build_plan(refresh_optimizers=False)
        if sync_models_at_startup and self.world_size > 1:
            skdist.broadcast_tensors_from_rank0(
                list(module.parameters()) + list(module.buffers()), self.process_group,
                max(self.reduce_buffer_size, 1 << 20), self.comm)

    # ------------------------------------------------------------------ public surface

    def __getstate__(self):
        # Note: a copy would share hooks with, or deep-copy, the OSS optimizers this wrapper
        # reduces into (which refuse to be copied: they hold this rank's shard). pickle,
        # torch.save(model) and copy.deepcopy (AveragedModel(model) for EMA/SWA) come here.
        raise TypeError(
            "ShardedDataParallel cannot be pickled or copied (pickle, torch.save(model), "
            "copy.deepcopy, torch.optim.swa_utils.AveragedModel(model)): its hooks reduce "
            "gradients into the OSS optimizers it was built with, which hold this rank's shard. "
            "Copy the wrapped module instead: copy.deepcopy(model.module), or "
            "AveragedModel(model.module) (update_parameters(model) then reads the live "
            "weights); save model.state_dict()")

    def forward(self, *inputs, **kwargs):
        """Run the module; first re-plan if the trainable set changed on any rank
        (``auto_refresh_trainable``: one control row per rank all-gathered at a step's first
        forward with grad enabled) and broadcast rank 0's buffers (``broadcast_buffers``; as
        torch DDP, only when the previous forward was a reducing one, grad enabled and outside
        :meth:`no_sync`, or :meth:`reduce` ran since)."""
        refuse_training_sync_batchnorm(sync_batchnorm_layers(self, self.module),
                                       "ShardedDataParallel", torch.device(self.device_type))
        if self._backward_active:
            self._forget_aborted_backward()
        if self._hooks_released and torch.is_grad_enabled():
            # only a forward that may lead to a backward, as only such a forward arms torch
            # DDP's reducer: a no-grad one (a target or evaluation pass) between the newest
            # wrapper's forward and its backward took every hook the newest one held
            self._take_hooks_back()
        elif torch.is_grad_enabled() and self._hooked:
            self._rehook_swapped_parameters()
        if self._sync_enabled:
            self._check_grads_do_not_require_grad(
                p.grad for p in self._trainable if p.grad is not None)
        if torch.is_grad_enabled():
            if self.auto_refresh_trainable and not self.training:
                # an evaluation forward (module.eval()), which one rank may run alone (rank 0
                # validating, grad left enabled as DeepSpeed's engine leaves it): never a
                # collective. A cast alone is re-planned locally (the ranks compare plans at
                # the next agreement); a requires_grad change waits for the next agreement (a
                # training forward, or the start of a reducing backward), where every rank
                # re-plans together: OSS's refresh_trainable on one rank alone hung the others
                if self._plan_is_stale() and self._only_cast_since_plan():
                    self._build_plan(refresh_optimizers=False)
            elif self.auto_refresh_trainable:
                # agreed at the window's first training forward (one per rank and step, even
                # where the ranks run different numbers of forwards), or at once where it
                # changed here
                stale = self._plan_is_stale()
                drops = stale and self._window_open and self._drops_local_grads()
                if (stale or not self._window_open) and self._plan_is_stale_on_any_rank(
                        stale, _AT_FORWARD, drops):
                    self.refresh_trainable()
                self._window_open = True
            elif self._plan_is_stale():
                self._warn_stale_plan()
        if self.broadcast_buffers and self.require_forward_param_sync:
            self.sync_buffers()
        output = self.module(*inputs, **kwargs)
        # torch DDP's rule: the next forward broadcasts the buffers only if this one may lead
        # to a reducing backward (grad enabled, outside no_sync()), so an accumulation window
        # broadcasts once, at its first micro-batch, as DistributedDataParallel does
        self.require_forward_param_sync = torch.is_grad_enabled() and self._sync_enabled
        return output

    def _plan_is_stale_on_any_rank(self, stale: bool, site: int,
                                   drops_grads: bool = False) -> bool:
        """Whether ``requires_grad`` (or an OSS partition) changed on any rank since the plan
        (``stale``: on this one): one control row per rank all-gathered over the group
        (:func:`~shardkit.distributed.gather_control_rows`; a wait for the device on CUDA), so
        that a change on some ranks only is noticed by all of them rather than hanging the
        others, and a rank in another agreement (OSS's step, after a step skipped on some
        ranks) is named on every rank. An all-gather: no gradient goes to every rank.

        Each element also says where its rank is (``site``: a forward, the start of a reducing
        backward, :meth:`reduce`). Where some rank found a change, every rank then compares
        the ``requires_grad`` flags (one object all-gather): a ValueError naming the first
        parameter that differs, the same on every rank. Ranks found at different sites (a
        change inside an accumulation window on some ranks only: one rank agreeing at a
        forward, the others at the end of the window) raise a RuntimeError on every rank even
        when their flags agree by then, and so does a parameter frozen inside a window while it
        holds a gradient accumulated there (``drops_grads`` on some rank): it would be neither
        reduced nor stepped, where one process steps it (a ValueError naming it). Every rank
        decides from the same gathered values, so every rank issues the same collectives and
        none is left waiting. Nothing is re-planned here: ``True`` (a change, agreed by every
        rank at the same site) leaves that to the caller."""
        replaced = self._replaced_parameters() if stale else []
        if stale and not replaced:
            # a parameter added to an OSS outside the module: refused before any collective
            args.check_optimizer_params_in_module(self.module, self.sharded_optimizers)
        if self.world_size == 1:
            if replaced:
                raise self._replaced_error(replaced)
            return stale
        code = 16 * bool(replaced) + 8 * drops_grads + 2 * site + stale
        every = [row[0] for row in skdist.gather_control_rows(
            "ShardedDataParallel (its ranks' agreement on the trainable parameters)",
            [self._planned_fingerprint << _CODE_BITS | code], self.process_group,
            kind=_TRAINABLE_AGREEMENT)]
        codes = [c & _CODE_MASK for c in every]
        if not any(c & 1 for c in codes):
            if len({c >> _CODE_BITS for c in every}) > 1:
                raise self._plans_differ_error()
            return False
        if any(c & 16 for c in codes):
            raise self._replaced_error(replaced)
        self._window_open = False  # every rank agrees again at its next training forward
        sites = {(c >> 1) & 3 for c in codes}
        if sites == {_AT_REDUCE}:
            return True  # reduce() refuses it (as before: no re-plan inside reduce)
        self._raise_on_different_parameters()
        if len(sites) > 1:
            raise RuntimeError(
                "ShardedDataParallel: requires_grad changed inside an accumulation window "
                "(after a no_sync() backward) on some ranks and not at the same forward on "
                "the others; change requires_grad between steps (after the reducing backward "
                "or reduce()), identically on every rank; the buckets were not re-planned")
        if any(c & 8 for c in codes):
            frozen = [name for name, q in self.module.named_parameters()
                      if q in self._owner_of and not q.requires_grad]
            raise ValueError(
                f"ShardedDataParallel: requires_grad turned False on {frozen} inside an "
                f"accumulation window, after a no_sync() backward gave them gradients: those "
                f"would be neither reduced nor stepped (one process steps them). Freeze "
                f"between steps (after the reducing backward, or after zero_grad()); the "
                f"buckets were not re-planned")
        return True

    def _raise_on_different_parameters(self) -> None:
        """A ValueError on every rank naming the first parameter whose ``requires_grad``, dtype
        or device type differs between the ranks (one object all-gather)."""
        flags = {f"parameter {name!r}.{what}": value
                 for name, p in self.module.named_parameters()
                 for what, value in _planned_attributes(p)}
        skdist.raise_on_disagreement(
            flags, self.process_group, "ShardedDataParallel",
            "change requires_grad identically on every rank (and cast parameters alike), "
            "between steps (the ranks would reduce different gradients); the buckets were not "
            "re-planned")

    def _plans_differ_error(self) -> ValueError:
        """No rank found its plan stale, yet the ranks planned for different parameters: one
        re-planned alone at an evaluation forward (a cast on that rank only). Names the
        parameter (its current attributes are the ones planned) on every rank."""
        self._raise_on_different_parameters()
        return ValueError("ShardedDataParallel: the ranks planned their gradient buckets for "
                          "different parameters (a cast or requires_grad change seen at an "
                          "evaluation forward on some ranks only); cast and freeze parameters "
                          "identically on every rank")

    def _replaced_parameters(self) -> list[str]:
        """Names under which the module now holds another trainable Parameter object than
        the one planned there (Hugging Face's ``resize_token_embeddings()`` builds a new
        output layer when it is not tied to the input embedding; a head or adapter module
        put in place of another). A planned parameter found under another planned one's name
        (two layers swapped, a module moved) is not replaced: the plan is redone with it.
        Local."""
        planned = {id(p) for p in self._planned_names.values()}
        return [name for name, p in self.module.named_parameters()
                if p.requires_grad and name in self._planned_names and id(p) not in planned]

    def _replaced_error(self, names: list[str]) -> ValueError:
        """The error every rank raises when some rank found :meth:`_replaced_parameters`
        (``names``: this rank's, empty where only another rank replaced them)."""
        where = f"parameter(s) {names} of the wrapped module were" if names else \
            "on another rank, parameters of the wrapped module were"
        return ValueError(
            f"ShardedDataParallel: {where} replaced by new Parameter objects after "
            f"ShardedDataParallel was built (e.g. Hugging Face's resize_token_embeddings() "
            f"giving an untied output layer a new weight, or a module swapped for a new "
            f"head or adapter): the OSS optimizers and the reduction buckets hold the old "
            f"ones, so the new ones would be neither averaged nor stepped. Change the model "
            f"first, then build OSS and ShardedDataParallel over it; the buckets were not "
            f"re-planned")

    def _drops_local_grads(self) -> bool:
        """Whether a parameter of the plan, now frozen, holds a gradient (local, accumulated
        inside the window). Local."""
        return any(not p.requires_grad and p.grad is not None for p in self._trainable)

    def _warn_stale_plan(self) -> None:
        """Once per change: with ``auto_refresh_trainable=False`` a parameter that became
        trainable has no reduction hook until :meth:`refresh_trainable`, so its gradient would
        stay local (FairScale warns alike)."""
        signature = self._plan_signature()
        if not self.warn_on_trainable_params_changed or _same_signature(signature,
                                                                        self._warned_for):
            return
        self._warned_for = signature
        replaced = self._replaced_parameters()
        also = f"; parameter(s) {replaced} were replaced by new Parameter objects, which " \
            f"refresh_trainable() refuses: build OSS and ShardedDataParallel over the changed " \
            f"model" if replaced else ""
        warnings.warn("ShardedDataParallel: the trainable parameters (or their dtype, or an "
                      "OSS partition) changed since the buckets were planned and "
                      "auto_refresh_trainable=False; call refresh_trainable() on every rank, or "
                      "the gradients of newly trainable parameters are not reduced (and those "
                      f"of cast ones travel in the dtype planned){also}", RuntimeWarning,
                      stacklevel=3)

    def sync_buffers(self, blocking: bool = False) -> None:
        """Broadcast rank 0's module buffers (BatchNorm statistics...) to every rank, as
        FairScale's method; ``blocking`` is accepted, the broadcast always completes before
        returning. Collective: call on every rank. Wire: (N-1)/N of the buffers' bytes."""
        buffers = list(self.module.buffers())
        if buffers and self.world_size > 1:
            # version counters kept, as torch DDP's broadcast keeps them: a second forward
            # before one backward (training then evaluation) must not fail the first one's
            # backward for a running statistic it saved
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                skdist.broadcast_tensors_from_rank0(buffers, self.process_group,
                                                    max(self.reduce_buffer_size, 1 << 20),
                                                    self.comm)

    def __getattr__(self, name: str):
        """Attributes this wrapper lacks are looked up on the wrapped module (as FairScale)."""
        return attribute_through(self, name, "module")

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: ``False`` inside :meth:`no_sync` (gradients stay local). Settable
        as torch DDP's (nanoGPT's accumulation: ``model.require_backward_grad_sync =
        (micro_step == last)``): ``False`` makes the following backward passes accumulate
        locally, as inside :meth:`no_sync`; the first backward with ``True`` reduces the sum.
        Set it alike on every rank. Local; a non-bool is a TypeError."""
        return self._sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"ShardedDataParallel.require_backward_grad_sync = {value!r}: "
                            f"expected True or False")
        self._sync_enabled = value

    @property
    def bucket_bytes_cap(self) -> int:
        """torch DDP's name for ``reduce_buffer_size``."""
        return self.reduce_buffer_size

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes started inside accumulate gradients locally (full gradients on every
        rank, no communication); the first backward outside reduces the accumulated sum."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def reduce(self) -> None:
        """Reduce the gradients accumulated so far to their owners now, as the end of a
        backward outside :meth:`no_sync` would (FairScale's manual reduction): typically after
        backward passes inside ``no_sync()``. Owners then hold the average over ranks, the
        others none. Calling it again, with no backward in between, changes nothing (with
        ``step_in_backward=True``, where it also steps, it is an error before ``step()``).
        Collective: call on every rank alike, between backward and step. Wire: one reduced
        backward's, ``(N-1)/N`` of the trainable gradients' bytes in all."""
        if self._backward_active:
            raise RuntimeError("ShardedDataParallel.reduce() was called during backward; call "
                               "it after backward, before optimizer.step()")
        self.require_forward_param_sync = True  # the window ends: the next forward broadcasts
        if self.world_size == 1:
            return
        self._window_open = False
        self._accumulated_locally = False
        # agreed (one element): a change on one rank only must not leave the others reducing
        if self._plan_is_stale_on_any_rank(self._plan_is_stale(), _AT_REDUCE):
            raise RuntimeError("ShardedDataParallel.reduce(): the trainable parameters changed "
                               "since the last forward (on this rank or another); run a "
                               "forward first (or call refresh_trainable() on every rank)")
        if self._steps_after and any(o._stepped_in_backward is not None
                                     for o in self.sharded_optimizers):
            raise RuntimeError("ShardedDataParallel.reduce(): with step_in_backward=True the "
                               "owners already stepped on the last reduction; call "
                               "optimizer.step() before reducing again")
        self._carry_reduced_grads(reducing=True)
        self._syncing = True
        self._begin_owner_steps()
        try:
            self._next_launch = 0
            self._launch_rest_and_wait()
        finally:
            self._syncing = False
            self._restore_held_grads()

    def refresh_trainable(self) -> None:
        """Re-partition the OSS optimizers (``OSS.refresh_trainable``: collective when ownership
        moves) and re-plan the buckets after ``requires_grad`` changed. Call it on every rank
        alike, between steps."""
        if self._backward_active:
            raise RuntimeError("ShardedDataParallel.refresh_trainable() was called during "
                               "backward; call it between steps")
        self._build_plan(refresh_optimizers=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every gradient of the module, as ``nn.Module.zero_grad``."""
        self._carried.clear()
        self._held.clear()
        self.module.zero_grad(set_to_none=set_to_none)

    def model_state_tensors(self):
        """Buckets in flight, reported as gradient memory to ``model_state_bytes``."""
        for reduction in self._in_flight:
            for t in reduction.tensors_in_flight():
                yield "grads", t

    @property
    def buckets(self) -> tuple[BucketLayout, ...]:
        """The current bucket layouts, in launch (backward) order."""
        return tuple(self._buckets)

    # ------------------------------------------------------------------ planning

    def _trainable_params(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _plan_signature(self) -> tuple:
        params = tuple(self.module.parameters())
        flags = tuple(p.requires_grad for p in params)
        # the trainable parameter objects too: one replaced in place of another (same flag,
        # same position) would otherwise keep the old plan, its gradient never reduced
        trainable = tuple(p for p in params if p.requires_grad)
        # and their dtypes and devices: the buckets pack the gradients in the dtype planned (a
        # model cast to fp64 after wrapping had them reduced in fp32)
        kinds = tuple([(p.dtype, p.device) for p in trainable])
        return flags, kinds, trainable, tuple(o.partition for o in self.sharded_optimizers)

    def _plan_is_stale(self) -> bool:
        # Partitions compare by identity: OSS replaces the object whenever ownership changes
        # (holding them here also keeps their ids from being reused).
        return not _same_signature(self._plan_signature(), self._planned_with)

    def _only_cast_since_plan(self) -> bool:
        """Whether the trainable parameters, their flags and the partitions are the ones
        planned and only a dtype or device changed (``ddp.half()``): the buckets can be
        re-planned locally, with no collective (OSS re-lays its own buckets at its step)."""
        now, planned = self._plan_signature(), self._planned_with
        flags, kinds, *parameters_and_partitions = now
        same_parameters = _same_signature((flags, planned[1], *parameters_and_partitions),
                                          planned)
        return kinds != planned[1] and same_parameters

    def _build_plan(self, refresh_optimizers: bool) -> None:
        if refresh_optimizers:
            replaced = self._replaced_parameters()
            if replaced:  # local, before any collective, as the check below
                raise self._replaced_error(replaced)
            # a parameter added since (OSS.add_param_group) must be the module's too, as at
            # construction: no hook would ever average its gradient. Local, before any collective.
            args.check_optimizer_params_in_module(self.module, self.sharded_optimizers)
            for optimizer in self.sharded_optimizers:
                optimizer.refresh_trainable()
        trainable = self._trainable_params()
        owner_of = self._owners_of(trainable)
        if self.world_size > 1:
            for p in trainable:
                self._hook(p)
        self._trainable, self._owner_of = trainable, owner_of
        self._plan_in_order(list(reversed(trainable)))
        self._observed = [] if self.world_size > 1 else None
        self._planned_with = self._plan_signature()
        self._planned_names = {name: p for name, p in self.module.named_parameters()
                               if p.requires_grad}
        self._planned_fingerprint = zlib.crc32(repr([
            (name, _planned_attributes(p)) for name, p in self.module.named_parameters()
        ]).encode())

    def _plan_in_order(self, backward_order: list) -> None:
        self._buckets = plan_buckets(
            backward_order, self._owner_of.__getitem__, self.world_size,
            self.reduce_buffer_size, lambda p: self._comm_dtype or p.dtype)
        self._bucket_of = {p: b.index for b in self._buckets for p in b.params}
        self._steps_after = self._plan_steps_in_backward()

    def _plan_steps_in_backward(self) -> list[list]:
        """For each reduce bucket, the OSS sync buckets whose gradients are all reduced once
        it is (``(optimizer index, sync bucket index)``, in that order). Every rank derives the
        same lists from the plan, so the all-gathers start in the same order everywhere."""
        if not self.step_in_backward or not self._buckets or self.world_size == 1:
            return []
        after: list[list] = [[] for _ in self._buckets]
        last_bucket = len(self._buckets) - 1
        for o, optimizer in enumerate(self.sharded_optimizers):
            for s, params in enumerate(optimizer._sync_bucket_params()):
                last = max((self._bucket_of[p] for p in params if p in self._bucket_of),
                           default=last_bucket)
                after[last].append((o, s))
        return after

    def _settle_bucket_order(self) -> None:
        """After the first reduced backward of a plan: re-plan the buckets in the order rank 0's
        gradients really arrived (as torch DDP rebuilds its buckets), parameters that got none
        last. Every rank adopts rank 0's order: one small object broadcast, once per plan."""
        index = {p: i for i, p in enumerate(self._trainable)}
        seen = list(dict.fromkeys(index[p] for p in self._observed if p in index))
        planned = [index[p] for b in self._buckets for p in b.params]
        unseen = set(planned) - set(seen)
        mine = seen + [i for i in planned if i in unseen]
        order = skdist.broadcast_object(mine if self.rank == 0 else None,
                                        src=skdist.get_global_rank(self.process_group, 0),
                                        group=self.process_group)
        self._observed = None
        if order != planned:
            self._plan_in_order([self._trainable[i] for i in order])

    def _owners_of(self, trainable: Sequence[torch.Tensor]) -> dict:
        """``{param: owning group rank}`` from the optimizers' partitions (re-partitioning an
        optimizer whose partition predates a ``requires_grad`` change)."""
        owner_of = {}
        missing = []
        for p in trainable:
            for optimizer in self.sharded_optimizers:
                if p in optimizer.partition:
                    owner_of[p] = optimizer.partition.owner(p)
                    break
            else:
                missing.append(p)
        stale = [o for o in self.sharded_optimizers
                 if any(args.in_param_groups(p, o) for p in missing)]
        if stale:
            for optimizer in stale:
                optimizer.refresh_trainable()
            return self._owners_of(trainable)
        if missing:
            names = args.param_names(self.module, missing)
            raise ValueError(f"ShardedDataParallel: trainable parameter(s) {names} are in no "
                             f"optimizer's param groups; pass an OSS covering them, or set "
                             f"requires_grad=False on them")
        return owner_of

    def _hook(self, p: torch.Tensor) -> None:
        if p in self._hooked:
            return
        _take_hooks_over(p, self)
        reattach_hook_dicts(p)
        # Note: weakly bound, both: torch keeps post-accumulate-grad hooks in C++, where the
        # garbage collector cannot see the cycle back to this wrapper (it kept every ShardedDDP,
        # its module and optimizer alive after the user dropped them); and a module the user
        # keeps holds its parameters' tensor hooks, which kept a dropped wrapper alive and
        # reducing at every backward through the module (a backward on one rank alone hung)
        self._hooked[p] = _ParamHooks(
            p.register_hook(weakly_bound(self._on_grad_incoming)),
            p.register_post_accumulate_grad_hook(weakly_bound(self._on_grad_accumulated)),
            tensor_mark(p))

    def _rehook_swapped_parameters(self) -> None:
        """Hook again the parameters given another tensor since they were hooked
        (``torch.utils.swap_tensors``: ``load_state_dict`` or ``.to()`` under
        ``torch.__future__.set_swap_module_params_on_conversion(True)``), whose hooks autograd
        no longer runs: this wrapper reduced none of their gradients and each owner stepped on
        its own rank's. Local; a dict look-up per hooked parameter."""
        swapped = [p for p, hooks in self._hooked.items()
                   if swapped_since(p, hooks.tensor_mark)]
        for p in swapped:
            self._hooked.pop(p).remove()
            self._hook(p)
            self._follow_converted_grad(p)

    def _follow_converted_grad(self, p: torch.Tensor) -> None:
        """A reduced gradient still in ``p.grad`` when ``.to()`` converted ``p`` through
        ``swap_tensors`` is the same Python object with a new tensor (and without its mark):
        it is still the carried one, which the next backward adds to."""
        grad_id, mark = self._carried.get(p, (None, None))
        g = p.grad
        if g is not None and id(g) == grad_id and swapped_since(g, mark):
            self._carried[p] = (grad_id, tensor_mark(g))

    def _release_hooks(self) -> None:
        """Remove this wrapper's gradient hooks: a newer ShardedDataParallel wraps its
        parameters. Its next forward takes them back (:meth:`_take_hooks_back`)."""
        _remove_hooks(self._hooked)
        self._hooks_released = True

    def _take_hooks_back(self) -> None:
        """At a forward with gradients enabled of a wrapper whose hooks a newer one took: hook
        its parameters again (the newer one's hooks on them are released in turn)."""
        self._hooks_released = False
        if self.world_size > 1:
            for p in self._trainable:
                self._hook(p)

    # ------------------------------------------------------------------ backward

    # Note: ordering. Collectives must be issued in the same order on every rank, whatever
    # the timing of autograd. Buckets are therefore launched strictly in plan order: a bucket
    # that is complete waits for the ones before it; buckets still incomplete when backward
    # ends (unused parameters) are launched then, by the callback queued on the engine, which
    # also waits for every reduction, so gradients are in place when backward() returns.

    def _check_grads_do_not_require_grad(self, grads) -> None:
        if any(g.requires_grad for g in grads):
            raise RuntimeError("ShardedDataParallel: a gradient requires grad (backward with "
                               "create_graph=True, or a .grad that is part of a graph); "
                               "double backward through the gradient reduction is not "
                               "supported. Use no_sync() for such a backward, or detach the "
                               "gradients (p.grad = p.grad.detach())")

    def _on_grad_incoming(self, grad):
        if self._sync_enabled and not self._backward_active:
            self._check_grads_do_not_require_grad((grad,))
        if not self._backward_active:
            self._begin_backward()
        elif self._syncing:
            self._launch_complete()
        return None

    def _begin_backward(self) -> None:
        if self._sync_enabled and self.world_size > 1 and self.auto_refresh_trainable:
            # a reducing backward: agreed before any bucket is launched, so that a change of
            # requires_grad inside the accumulation window on some ranks only (agreed there at
            # a forward) raises on every rank instead of pairing with these reductions. A
            # change every rank agrees on here (a freeze before an evaluation-mode forward,
            # which re-plans nothing) is re-planned by every rank before any bucket launches,
            # unless it froze a parameter holding a no_sync() gradient (refused, as at a
            # training forward: one process would step that gradient)
            stale = self._plan_is_stale()
            drops = stale and self._accumulated_locally and self._drops_local_grads()
            if self._plan_is_stale_on_any_rank(stale, _AT_BACKWARD, drops):
                self.refresh_trainable()
        if not self._sync_enabled:
            self._accumulated_locally = True
        self._backward_active = True
        self._syncing = self._sync_enabled
        if self._observed is not None:
            self._observed = []
        self._ready_count = [0] * len(self._buckets)
        self._arrived = set()
        self._next_launch = 0
        if self._syncing:
            self._begin_owner_steps()  # may refuse: before any gradient is set aside
        self._carry_reduced_grads(reducing=self._sync_enabled)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _begin_owner_steps(self) -> None:
        """With ``step_in_backward``: the optimizers start a step whose buckets the landing
        reductions complete."""
        if self._steps_after:
            if any(o._stepped_in_backward is not None for o in self.sharded_optimizers):
                # every rank alike, before this backward reduces anything
                raise RuntimeError(
                    "ShardedDataParallel(step_in_backward=True): the owners already stepped on "
                    "the last reduction and optimizer.step() has not been called since; another "
                    "backward outside no_sync() would step them again. Call optimizer.step() "
                    "(and zero_grad()) after each reducing backward, and accumulate "
                    "micro-batches inside no_sync()")
            for optimizer in self.sharded_optimizers:
                optimizer._begin_step_in_backward()

    def _carry_reduced_grads(self, reducing: bool) -> None:
        """Keep each reduced gradient still sitting untouched (same tensor) in an owner's
        ``p.grad`` in the sum the next reduction yields, carried + mean(new).

        A reduction that starts now (a reducing backward, :meth:`reduce`) sets it aside
        (``p.grad = None``, so autograd writes only this backward's local gradient) and
        :meth:`_finish` adds the reduced result to it in place: no copy, one rounding, and
        fp16 stays finite wherever the sum is. A ``no_sync()`` backward, which accumulates into
        ``p.grad`` until some later reduction, and a parameter whose owner changed (its old
        owner must send what it holds) multiply it by N instead: the bucket divides all by N
        (in fp16 that product overflows above 65504 / N). A parameter frozen since is left as
        it is (no bucket reduces it; as in torch, its ``.grad`` stays) and stays carried.
        A backward that raises drops what it set aside (:meth:`_forget_aborted_backward`)."""
        carried = list(self._carried.items())
        self._carried.clear()
        for p, (grad_id, mark) in carried:
            g = p.grad
            if g is None or id(g) != grad_id or swapped_since(g, mark):
                continue
            if p not in self._owner_of:  # frozen: nothing reduces it now
                self._carried[p] = (grad_id, mark)
                continue
            if reducing and self._owner_of[p] == self.rank:
                self._held[p] = g
                p.grad = None
            else:
                g.mul_(self.world_size)

    def _restore_held_grads(self) -> None:
        """After a reduction that failed in this wrapper's own code (a transport error at the
        end of backward, in :meth:`reduce`): give each set-aside gradient back, plus whatever
        local gradient reached ``p.grad`` meanwhile (as torch's accumulation would hold)."""
        held, self._held = self._held, {}
        for p, g in held.items():
            p.grad = g if p.grad is None else g.add_(p.grad)

    def _on_grad_accumulated(self, p: torch.Tensor) -> None:
        if not self._syncing:
            return
        if self._observed is not None:
            self._observed.append(p)
        index = self._bucket_of.get(p)
        if index is None:
            return
        if id(p) in self._arrived:
            self._refuse_second_gradient(p)
        self._arrived.add(id(p))
        self._ready_count[index] += 1
        # Note: the bucket this gradient completes is launched at the next gradient's arrival
        # (or at the end of backward), not here: post-accumulate-grad hooks that the user
        # registered after wrapping run after this one and must still find p.grad, the local
        # gradient, as under torch DDP (launching drops it)
        self._finish_arrived()

    def _launch_complete(self) -> None:
        """Launch, in plan order, the buckets whose gradients have all arrived (and whose
        post-accumulate-grad hooks have all run: called as the next gradient arrives)."""
        while self._next_launch < len(self._buckets) and self._bucket_complete(self._next_launch):
            self._launch(self._next_launch)

    def _refuse_second_gradient(self, p: torch.Tensor) -> None:
        """A gradient accumulated twice into ``p`` in one backward (a parameter used inside a
        reentrant checkpoint and outside it, or in two of them): its bucket may already be
        reduced, and the second part would stay local. Refused, as torch DDP refuses it; every
        rank running the same graph raises at the same point."""
        names = args.param_names(self.module, [p]) or [f"of shape {tuple(p.shape)}"]
        raise RuntimeError(f"ShardedDataParallel: parameter {names[0]} received its gradient "
                           f"twice in one backward (used inside a reentrant checkpoint, "
                           f"torch.utils.checkpoint(use_reentrant=True), and outside it or in "
                           f"another one); its first part may already be reduced. Use "
                           f"non-reentrant checkpointing (shardkit.nn.checkpoint."
                           f"checkpoint_wrapper, or use_reentrant=False), or run that backward "
                           f"inside no_sync() and call reduce() after it")

    def _bucket_complete(self, index: int) -> bool:
        return self._ready_count[index] >= len(self._buckets[index].params)

    def _launch(self, index: int) -> None:
        layout = self._buckets[index]
        reduction = ReduceToOwners(layout, self.process_group, self.rank, self.comm)
        grads = [p.grad for p in layout.params]
        for p in layout.params:
            p.grad = None
        # the only references left are the list's: launch drops each gradient once packed
        reduction.launch(grads)
        del grads
        # Note: watched, so that is_complete() is a true poll on gloo (whose sends and
        # receives complete only when waited for): each reduction that has arrived is finished
        # at the next gradient, freeing its packed buffer and the transport's receive buffers
        # then rather than at the end of backward (they were all of the model's gradients).
        reduction.watch()
        self._in_flight.append(reduction)
        self._next_launch = index + 1
        self._finish_arrived()
        while len(self._in_flight) > 1 and self._inflight_bytes() > self.max_inflight_bytes:
            self._finish(self._in_flight.popleft())

    def _finish_arrived(self) -> None:
        """Finish the reductions that have arrived, strictly oldest first (so that, with
        ``step_in_backward``, the steps and the all-gathers they start come in the same order
        on every rank, whenever the reductions land). Issues no collective, and never blocks
        except with ``step_in_backward`` on a transport whose handles cannot poll (shared
        memory), where each reduction is finished, and its bucket stepped, right away."""
        arrived = BucketReduction.is_complete if self._steps_after else \
            BucketReduction.has_arrived
        while self._in_flight and arrived(self._in_flight[0]):
            self._finish(self._in_flight.popleft())

    def _inflight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self._in_flight
                   for t in r.tensors_in_flight())

    def _finish(self, reduction: BucketReduction) -> None:
        for p, grad in reduction.finish():
            held = self._held.pop(p, None)
            if held is not None:
                grad = held if grad is None else held.add_(grad)
            p.grad = grad
            if grad is not None:
                self._carried[p] = (id(grad), tensor_mark(grad))
        if self._steps_after:
            for o, s in self._steps_after[reduction.layout.index]:
                self.sharded_optimizers[o]._step_bucket_in_backward(s)

    def _end_backward(self) -> None:
        try:
            if self._syncing:
                self._window_open = False
                self._accumulated_locally = False
                self._launch_rest_and_wait()
                if self._observed is not None:
                    self._settle_bucket_order()
        finally:
            self._backward_active = False
            self._syncing = False
            self._restore_held_grads()

    def _launch_rest_and_wait(self) -> None:
        """Launch every bucket not launched yet (unused parameters: their gradients count as
        zero), then finish every reduction in flight: gradients are in place on return."""
        while self._next_launch < len(self._buckets):
            self._launch(self._next_launch)
        while self._in_flight:
            self._finish(self._in_flight.popleft())

    def _forget_aborted_backward(self) -> None:
        """A backward that raised (on every rank alike) never ran its end callback: wait for
        the buckets it launched and start the next backward from a clean state (the owners'
        carried gradients it had set aside are dropped: zero the gradients to recover)."""
        try:
            while self._in_flight:
                self._in_flight.popleft().finish()
        finally:
            self._in_flight.clear()
            self._backward_active = False
            self._syncing = False
            # dropped, not given back: the script has had the gradients since the backward
            # raised, and zeroes them to recover (OSS's or the module's zero_grad cannot be
            # seen here); continuing to accumulate after a failed backward accumulates
            # partial gradients under torch DDP too
            self._held.clear()

    def _check_step_in_backward(self, step_in_backward) -> None:
        """A bool, and with ``True`` optimizers that update each parameter alone. Local."""
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"ShardedDataParallel(step_in_backward={step_in_backward!r}): "
                            f"expected True or False")
        for optimizer in self.sharded_optimizers if step_in_backward else ():
            optimizer._check_steps_per_parameter("ShardedDataParallel(step_in_backward=True)")

    def _prepare_step_in_backward(self, step_in_backward: bool) -> bool:
        """Give the optimizers' parameter sync a process group of its own (so that steps
        started whenever a reduction lands cannot interleave with the reductions' order) and
        let the next forward wait for it per module. Collective over the group's ranks."""
        self._check_step_in_backward(step_in_backward)
        if not step_in_backward:
            return False
        if self.world_size == 1:
            return True
        sync_group = skdist.group_of_same_ranks(self.process_group)
        for optimizer in self.sharded_optimizers:
            optimizer._prepare_step_in_backward(sync_group, self.module)
        return True


# ---------------------------------------------------------------------- helpers

# Where a rank agrees on the trainable set (ShardedDataParallel._plan_is_stale_on_any_rank).
_AT_FORWARD, _AT_BACKWARD, _AT_REDUCE = 0, 1, 2
# The agreement's element: the plan's fingerprint above the code's bits (stale, site, ...).
_CODE_BITS = 5
_CODE_MASK = (1 << _CODE_BITS) - 1
_TRAINABLE_AGREEMENT = skdist.control_kind(
    "ShardedDataParallel's agreement on the trainable parameters (at a training forward or "
    "the reducing backward)")


def _planned_attributes(p: torch.Tensor) -> tuple:
    """What of ``p`` the bucket plan depends on, as ``(attribute, value)`` pairs every rank
    compares (the dtype and device type only for a trainable parameter, whose gradient
    travels; each rank has its own device index)."""
    if not p.requires_grad:
        return (("requires_grad", False),)
    return (("requires_grad", True), ("dtype", str(p.dtype)), ("device.type", p.device.type))


def _same_signature(a: tuple, b: Optional[tuple]) -> bool:
    """Plan signatures ``(requires_grad flags, (dtype, device) of the trainable parameters,
    trainable parameters, partitions)`` equal, parameters and partitions by identity."""
    return b is not None and a[:2] == b[:2] and all(
        len(x) == len(y) and all(u is v for u, v in zip(x, y)) for x, y in zip(a[2:], b[2:]))


class _ParamHooks(NamedTuple):
    """A wrapper's two gradient hooks on a parameter, and the parameter's
    :func:`~shardkit.utils.swapped_tensors.tensor_mark` when they were registered (a swap of
    its tensor detaches them)."""

    incoming: RemovableHandle
    accumulated: RemovableHandle
    tensor_mark: int

    def remove(self) -> None:
        self.incoming.remove()
        self.accumulated.remove()


# id(param) -> (weakref to the ShardedDataParallel whose hooks it carries, that wrapper's dict
# of hooked parameters). Note: no weak reference to the parameter itself: torch's
# ``swap_tensors`` (``load_state_dict`` under ``swap_module_params_on_conversion``) refuses a
# tensor that has one. The wrapper's dict holds its parameters while their hooks are on, so an
# id found in it is that parameter's (ids are reused only after an object is freed).
_HOOKS_HELD_BY: dict = {}


def _take_hooks_over(p: torch.Tensor, wrapper: ShardedDataParallel) -> None:
    """Make ``wrapper`` the one ShardedDataParallel whose hooks ``p`` carries: an earlier
    wrapper of the same parameter (the user re-wrapped the module, keeping it) releases its
    hooks, as FairScale's and torch DDP's earlier wrappers reduce nothing for forwards they did
    not run; its hooks reduced every gradient a second time and kept it alive. One dict entry
    per hooked parameter, dropped when its hooks are removed."""
    held = _HOOKS_HELD_BY.get(id(p))
    previous = held[0]() if held is not None and p in held[1] else None
    if previous is not None and previous is not wrapper:
        previous._release_hooks()
    _HOOKS_HELD_BY[id(p)] = (weakref.ref(wrapper), wrapper._hooked)


def _remove_hooks(hooked: dict) -> None:
    """Remove the hooks in ``hooked`` (param -> :class:`_ParamHooks`) and forget them."""
    for p, hooks in hooked.items():
        hooks.remove()
        held = _HOOKS_HELD_BY.get(id(p))
        if held is not None and held[1] is hooked:
            del _HOOKS_HELD_BY[id(p)]
    hooked.clear()
