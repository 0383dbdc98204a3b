"""Finding and starting the fill-in arbiter actor (fillin/arbiter.py), without importing it: a tenant's
process (fillin/busy.py) only needs its handle."""
from __future__ import annotations

import os
import tempfile

from spotfill.fillin.policy import DEFAULT_ORDER
from spotfill.train.arbiter_link import ARBITER_NAME, NAMESPACE, get_arbiter  # noqa: F401 - training's side



def default_state_path() -> str:
    """The arbiter's state file on the head node, one per cluster (the head node's id): a new cluster on the
    same machine must not adopt the tenants, targets and dashboard URL of an earlier one."""
    import ray
    head = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "no-cluster"
    return os.path.join(tempfile.gettempdir(), "spotfill-arbiter", head[:16], "state.json")


def ensure_arbiter(gpu_resource: str = "GPU", order: tuple[str, ...] = DEFAULT_ORDER,
                   state_path: str | None = None, runtime_env: dict | None = None, dashboard_url: str | None = None,
                   autoscaled: bool | None = None, launch_nodes: bool = False,
                   idle_reclaim_s: float | None = None, turn_s: float | None = None):
    """The arbiter actor: found by name, else started detached on the head node (0 CPUs). `autoscaled`:
    the cluster is scaled by Ray's autoscaler -- fill-in lends only on nodes training uses, gives a node
    back idle_reclaim_s after training left it, and never leaves a replica pending (autoscaler demand)
    unless `launch_nodes` (the user allows fill-in to make the autoscaler launch nodes); None (the default):
    the arbiter finds out on the head (fillin/cluster_kind.py). `turn_s`: with fewer units than tenants, how
    long a batch job or sweep keeps a unit another tenant waits for (lending.take_turns; None: TURN_S).
    Callers go through fillin/wiring.py."""
    import ray

    from spotfill.fillin.arbiter import IDLE_RECLAIM_S, Arbiter
    from spotfill.ray_compat import require
    require("fillin_arbiter")       # one line (RayCompatError) where Ray moved what the arbiter reads
    from spotfill.fillin.turns import TURN_S
    idle_reclaim_s = IDLE_RECLAIM_S if idle_reclaim_s is None else idle_reclaim_s
    turn_s = TURN_S if turn_s is None else turn_s

    options = dict(name=ARBITER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                   num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=16)
    head = head_node_strategy(soft=False)
    if head is not None:
        options["scheduling_strategy"] = head
    if runtime_env:
        options["runtime_env"] = runtime_env
    handle = ray.remote(Arbiter).options(**options).remote(gpu_resource, tuple(order), state_path,
                                                           dashboard_url=dashboard_url, autoscaled=autoscaled,
                                                           launch_nodes=launch_nodes, idle_reclaim_s=idle_reclaim_s,
                                                           turn_s=turn_s)
    ray.get(handle.ping.remote(), timeout=60)
    return handle


def head_node_strategy(soft: bool = True):
    """Ray's scheduling strategy for the head node (a control-plane actor: the arbiter, a job's standby or state
    keeper), or None where no head is found. Not "this driver's node": a driver connected to a cluster whose
    nodes share one address may be attached to any of their raylets, a spot GPU node that goes away."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    head = next((n["NodeID"] for n in ray.nodes() if n.get("Alive")
                 and "node:__internal_head__" in (n.get("Resources") or {})), None)
    return NodeAffinitySchedulingStrategy(head, soft=soft) if head else None
