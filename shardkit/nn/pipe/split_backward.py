"""Backward split in two passes, for any stage module, through autograd.

A zero-bubble schedule runs each micro-batch's backward in two parts: **B**, the gradient of the
stage's input (the previous stage waits for it), and **W**, the gradients of the stage's
parameters (nobody waits for them, so they fill the bubble). :func:`backward_input` runs B and
returns a :class:`WeightGradPass` that runs W later. No layer type is special: the split is found
on the autograd graph of the micro-batch.

How: walk the graph from the roots (the stage outputs or the loss). A node *reaches the input* when
a path of ``next_functions`` leads from it to a stage input. For every trainable parameter, follow
the graph back from its gradient accumulator towards the roots until the first nodes that reach the
input: these *frontier* nodes (the ``Addmm`` of a ``Linear``, the ``NativeLayerNorm`` of a
``LayerNorm``, the ``Add`` of a bias) are where the input path and the parameter path meet. B asks
autograd for the input gradient only (it computes, at each frontier node, only the outputs the
input needs) and records with a pre-hook the gradient arriving at every frontier node. W starts
autograd again at the frontier nodes with those recorded gradients and asks for the parameters'
gradients only, one call per group of parameters that share frontier nodes, so the input path is
not walked twice. Where a stage input does not require grad (the first stage), nothing reaches the
input: the roots are the frontier, B does nothing and W is the whole backward.

Note: one group can hold two frontier nodes of which one lies below the other on the input path (a
tied weight used at two depths). W, started at both, would send the upper node's gradient down to
the lower one on top of the lower one's recorded total; a pre-hook on the lower node replaces what
arrives with the recorded total, so nothing is counted twice. The walk between the two may cross
other groups' frontier nodes, so such a W pass keeps the graph's buffers until its last group.

Memory: B keeps the micro-batch's graph (``retain_graph``), so its saved activations live until
W: the schedule decides how many micro-batches wait for their W. Plus the recorded gradients, one
tensor per frontier node output (about one activation per parameterised layer). No communication.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["backward_input", "WeightGradPass", "GradientSink"]


def _grad_node(t: torch.Tensor) -> Optional[Node]:
    """The node a gradient for ``t`` flows into (its grad_fn, or its accumulator if a leaf)."""
    if not t.requires_grad:
        return None
    return get_gradient_edge(t).node


def _graph(roots: Sequence[Node]) -> dict:
    """Each node below ``roots`` (roots included) mapped to its parents."""
    parents, seen = {}, set()
    stack = [n for n in roots if n is not None]
    for n in stack:
        seen.add(n)
        parents.setdefault(n, [])
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents.setdefault(child, []).append(node)
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return parents


def _reaching(targets: set, parents: dict) -> set:
    """Nodes from which some node of ``targets`` can be reached (targets included)."""
    found, stack = set(), [t for t in targets if t in parents]
    found.update(stack)
    while stack:
        node = stack.pop()
        for parent in parents[node]:
            if parent not in found:
                found.add(parent)
                stack.append(parent)
    return found


class _Groups:
    """Union-find over frontier nodes: parameters meeting the input path at a shared node go
    into one W call."""

    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] is not x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


class WeightGradPass:
    """The W half of one micro-batch's backward: :meth:`run` returns each parameter's gradient
    of this micro-batch (and frees the graph). Runs at most once."""

    def __init__(self, groups: list, recorded: dict, root_grads: dict):
        self._groups = groups          # [(frontier nodes, params)]
        self._recorded = recorded      # frontier node -> tuple of gradients at its outputs
        self._root_grads = root_grads  # root node -> its gradient tuple (roots in the frontier)

    def run(self, into_grad: bool = False) -> dict:
        """``{parameter: gradient}`` for the parameters this micro-batch reached; with
        ``into_grad`` the gradients are added to ``.grad`` instead (by the parameters' own
        accumulators, as a plain backward would: no extra buffer, gradient hooks fire) and the
        dict is empty."""
        if self._groups is None:
            raise RuntimeError("WeightGradPass.run: this W pass already ran")
        out: dict = {}
        recorded = {**self._root_grads, **self._recorded}
        # a group with several frontier nodes walks the input path between them, through other
        # groups' frontier nodes: keep every buffer until the last group has run
        retain = any(len(frontier) > 1 for frontier, _ in self._groups)
        for frontier, params in self._groups:
            edges, grads = [], []
            for node in frontier:
                for i, g in enumerate(recorded.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            clamps = []
            if len(frontier) > 1:  # see the module's Note
                clamps = [node.register_prehook(lambda _g, saved=recorded.get(node, ()): saved)
                          for node in frontier if node in recorded]
            try:
                if into_grad:
                    torch.autograd.backward(edges, grads, inputs=params, retain_graph=retain)
                    continue
                got = torch.autograd.grad(edges, [get_gradient_edge(p) for p in params], grads,
                                          retain_graph=retain, allow_unused=True)
            finally:
                for handle in clamps:
                    handle.remove()
            for p, g in zip(params, got):
                if g is not None:
                    out[p] = g if p not in out else out[p] + g
        self._groups = self._recorded = self._root_grads = None
        return out


def _frontier_of(param_node: Node, parents: dict, input_side: set, roots: set) -> set:
    """The first nodes that reach the input on every path from ``param_node`` up to the roots
    (a root that does not reach the input counts as one)."""
    frontier, seen, stack = set(), {param_node}, [param_node]
    while stack:
        node = stack.pop()
        if node in roots and node not in input_side:
            frontier.add(node)
        for parent in parents[node]:
            if parent in input_side:
                frontier.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return frontier


def _weight_groups(params: list, parents: dict, input_side: set, roots: set) -> list:
    """``[(frontier nodes, params)]``: parameters whose frontiers share a node form one group."""
    groups, frontiers = _Groups(), {}
    for p in params:
        start = _grad_node(p)
        if start not in parents:
            continue  # not used by this micro-batch
        frontier = sorted(_frontier_of(start, parents, input_side, roots), key=id)
        if frontier:
            frontiers[p] = frontier
            for node in frontier[1:]:
                groups.union(frontier[0], node)
    by_root: dict = {}
    for p, frontier in frontiers.items():
        nodes, members = by_root.setdefault(groups.find(frontier[0]), (set(), []))
        nodes.update(frontier)
        members.append(p)
    return [(sorted(nodes, key=id), members) for nodes, members in by_root.values()]


def _root_gradients(root_edges: list, grads: list, frontier: set, input_side: set) -> dict:
    """For roots in the frontier that do not reach the input: node -> gradient tuple (the
    gradients given for them), which W starts from."""
    out: dict = {}
    for edge, g in zip(root_edges, grads):
        if edge.node in frontier and edge.node not in input_side:
            slots = list(out.get(edge.node, ()))
            slots += [None] * (edge.output_nr + 1 - len(slots))
            old = slots[edge.output_nr]
            slots[edge.output_nr] = g if old is None else old + g
            out[edge.node] = tuple(slots)
    return out


def backward_input(roots: Sequence[torch.Tensor], grads: Optional[Sequence], inputs: Sequence,
                   params: Sequence[torch.Tensor]) -> tuple[list, WeightGradPass]:
    """B: the gradients of ``inputs`` (``None`` where an input does not require grad or is not
    reached) for ``roots`` with gradients ``grads`` (``None``: ones, for a loss), and the W pass
    that computes ``params``' gradients later. Parameters that do not require grad are skipped.
    """
    roots = [r for r in roots if r.requires_grad]
    if grads is None:
        grads = [torch.ones_like(r) for r in roots]
    root_edges = [get_gradient_edge(r) for r in roots]
    root_nodes = list(dict.fromkeys(e.node for e in root_edges))
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = list(dict.fromkeys(p for p in params if p.requires_grad))  # tied: once
    parents = _graph(root_nodes)
    input_side = _reaching({_grad_node(inputs[i]) for i in wanted}, parents)
    groups = _weight_groups(params, parents, input_side, set(root_nodes))
    frontier = {node for nodes, _ in groups for node in nodes}
    recorded: dict = {}
    handles = [node.register_prehook(lambda g, node=node: recorded.__setitem__(node, g))
               for node in frontier if node in input_side]
    result: list = [None] * len(inputs)
    try:
        if wanted:
            got = torch.autograd.grad(roots, [inputs[i] for i in wanted], grads,
                                      retain_graph=True, allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = g
    finally:
        for handle in handles:
            handle.remove()
    root_grads = _root_gradients(root_edges, grads, frontier, input_side)
    return result, WeightGradPass(groups, recorded, root_grads)


class GradientSink:
    """Where W passes put parameter gradients during a step.

    Without gradient hooks on the parameters, each W pass adds straight into ``.grad`` (through
    the parameters' accumulators, like a plain backward). When some parameter carries one
    (``register_hook`` / ``register_post_accumulate_grad_hook``, as data-parallel wrappers
    install), the step's gradients are summed in private buffers and
    :meth:`deliver` hands each parameter its total once, through autograd, so those hooks fire
    once per parameter per step. Memory: one gradient-sized buffer per hooked parameter.
    """

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(dict.fromkeys(p for p in params if p.requires_grad))
        self.deferred = any(_has_grad_hooks(p) for p in self.params)
        self._totals: dict = {}

    def run(self, weight_pass: WeightGradPass) -> None:
        """Run one micro-batch's W pass into ``.grad`` (or into the step's totals)."""
        if not self.deferred:
            weight_pass.run(into_grad=True)
            return
        for p, g in weight_pass.run().items():
            self._totals[p] = g if p not in self._totals else self._totals[p] + g

    def deliver(self) -> None:
        """Hand the summed gradients to the parameters through their accumulators (hooks run)."""
        if not self._totals:
            return
        params = list(self._totals)
        views = [p.view_as(p) for p in params]
        torch.autograd.backward(views, [self._totals[p] for p in params])
        self._totals = {}


def _has_grad_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_backward_hooks", None)) or bool(
        getattr(param, "_post_accumulate_grad_hooks", None))
