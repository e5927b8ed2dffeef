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
that is itself in N (an output that does not depend on the inputs; on a stage whose inputs
take no gradient, the first, every root: there :meth:`fxpipe.weights.WeightStore.backward_input`
skips the split and ``W`` runs the plain backward). During I a pre-hook on each such C node (an
*anchor*) records the gradient flowing into it; the engine then runs the anchor for its C-side
outputs only (``mm``'s input gradient).

W computes the rest without running the chain between anchors again. An anchor of a type with a
formula here (``mm``, ``addmm``, ``native_layer_norm``, ``mul``, ``convolution``,
``native_batch_norm``: the Linear and LayerNorm of a transformer stack, RMSNorm's gain, a
convolution and the CPU's BatchNorm) whose weight lies right below it, or below a ``t``, gets its
weight outputs from the formula autograd's own node applies (``mm_mat2_backward``, or the norm's
or convolution's backward operator with only the weight and bias asked for, the other operand of
a product) on the recorded gradient and the tensors it saved, added into the weight's gradient
with no call of the engine: the engine's start-up and its walk of the graph
cost about 90 us a call on the AMD EPYC host, a call per group of anchors. Each such anchor adds
its own share, so a layer applied at two depths splits too. The other anchors (a division or
any other operator, a weight behind a cast or a view) and roots outside C go through autograd:
started at those anchors with the recorded gradients and asked for the weights only, the engine
runs each anchor for its weight outputs only and the N nodes below it. Anchors that reach a
common weight run in one call (a *group*); groups share no node. Every micro-batch of a stage
builds a graph of the same shape, so the analysis is done once per stage and found again by the
graph's shape (:class:`SplitCache`).

What ``I`` leaves alive. Autograd frees a node's saved tensors when the node runs without
``retain_graph``; ``I`` must retain the graph for ``W``, so on its own every tensor the forward
saved would stay alive until ``W k``, including those only the input chain reads (attention
probabilities, a GELU's input), which no node of ``W`` reads again. A forward run under
:meth:`SavedTensors.hooks` keeps what autograd saves in a :class:`SavedTensors`; ``I`` notes the
tensors that non-anchor nodes of the chain read, and frees them node by node, as a plain backward
would have: a node's once the next node on its thread has read
(``torch._C._current_autograd_node`` tells them apart; a thread runs one node at a time), the
last when ``I`` returns. What a micro-batch holds from ``I`` to ``W`` is then what the anchors
and the nodes below them saved, and the gradients recorded at the anchors; ``W`` frees those
group by group. For the pinned GPT of ``benchmarks/limit.py`` this cuts the last stage's peak of saved
tensors under zb from 83.7 to 67.7 MiB (97.6 with the recorded gradients; 1f1b: 48.6; ZB-H1
holds two micro-batches there, 1f1b one). Export traces ``torch.func`` transforms into plain operators; a stage that still disables
saved-tensor hooks at run time (an opaque leaf module of the ``symbolic_trace`` path running
``torch.func``, say) makes torch raise under zb: use 1f1b for it.

Where an autograd call of W would run part of the chain again — an anchor W must run through
autograd lies above another anchor of that call's weights (a learnt divisor applied twice, say)
— :func:`backward_input` returns the reason instead, and the caller runs the plain backward in
``I`` (``W`` is then empty). A stage without trainable weights falls back the same way: there is
nothing to defer.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["PendingWeights", "SavedTensors", "SplitCache", "backward_input", "grads_into", "saving_nothing"]


# the saved-tensor hooks in force (pack, unpack) or None; torch's own AOT autograd reads them so
_hooks_in_force = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
# the autograd node running on this thread (None outside the engine); without it, what a call read
# is freed when the call returns instead of node by node
_running_node = getattr(torch._C, "_current_autograd_node", lambda: None)


@contextlib.contextmanager
def grads_into(leaves: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]):
    """Within: each leaf's ``.grad`` is its buffer (same shape and dtype), so a backward adds its
    gradient in where autograd computes it, as into any ``.grad``; after, even on an error, each
    leaf's ``.grad`` is what it was before."""
    held = [leaf.grad for leaf in leaves]
    for leaf, buf in zip(leaves, buffers):
        leaf.grad = buf
    try:
        yield
    finally:
        for leaf, g in zip(leaves, held):
            leaf.grad = g


def _never_unpacked(_):
    raise RuntimeError("fxpipe: a backward reached a forward that saved nothing (saving_nothing): the recomputed "
                       "forward, not this one, is the one to differentiate")


def saving_nothing():
    """Within: autograd records the graph as in training, but keeps none of the tensors it would
    save for the backward (each is dropped as it is packed).

    A forward whose activations a recomputation will make again runs so (as
    ``torch.utils.checkpoint``'s non-reentrant mode runs it), not under ``torch.no_grad()``:
    some kernels are chosen by whether autograd records, e.g. the CPU's
    ``scaled_dot_product_attention`` with a mask takes another backend under ``no_grad``, whose
    output differs in the last bits. The recomputed forward records, so only this way do the
    first forward's outputs and loss equal the ones the backward differentiates, and the
    numbers equal those of training without recomputation."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: None, _never_unpacked)


class SavedTensors:
    """What autograd saves during one micro-batch's forward, held by key so that ``I`` can free
    what only the input-gradient chain reads (module docstring). Saved-tensor hooks already in
    force when the forward starts (``torch.autograd.graph.save_on_cpu``, say) still apply: ours
    wrap them. The autograd graph holds this object through its unpack hook, so it lives exactly
    as long as the graph."""

    def __init__(self) -> None:
        self._values: dict[int, object] = {}
        self._outer = None
        self._reads: set[int] | None = None  # within freeing_reads: the keys read, an anchor's during I aside
        # per thread: whether an anchor is running, and (within freeing_reads) the node that read
        # last with the keys it read; autograd runs a CUDA graph's nodes on its device thread and
        # any CPU nodes on the caller's, possibly at the same time
        self._anchor = threading.local()
        self._last: dict[int, tuple[object, list[int]]] = {}

    def hooks(self):
        """The context to run the forward under."""
        if _hooks_in_force is None:  # a torch that cannot say which hooks are in force: stay out of their way
            return contextlib.nullcontext()
        self._outer = _hooks_in_force(False)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> int:
        key = len(self._values)  # packing is over before I frees any
        # detached: a saved output would otherwise hold its own node through this object (a cycle
        # the graph would never be freed from); an outer hook gets the tensor as autograd gave it
        self._values[key] = tensor.detach() if self._outer is None else self._outer[0](tensor)
        return key

    def _unpack(self, key: int):
        if key not in self._values:
            raise RuntimeError(f"fxpipe internal error: autograd read saved tensor {key} of a zb micro-batch after "
                               f"fxpipe freed it, expecting the node that read it never to run again; please report "
                               f"this with the model")
        value = self._values[key]
        if self._reads is not None and not getattr(self._anchor, "running", False):
            self._reads.add(key)
            node = _running_node()
            if node is not None:
                self._reading(node).append(key)
        return value if self._outer is None else self._outer[1](value)

    def _reading(self, node) -> list[int]:
        """The keys ``node`` has read on this thread. When another node read last here, that one
        has returned (a thread runs one node at a time, and a node runs once per call), so what
        it read is freed now, as a plain backward frees a node's saved tensors when the node
        returns; the rest of the call's reads are freed when it returns."""
        thread = threading.get_ident()
        last = self._last.get(thread)
        if last is None or last[0] is not node:
            for k in last[1] if last is not None else ():
                self._values.pop(k, None)
            last = self._last[thread] = (node, [])
        return last[1]

    @contextlib.contextmanager
    def freeing_reads(self):
        """Around one ``autograd.grad`` call whose nodes never run again: free the tensors it
        reads, except what an anchor reads during ``I`` (:meth:`anchor_runs` brackets those),
        each node's once another node has read on its thread (:meth:`_reading`), and whatever
        is left when the call returns. Autograd itself frees a node's saved tensors right after
        the node runs; this frees them at most one node later."""
        self._reads = set()
        try:
            yield
            for key in self._reads:
                self._values.pop(key, None)
        finally:
            self._reads = None
            self._last.clear()  # the call has returned: no node of it runs on any thread

    def anchor_runs(self, running: bool) -> None:
        """An anchor's pre-hook (True) and post-hook (False), on the thread that runs it."""
        self._anchor.running = running

    def __len__(self) -> int:
        return len(self._values)


@dataclass
class _Group:
    anchors: list = field(default_factory=list)  # C nodes whose incoming gradient I records
    roots: list = field(default_factory=list)  # indices of the roots outside C
    weights: set = field(default_factory=set)  # accumulator nodes of the weights the autograd call reaches
    direct: list = field(default_factory=list)  # (anchor, its sinks): anchors W computes itself


@dataclass
class _Call:
    """What ``W`` does for one group: the anchors it computes itself (``direct``: the node, its
    :data:`_Sink` tuple and the gradient recorded at its output), then one autograd call from
    ``edges`` with ``grads`` for ``weights`` (name, leaf), where the group has anchors of other
    types or roots outside the input chain."""

    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    weights: list[tuple[str, torch.Tensor]]
    direct: list[tuple[object, tuple, torch.Tensor]]


@dataclass
class PendingWeights:
    """What ``I k`` leaves for ``W k``: one :class:`_Call` per group of anchors."""

    calls: list[_Call]
    saved: SavedTensors | None = None

    def run(self, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The weight gradients of the micro-batch (name -> gradient; unreached weights absent).
        With ``into`` (name -> a buffer of the weight's shape and dtype, for every weight) each
        gradient is added into its buffer instead, as a plain backward adds into ``.grad``: right
        where it is computed, while it is still in the cache, and no group's gradients wait for
        the others'; the dict returned is then empty. Frees the graph as it goes: each group's
        nodes run once, and what a group read (its recorded gradients, the tensors its nodes
        saved) is freed when the group is done."""
        out: dict[str, torch.Tensor] = {}

        def add(name: str, g: torch.Tensor) -> None:
            if into is not None:
                into[name].add_(g)
            else:
                out[name] = out[name] + g if name in out else g

        calls, self.calls = deque(self.calls), []
        while calls:
            call = calls.popleft()
            with self.saved.freeing_reads() if self.saved is not None else contextlib.nullcontext():
                with torch.no_grad():
                    for node, sinks, grad in call.direct:
                        _run_direct(node, sinks, grad, add)
                if call.edges:
                    leaves = [w for _, w in call.weights]
                    if into is None:
                        got = torch.autograd.grad(call.edges, leaves, call.grads, allow_unused=True)
                        for (name, _), g in zip(call.weights, got):
                            if g is not None:
                                add(name, g)
                    else:
                        with grads_into(leaves, [into[name] for name, _ in call.weights]):
                            torch.autograd.backward(call.edges, call.grads, inputs=leaves)
            del call
        return out


# Anchors whose weight-side outputs W computes itself, with the formulas autograd's own nodes use
# (torch/csrc/autograd/FunctionsManual.cpp: mm_mat1_backward, mm_mat2_backward,
# mul_tensor_backward; the norms' and the convolution's backwards are aten ops), so the numbers are
# autograd's to the bit (tests check this). Each
# call of the engine costs its start-up and a walk of the graph below its roots (about 90 us on
# the AMD EPYC host even for one node): for the 26 groups of the pinned GPT's last stage this
# was most of what the split added to a plain backward.
def _node_type(make) -> type:
    with torch.enable_grad():
        return type(make(torch.ones(2, 2, requires_grad=True)).grad_fn)


_Mm = _node_type(lambda w: torch.ones(2, 2).mm(w))
_Addmm = _node_type(lambda w: torch.addmm(torch.ones(2), torch.ones(2, 2), w))
_LayerNorm = _node_type(lambda w: torch.native_layer_norm(w, (2,), None, None, 1e-5)[0])
_Mul = _node_type(lambda w: torch.ones(2, 2) * w)
_Convolution = _node_type(lambda w: torch.nn.functional.conv1d(torch.ones(1, 2, 3), w.unsqueeze(-1)))
_BatchNorm = _node_type(lambda w: torch.native_batch_norm(w, None, None, None, None, True, 0.1, 1e-5)[0])
_T = _node_type(lambda w: w.t())
_AccumulateGrad = torch._C._functions.AccumulateGrad

# A sink: (output slot of the anchor, weight name, whether a ``t`` lies between them), for every
# slot of the anchor whose gradient reaches a weight.
_Sink = tuple[int, str, bool]


def _scaled(t: torch.Tensor, s) -> torch.Tensor:
    return t if s == 1 else t * s


def _column_major(sizes, strides) -> bool:
    return strides[0] == 1 and strides[1] == sizes[0]


def _mm_grads(node, grad: torch.Tensor, slots: set[int]) -> dict[int, torch.Tensor]:
    """``mm(self, mat2)`` and ``addmm(self, mat1, mat2)``: the gradients of the operand slots in
    ``slots``, as autograd computes them (the layout of the result follows the operand's)."""
    addmm = type(node) is _Addmm
    first, second = (1, 2) if addmm else (0, 1)  # slots of the two matrices
    alpha = node._saved_alpha if addmm else 1
    got: dict[int, torch.Tensor] = {}
    if addmm and 0 in slots:
        got[0] = _scaled(grad, node._saved_beta)
    if first in slots:
        mat2 = node._saved_mat2
        sizes, strides = ((node._saved_mat1_sym_sizes, node._saved_mat1_sym_strides) if addmm else
                          (node._saved_self_sym_sizes, node._saved_self_sym_strides))
        got[first] = _scaled(mat2.mm(grad.t()).t() if _column_major(sizes, strides) else grad.mm(mat2.t()), alpha)
    if second in slots:
        mat1 = node._saved_mat1 if addmm else node._saved_self
        if _column_major(node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides):
            got[second] = _scaled(grad.t().mm(mat1).t(), alpha)
        else:
            got[second] = _scaled(mat1.t().mm(grad), alpha)
    return got


def _asked(backward_op, slots: set[int], *args) -> dict[int, torch.Tensor]:
    """An aten backward of a three-input operator (input, weight, bias) called with ``args`` and
    the output mask of ``slots``, as autograd's node calls it: the gradients of those slots."""
    got = backward_op(*args, [i in slots for i in range(3)])
    return {i: got[i] for i in slots}


def _layer_norm_grads(node, grad: torch.Tensor, slots: set[int]) -> dict[int, torch.Tensor]:
    """``native_layer_norm(input, shape, weight, bias)``: the gradients of the slots in ``slots``."""
    return _asked(torch.ops.aten.native_layer_norm_backward, slots, grad, node._saved_input,
                  node._saved_normalized_shape, node._saved_result1, node._saved_result2, node._saved_weight,
                  node._saved_bias)


def _mul_grads(node, grad: torch.Tensor, slots: set[int]) -> dict[int, torch.Tensor]:
    """``mul(self, other)`` of two tensors (an elementwise gain: RMSNorm's weight, a learnt
    scale): each slot's gradient is the incoming one times the other operand (``mul_tensor_backward``
    for real tensors), in the result's shape; :func:`_run_direct` sums it to the weight's."""
    got: dict[int, torch.Tensor] = {}
    if 0 in slots:
        got[0] = grad * node._saved_other
    if 1 in slots:
        got[1] = grad * node._saved_self
    return got


def _convolution_grads(node, grad: torch.Tensor, slots: set[int]) -> dict[int, torch.Tensor]:
    """``convolution(input, weight, bias, ...)`` (every ``conv1d/2d/3d`` and transposed one):
    ``convolution_backward`` asked for the slots in ``slots`` only."""
    return _asked(torch.ops.aten.convolution_backward, slots, grad, node._saved_input, node._saved_weight,
                  node._saved_bias_sym_sizes_opt, node._saved_stride, node._saved_padding, node._saved_dilation,
                  node._saved_transposed, node._saved_output_padding, node._saved_groups)


def _batch_norm_grads(node, grad: torch.Tensor, slots: set[int]) -> dict[int, torch.Tensor]:
    """``native_batch_norm(input, weight, bias, running_mean, running_var, training, ...)`` (the
    CPU's BatchNorm, and CUDA's where cuDNN does not take it; cuDNN's has a node of its own, which
    goes through autograd). The input's gradient is asked for as well and dropped: without it,
    CUDA's kernel reduces along another path, whose bf16 bias gradient differed from a full
    backward's in the last bit (H200, torch 2.11)."""
    got = _asked(torch.ops.aten.native_batch_norm_backward, slots | {0}, grad, node._saved_input,
                 node._saved_weight, node._saved_running_mean, node._saved_running_var, node._saved_result1,
                 node._saved_result2, node._saved_training, node._saved_eps)
    return {i: got[i] for i in slots}


_FORMULAS = {_Mm: _mm_grads, _Addmm: _mm_grads, _LayerNorm: _layer_norm_grads, _Mul: _mul_grads,
             _Convolution: _convolution_grads, _BatchNorm: _batch_norm_grads}


def _run_direct(node, sinks: tuple, grad: torch.Tensor, add) -> None:
    """One anchor's weight gradients, each handed to ``add(name, gradient)`` in its weight's
    shape (a broadcast bias summed to it, as autograd sums a gradient that does not match its
    input) and dtype."""
    got = _FORMULAS[type(node)](node, grad, {slot for slot, _, _ in sinks})
    for slot, name, transposed in sinks:
        g = got.pop(slot)
        if transposed:
            g = g.t()
        meta = node.next_functions[slot][0]
        leaf = (meta.next_functions[0][0] if transposed else meta).variable
        if g.shape != leaf.shape:
            g = g.sum_to_size(leaf.shape)
        add(name, g if g.dtype == leaf.dtype else g.to(leaf.dtype))


def _sinks(node, children: list[tuple[int, object]], acc: dict) -> tuple[_Sink, ...] | None:
    """``node``'s :data:`_Sink` per slot in ``children`` ((slot, N node below it that reaches a
    weight)), or None where W must run it through autograd: a type without a formula, operands
    that are not dense real tensors, or a slot whose gradient reaches its weight through more
    than a ``t``."""
    if type(node) not in _FORMULAS:
        return None
    saved = [getattr(node, a, None) for a in ("_saved_self", "_saved_other", "_saved_mat1", "_saved_mat2",
                                                "_saved_input", "_saved_weight")]
    if any(t is not None and (t.layout != torch.strided or t.is_complex()) for t in saved):
        return None
    sinks = []
    for slot, child in children:
        transposed = type(child) is _T
        end = child.next_functions[0][0] if transposed else child
        if type(end) is not _AccumulateGrad or end not in acc:
            return None
        sinks.append((slot, acc[end], transposed))
    return tuple(sinks)


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


def _shape(root_edges: Sequence[GradientEdge], leaves: dict[int, object]) -> tuple[list, list]:
    """The autograd graph below ``root_edges``: its nodes in a canonical order (depth first, each
    node's edges in order), and a description of it that two graphs share exactly when they are
    the same graph up to the identity of their nodes: each node's type, its number of edges and
    the input slot it is entered at, each edge's end as a new node, one already seen (its place in
    the order) or none, and at an accumulator whose leaf is in ``leaves`` (id -> label) the label.
    One pass, no more than a walk of the graph costs."""
    order: list = []
    index: dict = {}
    shape: list = []
    stack = [(e.node, e.output_nr) for e in reversed(root_edges)]
    while stack:
        node, nr = stack.pop()
        if node is None:
            shape.append(None)
            continue
        seen = index.get(node)
        if seen is not None:
            shape += (~seen, nr)
            continue
        index[node] = len(order)
        order.append(node)
        edges = node.next_functions
        shape += (type(node), len(edges), nr)
        if type(node) is _AccumulateGrad:
            shape.append(leaves.get(id(node.variable)))
        stack.extend(reversed(edges))
    return order, shape


@dataclass
class _Plan:
    """The analysis of one graph (:func:`_analyse`) with its nodes as places in :func:`_shape`'s
    order: the roots the input-gradient pass starts from, and per group its anchors run through
    autograd, its roots, its weights' names for that call, and its anchors W computes itself
    with their sinks."""

    used: list[int]
    groups: list[tuple[list[int], list[int], list[str], list[tuple[int, tuple]]]]


class SplitCache:
    """The last graph a stage split and its analysis. Every micro-batch of a stage builds a new
    autograd graph of the same shape, so the analysis (the input chain, the anchors, their
    groups: a Python walk over every node, several times) is done once and then found again by
    the graph's shape (:func:`_shape`), which one walk computes. A graph of another shape (a
    frozen weight, a module in another mode) is analysed afresh and replaces it. ``hits`` and
    ``misses`` count the graphs found and analysed (as ``functools.lru_cache``'s ``cache_info``
    does): a stage whose misses keep growing builds a graph of a new shape every micro-batch."""

    def __init__(self) -> None:
        self.shape: list | None = None
        self.plan: _Plan | str | None = None
        self.hits = 0
        self.misses = 0


_Groups = list[tuple[list, list[int], list[str], list[tuple[object, tuple]]]]


def _analyse(root_edges: list[GradientEdge], inputs: list[torch.Tensor],
             weights: dict[str, torch.Tensor]) -> tuple[list[int], _Groups] | str:
    """The roots the input chain starts from and the anchors' groups (module docstring), each as
    (anchors W runs through autograd, root indices, the names of the weights that call reaches
    in order, [(anchor W computes itself, its sinks)]), or why the split cannot be done."""
    acc = {get_gradient_edge(w).node: name for name, w in weights.items()}
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    chain = _leads_to([e.node for e in root_edges], input_nodes) if input_nodes else set()

    # Anchors and their weights, then groups: anchors that reach a common weight.
    memo: dict = {}
    accs = set(acc)
    found: list[tuple[object, bool, frozenset, tuple | None]] = []  # (anchor or root index, is_root, weights, sinks)
    for node in chain:
        children = [(slot, c) for slot, (c, _) in enumerate(node.next_functions)
                    if c is not None and c not in chain and _weights_below(c, accs, memo)]
        if children:
            below = frozenset().union(*(_weights_below(c, accs, memo) for _, c in children))
            found.append((node, False, below, _sinks(node, children, acc)))
    for i, e in enumerate(root_edges):
        if e.node not in chain:
            below = _weights_below(e.node, accs, memo)
            if below:
                found.append((i, True, below, None))
    parent = list(range(len(found)))

    def top(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict = {}
    for i, (_, _, below, _) in enumerate(found):
        for w in below:
            j = owner.setdefault(w, i)
            parent[top(i)] = top(j)
    groups: dict[int, _Group] = {}
    for i, (what, is_root, below, sinks) in enumerate(found):
        g = groups.setdefault(top(i), _Group())
        if sinks is not None:
            g.direct.append((what, sinks))
            continue
        (g.roots if is_root else g.anchors).append(what)
        g.weights |= below
    reach = {what: below for what, is_root, below, _ in found if not is_root}
    for g in groups.values():
        # an autograd call from an anchor runs every chain node below it that leads to the call's
        # weights: one above another anchor of those weights would run that part of the chain again
        if g.anchors and len(g.anchors) + len(g.direct) > 1:
            members = set(g.anchors) | {d for d, _ in g.direct if reach[d] & g.weights}
            for a in g.anchors:
                if members & _below_in(a, chain):
                    names = sorted(acc[w] for w in g.weights)
                    return (f"a weight ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) is read at "
                            f"two depths of the input-gradient chain (e.g. a layer applied twice) by an operator "
                            f"fxpipe has no weight-gradient formula for, so a separate weight pass would run "
                            f"part of that chain again")
    return ([i for i, e in enumerate(root_edges) if e.node in chain],
            [(g.anchors, g.roots, sorted(acc[w] for w in g.weights), g.direct) for g in groups.values()])


def _plan(root_edges: list[GradientEdge], inputs: list[torch.Tensor], weights: dict[str, torch.Tensor],
          cache: SplitCache | None) -> tuple[list[int], _Groups] | str:
    """:func:`_analyse`'s answer, from ``cache`` where it holds a graph of this shape."""
    if cache is None:
        return _analyse(root_edges, inputs, weights)
    labels = {id(w): name for name, w in weights.items()}
    labels.update((id(x), ("boundary input", k)) for k, x in enumerate(inputs))
    order, shape = _shape(root_edges, labels)
    if shape == cache.shape:
        cache.hits += 1
        if isinstance(cache.plan, str):
            return cache.plan
        return cache.plan.used, [([order[a] for a in anchors], roots, names, [(order[a], sinks) for a, sinks in direct])
                                 for anchors, roots, names, direct in cache.plan.groups]
    cache.misses += 1
    plan = _analyse(root_edges, inputs, weights)
    cache.shape = shape
    if isinstance(plan, str):
        cache.plan = plan
    else:
        index = {node: i for i, node in enumerate(order)}
        cache.plan = _Plan(plan[0], [([index[a] for a in anchors], roots, names, [(index[a], sinks) for a, sinks in direct])
                                     for anchors, roots, names, direct in plan[1]])
    return plan


def backward_input(roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor | None],
                   boundary: Sequence[torch.Tensor], weights: dict[str, torch.Tensor],
                   saved: SavedTensors | None = None,
                   cache: SplitCache | None = None) -> tuple[list[torch.Tensor | None], PendingWeights] | str:
    """Run the input-gradient half of a backward: the gradients of ``boundary`` (None where an
    input does not influence the roots), and the :class:`PendingWeights` of ``weights`` (name ->
    leaf requiring grad). ``seeds``: the gradient of each root (None: a scalar root, seed 1).
    Returns the reason instead, running nothing, where the split would run part of the input
    chain again or has nothing to defer (module docstring): the caller then runs the plain
    backward. ``saved``: where the forward kept what autograd saved (:class:`SavedTensors`); the
    tensors only the input chain reads are freed as it runs (:meth:`SavedTensors.freeing_reads`).
    ``cache``: the stage's :class:`SplitCache`, to analyse its graph once rather than per call."""
    if not weights:
        return "it has no trainable weight, so there is no weight pass to defer"
    seeds = [torch.ones_like(r) if g is None else g for r, g in zip(roots, seeds)]
    root_edges = [get_gradient_edge(r) for r in roots]
    inputs = [x for x in boundary if x.requires_grad]
    plan = _plan(root_edges, inputs, weights, cache)
    if isinstance(plan, str):
        return plan
    used, groups = plan

    # I: the input gradients, recording what flows into each anchor.
    recorded: dict = {}
    hooks = []

    def enter(grads, a):
        recorded[a] = grads
        if saved is not None:
            saved.anchor_runs(True)

    for anchors, _, _, direct in groups:
        for a in [*anchors, *(a for a, _ in direct)]:
            hooks.append(a.register_prehook(lambda grads, a=a: enter(grads, a)))
            if saved is not None:
                hooks.append(a.register_hook(lambda grad_inputs, grad_outputs: saved.anchor_runs(False)))
    try:
        with saved.freeing_reads() if saved is not None else contextlib.nullcontext():
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
    for anchors, root_ids, names, direct in groups:
        edges, grads = [], []
        for a in anchors:
            for nr, grad in enumerate(recorded.get(a, ())):
                if grad is not None:
                    edges.append(GradientEdge(a, nr))
                    grads.append(grad)
        for i in root_ids:
            edges.append(root_edges[i])
            grads.append(seeds[i])
        # the anchors with formulas have one differentiable output; none flowed in where it is None
        mine = [(a, sinks, recorded[a][0]) for a, sinks in direct if a in recorded and recorded[a][0] is not None]
        calls.append(_Call(edges, grads, [(name, weights[name]) for name in names], mine))
    return input_grads, PendingWeights(calls, saved)
