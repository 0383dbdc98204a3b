"""A small, real HTTP stand-in for the AWS EC2 instance-metadata service (IMDSv2 subset).

Used by tests and by the demo to play spot notices without a cloud. It speaks the parts of the protocol
the spot watcher uses:

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600`` returns a session token
  (400 without a valid TTL). Tokens expire after their TTL, or at once through :meth:`ImdsStandin.expire_tokens`.
- ``GET /latest/meta-data/...`` requires ``X-aws-ec2-metadata-token`` (IMDSv2 only): missing, unknown or
  expired tokens get 401, as on EC2.
- ``/latest/meta-data/spot/instance-action``: 404 until :meth:`set_notice`, then
  ``{"action": "terminate", "time": "2026-11-29T12:00:00Z"}``.
- ``/latest/meta-data/events/recommendations/rebalance``: 404 until :meth:`set_rebalance`, then
  ``{"noticeTime": "..."}``.
- ``instance-id``, ``instance-life-cycle``, ``local-ipv4`` for completeness.

Switchable faults: slow responses (:meth:`set_delay`), 5xx answers (:meth:`set_failure`) and token rejection
(:meth:`reject_tokens`). Every request is counted in :attr:`requests` so tests can assert on the traffic.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

logger = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
MAX_TTL_S = 21600


def iso_utc(unix_s: float) -> str:
    """Format a UNIX time the way IMDS does: ``2026-11-29T12:00:00Z``."""
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ImdsStandin:
    """IMDSv2 stand-in on ``127.0.0.1`` (port 0 = any free port). Use as a context manager or start/stop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, instance_id: str = "i-0standin000000000",
                 life_cycle: str = "spot"):
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}            # token -> monotonic expiry
        self._notice: Optional[dict] = None
        self._rebalance: Optional[dict] = None
        self._delay_s, self._delay_left = 0.0, None     # None = every request
        self._fail_status, self._fail_left = 0, None
        self._reject_tokens = False
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.static = {"/latest/meta-data/instance-id": instance_id,
                       "/latest/meta-data/instance-life-cycle": life_cycle,
                       "/latest/meta-data/local-ipv4": host}
        self.requests: Counter = Counter()              # (method, path, status) -> count

    # lifecycle -----------------------------------------------------------------------------------
    def start(self) -> "ImdsStandin":
        """Bind and serve in a daemon thread; returns self."""
        standin = self

        class Handler(_Handler):
            owner = standin

        self._server = ThreadingHTTPServer((self._host, self._port), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        server = self._server
        self._thread = threading.Thread(target=lambda: server.serve_forever(poll_interval=0.05),
                                        name="imds-standin", daemon=True)
        self._thread.start()
        logger.info("IMDS stand-in listening at %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "ImdsStandin":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (what ``--imds-endpoint`` takes)."""
        if self._server is None:
            raise RuntimeError("IMDS stand-in is not started")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # scenario controls ---------------------------------------------------------------------------
    def set_notice(self, action: str = "terminate", seconds_from_now: float = 120.0) -> str:
        """Publish a spot instance-action; returns its ``time`` string (whole seconds, like AWS)."""
        when = iso_utc(time.time() + seconds_from_now)
        with self._lock:
            self._notice = {"action": action, "time": when}
        return when

    def clear_notice(self) -> None:
        with self._lock:
            self._notice = None

    def set_rebalance(self, seconds_ago: float = 0.0) -> str:
        """Publish a rebalance recommendation; returns its ``noticeTime``."""
        when = iso_utc(time.time() - seconds_ago)
        with self._lock:
            self._rebalance = {"noticeTime": when}
        return when

    def clear_rebalance(self) -> None:
        with self._lock:
            self._rebalance = None

    def expire_tokens(self) -> None:
        """Make every token issued so far invalid (as if its TTL ran out)."""
        with self._lock:
            self._tokens.clear()

    def reject_tokens(self, on: bool = True) -> None:
        """While on, every GET answers 401 whatever the token."""
        with self._lock:
            self._reject_tokens = on

    def set_delay(self, seconds: float, count: Optional[int] = None) -> None:
        """Delay responses by ``seconds``: the next ``count`` requests, or all when ``count`` is None."""
        with self._lock:
            self._delay_s, self._delay_left = float(seconds), count

    def set_failure(self, status: int = 500, count: Optional[int] = None) -> None:
        """Answer ``status`` (e.g. 500, 503): the next ``count`` requests, or all when None; 0 turns off."""
        with self._lock:
            self._fail_status, self._fail_left = int(status), count

    def count(self, method: Optional[str] = None, path: Optional[str] = None,
              status: Optional[int] = None) -> int:
        """How many requests matched (None = any)."""
        with self._lock:
            return sum(n for (m, p, s), n in self.requests.items()
                       if (method is None or m == method) and (path is None or p == path)
                       and (status is None or s == status))

    # request handling (called from handler threads) -----------------------------------------------
    def _take_fault(self) -> tuple[float, int]:
        with self._lock:
            delay = 0.0
            if self._delay_s > 0 and (self._delay_left is None or self._delay_left > 0):
                delay = self._delay_s
                if self._delay_left is not None:
                    self._delay_left -= 1
            status = 0
            if self._fail_status and (self._fail_left is None or self._fail_left > 0):
                status = self._fail_status
                if self._fail_left is not None:
                    self._fail_left -= 1
            return delay, status

    def _issue_token(self, ttl_header: Optional[str]) -> tuple[int, str]:
        try:
            ttl = int(ttl_header or "")
        except ValueError:
            return 400, "missing or invalid " + TTL_HEADER
        if not 1 <= ttl <= MAX_TTL_S:
            return 400, f"{TTL_HEADER} must be 1..{MAX_TTL_S}"
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._tokens[token] = time.monotonic() + ttl
        return 200, token

    def _token_ok(self, token: Optional[str]) -> bool:
        with self._lock:
            if self._reject_tokens or not token:
                return False
            expiry = self._tokens.get(token)
            return expiry is not None and time.monotonic() < expiry

    def _metadata(self, path: str) -> tuple[int, str]:
        with self._lock:
            if path == INSTANCE_ACTION_PATH:
                return (200, json.dumps(self._notice)) if self._notice else (404, "Not Found")
            if path == REBALANCE_PATH:
                return (200, json.dumps(self._rebalance)) if self._rebalance else (404, "Not Found")
        if path in self.static:
            return 200, self.static[path]
        return 404, "Not Found"

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests[(method, path, status)] += 1


class _Handler(BaseHTTPRequestHandler):
    owner: ImdsStandin
    server_version = "EC2ws"

    def _reply(self, method: str, status: int, body: str) -> None:
        self.owner._record(method, self.path, status)
        data = body.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout): fine
            pass

    def _faulted(self, method: str) -> bool:
        delay, status = self.owner._take_fault()
        if delay:
            time.sleep(delay)
        if status:
            self._reply(method, status, "Internal Server Error")
            return True
        return False

    def do_PUT(self) -> None:  # noqa: N802 - http.server API
        if self._faulted("PUT"):
            return
        if self.path != TOKEN_PATH:
            self._reply("PUT", 404, "Not Found")
            return
        status, body = self.owner._issue_token(self.headers.get(TTL_HEADER))
        self._reply("PUT", status, body)

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        if self._faulted("GET"):
            return
        if not self.owner._token_ok(self.headers.get(TOKEN_HEADER)):
            self._reply("GET", 401, "Unauthorized")
            return
        status, body = self.owner._metadata(self.path)
        self._reply("GET", status, body)

    def log_message(self, fmt: str, *args) -> None:  # route access logs to logging, not stderr
        logger.debug("imds-standin: " + fmt, *args)
