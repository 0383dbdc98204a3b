"""Shared base of the metadata stand-ins (gcp_metadata.py, azure_events.py, kube_api.py): a threaded HTTP
server on 127.0.0.1 only, switchable faults (slow answers, 5xx, stopped answering), and a request count.

A subclass implements ``answer(method, path, query, headers, body) -> (status, body, extra headers)``.
``publish()`` stamps :attr:`published_at` (``time.monotonic()``) so a test can measure notice -> drain.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)


class HttpStandin:
    """Start/stop (or use as a context manager); :attr:`url` is the base URL."""

    server_version = "standin"

    def __init__(self, port: int = 0):
        self._port = port
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)      # notified on every publish (long polls wait on it)
        self._delay_s, self._fail_status = 0.0, 0
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.requests: Counter = Counter()                # (method, path, status) -> count
        self.published_at: Optional[float] = None

    # lifecycle -----------------------------------------------------------------------------------
    def start(self):
        standin = self

        class Handler(_Handler):
            owner = standin
            server_version = standin.server_version

        self._server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._port = self._server.server_address[1]       # a restart binds the same port again
        self._server.daemon_threads = True
        self._server.block_on_close = False
        server = self._server
        self._thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05),
                                        name=f"{type(self).__name__}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering (connections are refused) -- idempotent; :meth:`start` serves again on the same port."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self.changed:
            self.changed.notify_all()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # faults --------------------------------------------------------------------------------------
    def set_delay(self, seconds: float) -> None:
        """Answer every request ``seconds`` late (0 = off): a server that hangs."""
        with self.lock:
            self._delay_s = float(seconds)

    def set_failure(self, status: int = 500) -> None:
        """Answer every request with ``status`` (0 = off)."""
        with self.lock:
            self._fail_status = int(status)

    def publish(self) -> None:
        """Call with the lock held after changing state: stamps the time and wakes long polls."""
        self.published_at = time.monotonic()
        self.changed.notify_all()

    def count(self, method: Optional[str] = None, path: Optional[str] = None, status: Optional[int] = None) -> int:
        with self.lock:
            return sum(n for (m, p, s), n in self.requests.items()
                       if (method is None or m == method) and (path is None or p == path)
                       and (status is None or s == status))

    def answer(self, method: str, path: str, query: dict, headers, body: bytes) -> tuple[int, str, dict]:
        """(status, body, headers) for a request; each stand-in answers its own paths -- here none: 404, as
        a metadata server answers a path it does not serve."""
        return 404, "not found", {}

    def _faults(self) -> tuple[float, int]:
        with self.lock:
            return self._delay_s, self._fail_status


class _Handler(BaseHTTPRequestHandler):
    owner: HttpStandin

    def _handle(self, method: str) -> None:
        delay, fail = self.owner._faults()
        if delay:
            time.sleep(delay)
        split = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if fail:
            status, text, extra = fail, "Internal Server Error", {}
        else:
            status, text, extra = self.owner.answer(method, split.path, parse_qs(split.query), self.headers, body)
        with self.owner.lock:
            self.owner.requests[(method, split.path, status)] += 1
        data = text.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", extra.pop("Content-Type", "text/plain"))
            for k, v in extra.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout): fine
            pass

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        self._handle("POST")

    def log_message(self, fmt: str, *args) -> None:
        logger.debug("standin: " + fmt, *args)
