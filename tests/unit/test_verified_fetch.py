"""storage/verified_fetch.py: where a fetch's bytes come from, and the local faults it reports -- also when
it gives up (the report travels with the exception)."""
from __future__ import annotations

import hashlib
import os

import pytest

from spotfill.config.errors import CheckpointCorrupt, LocalCopyCorrupt
from spotfill.storage.base import LocalStorage
from spotfill.storage.verified_fetch import LOCAL_RETRIES, fetch_verified

DATA = bytes(range(256)) * 64


class DamagingDisk(LocalStorage):
    """Intact objects, read onto a disk that flips a byte of the first `bad` downloads of `name`."""

    def __init__(self, root, name: str, bad: int):
        super().__init__(root)
        self.name, self.bad = name, bad

    def _move_many(self, items, upload):
        super()._move_many(items, upload)
        for local, key, _ in items if not upload else []:
            if key.endswith(self.name) and self.bad > 0:
                self.bad -= 1
                with open(local, "r+b") as f:
                    f.write(b"\xff")


def _store(tmp_path, name: str, bad: int) -> tuple[DamagingDisk, dict]:
    storage = DamagingDisk(str(tmp_path / "store"), name, bad)
    files = {}
    for rel in ("rank-0/a.pt", "rank-0/b.pt"):
        storage.put_bytes(f"ckpt/{rel}", DATA)
        files[rel] = {"size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest()}
    return storage, files


def test_a_local_fault_got_past_is_reported_recovered(tmp_path):
    storage, files = _store(tmp_path, "b.pt", bad=1)
    report = fetch_verified(storage, "ckpt", files, str(tmp_path / "out"), tag="t")
    assert report.local_errors == [{"file": "rank-0/b.pt", "detail": "checksum mismatch", "recovered": True}]
    assert report.files_storage == 2 and report.bytes_storage == 3 * len(DATA)       # b.pt twice
    assert (tmp_path / "out" / "rank-0" / "b.pt").read_bytes() == DATA


def test_a_local_copy_that_keeps_failing_raises_with_its_report(tmp_path):
    """Storage's re-check passes every time, the node's copy never does: LocalCopyCorrupt, and the report
    of what it tried -- the last fault `recovered: False` -- travels with it."""
    storage, files = _store(tmp_path, "b.pt", bad=100)
    with pytest.raises(LocalCopyCorrupt, match="not the checkpoint") as failed:
        fetch_verified(storage, "ckpt", files, str(tmp_path / "out"), tag="t")
    report = failed.value.report
    assert report is not None, "the fetch report was discarded"
    assert [(e["file"], e["recovered"]) for e in report.local_errors] == \
        [("rank-0/b.pt", True)] * LOCAL_RETRIES + [("rank-0/b.pt", False)]
    assert report.as_dict()["local_errors"][-1]["recovered"] is False
    assert report.bytes_storage == (2 + LOCAL_RETRIES) * len(DATA)
    assert not os.path.exists(tmp_path / "out")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".partial-")]


def test_damage_in_storage_raises_checkpoint_corrupt_with_the_faults_got_past_before(tmp_path):
    storage, files = _store(tmp_path, "a.pt", bad=1)                   # a.pt: this node's fault, once
    files["rank-0/b.pt"]["sha256"] = "0" * 64                          # b.pt: wrong in storage
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch in rank-0/b.pt") as failed:
        fetch_verified(storage, "ckpt", files, str(tmp_path / "out"), tag="t")
    assert failed.value.report is not None
    # a.pt's fault came first and storage held its bytes: reported; b.pt is damage, not a local fault
    assert [(e["file"], e["recovered"]) for e in failed.value.report.local_errors] == [("rank-0/a.pt", True)]
