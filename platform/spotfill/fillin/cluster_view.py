"""What the arbiter reads from Ray before it decides, without its lock: GPU nodes, what each tenant holds,
and (autoscaled clusters) what the autoscaler sees waiting.

What a tenant holds comes from its own call (Serve: the GCS's actor table; a job tenant: the State API's
placement groups and actors, a dashboard round trip). Reads run on a small pool and are waited for at most
READ_WAIT_S: a tenant whose read failed or did not answer in time is *unknown* this round -- its leases stay
as they were (policy.rebuild_leases), never read as "holds nothing" (that journaled a 0.3 s hand-back while
the GPU stayed in use). At most one read per tenant is out at a time; a slow one is reused by the next round.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from spotfill.fillin.policy import Holding, Node

log = logging.getLogger("spotfill.fillin.cluster_view")
READ_WAIT_S = 1.0          # a round waits this long for the tenants' holdings; later answers: next round
RAYLET_PROBE_S = 0.5       # a live raylet answers a loopback/local-network connect in milliseconds


@dataclass(frozen=True)
class Demand:
    """What the autoscaler reports waiting for resources: task/actor request shapes and pending placement
    groups (their ids and bundle shapes)."""
    shapes: frozenset = frozenset()          # frozenset(bundle.items()) of each task/actor request
    groups: frozenset = frozenset()          # ids of placement groups waiting

    def covers(self, shape: dict, groups=()) -> bool:
        """A unit of this shape waits as a task/actor request, or one of `groups` (the tenant's pending
        placement groups) waits."""
        return frozenset(shape.items()) in self.shapes or bool(self.groups & set(groups))


@dataclass(frozen=True)
class View:
    seq: int                                  # views are applied in the order their reads began
    nodes: tuple[Node, ...]
    holdings: tuple[Holding, ...]
    tenants: frozenset[str]                   # the tenants whose holdings were asked for
    unknown: frozenset[str] = frozenset()     # ... and could not be read this round
    errors: dict = field(default_factory=dict)
    demand: Demand | None = None


class HoldingsReads:
    def __init__(self, workers: int = 4):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="arbiter-holdings")
        self._lock = threading.Lock()
        self._out: dict[str, tuple[Future, bool]] = {}     # tenant -> (its latest read, used yet)

    def read(self, tenants: dict, wait_s: float = READ_WAIT_S) -> tuple[list[Holding], set[str], dict[str, str]]:
        """(holdings, unknown tenants, tenant -> why unknown) of `tenants` (name -> tenant). A read that
        answered after an earlier round stopped waiting for it is used now (it is newer than any used
        before: one read per tenant at a time); else a new one is made and waited for."""
        futures, late = {}, set()
        with self._lock:
            for name, tenant in tenants.items():
                f, used = self._out.get(name, (None, True))
                if f is not None and f.done() and not used:
                    late.add(name)
                elif f is None or f.done():
                    f = self._pool.submit(tenant.holdings)
                self._out[name] = (f, False)
                futures[name] = f
            for name in [k for k in self._out if k not in tenants]:
                del self._out[name]
        done, _ = wait([f for n, f in futures.items() if n not in late], timeout=wait_s)
        holdings, unknown, errors = [], set(), {}
        with self._lock:
            for name, f in futures.items():
                if name not in late and f not in done:
                    unknown.add(name)
                    errors[name] = f"no answer within {wait_s:g}s"
                    continue
                if self._out.get(name, (None,))[0] is f:
                    self._out[name] = (f, True)
                if f.exception() is not None:
                    unknown.add(name)
                    errors[name] = f"{type(f.exception()).__name__}: {f.exception()}"
                else:
                    holdings += list(f.result())
        return holdings, unknown, errors


def read_nodes(gpu_resource: str) -> list[Node]:
    """GPU nodes (and dead ones) with their free GPUs and CPUs, whether they answer and whether they drain."""
    import ray

    from spotfill.ray_compat import available_resources_per_node, draining_node_ids
    from spotfill.train.capacity import reachable
    avail, draining = available_resources_per_node(), draining_node_ids()
    listed = [n for n in ray.nodes() if gpu_resource in (n.get("Resources") or {}) or not n.get("Alive")]
    # the GCS keeps a killed node "alive" for its health-check window; its raylet refuses a connect at
    # once: such a node lends nothing and gives training nothing (as train/elastic.py sizes restarts)
    answering = reachable({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"])
                           for n in listed if n.get("Alive")}, RAYLET_PROBE_S)
    nodes = []
    for n in listed:
        node_id, res = n["NodeID"], n.get("Resources") or {}
        free = avail.get(node_id, {})
        nodes.append(Node(node_id, int(res.get(gpu_resource, 0)), int(free.get(gpu_resource, 0) + 1e-9),
                          bool(n.get("Alive")) and node_id in answering, node_id in draining,
                          free_cpus=float(free.get("CPU", 0.0))))
    return nodes


def read_demand() -> Demand | None:
    """The autoscaler's view of what waits (None: it did not answer; the patience rule still applies)."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status
    try:
        status = get_cluster_status(ray.get_runtime_context().gcs_address)
    except Exception as exc:  # noqa: BLE001
        log.warning("fill-in: cannot read the autoscaler's demand: %s", exc)
        return None
    d = status.resource_demands
    shapes = frozenset(frozenset(b.bundle.items()) for x in d.ray_task_actor_demand for b in x.bundles_by_count)
    groups = frozenset(x.pg_id for x in d.placement_group_demand if x.pg_id)
    return Demand(shapes, groups)
