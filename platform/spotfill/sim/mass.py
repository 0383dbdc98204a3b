"""The preempt_nodes action at run time (sim/mass_spec.py has its keys): which nodes it takes when it
fires, taking them all in one pass of the timeline, and its report.json entries.

No notice: every chosen node's processes are killed first (training's workers there die within
milliseconds of each other), then each node is removed -- a spot market taking instances together. With
notice: each node gets a Ray drain with the deadline, as drain_node does, and the runner removes it when its
deadline passes. Either way the runner adds no capacity: on an autoscaled cluster close the markets first
(`market` events) for "the cloud has no capacity"."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from spotfill.sim.mass_spec import MASS_ACTION
from spotfill.sim.outcomes import mass_outcome, node_event_outcome
from spotfill.sim.scenario import Event

NOTICE_MESSAGE = "spotfill demo: spot notice (mass preemption)"


@dataclass
class Choice:
    chosen: list[int]                                   # node indices the action takes, ascending
    not_alive: list[int] = field(default_factory=list)  # listed ones already gone (not fired)
    left: list[int] = field(default_factory=list)       # alive nodes it leaves
    skip: str | None = None                             # why it does not fire at all


def choose_nodes(ev: Event, group: dict, node_ids: list, alive) -> Choice:
    """The nodes `ev` takes now: its listed `nodes` that are alive, or the `count` alive nodes where
    training's current group (`group`: node id -> workers) has the most workers, ties to the lower index.
    Skipped (`skip` says why) when none is alive, fewer than `count` are, or -- without `allow_all` -- it
    would leave no GPU node alive."""
    alive_now = [i for i in range(len(node_ids)) if alive(i)]
    if ev.nodes is not None:
        chosen = [n for n in ev.nodes if n in alive_now]
        not_alive = [n for n in ev.nodes if n not in alive_now]
        if not chosen:
            return Choice([], not_alive, alive_now, f"none of nodes {list(ev.nodes)} is alive")
    else:
        if ev.count > len(alive_now):
            return Choice([], [], alive_now, f"{ev.count} nodes asked, {len(alive_now)} alive")
        ranked = sorted(alive_now, key=lambda i: (-group.get(node_ids[i], 0), i))
        chosen, not_alive = ranked[:ev.count], []
    chosen = sorted(chosen)
    left = [i for i in alive_now if i not in chosen]
    if not left and not ev.allow_all:
        return Choice([], not_alive, left, f"would leave no GPU node alive ({len(alive_now)} alive, allow_all false)")
    return Choice(chosen, not_alive, left)


def fire(ev: Event, chosen: list[int], cluster, removals: list, gone: dict, clock=time.time) -> dict[int, float]:
    """Preempt `chosen` in this one call; returns each node's fire time. With notice: a drain with
    `ev.deadline_s` each, its removal appended to the runner's `removals` ((when, index, graceful)). Without:
    every node's processes killed first, then each node removed (`gone[index]`: when it was)."""
    at: dict[int, float] = {}
    if ev.notice:
        for i in chosen:
            at[i] = clock()
            cluster.drain_node(i, ev.deadline_s, NOTICE_MESSAGE)
            removals.append((at[i] + ev.deadline_s, i, False))
        return at
    for i in chosen:
        at[i] = clock()
        cluster.kill_workers(i)
    for i in chosen:
        cluster.remove_node(i, graceful=False)
        gone[i] = clock()
    return at


def gpus_of(cluster, indices: list[int]) -> int | None:
    """GPU slots of these nodes, from the cluster's records (None when one is not on record: a node the
    autoscaler launched)."""
    by_id = {r["id"]: r.get("gpus") for r in getattr(cluster, "records", [])}
    slots = [by_id.get(cluster.node_ids[i]) for i in indices]
    return None if any(s is None for s in slots) else sum(slots)


def mass_report(ev: Event, choice: Choice, at: dict[int, float], gone: dict, events: list[dict], node_ids: list,
                world_before: int | None, gpus_left: int | None, min_workers: int) -> tuple[list[dict], dict]:
    """report.json entries of a fired preempt_nodes event: one `preemptions[]` entry per node (kind announced
    or hard, node, node_id, at, gone_at: when the runner removed it -- null for a notice whose deadline came
    after training ended -- and node_event_outcome's keys), and the event's `events[]` entry (the nodes,
    the spread of their fire times, and mass_outcome's keys, which the invariants read)."""
    deadline = ev.deadline_s if ev.notice else None
    preemptions = []
    for i in sorted(at, key=lambda n: (at[n], n)):
        preemptions.append({"kind": "announced" if ev.notice else "hard", "action": MASS_ACTION, "node": i,
                            "picked": None if ev.nodes is not None else "most_training",
                            "node_id": node_ids[i], "at": round(at[i], 3),
                            "gone_at": round(gone[i], 3) if i in gone else None, "event_index": ev.index,
                            "world_size_before": world_before, **node_event_outcome(events, at[i], deadline)})
    first, last = min(at.values()), max(at.values())
    ended = [gone[i] for i in at if i in gone]
    entry = {"nodes": sorted(at), "node_ids": [node_ids[i] for i in sorted(at)], "notice": ev.notice,
             "deadline_s": deadline, "count": ev.count, "not_alive": choice.not_alive, "nodes_left": choice.left,
             "fire_spread_s": round(last - first, 3),
             "gone_spread_s": round(max(ended) - min(ended), 3) if len(ended) == len(at) else None,
             "gpus_left": gpus_left, "min_workers": min_workers, "world_size_before": world_before,
             **mass_outcome(events, first, last)}
    if preemptions:
        entry["world_size_after"] = preemptions[0].get("world_size_after")
    return preemptions, entry


def add_node_ends(report: dict) -> None:
    """Each preemption's node end from report.json's `cluster.nodes` (when the node ended, Ray's death
    reason): `end: {ended, death_reason}`, null where the node is not listed."""
    nodes = {n["id"]: n for n in (report.get("cluster") or {}).get("nodes") or []}
    for p in report.get("preemptions") or []:
        n = nodes.get(p.get("node_id"))
        p["end"] = {"ended": n.get("ended"), "death_reason": n.get("death_reason")} if n else None
