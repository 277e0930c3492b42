"""DeepSpeed's ``deepspeed.ops.adam``: :class:`FusedAdam` and :class:`DeepSpeedCPUAdam`.

Both take DeepSpeed's constructor arguments and keep its update rules: ``adam_w_mode`` /
``adamw_mode`` true (the default) decays the weights decoupled from the gradient, as
``torch.optim.AdamW`` does; false adds ``weight_decay * p`` to the gradient (L2), as
``torch.optim.Adam`` does; ``bias_correction=False`` leaves the moments uncorrected. The step is
:class:`shardkit.optim.FusedAdamW`'s (flat state buffers per param group; one kernel launch
through :mod:`shardkit.kernels`: Triton on CUDA, torch's fused Adam/AdamW on CPU); with
``bias_correction=False`` it is plain torch arithmetic on the same buffers. State dicts have
torch's Adam format (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter).

Both update each element on its own, so :func:`shardkit.initialize` takes them at every ZeRO
stage (stages 1-2: OSS rebuilds the same class over each rank's parameters, the
hyper-parameters kept per group; stage 3: they step FSDP's row shards). Nothing here
communicates.

Differences from DeepSpeed:
    - ``amsgrad=True`` is a RuntimeError for both (DeepSpeed's FusedAdam refuses it; its CPU
      Adam accepts it and runs plain Adam).
    - ``DeepSpeedCPUAdam`` also steps parameters on CUDA (DeepSpeed asserts they are on the
      CPU, i.e. that ``offload_optimizer`` is on); ``FusedAdam`` also steps CPU parameters.
    - ``DeepSpeedCPUAdam(fp32_optimizer_states=True)`` (the default) over fp16/bf16 parameters
      is a ValueError: shardkit keeps the moments in the parameters' dtype. Give it fp32
      parameters (shardkit's ``fp16`` / ``bf16`` configs keep fp32 master weights, so models
      passed to ``initialize`` are fp32) or pass ``fp32_optimizer_states=False``.
"""

from __future__ import annotations

import math

import torch

from shardkit.kernels import adamw_step_many
from shardkit.optim.fused import FusedAdamW

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


class _DeepSpeedAdam(FusedAdamW):
    """The shared body: DeepSpeed's hyper-parameters on FusedAdamW's flat state. ``_MODE`` is
    the constructor's (and param groups') name of the decoupled-decay switch."""

    _MODE = "adam_w_mode"

    def _setup(self, params, defaults: dict) -> None:
        _check(type(self).__name__, defaults)
        self._flat = {}
        torch.optim.Optimizer.__init__(self, params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch), its hyper-parameters checked as the constructor's are."""
        torch.optim.Optimizer.add_param_group(self, param_group)
        added = self.param_groups[-1]
        try:
            _check(type(self).__name__, added)
            self._check_params(added)
        except (ValueError, RuntimeError):
            self.param_groups.pop()
            raise

    def _check_params(self, group: dict) -> None:
        """Per-class checks of a group's parameters (none here)."""

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict replaces each group by the saved one: a torch Adam/AdamW
        # state dict (or the other class's, adamw_mode vs adam_w_mode) lacks DeepSpeed's keys,
        # which then come from this optimizer's constructor, as torch's own optimizers do
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with each saved group's hyper-parameters checked as the constructor's are
        (``amsgrad=True``, which this step would ignore, is refused) before anything changes."""
        for saved in state_dict.get("param_groups", []):
            _check(type(self).__name__, {**self.defaults, **saved})
        super().load_state_dict(state_dict)

    def zero_grad(self, set_to_none=None) -> None:
        """DeepSpeed's ``zero_grad()``: gradients become ``None`` when the group's
        ``set_grad_none`` is true (the default), else zeros; an explicit ``set_to_none``
        decides for every group."""
        for group in self.param_groups:
            none = group.get("set_grad_none", True) if set_to_none is None else set_to_none
            for p in group["params"]:
                if p.grad is None:
                    continue
                if none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def _update(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                steps) -> None:
        decoupled = bool(group[self._MODE])
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            adamw_step_many(params, grads, exp_avgs, exp_avg_sqs, steps=steps, lr=group["lr"],
                            beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"], decoupled=decoupled,
                            validate=False)
            return
        lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            # fp16/bf16 computed in fp32, as DeepSpeed's kernel: in fp16, eps=1e-8 rounds to 0
            # and an element with a zero gradient became 0/0 = NaN (fp32/fp64: no copies)
            wide = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
            p32, m32, v32, g = p.to(wide), m.to(wide), v.to(wide), g.to(wide)
            if decay and decoupled:
                p32.mul_(1.0 - lr * decay)
            elif decay:
                g = g.add(p32, alpha=decay)
            m32.lerp_(g, 1.0 - beta1)
            v32.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            p32.addcdiv_(m32, v32.sqrt().add_(eps), value=-lr)
            for low, high in ((p, p32), (m, m32), (v, v32)):
                if low is not high:
                    low.copy_(high)


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)``.

    ``adam_w_mode=True``: ``torch.optim.AdamW``'s update; ``False``: ``torch.optim.Adam``'s
    (``weight_decay`` as L2 on the gradient). ``set_grad_none``: ``zero_grad()`` sets the
    gradients to ``None`` (else zeros them). Every hyper-parameter is kept per param group.
    Memory: 8 bytes of state per fp32 parameter; no communication.

    Raises:
        RuntimeError: ``amsgrad=True`` (as DeepSpeed).
        ValueError: ``lr`` < 0, ``betas`` not two numbers in [0, 1), ``eps`` <= 0 or
            ``weight_decay`` < 0, naming the argument.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        self._setup(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                 adam_w_mode=adam_w_mode, weight_decay=weight_decay,
                                 amsgrad=amsgrad, set_grad_none=set_grad_none))


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
    fp32_optimizer_states=True)``: the same update as :class:`FusedAdam` (``adamw_mode`` is
    its ``adam_w_mode``), on whatever device the parameters are.

    Raises:
        RuntimeError: ``amsgrad=True`` (DeepSpeed ignores it and runs Adam).
        ValueError: bad hyper-parameters (as :class:`FusedAdam`), or fp16/bf16 parameters with
            ``fp32_optimizer_states=True`` (the moments here follow the parameters' dtype).

    Memory: 8 bytes of state per fp32 parameter (two moments); no communication.
    """

    _MODE = "adamw_mode"

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True):
        self._setup(model_params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                       eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                       adamw_mode=adamw_mode,
                                       fp32_optimizer_states=fp32_optimizer_states))

    def _check_params(self, group: dict) -> None:
        if not isinstance(group["fp32_optimizer_states"], bool):
            raise ValueError(f"DeepSpeedCPUAdam: fp32_optimizer_states="
                             f"{group['fp32_optimizer_states']!r}; expected True or False")
        if group["fp32_optimizer_states"]:
            for p in group["params"]:
                if p.dtype in (torch.float16, torch.bfloat16):
                    raise ValueError(
                        f"DeepSpeedCPUAdam(fp32_optimizer_states=True): a parameter of shape "
                        f"{tuple(p.shape)} is {p.dtype}, and shardkit keeps the moments in "
                        f"the parameters' dtype; pass fp32 parameters (shardkit's fp16/bf16 "
                        f"configs keep fp32 master weights) or fp32_optimizer_states=False")


def _check(name: str, group: dict) -> None:
    """DeepSpeed's hyper-parameters of one group, checked before anything is built."""
    if group.get("amsgrad"):
        raise RuntimeError(f"{name}(amsgrad={group['amsgrad']!r}): the AMSGrad variant is not "
                           f"supported (DeepSpeed's FusedAdam refuses it; its CPU Adam ignores "
                           f"it); use torch.optim.Adam(amsgrad=True) or amsgrad=False")
    lr = group["lr"]
    if isinstance(lr, (bool, torch.Tensor)) or not isinstance(lr, (int, float)) \
            or not lr >= 0 or not math.isfinite(lr):
        raise ValueError(f"{name}(lr={lr!r}): expected a finite number >= 0")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
            for b in betas):
        raise ValueError(f"{name}(betas={betas!r}): expected two numbers in [0, 1)")
    group["betas"] = tuple(betas)
    eps = group["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0 \
            or not math.isfinite(eps):
        raise ValueError(f"{name}(eps={eps!r}): expected a finite number > 0")
    decay = group["weight_decay"]
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not decay >= 0 \
            or not math.isfinite(decay):
        raise ValueError(f"{name}(weight_decay={decay!r}): expected a finite number >= 0")
    for key in ("bias_correction", "adam_w_mode", "adamw_mode", "set_grad_none"):
        if key in group and not isinstance(group[key], bool):
            raise ValueError(f"{name}({key}={group[key]!r}): expected True or False")
