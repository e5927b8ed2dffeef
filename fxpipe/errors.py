"""Exceptions fxpipe raises for problems a user can cause.

Every message says what was expected, what was found, and what to do about it.
"""


class FxpipeError(Exception):
    """Base class of every error fxpipe raises on purpose."""


class TraceError(FxpipeError):
    """The model could not be captured as a torch.fx graph."""


class PlanError(FxpipeError, ValueError):
    """No valid pipeline plan exists for the request (sizes, memory, stage count)."""


class ScheduleError(FxpipeError, ValueError):
    """An action list breaks a schedule invariant (order, matching, versions, memory)."""


class RuntimeMismatchError(FxpipeError, RuntimeError):
    """Ranks disagree: different plans, traces or batches."""
