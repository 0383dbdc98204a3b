"""Diagnosis and recovery breakdown on the hand-made hard-loss log of test_telemetry_ledger (numbers by hand)."""
import pytest

from spotfill.telemetry.diagnosis import diagnose, diagnosis_report, recovery_breakdown
from spotfill.telemetry.ledger import compute_ledger
from test_telemetry_ledger import NODES, hard_loss_log, step


def with_controller(ev):
    ev = ev + [{"t": 33.0, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
               {"t": 36.0, "kind": "controller_state", "state": "SCHEDULING", "previous": "RESTARTING"}]
    return sorted(ev, key=lambda e: e["t"])


def test_every_lost_gpu_second_has_a_cause():
    ev = hard_loss_log()
    findings = {f.cause: f for f in diagnose(ev, compute_ledger(ev, NODES))}
    # lineage steps: attempt 0 steps 1-5 on 4 GPUs, attempt 1 steps 6-10 on 2, each 2 s with 0.5 s data wait
    assert findings["data_stall"].gpu_seconds == pytest.approx(5 * 0.5 * 4 + 5 * 0.5 * 2)      # 15
    assert findings["data_stall"].evidence["data_wait_share_of_step"] == pytest.approx(0.25)
    assert "25%" in findings["data_stall"].remedy and "data.prefetch" in findings["data_stall"].remedy
    assert findings["checkpoint_stall"].gpu_seconds == pytest.approx(4 * 1 + 2 * 2)           # 20->21, 55->57
    assert findings["rolled_back"].gpu_seconds == pytest.approx(4 * 4)                         # 21->25
    # startup 0->10 on 4; the group holds its 4 from its last step (25) until n1 dies (30), then n0's 2
    # until attempt 1 starts (40); attempt 1 starts 40->45 on 2
    assert findings["recovery"].gpu_seconds == pytest.approx(40 + 4 * 5 + 2 * 10 + 2 * 5)     # 90
    assert findings["unaccounted"].gpu_seconds == pytest.approx(2 * 3)                         # 57->60 on n0
    assert "minor" in findings["unaccounted"].remedy                                           # 6 of 135
    assert "step_overhead" not in findings and "collective_wait" not in findings   # none / not measured
    assert "idle_capacity" not in findings                                          # nothing was seen free
    # lost = 180 total - productive compute (60 step GPU-s - 15 data wait) = 135, all attributed
    assert sum(f.gpu_seconds for f in findings.values()) == pytest.approx(180 - (60 - 15))
    assert sum(f.share_of_lost for f in findings.values()) == pytest.approx(1.0)
    assert list(findings)[0] == "recovery"        # largest first
    inferred = {f.cause: f for f in diagnose(ev, compute_ledger(ev))}    # no node timeline
    assert "capacity was inferred" in inferred["unaccounted"].remedy


def ends_at(ev, t):
    return [e for e in ev if e["kind"] != "job_end"] + [{"t": t, "kind": "job_end"}]


def test_fill_in_is_recommended_only_for_gpus_seen_free():
    ev = ends_at(hard_loss_log(), 80.0)              # n0's 2 GPUs: 57->80 after finish, 46 GPU-s
    blind = {f.cause: f for f in diagnose(ev, compute_ledger(ev, NODES))}
    assert blind["unaccounted"].gpu_seconds == pytest.approx(2 * 23) and "idle_capacity" not in blind
    assert "arbiter" in blind["unaccounted"].remedy and "enable fill-in" not in blind["unaccounted"].remedy
    seen = ev + [{"t": 57.0, "kind": "gpu_free", "node": "n0", "free": 2}]   # the arbiter saw them free
    findings = {f.cause: f for f in diagnose(seen, compute_ledger(seen, NODES))}
    assert findings["idle_capacity"].gpu_seconds == pytest.approx(2 * 23) and "unaccounted" not in findings
    assert "enable fill-in" in findings["idle_capacity"].remedy


def test_collective_wait_counted_when_measured():
    ev = hard_loss_log()
    for e in ev:
        if e["kind"] == "step":
            # the worker's split of each 2 s step: 0.5 data wait, 1.0 forward+backward, 0.25 optimizer, 0.25 rest
            e.update(collective_wait_s=0.25, forward_backward_s=1.0, optimizer_s=0.25)
    findings = {f.cause: f for f in diagnose(ev, compute_ledger(ev, NODES))}
    assert findings["collective_wait"].gpu_seconds == pytest.approx(5 * 0.25 * 4 + 5 * 0.25 * 2)   # 7.5
    assert "straggler" in findings["collective_wait"].remedy
    assert findings["collective_wait"].evidence == {"collective_wait_share_of_step": 0.125,
                                                    "forward_backward_share_of_step": 0.5,
                                                    "optimizer_share_of_step": 0.125}


# The restart of hard_loss_log with controller events, as a story: when each phase began and ended.
RESTART_STORY = {
    "detect_s": (30.0, 33.0),         # the node kill (report.json preemptions[].at) -> RESTARTING
    "decide_s": (33.0, 36.0),         # -> SCHEDULING
    "workers_start_s": (36.0, 40.0),  # -> the training function entered (resume at 45 with startup_s 5)
    "state_load_s": (40.0, 43.0),     # restore_prep_s 2 + load_s 1
    "setup_s": (43.0, 45.0),          # the rest of startup_s: model and engine
    "first_step_s": (45.0, 47.0),     # resume -> the first step finished
}


def test_recovery_phases_from_controller_and_resume_events():
    (r,) = recovery_breakdown(with_controller(hard_loss_log()), faults=[30.0])
    assert (r.attempt, r.fault_t, r.fault_source) == (1, 30.0, "report")
    for phase, (t0, t1) in RESTART_STORY.items():
        assert getattr(r, phase) == pytest.approx(t1 - t0), phase
    assert r.total_s == pytest.approx(47.0 - 30.0)                    # fault -> first step, from the story
    assert r.slowest == "workers_start_s"


def test_recovery_without_controller_events_says_what_it_cannot_split():
    (r,) = recovery_breakdown(hard_loss_log())
    assert r.fault_source == "last_step" and r.fault_t == 25.0        # the old group's last step
    assert r.detect_s is None and r.decide_s is None and r.workers_start_s is None
    assert r.detail["fault_to_workers_up_s"] == pytest.approx(15.0)    # 25 -> 40
    assert r.state_load_s == pytest.approx(3.0) and r.total_s == pytest.approx(22.0)
    assert r.slowest == "fault_to_workers_up_s"                       # 15 s unsplit beats every known phase


def test_planned_exit_is_the_fault_and_the_slowest_phase_picks_the_remedy():
    ev = hard_loss_log() + [{"t": 31.0, "kind": "planned_exit", "reason": "preemption", "attempt": 0, "step": 7}]
    ev = with_controller(ev)
    for e in ev:
        if e["kind"] == "resume":
            e.update(restore_prep_s=4.5, load_s=0.5)                   # state load 5 s: the slowest phase
    (r,) = recovery_breakdown(ev)
    assert r.fault_source == "planned_exit" and r.cause == "preemption" and r.slowest == "state_load_s"
    rep = diagnosis_report(ev, compute_ledger(ev, NODES))
    rec = next(f for f in rep["diagnosis"]["findings"] if f["cause"] == "recovery")
    assert rec["evidence"]["slowest_phase"] == "state_load_s" and "checkpoint" in rec["remedy"]
    assert rep["recoveries"][0]["slowest"] == "state_load_s"


def test_no_restart_no_recovery_rows():
    ev = [{"t": 0.0, "kind": "job_start"}, {"t": 0.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 1}]
    ev += [step(2.0 * i, i, 0, 1) for i in range(1, 4)]
    assert recovery_breakdown(ev) == []


def _cluster_yaml_health_env() -> dict[str, str]:
    """RAY_health_check_* as cluster.yaml's head start command exports them."""
    import re
    from pathlib import Path

    import yaml
    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "cluster.yaml").read_text())
    head = next(c for c in cfg["head_start_ray_commands"] if "ray start --head" in c)
    return dict(re.findall(r"\b(RAY_health_check_\w+)=(\d+)", head))


def test_slow_detection_of_a_hard_loss_names_the_settings_that_decide_it():
    """A hard loss whose detection dominates: the remedy names the health-check settings and their bound as
    the cluster files really set them, and Ray's defaults -- not a setting the run is assumed to have."""
    from spotfill.config.failure_detection import CLUSTER, RAY_DEFAULT, HealthCheck

    ev = hard_loss_log()
    for e in ev:
        if e["kind"] == "attempt" and e["attempt"] == 1:
            e["cause"] = "unplanned: worker died or node lost"
    # the node went silent at 26; Ray Train left RUNNING only at 36, when the GCS had declared it dead
    ev = sorted(ev + [{"t": 36.0, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
                      {"t": 36.5, "kind": "controller_state", "state": "SCHEDULING", "previous": "RESTARTING"}],
                key=lambda e: e["t"])
    (r,) = recovery_breakdown(ev, faults=[26.0])
    assert r.detect_s == pytest.approx(10.0) and r.slowest == "detect_s" and r.cause.startswith("unplanned")
    rec = next(f for f in diagnose(ev, compute_ledger(ev, NODES), [r]) if f.cause == "recovery")
    shipped = _cluster_yaml_health_env()
    assert shipped == CLUSTER.env()
    for name, value in shipped.items():
        assert f"{name}={value}" in rec.remedy
    assert f"{CLUSTER.silent_node_bound_s():g}s" in rec.remedy and f"{RAY_DEFAULT.silent_node_bound_s():g}s" in rec.remedy
    assert HealthCheck(**{k[len("RAY_health_check_"):]: int(v) for k, v in shipped.items()}) == CLUSTER
    assert "spotfill sets" not in rec.remedy and "elastic_restarts" not in rec.remedy


def test_slow_detection_of_a_planned_exit_is_not_blamed_on_health_checks():
    """A notice's group leaves RUNNING after its emergency checkpoint: detection there is the save."""
    ev = hard_loss_log() + [{"t": 31.0, "kind": "planned_exit", "reason": "preemption", "attempt": 0, "step": 7},
                            {"t": 39.0, "kind": "controller_state", "state": "RESTARTING", "previous": "RUNNING"},
                            {"t": 39.2, "kind": "controller_state", "state": "SCHEDULING", "previous": "RESTARTING"}]
    ev = sorted(ev, key=lambda e: e["t"])
    (r,) = recovery_breakdown(ev)
    assert r.slowest == "detect_s" and not r.cause.startswith("unplanned")
    rec = next(f for f in diagnose(ev, compute_ledger(ev, NODES), [r]) if f.cause == "recovery")
    assert "health" not in rec.remedy and "emergency checkpoint" in rec.remedy


def test_lost_gpu_seconds_count_the_gpus_ray_assigned():
    from test_telemetry_ledger import assigned_log
    ev = assigned_log()
    findings = {f.cause: f for f in diagnose(ev, compute_ledger(ev))}
    # 10 lineage steps with 0.5 s data wait each on the 2 GPUs Ray assigned (the plan would say 4)
    assert findings["data_stall"].gpu_seconds == pytest.approx(10 * 0.5 * 2)
