"""Recovery benchmarks, side by side in one run on the same machine and the same kind of local cluster:
spotfill versus stock Ray Train 2.60 (its defaults: no drain-aware sizing, 60 s worker-group start
timeout, 5 s preemption poll) running the same training function.

- recovery:   hard node loss (SIGKILL of a node's raylet, no notice) -> the job steps again.
- preemption: announced loss (Ray drain with a 30 s deadline, the node removed at the deadline) -> the job
              steps again; spotfill's lost steps.
Each run is a scenario on a fresh embedded cluster (GCS failure detection tuned the same way for both).
"""
from __future__ import annotations

import tempfile
from typing import Callable

from benchmarks._common import rnd  # noqa: F401 - also puts platform/ on sys.path

from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario


def _scenario(event: dict, restarts: str, steps: int) -> dict:
    return {
        "cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 2}, {"gpus": 2}]},
        "training": {"model": "tiny", "workers": [1, 4], "steps": steps, "global_batch": 12,
                     "max_micro_batch": 3, "checkpoint_every": 20, "elastic_restarts": restarts},
        "events": [event],
    }


def _one(event: dict, restarts: str, steps: int, say: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"spotfill-bench-{restarts}-") as out:
        report = run_scenario(parse_scenario(_scenario(event, restarts, steps), f"bench-{restarts}"), out,
                              quiet=True)
    p = report["preemptions"][0]
    say(f"{restarts}: {event['action']} -> stepping again after {p['recovery_seconds']}s, "
        f"lost {p['lost_steps']} steps, ok={report['ok']}")
    return {"recovery_s": p["recovery_seconds"], "lost_steps": p["lost_steps"], "ok": report["ok"],
            "samples": report["training"]["samples"]}


def _pair(event: dict, quick: bool, progress) -> tuple[dict, dict]:
    say = progress or (lambda m: None)
    steps = 100 if quick else 200
    return _one(event, "spotfill", steps, say), _one(event, "stock", steps, say)


def bench_recovery(quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    ours, stock = _pair({"at_step": 40, "action": "kill_node", "node": 1}, quick, progress)
    return {"spotfill_s": ours["recovery_s"], "stock_ray_s": stock["recovery_s"],
            "speedup": rnd(stock["recovery_s"] / ours["recovery_s"], 2),
            "lost_steps": ours["lost_steps"], "stock_lost_steps": stock["lost_steps"],
            "invariants_ok": ours["ok"] and stock["ok"]}


def bench_preemption(quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    event = {"at_step": 40, "action": "drain_node", "node": 1, "deadline_s": 30}
    ours, stock = _pair(event, quick, progress)
    return {"lost_steps": ours["lost_steps"], "resume_s": ours["recovery_s"],
            "stock_resume_s": stock["recovery_s"], "stock_lost_steps": stock["lost_steps"],
            "deadline_s": 30, "invariants_ok": ours["ok"] and stock["ok"]}
