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
import threading
import time

import ray
from ray.train.torch import TorchTrainer

from spotfill.config import constants
from spotfill.ray_compat import (ElasticScalingPolicy, available_resources_per_node, draining_node_ids,
                                 kv_get, kv_list, kv_put, node_label_selector, usable, use_spotfill_controller)
from spotfill.spot.early_warning import without_warned
from spotfill.train.arbiter_link import announce_coming, fillin_reclaimable
from spotfill.train.capacity import (GrowDecision, GrowGate, NodeCapacity, capacity_state, count_workers,
                                     free_resources, reachable, workers_by_node)
from spotfill.config.pipe_layout import round_to_replicas
from spotfill.train.readiness import (GrowPlanner, GrowStep, ready_by_node, record_prefix, restart_size, short,
                                     warm_placement)

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


def ready_spares(job_id: str | None = None, warming: bool = False) -> dict[str, int]:
    """Ready warm spares per node of this job (with `warming`, those still warming up too: train.readiness
    records); {} when they cannot be read."""
    try:
        job_id = job_id or ray.get_runtime_context().get_job_id()
        keys = kv_list(record_prefix(job_id))
        return ready_by_node({k: kv_get(k) for k in keys}, time.time(), warming=warming)
    except Exception as exc:  # noqa: BLE001 -- no readiness known: sizing treats every node as cold
        log.warning("cannot read warm spares' readiness (%s: %s)", type(exc).__name__, exc)
        return {}


def warm_node(node_id: str, count: int, idle: bool = False, reserve: bool = False) -> None:
    """Ask node `node_id`'s raylet for `count` spare worker processes of this worker's job and runtime_env
    (they import torch and DeepSpeed and then record their readiness: train.warm), on a thread, off the
    step loop. `idle`: a node this run's group steps on -- the spares warm up in SCHED_IDLE there (tokens in
    the GCS store reach them on any node), on CPU time the steps leave unused. A node new to the run has no
    training to slow: its spares warm up at normal priority, ahead of fill-in's (nice 19, SCHED_IDLE), so
    the grow waits seconds, not until training leaves CPU time. A raylet starts at most as many processes at
    once as its node has CPUs and drops what it cannot start (Ray 2.60): the grow planner never asks a node
    for more spares than the workers it would hold there, and the node's memory caps them with the spares
    already there (train.spares.spares_within_memory). A failure is logged: the node then counts as ready
    only once the grow's bound passes (cold)."""
    from spotfill.ray_compat import prestart_workers
    from spotfill.train.spares import offer_kv, spares_within_memory

    def run():
        try:
            held = ready_spares(warming=True).get(node_id, 0) if ray.is_initialized() else 0
            n, why = spares_within_memory(count, node_memory_bytes(node_id), held,
                                          constants.WARM_SPARE_RSS_MB << 20, constants.WARM_SPARE_MEMORY_FRACTION)
            if why:
                log.info("spares on node %s: %s", short(node_id), why)
            if not n:
                return
            if idle or reserve:
                offer_kv(node_id, n, kv_put, reserve=reserve)     # held back: train.spares, train.warm
            prestart_workers(n, keep_alive_s=constants.WARM_SPARE_KEEP_ALIVE_S, node_id=node_id)
            log.info("warming %d spare worker process(es) on node %s", n, short(node_id))
        except Exception as exc:  # noqa: BLE001 -- the grow goes cold after its bound
            log.warning("spares not started on node %s (%s: %s)", short(node_id), type(exc).__name__, exc)

    threading.Thread(target=run, name="spotfill-warm-node", daemon=True).start()


def node_memory_bytes(node_id: str) -> int:
    """A node's memory as Ray counts it (its `memory` and `object_store_memory` resources; 0 when unknown)."""
    if not ray.is_initialized():        # no cluster to ask (and asking would start one)
        return 0
    try:
        node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    except Exception:  # noqa: BLE001 -- unknown: nothing caps its spares (spares.spares_within_memory)
        return 0
    res = (node or {}).get("Resources", {})
    return int(res.get("memory", 0) + res.get("object_store_memory", 0))


COMING_TTL_S = 20.0     # at least this long fill-in counts a node training waits for as training's (renewed)


class GrowCheck:
    """Rank 0's periodic question during training: how many more workers would fit in free capacity now,
    on nodes that can take them warm?

    Free capacity on a node is first warmed (train.readiness.GrowPlanner: spares asked from that node's
    raylet) and counted once it has a ready spare for each worker the grown group runs there, or cold after
    SPOTFILL_WARM_GROW_BOUND_S. At most
    one grow attempt per capacity state for the whole run: the states already tried are kept in the GCS
    key-value store under the run's name, since every grow restarts the worker processes."""

    def __init__(self, per_worker: dict[str, float], max_workers: int, run_key: str | None = None,
                 multiple: int = 1, group: dict | None = None, warm=warm_node, ready=ready_spares,
                 check_every_s: float = 1.0):
        self.per_worker, self.max_workers, self.multiple = per_worker, max_workers, multiple
        self._key = f"spotfill:grow-tried:{run_key or _train_run_name()}"
        self.group = dict(group or {})           # this group's workers per node
        spares = constants.WARM_SPARES
        self.planner = GrowPlanner(bound_s=constants.WARM_GROW_BOUND_S if spares > 0 else 0.0,
                                   spares_per_worker=max(1, spares),
                                   reserve=constants.WARM_SPARE_RESERVE if spares > 0 else 0)
        self._warm, self._ready = (warm if spares > 0 else None), (ready if spares > 0 else (lambda **_: {}))
        self.last: GrowDecision | None = None
        self.step: GrowStep | None = None       # the readiness decision behind the last grow
        self._run_key = run_key
        # the nodes last announced as coming, and when; None: nothing yet -- the first check writes (or removes)
        # the run's record, which the previous group left while it grew
        self._coming: tuple[tuple | None, float] = (None, 0.0)
        self._coming_ttl_s = max(COMING_TTL_S, 3 * check_every_s)     # outlives the checks that renew it

    def extra_workers(self, world: int, now: float) -> int:
        """Workers beyond `world` that the free capacity of schedulable nodes holds warm (0 when none, when
        new nodes are still warming, or when this capacity state was already tried; always 0 where Ray moved
        what it reads: drain_aware_restarts)."""
        if not usable("drain_aware_restarts"):
            return 0
        free = without_warned(free_resources(schedulable_nodes()))    # no grow onto an early-warned node
        step = self.planner.decide(world, self.max_workers, workers_by_node(free, self.per_worker),
                                   self.group, self._ready(), time.time(), self.multiple,
                                   present=self._ready(warming=True) if self._warm is not None else None)
        for node, count in step.warm.items():
            if self._warm is not None:
                self._warm(node, count, node in self.group)
        for node, count in step.reserve.items():        # for a restart that may come: held back until one
            if self._warm is not None:
                self._warm(node, count, True, True)
        # growing onto the nodes it waited for keeps them announced (renewed) until the group exits: its
        # synchronous save and the new group's claim take seconds, and the arbiter's idle rule (a node no
        # training runs on) must not reclaim their leases meanwhile -- the grow's claim takes them back, and
        # says so (a demo's sweep lease there was reclaimed as `node_idle` 1.3 s before the grow's exit).
        # The next group's first check replaces the record with what it waits for (or removes it).
        self._announce_coming((self._coming[0] or ()) if step.extra else step.waiting_nodes, now)
        if not step.extra:
            self.last = GrowDecision(0, step.reason)
            return 0
        gate = GrowGate(tried=self._load())
        self.last = gate.decide(world, world + step.extra, capacity_state(free, self.per_worker))
        if self.last.extra:
            self.step = step
            self._save(gate.tried)
            log.info("grow check: %s (%s)", self.last.reason, step.reason)
        return self.last.extra

    def _announce_coming(self, nodes: tuple, now: float) -> None:
        """The new nodes this run waits to grow onto, for fill-in (train.arbiter_link.announce_coming): an
        autoscaled cluster's fill-in lends their GPUs while the spares warm (the grow claims them back).
        Written when the set changes and renewed before its time runs out."""
        last, at = self._coming
        if tuple(sorted(nodes)) == last and (not nodes or now - at < self._coming_ttl_s / 2):
            return
        self._coming = (tuple(sorted(nodes)), now)
        announce_coming(self._run_key or _train_run_name(), nodes, self._coming_ttl_s)

    _told: str | None = None

    def news(self) -> str | None:
        """The last check's reason to wait for warm spares, when it is new (else None)."""
        reason = self.last.reason if self.last is not None and not self.last.extra else None
        if reason is None or not reason.startswith("waiting") or reason == self._told:
            return None
        self._told = reason
        log.info("grow check: %s", reason)
        return reason

    def exit_fields(self) -> dict:
        """What the planned exit of a grow records: how long it waited for ready nodes, which new nodes it
        grows onto warm and which cold (bound passed)."""
        s = self.step
        if s is None:
            return {}
        return {"ready_wait_s": s.ready_wait_s, "warm_nodes": list(s.warm_nodes),
                "cold_nodes": list(s.cold_nodes), "grow_reason": s.reason}

    def _load(self) -> set:
        raw = kv_get(self._key)
        return {tuple((node, tuple(counts)) for node, counts in s) for s in json.loads(raw)} if raw else set()

    def _save(self, tried: set) -> None:
        kv_put(self._key, json.dumps(sorted([list(map(list, s)) for s in tried])))


def _train_run_name() -> str:
    """This Ray Train run's name (one per TrainingJob.fit), from inside a worker."""
    import ray.train
    return ray.train.get_context().get_experiment_name()


# The run's policy in this controller process (one Ray Train controller per actor process): the fill-in claim
# callback asks it which nodes the group being started is pinned to (pinned_nodes).
PINNED: dict[int, "DrainAwareElasticPolicy"] = {}


def pinned_nodes() -> tuple[str, ...] | None:
    """The warm nodes the group this controller starts next is pinned to, or None (no pin / no policy)."""
    return next((nodes for policy in list(PINNED.values()) if (nodes := policy.pinned_nodes())), None)


class DrainAwareElasticPolicy(ElasticScalingPolicy):
    """Sizes restarts from the schedulable nodes' free resources, not the coordinator's reservations (they
    lag node changes by up to its tick). Ray Train decides the next size before it shuts the old group
    down, so the old group's own slots count as free here; anything else's never do."""

    _own_placement_group = None

    def __init__(self, scaling_config, workers_multiple: int = 1, sink: tuple[str, str] | None = None):
        super().__init__(scaling_config)
        self.workers_multiple = workers_multiple     # pipeline stages: a group of whole replicas only
        self.sink = sink            # (name, namespace) of the run's event sink: each sizing is reported

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        self._own_placement_group = worker_group_state.placement_group_handle.placement_group
        self._pinned_starts = 0         # a group runs: the next restart may be pinned again
        return super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)

    # the nodes the group being started is pinned to (warm_placement), shared with the run's claim callback
    # in this controller process (train.fillin_claims reads `pinned_nodes`)
    _pin: tuple[str, ...] | None = None
    _pinned_starts = 0

    def on_controller_start_worker_group(self, *, scaling_config, num_workers):
        """The group's label selector: on the warm nodes its size was counted on, at most once per restart
        (a pinned start that timed out -- a node gone meanwhile -- is retried unpinned)."""
        nodes = self.pinned_nodes()
        if nodes is None:
            return None
        self._pinned_starts += 1
        selector = node_label_selector(nodes)
        if selector is not None:
            log.info("the %d-worker group is placed on its warm node(s) %s", num_workers, ", ".join(nodes))
        return selector

    def pinned_nodes(self) -> tuple[str, ...] | None:
        return self._pin if self._pinned_starts == 0 else None

    def _count_possible_workers(self, reserved_resources) -> int:
        """The next group's size: the workers free capacity holds on nodes that can start them warm (a
        restart after a loss or notice goes on at once on the survivors' spares; other nodes join through a
        warm grow), or every worker that fits when the warm ones are below training's minimum
        (train.readiness.restart_size). Reported to the run's events with its reason."""
        sc = self.scaling_config
        free = free_resources(schedulable_nodes(RAYLET_PROBE_S), self._own_held(), fillin_reclaimable())
        by_node = workers_by_node(free, sc._resources_per_worker_not_none)
        if constants.WARM_SPARES <= 0:
            return round_to_replicas(count_workers(free, sc._resources_per_worker_not_none, sc.max_workers),
                                     self.workers_multiple)
        ready = ready_spares(warming=True)       # a survivor's spare still warming is woken by the restart
        size, reason = restart_size(by_node, ready, sc.min_workers, sc.max_workers, self.workers_multiple,
                                    done=ready_spares())
        self._pin = warm_placement(by_node, ready, size)
        PINNED[id(self)] = self
        self._report(size, reason, by_node, ready)
        return size

    _last_report: tuple | None = None

    def _report(self, size: int, reason: str, by_node: dict[str, int], ready: dict[str, int]) -> None:
        """The sizing with its reason, once per change (the controller asks again while it waits for nodes)."""
        if (size, reason) == self._last_report:
            return
        self._last_report = (size, reason)
        log.info("worker group size %d: %s", size, reason)
        if self.sink is None:
            return
        try:
            sink = ray.get_actor(self.sink[0], namespace=self.sink[1])
            sink.event.remote("group_sizing", workers=size, reason=reason,
                              nodes={n: {"fit": k, "ready": ready.get(n, 0)} for n, k in by_node.items() if k},
                              pinned=list(self.pinned_nodes() or ()))
        except Exception as exc:  # noqa: BLE001 -- a report, never a reason to fail the restart
            log.warning("group sizing not reported (%s)", exc)

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


def spotfill_trainer(stages: int = 1, sink: tuple[str, str] | None = None):
    """TorchTrainer whose elastic restarts size the group from free capacity of schedulable nodes that can
    start its workers warm (in whole replicas with pipeline stages), whose placement-group cleaner checks
    liveness through the GCS, and whose restarts are reported with a cause and a sizing reason."""
    return use_spotfill_controller(
        TorchTrainer, lambda sc: DrainAwareElasticPolicy(scaling_config=sc, workers_multiple=stages, sink=sink))


SpotfillTorchTrainer = spotfill_trainer()
"""spotfill_trainer() for one stage and no event sink (its sizing goes to the log only)."""
