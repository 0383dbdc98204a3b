"""The arbiter's `reclaimable()` (what training's restart sizing counts as its own): a unit a tenant took
since the arbiter's last tick counts at once. Stand-ins for Ray's node view and the tenant's holdings; the
arbiter itself is the real class, its tick loop idle."""
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
