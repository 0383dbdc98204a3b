"""Which nodes can take training workers warm, and when a grow waits for them (pure: no Ray import).

A worker process is warm when it was started before the worker group that uses it: a spare (train.spares,
train.warm) that imported torch, DeepSpeed and Ray Train while the run kept stepping. Each one that finished
its warm-up leaves a readiness record in the GCS key-value store (`record_key`, written by train.warm) until
it is taken by a worker group's actor (its record removed as the training function starts) or its keep-alive
runs out. This module reads those records and makes the two decisions that depend on them:

- `GrowPlanner.decide` (rank 0, every resize check): capacity that appears on a node -- new to the run, or
  one the group runs on -- is first WARMED (spares asked from that node's raylet), and the run grows onto
  it only once the node has a ready spare for every worker the grown group runs there -- or after `bound_s`
  with no readiness, when it grows cold and says so.
- `restart_size` (the controller, at a restart after a loss or notice): the group restarts at once on the
  workers it can start warm; nodes that are not ready join later through a grow. Only when the warm workers
  are fewer than training's minimum does it count cold capacity too (waiting is then cheaper than nothing).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

RECORD_PREFIX = "spotfill:spare-ready:"


def record_prefix(job_id: str, node_id: str | None = None) -> str:
    """The key prefix of one job's readiness records (of one node, with `node_id`)."""
    return f"{RECORD_PREFIX}{job_id}:" + (f"{node_id}:" if node_id else "")


def record_key(job_id: str, node_id: str, pid: int) -> str:
    return f"{record_prefix(job_id, node_id)}{int(pid)}"


def record_value(ready_t: float, until_t: float, idle: bool | None = None) -> str:
    """A record's value: when the spare became ready, until when its keep-alive holds it idle, and whether it
    warmed up in SCHED_IDLE (on CPU time nothing else on its node wanted)."""
    return json.dumps({"ready_t": round(ready_t, 3), "until_t": round(until_t, 3), "idle": idle})


def node_of(key: str) -> str | None:
    """The node id in a record key (None for a key of another shape)."""
    parts = key[len(RECORD_PREFIX):].split(":") if key.startswith(RECORD_PREFIX) else []
    return parts[1] if len(parts) == 3 else None


def ready_by_node(records: dict[str, str | bytes | None], now: float) -> dict[str, int]:
    """Ready spares per node from {key: value}: records whose keep-alive has not run out. A value that
    cannot be read counts as no spare (a warm grow is an optimisation; a wrong count must not make one)."""
    out: dict[str, int] = {}
    for key, raw in records.items():
        node = node_of(key)
        if node is None or raw is None:
            continue
        try:
            value = json.loads(raw)
            until = float(value["until_t"])
        except (ValueError, KeyError, TypeError):
            continue
        if until > now:
            out[node] = out.get(node, 0) + 1
    return out


@dataclass(frozen=True)
class GrowStep:
    """One resize check's outcome."""
    extra: int                              # workers to grow by now (0: keep stepping at this size)
    reason: str
    warm: dict = field(default_factory=dict)        # node -> spares to ask its raylet for now
    ready_wait_s: float | None = None       # a grow onto new nodes: how long it waited for them
    cold_nodes: tuple = ()                  # nodes it grows onto without ready spares (bound passed)
    warm_nodes: tuple = ()                  # nodes new to the run it grows onto warm


@dataclass
class GrowPlanner:
    """Rank 0's readiness state for one worker group: the nodes it asked to warm and since when.

    `decide(world, max_workers, fitting_by_node, group, ready, now)`:
      fitting_by_node  workers that free capacity holds per node, beyond this group's own workers there
      group            this group's workers per node (each asked its node for spares after its first step)
      ready            ready spares per node (ready_by_node)
    A grown group needs a process on a node for each worker it will run there: the group's own workers'
    (now) plus the new ones. A node counts once it has a ready spare for each of them, cold once `bound_s`
    passed since it was asked; it is asked once (`warm`) for the spares beyond those ready or already on
    their way (the group's own workers asked for `spares_per_worker` each).
    """
    bound_s: float = 60.0
    spares_per_worker: int = 1
    asked: dict = field(default_factory=dict)       # node -> when it was asked to warm

    def decide(self, world: int, max_workers: int, fitting_by_node: dict[str, int], group: dict[str, int],
               ready: dict[str, int], now: float, multiple: int = 1) -> GrowStep:
        for node in list(self.asked):       # a node that left (lost, draining, full) is asked again later
            if fitting_by_node.get(node, 0) <= 0:
                del self.asked[node]
        warm_ask: dict[str, int] = {}
        counted, waiting, cold, warm_new, waited = 0, [], [], [], []
        for node, n in sorted(fitting_by_node.items()):
            if n <= 0:
                continue
            own = group.get(node, 0)
            need, have = own + n, ready.get(node, 0)
            if node not in self.asked:
                self.asked[node] = now
                coming = max(have, own * self.spares_per_worker)
                if need > coming:
                    warm_ask[node] = need - coming
            if have >= need:
                counted += n
                waited.append(now - self.asked[node])
                if not own:
                    warm_new.append(node)
            elif now - self.asked[node] >= self.bound_s:
                counted += n
                cold.append(node)
                waited.append(now - self.asked[node])
            else:
                waiting.append(f"{node[:8]} ({have}/{need} ready)")
        fitting = min(max_workers, world + counted)
        fitting -= (fitting - world) % multiple if fitting > world else 0       # whole pipeline replicas
        extra = max(0, fitting - world)
        if extra:
            why = [f"free capacity for {world + extra} workers (now {world})"]
            if warm_new:
                why.append(f"warm spares ready on {len(warm_new)} new node(s)")
            if cold:
                why.append(f"{len(cold)} node(s) not ready after {self.bound_s:g}s: growing cold")
            if waiting:
                why.append(f"still warming: {', '.join(waiting)}")
            return GrowStep(extra, "; ".join(why), warm_ask, round(max(waited), 3) if waited else None,
                            tuple(cold), tuple(warm_new))
        if waiting:
            return GrowStep(0, f"waiting for warm spares: {', '.join(waiting)}", warm_ask)
        return GrowStep(0, f"no free capacity for more than {world} workers", warm_ask)


def restart_size(free_by_node: dict[str, int], ready: dict[str, int], min_workers: int, max_workers: int,
                 multiple: int = 1) -> tuple[int, str]:
    """How many workers a restart starts with, and why: the workers that free capacity holds on nodes with a
    ready spare for each (survivors of the last group have theirs), or -- when those are fewer than
    `min_workers` -- every worker free capacity holds (cold: below the minimum, waiting for readiness would
    stop training altogether)."""
    def whole(n: int) -> int:
        return n - n % multiple if multiple > 1 else n

    every = whole(min(max_workers, sum(free_by_node.values())))
    warm = whole(min(max_workers, sum(min(n, ready.get(node, 0)) for node, n in free_by_node.items())))
    if warm >= min_workers and warm < every:
        return warm, (f"{warm} workers start warm now; {every - warm} more fit on nodes whose spares are not "
                      "ready (a grow adds them once they are)")
    if warm >= min_workers:
        return warm, f"{warm} workers, all on warm spares"
    if warm < every:
        return every, (f"{every} workers, cold where no spare is ready: warm spares for only {warm} "
                       f"(below training's minimum {min_workers})")
    return every, f"{every} workers"
