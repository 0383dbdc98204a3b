"""The corrupt_checkpoint scenario action: schema, the report's quarantine list and its invariant."""
from __future__ import annotations

import pytest

from spotfill.config.errors import ConfigError
from spotfill.sim.outcomes import invariants
from spotfill.sim.scenario import parse_scenario
from spotfill.train.summary import checkpoints_section


def test_corrupt_checkpoint_parses_and_unknown_keys_stay_rejected():
    sc = parse_scenario({"events": [{"at_step": 45, "action": "corrupt_checkpoint"}]})
    assert sc.events[0].action == "corrupt_checkpoint" and sc.events[0].at_step == 45
    assert "corrupt the newest committed checkpoint at step 45" == sc.events[0].describe()
    with pytest.raises(ConfigError, match=r"events\[0\]\.node: unknown key for corrupt_checkpoint"):
        parse_scenario({"events": [{"at_step": 45, "action": "corrupt_checkpoint", "node": 1}]})


def _events(restored_tag, restored_step, quarantine=True, from_storage=1000):
    ev = [{"t": 1.0, "kind": "checkpoint", "attempt": 0, "step": 40, "tag": "step-00000040-a0", "bytes": 1,
           "upload_s": 0.1}]
    if quarantine:
        ev += [{"t": 20.0, "kind": "checkpoint_quarantined", "attempt": 1, "tag": "step-00000040-a0",
                "reason": "step-00000040-a0: checksum mismatch in rank-0/x.pt"}] * 2   # reported twice: listed once
    ev.append({"t": 21.0, "kind": "checkpoint_restored", "attempt": 1, "tag": restored_tag, "step": restored_step,
               "read_bytes_storage": from_storage, "read_bytes_local": 1000 - from_storage})
    return ev


def _report(events):
    training = {"steps_completed": 60, "steps_target": 60,
                "samples": {"consumed": 720, "duplicates": 0, "missing": 0}}
    corrupt = {"index": 0, "action": "corrupt_checkpoint", "fired": True, "tag": "step-00000040-a0", "step": 40,
               "file": "rank-0/x.pt", "t": 10.0}
    return {"training": training, "checkpoints": checkpoints_section(events), "events": [corrupt]}


@pytest.mark.parametrize("restored,step,quarantine,from_storage,ok", [
    ("step-00000030-a0", 30, True, 1000, True),     # went past it and quarantined it
    ("step-00000040-a0", 40, True, 1000, False),    # restored the damaged one
    ("step-00000040-a0", 40, False, 1, False),      # one byte of it from storage is one too many
    ("step-00000040-a0", 40, False, 0, True),       # every file from the nodes' own verified snapshots
    ("step-00000030-a0", 30, False, 1000, False),   # went past it silently
    ("step-00000050-a1", 50, False, 1000, True),    # a newer commit came first: never in the way
])
def test_corrupted_tag_quarantined_and_never_restored_from_storage(restored, step, quarantine, from_storage, ok):
    report = _report(_events(restored, step, quarantine, from_storage))
    if quarantine:
        assert report["checkpoints"]["quarantined"] == [
            {"tag": "step-00000040-a0", "reason": "step-00000040-a0: checksum mismatch in rank-0/x.pt"}]
    inv = invariants(report, 10)["corrupted_checkpoints_quarantined"]
    assert inv["ok"] is ok, inv


def test_fresh_start_is_in_the_report():
    ev = [{"t": 1.0, "kind": "fresh_start", "attempt": 2, "cause": "no intact checkpoint: 1 committed, all damaged",
           "damaged": ["step-00000010"]}]
    assert checkpoints_section(ev)["fresh_starts"] == [
        {"attempt": 2, "cause": "no intact checkpoint: 1 committed, all damaged"}]


def _hard_loss_events(quarantined: bool):
    """Attempt 0 runs steps 1..60 (saves at 20, 40, 60; 20 and 40 commit), a node dies at t=100, attempt 1
    resumes from 20 because 40 was damaged."""
    ev = [{"t": 1.0, "kind": "attempt", "attempt": 0}]
    ev += [{"t": 1.0 + s / 100, "kind": "step", "attempt": 0, "step": s} for s in range(1, 61)]
    ev += [{"t": 2.0, "kind": "checkpoint_save", "attempt": 0, "step": s} for s in (20, 40, 60)]
    ev += [{"t": 2.0, "kind": "checkpoint", "attempt": 0, "step": s} for s in (20, 40)]
    ev.append({"t": 101.0, "kind": "attempt", "attempt": 1})
    if quarantined:
        ev.append({"t": 102.0, "kind": "checkpoint_quarantined", "attempt": 1, "tag": "step-00000040-a0",
                   "reason": "checksum"})
    ev += [{"t": 103.0, "kind": "resume", "attempt": 1, "step": 20, "world_size": 2},
           {"t": 104.0, "kind": "step", "attempt": 1, "step": 21}]
    return ev


@pytest.mark.parametrize("quarantined,ok", [(True, True), (False, False)])
def test_hard_loss_bound_counts_the_damaged_checkpoints_the_restore_went_past(quarantined, ok):
    from spotfill.sim.outcomes import node_event_outcome
    p = node_event_outcome(_hard_loss_events(quarantined), 100.0)
    # lost 60 - 20 = 40: 20 because the save at 60 was still uploading, 20 more because 40 was damaged
    assert p["lost_steps"] == 40 and p["skipped_damaged_steps"] == (20 if quarantined else 0)
    report = {"training": {"steps_completed": 60, "steps_target": 60,
                           "samples": {"consumed": 1, "duplicates": 0, "missing": 0}},
              "preemptions": [{"kind": "hard", **p}]}
    assert invariants(report, 20)["hard_loss_within_interval"]["ok"] is ok
