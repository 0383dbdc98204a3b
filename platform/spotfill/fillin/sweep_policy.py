"""Which sweep trials may hold a lent GPU now: the pure decision half of jobs/sweep.py (no Ray import).

A sweep runs only on GPUs the fill-in arbiter lends it (its grant, fillin/grant.py). Every trial needs one
unit (one GPU). Given the grant and what each trial is doing, `plan` answers:

    pause   trials to pause now (with a checkpoint): the running/starting trials beyond the grant,
            newest-started first -- the trial that started last has the least unsaved work and the oldest
            trials are closest to finishing; a trial still waiting for its placement group (`starting`)
            goes before any running one (it holds nothing yet and loses nothing)
    resume  paused trials to restart from their checkpoint, the longest-paused first
    admit   how many new trials the searcher may hand out now (only when no paused trial waits: a
            paused trial is resumed before a new one is started, so a sweep's trials finish in order)

Nothing starts, and nothing is resumed, while the grant is 0. `SweepTally` keeps what report.json
`fillin.sweep` says (trials, completed, paused, resumed, best) from the events the driver feeds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STARTING, RUNNING, PAUSED, DONE = "starting", "running", "paused", "done"
#  starting: Tune has it PENDING: staged, its placement group requested or placed, no result yet
#            (a new trial, or a paused one handed back to Tune to restart): it counts as holding a unit
#  running:  it has an actor and reports results
#  paused:   stopped with a checkpoint, holds nothing
#  done:     finished (terminated or errored)
OCCUPYING = (STARTING, RUNNING)


@dataclass(frozen=True)
class TrialView:
    trial_id: str
    state: str
    started_at: float | None = None     # when it last (re)started: newest-started is paused first
    paused_at: float | None = None      # when it was last paused: longest-paused is resumed first


@dataclass
class Plan:
    pause: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    admit: int = 0

    def as_dict(self) -> dict:
        return {"pause": list(self.pause), "resume": list(self.resume), "admit": self.admit}


def occupying(trials: list[TrialView]) -> list[TrialView]:
    """Trials that hold (or are about to hold) a unit."""
    return [t for t in trials if t.state in OCCUPYING]


def plan(allowed: int, trials: list[TrialView], unstarted: int) -> Plan:
    """What to pause, resume and admit so that at most `allowed` trials hold a unit.

    `unstarted`: configurations the searcher has not handed out yet."""
    allowed = max(0, int(allowed))
    busy = occupying(trials)
    out = Plan()
    over = len(busy) - allowed
    if over > 0:
        def newest_first(t: TrialView):
            # starting (nothing to lose yet) before running; then the newest start first
            return (0 if t.state == STARTING else 1, -(t.started_at if t.started_at is not None
                                                                   else float("inf")), t.trial_id)
        out.pause = [t.trial_id for t in sorted(busy, key=newest_first)[:over]]
        return out
    room = allowed - len(busy)
    paused = sorted((t for t in trials if t.state == PAUSED),
                    key=lambda t: (t.paused_at if t.paused_at is not None else 0.0, t.trial_id))
    out.resume = [t.trial_id for t in paused[:room]]
    room -= len(out.resume)
    if not paused and room > 0:
        out.admit = min(room, max(0, int(unstarted)))
    return out


def demand(trials: list[TrialView], unstarted: int) -> int:
    """Units the sweep could use now: every unfinished trial, started or not."""
    return sum(1 for t in trials if t.state != DONE) + max(0, int(unstarted))


class TrialBook:
    """Each trial's state and when it last started / was paused, from what the driver observes;
    `clock` is injected (time.monotonic in the driver, a fake clock in tests)."""

    def __init__(self, clock):
        self.clock = clock
        self._trials: dict[str, dict] = {}

    def observe(self, trial_id: str, state: str) -> str | None:
        """Record `trial_id` in `state`; returns the previous state (None for a new trial)."""
        if state not in (STARTING, RUNNING, PAUSED, DONE):
            raise ValueError(f"unknown trial state {state!r}")
        rec = self._trials.setdefault(trial_id, {"state": None, "started_at": None, "paused_at": None})
        prev = rec["state"]
        if prev == state:
            return prev
        if state in OCCUPYING and prev not in OCCUPYING:
            rec["started_at"] = self.clock()
        if state == PAUSED:
            rec["paused_at"] = self.clock()
        rec["state"] = state
        return prev

    def state(self, trial_id: str) -> str | None:
        rec = self._trials.get(trial_id)
        return rec["state"] if rec else None

    def views(self) -> list[TrialView]:
        return [TrialView(tid, r["state"], r["started_at"], r["paused_at"]) for tid, r in self._trials.items()]


@dataclass
class SweepTally:
    """report.json `fillin.sweep`, from the driver's events (clock values are the caller's)."""
    trials: int = 0                       # configurations in the sweep
    started: int = 0                      # trials that got a unit at least once
    completed: int = 0                    # finished every step
    failed: int = 0                       # ended in error (after Tune's retries)
    paused: int = 0                       # pause events (a trial paused twice counts twice)
    resumed: int = 0                      # restarts from a pause checkpoint
    recovered: int = 0                    # restarts after the trial's actor died (Tune's max_failures)
    restored: bool = False                # this run continued an experiment an earlier driver left
    carried_over: int = 0                 # trials that earlier driver had completed (kept, not rerun)
    restored_trials: int = 0              # its unfinished trials continued here from their last checkpoint
    state_set_aside: list[str] = field(default_factory=list)   # its damaged state files, renamed NAME.damaged
    state_recovered: list[str] = field(default_factory=list)   # experiment states put back from NAME.last
    pauses: list[dict] = field(default_factory=list)   # {"trial", "at", "step"}
    # restarts from a checkpoint (resumed, recovered, restored) by where the state came from: the state
    # keeper's host memory or the storage checkpoint; and how long each restore took (seconds)
    resumed_from: dict = field(default_factory=lambda: {"memory": 0, "storage": 0})
    restore_s: dict = field(default_factory=lambda: {"memory": [], "storage": []})
    best: dict | None = None              # {"trial", "config", "metric", "value"}
    mode: str = "min"

    def on_pause(self, trial_id: str, at: float, step: int | None = None) -> None:
        self.paused += 1
        self.pauses.append({"trial": trial_id, "at": at, "step": step})

    def on_restore(self, source: str, seconds: float | None) -> None:
        """A trial restarted from a checkpoint whose state came from `source` (memory | storage)."""
        self.resumed_from[source] = self.resumed_from.get(source, 0) + 1
        if seconds is not None:
            self.restore_s.setdefault(source, []).append(round(float(seconds), 4))

    def on_complete(self, trial_id: str, config: dict, metric: str, value: float | None,
                    carried: bool = False) -> None:
        """A trial finished; `carried`: an earlier driver of the same experiment finished it."""
        self.completed += 1
        self.carried_over += bool(carried)
        if value is None:
            return
        better = (self.best is None or (value < self.best["value"] if self.mode == "min"
                                        else value > self.best["value"]))
        if better:
            self.best = {"trial": trial_id, "config": dict(config), "metric": metric, "value": float(value)}

    def as_report(self) -> dict:
        out = {"trials": self.trials, "started": self.started, "completed": self.completed,
               "failed": self.failed, "paused": self.paused, "resumed": self.resumed,
               "recovered": self.recovered, "restored": self.restored, "carried_over": self.carried_over,
               "restored_trials": self.restored_trials, "state_set_aside": list(self.state_set_aside),
               "state_recovered": list(self.state_recovered), "resumed_from": dict(self.resumed_from),
               "restore_s": {k: list(v) for k, v in self.restore_s.items()}, "best": None}
        if self.best is not None:
            out["best"] = {"config": self.best["config"], "metric": self.best["value"],
                           "metric_name": self.best["metric"], "trial": self.best["trial"]}
        return out
