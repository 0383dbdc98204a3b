"""`spotfill status [--address ADDR] [--json]`: what runs on a cluster now.

- every running spotfill training job's live numbers (step, loss, tokens/s, MFU/HFU, world size, GPUs by
  state, the step's split, checkpoints, the last events), as its event sink publishes them to Ray's KV store;
- the cluster's nodes: alive or dead, market type (spot / on-demand, from the node's
  `spotfill.io/market-type` or Ray's `ray.io/market-type` label), GPUs;
- where a fill-in arbiter runs, its view: GPUs per node by owner (training / each tenant / reclaiming /
  idle), training jobs, leases, pending reclaims, hand-backs and the last decisions with their reasons.
--json: the arbiter's keys at the top level (as before), plus `live_jobs` and `cluster_nodes`."""
from __future__ import annotations

import argparse
import json
import time

from spotfill.config.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("status", help="arbiter view: GPUs per node and workload, leases, reclaims")
    p.add_argument("--address", metavar="ADDR", help="Ray cluster address (default: auto)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--last", type=int, default=10, help="how many recent decisions to show (default 10)")
    p.set_defaults(func=run)


MARKET_LABELS = ("spotfill.io/market-type", "ray.io/market-type")


def market_of(labels: dict | None) -> str | None:
    """spot / on-demand from a node's labels (spotfill's label first, then Ray's own), else None."""
    for key in MARKET_LABELS:
        v = (labels or {}).get(key)
        if v:
            v = str(v).lower().replace("_", "-")
            return "on-demand" if v in ("on-demand", "ondemand") else v
    return None


def node_rows(nodes: list[dict], gpu_resource: str | None = None) -> list[dict]:
    """ray.nodes() entries as status rows (pure)."""
    rows = []
    for n in nodes:
        res = n.get("Resources") or {}
        labels = n.get("Labels") or {}
        gpus = {k: v for k, v in res.items() if k == (gpu_resource or "GPU") or (gpu_resource is None and
                                                                                 k in ("GPU", "GPU_SLOT"))}
        rows.append({"id": n.get("NodeID"), "alive": bool(n.get("Alive")), "ip": n.get("NodeManagerAddress"),
                     "market": market_of(labels), "role": labels.get("spotfill.io/role"),
                     "gpus": sum(gpus.values()), "cpus": res.get("CPU", 0.0),
                     "head": "node:__internal_head__" in res})
    return sorted(rows, key=lambda r: (not r["alive"], not r["head"], str(r["id"])))


def live_jobs(keys_values: dict[str, bytes | None], alive) -> list[dict]:
    """The published snapshots (KV key -> JSON) whose sink is still alive (`alive(sink_name)`); a stale
    entry (its driver died before it could remove it) is marked, not hidden."""
    import json as _json
    out = []
    for key, raw in sorted(keys_values.items()):
        if not raw:
            continue
        try:
            snap = _json.loads(raw)
        except ValueError:
            continue
        snap["key"] = key
        snap["sink_alive"] = bool(alive(snap.get("sink") or ""))
        out.append(snap)
    return out


def _read_live(gpu_resource: str | None) -> tuple[list[dict], list[dict]]:
    import ray

    from spotfill.ray_compat import kv_get, kv_list, require
    from spotfill.train.sink import LIVE_KEY_PREFIX

    require("gcs_kv")

    def alive(name: str) -> bool:
        try:
            ray.get_actor(name, namespace="spotfill")
            return True
        except ValueError:
            return False

    jobs = live_jobs({k: kv_get(k) for k in kv_list(LIVE_KEY_PREFIX)}, alive)
    return jobs, node_rows(ray.nodes(), gpu_resource)


def _require_listening(where: str, timeout_s: float = 3.0) -> None:
    """A HOST:PORT address where nothing listens is refused in seconds (ray.init would retry for minutes,
    printing GCS connection warnings). Other forms (auto, ray://, http://) are left to ray.init."""
    import socket

    host, _, port = where.rpartition(":")
    if "://" in where or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError("--address", where, reason=f"nothing answers there ({exc.strerror or exc})",
                          accepted="a running cluster's GCS address, e.g. 127.0.0.1:6379") from None


def read_status(address: str | None, last: int) -> dict:
    import ray

    from spotfill.fillin.arbiter import get_arbiter
    where = address or "auto"
    _require_listening(where)
    try:
        if where.split(":")[0] in ("127.0.0.1", "localhost"):
            # a loopback-bound cluster (`spotfill serve`, the demo): keep Ray from rewriting the address
            from spotfill.ray_compat import single_host_loopback
            single_host_loopback(True)
        ray.init(address=where, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError("--address", where, reason=f"no Ray cluster reachable there ({exc})".splitlines()[0],
                          accepted="a running cluster's address, e.g. 127.0.0.1:6379") from None
    try:
        arbiter = get_arbiter()
        st = ray.get(arbiter.status.remote(last), timeout=30) if arbiter is not None else {}
        st["arbiter"] = arbiter is not None
        st["live_jobs"], st["cluster_nodes"] = _read_live(st.get("gpu_resource"))
        return st
    finally:
        ray.shutdown()


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def render(st: dict, now: float | None = None) -> str:
    """The whole status as text (pure): live jobs, nodes, then the arbiter's view where one runs."""
    parts = []
    if "live_jobs" in st or "cluster_nodes" in st:
        parts.append(render_live(st.get("live_jobs") or [], st.get("cluster_nodes") or [], now))
    if st.get("arbiter", "gpu_resource" in st) and "gpu_resource" in st:
        parts.append(render_arbiter(st))
    elif "live_jobs" in st:
        parts.append("fill-in arbiter: none on this cluster (no GPUs are lent)")
    return "\n".join(parts)


def render_live(jobs: list[dict], nodes: list[dict], now: float | None = None) -> str:
    from spotfill.telemetry.progress import Progress

    now = time.time() if now is None else now
    lines = [f"training jobs ({len(jobs)}):" + ("" if jobs else " none running")]
    capacity = sum(n["gpus"] for n in nodes if n["alive"]) if nodes else None
    for snap in jobs:
        p = Progress.from_snapshot(snap)
        body = p.summary_lines(capacity=None, now=now)
        if not snap.get("sink_alive", True):
            body[0] += " [STALE: its event sink is gone; the job's driver died]"
        lines += ["  " + ln for ln in body]
        for t, line in (snap.get("last_events") or [])[-5:]:
            lines.append(f"    {_clock(t)} {line}")
    alive = [n for n in nodes if n["alive"]]
    markets: dict[str, float] = {}
    for n in alive:
        markets[n["market"] or "unknown"] = markets.get(n["market"] or "unknown", 0) + n["gpus"]
    lines.append(f"nodes ({len(alive)} alive, {len(nodes) - len(alive)} dead; GPUs {capacity or 0:g}: "
                 + ", ".join(f"{m} {g:g}" for m, g in sorted(markets.items())) + "):")
    for n in nodes:
        lines.append(f"  {str(n['id'])[:12]:<14}{'alive' if n['alive'] else 'dead':<7}"
                     f"{(n['market'] or 'market ?'):<11}{n['gpus']:>5g} GPU {n['cpus']:>5g} CPU"
                     f"{'  head' if n['head'] else ''}"
                     f"{'  ' + n['role'] if n.get('role') and n['role'] != 'head' else ''}")
    return "\n".join(lines)


def render_arbiter(st: dict) -> str:
    """The arbiter's view as text (pure: a dict in, lines out)."""
    lines = [f"fill-in arbiter (GPU resource {st['gpu_resource']}, reclaim order {' > '.join(st['order'])}, "
             f"up since {_clock(st['since'])}{', restored after a restart' if st.get('restored') else ''})"]
    owners = ["training"] + sorted({k for row in st["nodes"].values() for k in row}
                                   - {"total", "idle", "training", "reclaiming"}) + ["reclaiming", "idle"]
    lines.append("GPUs per node:  " + "".join(f"{o:>11}" for o in ["total"] + owners))
    for node_id, row in st["nodes"].items():
        lines.append(f"  {node_id[:12]:<14}" + "".join(f"{row.get(o, 0):>11}" for o in ["total"] + owners))
    for job in st["jobs"]:
        lines.append(f"training job {job['job']}: workers {job['min_workers']}..{job['max_workers']}, "
                     f"{job['current_workers']} running, {job['gpus_per_worker']} GPU(s) each"
                     + (f", {job['pending_gpus']} claimed GPU(s) held for it" if job.get("pending_gpus") else ""))
    lines.append(f"leases ({len(st['leases'])}):" + ("" if st["leases"] else " none"))
    for le in st["leases"]:
        lines.append(f"  {le['tenant']} on {le['node_id'][:12]}: {le['gpus']} GPU since {_clock(le['granted_at'])}"
                     f" (reclaim {le['reclaim_method']}, grace {le['grace_s']:g}s)")
    lines.append(f"pending reclaims ({len(st['pending_reclaims'])}):" + ("" if st["pending_reclaims"] else " none"))
    for r in st["pending_reclaims"]:
        lines.append(f"  {r['tenant']} on {r['node_id'][:12]}: {r['gpus']} GPU, since {_clock(r['since'])}, "
                     f"grace ends {_clock(r['deadline'])}")
    if st.get("handbacks"):
        lines.append("hand-backs (training's claim -> GPUs free): " + ", ".join(
            f"{h['job']} {h['seconds']:.2f}s ({h['leases']} lease(s))" for h in st["handbacks"]))
    lines.append("last decisions:" + ("" if st["decisions"] else " none"))
    for d in st["decisions"]:
        where = f" on {d['node_id'][:12]}" if d.get("node_id") else ""
        lines.append(f"  {_clock(d['at'])} {d['action']:<7} {d['tenant']} {d['gpus']} GPU{where} -- {d['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.last < 0:
        raise ConfigError("--last", args.last, accepted="an integer >= 0")
    st = read_status(args.address, args.last)
    print(json.dumps(st, indent=2) if args.json else render(st))
    return 0
