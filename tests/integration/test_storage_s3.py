"""Storage against a real S3 endpoint on loopback (moto's server) and the local backend."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from spotfill.config.errors import ConfigError, StorageError
from spotfill.testing.ports import free_port
from spotfill.storage.base import RetryPolicy, S3Storage, open_storage

FAST_RETRY = RetryPolicy(attempts=60, base_s=0.05, max_s=0.25, deadline_s=20)


@pytest.fixture(params=["s3", "local"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "store"))
    return open_storage(request.getfixturevalue("s3_uri"))


def write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_round_trips(storage, tmp_path):
    storage.put_bytes("a/b.json", b'{"x": 1}')
    assert storage.get_bytes("a/b.json") == b'{"x": 1}'
    assert storage.exists("a/b.json") and not storage.exists("a/c.json")
    with pytest.raises(FileNotFoundError):
        storage.get_bytes("a/c.json")
    (tmp_path / "f.bin").write_bytes(b"z" * 4096)
    assert storage.put_file(str(tmp_path / "f.bin"), "a/f.bin") == 4096
    assert storage.get_file("a/f.bin", str(tmp_path / "dl" / "f.bin")) == 4096
    assert (tmp_path / "dl" / "f.bin").read_bytes() == b"z" * 4096
    storage.put_bytes("a-sibling", b"1")
    assert storage.list("a/") == {"a/b.json": 8, "a/f.bin": 4096}
    assert list(storage.list("a")) == ["a-sibling", "a/b.json", "a/f.bin"]
    assert storage.delete_prefix("a") == 2
    assert list(storage.list()) == ["a-sibling"]
    storage.delete("a-sibling")
    assert storage.list() == {}


def test_upload_download_dir_nested_with_multipart_file(storage, tmp_path, s3_server):
    src = tmp_path / "src"
    big = os.urandom(1 << 20) * 21                      # 22 MB: several multipart parts
    small = {"model/a.pt": os.urandom(1000), "model/deep/er/b.pt": os.urandom(70_000), "empty": b""}
    write(str(src / "zero" / "optim.pt"), big)
    for rel, data in small.items():
        write(str(src / rel), data)
    up = storage.upload_dir(str(src), "ckpt/step-1")
    assert up.bytes == len(big) + sum(map(len, small.values())) and len(up.files) == 4
    assert storage.list("ckpt/step-1/")["ckpt/step-1/zero/optim.pt"] == len(big)
    if isinstance(storage, S3Storage):                  # it really went multipart
        head = s3_server.client().head_object(Bucket=storage.bucket,
                                              Key=f"{storage.prefix}/ckpt/step-1/zero/optim.pt")
        assert head["ETag"].strip('"').rsplit("-", 1)[-1] == str(-(-len(big) // storage.chunk_bytes))
    down = storage.download_dir("ckpt/step-1", str(tmp_path / "back"))
    assert down.files == up.files
    assert (tmp_path / "back" / "zero" / "optim.pt").read_bytes() == big
    for rel, data in small.items():
        assert (tmp_path / "back" / rel).read_bytes() == data


def test_child_storage_shares_the_bucket(s3_uri):
    parent = open_storage(s3_uri)
    child = parent.child("run-7")
    child.put_bytes("x", b"1")
    assert parent.get_bytes("run-7/x") == b"1"
    assert child.list() == {"x": 1}


# -- check() -------------------------------------------------------------------------------------------
def test_check_ok(s3_uri):
    open_storage(s3_uri).check()
    assert open_storage(s3_uri).list() == {}  # the write probe leaves nothing behind


def test_check_missing_bucket(s3_server):
    uri = s3_server.uri("x").replace(f"s3://{s3_server.bucket}/", "s3://no-such-bucket-here/")
    with pytest.raises(ConfigError, match="bucket 'no-such-bucket-here' does not exist") as info:
        open_storage(uri).check()
    assert "\n" not in str(info.value) and str(info.value).startswith("storage: ")


def test_check_unreachable_endpoint_is_fast():
    uri = f"s3://bkt/p?endpoint_override=http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="unreachable") as info:
        open_storage(uri).check()
    assert time.monotonic() - t0 < 5
    assert "\n" not in str(info.value)


def test_check_bad_credentials_without_leaking_them(s3_server, monkeypatch):
    # Keys in the URI (pyarrow style) and keys in the environment: both rejected, neither printed.
    bad_uri = s3_server.uri("p") + "&access_key=AKIABADBADBAD0000000&secret_key=sup3r-s3cret-VALUE"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-s3cret-VALUE")
    with s3_server.strict_auth():
        with pytest.raises(ConfigError, match="credentials rejected") as info:
            open_storage(bad_uri).check()
        with pytest.raises(ConfigError, match=r"credentials rejected \(SignatureDoesNotMatch") as info2:
            open_storage(s3_server.uri("p")).check()        # right key id, wrong secret from env
        # the right keys again -- all of this server's settings, since a scenario run earlier in the session
        # (sim/runner.py, its own LocalS3) may have left other AWS_* values in this process's environment
        for name, value in s3_server.env().items():
            if not name.startswith("AWS_ENDPOINT_URL"):
                monkeypatch.setenv(name, value)
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            monkeypatch.delenv(name, raising=False)
        open_storage(s3_server.uri("p")).check()
    for exc in (info.value, info2.value):
        text = str(exc)
        assert "\n" not in text
        for secret in ("sup3r-s3cret-VALUE", "env-s3cret-VALUE", "AKIABADBADBAD0000000"):
            assert secret not in text


# -- faults -------------------------------------------------------------------------------------------
def test_outage_then_recovery_with_retries(s3_server, s3_uri, tmp_path, caplog):
    st = open_storage(s3_uri, retry=FAST_RETRY, request_attempts=1)
    st.put_bytes("before", b"1")
    write(str(tmp_path / "d" / "x" / "y.bin"), b"y" * 10_000)
    caplog.set_level(logging.WARNING, logger="spotfill.storage.base")
    restored = s3_server.outage_for(1.0)
    t0 = time.monotonic()
    st.put_bytes("during", b"2")                       # retried until the endpoint is back
    assert time.monotonic() - t0 >= 0.5
    restored.join()
    assert st.get_bytes("before") == b"1" and st.get_bytes("during") == b"2"
    assert any("retry" in r.getMessage() for r in caplog.records)
    s3_server.outage_for(0.8)
    stats = st.upload_dir(str(tmp_path / "d"), "dir")
    assert stats.files == {"x/y.bin": 10_000}
    assert st.list("dir/") == {"dir/x/y.bin": 10_000}


def test_outage_longer_than_retry_budget_raises_storage_error(s3_server, s3_uri):
    st = open_storage(s3_uri, retry=RetryPolicy(attempts=3, base_s=0.05, max_s=0.1, deadline_s=5),
                      request_attempts=1)
    with s3_server.outage():
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=r"put k at s3://.*gave up after 3 attempts") as info:
            st.put_bytes("k", b"1")
        assert time.monotonic() - t0 < 5
    assert "\n" not in str(info.value)
    for secret in (s3_server.secret_key, s3_server.access_key):
        assert secret not in str(info.value)


def test_outage_during_parallel_download(s3_server, s3_uri, tmp_path):
    st = open_storage(s3_uri, retry=FAST_RETRY, request_attempts=1)
    for i in range(8):
        write(str(tmp_path / "src" / f"f{i}.bin"), os.urandom(50_000))
    st.upload_dir(str(tmp_path / "src"), "d")
    done = threading.Event()
    result = {}

    def download():
        result["stats"] = st.download_dir("d", str(tmp_path / "dst"))
        done.set()

    with s3_server.outage():
        thread = threading.Thread(target=download)
        thread.start()
        time.sleep(0.5)
        assert not done.is_set()
    thread.join(20)
    assert result["stats"].bytes == 8 * 50_000


def test_non_transient_errors_are_not_retried(s3_server):
    uri = s3_server.uri("x").replace(f"s3://{s3_server.bucket}/", "s3://no-such-bucket-here/")
    st = open_storage(uri, retry=FAST_RETRY)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="NoSuchBucket"):
        st.put_bytes("k", b"1")
    assert time.monotonic() - t0 < 2
