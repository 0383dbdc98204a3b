"""Several fill-in tenants share one pool of lendable GPUs (fillin/lending.py: pure, a fake clock). A GPU
given to a tenant and not yet taken is not lent again -- also one a Tune trial gave back between one trial
and the next -- tenants get fair shares of what is lendable, and what is already lent is rebalanced toward a
fair share when one tenant holds everything while another waits."""
from __future__ import annotations

from dataclasses import replace

from spotfill.fillin.lending import MIN_HOLD_S, TenantView, fair_share, lend_round
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
