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
