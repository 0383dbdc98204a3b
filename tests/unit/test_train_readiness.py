"""Warm grows and warm restarts (train.readiness, train.spares' store tokens, the recovery's warm flags):
pure decisions on a fake clock, no Ray."""
from __future__ import annotations

from spotfill.telemetry.diagnosis import recovery_breakdown, workers_warm
from spotfill.train.readiness import (GrowPlanner, ready_by_node, record_key, record_value, restart_size)
from spotfill.train.spares import claim_kv, offer_kv
from spotfill.train.step_policy import EXIT, StepFacts, StepPolicy

A, B, C = "a" * 56, "b" * 56, "c" * 56


def _records(now, **ready):
    out = {}
    for node, n in ready.items():
        for pid in range(n):
            out[record_key("01000000", {"A": A, "B": B, "C": C}[node], 100 + pid)] = record_value(now - 5, now + 60)
    return out


def test_ready_records_count_per_node_until_their_keep_alive_ends():
    recs = _records(1000.0, A=2, B=1)
    recs[record_key("01000000", C, 7)] = record_value(900.0, 990.0)      # keep-alive over: not a spare
    recs[record_key("01000000", C, 8)] = "not json"
    assert ready_by_node(recs, 1000.0) == {A: 2, B: 1}


def test_a_grow_onto_a_new_node_waits_until_its_spares_are_ready():
    """The fault this guards: a grow onto a node whose workers are not ready, while readiness was reachable."""
    plan = GrowPlanner(bound_s=60.0)
    step = plan.decide(world=2, max_workers=4, fitting_by_node={B: 2}, group={A: 2}, ready={A: 2}, now=0.0)
    assert step.extra == 0 and step.warm == {B: 2}            # asked to warm, no grow yet
    assert "waiting for warm spares" in step.reason and step.waiting_nodes == (B,)   # fill-in lends B meanwhile
    step = plan.decide(2, 4, {B: 2}, {A: 2}, {A: 2, B: 1}, now=5.0)
    assert step.extra == 0 and step.warm == {}                # asked once; half ready is not ready
    step = plan.decide(2, 4, {B: 2}, {A: 2}, {A: 2, B: 2}, now=8.0)
    assert step.extra == 2 and step.warm_nodes == (B,) and step.cold_nodes == ()
    assert step.ready_wait_s == 8.0 and step.waiting_nodes == ()


def test_a_grow_goes_cold_after_the_bound_and_says_so():
    plan = GrowPlanner(bound_s=30.0)
    plan.decide(1, 4, {B: 1}, {A: 1}, {A: 1}, now=0.0)
    assert plan.decide(1, 4, {B: 1}, {A: 1}, {A: 1}, now=29.0).extra == 0
    step = plan.decide(1, 4, {B: 1}, {A: 1}, {A: 1}, now=30.0)
    assert step.extra == 1 and step.cold_nodes == (B,) and "growing cold" in step.reason


def test_a_grow_on_the_groups_own_node_needs_a_spare_for_each_worker_there():
    """A's one worker asked for its one spare after its first step; a second worker there needs another."""
    plan = GrowPlanner(bound_s=60.0)
    step = plan.decide(1, 4, {A: 1, B: 2}, {A: 1}, {A: 1}, now=0.0)
    assert step.extra == 0 and step.warm == {A: 1, B: 2}
    step = plan.decide(1, 4, {A: 1, B: 2}, {A: 1}, {A: 2}, now=3.0)
    assert step.extra == 1 and step.warm == {} and "still warming" in step.reason   # A now, B later
    assert step.warm_nodes == ()                                # A is no new node


def test_a_grow_waits_for_the_groups_own_nodes_to_have_their_spares_ready():
    """The grown group restarts the group's own workers too: with A's spares not even started, a grow onto
    a ready B would restart A's workers cold (a run here moved 2 workers to B instead of growing to 4). A
    spare still warming on A does not count either: a demo's grow on spares still importing had its actors
    there wait 6-10 s with every worker stopped (their hold-back is bounded: SPOTFILL_SPARE_HOLD_MAX_S)."""
    plan = GrowPlanner(bound_s=60.0)
    step = plan.decide(2, 4, {B: 2}, {A: 2}, {B: 2}, now=0.0, present={B: 2})
    assert step.extra == 0 and f"{A[:8]} (0/2 spares)" in step.reason
    step = plan.decide(2, 4, {B: 2}, {A: 2}, {B: 2}, now=1.0, present={A: 2, B: 2})
    assert step.extra == 0 and f"{A[:8]} (0/2 spares)" in step.reason     # warming: not yet
    # B is ready and waited for all the same: it stays announced to fill-in (a demo's replica there was
    # reclaimed by the idle rule 3 s before the grow onto B)
    assert step.waiting_nodes == (B,)
    step = plan.decide(2, 4, {B: 2}, {A: 2}, {A: 2, B: 2}, now=2.0, present={A: 2, B: 2})
    assert step.extra == 2 and step.warm_nodes == (B,)


def test_nodes_whose_ids_share_all_but_their_last_digits_are_told_apart():
    """Ray's fake multi-node nodes (the autoscaled demo) share their first 51 hex digits: a planner that
    matched nodes by a prefix took the new node's wait for the group's own and never grew (a demo here
    stayed at 3 workers for all its 840 steps)."""
    own, new = "f" * 53 + "001", "f" * 53 + "002"
    plan = GrowPlanner(bound_s=60.0)
    assert plan.decide(3, 4, {new: 3}, {own: 3}, {own: 3}, now=0.0, present={own: 3}).extra == 0
    step = plan.decide(3, 4, {new: 3}, {own: 3}, {own: 3, new: 3}, now=5.0, present={own: 3, new: 3})
    assert step.extra == 1 and step.warm_nodes == (new,)


def test_a_node_needs_a_spare_for_every_worker_ray_may_place_there():
    """Ray's placement group packs the grown group where it likes: growing 3 -> 4 with 3 free GPUs on the new
    node may put up to 3 workers there (a demo here got 2 there, one on a cold process, with 1 spare)."""
    own, new = "a" * 56, "b" * 56
    plan = GrowPlanner(bound_s=60.0)
    step = plan.decide(3, 4, {new: 3}, {own: 3}, {own: 3}, now=0.0, present={own: 3})
    assert step.warm == {new: 3} and step.extra == 0
    assert plan.decide(3, 4, {new: 3}, {own: 3}, {own: 3, new: 1}, now=5.0,
                       present={own: 3, new: 3}).extra == 0
    assert plan.decide(3, 4, {new: 3}, {own: 3}, {own: 3, new: 3}, now=9.0,
                       present={own: 3, new: 3}).extra == 1


def test_spares_the_group_asked_for_itself_are_not_asked_again():
    plan = GrowPlanner(bound_s=60.0, spares_per_worker=2)
    # A runs 1 worker whose 2 spares are still warming: a second worker there needs 2 processes -> no ask
    assert plan.decide(1, 4, {A: 1}, {A: 1}, {}, now=0.0).warm == {}


def test_while_a_grow_waits_the_groups_own_nodes_warm_a_reserve_for_its_first_restart():
    """The fault this guards: a notice 5 s after a grow restarted on spares started 1.5 s before it (the grow
    had taken every ready one): 8.7 s of imports with every worker stopped. The own node A is asked, once,
    for a second set of the processes the grown group runs there -- once its first set has started (a raylet
    drops what it cannot start at once) -- and the grow does not wait for it."""
    plan = GrowPlanner(bound_s=60.0, reserve=1)
    # A runs 3 workers whose own 3 spares have not started yet; B is new with room for 1
    step = plan.decide(3, 4, {B: 3}, {A: 3}, {}, now=0.0, present={})
    assert step.warm == {B: 3} and step.reserve == {} and step.extra == 0   # A's first set not started yet
    step = plan.decide(3, 4, {B: 3}, {A: 3}, {}, now=1.0, present={A: 3, B: 3})
    assert step.warm == {} and step.reserve == {A: 3}        # started: the reserve, once (held back)
    step = plan.decide(3, 4, {B: 3}, {A: 3}, {}, now=15.0, present={A: 4, B: 3})
    assert step.warm == {} and step.reserve == {}   # never again: a spare still starting has no record yet
                                                    # (asking again started more and more processes)
    # A's first set and B's ready: the grow goes, the reserve still warming
    step = plan.decide(3, 4, {B: 3}, {A: 3}, {A: 3, B: 3}, now=16.0, present={A: 6, B: 3})
    assert step.extra == 1
    # no grow in prospect (nothing fits anywhere): no reserve
    idle = GrowPlanner(bound_s=60.0, reserve=1)
    assert idle.decide(3, 4, {}, {A: 3}, {}, now=0.0, present={A: 3}).reserve == {}
    # without a reserve (SPOTFILL_WARM_SPARE_RESERVE=0) the own node is asked for nothing beyond its own ask
    step = GrowPlanner(bound_s=60.0).decide(3, 4, {B: 3}, {A: 3}, {}, now=0.0, present={A: 3})
    assert step.warm == {B: 3} and step.reserve == {}


def test_a_node_that_left_is_asked_again_when_it_comes_back():
    plan = GrowPlanner(bound_s=60.0)
    assert plan.decide(1, 4, {B: 1}, {A: 1}, {}, now=0.0).warm == {B: 1}
    assert plan.decide(1, 4, {}, {A: 1}, {}, now=1.0).warm == {}
    assert plan.decide(1, 4, {B: 1}, {A: 1}, {}, now=2.0).warm == {B: 1}


def test_pipeline_grows_by_whole_replicas():
    plan = GrowPlanner(bound_s=0.0)
    step = plan.decide(2, 8, {B: 3}, {A: 2}, {}, now=0.0, multiple=2)
    assert step.extra == 2


def test_restart_goes_on_at_once_on_warm_survivors():
    # after a notice: A (survivor, its spares warm) holds 2, the replacement C holds 2 but has no spare yet
    size, why = restart_size({A: 2, C: 2}, {A: 2}, min_workers=1, max_workers=4)
    assert size == 2 and "nodes that are left now" in why


def test_a_restart_comes_back_at_full_size_on_gpus_taken_back_on_the_nodes_that_are_left():
    """A ran 2 workers and lent its third GPU to fill-in; its first rank asked spares for every slot (3):
    the restart takes all 3 there."""
    assert restart_size({A: 3, C: 2}, {A: 3}, 1, 4)[0] == 3


def test_a_restart_starts_no_worker_beyond_a_nodes_spares():
    """A survivor with 3 free GPUs and 2 spares: 2 workers now (warm), the third through a warm grow -- a
    demo's restart of 3 there started one process cold and the whole group waited 38 s for it."""
    size, why = restart_size({A: 3, C: 2}, {A: 2}, 1, 4)
    assert size == 2 and "2 more fit on 2 node(s) short of spares" in why
    assert restart_size({A: 3, B: 2}, {A: 2, B: 1}, 1, 4)[0] == 3          # per node: 2 on A, 1 on B
    size, why = restart_size({A: 3}, {A: 2}, 3, 4)                          # below the minimum: cold too
    assert size == 3 and "below training's minimum" in why


def test_a_restart_far_below_what_the_survivors_hold_starts_cold_where_spares_are_missing():
    """1 spare on a survivor that holds 3: a demo restarted at 1 worker and stepped at 1 for minutes while
    the grow's spares warmed; below half of what the warm nodes hold, the restart takes them all."""
    size, why = restart_size({A: 3}, {A: 1}, 1, 4)
    assert size == 3 and "2 of them cold" in why
    size, why = restart_size({A: 3, C: 2}, {A: 1}, 1, 4)                   # C (no spare) still waits
    assert size == 3 and "1 more fit on node(s) with no spare yet" in why
    assert restart_size({A: 4}, {A: 2}, 1, 4)[0] == 2                       # half: warm only


def test_a_restart_goes_on_the_spares_ready_now_and_leaves_those_still_importing_to_a_grow():
    """The fault this guards: a notice 6 s after a grow restarted 3 workers on 2 ready spares and one started
    3 s before; every worker waited 19.4 s for its imports. With at least half ready, the restart takes the
    ready ones; a warm grow adds the rest."""
    size, why = restart_size({A: 3}, {A: 3}, 1, 4, done={A: 2})
    assert size == 2 and "on the spares ready now" in why and "1 more on spares still importing" in why
    # fewer than half ready: as before (all of them, the warming ones woken)
    assert restart_size({A: 3}, {A: 3}, 1, 4, done={A: 1})[0] == 3
    # below training's minimum on ready ones alone: as before
    assert restart_size({A: 3}, {A: 3}, 3, 4, done={A: 2})[0] == 3
    # every spare ready: the same as without `done`
    assert restart_size({A: 3}, {A: 3}, 1, 4, done={A: 3}) == restart_size({A: 3}, {A: 3}, 1, 4)


def test_restart_below_the_minimum_counts_cold_capacity():
    size, why = restart_size({A: 1, C: 2}, {A: 1}, min_workers=2, max_workers=4)
    assert size == 3 and "below training's minimum" in why
    assert restart_size({A: 2}, {}, 1, 4)[0] == 2                # a first start: nothing warm anywhere


def test_a_restart_on_warm_survivors_is_pinned_to_them():
    from spotfill.train.readiness import warm_placement
    assert warm_placement({A: 3, C: 3}, {A: 2}, 3) == (A,)          # C (new, no spare) would take it cold
    assert warm_placement({A: 3}, {A: 3}, 3) == (A,)                # a replacement may appear any moment
    assert warm_placement({A: 2, B: 2, C: 3}, {B: 1, A: 1}, 4) == (A, B)
    assert warm_placement({A: 2, C: 3}, {A: 2}, 3) is None          # below min: cold capacity counted, no pin
    assert warm_placement({A: 3, C: 3}, {}, 3) is None              # a first start: nothing warm


def test_restart_with_every_node_warm_takes_them_all():
    assert restart_size({A: 2, B: 2}, {A: 2, B: 3}, 1, 3) == (3, "3 workers on the nodes that are left (their spares warm)")


def test_store_tokens_are_taken_once_each_and_stale_ones_removed():
    store: dict[str, str] = {}

    def take(key):
        return 1 if store.pop(key, None) is not None else 0

    def keys(prefix):
        return [k for k in store if k.startswith(prefix)]

    offer_kv(B, 2, store.__setitem__, now=100.0)
    offer_kv(C, 1, store.__setitem__, now=100.0)
    assert claim_kv(B, keys, take, now=101.0) == "spare"
    assert claim_kv(B, keys, take, now=101.0) == "spare"
    assert not claim_kv(B, keys, take, now=101.0)
    assert not claim_kv(C, keys, take, now=1000.0)              # stale: removed, not claimed
    assert store == {}


def test_a_notice_before_the_first_step_leaves_without_stepping():
    policy = StepPolicy(total_steps=100, checkpoint_every=10)
    d = policy.before_first_step(StepFacts(done=40, now=0.0, preempt_votes=1, deadline_unix_s=15.0))
    assert d is not None and d.action == EXIT and not d.saves
    assert policy.before_first_step(StepFacts(done=40, now=0.0)) is None


def test_each_restart_says_per_node_whether_its_workers_started_warm():
    assert workers_warm([["n1", 5.0], ["n1", 6.0], ["n2", 12.0]], decided_t=10.0) == {"n1": True, "n2": False}
    assert workers_warm(None, 10.0) is None
    events = [
        {"t": 1.0, "kind": "attempt", "attempt": 1}, {"t": 2.0, "kind": "start", "attempt": 1, "startup_s": 1.0},
        {"t": 3.0, "kind": "step", "attempt": 1, "step": 1},
        {"t": 9.0, "kind": "planned_exit", "attempt": 1, "reason": "grow", "ready_wait_s": 4.5},
        {"t": 9.5, "kind": "group_sizing", "workers": 2, "reason": "2 workers, all on warm spares"},
        {"t": 10.0, "kind": "attempt", "attempt": 2},
        {"t": 11.0, "kind": "resume", "attempt": 2, "startup_s": 1.0,
         "workers": [["n1", 8.0], ["n2", 8.5]]},
        {"t": 12.0, "kind": "step", "attempt": 2, "step": 2},
    ]
    (r,) = recovery_breakdown(events)
    assert r.warm == {"n1": True, "n2": True}
    assert r.ready_wait_s == 4.5 and r.sizing == "2 workers, all on warm spares"
    d = r.as_dict()
    assert d["warm"] == {"n1": True, "n2": True} and d["ready_wait_s"] == 4.5


def test_the_grow_check_warms_a_new_node_through_its_raylet_and_grows_once_it_is_ready(monkeypatch):
    """rank 0's GrowCheck end to end without a cluster: the node's capacity, the store and the raylet call
    are stand-ins; warm_node's own code runs (its imports, the store's tokens, the prestart call)."""
    import threading

    from spotfill.ray_compat import ray_train
    from spotfill.train import elastic
    from spotfill.train.capacity import NodeCapacity

    from spotfill.config import constants
    per = {"GPU": 1.0, "CPU": 1.0}
    monkeypatch.setattr(constants, "WARM_SPARE_RESERVE", 1)        # SPOTFILL_WARM_SPARE_RESERVE=1 (default 0)
    monkeypatch.setattr(elastic, "usable", lambda name: True)
    monkeypatch.setattr(elastic, "schedulable_nodes", lambda *a: {
        A: NodeCapacity({"GPU": 2, "CPU": 2}, {"GPU": 0, "CPU": 0}),
        B: NodeCapacity({"GPU": 2, "CPU": 2}, {"GPU": 2, "CPU": 2})})
    store: dict = {}
    monkeypatch.setattr(elastic, "kv_put", lambda k, v: store.__setitem__(k, v))
    monkeypatch.setattr(elastic, "kv_get", lambda k: store.get(k))
    asked, done = [], threading.Event()

    def prestart(count, keep_alive_s, timeout_s=5.0, node_id=None):
        asked.append((node_id, count))
        done.set()
        return True
    monkeypatch.setattr(ray_train, "prestart_workers", prestart)
    ready: dict = {}
    coming: list = []
    monkeypatch.setattr(elastic, "announce_coming", lambda run, nodes, ttl: coming.append((run, tuple(nodes))))
    check = elastic.GrowCheck(per, max_workers=4, run_key="t", group={A: 2}, ready=lambda warming=False: dict(ready))
    assert check.extra_workers(2, 0.0) == 0              # B is warming: no grow yet
    assert done.wait(10) and asked == [(B, 2)]
    assert coming == [("t", (B,))]                       # fill-in may lend B's GPUs while they warm
    # B runs no training: its spares warm at normal priority (no SCHED_IDLE tokens)
    assert not any(k.startswith("spotfill:spare-token:") for k in store)
    # A's own spares have started: A's reserve (SPOTFILL_WARM_SPARE_RESERVE) for the grown group's first
    # restart is asked, held back (tokens for A: the group steps there)
    ready.update({A: 2})
    done.clear()
    assert check.extra_workers(2, 0.5) == 0 and coming == [("t", (B,))]       # the same set: not written again
    assert done.wait(10) and asked == [(B, 2), (A, 2)]
    tokens = [k for k in store if k.startswith("spotfill:spare-token:")]
    assert tokens and all(A in k and B not in k for k in tokens)
    # a reserve's tokens: the spares that take them warm in SCHED_IDLE until a restart wakes them
    from spotfill.train.spares import claim_kv
    assert claim_kv(A, lambda prefix: [k for k in store if k.startswith(prefix)], store.pop) == "reserve"
    ready.update({A: 2, B: 2})
    assert check.extra_workers(2, 1.0) == 2
    # growing onto it: the record stays until the group exits (the grow's claim, not the idle rule, takes the
    # leases there back); the next group's first check replaces it
    assert coming == [("t", (B,))]
    nxt = elastic.GrowCheck(per, max_workers=4, run_key="t", group={A: 2, B: 2}, ready=lambda warming=False: dict(ready))
    assert nxt.extra_workers(4, 30.0) == 0 and coming[-1] == ("t", ())
    fields = check.exit_fields()
    assert fields["warm_nodes"] == [B] and fields["cold_nodes"] == [] and fields["ready_wait_s"] >= 0


def test_spares_asked_on_a_node_the_group_steps_on_warm_up_idle(monkeypatch):
    import threading

    from spotfill.ray_compat import ray_train
    from spotfill.train import elastic

    store: dict = {}
    monkeypatch.setattr(elastic, "kv_put", lambda k, v: store.__setitem__(k, v))
    done = threading.Event()
    monkeypatch.setattr(ray_train, "prestart_workers", lambda *a, **k: done.set())
    elastic.warm_node(A, 1, idle=True)
    assert done.wait(10) and [k for k in store if k.startswith(f"spotfill:spare-token:{A}:")]


def test_a_spare_still_warming_counts_only_where_warming_is_asked_for():
    now = 1000.0
    recs = {record_key("01000000", A, 1): record_value(None, now + 60),
            record_key("01000000", A, 2): record_value(now - 1, now + 60)}
    assert ready_by_node(recs, now) == {A: 1}
    assert ready_by_node(recs, now, warming=True) == {A: 2}


def test_spares_that_never_started_are_asked_for_again():
    """Three workers on A each asked for a spare; A's raylet started two (it drops what it cannot start at
    once): the planner asks A again for the one missing after reask_s -- a demo here waited for it until
    training ended, never growing."""
    plan = GrowPlanner(bound_s=90.0, reask_s=10.0)
    step = plan.decide(3, 4, {B: 1}, {A: 3}, {B: 1}, now=0.0, present={A: 2, B: 1})
    assert step.extra == 0 and step.warm == {}                 # A's three are assumed on their way
    assert plan.decide(3, 4, {B: 1}, {A: 3}, {B: 1}, now=5.0, present={A: 2, B: 1}).warm == {}
    step = plan.decide(3, 4, {B: 1}, {A: 3}, {B: 1}, now=10.0, present={A: 2, B: 1})
    assert step.warm == {A: 1} and step.extra == 0
    step = plan.decide(3, 4, {B: 1}, {A: 3}, {B: 1}, now=12.0, present={A: 3, B: 1})
    assert step.extra == 0 and step.warm == {}                 # all three on their way: not asked again
    step = plan.decide(3, 4, {B: 1}, {A: 3}, {A: 3, B: 1}, now=20.0, present={A: 3, B: 1})
    assert step.extra == 1
