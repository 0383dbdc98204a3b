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

A spare records itself as it starts (warming) and again once its imports are done (ready). A node the group
steps on warms its spares held back (nice 19, or SCHED_IDLE), on CPU time the steps leave, which on a busy
machine may be almost none -- for at most SPOTFILL_SPARE_HOLD_MAX_S, then at the workers' priority. A grow
(planned) counts a node once its spares are ready, the group's own nodes too; a restart after a loss counts a
spare still warming as well -- the restart wakes it (below) and its imports finish at normal priority, far
ahead of a process started cold. A node new to the run warms at normal priority (no steps there to give way
to).

Waking: a spare warming in SCHED_IDLE runs Ray's worker setup hook on its main thread, so Ray cannot hand it
an actor before the warm-up ends, and stopping the steps does not end it quickly where fill-in tenants (SCHED_IDLE
too) and other processes' starts keep the CPU busy -- measured in a demo: a grown group's actors waited 50-77 s
on spares still importing DeepSpeed in SCHED_IDLE. A watcher in the spare's own process cannot help: it needs
the GIL, which the starved import thread holds (a C extension's load keeps it for seconds of CPU). So each such
spare starts a small watcher process (train.spares.start_wake_watcher) that puts every thread of the spare back
to normal scheduling the moment one of its node's training workers of the run is gone (the group stops for a
restart, a resize or the end).
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


def record_value(ready_t: float | None, until_t: float, idle: bool | None = None,
                 since_t: float | None = None) -> str:
    """A record's value: when the spare became ready (None: still warming up), until when its keep-alive
    holds it idle, whether it warms up in SCHED_IDLE (on CPU time nothing else on its node wanted), and
    since when its process runs its warm-up (`since_t`: it started and registered with its raylet then)."""
    return json.dumps({"ready_t": None if ready_t is None else round(ready_t, 3), "until_t": round(until_t, 3),
                       "idle": idle, "since_t": None if since_t is None else round(since_t, 3)})


def starting_nodes(records: dict[str, str | bytes | None], now: float, within_s: float) -> set[str]:
    """Nodes where a spare of these records began its warm-up less than `within_s` ago: spares asked with it
    may still be starting there (a raylet starts at most as many processes at once as its node has CPUs and
    drops the rest, so other processes asked there now could push them out). A spare that began longer ago
    has started; its warm-up no longer competes for a start."""
    def began_within(value: dict) -> bool:
        try:
            return now - float(value["since_t"]) < within_s
        except (KeyError, TypeError, ValueError):        # no start time (an older record): started long ago
            return False
    return {node for node, value in _live(records, now) if value.get("ready_t") is None and began_within(value)}


def _live(records: dict[str, str | bytes | None], now: float):
    """(node, value) of each readable record whose keep-alive has not run out (an unreadable one: none)."""
    for key, raw in records.items():
        node = node_of(key)
        if node is None or raw is None:
            continue
        try:
            value = json.loads(raw)
            if float(value["until_t"]) > now:
                yield node, value
        except (ValueError, KeyError, TypeError, AttributeError):
            continue


def node_of(key: str) -> str | None:
    """The node id in a record key (None for a key of another shape)."""
    parts = key[len(RECORD_PREFIX):].split(":") if key.startswith(RECORD_PREFIX) else []
    return parts[1] if len(parts) == 3 else None


def ready_by_node(records: dict[str, str | bytes | None], now: float, warming: bool = False) -> dict[str, int]:
    """Spares per node from {key: value}, records whose keep-alive has not run out: ready ones, and with
    `warming` those still warming up too. A value that cannot be read counts as no spare (a warm grow is an
    optimisation; a wrong count must not make one)."""
    out: dict[str, int] = {}
    for node, value in _live(records, now):
        if warming or value.get("ready_t") is not None:
            out[node] = out.get(node, 0) + 1
    return out


@dataclass(frozen=True)
class GrowStep:
    """One resize check's outcome."""
    extra: int                              # workers to grow by now (0: keep stepping at this size)
    reason: str
    warm: dict = field(default_factory=dict)        # node -> spares to ask its raylet for now
    reserve: dict = field(default_factory=dict)     # node -> reserve spares to ask for now (held back)
    ready_wait_s: float | None = None       # a grow onto new nodes: how long it waited for them
    cold_nodes: tuple = ()                  # nodes it grows onto without ready spares (bound passed)
    warm_nodes: tuple = ()                  # nodes new to the run it grows onto warm
    waiting_nodes: tuple = ()               # nodes new to the run it waits to grow onto (their spares warm
                                            # up, or are ready while other nodes' still warm)


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

    `reserve`: while a grow is in prospect (free capacity somewhere), each of the group's own nodes is also
    asked, once its spares for the grow have started, for `reserve` more sets of the processes the grown
    group runs there -- not waited for (`GrowStep.reserve`: held back until a restart wakes them): a
    grow takes every spare it uses, and the grown group's own spares (asked after its first step) take
    10-20 s to warm; a loss or a notice in that window restarted cold (a demo here: a notice 5 s after a grow
    restarted on spares started 1.5 s before it, 8.7 s of their imports with every worker stopped). The
    reserve warms during the grow's wait (24-90 s in the demo), so the grown group's first restart finds it
    ready; the grown group's own ask counts it (train.spare_workers.prestart_spares).
    """
    bound_s: float = 60.0
    spares_per_worker: int = 1
    reask_s: float = 10.0                           # a node still short of spares that never started
    reserve: int = 0                                # sets of spares the group's own nodes warm beyond the grow's
    asked: dict = field(default_factory=dict)       # node -> when it was first asked to warm
    last_ask: dict = field(default_factory=dict)    # node -> when it was last asked
    reserved: dict = field(default_factory=dict)    # own node -> when its reserve was asked (once)

    def decide(self, world: int, max_workers: int, fitting_by_node: dict[str, int], group: dict[str, int],
               ready: dict[str, int], now: float, multiple: int = 1,
               present: dict[str, int] | None = None) -> GrowStep:
        """`present`: spares per node warming or ready (default `ready`): those already on their way (not
        asked again). A node counts, the group's own nodes too, once its spares are ready: a grow is planned,
        and the restart it makes would otherwise wait for the imports with every worker stopped (a demo
        here: a grown group's actors waited 6-10 s on its own node's spares still importing)."""
        present = ready if present is None else present
        for node in list(self.asked):       # a node that left (lost, draining, full) is asked again later
            if fitting_by_node.get(node, 0) <= 0 and node not in group:
                del self.asked[node]
                self.last_ask.pop(node, None)
        warm_ask: dict[str, int] = {}
        reserve_ask: dict[str, int] = {}
        counted, cold, warm_new, waited, waiting, own_waiting = 0, [], [], [], [], False
        new_waiting: list[str] = []
        room = max(0, max_workers - world)             # workers the grow can add at most
        # the group's own nodes first, then the nodes with the most spares ready: the room goes to them
        order = sorted(set(fitting_by_node) | set(group),
                       key=lambda nd: (-group.get(nd, 0), -ready.get(nd, 0), nd))
        most = world + room                              # the grown group's size at most
        prospect = room > 0 and any(v > 0 for v in fitting_by_node.values())    # a grow may come
        for node in order:
            fits = max(0, fitting_by_node.get(node, 0))
            n, own = min(room, fits), group.get(node, 0)
            room -= n
            if not fits and not own:
                continue
            # Ray places the grown group (its placement group packs the bundles where it likes): a node may
            # get as many workers as fit there, up to the group's size -- each needs a process there first
            need, have = min(own + fits, most), ready.get(node, 0)
            started = present.get(node, 0)          # spares that exist there, warming or ready
            if node not in self.asked:
                self.asked[node] = self.last_ask[node] = now
                coming = max(started, own * self.spares_per_worker)
                if n and need > coming:
                    warm_ask[node] = need - coming
            elif have < need and need > started and now - self.last_ask.get(node, now) >= self.reask_s:
                # a raylet drops what it cannot start at once (more asked than it has CPUs): ask again
                # for the spares that never started
                self.last_ask[node] = now
                warm_ask[node] = need - started
            if own and self.reserve and prospect and node not in self.reserved and started >= need:
                # the reserve, once per group: asked when the spares the grow needs there have started (a
                # raylet starts at most its CPUs' worth at once and drops the rest: asked beside the group's
                # own ask it was dropped), never again (a spare not yet started is no record: asking again
                # for it started more and more processes on a loaded node)
                self.reserved[node] = now
                more = need * (1 + self.reserve) - started - warm_ask.get(node, 0)
                if more > 0:
                    reserve_ask[node] = more
            if have >= need:
                counted += n
                waited.append(now - self.asked[node])
                warm_new += [node] if n and not own else []
            elif now - self.asked[node] >= self.bound_s:
                counted += n
                cold.append(node)
                waited.append(now - self.asked[node])
            else:
                waiting.append(f"{short(node)} ({have}/{need} {'spares' if own else 'ready'})")
                own_waiting = own_waiting or own > 0
                new_waiting += [node] if n and not own else []
        if own_waiting:
            counted = 0             # the group's own nodes not warm yet: a grow now would restart them cold
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
            return GrowStep(extra, "; ".join(why), warm_ask, reserve_ask, round(max(waited), 3) if waited else None,
                            tuple(cold), tuple(warm_new), tuple(new_waiting))
        if waiting and any(fitting_by_node.get(n, 0) > 0 for n in fitting_by_node):
            # every new node the grow waits to go onto, its spares ready or not: a new node already ready
            # while the group's own nodes still warm is waited for too (fill-in lends there meanwhile, and
            # its leases must not go to the idle rule -- a demo's Serve replica on such a node was reclaimed
            # "no training on the node for 10s" 3 s before the grow onto it)
            return GrowStep(0, f"waiting for warm spares: {', '.join(waiting)}", warm_ask, reserve_ask,
                            waiting_nodes=tuple(sorted(set(new_waiting) | set(warm_new))))
        return GrowStep(0, f"no free capacity for more than {world} workers", warm_ask, reserve_ask)



def short(node_id: str) -> str:
    """A node id as the reasons print it: its last 8 hex digits (Ray's fake multi-node nodes -- the
    autoscaled demo -- share all but their last few)."""
    return node_id[-8:]


def warm_placement(free_by_node: dict[str, int], ready: dict[str, int], size: int) -> tuple[str, ...] | None:
    """The nodes a restart of `size` workers is pinned to: those with this run's spares (warming or ready)
    when their free capacity (GPUs taken back from fill-in there included) holds the whole group. Without
    the pin Ray's placement may put the group on another node, cold -- seen in two demos: a hard loss
    restarted on the replacement the autoscaler launched seconds after the sizing while the survivor's
    spares sat warm (its GPUs still lent, and the unpinned claim answered from the new node's free ones).
    None: no pin (nothing warm holds the group: it starts where it fits)."""
    warm = sorted(node for node, n in free_by_node.items() if n and ready.get(node, 0) > 0)
    if size <= 0 or not warm or sum(free_by_node[node] for node in warm) < size:
        return None
    return tuple(warm)


def restart_size(free_by_node: dict[str, int], ready: dict[str, int], min_workers: int, max_workers: int,
                 multiple: int = 1, done: dict[str, int] | None = None) -> tuple[int, str]:
    """How many workers a restart starts with, and why: on the nodes that are left -- nodes with spares
    (warming or ready) of this run, where the last group ran -- a worker for each spare that free capacity
    holds (GPUs taken back from fill-in there count too: a node whose first rank asked spares for all its
    slots comes back at full size), and none on nodes without a spare (a replacement, a node new to the run)
    nor beyond a node's spares: a warm grow adds them once their spares are ready. One process started cold
    holds the whole group's start (a demo here: a survivor with 2 spares restarted 3 workers, 38 s from the
    loss to the group's start, against ~10 s warm). But a group that would start at less than half of what
    those nodes hold takes them all, cold ones too: it would step slowly for as long as the spares of the grow
    take (a demo here restarted at 1 of 3 and stepped at 1 worker for minutes). When the warm workers are
    fewer than `min_workers`, every worker free capacity holds (cold: waiting would stop training
    altogether).

    `done` (spares per node whose imports are done; `ready` counts those still warming too): when the done
    ones alone hold at least half of it (and training's minimum), the group restarts on them and a warm grow
    adds the rest once their imports are done. A spare still warming holds every worker's start until its
    imports finish: a demo's notice, 6 s after a grow, restarted 3 workers on 2 ready spares and one started
    3 s before -- 19.4 s of `workers_start_s`, against ~3-5 s on ready spares, a grow's restart included."""
    def whole(n: int) -> int:
        return n - n % multiple if multiple > 1 else n

    every = whole(min(max_workers, sum(free_by_node.values())))
    on_warm = whole(min(max_workers, sum(n for node, n in free_by_node.items() if ready.get(node, 0) > 0)))
    left = whole(min(max_workers, sum(min(n, ready.get(node, 0)) for node, n in free_by_node.items())))
    if done is not None:
        now_ready = whole(min(max_workers, sum(min(n, done.get(node, 0)) for node, n in free_by_node.items())))
        if now_ready < left and now_ready >= min_workers and 2 * now_ready >= on_warm:
            return now_ready, (f"{now_ready} workers on the spares ready now; {left - now_ready} more on spares "
                               f"still importing (a warm grow adds them once they are ready)"
                               + (f", {every - left} on node(s) short of spares" if every > left else ""))
    cold = [node for node, n in free_by_node.items() if n > ready.get(node, 0)]
    if 2 * left < on_warm and on_warm >= min_workers:      # far below their size: cold where spares miss
        return on_warm, (f"{on_warm} workers on the nodes that are left, {on_warm - left} of them cold: "
                         f"their {left} spare(s) hold less than half"
                         + (f"; {every - on_warm} more fit on node(s) with no spare yet (a warm grow adds "
                            f"them once they are ready)" if on_warm < every else ""))
    if left >= min_workers and left < every:
        return left, (f"{left} workers on the nodes that are left now; {every - left} more fit on "
                      f"{len(cold)} node(s) short of spares (a warm grow adds them once they are ready)")
    if left >= min_workers:
        return left, f"{left} workers on the nodes that are left (their spares warm)"
    if left < every:
        return every, (f"{every} workers, cold where no spare is ready: warm nodes hold only {left} "
                       f"(below training's minimum {min_workers})")
    return every, f"{every} workers"
