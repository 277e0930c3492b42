"""Triton kernels for the fused optimizer steps (AdamW/Adam and SGD with momentum).

Imported lazily by :mod:`shardkit.kernels.optim_step` (Triton reads ``TRITON_INTERPRET`` when a
``@triton.jit`` function is created, so this module must be imported after the environment is
set). Callers validate their arguments; the launchers here trust them.

Two shapes of launch:

* flat: one contiguous buffer per operand (a ZeRO shard, a flat parameter), one launch;
* many: a list of tensors per operand (the parameters of one param group), still one launch:
  a small int64 table carries each tensor's addresses and a second table maps every program to
  ``(tensor, first element)``, the way torch's multi-tensor-apply does it.

Every kernel reads and writes each element once: AdamW moves 28 bytes per fp32 parameter (read p,
g, m, v; write p, m, v), plus the gradient written back unscaled when ``grad_scale`` is given and
2 bytes per parameter for ``low_precision_out``. ``found_inf`` is read on the device and masks
every load and store, so a skipped step costs no host synchronisation and no memory traffic.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from shardkit.kernels.triton_common import (TL_DTYPES, cached_table, cast_to, host_table,
                                            interpreter_block, widen)

__all__ = ["adamw", "adamw_many", "sgd", "BLOCK"]

BLOCK = interpreter_block(1024)


@triton.jit
def _adamw_math(p, g, m, v, vmax, step_size, bc2_sqrt, lr, c1, beta2, c2, eps, weight_decay,
                DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr):
    """One AdamW/Adam update on fp32 registers; returns (p, m, v, vmax). ``c1``, ``c2``:
    ``1 - beta1`` and ``1 - beta2``, computed on the host in double precision (a compiled
    kernel gets a Python float as fp32, and ``1.0 - beta2`` taken in fp32 loses most of its
    digits near 1: 1.3% off at beta2 = 0.999999)."""
    if MAXIMIZE:
        g = -g
    if DECOUPLED:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = m + c1 * (g - m)
    v = beta2 * v + c2 * g * g
    if AMSGRAD:
        # NaN-propagating, as torch.maximum in torch.optim.AdamW: a NaN/inf gradient leaves a
        # NaN max (the default max keeps the stale finite one, as torch's fused kernels do)
        vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
        denom = tl.sqrt(vmax) / bc2_sqrt + eps
    else:
        denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, m, v, vmax


@triton.jit
def _live_mask(offs, n, found_inf_ptr, HAS_INF: tl.constexpr):
    """Elements to touch: in range, and none at all when ``found_inf`` is set."""
    if HAS_INF:
        n = tl.where(tl.load(found_inf_ptr) == 0, n, 0)
    return offs < n


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, lp_ptr, offs, mask, step_size, bc2_sqrt,
                 lr, c1, beta2, c2, eps, weight_decay, scale_ptr,
                 DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_LP: tl.constexpr):
    """Load one block, update it, store it back (``mask`` selects the live elements)."""
    p = widen(tl.load(p_ptr + offs, mask=mask, other=0.0))
    g = widen(tl.load(g_ptr + offs, mask=mask, other=0.0))
    m = widen(tl.load(m_ptr + offs, mask=mask, other=0.0))
    v = widen(tl.load(v_ptr + offs, mask=mask, other=0.0))
    vmax = v
    if AMSGRAD:
        vmax = widen(tl.load(vmax_ptr + offs, mask=mask, other=0.0))
    if HAS_SCALE:
        # torch's fused AdamW leaves the unscaled gradient in the grad buffer; so do we.
        g = g / tl.load(scale_ptr)
        tl.store(g_ptr + offs, cast_to(g, g_ptr.dtype.element_ty), mask=mask)
    p, m, v, vmax = _adamw_math(p, g, m, v, vmax, step_size, bc2_sqrt, lr, c1, beta2, c2,
                                eps, weight_decay, DECOUPLED, AMSGRAD, MAXIMIZE)
    stored = cast_to(p, p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, stored, mask=mask)
    tl.store(m_ptr + offs, cast_to(m, m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, cast_to(v, v_ptr.dtype.element_ty), mask=mask)
    if AMSGRAD:
        tl.store(vmax_ptr + offs, cast_to(vmax, vmax_ptr.dtype.element_ty), mask=mask)
    if HAS_LP:
        # the cast of the parameter as stored (a 16-bit parameter rounded once, then cast),
        # as the torch backend's copy_ of the updated parameter
        tl.store(lp_ptr + offs, cast_to(widen(stored), lp_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_flat_kernel(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, lp_ptr, n, step_size, bc2_sqrt,
                       lr, c1, beta2, c2, eps, weight_decay, scale_ptr, found_inf_ptr,
                       DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, HAS_LP: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = _live_mask(offs, n, found_inf_ptr, HAS_INF)
    _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, lp_ptr, offs, mask, step_size, bc2_sqrt,
                 lr, c1, beta2, c2, eps, weight_decay, scale_ptr,
                 DECOUPLED, AMSGRAD, MAXIMIZE, HAS_SCALE, HAS_LP)


@triton.jit
def _adamw_many_kernel(addr_table, numels, step_sizes, bc2_sqrts, block_tensor, block_start,
                       n_tensors, lr, c1, beta2, c2, eps, weight_decay, scale_ptr, found_inf_ptr,
                       P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
                       DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                       HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr):
    # addr_table rows: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq (n_tensors entries each)
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = _live_mask(offs, tl.load(numels + t), found_inf_ptr, HAS_INF)
    p_ptr = tl.load(addr_table + t).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(addr_table + n_tensors + t).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(addr_table + 2 * n_tensors + t).to(tl.pointer_type(P_DTYPE))
    v_ptr = tl.load(addr_table + 3 * n_tensors + t).to(tl.pointer_type(P_DTYPE))
    vmax_ptr = tl.load(addr_table + 4 * n_tensors + t).to(tl.pointer_type(P_DTYPE))
    _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, vmax_ptr, p_ptr, offs, mask,
                 tl.load(step_sizes + t), tl.load(bc2_sqrts + t), lr, c1, beta2, c2, eps,
                 weight_decay, scale_ptr, DECOUPLED, AMSGRAD, MAXIMIZE, HAS_SCALE, False)


@triton.jit
def _sgd_flat_kernel(p_ptr, g_ptr, buf_ptr, n, lr, momentum, undamped, weight_decay,
                     scale_ptr, found_inf_ptr, HAS_MOMENTUM: tl.constexpr,
                     FIRST_STEP: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
                     HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = _live_mask(offs, n, found_inf_ptr, HAS_INF)
    p = widen(tl.load(p_ptr + offs, mask=mask, other=0.0))
    g = widen(tl.load(g_ptr + offs, mask=mask, other=0.0))
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
        tl.store(g_ptr + offs, cast_to(g, g_ptr.dtype.element_ty), mask=mask)
    if MAXIMIZE:
        g = -g
    g = g + weight_decay * p
    if HAS_MOMENTUM:
        if FIRST_STEP:
            buf = g
        else:
            buf = widen(tl.load(buf_ptr + offs, mask=mask, other=0.0))
            buf = momentum * buf + undamped * g  # undamped: 1 - dampening, from the host
        tl.store(buf_ptr + offs, cast_to(buf, buf_ptr.dtype.element_ty), mask=mask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p - lr * g
    tl.store(p_ptr + offs, cast_to(p, p_ptr.dtype.element_ty), mask=mask)


def _bias_corrections(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """``(lr / (1 - beta1**step), sqrt(1 - beta2**step))`` in double precision, on the host."""
    return lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def _grid(n: int) -> tuple[int]:
    return (max(1, triton.cdiv(n, BLOCK)),)


def adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
          exp_avg_sq: torch.Tensor, max_exp_avg_sq: Optional[torch.Tensor], *, step: int,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
          maximize: bool, amsgrad: bool, decoupled: bool,
          grad_scale: Optional[torch.Tensor], found_inf: Optional[torch.Tensor],
          low_precision_out: Optional[torch.Tensor]) -> None:
    """AdamW/Adam over flat contiguous buffers in one launch (see the module docstring)."""
    n = param.numel()
    if n == 0:
        return
    step_size, bc2_sqrt = _bias_corrections(step, lr, beta1, beta2)
    _adamw_flat_kernel[_grid(n)](
        param, grad, exp_avg, exp_avg_sq,
        max_exp_avg_sq if amsgrad else exp_avg_sq,
        low_precision_out if low_precision_out is not None else param,
        n, step_size, bc2_sqrt, lr, 1.0 - beta1, beta2, 1.0 - beta2, eps, weight_decay,
        grad_scale if grad_scale is not None else param,
        found_inf if found_inf is not None else param,
        DECOUPLED=decoupled, AMSGRAD=amsgrad, MAXIMIZE=maximize,
        HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
        HAS_LP=low_precision_out is not None, BLOCK=BLOCK)


def _block_table(numels: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each program: which tensor it works on and the first element of its block.
    Depends on the sizes only, so it is built once per set of sizes and cached."""
    key = ("adamw_blocks", tuple(numels), BLOCK)

    def tensor_ids():
        return [i for i, n in enumerate(numels) for _ in range(triton.cdiv(n, BLOCK))]

    def starts():
        return [s for n in numels for s in range(0, triton.cdiv(n, BLOCK) * BLOCK, BLOCK)]

    return (cached_table(key, tensor_ids, torch.int32, device),
            cached_table(key, starts, torch.int64, device))


def adamw_many(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
               max_exp_avg_sqs: Sequence[torch.Tensor], *, steps: Sequence[int], lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool,
               amsgrad: bool, decoupled: bool, grad_scale: Optional[torch.Tensor],
               found_inf: Optional[torch.Tensor]) -> None:
    """AdamW/Adam over lists of tensors in one launch per grad dtype.

    Costs beside the 28 B/param of the update: small host-built tables per launch (5 addresses
    and 3 numbers per tensor) and a cached block map (one entry per 1024-element block).
    """
    by_dtype: dict[tuple, list[int]] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        if p.numel():
            by_dtype.setdefault((p.dtype, g.dtype), []).append(i)
    device = params[0].device if params else torch.device("cpu")
    for (p_dtype, g_dtype), idx in by_dtype.items():
        vmaxes = [max_exp_avg_sqs[i] for i in idx] if amsgrad else [exp_avg_sqs[i] for i in idx]
        addresses = ([params[i].data_ptr() for i in idx] + [grads[i].data_ptr() for i in idx]
                     + [exp_avgs[i].data_ptr() for i in idx]
                     + [exp_avg_sqs[i].data_ptr() for i in idx]
                     + [t.data_ptr() for t in vmaxes])
        numels = [params[i].numel() for i in idx]
        corrections = [_bias_corrections(steps[i], lr, beta1, beta2) for i in idx]
        block_tensor, block_start = _block_table(numels, device)
        _adamw_many_kernel[(block_tensor.numel(),)](
            host_table(addresses, torch.int64, device), host_table(numels, torch.int64, device),
            host_table([c[0] for c in corrections], torch.float32, device),
            host_table([c[1] for c in corrections], torch.float32, device),
            block_tensor, block_start, len(idx), lr, 1.0 - beta1, beta2, 1.0 - beta2, eps,
            weight_decay,
            grad_scale if grad_scale is not None else params[idx[0]],
            found_inf if found_inf is not None else params[idx[0]],
            P_DTYPE=TL_DTYPES[p_dtype], G_DTYPE=TL_DTYPES[g_dtype],
            DECOUPLED=decoupled, AMSGRAD=amsgrad, MAXIMIZE=maximize,
            HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None, BLOCK=BLOCK)


def sgd(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor], *,
        lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool,
        maximize: bool, first_step: bool, grad_scale: Optional[torch.Tensor],
        found_inf: Optional[torch.Tensor]) -> None:
    """SGD (torch.optim.SGD semantics) over flat contiguous buffers in one launch.
    Memory traffic: 12 B/param without momentum, 20 with (16 on the first step)."""
    n = param.numel()
    if n == 0:
        return
    _sgd_flat_kernel[_grid(n)](
        param, grad, momentum_buffer if momentum_buffer is not None else param, n,
        lr, momentum, 1.0 - dampening, weight_decay,
        grad_scale if grad_scale is not None else param,
        found_inf if found_inf is not None else param,
        HAS_MOMENTUM=bool(momentum), FIRST_STEP=first_step, NESTEROV=nesterov,
        MAXIMIZE=maximize, HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
        BLOCK=BLOCK)
