"""Reentrant activation checkpoints inside
:class:`~shardkit.nn.data_parallel.fully_sharded.FullyShardedDataParallel` units: a
checkpointed region gathers its unit before it is recomputed in backward; the walk over a
unit's output graph that finds the reentrant checkpoint nodes its forward made (and which of
them only recompute nested units); and the unit's methods (:class:`FSDPReentrantCheckpointMixin`)
that keep it gathered, or gather it again, for the later checkpoints of one backward and reduce
their gradients once. Costs are stated per method; the gathers and reduce-scatters are the
unit's own."""

from __future__ import annotations

import copy
import functools
import inspect
import weakref
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointFunction as _ReentrantCheckpoint

from shardkit.checkpointing import _CheckpointFunction as _ShardkitReentrantCheckpoint
from shardkit.nn.checkpoint.checkpoint_activations import is_recomputing
from shardkit.nn.data_parallel.flat_param import FlatParamShard
from shardkit.nn.data_parallel.fsdp_hook_control import _BACKWARD_HOOKS_PAUSED, _eager
from shardkit.nn.data_parallel.fsdp_unit_modules import _inner_units
from shardkit.utils.weak_hooks import weakly_bound

if TYPE_CHECKING:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel


def _gather_before_recomputations(unit: FullyShardedDataParallel, modules) -> None:
    """Make each of ``modules`` (the unit's own) that ``checkpoint_wrapper`` made a checkpointed
    region gather the unit before the region is recomputed in backward.

    Note: the unit gathers (and exposes its parameters for the recomputation) when backward
    reaches its outputs. A gradient can enter the region elsewhere first: a tensor the region
    stashed for a later unit (a ``@skippable`` stash popped there, a value kept on the
    module), whose backward needs the recomputation. It ran with the unit's shards
    ("mat1 and mat2 shapes cannot be multiplied"); torch FSDP1 gathers in the recomputation
    through its forward pre-hook on the wrapped module."""
    for m in modules:
        forward = vars(m).get("_shardkit_unwrapped_forward")
        if forward is not None and not isinstance(forward, _GatheredWhenRecomputed):
            m._shardkit_unwrapped_forward = _GatheredWhenRecomputed(forward, unit)


class _GatheredWhenRecomputed:
    """A checkpointed region's forward that, called inside a backward (its recomputation),
    first runs the unit's backward gather (a no-op once backward reached the unit's outputs).
    The unit is held weakly (the module holds this, the unit holds the module)."""

    def __init__(self, forward, unit: FullyShardedDataParallel):
        self.forward = forward
        self.unit = weakref.ref(unit)

    def __call__(self, *args, **kwargs):
        unit = self.unit()
        if unit is not None and torch._C._current_graph_task_id() != -1:
            unit._gather_for_hooks(None, None)
        return self.forward(*args, **kwargs)

    @property
    def __signature__(self):
        return inspect.signature(self.forward)

    def __deepcopy__(self, memo: dict) -> "_GatheredWhenRecomputed":
        unit = self.unit()
        return _GatheredWhenRecomputed(copy.deepcopy(self.forward, memo),
                                       memo.get(id(unit), unit))

    def __reduce__(self):
        return _GatheredWhenRecomputed, (self.forward, self.unit())


# the autograd node types of the reentrant checkpoints (see _reentrant_checkpoints_in)
_REENTRANT_CHECKPOINT_NODES = (_ReentrantCheckpoint._backward_cls,
                               _ShardkitReentrantCheckpoint._backward_cls)

# key (with the unit's id) of a unit's forward span in its outputs' autograd node metadata
_FORWARD_SPAN = "shardkit.fsdp.forward_span"


def _reentrant_checkpoints_in(output_node, first: int, end: int,
                              nested_ids: frozenset = frozenset()) -> tuple[list, list]:
    """The nodes of reentrant activation checkpoints (torch's ``checkpoint(fn, x,
    use_reentrant=True)``, ``shardkit.checkpointing.checkpoint``) reachable backwards from
    ``output_node`` that a forward made while the autograd sequence numbers went from
    ``first`` to ``end`` (older nodes are not walked), and the forward spans of the units
    whose ids are in ``nested_ids`` that the walk met on their outputs' nodes. Local."""
    found, spans, seen, todo = [], [], set(), [output_node]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or node._sequence_nr() < first:
            continue
        seen.add(id(node))
        if isinstance(node, _REENTRANT_CHECKPOINT_NODES) and node._sequence_nr() < end:
            found.append(node)
        if nested_ids:
            spans.extend(span for key, span in node.metadata.items()
                         if isinstance(key, tuple) and len(key) == 2
                         and key[0] == _FORWARD_SPAN and key[1] in nested_ids)
        todo.extend(following for following, _ in node.next_functions)
    return found, spans


def _runs_nested_units_only(node, nested_spans: list, nested_modules: set) -> bool:
    """Whether the reentrant checkpoint ``node`` recomputes code of nested units only, so
    that its backward delivers no gradient to the unit whose forward made it: it was made
    inside a nested unit's forward (one of ``nested_spans``), or it runs a nested unit or a
    module inside one (``checkpoint(self.layers[i], h)`` with the layers wrapped,
    ``functools.partial``s and bound methods such as HF's ``layer.__call__`` looked through;
    ``nested_modules``: the ids of those modules). Any other function (a lambda, a closure)
    may read the unit's parameters and counts as reading them.

    Note: counted as a use of the unit, such a checkpoint kept the unit's gradients unreduced
    and the unit gathered through it (see
    :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel._hold_for_later_checkpoints`): a root
    whose checkpointed LM head ran first in backward held the head's whole gradient through the
    backward of every checkpointed layer unit, for no collective saved. Local."""
    seq = node._sequence_nr()
    if any(first <= seq < end for first, end in nested_spans):
        return True
    module = _module_run_by(getattr(node, "run_function", None))
    return module is not None and id(module) in nested_modules


def _module_run_by(function) -> Optional[nn.Module]:
    """The module a checkpoint's function runs: the module itself, the module of a bound
    method (``layer.__call__``, ``layer.forward``), through ``functools.partial``; else
    ``None``."""
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


class FSDPReentrantCheckpointMixin:
    """The reentrant-checkpoint methods of :class:`~shardkit.nn.data_parallel.fully_sharded.
    FullyShardedDataParallel` (needs its ``_root``, ``_shard``, ``_pre_backward_hook``,
    ``_release_after_backward``, ``_reduce_and_release`` and the checkpoint bookkeeping its
    constructor sets up): how a unit recomputed by several reentrant checkpoints in one
    backward is gathered for each and reduced once."""

    def _gather_before_later_checkpoints(self, task: int) -> None:
        """Outer backward (graph task ``task``), in the pre-backward hook of one of the unit's
        outputs, when the backward reads the parameters only through reentrant activation
        checkpoints inside the unit: put a pre-hook on each such checkpoint's node behind that
        output that this backward will run, which gathers and exposes the unit again if it
        was freed meanwhile, and count those checkpoints, so that the gradients of all of them
        go in one reduce-scatter (see :meth:`_hold_for_later_checkpoints`).

        Note: a reentrant checkpoint's backward that delivers the unit's last gradients
        reduces and frees the unit (see
        :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel._on_grad_ready`). A later
        checkpoint whose recomputation calls a submodule holding the parameters gathers it again
        through that call (:meth:`_regather_for_later_recomputations`), but one that reads them
        in the wrapped module's own code (``checkpoint(lambda t: F.linear(t, self.weight), x,
        use_reentrant=True)``, or ``self.proj.weight`` of a plain submodule not called)
        announces nothing: it read this rank's row shard (a shape error, or wrong numbers
        where the shapes broadcast). Reentrant checkpoints are torch's and
        ``shardkit.checkpointing.checkpoint``'s. Units that stay gathered (the root,
        ``reshard_after_forward=False``) are exposed again instead
        (:meth:`_expose_for_later_recomputations`); freed units are gathered just before the
        checkpoint's recomputation (once: the first one's backward keeps the unit gathered
        for the others), so the memory stays that of one unit. Cost: one walk over
        the autograd nodes the unit's forward made, per backward, for units whose backward
        reads no forward views; the unit's one all-gather and one reduce-scatter per
        backward, however many checkpoints recompute it. Checkpoints that recompute nested
        units only are left to those units (see :func:`_runs_nested_units_only`). A
        collective: every rank runs the same checkpoints."""
        if task != self._root._backward_task or self._backward_reads_forward_views is not False \
                or self._shard is None:
            return
        output_node = torch._C._current_autograd_node()  # the output whose hook runs
        span = None if output_node is None else \
            output_node.metadata.get((_FORWARD_SPAN, id(self)))
        if span is None:
            return
        gather = weakly_bound(self._gather_before_a_checkpoint)
        nested = _inner_units(self.module)
        checkpoints, nested_spans = _reentrant_checkpoints_in(
            output_node, *span, nested_ids=frozenset(id(unit) for unit in nested))
        nested_modules = {id(m) for unit in nested for m in unit.modules()} \
            if checkpoints and nested else set()
        for node in checkpoints:
            if id(node) not in self._checkpoint_gathers \
                    and not _runs_nested_units_only(node, nested_spans, nested_modules) \
                    and torch._C._will_engine_execute_node(node):
                self._checkpoints_to_run.add(id(node))
                self._checkpoint_gathers[id(node)] = (
                    node.register_prehook(_eager(functools.partial(gather, id(node)))),
                    node.register_hook(_eager(weakly_bound(self._free_after_checkpoint))))

    def _gather_before_a_checkpoint(self, node_id: int, grad_outputs) -> None:
        """Pre-hook of the reentrant checkpoint's node ``node_id`` (see
        :meth:`_gather_before_later_checkpoints`): its backward begins; unless the root's
        backward is over, count it as running (see :meth:`_free_after_checkpoint`) and gather
        and expose the unit unless it is exposed."""
        self._checkpoints_to_run.discard(node_id)
        root, shard = self._root, self._shard
        if root is None or shard is None or not root._final_callback_queued:
            return None
        self._checkpoint_backwards_running += 1
        if not shard._exposed:
            self._pre_backward_hook(None)
        return None

    def _free_after_checkpoint(self, grad_inputs, grad_outputs) -> None:
        """Post-hook of a reentrant checkpoint's node (see
        :meth:`_gather_before_later_checkpoints`): its backward is over; free the unit if a
        reduction inside it owed the free (see
        :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel._on_grad_ready`)."""
        self._checkpoint_backwards_running = max(0, self._checkpoint_backwards_running - 1)
        if self._checkpoint_backwards_running == 0 and self._free_owed:
            self._free_owed = False
            self._release_after_backward(self._shard)
        if self._grads_held_for_checkpoints and not self._checkpoints_to_run \
                and self._checkpoint_backwards_running == 0 and self._shard is not None:
            # the later checkpoints delivered nothing to the unit (they read a child unit's
            # parameters only): reduce what the earlier ones left
            self._reduce_and_release(self._shard, recomputed_only=True)
        return None

    def _hold_for_later_checkpoints(self, shard: FlatParamShard) -> None:
        """A reentrant checkpoint's backward delivered the unit's gradients while further
        checkpoints of the unit's forward are still to run in this backward (see
        :meth:`_gather_before_later_checkpoints`): keep the gradients for them, and the unit
        gathered, exposed afresh for their recomputations. The last one's delivery (or its
        node's end, :meth:`_free_after_checkpoint`; at the latest the root's end of backward)
        reduces the sum in one reduce-scatter.

        Note: before, each checkpoint's backward reduced and freed the unit and the next one
        gathered it again: ``k`` checkpoints over one unit (``checkpoint(self.attn, x)`` then
        ``checkpoint(self.mlp, h)`` in a wrapped block, or HF's reentrant gradient
        checkpointing of every layer of a model wrapped as one unit) cost ``k`` all-gathers
        and ``k`` reduce-scatters of the whole unit per backward, where a unit without
        checkpoints pays one of each. Memory: the unit's parameters and one unsharded
        gradient from the first checkpoint's backward to the last, as a unit without
        checkpoints holds them through its backward. Local: every rank runs the same
        checkpoints."""
        self._grads_held_for_checkpoints = True
        self._expose_for_later_recomputations(shard)

    def _drop_checkpoint_gathers(self) -> None:
        """End of a backward (finished or failed): remove the checkpoint hooks it put.
        Local."""
        for handles in self._checkpoint_gathers.values():
            for handle in handles:
                handle.remove()
        self._checkpoint_gathers = {}
        self._checkpoint_backwards_running = 0
        self._free_owed = False
        self._checkpoints_to_run = set()
        self._grads_held_for_checkpoints = False

    def _expose_for_later_recomputations(self, shard: FlatParamShard) -> None:
        """After a reentrant checkpoint's backward reduced the unit (see
        :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel._on_grad_ready`): keep it
        gathered until the end of backward, its parameters exposed afresh (views with history, of a
        new split), so that a later checkpoint recomputing code of the wrapped module itself reads
        them whole. Before, such a read (``F.linear(t, self.weight)`` in a second
        ``checkpoint(self.region, x, use_reentrant=True)`` of the root) got this rank's
        shard: no module call's pre-hook (:meth:`_regather_for_later_recomputations`) could
        gather it. Its gradient is reduced once more, as for a re-gathered unit, unless the
        checkpoint was counted beforehand (see :meth:`_hold_for_later_checkpoints`). Also for a
        unit whose parameters sit in plain submodules (a model wrapped as one unit under HF's
        reentrant gradient checkpointing): freed, it was all-gathered whole again before each
        later recomputation, for memory it keeps anyway. Memory: the unit stays gathered as it
        did from its forward on; the end of backward frees it. Local."""
        with torch.enable_grad():
            shard.expose()

    def _regather_for_later_recomputations(self, shard: FlatParamShard) -> None:
        """After a reentrant checkpoint's backward reduced and freed the unit: let a later
        recomputation in the same backward gather it again (once per unit, a forward pre-hook
        on each module holding its parameters).

        Note: a unit whose forward uses its parameters only inside two or more reentrant
        checkpoints (HF's ``gradient_checkpointing_enable(use_reentrant=True)`` on a model
        wrapped as one unit, its embedding frozen as in LoRA fine-tuning; a block running
        ``checkpoint(self.attn, ...)`` then ``checkpoint(self.mlp, ...)``) is recomputed once
        per checkpoint. The first recomputation's backward reduces and frees the unit; the
        next one read the shards (a shape error, or wrong numbers where the shapes happen to
        broadcast). Now its first module call gathers the unit again, and its gradient is
        reduced once more (one all-gather and one reduce-scatter per further checkpoint, the
        memory of one unit as before) where the checkpoints were not counted beforehand (see
        :meth:`_hold_for_later_checkpoints`). A collective: every rank recomputes the same
        checkpoints in the same order."""
        if self._regathers_for_recomputations:
            return
        self._regathers_for_recomputations = True
        holders = {id(module): module for locs in shard.locations for module, _ in locs}
        for module in holders.values():
            module.register_forward_pre_hook(_eager(weakly_bound(self._gather_if_recomputing)))

    def _gather_if_recomputing(self, module: nn.Module, args) -> None:
        """Forward pre-hook (see :meth:`_regather_for_later_recomputations`): inside this
        root's backward, when the call is an activation checkpoint's recomputation, gather and
        expose the unit unless it is exposed (inside ``no_sync`` a unit that stays gathered is
        only hidden). Outside a backward, while exposed, or for any other forward run during
        a backward (a module called in a user's gradient hook, often on one rank only: a
        gather there is a collective the other ranks never join), nothing."""
        root, shard = self._root, self._shard
        if root is None or shard is None or shard._exposed or self._summoned \
                or _BACKWARD_HOOKS_PAUSED[0] or not root._final_callback_queued \
                or not is_recomputing():
            return
        self._pre_backward_hook(None)
