"""The arbiter's pure policy: lend only what training cannot use, reclaim in order, follow node loss and
drains, rebuild after an arbiter restart. Time is a fake clock (plain floats)."""
import pytest
from dataclasses import replace

from spotfill.fillin.policy import (ClaimPlan, Holding, Lease, Node, Snapshot, TrainingJob, claim_finished,
                                    decide_claim, decide_lend, extra_replicas, feasible_workers, lendable,
                                    mark_reclaiming, ownership, rebuild_leases, reclaim_off_hosts, reconcile,
                                    training_hosts)

T0 = 1000.0


def lease(lid, kind, node, gpus=1, at=0.0, reclaiming=None):
    return Lease(lid, f"{kind}:t", kind, node, gpus, grace_s=3.0, granted_at=at, reclaiming_since=reclaiming)


@pytest.mark.parametrize("name, nodes, jobs, expected", [
    ("no training: all free GPUs lendable",
     [Node("a", 4, 4), Node("b", 2, 2)], [], {"a": 4, "b": 2}),
    ("training below max keeps whole workers",
     [Node("a", 4, 4), Node("b", 2, 2)], [TrainingJob("j", 1, 4, current_workers=2)], {"a": 2, "b": 2}),
    ("beyond max: training at max lends everything free",
     [Node("a", 4, 2)], [TrainingJob("j", 1, 2, current_workers=2)], {"a": 2}),
    ("fragments smaller than a worker are lent",
     [Node("a", 4, 3), Node("b", 4, 1)], [TrainingJob("j", 1, 8, current_workers=1, gpus_per_worker=2)],
     {"a": 1, "b": 1}),
    ("a job waiting below min cannot use anything",
     [Node("a", 2, 2)], [TrainingJob("j", 4, 8, current_workers=0, restarting=True)], {"a": 2}),
    ("a restarting job that can reach min reserves up to max",
     [Node("a", 2, 2), Node("b", 2, 2)], [TrainingJob("j", 2, 3, restarting=True, current_workers=3)],
     {"b": 1}),
    ("GPUs claimed but not yet taken by training are never lent",
     [Node("a", 2, 2)], [TrainingJob("j", 1, 1, current_workers=1, pending_gpus=1)], {"a": 1}),
    ("draining and dead nodes lend nothing",
     [Node("a", 2, 2, draining=True), Node("b", 2, 2, alive=False), Node("c", 1, 1)], [], {"c": 1}),
])
def test_lendable(name, nodes, jobs, expected):
    assert lendable(Snapshot(tuple(nodes), tuple(jobs))) == expected, name


def test_lend_prefers_fragments_and_whole_gpus_and_refuses_with_reason():
    snap = Snapshot((Node("a", 4, 3), Node("b", 4, 1)),
                    (TrainingJob("j", 1, 8, current_workers=1, gpus_per_worker=2),))
    got = decide_lend(snap, "serve:x", "serve", 5, T0)
    assert [(d.action, d.node_id, d.gpus) for d in got] == [("lend", "a", 1), ("lend", "b", 1)]
    assert all(d.at == T0 and "training cannot use" in d.reason for d in got)
    full = Snapshot((Node("a", 2, 2),), (TrainingJob("j", 1, 4, current_workers=0),))
    (refused,) = decide_lend(full, "serve:x", "serve", 1, T0)
    assert refused.action == "refuse" and "j may grow by 2 workers" in refused.reason


def test_claim_from_free_gpus_is_granted_at_once():
    snap = Snapshot((Node("a", 4, 2),), (), (lease("s1", "serve", "a", 2),))
    plan = decide_claim(snap, "j", 2, 1, T0)
    assert plan.ready and plan.decisions[0].action == "grant" and plan.free_now == 2


@pytest.mark.parametrize("order, first", [
    (("sweep", "batch", "serve"), ["w1", "b1"]),
    (("serve", "batch", "sweep"), ["s2", "s1"]),
])
def test_claim_reclaims_in_configured_order_newest_first(order, first):
    leases = (lease("s1", "serve", "a", at=1), lease("s2", "serve", "a", at=2),
              lease("b1", "batch", "b"), lease("w1", "sweep", "b"))
    snap = Snapshot((Node("a", 2, 0), Node("b", 2, 0)), (), leases)
    plan = decide_claim(snap, "j", 2, 1, T0, order=order)
    assert [d.lease_id for d in plan.reclaims] == first
    assert all(d.deadline == T0 + 3.0 for d in plan.reclaims) and plan.short_by == 0 and not plan.ready
    assert ">".join(order) in plan.reclaims[0].reason


def test_a_claim_pinned_to_the_warm_node_reclaims_there_although_another_node_is_free():
    # a hard loss: survivor a (training's warm spares) lent 2 GPUs to tenants; c, just launched, is all free.
    # Pinned to a, the claim takes a's leases back; unpinned, c's free GPUs answer it and nothing comes back.
    snap = Snapshot((Node("a", 3, 1), Node("c", 3, 3)), (),
                    (lease("s1", "serve", "a", at=1), lease("w1", "sweep", "a", at=2)))
    pinned = decide_claim(snap, "j", 3, 1, T0, nodes=["a"])
    assert sorted(d.lease_id for d in pinned.reclaims) == ["s1", "w1"] and pinned.free_now == 1
    assert pinned.short_by == 0 and "1 free" in pinned.reclaims[0].reason
    unpinned = decide_claim(snap, "j", 3, 1, T0)
    assert not unpinned.reclaims and unpinned.free_now == 4
    assert decide_claim(snap, "j", 4, 1, T0, nodes=["a"]).short_by == 1    # a holds 3 at most


def test_gpus_held_for_a_group_pinned_to_its_warm_node_are_held_there_not_on_a_freer_node():
    # after a hard loss: the group restarts pinned to survivor a (1 GPU free now, its own old one coming);
    # c, just launched, has 3 free. Held by count alone, c's free GPUs would cover the hold and a's free GPU
    # would be lent -- and the pinned group could not be placed (seen in a demo: the start timed out).
    job = TrainingJob("j", 1, 3, current_workers=3, pending_gpus=3, pending_nodes=("a",))   # as the claim left it
    snap = Snapshot((Node("a", 3, 1), Node("c", 3, 3)), (job,))
    assert lendable(snap).get("a", 0) == 0
    unpinned = Snapshot(snap.nodes, (replace(job, pending_nodes=()),))
    assert lendable(unpinned).get("a", 0) == 1 and lendable(unpinned).get("c", 0) == 0


def test_every_free_gpu_of_a_pinned_groups_nodes_is_held_until_the_group_is_placed():
    """A grow pinned to a and b claimed 1 GPU more than it runs (4 workers, 3 running on b). Ray packs the
    4 bundles onto a and b as it likes -- 2 may land on a -- so a's 3 free GPUs are all held until the
    group is placed (its GPUs taken, pending 0); then a's rest is lent. Before, 2 of a's were lent, Ray took
    one of them for training, and the batch unit lent it waited 30 s and was refused (a demo, 6 times)."""
    job = TrainingJob("j", 1, 4, current_workers=3, pending_gpus=1, pending_nodes=("a", "b"))
    snap = Snapshot((Node("a", 3, 3), Node("b", 3, 0), Node("c", 3, 3)), (job,))
    assert lendable(snap).get("a", 0) == 0
    placed = Snapshot((Node("a", 3, 1), Node("b", 3, 1), Node("c", 3, 3)),
                      (replace(job, current_workers=4, pending_gpus=0),))
    assert lendable(placed).get("a", 0) == 1 and lendable(placed).get("b", 0) == 1
    unpinned = Snapshot(snap.nodes, (replace(job, pending_nodes=()),))
    assert lendable(unpinned).get("a", 0) + lendable(unpinned).get("c", 0) == 4   # the claimed GPU + headroom


def test_claim_counts_whole_workers_and_skips_useless_reclaims():
    # 2 GPUs per worker: reclaiming one lease on node b (whose other GPU is training's) frees no worker
    leases = (lease("a1", "serve", "a", at=3), lease("b1", "serve", "b", at=2), lease("a2", "serve", "a", at=1))
    snap = Snapshot((Node("a", 2, 0), Node("b", 2, 0)), (), leases)
    plan = decide_claim(snap, "j", 2, 2, T0)
    assert sorted(d.lease_id for d in plan.reclaims) == ["a1", "a2"] and plan.short_by == 0


def test_claim_beyond_everything_reports_the_shortfall():
    snap = Snapshot((Node("a", 2, 1),), (), (lease("s1", "serve", "a"),))
    plan = decide_claim(snap, "j", 4, 1, T0)
    assert [d.lease_id for d in plan.reclaims] == ["s1"] and plan.short_by == 2


def test_a_node_never_gives_back_more_gpus_than_it_has():
    # the state API still lists a holder that let go (a1) beside the one that took its GPU (a2): reclaiming
    # both frees one GPU on node a, so a claim of 2 must reclaim b's lease too (seen in CI: 6.6 s hand-back)
    leases = (lease("a1", "batch", "a", at=3), lease("a2", "batch", "a", at=2), lease("b1", "batch", "b", at=1))
    snap = Snapshot((Node("a", 1, 0), Node("b", 1, 0)), (), leases)
    plan = decide_claim(snap, "j", 2, 1, T0)
    assert [d.lease_id for d in plan.reclaims] == ["a1", "b1"] and plan.short_by == 0   # a1 newest: first
    job = TrainingJob("j", 1, 4, current_workers=0)
    assert feasible_workers(snap, job) == 2


def test_leases_already_reclaiming_count_as_coming_back():
    snap = Snapshot((Node("a", 2, 0),), (), (lease("s1", "serve", "a", reclaiming=T0 - 1),
                                             lease("s2", "serve", "a")))
    plan = decide_claim(snap, "j", 1, 1, T0)
    assert plan.reclaims == () and plan.short_by == 0 and plan.free_now == 0


def test_node_loss_drops_its_leases_and_a_drain_reclaims():
    leases = (lease("x", "serve", "gone"), lease("d", "serve", "draining"), lease("ok", "serve", "fine"))
    snap = Snapshot((Node("draining", 1, 0, draining=True), Node("fine", 1, 0)), (), leases)
    got = {d.lease_id: d for d in reconcile(snap, T0)}
    assert set(got) == {"x", "d"}
    assert got["x"].action == "drop" and "node lost" in got["x"].reason
    assert got["d"].action == "reclaim" and got["d"].deadline == T0 + 3.0
    dead = Snapshot((Node("gone", 1, 0, alive=False),), (), (lease("x", "serve", "gone"),))
    assert [d.action for d in reconcile(dead, T0)] == ["drop"]


def test_arbiter_restart_rebuilds_leases_from_what_tenants_hold():
    holdings = [Holding("serve:x", "serve", "a", 1, key="r1"), Holding("serve:x", "serve", "b", 1, key="r2")]
    known = [lease("r1", "serve", "a", at=5.0, reclaiming=7.0), lease("r9", "serve", "c")]
    leases, decisions = rebuild_leases(holdings, known, T0)
    by_id = {le.lease_id: le for le in leases}
    assert by_id["r1"].granted_at == 5.0 and by_id["r1"].reclaiming_since == 7.0   # history kept
    assert by_id["r2"].granted_at == T0                                              # adopted
    assert {(d.action, d.lease_id) for d in decisions} == {("adopt", "r2"), ("drop", "r9")}
    # after a restart nothing is known: every holding is adopted, as a lease granted now
    fresh, adopted = rebuild_leases(holdings, [], T0)
    assert [d.action for d in adopted] == ["adopt", "adopt"]
    assert [(le.lease_id, le.node_id, le.granted_at, le.reclaiming_since) for le in fresh] == \
        [("r1", "a", T0, None), ("r2", "b", T0, None)]
    # and a claim is met from them as from any lease, by hand: node a's 2 GPUs are training's 1 and r1's,
    # node b's are r2's and 1 free. A claim of 2 GPUs (1 per worker) takes b's free one and needs one
    # more: both leases are equally old (adopted now), so the tie goes by lease id -- r1 -- with its 3 s
    # grace; r2 stays lent
    snap = Snapshot((Node("a", 2, 0), Node("b", 2, 1)), (), fresh)
    plan = decide_claim(snap, "j", 2, 1, T0)
    assert (plan.free_now, plan.short_by, plan.ready) == (1, 0, False)
    assert [(d.action, d.lease_id, d.node_id, d.gpus, d.deadline) for d in plan.decisions] == \
        [("reclaim", "r1", "a", 1, T0 + 3.0)]


def test_a_new_lease_starts_when_its_holder_began_holding_never_at_the_lend():
    # lent at T0 - 30, the replica's actor seen holding its GPU first now (Ray gives no start for an actor
    # still starting): the lease starts now -- the 30 s the worker was being placed and started were nobody's
    # GPU-seconds -- and keeps the lend's time beside it (lend-to-busy). A holder whose start Ray gives
    # (T0 - 2, after its lend) starts then; one deployed before the arbiter knew its tenant (T0 - 8) is
    # adopted from its start; a start in the future is taken as now.
    holdings = [Holding("serve:x", "serve", "a", 1, key="lent", lent_at=T0 - 30.0),
                Holding("serve:x", "serve", "e", 1, key="started", since=T0 - 2.0, lent_at=T0 - 30.0),
                Holding("serve:x", "serve", "b", 1, key="early", since=T0 - 8.0),
                Holding("serve:x", "serve", "c", 1, key="clock", since=T0 + 5.0),
                Holding("serve:x", "serve", "d", 1, key="unknown")]
    leases, decisions = rebuild_leases(holdings, [], T0)
    assert {le.lease_id: le.granted_at for le in leases} == {"lent": T0, "started": T0 - 2.0, "early": T0 - 8.0,
                                                             "clock": T0, "unknown": T0}
    assert {le.lease_id: le.lent_at for le in leases} == {"lent": T0 - 30.0, "started": T0 - 30.0, "early": None,
                                                          "clock": None, "unknown": None}
    # the lend was logged when it was made; a holding nobody lent is adopted (and said so)
    assert sorted(d.lease_id for d in decisions if d.action == "adopt") == ["clock", "early", "unknown"]


def test_a_tenant_whose_holdings_could_not_be_read_keeps_its_leases():
    # the read failed (State API error, or no answer in time): not "holds nothing" -- no drop, no hand-back
    known = [lease("r1", "serve", "a", at=5.0, reclaiming=7.0), lease("b1", "batch", "b", at=6.0)]
    leases, decisions = rebuild_leases([Holding("batch:t", "batch", "b", 1, key="b1")], known, T0,
                                       unknown={"serve:t"})
    assert {le.lease_id: le.reclaiming_since for le in leases} == {"r1": 7.0, "b1": None}
    assert decisions == ()
    _, dropped = rebuild_leases([Holding("batch:t", "batch", "b", 1, key="b1")], known, T0)   # read: empty
    assert [(d.action, d.lease_id) for d in dropped] == [("drop", "r1")]


def test_leases_beyond_a_tenants_target_are_marked_going_on_the_given_clock():
    mine = (lease("a", "serve", "n1", at=1.0), lease("b", "serve", "n2", at=2.0), lease("c", "serve", "n3", at=3.0))
    other = (lease("x", "batch", "n3", at=4.0),)
    got = mark_reclaiming(mine + other, {"serve:t": 1, "batch:t": None}, {"a": 50.0}, now=T0)
    since = {le.lease_id: le.reclaiming_since for le in got}
    # the one the arbiter chose (a, since 50) and then the newest (c, from now); batch's target is not set
    assert since == {"a": 50.0, "c": T0, "b": None, "x": None}


def test_training_waiting_below_min_lends_then_claims_back_when_capacity_returns():
    job = TrainingJob("j", 3, 4, restarting=True)
    lost = Snapshot((Node("a", 2, 2),), (job,))
    assert lendable(lost) == {"a": 2}                        # cannot start with 2 < 3: lend them
    (lent,) = decide_lend(lost, "serve:x", "serve", 2, T0)
    assert lent.gpus == 2
    back = Snapshot((Node("a", 2, 0), Node("b", 2, 2)), (job,),
                    (lease("s1", "serve", "a", at=T0), lease("s2", "serve", "a", at=T0 + 1)))
    assert lendable(back) == {}                               # 4 possible >= min 3: keep b for training
    plan = decide_claim(back, "j", 4, 1, T0 + 10)
    assert [d.lease_id for d in plan.reclaims] == ["s2", "s1"] and plan.short_by == 0


def test_ownership_splits_each_node():
    snap = Snapshot((Node("a", 4, 1),), (), (lease("s1", "serve", "a"), lease("s2", "serve", "a", reclaiming=1.0)))
    assert ownership(snap) == {"a": {"total": 4, "idle": 1, "training": 1, "serve": 1, "reclaiming": 1}}


# -- an autoscaled cluster: fill-in lends only on nodes training uses, and gives the others back ----------
def test_training_hosts_follow_where_training_ran_within_the_idle_time():
    seen = {"a": T0 - 1.0, "b": T0 - 4.0, "c": T0 - 11.0}
    assert training_hosts(seen, T0, idle_s=5.0) == frozenset({"a", "b"})
    assert training_hosts(seen, T0 + 20.0, idle_s=5.0) == frozenset()      # training ended: no host left
    assert training_hosts({}, T0, idle_s=5.0) == frozenset()


def test_autoscaled_cluster_lends_only_on_training_hosts_and_says_why():
    nodes = (Node("a", 3, 1), Node("b", 3, 3))          # training runs 2 on a (its max); b is free, unused
    job = TrainingJob("j", 1, 2, current_workers=2)
    assert lendable(Snapshot(nodes, (job,))) == {"a": 1, "b": 3}                  # a static cluster: both
    assert lendable(Snapshot(nodes, (job,), hosts=frozenset({"a"}))) == {"a": 1}
    (refused,) = decide_lend(Snapshot(nodes, (job,), hosts=frozenset()), "serve:x", "serve", 1, T0)
    assert refused.action == "refuse" and "nodes training does not use" in refused.reason


def test_leases_on_nodes_training_left_are_reclaimed_for_scale_down():
    nodes = (Node("a", 2, 0), Node("b", 2, 1), Node("c", 2, 1, draining=True), Node("d", 2, 1, alive=False))
    leases = (lease("l1", "serve", "a"), lease("l2", "serve", "b"), lease("l3", "serve", "b", reclaiming=T0 - 1),
              lease("l4", "serve", "c"), lease("l5", "serve", "d"))
    got = reclaim_off_hosts(Snapshot(nodes, (), leases, hosts=frozenset({"a"})), T0, idle_s=5.0)
    # b: the open lease (l3 is already going); c is draining and d is dead: reconcile() handles those
    assert [(d.action, d.lease_id, d.deadline) for d in got] == [("reclaim", "l2", T0 + 3.0)]
    assert "no training on the node for 5s" in got[0].reason
    assert reclaim_off_hosts(Snapshot(nodes, (), leases), T0, idle_s=5.0) == ()   # static cluster: nothing


@pytest.mark.parametrize("held,target,stopping,expected", [
    (3, None, 0, []),                   # the arbiter has not taken the tenant over yet
    (2, 2, 0, []),                      # holds what it was given
    (2, 3, 0, []),                      # a replica still starting: not extra
    (2, 0, 2, []),                      # both reclaimed, still stopping
    (3, 0, 2, ["c"]),                   # two stopping, and Serve started one by itself: the newest is extra
    (2, 0, 0, ["b", "a"]),              # Serve runs two the arbiter did not set
    (3, 1, 1, ["c"]),
])
def test_extra_replicas_are_those_beyond_the_target_and_the_ones_stopping(held, target, stopping, expected):
    mine = [lease("a", "serve", "n1", at=1.0), lease("b", "serve", "n2", at=2.0), lease("c", "serve", "n3", at=3.0)]
    other = [lease("x", "batch", "n3", at=4.0)]     # another tenant's lease never counts
    got = extra_replicas(mine[:held] + other, "serve:t", target, stopping)
    assert [le.lease_id for le in got] == expected


def test_a_unit_asking_for_cpus_is_lent_only_where_they_are_free():
    # node a: 2 GPUs free but training's workers took its CPUs (0.5 left); node b: 1 GPU and 4 CPUs free.
    # A Tune trial asks {CPU: 1, GPU: 1}: lent on a, it would wait for CPUs (demand an autoscaler acts on)
    nodes = (Node("a", 4, 2, free_cpus=0.5), Node("b", 2, 1, free_cpus=4.0))
    snap = Snapshot(nodes, (TrainingJob("j", 1, 2, current_workers=2),))
    assert lendable(snap) == {"a": 2, "b": 1}                       # a unit that asks for no CPU: both
    assert lendable(snap, 1, 1.0) == {"b": 1}
    (lent,) = decide_lend(snap, "sweep:s", "sweep", 2, T0, cpus_per_unit=1.0)
    assert (lent.node_id, lent.gpus) == ("b", 1)
    (refused,) = decide_lend(Snapshot(nodes[:1]), "sweep:s", "sweep", 1, T0, cpus_per_unit=1.0)
    assert refused.action == "refuse" and "1 free CPU(s) a unit asks for" in refused.reason


def test_a_claim_answers_when_freed_or_at_its_deadline_or_once_the_view_had_time_to_catch_up():
    short = ClaimPlan("j", wanted=2, free_now=1, short_by=1)
    met = ClaimPlan("j", wanted=2, free_now=2)
    assert claim_finished(met, 0.1, 10.0, True, True, None, 8.0) == (True, None)
    assert claim_finished(short, 10.5, 10.0, True, True, None, 8.0) == (True, None)          # deadline
    assert claim_finished(short, 0.3, 10.0, True, True, None, 8.0) == (False, None)          # still going
    assert claim_finished(short, 0.3, 10.0, False, False, None, 8.0) == (True, 0.3)          # nothing to do
    # it reclaimed GPUs and nothing is left going: Ray's view gets lag_s to show them free
    done, settled = claim_finished(short, 2.0, 20.0, False, True, None, 8.0)
    assert (done, settled) == (False, 2.0)
    assert claim_finished(short, 9.0, 20.0, False, True, settled, 8.0) == (False, 2.0)
    assert claim_finished(short, 10.1, 20.0, False, True, settled, 8.0) == (True, 2.0)
