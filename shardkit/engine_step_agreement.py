"""The ranks' agreement on each optimizer step (:class:`StepAgreement`, mixed into
:class:`shardkit.engine.ShardedEngine`): every rank steps or none, and none with its optimizer
state offloaded, else a RuntimeError on every rank before any collective of the step; ranks that
did not step join it at their next reducing forward, backward, checkpoint or gather. At stages
1-2 it carries OSS's own agreements on its clip and step. Communication: one all-gather of 16
int64s a rank per boundary (a control message), in a world of several ranks.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Callable, Mapping, Optional

import torch

from shardkit import distributed
from shardkit.optim.oss import OSS
from shardkit.utils.nested import tensors_in

_STEP_AGREEMENT = distributed.control_kind("the engine's step agreement")


# what a rank tells the others in the step agreement (see ShardedEngine._agree_on_step): first
# whether it steps, and whether its optimizer state is offloaded
_NOT_STEPPING, _STEPPING = 0, 1
# then OSS's own agreement row (two ints) for each of these calls of the step, carried in the
# engine's exchange (see ShardedEngine._oss_calls_to_carry), or _NOT_CARRIED twice: every rank
# sends a row of one length, whether it steps or not
_CARRIED_OSS_CALLS = ("clip_grad_norm", "step")
_NOT_CARRIED = -1


def _split_carried_rows(rows: list) -> tuple:
    """``(engine rows, {call: OSS rows})`` of the step agreement's gathered ``rows``: each
    rank's own two ints, and for each call of :data:`_CARRIED_OSS_CALLS` that every rank
    carried, every rank's OSS row for it (group-rank order: OSS spans the world)."""
    carried = {}
    for i, call in enumerate(_CARRIED_OSS_CALLS):
        oss_rows = [row[2 + 2 * i:4 + 2 * i] for row in rows]
        if all(_NOT_CARRIED not in oss_row for oss_row in oss_rows):
            carried[call] = oss_rows
    return [row[:2] for row in rows], carried


def _is_oss_clip(clip: Callable, optimizer: OSS) -> bool:
    """Whether the composition's ``clip`` is ``optimizer.clip_grad_norm`` itself (stages 1-2),
    whose agreement the step agreement can carry."""
    return getattr(clip, "__self__", None) is optimizer and \
        getattr(clip, "__func__", None) is OSS.clip_grad_norm


def _step_runs_no_foreign_code(optimizer: OSS) -> bool:
    """Whether ``optimizer.step()`` runs only torch's and shardkit's code before OSS's
    agreement: no step hook (instance or global, pre or post: nothing of the script's runs
    inside ``OSS.agreed_in_advance``) but shardkit's own checks
    (:func:`~shardkit.engine_optimizer_hooks._refuse_direct_step`; the global ones FSDP registers
    once a process builds a unit, as a ZeRO-3 reference model beside a ZeRO-2 actor does), and
    ``step`` itself OSS's, or torch's scheduler's counting wrapper around OSS's own
    (:func:`_is_schedulers_wrapper_of_oss_step`). Where torch keeps its hooks elsewhere than this
    reads, False (OSS then agrees on its own, as before)."""
    from torch.optim import optimizer as torch_optimizer
    hook_tables = [getattr(optimizer, "_optimizer_step_pre_hooks", None),
                   getattr(optimizer, "_optimizer_step_post_hooks", None),
                   getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
                   getattr(torch_optimizer, "_global_optimizer_post_hooks", None)]
    if not all(isinstance(table, Mapping) for table in hook_tables):
        return False
    hooks = [hook for table in hook_tables for hook in table.values()]
    if not all(_is_shardkit_function(hook) for hook in hooks):
        return False
    own_step = optimizer.__dict__.get("step")
    return type(optimizer).step is OSS.step and \
        (own_step is None or _is_schedulers_wrapper_of_oss_step(own_step))


def _is_schedulers_wrapper_of_oss_step(step) -> bool:
    """Whether ``step``, set on an OSS instance, is the wrapper a torch ``LRScheduler`` puts
    there around OSS's own ``step`` (it only notes that the optimizer stepped). That wrapper
    calls whatever ``step`` the instance held when the scheduler was built, which
    ``functools.wraps`` records: a script's own ``step`` set before (a warmup that sets the
    learning rate in it) runs under the same mark, and is the script's code."""
    return bool(getattr(step, "_wrapped_by_lr_sched", False)) and \
        getattr(step, "__wrapped__", None) is OSS.step


def _is_shardkit_function(hook) -> bool:
    """Whether ``hook`` is a plain function defined in shardkit (a check of its own, which
    changes no setting), not the script's."""
    return inspect.isfunction(hook) and (hook.__module__ or "").startswith("shardkit.")


class StepAgreement:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.optimizer``,
    ``self.composition``, ``self.module``, ``self._offloaded_optimizer_state``,
    ``self._awaiting_step``, ``self._armed_leaf_outputs``, ``self._no_sync_depth`` and the
    engine's ``_clip_max_norm``, ``is_gradient_accumulation_boundary`` and
    ``require_backward_grad_sync``."""

    def _agree_on_step(self, call: str = "engine.step()",
                       carry: Optional[dict] = None) -> dict:
        """Before a boundary step (``engine.step()`` or ``engine.optimizer.step()``), the
        ranks agree that every one of them is stepping, and none holds its optimizer state
        offloaded; otherwise a RuntimeError on every rank, before any collective of the step.

        A step taken on some ranks only (``optimizer.step()`` behind ``if rank == 0`` or a
        rank-local check of the loss) left the others waiting forever in their next forward's
        or backward's collectives, or, where the optimizer's step is local, training on
        weights that no longer match. The ranks that did not step meet this agreement at their
        next reducing training forward, or any forward at stage 3, or the backward of a loss
        computed without the engine's forward, or a checkpoint save or load
        (:meth:`_agree_on_step_skipped`), so both sides learn it from the one exchange the step
        makes anyway. ``step()`` between :meth:`~shardkit.engine.ShardedEngine.offload_states` and
        :meth:`~shardkit.engine.ShardedEngine.reload_states` would update state that is not where
        the parameters are (on a GPU, a device mismatch inside the optimizer; on a CPU run, a script
        that forgets the reload would break on a GPU).

        ``carry``: ``{call: arguments}`` of OSS's agreements (its ``clip_grad_norm`` and
        ``step``) whose rows this exchange carries (:meth:`_oss_calls_to_carry`). Returns
        ``{call: (rows, arguments)}`` for those every rank carried, for
        ``OSS.agreed_in_advance`` to check as the call would (after this agreement's own
        refusals, which win); the others' calls agree as usual.

        Communication: in a world of several ranks, one all-gather of 16 int64s a rank (a
        control message ``CommCounter`` does not count)."""
        offloaded = self._offloaded_optimizer_state is not None
        carry = carry or {}
        rows = self._step_agreement_rows(call, [_STEPPING, int(offloaded)], self._oss_rows(carry))
        self._awaiting_step = False  # settled on every rank, whatever the rows say
        rows, carried = _split_carried_rows(rows)
        self._refuse_steps_on_some_ranks(call, rows)
        ranks = [rank for rank, (_, flag) in enumerate(rows) if flag]
        if ranks:
            where = "" if ranks == list(range(distributed.get_world_size())) \
                else f" on rank(s) {ranks} (not on the others)"
            raise RuntimeError(f"{call}: the optimizer state was moved off the device by "
                               f"engine.offload_states(){where}; call engine.reload_states() "
                               f"on every rank before the next step (no rank stepped)")
        return {name: (carried[name], carry[name]) for name in carry if name in carried}

    def _oss_calls_to_carry(self) -> dict:
        """``{call: arguments}`` of the OSS agreements the step agreement can carry for this
        ``engine.step()``: its ``clip_grad_norm`` (with the ``max_norm`` it clips with) and its
        ``step``. None unless the optimizer is OSS over the whole world in rank order (the
        step agreement's ranks: with tensor parallelism OSS spans the data-parallel group
        only), in a world of several ranks; the step only where no code but torch's and
        shardkit's runs in ``optimizer.step()`` (:func:`_step_runs_no_foreign_code`: a step
        pre-hook of the script's could change the hyper-parameters after the rows were made,
        and OSS would then raise on this rank alone). Local."""
        optimizer = self.optimizer
        world = distributed.get_world_size()
        if not isinstance(optimizer, OSS) or world < 2 or \
                distributed.group_ranks(optimizer.group) != list(range(world)):
            return {}
        calls = {}
        max_norm = self._clip_max_norm()
        if max_norm is not None and _is_oss_clip(self.composition.clip_grad_norm, optimizer):
            calls["clip_grad_norm"] = {"max_norm": max_norm}
        if _step_runs_no_foreign_code(optimizer):
            calls["step"] = {}
        return calls

    def _oss_rows(self, carry: dict) -> list:
        """This rank's OSS rows for the step agreement: ``OSS.agreement_row`` of each call
        of :data:`_CARRIED_OSS_CALLS` in ``carry``, ``_NOT_CARRIED`` twice for the others."""
        row = []
        for call in _CARRIED_OSS_CALLS:
            row += self.optimizer.agreement_row(call, **carry[call]) if call in carry \
                else [_NOT_CARRIED, _NOT_CARRIED]
        return row

    def _agree_on_step_skipped_at_forward(self) -> bool:
        """The other side of :meth:`_agree_on_step` for a rank that did not step: at a
        forward that starts a new reducing training pass (grad enabled, training mode, at the
        accumulation boundary, reducing) after the backward of an earlier one that this rank
        has not stepped for, and at any forward at stage 3, whose forwards gather the
        parameters on every rank. Returns whether this forward starts a reducing training
        pass. Nothing is sent in the usual loop (one step after each backward), nor for the
        second forward of a loss of two, nor for a forward that no backward follows (a
        rank-local forward that forgot ``torch.no_grad()``)."""
        if self.optimizer is None:
            return False
        reducing = self.is_gradient_accumulation_boundary() and self._no_sync_depth == 0 \
            and self.require_backward_grad_sync
        training = torch.is_grad_enabled() and self.module.training and reducing
        if training or self.composition.stage == 3:
            self._agree_on_step_skipped("engine forward")
        return training

    def _await_step_after_backward_of(self, output) -> None:
        """Mark this rank as owing a step once a backward reaches ``output`` (a reducing
        training forward's: ``engine.backward(loss)`` or the script's own ``loss.backward()``),
        not at the forward itself: a forward that no backward follows on some ranks only
        would otherwise make those ranks alone join the agreement at their next forward, and
        wait there forever. A gradient hook on each output tensor that needs a gradient (on
        a view's base), found in any container :func:`~shardkit.utils.nested.tensors_in`
        walks (it holds only a weak reference to the engine); a leaf output is armed instead
        (:meth:`_arm_leaf_output`). No communication."""
        owner = weakref.ref(self)

        def note_backward(_grad):
            engine = owner()
            if engine is not None:
                engine._awaiting_step = True
        for tensor in tensors_in(output):
            if not tensor.requires_grad:
                continue
            # a view's own hook is lost when the script modifies it in place (torch rebuilds
            # its grad_fn from its base's), its base's is not
            hooked = tensor if tensor._base is None else tensor._base
            if hooked.grad_fn is None:
                self._arm_leaf_output(hooked)
            else:
                hooked.register_hook(note_backward)

    def _arm_leaf_output(self, leaf: torch.Tensor) -> None:
        """A leaf returned by the forward as is (a parameter, such as the log-variances of
        a multi-task loss's weighting) lives as long as the model, so a hook a forward would
        pile up on it, one more call in every backward: one hook a leaf for the engine,
        armed by each reducing training forward that returns it, disarmed when it fires."""
        armed = self._armed_leaf_outputs.get(leaf)
        if armed is None:
            armed = self._armed_leaf_outputs[leaf] = [False]
            owner = weakref.ref(self)

            def note_backward(_grad):
                engine = owner()
                if armed[0] and engine is not None:
                    armed[0] = False
                    engine._awaiting_step = True
            leaf.register_hook(note_backward)
        armed[0] = True

    def _agree_on_step_skipped(self, call: str, keeps_step_owed: bool = False) -> None:
        """When the backward of a reducing training pass ran here since the ranks last agreed
        on a step: join the agreement as a rank that is not stepping. Every rank passing here
        together (a script that backwards without stepping, or backwards twice) agrees, and
        goes on; a rank that stepped meanwhile makes every rank raise. ``keeps_step_owed``
        (a checkpoint save or load, a gather of the weights): the backward is still owed its
        step after the ranks agreed, so that a rank stepping later on its own still meets the
        others' agreement at their next forward (a forward clears it: its own backward owes
        the next one). Communication: none unless a pass is pending, then one all-gather of
        16 int64s a rank."""
        if not self._awaiting_step:
            return
        rows = self._step_agreement_rows(call, [_NOT_STEPPING, 0])
        self._awaiting_step = False  # settled on every rank when some stepped: they raise
        self._refuse_steps_on_some_ranks(call, _split_carried_rows(rows)[0])
        self._awaiting_step = keeps_step_owed

    @staticmethod
    def _step_agreement_rows(call: str, row: list, oss_rows: Optional[list] = None) -> list:
        """Every rank's ``row`` followed by its ``oss_rows`` (:meth:`_oss_rows`; default:
        none carried), over the world: the engine's ranks are the world's (``initialize``
        refuses an ``mpu`` whose tensor- and data-parallel groups do not cover it), and with
        tensor parallelism each rank's tensor-parallel partners must agree too, which its
        data-parallel group alone would not tell it."""
        if oss_rows is None:
            oss_rows = [_NOT_CARRIED] * (2 * len(_CARRIED_OSS_CALLS))
        row = list(row) + list(oss_rows)
        if distributed.get_world_size() < 2:
            return [row]
        return distributed.gather_control_rows(call, row, kind=_STEP_AGREEMENT)

    @staticmethod
    def _refuse_steps_on_some_ranks(call: str, rows: list) -> None:
        stepping = [rank for rank, (kind, _) in enumerate(rows) if kind == _STEPPING]
        if not stepping or len(stepping) == len(rows):
            return
        others = [rank for rank in range(len(rows)) if rank not in stepping]
        raise RuntimeError(
            f"{call}: rank(s) {stepping} are stepping the optimizer (engine.step() or "
            f"engine.optimizer.step()) while rank(s) {others} went on without stepping (to "
            f"their next forward or backward, a checkpoint save or load, or a gather of the "
            f"full weights); every rank must step after each accumulation boundary, or none (a "
            f"step behind a rank-local condition, such as `if rank == 0` or a check of this "
            f"rank's loss, would leave the ranks' weights different): no rank stepped. Under "
            f"fp16, engine.step() itself skips the update on every rank when any rank's "
            f"gradients overflowed: call it everywhere. To skip a step everywhere, agree on the "
            f"condition first (e.g. all-reduce the flag). A forward with gradients on, in "
            f"training mode, between backward and step on some ranks only (a preview or log) "
            f"counts as going on: run it under torch.no_grad()")
