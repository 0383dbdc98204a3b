"""A preemption notice that reaches a worker group while it starts or restores, before its first step.

Ray Train's PreemptionWatcher hands a drain on any of the group's nodes to every worker (its
`mark_preempt`) from the moment the group is placed, while the training function is still restoring the
checkpoint, importing and building its engine: seconds to tens of seconds on a cold or busy node. A group
that looked at its notice only at its first step stepped into a deadline it could no longer save within
(an emergency save abandoned "no time", the steps since the restore lost). So the start looks at it at
each phase boundary -- placed, restored, engine built, and before the first step (StepPolicy
.before_first_step) -- through one small collective, so every rank sees every rank's notice and they leave
together: the group's state is still the checkpoint it restored (the newest committed one), nothing was
stepped, nothing is saved or lost; the restart sizes the next group without the draining node.
"""
from __future__ import annotations

import time

from spotfill.train.step_policy import StepFacts, StepPolicy

# the phase boundaries of a group's start where every rank looks at its notice (before the first step too)
PHASES = ("placed", "restored", "engine built", "loaded")


class PlannedExit(RuntimeError):
    """Raised by every rank after a committed checkpoint (or before any step) so Ray Train restarts the
    group at a new size."""


class StartNotice:
    """One group's look at its notice during the start. `read_notice()` returns this worker's notice (a
    PreemptionInfo or None), `gather(obj)` every rank's value of `obj` (the group's collective)."""

    def __init__(self, policy: StepPolicy, read_notice, gather, rank: int, entered_t: float):
        self.policy, self.read_notice, self.gather = policy, read_notice, gather
        self.rank, self.entered_t = rank, entered_t

    def decide(self, phase: str, done: int):
        """Every rank's notice (one collective) -> the policy's decision (None: start on)."""
        notice = self.read_notice()
        mine = (notice is not None, getattr(notice, "deadline_ms", None) if notice is not None else None)
        rows = self.gather(mine)
        deadlines = [d / 1000.0 for held, d in rows if held and d]
        return self.policy.before_first_step(
            StepFacts(done=done, now=time.time(), preempt_votes=sum(1 for held, _ in rows if held),
                      deadline_unix_s=min(deadlines) if deadlines else None), phase=phase)

    def check(self, phase: str, done: int, sink, on_leave=None) -> None:
        """Leave now (every rank raises PlannedExit) when any rank holds a notice; rank 0 first records the
        planned exit with the phase it came in and how long after the training function started."""
        d = self.decide(phase, done)
        if d is None:
            return
        if on_leave is not None:
            on_leave()
        if self.rank == 0:
            import ray
            ray.get(sink.planned_exit.remote(d.reason, step=done, detail=d.detail,
                                             phase=phase, before_first_step=True,
                                             notice_deadline_unix_s=d.notice_deadline_unix_s,
                                             since_start_s=round(time.time() - self.entered_t, 3)))
        raise PlannedExit(f"{d.reason} at step {done} ({d.detail}); restarting the worker group")
