"""Several fill-in tenants share one pool of lendable GPUs (fillin/lending.py: pure, a fake clock). A GPU
given to a tenant and not yet taken is not lent again -- also one a Tune trial gave back between one trial
and the next -- tenants get fair shares of what is lendable, and what is already lent is rebalanced toward a
fair share when one tenant holds everything while another waits; with fewer units than tenants, the units
go round in turns."""
from __future__ import annotations

from dataclasses import replace

from spotfill.fillin.lending import MIN_HOLD_S, START_PATIENCE_S, TenantView, fair_share, lend_round
from spotfill.fillin.turns import TurnClock, take_turns
from spotfill.fillin.policy import Lease, Node, Snapshot

T0 = 1000.0
FOUR_FREE = (Node("a", 2, 2), Node("b", 2, 2))


def view(kind: str, target: int | None = 0, wanted: int = 4) -> TenantView:
    return TenantView(f"{kind}:t", kind, target=target, wanted=wanted, grace_s=5.0)


def held(tenant: str, *nodes: str, at: float = T0 - 100.0) -> tuple[Lease, ...]:
    return tuple(Lease(f"{tenant}-{i}", tenant, tenant.split(":")[0], n, 1, granted_at=at + i)
                 for i, n in enumerate(nodes))


def targets(growths) -> dict:
    return {g.tenant: g.target for g in growths if g.target is not None}


def test_two_tenants_split_the_spare_gpus_and_nothing_is_lent_twice():
    batch, sweep = view("batch"), view("sweep")
    got = targets(lend_round([batch, sweep], Snapshot(FOUR_FREE), T0))
    assert got == {"batch:t": 2, "sweep:t": 2}, "a fair share each, not all four to both"
    # the next second, before any actor started: Ray still shows 4 free, but all 4 were given
    batch, sweep = replace(batch, target=2, asked_at=T0), replace(sweep, target=2, asked_at=T0)
    assert targets(lend_round([batch, sweep], Snapshot(FOUR_FREE), T0 + 1)) == {}


def test_a_lone_tenant_takes_everything_lendable():
    assert targets(lend_round([view("batch", wanted=8)], Snapshot(FOUR_FREE), T0)) == {"batch:t": 4}


def test_a_unit_given_back_between_two_trials_stays_the_sweeps():
    # the sweep holds 2 of its target 2 and the batch job 2; one trial finishes: its group is gone (1 GPU free
    # on b) and the next trial's group is being placed -- that GPU is not lent to the batch job meanwhile
    leases = held("sweep:t", "a") + held("batch:t", "a", "b")
    snap = Snapshot((Node("a", 2, 0), Node("b", 2, 1)), leases=leases)
    sweep, batch = view("sweep", target=2, wanted=2), view("batch", target=2, wanted=4)
    assert targets(lend_round([sweep, batch], snap, T0)) == {}
    # ... until the sweep is done with it (its demand fell): then the batch job gets it
    assert targets(lend_round([replace(sweep, target=1, wanted=1), batch], snap, T0)) == {"batch:t": 3}


def test_a_tenant_that_came_second_gets_a_fair_share_of_what_is_lent():
    # the sweep registered first and holds all four spare GPUs; the batch job registers and nothing is free
    leases = held("sweep:t", "a", "a", "b", "b")
    snap = Snapshot((Node("a", 2, 0), Node("b", 2, 0)), leases=leases)
    sweep, batch = view("sweep", target=4, wanted=4), view("batch", target=0, wanted=4)
    d = fair_share([sweep, batch], snap, T0, order=("sweep", "batch", "serve"))
    assert d is not None and d.action == "reclaim" and d.tenant == "sweep:t"
    assert d.lease_id == "sweep:t-3" and d.deadline == T0 + 3.0          # its newest unit
    assert "fair share" in d.reason and "2 each" in d.reason
    # one at a time: nothing more while that unit is going
    going = tuple(replace(le, reclaiming_since=T0) if le.lease_id == d.lease_id else le for le in leases)
    assert fair_share([sweep, batch], replace(snap, leases=going), T0) is None
    # at the share (2 and 2): nothing to move
    even = held("sweep:t", "a", "a") + held("batch:t", "b", "b")
    assert fair_share([sweep, replace(batch, target=2)], Snapshot(snap.nodes, leases=even), T0) is None


def test_fair_share_leaves_young_leases_and_satisfied_tenants_alone():
    young = held("sweep:t", "a", "a", at=T0 - MIN_HOLD_S / 2)
    snap = Snapshot((Node("a", 2, 0),), leases=young)
    sweep, batch = view("sweep", target=2, wanted=2), view("batch", target=0, wanted=2)
    assert fair_share([sweep, batch], snap, T0) is None                   # held too briefly to move yet
    assert fair_share([sweep, batch], snap, T0 + MIN_HOLD_S) is not None
    assert fair_share([sweep, replace(batch, wanted=0)], snap, T0 + MIN_HOLD_S) is None   # wants nothing
    # something is still lendable to the batch job: lending serves it, nothing is taken back
    spare = Snapshot((Node("a", 2, 0), Node("b", 1, 1)), leases=young)
    assert fair_share([sweep, batch], spare, T0 + MIN_HOLD_S) is None


def test_fair_share_moves_no_unit_still_starting_and_counts_compute_where_it_is_known():
    # the sweep holds both spare GPUs; the batch job wants one. The sweep's newest unit was granted 25 s ago
    # and its trial is still starting cold (a demo's: 20-35 s): moving it would waste its start and the
    # batch job's start alike, so it stays until it computed MIN_HOLD_S
    old = Lease("sweep:t-old", "sweep:t", "sweep", "a", 1, granted_at=T0 - 100)
    new = Lease("sweep:t-new", "sweep:t", "sweep", "a", 1, granted_at=T0 - 25)
    snap = Snapshot((Node("a", 2, 0),), leases=(old, new))
    sweep, batch = view("sweep", target=2, wanted=2), view("batch", target=0, wanted=2)
    d = fair_share([sweep, batch], snap, T0, busy_since={"sweep:t-old": T0 - 90})
    assert d is not None and d.lease_id == "sweep:t-old", "the unit that computed goes, not the one starting"
    assert "computing 90s" in d.reason
    started = {"sweep:t-old": T0 - 90, "sweep:t-new": T0 - 5}
    assert fair_share([sweep, batch], snap, T0, busy_since=started).lease_id == "sweep:t-old", "5 s: not yet"
    d = fair_share([sweep, batch], snap, T0 - 5 + MIN_HOLD_S, busy_since=started)
    assert d.lease_id == "sweep:t-new", "the newest, once it computed MIN_HOLD_S"
    # without compute reports a unit goes after MIN_HOLD_S + START_PATIENCE_S from its grant
    alone = Snapshot((Node("a", 2, 0),), leases=(new, replace(new, lease_id="sweep:t-new2")))
    at = T0 - 25 + MIN_HOLD_S + START_PATIENCE_S
    assert fair_share([sweep, batch], alone, at - 1, busy_since={}) is None
    d = fair_share([sweep, batch], alone, at, busy_since={})
    assert d is not None and "computing" not in d.reason


TURN = 60.0


def one_spare_held_by(holder: str, *, since: float) -> Snapshot:
    """Node a: 2 GPU slots, training on one, the other lent to `holder` since `since`; nothing free."""
    return Snapshot((Node("a", 2, 0),), leases=held(holder, "a", at=since))


def test_with_one_spare_gpu_and_two_job_tenants_they_take_turns():
    # the demo's shape: the sweep got the only spare GPU first; the batch job waits with nothing. A share of
    # 0 each (1 unit, 2 tenants), so fair_share moves nothing -- without turns the batch job waited until the
    # sweep ran out of trials
    snap = one_spare_held_by("sweep:t", since=T0)
    sweep = replace(view("sweep", target=1, wanted=3), holding_since=T0)
    batch = replace(view("batch", target=0, wanted=4), waiting_since=T0)
    computed = {"sweep:t-0": T0}               # its trial computes from the start of its hold
    assert fair_share([sweep, batch], snap, T0 + 2 * TURN) is None
    assert take_turns([sweep, batch], snap, T0 + TURN / 2, TURN, computed) is None, "nobody waited a turn yet"
    d = take_turns([sweep, batch], snap, T0 + TURN, TURN, computed)
    assert d is not None and d.action == "reclaim" and d.tenant == "sweep:t" and d.lease_id == "sweep:t-0"
    assert "batch:t has waited 60s" in d.reason and "that computed" in d.reason and d.deadline == T0 + TURN + 3.0
    # the freed GPU goes to the batch job, which waited longest, not back to the sweep (which now waits too,
    # and whose name sorts after "batch" -- so test it the other way round too)
    freed = Snapshot((Node("a", 2, 1),))
    for waiting_first, waiting_next in ((batch, replace(sweep, target=0, waiting_since=T0 + TURN)),
                                        (replace(sweep, target=0, waiting_since=T0),
                                         replace(batch, waiting_since=T0 + TURN))):
        got = targets(lend_round([waiting_next, waiting_first], freed, T0 + TURN + 1))
        assert got == {waiting_first.tenant: 1}, got
    # a turn later the sweep, waiting since it gave the unit up, gets it back from the batch job
    snap = one_spare_held_by("batch:t", since=T0 + TURN + 3)
    sweep = replace(sweep, target=0, waiting_since=T0 + TURN, holding_since=None)
    batch = replace(batch, target=1, waiting_since=None, holding_since=T0 + TURN + 3)
    computed = {"batch:t-0": T0 + TURN + 3}
    assert take_turns([sweep, batch], snap, T0 + 2 * TURN, TURN, computed) is None, "the batch job's turn is not over"
    d = take_turns([sweep, batch], snap, T0 + 2 * TURN + 3, TURN, computed)
    assert d is not None and d.tenant == "batch:t"


def test_a_turn_takes_a_unit_that_computed_and_counts_the_holders_compute_not_the_units():
    # the sweep has held the spare GPU for two turns, but through several trials: its current trial's group
    # got the unit 5 s ago and is still starting -- it is not taken until it computed (a running trial pauses
    # with a checkpoint; a starting one has nothing to save yet) or a turn passed since its grant
    t = T0 + 2 * TURN
    snap = one_spare_held_by("sweep:t", since=t - 5)
    sweep = replace(view("sweep", target=1, wanted=3), holding_since=T0, computing_since=T0 + 5)  # its first trial's
    batch = replace(view("batch", target=0, wanted=4), waiting_since=T0)
    assert take_turns([sweep, batch], snap, t, TURN, {}) is None
    d = take_turns([sweep, batch], snap, t, TURN, {"sweep:t-0": t - 1})
    assert d is not None and d.lease_id == "sweep:t-0", "its new trial computes: the turn is over"
    assert take_turns([sweep, batch], snap, t - 5 + TURN + START_PATIENCE_S - 1, TURN, {}) is None
    d = take_turns([sweep, batch], snap, t - 5 + TURN + START_PATIENCE_S, TURN, {})
    assert d is not None and "not computing yet" in d.reason, "a unit that never computed goes after a turn " \
                                                              "and a start's patience"
    # the holder's compute counts, not the unit's: a tenant that started computing 8 s ago keeps its unit
    fresh = replace(sweep, holding_since=t - 10, computing_since=t - 8)
    assert take_turns([fresh, batch], snap, t, TURN, {"sweep:t-0": t - 8}) is None


def test_a_turn_is_time_computing_not_time_holding():
    # the demo's batch job: lent the GPU at T0, its wave's cold start took 25 s (the lease held the GPU all
    # along), then it computed. With turns counted from the hold's start it was taken back 5 s into its
    # compute (six leases, 0.7 s computed in a demo); counted from its first compute, it computes a whole turn
    snap = one_spare_held_by("batch:t", since=T0)
    batch = replace(view("batch", target=1, wanted=4), holding_since=T0, computing_since=T0 + 25)
    sweep = replace(view("sweep", target=0, wanted=3), waiting_since=T0 - 40)
    computed = {"batch:t-0": T0 + 25}
    assert take_turns([sweep, batch], snap, T0 + TURN + 5, TURN, computed) is None, "computed 5 s of its turn"
    assert take_turns([sweep, batch], snap, T0 + 25 + TURN - 1, TURN, computed) is None
    d = take_turns([sweep, batch], snap, T0 + 25 + TURN, TURN, computed)
    assert d is not None and d.lease_id == "batch:t-0"
    assert f"has computed {TURN:.0f}s of the {TURN + 25:.0f}s it held GPUs" in d.reason, d.reason
    # a hold in which nothing ever computed ends a turn and a start's patience after its start (a start that
    # never finishes); not after a turn alone: two tenants whose cold starts outlast a turn then took the unit
    # from each other every 30 s in a demo, neither ever computing
    stuck = replace(batch, computing_since=None)
    assert take_turns([sweep, stuck], snap, T0 + TURN, TURN, {}) is None
    d = take_turns([sweep, stuck], snap, T0 + TURN + START_PATIENCE_S, TURN, {})
    assert d is not None and "computed on none" in d.reason and "not computing yet" in d.reason


def test_the_clock_counts_a_tenants_compute_from_its_first_busy_unit_in_the_hold():
    clock = TurnClock()
    snap = one_spare_held_by("batch:t", since=T0)
    clock.observe({"batch:t": 4}, snap, T0)
    assert clock.holding_since["batch:t"] == T0 and "batch:t" not in clock.computing_since
    clock.busy("batch:t-0", T0 + 25)
    clock.observe({"batch:t": 4}, snap, T0 + 26)
    assert clock.computing_since["batch:t"] == T0 + 25
    clock.busy("batch:t-0", T0 + 40)                      # later reports keep the first
    clock.observe({"batch:t": 4}, snap, T0 + 41)
    assert clock.computing_since["batch:t"] == T0 + 25
    # a break (nothing held longer than HOLD_BREAK_S) ends the hold and its compute
    clock.ended(["batch:t-0"])
    clock.observe({"batch:t": 4}, Snapshot((Node("a", 2, 1),)), T0 + 50)
    assert "batch:t" not in clock.computing_since and "batch:t" not in clock.holding_since


def test_serve_is_never_made_to_give_its_replica_up_for_a_turn_but_may_take_one():
    serve = replace(view("serve", target=1, wanted=1), scaled=True, holding_since=T0)
    batch = replace(view("batch", target=0, wanted=4), waiting_since=T0)
    assert take_turns([serve, batch], one_spare_held_by("serve:t", since=T0), T0 + 10 * TURN, TURN,
                      {"serve:t-0": T0}) is None
    # Serve waiting for a replica while a batch job holds the only spare GPU: it gets its turn
    serve = replace(serve, target=0, waiting_since=T0, holding_since=None)
    d = take_turns([serve, replace(batch, target=1, waiting_since=None, holding_since=T0)],
                   one_spare_held_by("batch:t", since=T0), T0 + TURN, TURN, {"batch:t-0": T0})
    assert d is not None and d.tenant == "batch:t"


def test_no_turn_while_a_unit_is_going_or_one_is_lendable_or_the_waiter_wants_nothing():
    snap = one_spare_held_by("sweep:t", since=T0)
    sweep = replace(view("sweep", target=1, wanted=3), holding_since=T0)
    batch = replace(view("batch", target=0, wanted=4), waiting_since=T0)
    later, computed = T0 + 2 * TURN, {"sweep:t-0": T0 + 1}
    assert take_turns([sweep, batch], snap, later, TURN, computed) is not None
    going = replace(snap, leases=tuple(replace(le, reclaiming_since=later) for le in snap.leases))
    assert take_turns([sweep, batch], going, later, TURN, computed) is None
    assert take_turns([sweep, batch], replace(snap, nodes=(Node("a", 2, 0), Node("b", 1, 1))), later, TURN,
                      computed) is None
    assert take_turns([sweep, replace(batch, wanted=0)], snap, later, TURN, computed) is None
    assert take_turns([sweep, replace(batch, waiting_since=None)], snap, later, TURN, computed) is None
    # a draining node's lease is not handed round (the drain reclaims it anyway)
    draining = replace(snap, nodes=(Node("a", 2, 0, draining=True),))
    assert take_turns([sweep, batch], draining, later, TURN, computed) is None


def test_a_tenant_kept_waiting_is_told_why():
    """Nothing lendable while a tenant wants GPUs: its step says why (the arbiter records it as a `wait`
    decision when the reason changes) -- a demo's batch job waited 30 s after a spot notice with GPUs free
    and nothing in the arbiter's decisions said why."""
    from spotfill.fillin.policy import TrainingJob
    snap = Snapshot(FOUR_FREE, jobs=(TrainingJob("demo", 1, 4, current_workers=0, restarting=True),))
    [g] = lend_round([view("batch")], snap, T0)
    assert g.lends == () and g.waiting is not None and g.waiting.action == "wait"
    assert "demo may grow by 4 workers" in g.waiting.reason and g.waiting.gpus >= 1
    # GPUs lendable: no wait
    [g] = lend_round([view("batch")], Snapshot(FOUR_FREE), T0)
    assert g.lends and g.waiting is None
