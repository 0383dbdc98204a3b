"""The `preempt_nodes` scenario action's keys (pure): several nodes preempted in one pass of the timeline.

    {at_step: 40, min_world: 8, action: preempt_nodes, nodes: [0, 2, 3, 5, 6], notice: false}
    {at_step: 40, action: preempt_nodes, count: 5, notice: true, deadline_s: 30}

Exactly one of `nodes` (distinct node indices) or `count` (the N alive nodes where training's current
worker group has the most workers, ties to the lower index). `notice` (default true): each node gets a spot
notice -- a Ray drain with `deadline_s` (default 20) -- and is removed at its deadline, as drain_node does;
false: every node is killed at once, as kill_node does (no deadline). `allow_all` (default false): without
it, an action that would leave no GPU node is refused up front (static clusters) and skipped when it fires.
"""
from __future__ import annotations

from typing import Any

from spotfill.config.errors import ConfigError

MASS_ACTION = "preempt_nodes"
MASS_KEYS = {"nodes", "count", "notice", "deadline_s", "allow_all"}


def parse_mass(path: str, raw: dict) -> dict[str, Any]:
    """The action's own keys of event `raw` (at `path`) as Event fields; one-line ConfigError otherwise."""
    if ("nodes" in raw) == ("count" in raw):
        raise ConfigError(path, {k: raw[k] for k in ("nodes", "count") if k in raw} or None,
                          reason=f"{MASS_ACTION} needs exactly one of `nodes` or `count`",
                          accepted="nodes: [i, j, ...] (node indices) or count: N (N >= 1)")
    out: dict[str, Any] = {}
    if "nodes" in raw:
        nodes = raw["nodes"]
        if not isinstance(nodes, list) or not nodes or len(set(map(repr, nodes))) != len(nodes) or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in nodes):
            raise ConfigError(f"{path}.nodes", nodes,
                              accepted="a non-empty list of distinct node indices (integers >= 0)")
        out["nodes"] = tuple(nodes)
    else:
        count = raw["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{path}.count", count, accepted="an integer >= 1")
        out["count"] = count
    for key in ("notice", "allow_all"):
        if key in raw:
            if not isinstance(raw[key], bool):
                raise ConfigError(f"{path}.{key}", raw[key], accepted="true or false")
            out[key] = raw[key]
    if "deadline_s" in raw and not out.get("notice", True):
        raise ConfigError(f"{path}.deadline_s", raw["deadline_s"], reason="applies only with notice: true "
                          "(a loss without notice has no deadline)", accepted="leave deadline_s out, or notice: true")
    return out


def check_mass_refs(events: list, known: int, autoscaled: bool) -> None:
    """Up front, for each preempt_nodes event: every index of `nodes` can exist (`known`: listed plus added
    nodes), and -- on a static cluster, unless `allow_all` -- at least one node is left."""
    for e in events:
        if e.action != MASS_ACTION:
            continue
        field = f"events[{e.index}].{'nodes' if e.nodes is not None else 'count'}"
        if e.nodes is not None and not autoscaled:
            beyond = [n for n in e.nodes if n >= known]
            if beyond:
                raise ConfigError(field, list(e.nodes), reason=f"node(s) {beyond} can never exist",
                                  accepted=f"indices 0..{known - 1} (cluster.nodes plus added nodes)")
        taken = len(e.nodes) if e.nodes is not None else e.count
        if not autoscaled and not e.allow_all and taken >= known:
            raise ConfigError(field, list(e.nodes) if e.nodes is not None else e.count,
                              reason=f"would preempt all {known} nodes: at least one GPU node must remain",
                              accepted=f"fewer than {known} nodes, or allow_all: true")
