"""AWS: the EC2 instance-metadata service (IMDSv2).

- ``/latest/meta-data/spot/instance-action`` (404 until a notice; then ``{"action": "terminate", "time":
  "...Z"}``, two minutes ahead) -> preempt notice, deadline = its time (120 s from now when unreadable);
- ``/latest/meta-data/events/recommendations/rebalance`` (``{"noticeTime": ...}``) -> early warning: no drain
  unless ``--on-rebalance drain``; recorded so training does not grow onto the node.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Collection, Optional

from spotfill.spot.notice import (EARLY_WARNING, PREEMPT, Decision, Notice, PollingSource, Reading, SourceError,
                                  decide as decide_reading, http_opener, http_request, parse_time)

logger = logging.getLogger(__name__)

NAME = "aws"
DEFAULT_ENDPOINT = "http://169.254.169.254"
DEFAULT_NOTICE_DEADLINE_S = 120.0      # AWS gives two minutes; used when a notice carries no usable time
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
ON_REBALANCE_CHOICES = ("log", "drain")


# --- pure ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceAction:
    """A spot interruption notice. ``time_s`` is None when the body had no usable time."""

    action: str
    time_s: Optional[float]
    raw: str
    problem: Optional[str] = None      # set when the body could not be fully parsed


@dataclass(frozen=True)
class RebalanceNotice:
    """An EC2 rebalance recommendation (elevated interruption risk; no deadline)."""

    notice_time_s: Optional[float]
    raw: str


def parse_instance_action(body: str) -> InstanceAction:
    """Parse an instance-action body. Never raises: a 200 means a notice exists, even if garbled."""
    try:
        data = json.loads(body)
    except (TypeError, ValueError):
        return InstanceAction("unknown", None, body, problem="body is not JSON")
    if not isinstance(data, dict):
        return InstanceAction("unknown", None, body, problem="body is not a JSON object")
    action = str(data.get("action") or "unknown")
    time_s = parse_time(data.get("time"))
    problem = None if time_s is not None else f"no usable time in {data.get('time')!r}"
    return InstanceAction(action, time_s, body, problem)


def parse_rebalance(body: str) -> RebalanceNotice:
    """Parse a rebalance-recommendation body (``{"noticeTime": ...}``). Never raises."""
    try:
        data = json.loads(body)
    except (TypeError, ValueError):
        data = None
    when = parse_time(data.get("noticeTime")) if isinstance(data, dict) else None
    return RebalanceNotice(when, body)


def reading(action: Optional[InstanceAction], rebalance: Optional[RebalanceNotice], *, now: float,
            default_deadline_s: float = DEFAULT_NOTICE_DEADLINE_S) -> Reading:
    """The notices IMDS's two answers stand for. Any instance-action (terminate, stop, hibernate, or one we
    cannot read) means the instance goes away: a preempt notice at its time (``now + default_deadline_s``
    when it has none, the garbled body reported as a problem)."""
    notices, problems = [], []
    if action is not None:
        if action.time_s is not None:
            deadline, source = action.time_s, "notice time"
        else:
            deadline, source = now + default_deadline_s, f"default {default_deadline_s:g}s ({action.problem})"
            problems.append(f"instance-action: {action.problem}: {action.raw[:200]!r}")
        when = datetime.fromtimestamp(deadline, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        notices.append(Notice(NAME, PREEMPT, "instance-action", f"instance-action:{action.raw}", deadline,
                              f"AWS spot instance-action: {action.action} at {when}",
                              f"spot instance-action {action.action!r}; deadline from {source}"))
    if rebalance is not None:
        notices.append(Notice(NAME, EARLY_WARNING, "rebalance", f"rebalance:{rebalance.raw}", None,
                              "AWS EC2 rebalance recommendation", "rebalance recommendation"))
    return Reading(tuple(notices), tuple(problems))


def decide(action: Optional[InstanceAction], rebalance: Optional[RebalanceNotice], *, now: float,
           done: Collection[str] = (), on_rebalance: str = "log",
           default_deadline_s: float = DEFAULT_NOTICE_DEADLINE_S) -> Decision:
    """:func:`spotfill.spot.notice.decide` on IMDS's two answers (``on_rebalance`` is the early-warning option)."""
    return decide_reading(reading(action, rebalance, now=now, default_deadline_s=default_deadline_s), now=now,
                          done=done, on_early_warning=on_rebalance, option="on_rebalance")


# --- HTTP ------------------------------------------------------------------------------------------
ImdsError = SourceError


class ImdsClient:
    """Minimal IMDSv2 client: PUT a session token, GET with it, refetch it on 401 or near expiry."""

    def __init__(self, endpoint: str, timeout_s: float = 1.0, token_ttl_s: int = 21600,
                 clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s, self.token_ttl_s, self._clock = timeout_s, int(token_ttl_s), clock
        self._token: Optional[str] = None
        self._token_expiry = 0.0
        self._opener = http_opener()

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, str]:
        status, body, _ = http_request(self._opener, method, self.endpoint + path, headers, self.timeout_s)
        return status, body

    def token(self) -> str:
        """A valid session token (cached until shortly before its TTL runs out)."""
        if self._token is None or self._clock() >= self._token_expiry:
            status, body = self._request("PUT", TOKEN_PATH,
                                         {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)})
            if status != 200 or not body:
                raise ImdsError(f"PUT {TOKEN_PATH}: HTTP {status}")
            self._token = body.strip()
            self._token_expiry = self._clock() + max(1.0, self.token_ttl_s * 0.9)
            logger.debug("IMDS session token fetched (ttl %ss)", self.token_ttl_s)
        return self._token

    def get(self, path: str) -> Optional[str]:
        """Body of ``path``; None on 404. A 401 (expired/invalid token) refetches the token once."""
        for attempt in range(2):
            status, body = self._request("GET", path, {"X-aws-ec2-metadata-token": self.token()})
            if status == 200:
                return body
            if status == 404:
                return None
            if status == 401 and attempt == 0:
                logger.info("IMDS rejected the session token (401); fetching a new one")
                self._token = None
                continue
            raise ImdsError(f"GET {path}: HTTP {status}")
        raise AssertionError("unreachable")


class AwsSource(PollingSource):
    """Polls instance-action, and the rebalance recommendation while there is no instance-action."""

    name = NAME

    def __init__(self, endpoint: str = DEFAULT_ENDPOINT, timeout_s: float = 1.0,
                 default_deadline_s: float = DEFAULT_NOTICE_DEADLINE_S, client: Optional[ImdsClient] = None):
        self.imds = client or ImdsClient(endpoint, timeout_s=timeout_s)
        self.endpoint, self.default_deadline_s = self.imds.endpoint, default_deadline_s

    def read(self, now: float) -> Reading:
        body = self.imds.get(INSTANCE_ACTION_PATH)
        action = parse_instance_action(body) if body is not None else None
        rebalance = None
        if action is None:
            try:
                rebody = self.imds.get(REBALANCE_PATH)
                rebalance = parse_rebalance(rebody) if rebody is not None else None
            except SourceError as exc:   # the early warning is optional: never let it block the main check
                logger.debug("rebalance check failed: %s", exc)
        return reading(action, rebalance, now=now, default_deadline_s=self.default_deadline_s)
