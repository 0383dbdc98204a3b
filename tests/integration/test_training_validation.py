"""Bad configs are rejected up front, before any worker (GPU time) starts."""
from __future__ import annotations

import pytest

from spotfill.config.job import JobConfig, from_mapping
from spotfill.config.errors import ConfigError
from spotfill.train.job import TrainingJob


def _job(**kw) -> TrainingJob:
    return TrainingJob(from_mapping(JobConfig, {"storage": "/tmp/x", "data": {"path": "/tmp/y"}, **kw}))


def test_unreachable_storage(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    job = _job(storage="s3://bucket/run?endpoint_override=http://127.0.0.1:9")
    with pytest.raises(ConfigError, match=r"^storage: .*unreachable"):
        job.validate()


def test_bad_credentials(s3_server, s3_uri, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with s3_server.strict_auth():
        with pytest.raises(ConfigError) as err:
            _job(storage=s3_uri, data={"path": str(tmp_path)}).validate()
    assert "wrong-secret" not in str(err.value)


def test_missing_dataset(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path: .*manifest"):
        _job(storage=str(tmp_path / "ckpt"), data={"path": str(tmp_path)}).validate()


@pytest.mark.parametrize("training, field", [
    ({"workers": [3, 1]}, "training.workers"),
    ({"model": "gpt-17"}, "training.model"),
    ({"workers": [1, 3], "global_batch": 16}, "training.global_batch"),
])
def test_bad_training_section(training, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        _job(training=training)


# --- numeric SPOTFILL_* environment variables: every entrypoint validates them all up front -------------------

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
BAD_RETRIES = "SPOTFILL_STORAGE_RETRIES: bad value 'abc'; accepted: an integer >= 1"


def _run(args: list[str], cwd, **env) -> "subprocess.CompletedProcess":
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO / "platform"), **env})


def _one_line_exit_2(r, expected: str) -> None:
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr and r.stderr == expected + "\n", r.stderr[-3000:]


@pytest.mark.parametrize("script", ["pretrain.py", "prepare_data.py"])
def test_jobs_reject_a_bad_environment_number_in_one_line(tmp_path, script):
    config = REPO / "examples" / ("tiny-cpu.yaml" if script == "pretrain.py" else "prepare-stdlib.yaml")
    r = _run([str(REPO / "jobs" / script), "--config", str(config)], tmp_path, SPOTFILL_STORAGE_RETRIES="abc")
    _one_line_exit_2(r, f"{script}: error: {BAD_RETRIES}")


@pytest.mark.parametrize("name, raw, accepted", [
    ("SPOTFILL_STORAGE_RETRIES", "abc", "an integer >= 1"),
    ("SPOTFILL_SPOT_POLL_S", "0", "a number > 0"),          # read by spot-watch only; checked for every command
    ("SPOTFILL_CHECKPOINT_COMMIT_TIMEOUT_S", "nan", "a number > 0"),
])
def test_spotfill_cli_rejects_a_bad_environment_number_in_one_line(tmp_path, name, raw, accepted):
    ok = _run(["-m", "spotfill", "plan", "--params", "125M", "--gpus", "1", "--json"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-2000:]
    r = _run(["-m", "spotfill", "plan", "--params", "125M", "--gpus", "1", "--json"], tmp_path, **{name: raw})
    _one_line_exit_2(r, f"spotfill: error: {name}: bad value {raw!r}; accepted: {accepted}")


def test_training_job_validate_rejects_a_bad_environment_number(tmp_path, monkeypatch):
    import numpy as np

    from spotfill.storage.base import open_storage
    from spotfill.train.data import BYTE_VOCAB, ShardWriter

    writer = ShardWriter(open_storage(str(tmp_path / "data")), 8, BYTE_VOCAB, "bytes")
    writer.add(np.zeros((32, 9), dtype=np.int64))
    writer.close()
    job = _job(storage=str(tmp_path / "ckpt"), data={"path": str(tmp_path / "data")})
    monkeypatch.setenv("SPOTFILL_STORAGE_RETRIES", "abc")    # set after spotfill was imported
    with pytest.raises(ConfigError) as err:
        job.validate()
    assert str(err.value) == BAD_RETRIES
