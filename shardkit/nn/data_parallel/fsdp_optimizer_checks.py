"""The optimizer-step watches that :class:`~shardkit.nn.data_parallel.fully_sharded.
FullyShardedDataParallel` registers once per process (torch's global optimizer step pre-hooks):
an optimizer holding state made for a whole parameter rather than its shard, an ``LBFGS``
stepping sharded parameters, and an optimizer that reads each parameter as a whole tensor
(``Adafactor``, ``Muon``) stepping row shards raise before the step changes anything. Local: no
communication."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardkit.nn.data_parallel.flat_param import _where
from shardkit.nn.data_parallel.fsdp_unit_modules import unit_holding


# optimizer -> (id of its state dict, its length) when its state was last found to fit the
# shards (see _refuse_state_of_whole_params); the step pre-hooks (that check, and
# _refuse_lbfgs_over_shards, _refuse_whole_tensor_optimizers_over_shards) are registered once
_STATES_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_STATE_HOOK: list = []

# optimizers whose update of a parameter reads the whole tensor (not element by element), by
# class name, with what they read: torch's, and those of other libraries by the same name
# (transformers' and fairseq's Adafactor, Keller Jordan's Muon, timm's / apex's / DeepSpeed's
# LAMB and timm's LARS)
_TRUST_RATIO = ("scales each parameter's update by the ratio of the parameter's norm to the "
                "update's (a layer-wise trust ratio)")
_WHOLE_TENSOR_READERS = {
    "Adafactor": "factors each matrix's second moment into row and column means and scales "
                 "each step by the parameter's root mean square",
    "Muon": "orthogonalizes each whole matrix (Newton-Schulz iterations on the whole update)",
    **{name: _TRUST_RATIO for name in ("Lamb", "LAMB", "FusedLamb", "FusedLAMB", "Lars",
                                       "LARS")},
}


def _watch_optimizer_states_of_whole_params() -> None:
    if not _STATE_HOOK:
        _STATE_HOOK.append(register_optimizer_step_pre_hook(_refuse_state_of_whole_params))
        _STATE_HOOK.append(register_optimizer_step_pre_hook(_refuse_lbfgs_over_shards))
        _STATE_HOOK.append(register_optimizer_step_pre_hook(
            _refuse_whole_tensor_optimizers_over_shards))


def whole_tensor_reading(optimizer_class: type) -> Optional[str]:
    """What an optimizer of ``optimizer_class`` reads across a whole parameter when that
    class, or a class it derives from, has one of :data:`_WHOLE_TENSOR_READERS`' names; None
    otherwise. Local; a look at the class's names.

    Note: told by name, not by torch's classes alone, because the Adafactor most FSDP users
    step is ``transformers.optimization.Adafactor`` (no subclass of torch's), which factors
    and scales by the parameter's norm alike."""
    for cls in getattr(optimizer_class, "__mro__", ()):
        if cls.__name__ in _WHOLE_TENSOR_READERS:
            return _WHOLE_TENSOR_READERS[cls.__name__]
    return None


def _refuse_whole_tensor_optimizers_over_shards(optimizer, args, kwargs) -> None:
    """Every ``torch.optim.Optimizer.step``, before it changes anything: a ``RuntimeError``
    when an optimizer whose update reads each parameter as a whole tensor (an ``Adafactor`` or
    a ``Muon``, see :func:`whole_tensor_reading`) steps a parameter that a unit cuts into row
    shards over more than one rank.

    Note: each rank steps its own rows, so Adafactor's column statistic ``col_var`` averaged
    this rank's rows only (its padding rows too) and its step size read the norm of the shard,
    and Muon orthogonalized the shard instead of the matrix: trained weights 6e-3 (Adafactor)
    and 1.5e-2 (Muon) off one process after three steps of lr 1e-2 at world size 2, with no
    error. (torch FSDP1 and FairScale hand the optimizer flattened 1-D shards, which Adafactor
    steps unfactored and Muon refuses; FSDP2's DTensor shards fail inside Adafactor's in-place
    ops.) Replicated parameters (``NO_SHARD``, the replicas of hybrid sharding) and world size 1
    hold whole parameters and step as in one process, and so does a parameter of at most one
    row (a ``(1, seq, d)`` position embedding: the first rank holds it whole, the others a zero
    padding row that a zero gradient leaves zero). A frozen parameter (``requires_grad=False``:
    a frozen FSDP backbone under ``Adafactor(model.parameters())``) gets no gradient, so the
    optimizer never steps it. Every rank of the unit steps the same optimizer class over the
    same parameters, so every rank raises. Cost: a look at the names of the optimizer's
    classes for other optimizers."""
    what = whole_tensor_reading(type(optimizer))
    if what is None:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = unit_holding(p)
            if unit is None or unit._shard is None or unit._summoned \
                    or unit._shard.world_size == 1 or not p.requires_grad:
                continue
            index = [id(q) for q in unit._shard.params].index(id(p))
            if unit._shard.layouts[index].rows <= 1:
                continue  # one row block: the first rank holds it whole, the others padding
            raise RuntimeError(
                f"FullyShardedDataParallel: {type(optimizer).__name__}.step() over "
                f"{_where(unit._shard.locations[index])} of the FSDP unit wrapping a "
                f"{type(unit.module).__name__}, which is cut into row shards over "
                f"{unit._shard.world_size} ranks: {type(optimizer).__name__} {what}, while each "
                f"rank holds only its rows, so the update would differ from one process's. Use "
                f"an element-wise optimizer (Adam, AdamW, SGD), sharding_strategy=NO_SHARD, or "
                f"DistributedDataParallel / ShardedDataParallel with OSS, which steps whole "
                f"parameters")


def _refuse_lbfgs_over_shards(optimizer, args, kwargs) -> None:
    """Every ``torch.optim.Optimizer.step``, before its closure runs: a ``RuntimeError`` when
    an ``LBFGS`` steps a parameter that a unit shards or replicates over more than one rank.

    Note: LBFGS's stopping tests, curvature pairs and line search read the whole flattened
    gradient and the closure's loss. Under FSDP each rank sees only its shard of the
    gradient and the loss of its own batch, so the ranks computed different directions and
    step sizes (wrong weights with no error: 0.78 off at world 2 after two steps), and could
    stop after different numbers of closure calls, leaving the others in a collective
    forever. Every rank steps the same optimizer, so every rank raises. At world size 1 it
    steps as in one process. Cost: an ``isinstance`` check for any other optimizer."""
    if not isinstance(optimizer, torch.optim.LBFGS):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = unit_holding(p)
            if unit is None or unit._shard is None:
                continue
            ranks = unit._shard.world_size * unit._shard.replicas
            if ranks > 1:
                index = [id(q) for q in unit._shard.params].index(id(p))
                raise RuntimeError(
                    f"FullyShardedDataParallel: {type(optimizer).__name__}.step() over "
                    f"{_where(unit._shard.locations[index])} of the FSDP unit wrapping a "
                    f"{type(unit.module).__name__}, which is sharded or replicated over {ranks} "
                    f"ranks: LBFGS's line search and curvature history need the whole "
                    f"gradient and the global loss, while each rank holds its shard and its "
                    f"own batch's loss, so the ranks would step differently (or run different "
                    f"numbers of closure calls and hang). Use a first-order optimizer (SGD, "
                    f"Adam), or LBFGS through DistributedDataParallel with OSS, which runs it "
                    f"on the whole model")


def _refuse_state_of_whole_params(optimizer, args, kwargs) -> None:
    """Every ``torch.optim.Optimizer.step``, before it changes anything: a ``RuntimeError``
    when the optimizer holds, for a sharded parameter, state made for the whole parameter
    (``exp_avg`` of an optimizer that stepped before wrapping) instead of for the shard.

    Note: wrapping keeps the parameter objects (their ``.data`` becomes this rank's shard),
    so an optimizer built before wrapping steps the shards correctly, as long as it has no
    state yet. One that stepped before wrapping (or loaded an unsharded state dict) failed
    inside the update with torch's "The size of tensor a (4) must match the size of tensor
    b (2)", naming neither the parameter nor the cause. Every rank holds such state alike,
    so every rank raises. See :func:`_state_made_for_whole` for what counts as such state.
    Cost: one pass over the optimizer's state when it was replaced or grew since the last
    check, a dictionary lookup otherwise."""
    mark = (id(optimizer.state), len(optimizer.state))
    if _STATES_CHECKED.get(optimizer) == mark:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            unit = unit_holding(p)
            if unit is None or unit._summoned:
                continue
            index = [id(q) for q in unit._shard.params].index(id(p))
            whole = tuple(unit._shard.layouts[index].shape)
            if whole == tuple(p.shape) or len(whole) == 0:
                continue  # not cut here, or 0-dim (its shape is the scalar 'step' one)
            key = _state_made_for_whole(optimizer.state.get(p, {}), whole)
            if key is not None:
                where = unit._shard.locations[index]
                value = optimizer.state[p][key]
                raise RuntimeError(
                    f"FullyShardedDataParallel: {type(optimizer).__name__}.step() holds "
                    f"state {key!r} of shape {tuple(value.shape)} for "
                    f"{_where(where)} in unit {unit._shard.label[1]!r}, which is now "
                    f"this rank's shard of shape {tuple(p.shape)}: the optimizer's state "
                    f"was made for the whole parameter (it stepped, or loaded a state "
                    f"dict, before the model was wrapped). Build the optimizer after "
                    f"wrapping, or load its state into the shards with "
                    f"model.get_shard_from_optim_state_dict(full_optim_state_dict)")
    _STATES_CHECKED[optimizer] = mark


def _state_made_for_whole(state: Mapping, whole: tuple) -> Optional[str]:
    """The key of a tensor in one parameter's optimizer ``state`` showing that it was made
    for the whole parameter of shape ``whole`` (not for its shard), or None.

    Note: an optimizer that stepped before wrapping keeps per-element state (``exp_avg``,
    ``momentum_buffer``) of the whole parameter's shape. A tensor of that shape alone is no
    proof: state made for the shard may have it too, such as Shampoo's column statistic
    ``(n, n)`` of a square weight ``(n, n)`` cut by rows, next to its row statistic of the
    shard's rows and its momentum of the shard's shape. So the state counts as the whole
    parameter's only when every tensor in it that could be per-element (more than one
    element: ``step`` counters are not) has the whole shape; a factored state (Adafactor's
    row and column statistics) has shapes of its own and never does."""
    shaped = [(key, value) for key, value in state.items()
              if isinstance(value, torch.Tensor) and value.numel() > 1]
    if shaped and all(tuple(value.shape) == whole for _, value in shaped):
        return shaped[0][0]
    return None
