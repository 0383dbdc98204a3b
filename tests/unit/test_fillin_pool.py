"""Several fill-in tenants share one pool of lendable GPUs (Arbiter._grow_all, no Ray: the job tenants'
targets are plain numbers). A GPU lent but not yet taken is not lent again, and tenants get fair shares."""
from __future__ import annotations

from dataclasses import replace

from spotfill.fillin.arbiter import Arbiter
from spotfill.fillin.job_tenant import JobTenant, JobTenantSpec
from spotfill.fillin.policy import DecisionLog, Lease, Node, Snapshot


def arbiter(*tenants) -> Arbiter:
    a = Arbiter.__new__(Arbiter)          # no actor, no tick thread: only the lending bookkeeping
    a.tenants = {t.tenant: t for t in tenants}
    a.promised, a.lent_at, a.asked_at, a.decisions = {}, {}, {}, DecisionLog()
    a.autoscaled = a.launch_nodes = False
    return a


def tenant(kind: str, max_units: int = 4) -> JobTenant:
    t = JobTenant(JobTenantSpec(name="t", kind=kind, job_id="01000000", max_replicas=max_units))
    t.target = 0
    return t


FOUR_FREE = Snapshot(nodes=(Node("a", 2, 2), Node("b", 2, 2)))


def test_two_tenants_split_the_spare_gpus_and_nothing_is_lent_twice():
    batch, sweep = tenant("batch"), tenant("sweep")
    a = arbiter(batch, sweep)
    a._grow_all(FOUR_FREE, now=100.0)
    assert (batch.target, sweep.target) == (2, 2), "a fair share each, not all four to both"
    # a second tick before any actor started: Ray still shows 4 free, but all 4 are promised
    a._grow_all(FOUR_FREE, now=101.0)
    assert (batch.target, sweep.target) == (2, 2)
    lends = [d for d in a.decisions.items if d.action == "lend"]
    assert sum(d.gpus for d in lends) == 4


def test_a_lone_tenant_takes_everything_lendable():
    serve_like = tenant("batch", max_units=8)
    a = arbiter(serve_like)
    a._grow_all(FOUR_FREE, now=100.0)
    assert serve_like.target == 4


def test_promises_end_when_the_tenant_holds_what_it_was_lent():
    batch, sweep = tenant("batch"), tenant("sweep", max_units=2)
    a = arbiter(batch, sweep)
    a._grow_all(FOUR_FREE, now=100.0)
    assert (batch.target, sweep.target) == (2, 2)
    # both took their GPUs: Ray shows none free, the leases are seen; then the sweep finishes and lets go
    held = tuple(Lease(f"{t.tenant}-{i}", t.tenant, t.spec.kind, "ab"[i], 1) for t in (batch, sweep) for i in range(2))
    a._grow_all(Snapshot(nodes=(Node("a", 2, 0), Node("b", 2, 0)), leases=held), now=102.0)
    assert a.promised == {}
    sweep.target, sweep.spec = 0, replace(sweep.spec, demand=0)     # done: wants nothing more
    a._grow_all(Snapshot(nodes=(Node("a", 2, 1), Node("b", 2, 1)), leases=held[:2]), now=103.0)
    assert batch.target == 4, "the GPUs the sweep gave back go to the batch job"
