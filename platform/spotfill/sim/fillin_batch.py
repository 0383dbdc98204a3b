"""Batch fill-in in a scenario (`fillin.batch`): jobs/batch_infer.py as its own Ray job on lent GPUs while
training runs, and report.json's `fillin.batch` read back from its output.

The driver is a subprocess (its own Ray job, as `ray job submit` would run it), so the arbiter sees its Data
actors as the tenant `batch:<run>-batch` and can stop that driver, never the runner. It starts at training's
first step and waits for training's first committed checkpoint (the one it evaluates), evaluates `rows` rows of the scenario's prepared shards
and generates for `prompts` prompts (lines of the corpus files). After training ends the runner waits
up to FINISH_S for it (the GPUs training gave back are lent to it); a driver still running then is stopped
and the report says how far it got (a rerun with the same output would resume). On an autoscaled cluster
no GPU is lent once training ends (its nodes go idle and away): the job gets AUTOSCALED_FINISH_S to finish
what it runs, and what it leaves is `left_for_rerun` -- the invariant holds when every row it wrote is
there exactly once and the rest is still planned on its output (uncommitted units: a rerun redoes them).
"""
from __future__ import annotations

import json
import logging
import os

from spotfill.sim.fillin_driver import AUTOSCALED_FINISH_S, FINISH_S, DriverFillin

log = logging.getLogger(__name__)
CHECKPOINT_WAIT_S = 600.0


def corpus_prompts(corpus: str, n: int, per_file: int = 4) -> list[dict]:
    """`n` prompts: non-empty lines (<= 60 chars), up to `per_file` from each of the corpus's .py files in
    sorted order."""
    from spotfill.train.data import iter_corpus_files
    out: list[dict] = []
    for path in iter_corpus_files(corpus, (".py",)):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = [ln.strip()[:60] for ln in f if ln.strip()][:per_file]
        except OSError:
            continue
        for line in lines[: n - len(out)]:
            out.append({"id": f"p{len(out):04d}", "prompt": line})
        if len(out) >= n:
            break
    return out


class BatchFillin(DriverFillin):
    kind, script = "batch", "batch_infer.py"

    def __init__(self, cluster, scenario, checkpoint_uri: str, name: str, out_dir: str, env: dict, say,
                 data_dir: str, corpus: str):
        super().__init__(cluster, scenario, name, out_dir, env, say)
        self.checkpoint, self.data_dir, self.corpus = checkpoint_uri, data_dir, corpus
        self.output = os.path.join(self.dir, "output")

    def _config(self) -> str:
        import yaml
        spec = self.scenario.fillin.batch
        gpus = self.scenario.cluster.gpu_slots() or 1      # autoscaled: what the autoscaler may launch too
        cfg = {"name": self.name, "checkpoint": self.checkpoint, "output": self.output,
               "checkpoint_wait_s": CHECKPOINT_WAIT_S,
               "cluster": {"gpu_resource": self.scenario.cluster.gpu_resource,
                           "max_units": spec["max_units"] or gpus, "grace_s": 5.0,
                           "standby_per_node": spec["standby_per_node"]}}
        if spec["rows"]:
            cfg["eval"] = {"data": self.data_dir, "rows": spec["rows"], "rows_per_unit": 16, "batch_size": 8}
        if spec["prompts"]:
            prompts = os.path.join(self.dir, "prompts.jsonl")
            with open(prompts, "w") as f:
                f.writelines(json.dumps(p) + "\n" for p in corpus_prompts(self.corpus, spec["prompts"]))
            cfg["generate"] = {"prompts": prompts, "max_tokens": 16, "rows_per_unit": 2}
        path = os.path.join(self.dir, "batch.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        return path

    def _started(self) -> str:
        return f"batch fill-in: evaluation + generation job started on lent GPUs (output {self.output})"

    def stop(self, timeout_s: float = FINISH_S) -> dict:
        """After training: wait for the driver (bounded), then fillin.batch read back from the output."""
        autoscaled = bool(self.scenario.cluster.autoscaler)
        summary = self.wait(AUTOSCALED_FINISH_S if autoscaled else timeout_s, after=" (a rerun resumes)",
                            left_ok=autoscaled)
        return self.report(summary, self.arbiter)

    def report(self, summary: dict, arbiter=None) -> dict:
        from spotfill.fillin.batch import read_back, tenant_reclaims
        from spotfill.fillin.batch_plan import PLAN_KEY
        from spotfill.storage.base import open_storage
        rep: dict = {"enabled": True}
        try:
            out = open_storage(self.output)
            if out.exists(PLAN_KEY):
                rep.update(read_back(out))          # from the output itself, not the driver's counters
        except Exception as exc:  # noqa: BLE001
            self.error = self.error or f"batch output not readable: {exc}"
        for key in ("waves", "resumed", "wall_s"):       # stops: read back from the output (every run's)
            if key in summary:
                rep[key] = summary[key]
        if arbiter is not None:
            try:
                rec = tenant_reclaims(arbiter, self.tenant)
                rep["reclaims"] = len(rec)
                rep["handback_seconds"] = [r.get("reclaim_s") for r in rec]
            except Exception as exc:  # noqa: BLE001
                log.warning("batch fill-in: reclaims not read from the arbiter: %s", exc)
        if self.reruns:
            rep["driver_reruns"] = self.reruns       # stopped by force while training ran, started again
        if self.left and "rows_target" in rep:
            rep["left_for_rerun"] = {"rows": rep["missing"], "units": rep.get("units_uncommitted"),
                                     "why": self.left}
        if self.error:
            rep["error"] = self.error
        return rep


def invariant(rep: dict) -> dict:
    """report.json invariants.batch_exactly_once: every row written once, none missing -- or, stopped at
    training's end on an autoscaled cluster (`left_for_rerun`), the rows it did not write are exactly those of
    its uncommitted units, which its rerun redoes."""
    if "rows_target" not in rep:
        return {"ok": False, "detail": rep.get("error") or "the batch job wrote no output"}
    left = rep.get("left_for_rerun")
    ok = rep["duplicates"] == 0 and not rep.get("unexpected") and "error" not in rep and (
        rep["missing"] == 0 or (left is not None and rep["rows_written"] + rep["missing"] == rep["rows_target"]))
    tail = (f"; {rep['missing']} left for its rerun ({left['units']} uncommitted unit(s): {left['why']})"
            if left and rep["missing"] else "")
    return {"ok": ok, "detail": rep.get("error") or f"{rep['rows_written']} of {rep['rows_target']} rows "
            f"written, {rep['duplicates']} duplicate(s), {rep['missing']} missing{tail}, read back from "
            f"{rep.get('output')}"}


def start(cluster, scenario, checkpoint_uri: str, name: str, out_dir: str, env: dict, say, data_dir: str,
          corpus: str, arbiter) -> "BatchFillin":
    """The runner's hook before training starts: the batch fill-in ready to start at training's first step
    (`arbiter`: the one the runner started through fillin/wiring.py)."""
    batch = BatchFillin(cluster, scenario, checkpoint_uri, name, out_dir, env, say, data_dir, corpus)
    batch.arbiter = arbiter
    return batch


def merge(report: dict, rep: dict | None) -> None:
    """fillin.batch and invariants.batch_exactly_once into the scenario's report."""
    if rep is None:
        return
    report.setdefault("fillin", {})["batch"] = rep
    inv = report.setdefault("invariants", {})["batch_exactly_once"] = invariant(rep)
    report["ok"] = bool(report.get("ok")) and inv["ok"]
