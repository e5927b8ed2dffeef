"""calibrate: timing this machine. Every node of a traced graph run alone, forward and backward
(``cost_mode="measured"``, :func:`fxpipe.cost.annotate` reads :func:`measure_nodes`), and the
:class:`fxpipe.cost.DeviceModel` fitted to the whole model's forward and backward, the update,
the random numbers and zb's split (:func:`calibrate`), and to the link between two ranks
(:func:`measure_p2p`). The analytic model these figures feed is :mod:`fxpipe.cost`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .cost import DeviceModel, _bytes_moved, _dependence, _node_flops, _random_elements, annotate, is_view
from .backward import SavedTensors, SplitCache, backward_input, grads_into
from .device import moved_copy, release_heap, rng_devices
from .errors import PlanError
from .trace import get_attr, normalize_inputs

__all__ = ["calibrate", "measure_p2p", "measure_nodes"]


def calibrate(model: DeviceModel, gm: fx.GraphModule, example_inputs=None, *, optimizer=None,
              torch_device: str | torch.device | None = None, repeats: int = 10,
              barrier=None, host_ranks: int = 1, alone: bool = False, split: bool = False) -> "DeviceModel":
    """``model`` fitted to what this machine does with ``gm`` now: the whole traced graph
    runs forward and backward on ``example_inputs`` (median of ``repeats`` after two warm-ups;
    the backward adds into ``.grad`` buffers, as the runtime's adds into its accumulator; the
    gradients the parameters held are put back), and the roofline's ``peak_flops`` and
    ``mem_bandwidth`` are fitted so that the analytic forward times of the nodes sum to the measured forward, and
    ``backward_ratio`` so that their backwards sum to the measured backward. The two roofs
    are fitted apart: each node also runs alone, forward and backward (:func:`_roofs`);
    ``peak_flops`` is scaled against ``mem_bandwidth`` by how much faster than the model
    assumes this machine runs the nodes bound by FLOPs (matrix products) relative to those
    bound by bytes (elementwise passes, norms, copies), and ``backward_ratio_bytes`` keeps
    the measured ratio of the two kinds' backward ratios; one factor then scales both roofs
    to the measured forward, one more both backward ratios to the measured backward. With
    ``optimizer`` (``compile``'s factory) the runtime's update over parameters of the model's
    shapes (up to 8M elements), each timed right after a forward and backward as in training,
    gives ``update_time_per_byte`` and ``copy_time_per_byte``; a dropout mask gives
    ``random_time_per_element``, and the graph's random numbers at that pace are left out
    of the roofline's fit. Within each roof the per-node split keeps the roofline's
    proportions: what is calibrated is this machine's speed (two roofs and their backward
    ratios), not a stage's time, so a plan predicts splits, schedules, micro-batch counts
    and models it never ran.

    Ranks that calibrate together call it at once with the same ``barrier`` (e.g.
    ``torch.distributed.barrier``), which lines up every timed run, so each is timed while
    the others compute too. Where ``host_ranks`` > 1 of them share this host's cores (CPU
    processes), the rank with ``alone=True`` also times the model alone after each lined-up
    run, while the others wait in ``barrier``, and only it times the update, the random
    numbers, the roofs and the split (the others' models keep this model's figures for
    those): its model holds the speed alone and ``host_cores``, the number of ranks the host
    runs at full speed at once (the median over those pairs of ``host_ranks`` times alone
    over the lined-up run's span, barrier to barrier, which ends when the slowest rank is
    done), which the simulator uses to slow ranks that compute at the same time. ``split`` (the zb
    schedule) also times zb's input- and weight-gradient passes against a whole backward of
    the second half of the graph (``backward_input_share``, ``backward_weight_share``).
    ``compile(cost_mode="calibrated")`` calls it on every rank, rank 0 timing alone."""
    gm, dev, flat, sync = _timing_setup(gm, example_inputs, torch_device)
    args, kwargs = pytree.tree_unflatten(flat, gm.meta["fxpipe"].in_spec)  # the model's calling convention
    params = [p for p in gm.parameters() if p.requires_grad]
    if any(p.is_meta for p in params):
        raise PlanError("calibrate times the model on real tensors, but its parameters are on the meta device; "
                        "calibrate a real copy (or one block of it) and pass the result as device_model=, or plan "
                        "a meta model with cost_mode='analytic'")

    def once(line_up) -> tuple[float, float, float]:
        """One forward and backward: when it started, its forward and backward seconds. The
        backward adds the weight gradients into ``.grad`` buffers, as the runtime's does into
        its accumulator (on the pinned GPT of ``benchmarks/limit.py`` that is 2.5% of it)."""
        sync()
        if line_up is not None:
            line_up()
        t0 = time.perf_counter()
        outs = [o for o in pytree.tree_leaves(gm(*args, **kwargs)) if isinstance(o, torch.Tensor) and o.requires_grad]
        sync()
        t1 = time.perf_counter()
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs], inputs=params)
        sync()
        return t0, t1 - t0, time.perf_counter() - t1

    def medians(runs) -> tuple[float, float]:
        return statistics.median(f for _, f, _ in runs), statistics.median(b for _, _, b in runs)

    # this model's own figures for the update, the random numbers, the roofs and the split,
    # where they are not timed (no optimizer, no split, a rank that does not time alone)
    kept = ((model.update_time_per_byte, model.copy_time_per_byte), model.random_time_per_element,
            model._own_roofs(), (model.backward_input_share, model.backward_weight_share))

    def rest() -> tuple[tuple[float | None, float | None], float, tuple[float, float], tuple[float, float]]:
        """The update (step and copy), the random numbers, the roofs (:func:`_roofs`) and
        (``split``) zb's split."""
        update = kept[0] if optimizer is None else \
            _time_update(optimizer, [(n, p) for n, p in gm.named_parameters() if p.requires_grad], dev, sync,
                         max(3, repeats // 2), lambda: once(None))
        roofs = _roofs(gm, example_inputs, dev, max(3, repeats // 2), model)
        shares = _time_split(gm, flat, sync, repeats) if split else kept[3]
        return update, _time_random(dev, sync, repeats), roofs, shares

    cores = None
    shared = host_ranks > 1 and barrier is not None
    # The timed forwards update buffers in place (BatchNorm's running statistics): they are
    # put back afterwards, so calibrating leaves the model as it found it.
    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    with torch.random.fork_rng(devices=rng_devices(dev)), _restored(buffers), _accumulating(params):
        once(barrier), once(barrier)  # warm-up: the allocator's pools, lazily built kernels
        if not shared:
            runs = [once(barrier) for _ in range(repeats)]
            fwd, bwd = medians(runs)
            update, per_random, roofs, shares = rest()
        else:
            # Each lined-up run is followed by one run of the rank timing alone, while the others
            # wait in the barrier, so that each pair sees the host at one moment: a shared host's
            # pace drifts by a fifth from one minute to the next, and timing all the lined-up runs
            # first and then all the lone ones read that drift as the cores' sharing.
            runs, lone, ratios = [], [], []
            for _ in range(repeats):
                run = once(barrier)
                barrier()  # every rank is done
                # the lined-up run lasts, barrier to barrier, until the slowest rank is done: the
                # host's pace with every rank computing, however its scheduler shared the cores
                span = time.perf_counter() - run[0]
                runs.append(run)
                if alone:
                    lone.append(once(None))
                    ratios.append(host_ranks * (lone[-1][1] + lone[-1][2]) / span)
                barrier()  # the others wait here while this rank runs alone
            fwd, bwd = medians(runs)
            # The rest is timed by the rank timing alone, below, while the others wait: their
            # models keep this one's figures for it (compile plans with the alone rank's).
            update, per_random, roofs, shares = kept
            if alone:
                fwd, bwd = medians(lone)
                cores = min(max(statistics.median(ratios), 1.0), float(host_ranks))
                update, per_random, roofs, shares = rest()
            barrier()  # the others wait here while this rank times the rest

    # The random numbers the graph draws go at the generator's measured pace; the roofline,
    # its roofs set apart by their measured ratio, is fitted to the rest of the forward.
    speed, back = roofs
    roofline = dataclasses.replace(model, peak_flops=model.peak_flops * speed, random_time_per_element=0.0)
    costs = annotate(gm, mode="analytic", device=roofline)
    drawn = sum(_random_elements(node) for node in gm.graph.nodes)
    nodes = [c for c in costs.nodes.values() if c.fwd_time.a or c.fwd_time.c]
    n = len(nodes)
    batch = costs.batch_size
    lat = min(model.op_latency, 0.5 * fwd / max(n, 1))
    roof = sum(c.fwd_time(batch) - model.op_latency for c in nodes)  # time above the fixed cost
    scale = roof / max(fwd - n * lat - drawn * per_random, 1e-12)
    # The backward: nodes bound by bytes at the measured ratio to those bound by FLOPs, and
    # one factor for both so that the nodes' backwards sum to the measured one.
    grads = [c for c in nodes if c.requires_grad]
    weighted = sum((c.fwd_time(batch) - model.op_latency)
                   * (1.0 if roofline.bound_by_flops(c.flops(batch), c.bytes_moved(batch)) else back)
                   for c in grads) / scale
    ratio = max((bwd - len(grads) * lat) / max(weighted, 1e-12), 0.1)
    if dev.type == "cpu":
        release_heap()  # what the timing held (every node's output, in _roofs) leaves the rank's RSS
    return dataclasses.replace(model, peak_flops=roofline.peak_flops * scale, mem_bandwidth=model.mem_bandwidth * scale,
                               op_latency=lat, backward_ratio=ratio, backward_ratio_bytes=ratio * back,
                               update_time_per_byte=update[0],
                               copy_time_per_byte=update[1],
                               host_cores=cores, random_time_per_element=per_random,
                               backward_input_share=shares[0], backward_weight_share=shares[1])


def measure_p2p(model: DeviceModel, group=None, *, sizes: tuple[int, int] = (4, 8 << 20), repeats: int = 10) -> "DeviceModel":
    """``model`` with ``p2p_latency``/``p2p_bandwidth`` measured by a ping-pong between
    ranks 0 and 1 of ``group`` (every rank of the group must call it; the result is
    broadcast from rank 0 so all ranks plan with the same numbers). Without an initialised
    process group of two or more ranks, returns ``self`` unchanged."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) < 2:
        return model
    rank = dist.get_rank(group)
    peer0 = dist.get_global_rank(group, 0) if group is not None else 0
    peer1 = dist.get_global_rank(group, 1) if group is not None else 1
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    result = torch.zeros(2, dtype=torch.float64, device=dev)
    if rank in (0, 1):
        times = []
        for size in sizes:
            buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=dev)
            other = peer1 if rank == 0 else peer0
            samples = []
            for i in range(repeats + 1):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, other, group=group)
                    dist.recv(buf, other, group=group)
                else:
                    dist.recv(buf, other, group=group)
                    dist.send(buf, other, group=group)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if i:  # the first round trip sets up the connection
                    samples.append((time.perf_counter() - t0) / 2)
            times.append(statistics.median(samples))
        latency = times[0]
        bandwidth = (sizes[1] - sizes[0]) / max(times[1] - times[0], 1e-9)
        result = torch.tensor([latency, bandwidth], dtype=torch.float64, device=dev)
    dist.broadcast(result, peer0, group=group)
    return dataclasses.replace(model, p2p_latency=float(result[0]), p2p_bandwidth=float(result[1]))


def _timing_setup(gm: fx.GraphModule, example_inputs, torch_device):
    """(``gm`` on the device, the device, the graph's flat inputs on it, a sync that waits for the
    device) for timing ``gm``: a model built on the CPU for a GPU is timed as a copy moved there
    (:func:`fxpipe.device.moved_copy`, same node names); the inputs are the example's, or
    synthesised from the traced shapes."""
    dev = torch.device(torch_device) if torch_device is not None else torch.device("cpu")
    gm = moved_copy(gm, dev)
    if example_inputs is None:
        flat = _synth_inputs(gm)
    else:
        args, kwargs = normalize_inputs(example_inputs)
        flat = gm.meta["fxpipe"].flatten_inputs(args, kwargs)
    flat = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in flat]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    return gm, dev, flat, sync


def _time_update(factory, named, dev, sync, repeats: int, before, budget: int = 8 << 20) -> tuple[float, float]:
    """Seconds per parameter byte of the runtime's ``UPDATE`` as it runs in training: (the step
    of the optimizer ``factory`` makes plus zeroing the gradient accumulator; the copy of one
    weight version into another's buffer, which 2bw makes of ``W(t-1)`` before stepping it into
    ``W(t)``'s slot). Over copies of the parameters ``named`` (``(name, parameter)`` in model
    order, the names the factory gets in training), those that fit in ``budget`` elements
    together (a larger one is passed over; the smallest if none fits), laid out as the runtime
    lays out a stage's: each dtype's weights, their previous version and their gradients in one
    flat buffer each. ``before`` (a forward and backward of the model, untimed) runs
    before each timed update, so the update meets the caches as a backward leaves them: on a
    2-core CPU host the step then takes 1.6x what it takes in a loop of steps alone."""
    if not named:
        return 0.0, 0.0
    chosen, total = [], 0
    for name, p in named:
        if total + p.numel() <= budget:
            chosen.append((name, p))
            total += p.numel()
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, p in chosen or [min(named, key=lambda item: item[1].numel())]:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    stand_ins, flats, nbytes = [], [], 0
    for dtype, ps in by_dtype.items():
        n = sum(p.numel() for _, p in ps)
        weights, previous, grads = (torch.randn(n, device=dev).to(dtype) for _ in range(3))
        flats.append((weights, previous, grads))
        nbytes += weights.numel() * weights.element_size()
        offset = 0
        for name, p in ps:
            q = torch.nn.Parameter(weights[offset:offset + p.numel()].view(p.shape))
            q.grad = grads[offset:offset + p.numel()].view(p.shape)
            stand_ins.append((name, q))
            offset += p.numel()
    opt = factory(stand_ins)

    def step():
        opt.step()
        for _, _, grads in flats:
            grads.zero_()

    before()
    step()  # builds the optimizer's state
    steps, copies = [], []
    for _ in range(repeats):
        before()
        sync()
        t0 = time.perf_counter()
        for weights, previous, _ in flats:
            weights.copy_(previous)
        sync()
        t1 = time.perf_counter()
        step()
        sync()
        steps.append(time.perf_counter() - t1)
        copies.append(t1 - t0)
    return statistics.median(steps) / nbytes, statistics.median(copies) / nbytes


def _median_seconds(fn, sync, repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` on the device, after one untimed call."""
    fn()
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _time_random(dev, sync, repeats: int, elements: int = 1 << 20) -> float:
    """Seconds per random number of a dropout mask (the commonest draw in training) on ``dev``,
    less the roofline-free part: the same elementwise pass without drawing (a multiply by a
    ready mask)."""
    x = torch.ones(elements, device=dev)
    mask = torch.ones(elements, device=dev)
    drawing = _median_seconds(lambda: torch.nn.functional.dropout(x, 0.1, training=True), sync, repeats)
    plain = _median_seconds(lambda: x * mask, sync, repeats)
    return max(drawing - plain, 0.0) / elements


@contextlib.contextmanager
def _restored(buffers: list[tuple[torch.Tensor, torch.Tensor]]):
    """Copy each saved value back into its buffer on the way out."""
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)


def _accumulating(params: list[torch.Tensor]):
    """Point each parameter's ``.grad`` at a zeroed buffer of its own, so that timed backwards
    accumulate into it as the runtime's do; the gradients the parameters held come back after."""
    return grads_into(params, [torch.zeros_like(p) for p in params])


def _time_split(gm: fx.GraphModule, flat: list, sync, repeats: int) -> tuple[float, float]:
    """zb's ``I`` and ``W`` (:mod:`fxpipe.backward`) over a whole backward, timed alternately on
    the graph's second half: at its middle floating-point node the forward detaches every live
    value into a boundary input, as a cut into two stages would. Each is timed where zb runs it
    on the last stage (:func:`fxpipe.schedule.zb_split`), ``F k+1, I k+1, W k``: ``I`` while an
    earlier micro-batch's weight pass is pending, ``W`` after a later micro-batch's forward and
    ``I``, so what a deferred micro-batch holds weighs on both as in training; the whole
    backward as 1f1b runs it, with nothing pending. (1, 0) where the graph cannot be split (the
    runtime then runs the whole backward in ``I``); (0.5, 0.5), untimed, for a graph with no
    floating-point node of 2 or more dims or no trainable weight."""
    floats = [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
              and n.meta["val"].is_floating_point() and n.meta["val"].dim() >= 2]
    weights = {name: p for name, p in gm.named_parameters() if p.requires_grad}
    if not floats or not weights:
        return 0.5, 0.5
    cut = floats[len(floats) // 2]
    cache = SplitCache()  # analysed once, as the runtime does

    class Cut(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n is cut:
                self.boundary = []
                for node, v in self.env.items():  # the values still live here (the interpreter frees the rest)
                    if node.op.startswith("call") and isinstance(v, torch.Tensor) and v.requires_grad:
                        self.env[node] = v.detach().requires_grad_()
                        self.boundary.append(self.env[node])
                out = out.detach().requires_grad_()
                self.boundary.append(out)
            return out

    def forward(split: bool):
        run = Cut(gm)
        saved = SavedTensors() if split else None  # as the runtime runs a zb forward
        with saved.hooks() if split else contextlib.nullcontext():
            outs = run.run(*flat)
        roots = [o for o in pytree.tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        return run.boundary, roots, [torch.ones_like(r) for r in roots], saved

    def whole() -> float:
        boundary, roots, seeds, _ = forward(False)
        sync()
        t0 = time.perf_counter()
        # the weight gradients accumulate, as in the runtime's backward
        torch.autograd.backward(roots, seeds, inputs=[*boundary, *weights.values()])
        sync()
        return time.perf_counter() - t0

    def input_pass():
        """A forward and its ``I``: (seconds of ``I``, what ``W`` needs), or None where the graph
        cannot be split."""
        boundary, roots, seeds, saved = forward(True)
        sync()
        t0 = time.perf_counter()
        got = backward_input(roots, seeds, boundary, weights, saved, cache)
        if isinstance(got, str):
            return None
        sync()
        return time.perf_counter() - t0, got[1]

    def weight_pass(pending) -> float:
        sync()
        t0 = time.perf_counter()
        pending.run(into={name: w.grad for name, w in weights.items()})  # into the accumulator, as the runtime's
        sync()
        return time.perf_counter() - t0

    def split() -> tuple[float, float]:
        _, pending = input_pass()
        i, following = input_pass()
        w = weight_pass(pending)
        weight_pass(following)
        return i, w

    with _accumulating(list(weights.values())):
        first = input_pass()
        if first is None:
            return 1.0, 0.0
        weight_pass(first[1])
        split(), whole()  # warm-up
        wholes, parts = [], []
        for _ in range(repeats):
            wholes.append(whole())
            parts.append(split())
    b = max(statistics.median(wholes), 1e-12)
    return statistics.median(i for i, _ in parts) / b, statistics.median(w for _, w in parts) / b


def _roofs(gm: fx.GraphModule, example_inputs, torch_device, repeats: int, device: DeviceModel) -> tuple[float, float]:
    """How this machine's speeds stand to each other where ``device``'s roofline cannot tell:
    (how much faster than ``device`` assumes it runs the nodes bound by FLOPs, relative to those
    bound by bytes; the backward over the forward of the nodes bound by bytes, relative to that
    of the nodes bound by FLOPs). Every compute node runs alone forward and backward
    (:func:`measure_nodes`, less ``op_latency`` each), and the nodes are sorted by the roof that binds
    them (at ``device``'s figures, then once more at the first answer's). On a CPU a
    transformer's matrix products run near the FLOP roof with a backward of two products, and
    its elementwise passes (a GELU's five, a mask, dropout's multiply) well below the memory roof
    with a backward barely dearer than the pass: priced with one factor and one backward ratio
    for both, a model with more such passes than the calibrated one (Hugging Face GPT-2 beside
    the pinned GPT of ``benchmarks/limit.py``) is priced too fast forward and too slow backward.
    Views and random draws (priced at their own pace) count in neither group; a ratio stays
    ``device``'s where a group has nothing to give it (no node, or no node with a backward). The
    timing holds every node's output and its backward's graph at once, a few times one forward's
    activations (on the CPU :func:`fxpipe.device.release_heap` hands that back after the
    calibration); where that does not fit, both stay ``device``'s, with a warning, rather than
    fail the calibration."""
    own = device._own_roofs()
    _, grad = _dependence(gm)
    try:
        seconds = measure_nodes(gm, example_inputs, torch_device, repeats, grad)
    except (torch.OutOfMemoryError, MemoryError) as e:
        warnings.warn(f"fxpipe: calibrate could not time each node of the model alone ({type(e).__name__}: the timing "
                      f"holds every node's output at once), so the FLOP and memory roofs and their backward ratios keep "
                      f"the device model's proportions. Calibrate a smaller micro-batch or one block of the model to "
                      f"fit them apart.", RuntimeWarning, stacklevel=2)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return own
    cache: dict = {}
    nodes = []  # (FLOPs, bytes moved, forward, backward or None)
    for node in gm.graph.nodes:
        if node.name not in seconds or is_view(node) or _random_elements(node):
            continue
        flops, moved = _node_flops(gm, node, cache), sum(_bytes_moved(node, node.meta["fxpipe"]))
        if flops or moved:
            fwd, bwd = (max(t - device.op_latency, 0.0) for t in seconds[node.name])
            nodes.append((flops, moved, fwd, bwd if grad[node.name] else None))

    def sums_at(roof: DeviceModel) -> dict[bool, list[float]]:
        """Per group (bound by FLOPs at ``roof``'s figures or not): the roofline's time, the
        measured forward, the measured forward of the nodes with a backward, their backward."""
        sums = {True: [0.0, 0.0, 0.0, 0.0], False: [0.0, 0.0, 0.0, 0.0]}
        for flops, moved, fwd, bwd in nodes:
            group = sums[roof.bound_by_flops(flops, moved)]
            group[0] += max(flops / roof.peak_flops, moved / roof.mem_bandwidth)
            group[1] += fwd
            if bwd is not None:
                group[2] += fwd
                group[3] += bwd
        return sums

    def ratio(sums, part: int, whole: int) -> float | None:  # (part / whole) of the FLOP-bound over the byte-bound
        if not all(group[part] > 0 and group[whole] > 0 for group in sums.values()):
            return None
        return (sums[True][part] / sums[True][whole]) / (sums[False][part] / sums[False][whole])

    speed = 1.0
    for _ in range(2):  # the groups at device's roofs, then at the roofs the first answer sets apart
        sums = sums_at(dataclasses.replace(device, peak_flops=device.peak_flops * speed))
        speed *= ratio(sums, 0, 1) or 1.0  # priced over measured
    back = ratio(sums, 3, 2)  # backward over forward
    return speed, 1.0 / back if back else own[1]


def _synth_inputs(gm: fx.GraphModule) -> list:
    flat = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            if v.dtype.is_floating_point:
                flat.append(torch.randn(tuple(v.shape), dtype=v.dtype))
            elif v.dtype == torch.bool:
                flat.append(torch.ones(tuple(v.shape), dtype=v.dtype))
            else:
                flat.append(torch.zeros(tuple(v.shape), dtype=v.dtype))
        else:
            flat.append(v)
    return flat


def measure_nodes(gm, example_inputs, torch_device, repeats: int, grad: dict[str, bool]) -> dict[str, tuple[float, float]]:
    """Median forward and backward seconds of every compute node, run one by one on real
    tensors. A first pass runs every node once (warm-up, and the values the next nodes read);
    then ``repeats`` passes time every node's forward and backward once each, so a burst of
    background load costs one sample of many nodes instead of every sample of a few, and the
    median discards it. Parameters are used in place (detached aliases, no copies); buffers are
    cloned so in-place updates (BatchNorm statistics) leave the model untouched; the RNG is
    restored. Each backward runs on copies of its node's other inputs (:func:`_backward_closure`),
    so up to twice one micro-batch's activations are alive; a node that writes into an input is
    timed again on copies of its inputs (the copy inside its time), so the values the next nodes
    and the backwards read stay those of the first pass."""
    gm, dev, flat, sync = _timing_setup(gm, example_inputs, torch_device)
    env: dict[str, Any] = {}
    it = iter(flat)
    params = dict(gm.named_parameters())
    runs: dict[str, tuple[Any, Any]] = {}  # node -> (forward closure, backward closure or None)
    weights: set[int] = set()  # ids of the parameters' aliases in env (never written by a node)

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    with torch.random.fork_rng(devices=rng_devices(dev)):
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if node.op == "placeholder":
                env[node.name] = next(it)
                continue
            if node.op == "get_attr":
                obj = get_attr(gm, node.target)
                if isinstance(obj, torch.Tensor):
                    obj = obj.detach().to(dev)
                    if node.target in params:
                        obj.requires_grad_()
                        weights.add(id(obj))
                    else:
                        obj = obj.clone()
                env[node.name] = obj
                continue
            fn = _callable(gm, node)
            load = lambda a: env[a.name] if isinstance(a, fx.Node) else a  # noqa: E731
            args = pytree.tree_map(load, node.args)
            kwargs = pytree.tree_map(load, node.kwargs)

            def forward(fn=fn, args=args, kwargs=kwargs):
                with torch.no_grad():
                    return fn(*args, **kwargs)

            env[node.name] = forward()
            backward = _backward_closure(fn, args, kwargs, weights) if grad[node.name] else None
            if backward is not None:
                backward()
            if _mutates(node):  # timed again on copies: the values other nodes read stay as the graph made them
                def forward(fn=fn, args=args, kwargs=kwargs):
                    with torch.no_grad():
                        return fn(*_copies(args), **_copies(kwargs))
            runs[node.name] = (forward, backward)
        samples: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in runs}
        for _ in range(repeats):
            for name, (forward, backward) in runs.items():
                samples[name][0].append(timed(forward))
                samples[name][1].append(timed(backward) if backward is not None else 0.0)
    return {n: (statistics.median(f), statistics.median(bw)) for n, (f, bw) in samples.items()}


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes into an argument (``index_put_``, ``add_``, ``copy_``)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    return node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__")


def _copies(tree):
    """``tree`` with every tensor replaced by a copy of it."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _backward_closure(fn, args, kwargs, weights: set[int] = frozenset()):
    """A callable running the backward of ``fn(*args, **kwargs)`` with respect to every floating
    input (parameters included), or None when nothing is differentiable. It runs ``fn`` on copies
    of the tensors but the parameters (``weights``: their ids): every floating input is a leaf
    here, so autograd may save one the model's own graph does not, and a later node may write
    into it in place (a mixture of experts' index and accumulator tensors), which would fail this
    backward's version check; and ``fn`` itself may write into its inputs."""
    leaves: list[torch.Tensor] = []

    def leaf(x):
        if isinstance(x, torch.Tensor) and (x.dtype.is_floating_point or x.is_complex()):
            x = x.detach() if id(x) in weights else x.detach().clone()
            leaves.append(x.requires_grad_())
        elif isinstance(x, torch.Tensor):
            x = x.clone()
        return x

    try:
        a = pytree.tree_map(leaf, args)
        k = pytree.tree_map(leaf, kwargs)
        with torch.enable_grad():
            res = fn(*a, **k)
        outs = [t for t in pytree.tree_leaves(res) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not leaves:
            return None
        grads = [torch.ones_like(t) for t in outs]
        return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    except RuntimeError:
        # An in-place op on a leaf cannot be differentiated in isolation; its backward is
        # usually a copy of the incoming gradient, about as fast as its forward.
        def as_forward():
            with torch.no_grad():
                fn(*_copies(args), **_copies(kwargs))

        return as_forward


def _callable(gm: fx.GraphModule, node: fx.Node):
    if node.op == "call_module":
        return gm.get_submodule(node.target)
    if node.op == "call_method":
        return lambda self, *a, **k: getattr(self, node.target)(*a, **k)
    return node.target
