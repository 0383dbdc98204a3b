"""How many workers the cluster holds, and when a grow is worth trying (pure: no Ray import).

The elastic policy (restart sizing) and rank 0's grow check both count FREE capacity: per node, what is
available now, plus -- at restart time -- what this run's own worker group still holds there (Ray Train
sizes the next group before it shuts the old one down). Totals are never counted: anything else holding a
slot (another job, fill-in) would make training believe more workers fit than do.
"""
from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeCapacity:
    """One schedulable node's resources: `total` as registered, `available` right now (unreserved)."""
    total: dict[str, float]
    available: dict[str, float]


def free_resources(nodes: dict[str, NodeCapacity],
                   own_held: dict[str, dict[str, float]] | None = None,
                   reclaimable: dict[str, dict[str, float]] | None = None) -> dict[str, dict[str, float]]:
    """Per node, the resources a new worker group of this run could get: available, plus what the run's
    own (about to be released) group holds on that node, plus what fill-in borrowed there (`reclaimable`:
    the arbiter takes it back when training claims it, before the group starts) -- never more than the
    node's total. Only nodes in `nodes` count: a lease on a lost or draining node gives nothing back.

    The one place that decides what counts as free."""
    out: dict[str, dict[str, float]] = {}
    for node_id, cap in nodes.items():
        held = (own_held or {}).get(node_id, {})
        lent = (reclaimable or {}).get(node_id, {})
        names = set(cap.available) | set(held) | set(lent)
        out[node_id] = {r: min(cap.available.get(r, 0.0) + held.get(r, 0.0) + lent.get(r, 0.0),
                               cap.total.get(r, float("inf")))
                        for r in names}
    return out


def count_workers(node_resources: dict[str, dict], per_worker: dict[str, float], max_workers: int) -> int:
    """Workers that fit on these nodes (each worker on one node), capped at max_workers (pure)."""
    return min(sum(workers_by_node(node_resources, per_worker).values()), max_workers)


def workers_by_node(node_resources: dict[str, dict], per_worker: dict[str, float]) -> dict[str, int]:
    """Per node, how many workers its resources hold (each worker on one node; uncapped)."""
    need = {r: v for r, v in per_worker.items() if v > 0}
    return {node: int(min(res.get(r, 0.0) // v for r, v in need.items())) for node, res in node_resources.items()}


def capacity_state(node_resources: dict[str, dict], per_worker: dict[str, float]) -> tuple:
    """What a grow decision depends on, comparable across checks: per node, how many workers' worth of
    each needed resource is free (sorted, so dict order does not matter)."""
    need = sorted(r for r, v in per_worker.items() if v > 0)
    return tuple(sorted((node, tuple(int(res.get(r, 0.0) // per_worker[r]) for r in need))
                        for node, res in node_resources.items()))


@dataclass(frozen=True)
class GrowDecision:
    extra: int              # workers to add (0: keep going at this size)
    reason: str             # why, for the event log
    state: tuple = ()       # the capacity state this decision saw


@dataclass
class GrowGate:
    """At most one grow attempt per capacity state. A grow that could not get its slots (the restart fell
    back to the previous size) must not be retried until the capacity changes: that was the livelock."""
    tried: set = field(default_factory=set)

    def decide(self, world: int, fitting: int, state: tuple) -> GrowDecision:
        """`fitting`: workers the free capacity plus this group's own slots hold (capped at max)."""
        if fitting <= world:
            return GrowDecision(0, f"no free capacity for more than {world} workers", state)
        if state in self.tried:
            return GrowDecision(0, "a grow was already tried with this free capacity", state)
        self.tried.add(state)
        return GrowDecision(fitting - world, f"free capacity for {fitting} workers (now {world})", state)


def reachable(addresses: dict[str, tuple[str, int]], timeout_s: float, connect=None) -> set[str]:
    """The keys whose (host, port) accepts a TCP connection within timeout_s, probed in parallel. A killed
    raylet refuses at once; a vanished machine does not answer and times out."""
    def default_connect(addr: tuple[str, int]) -> bool:
        try:
            socket.create_connection(addr, timeout=timeout_s).close()
            return True
        except OSError:
            return False

    probe = connect or default_connect
    if not addresses:
        return set()
    with ThreadPoolExecutor(min(32, len(addresses))) as pool:
        results = dict(zip(addresses, pool.map(probe, addresses.values())))
    return {key for key, ok in results.items() if ok}
