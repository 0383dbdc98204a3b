"""Sweep fill-in in a scenario (`fillin.sweep`): jobs/sweep.py as its own Ray job on lent GPUs while training
runs, and report.json's `fillin.sweep` from the sweep's own report.

Like batch fill-in (sim/fillin_batch.py) the driver is a subprocess -- its own Ray job, as `ray job submit`
would run it -- so the arbiter sees its trial placement groups as the tenant `sweep:<run>-sweep` and can
stop that driver, never the runner. It starts at training's first step on the scenario's prepared data: a
learning-rate x warm-up grid of the tiny GPT (`trials` of it, `steps` each). Trials run only on GPUs the
arbiter lends; training's claims pause them (with a checkpoint) and they resume later. After training ends
the runner waits up to FINISH_S for the sweep (the GPUs training gave back are lent to it); a driver still
running then is stopped and the report says so.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading

from spotfill.sim.fillin_batch import ensure_arbiter, last_json

log = logging.getLogger(__name__)
FINISH_S = 180.0
GRID = {"lr": [1e-3, 3e-3, 1e-2, 3e-4], "warmup_steps": [0, 10]}     # 8 trials at most, in this order


class SweepFillin:
    def __init__(self, cluster, scenario, name: str, out_dir: str, env: dict, say, data_dir: str):
        self.cluster, self.scenario, self.name = cluster, scenario, f"{name}-sweep"
        self.out_dir, self.env, self.say, self.data_dir = out_dir, dict(env), say, data_dir
        self.dir = os.path.join(out_dir, "sweep")
        self.run_dir = os.path.join(self.dir, "run")
        self.proc: subprocess.Popen | None = None
        self.error: str | None = None
        self.log_path = os.path.join(self.dir, "driver.log")
        self._thread: threading.Thread | None = None

    def _config(self) -> str:
        import yaml
        spec = self.scenario.fillin.sweep
        gpus = sum(n.get("gpus", 1) for n in self.scenario.cluster.nodes) or 1
        cfg = {"name": self.name, "run_dir": self.run_dir, "storage": os.path.join(self.dir, "trials"),
               "data": {"path": self.data_dir},
               "sweep": {"model": "tiny", "steps": spec["steps"], "batch": 8, "steps_per_report": 5,
                         "checkpoint_every": 10, "eval_rows": 32, "search": GRID, "trials": spec["trials"]},
               "fillin": {"grant": "arbiter", "max_units": spec["max_units"] or gpus, "grace_s": 5.0},
               "cluster": {"gpu_resource": self.scenario.cluster.gpu_resource, "cpus_per_trial": 0}}
        path = os.path.join(self.dir, "sweep.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def start(self) -> None:
        """Training steps: start the sweep's driver."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._start, name="sweep-fillin", daemon=True)
            self._thread.start()

    def _start(self) -> None:
        from spotfill.sim.cluster import LOOPBACK_CLIENT_ENV
        try:
            os.makedirs(self.dir, exist_ok=True)
            repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            env = {**os.environ, **self.env, **LOOPBACK_CLIENT_ENV, "RAY_ADDRESS": self.cluster.address}
            self.proc = subprocess.Popen([sys.executable, os.path.join(repo, "jobs", "sweep.py"), "--config",
                                          self._config()], stdout=subprocess.PIPE,
                                         stderr=open(self.log_path, "w"), text=True, env=env, cwd=repo)
            spec = self.scenario.fillin.sweep
            self.say(f"sweep fill-in: {spec['trials']} trials of the tiny GPT started on lent GPUs")
        except Exception as exc:  # noqa: BLE001 - reported in fillin.sweep, never breaks the scenario
            self.error = f"sweep fill-in did not start: {type(exc).__name__}: {exc}"
            log.exception("sweep fill-in did not start")

    def stop(self, timeout_s: float = FINISH_S) -> dict:
        """After training: wait for the driver (bounded), then fillin.sweep from its report.json."""
        if self._thread is not None:
            self._thread.join(30)
        summary: dict = {}
        if self.proc is not None:
            try:
                out, _ = self.proc.communicate(timeout=timeout_s)
                summary = last_json(out)
                if self.proc.returncode != 0:
                    self.error = f"sweep driver exited {self.proc.returncode} (see {self.log_path})"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
                self.error = f"sweep not finished {timeout_s:.0f}s after training; stopped"
        return self.report(summary)

    def report(self, summary: dict) -> dict:
        rep: dict = {"enabled": True}
        try:
            with open(os.path.join(self.run_dir, "report.json")) as f:
                section = json.load(f)["fillin"]["sweep"]
            rep.update({k: v for k, v in section.items() if k != "results"})
        except (OSError, ValueError, KeyError) as exc:
            self.error = self.error or f"the sweep wrote no report ({type(exc).__name__}: {exc})"
        rep["report"] = os.path.join(self.run_dir, "report.json")
        if self.error:
            rep["error"] = self.error
        return rep


def invariant(rep: dict) -> dict:
    """report.json invariants.sweep_every_trial_completed."""
    if "trials" not in rep:
        return {"ok": False, "detail": rep.get("error") or "the sweep wrote no report"}
    ok = rep["completed"] == rep["trials"] and not rep.get("failed") and "error" not in rep
    return {"ok": ok, "detail": rep.get("error") or f"{rep['completed']} of {rep['trials']} trials completed, "
            f"{rep.get('paused', 0)} paused and {rep.get('resumed', 0)} resumed from their checkpoints"}


def start(cluster, scenario, name: str, out_dir: str, env: dict, say, data_dir: str) -> SweepFillin:
    """The runner's hook before training starts: the arbiter up, the sweep ready to start at the first step."""
    sweep = SweepFillin(cluster, scenario, name, out_dir, env, say, data_dir)
    ensure_arbiter(scenario, name, out_dir, env)
    return sweep


def merge(report: dict, rep: dict | None) -> None:
    """fillin.sweep and invariants.sweep_every_trial_completed into the scenario's report."""
    if rep is None:
        return
    report.setdefault("fillin", {})["sweep"] = rep
    inv = report.setdefault("invariants", {})["sweep_every_trial_completed"] = invariant(rep)
    report["ok"] = bool(report.get("ok")) and inv["ok"]
