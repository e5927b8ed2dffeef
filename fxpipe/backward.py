"""backward: one micro-batch's backward split into an input-gradient pass and a weight-gradient pass.

The zb schedule (:mod:`fxpipe.schedule`, Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024) runs ``I k`` on the critical path (the gradient of the stage's boundary inputs, which the
previous stage waits for) and ``W k`` later, to fill a bubble. :func:`backward_input` runs the
first half on the autograd graph the forward built and returns a :class:`PendingWeights`, which
:meth:`PendingWeights.run` turns into the weight gradients without running the input-gradient
chain again.

How (the technique of ``torch.distributed.pipelining._backward``; the code is ours). Call *C*
the nodes of the autograd graph from which a boundary input is reachable: exactly the nodes the
input-gradient pass executes. C is closed towards the roots, so every node outside C (*N*) has
only N nodes below it. A weight is reached from C through an edge from a C node into N (``mm``
of ``x @ W.T`` is in C, the ``t`` of ``W`` and ``W``'s accumulator are in N), or from a root
that is itself in N (an output that does not depend on the inputs; on the first stage every
root). During I a pre-hook on each such C node (an *anchor*) records the gradient flowing into
it; W then starts autograd at those anchors with the recorded gradients and asks only for the
weights, so the engine runs each anchor for its weight outputs only (``mm``'s ``grad_mat2``,
``layer_norm``'s weight and bias) and the N nodes below it, never the chain between anchors.
Anchors that reach a common weight run in one call (a *group*); groups share no node.

Where that would count a gradient twice or run the chain again — a weight read at two depths of
the input-gradient chain (one anchor of its group lies below another in C: a layer applied
twice) — :func:`backward_input` returns the reason instead, and the caller runs the plain
backward in ``I`` (``W`` is then empty). A stage without trainable weights falls back the same
way: there is nothing to defer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["PendingWeights", "backward_input"]


@dataclass
class _Group:
    anchors: list = field(default_factory=list)  # C nodes whose incoming gradient I records
    roots: list = field(default_factory=list)  # (GradientEdge, seed) of roots outside C
    weights: set = field(default_factory=set)  # accumulator nodes of the weights it reaches


@dataclass
class PendingWeights:
    """What ``I k`` leaves for ``W k``: per group, the edges to start from with their gradients
    and the weights (name, leaf) to differentiate."""

    calls: list[tuple[list[GradientEdge], list[torch.Tensor], list[tuple[str, torch.Tensor]]]]

    def run(self) -> dict[str, torch.Tensor]:
        """The weight gradients of the micro-batch (name -> gradient; unreached weights absent).
        Frees the graph as it goes: each group's nodes run once."""
        out: dict[str, torch.Tensor] = {}
        calls, self.calls = self.calls, []
        for edges, grads, weights in calls:
            if not edges:
                continue
            got = torch.autograd.grad(edges, [w for _, w in weights], grads, allow_unused=True)
            out.update((name, g) for (name, _), g in zip(weights, got) if g is not None)
        return out


def _children(node) -> list:
    return [c for c, _ in node.next_functions if c is not None]


def _fold_below(root, memo: dict, value):
    """Post-order over the graph below ``root`` (inclusive): ``memo[node] = value(node, [memo of
    each child])`` for every node not yet in ``memo``; returns ``memo[root]``. Iterative, so a
    deep graph does not hit Python's recursion limit."""
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        if expanded:
            memo[node] = value(node, [memo[c] for c in _children(node)])
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if c not in memo)
    return memo[root]


def _leads_to(roots: Sequence, targets: set) -> set:
    """The nodes below ``roots`` (inclusive) from which some node of ``targets`` is reachable."""
    memo: dict = {}
    for root in roots:
        _fold_below(root, memo, lambda n, below: n in targets or any(below))
    return {n for n, hit in memo.items() if hit}


def _weights_below(node, weights: set, memo: dict) -> frozenset:
    """The weight accumulators reachable from ``node`` (an N node: nothing below it is in C)."""
    return _fold_below(node, memo, lambda n, below: frozenset(({n} if n in weights else set()).union(*below)))


def _below_in(node, inside: set) -> set:
    """Nodes of ``inside`` strictly below ``node``, walking through ``inside`` only."""
    seen: set = set()
    stack = [c for c in _children(node) if c in inside]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(c for c in _children(n) if c in inside)
    return seen


def backward_input(roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None],
                   boundary: Sequence[torch.Tensor], weights: dict[str, torch.Tensor]
                   ) -> tuple[list[torch.Tensor | None], PendingWeights] | str:
    """Run the input-gradient half of a backward: the gradients of ``boundary`` (None where an
    input does not influence the roots), and the :class:`PendingWeights` of ``weights`` (name ->
    leaf requiring grad). ``seeds``: the gradient of each root (None: a scalar root, seed 1).
    Returns the reason instead, running nothing, where the split would run part of the input
    chain again or has nothing to defer (module docstring): the caller then runs the plain
    backward."""
    if not weights:
        return "it has no trainable weight, so there is no weight pass to defer"
    seeds = [torch.ones_like(r) if g is None else g for r, g in zip(roots, seeds)]
    root_edges = [get_gradient_edge(r) for r in roots]
    inputs = [x for x in boundary if x.requires_grad]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    acc = {get_gradient_edge(w).node: name for name, w in weights.items()}
    chain = _leads_to([e.node for e in root_edges], input_nodes) if input_nodes else set()

    # Anchors and their weights, then groups: anchors that reach a common weight.
    memo: dict = {}
    accs = set(acc)
    found: list[tuple[object, bool, frozenset]] = []  # (anchor node or root index, is_root, weights)
    for node in chain:
        below = frozenset().union(*(_weights_below(c, accs, memo) for c in _children(node) if c not in chain))
        if below:
            found.append((node, False, below))
    for i, e in enumerate(root_edges):
        if e.node not in chain:
            below = _weights_below(e.node, accs, memo)
            if below:
                found.append((i, True, below))
    parent = list(range(len(found)))

    def top(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict = {}
    for i, (_, _, below) in enumerate(found):
        for w in below:
            j = owner.setdefault(w, i)
            parent[top(i)] = top(j)
    groups: dict[int, _Group] = {}
    for i, (what, is_root, below) in enumerate(found):
        g = groups.setdefault(top(i), _Group())
        (g.roots if is_root else g.anchors).append(what)
        g.weights |= below
    for g in groups.values():
        if len(g.anchors) > 1:
            members = set(g.anchors)
            for a in g.anchors:
                if members & _below_in(a, chain):
                    names = sorted(acc[w] for w in g.weights)
                    return (f"a weight ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) is read at two "
                            f"depths of the input-gradient chain (e.g. a layer applied twice), so a separate weight "
                            f"pass would run part of that chain again")

    # I: the input gradients, recording what flows into each anchor.
    recorded: dict = {}
    hooks = []
    for g in groups.values():
        for a in g.anchors:
            hooks.append(a.register_prehook(lambda grads, a=a: recorded.__setitem__(a, grads)))
    try:
        used = [i for i, e in enumerate(root_edges) if e.node in chain]
        if inputs and used:
            got = torch.autograd.grad([roots[i] for i in used], inputs, [seeds[i] for i in used],
                                      retain_graph=True, allow_unused=True)
        else:
            got = [None] * len(inputs)
    finally:
        for h in hooks:
            h.remove()
    by_input = dict(zip(map(id, inputs), got))
    input_grads = [by_input.get(id(x)) for x in boundary]

    calls = []
    for g in groups.values():
        edges, grads = [], []
        for a in g.anchors:
            for nr, grad in enumerate(recorded.get(a, ())):
                if grad is not None:
                    edges.append(GradientEdge(a, nr))
                    grads.append(grad)
        for i in g.roots:
            edges.append(root_edges[i])
            grads.append(seeds[i])
        calls.append((edges, grads, [(acc[w], weights[acc[w]]) for w in sorted(g.weights, key=lambda w: acc[w])]))
    return input_grads, PendingWeights(calls)
