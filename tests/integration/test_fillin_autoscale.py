"""Serve fill-in on a cluster scaled by Ray's own autoscaler (v2, fake multi-node provider, head-only at first;
one worker type of 2 GPU slots, idle timeout 3 s). One cluster for the module, one story in order:

  1. Serve fill-in deployed (the generation app, 0 Generator replicas, arbiter in autoscaled mode) while no
     GPU exists: the autoscaler launches nothing, and Ray reports no pending demand from Serve;
  2. a stand-in training job (a Ray actor holding 1 GPU slot, registered with the arbiter like Ray Train's
     claim hook does; max 1 worker) makes the autoscaler launch one node; the slot beyond training's max on
     that node is lent to Serve -- and no second node is launched for Serve;
  3. training claims 2 GPUs (as before a grow): the lease is reclaimed, the hand-back measured, the second
     training worker placed on the same node (still one launch);
  4. training ends while Serve holds a lease on the node: the arbiter reclaims it once training has been
     gone for its idle time, and the autoscaler removes the idle node -- with Serve still deployed.

Injecting the faults this guards against: a Serve app deployed with one replica (Serve's default) leaves a
pending GPU request in step 1 that the autoscaler answers with a node; a lease kept after training ended
keeps the node busy in step 4, and it never scales down.
"""
from __future__ import annotations

import os
import socket
import time

import pytest

from spotfill.testing.waiting import wait_for as _wait_for

pytestmark = pytest.mark.timeout(300)
IDLE_S = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str, every: float = 0.3):
    return _wait_for(check, timeout, what, every)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from spotfill.fillin.arbiter import ensure_arbiter
    from spotfill.fillin.local import deploy_serve, runtime_env
    from spotfill.sim.autoscaler_config import NodeTypeSpec
    from spotfill.sim.autoscaling import AutoscalingCluster

    tmp = tmp_path_factory.mktemp("fillin-autoscale")
    cluster = AutoscalingCluster([NodeTypeSpec("gpu_spot", gpus=2, market="spot", max_workers=2, priority=10)],
                                 "GPU_SLOT", idle_timeout_s=IDLE_S, allocate_timeout_s=8,
                                 workdir=str(tmp / "autoscaler"))
    try:
        ray.init(address=cluster.address, runtime_env=runtime_env(), log_to_driver=False)
        renv = runtime_env()
        arbiter = ensure_arbiter("GPU_SLOT", runtime_env=renv, state_path=str(tmp / "arbiter" / "state.json"),
                                 autoscaled=True, idle_reclaim_s=IDLE_S)
        os.makedirs(tmp / "run", exist_ok=True)
        t0 = time.time()
        out = deploy_serve(f"file://{tmp / 'run'}", port=free_port(), dashboard_url=cluster.cluster.webui_url,
                           max_replicas=2, arbiter=arbiter, max_tokens=8, replicas=0)
        yield {"cluster": cluster, "arbiter": arbiter, "deployed_at": t0, "url": out["url"], "tmp": tmp}
    finally:
        try:
            from ray import serve
            serve.shutdown()
        except Exception:  # noqa: BLE001
            pass
        cluster.shutdown()


def launches(cluster) -> list[dict]:
    return [e for e in cluster.provider_log() if e["event"] == "launched"]


def pending_demand(cluster) -> list[dict]:
    """Task/actor/placement-group demand the autoscaler sees (what it would launch nodes for)."""
    from ray.autoscaler.v2.sdk import get_cluster_status
    status = get_cluster_status(cluster.gcs_address)
    d = status.resource_demands
    out = [{"bundle": dict(b.bundle), "count": b.count} for x in d.ray_task_actor_demand for b in x.bundles_by_count]
    out += [{"pg": True, "bundles": [dict(b.bundle) for b in x.bundles_by_count]} for x in d.placement_group_demand]
    return out


def serve_state() -> tuple[str, int]:
    from ray import serve
    app = serve.status().applications["spotfill-serve"]
    dep = app.deployments["Generator"]
    return str(getattr(app.status, "value", app.status)), int(dep.replica_states.get("RUNNING", 0))


def leases(arbiter) -> list[dict]:
    import ray
    return ray.get(arbiter.status.remote())["leases"]


@pytest.fixture(scope="module")
def story(env):
    """Steps 1-4 in order (each test below checks one); returns what was seen."""
    import ray

    cluster, arbiter = env["cluster"], env["arbiter"]
    seen: dict = {}
    # 1. no GPU anywhere: Serve deployed, nothing lent, nothing launched, no demand from Serve
    time.sleep(8)                                    # several autoscaler rounds (1 s each here)
    seen["step1"] = {"launches": launches(cluster), "demand": pending_demand(cluster), "serve": serve_state(),
                     "status": ray.get(arbiter.status.remote())}

    # 2. training starts (max 1 worker): the autoscaler launches a node for it; the other slot is lent
    @ray.remote(num_cpus=1, resources={"GPU_SLOT": 1})
    class Worker:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    ray.get(arbiter.register_job.remote("train", 1, 1, 1), timeout=30)
    a = Worker.remote()
    node_a = ray.get(a.node.remote(), timeout=120)
    ray.get(arbiter.claim.remote("train", 1, 10.0, 1, 1, 1), timeout=30)   # as Ray Train's hook: it runs 1
    lent = wait_for(lambda: [le for le in leases(arbiter) if le["node_id"] == node_a], 60,
                    "the slot beyond training's max lent to Serve")
    wait_for(lambda: serve_state()[1] >= 1, 60, "a Serve replica running on the lent slot")
    time.sleep(4)                                    # room for a (wrong) launch for Serve to show up
    seen["step2"] = {"node": node_a, "leases": lent, "launches": launches(cluster),
                     "demand": pending_demand(cluster)}

    # 3. training claims both slots (a grow to 2): the lease is reclaimed, worker 2 lands on the same node
    answer = ray.get(arbiter.claim.remote("train", 2, 10.0, 1, 1, 2), timeout=30)
    b = Worker.remote()
    node_b = ray.get(b.node.remote(), timeout=60)
    seen["step3"] = {"answer": answer, "node": node_b, "launches": launches(cluster),
                     "handbacks": ray.get(arbiter.status.remote())["handbacks"]}

    # training shrinks back to 1 worker: the slot is lent again (training runs its max of 2 as recorded)
    ray.kill(b)
    wait_for(lambda: [le for le in leases(arbiter) if le["node_id"] == node_a], 60, "the slot lent again")
    wait_for(lambda: serve_state()[1] >= 1, 60, "a Serve replica running again")

    # 4. training ends: the lease goes back once training is gone for IDLE_S, then the node scales down
    ray.kill(a)
    ray.get(arbiter.release_job.remote("train"), timeout=30)
    ended = time.time()

    def node_gone():
        return not any(n["NodeID"] == node_a and n.get("Alive") for n in ray.nodes())
    wait_for(node_gone, 90, "the idle node removed by the autoscaler")
    from spotfill.ray_compat import node_death_reason_name
    dead = next(n for n in ray.nodes() if n["NodeID"] == node_a)
    seen["step4"] = {"seconds": round(time.time() - ended, 1), "serve": serve_state(),
                     "death_reason": node_death_reason_name(dead.get("DeathReason")),
                     "decisions": ray.get(arbiter.status.remote(last=100))["decisions"],
                     "launches": launches(cluster), "leases": leases(arbiter)}
    print(f"\nfill-in on the autoscaler: training ended -> idle node removed in {seen['step4']['seconds']} s; "
          f"hand-back {answer['waited_s']} s")
    return seen


def test_serve_deployed_without_gpus_makes_the_autoscaler_launch_nothing(story):
    s = story["step1"]
    assert s["launches"] == [], s["launches"]
    assert s["demand"] == [], s["demand"]               # no replica waits for a GPU slot
    assert s["serve"] == ("RUNNING", 0)
    # the arbiter took Serve over at 0 replicas and lent nothing
    assert [t["target"] for t in s["status"]["tenants"]] == [0] and s["status"]["leases"] == []


def test_fillin_lends_only_beyond_training_on_its_node_and_launches_nothing(story):
    s = story["step2"]
    assert len(s["launches"]) == 1                      # the node training asked for, none for Serve
    assert [le["gpus"] for le in s["leases"]] == [1]
    assert s["demand"] == [], s["demand"]


def test_training_takes_the_lent_gpu_back(story):
    s = story["step3"]
    assert s["answer"]["ok"] and s["answer"]["reclaimed"], s["answer"]
    assert s["node"] == story["step2"]["node"]           # on the GPU Serve gave back, not on a new node
    assert len(s["launches"]) == 1
    assert s["handbacks"] and s["handbacks"][-1]["ok"]


def test_idle_node_scales_down_with_serve_still_deployed(story):
    s = story["step4"]
    assert s["death_reason"].startswith("AUTOSCALER_DRAIN_IDLE"), s["death_reason"]
    assert s["serve"] == ("RUNNING", 0)                  # the app is up, its replicas gave the node back
    idle = [d for d in s["decisions"] if d["action"] == "reclaim" and "no training on the node" in d["reason"]]
    assert idle and idle[-1]["node_id"] == story["step2"]["node"], s["decisions"][-10:]
    assert len(s["launches"]) == 1 and s["leases"] == []
