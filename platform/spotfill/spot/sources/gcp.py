"""GCP: the Compute Engine metadata server (header ``Metadata-Flavor: Google``).

- ``computeMetadata/v1/instance/preempted``: ``FALSE``, then ``TRUE`` when a Spot/preemptible VM is being
  preempted (about 30 s before it stops) -> preempt notice, deadline = first seen + 30 s;
- ``computeMetadata/v1/instance/maintenance-event``: ``NONE``; ``TERMINATE_ON_HOST_MAINTENANCE`` 60 s before
  the VM is stopped for host maintenance -> preempt notice (deadline first seen + 60 s);
  ``MIGRATE_ON_HOST_MAINTENANCE`` (live migration: the VM stays) -> early warning.

The metadata server says no time, so the deadline counts from when this watcher first saw the value. Both keys
are watched with ``?wait_for_change=true&last_etag=E`` (one thread each): a change wakes the watcher at once,
so a notice is drained within one round trip; the periodic read stays the source of truth.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

from spotfill.spot.notice import (EARLY_WARNING, PREEMPT, Notice, PollingSource, Reading, SourceError,
                                  http_opener, http_request)

logger = logging.getLogger(__name__)

NAME = "gcp"
DEFAULT_ENDPOINT = "http://metadata.google.internal"
HEADERS = {"Metadata-Flavor": "Google"}
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
PREEMPT_NOTICE_S = 30.0          # Spot VM / preemptible: ~30 s from the notice to ACPI G2 soft off
MAINTENANCE_NOTICE_S = 60.0      # maintenance-event changes 60 s before the maintenance
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
WATCH_TIMEOUT_S = 60             # one wait_for_change request answers after at most this long


# --- pure ------------------------------------------------------------------------------------------
def reading(preempted: Optional[str], maintenance: Optional[str], *, now: float,
            since: Optional[dict] = None) -> Reading:
    """Notices for the two values (None = not read). ``since`` maps a notice key to when it was first seen
    (its deadline counts from there); an unknown value is reported as a problem, never drained on."""
    since = since or {}
    notices, problems = [], []
    p = (preempted or "").strip().upper()
    if preempted is not None and p not in ("TRUE", "FALSE"):
        problems.append(f"instance/preempted: unexpected value {preempted[:100]!r} (TRUE or FALSE)")
    if p == "TRUE":
        key = "gcp:preempted"
        t0 = since.get(key, now)
        notices.append(Notice(NAME, PREEMPT, "preempted", key, t0 + PREEMPT_NOTICE_S,
                              "GCP preemption: instance/preempted TRUE",
                              f"instance/preempted TRUE; deadline first seen + {PREEMPT_NOTICE_S:g}s"))
    m = (maintenance or "").strip()
    if maintenance is not None and m not in MAINTENANCE_VALUES:
        problems.append(f"instance/maintenance-event: unexpected value {maintenance[:100]!r} "
                        f"({', '.join(MAINTENANCE_VALUES)})")
    elif m == "TERMINATE_ON_HOST_MAINTENANCE":
        key = f"gcp:maintenance:{m}"
        t0 = since.get(key, now)
        notices.append(Notice(NAME, PREEMPT, "maintenance-event", key, t0 + MAINTENANCE_NOTICE_S,
                              f"GCP host maintenance: {m}",
                              f"maintenance-event {m}; deadline first seen + {MAINTENANCE_NOTICE_S:g}s"))
    elif m == "MIGRATE_ON_HOST_MAINTENANCE":
        notices.append(Notice(NAME, EARLY_WARNING, "maintenance-event", f"gcp:maintenance:{m}", None,
                              f"GCP host maintenance: {m}", f"maintenance-event {m} (live migration)"))
    return Reading(tuple(notices), tuple(problems))


# --- HTTP ------------------------------------------------------------------------------------------
class GcpSource(PollingSource):
    """Reads both keys each poll; :meth:`wait` returns early when a wait_for_change watch sees a change."""

    name = NAME

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 1.0, watch: bool = True):
        self.endpoint, self.timeout_s = endpoint.rstrip("/"), timeout_s
        self._opener = http_opener()
        self._since: dict[str, float] = {}
        self._changed = threading.Event()
        self._closed = threading.Event()
        self._watching = not watch          # True = nothing (more) to start
        self._etags: dict[str, str] = {}

    def get(self, path: str, query: str = "", timeout_s: Optional[float] = None) -> tuple[str, str]:
        """(body, ETag) of ``path``; any status but 200 is a :class:`SourceError` (these keys always exist)."""
        status, body, headers = http_request(self._opener, "GET", f"{self.endpoint}{path}{query}", HEADERS,
                                             timeout_s or self.timeout_s)
        if status != 200:
            raise SourceError(f"GET {path}: HTTP {status}")
        return body, headers.get("ETag", "") or headers.get("etag", "")

    def read(self, now: float) -> Reading:
        preempted, self._etags[PREEMPTED_PATH] = self.get(PREEMPTED_PATH)
        maintenance, self._etags[MAINTENANCE_PATH] = self.get(MAINTENANCE_PATH)
        out = reading(preempted, maintenance, now=now, since=self._since)
        seen = {n.key for n in out.notices}
        self._since = {k: t for k, t in self._since.items() if k in seen}    # a withdrawn value starts over
        for n in out.notices:
            self._since.setdefault(n.key, now)
        return out

    def _start_watches(self) -> None:
        if self._watching:
            return
        self._watching = True
        for path in (PREEMPTED_PATH, MAINTENANCE_PATH):
            threading.Thread(target=self._watch, args=(path,), name=f"gcp-watch{path.rsplit('/', 1)[-1]}",
                             daemon=True).start()

    def _watch(self, path: str) -> None:
        """Long-poll ``path`` until closed; wake :meth:`wait` on every change. Failures back off 1 s (the
        periodic read reports them)."""
        while not self._closed.is_set():
            etag = self._etags.get(path, "")
            query = f"?wait_for_change=true&timeout_sec={WATCH_TIMEOUT_S}" + (f"&last_etag={etag}" if etag else "")
            try:
                _, new = self.get(path, query, timeout_s=WATCH_TIMEOUT_S + 5)
            except SourceError as exc:
                logger.debug("wait_for_change on %s failed: %s", path, exc)
                self._closed.wait(1.0)
                continue
            if new and new != etag:
                self._etags[path] = new
                self._changed.set()

    def wait(self, stop, timeout_s: float) -> None:
        self._start_watches()             # in the run loop only (closed at its end), from the etags read saw
        waited = 0.0
        while waited < timeout_s and not stop.is_set():          # wake on a change or a stop
            step = min(0.05, timeout_s - waited)
            if self._changed.wait(step):
                break
            waited += step
        self._changed.clear()

    def close(self) -> None:
        self._closed.set()
