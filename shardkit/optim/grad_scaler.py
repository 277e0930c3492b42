"""ShardedGradScaler: ``torch.amp.GradScaler`` whose inf/nan decision spans every rank.

With sharded gradients (OSS, ShardedDataParallel, FSDP) each rank inspects only the gradients
it holds, so one rank may see an overflow that the others do not. Left alone, that rank would
skip ``optimizer.step()`` while the others step and then wait in OSS's parameter sync: wrong
weights or a hang. This scaler combines the found-inf flags with one all-reduce (MAX) over
the process group, so all ranks skip together and back the scale off together.
"""

from __future__ import annotations

import math

import torch

from shardkit import distributed as skdist
from shardkit.optim.oss import OSS, STEPPED_WITH_SCALED_GRADS

__all__ = ["GradScaler", "ShardedGradScaler"]


class GradScaler(torch.amp.GradScaler):
    """FairScale's ``fairscale.optim.GradScaler``: torch's scaler that also unscales 16-bit
    gradients (pure fp16 training; torch's refuses them), for one process or replicated
    gradients (torch DDP).

    Given an :class:`~shardkit.optim.OSS` over several ranks (``unscale_`` / ``step``), it
    combines the inf/nan flags over the OSS's group as :class:`ShardedGradScaler` does, so
    that under ``ShardedDataParallel`` (or DDP's ``reduce_to_owners_hook``), where each rank
    holds only the gradients it owns, an overflow in one owner's shard skips the step and
    backs the scale off on every rank (for torch's own scaler ``OSS.step`` corrects the
    scaler's record after one more all-reduce). Every rank must then call ``unscale_`` /
    ``step`` for that OSS, as its step requires anyway.

    Args: FairScale's (and ``torch.cuda.amp.GradScaler``'s) order, ``init_scale`` first
    (defaults 2**16, 2.0, 0.5, 2000, True); ``device`` by name only (default ``"cuda"`` when
    CUDA is available, else ``"cpu"``, where FairScale's would disable itself).

    Communication: with an OSS over several ranks, one all-reduce of one float32 per
    ``unscale_`` / ``step``, which takes the place of the one ``OSS.step`` would make (no
    more collectives than torch's scaler); none otherwise.
    """

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, *, device=None):
        if not isinstance(enabled, bool):
            raise TypeError(f"GradScaler(enabled={enabled!r}): expected True or False")
        _check_positive("init_scale", init_scale, "GradScaler")
        _check_positive_int("growth_interval", growth_interval, "GradScaler")
        _check_number("growth_factor", growth_factor, "GradScaler")
        _check_number("backoff_factor", backoff_factor, "GradScaler")
        if enabled and not growth_factor > 1.0:
            raise ValueError(f"GradScaler(growth_factor={growth_factor!r}): must be a finite "
                             f"number > 1.0")
        if enabled and not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler(backoff_factor={backoff_factor!r}): must be in (0, 1)")
        super().__init__(_device_name(device, "GradScaler"), init_scale=init_scale,
                         growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if not isinstance(optimizer, OSS) or optimizer.world_size == 1:
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        return _unscale_agreed_over(self, optimizer, inv_scale, found_inf, optimizer.group)


def _unscale_agreed_over(scaler: torch.amp.GradScaler, optimizer, inv_scale, found_inf,
                         group) -> dict:
    """torch's unscale of ``optimizer``'s gradients (16-bit ones too), then its inf/nan flags
    combined over ``group`` (one all-reduce of one float32): the per-device flags the scaler
    records, alike on every rank. An OSS is told, so its step does not combine them again."""
    if getattr(optimizer, "_stepped_in_backward", None) is not None:
        # before the collective: every rank of such an OSS stepped in the same backward
        raise RuntimeError(f"{type(scaler).__name__}: " + STEPPED_WITH_SCALED_GRADS)
    per_device = torch.amp.GradScaler._unscale_grads_(scaler, optimizer, inv_scale, found_inf,
                                                      True)
    agreed = _found_inf_on_any_rank(per_device, found_inf.device, group)
    if isinstance(optimizer, OSS):
        optimizer._found_inf_agreed_over(group)
    return agreed


def _found_inf_on_any_rank(per_device: dict, scale_device: torch.device, group) -> dict:
    """One flag: 1.0 if any device of any rank of ``group`` found inf/nan. Returned for every
    device this rank checked (or the scale's device when it checked none)."""
    flag = torch.zeros((), dtype=torch.float32, device=scale_device)
    for found in per_device.values():
        flag = torch.maximum(flag, found.to(scale_device))
    if skdist.is_initialized() and skdist.get_world_size(group) > 1:
        skdist.all_reduce(flag, op=skdist.ReduceOp.MAX, group=group)
    devices = list(per_device) or [scale_device]
    return {d: flag.to(d) for d in devices}


class ShardedGradScaler(torch.amp.GradScaler):
    """Dynamic loss scaling (``torch.amp.GradScaler`` semantics) for sharded training.

    Args (positional in torch's order, ``device`` first, or in FairScale's, ``init_scale``
    first: a number as the first positional argument means FairScale's order):
        device: device of the scale, ``"cuda"`` or ``"cpu"`` (default: ``"cuda"`` when CUDA is
            available, else ``"cpu"``); as ``torch.amp.GradScaler``.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler`` (defaults 2**16, 2.0, 0.5, 2000, True).
        process_group: ranks whose inf/nan checks are combined (default: the default group).

    Unlike torch's scaler and like FairScale's, 16-bit gradients may be unscaled (pure fp16
    training, e.g. an FSDP model cast with ``.half()``): they are unscaled in place, in their
    own dtype.

    ``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``/``load_state_dict`` behave as
    torch's; a rank that holds no gradient of an optimizer (a non-owner under ShardedDDP)
    still takes part and skips or steps with the others. An OSS that
    ``ShardedDataParallel(step_in_backward=True)`` already stepped during backward is refused
    (a RuntimeError before any collective): its step can be neither unscaled nor skipped.

    Cost: memory, two scalars; communication, one all-reduce of one float32 per
    ``unscale_``/``step`` per optimizer.

    torch's own ``torch.amp.GradScaler`` checks only the gradients a rank holds. With
    :class:`~shardkit.optim.OSS` it still skips and backs off alike on every rank: OSS
    combines the flags itself (one more all-reduce of one element per step) and, when only
    some ranks saw inf/nan (under ``ShardedDataParallel`` each rank holds only the gradients
    it owns), writes the agreed finding into the calling scaler's record for its
    ``update()``. ``FullyShardedDataParallel`` carries an overflow in any rank's gradients of a
    unit, or one its fp16 reduce-scatter makes, into every rank's shard of it, so torch's
    scaler agrees there too; this class works with it as well (its all-reduce then only
    confirms). A gradient made inf by hand after ``backward`` on some ranks only is seen by
    this class alone.

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

    def __init__(self, *args, **kwargs):
        options = {**_DEFAULTS, **_named_arguments(args, kwargs)}
        device = _device_name(options["device"])
        init_scale, growth_factor = options["init_scale"], options["growth_factor"]
        backoff_factor, growth_interval = options["backoff_factor"], options["growth_interval"]
        enabled = options["enabled"]
        skdist.check_group(options["process_group"], "ShardedGradScaler", "process_group")
        if not isinstance(enabled, bool):
            raise TypeError(f"ShardedGradScaler(enabled={enabled!r}): expected True or False")
        _check_positive("init_scale", init_scale)
        _check_positive_int("growth_interval", growth_interval)
        _check_number("growth_factor", growth_factor)
        _check_number("backoff_factor", backoff_factor)
        if enabled and not growth_factor > 1.0:
            raise ValueError(f"ShardedGradScaler(growth_factor={growth_factor!r}): must be a "
                             f"finite number > 1.0")
        if enabled and not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"ShardedGradScaler(backoff_factor={backoff_factor!r}): must be in "
                             f"(0, 1)")
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = options["process_group"]

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # FairScale's scaler unscales fp16 gradients too (torch's refuses them)
        return _unscale_agreed_over(self, optimizer, inv_scale, found_inf, self.process_group)


_TORCH_ORDER = ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval",
                "enabled", "process_group")
_DEFAULTS = {"device": None, "init_scale": 2.0 ** 16, "growth_factor": 2.0,
             "backoff_factor": 0.5, "growth_interval": 2000, "enabled": True,
             "process_group": None}


def _named_arguments(args: tuple, kwargs: dict) -> dict:
    """The constructor's arguments by name: positional ones in torch's order (``device``
    first), or in FairScale's (``init_scale`` first) when the first one is a number."""
    fairscale_order = bool(args) and isinstance(args[0], (int, float)) and \
        not isinstance(args[0], bool)
    order = _TORCH_ORDER[1:] if fairscale_order else _TORCH_ORDER
    if len(args) > len(order):
        raise TypeError(f"ShardedGradScaler takes at most {len(order)} positional arguments "
                        f"({', '.join(order)}), got {len(args)}")
    named = dict(zip(order, args))
    for name, value in kwargs.items():
        if name not in _DEFAULTS:
            raise TypeError(f"ShardedGradScaler({name}=...): unknown argument; valid ones are "
                            f"{', '.join(_TORCH_ORDER)}")
        if name in named:
            raise TypeError(f"ShardedGradScaler: {name} given both by position and by name")
        named[name] = value
    return named


def _device_name(device, owner: str = "ShardedGradScaler") -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return torch.device(device).type
    note = (" (positionally, a number first means FairScale's order: init_scale first)"
            if owner == "ShardedGradScaler" else "")
    raise TypeError(f"{owner}(device={device!r}): expected 'cuda', 'cpu' or a "
                    f"torch.device{note}")


def _check_number(name: str, value, owner: str = "ShardedGradScaler") -> None:
    """A finite int or float (not a bool): torch's scaler would take an inf or a string here
    and fail, or scale by inf, only at the first ``update()``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value):
        raise ValueError(f"{owner}({name}={value!r}): must be a finite number")


def _check_positive(name: str, value, owner: str = "ShardedGradScaler") -> None:
    _check_number(name, value, owner)
    if not value > 0:
        raise ValueError(f"{owner}({name}={value!r}): must be a finite number > 0")


def _check_positive_int(name: str, value, owner: str = "ShardedGradScaler") -> None:
    # torch's update() passes growth_interval to an op that takes an int only
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}={value!r}): must be an integer >= 1")
