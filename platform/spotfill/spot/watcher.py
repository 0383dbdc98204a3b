"""Spot watcher: a notice source (spot.sources: aws, gcp, azure, kubernetes) -> Ray drain of this node
(PREEMPTION, deadline); early warnings -> a record that keeps training from growing onto the node.

Layers, kept apart so each is testable alone:

1. Pure decisions (no IO, time is an argument): each source module's ``reading(...)`` and
   :func:`spotfill.spot.notice.decide` -> :class:`Decision` (drain or not, deadline, reason, message, key).
2. IO: the sources (HTTP to their metadata server, or a signal) and :class:`SpotWatcher` (one ``poll_once``
   per interval or as soon as the source wakes it; survives a metadata server that stops answering and
   says so once; drains once per notice; records early warnings; acknowledges a drained notice that wants
   it -- Azure -- once this node's work has left).
3. Ray, thin and in one place at the bottom: :func:`drain_ray_node` and :class:`RayNodeDrainer`. Ray is
   imported lazily there, so this module (and ``spotfill spot-watch --help``) never imports ray.

How a drain shows up in Ray 2.60: the GCS lists the node in ``get_draining_nodes()`` as
``{node_id_hex: deadline_ms}`` (what Ray Train's PreemptionWatcher polls, so ``ray.train.get_preemption_info()``
returns the deadline), the raylet stops taking new work, the node's autoscaler state becomes DRAINING, and
once idle the node exits with death reason ``AUTOSCALER_DRAIN_PREEMPTED`` (state message
"Terminated due to preemption: <message>"). An idle node exits at once when drained.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from spotfill.config.errors import ConfigError, SpotfillError
from spotfill.spot.notice import (EARLY_WARNING, PREEMPTION_REASON, Decision, Notice,  # noqa: F401
                                  NoticeSource, Reading, SourceError, decide as decide_reading, parse_time)
from spotfill.spot.sources.aws import (DEFAULT_NOTICE_DEADLINE_S, INSTANCE_ACTION_PATH,  # noqa: F401
                                       ON_REBALANCE_CHOICES, REBALANCE_PATH, TOKEN_PATH, AwsSource, ImdsClient,
                                       ImdsError, InstanceAction, RebalanceNotice, decide, parse_instance_action,
                                       parse_rebalance)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# 2. The watcher loop (any source)
# ---------------------------------------------------------------------------------------------------
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
WarnFn = Callable[[Notice, bool, float], None]     # (notice, withdrawn, now)


class SpotWatcher:
    """Reads ``source`` and applies :func:`decide`; ``drain(decision)`` drains (returns a target label).

    ``warn(notice, withdrawn, now)`` records an early warning (and its withdrawal); ``left()`` says whether
    this node's work has left after a drain (a drained Ray node exits once training committed its emergency
    checkpoint and moved off) -- a drained notice with an ``ack_id`` is acknowledged to the source then."""

    def __init__(self, source: NoticeSource, drain: DrainFn, *, on_rebalance: str = "log",
                 clock: Callable[[], float] = time.time, warn: Optional[WarnFn] = None,
                 left: Optional[Callable[[], bool]] = None):
        if on_rebalance not in ON_REBALANCE_CHOICES:
            raise ConfigError("--on-rebalance", on_rebalance, ON_REBALANCE_CHOICES)
        self.source, self._drain, self.on_rebalance = source, drain, on_rebalance
        self._clock, self._warn, self._left = clock, warn, left
        self.done: set[str] = set()        # notice keys drained
        self._seen: set[str] = set()       # notice keys and problems logged at WARNING already
        self._failing = False
        self.warned: dict[str, Notice] = {}      # early warnings recorded (key -> notice)
        self.pending_acks: dict[str, Notice] = {}
        self.acked: set[str] = set()
        self.drained_notices: dict[str, Notice] = {}

    def _once(self, key: str, level: int, msg: str, *args) -> None:
        if key not in self._seen:
            self._seen.add(key)
            logger.log(level, msg, *args)

    def poll_once(self) -> PollOutcome:
        """One poll. Status: no-notice | <early warning's event> | drained | already-drained | imds-error
        (the metadata server did not answer) | drain-failed."""
        now = self._clock()
        try:
            reading = self.source.read(now)
        except SourceError as exc:
            if not self._failing:
                logger.warning("%s metadata poll failed (will keep polling; said once until it answers): %s",
                               self.source.name, exc)
            else:
                logger.debug("%s metadata still failing: %s", self.source.name, exc)
            self._failing = True
            return PollOutcome("imds-error", detail=str(exc))
        if self._failing:
            logger.info("%s metadata reachable again", self.source.name)
            self._failing = False
        for problem in reading.problems:
            self._once(f"problem:{problem}", logging.WARNING, "%s: unusable answer: %s", self.source.name, problem)
        self._track(reading, now)
        decision = decide_reading(reading, now=now, done=self.done, on_early_warning=self.on_rebalance,
                                  option="on_rebalance")
        if decision.key:
            self._once(decision.key, logging.WARNING, "%s: %s (%s)", decision.kind, decision.why,
                       decision.notice.message if decision.notice else "")
        if not decision.drain:
            if decision.key is not None and decision.key in self.done:
                return PollOutcome("already-drained", decision)
            return PollOutcome("no-notice" if decision.kind == "none" else decision.kind, decision)
        logger.warning("draining (reason %s, deadline %s, source %s): %s", decision.reason,
                       f"in {decision.remaining_s:.0f}s" if decision.remaining_s is not None else "none",
                       self.source.name, decision.message)
        try:
            target = self._drain(decision)
        except Exception as exc:  # noqa: BLE001 - a failed drain is retried on the next poll
            logger.error("drain failed (retrying next poll): %s", exc)
            return PollOutcome("drain-failed", decision, detail=str(exc))
        self.done.add(decision.key or "")
        if decision.notice is not None:
            self.drained_notices[decision.notice.key] = decision.notice
            if decision.notice.ack_id:
                self.pending_acks[decision.notice.key] = decision.notice
        logger.warning("drain accepted for %s", target or "this node")
        return PollOutcome("drained", decision, detail=target or "")

    def _track(self, reading: Reading, now: float) -> None:
        """Early warnings recorded / withdrawn, drained notices withdrawn (said once), pending acks sent."""
        current = {n.key: n for n in reading.notices}
        if self._warn is not None:
            for key, n in current.items():
                if n.kind == EARLY_WARNING and key not in self.warned and self._warn_safely(n, False, now):
                    self.warned[key] = n
            for key in [k for k in self.warned if k not in current]:
                if self._warn_safely(self.warned[key], True, now):
                    del self.warned[key]
        for key, n in self.drained_notices.items():
            if key not in current:
                self._once(f"withdrawn:{key}", logging.WARNING, "%s: notice withdrawn after this node was "
                           "drained (%s); Ray cannot undo a drain: the node leaves once its work has moved",
                           self.source.name, n.message)
                self.pending_acks.pop(key, None)
        if self.pending_acks and self._left is not None and self._left_safely():
            for key, n in list(self.pending_acks.items()):
                try:
                    self.source.acknowledge(n)
                except SourceError as exc:
                    logger.warning("acknowledging %s failed (retrying next poll): %s", n.message, exc)
                    continue
                del self.pending_acks[key]
                self.acked.add(key)
                logger.warning("acknowledged %s: this node's work has left", n.message)

    def _warn_safely(self, notice: Notice, withdrawn: bool, now: float) -> bool:
        try:
            self._warn(notice, withdrawn, now)
        except Exception as exc:  # noqa: BLE001 - retried next poll; never blocks a drain
            logger.warning("could not record early warning %s (retrying): %s", notice.message, exc)
            return False
        logger.info("early warning %s: %s", "withdrawn" if withdrawn else "recorded", notice.message)
        return True

    def _left_safely(self) -> bool:
        try:
            return bool(self._left())
        except Exception as exc:  # noqa: BLE001 - asked again next poll
            logger.debug("cannot tell whether this node's work has left: %s", exc)
            return False

    def run(self, poll_s: float, stop: Optional[threading.Event] = None) -> None:
        """Poll every ``poll_s`` seconds (sooner when the source wakes it) until ``stop`` is set (forever when
        None), or -- for a source whose notice ends the process (Kubernetes SIGTERM) -- once it is drained and
        acknowledged."""
        stop = stop or threading.Event()
        logger.info("spot watcher: source %s at %s, polling every %gs (on_rebalance=%s)", self.source.name,
                    self.source.endpoint or "-", poll_s, self.on_rebalance)
        try:
            while not stop.is_set():
                try:
                    outcome = self.poll_once()
                    if outcome.status in ("drained", "already-drained") and \
                            getattr(self.source, "exit_after_drain", False):
                        break
                except Exception:  # noqa: BLE001 - a daemon must outlive any one bad poll
                    logger.exception("spot watcher poll crashed; continuing")
                self.source.wait(stop, poll_s)
        finally:
            self.source.close()


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
        self._drained: Optional[str] = None

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

    def warn(self, notice: Notice, withdrawn: bool, now: float) -> None:
        """Record (or end) an early warning for this node in the GCS key-value store (spot.early_warning),
        which training's grow check reads."""
        from spotfill.ray_compat import gcs_kv_put
        from spotfill.spot.early_warning import record

        node_id = self.resolve()
        key, value = record(node_id, source=notice.source, event=notice.event, message=notice.message, now=now,
                            withdrawn=withdrawn)
        gcs_kv_put(self._gcs, key, value, timeout_s=self.timeout_s)

    def has_left(self) -> bool:
        """Whether the node drained last is no longer alive (its raylet exits once its work has left)."""
        if self._drained is None or self._gcs is None:
            return False
        return not any(n["node_id"] == self._drained for n in alive_nodes(self._gcs, self.timeout_s))

    def __call__(self, decision: Decision) -> str:
        try:
            node_id = self.resolve()
            drain_ray_node(node_id, decision.deadline_s, decision.message, reason=decision.reason,
                           gcs_client=self._gcs, timeout_s=self.timeout_s)
            self._drained = node_id
        except DrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - RpcError, ConnectionError, ...: make it one clear error
            raise DrainError(f"drain via GCS {self._gcs_address or self.address or 'auto'} failed: {exc}") from exc
        return f"node {node_id}"
