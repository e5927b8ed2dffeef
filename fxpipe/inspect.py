"""inspect: dump what each phase produced, as text tables, JSON and pictures.

``fxpipe.inspect(model, example_inputs, out_dir, stages=d)`` writes::

    nodes.txt / nodes.json   one row per traced node: name, op, target, module path, output
                             shape, dtype, bytes, parameter bytes, stage
    graph.dot                the graph for Graphviz (``dot -Tsvg graph.dot``), one cluster and
                             colour per stage
    plan.txt / plan.json     the plan table and the reloadable plan
    stage_{i}.py             each stage's generated code, with a header naming its boundary
    schedule.txt/.json/.svg  the schedule's step x rank grid, Chrome-trace timeline and picture
                             (simulated from the plan's costs): the Program fxpipe.compile
                             runs for this plan (Program.of_plan), norm all-reduce included

Without ``stages`` only the trace dumps (nodes, graph) are written. A compiled pipeline writes
the same set, its own Program's schedule and its recorded timeline, with ``pipe.dump(out_dir)``.

The CLI form is ``fxpipe inspect MODULE:FACTORY --out DIR`` where ``FACTORY()`` returns
``(model, example_inputs)``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch.fx as fx
from tabulate import tabulate

from .trace import trace

__all__ = ["inspect", "node_rows", "write_node_table", "write_dot"]

# Distinguishable pastel fills for up to 12 stages (cycled beyond).
_PALETTE = [
    "#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99",
    "#8dd3c7", "#bebada", "#80b1d3", "#fccde5", "#d9d9d9", "#ccebc5",
]


def _target(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)


def node_rows(gm: fx.GraphModule, assignment: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """One dict per node with the columns of the node table."""
    rows = []
    for node in gm.graph.nodes:
        info = node.meta.get("fxpipe")
        outs = info.outputs if info else ()
        row = {
            "name": node.name,
            "op": node.op,
            "target": _target(node),
            "module": info.module_path if info else "",
            "shape": ", ".join(str(list(s.shape)) for s in outs),
            "dtype": ", ".join(s.dtype for s in outs),
            "bytes": info.out_bytes if info else 0,
            "param_bytes": info.param_bytes if info else 0,
        }
        if assignment is not None:
            row["stage"] = assignment.get(node.name, "")
        rows.append(row)
    return rows


def write_node_table(gm: fx.GraphModule, out_dir: str, assignment: Mapping[str, int] | None = None) -> list[str]:
    """Write ``nodes.txt`` (tabulate) and ``nodes.json``; returns the paths."""
    rows = node_rows(gm, assignment)
    txt = os.path.join(out_dir, "nodes.txt")
    js = os.path.join(out_dir, "nodes.json")
    info = gm.meta.get("fxpipe")
    header = ""
    if info:
        header = f"# {info.model_class}: {len(rows)} nodes, traced with {info.path}\n"
        if info.export_error:  # why torch.export refused the model, the first line of its error
            header += f"# torch.export failed first: {info.export_error.splitlines()[0]}\n"
    with open(txt, "w") as f:
        f.write(header + tabulate(rows, headers="keys", tablefmt="simple") + "\n")
    with open(js, "w") as f:
        json.dump(rows, f, indent=1)
    return [txt, js]


def write_dot(gm: fx.GraphModule, out_dir: str, assignment: Mapping[str, int] | None = None) -> str:
    """Write ``graph.dot``: compute nodes as boxes, inputs as ellipses, parameters as notes;
    with an assignment, one cluster (and fill colour) per stage."""
    path = os.path.join(out_dir, "graph.dot")

    def label(n: fx.Node) -> str:
        info = n.meta.get("fxpipe")
        shape = " x ".join(str(list(s.shape)) for s in info.outputs) if info else ""
        return f"{n.name}\\n{_target(n)}\\n{shape}".replace('"', "'")

    def attrs(n: fx.Node) -> str:
        shape = {"placeholder": "ellipse", "get_attr": "note", "output": "doublecircle"}.get(n.op, "box")
        fill = "white"
        if assignment is not None and n.name in assignment:
            fill = _PALETTE[assignment[n.name] % len(_PALETTE)]
        return f'label="{label(n)}", shape={shape}, style=filled, fillcolor="{fill}"'

    lines = ["digraph fxpipe {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=9];']
    nodes = list(gm.graph.nodes)
    if assignment is None:
        lines += [f'  "{n.name}" [{attrs(n)}];' for n in nodes]
    else:
        for stage in sorted(set(assignment.values())):
            lines.append(f"  subgraph cluster_stage{stage} {{")
            lines.append(f'    label="stage {stage}"; style=rounded; color="{_PALETTE[stage % len(_PALETTE)]}";')
            lines += [f'    "{n.name}" [{attrs(n)}];' for n in nodes if assignment.get(n.name) == stage]
            lines.append("  }")
        lines += [f'  "{n.name}" [{attrs(n)}];' for n in nodes if n.name not in assignment]
    for n in nodes:
        for user in n.users:
            lines.append(f'  "{n.name}" -> "{user.name}";')
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def inspect(model, example_inputs, out_dir: str, *, stages: int | None = None, microbatches: int | None = None,
            schedule: str = "2bw", leaf_modules=(), lookahead: int | None = None, chunks: int = 1) -> list[str]:
    """Trace ``model`` and write the node table (text + JSON) and the DOT graph into
    ``out_dir``; with ``stages`` also plan, split and schedule it (see :func:`inspect_pipeline`).
    Returns the paths written."""
    if stages is not None:
        return inspect_pipeline(model, example_inputs, out_dir, stages=stages, microbatches=microbatches,
                                schedule=schedule, leaf_modules=leaf_modules, lookahead=lookahead, chunks=chunks)
    os.makedirs(out_dir, exist_ok=True)
    gm = model if isinstance(model, fx.GraphModule) and "fxpipe" in model.meta else trace(
        model, example_inputs, leaf_modules=leaf_modules
    )
    return _without_stale(out_dir, write_node_table(gm, out_dir) + [write_dot(gm, out_dir)])


#: The files the dumps write (``*``: a stage's index); a folder written again keeps only this run's.
_DUMP_FILES = ("nodes.txt", "nodes.json", "graph.dot", "plan.txt", "plan.json", "stage_*.py",
               *(f"{name}.{ext}" for name in ("schedule", "timeline") for ext in ("txt", "json", "svg")))


def _without_stale(out_dir: str, written: list[str]) -> list[str]:
    """Delete the dumps an earlier run left in ``out_dir`` that this one did not write (a deeper
    plan's ``stage_2.py`` beside a 2-stage plan, say); returns ``written``."""
    import glob

    fresh = {os.path.abspath(p) for p in written}
    for pattern in _DUMP_FILES:
        for path in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
            if os.path.abspath(path) not in fresh and os.path.isfile(path):
                os.remove(path)
    return written


def write_plan(plan, out_dir: str) -> list[str]:
    """``plan.txt`` (the printed plan) and ``plan.json`` (``Plan.to_json``, reloadable)."""
    txt, js = os.path.join(out_dir, "plan.txt"), os.path.join(out_dir, "plan.json")
    with open(txt, "w") as f:
        f.write(str(plan) + "\n")
    with open(js, "w") as f:
        f.write(plan.to_json())
    return [txt, js]


# Steps drawn in the schedule dumps (then the flush): the fill, a steady step and the drain.
_DUMP_STEPS = 3


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _plan_words(plan) -> str:
    """``2bw (lookahead 1), 2 stages x 1 replica, 4 micro-batches of 8 per step``: a picture's title."""
    ahead = f" (lookahead {plan.lookahead})" if plan.lookahead else ""
    if plan.chunks > 1:
        ahead += f" ({plan.chunks} stages per rank)"
    return (f"{plan.schedule}{ahead}, {_count(plan.stages, 'stage', 'stages')} x "
            f"{_count(plan.width, 'replica', 'replicas')}, "
            f"{_count(plan.microbatches, 'micro-batch', 'micro-batches')} of {plan.microbatch_size} per step")


def _simulated_schedule(out_dir: str, lists, plan) -> list[str]:
    """``schedule.txt/.json/.svg``: ``lists`` timed by the simulator with the plan's predicted costs."""
    from .simulate import Costs, write_schedule_dumps

    title = f"schedule simulated with the plan's {plan.cost_mode} costs (a prediction): {_plan_words(plan)}"
    return [str(p) for p in write_schedule_dumps(out_dir, lists, Costs.of_plan(plan), name="schedule", title=title,
                                                 unit="s", microbatches=plan.microbatches,
                                                 chunks=plan.chunks).values()]


def write_pipeline_dumps(pipe, out_dir: str, events=()) -> list[str]:
    """Everything about a compiled pipeline: node table and graph with stages, plan, stage code,
    the simulated schedule and (when ``events`` were recorded) the measured timeline."""
    from .codegen import write_stage_code
    from .simulate import timeline_from_events, write_schedule_dumps

    os.makedirs(out_dir, exist_ok=True)
    gm = pipe.staged_graph
    assignment = pipe.plan.assignment
    paths = write_node_table(gm, out_dir, assignment) + [write_dot(gm, out_dir, assignment)]
    paths += write_plan(pipe.plan, out_dir)
    paths += [str(p) for p in write_stage_code(pipe.staged, out_dir)]
    lists = pipe.program.lists(_DUMP_STEPS)  # the Program the pipeline runs, not a second opinion
    paths += _simulated_schedule(out_dir, lists, pipe.plan)
    if events:
        where = (f"{pipe.world_size} processes" if pipe.distributed
                 else "one process (its ranks take turns on one thread)")
        title = f"recorded timeline: {_plan_words(pipe.plan)}, {where}"
        tl = timeline_from_events(events, apart=pipe.distributed)  # under torchrun, each rank's own step()
        written = write_schedule_dumps(out_dir, lists, timeline=tl, name="timeline", title=title, unit="s",
                                       microbatches=pipe.plan.microbatches, total_steps=pipe.steps,
                                       chunks=pipe.plan.chunks)
        paths += [str(p) for p in written.values()]
    return _without_stale(out_dir, paths)


def inspect_pipeline(model, example_inputs, out_dir: str, *, stages: int = 2, microbatches: int | None = None,
                     schedule: str = "2bw", leaf_modules=(), lookahead: int | None = None, chunks: int = 1) -> list[str]:
    """Trace, plan (analytic costs), split and schedule ``model`` without training it, and write
    every dump: node table and DOT graph with stage columns/clusters, the plan, one Python file
    per stage, and the schedule's grid, Chrome-trace JSON and SVG picture. ``lookahead``: as
    ``fxpipe.compile``'s (None: the planner's); ``chunks``: stages per rank (1f1b, interleaved:
    ``stages`` counts them all, on ``stages / chunks`` ranks)."""
    from .codegen import from_plan, write_stage_code
    from .errors import ConfigError
    from .partition import plan as make_plan
    from .schedule import Program, norm_every_step

    if microbatches is not None and not (isinstance(microbatches, int) and microbatches >= 1):
        raise ConfigError(
            f"microbatches must be an int >= 1 (micro-batches per step), found {microbatches!r}: pass a positive "
            f"number, or None for the default max(2 x stages, 4) = {max(2 * stages, 4)}"
        )
    os.makedirs(out_dir, exist_ok=True)
    gm = trace(model, example_inputs, leaf_modules=leaf_modules)
    m = microbatches if microbatches is not None else max(2 * stages, 4)
    # What fxpipe.compile plans and runs at these stages and micro-batches: its per-step norm all-reduce (2bw: a second gradient buffer).
    p = make_plan(gm, None, stages=stages, microbatches=m, schedule=schedule, world_size=max(stages // chunks, 1),
                  clip=norm_every_step(), lookahead=lookahead, chunks=chunks)
    staged = from_plan(gm, p)
    tied = sorted({s for tp in staged.tied if len(tp.stages) > 1 for s in tp.stages})
    assignment = p.assignment
    paths = write_node_table(gm, out_dir, assignment) + [write_dot(gm, out_dir, assignment)]
    paths += write_plan(p, out_dir)
    paths += [str(x) for x in write_stage_code(staged, out_dir)]
    lists = Program.of_plan(p, tied).lists(_DUMP_STEPS)
    return _without_stale(out_dir, paths + _simulated_schedule(out_dir, lists, p))
