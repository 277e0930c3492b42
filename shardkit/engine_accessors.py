"""DeepSpeed's engine accessors that report the config (``engine.zero_overlap_comm()``,
``engine.optimizer_name()``...) and its two batch-size setters, for scripts written against
``deepspeed.DeepSpeedEngine``; and the check that the gradients held are the reduced ones,
for DeepSpeed's ``safe_*_grad`` functions (:mod:`shardkit.utils.tensor_fragment`).

Each reads :class:`shardkit.config.EngineConfig` (DeepSpeed's defaults filled in); a knob
shardkit accepts but does not act on (``overlap_comm``, ``allgather_bucket_size``...) is reported
as configured, as DeepSpeed reports it. No memory, no communication.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from shardkit.config import accumulation_dtype_name
from shardkit.engine_compose import _DTYPE_OF_NAME

__all__ = ["DeepSpeedAccessors", "LossScaleReading"]


class LossScaleReading(float):
    """The engine's loss scale now, as a float that can also be called: shardkit's attribute
    (``engine.loss_scale * 2``) and DeepSpeed's method (``engine.loss_scale()``, which
    Megatron-DeepSpeed-style trainers call to log the scale) both read it. Unlike DeepSpeed,
    whose method returns the config's ``fp16.loss_scale`` (0 when the scale is dynamic), the
    call returns the scale in use. Costs nothing."""

    def __call__(self) -> float:
        return float(self)


class DeepSpeedAccessors:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.config`` (an
    :class:`~shardkit.config.EngineConfig`), ``self.global_steps``, ``self.micro_steps``,
    ``self.global_samples``, ``self.dp_world_size``, ``self._boundary_override``, and for
    :meth:`_check_full_grads_readable` ``self._backwards_since_step`` and
    ``self._boundary_unreduced``."""

    # -- the config's sections, as DeepSpeed reports them
    def _zero_section(self) -> dict:
        return self.config.checked.get("zero_optimization", {})

    def optimizer_name(self) -> Optional[str]:
        """The config's ``optimizer.type``, or, as in DeepSpeed, the class name of the optimizer
        the script passed (``"AdamW"`` for ``optimizer=torch.optim.AdamW(...)`` or a callable
        building one)."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type
        return getattr(self, "client_optimizer_name", None)

    def optimizer_params(self) -> Optional[dict]:
        """The config's ``optimizer.params`` as written (``None`` without the section)."""
        return _params_of(self.config.raw.get("optimizer"))

    def scheduler_name(self) -> Optional[str]:
        """The config's ``scheduler.type`` (``None`` without the section)."""
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> Optional[dict]:
        """The config's ``scheduler.params`` as written (``None`` without the section)."""
        return _params_of(self.config.raw.get("scheduler"))

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are sharded (ZeRO stage 2 or 3)."""
        return self.config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Whether parameters are sharded (ZeRO stage 3)."""
        return self.config.zero.stage >= 3

    def zero_offload_optimizer(self) -> Optional[dict]:
        """The ``offload_optimizer`` section when it offloads (``device`` not "none"), else
        ``None``: truthy exactly when DeepSpeed's is."""
        if self.config.zero.offload_optimizer_device == "none":
            return None
        return dict(self._zero_section().get("offload_optimizer", {}),
                    device=self.config.zero.offload_optimizer_device)

    def zero_offload_param(self) -> Optional[dict]:
        """The ``offload_param`` section when it offloads (stage 3), else ``None``."""
        if self.config.zero.offload_param_device == "none":
            return None
        return dict(self._zero_section().get("offload_param", {}))

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to the CPU."""
        return self.config.zero.offload_optimizer_device == "cpu"

    def zero_reduce_bucket_size(self) -> int:
        """``zero_optimization.reduce_bucket_size`` in elements (DeepSpeed's default 5e8 when
        unset; shardkit's wrappers then use their own bucket)."""
        size = self.config.zero.reduce_bucket_numel
        return int(5e8) if size is None else size

    def zero_allgather_bucket_size(self) -> int:
        """``zero_optimization.allgather_bucket_size`` (accepted, reported; OSS and FSDP size
        their own gathers)."""
        return int(self._zero_section().get("allgather_bucket_size", 5e8))

    def zero_reduce_scatter(self) -> bool:
        """``zero_optimization.reduce_scatter`` (stage 1: each gradient is averaged onto its
        owner only)."""
        return bool(self._zero_section().get("reduce_scatter", True))

    def zero_overlap_comm(self) -> bool:
        """``zero_optimization.overlap_comm`` as configured (shardkit's wrappers overlap their
        reductions with backward in any case)."""
        return bool(self._zero_section().get("overlap_comm", False))

    def zero_contiguous_gradients(self) -> bool:
        """``zero_optimization.contiguous_gradients`` as configured."""
        return bool(self._zero_section().get("contiguous_gradients", True))

    def zero_ignore_unused_parameters(self) -> bool:
        """``zero_optimization.ignore_unused_parameters``."""
        return self.config.zero.ignore_unused_parameters

    def zero_max_live_parameters(self) -> int:
        """``stage3_max_live_parameters`` as configured (reported; FSDP's prefetch holds one
        unit ahead)."""
        return int(self._stage3_knob("max_live_parameters", 1e9))

    def zero_max_reuse_distance(self) -> int:
        """``stage3_max_reuse_distance`` as configured (reported)."""
        return int(self._stage3_knob("max_reuse_distance", 1e9))

    def zero_prefetch_bucket_size(self) -> int:
        """``stage3_prefetch_bucket_size`` as configured (reported)."""
        return int(self._stage3_knob("prefetch_bucket_size", 5e7))

    def zero_param_persistence_threshold(self) -> int:
        """``stage3_param_persistence_threshold`` as configured (reported)."""
        return int(self._stage3_knob("param_persistence_threshold", 1e5))

    def zero_sub_group_size(self) -> int:
        """``zero_optimization.sub_group_size`` as configured (reported)."""
        return int(self._zero_section().get("sub_group_size", 1e9))

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """``stage3_gather_16bit_weights_on_model_save`` (or its older ``fp16`` spelling) as
        configured. shardkit's :meth:`~shardkit.engine.ShardedEngine.save_16bit_model` gathers the
        full model at stage 3 whatever it says (DeepSpeed writes nothing and returns ``False`` when
        it is off)."""
        section = self._zero_section()
        return bool(section.get("stage3_gather_16bit_weights_on_model_save",
                                section.get("stage3_gather_fp16_weights_on_model_save", False)))

    def _stage3_knob(self, name: str, default: float) -> float:
        """A ``stage3_*`` knob under either of DeepSpeed's spellings (``max_live_parameters``
        or ``stage3_max_live_parameters``); the config already renamed the short one."""
        section = self._zero_section()
        return section.get(f"stage3_{name}", section.get(name, default))

    def zero_hpz_partition_size(self) -> int:
        """ZeRO++ hpZ's partition size (1: off)."""
        return self.config.zero.hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        """ZeRO++ qwZ: int8 weight all-gathers (stage 3)."""
        return self.config.zero.quantized_weights

    def zero_quantized_gradients(self) -> bool:
        """ZeRO++ qgZ: int4 gradient reduce-scatters (stage 3)."""
        return self.config.zero.quantized_gradients

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16 runs with a dynamic loss scale (``fp16.loss_scale`` 0)."""
        precision = self.config.precision
        return precision.dtype == "fp16" and precision.static_loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        """``2 ** fp16.initial_scale_power``."""
        return float(2 ** self.config.precision.initial_scale_power)

    def dynamic_loss_scale_args(self) -> Optional[dict]:
        """The dynamic scaler's settings under DeepSpeed's keys, ``None`` without one."""
        if not self.dynamic_loss_scale():
            return None
        p = self.config.precision
        return {"init_scale": self.initial_dynamic_scale(), "scale_window": p.loss_scale_window,
                "delayed_shift": p.hysteresis, "consecutive_hysteresis": p.consecutive_hysteresis,
                "min_scale": p.min_loss_scale}

    def gradient_predivide_factor(self) -> float:
        """The config's ``gradient_predivide_factor`` (1.0 by default)."""
        return float(self.config.checked.get("gradient_predivide_factor", 1.0))

    def postscale_gradients(self) -> bool:
        """Whether gradients are averaged after the reduction (``not prescale_gradients``)."""
        return not self.config.checked.get("prescale_gradients", False)

    def wall_clock_breakdown(self) -> bool:
        """The config's ``wall_clock_breakdown`` (accepted; nothing is printed for it)."""
        return bool(self.config.checked.get("wall_clock_breakdown", False))

    def memory_breakdown(self) -> bool:
        """The config's ``memory_breakdown`` (accepted; nothing is printed for it)."""
        return bool(self.config.checked.get("memory_breakdown", False))

    def dataloader_drop_last(self) -> bool:
        """Whether the engine's dataloader drops a last partial micro-batch."""
        return self.config.dataloader_drop_last

    def sparse_gradients_enabled(self) -> bool:
        """The config's ``sparse_gradients`` (accepted at stage 0 only, where torch DDP reduces
        the sparse gradients of ``sparse=True`` embeddings)."""
        return bool(self.config.checked.get("sparse_gradients", False))

    @property
    def communication_data_type(self):
        """DeepSpeed's engine property: the torch dtype gradients are reduced in, the config's
        ``communication_data_type`` when set (``"fp32"`` included: a 16-bit model's gradients
        widened for the sum), else the 16-bit precision's dtype, else fp32."""
        named = self.config.communication_dtype or self.config.precision.dtype
        return _DTYPE_OF_NAME[named]

    @communication_data_type.setter
    def communication_data_type(self, value) -> None:
        # DeepSpeed's setter rewrites its config, read at each reduction; shardkit's wrappers
        # took their reduction dtype from the config at initialize: say so, not ignore it
        raise AttributeError(f"engine.communication_data_type = {value!r}: shardkit reduces "
                             f"gradients in the dtype its wrappers were built with; set "
                             f"\"communication_data_type\" in the config given to initialize")

    def amp_enabled(self) -> bool:
        """Always ``False``: apex AMP is not supported (use ``fp16`` or ``bf16``)."""
        return False

    def get_data_types(self) -> tuple:
        """DeepSpeed's ``(model dtype, gradient accumulation dtype)``: the dtype the config's
        ``fp16`` / ``bf16`` section runs the model in (fp32 without one), and the dtype the
        engine accumulates gradients in (what ``data_types.grad_accum_dtype`` must name when
        set): the model's at stages 0-2, fp32 at stage 3 (DeepSpeed, unset: the model's)."""
        precision = self.config.precision.dtype
        return (_DTYPE_OF_NAME[precision],
                _DTYPE_OF_NAME[accumulation_dtype_name(precision, self.config.zero.stage)])

    def dump_state(self) -> bool:
        """The config's ``dump_state`` (DeepSpeed prints its state at start-up when set)."""
        return bool(self.config.raw.get("dump_state", False))

    @property
    def param_names(self) -> dict:
        """DeepSpeed's ``{parameter: name}`` of the model's parameters, named as in
        ``engine.module.named_parameters()`` (the user's names, also at stage 3). A walk over
        the parameters at each read."""
        return {p: name for name, p in self.module.named_parameters()}

    @property
    def data_parallel_group(self):
        """The process group the batch is split over: the data-parallel group under tensor
        parallelism, else the default group (``torch.distributed.group.WORLD``)."""
        return self.checkpoint_group or torch.distributed.group.WORLD

    @property
    def is_compiled(self) -> bool:
        """DeepSpeed's property: whether ``engine.compile()`` (``nn.Module.compile``) was
        called, so the engine's forward runs the compiled module."""
        return getattr(self, "_compiled_call_impl", None) is not None

    @staticmethod
    def is_map_style_dataset(obj) -> bool:
        """Whether ``obj`` can be indexed and has a length (DeepSpeed's test)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj) -> bool:
        """Whether ``obj`` is a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)

    # -- when the gradients are the reduced ones (DeepSpeed's safe_*_grad functions)
    def _check_full_grads_readable(self, what: str) -> None:
        """ValueError, naming ``what`` (the caller), unless the gradients this engine holds are
        the reduced ones: after the ``engine.backward(loss)`` of an accumulation window's last
        micro-batch and before its ``engine.step()`` (or with nothing accumulated since the last
        optimizer step, where every gradient is ``None``). In the middle of a window each rank
        holds its own partial sums (stage 3: none at all), so a full gradient read or written
        there would be wrong; DeepSpeed raises there too ("Gradients are only available
        immediately after backward and before engine step"). The micro-batch counters are the
        same on every rank, so every rank raises alike, before any collective. Local."""
        gas = self.config.gradient_accumulation_steps
        backward_since_step = self._backwards_since_step > 0
        if backward_since_step and self.is_gradient_accumulation_boundary():
            if not self._boundary_unreduced:
                return
            raise ValueError(f"{what}: the accumulation boundary's engine.backward(loss) ran "
                             f"inside engine.no_sync() (or with require_backward_grad_sync = "
                             f"False), so the gradients are this rank's own, not averaged over "
                             f"the ranks; run the window's last backward outside no_sync()")
        if backward_since_step:
            partial = True
        elif self._boundary_override is None:  # counting micro-batches: is a window open?
            partial = self.micro_steps % gas != 0
        else:
            partial = False
        if partial:
            done = self.micro_steps % gas + (1 if backward_since_step else 0)
            where = (f"after micro-batch {done} of {gas} of a gradient accumulation window"
                     if self._boundary_override is None else
                     "inside a gradient accumulation window (set_gradient_accumulation_"
                     "boundary(False))")
            raise ValueError(f"{what}: called {where}, where each rank holds its own partial "
                             f"gradients (stage 3: none), not the averaged ones; the full "
                             f"gradient exists only after the engine.backward(loss) of the "
                             f"window's last micro-batch (engine.is_gradient_accumulation_"
                             f"boundary() True) and before engine.step(), as in DeepSpeed")

    # -- DeepSpeed's batch-size setters
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the gradient accumulation steps (the micro-batch
        stays), as DeepSpeed does: ``train_batch_size`` must be a multiple of micro-batch x
        data-parallel ranks. Call it between optimizer steps (ValueError mid-accumulation,
        where DeepSpeed would silently move the next boundary)."""
        micro, ranks = self.config.train_micro_batch_size_per_gpu, self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) \
                or train_batch_size < 1 or train_batch_size % (micro * ranks):
            raise ValueError(f"engine.set_train_batch_size({train_batch_size!r}): must be a "
                             f"positive multiple of micro-batch {micro} x data-parallel ranks "
                             f"{ranks} = {micro * ranks}")
        self._set_batch_sizes(train_batch_size, micro, train_batch_size // (micro * ranks),
                              "set_train_batch_size")

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch and keep the gradient accumulation steps, as DeepSpeed does
        (``train_batch_size`` becomes micro x steps x data-parallel ranks). A dataloader the
        engine built keeps its batch size, as in DeepSpeed. Call it between optimizer steps."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) \
                or micro_batch_size < 1:
            raise ValueError(f"engine.set_train_micro_batch_size({micro_batch_size!r}): must be "
                             f"a positive int")
        gas = self.config.gradient_accumulation_steps
        self._set_batch_sizes(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas,
                              "set_train_micro_batch_size")

    def _set_batch_sizes(self, train: int, micro: int, gas: int, caller: str) -> None:
        old_gas = self.config.gradient_accumulation_steps
        if self._boundary_override is None and self.micro_steps % old_gas:
            raise ValueError(f"engine.{caller}: called after {self.micro_steps % old_gas} of "
                             f"{old_gas} micro-batches of an accumulation; call it right after "
                             f"engine.step() at a boundary")
        self._samples_before_resize = self.global_samples
        self._steps_before_resize = self.global_steps
        self.config = dataclasses.replace(self.config, train_batch_size=train,
                                          train_micro_batch_size_per_gpu=micro,
                                          gradient_accumulation_steps=gas)
        self.micro_steps = self.global_steps * gas  # the next boundary after gas micro-batches
        self.tput_timer.batch_size = train


def _params_of(section: Any) -> Optional[dict]:
    return None if not isinstance(section, dict) else dict(section.get("params", {}))
