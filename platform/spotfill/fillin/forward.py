"""Copies the fill-in arbiter's journal (lease / reclaim / node events, fillin/journal.py) into a training
run's events.jsonl, so the run's GPU-seconds ledger counts fill-in and its harvest ratio.

A thread in the training driver asks the arbiter every `interval_s` for what is new and hands it to the
run's event sink. No arbiter on the cluster (or one that does not answer) is not an error: the thread keeps
asking, quietly, and the run simply has no fill-in events until one appears.
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class LeaseForwarder:
    def __init__(self, sink, interval_s: float = 1.0):
        self.sink, self.interval_s = sink, interval_s
        self.seq: int | None = None
        self.forwarded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spotfill-fillin-events", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> "LeaseForwarder":
        self._thread.start()
        return self

    def poll(self) -> int:
        """Forward what is new; returns how many events were written (0 without an arbiter)."""
        import ray

        from spotfill.fillin.arbiter import get_arbiter
        with self._lock:
            arbiter = get_arbiter()
            if arbiter is None:
                return 0
            answer = ray.get(arbiter.journal_since.remote(self.seq), timeout=10)
            events = answer["events"]
            if events:
                ray.get(self.sink.log.remote(events), timeout=10)
            self.seq = answer["seq"]
            self.forwarded += len(events)
            return len(events)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - fill-in telemetry never disturbs training
                log.debug("fill-in events not forwarded this time: %s", exc)

    def stop(self) -> None:
        """Stop the thread after one last poll (the run's last leases end up in its log)."""
        self._stop.set()
        self._thread.join(timeout=15)
        try:
            self.poll()
        except Exception as exc:  # noqa: BLE001
            log.warning("fill-in: the last lease events were not forwarded: %s", exc)
