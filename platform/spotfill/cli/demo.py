"""`spotfill demo`: run a scenario on the embedded local cluster and check its invariants."""
from __future__ import annotations

import os

from spotfill.config.errors import JobFailed
from spotfill.config.tenant_kinds import KINDS


def register(sub) -> None:
    p = sub.add_parser("demo", help="run a scenario (preemption, node return, hard loss) on an embedded local Ray cluster")
    p.add_argument("--scenario", metavar="FILE", help="scenario YAML (default: the built-in scenario)")
    p.add_argument("--out", metavar="DIR", default="runs/demo", help="run directory (default: %(default)s)")
    p.add_argument("--storage", metavar="URI", help="checkpoint storage: local path or s3://bucket/prefix "
                                                     "(default: RUN_DIR/storage)")
    p.add_argument("--quick", action="store_true", help="shorter run (fewer steps)")
    p.add_argument("--static", action="store_true", help="the built-in scenario on fixed nodes added by the "
                                                          "scenario, without Ray's autoscaler")
    p.set_defaults(func=run)


def summarize(report: dict) -> str:
    tr = report["training"]
    lines = [f"training: {tr['steps_completed']}/{tr['steps_target']} steps, final loss "
             f"{tr['final_loss']:.3f}" if tr.get("final_loss") is not None else "training: no step finished",
             f"world size over time: {[n for _, n in tr['world_size_timeline']]}",
             f"samples: {tr['samples']['consumed']} consumed, {tr['samples']['duplicates']} duplicates, "
             f"{tr['samples']['missing']} missing"]
    for p in report.get("preemptions", []):
        rec = f"{p['recovery_seconds']:.1f}s" if p.get("recovery_seconds") is not None else "n/a"
        picked = {"most_training": ", the node training used most", "most_lent": ", the node fill-in used most"
                  }.get(p.get("picked") or "", "")
        if not p.get("affected", True):
            lines.append(f"{p['kind']} ({p['action']} node {p['node']}{picked}): training did not restart after it "
                         f"({p.get('steps_after', 0)} step(s) ran after it, then training finished)")
            continue
        lines.append(f"{p['kind']} ({p['action']} node {p['node']}{picked}): lost {p['lost_steps']} steps, stepping "
                     f"again after {rec}, emergency checkpoint: {p['emergency_checkpoint']}")
    for e in report.get("events", []):
        if e["action"] == "add_node" and e.get("fired"):
            lines.append(f"capacity returned: grew to {e.get('world_size_after')} workers "
                         f"after {e.get('seconds_to_grow')}s, lost {e.get('lost_steps', 0)} steps")
    lines += restart_lines(report)
    fill = report.get("fillin") or {}
    if fill.get("serve"):
        sv = fill["serve"]
        by = sv.get("answered_by") or {}
        lines.append(f"serve fill-in: {sv['requests_ok']} ok" + (f" ({by.get('lent', 0)} by lent replicas, "
                     f"{by.get('floor', 0)} by the floor)" if by.get("floor") else "") +
                     f", {sv['requests_rejected_503']} rejected at once (503), "
                     f"{sv['requests_failed']} failed; p50 {sv['p50_ms']} ms, p99 {sv['p99_ms']} ms")
    lines += wake_sleep_lines(fill)
    if fill.get("batch"):
        b = fill["batch"]
        left = (b.get("left_for_rerun") or {}).get("rows")
        lines.append(f"batch fill-in: {b.get('rows_written', 0)} of {b.get('rows_target', '?')} rows written, "
                     f"{b.get('duplicates', '?')} duplicates, " + (f"{left} left for its rerun (stopped "
                     "at training's end)" if left else f"{b.get('missing', '?')} missing") + "; stopped "
                     f"{len(b.get('stops') or [])} time(s) when its GPUs were taken back" + (", resumed" if b.get("resumed") else "")
                     + (f"; eval loss {b['eval']['loss']:.3f}" if (b.get("eval") or {}).get("loss") else ""))
    if fill.get("sweep"):
        w = fill["sweep"]
        best = w.get("best") or {}
        left = w.get("left_for_rerun")
        lines.append(f"sweep fill-in: {w.get('completed', 0)} of {w.get('trials', '?')} trials completed"
                     + (f" ({w.get('trials', 0) - w.get('completed', 0)} left for its rerun, experiment "
                        f"{'restorable' if left.get('restorable') else 'NOT restorable'})" if left else "") +
                     f", {w.get('paused', 0)} paused and {w.get('resumed', 0)} resumed from their checkpoints"
                     + (f"; best {best['config']} ({best.get('metric_name')} {best['metric']:.3f})"
                        if best.get("config") and best.get("metric") is not None else ""))
    if fill.get("leases") is not None:
        lines.append(f"fill-in leases: {len(fill['leases'])}, given back: {reclaims_by_workload(fill['leases'])}; "
                     f"GPU-seconds lent {report.get('gpu_seconds', {}).get('fillin', 0):.1f}, harvest ratio "
                     f"{report.get('harvest_ratio', 'n/a (tenants did not measure busy time)')}, held "
                     f"{report.get('harvest_ratio_reserved', 'n/a')} of the spare GPU-seconds")
    if fill.get("reclaimed_and_resumed"):
        lines.append("fill-in given back and carried on: " + "; ".join(
            f"{t} {'yes' if r['ok'] else 'no'} ({r['detail']})" for t, r in fill["reclaimed_and_resumed"].items()))
    nodes = (report.get("cluster") or {}).get("nodes") or []
    t0 = min((n["started"] for n in nodes if n.get("started")), default=0)
    for n in nodes:
        if n["launched_by"] == "autoscaler":
            end = f"gone at +{n['ended'] - t0:.0f}s ({n['death_reason']})" if n.get("ended") else "alive at the end"
            lines.append(f"node {n['id'][-6:]} ({n['type']}, {n['market']}) launched by the autoscaler at "
                         f"+{n['started'] - t0:.0f}s, {end}")
    ck = report["checkpoints"]
    lines.append(f"checkpoints: {ck['committed']} committed, stall max {ck['stall_seconds_max']:.3f}s")
    for name, inv in report.get("invariants", {}).items():
        lines.append(f"{'PASS' if inv['ok'] else 'FAIL'} {name}: {inv['detail']}")
    lines.append(f"{'OK' if report['ok'] else 'FAILED'} in {report.get('seconds', 0):.0f}s")
    return "\n".join(lines)


def wake_sleep_lines(fill: dict) -> list[str]:
    """Per fill-in workload: how its lent actors woke (warm on a standby or cold: the constructor's seconds,
    wake or load) and slept (reclaim -> the lent GPU free again: the hand-back's median and worst)."""
    import statistics

    def med(d):
        return f"{d['median']:g}s" if d else "-"
    lines = []
    for workload in KINDS:
        st = (fill.get("starts") or {}).get(workload)
        back = sorted(le["reclaim_s"] for le in fill.get("leases") or [] if le.get("workload") == workload
                      and le.get("ended_by") == "reclaim" and le.get("reclaim_s") is not None)
        if not st and not back:
            continue
        wake = (f"{st['warm']} warm on a standby (constructor {med(st['init_s_warm'])}, wake {med(st['wake_s'])}), "
                f"{st['cold']} cold (constructor {med(st['init_s_cold'])}, load {med(st['load_s'])})"
                + (f" [{st['notes'][0]}]" if st.get("notes") else "")) if st else "no start recorded"
        sleep = (f"{len(back)} given back, median {statistics.median(back):.2f}s, worst {back[-1]:.2f}s" if back
                 else "none taken back")
        lines.append(f"{workload} wake: {wake}; sleep: {sleep}")
    return lines


def restart_lines(report: dict) -> list[str]:
    """One line per worker-group restart: cause, fault -> next step seconds, warm or cold per node (and how
    long a grow waited for warm spares), then goodput and the recovery share of the GPU-seconds."""
    lines = []
    for r in report.get("recoveries") or []:
        warm = r.get("warm")
        how = ("warm" if all(warm.values()) else "cold" if not any(warm.values()) else
               "warm on " + ", ".join(n[-6:] for n, w in warm.items() if w) + "; cold on " +
               ", ".join(n[-6:] for n, w in warm.items() if not w)) if warm else "warm/cold not recorded"
        took = f"{r['total_s']:.1f}s" if r.get("total_s") is not None else "n/a"
        wait = f", waited {r['ready_wait_s']:.1f}s for warm spares" if r.get("ready_wait_s") is not None else ""
        lines.append(f"restart (attempt {r['attempt']}, {r['cause']}): stepping again after {took}, {how}{wait}")
    gs = report.get("gpu_seconds") or {}
    if gs.get("total"):
        lines.append(f"goodput {report.get('goodput', 'n/a')}; recovery held {gs.get('recovering', 0):.0f} of "
                     f"{gs['total']:.0f} GPU-seconds ({gs.get('recovering', 0) / gs['total']:.0%})")
    return lines


def reclaims_by_workload(leases: list[dict]) -> str:
    """'serve 2 (to training 1.08s, 0.41s; node_draining 1), batch 1 (...)' -- every lease taken back, by
    workload and cause, with the hand-back seconds of those a training claim took; 'none' without any."""
    parts = []
    for workload in KINDS:                        # the registry's order (config/tenant_kinds.py)
        taken = [le for le in leases if le.get("workload") == workload and le.get("ended_by") == "reclaim"]
        if not taken:
            continue
        to_training = [le["reclaim_s"] for le in taken if le.get("cause") == "training_claim"
                       and le.get("reclaim_s") is not None]
        causes: dict[str, int] = {}
        for le in taken:
            if le.get("cause") != "training_claim":
                causes[le.get("cause") or "?"] = causes.get(le.get("cause") or "?", 0) + 1
        detail = ([f"to training {', '.join(f'{h:.2f}s' for h in to_training)}"] if to_training else []) + \
            [f"{cause} {n}" for cause, n in sorted(causes.items())]
        parts.append(f"{workload} {len(taken)} ({'; '.join(detail)})")
    return ", ".join(parts) or "none"


def run(args) -> int:
    from spotfill.sim.scenario import AUTOSCALING_SCENARIO, DEFAULT_SCENARIO, load_scenario, parse_scenario

    builtin = DEFAULT_SCENARIO if args.static else AUTOSCALING_SCENARIO
    scenario = load_scenario(args.scenario) if args.scenario else parse_scenario(builtin, "demo")
    if args.quick:
        t = scenario.training
        # on an autoscaling cluster the replacement node must launch and training regrow before the end, and
        # the batch job and the sweep (lent GPUs only while training runs there) finish
        t.steps = max(t.checkpoint_every, min(t.steps, 300 if scenario.cluster.autoscaler else 90))
        if scenario.fillin.require_resumes:
            scenario.fillin.require_resumes = False
            print("--quick: too few steps for every fill-in tenant to be taken back and carry on; the invariant "
                  "fillin_reclaimed_and_resumed is not checked (report.json still says what each one did)")
    from spotfill.sim.runner import run_scenario
    report = run_scenario(scenario, args.out, storage=args.storage)
    print(summarize(report))
    print(f"report: {os.path.join(os.path.abspath(args.out), 'report.json')}")
    if not report["ok"]:
        raise JobFailed("an invariant did not hold (see report.json)")
    return 0
