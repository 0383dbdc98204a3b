"""jobs/sweep.py's body: connect to Ray, take the grant (the arbiter's, or a fixed one), run the Tune sweep
(fillin/sweep.py), and write RUN_DIR/report.json (`fillin.sweep`) and RUN_DIR/events.jsonl.

report.json here:
    {"ok": every trial completed, "invariants": {...},
     "fillin": {"sweep": {trials, started, completed, failed, paused, resumed, recovered, best,
                          resumed_from: {memory, storage}, restore_s: {memory: [...], storage: [...]},
                          state_keeper: {...}, handback_seconds, results: [...]},
                "handback_seconds": [...]}}       # this sweep's reclaims: training's claim -> GPU free
`handback_seconds` come from the arbiter's journal (`reclaim` events of tenant `sweep:<name>`), measured by
the arbiter as for Serve; empty with `fillin.grant: fixed`.
"""
from __future__ import annotations

import json
import logging
import os
import time

from spotfill.config.errors import ConfigError, JobFailed

log = logging.getLogger("spotfill.fillin.sweep_job")


def check_inputs(cfg) -> dict:
    """Fail fast (exit 2) on a dataset that is not there; returns its manifest."""
    from spotfill.storage.base import open_storage
    from spotfill.train.data import read_manifest

    manifest = read_manifest(open_storage(cfg.data.path))
    if manifest["num_samples"] <= cfg.sweep.eval_rows:
        raise ConfigError("sweep.eval_rows", cfg.sweep.eval_rows,
                          reason=f"the dataset has only {manifest['num_samples']} rows",
                          accepted=f"fewer than {manifest['num_samples']}")
    return manifest


def make_grant(cfg, runtime_env: dict | None = None):
    from spotfill.fillin.grant import ArbiterGrant, FixedGrant

    f = cfg.fillin
    if f.grant == "fixed":
        return FixedGrant(f.max_units, grace_s=f.grace_s)
    # a trial asks for {CPU: cpus_per_trial, GPU: 1}: the arbiter lends its GPU only where the CPUs are free too
    return ArbiterGrant("sweep", cfg.name, max_units=f.max_units, gpus_per_unit=1, grace_s=f.grace_s,
                        gpu_resource=cfg.cluster.gpu_resource, runtime_env=runtime_env,
                        cpus_per_unit=cfg.cluster.cpus_per_trial,
                        demand=0)     # Tune's searcher states it (SweepControl.plan) once it can start trials


def sweep_handbacks(tenant: str, since: float) -> list[float]:
    """reclaim_s of this tenant's reclaims in the arbiter's journal (training's claim -> GPU free)."""
    import ray

    from spotfill.fillin.arbiter import get_arbiter
    arbiter = get_arbiter()
    if arbiter is None:
        return []
    try:
        events = ray.get(arbiter.journal_since.remote(0), timeout=30)["events"]
    except Exception as exc:  # noqa: BLE001 - the report says what it could not read
        log.warning("could not read the arbiter's journal: %s", exc)
        return []
    return [e["reclaim_s"] for e in events if e.get("kind") == "reclaim" and e.get("tenant") == tenant
            and e.get("reclaim_s") is not None and float(e.get("end") or e.get("t") or since) >= since]


def run_sweep_job(cfg, *, runtime_env: dict | None = None, step_sleep_s: float = 0.0, grant=None) -> dict:
    from spotfill.fillin.sweep import run_sweep
    from spotfill.fillin.wiring import connect_ray
    from spotfill.telemetry.events import EventLog

    from spotfill.fillin.sweep_standby import job_runtime_env, start_keeper
    check_inputs(cfg)
    # the job's processes get the standby setup hook; its keeper prestarts warm trial processes per GPU node
    connect_ray(job_runtime_env(runtime_env, cfg.fillin.standby_per_node))
    keeper = start_keeper(cfg.cluster.gpu_resource, cfg.fillin.standby_per_node)
    os.makedirs(cfg.run_dir, exist_ok=True)
    events = EventLog(os.path.join(cfg.run_dir, "events.jsonl"))
    t0 = time.time()
    grant = grant or make_grant(cfg, runtime_env)
    events.write("sweep_start", name=cfg.name, trials=len(cfg.sweep.grid()), grant=cfg.fillin.grant,
                 max_units=cfg.fillin.max_units, grace_s=cfg.fillin.grace_s)
    try:
        section = run_sweep(cfg, grant, emit=lambda kind, **f: events.write(kind, **f), step_sleep_s=step_sleep_s)
    finally:
        events.close()
        from spotfill.fillin.standby import stop_keeper
        stop_keeper(keeper)
    section["handback_seconds"] = (sweep_handbacks(f"sweep:{cfg.name}", t0) if cfg.fillin.grant == "arbiter"
                                   else [])
    results = section.get("results", [])
    invariants = {
        "every_trial_completed": {"ok": section["completed"] == section["trials"] and section["failed"] == 0,
                                  "detail": f"{section['completed']} of {section['trials']} completed, "
                                            f"{section['failed']} failed"},
        "steps_applied_once": {"ok": all(r.get("history_ok") for r in results) and len(results) == section["trials"],
                               "detail": "each trial's final checkpoint history is steps 1..N, each once"},
    }
    report = {"ok": all(v["ok"] for v in invariants.values()), "invariants": invariants,
              "fillin": {"sweep": section, "handback_seconds": section["handback_seconds"]}}
    tmp = os.path.join(cfg.run_dir, "report.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, os.path.join(cfg.run_dir, "report.json"))
    if not report["ok"]:
        bad = [k for k, v in invariants.items() if not v["ok"]]
        raise JobFailed(f"sweep {cfg.name}: {', '.join(bad)} did not hold (see {cfg.run_dir}/report.json)")
    return report
