"""Sweeps on lent GPUs (jobs/sweep.py, fillin/sweep.py) on a local multi-node cluster (2 nodes x 1 GPU
slot, one cluster for the module): no trial starts while nothing is lent; a grant drop pauses the running
trials with a checkpoint and a rise resumes them from it (their own reported steps continue); a trial whose
actor is killed mid-run is restarted from its checkpoint and no step is applied twice; a real training
claim on the arbiter takes the sweep's GPUs back within the grace and the sweep still finishes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from spotfill.testing.waiting import wait_for as _wait_for
import yaml

pytestmark = pytest.mark.timeout(400)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ_LEN = 32
STEPS, PER_REPORT, CKPT_EVERY, SLEEP_S = 80, 4, 8, 0.3     # ~7 s per trial: both run at once
# the pause-resume test's trials: twice as long, so the drop lands while both still have reports to go (with
# 80 steps on a slow 2-core run, one trial was in its last train() call at the drop and finished instead
# of pausing, and in another run one had finished before the second was placed)
PAUSE_STEPS, LEFT_AT_DROP = 2 * STEPS, 3 * PER_REPORT


def wait_for(check, timeout: float, what: str, every: float = 0.1):
    return _wait_for(check, timeout, what, every)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from spotfill.fillin.arbiter import ensure_arbiter
    from spotfill.fillin.wiring import runtime_env
    from spotfill.sim.cluster import EmbeddedCluster
    from spotfill.storage.base import open_storage
    from spotfill.train.data import BYTE_VOCAB, ShardWriter

    root = tmp_path_factory.mktemp("sweep")
    data = str(root / "data")
    writer = ShardWriter(open_storage(data), SEQ_LEN, BYTE_VOCAB, "bytes", rows_per_shard=256)
    writer.add(np.random.default_rng(0).integers(0, 256, size=(512, SEQ_LEN + 1)))
    writer.close()
    cluster = EmbeddedCluster()
    for _ in range(2):
        cluster.add_node(1)
    ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
    arbiter = ensure_arbiter("GPU", runtime_env=runtime_env(), state_path=str(root / "arbiter.json"))
    try:
        yield {"cluster": cluster, "arbiter": arbiter, "data": data, "root": root}
    finally:
        try:
            ray.kill(arbiter, no_restart=True)
        finally:
            ray.shutdown()
            cluster.shutdown()


def sweep_config(env, name: str, grant: str = "fixed", trials: int = 2, steps: int = STEPS) -> dict:
    return {"name": name, "run_dir": str(env["root"] / name / "run"), "storage": str(env["root"] / name / "tune"),
            "data": {"path": env["data"]},
            "sweep": {"model": "tiny", "steps": steps, "batch": 4, "steps_per_report": PER_REPORT,
                      "checkpoint_every": CKPT_EVERY, "eval_rows": 32, "trials": trials,
                      "search": {"lr": [0.001, 0.003], "warmup_steps": [0, 4]}, "max_failures": 2},
            "fillin": {"grant": grant, "max_units": 2, "grace_s": 5.0},
            "cluster": {"gpu_resource": "GPU", "cpus_per_trial": 1}}


def make_cfg(cfg_dict):
    from spotfill.config.job import from_mapping
    from spotfill.config.sweep import SweepJobConfig
    return from_mapping(SweepJobConfig, cfg_dict)


def recorder():
    from ray import tune

    class Recorder(tune.Callback):
        def __init__(self):
            self.results: list[dict] = []
            self.lock = threading.Lock()
            self.on_result = None

        def on_trial_result(self, iteration, trials, trial, result, **info):
            row = {"t": time.monotonic(), "trial": trial.trial_id, **{k: result.get(k) for k in (
                "step", "restored_from", "first_step", "incarnation", "pid", "history_ok", "done",
                "restored_via", "restore_s", "restore_why")}}
            with self.lock:
                self.results.append(row)
            if self.on_result:
                self.on_result(row)

        def __getstate__(self):          # Tune pickles its run config; the copy records nothing
            return {"results": [], "on_result": None}

        def __setstate__(self, state):
            self.__dict__.update(state)
            self.lock = threading.Lock()

        def of(self, trial_id):
            with self.lock:
                return [r for r in self.results if r["trial"] == trial_id]

        def trials(self):
            with self.lock:
                return sorted({r["trial"] for r in self.results})

    return Recorder()


def job_pgs(job_id: str) -> list[dict]:
    from ray.util.state import list_placement_groups
    return [pg for pg in list_placement_groups(detail=True, limit=1000)
            if pg.get("creator_job_id") == job_id and pg.get("state") != "REMOVED"]


def incarnations(rows: list[dict]) -> list[list[dict]]:
    """The trial's results split by actor incarnation, in order."""
    out: list[list[dict]] = []
    for r in rows:
        if not out or out[-1][-1]["incarnation"] != r["incarnation"]:
            out.append([])
        out[-1].append(r)
    return out


def sweep_keeper(name: str):
    import ray

    from spotfill.fillin.sweep_keeper import PREFIX
    (found,) = [n for n in ray.util.list_named_actors() if n.startswith(f"{PREFIX}{name}:")]
    return ray.get_actor(found)


def plant_stale_state(keeper, tid: str) -> dict:
    """Check the paused trial's state in the keeper against its storage checkpoint (written, same step,
    same bytes), then put a stale state in its place: that checkpoint's state 4 steps back (step and
    history), labelled honestly. A resume must not take it (it would repeat those 4 steps' count)."""
    import io

    import ray
    import torch

    from spotfill.fillin.sweep_memory import StateId, digest
    kept = ray.get(keeper.peek.remote(tid), timeout=30)
    assert kept is not None, f"trial {tid}'s pause left no state in the keeper"
    path = os.path.join(kept["checkpoint"], "state.pt")
    assert os.path.exists(path), f"the pause checkpoint {path} was not written to storage"
    with open(path, "rb") as f:
        data = f.read()
    assert digest(data) == kept["sha256"], "the kept state is not the storage checkpoint's bytes"
    state = torch.load(io.BytesIO(data), weights_only=False)
    assert state["step"] == kept["step"], (state["step"], kept)
    state["step"], state["history"] = state["step"] - 4, state["history"][:-4]
    buf = io.BytesIO()
    torch.save(state, buf)
    stale = StateId(tid, kept["step"] - 4, kept["checkpoint"], digest(buf.getvalue()))
    assert ray.get(keeper.put.remote(stale.as_dict(), buf.getvalue()), timeout=30)["kept"]
    return kept


def test_nothing_starts_at_grant_zero_and_a_drop_pauses_trials_that_resume_from_their_checkpoint(env):
    """... and a resumed trial takes its state from the keeper's host memory when it holds exactly its pause
    checkpoint's state (no storage read), from storage when the keeper holds a stale one; the storage
    checkpoint is written either way."""
    import ray

    from spotfill.fillin.grant import FixedGrant
    from spotfill.fillin.sweep import run_sweep

    cfg = make_cfg(sweep_config(env, "pause-resume", steps=PAUSE_STEPS))
    grant = FixedGrant(0, grace_s=5.0)
    rec = recorder()
    job_id = ray.get_runtime_context().get_job_id()
    seen: dict = {}

    def drive():
        try:
            time.sleep(4.0)                       # the sweep is up, nothing is lent
            seen["results_at_zero"] = len(rec.results)
            seen["pgs_at_zero"] = len(job_pgs(job_id))
            grant.set(2)
            wait_for(lambda: len(rec.trials()) == 2 and all(
                rec.of(t)[-1]["step"] <= PAUSE_STEPS - LEFT_AT_DROP for t in rec.trials()), 90,
                "both trials running at once, each with reports to go")
            seen["steps_before_drop"] = {t: max(r["step"] for r in rec.of(t)) for t in rec.trials()}
            t_drop = time.monotonic()
            grant.set(0)
            wait_for(lambda: not job_pgs(job_id), 30, "the trials' placement groups removed", every=0.05)
            seen["handback_s"] = time.monotonic() - t_drop
            # the first trial's kept state is replaced by a stale one: it must resume from storage
            seen["stale_trial"] = rec.trials()[0]
            seen["kept"] = plant_stale_state(sweep_keeper(cfg.name), seen["stale_trial"])
            n = len(rec.results)
            time.sleep(2.0)
            seen["results_while_zero"] = len(rec.results) - n
            seen["pgs_while_zero"] = len(job_pgs(job_id))
            grant.set(2)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            seen["error"] = exc
            grant.set(2)

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    events: list = []
    out = run_sweep(cfg, grant, callbacks=[rec], step_sleep_s=SLEEP_S,
                    emit=lambda kind, **f: events.append({"t": time.monotonic(), "kind": kind, **f}))
    t.join(30)
    print("\nsweep events:", [(e.get("action"), e.get("trial")) for e in events])
    assert "error" not in seen, seen.get("error")
    assert seen["results_at_zero"] == 0 and seen["pgs_at_zero"] == 0, seen    # nothing started at grant 0
    assert seen["results_while_zero"] == 0 and seen["pgs_while_zero"] == 0, seen
    assert out["completed"] == 2 and out["failed"] == 0, out
    assert out["paused"] >= 2 and out["resumed"] >= 2, out
    for tid in rec.trials():
        runs = incarnations(rec.of(tid))
        assert len(runs) >= 2, f"trial {tid} was never restarted: {runs}"
        first, second = runs[0], runs[1]
        assert first[0]["restored_from"] is None and first[0]["first_step"] == 1
        paused_at = first[-1]["step"]
        assert paused_at < PAUSE_STEPS, f"trial {tid} finished before the drop"
        # resumed from the pause checkpoint: the step count continues where the trial stopped
        assert second[0]["restored_from"] == paused_at, (first[-1], second[0])
        assert second[0]["first_step"] == paused_at + 1
        assert all(r["step"] > paused_at for r in second)
        assert runs[-1][-1]["step"] == PAUSE_STEPS and runs[-1][-1]["history_ok"] is True
        if tid == seen["stale_trial"]:       # the keeper held a stale state: restored from storage instead
            assert seen["kept"]["step"] == paused_at, seen["kept"]
            assert second[0]["restored_via"] == "storage", second[0]
            assert "step" in second[0]["restore_why"], second[0]
        else:                                # exactly its pause checkpoint's state: from host memory
            assert second[0]["restored_via"] == "memory", second[0]
        assert second[0]["restore_s"] is not None
    assert out["resumed_from"]["memory"] >= 1 and out["resumed_from"]["storage"] >= 1, out
    assert out["state_keeper"]["hits"] >= 1 and out["state_keeper"]["misses"] >= 1, out["state_keeper"]
    # a completed trial's kept state is dropped: the keeper holds nothing at the end
    assert out["state_keeper"]["dropped"] == 2 and out["state_keeper"]["states"] == 0, out["state_keeper"]
    assert all(r["history_ok"] for r in out["results"]) and len(out["results"]) == 2
    print(f"\nFixedGrant drop -> placement groups removed: {seen['handback_s']:.2f}s; restores by source "
          f"{out['resumed_from']}, seconds {out['restore_s']}")


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_a_trial_still_in_its_setup_gives_its_gpu_back_within_the_grace(env):
    """A grant drop while the trial's actor is still in its setup (a CPU-starved fill-in process took 25 s
    there): Tune queues the actor's stop() behind the setup and, for an actor already created, waited a fixed
    10 s before killing it -- the GPU stayed held past the grace and the arbiter stopped the whole driver."""
    import ray

    from spotfill.fillin.grant import FixedGrant
    from spotfill.fillin.sweep import run_sweep

    raw = sweep_config(env, "slow-setup", trials=1)
    raw["sweep"].update(steps=8, checkpoint_every=4)
    cfg = make_cfg(raw)
    grant = FixedGrant(1, grace_s=5.0)
    job_id = ray.get_runtime_context().get_job_id()
    seen: dict = {}

    def drive():
        try:
            wait_for(lambda: job_pgs(job_id), 60, "the trial's placement group", every=0.05)
            time.sleep(1.5)                       # its actor is created and sleeps in setup (12 s)
            t_drop = time.monotonic()
            grant.set(0)
            wait_for(lambda: not job_pgs(job_id), 30, "the trial's placement group removed", every=0.05)
            seen["handback_s"] = time.monotonic() - t_drop
            time.sleep(1.0)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            seen["error"] = exc
        grant.set(1)

    t = threading.Thread(target=drive, daemon=True)
    t.start()
    events: list = []
    out = run_sweep(cfg, grant, setup_sleep_s=12.0,
                    emit=lambda kind, **f: events.append({"kind": kind, **f}))
    t.join(30)
    assert "error" not in seen, seen.get("error")
    assert any(e.get("action") == "deferred" for e in events), events     # stopped while starting
    assert seen["handback_s"] < grant.grace_s, f"GPU held {seen['handback_s']:.1f}s after the drop"
    assert out["completed"] == 1 and out["failed"] == 0, out
    (res,) = out["results"]
    assert res["history_ok"] is True and res["step"] == 8, res
    print(f"\ndrop during setup -> placement group removed: {seen['handback_s']:.2f}s")


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_a_trial_whose_actor_is_killed_resumes_from_its_checkpoint_without_repeating_steps(env):
    from spotfill.fillin.grant import FixedGrant
    from spotfill.fillin.sweep import run_sweep

    cfg = make_cfg(sweep_config(env, "kill-trial", trials=1))
    grant = FixedGrant(2)
    rec = recorder()
    killed: dict = {}

    def kill_once(row):
        # past the first periodic checkpoint (step CKPT_EVERY) and before the next one
        if not killed and row["step"] == CKPT_EVERY + PER_REPORT:
            killed.update(row)
            os.kill(row["pid"], signal.SIGKILL)

    rec.on_result = kill_once
    out = run_sweep(cfg, grant, callbacks=[rec], step_sleep_s=SLEEP_S)
    assert killed, "the trial never reached the kill point"
    assert out["completed"] == 1 and out["failed"] == 0 and out["recovered"] >= 1, out
    runs = incarnations(rec.of(killed["trial"]))
    assert len(runs) == 2, runs
    # restarted from its last checkpoint (step CKPT_EVERY), not from 0 and not from the lost step
    assert runs[1][0]["restored_from"] == CKPT_EVERY and runs[1][0]["first_step"] == CKPT_EVERY + 1
    assert runs[1][0]["pid"] != killed["pid"]
    # the keeper outlived the killed actor: its newest checkpoint's state came from host memory
    assert runs[1][0]["restored_via"] == "memory", runs[1][0]
    # the final weights saw every step exactly once (their own history), one output per trial
    (res,) = out["results"]
    assert res["history_ok"] is True and res["history_len"] == res["history_unique"] == STEPS, res
    assert res["step"] == STEPS and res["eval_loss"] is not None


# CI's time budget (`python -m pytest -m slow`); in CI a sweep's GPUs are taken back (and its trials paused and
# resumed) by test_nothing_starts_at_grant_zero_and_a_drop_pauses_trials_that_resume_from_their_checkpoint
@pytest.mark.slow
def test_a_training_claim_takes_the_sweeps_gpus_back_within_its_grace_and_the_sweep_finishes(env, tmp_path):
    import ray

    name = "claimed"
    cfg = sweep_config(env, name, grant="arbiter")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(cfg))
    tenant = f"sweep:{name}"

    def leases():
        st = ray.get(env["arbiter"].status.remote(last=50), timeout=30)
        return [le for le in st["leases"] if le["tenant"] == tenant]

    # longer trials than above (~16 s each), so that both hold a GPU at once when training claims
    errlog = open(tmp_path / "sweep.stderr", "w+")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "jobs", "sweep.py"), "--config", str(path),
                             "--steps", "120", "--step-sleep-s", "0.5"], stdout=subprocess.PIPE, stderr=errlog,
                            text=True, env={**os.environ, "RAY_ADDRESS": env["cluster"].address,
                                            "PYTHONPATH": os.path.join(ROOT, "platform")})

    def stderr_tail() -> str:
        errlog.flush()
        return (tmp_path / "sweep.stderr").read_text()[-3000:]

    try:
        try:
            wait_for(lambda: len(leases()) == 2 or proc.poll() is not None, 120, "both trials on lent GPUs",
                     every=0.3)
        except AssertionError:
            raise AssertionError(f"never 2 leases: {leases()}; sweep: {stderr_tail()}") from None
        assert proc.poll() is None, f"the sweep ended before the claim: {stderr_tail()}"
        events = os.path.join(cfg["run_dir"], "events.jsonl")

        def started() -> int:       # a placed group is a lease before its trial runs: wait for both to report
            return sum(1 for line in open(events) if '"action":"started"' in line) if os.path.exists(events) else 0
        wait_for(lambda: started() == 2, 60, "both trials reporting")
        answer = ray.get(env["arbiter"].claim.remote("train-sweep", 2, 20.0, 1, 1, 2), timeout=60)
        assert answer["ok"], answer
        assert len(answer["reclaimed"]) == 2, answer
        handback = answer["waited_s"]
        wait_for(lambda: not leases(), 10, "the arbiter to see the sweep's leases end")
        # nothing is lent while training holds the GPUs: no trial starts or resumes
        for _ in range(10):
            assert not leases()
            time.sleep(0.3)
        st = ray.get(env["arbiter"].status.remote(last=100), timeout=30)
        forced = [d for d in st["decisions"] if d["tenant"] == tenant and d["reason"].startswith("forced")]
        assert not forced, forced
        ray.get(env["arbiter"].release_job.remote("train-sweep"), timeout=30)
        stdout, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr_tail()
    summary = json.loads(stdout.strip().splitlines()[-1])
    report = json.loads(open(summary["report"]).read())
    s = report["fillin"]["sweep"]
    assert s["trials"] == 2 and s["completed"] == 2 and s["paused"] >= 2 and s["resumed"] >= 2, s
    assert s["best"]["config"] in ({"lr": 0.001, "warmup_steps": 0}, {"lr": 0.001, "warmup_steps": 4}), s
    assert len(s["handback_seconds"]) == 2 and max(s["handback_seconds"]) <= handback + 1.0, s
    assert handback < cfg["fillin"]["grace_s"], f"the sweep did not yield within its grace: {handback}s"
    kinds = [json.loads(line) for line in open(os.path.join(cfg["run_dir"], "events.jsonl"))]
    assert sum(1 for e in kinds if e["kind"] == "sweep_trial" and e["action"] == "paused") >= 2
    print(f"\nsweep hand-back (claim -> GPUs free): {handback:.2f}s; per lease {s['handback_seconds']}")
    # the trials resumed after the claim started on the job's warm standbys (fillin/sweep_standby.py): their
    # processes existed before the lend, with a trial's imports done
    journal = ray.get(env["arbiter"].journal_since.remote(0), timeout=30)["events"]
    starts = [e for e in journal if e["kind"] == "fillin_start" and e["tenant"] == tenant]
    print("sweep trial starts:", [(e["warm"], e["init_s"], e.get("standby_note")) for e in starts])
    assert len(starts) >= 4 and any(e["warm"] and e["process_age_s"] > e["init_s"] for e in starts), starts
