"""The real Arbiter class (its tick loop idle) with stand-ins for Ray's node view and the tenants:

- a lease starts when its holder holds the GPU, not at the lend decision (which it keeps beside it);
- a claim never waits behind a tenant's slow call: a Serve scale call that blocks 10 s does not hold the
  arbiter's lock, and a claim for free GPUs is answered at once;
- a holdings read that fails during a claim is not "holds nothing": no hand-back is journaled while the GPU
  stays in use, and the lease stays.
"""
from __future__ import annotations

import threading
import time

import pytest

from spotfill.fillin.arbiter import Arbiter
from spotfill.fillin.job_tenant import JobTenant, JobTenantSpec
from spotfill.fillin.policy import Holding, Node
from spotfill.fillin.serve_tenant import ServeTenantSpec
from spotfill.fillin.tenant_calls import Scaled

T0 = 1_000_000.0


@pytest.fixture
def arb(tmp_path):
    a = Arbiter("GPU", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=False)
    try:
        yield a
    finally:
        a._stop.set()


class _Job(JobTenant):
    """A job tenant whose holdings the test sets (or makes fail)."""

    def __init__(self, units: int = 2, kind: str = "batch", cpus: float = 0.0):
        super().__init__(JobTenantSpec(kind[0], kind, job_id="01000000", max_replicas=units, grace_s=5.0,
                                       cpus_per_replica=cpus))
        self.held: list[Holding] = []
        self.fail: Exception | None = None
        self.target = 0

    def holdings(self):
        if self.fail is not None:
            raise self.fail
        return list(self.held)


def test_a_lease_starts_when_its_holder_holds_the_gpu_not_at_the_lend(arb):
    nodes = [Node("n1", 2, 2)]
    arb._nodes = lambda: list(nodes)
    tenant = _Job()
    arb.tenants[tenant.tenant] = tenant
    arb._lend(arb._snapshot(T0), T0)                    # both GPUs lent at T0
    assert tenant.target == 2 and arb.lent_at[tenant.tenant] == [T0, T0]
    # the Data actor is placed, its worker started, imports done: first seen holding its GPU 20 s later
    tenant.held = [Holding(tenant.tenant, "batch", "n1", 1, key="actor-1", reclaim_method="job_yield")]
    nodes[0] = Node("n1", 2, 1)
    arb._snapshot(T0 + 20.0)
    (lease,) = arb.leases
    assert lease.granted_at == T0 + 20.0, "a lease dated back to the lend counts the start-up as harvested"
    assert lease.lent_at == T0
    (event,) = [e for e in arb.journal_since(0)["events"] if e["kind"] == "lease"]
    assert (event["start"], event["lent_at"]) == (T0 + 20.0, T0)


class _SlowServe:
    """A ServeTenant whose scale call blocks until released (a dashboard that does not answer)."""

    def __init__(self):
        self.spec = ServeTenantSpec(app="app", deployment="Gen", dashboard_url="127.0.0.1:1", max_replicas=2)
        self.tenant, self.scale_url, self.target = self.spec.tenant, "http://127.0.0.1:1/scale", None
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls: list[int] = []

    @property
    def wanted_units(self) -> int:
        return self.spec.max_replicas

    def holdings(self):
        return []

    def set_replicas(self, n: int) -> bool:
        self.calls.append(n)
        self.entered.set()
        self.release.wait(10.0)
        self.target = n
        return True


def test_a_claim_does_not_wait_behind_a_tenants_blocked_scale_call(arb):
    nodes = [Node("n1", 3, 3)]
    arb._nodes = lambda: list(nodes)
    arb.register_job("train", 1, 2)                     # 2 of 3 GPUs are training's to take: 1 lendable
    slow = _SlowServe()
    arb.tenants[slow.tenant] = Scaled(slow, arb.calls)
    ticked = threading.Thread(target=arb.tick, daemon=True)
    ticked.start()
    try:
        assert slow.entered.wait(10.0), "the tick lends the spare GPU: Serve is asked for a replica"
        t0 = time.monotonic()
        answer = arb.claim("train", 2, deadline_s=5.0, gpus_per_worker=1, min_workers=1, max_workers=2)
        waited = time.monotonic() - t0
        assert answer["ok"], answer
        assert waited < 1.5, f"the claim waited {waited:.1f}s behind a scale call"
        assert not ticked.is_alive() and not slow.release.is_set(), "the tick is done, the call still out"
        assert arb.tenants[slow.tenant].target == 1 and slow.calls == [1]
    finally:
        slow.release.set()


def test_a_failed_holdings_read_during_a_claim_is_not_a_hand_back(arb):
    nodes = [Node("n1", 1, 0)]                           # the tenant's actor holds the only GPU
    arb._nodes = lambda: list(nodes)
    tenant = _Job(units=1)
    tenant.held = [Holding(tenant.tenant, "batch", "n1", 1, key="actor-1", reclaim_method="job_yield")]
    tenant.target = 1
    arb.tenants[tenant.tenant] = tenant
    arb.tick()
    assert [le.lease_id for le in arb.leases] == ["actor-1"]
    real_set = tenant.set_replicas

    def set_and_break(n):                                # the claim lowers the target; from then on the State
        tenant.fail = RuntimeError("state API: 503")     # API fails -- the actor still runs, the GPU in use
        return real_set(n)
    tenant.set_replicas = set_and_break
    answer = arb.claim("train", 1, deadline_s=2.0, gpus_per_worker=1, min_workers=1, max_workers=1)
    assert not answer["ok"] and answer["reclaimed"] == ["actor-1"], answer
    ended = [e for e in arb.journal_since(0)["events"] if e["kind"] in ("reclaim", "release", "lease_end")]
    assert ended == [], f"a failed read journaled the GPU as handed back: {ended}"
    assert [(le.lease_id, le.reclaiming_since is not None) for le in arb.leases] == [("actor-1", True)]
    # the read works again and the actor is gone: now it is a hand-back
    tenant.fail, tenant.held = None, []
    nodes[0] = Node("n1", 1, 1)
    for _ in range(3):
        arb.tick()
    (reclaim,) = [e for e in arb.journal_since(0)["events"] if e["kind"] == "reclaim"]
    assert reclaim["lease_id"] == "actor-1" and reclaim["cause"] == "training_claim"


def test_busy_reports_are_checked_and_journaled(arb):
    now = time.time()
    good = {"kind": "fillin_busy", "tenant": "batch:b", "workload": "batch", "node": "n1", "lease_id": "actor-1",
            "gpus": 1, "busy_s": 9.0, "t0": now - 5.0, "t1": now - 1.0}
    bad = [{"kind": "lease"}, {"kind": "fillin_busy", "tenant": "x", "t0": now, "t1": now - 1, "busy_s": 0.1},
           {"kind": "fillin_busy", "tenant": "x", "t0": now, "t1": now + 60, "busy_s": 1}, "junk"]
    assert arb.report_busy([good] + bad) == 1
    (event,) = [e for e in arb.journal_since(0)["events"] if e["kind"] == "fillin_busy"]
    assert event["busy_s"] == 4.0 and event["lease_id"] == "actor-1"      # capped at its interval


def test_a_trial_is_lent_a_gpu_only_where_its_cpu_is_free_too(arb):
    # n1: a free GPU but training's workers hold its CPUs; n2: a free GPU and a free CPU
    arb._nodes = lambda: [Node("n1", 2, 1, free_cpus=0.0), Node("n2", 2, 1, free_cpus=1.0)]
    sweep = _Job(units=2, kind="sweep", cpus=1.0)
    arb.tenants[sweep.tenant] = sweep
    arb._lend(arb._snapshot(T0), T0)
    assert sweep.target == 1
    (lend,) = [d for d in arb.decisions.items if d.action == "lend"]
    assert lend.node_id == "n2"


def test_a_trial_group_the_autoscaler_reports_waiting_is_given_up_at_once(tmp_path):
    """Autoscaled cluster, launch_nodes off: a lent unit whose placement group the autoscaler reports as
    pending demand (it would launch a node for it) is taken back at once, not after the 30 s patience."""
    from spotfill.fillin.cluster_view import Demand

    arb = Arbiter("GPU", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=True)
    try:
        arb._nodes = lambda: [Node("n1", 2, 1, free_cpus=0.0)]
        sweep = _Job(units=1, kind="sweep", cpus=1.0)
        sweep.target, sweep.pending_groups = 1, frozenset({"pg-waiting"})
        arb.tenants[sweep.tenant] = sweep
        arb.asked_at[sweep.tenant] = T0
        snap = arb._snapshot(T0 + 1.0)
        arb._lend(snap, T0 + 1.0, Demand(groups=frozenset({"someone-elses"})))
        assert sweep.target == 1, "another group's demand is not this tenant's"
        arb._lend(snap, T0 + 1.0, Demand(groups=frozenset({"pg-waiting"})))
        assert sweep.target == 0
        (refused,) = [d for d in arb.decisions.items if d.action == "refuse"]
        assert "the autoscaler sees it as demand" in refused.reason
    finally:
        arb._stop.set()


def test_a_read_slower_than_a_round_is_used_by_the_next_round():
    """A State API listing that takes longer than READ_WAIT_S: that round the tenant is unknown, the next
    round uses the answer (a dashboard that is always slow must not leave a tenant unknown for good)."""
    from spotfill.fillin.cluster_view import HoldingsReads

    class Slow:
        def __init__(self):
            self.calls = 0

        def holdings(self):
            self.calls += 1
            time.sleep(0.3)
            return [Holding("batch:b", "batch", "n1", 1, key=f"actor-{self.calls}")]

    reads, slow = HoldingsReads(), Slow()
    held, unknown, errors = reads.read({"batch:b": slow}, wait_s=0.05)
    assert held == [] and unknown == {"batch:b"} and "no answer within" in errors["batch:b"]
    time.sleep(0.4)
    held, unknown, _ = reads.read({"batch:b": slow}, wait_s=0.05)
    assert [h.key for h in held] == ["actor-1"] and unknown == set() and slow.calls == 1
    held, _, _ = reads.read({"batch:b": slow}, wait_s=1.0)           # used: a new read, waited for
    assert [h.key for h in held] == ["actor-2"]


def test_two_job_tenants_on_one_spare_gpu_take_turns_through_the_real_arbiter(tmp_path):
    """Fewer spare GPUs than tenants (lending.take_turns): the sweep holds the one spare GPU through two trials
    (a one-tick gap between them is no break), the batch job waits; once the sweep computed a turn (counted from
    its first busy report: its trials' starts do not eat its turn), the arbiter reclaims it (cause fair_share)
    and lends the freed GPU to the batch job."""
    arb = Arbiter("GPU", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=False, turn_s=30.0)
    try:
        nodes = [Node("n1", 2, 1)]                    # training holds one GPU slot; one is spare
        arb._nodes = lambda: list(nodes)
        sweep, batch = _Job(units=3, kind="sweep"), _Job(units=3, kind="batch")
        arb.tenants = {sweep.tenant: sweep}            # the sweep came first and got the spare GPU

        def tick(t: float) -> None:
            arb._lend(arb._snapshot(t), t)

        def trial(key: str) -> None:
            sweep.held = [Holding(sweep.tenant, "sweep", "n1", 1, key=key, reclaim_method="job_yield")]
            nodes[0] = Node("n1", 2, 0)

        tick(T0)
        assert sweep.target == 1
        arb.tenants[batch.tenant] = batch
        trial("pg1:0")
        for t in range(1, 12):
            tick(T0 + t)
        sweep.held, nodes[0] = [], Node("n1", 2, 1)   # its first trial ends; the next group takes the unit a tick later
        tick(T0 + 12)
        trial("pg2:0")
        for t in range(13, 40):
            tick(T0 + t)
        assert sweep.target == 1 and not arb.reclaiming, "the second trial has not computed yet: no turn"
        arb.report_busy([{"kind": "fillin_busy", "tenant": sweep.tenant, "workload": "sweep", "lease_id": "pg2:0",
                          "busy_s": 1.0, "t0": T0 + 38, "t1": T0 + 39}])
        for t in range(40, 68):
            tick(T0 + t)
        assert sweep.target == 1 and not arb.reclaiming, "held 67 s but computed 29 s of its turn: no turn yet"
        tick(T0 + 68)
        assert list(arb.reclaiming) == ["pg2:0"] and sweep.target == 0
        assert any(o.cause == "fair_share" and o.tenant == sweep.tenant for o in arb.orders)
        reason = arb.decisions.items[-1].reason
        assert "turns: " + batch.tenant in reason and "has computed 30s of the 67s it held GPUs" in reason, reason
        sweep.held, nodes[0] = [], Node("n1", 2, 1)   # the trial paused: its GPU is free
        tick(T0 + 73)
        assert batch.target == 1 and sweep.target == 0, "the freed GPU goes to the batch job that waited its turn"
    finally:
        arb._stop.set()
