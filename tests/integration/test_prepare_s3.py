"""Data preparation reads its source from S3 (loopback endpoint) exactly as from a local folder."""
from __future__ import annotations

import json

import pytest

from spotfill.config.job import PrepareConfig, from_mapping
from spotfill.storage.base import open_storage


@pytest.fixture(scope="module")
def ray_local(s3_server):          # after s3_server: Ray's workers inherit its AWS_* environment
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _docs():
    return {f"docs/part-{i}.txt": (f"document {i}: " + "spot notice, drain, checkpoint. " * (40 + i)).encode()
            for i in range(6)}


def test_prepare_from_s3_matches_a_local_source(ray_local, s3_uri, tmp_path):
    from spotfill.train.prepare import prepare

    src = open_storage(s3_uri)
    local_src = tmp_path / "src"
    for key, data in _docs().items():
        src.put_bytes(key, data)
        (local_src / key).parent.mkdir(parents=True, exist_ok=True)
        (local_src / key).write_bytes(data)
    src.put_bytes("docs/skip.bin", b"not text")      # the suffix filter applies on S3 too

    def run(source, out):
        return prepare(from_mapping(PrepareConfig, {"source": source, "output": str(out), "seq_len": 32,
                                                    "suffixes": [".txt"]}))

    base, query = s3_uri.split("?", 1)
    from_s3 = run(f"{base}/docs?{query}", tmp_path / "from-s3")
    from_local = run(str(local_src / "docs"), tmp_path / "from-local")
    assert from_s3["files"] == from_local["files"] == 6
    assert from_s3["num_samples"] == from_local["num_samples"] > 0
    def shards(folder):
        return [(s["key"], s["num_samples"], s["sha256"])
                for s in json.loads((folder / "manifest.json").read_text())["shards"]]

    assert shards(tmp_path / "from-s3") == shards(tmp_path / "from-local")   # the same tokens, byte for byte
