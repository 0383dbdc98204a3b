"""Ray Train's elastic scaling policy and rank 0's grow check, made to count FREE capacity.

Stock Ray Train 2.60 sizes a (re)started worker group from the autoscaling coordinator's view of the
cluster, which still counts a node that is draining (spot notice) or was just lost. The group then waits
for slots that will never come (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) before it shrinks. Both the restart
sizing and the grow check here count only nodes that are alive, not draining, and whose raylet answers a
connect (the GCS keeps a killed node "alive" for its health-check window) -- and on those nodes only the
resources that are free: available now, plus (at restart time) what this run's own group still holds and
what fill-in borrowed (the claim hook takes it back before the group starts).
Counting totals made rank 0 grow into slots another actor held, and restart every resize_check_s forever.

The pure arithmetic is in capacity.py; the private Ray hooks in spotfill.ray_compat.
"""
from __future__ import annotations

import json
import logging

import ray
from ray.train.torch import TorchTrainer

from spotfill.ray_compat import (ElasticScalingPolicy, available_resources_per_node, draining_node_ids,
                                 kv_get, kv_put, usable, use_spotfill_controller)
from spotfill.train.capacity import (GrowDecision, GrowGate, NodeCapacity, capacity_state, count_workers,
                                     free_resources, reachable)
from spotfill.train.pipe_layout import round_to_replicas

log = logging.getLogger(__name__)
RAYLET_PROBE_S = 0.5   # a live raylet answers a local-network connect in milliseconds


def schedulable_nodes(probe_s: float | None = RAYLET_PROBE_S) -> dict[str, NodeCapacity]:
    """Total and available resources of nodes that are alive, not draining (ray._private state, as Ray
    Train's own PreemptionWatcher reads it) and, with `probe_s`, whose raylet accepts a TCP connection
    within that time: right after a hard loss the GCS still lists the dead node as alive for its
    health-check window, and a restart sized with it waits out Ray Train's start timeout."""
    draining = draining_node_ids()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n["NodeID"] not in draining]
    if probe_s is not None:
        answering = reachable({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"]) for n in nodes},
                              probe_s)
        nodes = [n for n in nodes if n["NodeID"] in answering]
    available = available_resources_per_node()
    return {n["NodeID"]: NodeCapacity(total=dict(n["Resources"]), available=dict(available.get(n["NodeID"], {})))
            for n in nodes}


class GrowCheck:
    """Rank 0's periodic question during training: how many more workers would fit in free capacity now?

    At most one grow attempt per capacity state for the whole run: the states already tried are kept in the
    GCS key-value store under the run's name, since every grow restarts the worker processes."""

    def __init__(self, per_worker: dict[str, float], max_workers: int, run_key: str | None = None,
                 multiple: int = 1):
        self.per_worker, self.max_workers, self.multiple = per_worker, max_workers, multiple
        self._key = f"spotfill:grow-tried:{run_key or _train_run_name()}"
        self.last: GrowDecision | None = None

    def extra_workers(self, world: int, now: float) -> int:
        """Workers beyond `world` that the free capacity of schedulable nodes holds (0 when none, or when
        this capacity state was already tried; always 0 where Ray moved what it reads: drain_aware_restarts)."""
        if not usable("drain_aware_restarts"):
            return 0
        free = free_resources(schedulable_nodes())
        fitting = min(self.max_workers, world + count_workers(free, self.per_worker, self.max_workers))
        fitting = round_to_replicas(fitting, self.multiple)      # a pipeline grows by whole replicas
        gate = GrowGate(tried=self._load())
        self.last = gate.decide(world, fitting, capacity_state(free, self.per_worker))
        if self.last.extra:
            self._save(gate.tried)
            log.info("grow check: %s", self.last.reason)
        return self.last.extra

    def _load(self) -> set:
        raw = kv_get(self._key)
        return {tuple((node, tuple(counts)) for node, counts in s) for s in json.loads(raw)} if raw else set()

    def _save(self, tried: set) -> None:
        kv_put(self._key, json.dumps(sorted([list(map(list, s)) for s in tried])))


def _train_run_name() -> str:
    """This Ray Train run's name (one per TrainingJob.fit), from inside a worker."""
    import ray.train
    return ray.train.get_context().get_experiment_name()


def fillin_reclaimable() -> dict[str, dict[str, float]]:
    """GPUs per node lent to fill-in, which training's claim takes back before its group starts (the
    arbiter's view); {} without an arbiter or when it does not answer in time -- sizing then counts only
    what is free, as it would without fill-in."""
    try:
        from spotfill.fillin.arbiter import get_arbiter
        arbiter = get_arbiter()
        return ray.get(arbiter.reclaimable.remote(), timeout=5) if arbiter is not None else {}
    except Exception as exc:  # noqa: BLE001 - fill-in never stops training
        log.warning("fill-in: cannot read reclaimable GPUs (%s); sizing the restart without them", exc)
        return {}


class DrainAwareElasticPolicy(ElasticScalingPolicy):
    """Sizes restarts from the schedulable nodes' free resources, not the coordinator's reservations (they
    lag node changes by up to its tick). Ray Train decides the next size before it shuts the old group
    down, so the old group's own slots count as free here; anything else's never do."""

    _own_placement_group = None

    def __init__(self, scaling_config, workers_multiple: int = 1):
        super().__init__(scaling_config)
        self.workers_multiple = workers_multiple     # pipeline stages: a group of whole replicas only

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._own_placement_group = worker_group_state.placement_group_handle.placement_group
        return super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)

    def _count_possible_workers(self, reserved_resources) -> int:
        free = free_resources(schedulable_nodes(RAYLET_PROBE_S), self._own_held(), fillin_reclaimable())
        return round_to_replicas(count_workers(free, self.scaling_config._resources_per_worker_not_none,
                                               self.scaling_config.max_workers), self.workers_multiple)

    def _own_held(self) -> dict[str, dict[str, float]]:
        """Per node, what this run's current worker group still holds (nothing once it was removed)."""
        pg = self._own_placement_group
        if pg is None:
            return {}
        try:
            table = ray.util.placement_group_table(pg)
        except Exception as exc:  # the GCS answers this; a miss only makes the restart smaller
            log.warning("cannot read this run's placement group (%s); sizing without its slots", exc)
            return {}
        if table.get("state") in (None, "REMOVED"):   # partly lost (RESCHEDULING): its live bundles count
            return {}
        held: dict[str, dict[str, float]] = {}
        for index, node_id in table.get("bundles_to_node_id", {}).items():
            for name, amount in table["bundles"].get(index, {}).items():
                held.setdefault(node_id, {})[name] = held.get(node_id, {}).get(name, 0.0) + amount
        return held


SpotfillTorchTrainer = use_spotfill_controller(TorchTrainer, lambda sc: DrainAwareElasticPolicy(scaling_config=sc))
"""TorchTrainer whose elastic restarts size the group from free capacity of schedulable nodes, whose
placement-group cleaner checks liveness through the GCS, and whose restarts are reported with a cause."""


def spotfill_trainer(stages: int = 1):
    """SpotfillTorchTrainer; with pipeline stages, one whose restarts size the group in whole replicas."""
    if stages <= 1:
        return SpotfillTorchTrainer
    return use_spotfill_controller(
        TorchTrainer, lambda sc: DrainAwareElasticPolicy(scaling_config=sc, workers_multiple=stages))
