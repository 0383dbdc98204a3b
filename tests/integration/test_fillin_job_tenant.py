"""Job tenants of the fill-in arbiter (the batch and sweep side of fill-in) on a local multi-node cluster
(2 nodes x 1 GPU slot, one cluster for the module): a driver's grant follows the arbiter's lends; what it
holds (GPU actors, placement-group bundles of its Ray job) is seen as its leases; a training claim lowers
its target and a driver that yields hands the GPUs back; a driver that does not yield is stopped after its
grace and the reclaim is recorded as forced."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from spotfill.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STUBBORN = r"""
import sys, time, ray
from spotfill.fillin.grant import ArbiterGrant
from spotfill.fillin.wiring import runtime_env
ray.init(address=sys.argv[1], runtime_env=runtime_env(), logging_level="WARNING")
grant = ArbiterGrant("sweep", "stubborn", max_units=1, grace_s=1.0)
assert grant.wait(1, timeout=60) >= 1, "never granted"

@ray.remote(num_cpus=0, num_gpus=1)
class Holder:
    def ping(self):
        return "ok"

h = Holder.remote()
ray.get(h.ping.remote(), timeout=60)
print("HOLDING", flush=True)
while True:                      # never yields, whatever the grant says
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from spotfill.fillin.arbiter import ensure_arbiter
    from spotfill.fillin.wiring import runtime_env
    from spotfill.sim.cluster import EmbeddedCluster

    cluster = EmbeddedCluster()
    for _ in range(2):
        cluster.add_node(1)
    ray.init(address=cluster.address, runtime_env=runtime_env(), logging_level="WARNING")
    arbiter = ensure_arbiter("GPU", runtime_env=runtime_env(),
                             state_path=str(tmp_path_factory.mktemp("arbiter") / "state.json"))
    try:
        yield {"cluster": cluster, "arbiter": arbiter}
    finally:
        try:
            ray.kill(arbiter, no_restart=True)
        finally:
            cluster.shutdown()


def arbiter_status(env) -> dict:
    import ray
    return ray.get(env["arbiter"].status.remote(last=50), timeout=30)


def leases_of(env, tenant: str) -> list[dict]:
    return [le for le in arbiter_status(env)["leases"] if le["tenant"] == tenant]


def test_a_yielding_job_tenant_gets_spare_gpus_and_hands_them_back_on_a_claim(env):
    import ray

    from spotfill.fillin.grant import ArbiterGrant

    grant = ArbiterGrant("batch", "evaluate", max_units=2, grace_s=3.0, arbiter=env["arbiter"])
    try:
        assert grant.wait(2, timeout=30) == 2, "both idle slots are lent to the batch tenant"

        @ray.remote(num_cpus=0, num_gpus=1)
        class Worker:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        workers = [Worker.remote() for _ in range(2)]
        nodes = ray.get([w.node.remote() for w in workers], timeout=60)
        assert len(set(nodes)) == 2
        held = wait_for(lambda: (lambda ls: ls if len(ls) == 2 else None)(leases_of(env, "batch:evaluate")), 20,
                        "the two actors seen as the tenant's leases")
        assert {le["node_id"] for le in held} == set(nodes)
        assert all(le["kind"] == "batch" for le in held)

        # training claims both slots; the "driver" yields as soon as its target drops, as a batch job does
        def yield_when_told():
            wait_for(lambda: grant.allowed() == 0, 20, "the grant to drop to 0")
            for w in workers:
                ray.kill(w)

        import threading
        t = threading.Thread(target=yield_when_told)
        t.start()
        answer = ray.get(env["arbiter"].claim.remote("train-a", 2, 20.0, 1, 1, 2), timeout=40)
        t.join(30)
        assert answer["ok"], answer
        assert len(answer["reclaimed"]) == 2
        assert answer["waited_s"] < 10.0
        st = arbiter_status(env)
        assert st["handbacks"][-1]["job"] == "train-a"
        journal = ray.get(env["arbiter"].journal_since.remote(0), timeout=30)["events"]
        reclaims = [e for e in journal if e["kind"] == "reclaim" and e["tenant"] == "batch:evaluate"]
        assert len(reclaims) == 2 and all(e["cause"] == "training_claim" and e["job"] == "train-a"
                                          for e in reclaims), journal
        assert grant.allowed() == 0, "nothing is lent while training holds its claim"
    finally:
        grant.close()
        ray.get(env["arbiter"].release_job.remote("train-a"), timeout=30)
    assert not any(t["tenant"] == "batch:evaluate" for t in arbiter_status(env)["tenants"])


def test_a_job_registered_with_no_demand_is_lent_nothing_until_it_states_one(env):
    """A batch job or sweep registers before it can run a unit (its plan, its keeper, Tune's start) with
    demand 0: nothing is lent to it -- a demo's batch job held a lent GPU 53 s before its first wave -- until
    it states what it can use."""
    from spotfill.fillin.grant import ArbiterGrant

    grant = ArbiterGrant("batch", "preparing", max_units=2, grace_s=3.0, arbiter=env["arbiter"], demand=0)
    try:
        assert grant.wait(1, timeout=3) == 0 and leases_of(env, "batch:preparing") == []
        grant.demand(1)
        assert grant.wait(1, timeout=30) == 1, "lent once it states a demand"
    finally:
        grant.close()


def test_a_unit_whose_constructor_runs_is_seen_as_the_tenants_lease(env):
    """A batch unit's actor holds its GPU from the moment Ray hands it a process; while its constructor runs
    (a cold start, or a standby still warming) Ray's state API gives it no node (PENDING_CREATION, node_id
    None, pid set). Before, the arbiter did not see it -- its GPU counted as training's and the unit as
    "not placed" -- and gave it up after 30 s (a demo: six times). Now its node comes from its process."""
    import ray
    from ray.util.state import list_actors

    from spotfill.fillin.grant import ArbiterGrant

    grant, actor = ArbiterGrant("batch", "constructing", max_units=1, grace_s=3.0, arbiter=env["arbiter"]), None
    try:
        assert grant.wait(1, timeout=30) == 1

        @ray.remote(num_cpus=0, num_gpus=1)
        class SlowStart:
            def __init__(self):
                time.sleep(60)             # a warm-up that has not ended

        actor = SlowStart.remote()
        rows = wait_for(lambda: [a for a in list_actors(detail=True)        # its class name is qualified
                                 if a.class_name.endswith(".SlowStart") and a.pid] or None, 60, "the actor's process")
        assert rows[0].state == "PENDING_CREATION" and rows[0].node_id is None, rows   # what Ray says of it
        held = wait_for(lambda: leases_of(env, "batch:constructing") or None, 20, "the constructing unit's lease")
        assert len(held) == 1 and held[0]["lease_id"] == rows[0].actor_id, held
    finally:
        if actor is not None:
            ray.kill(actor)
        grant.close()


def test_a_job_tenant_that_does_not_yield_is_stopped_after_its_grace(env):
    import ray

    proc = subprocess.Popen([sys.executable, "-c", STUBBORN, env["cluster"].address], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "platform")})
    try:
        line = ""
        t_end = time.monotonic() + 120
        while "HOLDING" not in line and time.monotonic() < t_end and proc.poll() is None:
            line = proc.stdout.readline()
        assert "HOLDING" in line, f"the stubborn driver never held its GPU (exit {proc.poll()})"
        wait_for(lambda: leases_of(env, "sweep:stubborn"), 20, "the stubborn tenant's lease")
        answer = ray.get(env["arbiter"].claim.remote("train-b", 2, 20.0, 1, 1, 2), timeout=40)
        assert answer["ok"], answer
        assert 1.0 <= answer["waited_s"] < 15.0, answer      # grace 1 s, then forced
        assert proc.wait(timeout=30) != 0, "the driver was stopped"
        # the stop is made off the arbiter's lock and recorded when it is done
        forced = wait_for(lambda: [d for d in arbiter_status(env)["decisions"]
                                   if d["tenant"] == "sweep:stubborn" and d["reason"].startswith("forced")],
                          20, "the forced stop to be recorded")
        assert "killed driver pid" in forced[-1]["reason"], forced
    finally:
        if proc.poll() is None:
            proc.kill()
        ray.get(env["arbiter"].release_job.remote("train-b"), timeout=30)
