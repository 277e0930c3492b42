"""ShardedGradScaler: ``torch.amp.GradScaler`` whose inf/nan decision spans every rank.

With sharded gradients (OSS, ShardedDataParallel, FSDP) each rank inspects only the gradients
it holds, so one rank may see an overflow that the others do not. Left alone, that rank would
skip ``optimizer.step()`` while the others step and then wait in OSS's parameter sync: wrong
weights or a hang. This scaler combines the found-inf flags with one all-reduce (MAX) over
the process group, so all ranks skip together and back the scale off together.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from shardkit import distributed as skdist

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling (``torch.amp.GradScaler`` semantics) for sharded training.

    Args:
        device: device of the scale, ``"cuda"`` or ``"cpu"`` (default: ``"cuda"`` when CUDA is
            available, else ``"cpu"``); as ``torch.amp.GradScaler``.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        process_group: ranks whose inf/nan checks are combined (default: the default group).

    ``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``/``load_state_dict`` behave as
    torch's; a rank that holds no gradient of an optimizer (a non-owner under ShardedDDP)
    still takes part and skips or steps with the others.

    Cost: memory, two scalars; communication, one all-reduce of one float32 per
    ``unscale_``/``step`` per optimizer.

    Usage::

        scaler = ShardedGradScaler()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(optimizer)        # skipped on every rank if any rank saw inf/nan
        scaler.update()

    .. warning:: ``unscale_``/``step`` issue a collective: call them on every rank, for the
        same optimizers in the same order.
    """

    def __init__(self, device: Optional[Union[str, torch.device]] = None,
                 init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
                 process_group=None):
        device = _device_name(device)
        _check_positive("init_scale", init_scale)
        _check_positive("growth_interval", growth_interval)
        if enabled and not growth_factor > 1.0:
            raise ValueError(f"ShardedGradScaler(growth_factor={growth_factor!r}): must be > 1.0")
        if enabled and not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"ShardedGradScaler(backoff_factor={backoff_factor!r}): must be in "
                             f"(0, 1)")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        return self._found_inf_on_any_rank(per_device, found_inf.device)

    def _found_inf_on_any_rank(self, per_device: dict, scale_device: torch.device) -> dict:
        """One flag: 1.0 if any device of any rank found inf/nan. Returned for every device
        this rank checked (or the scale's device when it checked none)."""
        flag = torch.zeros((), dtype=torch.float32, device=scale_device)
        for found in per_device.values():
            flag = torch.maximum(flag, found.to(scale_device))
        if skdist.is_initialized() and skdist.get_world_size(self.process_group) > 1:
            skdist.all_reduce(flag, op=skdist.ReduceOp.MAX, group=self.process_group)
        devices = list(per_device) or [scale_device]
        return {d: flag.to(d) for d in devices}


def _device_name(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return torch.device(device).type
    raise TypeError(f"ShardedGradScaler(device={device!r}): expected 'cuda', 'cpu' or a "
                    f"torch.device (torch.amp's order: device first; pass init_scale= by keyword)")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"ShardedGradScaler({name}={value!r}): must be a positive number")
