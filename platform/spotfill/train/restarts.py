"""Why a worker group (re)started, from what Ray Train's controller saw (pure: no Ray import).

The controller callback (sink.RestartCauseCallback) hands each state change here; the event sink keeps the
last failure and labels the next attempt with its cause: planned (the previous attempt left on purpose:
preemption notice, grow, ...) or unplanned (the failure Ray Train saw: a worker died, a node was lost, an
error with its first line; workers that could not be scheduled in time).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")

# Ray Train controller states (TrainControllerStateType names) that end an attempt and start another.
RESTART_STATES = ("RESTARTING", "RESCHEDULING", "RESIZING")


@dataclass(frozen=True)
class Failure:
    kind: str       # "worker died or node lost" | "workers not scheduled in time" | "planned exit" | "worker error"
    detail: str     # the most telling line of Ray Train's error, shortened


# Marks a failure whose worker group lost its placement group while the controller lived: the
# placement-group cleaner tore the run down (ray-project/ray#65447), whatever error the workers then saw.
PLACEMENT_GROUP_REMOVED = "PlacementGroupRemoved: the run's placement group was removed while its controller was alive"

_KINDS = (  # first match wins; checked against Ray Train 2.60's error texts
    ("placement group removed (cleaner teardown)", ("PlacementGroupRemoved:",)),
    ("planned exit", ("PlannedExit",)),
    ("workers not scheduled in time", ("WorkerGroupStartupTimeoutError", "StartupTimeout",
                                       "Timed out waiting for the placement group")),
    ("worker died or node lost", ("ActorDiedError", "ActorUnavailableError", "actor died", "node died",
                                  "NodeDiedError", "raylet died", "has been marked dead", "WorkerHealthCheck",
                                  "health check")),
)


def classify_failure(error_text: str) -> Failure:
    text = error_text or ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    kind = next((k for k, marks in _KINDS if any(m in text for m in marks)), "worker error")
    telling = next((ln for ln in lines if _EXCEPTION_LINE.match(ln)), None)
    if telling is None:     # no exception line: the first line, and what it introduces ("...error:" + next)
        telling = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return Failure(kind, telling[:300])


def attempt_cause(first: bool, planned_reason: str | None, failure: Failure | None,
                  earlier_attempts: int = 0) -> dict:
    """The cause recorded with a worker-group start: `first` for the run's first group (after
    `earlier_attempts` attempts of earlier runs over the same checkpoint store, when there were any)."""
    if first:
        return {"cause": "first start", "planned": True,
                **({"earlier_attempts": earlier_attempts} if earlier_attempts else {})}
    if planned_reason:
        return {"cause": f"planned: {planned_reason}", "planned": True}
    if failure is None:
        return {"cause": "unplanned: the previous attempt ended without a reason on record", "planned": False}
    return {"cause": f"unplanned: {failure.kind}", "planned": False, "error": failure.detail}
