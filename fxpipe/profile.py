"""profile: where one rank's training steps go, measured while it trains.

Set ``pipe.profile = Profile()`` and every later ``step`` is accounted for, on each rank of this
process, in five parts that add up to the step's wall time:

* ``compute``: forwards, recomputations and backwards (F, R, B, I, W), less any time they spent
  blocked;
* ``waiting on a peer``: time blocked in a wait anywhere in the step (a receive whose sender had
  not sent yet or whose message was still in flight, a reduction or loss all-reduce whose other
  members had not posted yet, a send not yet received): the bubble and the imbalance;
* ``communication not hidden``: the rest of the time in communication actions: posting sends,
  receives and all-reduces (copies into send buffers, the norm of the gradient), unblocked joins;
* ``optimizer``: ``UPDATE`` (clipping's scale, the optimizer step, writing the next version);
* ``runtime overhead``: the rest, fxpipe's own Python between actions (input checks, splitting
  the batch into micro-batches, fetching the step's segment, the driver loop).

``summary()`` gives milliseconds per step. ``benchmarks/limit.py`` prints it per rank.

``action_times()`` gives, per stage and kind of training's compute action (and ``UPDATE``), the mean time
one such action worked (its wait left out): the run's own costs, which
:meth:`fxpipe.simulate.Costs.measured` puts in place of a plan's predicted ones. The simulator
replaying a schedule at its run's own action times checks the schedule model (order, waits,
transfers) apart from the cost model's prediction of those times.
"""

from __future__ import annotations

from collections import defaultdict

from .schedule import COMPUTE, Kind

__all__ = ["Profile", "CATEGORIES"]

CATEGORIES = ("compute", "waiting on a peer", "communication not hidden", "optimizer", "runtime overhead")
_COMPUTE = COMPUTE | {Kind.EVAL}


class Profile:
    """Seconds per category, summed over the steps seen (see the module docstring)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._in_actions = 0.0  # this step: wall time inside actions
        self._waited_in_actions = 0.0  # this step: blocked time inside actions
        # (stage, kind) -> [seconds worked, actions]: F, R, B, I, W and UPDATE (a sum and a
        # count, so a profile left on for days stays this size)
        self._worked: dict[tuple[int, Kind], list[float]] = {}

    def action(self, kind: Kind, seconds: float, waited: float, stage: int | None = None) -> None:
        """One executed action of ``stage``: its wall time and how much of it was blocked in a wait."""
        self._in_actions += seconds
        self._waited_in_actions += waited
        self.seconds["waiting on a peer"] += waited
        part = "compute" if kind in _COMPUTE else "optimizer" if kind is Kind.UPDATE else "communication not hidden"
        self.seconds[part] += seconds - waited
        if stage is not None and part != "communication not hidden" and kind is not Kind.EVAL:
            worked = self._worked.setdefault((stage, kind), [0.0, 0])
            worked[0] += seconds - waited
            worked[1] += 1

    def step(self, seconds: float, waited: float) -> None:
        """One ``step`` call: its wall time and the blocked time in it (in actions or not)."""
        outside = waited - self._waited_in_actions  # e.g. the loss read after the segment
        self.seconds["waiting on a peer"] += outside
        self.seconds["runtime overhead"] += seconds - self._in_actions - outside
        self._in_actions = self._waited_in_actions = 0.0
        self.steps += 1

    def summary(self) -> dict[str, float]:
        """Milliseconds per step in each category, and their sum (``step``)."""
        n = max(self.steps, 1)
        out = {c: 1e3 * self.seconds[c] / n for c in CATEGORIES}
        out["step"] = sum(out.values())
        return out

    def action_times(self) -> dict[tuple[int, Kind], float]:
        """Seconds one action of each (stage, kind) worked, on average: training's compute kinds
        (F, R, B, I, W) and ``UPDATE``, the time blocked in a wait left out (see the module
        docstring)."""
        return {key: total / n for key, (total, n) in sorted(self._worked.items())}
