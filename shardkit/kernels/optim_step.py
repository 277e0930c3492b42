"""Fused optimizer steps over flat buffers (AdamW/Adam and SGD with momentum).

Each function updates ``param`` in place from ``grad`` and its state buffers, in one pass over
memory where the backend allows it. Semantics are torch.optim.AdamW's / torch.optim.SGD's,
including those of torch's fused kernels: with ``grad_scale`` the gradient buffer is left holding
the unscaled gradient; with ``found_inf`` nonzero nothing is updated.

Backends (see :func:`shardkit.kernels.backend_for`): Triton kernels on CUDA (one launch, the
``found_inf`` test on the device, no host synchronisation); on CPU torch's fused kernels
(``torch._fused_adamw_``, ``torch._fused_sgd_``), which stream memory once.
"""

from __future__ import annotations

import math
import numbers
from itertools import chain
from typing import Optional, Sequence

import torch

from shardkit.kernels.dispatch import backend_for

__all__ = ["adamw_step", "adamw_step_many", "sgd_step"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_flat(name: str, key: str, t: torch.Tensor, like: torch.Tensor,
                same_dtype: bool) -> None:
    if t.shape != like.shape:
        raise ValueError(f"{name}: {key} has shape {tuple(t.shape)}, param has "
                         f"{tuple(like.shape)}; they must match")
    if t.device != like.device:
        raise ValueError(f"{name}: {key} is on {t.device}, param on {like.device}; "
                         f"all buffers must share a device")
    if same_dtype and t.dtype != like.dtype:
        raise ValueError(f"{name}: {key} is {t.dtype}, param is {like.dtype}; optimizer state "
                         f"must have the parameter's dtype")
    if t.dtype not in _FLOATS:
        raise ValueError(f"{name}: {key} is {t.dtype}; valid dtypes are {list(_FLOATS)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: {key} (shape {tuple(t.shape)}, stride {t.stride()}) is not "
                         f"contiguous; flat buffers must be (call .contiguous())")


def _check_scalar_tensor(name: str, key: str, t: Optional[torch.Tensor],
                         device: torch.device) -> None:
    if t is None:
        return
    if t.numel() != 1 or t.device != device:
        raise ValueError(f"{name}: {key} must be a one-element tensor on {device}; got "
                         f"{t.numel()} elements on {t.device}")


def _check_hyper(name: str, lr: float, **coefficients: float) -> None:
    if not lr >= 0.0:
        raise ValueError(f"{name}: lr={lr}; it must be >= 0")
    for key, value in coefficients.items():
        if not 0.0 <= value < 1.0 and key.startswith("beta"):
            raise ValueError(f"{name}: {key}={value}; valid range is [0, 1)")
        if not value >= 0.0:
            raise ValueError(f"{name}: {key}={value}; it must be >= 0")


def _check_adamw(name, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad,
                 low_precision_out, grad_scale, found_inf):
    _check_flat(name, "param", param, param, same_dtype=True)
    _check_flat(name, "grad", grad, param, same_dtype=False)
    _check_flat(name, "exp_avg", exp_avg, param, same_dtype=True)
    _check_flat(name, "exp_avg_sq", exp_avg_sq, param, same_dtype=True)
    if amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError(f"{name}: amsgrad=True needs max_exp_avg_sq")
        _check_flat(name, "max_exp_avg_sq", max_exp_avg_sq, param, same_dtype=True)
    if low_precision_out is not None:
        _check_flat(name, "low_precision_out", low_precision_out, param, same_dtype=False)
    _check_scalar_tensor(name, "grad_scale", grad_scale, param.device)
    _check_scalar_tensor(name, "found_inf", found_inf, param.device)


def _check_no_shared_memory(name: str, written: list, read: list = ()) -> None:
    """A ValueError naming two buffers that share memory where one of them is written.

    ``written`` / ``read``: ``(label, tensor)`` pairs. The kernels update every element
    independently and in parallel (Triton: one program per block, in no set order), so a
    parameter or state buffer passed twice, or overlapping another buffer of the call, was
    updated from stale values and the result depended on scheduling (a race, on CUDA); on CPU it
    was stepped twice with the state of one entry. Read-only buffers (gradients) may share
    memory with each other. Cost: a sort of the buffers' address ranges, no memory traffic.
    """
    spans = []
    for is_written, pairs in ((True, written), (False, read)):
        for label, t in pairs:
            if t is not None and t.numel():
                start = t.data_ptr()
                spans.append((str(t.device), start, start + t.numel() * t.element_size(),
                              is_written, label))
    spans.sort(key=lambda span: span[:2])
    device, last_any, last_written = None, None, None  # (end, label) of the furthest-reaching
    for dev, start, end, is_written, label in spans:
        if dev != device:
            device, last_any, last_written = dev, None, None
        other = last_any if is_written else last_written
        if other is not None and start < other[0]:
            raise ValueError(f"{name}: {other[1]} and {label} share memory; every buffer the "
                             f"step writes (parameters, optimizer state, and gradients when a "
                             f"grad_scale unscales them) must be a tensor of its own, apart "
                             f"from the others (the step updates them in place, in parallel): "
                             f"to step a tensor twice, make two calls")
        if last_any is None or end > last_any[0]:
            last_any = (end, label)
        if is_written and (last_written is None or end > last_written[0]):
            last_written = (end, label)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
               beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01,
               maximize: bool = False, amsgrad: bool = False,
               max_exp_avg_sq: Optional[torch.Tensor] = None, decoupled: bool = True,
               grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None,
               low_precision_out: Optional[torch.Tensor] = None) -> None:
    """One AdamW (``decoupled=True``) or Adam (L2, ``decoupled=False``) step, in place.

    ``param``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``) are contiguous buffers of one
    shape and dtype; ``grad`` has their shape, any float dtype (fp32/bf16/fp16).
    ``step`` is the step number after this update (1 on the first step): a number, or a
    one-element tensor as torch keeps ``state["step"]`` (read on the host). ``grad_scale``: the
    gradient is divided by it first (and left unscaled in ``grad``); ``found_inf`` (nonzero):
    nothing is updated. ``low_precision_out``: a bf16/fp16 buffer that receives the updated
    parameters in the same pass (on CPU a second pass; on a CPU skip it is left untouched).

    Memory traffic: 28 bytes per fp32 parameter (read p, g, m, v; write p, m, v); +4 with
    ``grad_scale`` (grad written back), +2 per element of ``low_precision_out``. No extra memory
    on Triton (float64 parameters take torch's ops there); on CPU, a copy of a ``grad`` of
    another dtype than the parameter's, and fp32 copies of a 16-bit parameter's buffers when its
    ``grad`` has another dtype. No communication.
    """
    _check_adamw("adamw_step", param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, amsgrad,
                 low_precision_out, grad_scale, found_inf)
    _check_no_shared_memory(
        "adamw_step",
        [("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
         ("max_exp_avg_sq", max_exp_avg_sq if amsgrad else None),
         ("low_precision_out", low_precision_out)]
        + ([("grad", grad)] if grad_scale is not None else []),
        [("grad", grad)] if grad_scale is None else [])
    _check_hyper("adamw_step", lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    step = _step_number("adamw_step", "step", step)
    if step < 1:
        raise ValueError(f"adamw_step: step={step}; it counts from 1")
    hyper = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                 weight_decay=float(weight_decay), maximize=bool(maximize),
                 amsgrad=bool(amsgrad))
    if backend_for(param, grad) == "triton" and _triton_ok(param):
        from shardkit.kernels import triton_optim
        triton_optim.adamw(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step,
                           decoupled=decoupled, grad_scale=grad_scale, found_inf=found_inf,
                           low_precision_out=low_precision_out, **hyper)
        return
    _torch_adamw([param], [grad], [exp_avg], [exp_avg_sq],
                 [max_exp_avg_sq] if amsgrad else [], [step], decoupled=decoupled,
                 grad_scale=grad_scale, found_inf=found_inf, **hyper)
    if low_precision_out is not None and not _skipped_on_cpu(found_inf):
        low_precision_out.copy_(param)


def _step_number(name: str, key: str, step):
    """``step`` as a Python number. Taken: an int or float, or a one-element tensor (torch's
    optimizers keep ``state["step"]`` as one; read on the host, on CUDA a synchronisation): the
    Triton launch needs the bias corrections as host numbers."""
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype == torch.bool or step.is_complex():
            raise ValueError(f"{name}: {key} is a {step.dtype} tensor of {step.numel()} "
                             f"elements; valid values are numbers >= 1 or one-element real "
                             f"tensors holding one")
        step = step.item()
    # numbers.Real: Python and NumPy scalars (np.int64 from a saved array), as before
    if isinstance(step, bool) or not isinstance(step, numbers.Real) \
            or not math.isfinite(step):
        raise ValueError(f"{name}: {key}={step!r}; valid values are numbers >= 1 or one-element "
                         f"real tensors holding one")
    return int(step) if isinstance(step, numbers.Integral) else float(step)


def _skipped_on_cpu(found_inf: Optional[torch.Tensor]) -> bool:
    # Reading a CPU scalar is a memory load, not a device synchronisation. On a CUDA tensor
    # (torch fallback) we do not sync: the low-precision copy is refreshed from the (unchanged)
    # parameters instead.
    return found_inf is not None and found_inf.device.type == "cpu" and bool(found_inf.item())


_LOW = (torch.float16, torch.bfloat16)


def _needs_fp32(param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether the CPU path must run on fp32 copies: a 16-bit parameter whose gradient has
    another dtype. torch's fused kernels take the gradient in the parameter's dtype, and casting
    an fp32 (or the other 16-bit) gradient to it would round it, or overflow it to inf (an fp32
    gradient scaled by 65536), before the update; the Triton kernels read it as it is."""
    return param.dtype in _LOW and grad.dtype != param.dtype


def _triton_ok(param: torch.Tensor) -> bool:
    """The Triton optimizer kernels compute in fp32; float64 parameters take torch's ops."""
    return param.dtype != torch.float64


def _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, *, decoupled,
                 grad_scale, found_inf, **hyper) -> None:
    """torch's fused Adam(W) over lists: one C++ call, one pass over memory per tensor.
    A 16-bit parameter with a gradient of another dtype is updated through fp32 copies of its
    buffers (see :func:`_needs_fp32`): the same fp32 arithmetic, rounded once, as Triton's.
    With ``amsgrad`` the max is then made NaN where ``exp_avg_sq`` is, as torch.optim.AdamW's
    (one more pass over the two buffers: 12 B per fp32 parameter)."""
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    device = params[0].device
    step_tensors = [_step_tensor(s, device) for s in steps]
    amsgrad = bool(max_exp_avg_sqs)
    work_p, work_g, work_m, work_v, work_x = [], [], [], [], []
    widened = []  # (originals, fp32 copies) of the parameters updated through fp32
    for i, (p, g) in enumerate(zip(params, grads)):
        originals = [p, exp_avgs[i], exp_avg_sqs[i]] + ([max_exp_avg_sqs[i]] if amsgrad else [])
        if _needs_fp32(p, g):
            copies = [t.float() for t in originals]
            g = g.float()
            widened.append((originals, copies))
        else:
            copies = originals
            g = g if g.dtype == p.dtype else g.to(p.dtype)
        work_p.append(copies[0])
        work_g.append(g)
        work_m.append(copies[1])
        work_v.append(copies[2])
        if amsgrad:
            work_x.append(copies[3])
    fused(work_p, work_g, work_m, work_v, work_x, list(step_tensors), grad_scale=grad_scale,
          found_inf=found_inf, **hyper)
    if amsgrad and not _skipped_on_cpu(found_inf):
        # torch's fused kernels keep a stale finite max where exp_avg_sq became NaN (a NaN/inf
        # gradient); torch.optim.AdamW's default loop (torch.maximum) and the Triton kernel
        # leave NaN there. A no-op on every other element (the max is already >= exp_avg_sq).
        torch._foreach_maximum_(work_x, work_v)
    for originals, copies in widened:
        for original, copy in zip(originals, copies):
            original.copy_(copy)
    if grad_scale is not None:
        for g, cast in zip(grads, work_g):
            if cast is not g:  # keep the contract: grad holds the unscaled gradient
                g.copy_(cast)


_STEP_TENSORS: dict = {}


def _step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """A read-only scalar tensor holding ``step`` for torch's fused kernels, cached: building
    one per call costs more than the whole update of a small buffer."""
    key = (step, device)
    t = _STEP_TENSORS.get(key)
    if t is None:
        if len(_STEP_TENSORS) > 256:
            _STEP_TENSORS.clear()
        # fp32 whatever the default dtype, as torch keeps its step counts (bf16 stops at 256)
        t = _STEP_TENSORS[key] = torch.tensor(float(step), dtype=torch.float32, device=device)
    return t


def _plainly_valid(device, params, *others) -> bool:
    """The common case, checked with list-level comparisons (a model has many tensors);
    anything else goes through the per-tensor checks, which name the problem."""
    shapes = [p.shape for p in params]
    dtypes = [p.dtype for p in params]
    tensors = list(chain(params, *others))
    return (all(d in _FLOATS for d in set(dtypes))
            and all(others[0][i].dtype in _FLOATS for i in range(len(params)))
            and all([t.shape for t in ts] == shapes for ts in others)
            and all([t.dtype for t in ts] == dtypes for ts in others[1:])
            and {t.device for t in tensors} == {device}
            and all(map(torch.Tensor.is_contiguous, tensors)))


def adamw_step_many(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                    steps: Sequence[int], lr: float, beta1: float = 0.9, beta2: float = 0.999,
                    eps: float = 1e-8, weight_decay: float = 0.01, maximize: bool = False,
                    amsgrad: bool = False,
                    max_exp_avg_sqs: Optional[Sequence[torch.Tensor]] = None,
                    decoupled: bool = True, grad_scale: Optional[torch.Tensor] = None,
                    found_inf: Optional[torch.Tensor] = None, validate: bool = True) -> None:
    """:func:`adamw_step` over lists of tensors (e.g. one param group) in one kernel launch.

    ``steps[i]`` is tensor ``i``'s step number after this update (a number, or a one-element
    tensor as torch keeps ``state["step"]``). Each tensor ``i`` follows the
    rules of :func:`adamw_step`; all share one device. No two params or state buffers may share
    memory (a tensor listed twice is a ValueError, not a race of the parallel update; step it
    twice with two calls); gradients may. ``validate=False`` skips the per-tensor checks (about
    1 µs per tensor) for callers that built the state buffers themselves, each parameter once,
    and take params and grads from autograd. Memory traffic: 28 B per fp32 parameter, as the
    flat step; the Triton launch also copies a small address table to the device.
    """
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if amsgrad:
        if max_exp_avg_sqs is None:
            raise ValueError("adamw_step_many: amsgrad=True needs max_exp_avg_sqs")
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for key, values in lists.items():
        if len(values) != len(params):
            raise ValueError(f"adamw_step_many: {key} has {len(values)} entries for "
                             f"{len(params)} params")
    if not params:
        return
    if set(map(type, steps)) != {int}:  # the common case, a list of ints, in one C pass
        steps = [_step_number("adamw_step_many", f"steps[{i}]", s) for i, s in enumerate(steps)]
    device = params[0].device
    maxes = list(max_exp_avg_sqs) if amsgrad else []
    plainly_valid = not validate or (
        _plainly_valid(device, params, grads, exp_avgs, exp_avg_sqs,
                       *([maxes] if amsgrad else [])) and min(steps) >= 1)
    for i, p in enumerate(params if not plainly_valid else ()):
        if p.device != device:
            raise ValueError(f"adamw_step_many: params[{i}] is on {p.device}, params[0] on "
                             f"{device}; all must share a device")
        _check_adamw(f"adamw_step_many (tensor {i})", p, grads[i], exp_avgs[i], exp_avg_sqs[i],
                     max_exp_avg_sqs[i] if amsgrad else None, amsgrad, None, None, None)
        if steps[i] < 1:
            raise ValueError(f"adamw_step_many: steps[{i}]={steps[i]}; steps count from 1")
    _check_scalar_tensor("adamw_step_many", "grad_scale", grad_scale, device)
    _check_scalar_tensor("adamw_step_many", "found_inf", found_inf, device)
    if validate:
        _check_many_unshared(params, grads, exp_avgs, exp_avg_sqs, maxes,
                             grads_written=grad_scale is not None)
    _check_hyper("adamw_step_many", lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay)
    hyper = dict(lr=float(lr), beta1=float(beta1), beta2=float(beta2), eps=float(eps),
                 weight_decay=float(weight_decay), maximize=bool(maximize),
                 amsgrad=bool(amsgrad))
    if backend_for(*params) == "triton":
        # float64 tensors take torch's ops (the kernels compute in fp32), the rest Triton
        kept = [i for i, p in enumerate(params) if _triton_ok(p)]
        doubles = [i for i, p in enumerate(params) if not _triton_ok(p)]
        if kept:
            from shardkit.kernels import triton_optim
            triton_optim.adamw_many(*_pick(kept, params, grads, exp_avgs, exp_avg_sqs, maxes),
                                    steps=[steps[i] for i in kept], decoupled=decoupled,
                                    grad_scale=grad_scale, found_inf=found_inf, **hyper)
        if not doubles:
            return
        params, grads, exp_avgs, exp_avg_sqs, maxes = _pick(doubles, params, grads, exp_avgs,
                                                            exp_avg_sqs, maxes)
        steps = [steps[i] for i in doubles]
    _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, maxes, steps, decoupled=decoupled,
                 grad_scale=grad_scale, found_inf=found_inf, **hyper)


def _check_many_unshared(params, grads, exp_avgs, exp_avg_sqs, maxes, grads_written) -> None:
    """:func:`_check_no_shared_memory` over the lists of :func:`adamw_step_many` (the
    gradients are written back too when a ``grad_scale`` unscales them)."""
    named = (("params", params), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
             ("max_exp_avg_sqs", maxes))
    gradients = [(f"grads[{i}]", g) for i, g in enumerate(grads)]
    written = [(f"{key}[{i}]", t) for key, values in named for i, t in enumerate(values)]
    _check_no_shared_memory("adamw_step_many", written + (gradients if grads_written else []),
                            [] if grads_written else gradients)


def _pick(indices, *lists):
    """The entries ``indices`` of each list (an empty list stays empty)."""
    return tuple([seq[i] for i in indices] if seq else [] for seq in lists)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor],
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False,
             first_step: bool = False, grad_scale: Optional[torch.Tensor] = None,
             found_inf: Optional[torch.Tensor] = None) -> None:
    """One SGD step (torch.optim.SGD semantics), in place. ``first_step``: the momentum buffer
    is initialised to the gradient, as torch does on a parameter's first step.

    Memory traffic: 12 B per fp32 parameter without momentum, 20 with. No communication.
    """
    _check_flat("sgd_step", "param", param, param, same_dtype=True)
    _check_flat("sgd_step", "grad", grad, param, same_dtype=False)
    if momentum:
        if momentum_buffer is None:
            raise ValueError(f"sgd_step: momentum={momentum} needs momentum_buffer")
        _check_flat("sgd_step", "momentum_buffer", momentum_buffer, param, same_dtype=True)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"sgd_step: nesterov=True needs momentum > 0 and dampening == 0; got "
                         f"momentum={momentum}, dampening={dampening}")
    _check_hyper("sgd_step", lr, momentum=momentum, weight_decay=weight_decay)
    _check_scalar_tensor("sgd_step", "grad_scale", grad_scale, param.device)
    _check_scalar_tensor("sgd_step", "found_inf", found_inf, param.device)
    gradient = [("grad", grad)]
    _check_no_shared_memory(
        "sgd_step",
        [("param", param), ("momentum_buffer", momentum_buffer if momentum else None)]
        + (gradient if grad_scale is not None else []),
        gradient if grad_scale is None else [])
    hyper = dict(lr=float(lr), momentum=float(momentum), dampening=float(dampening),
                 weight_decay=float(weight_decay), nesterov=bool(nesterov),
                 maximize=bool(maximize))
    if backend_for(param, grad) == "triton" and _triton_ok(param):
        from shardkit.kernels import triton_optim
        triton_optim.sgd(param, grad, momentum_buffer if momentum else None,
                         first_step=first_step, grad_scale=grad_scale, found_inf=found_inf,
                         **hyper)
        return
    # torch's CPU fused SGD (2.13) updates fp16/bf16 buffers wrongly (momentum and weight
    # decay): 16-bit parameters on CPU, like mixed dtypes (see _needs_fp32), go through fp32
    # copies, which is the Triton kernel's arithmetic, rounded once.
    widen = _needs_fp32(param, grad) or (param.dtype in _LOW and param.device.type == "cpu")
    originals = [param] + ([momentum_buffer] if momentum else [])
    work = [t.float() for t in originals] if widen else originals
    g = grad.float() if widen else grad if grad.dtype == param.dtype else grad.to(param.dtype)
    torch._fused_sgd_(work[:1], [g], work[1:], is_first_step=bool(first_step),
                      grad_scale=grad_scale, found_inf=found_inf, **hyper)
    if widen:
        for original, copy in zip(originals, work):
            original.copy_(copy)
    if grad_scale is not None and g is not grad:
        grad.copy_(g)
