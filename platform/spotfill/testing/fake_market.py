"""Ray's fake multi-node node provider with a spot market in front of it (tests and the demo; not product logic).

The autoscaler's monitor process loads this class (autoscaler config `provider: {type: external, module:
spotfill.testing.fake_market.MarketFakeProvider}`). Each launch is what Ray's FakeMultiNodeProvider does: a
real raylet on this machine whose node id is the "cloud instance id". In front of it:

- a market file (JSON, `provider.market_file`), read at every launch: `{"unavailable": {"<node type>":
  "refuse" | "unfulfilled"}}`. `refuse` raises at launch, as EC2 answers InsufficientInstanceCapacity;
  `unfulfilled` accepts the request and never starts Ray on it, as a spot request that stays open. The
  test or scenario edits the file while the cluster runs ("spot capacity is gone").
- a log (JSON lines, `provider.log_file`) of every launch, refusal and termination with its time, node type
  and market: what report.json's `cluster.nodes` reads to say a node was launched by the autoscaler.
"""
from __future__ import annotations

import json
import logging
import os
import time

from ray.autoscaler.tags import (NODE_KIND_WORKER, STATUS_UP_TO_DATE, TAG_RAY_NODE_KIND, TAG_RAY_NODE_NAME,
                                  TAG_RAY_NODE_STATUS, TAG_RAY_USER_NODE_TYPE as TAG_NODE_TYPE)

from spotfill.ray_compat import FakeMultiNodeProvider

log = logging.getLogger(__name__)


class CapacityUnavailable(RuntimeError):
    """The fake cloud has no capacity of this node type (EC2: InsufficientInstanceCapacity)."""


def read_market(path: str | None) -> dict[str, str]:
    """Node type -> how it is unavailable ("refuse" | "unfulfilled"); {} when all can be had."""
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return dict(json.load(f).get("unavailable") or {})
    except (OSError, ValueError, AttributeError):
        return {}


def write_market(path: str, unavailable: dict[str, str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"unavailable": unavailable}, f)
    os.replace(tmp, path)


class MarketFakeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config, cluster_name):
        super().__init__(provider_config, cluster_name)
        self._market_file = provider_config.get("market_file")
        self._log_file = provider_config.get("log_file")

    def _record(self, event: str, node_id: str | None, node_type: str, labels: dict | None = None, **extra):
        if not self._log_file:
            return
        entry = {"t": round(time.time(), 3), "event": event, "node_id": node_id, "node_type": node_type,
                 "market": (labels or {}).get("spotfill.io/market-type"), **extra}
        with open(self._log_file, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _create_node_with_resources_and_labels(self, node_config, tags, count, resources, labels):
        node_type = tags[TAG_NODE_TYPE]
        how = read_market(self._market_file).get(node_type)
        if how == "refuse":
            self._record("refused", None, node_type, labels)
            raise CapacityUnavailable(f"no capacity for node type {node_type} (fake market)")
        if how == "unfulfilled":
            with self.lock:
                node_id = self._next_hex_node_id()
                self._nodes[node_id] = {"tags": {**tags, TAG_RAY_NODE_KIND: NODE_KIND_WORKER, TAG_RAY_NODE_NAME: node_id,
                                                 TAG_RAY_NODE_STATUS: STATUS_UP_TO_DATE}, "labels": dict(labels)}
            self._record("unfulfilled", node_id, node_type, labels)
            return
        super()._create_node_with_resources_and_labels(node_config, tags, count, resources, labels)
        with self.lock:
            node_id = max(self._nodes)          # ids increase: the one just made
            self._nodes[node_id]["labels"] = dict(labels)
        self._record("launched", node_id, node_type, labels)

    def terminate_node(self, node_id):
        with self.lock:
            entry = self._nodes.get(node_id) or {}
            node_type = entry.get("tags", {}).get(TAG_NODE_TYPE, "")
            labels = entry.get("labels")
            if entry and "node" not in entry:     # an unfulfilled request: nothing runs
                self._nodes.pop(node_id)
                self._record("terminated", node_id, node_type, labels)
                return
        super().terminate_node(node_id)
        self._record("terminated", node_id, node_type, labels)
