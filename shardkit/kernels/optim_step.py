"""Fused optimizer steps over flat buffers (AdamW/Adam and SGD with momentum).

Each function updates ``param`` in place from ``grad`` and its state buffers, in one pass over
memory where the backend allows it. Semantics are torch.optim.AdamW's / torch.optim.SGD's.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit.kernels.dispatch import backend_for

__all__ = ["adamw_step", "sgd_step"]


def _check_buffers(name: str, param: torch.Tensor, **buffers: Optional[torch.Tensor]) -> None:
    for key, t in buffers.items():
        if t is None:
            continue
        if t.shape != param.shape:
            raise ValueError(f"{name}: {key} has shape {tuple(t.shape)}, param has "
                             f"{tuple(param.shape)}; they must match")
        if t.device != param.device:
            raise ValueError(f"{name}: {key} is on {t.device}, param on {param.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {key} is not contiguous; flat buffers must be")
    if not param.is_contiguous():
        raise ValueError(f"{name}: param is not contiguous; flat buffers must be")


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
               beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
               maximize: bool = False, amsgrad: bool = False,
               max_exp_avg_sq: Optional[torch.Tensor] = None, decoupled: bool = True,
               grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None,
               low_precision_out: Optional[torch.Tensor] = None) -> None:
    """One AdamW (``decoupled=True``) or Adam (L2, ``decoupled=False``) step, in place.

    ``step`` is the step number after this update (1 on the first step). ``grad_scale``: the
    gradient is divided by it first; ``found_inf`` (nonzero): nothing is updated.
    ``low_precision_out``: a bf16/fp16 buffer that receives the updated parameters.
    Memory traffic: 28 bytes per fp32 parameter (read p, g, m, v; write p, m, v).
    """
    _check_buffers("adamw_step", param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq,
                   max_exp_avg_sq=max_exp_avg_sq, low_precision_out=low_precision_out)
    if amsgrad and max_exp_avg_sq is None:
        raise ValueError("adamw_step: amsgrad=True needs max_exp_avg_sq")
    if step < 1:
        raise ValueError(f"adamw_step: step={step}; it counts from 1")
    if backend_for(param, grad) == "triton":
        from shardkit.kernels import triton_optim
        triton_optim.adamw(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step, lr=lr,
                           beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                           maximize=maximize, amsgrad=amsgrad, decoupled=decoupled,
                           grad_scale=grad_scale, found_inf=found_inf,
                           low_precision_out=low_precision_out)
        return
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    step_t = torch.tensor(float(step), device=param.device)
    g = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    fused([param], [g], [exp_avg], [exp_avg_sq],
          [max_exp_avg_sq] if amsgrad else [], [step_t], lr=lr, beta1=beta1, beta2=beta2,
          weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
          grad_scale=grad_scale, found_inf=found_inf)
    if low_precision_out is not None and not (found_inf is not None and found_inf.item()):
        low_precision_out.copy_(param)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
             first_step: bool = False, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None) -> None:
    """One SGD step (torch.optim.SGD semantics), in place. ``first_step``: the momentum buffer
    is initialised to the gradient, as torch does on a parameter's first step."""
    _check_buffers("sgd_step", param, grad=grad, momentum_buffer=momentum_buffer)
    if momentum and momentum_buffer is None:
        raise ValueError("sgd_step: momentum > 0 needs momentum_buffer")
    if backend_for(param, grad) == "triton":
        from shardkit.kernels import triton_optim
        triton_optim.sgd(param, grad, momentum_buffer, lr=lr, momentum=momentum,
                         dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                         maximize=maximize, first_step=first_step, grad_scale=grad_scale,
                         found_inf=found_inf)
        return
    if found_inf is not None and found_inf.item():
        return
    g = grad.to(param.dtype)
    if grad_scale is not None:
        g = g / grad_scale
    if maximize:
        g = -g
    if weight_decay:
        g = g.add(param, alpha=weight_decay)
    if momentum:
        if first_step:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    param.add_(g, alpha=-lr)
