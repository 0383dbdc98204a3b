"""A run directory's telemetry: report.json's ledger/diagnosis keys, report.html and timeline.png.

`summarize(events, report)` -> the keys report.json gains (gpu_seconds, goodput, harvest_ratio, diagnosis,
recoveries; a recovery_breakdown on each preemption). `enrich_report(report, events)` merges them in.
`write_report(run_dir)` (the CLI and, at the end of a run, TrainingJob / the demo runner) reads
RUN_DIR/events.jsonl (+ report.json when present) and writes RUN_DIR/report.html and RUN_DIR/timeline.png.
"""
from __future__ import annotations

import json
import os

from spotfill.config.errors import ConfigError
from spotfill.telemetry.diagnosis import diagnosis_report
from spotfill.telemetry.events import StepSampler, log_files
from spotfill.telemetry.evidence import (LEASE_END_KINDS, NodeSpan, nodes_from_events, nodes_from_report,
                                         workload_of)
from spotfill.telemetry.ledger import compute_ledger

PHASES = ("detect_s", "decide_s", "workers_start_s", "state_load_s", "setup_s", "first_step_s", "total_s")


def load_events(path: str, compact: bool = True) -> list[dict]:
    """Every event of the log at `path` (its rolled segments first, then events.jsonl), read one line at a
    time; `compact` folds step events as the writer's sampler does (exact totals: a log written without
    sampling is read in bounded memory). A torn last line of a file (a crash mid-write) is skipped; any
    other bad line is a ConfigError naming its file and line."""
    sampler = StepSampler.from_env() if compact else None
    events: list[dict] = []
    for p in log_files(path) or [path]:
        bad = None
        with open(p, encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if bad is not None:
                    raise _bad_line(*bad)
                try:
                    e = json.loads(line)
                    if not isinstance(e, dict) or not isinstance(e.get("kind"), str) or \
                            not isinstance(e.get("t", 0.0), (int, float)):
                        raise ValueError("not an event")
                except ValueError:
                    bad = (p, i, line)
                    continue
                events.extend(sampler.feed(e) if sampler else [e])
        if bad is not None and not events:
            raise _bad_line(*bad)
    return events + (sampler.flush() if sampler else [])


def _bad_line(path: str, i: int, line: str) -> ConfigError:
    return ConfigError(path, reason=f"line {i} is not an event", value=line.strip()[:60],
                       accepted='one JSON object per line with "t" (unix seconds) and "kind"')


def load_run(run_dir: str) -> tuple[list[dict], dict]:
    """(events, report.json or {}) of a run directory; ConfigError for a missing, empty or garbled one."""
    path = os.path.join(run_dir, "events.jsonl")
    if not os.path.isdir(run_dir):
        raise ConfigError("RUN_DIR", run_dir, reason="no such directory",
                          accepted="a run directory with events.jsonl")
    if not os.path.isfile(path):
        raise ConfigError("RUN_DIR", run_dir, reason="has no events.jsonl", accepted="a run directory written "
                          "by `spotfill demo` or jobs/pretrain.py")
    events = load_events(path)
    if not any("t" in e for e in events):
        raise ConfigError(path, reason="holds no timed event", accepted='lines like {"t": 1.0, "kind": "step"}')
    report: dict = {}
    rpath = os.path.join(run_dir, "report.json")
    if os.path.isfile(rpath):
        try:
            with open(rpath) as f:
                report = json.load(f)
        except ValueError:
            raise ConfigError(rpath, reason="is not valid JSON", accepted="report.json as spotfill writes it") from None
        if not isinstance(report, dict):
            raise ConfigError(rpath, reason="is not a JSON object", accepted="report.json as spotfill writes it")
    return events, report


def _nodes(events: list[dict], report: dict) -> list[NodeSpan] | None:
    return nodes_from_events(events) or nodes_from_report(report) or None


def fillin_section(events: list[dict], window: tuple[float, float]) -> dict | None:
    """report.json `fillin.leases` (each lease overlapping the run's window: tenant, workload, node, gpus,
    start, end, how it ended, reclaim_s; with the tenants' own busy measurements: lent_at, first_busy,
    lend_to_busy_s, busy_s), `fillin.handback_seconds` (one per reclaim that a training claim caused: the
    claim -> that lease's GPUs free), `fillin.lend_to_busy_s` per workload (the lend decision -> the GPU's
    first measured compute) and `fillin.handbacks_incomplete` (reclaims whose GPUs were never seen given
    back), from the lease, fillin_busy and handback_incomplete events; None without any lease."""
    start, end = window
    open_: dict[str, dict] = {}
    leases: list[dict] = []

    def row(e: dict) -> dict:
        return {"lease_id": e.get("lease_id"), "tenant": e.get("tenant"), "workload": workload_of(e),
                "node": e.get("node", e.get("node_id")), "gpus": e.get("gpus"), "start": e.get("start", e["t"]),
                "lent_at": e.get("lent_at"), "end": None, "ended_by": None, "reclaim_s": None}

    for e in events:
        if e["kind"] == "lease":
            open_[e.get("lease_id") or (e.get("tenant"), e.get("node"))] = row(e)
        elif e["kind"] in LEASE_END_KINDS:
            le = open_.pop(e.get("lease_id") or (e.get("tenant"), e.get("node")), None)
            if le is not None:
                le.update(end=e.get("end", e["t"]), ended_by=e["kind"], reclaim_s=e.get("reclaim_s"),
                          cause=e.get("cause") or e.get("reason"))
                if e.get("node_lost"):
                    le["node_lost"] = True      # a notice's reclaim whose node went before the hand-back was seen
                leases.append(le)
    leases += open_.values()
    leases = [le for le in leases if le["start"] < end and (le["end"] is None or le["end"] > start)]
    if not leases:
        return None
    leases.sort(key=lambda le: le["start"])
    _add_busy(leases, [e for e in events if e["kind"] == "fillin_busy"])
    handback = [le["reclaim_s"] for le in leases if le["ended_by"] == "reclaim" and le.get("cause") == "training_claim"
                and le["reclaim_s"] is not None]
    incomplete = [{k: e.get(k) for k in ("tenant", "lease_id", "requested_at", "waited_s", "cause", "job")}
                  for e in events if e["kind"] == "handback_incomplete" and start <= e["t"] <= end]
    out = {"leases": leases, "handback_seconds": handback,
           "handback_seconds_max": max(handback) if handback else None, "handbacks_incomplete": incomplete}
    latency = lend_to_busy_summary(leases)
    if latency:
        out["lend_to_busy_s"] = latency
    starts = starts_summary([e for e in events if e["kind"] == "fillin_start" and start <= e["t"] <= end], leases)
    if starts:
        out["starts"] = starts
    return out


def starts_summary(starts: list[dict], leases: list[dict]) -> dict:
    """Per workload, how its lent replicas started (`fillin_start` events, serving/standby.py): warm (on a
    standby holding the model) or cold, the constructor's seconds for each (median, max), the warm ones'
    wake (weights to the device) and the cold ones' load from storage. Each lease gets its `start`."""
    import statistics

    def stats(values: list) -> dict | None:
        values = [float(v) for v in values if v is not None]
        return {"median": round(statistics.median(values), 3), "max": round(max(values), 3)} if values else None

    by_lease = {str(e.get("lease_id")): e for e in starts if e.get("lease_id")}
    for le in leases:
        e = by_lease.get(str(le.get("lease_id")))
        if e is not None:
            le["start_kind"], le["init_s"] = ("warm" if e.get("warm") else "cold"), e.get("init_s")
    out: dict[str, dict] = {}
    for w in sorted({e.get("workload") or "serve" for e in starts}):
        mine = [e for e in starts if (e.get("workload") or "serve") == w]
        warm, cold = [e for e in mine if e.get("warm")], [e for e in mine if not e.get("warm")]
        out[w] = {"warm": len(warm), "cold": len(cold), "init_s_warm": stats([e.get("init_s") for e in warm]),
                  "init_s_cold": stats([e.get("init_s") for e in cold]),
                  "wake_s": stats([e.get("wake_s") for e in warm]), "load_s": stats([e.get("load_s") for e in cold]),
                  "notes": sorted({e["standby_note"] for e in mine if e.get("standby_note")})}
    return out


def _add_busy(leases: list[dict], busy: list[dict]) -> None:
    """Each lease's busy seconds and first measured compute, from the fillin_busy events of its holder."""
    by_id: dict[str, list[dict]] = {}
    for e in busy:
        if e.get("lease_id"):
            by_id.setdefault(str(e["lease_id"]), []).append(e)
    for le in leases:
        mine = [e for e in by_id.get(str(le["lease_id"]), [])
                if e["t1"] >= le["start"] - 1.0 and (le["end"] is None or e["t0"] <= le["end"] + 1.0)]
        le["busy_s"] = round(sum(float(e["busy_s"]) for e in mine), 3) if busy else None
        first = min((float(e["t0"]) for e in mine), default=None)
        le["first_busy"] = None if first is None else round(first, 3)
        since = le["lent_at"] if le.get("lent_at") is not None else le["start"]
        le["lend_to_busy_s"] = None if first is None else round(max(0.0, first - since), 3)


def lend_to_busy_summary(leases: list[dict]) -> dict:
    """Per workload: how long after the lend decision (or the lease's start, for a lease nobody lent) a GPU
    first computed -- median and max over the leases that did, and how many leases never did -- split into
    its two parts: the lend decision -> the tenant holding the GPU (`to_hold_median`: placement, actor or
    worker start) and holding it -> its first measured compute (`hold_to_busy_median`: imports, checkpoint
    load, waiting for work)."""
    import statistics

    def median(values: list[float]):
        return round(statistics.median(values), 3) if values else None

    out: dict[str, dict] = {}
    for w in sorted({le["workload"] for le in leases if le.get("busy_s") is not None}):
        mine = [le for le in leases if le["workload"] == w]
        busy = [le for le in mine if le.get("lend_to_busy_s") is not None]
        lat = [le["lend_to_busy_s"] for le in busy]
        to_hold = [max(0.0, le["start"] - le["lent_at"]) for le in busy if le.get("lent_at") is not None]
        hold_to_busy = [max(0.0, le["first_busy"] - le["start"]) for le in busy]
        out[w] = {"leases": len(mine), "busy_leases": len(lat), "never_busy": len(mine) - len(lat),
                  "median": median(lat), "max": max(lat) if lat else None,
                  "to_hold_median": median(to_hold), "hold_to_busy_median": median(hold_to_busy)}
    return out


def summarize(events: list[dict], report: dict | None = None, nodes: list[NodeSpan] | None = None):
    """(ledger, keys for report.json)."""
    report = report or {}
    events = sorted((e for e in events if "t" in e), key=lambda e: e["t"])
    ledger = compute_ledger(events, nodes or _nodes(events, report))
    preemptions = report.get("preemptions") or []
    faults = [p["at"] for p in preemptions if p.get("at") is not None and p.get("affected", True)]
    keys = ledger.as_report()
    keys.update(diagnosis_report(events, ledger, faults))
    fillin = fillin_section(events, (ledger.start, ledger.end))
    if fillin:
        keys["fillin"] = {**(report.get("fillin") or {}), **fillin}
    return ledger, keys


def enrich_report(report: dict, events: list[dict], nodes: list[NodeSpan] | None = None) -> dict:
    """report.json plus gpu_seconds, goodput, harvest_ratio (with fill-in), diagnosis, recoveries, and a
    recovery_breakdown on each preemption whose restart the events show. Returns the same dict."""
    _, keys = summarize(events, report, nodes)
    report.update(keys)
    by_fault = {round(r["fault_t"], 3): r for r in keys["recoveries"] if r["fault_source"] == "report"}
    for p in report.get("preemptions") or []:
        r = by_fault.get(round(p["at"], 3)) if p.get("at") is not None else None
        if r is not None:
            p["recovery_breakdown"] = {k: r[k] for k in PHASES}
            if r["detail"].get("reads") is not None:   # state_load_s's bytes: per node, from storage / local
                p["recovery_breakdown"]["state_reads"] = r["detail"]["reads"]
    return report


def write_report(run_dir: str, events: list[dict] | None = None, report: dict | None = None,
                 nodes: list[NodeSpan] | None = None) -> dict:
    """Write RUN_DIR/report.html and RUN_DIR/timeline.png; returns {"html", "png", "summary"}."""
    from spotfill.telemetry.html import render_html
    from spotfill.telemetry.timeline import STATE_COLORS, render_timeline, workload_colors

    if events is None:
        events, loaded = load_run(run_dir)
        report = loaded if report is None else report
    report = report or {}
    ledger, keys = summarize(events, report, nodes)
    summary = {**report, **keys}
    events = sorted((e for e in events if "t" in e), key=lambda e: e["t"])
    png = render_timeline(ledger, events, report.get("preemptions"))
    colors = {**STATE_COLORS, **{f"fillin:{w}": c for w, c in
                                 workload_colors(keys["gpu_seconds"]["fillin_by_workload"]).items()}}
    name = next((e.get("name") for e in events if e["kind"] == "job_start" and e.get("name")), None)
    page = render_html(summary, png, colors, f"spotfill run {name or os.path.basename(os.path.abspath(run_dir))}")
    png_path, html_path = os.path.join(run_dir, "timeline.png"), os.path.join(run_dir, "report.html")
    with open(png_path, "wb") as f:
        f.write(png)
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(page)
    return {"html": html_path, "png": png_path, "summary": summary}
