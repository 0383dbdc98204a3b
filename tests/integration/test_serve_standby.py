"""Warm standby Serve replicas on a real local cluster (one node with one GPU slot, the arbiter lending it):
while training holds the slot, the Ingress's keeper has the node's raylet prestart a standby process that
imports the replica's code and loads the checkpoint into host memory, holding no GPU; when training lets
the slot go, the arbiter lends it, Serve places the Generator replica, and Ray hands it the standby's
process: the replica starts warm (its `fillin_start` event says so, its process existed before the lend
and it did not load the checkpoint), answers, and the keeper starts the next standby. With standbys off the
same lend starts cold (loaded from storage). Measured numbers are printed as `SERVE-METRIC name value`."""
from __future__ import annotations

import json
import time

import pytest

from spotfill.sim.cluster import free_port
from spotfill.testing.waiting import wait_for
from test_serve_reclaim import metric, post, tiny_checkpoint

pytestmark = pytest.mark.timeout(600)
APP = "spotfill-serve"


def standby_records() -> dict[str, dict]:
    from spotfill.ray_compat import kv_get, kv_list
    from spotfill.serving.standby import RECORD_PREFIX
    out = {}
    for key in kv_list(f"{RECORD_PREFIX}{APP}:"):
        raw = kv_get(key)
        if raw is not None:
            out[key] = json.loads(raw)
    return out


def starts(arbiter) -> list[dict]:
    import ray
    return [e for e in ray.get(arbiter.journal_since.remote(0), timeout=30)["events"] if e["kind"] == "fillin_start"]


def lend_after_standby(tmp_path_factory, standby_per_node: int) -> dict:
    """Training holds the node's slot while the app deploys (and its standby warms up); then lets it go."""
    import ray

    from spotfill.serving.deploy import deploy_serve
    from spotfill.sim.fillin_cluster import fillin_cluster

    uri = f"file://{tmp_path_factory.mktemp('ckpt')}/run"
    tiny_checkpoint(uri)
    with fillin_cluster(1, 1, str(tmp_path_factory.mktemp("arbiter") / "state.json")) as (cluster, arbiter):
        ray.get(arbiter.register_job.remote("train", 1, 1), timeout=30)
        assert ray.get(arbiter.claim.remote("train", 1, 15.0, 1, 1, 1), timeout=60)["ok"]
        out = deploy_serve(uri, port=free_port(), max_replicas=1, replicas=0, reload_s=30,
                           standby_per_node=standby_per_node)
        if standby_per_node:
            wait_for(lambda: any(r["state"] == "ready" and r.get("tag") for r in standby_records().values()), 240,
                     "a standby with the checkpoint loaded")
        before = standby_records()
        t_lend = time.time()
        ray.get(arbiter.release_job.remote("train"), timeout=30)
        wait_for(lambda: starts(arbiter), 240, "the lent replica's fillin_start event")
        start = starts(arbiter)[0]
        status, answer = post(out["url"] + "/v1/completions", {"prompt": "hello", "max_tokens": 4,
                                                               "temperature": 0})
        after = {}
        if standby_per_node:    # the keeper replaces the standby the replica took (its own test says if not)
            try:
                wait_for(lambda: any(k not in before for k in standby_records()), 120, "the next standby")
            except AssertionError:
                pass
            after = standby_records()
        return {"start": start, "t_lend": t_lend, "status": status, "answer": answer, "before": before,
                "after": after}


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    return lend_after_standby(tmp_path_factory, 1)


def test_a_lend_starts_its_replica_on_the_warm_standby(warm):
    start = warm["start"]
    metric("standby_start", json.dumps(start))
    assert start["warm"] is True and start["standby"] is True, start
    assert start["load_s"] is None and start["wake_s"] is not None, start       # no load from storage
    # the replica's process existed before the lend (the standby), with its imports done
    assert start["process_age_s"] > 0 and time.time() - start["process_age_s"] > 0, start
    assert start["t"] - start["init_s"] - start["process_age_s"] < warm["t_lend"], start
    pids = {int(k.rsplit(":", 1)[1]) for k in warm["before"]}
    assert pids, warm["before"]
    assert warm["status"] == 200 and warm["answer"]["usage"]["completion_tokens"] >= 1, warm["answer"]


def test_the_keeper_starts_the_next_standby_after_a_lend_took_one(warm):
    new = [k for k in warm["after"] if k not in warm["before"]]
    assert new and all(warm["after"][k]["state"] in ("warming", "ready") for k in new), warm["after"]


@pytest.mark.slow   # CI's time budget: the cold baseline; `spotfill bench --only fillin` runs the same comparison
def test_without_standbys_the_same_lend_starts_cold(tmp_path_factory, warm):
    """The comparison the warm start is measured against (the same lend, standby_per_node 0)."""
    cold = lend_after_standby(tmp_path_factory, 0)
    metric("cold_start", json.dumps(cold["start"]))
    assert cold["start"]["warm"] is False and cold["start"]["standby"] is False and cold["start"]["load_s"] is not None
    assert cold["status"] == 200
    metric("init_s_warm_vs_cold", [warm["start"]["init_s"], cold["start"]["init_s"]])
