"""What the events say about GPUs besides training's hold (pure): the run's window, the node timeline,
fill-in leases and the busy time tenants measured, observations of free GPUs, pipeline bubbles.

Event shapes (docs/metrics.md, "Events the telemetry reads"):
  node_up {node, gpus, market?} / node_down {node}        a GPU node's life (the arbiter journals both)
  gpu_free {node, free}                                    the arbiter saw `free` of the node's GPUs held by
                                                           nobody (Ray's available resources); journalled at
                                                           every change, so it holds until the node's next
                                                           gpu_free or node_down
  lease {lease_id, tenant, workload, node, gpus, start} .. reclaim / release / lease_end {lease_id, end}
  fillin_busy {tenant, workload?, node?, lease_id?, gpus, busy_s, t0, t1}
                                                           a tenant measured that its `gpus` GPUs computed
                                                           `busy_s` seconds (each) between t0 and t1
  step {..., bubble_s}                                     pipeline bubbles of the step: GPU-seconds with
                                                           no compute scheduled, already summed over the
                                                           group's ranks (train/pipeline.py); a span
                                                           carries their sum over its steps
  attempt {attempt, world_size, gpus?}                     a worker group began: `gpus` is what Ray assigned
                                                           its workers (claims.py reads it)
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from spotfill.telemetry.events import step_totals

LEASE_END_KINDS = ("reclaim", "release", "lease_end")


@dataclass(frozen=True)
class NodeSpan:
    """A node's life: `gpus` GPUs alive from `start` to `end` (None: still alive at the window's end)."""
    node: str
    gpus: int
    start: float
    end: float | None = None
    market: str | None = None


@dataclass(frozen=True)
class Lease:
    start: float
    end: float
    node: str | None
    gpus: int
    workload: str


def run_window(events: list[dict]) -> tuple[float, float]:
    """job_start .. job_end when logged, else the first and last event."""
    ts = [e["t"] for e in events if "t" in e]
    if not ts:
        raise ValueError("no timed events")
    start = next((e["t"] for e in events if e["kind"] == "job_start"), min(ts))
    end = next((e["t"] for e in reversed(events) if e["kind"] == "job_end"), max(ts))
    return start, end


def nodes_from_events(events: list[dict]) -> list[NodeSpan]:
    """NodeSpans from `node_up` {node, gpus, market?} and `node_down` {node} events ([] if none)."""
    up: dict[str, dict] = {}
    spans: list[NodeSpan] = []
    for e in events:
        if e["kind"] == "node_up":
            up[str(e["node"])] = e
        elif e["kind"] == "node_down" and str(e["node"]) in up:
            u = up.pop(str(e["node"]))
            spans.append(NodeSpan(str(u["node"]), int(u["gpus"]), u["t"], e["t"], u.get("market")))
    spans += [NodeSpan(n, int(u["gpus"]), u["t"], None, u.get("market")) for n, u in up.items()]
    return spans


def nodes_from_report(report: dict) -> list[NodeSpan]:
    """NodeSpans from report.json's cluster.nodes when they carry `gpus` ([] otherwise)."""
    nodes = (report.get("cluster") or {}).get("nodes") or []
    return [NodeSpan(str(n["id"]), int(n["gpus"]), n["started"], n.get("ended"), n.get("market"))
            for n in nodes if n.get("gpus") is not None and n.get("started") is not None]


def workload_of(lease_event: dict) -> str:
    """The fill-in workload: `workload`, else the tenant's prefix ("serve:app" -> "serve"), else the tenant."""
    w = lease_event.get("workload") or str(lease_event.get("tenant") or "fillin").split(":")[0]
    return str(w)


def node_of(e: dict) -> str | None:
    n = e.get("node", e.get("node_id"))
    return None if n is None else str(n)


def leases(events: list[dict], end: float) -> list[Lease]:
    """Fill-in leases: `lease` {lease_id?, tenant, workload?, node, gpus, start?, end?} closed by a
    `reclaim` / `release` / `lease_end` event with the same lease_id (or tenant and node), at its `end`
    field or its time; an open lease lasts to the window's end (node deaths cut it in the ledger)."""
    open_: dict[tuple, dict] = {}
    out: list[Lease] = []

    def key(e: dict) -> tuple:
        return (e["lease_id"],) if e.get("lease_id") else (e.get("tenant"), str(node_of(e)))

    def close(e: dict, t_end: float) -> None:
        out.append(Lease(e.get("start", e["t"]), t_end, node_of(e), int(e["gpus"]), workload_of(e)))

    for e in events:
        if e["kind"] == "lease":
            if e.get("end") is not None:
                close(e, e["end"])
            else:
                open_[key(e)] = e
        elif e["kind"] in LEASE_END_KINDS and key(e) in open_:
            close(open_.pop(key(e)), e.get("end", e["t"]))
    for e in open_.values():
        close(e, end)
    return out


class FreeObservations:
    """`gpu_free` observations per node: `at(node, t)` is the free GPUs last observed on the node at or
    before t (None: none yet, or the node went down since)."""

    def __init__(self, events: list[dict]):
        self.by_node: dict[str, tuple[list[float], list[int | None]]] = {}
        for e in events:
            if e["kind"] == "gpu_free":
                ts, vs = self.by_node.setdefault(str(e["node"]), ([], []))
                ts.append(e["t"])
                vs.append(max(0, int(e["free"])))
            elif e["kind"] == "node_down" and str(e.get("node")) in self.by_node:
                ts, vs = self.by_node[str(e["node"])]
                ts.append(e["t"])
                vs.append(None)

    def __bool__(self) -> bool:
        return bool(self.by_node)

    def times(self) -> list[float]:
        return [t for ts, _ in self.by_node.values() for t in ts]

    def at(self, node: str, t: float) -> int | None:
        ts, vs = self.by_node.get(node, ((), ()))
        i = bisect.bisect_right(ts, t) - 1
        return vs[i] if i >= 0 else None


def busy_gpu_seconds(events: list[dict], start: float, end: float) -> tuple[dict[str, float], list[str]]:
    """Fill-in busy GPU-seconds per workload from `fillin_busy` measurements inside the window ({} when no
    tenant measured any), and notes. A measurement that straddles the window counts in proportion; one
    claiming more than its interval is capped at the interval."""
    out: dict[str, float] = {}
    notes: list[str] = []
    capped = 0
    for e in events:
        if e["kind"] != "fillin_busy":
            continue
        t0, t1 = float(e.get("t0", e["t"])), float(e.get("t1", e["t"]))
        length = t1 - t0
        busy = float(e.get("busy_s") or 0.0)
        if length <= 0:
            continue
        if busy > length:
            busy, capped = length, capped + 1
        inside = max(0.0, min(t1, end) - max(t0, start)) / length
        w = workload_of(e)
        out[w] = out.get(w, 0.0) + busy * inside * int(e.get("gpus") or 1)
    if capped:
        notes.append(f"{capped} fillin_busy measurement(s) claimed more busy time than their interval: capped")
    return out, notes


def bubble_gpu_seconds(events: list[dict]) -> float | None:
    """Pipeline bubbles: Σ over step events of their `bubble_s` -- GPU-seconds already summed over the
    group's ranks, so never multiplied by a GPU count again (None: no step measured its bubbles)."""
    total, seen = 0.0, False
    for e in events:
        if e["kind"] == "step":
            b = step_totals(e, "bubble_s", None)
            if b is not None:
                seen = True
                total += b
    return total if seen else None


def configured_job_gpus(events: list[dict], gpus_per_worker: int) -> int | None:
    """The GPUs the job's configuration asked for: training.workers' maximum (job_start `workers`) x
    gpus_per_worker -- the plan, read only where the events do not record what Ray assigned (older logs)."""
    js = next((e for e in events if e["kind"] == "job_start"), {})
    w = js.get("workers")
    if isinstance(w, (list, tuple)) and w:
        return int(max(w)) * gpus_per_worker
    if isinstance(w, (int, float)) and w > 0:
        return int(w) * gpus_per_worker
    return None
