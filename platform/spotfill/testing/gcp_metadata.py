"""GCE metadata-server stand-in (127.0.0.1): ``instance/preempted`` and ``instance/maintenance-event``.

Requests need ``Metadata-Flavor: Google`` (403 without, as on GCE); answers carry ``Metadata-Flavor: Google``
and an ``ETag``. ``?wait_for_change=true`` holds the request until the value's ETag differs from
``last_etag`` (at once when it already does) or ``timeout_sec`` passes, then answers the current value.
"""
from __future__ import annotations

import hashlib

from spotfill.testing.http_standin import HttpStandin

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"


def etag(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class GcpMetadataStandin(HttpStandin):
    server_version = "Metadata Server for VM"

    def __init__(self, port: int = 0):
        super().__init__(port)
        self.values = {PREEMPTED_PATH: "FALSE", MAINTENANCE_PATH: "NONE"}
        self.waiting = 0              # wait_for_change requests being held now

    def set_value(self, path: str, value: str) -> None:
        """Any value, including a malformed one."""
        with self.changed:
            self.values[path] = value
            self.publish()

    def set_preempted(self, on: bool = True) -> None:
        self.set_value(PREEMPTED_PATH, "TRUE" if on else "FALSE")

    def set_maintenance(self, value: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        self.set_value(MAINTENANCE_PATH, value)

    def answer(self, method, path, query, headers, body):
        if headers.get("Metadata-Flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header.", {}
        if method != "GET" or path not in self.values:
            return 404, "Not Found", {}
        with self.changed:
            if query.get("wait_for_change", [""])[0] == "true":
                last = query.get("last_etag", [""])[0] or etag(self.values[path])   # none: wait for a change
                timeout = float(query.get("timeout_sec", ["300"])[0])
                self.waiting += 1
                self.changed.wait_for(lambda: etag(self.values[path]) != last or self._server is None,
                                      timeout=timeout)
                self.waiting -= 1
            value = self.values[path]
        return 200, value, {"Metadata-Flavor": "Google", "ETag": etag(value)}
