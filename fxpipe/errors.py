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


class ConfigError(FxpipeError, ValueError):
    """An argument of ``fxpipe.compile`` is invalid (checked before anything runs)."""


class InputError(FxpipeError, ValueError):
    """A batch given to ``step``/``eval_step`` does not fit the traced example inputs or the
    plan (checked before anything is split or communicated)."""


class PeerError(FxpipeError, RuntimeError):
    """A wait on another rank failed: the peer died, hangs, or answered too late."""


class NonFiniteError(FxpipeError, FloatingPointError):
    """A loss or gradient was NaN or infinite (``nonfinite="raise"``); no weight took it in."""


class CheckpointError(FxpipeError):
    """A checkpoint cannot be written or read, or does not fit this pipeline."""
