"""Bad input against a real local cluster (spotfill.sim.cluster.EmbeddedCluster: a head with no slots and one
node with 2 GPU_SLOTs), all on loopback:

- every node of the embedded cluster binds 127.0.0.1;
- a misspelled cluster.gpu_resource, or more workers than the cluster can ever hold, fails in seconds with
  exit 2 and one line (jobs/pretrain.py in a subprocess, and TrainingJob.validate in process), instead of a
  placement group that waits forever;
- training.seq_len that does not match the prepared dataset is refused at validate;
- an S3 endpoint given only as AWS_ENDPOINT_URL on the driver reaches the Ray Train workers: a short run
  reads its shards and commits its checkpoints through the loopback S3 server.

Run under the shared lock: flock /tmp/spotfill-ray.lock timeout 900 python3 -m pytest -q -x <this file>
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from spotfill.config import constants
from spotfill.config.errors import ConfigError
from spotfill.config.job import JobConfig, from_mapping

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 16


@pytest.fixture(scope="module")
def cluster(s3_server):
    """Started after s3_server: the raylets (and so every Ray worker) inherit its keys and region but no
    endpoint -- the fixture exports none, exactly like a worker node that was never told about it. A short
    storage retry deadline makes a worker that cannot reach storage fail in seconds, not minutes."""
    import ray

    from spotfill.sim.cluster import EmbeddedCluster

    with constants.scoped_env(SPOTFILL_STORAGE_RETRY_DEADLINE_S="10", AWS_ENDPOINT_URL=None,
                              AWS_ENDPOINT_URL_S3=None):
        c = EmbeddedCluster("GPU_SLOT", head_cpus=1)
        c.add_node(2)
    ray.init(address=c.address, logging_level="WARNING")
    try:
        yield c
    finally:
        c.shutdown()


def _dataset(storage, rows: int = 256) -> dict:
    from spotfill.train.data import BYTE_VOCAB, ShardWriter

    writer = ShardWriter(storage, SEQ_LEN, BYTE_VOCAB, "bytes", rows_per_shard=128)
    writer.add(np.random.default_rng(0).integers(0, 256, size=(rows, SEQ_LEN + 1)))
    return writer.close()


@pytest.fixture(scope="module")
def local_data(tmp_path_factory) -> str:
    from spotfill.storage.base import open_storage

    path = str(tmp_path_factory.mktemp("data"))
    _dataset(open_storage(path))
    return path


def _config(tmp_path, data: str, storage: str | None = None, **sections) -> JobConfig:
    training = {"model": "tiny", "workers": [1, 1], "steps": 4, "global_batch": 4, "max_micro_batch": 4,
                "checkpoint_every": 2, "precision": "fp32", "max_failures": 0, **sections.pop("training", {})}
    return from_mapping(JobConfig, {"name": "pf", "run_dir": str(tmp_path / "run"),
                                    "storage": storage or str(tmp_path / "ckpt"), "data": {"path": data},
                                    "training": training,
                                    "cluster": {"gpu_resource": "GPU_SLOT", **sections.pop("cluster", {})},
                                    **sections})


def test_every_node_of_the_embedded_cluster_binds_loopback(cluster):
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}, [n["NodeManagerAddress"] for n in nodes]
    assert {n["NodeManagerHostname"] for n in nodes} and cluster.address.startswith("127.0.0.1:")
    assert all("node:127.0.0.1" in n["Resources"] for n in nodes)
    # and every socket its processes (children of this one) listen on is a loopback one
    import psutil

    listening = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            listening |= {(proc.name(), c.laddr.ip) for c in proc.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    assert any(name == "gcs_server" for name, _ in listening), listening
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening


@pytest.mark.parametrize("flags, expected, tail", [
    (["--config", "{cfg}"], "pretrain.py: error: cluster.gpu_resource: 'GPU_SLTO' is not a resource of any "
                            "node (counted the 2 nodes alive now; ",
     "; accepted: a resource the nodes offer: CPU, GPU_SLOT, memory, object_store_memory"),
    (["--config", "{ok}"], "pretrain.py: error: training.workers: a minimum of 3 workers ({GPU_SLOT: 1, CPU: 1} "
                           "each) can never be placed: the cluster holds at most 2 (GPU_SLOT 2 in total",
     "; accepted: a minimum <= 2, a smaller cluster.cpus_per_worker, or more nodes"),
])
def test_pretrain_fails_in_seconds_on_what_the_cluster_cannot_offer(cluster, local_data, tmp_path, flags, expected,
                                                                    tail):
    import yaml

    base = {"name": "pf", "run_dir": str(tmp_path / "run"), "storage": str(tmp_path / "ckpt"),
            "data": {"path": local_data}, "training": {"model": "tiny", "workers": [3, 4], "global_batch": 12},
            "cluster": {"gpu_resource": "GPU_SLTO"}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump({**base, "cluster": {"gpu_resource": "GPU_SLOT"}}))
    args = [a.format(cfg=tmp_path / "bad.yaml", ok=tmp_path / "ok.yaml") for a in flags]
    from spotfill.sim.cluster import LOOPBACK_CLIENT_ENV

    env = {**os.environ, "RAY_ADDRESS": cluster.address, **LOOPBACK_CLIENT_ENV}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(REPO / "jobs" / "pretrain.py"), *args], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    errors = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(expected) and errors[0].endswith(tail), r.stderr[-3000:]
    assert seconds < 60, seconds
    assert not (tmp_path / "run").exists()            # nothing started
    print(f"\nfailed in {seconds:.1f}s: {errors[0]}")


def test_validate_refuses_too_many_workers_in_process(cluster, local_data, tmp_path):
    from spotfill.train.job import TrainingJob

    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        TrainingJob(_config(tmp_path, local_data, training={"workers": [2, 4], "global_batch": 12},
                            cluster={"cpus_per_worker": 1.5})).validate()
    assert err.value.field == "training.workers" and "holds at most 1 " in str(err.value)
    assert time.monotonic() - t0 < 30


def test_seq_len_must_match_the_dataset(cluster, local_data, tmp_path):
    from spotfill.train.job import TrainingJob

    with pytest.raises(ConfigError) as err:
        TrainingJob(_config(tmp_path, local_data, training={"seq_len": 1024})).validate()
    assert str(err.value).startswith(f"training.seq_len: 1024 does not match the prepared dataset's seq_len "
                                     f"{SEQ_LEN} (data.path {local_data})")
    TrainingJob(_config(tmp_path, local_data, training={"seq_len": SEQ_LEN})).validate()


def test_s3_endpoint_only_in_the_driver_environment_reaches_the_workers(cluster, s3_server, tmp_path, monkeypatch):
    from spotfill.sim.cluster import worker_env
    from spotfill.storage.base import open_storage
    from spotfill.train.job import TrainingJob

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)    # the only place the endpoint is given
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    prefix = f"s3://{s3_server.bucket}/endpoint-env-{uuid.uuid4().hex[:8]}"
    assert "endpoint_override" not in prefix
    _dataset(open_storage(f"{prefix}/data"))
    job = TrainingJob(_config(tmp_path, f"{prefix}/data", storage=f"{prefix}/ckpt"),
                      runtime_env={"env_vars": worker_env()})
    report = job.fit()
    assert report["ok"] and report["training"]["steps_completed"] == 4, report
    keys = list(open_storage(f"{prefix}/ckpt").list())
    assert any(k.endswith("manifest.json") for k in keys), keys          # committed through the workers
