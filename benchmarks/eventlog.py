"""The event log's size and `spotfill report`'s cost on a long run (no Ray, no torch).

    python -m benchmarks.eventlog [--steps 1000000] [--json PATH]      (also: spotfill bench --only eventlog)

A synthetic run of N steps -- each step event with the fields a CPU worker writes, a checkpoint every 1000
steps, a restart at the middle -- is written twice through telemetry.events.EventLog: unsampled in one file
(every step a line, as before the log was bounded) and with the default sampler and rolling. For each:
bytes per step, lines, and `spotfill report RUN_DIR` in a fresh interpreter -- its wall time and peak RSS
(ru_maxrss). The unsampled log stands for an old run: the reader folds it while streaming it. `--baseline
DIR` also runs another checkout's `spotfill report` (e.g. /work/main/platform) on the unsampled log.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks._common import REPO, rnd, subprocess_env

STEP_S = 0.1          # synthetic event time per step
SAVE_EVERY = 1000


def synthetic_events(steps: int):
    """The run's events in order (a generator: nothing is held)."""
    t = 1_000_000.0
    yield {"t": t, "kind": "job_start", "name": "bench", "steps": steps, "workers": [4, 4], "gpus_per_worker": 1}
    yield {"t": t, "kind": "node_up", "node": "n0", "gpus": 8}
    yield {"t": t, "kind": "gpu_free", "node": "n0", "free": 4}
    half = steps // 2
    for attempt, (lo, hi) in enumerate(((1, half + SAVE_EVERY // 2), (half + 1, steps))):
        yield {"t": t, "kind": "attempt", "attempt": attempt, "world_size": 4, "group": attempt + 1}
        yield {"t": t + 1, "kind": "start" if attempt == 0 else "resume", "attempt": attempt, "step": lo - 1,
               "world_size": 4, "startup_s": 1.0, "device": "cpu", "params": 137088,
               "flops_per_token": 920832.0, "hardware_flops_per_token": 920832.0, "peak_flops_per_gpu": None}
        t += 1
        for i in range(lo, hi + 1):
            t += STEP_S
            yield {"t": round(t, 6), "kind": "step", "step": i, "attempt": attempt, "loss": 2.5 + 1.0 / i,
                   "world_size": 4, "tokens": 1024, "lr": 0.000999871, "step_s": 0.0987654, "data_wait_s": 0.00123,
                   "compute_s": 0.0975354, "forward_backward_s": 0.0812345, "optimizer_s": 0.0123456,
                   "collective_wait_s": 0.0039553, "tokens_per_s": 10367.9, "mfu": None, "hfu": None}
            if i % SAVE_EVERY == 0:
                yield {"t": round(t + 0.01, 6), "kind": "checkpoint_save", "attempt": attempt, "step": i,
                       "stall_s": 0.01, "emergency": False, "grow": False}
        t += 5
    yield {"t": t + 1, "kind": "finish", "ok": True, "attempt": 1}
    yield {"t": t + 2, "kind": "job_end"}


def write_log(run_dir: str, steps: int, sampled: bool) -> dict:
    from spotfill.telemetry.events import EventLog, log_size

    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "events.jsonl")
    # unsampled: one file, as the log was written before it was bounded (an old run's log)
    log = EventLog(path, sampler=None if sampled else False, roll_mb=None if sampled else 2 ** 20)
    batch: list[dict] = []
    for e in synthetic_events(steps):
        batch.append(e)
        if len(batch) == 200:          # the sink receives steps in batches
            log.write_many(batch)
            batch = []
    log.write_many(batch)
    log.close()
    size = log_size(path)
    return {"bytes": size, "bytes_per_step": rnd(size / steps, 1), "lines": log.written["lines"],
            "steps_in": log.written["steps"]}


def report_cost(run_dir: str, platform: str | None = None) -> dict:
    """`spotfill report RUN_DIR` in a fresh interpreter (`platform`: another checkout's platform/ folder,
    e.g. the code before this log was bounded): wall seconds and peak RSS (MB)."""
    code = ("import resource, sys, time; t0 = time.perf_counter(); from spotfill.cli.main import main; "
            "rc = main(['report', sys.argv[1]]); "
            "print('RESULT', rc, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    env = subprocess_env()
    if platform:
        env["PYTHONPATH"] = platform
    out = subprocess.run([sys.executable, "-c", code, run_dir], cwd=platform or REPO, env=env,
                         capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"spotfill report failed: {out.stderr.strip().splitlines()[-1:]}")
    _, rc, secs, rss_kb = line.split()
    return {"rc": int(rc), "seconds": rnd(float(secs), 2), "peak_rss_mb": rnd(int(rss_kb) / 1024, 1),
            "summary": out.stdout.splitlines()[0]}


def bench_eventlog(quick: bool = True, steps: int | None = None, progress=None, baseline: str | None = None) -> dict:
    """`baseline`: also run that checkout's `spotfill report` on the unsampled log (before/after)."""
    steps = steps or (100_000 if quick else 1_000_000)
    say = progress or (lambda m: None)
    work = tempfile.mkdtemp(prefix="spotfill-bench-eventlog-")
    out: dict = {"steps": steps}
    try:
        for name, sampled in (("sampled", True), ("unsampled", False)):
            run_dir = os.path.join(work, name)
            t0 = time.perf_counter()
            out[name] = write_log(run_dir, steps, sampled)
            out[name]["write_s"] = rnd(time.perf_counter() - t0, 2)
            say(f"{name}: {out[name]['bytes_per_step']} bytes/step; running spotfill report")
            out[name]["report"] = report_cost(run_dir)
            if baseline and not sampled:
                say("unsampled: running the baseline's spotfill report")
                out[name]["report_baseline"] = report_cost(run_dir, baseline)
            shutil.rmtree(run_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["bytes_per_step_unsampled"] = out["unsampled"]["bytes_per_step"]
    out["bytes_per_step_sampled"] = out["sampled"]["bytes_per_step"]
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--baseline", metavar="PLATFORM_DIR", help="another checkout's platform/ folder to compare")
    a = ap.parse_args()
    result = bench_eventlog(False, a.steps, progress=lambda m: print(m, file=sys.stderr, flush=True),
                            baseline=a.baseline)
    text = json.dumps(result, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    print(text)
