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
    - ``DeepSpeedCPUAdam`` keeps fp64 parameters' moments in fp64 (DeepSpeed's kernel takes
      fp32, fp16 and bf16 parameters only).
"""

from __future__ import annotations

import math

import torch

from shardkit.kernels import adamw_step_many
from shardkit.optim.fused import (FusedAdamW, _bind_to_views, _by_device_dtype,
                                  _check_state_shape, _FlatState, _params_by_index)

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# elements of 16-bit parameters widened to fp32 at a time: two fp32 copies (parameter and
# gradient) of 16 MiB each, however large the parameters
_WIDEN_TILE = 1 << 22


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
        except (ValueError, RuntimeError):
            self.param_groups.pop()
            raise

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
        if params[0].dtype == exp_avgs[0].dtype:
            self._update_alike(group, params, grads, exp_avgs, exp_avg_sqs, steps)
            return
        # 16-bit parameters over fp32 moments (DeepSpeedCPUAdam's fp32_optimizer_states): as
        # DeepSpeed's kernel, the update runs in fp32 from the parameter and gradient, and the
        # parameter is rounded back to its dtype once
        for tile in _tiles(params, grads, exp_avgs, exp_avg_sqs, steps):
            self._update_widened(group, *tile)

    def _update_widened(self, group, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        """One tile of 16-bit ``params``: updated through fp32 copies of them and of their
        gradients, rounded back. A function of its own so that the copies are gone when it
        returns (a loop variable would keep the last one alive through the next tile)."""
        wide = [p.float() for p in params]
        self._update_alike(group, wide, [g.float() for g in grads], exp_avgs, exp_avg_sqs,
                           steps)
        for p, p32 in zip(params, wide):
            p.copy_(p32)

    def _update_alike(self, group, params, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        """The update of parameters whose moments have their dtype (gradients may differ)."""
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
            wide = torch.float32 if p.dtype in _SIXTEEN_BIT else p.dtype
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

    ``fp32_optimizer_states=True`` (kept per param group): fp16/bf16 parameters get fp32
    moments, as DeepSpeed's; each step computes the update in fp32 from the 16-bit parameter
    and gradient and writes the parameter back rounded to its dtype (there is no fp32 master
    copy of the parameter). ``state_dict`` / ``load_state_dict`` keep these moments fp32
    (torch's loader would cast them to the parameter's dtype). ``False``: the moments have
    the parameters' dtype.

    Raises:
        RuntimeError: ``amsgrad=True`` (DeepSpeed ignores it and runs Adam).
        ValueError: bad hyper-parameters (as :class:`FusedAdam`), or ``fp32_optimizer_states``
            not a bool.

    Memory: 8 bytes of state per fp32 parameter (two moments), and per fp16/bf16 parameter
    with ``fp32_optimizer_states`` (4 without); a 16-bit parameter's step also widens it and
    its gradient to fp32 a tile at a time (at most 32 MiB more while it runs). No
    communication.
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

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's (see :class:`FusedAdam`), the fp32 moments of fp16/bf16 parameters loaded
        as saved: torch's loader casts each moment to its parameter's dtype, and the
        rounded moments put back into fp32 buffers would change every later step."""
        super().load_state_dict(state_dict)
        by_index = _params_by_index(state_dict["param_groups"], self.param_groups)
        for index, saved in state_dict["state"].items():
            p = by_index.get(index)
            live = self.state.get(p) if p is not None else None
            if not live:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                value, now = saved.get(key), live.get(key)
                widened = isinstance(now, torch.Tensor) and now.dtype != p.dtype
                if widened and isinstance(value, torch.Tensor) and value.shape == now.shape:
                    now.copy_(value)  # the flat buffer's view: the saved value, unrounded

    def _flat_states(self, index: int, group: dict):
        # the buffers' dtype follows the group's fp32_optimizer_states: set by hand (or by a
        # loaded group) after a step, the buffers are rebuilt, the moments cast into them
        cached = self._flat.get(index)
        if cached and any(f.state_dtype != _state_dtype(group, f.dtype) for f in cached[1]):
            del self._flat[index]
        return super()._flat_states(index, group)

    def _build_flat_states(self, group: dict, stepped: list) -> list[_FlatState]:
        """FusedAdamW's flat buffers (one per device and dtype of ``stepped``), in the
        group's state dtype (:func:`_state_dtype`); existing state is moved into them."""
        flats = []
        for (device, dtype), params in _by_device_dtype(stepped).items():
            total = sum(p.numel() for p in params)
            buffers = {key: torch.zeros(total, dtype=_state_dtype(group, dtype), device=device)
                       for key in ("exp_avg", "exp_avg_sq")}
            flat = _WideFlatState(params, buffers)
            for i, p in enumerate(params):
                state = self.state.get(p)
                if not state:
                    continue
                for key, value in state.items():
                    _check_state_shape(p, key, value)
                _bind_to_views(state, flat.views, i)
            flats.append(flat)
        return flats


class _WideFlatState(_FlatState):
    """A :class:`~shardkit.optim.fused._FlatState` whose buffers may be wider than its
    parameters (fp32 moments of fp16/bf16 parameters): ``dtype`` is the parameters' (what
    ``outdated`` and the merging of later-stepped parameters compare), ``state_dtype`` the
    buffers'."""

    def __post_init__(self):
        super().__post_init__()
        self.state_dtype = self.dtype
        self.dtype = self.params[0].dtype


def _state_dtype(group: dict, param_dtype: torch.dtype) -> torch.dtype:
    """The moments' dtype for parameters of ``param_dtype`` in ``group``: fp32 for fp16/bf16
    ones under ``fp32_optimizer_states`` (as DeepSpeed), else the parameters' own."""
    if param_dtype in _SIXTEEN_BIT and group.get("fp32_optimizer_states", True):
        return torch.float32
    return param_dtype


def _tiles(params, grads, exp_avgs, exp_avg_sqs, steps):
    """``(params, grads, exp_avgs, exp_avg_sqs, steps)`` lists of flat pieces of the given
    contiguous tensors, at most :data:`_WIDEN_TILE` elements per yield (a large tensor split
    over several, small ones packed together); each piece of tensor ``i`` has ``steps[i]``.
    Every element is updated on its own, so a piece steps as its tensor would."""
    tile, size = [[], [], [], [], []], 0
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        flat = [t.view(-1) for t in (p, g, m, v)]
        for start in range(0, p.numel(), _WIDEN_TILE):
            pieces = [t[start:start + _WIDEN_TILE] for t in flat]
            if size and size + pieces[0].numel() > _WIDEN_TILE:
                yield tile
                tile, size = [[], [], [], [], []], 0
            for entries, piece in zip(tile, pieces + [step]):
                entries.append(piece)
            size += pieces[0].numel()
    if size:
        yield tile


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
    for key in ("bias_correction", "adam_w_mode", "adamw_mode", "set_grad_none",
                "fp32_optimizer_states"):
        if key in group and not isinstance(group[key], bool):
            raise ValueError(f"{name}({key}={group[key]!r}): expected True or False")
