"""Per-event outcomes, invariants and the attempt history, computed from a synthetic events.jsonl."""
from __future__ import annotations

from spotfill.sim.outcomes import grow_outcome, invariants, node_event_outcome
from spotfill.train.summary import attempt_history, training_section


G = 12


def _steps(attempt, first, last, world, t0, dt=0.1):
    """Steps first..last done (1-based)."""
    out = []
    for i, s in enumerate(range(first, last + 1)):
        out.append({"t": t0 + i * dt, "kind": "step", "attempt": attempt, "step": s, "world_size": world,
                    "loss": 1.0, "tokens": 10, "step_s": dt, "data_wait_s": 0.0, "compute_s": dt})
    return out


def _save(t, attempt, step, emergency=False, ledger=None):
    """A save whose checkpoint carries a clean ledger of `step` steps unless `ledger` says otherwise."""
    return {"t": t, "kind": "checkpoint_save", "attempt": attempt, "step": step, "emergency": emergency,
            "stall_s": 0.1, "ledger": ledger or {"consumed": step * G, "duplicates": 0, "missing": 0,
                                                  "owed": step * G}}


def _commit(t, attempt, step):
    return {"t": t, "kind": "checkpoint", "attempt": attempt, "step": step, "tag": f"step-{step:08d}",
            "bytes": 9, "upload_s": 0.1}


def _restart(t, attempt, step, world):
    return [{"t": t, "kind": "attempt", "attempt": attempt, "world_size": world},
            {"t": t + 1, "kind": "resume" if attempt else "start", "attempt": attempt, "step": step,
             "world_size": world}]


def _timeline():
    """attempt 0: 4 workers, notice at t=102 -> emergency checkpoint at step 25, planned exit;
    attempt 1: 2 workers from 25, grows at 40 (planned); attempt 2: 4 workers from 40, node killed at 61
    (last commit 60); attempt 3: 2 workers from 60 to 80, finished."""
    ev = _restart(100.0, 0, 0, 4) + _steps(0, 1, 25, 4, 101.1)
    ev += [_save(103.7, 0, 20), _commit(103.75, 0, 20), _save(103.8, 0, 25, emergency=True),
           _commit(103.9, 0, 25),
           {"t": 104.0, "kind": "planned_exit", "attempt": 0, "reason": "preemption", "step": 25}]
    ev += _restart(110.0, 1, 25, 2) + _steps(1, 26, 40, 2, 111.1)
    ev += [_save(112.7, 1, 40), _commit(112.75, 1, 40),
           {"t": 112.8, "kind": "planned_exit", "attempt": 1, "reason": "grow", "step": 40}]
    ev += _restart(120.0, 2, 40, 4) + _steps(2, 41, 61, 4, 121.1)
    ev += [_save(123.15, 2, 60), _commit(123.2, 2, 60)]
    ev += _restart(130.0, 3, 60, 2) + _steps(3, 61, 80, 2, 131.1)
    ev += [_save(133.15, 3, 80), _commit(133.2, 3, 80), {"t": 133.3, "kind": "finish", "attempt": 3, "ok": True}]
    return sorted(ev, key=lambda e: e["t"])


def test_announced_preemption_outcome():
    out = node_event_outcome(_timeline(), fired_at=102.0, deadline_s=10)
    assert out["affected"] and out["lost_steps"] == 0 and out["emergency_checkpoint"]
    assert out["committed_before_deadline"] and out["commit_seconds_after_notice"] == 1.9
    assert out["world_size_after"] == 2 and out["planned_exit"] == "preemption"
    assert out["recovery_seconds"] == round(111.1 - 102.0, 2)


def test_announced_preemption_committed_too_late_is_reported():
    out = node_event_outcome(_timeline(), fired_at=102.0, deadline_s=1)
    assert out["emergency_checkpoint"] and out["committed_before_deadline"] is False


def test_hard_loss_counts_steps_since_the_last_commit():
    out = node_event_outcome(_timeline(), fired_at=123.3)
    assert out["lost_steps"] == 1 and not out["emergency_checkpoint"] and out["planned_exit"] is None
    assert "committed_before_deadline" not in out


def test_event_after_the_last_restart_affected_nothing():
    assert node_event_outcome(_timeline(), fired_at=140.0)["affected"] is False


def test_an_event_training_outran_says_how_many_steps_ran_after_it():
    # fired while the last attempt stepped: steps 79 and 80 (t 132.9, 133.0) ran after it, then the finish
    out = node_event_outcome(_timeline(), fired_at=132.85)
    assert out["affected"] is False and out["steps_after"] == 2
    assert node_event_outcome(_timeline(), fired_at=140.0)["steps_after"] == 0


def test_grow_outcome():
    out = grow_outcome(_timeline(), fired_at=112.0)
    assert out["grew"] and out["world_size_after"] == 4 and out["lost_steps"] == 0


def test_invariants_pass_and_fail():
    ev = _timeline()
    report = {"training": training_section(ev, 80, G), "preemptions": [
        {"kind": "announced", **node_event_outcome(ev, 102.0, 10)},
        {"kind": "hard", **node_event_outcome(ev, 123.3)}]}
    inv = invariants(report, checkpoint_every=20)
    assert all(i["ok"] for i in inv.values()), inv
    assert report["training"]["samples"] == {"consumed": 80 * G, "duplicates": 0, "missing": 0,
                                             "source": "checkpoint-ledger"}
    report["preemptions"][1]["lost_steps"] = 21
    assert not invariants(report, checkpoint_every=20)["hard_loss_within_interval"]["ok"]
    report["preemptions"][0]["committed_before_deadline"] = False
    assert not invariants(report, checkpoint_every=20)["announced_preemption_loses_nothing"]["ok"]


def test_samples_come_from_the_ledger_of_the_newest_commit():
    """The final model is the newest commit's, even when an older attempt committed a higher step."""
    ev = _timeline()
    bad = {"consumed": 50 * G, "duplicates": 3 * G, "missing": 3 * G, "owed": 50 * G}
    ev += [_save(140.0, 4, 50, ledger=bad), _commit(140.1, 4, 50)]
    assert training_section(ev, 80, G)["samples"] == {"consumed": 50 * G, "duplicates": 3 * G,
                                                      "missing": 3 * G, "source": "checkpoint-ledger"}
    report = {"training": training_section(ev, 80, G), "preemptions": []}
    assert not invariants(report, checkpoint_every=20)["no_sample_lost_or_repeated"]["ok"]


def test_samples_without_a_ledger_on_record_prove_nothing():
    ev = [e for e in _timeline() if e["kind"] != "checkpoint_save"]
    assert training_section(ev, 80, G)["samples"] == {"consumed": 0, "duplicates": 0, "missing": 80 * G,
                                                      "source": "none"}
    ev = _timeline()
    ev[-2:-2] = [_commit(133.25, 3, 80)]     # a commit with no save event carrying its ledger
    ev = [e for e in ev if not (e["kind"] == "checkpoint_save" and e["step"] == 80)]
    assert training_section(ev, 80, G)["samples"]["source"] == "none"


def test_attempt_history_says_how_each_attempt_ended():
    hist = attempt_history(_timeline())
    assert [(h["world_size"], h["from_step"], h["to_step"], h["ended"]) for h in hist] == [
        (4, 0, 25, "preemption"), (2, 25, 40, "grow"), (4, 40, 61, "failed"), (2, 60, 80, "finished")]
    assert hist[0]["checkpoints"] == [20, 25]


def test_attempt_history_of_a_run_still_going():
    ev = [e for e in _timeline() if e["t"] < 125]
    assert attempt_history(ev)[-1]["ended"] == "running"


def test_hard_loss_while_the_newest_checkpoint_uploads_rolls_back_one_more_interval():
    """Killed 3 steps after the save at 60, before it committed: resumed from 40, 23 steps lost. That is the
    interval plus the 3 steps since the save; resuming from 20 would not be."""
    ev = [e for e in _timeline() if not (e["kind"] == "checkpoint" and e["step"] == 60)]
    ev += _steps(2, 62, 63, 4, 123.25, dt=0.01)
    for e in ev:
        if e["kind"] == "resume" and e["attempt"] == 3:
            e["step"] = 40
    ev.sort(key=lambda e: e["t"])
    out = node_event_outcome(ev, fired_at=123.3)
    assert out["upload_in_flight"] and out["steps_since_newest_save"] == 3 and out["lost_steps"] == 23
    report = {"training": {"steps_completed": 80, "steps_target": 80,
                           "samples": {"consumed": 0, "duplicates": 0, "missing": 0}},
              "preemptions": [{"kind": "hard", **out}]}
    assert invariants(report, 20)["hard_loss_within_interval"]["ok"]
    report["preemptions"][0]["lost_steps"] = 24
    assert not invariants(report, 20)["hard_loss_within_interval"]["ok"]


def test_checkpoints_section_lists_every_skipped_snapshot_with_its_reason():
    from spotfill.train.summary import checkpoints_section
    events = [
        {"t": 1.0, "kind": "checkpoint_skipped", "attempt": 0, "tag": "step-00000040-a0", "step": 40,
         "reason": "superseded by step 60 while an upload was blocked"},
        {"t": 2.0, "kind": "checkpoint", "attempt": 0, "tag": "step-00000060-a0", "step": 60, "bytes": 10,
         "upload_s": 1.0},
        {"t": 3.0, "kind": "checkpoint_skipped", "attempt": 1, "tag": "step-00000070-a1", "step": 70,
         "reason": "emergency save abandoned: would not commit before the deadline"},
    ]
    section = checkpoints_section(events)
    assert section["committed"] == 1
    assert section["skipped"] == [
        {"tag": "step-00000040-a0", "step": 40, "reason": "superseded by step 60 while an upload was blocked"},
        {"tag": "step-00000070-a1", "step": 70,
         "reason": "emergency save abandoned: would not commit before the deadline"}]
    assert checkpoints_section([])["skipped"] == []


def test_a_notice_that_lands_during_a_grow_exit_is_covered_by_the_grow_checkpoint():
    """Attempt 1 is saving for its grow (commit of step 40 at 112.75) when a notice lands at 112.72: no
    emergency save follows, and none is needed -- the grow's checkpoint is what the next attempt resumes."""
    out = node_event_outcome(_timeline(), fired_at=112.72, deadline_s=10)
    assert out["lost_steps"] == 0 and not out["emergency_checkpoint"]
    assert out["covered_by_planned_exit"] == "grow" and out["resumed_from_step"] == 40
    assert out["committed_before_deadline"] and out["commit_seconds_after_notice"] == 0.03
    report = {"training": training_section(_timeline(), 80, G),
              "preemptions": [{"kind": "announced", "affected": True, **out}]}
    assert invariants(report, 20)["announced_preemption_loses_nothing"]["ok"]
    late = node_event_outcome(_timeline(), fired_at=112.72, deadline_s=0.01)
    assert late["covered_by_planned_exit"] == "grow" and late["committed_before_deadline"] is False
    report["preemptions"] = [{"kind": "announced", "affected": True, **late}]
    assert not invariants(report, 20)["announced_preemption_loses_nothing"]["ok"]


def test_detected_is_when_the_controller_left_running_after_the_fault():
    ev = _timeline() + [{"t": 123.3 + 6.4, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
                        {"t": 123.3 + 6.5, "kind": "controller_state", "state": "SCHEDULING",
                         "previous": "RESTARTING"}]
    out = node_event_outcome(sorted(ev, key=lambda e: e["t"]), fired_at=123.3)
    assert out["detected_s"] == 6.4
    assert node_event_outcome(_timeline(), fired_at=123.3)["detected_s"] is None     # no controller events


def _notice_into_a_restart(stepped: int = 0):
    """Attempt 1 (2 workers) grows at 40 (planned, step 40 committed); attempt 2 begins its start at 120 and a
    notice comes at 120.5, while it restores; it leaves before its first step (planned exit at 121.5) -- or,
    with `stepped`, it steps that many steps first and leaves without a save (the notice seen too late);
    attempt 3 resumes from 40."""
    ev = _restart(110.0, 1, 25, 2) + _steps(1, 26, 40, 2, 111.1)
    ev += [_save(112.7, 1, 40), _commit(112.75, 1, 40),
           {"t": 112.8, "kind": "planned_exit", "attempt": 1, "reason": "grow", "step": 40}]
    ev += [{"t": 120.0, "kind": "attempt", "attempt": 2, "world_size": 4}]
    if stepped:
        ev += [{"t": 121.0, "kind": "resume", "attempt": 2, "step": 40, "world_size": 4}]
        ev += _steps(2, 41, 40 + stepped, 4, 121.2)
    ev += [{"t": 121.5 + stepped, "kind": "planned_exit", "attempt": 2, "reason": "preemption",
            "step": 40 + stepped, "phase": "restored", "before_first_step": not stepped}]
    ev += _restart(125.0 + stepped, 3, 40, 2) + _steps(3, 41, 80, 2, 126.1 + stepped)
    return sorted(ev, key=lambda e: e["t"])


def test_a_notice_into_a_restart_left_before_the_first_step_loses_nothing():
    """The notice reached the grown group while it restored: it left at once, before stepping; the checkpoint
    it had restored (committed before the notice) is the one the next attempt resumes from."""
    out = node_event_outcome(_notice_into_a_restart(), fired_at=120.5, deadline_s=8)
    assert out["lost_steps"] == 0 and not out["emergency_checkpoint"]
    assert out["covered_by_planned_exit"] == "preemption" and out["committed_before_deadline"]
    assert out["notice_during_start"] == {"attempt": 2, "phase": "restored", "left_s_after_notice": 1.0}
    report = {"training": training_section(_notice_into_a_restart(), 80, G),
              "preemptions": [{"kind": "announced", "affected": True, **out}]}
    assert invariants(report, 20)["announced_preemption_loses_nothing"]["ok"]


def test_a_notice_into_a_restart_seen_only_after_steps_loses_them():
    """The same notice seen only at the group's steps (no time left to save): the steps are lost, and the
    invariant says so."""
    events = _notice_into_a_restart(stepped=3)
    out = node_event_outcome(events, fired_at=120.5, deadline_s=8)
    assert out["lost_steps"] == 3 and "notice_during_start" not in out
    report = {"training": training_section(events, 80, G), "preemptions": [{"kind": "announced", "affected": True, **out}]}
    assert not invariants(report, 20)["announced_preemption_loses_nothing"]["ok"]


def test_a_loss_into_a_start_counts_steps_from_the_newest_commit_before_it():
    """A group that never stepped held the newest checkpoint committed before the event: a restore that went
    back past it counts those steps as lost."""
    events = [e for e in _notice_into_a_restart() if not (e["kind"] == "resume" and e["attempt"] == 3)]
    events += [{"t": 126.0, "kind": "resume", "attempt": 3, "step": 25, "world_size": 2}]
    out = node_event_outcome(sorted(events, key=lambda e: e["t"]), fired_at=120.5, deadline_s=8)
    assert out["lost_steps"] == 15


def test_a_notice_whose_recovery_left_during_its_start_counts_the_attempt_that_resumed():
    """Notice 1 at 102 (attempt 0 saves step 25 and leaves); notice 2 comes into attempt 1's start, which
    leaves before resuming; attempt 2 resumes from 25. Notice 1's recovery is attempt 2 -- not the attempt
    that never resumed (read as a restart from step 0 before) -- and neither notice lost a step."""
    ev = _restart(100.0, 0, 0, 3) + _steps(0, 1, 25, 3, 101.1)
    ev += [_save(103.8, 0, 25, emergency=True), _commit(103.9, 0, 25),
           {"t": 104.0, "kind": "planned_exit", "attempt": 0, "reason": "preemption", "step": 25},
           {"t": 110.0, "kind": "attempt", "attempt": 1, "world_size": 2},
           {"t": 111.0, "kind": "planned_exit", "attempt": 1, "reason": "preemption", "step": 25,
            "phase": "placed", "before_first_step": True}]
    ev += _restart(115.0, 2, 25, 1) + _steps(2, 26, 80, 1, 116.1)
    ev = sorted(ev, key=lambda e: e["t"])
    first = node_event_outcome(ev, fired_at=102.0, deadline_s=20)
    assert first["lost_steps"] == 0 and first["emergency_checkpoint"] and first["committed_before_deadline"]
    assert first["resumed_from_step"] == 25 and first["world_size_after"] == 1
    second = node_event_outcome(ev, fired_at=110.2, deadline_s=8)
    assert second["lost_steps"] == 0 and second["notice_during_start"]["attempt"] == 1
    assert second["committed_before_deadline"]
