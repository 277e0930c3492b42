"""The engine's boundary step (:class:`OptimizerStep`, mixed into
:class:`shardkit.engine.ShardedEngine`): the gradients' overflow check, unscaling, clipping and
norm, the optimizer and scheduler steps, and the fp16 loss scaler's update. Communication: the
overflow flag's one-element all-reduce and the clip's norm all-reduce where configured, plus the
optimizer's own.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch

from shardkit import distributed
from shardkit.config import EngineConfig
from shardkit.engine_optimizer_hooks import _ENGINE_STEPPING
from shardkit.engine_scheduler import _note_step_taken_for
from shardkit.optim.loss_scaler import DynamicLossScaler, StaticLossScaler
from shardkit.optim.master_weights import master_weights_of

logger = logging.getLogger("shardkit")


def _loss_scaler(cfg: EngineConfig):
    p = cfg.precision
    if p.dtype != "fp16":
        return None
    if p.static_loss_scale > 0:
        return StaticLossScaler(p.static_loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** p.initial_scale_power,
                             scale_window=p.loss_scale_window, hysteresis=p.hysteresis,
                             min_scale=p.min_loss_scale,
                             raise_error_at_min_scale=p.raise_error_at_min_scale,
                             consecutive_hysteresis=p.consecutive_hysteresis)


def _sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """A dense gradient itself; a sparse one's coalesced values (repeated indices summed, as
    they are added to the weight)."""
    return grad.coalesce().values() if grad.is_sparse else grad


class OptimizerStep:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.optimizer``,
    ``self.lr_scheduler``, ``self.loss_scaler``, ``self.composition``, ``self.config``,
    ``self.module`` and the engine's step counters, ``loss_scale``, ``dp_world_size``,
    ``_measures_grad_norm``, ``_publish_loss_scale`` and ``zero_grad``."""

    def _optimizer_step(self, lr_kwargs: dict, loss_scaled: bool = True,
                        agreed_in_advance: Optional[dict] = None) -> None:
        """Step at the boundary; ``agreed_in_advance``: the OSS agreements the step agreement
        carried (:meth:`~shardkit.engine.ShardedEngine._agree_on_step`), whose calls here then skip
        their own exchange."""
        agreed_in_advance = agreed_in_advance or {}
        scale_before = self.loss_scale
        overflow = self._prepare_gradients_for_step(loss_scaled, agreed_in_advance)
        if not overflow:
            optimizer = self.optimizer
            _ENGINE_STEPPING[optimizer] = _ENGINE_STEPPING.get(optimizer, 0) + 1
            try:
                with self._in_oss_agreement(agreed_in_advance, "step"):
                    optimizer.step()
            finally:
                _ENGINE_STEPPING[optimizer] -= 1
            if self.lr_scheduler is not None:
                _note_step_taken_for(self.lr_scheduler)
                self.lr_scheduler.step(**lr_kwargs)
        self._update_loss_scale(overflow, scale_before)
        self._boundary_unreduced = False
        self.zero_grad()

    def _prepare_gradients_for_step(self, loss_scaled: bool, agreed_in_advance: dict) -> bool:
        """The boundary step's work on the gradients before the optimizer runs (also that of
        a direct ``engine.optimizer.step()``, :mod:`shardkit.engine_direct_step`): clear
        those the optimizer leaves out, sum sequence-parallel ones, agree on overflow (fp16,
        bf16 as configured), then unless it overflowed unscale them (``loss_scaled``: by the
        loss scale; times the data-parallel size under ``gradient_allreduce_op`` "sum") and
        clip or measure their norm (``gradient_clipping``). Returns whether the step
        overflowed and must be skipped. Communication: the overflow flag's one-element
        all-reduce and the clip's norm all-reduce, where configured."""
        for param in self._left_out():  # never stepped: kept out of the clip, never accumulated
            param.grad = None
        if self._sums_sequence_parallel_grads:  # (not again where the script summed them)
            from shardkit.nn.model_parallel import reduce_sequence_parallel_grads
            reduce_sequence_parallel_grads(self.module, unless_summed=True)
        overflow = self._agreed_overflow() if self.config.precision.check_grad_overflow \
            else False
        self._last_step_applied = not overflow
        # DeepSpeed's ZeRO and fp16 optimizers' flag: did the last step overflow (skipped)
        self.optimizer.overflow = overflow
        if overflow:
            self.skipped_steps += 1
            self._last_grad_norm = None
            return True
        factor = 1.0 / self.loss_scale if self.loss_scaler is not None and loss_scaled else 1.0
        if self.config.gradient_allreduce_op == "sum":  # the reduction averaged them
            factor *= self.dp_world_size
        if factor != 1.0:
            self._unscale_gradients(factor)
        max_norm = self._clip_max_norm()
        if max_norm is not None:
            with self._in_oss_agreement(agreed_in_advance, "clip_grad_norm"):
                norm = self._clip_grad_norm(max_norm)
            self._last_grad_norm = None if norm is None else torch.as_tensor(norm).detach()
        return False

    def _update_loss_scale(self, overflow: bool, scale_before: float) -> None:
        """Tell the fp16 loss scaler how the step went (an overflow backs the scale off) and
        publish the new scale on the optimizer; rank 0 logs a skipped step. Local."""
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(overflow)
            self._publish_loss_scale()
        if overflow and distributed.get_rank() == 0:
            logger.info("step %d: %s gradients overflowed (inf/nan); step skipped, loss scale "
                        "%g -> %g", self.global_steps + 1, self.config.precision.dtype,
                        scale_before, self.loss_scale)

    def _clip_max_norm(self) -> Optional[float]:
        """The ``max_norm`` the step clips with (``inf``: measures the norm only), or ``None``
        where it neither clips nor measures."""
        if self.config.gradient_clipping > 0 or self._measures_grad_norm:
            return self.config.gradient_clipping or math.inf
        return None

    def _in_oss_agreement(self, agreed_in_advance: dict, call: str):
        """The block that runs OSS's ``call`` (``"step"`` or ``"clip_grad_norm"``) on the rows
        the step agreement carried for it (``OSS.agreed_in_advance``, which checks them as the
        call would: the same error on every rank), so the call makes no exchange of its own;
        where the agreement did not carry it, a block that changes nothing."""
        if call not in agreed_in_advance:
            return contextlib.nullcontext()
        rows, arguments = agreed_in_advance[call]
        return self.optimizer.agreed_in_advance(call, rows, **arguments)

    def _left_out(self) -> list:
        """Trainable parameters the optimizer does not step now (``model_parameters=...`` a
        subset): read at each step, so that parameters added later by
        ``optimizer.add_param_group`` (or unfrozen later) are counted as they are then."""
        stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        return [p for p in self.module.parameters() if p.requires_grad and id(p) not in stepped]

    def _local_gradients(self) -> list[torch.Tensor]:
        """The gradients the step reads: at stages 0-2 with fp32 master weights (a 16-bit
        model, :class:`~shardkit.optim.MasterWeights`), those it steps widened to fp32, so that
        the overflow check, unscaling and clipping act on them in fp32 (a loss-scaled fp16
        gradient unscaled in fp16 flushes to zero); elsewhere the parameters' own."""
        masters = master_weights_of(self.optimizer)
        if masters is not None:
            return masters.prepare_master_grads()
        return [p.grad for group in self.optimizer.param_groups for p in group["params"]
                if p.grad is not None]

    def _agreed_overflow(self) -> bool:
        """Inf/nan in any rank's gradients, all-reduced so every rank decides the same. A sparse
        gradient (an embedding with ``sparse=True``, stage 0) is checked on its coalesced
        values, the entries it adds to the weight."""
        grads = [_sparse_values(g) for g in self._local_gradients()]
        overflow = bool(grads) and not bool(
            torch.stack([torch.isfinite(g).all() for g in grads]).all())
        device = grads[0].device if grads else torch.device("cpu")
        return distributed.any_rank(overflow, device=device)

    def _unscale_gradients(self, inv_scale: float) -> None:
        grads = self._local_gradients()
        dense = [g for g in grads if not g.is_sparse]
        if dense:
            torch._foreach_mul_(dense, inv_scale)
        for grad in grads:
            if grad.is_sparse:
                grad.mul_(inv_scale)

    def _clip_grad_norm(self, max_norm: float):
        """The composition's clip (``max_norm=inf``: measure only), except with sparse
        gradients (stage 0, every rank holds the averaged ones), which torch's
        ``clip_grad_norm_`` cannot take: the 2-norm over the dense gradients and the sparse
        ones' coalesced values, and torch's clip coefficient ``max_norm / (norm + 1e-6)``
        (at most 1) applied to both. No communication."""
        grads = self._local_gradients()
        if self.composition.stage != 0 or not any(g.is_sparse for g in grads):
            return self.composition.clip_grad_norm(max_norm)
        squares = [torch.linalg.vector_norm(_sparse_values(g).float()) ** 2 for g in grads]
        total = torch.stack(squares).sum().sqrt()
        if not math.isinf(max_norm):
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for grad in grads:
                if grad.is_sparse:
                    grad.mul_(coefficient.to(grad.dtype).item())
                else:
                    grad.mul_(coefficient.to(grad.dtype))
        return total
