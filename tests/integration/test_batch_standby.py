"""Warm standbys for a batch job's GPU actors on a real local cluster (one node with one GPU slot, the arbiter
lending it; the batch driver is jobs/batch_infer.py, as users submit it): while training holds the slot, the
job's keeper has the node's raylet prestart a standby process of the job that imports a UnitWorker's code and
reads the plan's pinned model into host memory, holding no GPU; when training lets the slot go, the arbiter
lends it, the wave's actor lands on the standby's process and starts warm (its `fillin_start` event says so:
its process existed before the lend, nothing was loaded from storage), and every row lands exactly once. The
same job with `standby_per_node: 0` starts its actor cold (loaded from the plan). Numbers printed as
`BATCH-METRIC name value`."""
from __future__ import annotations

import json
import time

import pytest
import yaml

from spotfill.testing.waiting import wait_for
from test_batch_infer import EVAL_ROWS, driver, expected_ids, finish, ids_in_output, inputs, write_config  # noqa: F401

pytestmark = pytest.mark.timeout(600)
PROMPTS = 160


def metric(name: str, value) -> None:
    print(f"BATCH-METRIC {name} {value}")


def standby_records() -> dict[str, dict]:
    from spotfill.fillin.batch_standby import RECORD_PREFIX
    from spotfill.ray_compat import kv_get, kv_list
    out = {}
    for key in kv_list(RECORD_PREFIX):
        raw = kv_get(key)
        if raw is not None:
            out[key] = json.loads(raw)
    return out


def starts(arbiter) -> list[dict]:
    import ray
    return [e for e in ray.get(arbiter.journal_since.remote(0), timeout=30)["events"]
            if e["kind"] == "fillin_start" and e.get("workload") == "batch"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from spotfill.sim.fillin_cluster import fillin_cluster
    with fillin_cluster(1, 1, str(tmp_path_factory.mktemp("arbiter") / "state.json")) as (cluster, arbiter):
        yield {"cluster": cluster, "arbiter": arbiter}


def run_job(env, inputs, tmp_path, name: str, standby_per_node: int) -> dict:
    """Training holds the slot while the job plans (and its standby warms); then lets it go."""
    import ray
    arbiter = env["arbiter"]
    ray.get(arbiter.register_job.remote("train", 1, 1), timeout=30)
    assert ray.get(arbiter.claim.remote("train", 1, 15.0, 1, 1, 1), timeout=60)["ok"]
    path = tmp_path / f"{name}.yaml"
    write_config(path, inputs, str(tmp_path / "out"), units=0, max_tokens=8)
    cfg = yaml.safe_load(path.read_text())
    cfg["cluster"]["standby_per_node"] = standby_per_node
    path.write_text(yaml.safe_dump(cfg))
    seen = len(starts(arbiter))
    proc = driver(env, str(path))
    try:
        if standby_per_node:
            wait_for(lambda: any(r["state"] == "ready" and r.get("tag") for r in standby_records().values()), 240,
                     "a batch standby holding the plan's model")
        else:
            time.sleep(5)                  # the driver has planned and asks for a GPU
        before = standby_records()
        t_lend = time.time()
        ray.get(arbiter.release_job.remote("train"), timeout=30)
        wait_for(lambda: len(starts(arbiter)) > seen, 240, "the lent actor's fillin_start event")
        start = starts(arbiter)[seen]
        summary = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    return {"start": start, "t_lend": t_lend, "before": before, "summary": summary, "output": str(tmp_path / "out")}


def test_a_lent_gpu_runs_its_first_unit_on_the_jobs_warm_standby(env, inputs, tmp_path):
    got = run_job(env, inputs, tmp_path, "warm", 1)
    start = got["start"]
    metric("standby_start", json.dumps(start))
    assert start["warm"] is True and start["standby"] is True, start
    assert start["load_s"] is None and start["wake_s"] is not None, start           # nothing read from storage
    # the actor's process is the standby: it existed before the lend, with its imports and the model
    assert start["t"] - start["init_s"] - start["process_age_s"] < got["t_lend"], start
    assert start["host_bytes"] > 0 and start["tenant"] == "batch:warm", start
    # the GPU it computes on is exactly its lease's: the process sees only what Ray assigned the actor
    device = start["device"]
    assert device["gpu_ids"] and device["cuda_visible_devices"].split(",") == device["gpu_ids"], start
    pids = {int(k.rsplit(":", 1)[1]) for k in got["before"]}
    assert pids, got["before"]
    assert sorted(ids_in_output(got["output"])) == expected_ids(EVAL_ROWS, PROMPTS), "every row exactly once"
    metric("init_s_warm", start["init_s"])
    metric("lend_to_started_s_warm", round(start["t"] - got["t_lend"], 3))


@pytest.mark.slow   # CI's time budget: the cold baseline; `spotfill bench --only fillin` runs the same comparison
def test_without_standbys_the_same_lend_starts_its_actor_cold(env, inputs, tmp_path):
    got = run_job(env, inputs, tmp_path, "cold", 0)
    start = got["start"]
    metric("cold_start", json.dumps(start))
    assert start["warm"] is False and start["standby"] is False and start["load_s"] is not None, start
    assert (got["summary"]["rows_written"], got["summary"]["duplicates"]) == (EVAL_ROWS + PROMPTS, 0)
    metric("init_s_cold", start["init_s"])
    metric("lend_to_started_s_cold", round(start["t"] - got["t_lend"], 3))
