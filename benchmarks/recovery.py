"""Recovery benchmarks, side by side in one run on the same machine and the same kind of local cluster,
running the same training function:

- spotfill:    spotfill's restarts (drain-aware free-capacity sizing, its Ray Train knobs);
- stock:       stock Ray Train 2.60 with its defaults (no drain-aware sizing, 60 s worker-group start
               timeout, 2 s health-check poll, 5 s preemption poll);
- stock-tuned: stock Ray Train with the same Ray timeouts spotfill sets (train.job.ray_train_env), so the
               part of the gain that is spotfill's own is visible.

- recovery:   hard node loss (SIGKILL of a node's raylet, no notice) -> the job steps again.
- preemption: announced loss (Ray drain with a 30 s deadline, the node removed at the deadline) -> the job
              steps again; spotfill's lost steps.
Each run is a scenario on a fresh embedded cluster (GCS failure detection tuned the same way for all).
Each side also reports where the seconds went (recovery_breakdown), from its events.jsonl.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable

from benchmarks._common import rnd  # noqa: F401 - also puts platform/ on sys.path

from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario
from spotfill.telemetry.events import read_events

SIDES = ("spotfill", "stock", "stock-tuned")
# Ray Train controller states that mean "this attempt is over, a new one comes" (detect).
_DETECT_STATES = ("RESTARTING", "RESCHEDULING", "PREEMPTING", "RESIZING")


# The "with fill-in" row: the same training and node loss on nodes of 3 GPUs, the 2 that training's 4
# workers leave lent to a Ray Serve app under load (the restart takes back what it needs from it).
FILLIN = {"serve": {"enabled": True, "load_rps": 2, "max_replicas": 2}}


def _scenario(event: dict, restarts: str, steps: int, fillin: bool = False) -> dict:
    gpus = 3 if fillin else 2
    return {
        "cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": gpus}, {"gpus": gpus}]},
        "training": {"model": "tiny", "workers": [1, 4], "steps": steps, "global_batch": 12,
                     "max_micro_batch": 3, "checkpoint_every": 20, "elastic_restarts": restarts},
        **({"fillin": FILLIN} if fillin else {}),
        "events": [event],
    }


def recovery_breakdown(events: list[dict], fired_at: float) -> dict:
    """Where the seconds from a node event to stepping again went (pure, from events.jsonl):
    detect (the controller saw the attempt end), decide (it chose the next size), workers_start (worker
    processes up, torch.distributed joined, the loop entered), state_load (restore, model and engine built,
    checkpoint loaded), first_step. Without controller events (older runs) detect+decide+workers_start is
    one number."""
    nxt = next((e for e in events if e["kind"] == "attempt" and e["t"] >= fired_at), None)
    if nxt is None:
        return {}
    a = nxt["attempt"]
    ready = next((e for e in events if e["kind"] in ("resume", "start") and e.get("attempt") == a), None)
    first = next((e for e in events if e["kind"] == "step" and e.get("attempt") == a), None)
    states = [e for e in events if e["kind"] == "controller_state" and fired_at <= e["t"] <= nxt["t"]]
    detect = next((e for e in states if e["state"] in _DETECT_STATES), None)
    decide = next((e for e in states if e["state"] == "SCHEDULING" and detect and e["t"] >= detect["t"]), None)
    out: dict = {}
    if detect and decide:
        out.update(detect_s=rnd(detect["t"] - fired_at, 2), decide_s=rnd(decide["t"] - detect["t"], 2),
                   workers_start_s=rnd(nxt["t"] - decide["t"], 2))
    else:
        out["detect_decide_workers_start_s"] = rnd(nxt["t"] - fired_at, 2)
    if ready:
        out["state_load_s"] = rnd(ready["t"] - nxt["t"], 2)
        for key in ("restore_prep_s", "load_s"):
            if key in ready:
                out[f"state_load.{key}"] = ready[key]
        out.update(_worker_marks(ready, decide["t"] if detect and decide else None, nxt["t"]))
    if ready and first:
        out["first_step_s"] = rnd(first["t"] - ready["t"], 2)
    failed_schedules = [e for e in states if e["state"] == "RESCHEDULING"]
    if failed_schedules:
        out["failed_schedules"] = len(failed_schedules)
    return out


def _worker_marks(ready: dict, decided: float | None, attempt_t: float) -> dict:
    """Rank 0's own moments (resume/start event, newer runs) split workers start and state load further:
    workers_start.process_s (decision to rank 0's process created: placement group, process spawn),
    .init_s (process created to the training function entered: imports, Ray Train's worker set-up,
    torch.distributed); a process created before the decision (a spare) is marked .prestarted, with
    .process_s 0 and .init_s from the decision, .loop_s (function entered to the attempt recorded); state_load.restore_s
    (attempt to restore done), .imports_s (waiting for the warm imports after it), .engine_s (model and
    deepspeed.initialize), .checkpoint_s (the rest: engine.load_checkpoint and the event)."""
    out: dict = {}
    proc, entered = ready.get("process_started_t"), ready.get("loop_entered_t")
    if proc is not None and decided is not None and entered is not None:
        if proc < decided:      # a spare process started before the decision (train.worker_loop's spares)
            out["workers_start.prestarted"] = True
            out["workers_start.process_s"] = 0.0
            out["workers_start.init_s"] = rnd(entered - decided, 2)
        else:
            out["workers_start.process_s"] = rnd(proc - decided, 2)
            out["workers_start.init_s"] = rnd(entered - proc, 2)
    if entered is not None:
        out["workers_start.loop_s"] = rnd(attempt_t - entered, 2)
    marks = [ready.get(k) for k in ("restored_t", "imported_t", "engine_t")]
    if all(m is not None for m in marks):
        restored, imported, engine = marks
        out.update({"state_load.restore_s": rnd(restored - attempt_t, 2),
                    "state_load.imports_s": rnd(imported - restored, 2),
                    "state_load.engine_s": rnd(engine - imported, 2),
                    "state_load.checkpoint_s": rnd(ready["t"] - engine, 2)})
    return out


def _one(event: dict, restarts: str, steps: int, say: Callable[[str], None], fillin: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"spotfill-bench-{restarts}-") as out:
        report = run_scenario(parse_scenario(_scenario(event, restarts, steps, fillin), f"bench-{restarts}"), out,
                              quiet=True)
        events = [e for e in read_events(os.path.join(out, "events.jsonl")) if e["kind"] != "samples"]
    p = report["preemptions"][0]
    breakdown = recovery_breakdown(events, p["at"])
    say(f"{restarts}{' with fill-in' if fillin else ''}: {event['action']} -> stepping again after "
        f"{p['recovery_seconds']}s, lost {p['lost_steps']} steps, ok={report['ok']}; {breakdown}")
    warm = [r.get("warm") for r in report.get("recoveries") or [] if r.get("fault_t", 0) >= p["at"] - 1e-3]
    return {"recovery_s": p["recovery_seconds"], "lost_steps": p["lost_steps"], "ok": report["ok"],
            "samples": report["training"]["samples"], "breakdown": breakdown,
            "warm": warm[0] if warm else None, "world_size_after": p.get("world_size_after")}


def _sides(event: dict, quick: bool, progress) -> dict[str, dict]:
    say = progress or (lambda m: None)
    steps = 100 if quick else 200
    return {side: _one(event, side, steps, say) for side in SIDES}


def _ratio(a: float | None, b: float | None) -> float | None:
    return rnd(a / b, 2) if a and b else None


def bench_recovery(quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    runs = _sides({"at_step": 40, "action": "kill_node", "node": 1}, quick, progress)
    ours, stock, tuned = runs["spotfill"], runs["stock"], runs["stock-tuned"]
    return {"spotfill_s": ours["recovery_s"], "stock_ray_s": stock["recovery_s"],
            "speedup": _ratio(stock["recovery_s"], ours["recovery_s"]),
            "stock_tuned_s": tuned["recovery_s"], "speedup_vs_tuned": _ratio(tuned["recovery_s"], ours["recovery_s"]),
            "lost_steps": ours["lost_steps"], "stock_lost_steps": stock["lost_steps"],
            "stock_tuned_lost_steps": tuned["lost_steps"],
            "recovery_breakdown": {side: r["breakdown"] for side, r in runs.items()},
            "warm": ours["warm"],
            # the same hard loss with Serve fill-in on the GPUs training does not use (spotfill side only)
            "with_fillin": with_fillin({"at_step": 40, "action": "kill_node", "node": 1}, quick, progress),
            "invariants_ok": all(r["ok"] for r in runs.values())}


def with_fillin(event: dict, quick: bool, progress) -> dict:
    r = _one(event, "spotfill", 100 if quick else 200, progress or (lambda m: None), fillin=True)
    return {"spotfill_s": r["recovery_s"], "lost_steps": r["lost_steps"], "world_size_after": r["world_size_after"],
            "warm": r["warm"], "breakdown": r["breakdown"], "ok": r["ok"]}


def bench_preemption(quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    event = {"at_step": 40, "action": "drain_node", "node": 1, "deadline_s": 30}
    runs = _sides(event, quick, progress)
    ours, stock, tuned = runs["spotfill"], runs["stock"], runs["stock-tuned"]
    return {"lost_steps": ours["lost_steps"], "resume_s": ours["recovery_s"],
            "stock_resume_s": stock["recovery_s"], "stock_lost_steps": stock["lost_steps"],
            "stock_tuned_resume_s": tuned["recovery_s"], "stock_tuned_lost_steps": tuned["lost_steps"],
            "recovery_breakdown": {side: r["breakdown"] for side, r in runs.items()},
            "deadline_s": 30, "invariants_ok": all(r["ok"] for r in runs.values())}
