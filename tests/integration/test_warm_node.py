"""Warming a node new to the run, on a real local cluster: the spares a grow asks that node's raylet for
(train.elastic.warm_node) start, import torch and DeepSpeed (at normal priority on a node new to the run;
in SCHED_IDLE, through tokens in the GCS store, on a node the group steps on), record their readiness
(train.readiness), and hold none of the node's Ray resources: a tenant still gets the node's GPU and CPU
while they are there. The same holds for the spares a training worker asks its own node's raylet for
(train.spare_workers.prestart_spares)."""
from __future__ import annotations

import logging
import time

import pytest

READY_DEADLINE_S = 240


@pytest.fixture(scope="module")
def cluster():
    import ray

    from spotfill.ray_compat import worker_setup_hook_env
    from spotfill.sim.cluster import EmbeddedCluster, worker_env
    from spotfill.train.warm import HOOK
    c = EmbeddedCluster("GPU")
    c.add_node(2)       # 2 GPUs, 2 CPUs: its raylet starts 2 processes at once (one per CPU, Ray's default)
    # the job's processes run spotfill's warm hook, as a training run's worker_runtime_env gives them
    ray.init(address=c.address, runtime_env={"env_vars": worker_setup_hook_env(HOOK, worker_env())},
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _node_resources(node_id: str) -> dict:
    from spotfill.ray_compat import available_resources_per_node
    return available_resources_per_node().get(node_id, {})


def test_warmed_spares_are_ready_idle_and_hold_no_gpu_or_cpu(cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from spotfill.train.elastic import ready_spares, warm_node
    node = cluster.node_ids[0]
    before = _node_resources(node)
    assert before.get("GPU") == 2.0 and before.get("CPU") == 2.0, before
    warm_node(node, 2, idle=True)
    deadline = time.time() + READY_DEADLINE_S
    while time.time() < deadline and ready_spares().get(node, 0) < 2:
        time.sleep(1.0)
    assert ready_spares().get(node, 0) == 2, ready_spares()

    # the records say each spare warmed up in SCHED_IDLE (the store's tokens reached the other node)
    from spotfill.ray_compat import kv_get, kv_list
    from spotfill.train.readiness import record_prefix
    import json
    records = [json.loads(kv_get(k)) for k in kv_list(record_prefix(ray.get_runtime_context().get_job_id(), node))]
    assert len(records) == 2 and all(r["idle"] for r in records), records

    # nothing of the node's resources is held by them: a tenant gets its GPU and CPU
    assert _node_resources(node) == before
    pin = NodeAffinitySchedulingStrategy(node, soft=False)

    @ray.remote(num_gpus=2, num_cpus=2)
    def tenant():
        import os
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    assert ray.get(tenant.options(scheduling_strategy=pin).remote(), timeout=120) == "0,1"


def test_a_process_taken_by_a_worker_group_withdraws_its_record(cluster):
    import ray

    from spotfill.train.elastic import ready_spares

    node = cluster.node_ids[0]
    before = ready_spares().get(node, 0)

    @ray.remote(num_cpus=0)
    class Worker:
        def take(self):
            from spotfill.train.warm import withdraw
            withdraw()
            return True

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    w = Worker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    assert ray.get(w.take.remote(), timeout=120)
    # the actor landed on a ready spare (Ray hands an idle process of the same job and runtime_env to a new
    # actor), whose record went as it was taken
    assert ready_spares().get(node, 0) == before - 1
    ray.kill(w)


def test_the_worker_loops_spares_hold_no_ray_resource_and_warm_idle(cluster):
    """A training worker's ask for spares on its own node (the worker loop's, after its group's first step):
    the spares are processes with no lease -- the node's GPU and CPU stay available in Ray's accounting, a
    tenant still gets them -- and they warmed up in SCHED_IDLE (the worker's file tokens). Run from a task
    on a node of its own, as a worker of the job is."""
    import json

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from spotfill.ray_compat import kv_get, kv_list
    from spotfill.train.readiness import record_prefix
    node = cluster.node_ids[cluster.add_node(2)]
    deadline = time.time() + 60
    while time.time() < deadline and _node_resources(node).get("CPU") != 2.0:
        time.sleep(0.5)
    before = _node_resources(node)
    assert before.get("GPU") == 2.0 and before.get("CPU") == 2.0, before
    pin = NodeAffinitySchedulingStrategy(node, soft=False)

    @ray.remote(num_cpus=0)
    def ask_for_spares():
        import os

        from spotfill.train.spare_workers import prestart_spares
        from spotfill.train.warm import withdraw
        withdraw()          # as a training worker does at its start: this process is no spare
        prestart_spares(2)  # the node's target: the spares already there count
        return os.getpid()          # its thread asks the raylet; the process stays (an idle worker)

    ray.get(ask_for_spares.options(scheduling_strategy=pin).remote(), timeout=120)
    prefix = record_prefix(ray.get_runtime_context().get_job_id(), node)

    def records() -> list[dict]:
        """The node's warm processes of the job: those that took the asker's tokens (idle: held back while
        they warmed) and any other worker process of the job there that ran the hook (one Ray started on
        its own) -- a process a restart's actor can land on, which the ask counts (it asks the rest)."""
        return [json.loads(kv_get(k)) for k in kv_list(prefix)]
    deadline = time.time() + READY_DEADLINE_S
    while time.time() < deadline and sum(1 for r in records() if r["ready_t"]) < 2:
        time.sleep(1.0)
    warm = records()
    assert sum(1 for r in warm if r["ready_t"]) == len(warm) == 2, warm       # 2 wanted, 2 there, no more
    assert any(r["idle"] for r in warm), warm       # what the ask started took its tokens and warmed held back
    assert _node_resources(node) == before          # 0 GPU, 0 CPU held by the spares in Ray's accounting

    @ray.remote(num_gpus=2, num_cpus=2)
    def tenant():
        import os
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    assert ray.get(tenant.options(scheduling_strategy=pin).remote(), timeout=120) == "0,1"
