"""Training jobs announce themselves in the GCS (fillin/wiring.py): an arbiter that starts after the job reads
the record and never lends the GPUs the job may grow into; the record of a job whose driver died unannounced
is dropped, so its GPUs are lent again. On the real Arbiter (tick loop idle) with the GCS reads stood in."""
from __future__ import annotations

import json

import pytest

from spotfill import ray_compat
from spotfill.fillin import wiring
from spotfill.fillin.arbiter import RECORDS_EVERY_S, Arbiter
from spotfill.train import arbiter_link


@pytest.fixture
def gcs(monkeypatch):
    kv: dict[str, str] = {}
    dead: set[str] = set()
    monkeypatch.setattr(ray_compat, "kv_put", lambda k, v: kv.__setitem__(k, v))
    monkeypatch.setattr(ray_compat, "kv_get", lambda k: kv.get(k))
    monkeypatch.setattr(ray_compat, "kv_list", lambda prefix: [k for k in kv if k.startswith(prefix)])
    monkeypatch.setattr(ray_compat, "kv_del", lambda k: kv.pop(k, None))
    monkeypatch.setattr(ray_compat, "dead_job_ids", lambda: set(dead))
    return kv, dead


def record(kv, name, lo, hi, job_id):
    kv[wiring.TRAINING_KEY + name] = json.dumps(wiring.training_record(name, lo, hi, 1, job_id))


def test_an_arbiter_started_after_training_registers_the_announced_job(gcs, tmp_path):
    kv, _ = gcs
    record(kv, "pretrain", 2, 6, "02000000")
    arb = Arbiter("GPU", state_path=str(tmp_path / "s.json"), interval_s=3600, autoscaled=False)
    arb._read_training_records(1000.0)
    job = arb.jobs["pretrain"]
    assert (job.min_workers, job.max_workers, job.gpus_per_worker) == (2, 6, 1)
    assert any(d.action == "adopt" and "announced in the GCS" in d.reason for d in arb.decisions.items)


def test_a_dead_drivers_record_is_dropped_and_its_job_released(gcs, tmp_path):
    kv, dead = gcs
    record(kv, "pretrain", 1, 4, "03000000")
    arb = Arbiter("GPU", state_path=str(tmp_path / "s.json"), interval_s=3600, autoscaled=False)
    arb._read_training_records(1000.0)
    assert "pretrain" in arb.jobs
    dead.add("03000000")                                   # the driver was killed: nothing withdrew it
    arb._read_training_records(1000.0 + RECORDS_EVERY_S / 2)
    assert "pretrain" in arb.jobs                          # read at most every RECORDS_EVERY_S
    arb._read_training_records(1000.0 + RECORDS_EVERY_S)
    assert "pretrain" not in arb.jobs and wiring.TRAINING_KEY + "pretrain" not in kv
    drop = [d for d in arb.decisions.items if d.action == "drop"]
    assert drop and "03000000" in drop[0].reason and "lent again" in drop[0].reason


def test_a_withdrawn_job_is_not_registered_again(gcs, tmp_path, monkeypatch):
    kv, _ = gcs
    monkeypatch.setattr(arbiter_link, "get_arbiter", lambda: None)
    record(kv, "pretrain", 1, 2, "04000000")
    wiring.withdraw_training("pretrain")
    arb = Arbiter("GPU", state_path=str(tmp_path / "s.json"), interval_s=3600, autoscaled=False)
    arb._read_training_records(1000.0)
    assert arb.jobs == {}
