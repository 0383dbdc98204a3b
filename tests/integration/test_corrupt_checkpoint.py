"""A damaged checkpoint store on a real local multi-node Ray cluster, through the scenario runner: the
`corrupt_checkpoint` action flips a byte in the newest committed checkpoint, a hard node loss forces a
restore, and the restore must quarantine the damaged tag and go past it -- or, when nothing intact is left,
fail loudly naming the damaged tag (training.on_no_intact_checkpoint defaults to fail).

The damage lands first and the kill right after it, in the same tick (actions due at the same step fire
in list order). The other order raced the restart: the dead attempt's unfinished upload looked like a save
in flight, the action waited for it, and a group restarting on warm spares read the newest checkpoint 30 ms
before the damage landed."""
from __future__ import annotations

import contextlib
import io

import pytest


from spotfill.sim.outcomes import digest
from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import parse_scenario
from spotfill.telemetry.events import read_events

TRAINING = {"model": "tiny", "workers": [1, 4], "global_batch": 12, "max_micro_batch": 3, "zero_stage": 2,
            "warmup_steps": 5}
CLUSTER = {"gpu_resource": "GPU_SLOT", "nodes": [{"gpus": 2}, {"gpus": 2}]}


def _run(tmp_path, name, training, events):
    scenario = {"cluster": CLUSTER, "training": {**TRAINING, **training}, "events": events}
    with contextlib.redirect_stdout(io.StringIO()):
        return run_scenario(parse_scenario(scenario, name), str(tmp_path), quiet=True)


# CI's time budget (`python -m pytest -m slow`); in CI the same restore (real checkpoint files, a damaged newest
# tag quarantined, the previous one restored on every rank) is tests/unit/test_restore.py
@pytest.mark.slow
def test_restore_goes_past_a_corrupted_checkpoint_and_quarantines_it(tmp_path):
    report = _run(tmp_path, "corrupt", {"steps": 80, "checkpoint_every": 20, "keep_checkpoints": 3},
                  [{"at_step": 45, "action": "corrupt_checkpoint"}, {"at_step": 45, "action": "kill_node", "node": 1}])
    assert report["ok"], digest(report)
    corrupt = next(e for e in report["events"] if e["action"] == "corrupt_checkpoint")
    assert corrupt["fired"] and corrupt["tag"].startswith("step-") and corrupt["step"] >= 40, corrupt
    assert report["invariants"]["corrupted_checkpoints_quarantined"]["ok"]
    quarantined = report["checkpoints"]["quarantined"]
    assert [q["tag"] for q in quarantined] == [corrupt["tag"]]
    assert "checksum mismatch" in quarantined[0]["reason"]
    after = [r for r in report["checkpoints"]["restored"] if r["t"] >= corrupt["t"]]
    assert after and after[0]["step"] < corrupt["step"], report["checkpoints"]["restored"]
    assert report["training"]["steps_completed"] == 80
    kinds = [e["kind"] for e in read_events(str(tmp_path / "events.jsonl"))]
    assert kinds.index("checkpoint_quarantined") < kinds.index("checkpoint_restored", kinds.index("checkpoint_quarantined"))


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_no_intact_checkpoint_fails_the_job_naming_the_damaged_tag(tmp_path):
    report = _run(tmp_path, "allbad", {"steps": 60, "checkpoint_every": 20, "keep_checkpoints": 1},
                  [{"at_step": 25, "action": "corrupt_checkpoint"}, {"at_step": 25, "action": "kill_node", "node": 1}])
    corrupt = next(e for e in report["events"] if e["action"] == "corrupt_checkpoint")
    assert not report["ok"], digest(report)
    assert "no intact checkpoint" in report["error"] and corrupt["tag"] in report["error"], report["error"]
    assert "\n" not in report["error"]
    assert report["training"]["steps_completed"] < 60
    assert [q["tag"] for q in report["checkpoints"]["quarantined"]] == [corrupt["tag"]]
    assert not any(e["kind"] == "step" and e["attempt"] > 0 for e in read_events(str(tmp_path / "events.jsonl")))
