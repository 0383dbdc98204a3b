"""A sweep whose driver dies is continued, not started over (jobs/sweep.py + Tuner.restore), and a trial the
plan pauses while Tune has only staged it (ray_compat.tune_unstage_trial) still starts later; on a local
multi-node cluster (2 nodes x 1 GPU slot, one cluster for the module).

Evidence is Tune's own per-trial result log (result.json: every result the driver received, with the
trainable's step, the checkpoint step it restored from and its actor incarnation), not the sweep's report."""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from spotfill.testing.waiting import wait_for
import yaml

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ_LEN = 32
STEPS, PER_REPORT, CKPT_EVERY, SLEEP_S = 40, 4, 8, 0.4     # ~4 s of reports per trial


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from spotfill.fillin.wiring import runtime_env
    from spotfill.sim.cluster import EmbeddedCluster
    from spotfill.storage.base import open_storage
    from spotfill.train.data import BYTE_VOCAB, ShardWriter

    root = tmp_path_factory.mktemp("sweeprs")
    data = str(root / "data")
    writer = ShardWriter(open_storage(data), SEQ_LEN, BYTE_VOCAB, "bytes", rows_per_shard=256)
    writer.add(np.random.default_rng(0).integers(0, 256, size=(512, SEQ_LEN + 1)))
    writer.close()
    cluster = EmbeddedCluster()
    for _ in range(2):
        cluster.add_node(1)
    ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
    try:
        yield {"cluster": cluster, "data": data, "root": root}
    finally:
        ray.shutdown()
        cluster.shutdown()


def sweep_config(env, name: str, trials: int = 2, max_units: int = 1) -> dict:
    return {"name": name, "run_dir": str(env["root"] / name / "run"), "storage": str(env["root"] / name / "tune"),
            "data": {"path": env["data"]},
            "sweep": {"model": "tiny", "steps": STEPS, "batch": 4, "steps_per_report": PER_REPORT,
                      "checkpoint_every": CKPT_EVERY, "eval_rows": 32, "trials": trials,
                      "search": {"lr": [0.001, 0.003], "warmup_steps": [0, 4]}, "max_failures": 2},
            "fillin": {"grant": "fixed", "max_units": max_units, "grace_s": 5.0},
            "cluster": {"gpu_resource": "GPU", "cpus_per_trial": 1}}


def experiment_state(exp_dir: str) -> dict:
    """trial id -> (status, run metadata) from Tune's newest saved experiment state."""
    files = sorted(glob.glob(os.path.join(exp_dir, "experiment_state-*.json")))
    if not files:
        return {}
    try:
        with open(files[-1]) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}                                      # being replaced
    out = {}
    for trial_json, meta_json in state["trial_data"]:
        trial, meta = json.loads(trial_json), json.loads(meta_json)
        out[trial["trial_id"]] = (trial["status"], meta)
    return out


def result_rows(exp_dir: str) -> dict[str, list[dict]]:
    """trial id -> every result Tune logged for it (result.json of the trial's folder), in order."""
    out = {}
    for path in glob.glob(os.path.join(exp_dir, "*", "result.json")):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if rows:
            out[rows[0]["trial_id"]] = rows
    return out


def incarnations(rows: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for r in rows:
        if not out or out[-1][-1]["incarnation"] != r["incarnation"]:
            out.append([])
        out[-1].append(r)
    return out


def start_driver(env, cfg_path, log_path):
    return subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "jobs", "sweep.py"), "--config", str(cfg_path),
         "--step-sleep-s", str(SLEEP_S)], stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
        env={**os.environ, "RAY_ADDRESS": env["cluster"].address, "PYTHONPATH": os.path.join(ROOT, "platform")})


# CI's time budget (`python -m pytest -m slow`); in CI the rerun's restore decision is the unit tests of
# fillin/sweep_state.py
@pytest.mark.slow
def test_a_sweep_driver_killed_mid_run_is_continued_by_a_rerun_not_started_over(env, tmp_path):
    name = "killed-driver"
    cfg = sweep_config(env, name)          # one unit: the trials run one after the other
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    exp = os.path.join(cfg["storage"], name)
    rows_at_kill: dict = {}

    first = start_driver(env, path, tmp_path / "first.log")
    try:
        def one_done_one_checkpointed():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            rows = result_rows(exp)
            done = [t for t, rs in rows.items() if rs[-1].get("done")]
            mid = [t for t, rs in rows.items() if not rs[-1].get("done") and rs[-1]["step"] >= CKPT_EVERY + PER_REPORT]
            state = experiment_state(exp)
            # the completion and the mid trial's first checkpoint (saved before its 3rd result) are in the
            # experiment state Tune saved: that is what a rerun restores
            ok = (done and mid and state.get(done[0], ("",))[0] == "TERMINATED"
                  and ((state.get(mid[0], ("", {}))[1].get("last_result") or {}).get("step") or 0)
                  >= CKPT_EVERY + PER_REPORT)
            return (done[0], mid[0]) if ok else None
        done_tid, mid_tid = wait_for(one_done_one_checkpointed, 150, "a trial completed and the next checkpointed")
        rows_at_kill = {t: list(rs) for t, rs in result_rows(exp).items()}
        first.send_signal(signal.SIGKILL)          # the driver dies: Ray ends its job, trial actors included
        first.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == -signal.SIGKILL
    killed_at = max(r["step"] for r in rows_at_kill[mid_tid])
    assert killed_at < STEPS
    # the fault CI met: the driver was killed while Tune copied its state to storage, leaving the searcher
    # state empty (Tune's restore fails on it; a stale copy could hand a configuration out twice) -- here
    # the experiment state too, the one file of this first driver's session a restore cannot do without
    searcher_files = sorted(glob.glob(os.path.join(exp, "searcher-state-*.pkl")))
    state_files = sorted(glob.glob(os.path.join(exp, "experiment_state-*.json")))
    assert len(searcher_files) == len(state_files) == 1
    assert os.path.exists(state_files[0] + ".last")           # the sweep's whole copy of it
    for damaged_file in (searcher_files[0], state_files[0]):
        open(damaged_file, "w").close()

    second = start_driver(env, path, tmp_path / "second.log")
    stdout, _ = second.communicate(timeout=180)
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-4000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    s = json.loads(open(summary["report"]).read())["fillin"]["sweep"]
    assert s["restored"] is True and s["trials"] == 2 and s["completed"] == 2 and s["failed"] == 0, s
    assert s["carried_over"] == 1 and s["restored_trials"] == 1, s

    rows = result_rows(exp)
    # the completed trial did not run again: nothing new in its log, one actor incarnation
    assert rows[done_tid] == rows_at_kill[done_tid], "the completed trial ran again"
    assert len(incarnations(rows[done_tid])) == 1
    # the interrupted trial continued from its last checkpoint (a multiple of the checkpoint period, at or
    # before the step it was killed at), not from step 0
    runs = incarnations(rows[mid_tid])
    assert len(runs) == 2, [[(r["step"], r["restored_from"]) for r in run] for run in runs]
    before, after = runs
    assert before[0]["restored_from"] is None and before[0]["first_step"] == 1
    resumed_from = after[0]["restored_from"]
    assert resumed_from is not None and 0 < resumed_from <= killed_at and resumed_from % CKPT_EVERY == 0, after[0]
    assert after[0]["first_step"] == resumed_from + 1
    assert [r["step"] for r in after] == list(range(resumed_from + PER_REPORT, STEPS + 1, PER_REPORT))
    assert after[-1]["done"] and after[-1]["history_ok"] is True     # the weights saw each step once
    events = [json.loads(line) for line in open(os.path.join(cfg["run_dir"], "events.jsonl"))]
    actions = {(e.get("action"), e.get("trial")) for e in events if e["kind"] == "sweep_trial"}
    assert ("carried_over", done_tid) in actions and ("restored", mid_tid) in actions, actions
    assert any(e["kind"] == "sweep_restore" and e["cause"] == "driver_restarted" for e in events)
    damaged = sorted(os.path.basename(f) for f in (searcher_files[0], state_files[0]))
    assert s["state_set_aside"] == damaged and s["state_recovered"] == [os.path.basename(state_files[0])], s
    assert [(e["file"], e["cause"]) for e in events if e["kind"] == "sweep_state_damaged"] == [
        (name, "partial_write") for name in damaged]
    assert [(e["file"], e["cause"]) for e in events if e["kind"] == "sweep_state_recovered"] == [
        (os.path.basename(state_files[0]), "partial_write")]
    assert all(os.path.exists(f + ".damaged") for f in (searcher_files[0], state_files[0]))   # kept, not deleted
    print(f"\nkilled at step {killed_at} of trial {mid_tid}; the rerun continued it from step {resumed_from}")

    # a rerun of the finished sweep restores it and finishes at once: both trials carried over, nothing ran
    third = start_driver(env, path, tmp_path / "third.log")
    stdout, _ = third.communicate(timeout=120)
    assert third.returncode == 0, (tmp_path / "third.log").read_text()[-4000:]
    s3 = json.loads(open(json.loads(stdout.strip().splitlines()[-1])["report"]).read())["fillin"]["sweep"]
    assert (s3["restored"], s3["completed"], s3["carried_over"], s3["restored_trials"]) == (True, 2, 2, 0), s3
    assert s3["best"] == s["best"], (s3["best"], s["best"])
    assert result_rows(exp) == rows
    # the same storage and name with other sweep settings: refused up front, one line, exit 2
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**cfg, "sweep": {**cfg["sweep"], "steps": STEPS + 4}}))
    fourth = start_driver(env, other, tmp_path / "fourth.log")
    stdout, _ = fourth.communicate(timeout=120)
    err = (tmp_path / "fourth.log").read_text()
    assert fourth.returncode == 2 and stdout == "", err[-3000:]
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("sweep.py: error: storage: ") and "Traceback" not in err, err
    assert result_rows(exp) == rows


def test_a_trial_paused_while_tune_has_only_staged_it_starts_when_units_are_lent_again(env, monkeypatch):
    """The plan pauses a trial Tune has staged (its placement group requested, not placed: the GPU slots are
    taken) -- fillin/sweep.py's `deferred` path, which must unstage it through ray_compat.tune_unstage_trial:
    a trial left staged is never started again (the sweep would hang)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.state import list_placement_groups

    from spotfill import ray_compat
    from spotfill.config.job import from_mapping
    from spotfill.config.sweep import SweepJobConfig
    from spotfill.fillin.grant import FixedGrant
    from spotfill.fillin.sweep import run_sweep

    unstaged: list[bool] = []
    real = ray_compat.tune_unstage_trial

    def spy(controller, trial):
        unstaged.append(real(controller, trial))
        return unstaged[-1]
    monkeypatch.setattr(ray_compat, "tune_unstage_trial", spy)

    blocker = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="SPREAD")   # "training" holds both
    ray.get(blocker.ready(), timeout=60)
    job_id = ray.get_runtime_context().get_job_id()
    blocker_id = blocker.id.hex()

    def trial_group_waiting() -> bool:
        return any(pg["placement_group_id"] != blocker_id and pg["state"] == "PENDING"
                   for pg in list_placement_groups(detail=True, limit=1000)
                   if pg.get("creator_job_id") == job_id)

    cfg = from_mapping(SweepJobConfig, sweep_config(env, "staged", trials=1))
    grant = FixedGrant(1, grace_s=5.0)      # one unit lent, but the slot is not free yet
    events: list[dict] = []
    seen: dict = {}
    out: dict = {}

    def sweep():
        try:
            out.update(run_sweep(cfg, grant, step_sleep_s=0.1,
                                 emit=lambda kind, **f: events.append({"kind": kind, **f})))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out["error"] = exc

    t = threading.Thread(target=sweep, daemon=True)
    t.start()
    try:
        wait_for(trial_group_waiting, 60, "Tune to stage the trial (its placement group pending)")
        grant.set(0)                                              # reclaimed before the trial ever ran
        wait_for(lambda: any(e.get("action") == "deferred" for e in events), 30, "the staged trial deferred")
        seen["pending_after_defer"] = wait_for(lambda: not trial_group_waiting() or None, 30,
                                               "the trial's placement group request withdrawn")
        remove_placement_group(blocker)
        seen["blocker_removed"] = True
        time.sleep(1.0)
        seen["results_while_zero"] = [e for e in events if e.get("action") in ("started", "restored")]
        grant.set(1)
        t.join(120)
    finally:
        grant.set(1)
        if not seen.get("blocker_removed"):
            remove_placement_group(blocker)
    assert not t.is_alive(), f"the deferred trial never started again (still staged?): {events}"
    assert "error" not in out, out.get("error")
    assert unstaged and unstaged[0] is True, unstaged
    assert seen["results_while_zero"] == [], seen
    assert out["completed"] == 1 and out["failed"] == 0, out
    (res,) = out["results"]
    assert res["step"] == STEPS and res["history_ok"] is True, res
    actions = [e.get("action") for e in events if e["kind"] == "sweep_trial"]
    assert actions.index("deferred") < actions.index("started") < actions.index("completed"), actions
