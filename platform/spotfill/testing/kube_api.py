"""Kubernetes API-server stand-in (127.0.0.1, plain HTTP): ``GET /api/v1/nodes/<name>`` with the node's taints.

Only what spot-watch's kubernetes source reads. A taint is ``{"key", "effect"[, "value"]}`` as in a Node's
``spec.taints``. The SIGTERM half of the source needs no server: tests send the signal.
"""
from __future__ import annotations

import json
from typing import Optional

from spotfill.testing.http_standin import HttpStandin


class KubeApiStandin(HttpStandin):
    server_version = "kube-apiserver"

    def __init__(self, port: int = 0, node_name: str = "gke-spot-gpu-1"):
        super().__init__(port)
        self.node_name = node_name
        self.taints: list[dict] = []
        self.raw: Optional[str] = None

    def set_taint(self, key: str, effect: str = "NoSchedule", value: Optional[str] = None) -> None:
        with self.changed:
            self.taints.append({"key": key, "effect": effect, **({"value": value} if value is not None else {})})
            self.publish()

    def clear_taints(self) -> None:
        with self.changed:
            self.taints = []
            self.publish()

    def set_raw(self, body: Optional[str]) -> None:
        with self.changed:
            self.raw = body
            self.publish()

    def answer(self, method, path, query, headers, body):
        if method != "GET" or path != f"/api/v1/nodes/{self.node_name}":
            return 404, json.dumps({"kind": "Status", "reason": "NotFound"}), {"Content-Type": "application/json"}
        with self.lock:
            if self.raw is not None:
                return 200, self.raw, {"Content-Type": "application/json"}
            node = {"kind": "Node", "apiVersion": "v1", "metadata": {"name": self.node_name},
                    "spec": {"taints": list(self.taints)}}
        return 200, json.dumps(node), {"Content-Type": "application/json"}
