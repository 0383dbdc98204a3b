"""The run's event log: CONTRACTS' events.jsonl, one JSON object per line with `t` and `kind`.

`EventLog` writes lines to a local file. In a Ray job the workers reach it through the `EventSink`
actor (events_actor.py), which runs on the driver's node and owns the file; `read_events` reads it back.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)


class EventLog:
    """Append-only JSONL writer; thread-safe; flushes every line so a crash loses nothing written.
    `on_event(event)`, when given, sees every event after it is written (e.g. telemetry.prometheus.record)."""

    def __init__(self, path: str, on_event: Callable[[dict], None] | None = None):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._f = open(path, "a", buffering=1)
        self._on_event = on_event

    def write(self, kind: str, t: float | None = None, **fields: Any) -> dict:
        event = {"t": time.time() if t is None else t, "kind": kind, **fields}
        line = json.dumps(event, separators=(",", ":"), default=_jsonable)
        with self._lock:
            self._f.write(line + "\n")
        self._notify([event])
        return event

    def write_many(self, events: list[dict]) -> None:
        with self._lock:
            for e in events:
                self._f.write(json.dumps(e, separators=(",", ":"), default=_jsonable) + "\n")
        self._notify(events)

    def _notify(self, events: list[dict]) -> None:
        if self._on_event is None:
            return
        for e in events:
            if e.get("kind") != "samples":   # per-rank sample ids: no metric needs them
                try:
                    self._on_event(e)
                except Exception as exc:  # an observer never breaks the log
                    log.warning("event observer failed on a %s event: %s", e.get("kind"), exc)

    def close(self) -> None:
        with self._lock:
            self._f.close()


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


class EventTail:
    """Reads the events appended to an events.jsonl since the last poll, from byte `offset` (where a run's
    events begin: a run dir may hold older ones). A line still being written waits for the next poll; a
    line that is not JSON is skipped, as read_events skips a torn last line."""

    def __init__(self, path: str, offset: int = 0):
        self.path, self.offset = path, offset

    def poll(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in chunk[:end].decode("utf-8", "replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def read_events(path: str, kinds: set[str] | None = None) -> Iterator[dict]:
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
            if kinds is None or event.get("kind") in kinds:
                yield event
