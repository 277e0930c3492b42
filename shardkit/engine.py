"""``shardkit.initialize``: a DeepSpeed-style front end over :func:`shardkit.recipes.compose`.

The config (validated by :mod:`shardkit.config`) picks a ZeRO stage, and
:func:`compose_from_config` turns its choices into :func:`shardkit.recipes.compose`'s
arguments (stage-3 wrap units: ``initialize(wrap_policy=...)``, default
:func:`shardkit.recipes.default_wrap_policy`). Per-rank memory and traffic are
:func:`shardkit.plan.zero_model_state_bytes` and :func:`shardkit.plan.zero_comm_elements_per_step`:

====== ======================================= ===== ===== ========= ==========================
stage  wrappers                                 params grads optimizer communication per step
====== ======================================= ===== ===== ========= ==========================
0      torch DistributedDataParallel           full  full  full      all-reduce 2Ψ(N-1)/N
1      OSS + torch DDP, reduce to owners        full  full* 1/N       2Ψ(N-1)/N
2      OSS + ShardedDataParallel                full  1/N   1/N       2Ψ(N-1)/N
3      FullyShardedDataParallel per block       1/N   1/N   1/N       3Ψ(N-1)/N
====== ======================================= ===== ===== ========= ==========================

(*) At stage 1 each gradient is averaged onto its OSS owner only
(``zero_optimization.reduce_scatter``, default true as in DeepSpeed;
:func:`shardkit.comm_hooks.reduce_to_owners_hook`): a rank's gradients of parameters it does
not own read zero after backward, and several reducing backwards in one step add up on the
owner as under the all-reduce (the hook carries the owner's earlier average).
``"reduce_scatter": false`` keeps torch DDP's all-reduce (every rank holds the averaged
gradients; ``3Ψ(N-1)/N``), and so does an optimizer that leaves some trainable parameters
out (``model_parameters=`` a subset, as DeepSpeed allows: those get gradients and are never
stepped; rank 0 says so once). At stage 2 such an optimizer is a ConfigError before any
collective (freeze those parameters instead); stages 0 and 3 train it as DeepSpeed does. At
every stage ``gradient_clipping`` and ``get_global_grad_norm()`` take the norm over the
parameters the optimizer steps, as DeepSpeed's ZeRO stages do, and ``engine.step()`` clears the
gradients of the trainable parameters it leaves out (they never accumulate).

``zero_optimization.zero_hpz_partition_size=h`` (stage 3, DeepSpeed's hpZ) gives every FSDP unit
``hpz_partition_size=h``: backward gathers inside blocks of ``h`` ranks (a node), leaving
``2Ψ(N-1)/N`` on links between blocks, for ``Ψ/h`` more memory per resharded unit.

Master weights and optimizer state are always fp32; ``fp16``/``bf16`` run the forward and
backward under ``torch.autocast`` (CPU or CUDA), fp16 with a
:class:`~shardkit.optim.DynamicLossScaler`. At stages 0-2 the model's weights and gradients are
then 16-bit (its floating parameters are cast, the same ``Parameter`` objects, except those of
BatchNorm, LayerNorm and GroupNorm layers, kept fp32; forward-only engines too, as DeepSpeed
halves the module) and the optimizer keeps fp32 masters of the
parameters it steps (:class:`~shardkit.optim.MasterWeights`; at stages 1-2 each rank's OSS shard
those it owns), DeepSpeed's layout and DESIGN.md's mixed-precision column: ``16Ψ`` bytes per
rank at stage 0, ``4Ψ + 12Ψ/N`` at stage 1, ``2Ψ + 14Ψ/N`` at stage 2 (Adam), gradients reduced
and the parameter sync moving 16-bit values; the overflow check, unscaling and clipping act on
the gradients widened to fp32, and checkpoints hold the fp32 masters as the weights. At stage 3
a model passed in fp16 or bf16 has its trainable 16-bit parameters and buffers cast to fp32
first (rank 0 says so): FSDP keeps fp32 shards (the masters, ``16Ψ/N`` with Adam) under a
mixed-precision policy, as DeepSpeed's ZeRO-3: each unit is all-gathered and computed in the
16-bit dtype (buffers keep their dtype, but BatchNorm statistics are cast to the 16-bit one to
match the weights), and gradients are reduce-scattered in the
16-bit dtype, or in ``communication_data_type`` (``"fp32"``: fp32), then kept fp32 in the
shards; the plan's ``--mixed-precision`` bytes, half of fp32 training's. A step
whose gradients hold inf/nan is skipped under fp16, and under bf16 unless
``bf16.check_grad_overflow`` is false (DeepSpeed's default, true); the decision is all-reduced
(one element) so every rank skips together. A script's own ``engine.optimizer.step()`` gets
that work on the gradients first, as DeepSpeed's wrapped optimizers do
(:mod:`shardkit.engine_direct_step`).

A model built from ``shardkit.nn.model_parallel`` layers trains through ``mpu=`` (DeepSpeed's
model-parallel unit): the table's wrappers then run over the data-parallel group, N is its size,
and the tensor-parallel ranks add one one-element all-reduce a step for the gradient norm
(:func:`initialize`).

Without any optimizer (no ``optimizer=`` and no config ``optimizer`` section: DeepSpeed's
reference, reward and EMA engines, "ZeRO-3 inference") ``initialize`` returns a forward-only
engine, ``optimizer`` and ``lr_scheduler`` ``None``: stage 3 shards the parameters with FSDP
(``4Ψ/N`` bytes of fp32 parameters per rank, no gradients, no optimizer state; each forward
all-gathers the units it runs, in the 16-bit dtype under ``fp16``/``bf16``); stages 0-2 have
nothing to shard without an optimizer and keep the model whole (``4Ψ``, rank 0's weights
broadcast once, forwards local; ``2Ψ`` with ``fp16``/``bf16``, whose 16-bit weights they
keep). ``fp16``/``bf16`` run the forward under
``torch.autocast`` as with an optimizer. ``engine.backward`` and
``engine.step`` are a RuntimeError on every rank before any collective, as DeepSpeed asserts;
``module_state_dict``, ``save_16bit_model`` and ``save_checkpoint``/``load_checkpoint``
(weights, counters and RNG; a training checkpoint loads its weights) work.

Usage::

    engine, optimizer, _, scheduler = shardkit.initialize(model=model, config="ds_config.json")
    for x, y in batches:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import distributed, engine_direct_step, engine_export
from shardkit.config import ConfigError, EngineConfig, load_config
from shardkit.deepspeed_compat import ensure_process_group
from shardkit.engine_accessors import DeepSpeedAccessors, LossScaleReading
from shardkit.engine_arguments import _check_arguments, _check_sparse_modules
from shardkit.engine_checkpoint import CheckpointMethods
from shardkit.engine_compose import (_HALF_DTYPES, _DTYPE_OF_NAME, _checks_of_compose,
                                     _left_out_of_optimizer, _shown, compose_from_config)
from shardkit.engine_config_sources import _config_source, _flat_config
from shardkit.engine_data_loader import DeepSpeedIO, _check_dataset
from shardkit.engine_master_weights import (_batchnorm_statistics_in, _keep_16bit_weights,
                                            _keep_fp32_master_weights)
from shardkit.engine_model_weights import ModelWeights
from shardkit.engine_offload import OffloadStates
from shardkit.engine_optimizer_hooks import _expose_offload_on_optimizer, _guard_direct_steps
from shardkit.engine_optimizer_recipe import _optimizer_recipe
from shardkit.engine_optimizer_step import OptimizerStep, _loss_scaler
from shardkit.engine_progress import ProgressLog, ThroughputTimer, _ensure_log_handler
from shardkit.engine_scheduler import _build_scheduler, _check_config_scheduler, _check_lr_kwargs
from shardkit.engine_step_agreement import StepAgreement
from shardkit.model_parallel_unit import ModelParallelGroups, model_parallel_groups
from shardkit.recipes import (Composition, agree_on_refusal, model_fingerprint,
                              optimizer_fingerprint, refuse_meta_tensors)
from shardkit.utils.wrapped_attributes import attribute_through
# imported from here by scripts and tests: kept importable
from shardkit.engine_checkpoint import NoOptimizer  # noqa: F401
from shardkit.engine_offload import OFFLOAD_STATE_TYPES  # noqa: F401

__all__ = ["initialize", "ShardedEngine"]

# parameter -> the gradient-arrival hook of the latest engine built over it (a new engine over
# the same model replaces it rather than adding one more; see _watch_gradient_arrivals)
_ARRIVAL_HOOKS = WeakIdKeyDictionary()

logger = logging.getLogger("shardkit")


def _names_by_trainability(model: nn.Module) -> tuple[list[str], list[str]]:
    """``(trainable parameter names, frozen parameter names)`` of ``model``, every name of a
    tied parameter (its aliases share its ``requires_grad``)."""
    named = list(model.named_parameters(remove_duplicate=False))
    return ([n for n, p in named if p.requires_grad], [n for n, p in named if not p.requires_grad])


# ----------------------------------------------------------------------------- engine


_NO_FORWARD = object()


class ShardedEngine(StepAgreement, OptimizerStep, OffloadStates, ModelWeights, CheckpointMethods,
                    DeepSpeedIO, ProgressLog, DeepSpeedAccessors, nn.Module):
    """The object ``initialize`` returns: call it, ``backward`` the loss, ``step``.

    Gradient accumulation: ``backward`` divides the loss by ``gradient_accumulation_steps``
    (and multiplies it by the fp16 loss scale) and, at stages 0-1, suppresses the gradient
    reduction except on the last micro-batch; stages 2-3 reduce every micro-batch into the
    gradient shards (the owners' gradients, FSDP's shards), as DeepSpeed's ZeRO-2 and ZeRO-3
    do, so that no rank holds the whole model's gradient (``1/N`` of it, DESIGN.md's rows; the
    reduction's bytes are paid once per micro-batch); ``step`` runs the optimizer, scheduler
    and loss scaler only at that boundary, then zeroes the gradients. Memory and communication
    are those of the stage's wrappers (module docstring); the engine adds one all-reduced flag
    per step under fp16 and bf16 (the overflow check).

    Attributes:
        module: the user's model (at stage 3 its blocks are FSDP units).
        wrapped: the outermost wrapper (DDP, ShardedDataParallel or FSDP).
        optimizer, lr_scheduler, loss_scaler: the composed parts (``None`` when unused;
            ``optimizer`` is ``None`` for a forward-only engine, built without one: then
            ``backward`` and ``step`` raise, see the module docstring). As on DeepSpeed's
            optimizers, ``optimizer.loss_scale`` and ``optimizer.cur_scale`` hold the loss scale
            (unless the optimizer's class defines that name itself).
        global_steps: optimizer steps taken (skipped fp16 steps included, as in DeepSpeed).
        micro_steps, skipped_steps: micro-batches seen; steps skipped on overflow.
        training_dataloader, collate_fn: the loader ``initialize(training_data=...)`` built
            (``None`` without one) and its ``collate_fn`` (:meth:`deepspeed_io`'s default).

    DeepSpeed's accessors: ``zero_optimization_stage()``, ``zero_optimization()``,
    ``gradient_accumulation_steps()``, ``train_batch_size()``,
    ``train_micro_batch_size_per_gpu()``, ``get_batch_info()``, ``gradient_clipping()``,
    ``get_lr()``, ``get_mom()``, ``get_global_grad_norm()``, ``was_step_applied()``,
    ``fp16_enabled()``, ``bfloat16_enabled()``, ``steps_per_print()``, ``loss_scale``,
    ``global_samples``, ``global_rank``, ``local_rank``, ``world_size``, ``dp_world_size``,
    ``mp_world_size``, ``device``; and ``no_sync()``, ``set_gradient_accumulation_boundary()``,
    ``deepspeed_io()``, ``module_state_dict()``, ``load_module_state_dict()``,
    ``save_fp16_model()`` (the older name of ``save_16bit_model``); between training and
    generation (RLHF), ``empty_partition_cache()`` and ``offload_states()`` /
    ``reload_states()``.

    Its methods live by concept in mixins: the step agreement between ranks
    (:mod:`shardkit.engine_step_agreement`), the boundary step and loss scaling
    (:mod:`shardkit.engine_optimizer_step`), ``offload_states`` (:mod:`shardkit.engine_offload`),
    ``module_state_dict`` and ``save_16bit_model`` (:mod:`shardkit.engine_model_weights`),
    ``save_checkpoint`` / ``load_checkpoint`` (:mod:`shardkit.engine_checkpoint`),
    ``deepspeed_io`` (:mod:`shardkit.engine_data_loader`), the progress log
    (:mod:`shardkit.engine_progress`) and the config accessors (:mod:`shardkit.engine_accessors`).
    """

    def __init__(self, model: nn.Module, composition: Composition, cfg: EngineConfig,
                 lr_scheduler=None, state_names: Optional[list] = None,
                 trainable_param_names: Optional[list] = None,
                 frozen_param_names: Optional[list] = None,
                 model_parallel: Optional[ModelParallelGroups] = None):
        super().__init__()
        self.module = model
        self.model_parallel = model_parallel
        # parameters of sequence-parallel regions: their gradients cover this tensor-parallel
        # rank's part of the sequence until summed over the group (before each step)
        from shardkit.nn.model_parallel.sequence_parallel import (
            sequence_parallel_parameters, watch_sequence_parallel_grads)
        # (marks of LayerNorms replaced by to_empty / deepcopy are restored by that look-up)
        self._sums_sequence_parallel_grads = composition.stage < 3 and bool(
            sequence_parallel_parameters(model))
        if self._sums_sequence_parallel_grads:  # tell a script's clipping from a new backward
            watch_sequence_parallel_grads(model)
        # Names of the unwrapped model, recorded before wrapping (FSDP renames and flattens).
        self._state_names = list(state_names or _state_names_of(model))
        trainable, frozen = _names_by_trainability(model)
        self.trainable_param_names = list(
            trainable if trainable_param_names is None else trainable_param_names)
        self.frozen_param_names = list(frozen if frozen_param_names is None else frozen_param_names)
        self.wrapped = composition.wrapped
        self.config = cfg
        self.composition = composition
        self.optimizer = composition.optimizer
        if self.optimizer is not None:  # DeepSpeed's optimizer.overflow before a first step
            self.optimizer.overflow = False
        _guard_direct_steps(self)
        _expose_offload_on_optimizer(self)
        self._export_serial = engine_export.next_engine_serial()
        # bumped on every rank wherever the weights may change (a step, direct or not; a load):
        # keeps save_16bit_model's outcome of one state apart from another's
        self._weights_version = 0
        self._save_calls = engine_export.SaveCalls()
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = _loss_scaler(cfg)
        self._publish_loss_scale()
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        # samples and steps before the last set_train_batch_size (global_samples counts on)
        self._samples_before_resize = self._steps_before_resize = 0
        self._autocast_dtype = _HALF_DTYPES.get(cfg.precision.dtype)
        self._device_type = next(model.parameters()).device.type
        # the losses since the last log line, summed on their device: read (one host sync)
        # only when a line is printed, never per micro-batch
        self._loss_sum: Optional[torch.Tensor] = None
        self._losses_counted = 0
        self._clock = time.perf_counter()
        self._steps_at_clock = 0
        self._pending_save = None  # an asynchronous save under way (checkpoint.async_save)
        # offload_states(): {id(host copy): (host copy, device it came from)}; None: not offloaded
        self._offloaded_optimizer_state: Optional[dict] = None
        self._last_grad_norm: Optional[torch.Tensor] = None  # read lazily: no device sync a step
        self._last_step_applied = False
        self._boundary_override: Optional[bool] = None
        self._no_sync_depth = 0  # how many engine.no_sync() contexts are open
        # the boundary backward ran inside engine.no_sync(): its gradients were never averaged
        self._boundary_unreduced = False
        # the class name of the optimizer the script passed (None: built from the config)
        self.client_optimizer_name: Optional[str] = None
        # grad-enabled engine forwards since the last backward: none means the script called
        # the model itself (DeepSpeed's GAN example), so torch DDP's hooks were never armed
        # (stages 0-1); a forward under no_grad (old values, a reference) arms nothing
        self._forwards_since_backward = 0
        # stages 0-1: the last grad-enabled engine forward ran without torch DDP's gradient
        # sync (off the boundary, or inside no_sync), so DDP's reducer was not armed and its
        # backward reduces nothing (see _note_ddp_arming)
        self._ddp_unarmed_forward = False
        # (grad-enabled) engine forwards and backwards since the last step(): a boundary step
        # after none of the latter means the script ran loss.backward() itself (DeepSpeed's
        # PyTorch-style backward): no loss scale was applied, and at stages 0-1 nothing was
        # reduced unless the forward ran through DDP
        self._forwards_since_step = self._backwards_since_step = 0
        # the backward of a reducing training pass ran since the ranks last agreed on a step:
        # the next forward (or backward) first checks that no other rank stepped meanwhile
        # (_agree_on_step)
        self._awaiting_step = False
        # leaf tensors the forward returned as is -> [armed] (see _arm_leaf_output)
        self._armed_leaf_outputs = WeakIdKeyDictionary()
        # stages 0-1 under torch DDP without find_unused_parameters: the trainable parameters
        # a gradient reached in the current reducing backward (see _refuse_unused_parameters)
        self._grads_arrived: Optional[set] = self._watch_gradient_arrivals()
        # stages 0-1 over more than one rank: the parameters torch DDP's reducer was built over
        # (see _refuse_parameters_trainable_since_initialize)
        self._ddp_reduced_at_initialize: Optional[set] = self._ddp_reduced_ids()
        # stages 0-2: the parameters the wrappers and the optimizer were built over (stage 3's
        # FSDP refuses a changed parameter itself), by identity (a wrapper applied later, such
        # as torch's activation checkpointing, renames them). Held strongly, so that an id here
        # is never reused by a new parameter: a weak reference would make torch.utils.
        # swap_tensors (load_state_dict and .to() under torch.__future__'s
        # set_swap_module_params_on_conversion) refuse every parameter; one the script removes
        # from the model is let go at the next forward (_forget_parameters_removed)
        self._params_at_initialize: Optional[dict] = None
        if self.optimizer is not None and composition.stage < 3:
            self._params_at_initialize = {id(p): (p, p.shape) for p in model.parameters()}
        from shardkit.utils.tensor_fragment import register_engine
        register_engine(self)  # deepspeed.utils.safe_* find the engine of a parameter
        if composition.stage == 3:  # DeepSpeed's ds_id / ds_status / ds_shape on the shards
            from shardkit.zero import expose_ds_attributes, placeholder_state_dict
            expose_ds_attributes(model)
            placeholder_state_dict(model, self.wrapped)
        # DeepSpeed's throughput timer (DeepSpeed-Chat ticks its epoch count)
        self.tput_timer = ThroughputTimer(cfg.train_batch_size)

    def __getattr__(self, name: str):
        # DeepSpeed's engine forwards unknown attributes to the model (engine.config_class,
        # a custom method of the user's model)
        try:
            value = attribute_through(self, name, "module")
        except AttributeError as error:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or not str(error).endswith(f"has no attribute '{name}'") \
                    or hasattr(type(module), name):  # a property of the module that raised
                raise
            # name the engine the script asked, not only the model the lookup fell through to
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}', nor has its module "
                f"(a {type(module).__name__}); shardkit's engine has the DeepSpeed engine "
                f"methods listed in help(shardkit.engine.ShardedEngine)") from None
        composition = self.__dict__.get("composition")
        if (composition is not None and composition.stage == 3 and name.startswith("forward")
                and self._in_root_unit(getattr(value, "__self__", None))):
            # the method's name, docstring and signature (inspect follows __wrapped__)
            return functools.update_wrapper(
                functools.partial(self._forward_through_root, value), value)
        return value

    def _in_root_unit(self, owner) -> bool:
        """Whether ``owner`` (what a method is bound to) is the model or a module of it outside
        the nested FSDP units: a wrapper around the model (PEFT's ``PeftModel``,
        ``torch.compile``'s ``OptimizedModule``) hands out its inner model's methods. Local."""
        from shardkit.nn.data_parallel import FullyShardedDataParallel
        module = self.__dict__["_modules"].get("module")
        if not isinstance(owner, nn.Module) or module is None:
            return False
        stack = [module]
        while stack:
            current = stack.pop()
            if current is owner:
                return True
            stack.extend(child for child in current.children()
                         if not isinstance(child, FullyShardedDataParallel))
        return False

    def _forward_through_root(self, method, *args, **kwargs):
        """Stage 3: the model's ``forward_*`` method (DeepSpeed-Chat's ``forward_value``) run
        as the root FSDP unit's forward (through the engine's forward, its precision context
        included), so the root's parameters are gathered for it and their gradients reach the
        shards. The method runs once in place of ``module.forward``, which it may call
        itself. Costs what the engine's forward costs."""
        module = self.module
        before = module.__dict__.get("forward", _NO_FORWARD)

        def restore():
            if before is _NO_FORWARD:
                module.__dict__.pop("forward", None)
            else:
                module.forward = before

        def run_method(*a, **k):
            restore()
            return method(*a, **k)

        module.forward = run_method
        try:
            return self.forward(*args, **kwargs)
        finally:
            restore()

    # -- properties DeepSpeed users reach for
    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag on the wrapped model (torch DDP, ShardedDataParallel or FSDP), for
        scripts written for torch DDP that accumulate with ``model.require_backward_grad_sync
        = (micro_step == last)`` and call ``loss.backward()`` themselves (nanoGPT): ``False``
        makes the following backward passes accumulate locally, as :meth:`no_sync` does. With
        ``gradient_accumulation_steps`` above 1 such a script's ``optimizer.step()`` is
        refused, and a boundary ``engine.step()`` after an ``engine.backward`` run with it
        ``False`` is refused, as inside :meth:`no_sync`. Set it alike on every rank. Local."""
        return bool(getattr(self.wrapped, "require_backward_grad_sync", True))

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"engine.require_backward_grad_sync = {value!r}: expected True or "
                            f"False")
        if hasattr(self.wrapped, "require_backward_grad_sync"):
            self.wrapped.require_backward_grad_sync = value

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage the config chose (0-3)."""
        return self.composition.stage

    # Methods, not properties: DeepSpeed's engine spells them as calls.
    def zero_optimization_stage(self) -> int:
        """The ZeRO stage (0-3), as DeepSpeed's engine reports it."""
        return self.composition.stage

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the config's, after the batch-size arithmetic)."""
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward on one rank."""
        return self.config.train_micro_batch_size_per_gpu

    @property
    def loss_scale(self) -> LossScaleReading:
        """The fp16 loss scale now (1.0 without fp16 loss scaling); a float that DeepSpeed
        scripts may also call, ``engine.loss_scale()`` (:class:`LossScaleReading`)."""
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        return LossScaleReading(scale)

    def _publish_loss_scale(self) -> None:
        """DeepSpeed's fp16 and ZeRO optimizers carry the loss scale as ``optimizer.cur_scale``
        and ``optimizer.loss_scale``, which training scripts log (DeiT's and BEiT's
        ``get_loss_scale_for_deepspeed(model)`` reads ``model.optimizer.loss_scale``, else
        ``cur_scale``): set on the engine's optimizer whenever the scale may change. A name the
        optimizer's class defines itself (a read-only property, a method) is its own and left
        as it is: setting it raised AttributeError in initialize, or shadowed the method. Local."""
        if self.optimizer is None:
            return
        for name in ("loss_scale", "cur_scale"):
            if not hasattr(type(self.optimizer), name):
                setattr(self.optimizer, name, self.loss_scale)

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer parameter group (``[]`` without an optimizer,
        as DeepSpeed returns)."""
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def gradient_clipping(self) -> float:
        """The config's ``gradient_clipping`` (0: off)."""
        return self.config.gradient_clipping

    def get_global_grad_norm(self) -> Optional[float]:
        """The total gradient norm (over every rank, before clipping) of the last optimizer
        step, as DeepSpeed reports it: measured at ZeRO stages 1-3 and with fp16/bf16 whether
        or not ``gradient_clipping`` is set (one all-reduce of one element a step), at stage 0
        in fp32 only when clipping (else ``None``: no extra pass). ``None`` also before the
        first step and after a skipped step (fp16, or bf16 with inf/nan gradients)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    @property
    def _measures_grad_norm(self) -> bool:
        return self.zero_stage > 0 or self.config.precision.dtype != "fp32"

    def was_step_applied(self) -> bool:
        """Whether the latest ``step()`` stepped the optimizer, as in DeepSpeed: ``False``
        after a ``step()`` inside an accumulation window (no update), when inf/nan gradients
        skipped the boundary's step under fp16 or bf16, and before the first ``step()``."""
        return self._last_step_applied

    @property
    def global_samples(self) -> int:
        """Samples consumed by the optimizer steps taken: ``global_steps x train_batch_size``
        (each step at the batch size it ran with, after ``set_train_batch_size``)."""
        return self._samples_before_resize + \
            (self.global_steps - self._steps_before_resize) * self.config.train_batch_size

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group."""
        return distributed.get_rank()

    @property
    def world_size(self) -> int:
        """Ranks in the default process group."""
        return distributed.get_world_size()

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 without it)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def device(self) -> torch.device:
        """Where the model's parameters (and so the batches) live."""
        return next(self.module.parameters()).device

    @property
    def dp_world_size(self) -> int:
        """Ranks the batch is split over: the data-parallel group's (every rank without
        tensor parallelism)."""
        if self.model_parallel is not None:
            return self.model_parallel.data_size
        return distributed.get_world_size()

    @property
    def checkpoint_group(self):
        """The ranks that write one checkpoint directory together: the data-parallel group
        under tensor parallelism (each tensor-parallel rank's slices go to ``TAG/mp_rank_XX``),
        ``None`` (the world) otherwise."""
        return None if self.model_parallel is None else self.model_parallel.data_group

    @property
    def mp_world_size(self) -> int:
        """Ranks that split each tensor-parallel layer (1 without tensor parallelism)."""
        return 1 if self.model_parallel is None else self.model_parallel.tensor_size

    def fp16_enabled(self) -> bool:
        """Whether the config's ``fp16.enabled`` runs the model in fp16 with loss scaling."""
        return self.config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        """Whether the config's ``bf16.enabled`` runs the model in bf16."""
        return self.config.precision.dtype == "bf16"

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage (1-3) shards anything."""
        return self.composition.stage > 0

    def steps_per_print(self) -> int:
        """Optimizer steps between two log lines (the config's ``steps_per_print``)."""
        return self.config.steps_per_print

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return (self.config.train_batch_size, self.config.train_micro_batch_size_per_gpu,
                self.config.gradient_accumulation_steps)

    def get_mom(self) -> list:
        """Each parameter group's momentum: Adam's ``betas``, else SGD's ``momentum`` (``[]``
        without an optimizer, as DeepSpeed returns)."""
        if self.optimizer is None:
            return []
        return [group["betas"] if "betas" in group else group.get("momentum")
                for group in self.optimizer.param_groups]

    def is_gradient_accumulation_boundary(self) -> bool:
        """True on the micro-batch whose ``step`` will run the optimizer (unless
        :meth:`set_gradient_accumulation_boundary` decided it)."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Decide by hand whether the coming micro-batches end an accumulation window (``True``:
        ``backward`` reduces and ``step`` steps; ``False``: neither), as DeepSpeed's engine
        allows for variable-length accumulation; ``None`` returns to counting micro-batches.
        Every rank must make the same choice (the reduction is a collective)."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise ValueError(f"engine.set_gradient_accumulation_boundary({is_boundary!r}): "
                             f"expected True, False or None")
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """A context in which ``backward`` accumulates gradients locally without reducing them
        (the wrappers' ``no_sync``); the first backward outside it reduces everything.
        As in DeepSpeed, ``step()`` inside it is an error, and so is a boundary ``step()``
        whose last ``backward`` ran inside it: either would apply this rank's own, unaveraged
        gradients (at stage 0 the replicas would silently drift apart). No memory or
        communication of its own."""
        with self.composition.no_sync():
            self._no_sync_depth += 1
            try:
                yield
            finally:
                self._no_sync_depth -= 1

    # -- training
    def forward(self, *args, **kwargs):
        """The wrapped model's forward (DDP, ShardedDataParallel or FSDP by stage) under the
        config's precision: bf16/fp16 autocast where the engine computes in 16 bits. Checks
        first, on every rank alike, that no trainable parameter changed since ``initialize``.
        Memory and communication: the wrapper's (stage 3 gathers each unit's parameters);
        nothing more in the usual loop (a rank that skipped a step joins the others' agreement
        on it here)."""
        self.tput_timer.start()
        self._refuse_parameters_changed_since_initialize()
        starts_reducing_pass = self._agree_on_step_skipped_at_forward()
        if torch.is_grad_enabled():  # one under no_grad leaves no gradient to reduce
            self._forwards_since_backward += 1
            self._forwards_since_step += 1
        with self._precision_context(), self._reduction_context():
            self._note_ddp_arming()
            output = self.wrapped(*args, **kwargs)
        if starts_reducing_pass:
            self._await_step_after_backward_of(output)
        return output

    def _note_ddp_arming(self) -> None:
        """Stages 0-1, before torch DDP's forward with gradients enabled: record whether it
        runs with its gradient sync off. DDP decides in its forward, not in backward, whether
        the coming backward reduces, so a script that decides the boundary between forward
        and backward (Accelerate's ``set_gradient_accumulation_boundary(sync_gradients)``
        right before ``engine.backward``; DeepSpeed decides in backward) would otherwise step
        on this rank's own gradients: the boundary's backward then averages them by hand.
        Local."""
        ddp = self.wrapped
        if isinstance(ddp, nn.parallel.DistributedDataParallel) and torch.is_grad_enabled():
            self._ddp_unarmed_forward = not ddp.require_backward_grad_sync

    def _refuse_parameters_changed_since_initialize(self) -> None:
        """Stages 0-2: a ValueError naming each trainable parameter of the model that was
        replaced by a new Parameter object, resized, or registered after ``initialize``
        (Hugging Face's ``resize_token_embeddings()`` or a new head called on
        ``engine.module``): torch DDP (stages 0-1) failed in backward with autograd's "invalid
        gradient" for a resized one and silently left a new one unaveraged and unstepped, as
        ShardedDataParallel (stage 2) did. Checked at each forward before the wrapper's, on
        every rank (each rank changing its model alike raises at the same forward, before any
        collective). Local: one pass over the parameters."""
        known = self._params_at_initialize
        if known is None:
            return
        changed, still_there = [], 0
        for name, p in self.module.named_parameters():
            was = known.get(id(p))  # the recorded parameter itself: held, its id is its own
            still_there += was is not None
            if not p.requires_grad:
                continue
            if was is None:
                changed.append(f"{name} (a Parameter registered after initialize, shape "
                               f"{tuple(p.shape)})")
            elif p.shape != was[1]:
                changed.append(f"{name} (resized from {tuple(was[1])} to {tuple(p.shape)})")
        if still_there < len(known):
            self._forget_parameters_removed()
        if changed:
            raise ValueError(
                f"engine forward: trainable parameter(s) {_shown(changed)} changed after "
                f"shardkit.initialize (zero_optimization.stage={self.composition.stage}), whose "
                f"optimizer and gradient reduction were built over the model as it was then "
                f"(a new parameter would be neither averaged nor stepped, a resized one no "
                f"longer fits the reduction buckets and optimizer state). Change the model "
                f"(resize_token_embeddings, new heads or adapters) before shardkit.initialize")

    def _forget_parameters_removed(self) -> None:
        """Drop the recorded parameters no longer in the model (a frozen embedding the script
        replaced), so that they are not kept alive here; should one come back, it is then
        refused as registered after ``initialize``."""
        present = {id(p) for p in self.module.parameters()}
        known = self._params_at_initialize
        for key in [key for key in known if key not in present]:
            del known[key]

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the fp16 loss scale);
        the gradient reduction runs only on the boundary micro-batch (stages 2-3: on every
        micro-batch, into the gradient shards). ``scale_wrt_gas=False``
        (DeepSpeed's, for a loss the script already divided, as Hugging Face's Trainer does)
        skips the division. Returns what DeepSpeed returns: the loss divided as the gradients
        were (``loss / gradient_accumulation_steps`` unless ``scale_wrt_gas=False``).
        No memory or communication beyond the backward's own. Without an optimizer: a
        RuntimeError on every rank, before any collective (see :meth:`_refuse_without_optimizer`).
        """
        self._refuse_without_optimizer("backward(loss)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward(loss): expected a scalar tensor, got "
                             f"{loss if not isinstance(loss, torch.Tensor) else loss.shape}")
        if not isinstance(scale_wrt_gas, bool):
            raise ValueError(f"engine.backward(scale_wrt_gas={scale_wrt_gas!r}): expected True "
                             f"or False")
        self._count_loss(loss)
        self._backwards_since_step += 1
        # a torch-DDP script's require_backward_grad_sync = False turns the reduction off too
        unsynced = self._no_sync_depth > 0 or not self.require_backward_grad_sync
        reducing = self.is_gradient_accumulation_boundary() and not unsynced
        if self.is_gradient_accumulation_boundary():
            self._boundary_unreduced = unsynced
        # stages 0-1 (torch DDP): a loss computed by calling the model itself bypassed DDP's
        # forward, so DDP reduces nothing; DeepSpeed averages the gradients in backward anyway
        model_called_by_script = reducing and self._forwards_since_backward == 0
        # stages 0-1: the forward ran off the boundary, so DDP will not reduce this backward
        boundary_after_forward = reducing and self._ddp_unarmed_forward
        by_hand = (model_called_by_script or boundary_after_forward) \
            and isinstance(self.wrapped, nn.parallel.DistributedDataParallel)
        self._forwards_since_backward = 0
        self._ddp_unarmed_forward = False
        if model_called_by_script or boundary_after_forward:  # no forward met the check
            self._agree_on_step_skipped("engine.backward(loss)")
            self._awaiting_step = True
        divisor = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        factor = self.loss_scale / divisor
        scaled = loss.float() * factor if factor != 1.0 else loss
        watching = reducing and not by_hand and self._grads_arrived is not None
        if watching:
            self._grads_arrived.clear()
        with self._reduction_context():
            try:
                scaled.backward(retain_graph=retain_graph)
            except RuntimeError as error:
                raise _explained_backward_error(error, self.config.zero) from error
        checking_late = reducing and not by_hand and self._ddp_reduced_at_initialize is not None
        if checking_late or watching:
            reduced = self._ddp_reduced_parameters()
            if checking_late:
                self._refuse_parameters_trainable_since_initialize(reduced)
            if watching:
                self._refuse_unused_parameters(reduced)
        if by_hand:
            self._average_gradients_by_hand()
        return loss / divisor if divisor != 1 else loss

    def _watch_gradient_arrivals(self) -> Optional[set]:
        """Under torch DDP without ``find_unused_parameters`` (stages 0-1 with
        ``"ignore_unused_parameters": false``; not with DDP's ``static_graph``, which allows
        unused parameters) over more than one rank: a set that a hook on
        each trainable parameter fills with the parameter's id when its gradient is
        accumulated, so that :meth:`_refuse_unused_parameters` can tell after a reducing
        backward whether DDP's reduction finished. ``None`` elsewhere (nothing registered).
        A later engine over the same model replaces these hooks (they never pile up). Costs
        one Python call per parameter and backward; no communication."""
        ddp = self.wrapped
        if not isinstance(ddp, nn.parallel.DistributedDataParallel) \
                or getattr(ddp, "find_unused_parameters", True) \
                or getattr(ddp, "static_graph", False) \
                or distributed.get_world_size(ddp.process_group) == 1:
            return None
        arrived: set = set()
        self._arrival_hooks = {}  # name -> this engine's hook on the parameter
        for name, param in self._ddp_reduced_parameters():
            earlier = _ARRIVAL_HOOKS.pop(param, None)
            if earlier is not None:  # an earlier engine's: this one takes over
                earlier.remove()
            _ARRIVAL_HOOKS[param] = self._arrival_hooks[name] = \
                param.register_post_accumulate_grad_hook(
                    lambda p, arrived=arrived: arrived.add(id(p)))
        return arrived

    def _ddp_reduced_ids(self) -> Optional[set]:
        """``id``s of the parameters torch DDP reduces now (stages 0-1 over more than one
        rank), ``None`` under any other wrapper or alone."""
        ddp = self.wrapped
        if not isinstance(ddp, nn.parallel.DistributedDataParallel) \
                or distributed.get_world_size(ddp.process_group) == 1:
            return None
        return {id(p) for _, p in self._ddp_reduced_parameters()}

    def _refuse_parameters_trainable_since_initialize(self, reduced: list) -> None:
        """After a reducing backward under torch DDP (stages 0-1) over more than one rank:
        a RuntimeError naming the parameters made trainable after ``initialize`` (a frozen
        layer unfrozen for a later phase of fine-tuning). DDP built its reducer over the
        parameters trainable then and never averages their gradients: each rank would step
        with its own (stage 0: the replicas drift apart; stage 1: the owner's alone, even
        after ``optimizer.refresh_trainable()``). Every rank changes its model alike, so
        every rank raises here, before any further collective. ``reduced``: what
        :meth:`_ddp_reduced_parameters` lists now. Local, no communication."""
        late = [name for name, p in reduced if id(p) not in self._ddp_reduced_at_initialize]
        if late:
            raise RuntimeError(
                f"engine.backward: {', '.join(late[:6])}"
                f"{f' and {len(late) - 6} more' if len(late) > 6 else ''} became trainable "
                f"after shardkit.initialize; torch DDP (stage {self.config.zero.stage}) built "
                f"its reducer then and never averages their gradients across ranks: set "
                f"requires_grad before initialize")

    def _ddp_reduced_parameters(self) -> list:
        """``(name, parameter)`` for every parameter torch DDP reduces now: trainable and
        not in its ``parameters_to_ignore``."""
        ddp = self.wrapped
        ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        return [(name, p) for name, p in ddp.module.named_parameters()
                if p.requires_grad and name not in ignored]

    def _refuse_unused_parameters(self, reduced: list) -> None:
        """After a reducing backward under torch DDP without ``find_unused_parameters``:
        raise, before the step and before any further collective, when a trainable parameter
        got no gradient on this rank. DDP then never reduced that parameter's bucket (its
        error would come only at the next forward, after a step on this rank's own gradients
        of the whole bucket). A rank where every parameter got one is meanwhile still inside
        backward, where DDP waits for the buckets this rank never started reducing, until this
        process exits or the group times out. (A parameter made trainable after
        ``initialize`` was refused as such before: see
        :meth:`_refuse_parameters_trainable_since_initialize`.) ``reduced``: what
        :meth:`_ddp_reduced_parameters` lists now. No communication."""
        # (one made trainable after initialize was refused first: it has no hook here)
        # a later engine over the same model took a parameter's hook over: not ours to judge
        trainable = [(name, p) for name, p in reduced
                     if name in self._arrival_hooks
                     and _ARRIVAL_HOOKS.get(p) is self._arrival_hooks[name]]
        missing = [name for name, p in trainable if id(p) not in self._grads_arrived]
        if not missing:
            return
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6
                                          else "")
        raise RuntimeError(
            f"engine.backward: zero_optimization.stage={self.config.zero.stage} with "
            f"\"ignore_unused_parameters\": false runs torch DDP without "
            f"find_unused_parameters, so every trainable parameter must get a gradient in each "
            f"reducing backward on every rank, but on rank {distributed.get_rank()} "
            f"{len(missing)} got none ({shown}; e.g. a head the loss does not use, or an "
            f"expert that received no tokens on this rank): DDP left their gradient buckets "
            f"unreduced and a step would apply this rank's own gradients. Set "
            f"\"ignore_unused_parameters\": true in zero_optimization (the default), freeze "
            f"those parameters (requires_grad=False) before initialize, or use stage 2 or 3")

    def _ddp_parameters(self) -> list:
        """The parameters torch DDP averages, and so the by-hand average: trainable, not in
        DDP's ``parameters_to_ignore`` (each rank keeps its own gradient of those). Local."""
        return [p for _, p in self._ddp_reduced_parameters()]

    def _average_gradients_by_hand(self) -> None:
        """Average every parameter's gradient that torch DDP reduces (trainable, not in its
        ``parameters_to_ignore``) over the data-parallel group, as DDP would have (absent ones
        count as zero, and stay ``None`` where every rank's is): every rank the same
        parameters in the same order, through flat buffers, so ranks whose forward left
        different parameters unused still agree. The buffer travels in
        ``communication_data_type`` when the config sets one (fp16/bf16: each gradient divided
        by the group size in fp32 first, then cast, as torch's fp16/bf16 compression hooks and
        the wrappers' own 16-bit reductions do; fp32: a 16-bit model's gradients widened, summed
        in fp32 and rounded back once), else in the gradients' own dtypes, one buffer
        per dtype (the fp32 normalization weights of a 16-bit model stay fp32, as in DDP's
        buckets), each gradient divided by the group size before the sum, as DDP's reducer
        divides (an fp16 sum could overflow where the average does not). Costs DDP's
        all-reduce traffic (half of it in 16 bits), one all-reduce per dtype, and a temporary
        of the gradients' size. A sparse gradient (an embedding with ``sparse=True``, stage 0)
        travels dense in that buffer and comes back sparse over the rows it touches on some
        rank."""
        params = self._ddp_parameters()
        group = self.wrapped.process_group
        size = distributed.get_world_size(group)
        if not params or size == 1:
            return
        wire = _DTYPE_OF_NAME.get(self.config.communication_dtype)
        if wire == torch.float32 and not any(p.dtype in _HALF_DTYPES.values() for p in params):
            wire = None  # fp32 (or wider) gradients travel as they are
        grads = [None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad
                 for p in params]
        if wire is None:  # each dtype in its own buffer, as DDP's buckets
            work = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
            for dtype in sorted({w.dtype for w in work}, key=str):
                distributed.all_reduce_as_one([w for w in work if w.dtype == dtype], group,
                                              divide_by=size)
        else:
            work = [(g.float() / size).to(wire) if g is not None
                    else torch.zeros_like(p, dtype=wire) for p, g in zip(params, grads)]
            distributed.all_reduce_as_one(work, group)
        for param, averaged in zip(params, work):
            if param.grad is None:
                if averaged.any():  # another rank's forward used it; nobody's did: stays None
                    param.grad = averaged.to(param.dtype)
            elif param.grad.is_sparse:
                param.grad = averaged.to(param.grad.dtype).to_sparse(param.grad.sparse_dim())
            elif averaged is not param.grad:  # reduced in another dtype
                param.grad.copy_(averaged)

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """At the accumulation boundary: (fp16) agree on overflow, unscale, clip, step the
        optimizer and scheduler (``scheduler.step(**lr_kwargs)``, DeepSpeed's argument), update
        the loss scale, zero gradients. Elsewhere: count. Without an optimizer, or at the
        boundary while any rank's optimizer state is offloaded (:meth:`offload_states`), or
        when only some ranks step (the others going on to their next training forward): a
        RuntimeError on every rank, before any collective of the step (the ranks agree first:
        one all-gather of 16 int64s a rank per boundary, in a world of several; see
        :meth:`_agree_on_step`). At stages 1-2 that exchange also carries OSS's agreements on
        its param groups before its clip and its step, which then make none of their own: one
        control all-gather a step in all. OSS's step still agrees on its own where a step hook
        of the script's is registered on the optimizer, and its clip and step with tensor
        parallelism (OSS over the data-parallel group only)."""
        self._refuse_without_optimizer("step()")
        if lr_kwargs is not None and not isinstance(lr_kwargs, dict):
            raise ValueError(f"engine.step(lr_kwargs={lr_kwargs!r}): expected a dict of keyword "
                             f"arguments for lr_scheduler.step(), or None")
        torch_backward = self._backwards_since_step == 0
        engine_direct_step.close_carried_step(self.optimizer)  # left open by a failed step
        if self.is_gradient_accumulation_boundary():
            agreed_in_advance = self._agree_on_step(carry=self._oss_calls_to_carry())
            if self.lr_scheduler is not None:  # the scheduler steps at the boundary only
                _check_lr_kwargs(self.lr_scheduler, lr_kwargs or {})
            self._check_gradients_reduced(torch_backward)
            self._optimizer_step(lr_kwargs or {}, loss_scaled=not torch_backward,
                                 agreed_in_advance=agreed_in_advance)
            self.tput_timer.stop(global_step=True)
            self.global_steps += 1
            self._maybe_print()
        else:
            self._last_step_applied = False  # DeepSpeed: a step inside the window applies nothing
        self._forwards_since_step = self._backwards_since_step = 0
        self._ddp_unarmed_forward = False
        self.micro_steps += 1
        self._weights_version += 1

    def _refuse_without_optimizer(self, call: str) -> None:
        """DeepSpeed asserts "must provide optimizer during init in order to use backward"
        (and ``step``): an engine built without an optimizer runs forward only. Its gradients
        would have no one to step them, and at stages 0-2 the model is not wrapped for a
        gradient reduction at all, so training through it is refused rather than half-done.
        Local, so every rank raises it before any collective."""
        if self.optimizer is not None:
            return
        raise RuntimeError(
            f"engine.{call}: this engine has no optimizer (shardkit.initialize was called "
            f"without optimizer=... and without a config 'optimizer' section), so it runs "
            f"forward only, as DeepSpeed's does (a reference, reward or EMA model, inference); "
            f"to train it, pass optimizer=<torch optimizer> or add an 'optimizer' section to "
            f"the config")

    def _refuse_unreduced_step(self, call: str) -> None:
        """DeepSpeed's rule, checked on every rank before any collective: a boundary step
        (``call``) must follow a backward whose gradients were reduced (outside
        :meth:`no_sync`)."""
        if self._no_sync_depth > 0:
            raise RuntimeError(
                f"{call} was called inside engine.no_sync(): the gradients there are "
                "this rank's own, not averaged over the ranks, so the step would diverge from "
                "single-process training (as in DeepSpeed, this is not allowed); leave the "
                "no_sync() block, run the accumulation boundary's engine.backward(loss) "
                "outside it, then call engine.step()")
        if self._boundary_unreduced:
            raise RuntimeError(
                f"{call}: the accumulation boundary's engine.backward(loss) ran inside "
                "engine.no_sync() or with engine.require_backward_grad_sync = False, so its "
                "gradients were never averaged over the ranks and the step would apply this "
                "rank's own; run the last backward of each accumulation window outside "
                "no_sync() with require_backward_grad_sync True (it reduces everything "
                "accumulated before it)")

    def _check_gradients_reduced(self, torch_backward: bool,
                                 call: str = "engine.step()") -> None:
        """Before a boundary step (``engine.step()`` or a direct ``engine.optimizer.step()``):
        refuse gradients left unreduced (:meth:`_refuse_unreduced_step`), and at stages 0-1
        average those of a model the script called itself with ``loss.backward()``
        (``torch_backward``: no ``engine.backward`` since the last step), which torch DDP did
        not reduce. Local, or one all-reduce of the gradients where averaged by hand."""
        self._refuse_unreduced_step(call)
        # model called and loss.backward() by hand, or DDP's forward ran off the boundary
        unreduced = self._forwards_since_step == 0 or self._ddp_unarmed_forward
        if torch_backward and unreduced and self._no_sync_depth == 0 \
                and isinstance(self.wrapped, nn.parallel.DistributedDataParallel):
            self._average_gradients_by_hand()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every wrapped parameter (``None`` by default, as torch).
        No communication."""
        self.composition.zero_grad(set_to_none=set_to_none)

    # -- contexts
    def _precision_context(self):
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._device_type, dtype=self._autocast_dtype)

    def _reduction_context(self):
        # stages 2-3 reduce every micro-batch into the gradient shards (owners' gradients,
        # FSDP's shards), as DeepSpeed's ZeRO-2 and ZeRO-3 do: no_sync would hold the whole
        # model's gradient (4 bytes per parameter on every rank) until the boundary
        if self.is_gradient_accumulation_boundary() or self.zero_stage >= 2:
            return contextlib.nullcontext()
        return self.composition.no_sync()


_DDP_READY_TWICE = "Expected to mark a variable ready only once"


def _explained_backward_error(error: RuntimeError, zero) -> RuntimeError:
    """torch DDP's "marked ready twice", in the config's terms where the config caused it:
    stages 0-1 with ``ignore_unused_parameters`` build DDP with ``find_unused_parameters``,
    which marks the parameters of a reentrant activation checkpoint unused after the forward
    (they are not in its graph yet) and fails when their recomputed gradients arrive. Every
    rank runs the same backward, so every rank raises it. Any other error comes back as is."""
    if _DDP_READY_TWICE not in str(error) or zero.stage > 1 \
            or not zero.ignore_unused_parameters:
        return error
    return RuntimeError(
        f"engine.backward: zero_optimization.stage={zero.stage} with ignore_unused_parameters="
        f"true (the default) runs torch DDP with find_unused_parameters, which cannot run a "
        f"reentrant activation checkpoint (torch.utils.checkpoint(use_reentrant=True), Hugging "
        f"Face's gradient_checkpointing_enable(gradient_checkpointing_kwargs={{'use_reentrant': "
        f"True}})) nor a parameter used outside the forward. Valid: \"ignore_unused_parameters"
        f"\": false in zero_optimization (every trainable parameter must then get a gradient "
        f"each step), checkpointing with use_reentrant=False, or stage 2 or 3. torch DDP "
        f"said: {str(error).splitlines()[0][:200]}")


# ----------------------------------------------------------------------------- initialize


def initialize(model: nn.Module, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, config=None, config_params=None, args=None, mpu=None,
               dist_init_required=None, collate_fn=None, peer_timeout_s=None, resume_from=None,
               wrap_policy=None, distributed_port=None, param_init_fn=None):
    """Compose shardkit's wrappers from a DeepSpeed config.

    Args:
        model: the ``nn.Module`` to train (on its target device).
        optimizer: a torch optimizer or ``callable(params) -> optimizer``; exclusive with a
            config ``optimizer`` section. Neither: a forward-only engine (module docstring),
            returned with ``optimizer`` and ``lr_scheduler`` ``None``.
        model_parameters: parameters or param groups for a config-built optimizer (default:
            every trainable parameter), at every stage (FSDP shards the same parameter objects
            in place).
        training_data: a ``torch.utils.data.Dataset``; a ``DataLoader`` with a
            ``DistributedSampler`` and the micro-batch size is returned for it
            (:meth:`ShardedEngine.deepspeed_io`; also ``engine.training_dataloader``).
        lr_scheduler: a scheduler or ``callable(optimizer) -> scheduler``; exclusive with a
            config ``scheduler`` section.
        config: a dict or the path of a JSON file (``config_params`` is an alias; without
            either, ``args.deepspeed_config`` is used as DeepSpeed does; both is an error).
        args, dist_init_required, collate_fn: DeepSpeed's.
        mpu: DeepSpeed's model-parallel unit for a model built from
            ``shardkit.nn.model_parallel`` layers (or Megatron-style ones marking their split
            weights ``tensor_model_parallel``): any object with the methods of
            :data:`shardkit.model_parallel_unit.MPU_METHODS`, e.g. the module
            ``shardkit.nn.model_parallel.initialize`` after
            ``initialize_model_parallel(tp)``. ``None`` with such a model uses the groups its
            layers were built with. The stage's wrappers then run over the data-parallel group
            only (initial weights broadcast from its rank 0, never across tensor-parallel
            ranks, which hold other slices); ``train_batch_size`` counts data-parallel ranks;
            the dataloader gives every tensor-parallel rank of a replica the same batch;
            ``gradient_clipping`` uses the unsplit model's norm (each slice and each
            replicated weight counted once); the fp16/bf16 skip decision is agreed over every
            rank; checkpoints keep each tensor-parallel rank's slices in ``TAG/mp_rank_XX``.
            It costs nothing beyond the layers' own collectives and, per step, one all-reduce
            of one element over the tensor-parallel group for the norm (the overflow flag is
            all-reduced over the world, as without ``mpu``). Pipeline-parallel sizes above 1,
            an ``mpu`` missing a method or disagreeing with the layers' groups are a
            :class:`~shardkit.config.ConfigError` before any collective.
        distributed_port: DeepSpeed's: the rendezvous port (``MASTER_PORT``) when this call
            starts the process group under a launcher that did not set one.
        peer_timeout_s: seconds without a peer's heartbeat before every surviving rank exits
            naming the lost one (:func:`shardkit.fault.watch_peers`; default
            ``SHARDKIT_PEER_TIMEOUT`` or 60; 0 turns the watchdog off).
        resume_from: a checkpoint directory: when it holds a complete checkpoint (its
            ``latest``), the engine loads it before returning (model, optimizer, scheduler,
            counters, RNG), so a job restarted by ``torchrun --max-restarts`` continues where
            the last complete save left off; ``engine.global_steps`` says where. Nothing is
            loaded when the directory or its ``latest`` does not exist yet.
        wrap_policy: stage 3: the ``auto_wrap`` policy choosing the FSDP units (default
            :func:`shardkit.recipes.default_wrap_policy`: HF's ``_no_split_modules``, else the
            repeated transformer blocks, else by parameter count).
        param_init_fn: stage 3, a model built under ``torch.device("meta")``: FSDP's
            ``param_init_fn`` (``callable(module)`` that materializes a module holding meta
            tensors), for modules without ``reset_parameters()`` (Hugging Face's RMSNorm,
            rotary embeddings); ``None``: each such module's ``reset_parameters()``. Every
            rank then takes rank 0's values. At stages 0-2 a ValueError.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``; ``dataloader`` is ``None`` without
        ``training_data``.

    Everything about the config and the arguments is checked before any wrapper's
    collective, and the ranks then agree on it: one small object all-gather over the world
    (each rank's verdict, its config's keys, fingerprints of its model and optimizer; none in
    a world of 1). So a refusal only some ranks reach (the llama-recipes pattern: the model on
    the meta device on every rank but rank 0, at stages 0-2; sparse embeddings on one rank)
    is raised on every rank, naming the refusing ranks and the first one's reason, and a
    config, model or optimizer that differs between ranks is a ValueError naming the first
    difference, instead of some ranks waiting in a collective. Costs: those of the stage's
    wrappers (module docstring), and that exchange.

    .. warning:: collective: call it on every rank, with the same config.
    """
    if distributed_port is not None and (isinstance(distributed_port, bool) or not isinstance(
            distributed_port, int) or not 0 < distributed_port < 65536):
        raise ConfigError(f"initialize(distributed_port={distributed_port!r}): expected a port "
                          f"number in 1-65535")
    # Every check below reads this rank's model, optimizer and config only; a refusal is
    # kept until the ranks have agreed (one exchange, after the process group exists), so
    # that a refusal only some ranks reach (a model on meta on all ranks but rank 0, sparse
    # embeddings or a config that differ on one rank) is raised on every rank.
    refusal = parallel = cfg = recipe = None
    try:
        config = _config_source(config, config_params, args)
        parallel = model_parallel_groups(model, mpu) if isinstance(model, nn.Module) else None
        world = parallel.data_size if parallel is not None else _data_parallel_world_size()
        cfg = load_config(config, world)
        _check_arguments(model, optimizer, lr_scheduler, cfg)
        _check_sparse_modules(model, cfg, optimizer)
        refuse_meta_tensors(model, cfg.zero.stage,
                            f"initialize: zero_optimization.stage={cfg.zero.stage}")
        if training_data is not None:
            _check_dataset(training_data, "initialize(training_data=")
        if resume_from is not None and not isinstance(resume_from, (str, os.PathLike)):
            raise TypeError(f"initialize(resume_from={resume_from!r}): expected a directory "
                            f"path")
    except Exception as error:
        refusal = error
    if refusal is not None and not distributed.is_initialized() and "RANK" not in os.environ:
        raise refusal  # one process and no group: no rank to tell
    try:
        ensure_process_group(distributed_port)
    except Exception:
        if refusal is not None:
            raise refusal
        raise
    from shardkit import fault
    fault.watch_peers(peer_timeout_s)
    if refusal is None:
        try:
            recipe = _optimizer_recipe(cfg, optimizer, model_parameters, model)
            _check_config_scheduler(cfg, recipe)
            _checks_of_compose(model, recipe, cfg, wrap_policy, param_init_fn)
        except Exception as error:
            refusal = error
    compared = {} if refusal is not None else {
        **_flat_config(cfg.raw), "optimizer": optimizer_fingerprint(recipe),
        **({"model": model_fingerprint(model)} if parallel is None else {})}
    # tensor-parallel ranks hold other slices of the model: each rank's model is compared with
    # those of the ranks at the same tensor-parallel rank (its data-parallel replicas) only
    among = None if parallel is None or refusal is not None else (
        f"tensor-parallel rank {parallel.tensor_ranks.index(distributed.get_rank())}",
        {"model": model_fingerprint(model)})
    agree_on_refusal(refusal, None, "initialize", compared,
                     "call initialize with the same model, optimizer and config on every rank",
                     among=among)
    if distributed.get_rank() == 0:
        _ensure_log_handler()
        for note in cfg.warnings:
            logger.warning(note)
    section = cfg.raw.get("comms_logger")
    if isinstance(section, dict) and section.get("enabled"):
        # DeepSpeed's engine configures deepspeed.comm from it, and only when enabled (a
        # disabled section leaves a logger the script configured as it was); the section's
        # unwritten switches take DeepSpeed's defaults, not what an earlier configure() set
        from shardkit.deepspeed_compat import comm
        comm.configure(enabled=True, prof_all=section.get("prof_all", True),
                       prof_ops=list(section.get("prof_ops", [])),
                       verbose=section.get("verbose", False), debug=section.get("debug", False))
    if cfg.precision.dtype != "fp32" and cfg.zero.stage < 3:
        cast = _keep_16bit_weights(model, _HALF_DTYPES[cfg.precision.dtype])
        if cast and distributed.get_rank() == 0:
            logger.info("%s at ZeRO stage %d: %d parameters of the model were cast to %s%s",
                        cfg.precision.dtype, cfg.zero.stage, cast, cfg.precision.dtype,
                        "" if recipe is None else "; the optimizer keeps fp32 master weights of "
                        "the parameters it steps")
    elif recipe is not None and cfg.precision.dtype != "fp32":
        cast = _keep_fp32_master_weights(model, recipe, cfg.zero.stage, wrap_policy)
        if cast and distributed.get_rank() == 0:
            logger.warning("%s training: %d 16-bit parameters and buffers of the model were cast "
                           "to fp32 master weights (FSDP still gathers and computes them in %s), "
                           "as DeepSpeed keeps fp32 master weights; stepping 16-bit weights "
                           "would lose small updates", cfg.precision.dtype, cast,
                           cfg.precision.dtype)
    if cfg.precision.dtype != "fp32" and cfg.zero.stage == 3:
        # FSDP gathers the weights in 16 bits and keeps buffers' dtypes: a BatchNorm's
        # statistics must match its weights
        _batchnorm_statistics_in(model, _HALF_DTYPES[cfg.precision.dtype])
    if cfg.zero.stage < 3 and cfg.zero.offload_optimizer_device == "cpu" \
            and next(model.parameters()).is_cuda and distributed.get_rank() == 0:
        logger.warning("zero_optimization.offload_optimizer: CPU offload is implemented at "
                       "stage 3 only (FSDP move_params_to_cpu); at stage %d the optimizer "
                       "state stays on the GPU", cfg.zero.stage)
    left_out = _left_out_of_optimizer(model, recipe)
    if left_out and cfg.zero.stage == 1 and cfg.zero.reduce_to_owners \
            and distributed.get_rank() == 0:
        logger.warning("zero_optimization.reduce_scatter at stage 1: the optimizer leaves the "
                       "trainable parameter(s) %s out (they get gradients and are never "
                       "stepped), so gradients are all-reduced by torch DDP (3Ψ(N-1)/N a step) "
                       "rather than averaged onto their owners; set requires_grad=False on "
                       "them to keep the owners' reduction", _shown(left_out))
    state_names = _state_names_of(model)
    trainable, frozen = _names_by_trainability(model)  # before wrapping renames them
    # the tensor-parallel split of each key, read unwrapped (stage 3 then refuses the model's
    # own state_dict()) for the checkpoints' layout file
    tp_specs = None if parallel is None else _tp_split_specs(model)
    composition = compose_from_config(model, recipe, cfg, wrap_policy,
                                      None if parallel is None else parallel.data_group,
                                      param_init_fn, agree_across_ranks=False)
    scheduler = _build_scheduler(cfg, lr_scheduler, composition.optimizer)
    engine = ShardedEngine(model, composition, cfg, scheduler, state_names, trainable, frozen,
                           parallel)
    engine.tp_split_specs = tp_specs
    # DeepSpeed's optimizer_name() names the client's optimizer class when it passed one
    engine.client_optimizer_name = None if cfg.optimizer is not None or recipe is None \
        else recipe.cls.__name__
    # DeepSpeed's: deepspeed_io's default; in __dict__, so that a callable nn.Module is not
    # registered as a submodule of the engine (and deepspeed_io's default still finds it)
    engine.__dict__["collate_fn"] = collate_fn
    loader = None if training_data is None else engine.deepspeed_io(training_data)
    engine.training_dataloader = loader
    if resume_from is not None:
        _resume(engine, os.fspath(resume_from))
    return engine, composition.optimizer, loader, scheduler


def _tp_split_specs(model: nn.Module) -> dict:
    from shardkit.nn.model_parallel.full_state import split_specs
    return split_specs(model)


def _resume(engine: ShardedEngine, load_dir: str) -> None:
    """Load ``load_dir``'s latest checkpoint if it has one (a first start has none: quiet)."""
    from shardkit.checkpoint import read_latest_tag
    if read_latest_tag(load_dir) is None:
        if distributed.get_rank() == 0:
            logger.info("resume_from=%s: no checkpoint yet; starting from step 0", load_dir)
        return
    path, _ = engine.load_checkpoint(load_dir)
    if distributed.get_rank() == 0:
        logger.info("resumed from %s at step %d", path, engine.global_steps)


def _data_parallel_world_size() -> int:
    if distributed.is_initialized():
        return distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _state_names_of(model: torch.nn.Module) -> list:
    """The keys of ``model.state_dict()`` without gathering: FSDP units the user built inside
    ``model`` (outermost ones, held by plain modules) give a full state dict by default, one
    all-gather per unit and the full model in memory; under ``LOCAL_STATE_DICT`` they give
    their shards under the same keys. Local."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.data_parallel.fsdp_state_dict_type import StateDictType
    if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return list(model.state_dict().keys())
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        return list(model.state_dict().keys())
