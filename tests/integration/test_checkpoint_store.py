"""The checkpoint commit protocol on real loopback S3 and on a local directory."""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest

from spotfill.storage.checkpoint_store import CheckpointStore, sha256_file, tag_for
from spotfill.config.errors import CheckpointCorrupt, ConfigError
from spotfill.storage.base import open_storage


@pytest.fixture(params=["s3", "local"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "store"))
    return open_storage(request.getfixturevalue("s3_uri"))


def make_rank_dir(root, step: int, rank: int) -> str:
    """A small checkpoint-like rank directory whose content depends on (step, rank)."""
    d = os.path.join(str(root), f"snap-{step}-{rank}")
    files = {"model_states.pt": f"model {step} {rank}".encode() * 50,
             f"zero/optim_rank{rank}.pt": bytes([step % 256, rank]) * 3000, "client_state.json": b"{}"}
    for rel, data in files.items():
        path = os.path.join(d, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return d


def save(store, tmp_path, step, world_size=2, commit=True, **kw):
    tag = tag_for(step)
    for rank in range(world_size):
        store.upload_part(tag, rank, world_size, make_rank_dir(tmp_path, step, rank))
    return store.commit(tag, step, world_size, meta={"loss": 1.0 / step}, **kw) if commit else None


def test_commit_writes_manifest_then_latest(storage, tmp_path):
    store = CheckpointStore(storage, keep_last=3)
    assert store.committed() == [] and store.latest_tag() is None and store.restore(str(tmp_path)) is None
    manifest = save(store, tmp_path, 10)
    assert manifest["tag"] == "step-00000010" and manifest["world_size"] == 2
    assert manifest["meta"] == {"loss": 0.1}
    assert set(manifest["files"]) == {f"rank-{r}/{f}" for r in (0, 1) for f in
                                      ("model_states.pt", f"zero/optim_rank{r}.pt", "client_state.json")}
    local = os.path.join(make_rank_dir(tmp_path, 10, 1), "zero", "optim_rank1.pt")
    assert manifest["files"]["rank-1/zero/optim_rank1.pt"] == {"size": os.path.getsize(local),
                                                               "sha256": sha256_file(local)}
    assert store.committed() == ["step-00000010"] and store.latest_tag() == "step-00000010"
    keys = storage.list("checkpoints/")
    assert "checkpoints/step-00000010/rank-0.done.json" in keys
    assert json.loads(storage.get_bytes("checkpoints/latest"))["step"] == 10


def test_commit_waits_for_every_rank_and_latest_moves_only_on_commit(storage, tmp_path):
    store = CheckpointStore(storage)
    save(store, tmp_path, 10)
    tag = tag_for(20)
    store.upload_part(tag, 0, 2, make_rank_dir(tmp_path, 20, 0))
    out = {}
    committer = threading.Thread(target=lambda: out.update(m=store.commit(tag, 20, 2, timeout_s=30)))
    committer.start()
    time.sleep(0.6)
    assert committer.is_alive()                             # waiting for rank 1's marker
    assert not storage.exists(f"checkpoints/{tag}/manifest.json")
    assert store.latest_tag() == "step-00000010" and store.committed() == ["step-00000010"]
    store.upload_part(tag, 1, 2, make_rank_dir(tmp_path, 20, 1))
    committer.join(30)
    assert out["m"]["tag"] == tag and store.latest_tag() == tag
    assert store.committed() == [tag, "step-00000010"]


def test_commit_timeout_leaves_latest_alone(storage, tmp_path):
    store = CheckpointStore(storage)
    save(store, tmp_path, 10)
    store.upload_part(tag_for(20), 1, 2, make_rank_dir(tmp_path, 20, 1))   # rank 0 died
    with pytest.raises(CheckpointCorrupt, match=r"ranks \[0\] of 2 did not finish"):
        store.commit(tag_for(20), 20, 2, timeout_s=0.3)
    assert store.latest_tag() == "step-00000010" and store.committed() == ["step-00000010"]


def test_stale_markers_of_a_dead_attempt_do_not_count(storage, tmp_path):
    store = CheckpointStore(storage)
    tag = tag_for(30)
    store.upload_part(tag, 1, 2, make_rank_dir(tmp_path, 30, 1), attempt="run-1")   # then it died
    store.upload_part(tag, 0, 2, make_rank_dir(tmp_path, 30, 0), attempt="run-2")
    with pytest.raises(CheckpointCorrupt, match=r"ranks \[1\]"):
        store.commit(tag, 30, 2, timeout_s=0.3, attempt="run-2")
    store.upload_part(tag, 1, 2, make_rank_dir(tmp_path, 30, 1), attempt="run-2")
    assert store.commit(tag, 30, 2, attempt="run-2")["tag"] == tag
    # and a world-size mismatch is refused
    store.upload_part(tag_for(40), 0, 1, make_rank_dir(tmp_path, 40, 0))
    store.upload_part(tag_for(40), 1, 2, make_rank_dir(tmp_path, 40, 1))
    with pytest.raises(CheckpointCorrupt, match="world_size"):
        store.commit(tag_for(40), 40, 2, timeout_s=1)


def test_restore_newest_and_ranks_filter(storage, tmp_path):
    store = CheckpointStore(storage)
    save(store, tmp_path, 10)
    save(store, tmp_path, 20)
    m = store.restore(str(tmp_path / "restore"))
    assert m["tag"] == "step-00000020" and m["path"] == str(tmp_path / "restore" / "step-00000020")
    got = tmp_path / "restore" / "step-00000020" / "rank-1" / "zero" / "optim_rank1.pt"
    assert got.read_bytes() == bytes([20, 1]) * 3000
    assert json.loads((tmp_path / "restore" / "step-00000020" / "manifest.json").read_text())["step"] == 20
    assert not [p for p in (tmp_path / "restore").iterdir() if p.name.startswith(".partial")]
    m = store.restore(str(tmp_path / "r2"), tag="step-00000010", ranks=[0])
    assert m["tag"] == "step-00000010"
    got = sorted(p.name for p in (tmp_path / "r2" / "step-00000010").iterdir())
    assert got == ["manifest.json", "rank-0"]


def _flip_byte(storage, key):
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    storage.put_bytes(key, bytes(data))


@pytest.mark.parametrize("damage,reason", [
    ("delete_file", "partial, rank-1/zero/optim_rank1.pt is missing"),
    ("flip_byte", "checksum mismatch in rank-1/zero/optim_rank1.pt"),
    ("wrong_size", "rank-1/zero/optim_rank1.pt has 6001 bytes, manifest says 6000"),
    ("bad_manifest", "unreadable manifest"),
])
def test_damaged_newest_is_skipped_with_warning(storage, tmp_path, caplog, damage, reason):
    store = CheckpointStore(storage)
    save(store, tmp_path, 10)
    save(store, tmp_path, 20)
    key = "checkpoints/step-00000020/rank-1/zero/optim_rank1.pt"
    if damage == "delete_file":
        storage.delete(key)
    elif damage == "flip_byte":
        _flip_byte(storage, key)
    elif damage == "wrong_size":
        storage.put_bytes(key, storage.get_bytes(key) + b"!")
    else:
        storage.put_bytes("checkpoints/step-00000020/manifest.json", b"{not json")
    caplog.set_level(logging.WARNING, logger="spotfill.storage.checkpoint_store")
    m = store.restore(str(tmp_path / "restore"))
    assert m["tag"] == "step-00000010"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step-00000020" in w and reason in w for w in warnings), warnings
    assert not (tmp_path / "restore" / "step-00000020").exists()
    with pytest.raises(CheckpointCorrupt, match="step-00000020"):
        store.restore(str(tmp_path / "restore"), tag="step-00000020")


def test_verify_false_skips_checksums_only(storage, tmp_path):
    store = CheckpointStore(storage)
    save(store, tmp_path, 10)
    _flip_byte(storage, "checkpoints/step-00000010/rank-0/model_states.pt")
    assert store.restore(str(tmp_path / "a"), verify=False)["tag"] == "step-00000010"
    assert store.restore(str(tmp_path / "b")) is None      # nothing intact left


def test_uncommitted_partial_checkpoint_is_ignored(storage, tmp_path):
    store = CheckpointStore(storage)
    save(store, tmp_path, 10)
    store.upload_part(tag_for(20), 0, 2, make_rank_dir(tmp_path, 20, 0))  # rank 1's marker never came
    assert store.committed() == ["step-00000010"]
    assert store.restore(str(tmp_path / "r"))["tag"] == "step-00000010"


def test_retention_keeps_last_k_and_removes_orphans(storage, tmp_path):
    store = CheckpointStore(storage, keep_last=2)
    save(store, tmp_path, 10)
    save(store, tmp_path, 20)
    store.upload_part(tag_for(25), 0, 2, make_rank_dir(tmp_path, 25, 0))   # a dead rank's leftovers
    store.upload_part(tag_for(40), 0, 2, make_rank_dir(tmp_path, 40, 0))   # in flight, newer: kept
    save(store, tmp_path, 30)
    assert store.committed() == ["step-00000030", "step-00000020"]
    tags = {k.split("/")[1] for k in storage.list("checkpoints/") if k.count("/") >= 2}
    assert tags == {"step-00000020", "step-00000030", "step-00000040"}
    assert store.discard_uncommitted() == ["step-00000040"]
    assert not storage.list("checkpoints/step-00000040/")
    assert store.latest_tag() == "step-00000030"
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointStore(storage, keep_last=-1)


# -- lineage: retention, `latest` and quarantine (issue 7, defects 1 and 6) -------------------------------
@pytest.mark.parametrize("keep,new_step", [(1, 25), (2, 25), (1, 30), (2, 30)])
def test_retention_follows_lineage_after_restore_skips_damaged(storage, tmp_path, keep, new_step):
    """Restore skips a damaged step 40, training commits 25 or 30: retention must keep that new commit
    (and with keep 2 its intact parent, not the damaged 40); `latest` moves to it; 40 is quarantined."""
    first = CheckpointStore(storage, keep_last=3)
    for step in (10, 20, 40):
        save(first, tmp_path, step)
    _flip_byte(storage, "checkpoints/step-00000040/rank-1/zero/optim_rank1.pt")
    second = CheckpointStore(storage, keep_last=keep)           # the next attempt
    assert second.restore(str(tmp_path / "r1"))["tag"] == "step-00000020"
    new = save(second, tmp_path, new_step)["tag"]
    expect_kept = [new] if keep == 1 else [new, "step-00000020"]
    assert second.committed() == expect_kept
    assert second.latest_tag() == new
    quarantined = second.quarantined()
    assert list(quarantined) == ["step-00000040"] and "checksum mismatch" in quarantined["step-00000040"]
    third = CheckpointStore(storage, keep_last=keep)
    assert third.restore(str(tmp_path / "r2"))["tag"] == new   # the damaged 40 is never restored


def test_a_step_resaved_after_rollback_never_writes_into_a_committed_tag(storage, tmp_path):
    store = CheckpointStore(storage, keep_last=5)
    for step in (10, 20):
        tag = tag_for(step, 1)
        for rank in range(2):
            store.upload_part(tag, rank, 2, make_rank_dir(tmp_path, step, rank), attempt="1")
        store.commit(tag, step, 2, attempt="1")
    assert store.committed() == ["step-00000020-a1", "step-00000010-a1"]
    # attempt 2 rolled back to step 10 and saves step 20 again: its own tag, the committed one is untouched
    assert tag_for(20, 2) == "step-00000020-a2" != tag_for(20, 1)
    with pytest.raises(CheckpointCorrupt, match="refusing to write rank 0 into a committed checkpoint"):
        store.upload_part(tag_for(20, 1), 0, 2, make_rank_dir(tmp_path / "again", 20, 0), attempt="2")
    store.upload_part(tag_for(20, 2), 0, 2, make_rank_dir(tmp_path / "again", 20, 0), attempt="2")
    # a crash here (rank 1 never uploads) must leave step-00000020-a1 intact and restorable
    m = CheckpointStore(storage).restore(str(tmp_path / "r"))
    assert m["tag"] == "step-00000020-a1" and CheckpointStore(storage).quarantined() == {}
