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

from spotfill.sim.fillin_driver import AUTOSCALED_FINISH_S, FINISH_S, DriverFillin

log = logging.getLogger(__name__)
GRID = {"lr": [1e-3, 3e-3, 1e-2, 3e-4], "warmup_steps": [0, 10]}     # 8 trials at most, in this order


class SweepFillin(DriverFillin):
    kind, script = "sweep", "sweep.py"

    def __init__(self, cluster, scenario, name: str, out_dir: str, env: dict, say, data_dir: str):
        super().__init__(cluster, scenario, name, out_dir, env, say)
        self.data_dir = data_dir
        self.run_dir = os.path.join(self.dir, "run")

    def _config(self) -> str:
        import yaml
        spec = self.scenario.fillin.sweep
        gpus = self.scenario.cluster.gpu_slots() or 1      # autoscaled: what the autoscaler may launch too
        cfg = {"name": self.name, "run_dir": self.run_dir, "storage": os.path.join(self.dir, "trials"),
               "data": {"path": self.data_dir},
               "sweep": {"model": "tiny", "steps": spec["steps"], "batch": 8,
                         # a short trial still reports (and can pause) a few times
                         "steps_per_report": max(1, min(5, spec["steps"] // 5)),
                         "checkpoint_every": min(10, spec["steps"]), "eval_rows": 32, "search": GRID, "trials": spec["trials"]},
               "fillin": {"grant": "arbiter", "max_units": spec["max_units"] or gpus, "grace_s": 5.0,
                          "standby_per_node": spec["standby_per_node"]},
               # as examples/sweep-tiny.yaml: a trial asks for a CPU beside its GPU (the arbiter lends only where
               # both are free; a node's CPUs equal its GPU slots here, and training takes one per worker)
               "cluster": {"gpu_resource": self.scenario.cluster.gpu_resource, "cpus_per_trial": 1}}
        path = os.path.join(self.dir, "sweep.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def _started(self) -> str:
        return f"sweep fill-in: {self.scenario.fillin.sweep['trials']} trials of the tiny GPT started on lent GPUs"

    def stop(self, timeout_s: float = FINISH_S) -> dict:
        """After training: wait for the driver (bounded: on an autoscaled cluster no GPU is lent once training
        ends, AUTOSCALED_FINISH_S), then fillin.sweep from its report.json."""
        autoscaled = bool(self.scenario.cluster.autoscaler)
        return self.report(self.wait(AUTOSCALED_FINISH_S if autoscaled else timeout_s,
                                     after=" (its rerun restores the experiment)", left_ok=autoscaled))

    def report(self, summary: dict) -> dict:
        rep: dict = {"enabled": True}
        try:
            with open(os.path.join(self.run_dir, "report.json")) as f:
                section = json.load(f)["fillin"]["sweep"]
            rep.update({k: v for k, v in section.items() if k != "results"})
        except (OSError, ValueError, KeyError) as exc:
            if self.left:               # stopped at training's end: what it left, from its own files
                rep.update(self._left_report())
            else:
                self.error = self.error or f"the sweep wrote no report ({type(exc).__name__}: {exc})"
        rep["report"] = os.path.join(self.run_dir, "report.json")
        if self.reruns:
            rep["driver_reruns"] = self.reruns       # stopped by force while training ran, started again
        if self.error:
            rep["error"] = self.error
        return rep


    def _left_report(self) -> dict:
        """fillin.sweep of a sweep stopped at training's end (on an autoscaled cluster): its trials as the
        experiment state Tune saved holds them (what a rerun restores: sweep_state.check_experiment), its
        pauses and resumes from its own event log."""
        from spotfill.fillin.sweep import experiment_path
        from spotfill.fillin.sweep_state import check_experiment
        events = []
        try:
            with open(os.path.join(self.run_dir, "events.jsonl")) as f:
                events = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            pass
        acts = [e.get("action") for e in events if e.get("kind") == "sweep_trial"]
        check = check_experiment(experiment_path(os.path.join(self.dir, "trials"), self.name))
        return left_section(self.scenario.fillin.sweep["trials"], check.restorable, check.statuses or {},
                            acts.count("paused"), acts.count("resumed"), self.left)


def left_section(trials: int, restorable: bool, statuses: dict[str, str], paused: int, resumed: int,
                 why: str) -> dict:
    """fillin.sweep for a sweep left to its rerun (pure)."""
    done = sum(1 for v in statuses.values() if v == "TERMINATED")
    return {"trials": trials, "completed": done, "failed": sum(1 for v in statuses.values() if v == "ERROR"),
            "paused": paused, "resumed": resumed,
            "left_for_rerun": {"trials": {t: v for t, v in statuses.items() if v != "TERMINATED"},
                               "not_started": max(0, trials - len(statuses)), "restorable": restorable,
                               "why": why}}


def invariant(rep: dict) -> dict:
    """report.json invariants.sweep_every_trial_completed: every trial completed -- or, stopped at training's
    end on an autoscaled cluster (`left_for_rerun`), none failed and the experiment is restorable: its rerun
    (Tuner.restore) continues each unfinished trial from its checkpoint."""
    if "trials" not in rep:
        return {"ok": False, "detail": rep.get("error") or "the sweep wrote no report"}
    left = rep.get("left_for_rerun")
    ok = not rep.get("failed") and "error" not in rep and (
        rep["completed"] == rep["trials"] or bool(left and left.get("restorable")))
    tail = (f"; {rep['trials'] - rep['completed']} left for its rerun (experiment "
            f"{'restorable' if left.get('restorable') else 'NOT restorable'}: {left.get('why')})"
            if left and rep["completed"] < rep["trials"] else "")
    return {"ok": ok, "detail": rep.get("error") or f"{rep['completed']} of {rep['trials']} trials completed, "
            f"{rep.get('paused', 0)} paused and {rep.get('resumed', 0)} resumed from their checkpoints{tail}"}


def start(cluster, scenario, name: str, out_dir: str, env: dict, say, data_dir: str, arbiter) -> SweepFillin:
    """The runner's hook before training starts: the sweep ready to start at the first step (`arbiter`: the
    one the runner started through fillin/wiring.py)."""
    sweep = SweepFillin(cluster, scenario, name, out_dir, env, say, data_dir)
    sweep.arbiter = arbiter
    return sweep


def merge(report: dict, rep: dict | None) -> None:
    """fillin.sweep and invariants.sweep_every_trial_completed into the scenario's report."""
    if rep is None:
        return
    report.setdefault("fillin", {})["sweep"] = rep
    inv = report.setdefault("invariants", {})["sweep_every_trial_completed"] = invariant(rep)
    report["ok"] = bool(report.get("ok")) and inv["ok"]
