"""The run's event sink: one Ray actor on the driver's node that owns RUN_DIR/events.jsonl.

Workers on any node send events to it; it also hands out attempt numbers (one per worker-group start),
keeps the failure budget (planned exits -- announced preemption, graceful grow -- are free), and holds the
stop verdict that `TrainingJob.fit()` reads when Ray Train returns.
"""
from __future__ import annotations


import ray

from spotfill.telemetry.events import EventLog


@ray.remote(num_cpus=0)
class EventSink:
    def __init__(self, path: str, max_failures: int):
        self._log = EventLog(path)
        self._attempt = -1
        self._unplanned = 0
        self._max_failures = max_failures
        self._planned_exit = False
        self._verdict: dict | None = None

    def begin_attempt(self, world_size: int) -> dict:
        """Called by rank 0 when a worker group starts. Counts an unplanned failure if the last attempt
        ended without saying why. Returns {"attempt", "give_up"}."""
        if self._attempt >= 0 and not self._planned_exit:
            self._unplanned += 1
        self._attempt += 1
        self._planned_exit = False
        give_up = self._max_failures >= 0 and self._unplanned > self._max_failures
        self._log.write("attempt", attempt=self._attempt, world_size=world_size,
                        unplanned_failures=self._unplanned)
        return {"attempt": self._attempt, "give_up": give_up, "unplanned_failures": self._unplanned}

    def planned_exit(self, reason: str, **fields) -> None:
        self._planned_exit = True
        self._log.write("planned_exit", reason=reason, attempt=self._attempt, **fields)

    def log(self, events: list[dict]) -> int:
        self._log.write_many(events)
        return len(events)

    def event(self, kind: str, **fields) -> None:
        self._log.write(kind, **fields)

    def finish(self, verdict: dict) -> None:
        self._verdict = verdict
        self._log.write("finish", **verdict)

    def verdict(self) -> dict | None:
        return self._verdict

    def close(self) -> None:
        self._log.close()
