"""Spot watcher: AWS instance-metadata (IMDSv2) spot notice -> Ray drain of this node (PREEMPTION, deadline).

Three layers, kept apart so each is testable alone:

1. Pure decisions (no IO, time is an argument): :func:`parse_instance_action`, :func:`parse_rebalance`,
   :func:`decide` -> :class:`Decision` (drain or not, deadline, reason, message, notice key).
2. IO: :class:`ImdsClient` (urllib, token flow, bounded timeouts, 401 -> refetch token) and
   :class:`SpotWatcher` (one ``poll_once`` per interval; survives IMDS hiccups; drains once per notice).
3. Ray, thin and in one place at the bottom: :func:`drain_ray_node` and :class:`RayNodeDrainer`. Ray is
   imported lazily there, so this module (and ``spotfill spot-watch --help``) never imports ray.

How a drain shows up in Ray 2.60: the GCS lists the node in ``get_draining_nodes()`` as
``{node_id_hex: deadline_ms}`` (what Ray Train's PreemptionWatcher polls, so ``ray.train.get_preemption_info()``
returns the deadline), the raylet stops taking new work, the node's autoscaler state becomes DRAINING, and
once idle the node exits with death reason ``AUTOSCALER_DRAIN_PREEMPTED`` (state message
"Terminated due to preemption: <message>"). An idle node exits at once when drained.
"""
from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Collection, Optional, Sequence

from spotfill.config.errors import ConfigError, RetryableError, SpotfillError

logger = logging.getLogger(__name__)

PREEMPTION_REASON = "DRAIN_NODE_REASON_PREEMPTION"
DEFAULT_NOTICE_DEADLINE_S = 120.0      # AWS gives two minutes; used when a notice carries no usable time
TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
ON_REBALANCE_CHOICES = ("log", "drain")
_MAX_BODY = 64 * 1024


# ---------------------------------------------------------------------------------------------------
# 1. Pure decisions
# ---------------------------------------------------------------------------------------------------
def parse_time(text: Any) -> Optional[float]:
    """IMDS timestamp (``2026-11-29T12:00:00Z``, ISO-8601) -> UNIX seconds, or None if unusable."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


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


@dataclass(frozen=True)
class Decision:
    """What to do about what IMDS said. ``deadline_s`` is UNIX seconds (None = no deadline)."""

    kind: str                           # "none" | "instance-action" | "rebalance"
    drain: bool
    why: str
    key: Optional[str] = None           # identity of the notice; a drain happens once per key
    deadline_s: Optional[float] = None
    remaining_s: Optional[float] = None
    reason: str = PREEMPTION_REASON
    message: str = ""


def decide(action: Optional[InstanceAction], rebalance: Optional[RebalanceNotice], *, now: float,
           done: Collection[str] = (), on_rebalance: str = "log",
           default_deadline_s: float = DEFAULT_NOTICE_DEADLINE_S) -> Decision:
    """Turn the current notices into a :class:`Decision`.

    Any instance-action (terminate, stop, hibernate, or one we cannot read) means the instance goes away:
    drain with reason PREEMPTION and the notice's time as the deadline (``now + default_deadline_s`` when the
    notice has no usable time). A rebalance recommendation drains only when ``on_rebalance == "drain"``
    (no deadline). ``done`` holds the keys already drained, so a notice that persists is drained once.
    """
    if on_rebalance not in ON_REBALANCE_CHOICES:
        raise ConfigError("on_rebalance", on_rebalance, ON_REBALANCE_CHOICES)
    if action is not None:
        key = f"instance-action:{action.raw}"
        if key in done:
            return Decision("instance-action", False, "already drained for this notice", key=key)
        if action.time_s is not None:
            deadline, source = action.time_s, "notice time"
        else:
            deadline, source = now + default_deadline_s, f"default {default_deadline_s:g}s ({action.problem})"
        when = datetime.fromtimestamp(deadline, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        return Decision("instance-action", True, f"spot instance-action {action.action!r}; deadline from {source}",
                        key=key, deadline_s=deadline, remaining_s=deadline - now,
                        message=f"AWS spot instance-action: {action.action} at {when}")
    if rebalance is not None:
        key = f"rebalance:{rebalance.raw}"
        if on_rebalance == "drain" and key not in done:
            return Decision("rebalance", True, "rebalance recommendation (on_rebalance=drain)", key=key,
                            message="AWS EC2 rebalance recommendation")
        why = ("already drained for this recommendation" if key in done
               else "rebalance recommendation (on_rebalance=log): early warning, not draining")
        return Decision("rebalance", False, why, key=key)
    return Decision("none", False, "no notice")


# ---------------------------------------------------------------------------------------------------
# 2. IO: IMDS client and the watcher loop
# ---------------------------------------------------------------------------------------------------
class ImdsError(RetryableError):
    """IMDS was unreachable, slow, or answered something other than 200/404."""


class ImdsClient:
    """Minimal IMDSv2 client: PUT a session token, GET with it, refetch it on 401 or near expiry."""

    def __init__(self, endpoint: str, timeout_s: float = 1.0, token_ttl_s: int = 21600,
                 clock: Callable[[], float] = time.monotonic):
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s, self.token_ttl_s, self._clock = timeout_s, int(token_ttl_s), clock
        self._token: Optional[str] = None
        self._token_expiry = 0.0
        # IMDS is link-local: never route it through an http_proxy from the environment.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, str]:
        req = urllib.request.Request(self.endpoint + path, method=method, headers=headers,
                                     data=b"" if method == "PUT" else None)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read(_MAX_BODY).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:  # refused, timeout
            raise ImdsError(f"{method} {path}: {getattr(exc, 'reason', exc)}") from None

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


@dataclass(frozen=True)
class PollOutcome:
    """What one poll saw and did; ``status`` is one of the values listed in :meth:`SpotWatcher.poll_once`."""

    status: str
    decision: Optional[Decision] = None
    detail: str = ""

    def describe(self) -> str:
        """One human line, printed by ``spot-watch --once``."""
        d = self.decision
        if self.status == "drained" and d is not None:
            left = f", {d.remaining_s:.0f}s left" if d.remaining_s is not None else ", no deadline"
            return f"drained {self.detail or 'node'} (reason {d.reason}{left}): {d.message}"
        if self.status == "no-notice":
            return "no notice"
        text = f"{self.status}: {d.why}" if d is not None else self.status
        return f"{text} ({self.detail})" if self.detail else text


DrainFn = Callable[[Decision], Optional[str]]


class SpotWatcher:
    """Polls IMDS and applies :func:`decide`; ``drain(decision)`` does the draining (returns a target label)."""

    def __init__(self, imds: ImdsClient, drain: DrainFn, *, on_rebalance: str = "log",
                 clock: Callable[[], float] = time.time,
                 default_deadline_s: float = DEFAULT_NOTICE_DEADLINE_S):
        if on_rebalance not in ON_REBALANCE_CHOICES:
            raise ConfigError("--on-rebalance", on_rebalance, ON_REBALANCE_CHOICES)
        self.imds, self._drain, self.on_rebalance = imds, drain, on_rebalance
        self._clock, self.default_deadline_s = clock, default_deadline_s
        self.done: set[str] = set()        # notice keys drained
        self._seen: set[str] = set()       # notice keys logged at WARNING already
        self._imds_failing = False

    def poll_once(self) -> PollOutcome:
        """One poll. Status: no-notice | rebalance | drained | already-drained | imds-error | drain-failed."""
        try:
            body = self.imds.get(INSTANCE_ACTION_PATH)
        except ImdsError as exc:
            if not self._imds_failing:
                logger.warning("IMDS poll failed (will retry): %s", exc)
            else:
                logger.debug("IMDS still failing: %s", exc)
            self._imds_failing = True
            return PollOutcome("imds-error", detail=str(exc))
        if self._imds_failing:
            logger.info("IMDS reachable again")
            self._imds_failing = False
        action = parse_instance_action(body) if body is not None else None
        rebalance = None
        if action is None:
            try:
                rebody = self.imds.get(REBALANCE_PATH)
                rebalance = parse_rebalance(rebody) if rebody is not None else None
            except ImdsError as exc:   # the early warning is optional: never let it block the main check
                logger.debug("rebalance check failed: %s", exc)
        decision = decide(action, rebalance, now=self._clock(), done=self.done,
                          on_rebalance=self.on_rebalance, default_deadline_s=self.default_deadline_s)
        if decision.key and decision.key not in self._seen:
            self._seen.add(decision.key)
            logger.warning("%s: %s (%s)", decision.kind, decision.why,
                           action.raw if action else rebalance.raw if rebalance else "")
        if not decision.drain:
            if decision.key is not None and decision.key in self.done:
                return PollOutcome("already-drained", decision)
            return PollOutcome("no-notice" if decision.kind == "none" else decision.kind, decision)
        logger.warning("draining (reason %s, deadline %s, on_rebalance=%s): %s", decision.reason,
                       f"in {decision.remaining_s:.0f}s" if decision.remaining_s is not None else "none",
                       self.on_rebalance, decision.message)
        try:
            target = self._drain(decision)
        except Exception as exc:  # noqa: BLE001 - a failed drain is retried on the next poll
            logger.error("drain failed (retrying next poll): %s", exc)
            return PollOutcome("drain-failed", decision, detail=str(exc))
        self.done.add(decision.key or "")
        logger.warning("drain accepted for %s", target or "this node")
        return PollOutcome("drained", decision, detail=target or "")

    def run(self, poll_s: float, stop: Optional[threading.Event] = None) -> None:
        """Poll every ``poll_s`` seconds until ``stop`` is set (forever when None)."""
        stop = stop or threading.Event()
        logger.info("spot watcher polling %s every %gs (on_rebalance=%s)", self.imds.endpoint, poll_s,
                    self.on_rebalance)
        while not stop.is_set():
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a daemon must outlive any one bad poll
                logger.exception("spot watcher poll crashed; continuing")
            stop.wait(poll_s)


# ---------------------------------------------------------------------------------------------------
# 3. Ray (thin, lazy imports). Everything that touches Ray lives below this line.
# ---------------------------------------------------------------------------------------------------
class DrainError(SpotfillError):
    """The drain could not be sent, was rejected, or this node could not be found in the cluster."""


def _gcs_client(address: Optional[str]):
    """(gcs_address, GcsClient) for ``address`` ("auto"/None = the cluster `ray start` joined here); the
    private hook is in spotfill.ray_compat."""
    from spotfill.ray_compat import gcs_client

    return gcs_client(address)


def alive_nodes(gcs_client, timeout_s: float = 10.0) -> list[dict]:
    """Alive nodes as ``[{"node_id", "ip", "is_head", "instance_id"}]``.

    PRIVATE RAY API: ``GcsClient.get_all_node_info`` (the public ``ray.nodes()`` needs ``ray.init`` and the
    state API needs the dashboard, which cluster.yaml binds to the head's localhost).
    """
    from spotfill.ray_compat import gcs_pb2

    infos = gcs_client.get_all_node_info(timeout=timeout_s)
    return [{"node_id": nid.hex(), "ip": info.node_manager_address, "is_head": info.is_head_node,
             "instance_id": info.instance_id}
            for nid, info in infos.items() if info.state == gcs_pb2.GcsNodeInfo.ALIVE]


def pick_node(nodes: Sequence[dict], ip: str, instance_id: str = "") -> str:
    """The node to drain among alive ``nodes``: the one started for ``instance_id`` (autoscaler v2 sets
    ``RAY_CLOUD_INSTANCE_ID``), else the one on ``ip``; several raylets on one IP (a laptop cluster) -> the
    single non-head one."""
    if instance_id:
        mine = [n for n in nodes if n.get("instance_id") == instance_id]
        if len(mine) == 1:
            return mine[0]["node_id"]
    here = [n for n in nodes if n["ip"] == ip]
    if len(here) > 1:
        here = [n for n in here if not n["is_head"]]
    if len(here) == 1:
        return here[0]["node_id"]
    if not here:
        raise DrainError(f"no alive Ray node with IP {ip} (raylet not registered yet?)")
    raise DrainError(f"{len(here)} Ray worker nodes share IP {ip}; pass --node-id")


def drain_ray_node(node_id: str, deadline_s: Optional[float] = None, message: str = "", *,
                   reason: str = PREEMPTION_REASON, address: Optional[str] = None, gcs_client=None,
                   timeout_s: float = 10.0) -> None:
    """Ask the GCS to drain ``node_id`` (hex) with ``reason`` and a deadline (UNIX seconds; None = none).

    PRIVATE RAY API, isolated here: ``GcsClient.drain_node(node_id_hex, DrainNodeReason, message,
    deadline_timestamp_ms, timeout=)`` is exactly what ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
    --reason-message M --deadline-remaining-seconds S`` calls, and what autoscaler v2 uses for preemption.
    PREEMPTION drains cannot be rejected by the raylet; a second call updates the deadline. The GCS accepts
    unknown node ids silently, so callers must pass the id of an alive node. Ray never kills the node at the
    deadline: the cloud (or the caller) does.
    """
    from spotfill.ray_compat import autoscaler_pb2

    if gcs_client is None:
        _, gcs_client = _gcs_client(address)
    deadline_ms = int(deadline_s * 1000) if deadline_s else 0
    accepted, rejection = gcs_client.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value(reason),
                                                message, deadline_ms, timeout=timeout_s)
    if not accepted:
        raise DrainError(f"drain of node {node_id} rejected: {rejection}")


class RayNodeDrainer:
    """The watcher's ``drain`` callable: drains this machine's Ray node (or ``node_id``) via the GCS."""

    def __init__(self, address: Optional[str] = None, node_id: Optional[str] = None,
                 node_ip: Optional[str] = None, timeout_s: float = 10.0):
        from spotfill.ray_compat import require
        require("spot_drain")       # at start, one line: not at the first notice
        self.address, self.node_id, self.node_ip, self.timeout_s = address, node_id, node_ip, timeout_s
        self._lock = threading.Lock()
        self._gcs = None
        self._gcs_address: Optional[str] = None

    def resolve(self) -> str:
        """Connect (once) and find the node to drain: ``node_id`` if given, else see :func:`pick_node`."""
        with self._lock:
            if self._gcs is None:
                self._gcs_address, self._gcs = _gcs_client(self.address)
            nodes = alive_nodes(self._gcs, self.timeout_s)
            if self.node_id:   # the GCS accepts drains of unknown ids silently: check it is alive
                if not any(n["node_id"] == self.node_id for n in nodes):
                    raise DrainError(f"node {self.node_id} is not an alive node of this cluster")
                return self.node_id
            import ray

            ip = self.node_ip or ray.util.get_node_ip_address(self._gcs_address)
            return pick_node(nodes, ip, ray.util.get_node_instance_id())

    def prepare(self) -> None:
        """Best-effort warm-up at daemon start: connect and log which node would be drained."""
        try:
            logger.info("spot watcher will drain Ray node %s (GCS %s)", self.resolve(), self._gcs_address)
        except Exception as exc:  # noqa: BLE001 - retried at drain time
            logger.warning("could not resolve this Ray node yet (retried at drain time): %s", exc)

    def __call__(self, decision: Decision) -> str:
        try:
            node_id = self.resolve()
            drain_ray_node(node_id, decision.deadline_s, decision.message, reason=decision.reason,
                           gcs_client=self._gcs, timeout_s=self.timeout_s)
        except DrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - RpcError, ConnectionError, ...: make it one clear error
            raise DrainError(f"drain via GCS {self._gcs_address or self.address or 'auto'} failed: {exc}") from exc
        return f"node {node_id}"
