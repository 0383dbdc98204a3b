"""The GPU-seconds ledger on hand-made event logs. Every expected number is worked out by hand from the
scenario's story -- a timeline of who held which GPUs, written out below and summed by the test -- never by
the ledger's own formula."""
import pytest

from spotfill.telemetry.ledger import NodeSpan, compute_ledger, nodes_from_events

STATES = ("training", "checkpoint_stall", "recovering", "fillin", "idle", "unaccounted")


def step(t, n, attempt, ws, step_s=2.0, **more):
    return {"t": t, "kind": "step", "step": n, "attempt": attempt, "world_size": ws, "loss": 1.0, "tokens": 100,
            "step_s": step_s, "data_wait_s": 0.5, "compute_s": step_s - 0.5, **more}


def by_hand(timeline):
    """GPU-seconds per state from a hand-written timeline [(t0, t1, {state: GPUs}), ...]."""
    out = {s: 0.0 for s in STATES}
    for t0, t1, gpus in timeline:
        for state, n in gpus.items():
            out[state] += (t1 - t0) * n
    return out


# ---- a dying worker group, a node nobody observes, a lease, free GPUs seen by the arbiter ----------------

def dying_group_log():
    """Node A (4 GPUs) lives 0-100; node B (4 GPUs) dies at 50. Group 1 (4 workers: 2 on A, 2 on B) is
    placed at 0, steps 1-25 from t=4 (step i ends at 4+i up to step 20, a save stalls 24->25, then step i
    ends at 5+i), and stops stepping at 30: it hangs until Ray Train tears it down at 55 (B died at 50).
    Group 2 (2 workers on A) is placed at 60, resumes from step 20 and steps 21-50 (step i ends at 42+i),
    saves its final checkpoint 92->94 (finish), and is torn down at 95. A Serve replica holds 1 GPU of A
    from 70 to 90. The arbiter observes A's free GPUs at every change; nobody observes B."""
    ev = [{"t": 0.0, "kind": "job_start", "name": "j", "workers": [1, 4], "gpus_per_worker": 1},
          {"t": 0.0, "kind": "node_up", "node": "A", "gpus": 4}, {"t": 0.0, "kind": "node_up", "node": "B", "gpus": 4},
          {"t": 0.0, "kind": "group_start", "group": 1, "workers": 4},
          {"t": 1.0, "kind": "attempt", "attempt": 0, "world_size": 4, "group": 1},
          {"t": 2.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 4, "startup_s": 2.0}]
    ev += [step(4.0 + i, i, 0, 4, step_s=1.0) for i in range(1, 21)]
    ev += [{"t": 25.0, "kind": "checkpoint_save", "attempt": 0, "step": 20, "stall_s": 1.0}]
    ev += [step(5.0 + i, i, 0, 4, step_s=1.0) for i in range(21, 26)]
    ev += [{"t": 50.0, "kind": "node_down", "node": "B"},
           {"t": 55.0, "kind": "group_end", "group": 1},
           {"t": 60.0, "kind": "group_start", "group": 2, "workers": 2},
           {"t": 61.0, "kind": "attempt", "attempt": 1, "world_size": 2, "group": 2},
           {"t": 62.0, "kind": "resume", "attempt": 1, "step": 20, "world_size": 2, "startup_s": 2.0}]
    ev += [step(42.0 + i, i, 1, 2, step_s=1.0) for i in range(21, 51)]
    ev += [{"t": 70.0, "kind": "lease", "lease_id": "L1", "tenant": "serve:app", "node": "A", "gpus": 1},
           {"t": 90.0, "kind": "reclaim", "lease_id": "L1", "tenant": "serve:app", "node": "A", "gpus": 1},
           {"t": 94.0, "kind": "finish", "ok": True, "attempt": 1},
           {"t": 95.0, "kind": "group_end", "group": 2},
           {"t": 100.0, "kind": "job_end"}]
    # what Ray showed free on A: group 1 holds 2, group 2 holds 2, the replica 1
    ev += [{"t": t, "kind": "gpu_free", "node": "A", "free": f}
           for t, f in ((0.0, 2), (55.0, 4), (60.0, 2), (70.0, 1), (90.0, 2), (95.0, 4))]
    return sorted(ev, key=lambda e: e["t"])


DYING_GROUP_TIMELINE = [   # the story above, GPU by GPU (A+B = 8 GPUs until 50, then A = 4)
    (0, 4, {"recovering": 4, "idle": 2, "unaccounted": 2}),     # group 1 starts; A's other 2 free; B's 2 unseen
    (4, 24, {"training": 4, "idle": 2, "unaccounted": 2}),
    (24, 25, {"checkpoint_stall": 4, "idle": 2, "unaccounted": 2}),
    (25, 30, {"training": 4, "idle": 2, "unaccounted": 2}),      # steps 21-25: rolled back later
    (30, 50, {"recovering": 4, "idle": 2, "unaccounted": 2}),   # the group hangs, still holding its 4
    (50, 55, {"recovering": 2, "idle": 2}),                     # B is gone: it holds A's 2 until teardown
    (55, 60, {"recovering": 2, "idle": 2}),                     # waiting for group 2's 2 GPUs
    (60, 62, {"recovering": 2, "idle": 2}),                     # group 2 starts and restores
    (62, 70, {"training": 2, "idle": 2}),
    (70, 90, {"training": 2, "fillin": 1, "idle": 1}),
    (90, 92, {"training": 2, "idle": 2}),
    (92, 94, {"checkpoint_stall": 2, "idle": 2}),               # the final save
    (94, 95, {"recovering": 2, "idle": 2}),                     # shut down after finish
    (95, 100, {"idle": 4}),
]


def test_every_state_from_its_own_evidence_adds_up_and_matches_the_story():
    led = compute_ledger(dying_group_log())
    gs = led.gpu_seconds
    want = by_hand(DYING_GROUP_TIMELINE)
    assert (want["training"], want["recovering"], want["idle"], want["unaccounted"]) == (160, 122, 190, 100)
    for s in STATES:
        assert gs[s] == pytest.approx(want[s]), s
    assert gs["total"] == pytest.approx(8 * 50 + 4 * 50)
    assert sum(gs[s] for s in STATES) == pytest.approx(gs["total"])
    assert gs["training_rolled_back"] == pytest.approx(4 * 5)                 # steps 21-25 of group 1
    assert gs["recovering_by_cause"] == pytest.approx({"startup": 16, "teardown": 80 + 10, "restart": 10 + 4,
                                                       "shutdown": 2})
    assert gs["fillin_reserved"] == gs["fillin"] == pytest.approx(20) and gs["fillin_busy"] is None
    assert gs["bubble"] is None
    # productive: group 1's steps 1-20 (4 GPUs x 20 s) + group 2's (2 GPUs x 30 s) of 4 GPUs x 100 s asked
    assert led.goodput == pytest.approx((80 + 60) / (4 * 100))
    assert led.time_goodput == pytest.approx((20 + 30) / 100)
    assert led.harvest_ratio is None and led.harvest_ratio_reserved == pytest.approx(20 / (600 - 160 - 8 - 122))
    assert "harvest_ratio" not in led.as_report()


def test_the_dying_group_is_recovering_slice_by_slice():
    led = compute_ledger(dying_group_log())
    dying = [s for s in led.slices if s.start >= 30.0 and s.end <= 50.0]
    assert dying and all(s.gpus["recovering"] == 4 and s.gpus["idle"] == 2 for s in dying)
    unseen = [s for s in led.slices if s.end <= 50.0]
    assert all(s.gpus["unaccounted"] == 2 for s in unseen)                 # B's two GPUs: no evidence


def test_without_observations_nothing_is_idle():
    ev = [e for e in dying_group_log() if e["kind"] != "gpu_free"]
    led = compute_ledger(ev)
    gs = led.gpu_seconds
    # nothing seen free: the dying group is not seen to have let A's other 2 GPUs go either, so from 50 to
    # 55 it holds all 4 of A's; every other GPU-second the story called idle is unaccounted
    assert gs["recovering"] == pytest.approx(122 + 2 * 5)
    assert gs["idle"] == 0.0 and gs["unaccounted"] == pytest.approx(190 + 100 - 2 * 5)
    assert any("no gpu_free observations" in n for n in led.notes)


def test_goodput_is_weighted_by_gpus():
    """Two 100 s runs that step all the time: one keeps 8 GPUs, one drops to 1 at t=50 (its group of 8 is
    replaced at once by a group of 1). By wall time both are 100% productive; by GPUs the second got
    8x50 + 1x50 of the 8x100 GPU-seconds it asked for."""
    def run(drop):
        ev = [{"t": 0.0, "kind": "job_start", "workers": [1, 8]}, {"t": 0.0, "kind": "node_up", "node": "n", "gpus": 8},
              {"t": 0.0, "kind": "attempt", "attempt": 0, "world_size": 8}]
        ev += [step(float(t), t, 0, 8, step_s=1.0) for t in range(1, 51)]
        size = 1 if drop else 8
        ev += [{"t": 50.0, "kind": "attempt", "attempt": 1, "world_size": size}]
        ev += [step(float(t), t, 1, size, step_s=1.0) for t in range(51, 101)]
        return compute_ledger(ev + [{"t": 100.0, "kind": "finish", "ok": True}, {"t": 100.0, "kind": "job_end"}])
    stay, drop = run(False), run(True)
    assert stay.goodput == pytest.approx(1.0) and drop.goodput == pytest.approx((8 * 50 + 1 * 50) / (8 * 100))
    assert drop.goodput < stay.goodput
    assert stay.time_goodput == drop.time_goodput == pytest.approx(1.0)   # wall time alone cannot tell


def test_fillin_busy_and_harvest_ratio_on_busy_seconds():
    ev = dying_group_log() + [
        # the replica computed 12 of its 20 s; a measurement straddling the window's end counts its inside
        # half; one that claims more than its interval is capped at the interval
        {"t": 90.0, "kind": "fillin_busy", "tenant": "serve:app", "node": "A", "gpus": 1, "busy_s": 12.0,
         "t0": 70.0, "t1": 90.0},
        {"t": 105.0, "kind": "fillin_busy", "tenant": "batch:x", "gpus": 2, "busy_s": 4.0, "t0": 95.0, "t1": 105.0},
        {"t": 80.0, "kind": "fillin_busy", "tenant": "sweep:s", "gpus": 1, "busy_s": 9.0, "t0": 75.0, "t1": 80.0}]
    led = compute_ledger(sorted(ev, key=lambda e: e["t"]), window=(0.0, 100.0))
    gs = led.gpu_seconds
    assert gs["fillin_busy_by_workload"] == pytest.approx({"serve": 12.0, "batch": 4.0 * 2 * 0.5, "sweep": 5.0})
    assert gs["fillin_busy"] == pytest.approx(12 + 4 + 5)
    spare = 600 - 160 - 8 - 122                      # what training did not hold
    assert led.harvest_ratio == pytest.approx(21 / spare) and led.as_report()["harvest_ratio"] == round(21 / spare, 4)
    assert any("capped" in n for n in led.notes) and any("outside their leases" in n for n in led.notes)


def test_pipeline_bubbles_from_step_events():
    ev = dying_group_log()
    for e in ev:
        if e["kind"] == "step" and e["attempt"] == 1:
            # a step event's bubble_s is already summed over the group's ranks (train/pipeline.py): group
            # 2's 2 GPUs each idle 0.25 s of the step give 0.5 GPU-s; 30 steps
            e["bubble_s"] = 0.5
    assert compute_ledger(ev).gpu_seconds["bubble"] == pytest.approx(0.5 * 30)


def test_ledger_bubble_equals_the_pipeline_sections_on_the_same_events():
    """Two step events of a 2-worker group, 2 GPUs per worker configured: each event's bubble_s (1.0 GPU-s,
    summed over the ranks by the pipeline) counts once in both places -- 2.0, never x world_size x GPUs."""
    from spotfill.train.pipeline_summary import pipeline_section
    ev = [{"t": 0.0, "kind": "job_start", "name": "j", "workers": [2, 2], "gpus_per_worker": 2},
          {"t": 0.0, "kind": "attempt", "attempt": 0, "world_size": 2}]
    steps = [step(float(t), t, 0, 2, step_s=1.0, stages=2, micro_batches=4, bubble_s=1.0, bubble_fraction=0.25)
             for t in (1, 2)]
    ev += steps + [{"t": 2.0, "kind": "finish", "ok": True, "attempt": 0}, {"t": 2.0, "kind": "job_end"}]
    ledger_bubble = compute_ledger(ev).gpu_seconds["bubble"]
    section_bubble = pipeline_section(steps)["bubble_gpu_s"]
    assert ledger_bubble == pytest.approx(2.0)
    assert section_bubble == pytest.approx(2.0)
    assert ledger_bubble == pytest.approx(section_bubble)


# ---- the older hand-made logs -----------------------------------------------------------------------

def hard_loss_log():
    """2 nodes x 2 GPUs; n1 dies at t=30. Attempt 0 (4 workers) steps 1-7 (t=12..25, step 1 starts at 10),
    a checkpoint at step 5 stalls 20->21; attempt 1 (2 workers) resumes from step 5 and runs steps 6-10
    (t=47..55, step 6 starts at 45), the final save stalls 55->56, finish at 57, job_end at 60. No group
    events and no observation of free GPUs."""
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
HARD_LOSS_TIMELINE = [
    (0, 5, {"recovering": 4}),                 # waiting for the first group's 4 GPUs
    (5, 10, {"recovering": 4}),                # the group is placed (attempt 0) and starts
    (10, 20, {"training": 4}),
    (20, 21, {"checkpoint_stall": 4}),
    (21, 25, {"training": 4}),                 # steps 6-7: rolled back by the restart from step 5
    (25, 30, {"recovering": 4}),               # the group stops stepping; nothing says it let go
    (30, 40, {"recovering": 2}),               # n1 is gone; the group holds what is left until the next one
    (40, 45, {"recovering": 2}),               # attempt 1 starts and restores
    (45, 55, {"training": 2}),
    (55, 57, {"checkpoint_stall": 2}),         # the final save, to finish
    (57, 60, {"unaccounted": 2}),              # after finish: no event says what n0's GPUs did
]


def test_hard_loss_every_state_by_hand():
    led = compute_ledger(hard_loss_log(), NODES)
    gs = led.gpu_seconds
    want = by_hand(HARD_LOSS_TIMELINE)
    for s in STATES:
        assert gs[s] == pytest.approx(want[s]), s
    assert gs["total"] == pytest.approx(2 * 60 + 2 * 30)
    assert gs["training_rolled_back"] == pytest.approx(4 * 4)
    assert gs["recovering_by_cause"] == pytest.approx({"startup": 40.0, "teardown": 20 + 20, "restart": 10})
    # goodput: productive GPU-s (10->20 on 4, 45->55 on 2) over the largest group (4) x 60 s (job_start does
    # not say training.workers: noted); ETTR: 60 productive of 174 held
    assert led.goodput == pytest.approx(60 / (4 * 60)) and any("training.workers" in n for n in led.notes)
    assert led.time_goodput == pytest.approx(20 / 60)
    assert led.effective_training_time_ratio == pytest.approx(60 / (76 + 8 + 90))
    assert led.harvest_ratio is None and led.harvest_ratio_reserved is None


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


def test_fillin_per_node_with_placement_and_observations():
    ev = fillin_log() + [{"t": t, "kind": "gpu_free", "node": "n1", "free": f}
                         for t, f in ((0.0, 2), (10.0, 0), (50.0, 2), (60.0, 1))]
    led = compute_ledger(sorted(ev, key=lambda e: e["t"]), [NodeSpan("n0", 2, 0.0), NodeSpan("n1", 2, 0.0)])
    gs = led.gpu_seconds
    want = by_hand([(0, 10, {"training": 2, "idle": 2}), (10, 50, {"training": 2, "fillin": 2}),
                    (50, 60, {"training": 2, "idle": 2}), (60, 100, {"training": 2, "fillin": 1, "idle": 1})])
    for s in STATES:
        assert gs[s] == pytest.approx(want[s]), s
    assert gs["fillin_by_workload"] == pytest.approx({"serve": 80.0, "batch": 40.0})
    n0, n1 = led.per_node["n0"], led.per_node["n1"]
    assert n0["training"] == pytest.approx(200.0) and n0["idle"] == 0 and n0["unaccounted"] == 0
    assert n1["fillin"] == pytest.approx({"serve": 80.0, "batch": 40.0})
    assert n1["idle"] == pytest.approx(2 * 10 + 2 * 10 + 1 * 40) and n1["unaccounted"] == 0
    assert n1["free_observed"] == pytest.approx(n1["idle"])


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


def test_group_numbers_restart_with_each_run_in_the_same_log():
    """Two runs appended to one events.jsonl, each sink numbering its groups from 1: each run's group ends
    at its own group_end (1 s after its finish), not at the other run's."""
    ev = []
    for run, (t0, first) in enumerate(((0.0, 1), (20.0, 11))):
        ev += [{"t": t0, "kind": "job_start", "workers": [1, 1]}, {"t": t0, "kind": "group_start", "group": 1},
               {"t": t0, "kind": "attempt", "attempt": run, "world_size": 1, "group": 1}]
        ev += [step(t0 + i, first + i - 1, run, 1, step_s=1.0) for i in range(1, 11)]
        ev += [{"t": t0 + 11, "kind": "finish", "ok": True, "attempt": run},
               {"t": t0 + 12, "kind": "group_end", "group": 1}, {"t": t0 + 13, "kind": "job_end"}]
    led = compute_ledger(ev, [NodeSpan("n", 1, 0.0)])
    assert led.gpu_seconds["training"] == pytest.approx(10 + 10)
    assert led.gpu_seconds["recovering_by_cause"]["shutdown"] == pytest.approx(1 + 1)


# ---- the GPUs Ray assigned, not the plan ----------------------------------------------------------------

def assigned_log(record_gpus=True):
    """The plan says 2 GPUs per worker and up to 4 workers (8 GPUs); Ray assigned each of the group's 2
    workers 1 GPU, and the `attempt` event records the group's 2. One 4-GPU node, nobody observes free GPUs.
    Steps 1-5 end at t=1..5 (1 s each, the first starts at 0), a save stalls 5->6, steps 6-10 end at
    t=7..11, finish at 11. `record_gpus=False`: the same run logged before attempts recorded them."""
    ev = [{"t": 0.0, "kind": "job_start", "name": "j", "workers": [1, 4], "gpus_per_worker": 2},
          {"t": 0.0, "kind": "node_up", "node": "n", "gpus": 4},
          {"t": 0.0, "kind": "attempt", "attempt": 0, "world_size": 2, **({"gpus": 2} if record_gpus else {})}]
    ev += [step(float(i), i, 0, 2, step_s=1.0) for i in range(1, 6)]
    ev += [{"t": 6.0, "kind": "checkpoint_save", "attempt": 0, "step": 5, "stall_s": 1.0}]
    ev += [step(float(i + 1), i, 0, 2, step_s=1.0) for i in range(6, 11)]
    return ev + [{"t": 11.0, "kind": "finish", "ok": True, "attempt": 0}, {"t": 11.0, "kind": "job_end"}]


def test_a_group_counts_the_gpus_ray_assigned_not_the_configured_ones():
    led = compute_ledger(assigned_log())
    gs = led.gpu_seconds
    # by hand: 2 GPUs train 0->5 and 6->11, stall 5->6; the node's other 2 GPUs nobody accounts for
    assert gs["training"] == pytest.approx(2 * 10) and gs["checkpoint_stall"] == pytest.approx(2 * 1)
    assert gs["unaccounted"] == pytest.approx(2 * 11) and gs["total"] == pytest.approx(4 * 11)
    # goodput's GPUs: the 2 Ray assigned, not training.workers' 4 x gpus_per_worker 2
    assert led.job_gpus == 2 and led.job_gpus_source == "assigned"
    assert led.goodput == pytest.approx(20 / (2 * 11))
    assert not any("training.workers" in n for n in led.notes)


def test_an_older_log_without_assigned_gpus_falls_back_on_the_plan_and_says_so():
    led = compute_ledger(assigned_log(record_gpus=False))
    gs = led.gpu_seconds
    # world_size 2 x gpus_per_worker 2 = 4 GPUs per group; goodput over training.workers' 4 x 2 = 8
    assert gs["training"] == pytest.approx(4 * 10) and gs["checkpoint_stall"] == pytest.approx(4 * 1)
    assert led.job_gpus == 8 and led.job_gpus_source == "configured"
    assert led.goodput == pytest.approx(40 / (8 * 11))
    assert any("do not record the GPUs Ray assigned" in n for n in led.notes)
