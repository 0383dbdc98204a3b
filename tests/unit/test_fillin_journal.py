"""The arbiter's journal -> a run's events.jsonl -> the ledger: fill-in GPU-seconds, harvest ratio and the
report's fillin.leases / handback_seconds, from lease decisions played on a fake clock."""
from __future__ import annotations

from dataclasses import replace

from spotfill.fillin.journal import Journal, ReclaimOrder, lease_ended, lease_event, node_events, opening
from spotfill.fillin.policy import Decision, Lease, Node
from spotfill.telemetry.ledger import compute_ledger
from spotfill.telemetry.report import fillin_section, summarize

A, B = "node-a", "node-b"


def lease(lid, node, t, tenant="serve:app/Gen"):
    return Lease(lid, tenant, "serve", node, 1, granted_at=t)


def drop(lid, node, t, reason="tenant no longer holds it (reclaimed)"):
    return Decision("drop", "serve:app/Gen", 1, reason, at=t, node_id=node, lease_id=lid)


def test_a_lease_ends_as_reclaim_release_or_lease_end_with_its_cause():
    known = {"r1": lease("r1", A, 10.0), "r2": lease("r2", B, 11.0), "r3": lease("r3", B, 12.0)}
    # training's claim at t=20 asked for r1; Serve stopped r2 instead (it picks the replica): r2 is the reclaim
    orders = [ReclaimOrder("serve:app/Gen", "r1", 20.0, "training_claim", "job j claims 2", job="j")]
    events, left = lease_ended([drop("r2", B, 20.4)], known, orders, now=20.4)
    assert left == [] and [e["kind"] for e in events] == ["reclaim"]
    assert events[0]["lease_id"] == "r2" and events[0]["reclaim_s"] == 0.4 and events[0]["cause"] == "training_claim"
    assert events[0]["job"] == "j" and events[0]["start"] == 11.0 and events[0]["end"] == 20.4
    # no order open: the tenant let it go by itself
    events, _ = lease_ended([drop("r3", B, 30.0)], known, [], now=30.0)
    assert [e["kind"] for e in events] == ["release"]
    # the node died: lease_end, and an order for that very lease is void
    order = ReclaimOrder("serve:app/Gen", "r1", 29.0, "training_claim", "job j claims 1", job="j")
    events, left = lease_ended([drop("r1", A, 31.0, "node lost: the lease died with it")], known, [order], now=31.0)
    assert [e["kind"] for e in events] == ["lease_end"] and left == []
    # ... unless that order was the node's own spot notice: the drained node went (its raylet exits once the
    # tenant let go, often before the next look) -- the notice's reclaim, node_lost said, no hand-back time
    order = ReclaimOrder("serve:app/Gen", "r1", 29.0, "node_draining", "node draining (spot notice)")
    events, left = lease_ended([drop("r1", A, 31.0, "node lost: the lease died with it")], known, [order], now=31.0)
    assert [e["kind"] for e in events] == ["reclaim"] and left == []
    assert events[0]["cause"] == "node_draining" and events[0]["node_lost"] is True
    assert events[0]["reclaim_s"] is None and events[0]["requested_at"] == 29.0
    # a notice's order for another lease of the tenant does not make this one a reclaim
    other = ReclaimOrder("serve:app/Gen", "r2", 29.0, "node_draining", "node draining (spot notice)")
    events, left = lease_ended([drop("r1", A, 31.0, "node lost: the lease died with it")], known, [other], now=31.0)
    assert [e["kind"] for e in events] == ["lease_end"] and left == [other]
    # an order nothing ended for expires instead of claiming a later, unrelated release -- and is reported
    # as a hand-back that never completed, not forgotten
    old = ReclaimOrder("serve:app/Gen", "r1", 0.0, "training_claim", "old", job="j")
    events, left = lease_ended([drop("r3", B, 500.0)], known, [old], now=500.0)
    assert [e["kind"] for e in events] == ["handback_incomplete", "release"] and left == []
    assert {k: events[0][k] for k in ("tenant", "lease_id", "requested_at", "waited_s", "cause", "job")} == {
        "tenant": "serve:app/Gen", "lease_id": "r1", "requested_at": 0.0, "waited_s": 500.0,
        "cause": "training_claim", "job": "j"}
    # a drop dated back (let_go: the GPU showed free at t=40, confirmed at 41) ends at that date, and a
    # lease that ended before an order was placed is not that order's hand-back
    order = ReclaimOrder("serve:app/Gen", "r2", 40.5, "training_claim", "job j claims 1", job="j")
    events, left = lease_ended([drop("r3", B, 40.0)], known, [order], now=41.0)
    assert [e["kind"] for e in events] == ["release"] and events[0]["end"] == 40.0 and left == [order]
    events, left = lease_ended([drop("r2", B, 40.7)], known, left, now=41.0)
    assert [e["kind"] for e in events] == ["reclaim"] and events[0]["reclaim_s"] == 0.2 and left == []


def test_node_events_and_opening():
    events, seen = node_events({}, [Node(A, 2, 2), Node(B, 1, 1)], now=5.0)
    assert [(e["kind"], e["node"], e.get("gpus"), e.get("free")) for e in events] == [
        ("node_up", A, 2, None), ("gpu_free", A, None, 2), ("node_up", B, 1, None), ("gpu_free", B, None, 1)]
    assert node_events(seen, [Node(A, 2, 2), Node(B, 1, 1)], now=6.0)[0] == []     # nothing changed
    events, seen = node_events(seen, [Node(A, 2, 0), Node(B, 1, 1)], now=6.5)      # A's GPUs were taken
    assert events == [{"t": 6.5, "kind": "gpu_free", "node": A, "free": 0}]
    events, seen2 = node_events(seen, [Node(A, 2, 0, alive=False)], now=9.0)
    assert sorted((e["kind"], e["node"]) for e in events) == [("node_down", A), ("node_down", B)] and seen2 == {}
    first = opening(seen, [lease("r1", B, 7.0)])
    assert [(e["kind"], e["t"], e.get("free")) for e in first] == [
        ("node_up", 5.0, None), ("node_up", 5.0, None), ("gpu_free", 5.0, 1), ("gpu_free", 6.5, 0),
        ("lease", 7.0, None)]


def test_journal_reads_what_is_new_and_sends_a_lost_reader_to_the_opening():
    j = Journal(keep=3)
    assert j.read(None) == (None, 0)
    assert j.read(0) == ([], 0)
    j.add([{"n": 1}, {"n": 2}])
    assert j.read(0) == ([{"n": 1}, {"n": 2}], 2)
    assert j.read(2) == ([], 2)
    j.add([{"n": 3}, {"n": 4}, {"n": 5}])
    assert j.read(2) == ([{"n": 3}, {"n": 4}, {"n": 5}], 5)
    assert j.read(1) == (None, 5)          # n=2 is no longer kept: start over from the opening
    assert j.read(9) == (None, 5)          # the journal started over (arbiter lost its state)


def run_events():
    """A 100 s run on 2 nodes x 2 GPUs; training holds 2 GPUs throughout; Serve borrows 1 GPU on node b at
    t=10 and a 2nd at t=20; training claims at t=60 and gets one back at 60.5 (hand-back 0.5 s); the other
    is released at t=80. Spare GPU-seconds = 4*100 - 2*100 = 200; lent = 50.5 + 60 = 110.5."""
    ev = [{"t": 0.0, "kind": "job_start"}, {"t": -5.0, "kind": "node_up", "node": A, "gpus": 2},
          {"t": -5.0, "kind": "node_up", "node": B, "gpus": 2},
          {"t": 0.0, "kind": "attempt", "attempt": 0, "world_size": 2}]
    ev += [{"t": float(s), "kind": "step", "step": s, "attempt": 0, "world_size": 2, "step_s": 1.0}
           for s in range(1, 101)]
    ev.append(lease_event(lease("r1", B, 10.0), 10.0))
    ev.append(lease_event(lease("r2", B, 20.0), 20.0))
    orders = [ReclaimOrder("serve:app/Gen", "r2", 60.0, "training_claim", "job j claims 4", job="j")]
    known = {"r1": lease("r1", B, 10.0), "r2": lease("r2", B, 20.0)}
    got, _ = lease_ended([drop("r1", B, 60.5)], known, orders, now=60.5)
    ev += got
    got, _ = lease_ended([drop("r2", B, 80.0, "tenant no longer holds it (released)")], known, [], now=80.0)
    ev += got
    ev.append({"t": 100.0, "kind": "job_end"})
    return ev


def test_the_ledger_counts_journal_leases_as_fillin_and_the_report_lists_them():
    ev = run_events()
    ledger = compute_ledger(sorted(ev, key=lambda e: e["t"]))
    assert ledger.nodes_source == "events"
    assert round(ledger.gpu_seconds["fillin"], 3) == 110.5
    assert round(ledger.gpu_seconds["total"], 3) == 400.0
    # no tenant measured its busy time: the harvest ratio (on busy seconds) is not guessed; what was held is
    assert ledger.harvest_ratio is None and ledger.gpu_seconds["fillin_busy"] is None
    assert round(ledger.harvest_ratio_reserved, 4) == round(110.5 / 200, 4)
    section = fillin_section(sorted(ev, key=lambda e: e["t"]), (0.0, 100.0))
    assert section["handback_seconds"] == [0.5] and section["handback_seconds_max"] == 0.5
    assert [(le["lease_id"], le["ended_by"], le["end"]) for le in section["leases"]] == \
        [("r1", "reclaim", 60.5), ("r2", "release", 80.0)]
    _, keys = summarize(ev, {"fillin": {"serve": {"requests_ok": 3}}})
    assert keys["fillin"]["serve"] == {"requests_ok": 3} and keys["fillin"]["handback_seconds"] == [0.5]
    assert "harvest_ratio" not in keys and keys["harvest_ratio_reserved"] == round(110.5 / 200, 4)


def test_no_lease_events_no_fillin_section():
    ev = [e for e in run_events() if e["kind"] not in ("lease", "reclaim", "release")]
    assert fillin_section(ev, (0.0, 100.0)) is None
    _, keys = summarize(ev)
    assert "fillin" not in keys and "harvest_ratio" not in keys


def test_a_hand_back_that_never_completes_is_reported_not_forgotten():
    """A reclaim order no lease ends for (the tenant refused or hung) expires as a handback_incomplete event,
    and the run's report lists it under fillin.handbacks_incomplete."""
    order = ReclaimOrder("serve:app/Gen", "r1", 10.0, "training_claim", "job j claims 1", job="j")
    events, left = lease_ended([], {}, [order], now=60.0)
    assert events == [] and left == [order]                       # still waiting: nothing to say yet
    events, left = lease_ended([], {}, [order], now=10.0 + 121.0)
    assert left == [] and [e["kind"] for e in events] == ["handback_incomplete"]
    assert events[0]["waited_s"] == 121.0 and events[0]["job"] == "j" and events[0]["lease_id"] == "r1"
    run = [lease_event(lease("r1", A, 5.0), 5.0)] + events
    section = fillin_section(run, (0.0, 200.0))
    assert section["handbacks_incomplete"] == [{"tenant": "serve:app/Gen", "lease_id": "r1", "requested_at": 10.0,
                                                "waited_s": 121.0, "cause": "training_claim", "job": "j"}]
    assert section["leases"][0]["end"] is None                      # the lease never ended


def test_busy_time_the_tenant_measured_gives_busy_gpu_seconds_and_lend_to_busy():
    """Leases r1 (lent at 8, held 10..60.5) and r2 (held 20..80, adopted); the tenant's meter (fillin/busy.py,
    a fake clock) measured r1 computing from 14 on, 30 s in all, and r2 never: the ledger books 30 busy
    GPU-seconds of the 110.5 held, the harvest ratio is on them, and the report says r1 computed 6 s after
    its lend while r2 never did."""
    from spotfill.fillin.busy import BusyMeter, check_busy

    clock = [0.0]
    meter = BusyMeter("serve:app/Gen", "serve", node=B, lease_id="r1", clock=lambda: clock[0])
    busy = []
    for start in range(14, 44, 2):                    # 15 spans of 2 s: 14..44, flushed every 10 s
        clock[0] = float(start)
        with meter.measure():
            clock[0] = start + 2.0
        if meter.due(clock[0], every_s=10.0):
            busy.append(meter.take())
    busy.append(meter.take())
    busy = check_busy([e for e in busy if e], now=100.0)
    assert sum(e["busy_s"] for e in busy) == 30.0 and busy[0]["t0"] == 14.0
    ev = [e for e in run_events() if e["kind"] != "lease" or e["lease_id"] != "r1"]
    ev.append({**lease_event(replace(lease("r1", B, 10.0), lent_at=8.0), 10.0)})
    ev += busy
    ledger = compute_ledger(sorted(ev, key=lambda e: e["t"]))
    assert round(ledger.gpu_seconds["fillin_busy"], 3) == 30.0
    assert round(ledger.harvest_ratio, 4) == round(30.0 / 200, 4)
    section = fillin_section(sorted(ev, key=lambda e: e["t"]), (0.0, 100.0))
    by_id = {le["lease_id"]: le for le in section["leases"]}
    assert (by_id["r1"]["lent_at"], by_id["r1"]["first_busy"], by_id["r1"]["lend_to_busy_s"]) == (8.0, 14.0, 6.0)
    assert by_id["r1"]["busy_s"] == 30.0 and by_id["r2"]["busy_s"] == 0.0 and by_id["r2"]["first_busy"] is None
    assert section["lend_to_busy_s"] == {"serve": {"leases": 2, "busy_leases": 1, "never_busy": 1,
                                                   "median": 6.0, "max": 6.0,
                                                   "to_hold_median": 2.0, "hold_to_busy_median": 4.0}}


def test_overlapping_spans_count_once():
    from spotfill.fillin.busy import BusyMeter
    meter = BusyMeter("serve:a/G", "serve")
    meter.add(10.0, 12.0)
    meter.add(11.0, 13.0)            # a second request in the same generation step: 1 s more, not 2
    meter.add(12.5, 12.8)            # inside what is counted: nothing
    event = meter.take()
    assert (event["t0"], event["t1"], event["busy_s"]) == (10.0, 13.0, 3.0) and meter.take() is None
