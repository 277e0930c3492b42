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

Matrix products: a parameter used once, as the weight of a matrix product (``addmm``/``mm``
with the weight transposed, which is what ``F.linear`` records, and its bias), needs in W only the
product's saved input ``x`` and the gradient ``g`` at its output: its gradient is ``g^T x``. B
captures ``g`` for those products (asking autograd for the gradient at the product's output, so
it works on a first stage whose input needs no gradient too), and W hands ``(x, g)`` to a
:class:`GradientSink`, which adds the products of several micro-batches in one ``addmm_`` into
``.grad`` (one weight-sized write instead of a weight-sized product plus an accumulation per
micro-batch). A dense ``embedding`` is handled alike: its indices and output gradient, one
``index_add_`` (instead of a vocabulary-sized zero fill and accumulation per micro-batch). These
are the ops autograd itself would run, read off its graph: no layer type is special, and
anything else (tied weights, norms, attention, padded embeddings) takes the generic path.

Memory: B keeps the micro-batch's graph (``retain_graph``), so its saved activations live until
W: the schedule decides how many micro-batches wait for their W. Plus the recorded gradients, one
tensor per frontier node output (about one activation per parameterised layer). A sink merging
``k`` micro-batches keeps, per matrix product, the input and output gradient of up to ``k - 1``
micro-batches whose graphs are already freed. No communication.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["backward_input", "WeightGradPass", "GradientSink", "ENOUGH_ROWS", "PASS_THROUGH"]

# Rows from which one micro-batch's weight-gradient product runs about as fast per row alone as
# merged with others (CPU, one thread, d = 512-2048: 13-15 us a row from 128 rows, 31 at 8)
ENOUGH_ROWS = 128

# Nodes that move a gradient between a parameter and its first real use without reading data
# (views, transposes, casts, the parameter's own node, FSDP's split of its gathered buffer).
PASS_THROUGH = frozenset({"ViewBackward0", "TBackward0", "UnsafeViewBackward0",
                          "ExpandBackward0", "ReshapeAliasBackward0", "ToCopyBackward0",
                          "AccumulateGrad", "_PiecesOfFullBackward"})


def _grad_node(t) -> Optional[Node]:
    """The node a gradient for ``t`` flows into (its grad_fn, or its accumulator if a leaf;
    a ``GradientEdge``'s node)."""
    if isinstance(t, GradientEdge):
        return t.node
    if not t.requires_grad:
        return None
    return get_gradient_edge(t).node


def _edge(param) -> GradientEdge:
    return param if isinstance(param, GradientEdge) else get_gradient_edge(param)


def _first_users(param, parents: dict) -> list:
    """The nodes a parameter's value flows into: for a ``GradientEdge``, only the users of that
    output of its node (a node with several outputs may carry several parameters)."""
    if not isinstance(param, GradientEdge):
        return parents[_grad_node(param)]
    return [n for n in parents[param.node]
            if any(child is param.node and k == param.output_nr
                   for child, k in n.next_functions)]


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

    def __init__(self, groups: list, recorded: dict, root_grads: dict, products: list = (),
                 input_side: Optional[set] = None):
        self._groups = groups          # [(frontier nodes, params)]
        self._recorded = recorded      # frontier node -> tuple of gradients at its outputs
        self._root_grads = root_grads  # root node -> its gradient tuple (roots in the frontier)
        self._products = list(products)  # [(product node, weight, bias or None)]
        self._input_side = input_side or set()  # nodes B walked (W runs none but the frontier)

    def groups(self) -> list:
        """``[(frontier nodes, params, nodes below the frontier)]``, one entry per autograd call
        W makes, in :meth:`run`'s order: the frontier nodes compute only their parameter-side
        gradients, the nodes below them (on the parameters' side: views, transposes, the
        parameters' own nodes) run whole. A wrapper that must prepare parameters for W (gather
        them) reads which ops W runs here. Matrix-product parameters merged by a sink are not
        listed."""
        out = []
        for frontier, params in self._groups or ():
            below, stack = set(), list(frontier)
            while stack:
                for child, _ in stack.pop().next_functions:
                    if child is not None and child not in self._input_side \
                            and child not in below:
                        below.add(child)
                        stack.append(child)
            out.append((list(frontier), list(params), below))
        return out

    def run(self, into_grad: bool = False, products: Optional[list] = None,
            around_group: Optional[Callable] = None) -> dict:
        """``{parameter: gradient}`` for the parameters this micro-batch reached; with
        ``into_grad`` the gradients are added to ``.grad`` instead (as a plain backward would:
        gradient hooks fire) and the dict is empty. With ``products`` (a list), the matrix-product
        parameters are not computed: ``(weight, bias, x, g)`` is appended for each, to be merged
        with other micro-batches' (:class:`GradientSink`). ``around_group(k)``: a context
        manager entered around the ``k``-th autograd call (the ``k``-th entry of
        :meth:`groups`). A parameter may be a ``GradientEdge`` (see :func:`backward_input`);
        its gradient is keyed by that edge."""
        if self._groups is None:
            raise RuntimeError("WeightGradPass.run: this W pass already ran")
        out: dict = {}
        # read the products' inputs before the generic groups free the graph
        with _recomputing_once():
            parts = [(w, b, _product_input(node), self._recorded[node][0])
                     for node, w, b in self._products if self._recorded.get(node, (None,))[0]
                     is not None]
        if products is not None:
            products.extend(parts)
        elif into_grad:
            for w, b, x, g in parts:
                for p, grad in _product_grads(w, b, x, g):
                    _add_to_grad(p, grad)
        else:
            for w, b, x, g in parts:
                for p, grad in _product_grads(w, b, x, g):
                    out[p] = grad
        recorded = {**self._root_grads, **self._recorded}
        # a group with several frontier nodes walks the input path between them, through other
        # groups' frontier nodes: keep every buffer until the last group has run
        retain = any(len(frontier) > 1 for frontier, _ in self._groups)
        # without a retained graph the groups' calls run disjoint nodes: one recomputation
        # serves them all; with one, a node may run in several calls (each recomputes)
        with _recomputing_once() if not retain else contextlib.nullcontext():
            for k, (frontier, params) in enumerate(self._groups):
                with around_group(k) if around_group is not None else \
                        contextlib.nullcontext():
                    self._run_group(frontier, params, recorded, into_grad, retain, out)
        self._groups = self._recorded = self._root_grads = self._products = None
        self._input_side = set()
        return out

    @staticmethod
    def _run_group(frontier, params, recorded, into_grad, retain, out) -> None:
        edges, grads = [], []
        for node in frontier:
            for i, g in enumerate(recorded.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            return
        clamps = []
        if len(frontier) > 1:  # see the module's Note
            clamps = [node.register_prehook(lambda _g, saved=recorded.get(node, ()): saved)
                      for node in frontier if node in recorded]
        try:
            if into_grad:
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=retain)
                return
            got = torch.autograd.grad(edges, [_edge(p) for p in params], grads,
                                      retain_graph=retain, allow_unused=True)
        finally:
            for handle in clamps:
                handle.remove()
        for p, g in zip(params, got):
            if g is not None:
                out[p] = g if p not in out else out[p] + g


_GraphExecGroup = getattr(torch.utils.checkpoint, "GraphExecGroup", None)


def _recomputing_once():
    """A fresh ``torch.utils.checkpoint.GraphExecGroup``, or nothing where one is open
    already (the caller's, around ``step()``: groups do not nest) or torch has none (older
    releases). Inside it a non-reentrant activation checkpoint recomputes its region once for
    every autograd call and saved-tensor read made there, where each recomputed it again (W
    made one call per group of parameters and read each matrix product's saved input: 5
    forwards of a checkpointed block per micro-batch). What is read in one group must be
    read once: the products' inputs and the generic groups' calls each get their own, and B
    (one call) none."""
    if _GraphExecGroup is None or torch._C._get_graph_exec_group() is not None:
        return contextlib.nullcontext()
    return _GraphExecGroup()


_PRODUCTS = {"AddmmBackward0": "_saved_mat1", "MmBackward0": "_saved_self",
             "EmbeddingBackward0": "_saved_indices"}
_NO_PADDING = (-1, 2 ** 64 - 1)  # padding_idx=None, as autograd saves it


def _accumulated(edge_node) -> Optional[torch.Tensor]:
    """The leaf an ``AccumulateGrad`` node feeds, else ``None``."""
    return getattr(edge_node, "variable", None) if edge_node is not None and \
        type(edge_node).__name__ == "AccumulateGrad" else None


def _product_params(node: Node, params: set) -> Optional[tuple]:
    """``(weight, bias or None)`` when ``node`` is ``x @ weight.t() (+ bias)`` (the scalars 1)
    or a dense ``embedding(indices, weight)`` without padding row or frequency scaling, with the
    parameters among ``params``; else ``None``."""
    kind = type(node).__name__
    if kind not in _PRODUCTS:
        return None
    edges = node.next_functions
    if kind == "EmbeddingBackward0":
        weight = _accumulated(edges[0][0])
        if weight is None or weight not in params or node._saved_sparse or \
                node._saved_scale_grad_by_freq or node._saved_padding_idx not in _NO_PADDING:
            return None
        return weight, None
    transpose = edges[-1][0]
    if transpose is None or type(transpose).__name__ != "TBackward0":
        return None
    weight = _accumulated(transpose.next_functions[0][0])
    if weight is None or weight not in params or weight.dim() != 2:
        return None
    bias = None
    if kind == "AddmmBackward0":
        if node._saved_alpha != 1 or node._saved_beta != 1:
            return None
        if edges[0][0] is not None:
            bias = _accumulated(edges[0][0])
            if bias is None or bias not in params or bias.dim() != 1:
                return None
    return weight, bias


def _product_input(node: Node) -> torch.Tensor:
    """The matrix product's input ``x`` (or the embedding's indices)."""
    # detached: an unpacked saved input carries its grad_fn, which would keep the graph alive
    return getattr(node, _PRODUCTS[type(node).__name__]).detach()


def _product_grads(weight, bias, x, g) -> list:
    """``[(param, gradient)]`` of one product from its input ``x`` and output gradient ``g``."""
    out = []
    if weight.requires_grad:
        out.append((weight, _weight_grad(weight, x, g)))
    if bias is not None and bias.requires_grad:
        out.append((bias, g.sum(0).to(bias.dtype)))
    return out


def _weight_grad(weight, x, g, into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``weight``'s gradient from rows ``x`` (or indices) and ``g``, added to ``into`` if given."""
    if not x.is_floating_point():  # an embedding: scatter-add the rows' gradients
        rows = g.reshape(-1, weight.shape[1]).to(weight.dtype)
        target = into if into is not None else torch.zeros_like(weight)
        return target.index_add_(0, x.reshape(-1), rows)
    if into is not None and into.dtype == g.dtype:
        return into.addmm_(g.t(), x.to(g.dtype))
    grad = (g.t() @ x.to(g.dtype)).to(weight.dtype)
    return grad if into is None else into.add_(grad)


def _add_to_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad``, through autograd when the parameter carries gradient hooks."""
    if _has_grad_hooks(param):
        torch.autograd.backward([param.view_as(param)], [grad])
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _frontier_of(param, parents: dict, input_side: set, roots: set) -> set:
    """The first nodes that reach the input on every path from ``param`` up to the roots
    (a root that does not reach the input counts as one)."""
    start = _grad_node(param)
    frontier, seen, stack = set(), {start}, []
    if start in roots and start not in input_side:
        frontier.add(start)
    users = _first_users(param, parents)
    while True:
        for parent in users:
            if parent in input_side:
                frontier.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
        if not stack:
            return frontier
        node = stack.pop()
        if node in roots and node not in input_side:
            frontier.add(node)
        users = parents[node]


def _weight_groups(params: list, parents: dict, input_side: set, roots: set) -> list:
    """``[(frontier nodes, params)]``: parameters whose frontiers share a node form one group."""
    groups, frontiers = _Groups(), {}
    for p in params:
        start = _grad_node(p)
        if start not in parents:
            continue  # not used by this micro-batch
        frontier = sorted(_frontier_of(p, parents, input_side, roots), key=id)
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
                   params: Sequence[torch.Tensor], split_at_parameters: bool = False
                   ) -> tuple[list, WeightGradPass]:
    """B: the gradients of ``inputs`` (``None`` where an input does not require grad or is not
    reached) for ``roots`` with gradients ``grads`` (``None``: ones, for a loss), and the W pass
    that computes ``params``' gradients later. Parameters that do not require grad are skipped.
    A parameter may also be given as a ``GradientEdge`` (an output of a node whose gradient W
    returns, keyed by the edge, without running the node): how FSDP's gathered views are
    named, whose leaf is the unit's flat buffer rather than the parameter.

    ``split_at_parameters``: W starts at each parameter's first use that reads data (the
    ``Addmm`` of a ``Linear``, past views and transposes: :func:`_data_users`) wherever that
    use lies, not at the first node on the path to ``inputs``; B walks everything above those
    uses, whether or not the path leads to an input. The split then depends on the
    parameters' uses alone, not on which inputs this graph reaches: what FSDP stages need,
    whose replicas must run the same W (the same gathers) when one replica's stage ignores its
    input (or its input needs no gradient: a first stage) and another's does not. B then also
    walks branches that do not lead to an input, which W walks otherwise.
    """
    roots = [r for r in roots if r.requires_grad]
    if grads is None:
        grads = [torch.ones_like(r) for r in roots]
    root_edges = [get_gradient_edge(r) for r in roots]
    root_nodes = list(dict.fromkeys(e.node for e in root_edges))
    wanted = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    params = list(dict.fromkeys(p for p in params
                                if isinstance(p, GradientEdge) or p.requires_grad))  # tied: once
    parents = _graph(root_nodes)
    owned = set(params)
    candidates = {}
    for node in parents:
        found = _product_params(node, owned)
        if found is not None:
            candidates[node] = found
    # products count as inputs: the path to them is B's, so their output gradient is known
    input_side = _reaching({_grad_node(inputs[i]) for i in wanted} | set(candidates), parents)
    # under split_at_parameters, the parameters' data users too: B reaches those off the
    # input path by asking autograd for the gradients arriving at them
    users = _data_users(params, parents) - input_side if split_at_parameters else set()
    input_side |= _reaching(users, parents)
    groups = _weight_groups(params, parents, input_side, set(root_nodes))
    products, generic = [], []
    for frontier, members in groups:
        # one frontier node: every member meets the input path there and nowhere else
        node = frontier[0] if len(frontier) == 1 else None
        weight, bias = candidates.get(node, (None, None))
        if weight is not None and any(p is weight for p in members):
            bias = bias if any(p is bias for p in members) else None
            products.append((node, weight, bias))
            members = [p for p in members if p is not weight and p is not bias]
        if members:
            generic.append((frontier, members))
    frontier = {node for nodes, _ in groups for node in nodes}
    captured = [node for node in frontier if node in candidates]
    recorded: dict = {}
    handles = [node.register_prehook(lambda g, node=node: recorded.__setitem__(node, g))
               for node in frontier if node in input_side and node not in candidates
               and node not in users]
    # the outputs of the data users off the input path that the graph uses: B stops there
    arrivals = [GradientEdge(node, k) for node in users if node in frontier
                for k in _used_outputs(node, parents, root_edges)]
    result: list = [None] * len(inputs)
    try:
        targets = [inputs[i] for i in wanted] + [GradientEdge(n, 0) for n in captured] + arrivals
        if targets:
            got = torch.autograd.grad(roots, targets, grads, retain_graph=True,
                                      allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = g
            for node, g in zip(captured, got[len(wanted):]):
                recorded[node] = (g,)
            _record_arrivals(recorded, arrivals, got[len(wanted) + len(captured):])
    finally:
        for handle in handles:
            handle.remove()
    root_grads = _root_gradients(root_edges, grads, frontier, input_side)
    return result, WeightGradPass(generic, recorded, root_grads, products, input_side)


def _data_users(params: list, parents: dict) -> set:
    """The first nodes above each parameter that read data (past :data:`PASS_THROUGH` nodes):
    where the parameter's gradient is computed from an activation or its gradient."""
    users: set = set()
    for p in params:
        if _grad_node(p) not in parents:
            continue  # not used by this graph
        stack, seen = list(_first_users(p, parents)), set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if type(node).__name__ in PASS_THROUGH:
                stack.extend(parents[node])
            else:
                users.add(node)
    return users


def _used_outputs(node: Node, parents: dict, root_edges: list) -> list:
    """The forward outputs of ``node`` that some node above it, or a root, uses."""
    used = {k for parent in parents[node] for child, k in parent.next_functions
            if child is node}
    used.update(e.output_nr for e in root_edges if e.node is node)
    return sorted(used)


def _record_arrivals(recorded: dict, edges: list, grads: Sequence) -> None:
    """``recorded[node]``: the gradients autograd gave at ``edges`` (outputs of ``node``), in
    the tuple form a pre-hook records (``None`` at outputs without one)."""
    for edge, g in zip(edges, grads):
        slots = list(recorded.get(edge.node, ()))
        slots += [None] * (edge.output_nr + 1 - len(slots))
        slots[edge.output_nr] = g
        recorded[edge.node] = tuple(slots)


class GradientSink:
    """Where W passes put parameter gradients during a step.

    Without gradient hooks on the parameters, each W pass adds straight into ``.grad`` (through
    the parameters' accumulators, like a plain backward). When some parameter carries one
    (``register_hook`` / ``register_post_accumulate_grad_hook``, as data-parallel wrappers
    install), the step's gradients are summed in private buffers and
    :meth:`deliver` hands each parameter its total once, through autograd, so those hooks fire
    once per parameter per step. Memory: one gradient-sized buffer per hooked parameter.

    Matrix-product parameters (see the module docstring) are merged over up to ``merge``
    micro-batches: a weight's inputs and output gradients wait until ``merge`` W passes have
    brought them, or until they hold ``enough_rows`` rows (a product that large already runs at
    full speed alone), or :meth:`deliver`; then one ``addmm_`` adds them. So small micro-batches
    are merged and large ones are added as their W runs, where the schedule placed the W.
    Memory: per product, the input and output gradient of up to ``merge - 1`` waiting
    micro-batches.
    """

    def __init__(self, params: Sequence[torch.Tensor], merge: int = 1,
                 enough_rows: int = ENOUGH_ROWS):
        for name, value in (("merge", merge), ("enough_rows", enough_rows)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GradientSink({name}={value!r}): expected a positive int")
        self.params = list(dict.fromkeys(p for p in params if p.requires_grad))
        self.deferred = any(_has_grad_hooks(p) for p in self.params)
        self.merge = merge
        self.enough_rows = enough_rows
        self._totals: dict = {}
        self._products: list = []  # (weight, bias, x, g) of the waiting micro-batches

    def weight_targets(self, roots: Sequence[torch.Tensor], real=None) -> list:
        """The parameters B hands to W (the stage's trainable parameters; ``roots`` and
        ``real`` unused)."""
        return self.params

    def run(self, weight_pass: WeightGradPass) -> None:
        """Run one micro-batch's W pass into ``.grad`` (or into the step's totals)."""
        if not self.deferred:
            weight_pass.run(into_grad=True, products=self._products)
        else:
            for p, g in weight_pass.run(products=self._products).items():
                self._add(p, g)
        self._flush(lambda xs: len(xs) >= self.merge or
                    sum(_rows(x) for x in xs) >= self.enough_rows)

    def flush(self) -> None:
        """Add the waiting micro-batches' matrix-product gradients (one ``addmm_`` per weight)."""
        self._flush(lambda xs: True)

    def _flush(self, ready: Callable) -> None:
        """Add the products of the weights whose waiting inputs ``ready(xs)`` accepts."""
        by_weight: dict = {}
        for weight, bias, x, g in self._products:
            entry = by_weight.setdefault(id(weight), (weight, bias, [], []))
            entry[2].append(x)
            entry[3].append(g)
        done = [key for key, (_, _, xs, _) in by_weight.items() if ready(xs)]
        self._products = [item for item in self._products if id(item[0]) not in done]
        for key in done:
            weight, bias, xs, gs = by_weight[key]
            x = xs[0] if len(xs) == 1 else torch.cat([t.reshape(-1) for t in xs]) \
                if not xs[0].is_floating_point() else torch.cat(xs)
            g = gs[0] if len(gs) == 1 else torch.cat([t.reshape(-1, t.shape[-1])
                                                      for t in gs])
            if weight.requires_grad:
                self._add_product(weight, g, x)
            if bias is not None and bias.requires_grad:
                self._add(bias, g.sum(0).to(bias.dtype))

    def _target(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        return self._totals.get(param) if self.deferred else param.grad

    def _add(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        target = self._target(param)
        if target is not None:
            target.add_(grad)
        elif self.deferred:
            self._totals[param] = grad
        else:
            param.grad = grad

    def _add_product(self, weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
        target = self._target(weight)
        if target is not None:
            _weight_grad(weight, x, g, into=target)
        else:
            self._add(weight, _weight_grad(weight, x, g))

    def deliver(self) -> None:
        """Flush the waiting products, then hand the summed gradients to the parameters through
        their accumulators (hooks run)."""
        self.flush()
        if not self._totals:
            return
        params = list(self._totals)
        views = [p.view_as(p) for p in params]
        torch.autograd.backward(views, [self._totals[p] for p in params])
        self._totals = {}


def _rows(x: torch.Tensor) -> int:
    """Rows a product's input adds to the merged ``addmm_`` (an embedding's: its indices)."""
    return x.numel() if not x.is_floating_point() else x.numel() // max(1, x.shape[-1])


def _has_grad_hooks(param: torch.Tensor) -> bool:
    return bool(getattr(param, "_backward_hooks", None)) or bool(
        getattr(param, "_post_accumulate_grad_hooks", None))
