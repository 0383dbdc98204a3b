"""report.json fillin.reclaimed_and_resumed (sim/fillin_resumes.py): a tenant counts as given back and carried on
only from what was measured -- a lease the arbiter journaled as reclaimed, a lease of the same tenant started
after it, and the tenant's own proof that it continued (batch: every row exactly once after a wave stopped
with units left; sweep: a trial paused with its checkpoint and resumed from it)."""
from __future__ import annotations

from spotfill.sim.fillin_resumes import as_invariant, reclaimed_and_resumed


def _lease(workload, start, end=None, ended_by=None, cause=None):
    return {"workload": workload, "tenant": f"{workload}:x", "start": start, "end": end, "ended_by": ended_by,
            "cause": cause}


BATCH_DONE = {"rows_target": 56, "rows_written": 56, "duplicates": 0, "missing": 0,
              "stops": [{"at": 120.0, "done": 2, "units": 7}]}
SWEEP_DONE = {"trials": 2, "completed": 2, "paused": 1, "resumed": 1}


def _fill(leases, batch=None, sweep=None):
    return {"leases": leases, "serve": {"requests_ok": 1}, "batch": batch or dict(BATCH_DONE),
            "sweep": sweep or dict(SWEEP_DONE)}


def test_each_tenant_reclaimed_then_lent_again_with_its_own_proof():
    leases = [_lease("serve", 10, 120, "reclaim", "training_claim"), _lease("serve", 150),
              _lease("batch", 20, 121, "reclaim", "training_claim"), _lease("batch", 160, 170, "release"),
              _lease("sweep", 30, 119, "reclaim", "node_draining"), _lease("sweep", 155, 200, "release")]
    got = reclaimed_and_resumed(_fill(leases))
    assert {t: r["ok"] for t, r in got.items()} == {"serve": True, "batch": True, "sweep": True}
    assert "training_claim" in got["serve"]["detail"] and "1 trial pause(s), 1 resumed" in got["sweep"]["detail"]


def test_what_the_baseline_demo_showed_is_not_enough():
    """As the demo on main: the sweep's one reclaim found no running trial (0 paused), the batch job was never
    reclaimed (its leases all ended by release), Serve was reclaimed but no replica came back."""
    leases = [_lease("serve", 10, 300, "reclaim", "node_draining"),
              _lease("batch", 20, 30, "release"), _lease("batch", 40, 60, "release"),
              _lease("sweep", 30, 119, "reclaim", "training_claim"), _lease("sweep", 155, 200, "release")]
    got = reclaimed_and_resumed(_fill(leases, sweep={"trials": 3, "completed": 3, "paused": 0, "resumed": 0}))
    assert {t: r["ok"] for t, r in got.items()} == {"serve": False, "batch": False, "sweep": False}


def test_a_batch_stop_with_nothing_left_or_rows_missing_is_no_resume():
    leases = [_lease("batch", 20, 121, "reclaim", "training_claim"), _lease("batch", 160, 170, "release")]
    nothing_left = {**BATCH_DONE, "stops": [{"at": 120.0, "done": 7, "units": 7}]}
    assert not reclaimed_and_resumed(_fill(leases, batch=nothing_left))["batch"]["ok"]
    missing = {**BATCH_DONE, "rows_written": 48, "missing": 8}
    assert not reclaimed_and_resumed(_fill(leases, batch=missing))["batch"]["ok"]
    assert reclaimed_and_resumed(_fill(leases))["batch"]["ok"]


def test_a_lease_before_the_reclaim_is_not_a_comeback():
    leases = [_lease("sweep", 5, 25, "release"), _lease("sweep", 30, 119, "reclaim", "training_claim")]
    assert not reclaimed_and_resumed(_fill(leases))["sweep"]["ok"]


def test_only_the_tenants_the_scenario_ran():
    assert reclaimed_and_resumed({"leases": [], "serve": {"requests_ok": 0}}).keys() == {"serve"}
    assert reclaimed_and_resumed({}) == {}


def test_a_trial_paused_but_never_resumed_is_no_resume():
    leases = [_lease("sweep", 30, 119, "reclaim", "training_claim"), _lease("sweep", 155, 200, "release")]
    got = reclaimed_and_resumed(_fill(leases, sweep={"trials": 2, "completed": 1, "paused": 1, "resumed": 0}))
    assert not got["sweep"]["ok"]


def test_the_invariant_fails_when_any_tenant_did_not_carry_on_or_none_ran():
    assert as_invariant({"serve": {"ok": True, "detail": "a"}, "sweep": {"ok": False, "detail": "b"}}) == {
        "ok": False, "detail": "serve: yes (a); sweep: no (b)"}
    assert as_invariant({})["ok"] is False
    assert as_invariant({"batch": {"ok": True, "detail": "c"}})["ok"] is True


def test_a_batch_job_stopped_at_trainings_end_counts_only_with_its_rest_left_for_its_rerun():
    """On an autoscaled cluster no GPU is lent after training: a job stopped then may leave rows, but only
    exactly those its uncommitted units hold (written + left = target, none twice)."""
    from spotfill.sim.fillin_batch import invariant
    leases = [_lease("batch", 20, 121, "reclaim", "fair_share"), _lease("batch", 160, 170, "release")]
    left = {"rows_target": 56, "rows_written": 40, "duplicates": 0, "missing": 16,
            "stops": [{"at": 120.0, "done": 2, "units": 7}], "left_for_rerun": {"rows": 16, "units": 2, "why": "w"}}
    got = reclaimed_and_resumed(_fill(leases, batch=left))["batch"]
    assert got["ok"] and "16 left for its rerun" in got["detail"]
    assert invariant(left)["ok"] and "16 left for its rerun" in invariant(left)["detail"]
    assert not invariant({**left, "left_for_rerun": None})["ok"]          # missing rows, no end-of-run stop
    assert not invariant({**left, "duplicates": 1})["ok"]
    assert not invariant({**left, "rows_written": 39})["ok"]               # a row neither written nor left


def test_a_sweep_stopped_at_trainings_end_counts_only_when_its_experiment_is_restorable():
    from spotfill.sim.fillin_sweep import invariant, left_section
    left = left_section(2, True, {"t1": "TERMINATED", "t2": "PAUSED"}, 1, 1, "stopped at the end")
    assert left["completed"] == 1 and left["left_for_rerun"]["trials"] == {"t2": "PAUSED"}
    got = invariant(left)
    assert got["ok"] and "1 left for its rerun (experiment restorable" in got["detail"]
    assert not invariant(left_section(2, False, {"t1": "TERMINATED", "t2": "PAUSED"}, 1, 1, "w"))["ok"]
    assert not invariant(left_section(2, True, {"t1": "ERROR", "t2": "PAUSED"}, 1, 1, "w"))["ok"]
    assert not invariant({"trials": 2, "completed": 1, "paused": 1, "resumed": 1})["ok"]      # no stop at the end
    assert left_section(3, True, {"t1": "PAUSED"}, 1, 0, "w")["left_for_rerun"]["not_started"] == 2


def test_a_tenant_taken_back_in_the_last_window_carries_on_in_its_rerun_only_with_its_state_left():
    from spotfill.sim.fillin_sweep import left_section
    leases = [_lease("sweep", 30, 119, "reclaim", "fair_share")]                  # never lent again after
    left = left_section(2, True, {"t1": "PAUSED", "t2": "PAUSED"}, 2, 0, "stopped at training's end")
    got = reclaimed_and_resumed(_fill(leases, sweep=left))["sweep"]
    assert got["ok"] and "left for its rerun" in got["detail"]
    assert not reclaimed_and_resumed(_fill(leases, sweep={**left, "paused": 0}))["sweep"]["ok"]   # no checkpoint
    assert not reclaimed_and_resumed(_fill(leases, sweep=left_section(2, False, {"t1": "PAUSED"}, 1, 0, "w"))
                                     )["sweep"]["ok"]                                          # not restorable
    assert not reclaimed_and_resumed(_fill([_lease("sweep", 30, 119, "release")], sweep=left))["sweep"]["ok"]
    assert not reclaimed_and_resumed(_fill(leases, sweep=dict(SWEEP_DONE)))["sweep"]["ok"]       # no rerun, no lend
