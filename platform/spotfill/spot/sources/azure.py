"""Azure: Scheduled Events of the instance metadata service (header ``Metadata: true``).

``GET /metadata/scheduledevents?api-version=2020-07-01`` answers ``{"DocumentIncarnation": N, "Events":
[{"EventId", "EventType", "ResourceType", "Resources": [vm names], "EventStatus", "NotBefore": RFC 1123 time,
...}]}``. For this VM (its name from ``/metadata/instance/compute/name``; every event when unknown):

- ``Preempt`` (Spot eviction, at least 30 s ahead) and ``Terminate`` (scale-set delete) -> preempt notice,
  deadline = ``NotBefore`` (30 s from first sight when it is empty or unreadable, reported);
- ``Freeze``, ``Reboot``, ``Redeploy`` -> early warning (no drain).

Acknowledging (``POST`` the same URL with ``{"StartRequests": [{"EventId": ...}]}``) lets the event start
before ``NotBefore``; the watcher does it once this node's work has left (spot.watcher), never before.
"""
from __future__ import annotations

import json
import logging
from email.utils import parsedate_to_datetime
from typing import Any, Optional

from spotfill.spot.notice import (EARLY_WARNING, PREEMPT, Notice, PollingSource, Reading, SourceError,
                                  http_opener, http_request, parse_time)

logger = logging.getLogger(__name__)

NAME = "azure"
DEFAULT_ENDPOINT = "http://169.254.169.254"
HEADERS = {"Metadata": "true"}
EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
VM_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
PREEMPT_TYPES = ("Preempt", "Terminate")
WARNING_TYPES = ("Freeze", "Reboot", "Redeploy")
DEFAULT_NOTICE_S = 30.0          # a Spot eviction's minimum notice


# --- pure ------------------------------------------------------------------------------------------
def parse_not_before(text: Any) -> Optional[float]:
    """``Mon, 19 Sep 2016 18:29:47 GMT`` (what Azure sends) or ISO-8601 -> UNIX seconds; None if unusable."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        return parsedate_to_datetime(text.strip()).timestamp()
    except (TypeError, ValueError, IndexError):
        return parse_time(text)


def reading(body: str, *, now: float, vm_name: Optional[str] = None,
            since: Optional[dict] = None) -> Reading:
    """Notices in a scheduledevents body for ``vm_name`` (None = every event). A body that is not the
    documented shape is a problem (reported, nothing drained); so is one event that cannot be used."""
    since = since or {}
    try:
        data = json.loads(body)
    except (TypeError, ValueError):
        return Reading(problems=(f"scheduledevents: body is not JSON: {body[:200]!r}",))
    events = data.get("Events") if isinstance(data, dict) else None
    if not isinstance(events, list):
        return Reading(problems=(f"scheduledevents: no Events list in {body[:200]!r}",))
    notices, problems = [], []
    for ev in events:
        if not isinstance(ev, dict) or not ev.get("EventId"):
            problems.append(f"scheduledevents: event without EventId: {str(ev)[:200]!r}")
            continue
        resources = ev.get("Resources") or []
        if vm_name and isinstance(resources, list) and resources and vm_name not in resources:
            continue
        event_id, kind = str(ev["EventId"]), str(ev.get("EventType", ""))
        key = f"azure:{event_id}"
        if kind in PREEMPT_TYPES:
            deadline = parse_not_before(ev.get("NotBefore"))
            why = f"{kind} event {event_id}; deadline NotBefore"
            if deadline is None:
                deadline = since.get(key, now) + DEFAULT_NOTICE_S
                why = f"{kind} event {event_id}; NotBefore {ev.get('NotBefore')!r} unusable: first seen + " \
                      f"{DEFAULT_NOTICE_S:g}s"
                if ev.get("EventStatus") != "Started":
                    problems.append(f"scheduledevents: {kind} {event_id} has no usable NotBefore "
                                    f"({ev.get('NotBefore')!r})")
            notices.append(Notice(NAME, PREEMPT, kind, key, deadline, f"Azure scheduled event: {kind} {event_id}",
                                  why, ack_id=event_id))
        elif kind in WARNING_TYPES:
            notices.append(Notice(NAME, EARLY_WARNING, kind, key, None, f"Azure scheduled event: {kind} {event_id}",
                                  f"{kind} event {event_id}"))
        else:
            problems.append(f"scheduledevents: unknown EventType {kind!r} ({event_id})")
    return Reading(tuple(notices), tuple(problems))


def ack_body(event_id: str) -> bytes:
    return json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()


# --- HTTP ------------------------------------------------------------------------------------------
class AzureSource(PollingSource):
    """Polls Scheduled Events (Azure's documented way: poll about once a second)."""

    name = NAME

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 1.0, vm_name: Optional[str] = None):
        self.endpoint, self.timeout_s, self.vm_name = endpoint.rstrip("/"), timeout_s, vm_name
        self._opener = http_opener()
        self._since: dict[str, float] = {}
        self._named = vm_name is not None

    def _call(self, method: str, path: str, data: Optional[bytes] = None) -> str:
        headers = dict(HEADERS, **({"Content-Type": "application/json"} if data else {}))
        status, body, _ = http_request(self._opener, method, self.endpoint + path, headers, self.timeout_s, data)
        if status != 200:
            raise SourceError(f"{method} {path.split('?', 1)[0]}: HTTP {status}")
        return body

    def read(self, now: float) -> Reading:
        if not self._named:               # best effort: without it every event counts as this VM's
            try:
                self.vm_name = self._call("GET", VM_NAME_PATH).strip() or None
                self._named = True
            except SourceError as exc:
                logger.debug("VM name not known yet (%s): every scheduled event counts", exc)
        out = reading(self._call("GET", EVENTS_PATH), now=now, vm_name=self.vm_name, since=self._since)
        seen = {n.key for n in out.notices}
        self._since = {k: t for k, t in self._since.items() if k in seen}
        for n in out.notices:
            self._since.setdefault(n.key, now)
        return out

    def acknowledge(self, notice: Notice) -> None:
        if notice.ack_id:
            self._call("POST", EVENTS_PATH, ack_body(notice.ack_id))
