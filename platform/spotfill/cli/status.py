"""`spotfill status [--address ADDR] [--json]`: the fill-in arbiter's view of the cluster -- GPUs per node by
owner (training / each tenant / reclaiming / idle), training jobs, leases, pending reclaims, hand-backs and
the last decisions with their reasons."""
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


def read_status(address: str | None, last: int) -> dict:
    import ray

    from spotfill.fillin.arbiter import get_arbiter
    where = address or "auto"
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
        if arbiter is None:
            raise ConfigError("--address", where, reason="no spotfill fill-in arbiter runs on this cluster",
                              accepted="a cluster where `spotfill serve` or fill-in started one")
        return ray.get(arbiter.status.remote(last), timeout=30)
    finally:
        ray.shutdown()


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def render(st: dict) -> str:
    """The status as text (pure: a dict in, lines out)."""
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
