"""``engine.optimizer.step()`` called by the script instead of ``engine.step()``.

As DeepSpeed's fp16, bf16 and ZeRO optimizers do in their own ``step``, the direct step first
gets ``engine.step()``'s work on the gradients (:func:`prepare`, run by the engine's step
pre-hook ``engine._refuse_direct_step`` once the ranks agreed on the step): gradients left
unreduced are refused, the overflow check is agreed over the ranks (fp16; bf16 unless
``bf16.check_grad_overflow`` is false), and an overflowed step is skipped on every rank (its
gradients are cleared, so the optimizer, which skips parameters without a gradient as torch's
do, applies nothing) while the fp16 loss scale backs off; otherwise the gradients are
unscaled and clipped (``gradient_clipping``) or measured (``get_global_grad_norm()``) as
``engine.step()`` does. What stays the script's, as with DeepSpeed's optimizers: stepping
the lr scheduler and zeroing the gradients after a step that was applied; ``global_steps``
counts ``engine.step()`` only. Communication: what ``engine.step()``'s work costs (the
overflow flag's one-element all-reduce, the clip's norm), and the step agreement's one
control all-gather. A closure, which computes the gradients after that work, is refused
where the work would change them, and otherwise gets none of it.

At ZeRO stages 1-2 (OSS), OSS's agreements on its param groups for its clip and its step
ride in the engine's step agreement, as they do under ``engine.step()``, so the direct step
makes one control exchange instead of two or three. The rows gathered for OSS's ``step`` are
handed to ``OSS.agreed_in_advance``, whose block must stay open until OSS's ``step`` has run:
:func:`prepare` opens it and a step post-hook closes it. A step that raises leaves no
post-hook run: the block left open is closed before the next step of that optimizer (direct
or ``engine.step()``), so a stale agreement is never used.

A skipped direct step at stages 1-2 must also skip OSS's parameter sync (an all-gather of
``Ψ(N-1)/N`` elements that would move nothing new; ``engine.step()`` never calls the optimizer
on a skipped step). A step pre-hook cannot cancel the step, so :func:`prepare` hands OSS the
agreed overflow as ``ShardedGradScaler`` does (``found_inf``, agreed over OSS's group), and
OSS returns before stepping or syncing. The post-hook (or, after a step that raised, the next
step) takes that hand-off back, so it never reaches a later step. Where a GradScaler is
stepping the optimizer (the script's ``scaler.step(engine.optimizer)``), OSS already holds
that scaler's ``found_inf``, which it reads, combines over the ranks and skips on, and which
the scaler deletes after the step: the engine then hands nothing off and takes nothing back
but its own.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardkit.optim.oss import OSS

# optimizer -> the OSS.agreed_in_advance("step", ...) block opened for its direct step
_OPEN_BLOCKS = WeakIdKeyDictionary()
# the OSS optimizers told by prepare() that their direct step is skipped
_SKIP_HANDED_OFF = WeakIdKeyDictionary()


def prepare(engine, optimizer, agreed: dict, args: tuple, kwargs: dict) -> None:
    """``engine.step()``'s work on the gradients before the script's direct
    ``optimizer.step(*args, **kwargs)`` of ``engine`` (see the module's docstring), on the
    step agreement ``agreed`` (``ShardedEngine._agree_on_step``'s result). Raises, if at all,
    before anything is applied.

    A closure computes the gradients the step applies after this hook has run, so none of
    that work can reach them: a closure is a RuntimeError where the work would change them
    (:func:`_gradient_changes`), and otherwise the step goes on as torch's would, with no
    work on gradients that the closure replaces (an average by hand of them, or a measured
    norm: ``get_global_grad_norm()`` is then ``None``)."""
    loss_scaled = engine._backwards_since_step > 0  # engine.backward scaled them, not torch's
    overflow = False
    if _closure_of(args, kwargs) is not None:
        _refuse_closure_where_gradients_change(engine, loss_scaled)
        engine._refuse_unreduced_step("engine.optimizer.step()")
        engine._last_step_applied, engine.optimizer.overflow = True, False
        engine._last_grad_norm = None
        _note_step_taken(engine, overflow=False)
    else:
        engine._check_gradients_reduced(not loss_scaled, "engine.optimizer.step()")
        scale_before = engine.loss_scale
        overflow = engine._prepare_gradients_for_step(loss_scaled, agreed)
        engine._update_loss_scale(overflow, scale_before)
        _note_step_taken(engine, overflow)
    open_carried_step(optimizer, agreed)
    if overflow:
        _hand_skip_to_oss(optimizer)


def _note_step_taken(engine, overflow: bool) -> None:
    """The engine's bookkeeping of a boundary step reached by a direct step; on ``overflow``
    (every rank alike) the gradients are cleared, so the optimizer steps nothing."""
    engine._boundary_unreduced = False
    engine._forwards_since_step = engine._backwards_since_step = 0
    engine._ddp_unarmed_forward = False  # as engine.step() leaves it
    if overflow:
        engine.zero_grad()


def _closure_of(args: tuple, kwargs: dict):
    """The ``closure`` of an ``optimizer.step(closure)`` call (torch's only argument), from
    the ``args`` torch hands a step pre-hook: the optimizer itself first."""
    return kwargs.get("closure", args[1] if len(args) > 1 else None)


def _refuse_closure_where_gradients_change(engine, loss_scaled: bool) -> None:
    """A RuntimeError (the same on every rank: read from the config and the model) where
    ``engine``'s work before a step would change the gradients a closure computes."""
    changes = _gradient_changes(engine, loss_scaled)
    if changes:
        raise RuntimeError(
            f"engine.optimizer.step(closure): before the step the engine {'; '.join(changes)}, "
            f"and the closure would recompute the gradients after that; call engine.step() "
            f"(or step without a closure, after engine.backward(loss))")


def _gradient_changes(engine, loss_scaled: bool) -> list[str]:
    """What ``engine``'s work before a step does to the gradients (in words, with the
    setting that asks for it): unscaling, the overflow check (which may clear them),
    clipping, rescaling summed ones, summing sequence-parallel ones. Measuring their norm
    only (``get_global_grad_norm()`` at stages 1-3, or under fp16/bf16) changes nothing."""
    config = engine.config
    changes = []
    if engine.loss_scaler is not None and loss_scaled:
        changes.append("unscales them (fp16 loss scaling)")
    if config.precision.check_grad_overflow:
        changes.append(f"checks them for inf/nan and clears them on overflow "
                       f"({config.precision.dtype})")
    if config.gradient_clipping > 0:
        changes.append(f"clips them (gradient_clipping={config.gradient_clipping})")
    if config.gradient_allreduce_op == "sum" and engine.dp_world_size > 1:
        changes.append("multiplies them by the data-parallel size "
                       "(gradient_allreduce_op='sum')")
    if engine._sums_sequence_parallel_grads:
        changes.append("sums the sequence-parallel ones over the tensor-parallel group")
    return changes


def open_carried_step(optimizer, agreed: dict) -> None:
    """Open ``optimizer.agreed_in_advance`` for its ``step`` on the rows the step agreement
    carried (``agreed``: ``ShardedEngine._agree_on_step``'s result); nothing where it carried
    none. Local: the rows were gathered already."""
    close_carried_step(optimizer)
    if "step" not in agreed:
        return
    rows, arguments = agreed["step"]
    block = optimizer.agreed_in_advance("step", rows, **arguments)
    block.__enter__()
    _OPEN_BLOCKS[optimizer] = block


def close_carried_step(optimizer, *_hook_arguments) -> None:
    """Close the block :func:`open_carried_step` opened for ``optimizer``, if any (also the
    step post-hook: torch passes the step's ``args`` and ``kwargs``, unused). Local."""
    _take_skip_back(optimizer)
    if not _OPEN_BLOCKS:  # (also spares the look-up an optimizer that takes no weak reference)
        return
    block = _OPEN_BLOCKS.pop(optimizer, None)
    if block is not None:
        block.__exit__(None, None, None)


def _hand_skip_to_oss(optimizer) -> None:
    """Make the coming ``step`` of ``optimizer``, an OSS whose gradients the skipped step
    cleared on every rank, return before it steps or syncs any parameter: the hand-off of
    ``ShardedGradScaler`` (an inf/nan finding, the same on every rank of OSS's group, so OSS
    makes no collective of its own to combine it). Nothing for another optimizer: it steps
    no parameter without a gradient and makes no collective. Nothing either where a
    GradScaler is stepping it: the scaler's ``found_inf`` (it saw the same gradients, so
    some rank found the inf/nan) already makes OSS skip, and the scaler deletes it after
    the step, which must find it there. Local."""
    if not isinstance(optimizer, OSS) or "found_inf" in optimizer.__dict__:
        return
    found_inf = torch.ones((), dtype=torch.float32)
    optimizer.found_inf = found_inf
    optimizer._found_inf_agreed_over(optimizer.group)
    _SKIP_HANDED_OFF[optimizer] = found_inf


def _take_skip_back(optimizer) -> None:
    """Remove what :func:`_hand_skip_to_oss` set on ``optimizer``, if anything (OSS leaves
    ``found_inf`` to its caller, as torch's GradScaler deletes it after the step). After a
    step that raised, the next step's GradScaler may have set its own ``found_inf`` since:
    that one stays, and OSS combines it over the ranks itself. Local."""
    if not _SKIP_HANDED_OFF:
        return
    handed = _SKIP_HANDED_OFF.pop(optimizer, None)
    if handed is None:
        return
    if optimizer.__dict__.get("found_inf") is handed:
        del optimizer.found_inf
    optimizer._found_inf_agreed = False
