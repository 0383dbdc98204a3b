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


def _lease(node: str, lease_id: str):
    from spotfill.fillin.policy import Lease
    return Lease(lease_id, "sweep:s", "sweep", node, 1)


def test_a_host_whose_view_lags_after_a_lease_ended_is_not_reclaimed_as_idle(tmp_path):
    """Autoscaled cluster, one training job. On n1 training was last seen at t=100 (then its group restarted
    there); sweep leases on n1 ended at t=101 and t=105, so n1's training count is not trusted until t=113.
    The idle rule (10 s) must not make n1 a non-host at t=111 from the stale sighting; after the lag, n1 is
    judged by what it shows again. A node that was not a host when its lease ended does not become one."""
    from spotfill.fillin.arbiter import RESOURCE_VIEW_LAG_S
    from spotfill.fillin.policy import Snapshot, TrainingJob

    arb = Arbiter("GPU_SLOT", state_path=str(tmp_path / "state.json"), interval_s=3600, autoscaled=True)
    try:
        arb.jobs["train"] = TrainingJob("train", 1, 4, 4)
        arb.training_gpus = 1
        training = Snapshot(nodes=(Node("n1", 3, 2), Node("n2", 3, 3)))          # 1 GPU in use on n1, no lease
        assert arb._hosts(training, {}, 100.0) == {"n1"}
        ended = {"l1": _lease("n1", "l1"), "l2": _lease("n2", "l2")}
        assert arb._hosts(training, ended, 101.0) == {"n1"}                     # n2 had no training: no host
        assert arb._hosts(training, {"l3": _lease("n1", "l3")}, 105.0) == {"n1"}
        assert arb._hosts(training, {}, 111.0) == {"n1"}                        # stale sighting, view lags
        assert 105.0 + RESOURCE_VIEW_LAG_S < 114.0
        assert arb._hosts(training, {}, 114.0) == {"n1"}                        # trusted again: training there
        idle = Snapshot(nodes=(Node("n1", 3, 3), Node("n2", 3, 3)))
        arb.training_gpus = 1                                                  # the job runs elsewhere
        assert arb._hosts(idle, {}, 124.5) == set()                              # training left n1 > 10 s ago
    finally:
        arb._stop.set()
