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


def schedulable_node_ids() -> set[str]:
    """Nodes that are alive and not draining (draining: ray._private state, as Ray Train's own
    PreemptionWatcher reads it)."""
    draining = ray._private.state.state.get_draining_nodes() or {}
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in draining}


class DrainAwareElasticPolicy(ElasticScalingPolicy):
    def _count_possible_workers(self, reserved_resources) -> int:
        live = schedulable_node_ids()
        return super()._count_possible_workers(
            {node: res for node, res in reserved_resources.items() if node in live})


class SpotfillTorchTrainer(TorchTrainer):
    """TorchTrainer whose elastic restarts size the group from schedulable nodes only."""

    def _initialize_and_run_controller(self, **kwargs):
        if isinstance(kwargs.get("scaling_policy"), ElasticScalingPolicy):
            kwargs["scaling_policy"] = DrainAwareElasticPolicy(scaling_config=self.scaling_config)
        return super()._initialize_and_run_controller(**kwargs)
