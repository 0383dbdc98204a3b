"""Fill-in benchmark, side by side in one run on the same machine and the same kind of local cluster:
the same elastic training scenario with Serve fill-in on the GPUs training leaves spare (under a steady
HTTP load), and without fill-in.

Scenario: nodes of 2, 1 and 1 GPU slots, training workers [1, 2]: training starts on node 0 (the only node
that holds its whole group), Serve gets the two 1-slot nodes. A hard loss of node 0 at step `kill_at`:
training restarts at full size (2) on the slots it takes back from Serve -- the hand-backs measured
(training's claim -> each lent GPU free). Without fill-in the same restart finds the two slots idle.

- handback_s_max: the worst hand-back of any fill-in workload (Serve: report.json fillin.handback_seconds
  of the first run; batch and sweep: see handback_by_workload);
- harvest_ratio: fill-in GPU-seconds / GPU-seconds training left unused (the GPU-seconds ledger, from the
  arbiter's lease events in the run's events.jsonl);
- training_slowdown: 1 - (tokens/s with fill-in) / (tokens/s without), training's own tokens/s
  (report.json training.tokens_per_s, compute time of the kept steps). On this machine Serve's replicas
  and training share the same CPU cores (the GPU slots are logical), so the slowdown measured here is
  CPU contention an accelerator node would not have. Fill-in runs at the lowest CPU priority (the product
  defaults `fillin.cpu_nice: 19`, `fillin.cpu_idle: true`: every thread of Serve's replica processes at
  nice 19 in SCHED_IDLE). The HTTP load
  generator is the bench's client, not fill-in: it runs as threads of this process (the training driver)
  and stands in for clients that would be on other machines, so the scenario runner starts it at nice 19
  too (its threads only; the training driver's own threads keep their priority). Serve's controller and
  HTTP proxy keep their priority.
- training_steady_step_ratio: median step time without fill-in / with it, over the steps from
  STEADY_AFTER past the kill to the end (training_steady_step_ms): the cost of fill-in to a training
  group at full size, apart from start-up and recovery, whose CPU use differs between the runs and whose
  share of the run swung training_tokens_ratio from 0.63 to 1.29 across runs on the 2-core machine.
- training_tokens_ratio_no_load: the same with Serve fill-in deployed and lent GPUs but no request sent
  (load_rps 0, a third run): what Serve's processes and the arbiter cost training, apart from the load.
- handback_by_workload: the same hand-backs per fill-in workload, from a fourth run where a Ray Data batch
  job (jobs/batch_infer.py) and a Ray Tune sweep (jobs/sweep.py) hold the two spare GPUs instead of Serve
  (the kill fires once both hold a lent GPU): each must give its GPU back when training restarts, the
  batch job by stopping its Data job within its grace, the sweep by pausing its trial with a checkpoint;
  both then finish on what training leaves (their exactly-once invariants are checked in that run).
- training_ratio: training tokens/s with Serve fill-in over without (training_tokens_ratio), target >= 0.98.
- lend_to_busy_s: per fill-in workload (Serve from the first run, batch and sweep from the fourth), how long
  from the lend decision to the lent GPU's first measured compute (report.json fillin.lend_to_busy_s): the
  median and worst, and the median of its two parts -- lend -> the tenant holding the GPU (to_hold_median)
  and holding it -> computing (hold_to_busy_median: imports, checkpoint load, the first request).
- serve_warm_vs_cold: the first run's Serve replicas started on warm standbys (serving/standby.py, the
  default `standby_per_node: 1`); a fifth run is the same scenario with `standby_per_node: 0` (every lent
  replica starts cold). Side by side: how each start went (report.json fillin.starts: warm/cold counts, the
  constructor's seconds, wake and load), lend -> first compute, and the harvest.
- cpu_layout: where the runs' processes ran. On a cluster the head (Serve's controller and proxy, the arbiter,
  the training driver) and each GPU node are machines of their own. Where this machine has enough cores (one
  for the head, one per GPU slot: 5), every run gives the head and each node cores of their own
  ("apart", sim.cpu_layout.plan_layout); with 2-4 cores ("training_apart") the training worker runs alone on
  the first core (moved there when it starts) and everything else -- head, arbiter, Serve, tenants, the
  driver and the load generator -- on the others, so fill-in's cost is measured where a cluster has it, not
  as contention for training's core; "shared" (cpu_layout="shared"): all on every core, where each fill-in
  Ray process's idle CPU comes out of training's (0.876 on 2 cores, almost all control plane).
- cpu_seconds: CPU seconds per process class over each run (psutil, sampled every second: Serve's
  controller, proxy and replicas, the arbiter, training workers, Ray's own processes, the bench driver
  with the HTTP load generator) -- where the machine's two cores went.
"""
from __future__ import annotations

import os
import statistics
import tempfile
from typing import Callable

from benchmarks._common import rnd  # noqa: F401 - also puts platform/ on sys.path

from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario


NODE_SLOTS = [2, 1, 1]     # GPU slots of the scenario's nodes


def _scenario(serve: bool, steps: int, kill_at: int, load_rps: float, jobs: bool = False, standby: int = 1) -> dict:
    fillin: dict = {"serve": {"enabled": serve, "load_rps": load_rps, "max_replicas": 2, "standby_per_node": standby}}
    if jobs:    # one lent GPU each, and big enough to be running when training claims them back after node
        # 0's loss, about 10 s after the kill here (a 200-step trial took 17 s and had finished by then;
        # 4096 rows of evaluation + 72 prompts took 9 s: the whole prepared data is evaluated instead)
        fillin.update(batch={"enabled": True, "rows": JOBS_ROWS, "prompts": JOBS_PROMPTS, "max_units": 1,
                             "standby_per_node": standby},
                      sweep={"enabled": True, "trials": 1, "steps": JOBS_TRIAL_STEPS, "max_units": 1,
                             "standby_per_node": standby})
    return {
        "cluster": {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": n} for n in NODE_SLOTS]},
        "training": {"model": "tiny", "workers": [1, 2], "steps": steps, "global_batch": 12,
                     "max_micro_batch": 3, "checkpoint_every": 20},
        "fillin": fillin,
        "events": [{"at_step": kill_at, "action": "kill_node", "node": 0}],
    }


JOBS_ROWS, JOBS_PROMPTS, JOBS_TRIAL_STEPS = 9216, 256, 1000
STEADY_AFTER = 200      # steady_step_ms: steps this far past the kill


def _process_class(p, me: int) -> str | None:
    import re
    try:
        cmd = " ".join(p.cmdline())
    except Exception:  # noqa: BLE001 - it exited
        return None
    m = re.match(r"ray::([A-Za-z_]+)", cmd)
    if m:
        if m.group(1).startswith("ServeReplica"):
            return "serve_replica:" + ("Generator" if "Generator" in cmd else "Ingress")
        return m.group(1)
    if "default_worker.py" in cmd:
        return "worker (starting)"             # renamed ray::<Class> once it runs an actor or a task
    if os.path.basename(cmd.split(" ", 1)[0]) in ("gcs_server", "raylet"):
        return os.path.basename(cmd.split(" ", 1)[0])
    for key in ("log_monitor.py", "monitor.py", "dashboard", "runtime_env"):   # Python processes by script
        if key in cmd:
            return key
    return "bench driver (training driver, HTTP load)" if p.pid == me else "other"


class CpuSampler:
    """CPU seconds per process class of this process and everything it started, sampled every second."""

    def __init__(self):
        import threading
        self.cpu: dict[int, float] = {}
        self.cls: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-cpu-sampler")

    def _run(self) -> None:
        import psutil
        me = psutil.Process()
        while not self._stop.wait(1.0):
            for p in [me] + me.children(recursive=True):
                try:
                    c = _process_class(p, me.pid)    # again each time: a worker is renamed when it starts
                    if c is None:
                        continue
                    t = p.cpu_times()
                    self.cls[p.pid], self.cpu[p.pid] = c, t.user + t.system
                except Exception:  # noqa: BLE001 - it exited between the listing and the read
                    pass

    def __enter__(self) -> "CpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        out: dict[str, float] = {}
        for pid, sec in self.cpu.items():
            out[self.cls[pid]] = out.get(self.cls[pid], 0.0) + sec
        return {k: round(v, 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def steady_step_ms(run_dir: str, after_step: int) -> float | None:
    """Median step time (ms, the step events' own step_s) of the steps after `after_step`: training at
    full size long after the restart, apart from start-up and recovery (whose CPU use differs between
    the runs: Serve's replicas start, the restart's imports)."""

    from spotfill.telemetry.events import read_events
    steps = [e["step_s"] for e in read_events(os.path.join(run_dir, "events.jsonl"), {"step"})
             if e["step"] > after_step and e.get("step_s")]
    return round(1000 * statistics.median(steps), 3) if steps else None


def _kill_step(run_dir: str, at: float) -> int | None:
    """The step training had reached when the kill fired."""
    from spotfill.telemetry.events import read_events
    steps = [e["step"] for e in read_events(os.path.join(run_dir, "events.jsonl"), {"step"}) if e["t"] <= at]
    return max(steps) if steps else None


def _run(serve: bool, quick: bool, say, kill_at: int | None = None, load_rps: float = 2.0,
         jobs: bool = False, cpu_layout: dict | None = None, standby: int = 1) -> dict:
    # with fill-in the runner's timeline waits until Serve answers (and the batch and sweep jobs hold their
    # GPUs): the kill fires then (or at kill_at, if later); the side without fill-in kills at the step the
    # first side's kill met
    steps, default_kill = (1000, 40) if quick else (2000, 600)
    kill_at = kill_at or default_kill
    name = ("fillin-jobs" if jobs else "fillin-serve" if serve else "fillin-off") + ("" if standby else "-cold")
    out = tempfile.mkdtemp(prefix=f"spotfill-bench-{name}-")
    say(f"{name}: {steps} steps, node 0 killed at step {kill_at}" + (f", load {load_rps:g} rps" if serve else "")
        + (", batch + sweep fill-in" if jobs else ""))
    with CpuSampler() as cpu:
        report = run_scenario(parse_scenario(_scenario(serve, steps, kill_at, load_rps, jobs, standby), name), out,
                              quiet=True, wait_for_fillin=serve or jobs, cpu_layout=cpu_layout)
    tr = report["training"]
    fill = report.get("fillin") or {}
    return {"ok": report["ok"], "tokens_per_s": tr.get("tokens_per_s"), "steps": tr.get("steps_completed"),
            "world_size_timeline": [n for _, n in tr.get("world_size_timeline", [])],
            "gpu_seconds": report.get("gpu_seconds"), "harvest_ratio": report.get("harvest_ratio"),
            "harvest_ratio_reserved": report.get("harvest_ratio_reserved"),
            "handback_seconds": fill.get("handback_seconds") or [], "leases": len(fill.get("leases") or []),
            "handback_by_workload": handback_by_workload(fill.get("leases") or []),
            "lend_to_busy_s": fill.get("lend_to_busy_s") or {}, "starts": fill.get("starts") or {},
            "batch": fill.get("batch"), "sweep": fill.get("sweep"),
            "serve": fill.get("serve"), "seconds": report.get("seconds"), "run_dir": out,
            "kill_step": next((_kill_step(out, p["at"]) for p in report.get("preemptions") or []), None),
            "steady_step_ms": steady_step_ms(out, kill_at + STEADY_AFTER),
            "invariants": {k: v["ok"] for k, v in (report.get("invariants") or {}).items()},
            "cpu_layout": report.get("cpu_layout"),
            "cpu_seconds": cpu.summary()}


def handback_by_workload(leases: list[dict]) -> dict[str, list[float]]:
    """report.json fillin.leases -> {workload: [hand-back seconds of each lease a training claim took]}."""
    out: dict[str, list[float]] = {}
    for le in leases:
        if le.get("ended_by") == "reclaim" and le.get("cause") == "training_claim" and le.get("reclaim_s") is not None:
            out.setdefault(le.get("workload") or "?", []).append(le["reclaim_s"])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def ratio_rounds(rounds: list[tuple]) -> dict:
    """Training tokens/s with fill-in over without, per interleaved round: each, their median and spread."""
    ratios = [r for r in (_ratio(a, b) for a, b in rounds) if r is not None]
    return {"ratios": ratios, "median": round(statistics.median(ratios), 4) if ratios else None,
            "min": min(ratios, default=None), "max": max(ratios, default=None), "rounds": len(rounds)}


def bench_fillin(quick: bool, progress: Callable[[str], None] | None = None, cpu_layout: str = "auto",
                 ratio_pairs: int | None = None) -> dict:
    """cpu_layout "auto": the head and each node on cores of their own where this machine has enough
    (sim.cpu_layout: 1 + the nodes' GPU slots, 5 here), as on a cluster, else the training worker on a core
    of its own and the rest on the others (2-4 cores); "shared": all on every core."""
    from spotfill.sim.cpu_layout import as_dict, describe, plan_layout, training_apart

    say = progress or (lambda msg: None)
    ratio_pairs = (1 if quick else 2) if ratio_pairs is None else ratio_pairs
    layout = (plan_layout(NODE_SLOTS) or training_apart(len(NODE_SLOTS))) if cpu_layout == "auto" else None
    say(f"cpu layout: {describe(layout)}")
    with_fill = _run(True, quick, say, cpu_layout=layout)
    say(f"with fill-in: hand-backs {with_fill['handback_seconds']}, harvest {with_fill['harvest_ratio']}, "
        f"{with_fill['tokens_per_s']} tokens/s")
    without = _run(False, quick, say, kill_at=with_fill["kill_step"], cpu_layout=layout)
    say(f"without fill-in: {without['tokens_per_s']} tokens/s")
    no_load = _run(True, quick, say, kill_at=with_fill["kill_step"], load_rps=0.0, cpu_layout=layout)
    say(f"with fill-in, no load: {no_load['tokens_per_s']} tokens/s")
    cold = _run(True, quick, say, kill_at=with_fill["kill_step"], cpu_layout=layout, standby=0)
    say(f"with fill-in, Serve without standbys: lend -> busy {cold['lend_to_busy_s'].get('serve')}, "
        f"harvest {cold['harvest_ratio']}")
    jobs = _run(False, quick, say, kill_at=with_fill["kill_step"], jobs=True, cpu_layout=layout)
    say(f"batch + sweep fill-in: hand-backs {jobs['handback_by_workload']}, lend -> busy "
        f"{jobs['lend_to_busy_s'].get('batch')}")
    jobs_cold = _run(False, quick, say, kill_at=with_fill["kill_step"], jobs=True, cpu_layout=layout, standby=0)
    say(f"batch + sweep fill-in without standbys: lend -> busy {jobs_cold['lend_to_busy_s'].get('batch')}")
    # training's ratio over interleaved rounds (with Serve under load / without): one pair cannot show 2%
    rounds = [(with_fill["tokens_per_s"], without["tokens_per_s"])]
    for i in range(ratio_pairs):
        w = _run(True, True, say, cpu_layout=layout)
        wo = _run(False, True, say, kill_at=w["kill_step"], cpu_layout=layout)
        rounds.append((w["tokens_per_s"], wo["tokens_per_s"]))
        say(f"ratio round {i + 2}: {_ratio(*rounds[-1])}")
    a, b, c = with_fill["tokens_per_s"], without["tokens_per_s"], no_load["tokens_per_s"]
    by_workload = {**jobs["handback_by_workload"], **with_fill["handback_by_workload"]}
    hb = [s for v in by_workload.values() for s in v]
    return {"handback_s_max": max(hb) if hb else None, "handback_seconds": with_fill["handback_seconds"],
            "handback_by_workload": by_workload,
            "handback_s_max_by_workload": {k: max(v) for k, v in by_workload.items() if v},
            "batch": jobs["batch"], "sweep": jobs["sweep"],
            "lend_to_busy_s": {**jobs["lend_to_busy_s"], **with_fill["lend_to_busy_s"]},  # batch + sweep, Serve
            "training_ratio_rounds": ratio_rounds(rounds),
            # the batch job's and the sweep's lent actors on warm standbys (the default) and, in the same
            # scenario, cold (standby_per_node 0)
            **{f"{w}_warm_vs_cold": {"starts": {"standby": jobs["starts"].get(w), "cold": jobs_cold["starts"].get(w)},
                                     "lend_to_busy_s": {"standby": jobs["lend_to_busy_s"].get(w),
                                                        "cold": jobs_cold["lend_to_busy_s"].get(w)}}
               for w in ("batch", "sweep")},
            "jobs_harvest_ratio": {"standby": jobs["harvest_ratio"], "cold": jobs_cold["harvest_ratio"]},
            # Serve's lent replicas started on warm standbys (the default) and, in the same scenario, cold
            "serve_warm_vs_cold": {"starts": {"standby": with_fill["starts"].get("serve"),
                                              "cold": cold["starts"].get("serve")},
                                   "lend_to_busy_s": {"standby": with_fill["lend_to_busy_s"].get("serve"),
                                                      "cold": cold["lend_to_busy_s"].get("serve")},
                                   "harvest_ratio": {"standby": with_fill["harvest_ratio"],
                                                     "cold": cold["harvest_ratio"]},
                                   "serve": {"standby": with_fill["serve"], "cold": cold["serve"]}},
            "harvest_ratio": with_fill["harvest_ratio"],                     # on busy GPU-s (tenants measure)
            "harvest_ratio_reserved": with_fill["harvest_ratio_reserved"],   # on held GPU-s
            "training_tokens_s_with_fillin": a, "training_tokens_s_without": b,
            "training_tokens_ratio": round(a / b, 4) if a and b else None,
            "training_ratio": round(a / b, 4) if a and b else None,
            "training_slowdown": round(1 - a / b, 4) if a and b else None,
            "training_tokens_s_with_fillin_no_load": c,
            "training_tokens_ratio_no_load": round(c / b, 4) if c and b else None,
            "training_steady_step_ms": {"with_fillin": with_fill["steady_step_ms"],
                                        "without": without["steady_step_ms"],
                                        "with_fillin_no_load": no_load["steady_step_ms"]},
            "training_steady_step_ratio": _ratio(without["steady_step_ms"], with_fill["steady_step_ms"]),
            "cpu_seconds": {"with_fillin": with_fill["cpu_seconds"], "without": without["cpu_seconds"],
                            "with_fillin_no_load": no_load["cpu_seconds"]},
            "serve": with_fill["serve"], "leases": with_fill["leases"],
            "gpu_seconds_fillin": (with_fill["gpu_seconds"] or {}).get("fillin"),
            "world_size_timeline": {"with_fillin": with_fill["world_size_timeline"],
                                    "without": without["world_size_timeline"]},
            "invariants_ok": with_fill["ok"] and without["ok"] and no_load["ok"] and jobs["ok"] and cold["ok"]
            and jobs_cold["ok"],
            "runs": {"with_fillin": with_fill, "without": without, "with_fillin_no_load": no_load,
                     "with_fillin_cold": cold, "batch_and_sweep": jobs, "batch_and_sweep_cold": jobs_cold},
            "cpu_layout": {**as_dict(layout), "training_workers_pinned": {
                k: (r.get("cpu_layout") or {}).get("training_workers_pinned")
                for k, r in (("with_fillin", with_fill), ("without", without))}},
            "notes": ["GPU slots are logical here: with cpu_layout shared, Serve's replicas, the fill-in "
                      "control plane and training share this machine's CPU cores, so training_slowdown "
                      "includes CPU contention a cluster's separate machines would not have"
                      if layout is None else
                      "GPU slots are logical here; the training worker ran on a core of its own and everything "
                      "else on the others (cpu_layout training_apart), as on a cluster where fill-in runs on "
                      "other GPUs' hosts" if layout.get("training") else
                      "GPU slots are logical here; the head and each node ran on cores of their own "
                      "(cpu_layout), as separate machines would"]}


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(bench_fillin("--quick" in sys.argv, progress=print), indent=2))
