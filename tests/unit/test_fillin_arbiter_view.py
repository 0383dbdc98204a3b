"""The arbiter's view of the cluster, on the real Arbiter class (its tick loop idle) with stand-ins for Ray's
node view and a tenant's holdings: `reclaimable()` (what training's restart sizing counts as its own) counts a
unit a tenant took since the last tick at once; a host whose resource view lags after a lease ended is not
reclaimed as idle from a stale sighting."""
from __future__ import annotations

from spotfill.fillin.arbiter import Arbiter
from spotfill.fillin.policy import Holding, Node


class _Tenant:
    """A Serve-like tenant whose holdings the test sets."""

    type = "serve"
    tenant = "serve:app/Generator"

    def __init__(self):
        self.held: list[Holding] = []
        self.target = 0

    def holdings(self):
        return list(self.held)


def test_a_unit_taken_since_the_last_tick_is_reclaimable_at_once(tmp_path):
    arb = Arbiter("GPU_SLOT", state_path=str(tmp_path / "state.json"), interval_s=3600)
    try:
        nodes = [Node("n1", 3, 3)]
        arb._nodes = lambda: list(nodes)
        tenant = _Tenant()
        arb.tenants[tenant.tenant] = tenant
        arb._snapshot(100.0)                               # a tick's view: nothing held, nothing leased
        assert arb.reclaimable() == {}
        # the replica takes a slot (Ray's view: 2 free); no tick has run since
        tenant.held = [Holding(tenant.tenant, "serve", "n1", 1, key="actor-1")]
        nodes[0] = Node("n1", 3, 2)
        assert arb.reclaimable() == {"n1": {"GPU_SLOT": 1.0}}
        nodes[0] = Node("n1", 3, 2, draining=True)         # a draining node gives training nothing
        assert arb.reclaimable() == {}
    finally:
        arb._stop.set()


def test_a_host_whose_view_lags_after_a_lease_ended_is_not_reclaimed_as_idle():
    """Autoscaled cluster, one training job (fillin/hosts.py, a fake clock). On n1 training was last seen at
    t=100 (then its group restarted there); sweep leases on n1 ended at t=101 and t=105, so n1's training
    count is not trusted until t=113. The idle rule (10 s) must not make n1 a non-host at t=111 from the
    stale sighting; after the lag, n1 is judged by what it shows again. A node that was not a host when its
    lease ended does not become one."""
    from spotfill.fillin.hosts import RESOURCE_VIEW_LAG_S, HostTracker
    from spotfill.fillin.policy import Snapshot

    hosts = HostTracker(idle_s=10.0)
    training = Snapshot(nodes=(Node("n1", 3, 2), Node("n2", 3, 3)))          # 1 GPU in use on n1, no lease

    def update(snap, ended, now):
        return hosts.update(snap, ended, jobs=True, between=False, now=now)
    assert update(training, [], 100.0) == {"n1"}
    assert update(training, ["n1", "n2"], 101.0) == {"n1"}                   # n2 had no training: no host
    assert update(training, ["n1"], 105.0) == {"n1"}
    assert update(training, [], 111.0) == {"n1"}                             # stale sighting, view lags
    assert 105.0 + RESOURCE_VIEW_LAG_S < 114.0
    assert update(training, [], 114.0) == {"n1"}                             # trusted again: training there
    idle = Snapshot(nodes=(Node("n1", 3, 3), Node("n2", 3, 3)))              # the job runs elsewhere
    assert update(idle, [], 124.5) == set()                                  # training left n1 > 10 s ago


def test_a_job_between_groups_keeps_its_hosts_for_the_restart_grace():
    """A registered job whose group is down (a restart): its nodes stay hosts -- their leases wait for its
    claim -- for up to RESTART_GRACE_S without training anywhere, then the idle rule applies."""
    from spotfill.fillin.hosts import RESTART_GRACE_S, HostTracker
    from spotfill.fillin.policy import Snapshot

    hosts, t0 = HostTracker(idle_s=10.0), 1000.0
    assert hosts.update(Snapshot(nodes=(Node("n1", 2, 1),)), [], jobs=True, between=False, now=t0) == {"n1"}
    down = Snapshot(nodes=(Node("n1", 2, 2),))
    assert hosts.update(down, [], jobs=True, between=True, now=t0 + 60.0) == {"n1"}
    assert hosts.update(down, [], jobs=True, between=False, now=t0 + 71.0) == set()     # back: idle rule
    hosts.update(Snapshot(nodes=(Node("n1", 2, 1),)), [], jobs=True, between=False, now=t0 + 80.0)
    assert hosts.update(down, [], jobs=True, between=True, now=t0 + 80.0 + RESTART_GRACE_S - 1) == {"n1"}
    assert hosts.update(down, [], jobs=True, between=True, now=t0 + 80.0 + RESTART_GRACE_S + 11) == set()


class _JobTenant(_Tenant):
    """A sweep-like job tenant: each unit (a Tune trial) asks for a CPU beside its GPU."""

    type = "sweep"
    tenant = "sweep:demo-sweep"

    def __init__(self):
        from spotfill.fillin.job_tenant import JobTenantSpec
        super().__init__()
        self.spec = JobTenantSpec("demo-sweep", "sweep", "01000000", cpus_per_replica=1.0, gpu_resource="GPU_SLOT")


def test_a_trial_gives_training_back_the_cpu_beside_its_gpu(tmp_path):
    """A 3-slot node (3 CPUs): training restarts there while a sweep trial holds 1 slot + 1 CPU. Training's
    sizing must count that CPU as its own too, or a worker needing GPU + CPU fits one fewer (a demo restarted
    on 2 workers with 3 slots and reclaimed only the sweep); a Serve replica (no CPU) gives back none."""
    from spotfill.train.capacity import NodeCapacity, count_workers, free_resources
    arb = Arbiter("GPU_SLOT", state_path=str(tmp_path / "state.json"), interval_s=3600)
    try:
        arb._nodes = lambda: [Node("n1", 3, 1)]
        serve, sweep = _Tenant(), _JobTenant()
        arb.tenants[serve.tenant], arb.tenants[sweep.tenant] = serve, sweep
        serve.held = [Holding(serve.tenant, "serve", "n1", 1, key="actor-1")]
        sweep.held = [Holding(sweep.tenant, "sweep", "n1", 1, key="pg-1")]
        got = arb.reclaimable()
        assert got == {"n1": {"GPU_SLOT": 2.0, "CPU": 1.0}}
        # Ray's view: 1 slot and 1 CPU free (the trial holds the other CPU, training's old worker is gone)
        free = free_resources({"n1": NodeCapacity({"GPU_SLOT": 3, "CPU": 3}, {"GPU_SLOT": 1, "CPU": 2})}, {}, got)
        assert count_workers(free, {"GPU_SLOT": 1, "CPU": 1}, 4) == 3
    finally:
        arb._stop.set()


def test_a_node_training_waits_to_grow_onto_is_a_host_while_it_waits():
    """Autoscaled cluster: n2 came back and training waits for its spares to warm before it grows onto it
    (train.readiness). Its GPUs are lent meanwhile -- before, fill-in lent only where training already ran
    and a demo's new node sat idle ~100 s (300 GPU-s) while its spares warmed. A node no longer waited for
    leaves the hosts by the idle rule; with no training job registered nothing is coming."""
    from spotfill.fillin.hosts import HostTracker
    from spotfill.fillin.policy import Snapshot, lendable

    hosts = HostTracker(idle_s=10.0)
    snap = Snapshot(nodes=(Node("n1", 3, 0), Node("n2", 3, 3)))              # training fills n1; n2 is new
    assert hosts.update(snap, [], jobs=True, between=False, now=100.0) == {"n1"}
    assert hosts.update(snap, [], jobs=True, between=False, now=102.0, coming=["n2"]) == {"n1", "n2"}
    from dataclasses import replace
    assert lendable(replace(snap, hosts=frozenset({"n1", "n2"}))).get("n2", 0) == 3
    assert lendable(replace(snap, hosts=frozenset({"n1"}))).get("n2", 0) == 0    # before: nothing lent there
    assert hosts.update(snap, [], jobs=True, between=False, now=110.0, coming=["n2"]) == {"n1", "n2"}
    assert hosts.update(snap, [], jobs=True, between=False, now=119.0) == {"n1", "n2"}   # within idle_s
    assert hosts.update(snap, [], jobs=True, between=False, now=121.0) == {"n1"}         # no longer waited for
    fresh = HostTracker(idle_s=10.0)
    assert fresh.update(snap, [], jobs=False, between=False, now=100.0, coming=["n2"]) == set()
    assert fresh.update(snap, [], jobs=True, between=False, now=101.0, coming=["gone"]) == {"n1"}   # not alive


def test_coming_records_run_out():
    from spotfill.train.arbiter_link import coming_nodes, coming_record
    recs = [coming_record(["a", "b"], 20.0, now=100.0), coming_record(["c"], 5.0, now=100.0), {"nodes": "x"}]
    assert coming_nodes(recs, 104.0) == {"a", "b", "c"}
    assert coming_nodes(recs, 110.0) == {"a", "b"}
    assert coming_nodes(recs, 121.0) == set()


def test_a_tenant_kept_waiting_is_recorded_once_per_kind_of_reason(tmp_path, monkeypatch):
    """`wait` decisions (lending.Growth.waiting) go into the arbiter's decision log once per reason, its
    counts aside: a log of the last 200 decisions must keep its lends and reclaims."""
    from spotfill.fillin import arbiter as arbiter_mod
    from spotfill.fillin.lending import Growth
    from spotfill.fillin.policy import Decision, Snapshot

    arb = Arbiter("GPU_SLOT", state_path=str(tmp_path / "state.json"), interval_s=3600)
    try:
        reasons = iter(["nothing lendable: 3 free GPU(s) on nodes training does not use",
                        "nothing lendable: 5 free GPU(s) on nodes training does not use",
                        "nothing lendable: demo may grow by 1 workers (1 GPUs each)", None,
                        "nothing lendable: demo may grow by 2 workers (1 GPUs each)"])

        def one_round(*a, **k):
            why = next(reasons)
            wait = Decision("wait", "batch:b", 1, why, at=0.0) if why else None
            return [Growth("batch:b", waiting=wait)]
        monkeypatch.setattr(arbiter_mod, "lend_round", one_round)
        monkeypatch.setattr(arbiter_mod, "fair_share", lambda *a, **k: None)
        monkeypatch.setattr(arbiter_mod, "take_turns", lambda *a, **k: None)
        arb.tenants["batch:b"] = __import__("types").SimpleNamespace(wanted_units=1)
        monkeypatch.setattr(arb, "_views", lambda demand=None: [])
        monkeypatch.setattr(arb.turns, "observe", lambda *a, **k: None)
        for _ in range(5):
            arb._lend(Snapshot(), 0.0)
        waits = [d.reason for d in arb.decisions.items if d.action == "wait"]
        # counts aside, the first two are one reason; after a round with no wait the same kind is new again
        assert waits == ["nothing lendable: 3 free GPU(s) on nodes training does not use",
                         "nothing lendable: demo may grow by 1 workers (1 GPUs each)",
                         "nothing lendable: demo may grow by 2 workers (1 GPUs each)"]
    finally:
        arb._stop.set()
