"""Training's claim on the real Arbiter class (its tick loop idle), with stand-ins for Ray's node view and a
job tenant that lets go of (or takes) units as soon as its target changes:

- the claim reads the tenants' holdings with the arbiter's lock free: a read waits on the State API (up to
  READ_WAIT_S a round, every 0.1 s while the claim waits), and a tenant's target poll, a tick or a Serve
  scale call made meanwhile must not queue behind it -- a driver that does not hear its target within its
  grace counts 0 units, and a reclaim's scale call would go out late;
- no tick lends while a claim is in flight: it would lend the GPUs the claim is taking back;
- reading -- a tenant's target, the arbiter's snapshot -- changes nothing.
"""
from __future__ import annotations

import threading

import pytest

from spotfill.fillin.arbiter import Arbiter
from spotfill.fillin.job_tenant import JobTenant, JobTenantSpec
from spotfill.fillin.policy import Holding, Node

WAIT_S = 10.0        # a guard against a hang, not a measure: each wait below ends at once unless it is blocked


@pytest.fixture
def arb(tmp_path):
    a = Arbiter("GPU", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=False)
    a.records_read_at = float("inf")          # no training records in a GCS here: never read
    try:
        yield a
    finally:
        a._stop.set()


class _Obedient(JobTenant):
    """A batch job on node n1 (2 GPUs) whose driver follows its target at once: a lower target lets go of its
    newest units, a higher one takes new units -- Ray's node view moves with it."""

    def __init__(self, nodes: list):
        super().__init__(JobTenantSpec("b", "batch", job_id="01000000", max_replicas=2, grace_s=5.0))
        self.nodes, self.taken, self.calls = nodes, 0, []
        self.held = [self._unit() for _ in range(2)]
        self.target = 2
        self._show()

    def _unit(self) -> Holding:
        self.taken += 1
        return Holding(self.tenant, "batch", "n1", 1, key=f"actor-{self.taken}", reclaim_method="job_yield")

    def _show(self) -> None:
        self.nodes[0] = Node("n1", 2, 2 - len(self.held))

    def holdings(self):
        return list(self.held)

    def set_replicas(self, n: int) -> bool:
        self.calls.append(n)
        super().set_replicas(n)
        self.held = self.held[:n] + [self._unit() for _ in range(n - len(self.held))]
        self._show()
        return True


class _DuringClaimReads:
    """The arbiter's holdings reads; each read the claim makes first runs `during()` on a thread of its own
    and waits (at most WAIT_S) for it to finish -- what the arbiter answers while a claim reads."""

    def __init__(self, real, claim_thread: str, during, reads: int):
        self.real, self.claim_thread, self.during, self.left = real, claim_thread, during, reads
        self.finished: list[bool] = []

    def read(self, tenants, wait_s):
        if threading.current_thread().name == self.claim_thread and self.left > 0:
            self.left -= 1
            other = threading.Thread(target=self.during, daemon=True)
            other.start()
            other.join(WAIT_S)
            self.finished.append(not other.is_alive())
        return self.real.read(tenants, wait_s)


def _claim_on_a_thread(arb, answers: list) -> threading.Thread:
    def run():
        answers.append(arb.claim("train", 2, deadline_s=30.0, gpus_per_worker=1, min_workers=1, max_workers=2))
    return threading.Thread(target=run, name="the-claim", daemon=True)


def test_a_claims_holdings_read_leaves_the_lock_free_for_a_targets_poll_and_a_tick(arb):
    nodes = [Node("n1", 2, 0)]
    arb._nodes = lambda: list(nodes)
    tenant = _Obedient(nodes)
    arb.tenants[tenant.tenant] = tenant
    arb.tick()
    assert sorted(le.lease_id for le in arb.leases) == ["actor-1", "actor-2"]
    heard: list[dict] = []

    def meanwhile():                         # the driver's target poll, then the arbiter's own tick
        heard.append(arb.tenant_target(tenant.tenant))
        arb.tick()
    # the claim's first read (before it decides) and its first two in the wait loop (before and after the
    # reclaims): the poll hears the lower target while the claim still waits
    arb.reads = _DuringClaimReads(arb.reads, "the-claim", meanwhile, reads=3)
    answers: list[dict] = []
    claim = _claim_on_a_thread(arb, answers)
    claim.start()
    claim.join(3 * WAIT_S)
    assert arb.reads.finished == [True] * 3, "a call made while the claim read holdings waited for the read"
    assert [h["target"] for h in heard] == [2, 2, 0]
    (answer,) = answers
    assert answer["ok"] and sorted(answer["reclaimed"]) == ["actor-1", "actor-2"], answer


def test_no_tick_lends_the_gpus_a_claim_in_flight_is_taking_back(arb):
    """The claim reclaims both units; the tenant lets go at once and the GPUs show free. A tick before the
    claim's next read would find 2 free GPUs and a tenant below what it wants: it must not lend them."""
    nodes = [Node("n1", 2, 0)]
    arb._nodes = lambda: list(nodes)
    tenant = _Obedient(nodes)
    arb.tenants[tenant.tenant] = tenant
    arb.tick()
    # a tick at each of the claim's first reads: before it decides, before its reclaims, after them
    arb.reads = _DuringClaimReads(arb.reads, "the-claim", arb.tick, reads=3)
    answers: list[dict] = []
    claim = _claim_on_a_thread(arb, answers)
    claim.start()
    claim.join(3 * WAIT_S)
    (answer,) = answers
    assert arb.reads.finished == [True] * 3
    assert tenant.calls == [1, 0], f"the tenant's target went {tenant.calls}: GPUs lent during the claim"
    assert not [d for d in arb.decisions.items if d.action == "lend"]
    assert answer["ok"] and sorted(answer["reclaimed"]) == ["actor-1", "actor-2"], answer
    arb.tick()                               # after the claim: held for its group (CLAIM_HOLD_S), not lent
    assert tenant.calls == [1, 0]


def test_a_tenants_target_is_read_without_change_and_its_demand_set_apart(arb):
    nodes = [Node("n1", 2, 0)]
    arb._nodes = lambda: list(nodes)
    tenant = _Obedient(nodes)
    arb.tenants[tenant.tenant] = tenant
    arb.tick()
    spec = tenant.spec
    for _ in range(2):
        assert arb.tenant_target(tenant.tenant) == {"target": 2, "known": True}
    assert tenant.spec is spec and tenant.target == 2
    assert arb.tenant_target("batch:unknown") == {"target": 0, "known": False}
    # its work runs out: its driver let one unit go, and one is all it could use -- the target comes down
    tenant.held = tenant.held[:1]
    tenant._show()
    arb.tick()
    assert [le.lease_id for le in arb.leases] == ["actor-1"] and tenant.target == 2
    assert arb.set_demand(tenant.tenant, 1) is True
    assert tenant.spec.demand == 1 and arb.tenant_target(tenant.tenant) == {"target": 1, "known": True}
    # ... but not below what it still holds (1 lease until the driver lets go)
    assert arb.set_demand(tenant.tenant, 0) is True and tenant.target == 1 and tenant.spec.demand == 0
    assert arb.set_demand("batch:unknown", 1) is False


def test_the_arbiters_snapshot_is_a_read_the_host_tracker_moves_only_when_a_view_is_applied(tmp_path):
    """Autoscaled cluster: training was seen on n1 at t=100 (a host). Reading the snapshot changes nothing;
    applying a new view does -- training gone from n1 past the restart grace and the idle rule: no host."""
    from dataclasses import asdict

    from spotfill.fillin.hosts import RESTART_GRACE_S

    arb = Arbiter("GPU", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=True)
    try:
        arb._nodes = lambda: [Node("n1", 2, 1)]          # 1 GPU in use that no lease holds: training's
        arb.register_job("train", 1, 1, current_workers=1)
        snap = arb._snapshot(100.0)
        assert snap.hosts == {"n1"}
        before = asdict(arb.hosts)
        for _ in range(2):
            assert arb._current() == snap
        assert asdict(arb.hosts) == before, "reading the snapshot moved the host tracker"
        arb._nodes = lambda: [Node("n1", 2, 2)]          # training left n1
        assert arb._snapshot(100.0 + RESTART_GRACE_S + 11.0).hosts == frozenset()
        assert arb._current().hosts == frozenset() and asdict(arb.hosts) != before
    finally:
        arb._stop.set()
