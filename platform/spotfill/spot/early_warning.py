"""Early warnings (AWS rebalance recommendation, GCP live migration, Azure Freeze/Reboot/Redeploy): no drain,
but training does not grow onto the warned node.

The spot watcher writes one record per node in the GCS key-value store (namespace ``spotfill``, key
``spotfill:early-warning:<node id hex>``, JSON ``{"node", "source", "event", "message", "t", "until"}``); a
withdrawn warning is written again with ``until`` = now. Training's grow check
(train.elastic.GrowCheck.extra_workers) drops warned nodes from its candidates with :func:`without_warned`.
The pure part (:func:`record`, :func:`warned_nodes`) has no Ray.
"""
from __future__ import annotations

import json
import logging
from typing import Mapping, Optional, TypeVar

logger = logging.getLogger(__name__)

PREFIX = "spotfill:early-warning:"
TTL_S = 3600.0       # a warning not renewed or withdrawn stops counting after an hour
V = TypeVar("V")


def record(node_id: str, *, source: str, event: str, message: str, now: float, ttl_s: float = TTL_S,
           withdrawn: bool = False) -> tuple[str, str]:
    """(key, value) of the record for ``node_id``; ``withdrawn`` ends it now."""
    value = {"node": node_id, "source": source, "event": event, "message": message, "t": now,
             "until": now if withdrawn else now + ttl_s}
    return PREFIX + node_id, json.dumps(value, sort_keys=True)


def warned_nodes(records: Mapping[str, Optional[bytes | str]], now: float) -> set[str]:
    """Node ids whose record stands at ``now``; unreadable records are skipped (logged)."""
    out = set()
    for key, raw in records.items():
        if raw is None:
            continue
        try:
            rec = json.loads(raw)
            if float(rec["until"]) > now:
                out.add(str(rec.get("node") or key[len(PREFIX):]))
        except (TypeError, ValueError, KeyError) as exc:
            logger.warning("early-warning record %s unreadable (%s): ignored", key, exc)
    return out


def without_warned(nodes: dict[str, V], now: Optional[float] = None) -> dict[str, V]:
    """``nodes`` (keyed by node id hex) less the nodes with a standing early warning. Inside a Ray job; a
    store that cannot be read drops nothing (logged)."""
    import time

    from spotfill.ray_compat import kv_get, kv_list

    try:
        warned = warned_nodes({k: kv_get(k) for k in kv_list(PREFIX)}, time.time() if now is None else now)
    except Exception as exc:  # noqa: BLE001 - an early warning never stops training
        logger.warning("cannot read early warnings (%s: %s): growing as if none", type(exc).__name__, exc)
        return nodes
    dropped = sorted(n[:12] for n in nodes if n in warned)
    if dropped:
        logger.info("not growing onto node(s) with an early warning: %s", ", ".join(dropped))
    return {n: v for n, v in nodes.items() if n not in warned}
