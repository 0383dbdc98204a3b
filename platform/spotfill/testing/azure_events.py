"""Azure Scheduled Events stand-in (127.0.0.1): ``/metadata/scheduledevents`` and the VM's compute name.

GET needs ``Metadata: true`` (400 without, as on Azure) and an ``api-version``; answers
``{"DocumentIncarnation": N, "Events": [...]}``. POST ``{"StartRequests": [{"EventId": ...}]}`` acknowledges:
the events are recorded in :attr:`acked` and turn ``EventStatus: Started``.
"""
from __future__ import annotations

import json
import time
import uuid
from email.utils import formatdate
from typing import Optional

from spotfill.testing.http_standin import HttpStandin

EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"


class AzureEventsStandin(HttpStandin):
    server_version = "Microsoft-IIS/10.0"

    def __init__(self, port: int = 0, vm_name: str = "spot-vm-0"):
        super().__init__(port)
        self.vm_name = vm_name
        self.events: list[dict] = []
        self.incarnation = 1
        self.raw: Optional[str] = None          # a malformed body, served instead of the events
        self.acked: list[str] = []

    def add_event(self, event_type: str = "Preempt", seconds_from_now: float = 30.0,
                  resources: Optional[list] = None, not_before: Optional[str] = None) -> str:
        """Publish an event for this VM (or ``resources``); returns its EventId."""
        event_id = str(uuid.uuid4()).upper()
        nb = formatdate(time.time() + seconds_from_now, usegmt=True) if not_before is None else not_before
        with self.changed:
            self.events.append({"EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine",
                                "Resources": resources if resources is not None else [self.vm_name],
                                "EventStatus": "Scheduled", "NotBefore": nb, "Description": "",
                                "EventSource": "Platform", "DurationInSeconds": -1})
            self.incarnation += 1
            self.publish()
        return event_id

    def remove_event(self, event_id: str) -> None:
        """The event is cancelled (withdrawn)."""
        with self.changed:
            self.events = [e for e in self.events if e["EventId"] != event_id]
            self.incarnation += 1
            self.publish()

    def set_raw(self, body: Optional[str]) -> None:
        with self.changed:
            self.raw = body
            self.publish()

    def answer(self, method, path, query, headers, body):
        if headers.get("Metadata") != "true":
            return 400, json.dumps({"error": "Bad request. Required metadata header not specified"}), {}
        if not query.get("api-version"):
            return 400, json.dumps({"error": "Bad request. api-version was not specified"}), {}
        if path == NAME_PATH and method == "GET":
            return 200, self.vm_name, {}
        if path != EVENTS_PATH:
            return 404, "Not Found", {}
        with self.changed:
            if method == "POST":
                try:
                    ids = [r["EventId"] for r in json.loads(body)["StartRequests"]]
                except (ValueError, KeyError, TypeError):
                    return 400, json.dumps({"error": "Bad request"}), {}
                for e in self.events:
                    if e["EventId"] in ids:
                        e["EventStatus"], e["NotBefore"] = "Started", ""
                self.acked.extend(ids)
                self.incarnation += 1
                return 200, "", {}
            if self.raw is not None:
                return 200, self.raw, {"Content-Type": "application/json"}
            return 200, json.dumps({"DocumentIncarnation": self.incarnation, "Events": self.events}), \
                {"Content-Type": "application/json"}
