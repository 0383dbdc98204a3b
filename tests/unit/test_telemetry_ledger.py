"""The GPU-seconds ledger on hand-made event logs; every expected number is worked out by hand below."""
import pytest

from spotfill.telemetry.ledger import NodeSpan, compute_ledger, nodes_from_events


def step(t, n, attempt, ws, step_s=2.0):
    return {"t": t, "kind": "step", "step": n, "attempt": attempt, "world_size": ws, "loss": 1.0, "tokens": 100,
            "step_s": step_s, "data_wait_s": 0.5, "compute_s": step_s - 0.5}


def hard_loss_log():
    """2 nodes x 2 GPUs; n1 dies at t=30. Attempt 0 (4 workers) steps 1-7 (t=12..25, step 1 starts at 10),
    a checkpoint at step 5 stalls 20->21; attempt 1 (2 workers) resumes from step 5 and runs steps 6-10
    (t=47..55, step 6 starts at 45), the final save stalls 55->56, finish at 57, job_end at 60."""
    ev = [{"t": 0.0, "kind": "job_start", "name": "j", "steps": 10},
          {"t": 5.0, "kind": "attempt", "attempt": 0, "world_size": 4},
          {"t": 10.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 4, "startup_s": 5.0,
           "restore_prep_s": 0.0, "load_s": 0.0}]
    ev += [step(10.0 + 2 * i, i, 0, 4) for i in range(1, 6)]                      # t = 12..20
    ev += [{"t": 21.0, "kind": "checkpoint_save", "attempt": 0, "step": 5, "stall_s": 1.0, "emergency": False}]
    ev += [step(23.0, 6, 0, 4), step(25.0, 7, 0, 4)]
    ev += [{"t": 40.0, "kind": "attempt", "attempt": 1, "world_size": 2},
           {"t": 45.0, "kind": "resume", "attempt": 1, "step": 5, "world_size": 2, "startup_s": 5.0,
            "restore_prep_s": 2.0, "load_s": 1.0}]
    ev += [step(45.0 + 2 * (i - 5), i, 1, 2) for i in range(6, 11)]               # t = 47..55
    ev += [{"t": 56.0, "kind": "checkpoint_save", "attempt": 1, "step": 10, "stall_s": 1.0, "emergency": False},
           {"t": 57.0, "kind": "finish", "ok": True}, {"t": 60.0, "kind": "job_end"}]
    return ev


NODES = [NodeSpan("n0", 2, 0.0, None), NodeSpan("n1", 2, 0.0, 30.0)]


def test_hard_loss_every_state_by_hand():
    led = compute_ledger(hard_loss_log(), NODES)
    gs = led.gpu_seconds
    # total: n0 2 GPUs x 60 s + n1 2 GPUs x 30 s
    assert gs["total"] == pytest.approx(180.0)
    # training: attempt 0 steps 10->20 (4 GPUs, 40) + 21->25 rolled back (4 GPUs, 16) + attempt 1 45->55 (2, 20)
    assert gs["training"] == pytest.approx(76.0)
    assert gs["training_rolled_back"] == pytest.approx(16.0)
    # checkpoint stall: 20->21 x 4 GPUs + the final checkpoint 55->57 x 2 GPUs
    assert gs["checkpoint_stall"] == pytest.approx(8.0)
    # recovering: startup 0->10 x 4 GPUs (40); the restart 25->45 waits for the next group's 2 GPUs (40)
    assert gs["recovering"] == pytest.approx(80.0)
    assert gs["recovering_by_cause"] == pytest.approx({"startup": 40.0, "restart": 40.0})
    # idle: 25->30 the dying node's other 2 GPUs (10) + 57->60 after finish on n0 (6)
    assert gs["idle"] == pytest.approx(16.0)
    assert gs["fillin"] == 0.0
    parts = sum(gs[s] for s in ("training", "fillin", "idle", "recovering", "checkpoint_stall"))
    assert abs(parts - gs["total"]) <= 0.02 * gs["total"]
    # goodput: productive wall time (10->20, 45->55) = 20 s of 60; ETTR: 60 productive GPU-s of 164 held
    assert led.goodput == pytest.approx(20 / 60)
    assert led.effective_training_time_ratio == pytest.approx(60 / 164)
    assert led.harvest_ratio is None and "harvest_ratio" not in led.as_report()


def test_restart_window_counts_as_recovering_not_idle():
    """The same run with the restart window (25->45) removed from the accounting would book it as idle:
    check the 20 s gap is recovering on the 2 surviving GPUs, slice by slice."""
    led = compute_ledger(hard_loss_log(), NODES)
    in_gap = [s for s in led.slices if s.start >= 30.0 and s.end <= 45.0]
    assert in_gap and all(s.gpus["recovering"] == 2 and s.gpus["idle"] == 0 for s in in_gap)


def test_checkpoint_stall_is_carved_out_of_training():
    led = compute_ledger(hard_loss_log(), NODES)
    stall = [s for s in led.slices if s.start >= 20.0 and s.end <= 21.0]
    assert stall and all(s.gpus["checkpoint_stall"] == 4 and s.gpus["training"] == 0 for s in stall)


def fillin_log():
    """n0, n1 with 2 GPUs each for 100 s. Training (2 workers on n0) steps every 2 s from 0 to 100. Serve
    leases 2 GPUs of n1 from 10 until reclaimed at 50; a batch job leases 1 GPU of n1 from 60 on (never ended)."""
    ev = [{"t": 0.0, "kind": "job_start"},
          {"t": 0.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 2, "placement": {"n0": 2}}]
    ev += [step(2.0 * i, i, 0, 2) for i in range(1, 51)]
    ev += [{"t": 10.0, "kind": "lease", "lease_id": "L1", "tenant": "serve:app", "node": "n1", "gpus": 2},
           {"t": 50.0, "kind": "reclaim", "lease_id": "L1", "tenant": "serve:app", "node": "n1", "gpus": 2},
           {"t": 60.0, "kind": "lease", "lease_id": "L2", "tenant": "batch:eval", "node": "n1", "gpus": 1},
           {"t": 100.0, "kind": "finish", "ok": True}, {"t": 100.0, "kind": "job_end"}]
    return ev


def test_fillin_by_workload_and_harvest_ratio():
    led = compute_ledger(fillin_log(), [NodeSpan("n0", 2, 0.0), NodeSpan("n1", 2, 0.0)])
    gs = led.gpu_seconds
    assert gs["total"] == pytest.approx(400.0)
    assert gs["training"] == pytest.approx(200.0)            # 2 GPUs x 100 s
    assert gs["fillin_by_workload"] == pytest.approx({"serve": 80.0, "batch": 40.0})   # 2x40, 1x40
    assert gs["fillin"] == pytest.approx(120.0)
    assert gs["idle"] == pytest.approx(80.0)                 # n1: 2x10 + 2x10 + 1x40
    assert led.harvest_ratio == pytest.approx(120 / 200)
    assert led.per_node["n0"]["training"] == pytest.approx(200.0) and led.per_node["n0"]["idle"] == 0
    assert led.per_node["n1"]["fillin"] == pytest.approx({"serve": 80.0, "batch": 40.0})
    assert led.per_node["n1"]["idle"] == pytest.approx(80.0)
    assert led.goodput == pytest.approx(1.0)


def test_nodes_from_node_up_and_down_events():
    ev = fillin_log() + [{"t": 0.0, "kind": "node_up", "node": "n0", "gpus": 2, "market": "spot"},
                         {"t": 0.0, "kind": "node_up", "node": "n1", "gpus": 2},
                         {"t": 80.0, "kind": "node_down", "node": "n1"}]
    spans = nodes_from_events(sorted(ev, key=lambda e: e["t"]))
    assert {(s.node, s.gpus, s.end) for s in spans} == {("n0", 2, None), ("n1", 2, 80.0)}
    led = compute_ledger(ev)
    assert led.nodes_source == "events"
    # n1 dies at 80: its lease ends with it. total 2x100 + 2x80; batch 1 GPU x 20 s
    assert led.gpu_seconds["total"] == pytest.approx(360.0)
    assert led.gpu_seconds["fillin_by_workload"]["batch"] == pytest.approx(20.0)


def test_without_node_timeline_capacity_is_the_largest_group_and_said_so():
    led = compute_ledger(hard_loss_log())
    assert led.nodes_source == "inferred" and any("no node timeline" in n for n in led.notes)
    assert led.gpu_seconds["total"] == pytest.approx(4 * 60.0)


def test_overcommitted_leases_are_capped_and_noted():
    ev = fillin_log() + [{"t": 20.0, "kind": "lease", "tenant": "sweep", "node": "n0", "gpus": 2, "end": 30.0}]
    led = compute_ledger(sorted(ev, key=lambda e: e["t"]), [NodeSpan("n0", 2, 0.0), NodeSpan("n1", 2, 0.0)])
    assert led.gpu_seconds["fillin_by_workload"].get("sweep", 0.0) == 0.0    # n0 is all training's
    assert any("exceeded" in n for n in led.notes)
    gs = led.gpu_seconds
    assert sum(gs[s] for s in ("training", "fillin", "idle", "recovering", "checkpoint_stall")) == \
        pytest.approx(gs["total"])
