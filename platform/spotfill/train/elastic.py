"""Ray Train's elastic scaling policy, made to see draining and dead nodes.

Stock Ray Train 2.60 sizes a (re)started worker group from the autoscaling coordinator's view of the
cluster, which still counts a node that is draining (spot notice) or was just lost. The group then waits
for slots that will never come (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default) before it
shrinks. This policy counts only nodes that are alive, not draining, and whose raylet answers a connect
(the GCS keeps a killed node "alive" for its health-check window), so the restart picks the size the
cluster can hold right now.

The private Ray Train hooks this needs (ElasticScalingPolicy._count_possible_workers, the trainer's
controller start) live in spotfill.ray_compat.
"""
from __future__ import annotations

import ray
from ray.train.torch import TorchTrainer

from spotfill.ray_compat import ElasticScalingPolicy, draining_node_ids, use_scaling_policy
from spotfill.train.capacity import count_workers, reachable


def schedulable_node_resources(probe_s: float | None = None) -> dict[str, dict]:
    """Total resources of nodes that are alive and not draining (draining: ray._private state, as Ray
    Train's own PreemptionWatcher reads it). With `probe_s`, also only nodes whose raylet accepts a TCP
    connection within that time: right after a hard loss the GCS still lists the dead node as alive for
    its health-check window (seconds), and a restart sized with it waits out Ray Train's start timeout."""
    draining = draining_node_ids()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in draining]
    if probe_s is not None:
        answering = reachable({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in nodes},
                              probe_s)
        nodes = [n for n in nodes if n["NodeID"] in answering]
    return {n["NodeID"]: n["Resources"] for n in nodes}


RAYLET_PROBE_S = 0.5   # a live raylet answers a local-network connect in milliseconds


class GrowCheck:
    """Rank 0's periodic question during training: how many more workers would fit now?"""

    def __init__(self, per_worker: dict[str, float], max_workers: int):
        self.per_worker, self.max_workers = per_worker, max_workers

    def extra_workers(self, world: int, now: float) -> int:
        """Workers beyond `world` that the schedulable nodes hold (0 when none)."""
        return max(0, count_workers(schedulable_node_resources(), self.per_worker, self.max_workers) - world)


class DrainAwareElasticPolicy(ElasticScalingPolicy):
    """Sizes from the nodes' own resources: the coordinator's reservations lag node changes by up to
    its tick, which made restarts pick a stale size. Nodes whose raylet does not answer are left out, so a
    restart right after a hard loss does not count the dead node. (spotfill's arbiter owns sharing with
    fill-in.)"""

    def _count_possible_workers(self, reserved_resources) -> int:
        return count_workers(schedulable_node_resources(probe_s=RAYLET_PROBE_S),
                             self.scaling_config._resources_per_worker_not_none, self.scaling_config.max_workers)


SpotfillTorchTrainer = use_scaling_policy(TorchTrainer, lambda sc: DrainAwareElasticPolicy(scaling_config=sc))
"""TorchTrainer whose elastic restarts size the group from schedulable nodes only."""
