"""DeepSpeed's memory controls between training and generation (RLHF loops), as
:class:`OffloadStates` mixed into :class:`shardkit.engine.ShardedEngine`:
``empty_partition_cache()``, ``offload_states()`` (this rank's optimizer state to host memory,
every argument checked before anything moves) and ``reload_states()``. Local, no communication;
memory: the moved state's device bytes are released until the reload.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from shardkit.optim.master_weights import MASTER_WEIGHT_KEY

logger = logging.getLogger("shardkit")


# DeepSpeed's OffloadStateTypeEnum values (what each means here: ShardedEngine.offload_states)
OFFLOAD_STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads",
                       "contiguous_grad_buffer")


def _check_flag(call: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"engine.{call}({name}={value!r}): expected True or False")


def _enum_value(value):
    """A DeepSpeed ``str`` enum member (``OffloadDeviceEnum.cpu``) or a plain string, as the
    string."""
    return getattr(value, "value", value)


def _offload_request(include, device, pin_memory, non_blocking) -> Optional[tuple]:
    """The states ``offload_states`` is asked to move (``None``: ``device='none'``, nothing
    to move), every argument checked before anything moves."""
    _check_flag("offload_states", "pin_memory", pin_memory)
    _check_flag("offload_states", "non_blocking", non_blocking)
    device = _enum_value(device)
    if device == "nvme":
        raise ValueError("engine.offload_states(device='nvme'): NVMe is not supported for "
                         "offloading states (as in DeepSpeed); use device='cpu'")
    if device not in ("cpu", "none"):
        raise ValueError(f"engine.offload_states(device={device!r}): valid devices are "
                         f"'cpu' (or OffloadDeviceEnum.cpu) and 'none'")
    if include is None:
        names = OFFLOAD_STATE_TYPES
    elif isinstance(include, (str, bytes)) or not hasattr(include, "__iter__"):
        raise ValueError(f"engine.offload_states(include={include!r}): expected None or a "
                         f"collection of state names, e.g. ['optim_states']")
    else:
        names = tuple(str(_enum_value(name)) for name in include)
    unknown = [n for n in names if n not in OFFLOAD_STATE_TYPES]
    if unknown:
        raise ValueError(f"engine.offload_states(include={list(names)!r}): unknown state(s) "
                         f"{unknown}; DeepSpeed's names are {list(OFFLOAD_STATE_TYPES)}")
    return None if device == "none" else names


def _release_flat_state_buffers(optimizer) -> None:
    """Drop the flat buffers of a :class:`~shardkit.optim.fused.FusedAdamW` (also DeepSpeed's
    ``FusedAdam``, and the one inside OSS) whose ``state`` was just replaced by host copies.
    Its ``state[p]`` tensors are views into those buffers: without this, the buffers keep the
    whole device state alive while it is "offloaded". Its next step rebuilds them from
    ``state`` (the tensors :meth:`~shardkit.engine.ShardedEngine.reload_states` put back), as after
    a ``load_state_dict``. Local."""
    from shardkit.optim.fused import FusedAdamW
    inner = getattr(optimizer, "optim", optimizer)  # OSS: the local shard's optimizer
    if isinstance(inner, FusedAdamW):
        inner._flat.clear()


def _to_host(tensor: torch.Tensor, pin_memory: bool, non_blocking: bool) -> torch.Tensor:
    """``tensor`` in host memory (itself when it is there already), pinned when asked and
    CUDA can pin."""
    if tensor.device.type == "cpu":
        return tensor
    pin = pin_memory and torch.cuda.is_available()
    host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
    host.copy_(tensor, non_blocking=non_blocking)
    return host


class OffloadStates:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.optimizer``,
    ``self.wrapped``, ``self.composition``, ``self._offloaded_optimizer_state`` and the engine's
    ``_refuse_without_optimizer``."""

    def empty_partition_cache(self) -> None:
        """Free the parameters stage 3 holds gathered outside a step (DeepSpeed's call after
        generation): units a direct call under ``no_grad`` gathered (HF ``generate()`` on an
        encoder-decoder), and units kept since a forward that no backward followed. The next
        forward gathers them again. Stages 0-2 hold no gathered copies: nothing to free. Memory:
        each such unit's full parameters go (storage released). Local, no communication; call it
        on every rank between steps (during a backward it is a RuntimeError)."""
        if self.composition.stage == 3 and hasattr(self.wrapped, "reshard"):
            self.wrapped.reshard()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Move this rank's optimizer state to host memory until :meth:`reload_states`
        (DeepSpeed's call before an RLHF generation phase, whose memory it gives back; also
        reachable as ``engine.optimizer.offload_states``, where OpenRLHF calls it).

        ``include`` takes DeepSpeed's state names (``OffloadStateTypeEnum`` members or their
        strings; ``None``: all). What each means here:

        - ``"optim_states"``: the optimizer's state tensors (Adam's two moments, ``8Ψ/N``
          bytes at stages 1-3, ``8Ψ`` at stage 0) move to host memory; ``step()`` is refused
          until :meth:`reload_states`, on every rank as long as any rank holds its state
          offloaded. Forwards still run.
        - ``"hp_params"`` / ``"lp_params"``: shardkit keeps one copy of the weights, the fp32
          parameters, which are both DeepSpeed's master and compute weights (at stages 1-2 with
          fp16/bf16 the fp32 masters are the optimizer shard's and stay where they are, the 16-bit
          weights are the model's); those in host memory already (a CPU run) stay, and on an
          accelerator naming them is a ValueError (they are not moved: use
          ``zero_optimization.offload_param`` at stage 3, or leave them out of ``include``). With
          ``include=None`` the states that cannot move stay, with a warning naming them, and the
          optimizer state moves.
        - ``"lp_grads"``: ``step()`` frees the gradients, so between steps there are none; held
          on an accelerator (mid-accumulation) they are a ValueError.
        - ``"contiguous_grad_buffer"``: stage 3 holds no gradient buffer between steps; at
          stages 0-2 torch DDP's and ShardedDataParallel's reduce buckets stay allocated, so
          on an accelerator naming it there is a ValueError.

        ``device`` must be ``"cpu"`` (``"none"`` only warns, as in DeepSpeed; ``"nvme"`` is
        refused). Every argument is checked before anything moves. Memory: the moved state's
        device bytes are released (pinned host copies when ``pin_memory`` and CUDA). Local, no
        communication; call it on every rank, between steps."""
        self._refuse_without_optimizer("offload_states()")
        states = _offload_request(include, device, pin_memory, non_blocking)
        if states is None:
            logger.warning("engine.offload_states(device='none'): nothing was moved")
            return
        if include is None:  # DeepSpeed's "everything": what shardkit can move, and a word
            stuck = self._unmovable_states(states)
            if stuck:
                logger.warning("engine.offload_states(): %s stay on the device (see "
                               "ShardedEngine.offload_states); the optimizer state moves", stuck)
        else:
            self._refuse_unmovable_states(states)
        self.empty_partition_cache()
        if "optim_states" in states:
            self._offload_optimizer_state(pin_memory, non_blocking)

    def _unmovable_states(self, states: tuple) -> list:
        """The states of ``states`` that would stay on the accelerator (see
        :meth:`offload_states`). Local."""
        on_device = [p for p in self.wrapped.parameters() if p.device.type != "cpu"]
        stuck = [name for name in ("hp_params", "lp_params") if name in states and on_device]
        if "lp_grads" in states and any(p.grad is not None for p in on_device):
            stuck.append("lp_grads")
        if "contiguous_grad_buffer" in states and on_device and self.composition.stage < 3:
            stuck.append("contiguous_grad_buffer")
        return stuck

    def _refuse_unmovable_states(self, states: tuple) -> None:
        """A ValueError naming each state in ``states`` that would stay on the accelerator
        (see :meth:`offload_states`). Local; the same on every rank of a run whose ranks hold
        the same kind of device."""
        stuck = self._unmovable_states(states)
        if stuck:
            on_device = next(p for p in self.wrapped.parameters() if p.device.type != "cpu")
            raise ValueError(
                f"engine.offload_states(include={list(states)!r}): {stuck} cannot be moved off "
                f"{on_device.device}: shardkit's fp32 parameters are both the master and the "
                f"compute weights (no separate copy to offload), gradients are held only until "
                f"step(), and at stage {self.composition.stage} the gradient reduction's buckets "
                f"stay allocated; offload include=['optim_states'] (zero_optimization."
                f"offload_param moves stage 3's parameter shards to the CPU for good)")

    def _offload_optimizer_state(self, pin_memory: bool, non_blocking: bool) -> None:
        """Replace each optimizer state tensor by a host copy, remembering where it came from.
        Leaves ``_offloaded_optimizer_state`` a dict on every rank (empty on a rank whose
        shard holds no state yet), so that ``step()`` is refused on all ranks or none."""
        moved = self._offloaded_optimizer_state or {}
        copied = False
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if key == MASTER_WEIGHT_KEY:  # hp_params: see offload_states
                    continue
                if isinstance(value, torch.Tensor) and moved.get(id(value), (None,))[0] \
                        is not value:
                    host = _to_host(value, pin_memory, non_blocking)
                    state[key] = host
                    moved[id(host)] = (host, value.device)
                    copied = copied or host is not value
        if copied:
            _release_flat_state_buffers(self.optimizer)
        self._offloaded_optimizer_state = moved

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move the optimizer state :meth:`offload_states` moved back to the device it came
        from (a state since replaced, by ``load_checkpoint``, stays as loaded), and allow
        ``engine.step()`` again. Without a preceding offload: nothing to do. Memory: the
        state's device bytes again. Local, no communication; call it on every rank."""
        _check_flag("reload_states", "non_blocking", non_blocking)
        moved, self._offloaded_optimizer_state = self._offloaded_optimizer_state, None
        if moved is None:
            return
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                host, origin = moved.get(id(value), (None, None))
                if host is value:
                    state[key] = value.to(origin, non_blocking=non_blocking)
