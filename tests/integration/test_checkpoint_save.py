"""The checkpoint save path with a real DeepSpeed engine (tiny model, world size 1, gloo) on the loopback S3
endpoint, under injected storage faults: an outage while training saves periodically, a slow periodic
upload when a preemption notice arrives, and an outage during the emergency save."""
from __future__ import annotations

import time

import pytest

from spotfill.config import constants
from spotfill.storage.base import RetryPolicy, open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.train.checkpointing import Checkpointer

# retries that keep trying through a few seconds of outage and notice its end within ~0.5 s
FAST_RETRY = RetryPolicy(attempts=1000, base_s=0.1, max_s=0.5, deadline_s=60.0)


@pytest.fixture(scope="module")
def engine():
    from benchmarks._common import single_rank_dist
    from benchmarks.checkpoint import build_engine

    with single_rank_dist():
        eng, step, _ = build_engine("tiny")
        step()                                  # Adam state exists
        yield eng, step


@pytest.fixture
def ckpt_store(s3_uri, tmp_path):
    store = CheckpointStore(open_storage(s3_uri, retry=FAST_RETRY), keep_last=0)
    ckpt = Checkpointer(store, str(tmp_path / "local"), rank=0, world_size=1, attempt="0")
    yield ckpt, store
    ckpt.close(wait=False)


def has_manifest(store, step) -> bool:
    return store.storage.exists(f"{store.prefix}/{tag_for(step)}/manifest.json")


def test_training_keeps_stepping_through_an_outage_and_the_newest_checkpoint_commits(engine, ckpt_store,
                                                                                      s3_server):
    eng, step = engine
    ckpt, store = ckpt_store
    ckpt.save(eng, 1, {}, kind="periodic")
    assert ckpt.uploader.wait(30) and [c["step"] for c in ckpt.pop_committed()] == [1]
    outage_s, saves, n = 4.0, [], 1
    with s3_server.outage():
        t_end = time.monotonic() + outage_s
        while time.monotonic() < t_end:
            step()
            n += 1
            if n % 3 == 0:
                saves.append(ckpt.save(eng, n, {}, kind="periodic"))
    assert len(saves) >= 4, "too few saves during the outage to show coalescing"
    stalls = [s["stall_s"] for s in saves]
    # the step loop waited for snapshots only: nothing like the outage (before: >= the outage per save)
    assert max(stalls) < 1.0 and sum(s["blocked_s"] for s in saves) < 0.5, stalls
    assert saves[0]["path"] == "started" and all(s["path"] == "pending" for s in saves[1:])
    assert ckpt.uploader.wait(30)                    # the endpoint is back: the uploads finish
    committed = [c["step"] for c in ckpt.pop_committed()]
    skipped = ckpt.pop_skipped()
    newest = saves[-1]["step"]
    assert committed == [saves[0]["step"], newest]   # the one on the wire, then the newest snapshot
    assert [s["step"] for s in skipped] == [s["step"] for s in saves[1:-1]]
    assert all("superseded by step" in s["reason"] for s in skipped)
    assert store.latest()["step"] == newest and not any(has_manifest(store, s["step"]) for s in skipped)


def test_emergency_save_cancels_a_slow_periodic_upload_and_commits_before_the_deadline(
        engine, ckpt_store, monkeypatch):
    eng, step = engine
    ckpt, store = ckpt_store
    monkeypatch.setattr(constants, "EMERGENCY_MARGIN_S", 1.0)
    ckpt.save(eng, 10, {}, kind="periodic")          # measured: the emergency's estimate
    assert ckpt.uploader.wait(30)
    real_upload_dir = store.storage.upload_dir

    def slow_upload_dir(local_dir, key_prefix):      # fault: step 20's upload crawls
        if tag_for(20) in key_prefix:
            time.sleep(5.0)
        return real_upload_dir(local_dir, key_prefix)
    monkeypatch.setattr(store.storage, "upload_dir", slow_upload_dir)
    ckpt.save(eng, 20, {}, kind="periodic")
    periodic = ckpt.uploader.active
    step()
    deadline = time.time() + 4.0
    res = ckpt.save(eng, 21, {}, kind="emergency", deadline_unix_s=deadline)
    took = time.time() - (deadline - 4.0)
    assert res["committed"] and res["path"] == "fresh" and res["step"] == 21, res
    assert took < 4.0 - 1.0 and res["budget_s"] <= 4.0
    assert [s["step"] for s in ckpt.pop_skipped()] == [20]
    assert store.latest()["step"] == 21
    assert periodic.wait(15)                         # the slow upload wound down ...
    assert periodic.state == "cancelled" and not has_manifest(store, 20)   # ... and never committed
    assert store.restore(str(ckpt.disk_root) + "-restore")["step"] == 21


def test_emergency_save_during_an_outage_is_abandoned_uncommitted_before_the_deadline(
        engine, ckpt_store, s3_server, monkeypatch):
    eng, _ = engine
    ckpt, store = ckpt_store
    monkeypatch.setattr(constants, "EMERGENCY_MARGIN_S", 1.0)
    with s3_server.outage():
        deadline = time.time() + 3.0
        res = ckpt.save(eng, 30, {}, kind="emergency", deadline_unix_s=deadline)
        assert time.time() < deadline - 0.5
    assert not res["committed"] and "abandoned uncommitted" in res["reason"], res
    assert [s["step"] for s in ckpt.pop_skipped()] == [30]
    time.sleep(1.5)                                  # the endpoint is back; the upload may resume ...
    assert not has_manifest(store, 30) and store.latest() is None       # ... it never commits
