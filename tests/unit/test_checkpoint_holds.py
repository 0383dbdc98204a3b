"""A reader of a store training writes (Serve, batch, export) against training's retention: the tag it
downloads is held (retention keeps it), and a tag that retention deleted while it was read anyway is
"rotated away" -- the reader lists again and takes the newest, and quarantines nothing. Before, a Serve
replica slower than a fast checkpoint cadence never loaded a checkpoint while training ran (CI, stop 37: 54
of 54 requests "no committed checkpoint yet") and quarantined every tag retention took from under it."""
from __future__ import annotations

import os

import pytest

from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import HOLDS, MANIFEST, CheckpointStore, tag_for


def _save(store, root, step: int) -> str:
    tag = tag_for(step)
    d = os.path.join(str(root), f"snap-{step}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "model.pt"), "wb") as f:
        f.write(bytes([step % 256]) * 4000)
    store.upload_part(tag, 0, 1, d)
    store.commit(tag, step, 1)
    return tag


@pytest.fixture
def stores(tmp_path):
    uri = str(tmp_path / "store")
    return CheckpointStore(open_storage(uri), keep_last=2), CheckpointStore(open_storage(uri), keep_last=2)


def test_retention_keeps_a_held_tag_until_the_reader_releases_it(stores, tmp_path):
    writer, reader = stores
    t1, t2 = _save(writer, tmp_path, 1), _save(writer, tmp_path, 2)
    key = reader.hold(t1)
    assert key and reader.held_until(t1) is not None
    _save(writer, tmp_path, 3)                                  # keep_last=2 would delete t1 here
    assert t1 in writer.committed(), writer.committed()
    reader.release(key)
    assert reader.held_until(t1) is None
    _save(writer, tmp_path, 4)                                  # the next cleanup deletes it
    assert t1 not in writer.committed() and t2 not in writer.committed(), writer.committed()


def test_an_expired_hold_keeps_nothing(stores, tmp_path):
    writer, reader = stores
    t1 = _save(writer, tmp_path, 1)
    _save(writer, tmp_path, 2)
    reader.hold(t1, ttl_s=-1)                                   # a reader that died long ago
    _save(writer, tmp_path, 3)
    assert t1 not in writer.committed()
    assert not writer.storage.list(writer._k(t1) + "/"), "the expired hold went with its tag"


def test_a_tag_rotated_away_mid_read_is_relisted_not_quarantined(stores, tmp_path, monkeypatch):
    """The injected fault: retention deletes the tag the reader downloads (before its hold landed) and
    training commits two newer ones meanwhile."""
    writer, reader = stores
    _save(writer, tmp_path, 1)
    t2 = _save(writer, tmp_path, 2)
    real, calls = CheckpointStore.download, []

    def racing_download(self, manifest, *a, **kw):
        calls.append(manifest["tag"])
        if len(calls) == 1:                                     # training moves on while this reader reads
            _save(writer, tmp_path, 3)
            _save(writer, tmp_path, 4)
            writer.storage.delete(writer._k(t2, MANIFEST))      # retention, as cleanup does: manifest first
            writer.storage.delete_prefix(writer._k(t2))
        return real(self, manifest, *a, **kw)

    monkeypatch.setattr(CheckpointStore, "download", racing_download)
    out = reader.restore(str(tmp_path / "read"), resume=False)
    assert out is not None and out["tag"] == tag_for(4), (out, calls)
    assert calls == [t2, tag_for(4)]
    assert reader.last_rotated == [t2] and reader.last_quarantined == []
    assert writer.quarantined() == {}, "a reader quarantined a tag retention deleted"
    assert not writer.storage.list(writer._k(HOLDS)), "no hold left behind"
    assert not [k for k in writer.storage.list(writer._k() + "/") if f"/{HOLDS}/" in k], "holds released"


def test_an_explicit_tag_rotated_away_says_so_and_quarantines_nothing(stores, tmp_path):
    from spotfill.config.errors import CheckpointCorrupt
    writer, reader = stores
    t1 = _save(writer, tmp_path, 1)
    for step in (2, 3):
        _save(writer, tmp_path, step)
    with pytest.raises(CheckpointCorrupt, match="no manifest|deleted by retention"):
        reader.restore(str(tmp_path / "read"), tag=t1, resume=False)
    assert writer.quarantined() == {}


def test_a_read_only_reader_reads_without_a_hold(stores, tmp_path, monkeypatch):
    writer, reader = stores
    _save(writer, tmp_path, 1)

    def refuse(*a, **kw):
        raise PermissionError("AccessDenied: s3:PutObject")

    monkeypatch.setattr(reader.storage, "put_bytes", refuse)
    assert reader.hold(tag_for(1)) is None
    out = reader.restore(str(tmp_path / "read"), resume=False)
    assert out["tag"] == tag_for(1)


def test_trainings_own_restore_takes_no_hold(stores, tmp_path, monkeypatch):
    writer, _ = stores
    _save(writer, tmp_path, 1)
    monkeypatch.setattr(CheckpointStore, "hold", lambda *a, **kw: pytest.fail("training held its own tag"))
    assert writer.restore(str(tmp_path / "read"))["tag"] == tag_for(1)
