"""The `stale_writer` scenario action on a real local multi-node Ray cluster, through the scenario runner: a
spot notice for one of the two nodes starts a second attempt, then the first attempt's writer (its
generation, as a rank 0 that outlived its group would hold it) commits, moves `latest` and deletes in the
live store mid-run. Every write must be refused and reported (report.json checkpoints.fenced), and the live
run must finish with its own lineage: `latest` on its final checkpoint, the zombie's tag never committed.

The same run checks the restore's reads: the surviving node reads its own ranks' files of the emergency
checkpoint from the snapshots it kept after uploading them, the rest from storage, and says so."""
from __future__ import annotations

import pytest

import contextlib
import io

from spotfill.sim.outcomes import digest
from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario
from spotfill.storage.base import open_storage
from spotfill.storage.checkpoint_store import CheckpointStore, parse_tag
from spotfill.telemetry.events import read_events

# Slow (CI's 40-minute budget): about 75 s on 2 cores; the fence runs in CI in
# tests/integration/test_writer_fence.py and tests/unit/test_lineage.py, test_fenced_report.py. Run with -m
# slow.
pytestmark = pytest.mark.slow

TRAINING = {"model": "tiny", "workers": [1, 4], "global_batch": 12, "max_micro_batch": 3, "zero_stage": 2,
            "warmup_steps": 5, "steps": 50, "checkpoint_every": 10, "keep_checkpoints": 3}
CLUSTER = {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 2}, {"gpus": 2}]}


def test_a_stale_writer_is_fenced_and_the_live_lineage_survives(tmp_path):
    scenario = {"cluster": CLUSTER, "training": TRAINING,
                "events": [{"at_step": 15, "action": "drain_node", "node": 1, "deadline_s": 20},
                           {"at_step": 32, "min_world": 1, "action": "stale_writer"}]}   # min_world: after the restart
    with contextlib.redirect_stdout(io.StringIO()):
        report = run_scenario(parse_scenario(scenario, "stale"), str(tmp_path), quiet=True)
    assert report["ok"], digest(report)
    zombie = next(e for e in report["events"] if e["action"] == "stale_writer")
    assert zombie["fired"] and "skipped" not in zombie, zombie
    assert zombie["attempted"] == ["commit", "move latest", "delete"] == zombie["refused"], zombie
    assert int(zombie["generation"]) < int(zombie["live_generation"]) and zombie["lineage_intact"]
    assert report["invariants"]["stale_writer_fenced"]["ok"]
    fenced = [f for f in report["checkpoints"]["fenced"] if f["generation"] == zombie["generation"]]
    assert sorted(f["op"] for f in fenced) == ["commit", "delete", "move latest"], report["checkpoints"]["fenced"]
    assert all(f["newest_generation"] == zombie["live_generation"] for f in fenced)
    assert next(f for f in fenced if f["op"] == "commit")["tag"] == zombie["tag"]
    writers = report["checkpoints"]["writers"]
    assert len(writers) >= 2 and all(w["mechanism"].startswith("local:") for w in writers), writers

    store = CheckpointStore(open_storage(str(tmp_path / "storage")).child("stale"))
    restored = next(r for r in report["checkpoints"]["restored"] if r["attempt"] == 1)
    reads, = report["preemptions"][0]["recovery_breakdown"]["state_reads"]      # one node left
    saved_bytes = sum(c["bytes"] for c in read_commits(tmp_path) if c["tag"] == restored["tag"])
    assert reads["bytes_local"] > 0 and reads["files_local"] >= 1, reads      # its own kept snapshots
    assert reads["bytes_local"] + reads["bytes_storage"] == saved_bytes, (reads, saved_bytes)  # 4 -> 2: all
    assert not store.storage.exists(f"checkpoints/{zombie['tag']}/manifest.json")
    assert zombie["tag"] not in store.committed()
    latest = store.latest()
    assert latest["step"] == 50 and int(parse_tag(latest["tag"])[1]) > int(zombie["attempt"]), latest
    assert latest["writer"] == writers[-1]["generation"]
    chain = store.lineage().live
    assert chain[0] == latest["tag"] and all(int(parse_tag(t)[1]) > int(zombie["attempt"]) or parse_tag(t)[0] <= 15
                                             for t in chain), chain


def read_commits(run_dir) -> list[dict]:
    return [e for e in read_events(str(run_dir / "events.jsonl")) if e["kind"] == "checkpoint"]
