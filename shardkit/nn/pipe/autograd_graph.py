"""Walks of a micro-batch's autograd graph for the pipeline executor
(:class:`~shardkit.nn.pipe.PlanSchedule`): the nodes below a backward's roots, which of a stage's
inputs and parameters a backward from them reaches, and which nodes it runs. Local (no
communication); time linear in the graph's nodes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.graph import get_gradient_edge

from shardkit.nn.pipe.p2p import MAX_TENSORS


def _graph_nodes(roots: list) -> set:
    """The autograd nodes below ``roots`` (theirs included)."""
    stack = [get_gradient_edge(r).node for r in roots if r.requires_grad]
    seen = set(stack)
    while stack:
        for child, _ in stack.pop().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def _inputs_reached(roots: list, activation) -> list:
    """``1.0`` for each of the first ``MAX_TENSORS`` of ``activation``'s tensors requiring
    grad that a backward from ``roots`` reaches, else ``0.0``."""
    nodes = _graph_nodes(roots)
    reached = [0.0] * MAX_TENSORS
    for k, a in enumerate(activation[:MAX_TENSORS]):
        if isinstance(a, torch.Tensor) and a.requires_grad and get_gradient_edge(a).node in nodes:
            reached[k] = 1.0
    return reached


def _nodes_needing_gradients(roots: list, activation) -> set:
    """The autograd nodes below ``roots`` that a backward from them runs: those with a path
    to a leaf requiring grad (a trainable parameter's or input's ``AccumulateGrad``) or to
    one of ``activation``'s tensors requiring grad."""
    targets = {get_gradient_edge(a).node for a in activation
               if isinstance(a, torch.Tensor) and a.requires_grad}
    needed, done = set(), set()
    stack = [(get_gradient_edge(r).node, False) for r in roots if r.requires_grad]
    while stack:  # post-order, so that a node is decided after its children
        node, expanded = stack.pop()
        if node in done:
            continue
        children = [child for child, _ in node.next_functions if child is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for child in children if child not in done)
            continue
        done.add(node)
        if node in targets or hasattr(node, "variable") or \
                any(child in needed for child in children):
            needed.add(node)
    return needed


def _reaches_a_parameter(roots: list, params: set) -> bool:
    """Whether a backward from ``roots`` accumulates into a parameter whose ``id`` is in
    ``params``."""
    return any(id(getattr(n, "variable", None)) in params for n in _graph_nodes(roots))


def _reached(real: Optional[list], tensors, grads: list) -> list:
    """``grads`` of ``tensors``, ``None`` where a backward from the ``real`` roots alone
    (``None``: every root was real) would not reach the tensor (zeros fed for the others
    reached it)."""
    if real is None:
        return list(grads)
    nodes = _graph_nodes(real)
    return [g if g is not None and isinstance(t, torch.Tensor) and t.requires_grad
            and get_gradient_edge(t).node in nodes else None for t, g in zip(tensors, grads)]
