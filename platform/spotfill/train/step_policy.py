"""What a worker group does after each optimizer step (pure: no Ray, torch or clock of its own).

The step loop (worker_loop.py) gathers the step's facts -- shared by every rank through the step's one
collective, so every rank reaches the same decision -- and applies the decision this module returns:

    continue        nothing to do
    save            a periodic checkpoint: snapshot now, upload in the background
    save_and_exit   a checkpoint, then leave so Ray Train restarts the group: a preemption notice
                    (emergency save within the notice's deadline) or room for more workers (grow save)
    exit            a preemption notice whose deadline leaves no time to commit a checkpoint: leave now,
                    the restart resumes from the newest committed one
    finish          the last step: a final synchronous save and the end of training -- also when a
                    preemption or grow flag is raised on that step (nothing is left to restart for)

Time is an argument (`now`, unix seconds), so the policy is tested with a fake clock.
"""
from __future__ import annotations

from dataclasses import dataclass

CONTINUE, SAVE, SAVE_AND_EXIT, EXIT, FINISH = "continue", "save", "save_and_exit", "exit", "finish"

# Seconds kept back from a preemption deadline for what follows the commit: the planned-exit event, the
# worker group's teardown. Ray Train kills the workers at the deadline (FailureConfig.preemption_grace_s 0).
# The worker loop passes the checkpointer's margin (constants.EMERGENCY_MARGIN_S): one margin for both, so
# the step policy's "no time" and the checkpointer's budget are the same number.
EMERGENCY_MARGIN_S = 1.0


@dataclass(frozen=True)
class StepFacts:
    """What every rank knows after step `done` (1-based count of completed steps) and its collective."""
    done: int
    now: float                              # unix seconds
    preempt_votes: int = 0                  # ranks that hold a preemption notice
    deadline_unix_s: float | None = None    # earliest notice deadline among them (None: none given)
    grow_workers: int = 0                   # workers beyond the current size that fit now (rank 0 asks)
    upload_in_flight: bool = False          # a periodic checkpoint is still uploading


@dataclass(frozen=True)
class StepDecision:
    action: str                             # CONTINUE, SAVE, SAVE_AND_EXIT, EXIT or FINISH
    reason: str = ""                        # "periodic", "preemption", "grow", "last step", ...
    save_kind: str | None = None            # Checkpointer.save kind: periodic, emergency, grow, final
    save_deadline_unix_s: float | None = None  # notice deadline - margin: commit before this or abandon
    budget_s: float | None = None           # save_deadline_unix_s - now
    notice_deadline_unix_s: float | None = None  # the notice's own deadline: what the checkpointer budgets
                                            # against, with the same margin (not on top of this one)
    detail: str = ""                        # one line for the event log

    @property
    def saves(self) -> bool:
        return self.save_kind is not None

    @property
    def leaves(self) -> bool:
        """The group leaves (PlannedExit) after applying this decision; a restart follows."""
        return self.action in (SAVE_AND_EXIT, EXIT)


@dataclass(frozen=True)
class StepPolicy:
    total_steps: int
    checkpoint_every: int
    margin_s: float = EMERGENCY_MARGIN_S

    def decide(self, f: StepFacts) -> StepDecision:
        if f.done >= self.total_steps:
            return self._finish(f)
        if f.preempt_votes > 0:
            return self._emergency(f)
        if f.grow_workers > 0:
            return StepDecision(SAVE_AND_EXIT, "grow", "grow",
                                detail=f"{f.grow_workers} more worker(s) fit: synchronous save, then restart "
                                       f"the group larger")
        if f.done % self.checkpoint_every == 0:
            return StepDecision(SAVE, "periodic", "periodic",
                                detail="previous upload still in flight: the checkpointer coalesces"
                                if f.upload_in_flight else "")
        return StepDecision(CONTINUE)

    def before_first_step(self, f: StepFacts, phase: str = "loaded") -> StepDecision | None:
        """A group that holds a preemption notice before its first step (it arrived while the group started
        or restored: `phase`, the start's boundary where it looked, train.notice_watch) leaves at once: its
        state is the checkpoint it restored, so nothing is lost, and the restart sizes the next group without
        the draining node. None: start on."""
        if f.preempt_votes > 0 and f.done < self.total_steps:
            return StepDecision(EXIT, "preemption", None, notice_deadline_unix_s=f.deadline_unix_s,
                                detail=f"notice before this group's first step (group {phase}): its state is "
                                       "the checkpoint it restored, nothing to save; leaving so the restart "
                                       "leaves out the draining node")
        return None

    def _finish(self, f: StepFacts) -> StepDecision:
        flags = [name for name, raised in (("preemption notice", f.preempt_votes > 0),
                                           ("grow", f.grow_workers > 0)) if raised]
        detail = (f"{' and '.join(flags)} on the last step: finishing instead of restarting" if flags else "")
        deadline = self._save_deadline(f.deadline_unix_s) if f.preempt_votes > 0 else None
        return StepDecision(FINISH, "last step", "final", save_deadline_unix_s=deadline,
                            budget_s=None if deadline is None else deadline - f.now, detail=detail,
                            notice_deadline_unix_s=f.deadline_unix_s if f.preempt_votes > 0 else None)

    def _emergency(self, f: StepFacts) -> StepDecision:
        deadline = self._save_deadline(f.deadline_unix_s)
        budget = None if deadline is None else deadline - f.now
        if budget is not None and budget <= 0:
            return StepDecision(EXIT, "preemption", None, save_deadline_unix_s=deadline, budget_s=budget,
                                notice_deadline_unix_s=f.deadline_unix_s,
                                detail=f"no time to commit a checkpoint ({budget:.2f} s left after the "
                                       f"{self.margin_s} s margin): leaving now")
        in_flight = "; a periodic upload is in flight (the emergency save may abandon it)" \
            if f.upload_in_flight else ""
        detail = ("no deadline given: emergency save without a budget" if budget is None
                  else f"emergency save within {budget:.2f} s") + in_flight
        return StepDecision(SAVE_AND_EXIT, "preemption", "emergency", save_deadline_unix_s=deadline,
                            budget_s=budget, detail=detail, notice_deadline_unix_s=f.deadline_unix_s)

    def _save_deadline(self, notice_deadline_unix_s: float | None) -> float | None:
        return None if notice_deadline_unix_s is None else notice_deadline_unix_s - self.margin_s
