"""Storage: URI parsing, secret redaction, and the local backend (no server, no network)."""
from __future__ import annotations

import os

import pytest

from spotfill.config.errors import ConfigError
from spotfill.storage.base import (TMP_MARK, LocalStorage, RetryPolicy, S3Storage, join_key, open_storage,
                              redact_url)


def write(path, data: bytes):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# -- URIs ------------------------------------------------------------------------------------------
def test_local_uris(tmp_path):
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    st = open_storage(f"file://{tmp_path}/runs")
    assert isinstance(st, LocalStorage) and st.root == f"{tmp_path}/runs"
    with pytest.raises(ConfigError, match="file:// URIs must name a local path"):
        open_storage("file://otherhost/x")


@pytest.mark.parametrize("uri,match", [
    ("", "accepted: a local path"),
    ("gs://bucket/x", "unknown scheme 'gs'"),
    ("s3:///nobucket", "no bucket"),
    ("s3://b/p?endpoint=http://x", "unknown query parameter.*endpoint_override"),
])
def test_bad_uris_are_one_line_config_errors(uri, match):
    with pytest.raises(ConfigError, match=match) as info:
        open_storage(uri)
    assert "\n" not in str(info.value) and str(info.value).startswith("storage: ")


def test_s3_uri_parsing_endpoint_and_region(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    st = open_storage("s3://bkt/runs/a/")
    assert isinstance(st, S3Storage)
    assert (st.bucket, st.prefix, st.endpoint_url, st.region) == ("bkt", "runs/a", None, "us-east-1")
    assert st.uri == "s3://bkt/runs/a"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
    assert open_storage("s3://bkt").endpoint_url == "http://generic:1"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3only:2")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    st = open_storage("s3://bkt/p")
    assert (st.endpoint_url, st.region) == ("http://s3only:2", "eu-west-1")
    st = open_storage("s3://bkt/p?endpoint_override=127.0.0.1:9000&scheme=http&region=ap-south-1")
    assert (st.endpoint_url, st.region) == ("http://127.0.0.1:9000", "ap-south-1")
    assert st.uri == "s3://bkt/p?endpoint_override=http://127.0.0.1:9000"


def test_secrets_never_in_uri_repr_or_errors():
    st = open_storage("s3://bkt/p?endpoint_override=http://u:pw123@h:1&access_key=AKIAXXXXSECRET"
                      "&secret_key=sk-very-secret&session_token=tok-secret")
    shown = f"{st.uri} {st!r}"
    for secret in ("pw123", "AKIAXXXXSECRET", "sk-very-secret", "tok-secret"):
        assert secret not in shown
    with pytest.raises(ConfigError) as info:
        open_storage("s3://bkt/p?secret_key=sk-very-secret&bogus=1")
    assert "sk-very-secret" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        open_storage("s3://user:sk-very-secret@bkt/p")
    assert "sk-very-secret" not in str(info.value)
    assert redact_url("http://a:b@h/p?secret_key=s&x=1") == "http://h/p?secret_key=***&x=1"


def test_retry_policy_is_bounded():
    policy = RetryPolicy(attempts=5, base_s=0.1, max_s=0.4, deadline_s=3)
    delays = [policy.delay(i) for i in range(1, 10)]
    assert all(0.05 <= d <= 0.4 for d in delays)
    assert join_key("a/", "", "/b/c/") == "a/b/c"


# -- local backend -----------------------------------------------------------------------------------
def test_local_round_trips(tmp_path):
    st = open_storage(str(tmp_path / "root"))
    st.put_bytes("a/b/c.bin", b"hello")
    assert st.get_bytes("a/b/c.bin") == b"hello"
    st.put_bytes("a/b/c.bin", b"again")           # overwrite is atomic replace
    assert st.get_bytes("a/b/c.bin") == b"again"
    assert st.exists("a/b/c.bin") and not st.exists("a/b/nope")
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    assert st.put_file(str(src), "files/src.bin") == 1000
    assert st.get_file("files/src.bin", str(tmp_path / "out" / "dst.bin")) == 1000
    assert (tmp_path / "out" / "dst.bin").read_bytes() == b"x" * 1000
    with pytest.raises(FileNotFoundError):
        st.get_bytes("missing")
    with pytest.raises(FileNotFoundError):
        st.get_file("missing", str(tmp_path / "m"))
    with pytest.raises(ValueError):
        st.put_bytes("../escape", b"")
    assert not [p for p in (tmp_path / "root").rglob("*") if TMP_MARK in p.name]


def test_local_list_prefix_semantics_and_delete(tmp_path):
    st = open_storage(str(tmp_path))
    for key in ("ck/step-1/a", "ck/step-10/a", "ck/step-10/sub/b", "ck/latest", "other"):
        st.put_bytes(key, b"12")
    assert list(st.list()) == ["ck/latest", "ck/step-1/a", "ck/step-10/a", "ck/step-10/sub/b", "other"]
    assert list(st.list("ck/step-1")) == ["ck/step-1/a", "ck/step-10/a", "ck/step-10/sub/b"]  # like S3
    assert st.list("ck/step-1/") == {"ck/step-1/a": 2}
    assert st.list("nothing/here/") == {}
    assert st.delete_prefix("ck/step-10") == 2
    assert list(st.list("ck/")) == ["ck/latest", "ck/step-1/a"]
    assert not (tmp_path / "ck" / "step-10").exists()  # empty directories pruned
    st.delete(["ck/latest", "ck/never-existed"])
    assert list(st.list()) == ["ck/step-1/a", "other"]


def test_local_upload_download_dir_nested(tmp_path):
    src = tmp_path / "src"
    files = {"model.pt": os.urandom(3000), "zero/rank0/optim.pt": os.urandom(5000),
             "zero/rank1/optim.pt": b"", "meta.json": b"{}"}
    for rel, data in files.items():
        write(str(src / rel), data)
    st = open_storage(str(tmp_path / "store"))
    stats = st.upload_dir(str(src), "ckpt/t1")
    assert stats.files == {k: len(v) for k, v in files.items()}
    assert stats.bytes == sum(len(v) for v in files.values())
    back = st.download_dir("ckpt/t1", str(tmp_path / "back"))
    assert back.files == stats.files
    for rel, data in files.items():
        assert (tmp_path / "back" / rel).read_bytes() == data
    child = st.child("ckpt")
    assert child.get_bytes("t1/meta.json") == b"{}"


def test_local_check(tmp_path):
    open_storage(str(tmp_path / "new" / "dir")).check()   # creates it
    assert (tmp_path / "new" / "dir").is_dir()
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(ConfigError, match="local path not usable") as info:
        open_storage(str(tmp_path / "afile" / "sub")).check()
    assert "\n" not in str(info.value)


def test_local_writes_survive_a_concurrent_delete_pruning_their_directory(tmp_path):
    """Ranks upload into one checkpoint folder while another rank deletes its own stale marker there:
    the delete prunes the folder while it is momentarily empty, between a writer's makedirs of the folder
    and of its subfolder. Every write must still land (found by the elastic scenario test)."""
    import threading

    st = open_storage(str(tmp_path))
    errors: list[BaseException] = []
    rounds = 300
    start = threading.Barrier(3)

    def writer(rank: int):
        for i in range(rounds):
            start.wait()
            try:
                st.put_bytes(f"ck/t{i}/rank-{rank}/deep/file", b"x")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

    def deleter():
        for i in range(rounds):
            start.wait()
            for _ in range(20):
                st.delete(f"ck/t{i}/rank-0.done.json")

    threads = [threading.Thread(target=writer, args=(r,)) for r in (1, 2)] + [threading.Thread(target=deleter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert len(st.list("ck/")) == 2 * rounds


def test_local_list_skips_an_object_that_vanishes_while_it_is_listed(tmp_path, monkeypatch):
    """A writer's temp file is renamed into place (or an object deleted) between list's walk and its stat:
    the listing must leave it out, as S3's would, not raise (a rank's marker write made rank 0's commit
    of another tag fail with FileNotFoundError in CI). A snapshot being uploaded still raises."""
    import spotfill.storage.base as base

    st = open_storage(str(tmp_path / "store"))
    for key in ("ck/t1/a", "ck/t1/gone", "ck/t2/b"):
        st.put_bytes(key, b"12")
    real_walk = os.walk

    def walk_then_delete(top, **kw):
        for root, dirs, files in real_walk(top, **kw):
            if "gone" in files:
                os.unlink(os.path.join(root, "gone"))       # vanishes after the walk named it
            yield root, dirs, files

    monkeypatch.setattr(base.os, "walk", walk_then_delete)
    assert st.list("ck/") == {"ck/t1/a": 2, "ck/t2/b": 2}
    write(str(tmp_path / "snap" / "gone"), b"1")
    with pytest.raises(FileNotFoundError):
        base.local_files(str(tmp_path / "snap"))
