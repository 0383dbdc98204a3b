"""Does an autoscaler add and remove this cluster's nodes? The arbiter asks once, on the head, at its start.

On an autoscaled cluster fill-in behaves differently (fillin/arbiter.py): it lends only on nodes training
uses, gives a node back once training left it (so the autoscaler can remove it idle), and never leaves a
replica pending (demand the autoscaler would buy a node for). Ray 2.60 has no public call that says whether
a cluster autoscales; two sources say it where it does:
  * the autoscaler config `ray up` leaves on the head (~/ray_bootstrap_config.yaml, or the file
    SPOTFILL_AUTOSCALER_CONFIG names; train/preflight.py reads its node types), and
  * the cluster config an autoscaler reports to the GCS (what Ray Data's own autoscaling check reads; KubeRay
    clusters report it).
A node type that may run more nodes than its minimum makes the cluster autoscaled. `decide` is pure.
"""
from __future__ import annotations

import logging

log = logging.getLogger("spotfill.fillin.cluster_kind")


def decide(node_types: list | None, group_configs: list[tuple[int, int]] | None) -> tuple[bool, str]:
    """(autoscaled, why) from the head's autoscaler node types (preflight.NodeType: min_count, max_count) and
    the GCS cluster config's node groups as (min_count, max_count) pairs (max -1: unbounded)."""
    for t in node_types or []:
        if t.max_count > t.min_count:
            return True, (f"the autoscaler config on the head lets node type {t.name} run "
                          f"{t.min_count}..{t.max_count} nodes")
    for lo, hi in group_configs or []:
        if hi == -1 or hi > lo:
            return True, f"the cluster config in the GCS has a node group of {lo}..{'any' if hi == -1 else hi} nodes"
    if node_types is None and not group_configs:
        return False, "no autoscaler config on the head and none reported to the GCS: fixed nodes"
    return False, "every node type the autoscaler knows runs a fixed number of nodes"


def detect() -> tuple[bool, str]:
    """decide() over what this node (the head) and the GCS say."""
    from spotfill import ray_compat
    from spotfill.train.preflight import autoscaler_node_types
    try:
        groups = ray_compat.cluster_config_node_groups()
    except Exception as exc:  # noqa: BLE001 - an unanswered GCS read says nothing either way
        log.warning("fill-in: the GCS cluster config could not be read (%s); deciding from the head's files", exc)
        groups = None
    return decide(autoscaler_node_types(), groups)
