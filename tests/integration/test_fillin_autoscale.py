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
import time

import pytest

from spotfill.fillin.load import ServeLoad
from spotfill.testing.waiting import wait_for as _wait_for
from spotfill.testing.ports import free_port

pytestmark = pytest.mark.timeout(300)
IDLE_S = 3


def wait_for(check, timeout: float, what: str, every: float = 0.3):
    return _wait_for(check, timeout, what, every)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import ray

    from spotfill.fillin.arbiter import ensure_arbiter
    from spotfill.fillin.wiring import runtime_env
    from spotfill.serving.deploy import deploy_serve
    from spotfill.sim.autoscaler_config import NodeTypeSpec
    from spotfill.sim.autoscaling import AutoscalingCluster

    tmp = tmp_path_factory.mktemp("fillin-autoscale")
    cluster = AutoscalingCluster([NodeTypeSpec("gpu_spot", gpus=2, market="spot", max_workers=2, priority=10)],
                                 "GPU", idle_timeout_s=IDLE_S, allocate_timeout_s=8,
                                 workdir=str(tmp / "autoscaler"))
    try:
        ray.init(address=cluster.address, runtime_env=runtime_env(), log_to_driver=False)
        renv = runtime_env()
        # not told the cluster autoscales: it finds out on the head (the autoscaler config), as on `ray up`
        arbiter = ensure_arbiter("GPU", runtime_env=renv, state_path=str(tmp / "arbiter" / "state.json"),
                                 idle_reclaim_s=IDLE_S)
        os.makedirs(tmp / "run", exist_ok=True)
        t0 = time.time()
        out = deploy_serve(f"file://{tmp / 'run'}", port=free_port(), max_replicas=2, max_tokens=8)
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
    @ray.remote(num_cpus=1, num_gpus=1)
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

    # 4. training ends under a steady HTTP load (a request every 50 ms): the lease goes back once training
    # is gone for IDLE_S, then the node scales down. Requests the Ingress forwards as the last replica stops
    # wait in Serve's router with no replica, and Serve's cold-start rule starts one by itself
    load = ServeLoad(env["url"], rps=20, max_tokens=8, timeout_s=15).start()
    time.sleep(2)
    ray.kill(a)
    ray.get(arbiter.release_job.remote("train"), timeout=30)
    ended = time.time()
    running: list[tuple[float, int]] = []          # (t, Generator replicas RUNNING), sampled every 0.2 s

    def node_gone():
        running.append((time.time(), serve_state()[1]))
        return not any(n["NodeID"] == node_a and n.get("Alive") for n in ray.nodes())
    try:
        wait_for(node_gone, 90, "the idle node removed by the autoscaler", every=0.2)
    finally:
        served = load.stop()
    from spotfill.ray_compat import node_death_reason_name
    dead = next(n for n in ray.nodes() if n["NodeID"] == node_a)
    decisions = ray.get(arbiter.status.remote(last=100))["decisions"]
    idle_at = max((d["at"] for d in decisions if d["action"] == "reclaim" and "no training on the node"
                   in d["reason"]), default=None)
    seen["step4"] = {"seconds": round(time.time() - ended, 1), "serve": serve_state(),
                     "death_reason": node_death_reason_name(dead.get("DeathReason")), "decisions": decisions,
                     "launches": launches(cluster), "leases": leases(arbiter), "load": served,
                     "idle_reclaim_at": idle_at, "running": running}
    print(f"\nfill-in on the autoscaler: training ended -> idle node removed in {seen['step4']['seconds']} s; "
          f"hand-back {answer['waited_s']} s")
    return seen


def test_the_head_node_reports_its_node_type_to_the_autoscaler(env):
    """Autoscaler v2 reconciles Ray's nodes before the provider's instances: a head node whose Ray state has
    no node type (it had none before spotfill.sim.autoscaling set RAY_NODE_TYPE_NAME) failed each round
    with "ALLOCATED update must have instance_type" whenever the head registered before the first round
    -- 2 of 4 runs here, and then the autoscaler launched nothing for the whole run."""
    from ray._raylet import GcsClient
    from ray.autoscaler.v2.sdk import get_cluster_resource_state

    from spotfill.sim.autoscaler_config import HEAD_TYPE

    state = get_cluster_resource_state(GcsClient(address=env["cluster"].gcs_address))
    types = {n.instance_id: n.ray_node_type_name for n in state.node_states}
    assert types.get(env["cluster"].head_node_id) == HEAD_TYPE, types


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


def test_a_replica_serve_starts_by_itself_after_the_idle_reclaim_is_stopped_at_once(story):
    """Under load, the scale to 0 races requests the Ingress forwards as the last replica stops; Serve's
    cold-start rule then starts a replica the arbiter did not lend (3 of 4 times here). Such a replica must
    not run: the Ingress cancels the requests no replica took (503) and the arbiter asks for 0 again within
    a second. Before that fix it ran on the node until the arbiter's 30 s patience ran out, the node never
    idle meanwhile. No admitted request fails."""
    s = story["step4"]
    assert s["idle_reclaim_at"], s["decisions"][-10:]
    after = [(t, n) for t, n in s["running"] if t > s["idle_reclaim_at"] + 2.0]   # the reclaimed one's grace
    busy = sum(0.2 for _, n in after if n > 0)
    assert busy <= 1.0, f"a Generator replica ran {busy:.1f} s after the idle reclaim: {after[:40]}"
    load = s["load"]
    assert load["requests_failed"] == 0, load
    assert load["requests_rejected_503"] > 0, load     # no checkpoint in this run: every answer is a 503


def test_the_arbiter_found_out_itself_that_the_cluster_autoscales(story):
    """Nobody told the arbiter (ensure_arbiter without `autoscaled`, as a `serve deploy`'d app or a batch
    driver starts it): it read the autoscaler config on the head."""
    st = story["step1"]["status"]
    assert st["autoscaled"] is True, st["cluster_kind"]
    assert "gpu_spot" in st["cluster_kind"] and "0..2" in st["cluster_kind"]
