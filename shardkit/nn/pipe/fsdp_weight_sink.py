"""W passes of a pipeline stage wrapped in :class:`~shardkit.nn.data_parallel.
FullyShardedDataParallel`: how zero-bubble schedules (B and W split) compose with FSDP.

FSDP computes with *views* of each unit's gathered flat buffer ``full``; autograd gives the views'
gradients to the split of ``full`` (one node per unit and forward), whose backward hands them to
the unit, which reduce-scatters them and frees ``full``. Under a split backward:

- **F** is FSDP's forward, unchanged (gather, compute, free unless the unit is the root).
- **B** asks autograd for the stage input's gradient and for the gradients arriving at each
  parameter's first use that reads data (``backward_input(..., split_at_parameters=True)``:
  the ``Addmm`` of a ``Linear``, wherever it lies, on the path to the input or not). FSDP's
  pre-backward hooks on the units' outputs gather each unit as the gradient reaches it (B
  needs the weights: ``dX = dY W``). The split nodes lie on the parameters' side, so B never
  runs them: no reduce-scatter. FSDP's end-of-backward callback frees every unit of the stage
  when B ends.
- **W** asks autograd for the gradients at the split nodes' outputs
  (:func:`~shardkit.nn.data_parallel.flat_param.gathered_param_edges`), without running them,
  and :class:`ShardedGradientSink` hands each unit the micro-batch's gradients of all its
  parameters at once, as a plain backward would: the unit reduce-scatters them (asynchronously,
  into the sharded ``.grad``: once per unit per micro-batch, like FSDP under 1F1B) unless inside
  ``no_sync()``, where they accumulate unsharded until the next synchronised step.

Weights in W. Most weight gradients read only the layer's input and output gradient (``g^T x`` of
a linear layer, an embedding's rows, the bias's sum): such a W runs while the unit stays sharded.
Where an op of W is not known to be of that kind (a ``LayerNorm``'s ``native_layer_norm_backward``
reads its weight's storage; an op nonlinear in its weight; a product of two parameters), the units
of that autograd call are gathered for it
(:meth:`~shardkit.nn.data_parallel.flat_param.FlatParamShard.start_gather`) and freed after the
unit's last such call in this W.

Note: W's ops, and so its gathers and reduce-scatters, depend on the parameters' uses only, never
on the path to the stage input, because B stops at those uses (``split_at_parameters``). So the
replicas of a stage run the same collectives when the stage ignores its input (or some of it) on
one replica and uses it on another, or when the input needs a gradient on one replica only; had
W started where the parameters' paths meet the input path, a replica whose stage ignored its
input would have run its whole backward in W (gathering for it) and the other not.

Memory, per stage: between B and W nothing is gathered (FSDP's end-of-backward callback frees the
stage's units when B ends; a root unit is gathered again by the next F, as without split). During
one B, each unit stays gathered from the moment the gradient reaches it to the end of that B: at
most the stage's units (compute dtype) at its end, what FSDP's root unit holds anyway when the
stage is one unit. During one W, at most the units whose weight-reading ops that W runs, each from
its first to its last such autograd call. Each waiting W keeps its micro-batch's graph (the saved
activations, which reference ``full`` but not its storage) and the gradients B recorded. Outside
``no_sync`` no unsharded gradient outlives its W's reduce-scatter.

Communication per step per unit: F's and B's all-gathers as FSDP under 1F1B (3Ψ_u(N-1)/N with
resharding), one reduce-scatter per micro-batch, plus one all-gather per micro-batch for units
whose W reads weights. Every data-parallel rank of a stage runs the same plan over the same
graph, so the collectives are issued in the same order everywhere.

An output of the stage that the next stage gave no gradient (it did not use it) still gets
zeros in B, so that the plan stays the replicas'; W hands the units only the gradients that the
real output gradients reached (:meth:`ShardedGradientSink.weight_targets`), so a parameter no
replica's backward reached keeps ``.grad`` ``None``, as in one process.

Limits: activation checkpointing inside a unit is not supported under a split backward (B's
recomputation builds views the W edges, found before B, do not name). The units a stage's
forward runs, and the ops using each parameter, must be the same on every replica (as FSDP
itself requires); what reaches the stage input may differ.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from shardkit.nn.data_parallel.flat_param import gathered_param_edges
from shardkit.nn.data_parallel.fully_sharded import backward_hooks_paused
from shardkit.nn.pipe.split_backward import PASS_THROUGH, WeightGradPass

__all__ = ["ShardedGradientSink", "stage_is_fully_sharded", "params_outside_fsdp",
           "frozen_units_with_replicas"]

# Ops whose gradient for the parameter's side reads only the other operand (the input side).
_FRONTIER_WITHOUT_WEIGHTS = frozenset({"AddmmBackward0", "MmBackward0", "EmbeddingBackward0",
                                       "AddBackward0", "SubBackward0", "MulBackward0"})
# Of those, the products, with the positions of their two factors among their inputs: each
# factor's gradient reads the other, a weight when both are parameters.
_FACTORS = {"AddmmBackward0": (1, 2), "MmBackward0": (0, 1), "MulBackward0": (0, 1)}


class ShardedGradientSink:
    """Where the W passes of a stage wrapped in FSDP put their gradients (see the module
    docstring): each W's gradients go to their units, which reduce-scatter them (or accumulate
    them inside ``no_sync``); :meth:`deliver` waits for the last reduce-scatters at the end of
    the step. Same interface as :class:`~shardkit.nn.pipe.split_backward.GradientSink`.

    Memory: nothing beyond FSDP's own (see the module docstring for what W gathers).
    """

    def __init__(self):
        self._owners: dict = {}    # GradientEdge -> (shard, index), for the waiting W passes
        self._touched: dict = {}   # shards that got gradients this step, in order
        self._unreached: set = set()  # edges only zero output gradients reached (see W)

    def weight_targets(self, roots: Sequence[torch.Tensor],
                       real: Optional[Sequence[torch.Tensor]] = None) -> list:
        """The gradient edges B hands to W: every trainable parameter view the micro-batch's
        graph below ``roots`` used. ``real``: the roots whose output gradient is real when
        the others were given zeros (an output the next stage did not use): W computes every
        edge, so that each replica runs the same plan, but hands the units only the gradients
        of the views ``real`` reach, as one process's backward would (the others count as
        not reached: ``.grad`` ``None`` where no replica reached them)."""
        edges = gathered_param_edges(roots)
        self._owners.update(edges)
        if real is not None:
            reached = gathered_param_edges(real)
            self._unreached.update(e for e in edges if e not in reached)
        return list(edges)

    def run(self, weight_pass: WeightGradPass) -> None:
        """Run one micro-batch's W pass and hand each unit its gradients."""
        groups = weight_pass.groups()
        needs = [self._shards_needing_weights(frontier, params, below)
                 for frontier, params, below in groups]
        last = {shard: k for k, shards in enumerate(needs) for shard in shards}
        gathered_here: set = set()

        @contextlib.contextmanager
        def around(k):
            for shard in needs[k]:
                if not shard.gathered:
                    shard.start_gather()
                    shard.finish_gather()
                    gathered_here.add(shard)
            try:
                yield
            finally:
                for shard in needs[k]:
                    if last[shard] == k and shard in gathered_here:
                        shard.free_full()

        # the units' own hooks would gather a unit whose output W starts at (the Addmm of a
        # unit's last Linear), weights or not, and free every unit when an autograd call ends
        with backward_hooks_paused():
            grads = weight_pass.run(around_group=around)
        by_shard: dict = {}
        for edge in (p for _, params, _ in groups for p in params):
            shard, index = self._owners.pop(edge)
            slots = by_shard.setdefault(shard, [None] * len(shard.params))
            g = None if edge in self._unreached else grads.get(edge)
            self._unreached.discard(edge)
            if g is not None:
                g = g.reshape(-1)  # the unit takes flat gradients, as its split's backward gives
                slots[index] = g if slots[index] is None else slots[index] + g
        for shard, slots in by_shard.items():
            shard.receive_grads(slots)
            self._touched[shard] = None

    def _shards_needing_weights(self, frontier, params, below) -> list:
        # several frontier nodes: W walks the input path between them (a weight used twice,
        # ``w @ tanh(w @ x)``), whose ops read weights (``dX = dY W``)
        reads = len(frontier) > 1 or any(_reads_weights(n, below) for n in frontier) or \
            any(type(n).__name__ not in PASS_THROUGH for n in below)
        if not reads:
            return []
        return list(dict.fromkeys(self._owners[p][0] for p in params))

    def deliver(self) -> None:
        """Wait for this step's reduce-scatters (and replica all-reduces) and add them to the
        shards' ``.grad``; the units are left sharded."""
        shards = list(self._touched)
        for shard in shards:
            shard.replicate_reduce()
        for shard in shards:
            shard.finish_reduce()
            shard.free_full()
        self._touched, self._owners = {}, {}  # edges of parameters no W reached
        self._unreached = set()


def _reads_weights(node, below: set) -> bool:
    """Whether W's run of frontier ``node`` (its parameter-side gradients) reads a weight: an
    op not known to read only its other operand, or a product whose two factors are both on
    the parameters' side (in ``below``)."""
    kind = type(node).__name__
    if kind not in _FRONTIER_WITHOUT_WEIGHTS:
        return True
    factors = [node.next_functions[k][0] for k in _FACTORS.get(kind, ())]
    return bool(factors) and all(f is not None and f in below for f in factors)


def stage_is_fully_sharded(module: torch.nn.Module) -> bool:
    """Whether a stage module is or holds a FullyShardedDataParallel unit."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def params_outside_fsdp(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s trainable parameters that no FullyShardedDataParallel unit in it
    owns (empty when there is no unit: nothing is sharded)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
    owned = {id(p) for unit in units for p in unit.parameters()}
    if not units:
        return []
    return [name for name, p in module.named_parameters()
            if p.requires_grad and id(p) not in owned]


def frozen_units_with_replicas(module: torch.nn.Module) -> list[tuple[str, object]]:
    """``(name, unit)`` of each FullyShardedDataParallel unit nested in ``module`` (not the
    outermost) whose parameters are all frozen and that is sharded over several ranks (its
    ``process_group``), in module order. A backward gathers such a unit only where it runs
    through the unit's output, which depends on what each replica's graph reaches."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel
    from shardkit.nn.data_parallel.fsdp_state_dict import clean_name

    found = []
    for name, unit in module.named_modules():
        if not name or not isinstance(unit, FullyShardedDataParallel) or unit.world_size < 2:
            continue
        params = list(unit.parameters())
        if params and not any(p.requires_grad for p in params):
            found.append((clean_name(name), unit))
    return found
