"""Ray Train's elastic scaling policy, made to see draining and dead nodes.

Stock Ray Train 2.60 sizes a (re)started worker group from the autoscaling coordinator's view of the
cluster, which still counts a node that is draining (spot notice) or was just lost. The group then waits
for slots that will never come (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default) before it
shrinks. This policy counts only nodes that are alive and not draining, so the restart picks the size
the cluster can hold right now.

PRIVATE RAY TRAIN API, isolated here: ElasticScalingPolicy._count_possible_workers and
DataParallelTrainer._initialize_and_run_controller (the scaling policy is built on the driver and handed
to the controller actor). Checked against ray 2.60.0.
"""
from __future__ import annotations

import ray
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy


def schedulable_node_resources() -> dict[str, dict]:
    """Total resources of nodes that are alive and not draining (draining: ray._private state, as Ray
    Train's own PreemptionWatcher reads it)."""
    draining = ray._private.state.state.get_draining_nodes() or {}
    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in draining}


def count_workers(node_resources: dict[str, dict], per_worker: dict[str, float], max_workers: int) -> int:
    """Workers that fit on these nodes (each worker on one node), capped at max_workers (pure)."""
    need = {r: v for r, v in per_worker.items() if v > 0}
    total = sum(int(min(res.get(r, 0.0) // v for r, v in need.items())) for res in node_resources.values())
    return min(total, max_workers)


class DrainAwareElasticPolicy(ElasticScalingPolicy):
    """Sizes from the nodes' own resources: the coordinator's reservations lag node changes by up to
    its tick, which made restarts pick a stale size. (spotfill's arbiter owns sharing with fill-in.)"""

    def _count_possible_workers(self, reserved_resources) -> int:
        return count_workers(schedulable_node_resources(), self.scaling_config._resources_per_worker_not_none,
                             self.scaling_config.max_workers)


class SpotfillTorchTrainer(TorchTrainer):
    """TorchTrainer whose elastic restarts size the group from schedulable nodes only."""

    def _initialize_and_run_controller(self, **kwargs):
        if isinstance(kwargs.get("scaling_policy"), ElasticScalingPolicy):
            kwargs["scaling_policy"] = DrainAwareElasticPolicy(scaling_config=self.scaling_config)
        return super()._initialize_and_run_controller(**kwargs)
