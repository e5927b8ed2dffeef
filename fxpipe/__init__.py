"""fxpipe: pipeline-parallel training for ordinary PyTorch models.

    pipe = fxpipe.compile(model, example_inputs, loss_fn=..., optimizer=..., microbatches=8)
    loss = pipe.step(inputs, target)

Phases, one module each: ``trace`` -> ``cost`` -> ``partition`` (a :class:`Plan`) ->
``codegen`` -> ``schedule`` -> ``runtime``; ``inspect`` dumps any of them.
"""

from .cluster import Cluster
from .errors import FxpipeError, PlanError, RuntimeMismatchError, ScheduleError, TraceError
from .inspect import inspect
from .partition import plan
from .pipeline import Pipeline, compile
from .plan import Plan
from .trace import trace

__version__ = "0.1.0"

__all__ = [
    "compile",
    "Pipeline",
    "trace",
    "plan",
    "Plan",
    "Cluster",
    "inspect",
    "FxpipeError",
    "TraceError",
    "PlanError",
    "ScheduleError",
    "RuntimeMismatchError",
]
