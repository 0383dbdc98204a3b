"""report.json `cluster`: every node that took part in a run, with who launched it and how it ended (pure).

Inputs, all plain data:
- `records`: nodes the cluster itself started -- the head and the scenario's nodes ({id, type, market,
  launched_by: static | scenario, started, ended?}); ended is set when the scenario removed the node.
- `provider_log`: the fake cloud's log (spotfill.testing.fake_market): `launched` (launched_by autoscaler,
  started = launch time), `terminated` (ended), `refused` / `unfulfilled` (launches that never gave a node,
  listed under `launch_failures`: how the spot market said no).
- `seen`: Ray's node table at the end ({id, alive, death_reason (NodeDeathInfo name or None), death_message,
  dead_at: when the runner first saw it dead, if it did}).

A node still alive at the end has `ended: null` and `death_reason: null`. A node Ray saw die gets Ray's
reason (e.g. AUTOSCALER_DRAIN_PREEMPTED for a drained spot node that left, AUTOSCALER_DRAIN_IDLE for an idle
scale-down, UNEXPECTED_TERMINATION for a hard loss) with Ray's message.
"""
from __future__ import annotations


def cluster_section(records: list[dict], provider_log: list[dict], seen: list[dict], now: float,
                    gpus_by_type: dict[str, int] | None = None) -> dict:
    """`gpus`: GPU slots of each node (records carry theirs; launched nodes take their type's), which lets
    the GPU-seconds ledger count idle capacity per node (telemetry.ledger.nodes_from_report)."""
    nodes: dict[str, dict] = {}
    for r in records:
        nodes[r["id"]] = {"id": r["id"], "type": r.get("type"), "market": r.get("market"), "gpus": r.get("gpus"),
                          "launched_by": r["launched_by"], "started": r.get("started"), "ended": r.get("ended")}
    failures = []
    for e in provider_log:
        if e["event"] == "launched":
            nodes.setdefault(e["node_id"], {"id": e["node_id"], "type": e.get("node_type"),
                                            "market": e.get("market"),
                                            "gpus": (gpus_by_type or {}).get(e.get("node_type")),
                                            "launched_by": "autoscaler",
                                            "started": e["t"], "ended": None})
        elif e["event"] == "terminated" and e.get("node_id") in nodes:
            if nodes[e["node_id"]].get("ended") is None:
                nodes[e["node_id"]]["ended"] = e["t"]
        elif e["event"] in ("refused", "unfulfilled"):
            failures.append({"type": e.get("node_type"), "market": e.get("market"), "how": e["event"], "t": e["t"]})
    by_id = {s["id"]: s for s in seen}
    out = []
    for node in nodes.values():
        s = by_id.get(node["id"])
        reason = None
        if s is not None and not s.get("alive"):
            reason = s.get("death_reason") or "dead (no reason recorded)"
            if s.get("death_message"):
                reason = f"{reason}: {s['death_message']}"
            dead_at = s.get("dead_at")
            if dead_at is not None and (node.get("ended") is None or dead_at < node["ended"]):
                node["ended"] = dead_at
            elif node.get("ended") is None:
                node["ended"] = round(now, 3)      # dead before the end; the exact time was not observed
        elif s is None and node.get("ended") is not None:
            reason = "terminated before Ray registered it"
        node["death_reason"] = reason
        out.append(node)
    out.sort(key=lambda n: (n.get("started") or 0, n["id"]))
    section = {"nodes": out}
    if failures:
        section["launch_failures"] = failures
    return section


def autoscaler_invariants(report: dict) -> dict:
    """What an autoscaling scenario promises, from the report's own sections (pure):

    - replaced_and_grown_back: after every announced preemption, the autoscaler launched a node and
      training ran again on at least as many workers as before the notice, after that node started;
    - idle_nodes_scaled_down: after training, launched nodes beyond the types' min_workers went away;
    - nothing_left_behind: no placement group, no actor on a launched node and no standing resource
      request once training was over."""
    nodes = (report.get("cluster") or {}).get("nodes") or []
    launched = sorted(n["started"] for n in nodes if n.get("launched_by") == "autoscaler")
    timeline = (report.get("training") or {}).get("world_size_timeline") or []
    inv: dict[str, dict] = {}
    announced = [p for p in report.get("preemptions", []) if p["kind"] == "announced" and p.get("affected")]
    if announced:
        details, ok = [], True
        for p in announced:
            before = p.get("world_size_before") or ([n for t, n in timeline if t <= p["at"]] or [0])[-1]
            new = [t for t in launched if t >= p["at"]]
            # the timeline records changes only: a restart straight back at the old size (the replacement
            # was up before the group restarted) shows as the preemption's own first step after the notice
            sizes = sorted([(t, n) for t, n in timeline] + ([(p["at"] + p["recovery_seconds"], p["world_size_after"])]
                           if p.get("recovery_seconds") is not None and p.get("world_size_after") else []))
            back = next((t for t, n in sizes if new and t >= new[0] and n >= before), None)
            ok = ok and back is not None
            details.append(f"notice at {p['at']:.0f}: {len(new)} launched after it, back to {before} workers "
                           + (f"{back - p['at']:.1f}s after the notice" if back is not None else "never"))
        inv["replaced_and_grown_back"] = {"ok": ok, "detail": "; ".join(details)}
    down = (report.get("autoscaler") or {}).get("scale_down")
    if down is not None:
        inv["idle_nodes_scaled_down"] = {
            "ok": down["nodes_left"] <= down["min_workers"],
            "detail": f"{down['nodes_left']} launched nodes left {down['seconds']}s after training "
                      f"(min_workers {down['min_workers']})"}
        left = {k: down.get(k) for k in ("placement_groups", "actors_on_launched_nodes", "request_after")}
        inv["nothing_left_behind"] = {"ok": not any(left.values()), "detail": json_short(left)}
    return inv


def json_short(value) -> str:
    import json
    return json.dumps(value, sort_keys=True)[:300]
