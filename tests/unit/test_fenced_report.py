"""A refused writer's refusals reach report.json checkpoints.fenced through its own Checkpointer only:
Checkpointer (train/checkpointing.py) -> checkpoint_events -> checkpoints_section (train/summary.py). Real
Checkpointers on a real local store with two writer generations; no Ray. The stale_writer scenario action
(sim/stale_writer.py) is played the same way, its event sink a list: it writes no refusal of its own."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from spotfill.config import constants
from spotfill.config.errors import WriterFenced
from spotfill.sim.stale_writer import stale_write, stale_writer_invariant
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
from spotfill.train.checkpointing import Checkpointer, checkpoint_events
from spotfill.train.summary import checkpoints_section


class Engine:
    """What Checkpointer needs of a DeepSpeed engine: save_checkpoint writing this rank's file."""

    module = SimpleNamespace(parameters=lambda: [])

    def save_checkpoint(self, root, tag, client_state, save_latest):
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        with open(os.path.join(root, tag, "state.pt"), "wb") as f:
            f.write(repr((tag, client_state)).encode() * 50)


@pytest.fixture(autouse=True)
def snapshots_off_tmpfs(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "SNAPSHOT_DIR", str(tmp_path / "snaps"))


def _attempt(uri: str, attempt: int, root, keep_last: int = 3) -> Checkpointer:
    """A training attempt's rank 0: its store, holding a generation taken now, and its Checkpointer."""
    store = CheckpointStore(open_storage(uri), keep_last=keep_last)
    store.take_generation(attempt=attempt)
    store.mark_resumed(store.latest_tag(), int((store.latest() or {}).get("step") or 0))
    return Checkpointer(store, str(root / f"local-{attempt}"), 0, 1, attempt=str(attempt))


def test_a_stale_checkpointers_refused_writes_are_what_the_report_lists(tmp_path):
    uri = str(tmp_path / "store")
    old = _attempt(uri, 0, tmp_path)
    old.save(Engine(), 10, {}, kind="final")
    assert checkpoints_section(checkpoint_events(old, 0))["fenced"] == []
    live = _attempt(uri, 1, tmp_path)             # the next attempt takes the store
    with pytest.raises(WriterFenced, match="commit"):
        old.save(Engine(), 20, {}, kind="final")
    old.save(Engine(), 30, {}, kind="periodic")   # refused in the background upload
    assert old.uploader.wait(30)
    with pytest.raises(WriterFenced, match="move latest"):
        old.store_write(lambda store: store.mark_resumed(tag_for(30, "0"), 30))
    assert old.stale
    section = checkpoints_section(checkpoint_events(old, 0))
    old_gen, live_gen = str(old.store.fence.generation), str(live.store.fence.generation)
    assert [(f["op"], f["tag"], f["attempt"]) for f in section["fenced"]] == [
        ("commit", tag_for(20, "0"), 0), ("commit", tag_for(30, "0"), 0), ("move latest", tag_for(30, "0"), 0)]
    assert all((f["generation"], f["newest_generation"]) == (old_gen, live_gen) for f in section["fenced"])
    assert [s["step"] for s in section["skipped"]] == [20, 30]
    assert checkpoint_events(old, 0) == []         # reported once
    live.save(Engine(), 40, {}, kind="final")      # the live writer is not fenced
    assert checkpoints_section(checkpoint_events(live, 1))["fenced"] == [] and not live.stale
    assert live.store.latest()["tag"] == tag_for(40, "1")
    old.close(), live.close()


def test_the_stale_writer_scenario_reports_only_through_the_zombies_checkpointer(tmp_path):
    """The action's entry says which writes raised; report.json's checkpoints.fenced must hold them, and
    holds only what the zombie's Checkpointer sent: the invariant fails on a report without them."""
    uri, name = str(tmp_path / "storage"), "run"
    job = SimpleNamespace(config=SimpleNamespace(storage=uri, name=name,
                                                 training=SimpleNamespace(keep_checkpoints=3)))
    first = _attempt(f"{uri}/{name}", 0, tmp_path)
    first.save(Engine(), 10, {}, kind="final")
    live = _attempt(f"{uri}/{name}", 1, tmp_path)
    live.save(Engine(), 15, {}, kind="final")
    sent: list[dict] = []
    said: list[str] = []
    entry = stale_write(job, said.append, send=sent.extend)
    assert entry["attempted"] == ["commit", "move latest", "delete"] == entry["refused"], (entry, said)
    assert entry["lineage_intact"] and entry["generation"] == str(first.store.fence.generation)
    report = {"checkpoints": checkpoints_section(sent)}
    fenced = report["checkpoints"]["fenced"]
    assert [(f["op"], f["generation"], f["newest_generation"], f["attempt"]) for f in fenced] == [
        (op, entry["generation"], entry["live_generation"], 0) for op in ("commit", "move latest", "delete")]
    assert fenced[0]["tag"] == entry["tag"] == tag_for(16, "0")
    assert stale_writer_invariant([entry], report)["ok"], stale_writer_invariant([entry], report)
    missing = stale_writer_invariant([entry], {"checkpoints": {"fenced": []}})
    assert not missing["ok"] and "not in checkpoints.fenced" in missing["detail"]
    store = CheckpointStore(open_storage(f"{uri}/{name}"))
    assert store.latest()["tag"] == tag_for(15, "1") and tag_for(16, "0") not in store.committed()
    first.close(), live.close()
