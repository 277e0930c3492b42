"""``summon_full_params`` of :class:`~shardkit.nn.data_parallel.fully_sharded.
FullyShardedDataParallel` (a mixin, :class:`FSDPSummonMixin`, so the method stays on the class)
and its checks: FairScale's and torch FSDP1's options, ``with_grads``, and what a forward or
backward inside the block may do. Costs are in the method's docstring."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.flat_param import shard_rows
from shardkit.nn.data_parallel.fsdp_unit_modules import _is_unit, unit_class
from shardkit.nn.data_parallel.training_state import TrainingState

if TYPE_CHECKING:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel


def _refuse_with_grads_without_orig_params(units: list) -> None:
    """torch FSDP1's NotImplementedError for ``summon_full_params(with_grads=True)`` on units
    built without ``use_orig_params=True``, raised before any gather (every rank built the
    same units)."""
    without = [u for u in units if not u._use_orig_params]
    if without:
        raise _NotSupported(
            f"summon_full_params(with_grads=True) is not supported without use_orig_params: "
            f"{len(without)} of the {len(units)} units summoned were built with "
            f"use_orig_params=False (the default); as in torch FSDP1, build them with "
            f"FullyShardedDataParallel(..., use_orig_params=True) (an auto_wrap_policy passes "
            f"it to every unit) to see full gradients in .grad inside the block, or read "
            f"this rank's rows of the gradients in .grad outside it")


def _refuse_with_grads_inside_a_summon_without(scope: list) -> None:
    """``summon_full_params(with_grads=True)`` nested in a block that summoned some of the same
    units without ``with_grads``: a nested block leaves units already summoned as they are, so
    theirs would keep this rank's gradient shard in ``.grad`` beside the full parameter
    instead of the full gradient asked for. Raised before any gather (every rank nests
    alike)."""
    plain = [u for u in scope if u._summoned and not u._summoned_grads]
    if plain:
        raise RuntimeError(
            f"summon_full_params(with_grads=True) was called inside a summon_full_params() "
            f"block that summoned {len(plain)} of its {len(scope)} units without with_grads: "
            f"their parameters are already full and stay as that block left them, with this "
            f"rank's shard of the gradient in .grad, not the full gradient; pass "
            f"with_grads=True to the outer summon_full_params(), or call this one outside it")


def _grad_after_summon(sharded: Optional[torch.Tensor], full: Optional[torch.Tensor],
                       layout, rank: int, writeback: bool) -> Optional[torch.Tensor]:
    """A parameter's ``.grad`` after ``summon_full_params(with_grads=True)``: its shard's
    gradient as it was (``sharded``), or with ``writeback`` this rank's rows of the full
    gradient the block left (``full``; ``None`` if the block set it so), copied into
    ``sharded`` when there is one (an optimizer holding it sees the edit). Local."""
    if not writeback:
        return sharded
    if full is None:
        return None
    rows = shard_rows(full.detach(), layout, rank)
    if sharded is None:
        return rows
    with torch.no_grad():
        sharded.copy_(rows)
    return sharded


def _resolve_writeback(volatile: Optional[bool], writeback: Optional[bool]) -> bool:
    for name, value in (("volatile", volatile), ("writeback", writeback)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"summon_full_params({name}={value!r}): must be True or False")
    if volatile is not None and writeback is not None and volatile == writeback:
        raise ValueError(f"summon_full_params(volatile={volatile}, writeback={writeback}): they "
                         f"contradict each other; volatile=True is writeback=False")
    if volatile is not None:
        return not volatile
    return True if writeback is None else writeback


class _NotSupported(ValueError, NotImplementedError):
    """A combination of ``summon_full_params`` options that torch FSDP1 refuses with a
    NotImplementedError: either ``except`` clause catches it."""


def _check_summon_options(writeback: bool, rank0_only, offload_to_cpu, with_grads) -> bool:
    """torch FSDP1's ``summon_full_params`` options, checked before any gather."""
    for name, value in (("rank0_only", rank0_only), ("offload_to_cpu", offload_to_cpu),
                        ("with_grads", with_grads)):
        if not isinstance(value, bool):
            raise ValueError(f"summon_full_params({name}={value!r}): must be True or False")
    if rank0_only and writeback:
        raise _NotSupported("summon_full_params(rank0_only=True) needs writeback=False (as in "
                            "torch's FSDP): the other ranks do not hold the full values, so "
                            "edits could not be written back consistently")
    return rank0_only


@contextlib.contextmanager
def _summon_units_inside(module, **options):
    """``summon_full_params(**options)`` of every outermost FSDP unit inside ``module``, a
    module that is not a unit (torch FSDP1's static call on a plain model holding units).
    Nothing to summon is fine, as in torch; something that is not an ``nn.Module`` is a
    ValueError."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"FullyShardedDataParallel.summon_full_params(module="
                         f"{type(module).__name__}): expected an FSDP unit or an nn.Module "
                         f"holding FSDP units")
    with contextlib.ExitStack() as stack:
        for unit in unit_class().fsdp_modules(module, root_only=True):
            stack.enter_context(unit.summon_full_params(**options))
        yield


def _check_summoned_alike(root: "FullyShardedDataParallel") -> None:
    """Under mixed precision a forward must not mix summoned units (fp32 masters) with
    gathered ones (compute dtype): their activations would meet parameters of the other
    dtype."""
    summoned = [u._summoned for u in root.sharded_units()]
    if any(summoned) and not all(summoned):
        raise RuntimeError("FullyShardedDataParallel: a forward inside summon_full_params() "
                           "under mixed precision needs every unit summoned (fp32), so that no "
                           "unit computes in the compute dtype beside them; call "
                           "summon_full_params(recurse=True) on the outermost unit (with "
                           "shardkit.zero.GatheredParameters, which summons the units of the "
                           "parameters it is given: pass every parameter, "
                           "engine.module.parameters())")


def _refuse_backward_while_summoned(grad):
    raise RuntimeError("FullyShardedDataParallel: backward through a forward run inside "
                       "summon_full_params() is not supported (its gradients would have the full "
                       "shapes, not the shards'); run forward and backward outside the block, or "
                       "the forward under torch.no_grad()")


class FSDPSummonMixin:
    """:meth:`summon_full_params` of :class:`~shardkit.nn.data_parallel.fully_sharded.
    FullyShardedDataParallel` (needs its ``sharded_units``, ``_check_idle``,
    ``_refuse_unreduced_grads`` and the units' shards); also callable as torch FSDP1's static
    method on a plain module holding units."""

    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, *positional,
                           volatile: Optional[bool] = None,
                           writeback: Optional[bool] = None, rank0_only: bool = False,
                           offload_to_cpu: bool = False, with_grads: bool = False):
        """Inside the block every parameter holds its full fp32 value (``module.weight`` has the
        original shape); edits are copied back into the shards on exit, unless ``volatile=True``
        (FairScale's name) or ``writeback=False`` (torch's) says they may be dropped. Both are
        keyword-only: FairScale's second positional argument is ``volatile``, torch's is
        ``writeback``, and they mean opposite things.

        Nested calls (``state_dict()`` inside the block, or another ``summon_full_params``)
        leave units already summoned as they are: the outermost block that summoned a unit
        writes it back and reshards it on exit.

        A forward inside the block (``model.generate(...)`` under ``torch.no_grad()``) computes
        with the summoned fp32 values, without gathering or casting them again; units not
        summoned (``recurse=False``) gather as usual, except under mixed precision, where the
        forward needs every unit summoned. A backward through it is refused.

        Called as torch FSDP1's static method on a module that is not a unit itself
        (``FSDP.summon_full_params(model)`` with FSDP units inside a plain ``model``), it
        summons every outermost unit inside ``model`` with the same options.

        torch FSDP1's options: ``rank0_only=True`` gives the full values on the group's first
        rank only (the others keep their shards inside the block; it needs ``writeback=False``,
        as in torch: the other ranks could not write edits back); ``offload_to_cpu=True`` holds
        the full values in CPU memory (edits are still written back). ``with_grads=True``
        also gives every parameter its full gradient in ``.grad`` (gathered from the ranks'
        reduced shards; ``None`` where no rank has one); as in torch FSDP1 it needs units
        built with ``use_orig_params=True`` (torch's NotImplementedError otherwise). Edits
        to those gradients are written back into the shards' ``.grad`` on exit (with
        ``writeback``; otherwise the shards' gradients are left as they were). It is refused
        while backwards inside :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.no_sync`
        hold gradients not reduced yet (they are not in ``.grad``).

        Memory: the full model (``recurse``) or this unit in master dtype (on rank 0 only with
        ``rank0_only``, in CPU memory with ``offload_to_cpu``), twice with ``with_grads``.
        Communication: one all-gather per unit not yet summoned, two with ``with_grads``. All
        ranks must enter it.
        """
        if positional:
            raise TypeError("summon_full_params(recurse, ...): pass volatile= (FairScale's: True "
                            "drops edits) or writeback= (torch's: False drops edits) by keyword; "
                            "a second positional argument means opposite things in the two")
        if not isinstance(recurse, bool):
            raise ValueError(f"summon_full_params(recurse={recurse!r}): must be True or False")
        writeback = _resolve_writeback(volatile, writeback)
        rank0_only = _check_summon_options(writeback, rank0_only, offload_to_cpu, with_grads)
        if not _is_unit(self):  # FSDP.summon_full_params(model)
            with _summon_units_inside(self, recurse=recurse, writeback=writeback,
                                      rank0_only=rank0_only, offload_to_cpu=offload_to_cpu,
                                      with_grads=with_grads):
                yield
            return
        keep_full = not rank0_only or self._is_first_rank()
        self._check_idle("summon_full_params")
        scope = self.sharded_units() if recurse else [self]
        units = [u for u in scope if not u._summoned]
        if with_grads:
            _refuse_with_grads_without_orig_params(units)
            _refuse_with_grads_inside_a_summon_without(scope)
            self._refuse_unreduced_grads("summon_full_params")
        shards = [u._shard for u in units if u._shard is not None]
        for unit in units:
            unit._summoned = True
            unit._summoned_grads = with_grads
            unit.training_state = TrainingState.SUMMON_FULL_PARAMS
        # a unit kept gathered since a forward (the root, reshard_after_forward=False) still
        # exposes its compute views as the module attributes: hide them for the block, or
        # ``module.weight`` would read (and edits would land in) the gathered copy, not the
        # summoned parameter that is written back
        exposed = [s for s in shards if s._exposed]
        for shard in exposed:
            shard.hide()
        # buffers cast to the compute dtype go back to their own dtype beside the fp32 values
        # (a forward in the block: BatchNorm statistics must match its summoned weight)
        recast = []
        for unit in units:
            for module, name, dtype in unit._buffer_dtypes:
                buf = module._buffers[name]
                recast.append((module, name, buf.dtype))
                module._buffers[name] = buf.to(dtype)
        gathered = False
        sharded_grads = {}  # id(param) -> its shard's .grad, kept aside for the block
        try:
            for shard in shards:  # one unit's full copy at a time on the compute device
                full = shard.gather_master()
                full_grads = shard.gather_master_grads() if with_grads else ()
                for p, f in zip(shard.params, full if keep_full else ()):
                    p.data = f.cpu() if offload_to_cpu else f
                for p, g in zip(shard.params, full_grads if keep_full else ()):
                    sharded_grads[id(p)] = p.grad
                    p.grad = None if g is None else (g.cpu() if offload_to_cpu else g)
            gathered = True
            yield
        finally:
            for module, name, dtype in recast:
                module._buffers[name] = module._buffers[name].to(dtype)
            for unit in units:
                unit._summoned = unit._summoned_grads = False
                unit.training_state = TrainingState.IDLE
            for shard in shards:
                if writeback and gathered:
                    shard.write_back([p.data for p in shard.params])
                full_grads = [p.grad for p in shard.params]
                for p in shard.params:
                    if id(p) in sharded_grads:
                        p.grad = None  # full-shaped: reassigned once the shard is back
                for p, view in zip(shard.params, shard.shard_views(shard.flat_shard)):
                    p.data = view
                for p, lay, full_grad in zip(shard.params, shard.layouts, full_grads):
                    if id(p) in sharded_grads:
                        p.grad = _grad_after_summon(sharded_grads[id(p)], full_grad, lay,
                                                    shard.rank, writeback and gathered)
            with torch.enable_grad():  # views with autograd history, as the forward left
                for shard in exposed:
                    if shard.gathered:
                        shard.expose()
