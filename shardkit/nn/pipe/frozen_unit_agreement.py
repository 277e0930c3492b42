"""Whether the FSDP replicas of a stage run a micro-batch's backward through the same frozen
units (:class:`FrozenUnitAgreement`, mixed into :class:`~shardkit.nn.pipe.PlanSchedule`).

A backward gathers a unit whose parameters are all frozen only where it runs through the unit's
output, so replicas that differ there would gather it on one side only. During each forward
the autograd nodes of every frozen unit's outputs are recorded; before each backward the
replicas share which units and inputs it reaches. Communication: one all-reduce of
``units + MAX_TENSORS + 1`` elements per micro-batch over each frozen unit's group; nothing
where the stage holds no frozen unit with replicas. Memory: those nodes' references until the
micro-batch's backward.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from shardkit import distributed as dist
from shardkit.nn.pipe.autograd_graph import _inputs_reached, _nodes_needing_gradients


class FrozenUnitAgreement:
    """The executor's methods that record and compare, over a stage's FSDP
    replicas, the frozen units each backward runs through (see the module); mixed into
    :class:`~shardkit.nn.pipe.PlanSchedule`."""

    @contextlib.contextmanager
    def _recording_frozen_outputs(self, s: int, i: int):
        """While stage ``s`` runs micro-batch ``i`` forward: the autograd nodes of each of its
        frozen FSDP units' outputs (none for a unit not called, or whose outputs do not
        require grad: no backward gathers it), or ``None`` for a unit called under
        ``no_grad`` (inside activation checkpointing: what its backward does is unknown
        here), for :meth:`_replicas_reach_alike`. Nothing where the stage holds none."""
        units = self._frozen_units[s]
        if not units:
            yield
            return
        nodes = [set() for _ in units]

        def record(k, _module, _args, output):
            if not torch.is_grad_enabled():
                nodes[k] = None
            elif nodes[k] is not None:
                nodes[k] |= {get_gradient_edge(t).node for t in tree_flatten(output)[0]
                             if isinstance(t, torch.Tensor) and t.requires_grad}

        handles = [unit.register_forward_hook(functools.partial(record, k))
                   for k, (_, unit) in enumerate(units)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._frozen_outputs[(s, i)] = nodes

    def _replicas_reach_alike(self, s: int, i: int, activation, roots: list) -> bool:
        """Whether stage ``s``'s replicas agree on which of its frozen FSDP units micro-batch
        ``i``'s backward runs through (else ``True`` at no cost, where it holds none).

        Note: a backward gathers a frozen unit only where it runs through the unit's output,
        that is where a path leads from there to something needing a gradient (a trainable
        parameter, or the stage's input): a stage that ignores its input on one replica and
        uses it on another may gather a unit on one side only (gloo aborts both). So every
        replica shares, before this backward, whether it runs through each unit, which inputs
        it reaches, and whether it called a unit under ``no_grad`` (inside activation
        checkpointing, where what the backward gathers is unknown here): one all-reduce of
        ``units + MAX_TENSORS + 1`` elements over each frozen unit's group, on every replica.
        Where they differ on a unit (or, with a unit unknown somewhere, on an input) every
        replica skips this backward alike (no unit gathers or reduce-scatters for it) and
        fails the step. A unit that every replica's backward runs through (a trainable layer
        before it) is no reason to refuse, whatever the input."""
        units = self._frozen_units[s]
        if not units:
            return True
        outputs = self._frozen_outputs.pop((s, i), None) or [set() for _ in units]
        needed = _nodes_needing_gradients(roots, activation)
        runs = [float(bool(nodes and nodes & needed)) for nodes in outputs]
        unknown = float(any(nodes is None for nodes in outputs))
        local = torch.tensor(runs + _inputs_reached(roots, activation) + [unknown],
                             device=self.stages[s].device)
        differ_units, differ_inputs, unknown_somewhere = [], set(), False
        groups = {id(unit.process_group): unit.process_group for _, unit in units}
        for group in groups.values():  # one per group, in module order
            total = local.clone()
            dist.all_reduce(total, group=group)
            size, total = dist.get_world_size(group), total.tolist()
            split = [k for k, v in enumerate(total[:-1]) if 0 < v < size]
            differ_units += [units[k][0] for k in split
                             if k < len(units) and units[k][1].process_group is group]
            differ_inputs.update(k - len(units) for k in split if k >= len(units))
            unknown_somewhere |= total[-1] > 0  # then the inputs decide
        if not differ_units and not (unknown_somewhere and differ_inputs):
            return True
        names = ", ".join(differ_units or [n for n, _ in units])
        what = f"whether its backward reaches its input {sorted(differ_inputs)} (the stage " \
            f"ignores it on some replicas only) and " if differ_inputs else "whether its " \
            "backward "
        self._fail_at(s, i, f"its replicas (FSDP's data-parallel ranks) disagree on {what}"
                            f"runs through FSDP units whose parameters are all frozen "
                            f"({names}), which a backward gathers only where it reaches "
                            f"them: their collectives would not pair. Use the input alike on "
                            f"every replica, or leave the frozen layers in the stage's outer "
                            f"unit (kept gathered from forward to backward)")
        return False
