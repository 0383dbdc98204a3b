"""The notice-source interface: what every cloud's spot notice turns into, and the one decision about it.

A source (spot/sources/<name>.py, one module per platform, one line in sources.REGISTRY) answers one question,
``read(now) -> Reading``: which notices stand now. It raises :class:`SourceError` when its metadata server does
not answer (the watcher keeps polling and says so once). Parsing is pure: each source module has functions
from a body to notices, unit-tested without HTTP or Ray.

A :class:`Notice` is either

- ``preempt``: the machine goes away at ``deadline_s`` (UNIX seconds) -> a Ray drain of this node with reason
  PREEMPTION and that deadline (what Ray Train's preemption watcher and spotfill's emergency checkpoint use);
- ``early-warning``: the machine is at risk but no deadline is set (AWS rebalance recommendation, GCP live
  migration, Azure Freeze/Reboot/Redeploy) -> no drain; recorded so training does not grow onto this node
  (spot.early_warning).

:func:`decide` turns a Reading into one :class:`Decision`; the watcher (spot.watcher) applies it.
"""
from __future__ import annotations

import http.client
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Collection, Optional, Protocol

from spotfill.config.errors import ConfigError, RetryableError

PREEMPTION_REASON = "DRAIN_NODE_REASON_PREEMPTION"
PREEMPT, EARLY_WARNING = "preempt", "early-warning"
ON_EARLY_WARNING_CHOICES = ("log", "drain")
MAX_BODY = 64 * 1024


class SourceError(RetryableError):
    """The metadata server was unreachable, slow, or answered something other than what the protocol allows."""


def parse_time(text: Any) -> Optional[float]:
    """ISO-8601 timestamp (``2026-11-29T12:00:00Z``) -> UNIX seconds, or None if unusable."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def iso_utc(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Notice:
    """One notice a source sees now. ``key`` identifies it: the same key on the next read is the same notice."""

    source: str                         # "aws" | "gcp" | "azure" | "kubernetes"
    kind: str                           # PREEMPT | EARLY_WARNING
    event: str                          # the platform's name for it: "instance-action", "Preempt", ...
    key: str
    deadline_s: Optional[float] = None  # UNIX seconds; a preempt notice always has one (default when unsaid)
    message: str = ""                   # the drain's reason message (shown as the node's death message)
    why: str = ""                       # how the deadline was found
    ack_id: Optional[str] = None        # what acknowledging it sends (Azure EventId), None = nothing to ack


@dataclass(frozen=True)
class Reading:
    """What a source saw in one read: the notices standing now, and answers it could not use (reported)."""

    notices: tuple[Notice, ...] = ()
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What to do about a Reading. ``deadline_s`` is UNIX seconds (None = no deadline)."""

    kind: str                           # "none" | the notice's event ("instance-action", "rebalance", "Preempt"...)
    drain: bool
    why: str
    key: Optional[str] = None           # identity of the notice; a drain happens once per key
    deadline_s: Optional[float] = None
    remaining_s: Optional[float] = None
    reason: str = PREEMPTION_REASON
    message: str = ""
    notice: Optional[Notice] = None


def decide(reading: Reading, *, now: float, done: Collection[str] = (), on_early_warning: str = "log",
           option: str = "on_early_warning") -> Decision:
    """One decision for what stands now: the preempt notice with the earliest deadline drains (once per key,
    keys in ``done`` were drained already); else an early warning drains only with ``on_early_warning ==
    "drain"`` (no deadline), and otherwise is reported, not drained."""
    if on_early_warning not in ON_EARLY_WARNING_CHOICES:
        raise ConfigError(option, on_early_warning, ON_EARLY_WARNING_CHOICES)
    preempts = sorted((n for n in reading.notices if n.kind == PREEMPT), key=lambda n: n.deadline_s or 0.0)
    for n in preempts:
        if n.key not in done:
            return Decision(n.event, True, n.why, key=n.key, deadline_s=n.deadline_s,
                            remaining_s=None if n.deadline_s is None else n.deadline_s - now,
                            message=n.message, notice=n)
    if preempts:
        n = preempts[0]
        return Decision(n.event, False, "already drained for this notice", key=n.key, notice=n)
    warnings = [n for n in reading.notices if n.kind == EARLY_WARNING]
    if warnings:
        n = warnings[0]
        if n.key in done:
            return Decision(n.event, False, "already drained for this early warning", key=n.key, notice=n)
        if on_early_warning == "drain":
            return Decision(n.event, True, f"{n.why} ({option}=drain)", key=n.key, message=n.message, notice=n)
        return Decision(n.event, False, f"{n.why} ({option}=log): early warning, not draining", key=n.key,
                        notice=n)
    return Decision("none", False, "no notice")


class NoticeSource(Protocol):
    """One platform's notices. ``wait`` returns when the next ``read`` is due (at most ``timeout_s``; sooner
    when the source learns of a change, e.g. GCP's wait_for_change or a signal); ``acknowledge`` tells the
    platform a drained notice may proceed (Azure), a no-op elsewhere."""

    name: str
    endpoint: str

    def read(self, now: float) -> Reading: ...

    def wait(self, stop, timeout_s: float) -> None: ...

    def acknowledge(self, notice: Notice) -> None: ...

    def close(self) -> None: ...


class PollingSource:
    """Base of the HTTP sources: wait = sleep until the next poll (or stop), nothing to acknowledge."""

    name = ""
    endpoint = ""

    def wait(self, stop, timeout_s: float) -> None:
        stop.wait(timeout_s)

    def acknowledge(self, notice: Notice) -> None:
        return None

    def close(self) -> None:
        return None


def http_opener() -> urllib.request.OpenerDirector:
    """Metadata servers are link-local: never route them through an http_proxy from the environment."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_request(opener, method: str, url: str, headers: dict, timeout_s: float,
                 data: Optional[bytes] = None) -> tuple[int, str, dict]:
    """(status, body, headers) of one request; HTTP error statuses are returned, not raised; a refused
    connection, a timeout or a broken answer raises :class:`SourceError`."""
    if data is None and method in ("PUT", "POST"):
        data = b""
    req = urllib.request.Request(url, method=method, headers=headers, data=data)
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return resp.status, resp.read(MAX_BODY).decode("utf-8", "replace"), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, "", dict(exc.headers or {})
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:  # refused, timeout
        path = url.split("://", 1)[-1].split("/", 1)[-1]
        raise SourceError(f"{method} /{path}: {getattr(exc, 'reason', exc)}") from None
