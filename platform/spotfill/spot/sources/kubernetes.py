"""Kubernetes (KubeRay on GKE, EKS with Karpenter, AKS): the pod's SIGTERM, and the node's taint.

- **SIGTERM.** ``spotfill spot-watch --source kubernetes`` runs as a sidecar container of each Ray worker
  pod (deploy/kuberay). When the pod is deleted (a cordon-and-drain of a reclaimed node, or GKE's graceful
  node shutdown), the kubelet sends the sidecar SIGTERM at once (it has no preStop hook) -> preempt notice,
  deadline = SIGTERM + ``deadline_s`` (the manifest passes the same budget as the worker's preStop drain,
  inside ``terminationGracePeriodSeconds``).
- **Node taint** (where the cluster's autoscaler or interruption handler sets one, before it evicts pods):
  read from the API server (``GET /api/v1/nodes/$NODE_NAME``, the pod's service-account token; RBAC in
  deploy/kuberay/spot-watch-rbac.yaml) -> preempt notice, deadline = first seen + ``deadline_s``:
  ``cloud.google.com/impending-node-termination`` (GKE), ``karpenter.sh/disrupted`` (Karpenter),
  ``aws-node-termination-handler/spot-itn`` (NTH), ``ToBeDeletedByClusterAutoscaler`` (cluster-autoscaler).
  Without a node name or an API server the source hears SIGTERM only (said once at start).
"""
from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.request
from typing import Optional

from spotfill.spot.notice import PREEMPT, Notice, PollingSource, Reading, SourceError, http_request

logger = logging.getLogger(__name__)

NAME = "kubernetes"
DEFAULT_DEADLINE_S = 30.0          # what a pod gets by default (terminationGracePeriodSeconds 30)
TAINTS = ("cloud.google.com/impending-node-termination", "karpenter.sh/disrupted",
          "aws-node-termination-handler/spot-itn", "ToBeDeletedByClusterAutoscaler")
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_cluster_endpoint(env=os.environ) -> str:
    """``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, or "" outside a pod."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


# --- pure ------------------------------------------------------------------------------------------
def reading(sigterm_at: Optional[float], node_body: Optional[str], *, now: float, deadline_s: float,
            since: Optional[dict] = None) -> Reading:
    """Notices for a SIGTERM seen at ``sigterm_at`` and a node object (JSON; None = not read)."""
    since = since or {}
    notices, problems = [], []
    if sigterm_at is not None:
        notices.append(Notice(NAME, PREEMPT, "SIGTERM", f"kubernetes:sigterm:{sigterm_at}", sigterm_at + deadline_s,
                              "kubernetes: pod received SIGTERM", f"pod SIGTERM; deadline + {deadline_s:g}s"))
    if node_body is not None:
        try:
            node = json.loads(node_body)
            taints = node.get("spec", {}).get("taints") or []
            if not isinstance(taints, list):
                raise TypeError("spec.taints is not a list")
            keys = [t.get("key") for t in taints if isinstance(t, dict)]
        except (TypeError, ValueError, AttributeError) as exc:
            return Reading(tuple(notices), (f"node: unusable answer ({exc}): {node_body[:200]!r}",))
        name = (node.get("metadata") or {}).get("name", "")
        for key in keys:
            if key in TAINTS:
                nkey = f"kubernetes:taint:{key}"
                notices.append(Notice(NAME, PREEMPT, "taint", nkey, since.get(nkey, now) + deadline_s,
                                      f"kubernetes: node {name} tainted {key}",
                                      f"node taint {key}; deadline first seen + {deadline_s:g}s"))
    return Reading(tuple(notices), tuple(problems))


# --- IO --------------------------------------------------------------------------------------------
class KubernetesSource(PollingSource):
    """SIGTERM (via :meth:`on_sigterm`, which the CLI installs as the handler) and the node's taints."""

    name = NAME

    def __init__(self, endpoint: str = "", node_name: Optional[str] = None, deadline_s: float = DEFAULT_DEADLINE_S,
                 timeout_s: float = 1.0, token_path: str = f"{SERVICE_ACCOUNT}/token",
                 ca_path: str = f"{SERVICE_ACCOUNT}/ca.crt", clock=time.time):
        self.endpoint, self.node_name = endpoint.rstrip("/"), node_name
        self.deadline_s, self.timeout_s, self._clock = deadline_s, timeout_s, clock
        self.token_path = token_path
        handlers: list = [urllib.request.ProxyHandler({})]
        if self.endpoint.startswith("https://") and os.path.exists(ca_path):
            handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca_path)))
        self._opener = urllib.request.build_opener(*handlers)
        self._sigterm_at: Optional[float] = None
        self._woken = threading.Event()
        self._since: dict[str, float] = {}
        self.exit_after_drain = False          # set by SIGTERM: the pod is going, so is the watcher
        if not (self.endpoint and self.node_name):
            logger.info("kubernetes source: no API server or node name (NODE_NAME): hearing SIGTERM only")

    def on_sigterm(self, *_args) -> None:
        """The notice itself (a signal handler: only sets state and wakes the watcher)."""
        if self._sigterm_at is None:
            self._sigterm_at = self._clock()
        self.exit_after_drain = True
        self._woken.set()

    def _node(self) -> Optional[str]:
        if not (self.endpoint and self.node_name):
            return None
        headers = {"Accept": "application/json"}
        try:
            with open(self.token_path, encoding="utf-8") as f:
                headers["Authorization"] = f"Bearer {f.read().strip()}"
        except OSError:
            pass                               # a stand-in or a proxy without auth
        status, body, _ = http_request(self._opener, "GET", f"{self.endpoint}/api/v1/nodes/{self.node_name}",
                                       headers, self.timeout_s)
        if status != 200:
            raise SourceError(f"GET /api/v1/nodes/{self.node_name}: HTTP {status}")
        return body

    def read(self, now: float) -> Reading:
        try:
            body = self._node()
        except SourceError:
            if self._sigterm_at is None:
                raise
            body = None                        # SIGTERM alone is enough: drain on it even if the API is down
        out = reading(self._sigterm_at, body, now=now, deadline_s=self.deadline_s, since=self._since)
        seen = {n.key for n in out.notices}
        self._since = {k: t for k, t in self._since.items() if k in seen}
        for n in out.notices:
            self._since.setdefault(n.key, now)
        return out

    def wait(self, stop, timeout_s: float) -> None:
        waited = 0.0
        while waited < timeout_s and not stop.is_set():
            step = min(0.05, timeout_s - waited)
            if self._woken.wait(step):
                break
            waited += step
        self._woken.clear()
