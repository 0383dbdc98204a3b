"""`spotfill demo`'s summary: every fill-in workload's reclaims, by cause, and the batch and sweep lines."""
from spotfill.cli.demo import reclaims_by_workload, summarize


def _lease(workload, ended_by, cause=None, reclaim_s=None):
    return {"workload": workload, "ended_by": ended_by, "cause": cause, "reclaim_s": reclaim_s}


def test_reclaims_grouped_by_workload_and_cause():
    leases = [_lease("serve", "reclaim", "training_claim", 1.081), _lease("serve", "reclaim", "node_draining", 0.2),
              _lease("batch", "reclaim", "training_claim", 0.4), _lease("batch", "release"),
              _lease("sweep", "reclaim", "node_idle", 0.9), _lease("sweep", "reclaim", "node_idle", 1.1),
              _lease("serve", None)]
    assert reclaims_by_workload(leases) == ("serve 2 (to training 1.08s; node_draining 1), "
                                            "batch 1 (to training 0.40s), sweep 2 (node_idle 2)")


def test_no_reclaim_says_none():
    assert reclaims_by_workload([_lease("batch", "release"), _lease("serve", None)]) == "none"


def test_summary_has_batch_and_sweep_lines():
    report = {
        "training": {"steps_completed": 10, "steps_target": 10, "final_loss": 3.0, "world_size_timeline": [[0, 2]],
                     "samples": {"consumed": 120, "duplicates": 0, "missing": 0}},
        "fillin": {"batch": {"rows_written": 56, "rows_target": 56, "duplicates": 0, "missing": 0,
                             "stops": [{"cause": "reclaim"}], "resumed": True, "eval": {"loss": 4.25}},
                   "sweep": {"trials": 2, "completed": 2, "paused": 1, "resumed": 1,
                             "best": {"config": {"lr": 0.001}, "metric": 4.5, "metric_name": "eval_loss"}},
                   "leases": [_lease("batch", "reclaim", "training_claim", 0.5)]},
        "checkpoints": {"committed": 1, "stall_seconds_max": 0.1}, "ok": True, "seconds": 5}
    lines = summarize(report).splitlines()
    assert ("batch fill-in: 56 of 56 rows written, 0 duplicates, 0 missing; stopped 1 time(s) when its GPUs were taken back, "
            "resumed; eval loss 4.250") in lines
    assert ("sweep fill-in: 2 of 2 trials completed, 1 paused and 1 resumed from their checkpoints; "
            "best {'lr': 0.001} (eval_loss 4.500)") in lines
    assert any(ln.startswith("fill-in leases: 1, given back: batch 1 (to training 0.50s)") for ln in lines)


def test_summary_says_a_notice_that_restarted_nothing():
    report = {
        "training": {"steps_completed": 10, "steps_target": 10, "final_loss": 3.0, "world_size_timeline": [[0, 4]],
                     "samples": {"consumed": 120, "duplicates": 0, "missing": 0}},
        "preemptions": [{"kind": "announced", "action": "drain_node", "node": 2, "picked": "most_lent",
                         "affected": False, "lost_steps": 0, "recovery_seconds": None, "emergency_checkpoint": False,
                         "steps_after": 1}],
        "checkpoints": {"committed": 1, "stall_seconds_max": 0.1}, "ok": True, "seconds": 5}
    lines = summarize(report).splitlines()
    assert ("announced (drain_node node 2, the node fill-in used most): training did not restart after it "
            "(1 step(s) ran after it, then training finished)") in lines
    assert not any("stepping again after n/a" in ln for ln in lines)


def test_the_summary_prints_each_restart_with_its_time_and_warm_or_cold():
    from spotfill.cli.demo import restart_lines
    report = {"recoveries": [
        {"attempt": 2, "cause": "planned: grow", "total_s": 6.25, "warm": {"aaaaaaaaaaaa": True}, "ready_wait_s": 12.0},
        {"attempt": 3, "cause": "unplanned: worker died or node lost", "total_s": 14.0,
         "warm": {"aaaaaaaaaaaa": True, "bbbbbbbbbbbb": False}, "ready_wait_s": None},
        {"attempt": 4, "cause": "planned: preemption", "total_s": None, "warm": None}],
        "goodput": 0.61, "gpu_seconds": {"total": 1000.0, "recovering": 120.0}}
    lines = restart_lines(report)
    assert lines[0] == ("restart (attempt 2, planned: grow): stepping again after 6.2s, warm, waited 12.0s for "
                        "warm spares")
    assert lines[1].endswith("warm on aaaaaa; cold on bbbbbb")
    assert "warm/cold not recorded" in lines[2]
    assert lines[3] == "goodput 0.61; recovery held 120 of 1000 GPU-seconds (12%)"


def test_the_summary_says_how_each_tenant_woke_and_slept():
    report = {
        "training": {"steps_completed": 10, "steps_target": 10, "final_loss": 3.0, "world_size_timeline": [[0, 2]],
                     "samples": {"consumed": 120, "duplicates": 0, "missing": 0}},
        "fillin": {"serve": {"requests_ok": 9, "requests_rejected_503": 0, "requests_failed": 0, "p50_ms": 40,
                             "p99_ms": 90},
                   "batch": {"rows_written": 70, "rows_target": 100, "duplicates": 0, "missing": 30,
                             "left_for_rerun": {"rows": 30, "units": 2, "why": "w"}, "stops": [{}]},
                   "leases": [{"workload": "serve", "ended_by": "reclaim", "reclaim_s": 0.5},
                              {"workload": "batch", "ended_by": "reclaim", "reclaim_s": 1.25},
                              {"workload": "batch", "ended_by": "reclaim", "reclaim_s": 0.75},
                              {"workload": "batch", "ended_by": "release", "reclaim_s": 9.0}],
                   "starts": {"serve": {"warm": 3, "cold": 1, "init_s_warm": {"median": 0.04, "max": 0.1},
                                        "init_s_cold": {"median": 3.9, "max": 3.9}, "wake_s": {"median": 0.001},
                                        "load_s": {"median": 0.07}, "notes": []}}},
        "checkpoints": {"committed": 1, "stall_seconds_max": 0.1}, "ok": True, "seconds": 5}
    lines = summarize(report).splitlines()
    assert ("serve wake: 3 warm on a standby (constructor 0.04s, wake 0.001s), 1 cold (constructor 3.9s, load "
            "0.07s); sleep: 1 given back, median 0.50s, worst 0.50s") in lines
    assert "batch wake: no start recorded; sleep: 2 given back, median 1.00s, worst 1.25s" in lines
    assert any(ln.startswith("batch fill-in: 70 of 100 rows written, 0 duplicates, 30 left for its rerun") for ln in lines)
