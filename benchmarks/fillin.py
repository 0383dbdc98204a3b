"""Fill-in benchmark, side by side in one run on the same machine and the same kind of local cluster:
the same elastic training scenario with Serve fill-in on the GPUs training leaves spare (under a steady
HTTP load), and without fill-in.

Scenario: 3 nodes x 1 GPU slot, training workers [1, 2]: one slot is spare and lent to Serve. A hard node
loss (a node training runs on) at step `kill_at`: training restarts at full size (2) on the slot it takes
back from Serve -- the hand-back measured (training's claim -> the lent GPU free).

- handback_s_max: the worst hand-back of the run (report.json fillin.handback_seconds);
- harvest_ratio: fill-in GPU-seconds / GPU-seconds training left unused (the GPU-seconds ledger, from the
  arbiter's lease events in the run's events.jsonl);
- training_slowdown: 1 - (tokens/s with fill-in) / (tokens/s without), training's own tokens/s
  (report.json training.tokens_per_s, compute time of the kept steps). On this machine Serve's replicas
  and training share the same CPU cores (the GPU slots are logical), so the slowdown measured here is
  CPU contention an accelerator node would not have.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable

from benchmarks._common import rnd  # noqa: F401 - also puts platform/ on sys.path

from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario


def _scenario(serve: bool, steps: int, kill_at: int, load_rps: float) -> dict:
    return {
        "cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 1}, {"gpus": 1}, {"gpus": 1}]},
        "training": {"model": "tiny", "workers": [1, 2], "steps": steps, "global_batch": 12,
                     "max_micro_batch": 3, "checkpoint_every": 20},
        "fillin": {"serve": {"enabled": serve, "load_rps": load_rps, "max_replicas": 1}},
        "events": [{"at_step": kill_at, "action": "kill_node", "node": 0}],
    }


def _run(serve: bool, quick: bool, say) -> dict:
    steps, kill_at = (80, 40) if quick else (200, 100)
    name = "fillin-serve" if serve else "fillin-off"
    out = tempfile.mkdtemp(prefix=f"spotfill-bench-{name}-")
    say(f"{name}: {steps} steps, node 0 killed at step {kill_at}")
    report = run_scenario(parse_scenario(_scenario(serve, steps, kill_at, 2.0), name), out, quiet=True)
    tr = report["training"]
    fill = report.get("fillin") or {}
    return {"ok": report["ok"], "tokens_per_s": tr.get("tokens_per_s"), "steps": tr.get("steps_completed"),
            "world_size_timeline": [n for _, n in tr.get("world_size_timeline", [])],
            "gpu_seconds": report.get("gpu_seconds"), "harvest_ratio": report.get("harvest_ratio"),
            "handback_seconds": fill.get("handback_seconds") or [], "leases": len(fill.get("leases") or []),
            "serve": fill.get("serve"), "seconds": report.get("seconds"), "run_dir": out,
            "invariants": {k: v["ok"] for k, v in (report.get("invariants") or {}).items()}}


def bench_fillin(quick: bool, progress: Callable[[str], None] | None = None) -> dict:
    say = progress or (lambda msg: None)
    with_fill = _run(True, quick, say)
    say(f"with fill-in: hand-backs {with_fill['handback_seconds']}, harvest {with_fill['harvest_ratio']}, "
        f"{with_fill['tokens_per_s']} tokens/s")
    without = _run(False, quick, say)
    say(f"without fill-in: {without['tokens_per_s']} tokens/s")
    a, b = with_fill["tokens_per_s"], without["tokens_per_s"]
    hb = with_fill["handback_seconds"]
    return {"handback_s_max": max(hb) if hb else None, "handback_seconds": hb,
            "harvest_ratio": with_fill["harvest_ratio"],
            "training_tokens_s_with_fillin": a, "training_tokens_s_without": b,
            "training_tokens_ratio": round(a / b, 4) if a and b else None,
            "training_slowdown": round(1 - a / b, 4) if a and b else None,
            "serve": with_fill["serve"], "leases": with_fill["leases"],
            "gpu_seconds_fillin": (with_fill["gpu_seconds"] or {}).get("fillin"),
            "world_size_timeline": {"with_fillin": with_fill["world_size_timeline"],
                                    "without": without["world_size_timeline"]},
            "invariants_ok": with_fill["ok"] and without["ok"],
            "runs": {"with_fillin": with_fill, "without": without},
            "notes": ["GPU slots are logical here: Serve's replicas and training share this machine's CPU "
                      "cores, so training_slowdown includes CPU contention a GPU node would not have"]}


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(bench_fillin("--quick" in sys.argv, progress=print), indent=2))
