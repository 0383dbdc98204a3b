"""The run's event sink: one Ray actor on the driver's node that owns RUN_DIR/events.jsonl.

Workers on any node send events to it; it also hands out attempt numbers (one per worker-group start),
keeps the failure budget (planned exits -- announced preemption, graceful grow -- are free; a data
mismatch ends the job at the next start), records why each attempt started (RestartCauseCallback reports
what Ray Train's controller saw), and holds the stop verdict that `TrainingJob.fit()` reads when Ray Train
returns.
"""
from __future__ import annotations

import json
import logging
import time

import ray

from spotfill.ray_compat import ControllerCallback, WorkerGroupCallback, require, usable
from spotfill.telemetry.events import EventLog
from spotfill.train.restarts import (PLACEMENT_GROUP_REMOVED, RESTART_STATES, Failure, attempt_cause,
                                    classify_failure)

log = logging.getLogger(__name__)



LIVE_KEY_PREFIX = "jobs/"        # Ray KV (namespace spotfill): one key per running job, its live numbers
PUBLISH_EVERY_S = 1.0
PUBLISH_NOW = ("job_start", "attempt", "start", "resume", "planned_exit", "checkpoint", "finish")


@ray.remote(num_cpus=0)
class EventSink:
    def __init__(self, path: str, max_failures: int, first_attempt: int = 0, live_key: str | None = None,
                 run_dir: str | None = None):
        from spotfill.telemetry.progress import Progress
        from spotfill.telemetry.prometheus import exporter

        # the live numbers share the exporter's GPU-seconds attribution (folded once per event, by record)
        self._progress, self._live_key, self._run_dir = Progress(live=exporter().live), live_key, run_dir
        self._published = 0.0
        self._log = EventLog(path, on_event=self._observe)
        # numbering continues past the attempts of earlier runs over the same checkpoint store, so tags
        # (step + attempt) stay unique across fit() calls
        self._first_attempt = first_attempt
        self._attempt = first_attempt - 1
        self._unplanned = 0
        self._max_failures = max_failures
        self._planned_exit: str | None = None
        self._failure: Failure | None = None
        self._verdict: dict | None = None
        self._fatal: str | None = None      # a fault no restart fixes (data_mismatch): the next attempt gives up
        self._group = 0          # worker groups Ray Train placed (group_start); each attempt names its group

    def _observe(self, event: dict) -> None:
        """Every written event: the spotfill_* series (this node's metrics endpoint) and, at most every
        PUBLISH_EVERY_S (at once for group changes and the end), the job's live numbers in Ray's KV store,
        where `spotfill status` reads them."""
        from spotfill.telemetry.prometheus import record

        record(event)
        if self._live_key is None:
            return
        self._progress.update(event, fold_live=False)
        now = time.monotonic()
        if event.get("kind") in PUBLISH_NOW or now - self._published >= PUBLISH_EVERY_S:
            self._published = now
            self.publish()

    def publish(self) -> None:
        from spotfill.ray_compat import kv_put
        try:
            kv_put(self._live_key, json.dumps({**self._progress.snapshot(), "run_dir": self._run_dir,
                                               "sink": self._live_key[len(LIVE_KEY_PREFIX):],
                                               "published": time.time()}, default=str))
        except Exception as exc:  # the status view is a convenience: never break the log for it
            log.warning("cannot publish live numbers to Ray's KV store: %s", exc)
            self._live_key = None

    def begin_attempt(self, world_size: int, gpus: float | None = None) -> dict:
        """Called by rank 0 when a worker group starts, with the GPUs Ray assigned the group (`gpus`: its
        workers' shares of the GPU resource, summed). Counts an unplanned failure if the last attempt
        ended without saying why; records the attempt's cause. Returns {"attempt", "give_up", ...}."""
        first = self._attempt < self._first_attempt
        if not first and not self._planned_exit:
            self._unplanned += 1
        self._attempt += 1
        cause = attempt_cause(first, self._planned_exit, self._failure, earlier_attempts=self._first_attempt)
        self._planned_exit, self._failure = None, None
        give_up = self._fatal is not None or (self._max_failures >= 0 and self._unplanned > self._max_failures)
        self._log.write("attempt", attempt=self._attempt, world_size=world_size, group=self._group or None,
                        unplanned_failures=self._unplanned, **cause,
                        **({} if gpus is None else {"gpus": round(float(gpus), 3)}))
        return {"attempt": self._attempt, "give_up": give_up, "unplanned_failures": self._unplanned,
                **({"reason": self._fatal} if self._fatal else {})}

    def data_mismatch(self, reason: str, **fields) -> None:
        """A worker read data that is not the data named (feed.py, data.py): logged, and the job ends with
        the first such line when the group restarts -- a restart would read the same data."""
        if self._fatal is None:
            self._fatal = reason
        self._log.write("data_mismatch", reason=reason, **fields)

    def planned_exit(self, reason: str, **fields) -> None:
        self._planned_exit = reason
        self._log.write("planned_exit", reason=reason, attempt=self._attempt, **fields)

    def controller_state(self, state: str, previous: str, t: float, error: str | None = None, **fields) -> None:
        """A Ray Train controller state change (from RestartCauseCallback, in the controller actor)."""
        failure = classify_failure(error) if error else None
        if state in RESTART_STATES and failure and failure.kind != "planned exit":
            self._failure = failure
        extra = {"failure": failure.kind, "error": failure.detail} if failure else {}
        self._log.write("controller_state", t=t, state=state, previous=previous, attempt=self._attempt,
                        **extra, **fields)

    def group(self, kind: str, t: float, **fields) -> int:
        """A worker group placed (`group_start`, numbered here) or torn down (`group_end`, the current
        number): the GPU-seconds ledger's evidence of when training held the group's GPUs."""
        if kind == "group_start":
            self._group += 1
        self._log.write(kind, t=t, group=self._group, **fields)
        return self._group

    def log(self, events: list[dict]) -> int:
        self._log.write_many(events)
        return len(events)

    def event(self, kind: str, **fields) -> None:
        self._log.write(kind, **fields)

    def finish(self, verdict: dict) -> None:
        stale = verdict.get("fenced") and verdict.get("attempt") is not None and verdict["attempt"] < self._attempt
        if stale:   # a superseded attempt's rank 0 (it outlived its group) stopped: the live one decides
            self._log.write("stale_finish", **verdict)
            return
        self._verdict = verdict
        self._log.write("finish", **verdict)

    def verdict(self) -> dict | None:
        return self._verdict

    def close(self) -> None:
        self._log.close()
        if self._live_key is not None:       # the job is over: `spotfill status` lists running jobs
            from spotfill.ray_compat import kv_del
            try:
                kv_del(self._live_key)
            except Exception as exc:
                log.warning("cannot remove the live numbers from Ray's KV store: %s", exc)


class RestartCauseCallback(ControllerCallback, WorkerGroupCallback):
    """Runs inside Ray Train's controller: sends each controller state change (with the failure Ray Train
    saw, the preemption it was told of, the size it decided) to the run's event sink, fire-and-forget, and
    each worker group's placement and teardown (`group_start` / `group_end`).
    A running group's failure that finds its placement group already removed (the controller alive) is a
    placement-group cleaner teardown. Public DeveloperAPI callbacks only (RunConfig(callbacks=[...]))."""

    def __init__(self, sink_name: str, namespace: str):
        require("train_controller_callbacks")     # one line (RayCompatError) where Ray moved them
        usable("ledger_group_end")                # one warning where Ray no longer calls group_end's hook
        self.sink_name, self.namespace = sink_name, namespace
        self._sink = None
        self._placement_group = None

    def after_worker_group_start(self, worker_group) -> None:
        self._placement_group = worker_group.get_worker_group_state().placement_group_handle.placement_group
        try:
            workers = len(worker_group.get_workers())
        except Exception:  # noqa: BLE001 -- the count is a detail; the event is what matters
            workers = None
        # waited for (briefly): rank 0's `attempt` event, which names this group, must come after it
        self._tell("group_start", wait_s=5.0, workers=workers)

    def after_worker_group_shutdown(self, worker_group_context) -> None:
        self._tell("group_end")

    def _tell(self, kind: str, wait_s: float = 0.0, **fields) -> None:
        try:
            if self._sink is None:
                self._sink = ray.get_actor(self.sink_name, namespace=self.namespace)
            ref = self._sink.group.remote(kind, time.time(), **fields)
            if wait_s:
                ray.get(ref, timeout=wait_s)
        except Exception as exc:  # the sink is gone (run over) or slow: the ledger falls back on other events
            log.warning("cannot report %s to the event sink: %s", kind, exc)

    def _placement_group_removed(self) -> bool:
        if self._placement_group is None:
            return False
        try:
            return ray.util.placement_group_table(self._placement_group).get("state") == "REMOVED"
        except Exception:
            return False

    def after_controller_state_update(self, previous_state, current_state) -> None:
        state, previous = _state_name(current_state), _state_name(previous_state)
        error = getattr(current_state, "training_failed_error", None)
        if state == previous and error is None:
            return     # one per health-check poll (RUNNING) or per wait for nodes (INITIALIZING): not a change
        fields: dict = {}
        if error is not None:
            fields["error"] = str(error)
            # only a running group's failure: a group that failed to start (SCHEDULING -> RESCHEDULING) is
            # not the one whose placement group this callback holds -- that one Ray Train removed itself
            # when it shut the previous group down (a node loss then read as a cleaner teardown)
            if previous == "RUNNING" and self._placement_group_removed():
                fields["error"] = f"{PLACEMENT_GROUP_REMOVED}\n{error}"
        decision = getattr(current_state, "scaling_decision", None)
        if decision is not None and hasattr(decision, "num_workers"):
            fields["num_workers"] = decision.num_workers
        info = getattr(current_state, "preemption_info", None)
        if info is not None:
            fields["preemption"] = str(info)[:300]
        try:
            if self._sink is None:
                self._sink = ray.get_actor(self.sink_name, namespace=self.namespace)
            self._sink.controller_state.remote(state, previous, time.time(), **fields)
        except Exception as exc:  # the sink is gone (run over): nothing left to tell
            log.warning("cannot report controller state %s to the event sink: %s", state, exc)


def _state_name(state) -> str:
    kind = getattr(state, "_state_type", None)
    return getattr(kind, "state_name", type(state).__name__)
