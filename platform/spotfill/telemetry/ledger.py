"""The cluster's GPU-seconds ledger from events.jsonl (pure).

Every GPU-second of every alive node inside the run's window lands in exactly one state, each booked from
its own evidence:
  training          a worker group steps (first step to last; the part after the final lineage's last step
                    is `training_rolled_back`; pipeline bubbles inside it are `bubble`)
  checkpoint_stall  the group waits on a checkpoint save (checkpoint_save.stall_s), and the final save
                    between the last step and `finish`
  recovering        training holds GPUs without stepping -- a group starting, a dying or exiting group
                    until its teardown (claims.py) -- or waits for the next group's GPUs between groups
  fillin            GPUs a tenant held (`lease` .. `reclaim`/`release`/`lease_end`): `fillin_reserved`
  idle              GPUs observed free (`gpu_free`, the arbiter's view of Ray's available GPUs) that no state
                    above took
  unaccounted       the rest: alive GPUs no event accounts for (never silently idle)
The time axis is cut at every change; in each slice training's claim is served first, fill-in next, then
observed-free GPUs, and what is left is unaccounted: the parts add up to GPUs x wall time on alive nodes.
Alongside: `fillin_busy` (what tenants measured computing, `fillin_busy` events; null when none did) and
`bubble` (null when no step measured bubbles).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from spotfill.telemetry.claims import (Claim, gpus_per_worker, lineage_keys, observed_job_gpus,  # noqa: F401
                                       stall_claims, training_claims)
from spotfill.telemetry.evidence import (LEASE_END_KINDS, FreeObservations, NodeSpan, bubble_gpu_seconds,  # noqa: F401
                                         busy_gpu_seconds, configured_job_gpus, leases, nodes_from_events,
                                         nodes_from_report, run_window, workload_of)

STATES = ("training", "checkpoint_stall", "recovering", "fillin", "idle", "unaccounted")
HELD = ("training", "checkpoint_stall", "recovering")


@dataclass(frozen=True)
class Slice:
    """One stretch of time with constant GPU use: GPUs per state and fill-in GPUs per workload."""
    start: float
    end: float
    gpus: dict
    fillin: dict


@dataclass(frozen=True)
class Ledger:
    start: float
    end: float
    gpu_seconds: dict             # STATES + total, fillin_reserved, fillin_busy, bubble, by workload / cause
    per_node: dict                # node -> {gpus, total, fillin, free_observed, [states when placed]}
    goodput: float | None         # productive training GPU-s / (the job's GPUs x wall time)
    time_goodput: float | None    # productive training wall time / wall time
    effective_training_time_ratio: float | None   # productive training GPU-s / GPU-s training held
    harvest_ratio: float | None   # fill-in busy GPU-s / GPU-s training did not hold (None: busy not measured)
    harvest_ratio_reserved: float | None   # the same with reserved GPU-s (None without leases)
    productive_gpu_seconds: float
    job_gpus: int | None = None
    job_gpus_source: str | None = None    # assigned | configured | largest_group
    slices: tuple = ()
    nodes_source: str = "given"
    notes: tuple = ()

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def as_report(self) -> dict:
        """report.json's gpu_seconds / goodput / harvest_ratio keys (harvest ratios only when measured)."""
        out = {"gpu_seconds": {k: _r(v) if isinstance(v, (float, dict)) else v for k, v in self.gpu_seconds.items()},
               "gpu_seconds_per_node": self.per_node,
               "goodput": _r(self.goodput, 4), "time_goodput": _r(self.time_goodput, 4),
               "effective_training_time_ratio": _r(self.effective_training_time_ratio, 4),
               "ledger": {"start": _r(self.start), "end": _r(self.end), "wall_s": _r(self.wall_s),
                          "job_gpus": self.job_gpus, "job_gpus_source": self.job_gpus_source,
                          "nodes_source": self.nodes_source, "notes": list(self.notes)}}
        if self.harvest_ratio is not None:
            out["harvest_ratio"] = _r(self.harvest_ratio, 4)
        if self.harvest_ratio_reserved is not None:
            out["harvest_ratio_reserved"] = _r(self.harvest_ratio_reserved, 4)
        return out


def _r(x, nd: int = 3):
    if isinstance(x, dict):
        return {k: _r(v, nd) for k, v in x.items()}
    return None if x is None else round(x, nd)


def compute_ledger(events: list[dict], nodes: list[NodeSpan] | None = None,
                   window: tuple[float, float] | None = None) -> Ledger:
    """GPU-seconds by state over `window` (default run_window). Nodes: given, else node_up/node_down
    events, else one stand-in node as large as the largest worker group (noted)."""
    events = sorted((e for e in events if "t" in e), key=lambda e: e["t"])
    start, end = window or run_window(events)
    notes: list[str] = []
    source = "given"
    if not nodes:
        nodes, source = nodes_from_events(events), "events"
    claims = training_claims(events, start, end)
    if not nodes:
        biggest = max((c.gpus for c in claims), default=0)
        nodes, source = [NodeSpan("training-gpus", biggest, start, end)], "inferred"
        notes.append(f"no node timeline: capacity taken as the largest worker group ({biggest} GPUs); "
                     "GPUs outside training's reach are not counted")
    stalls = stall_claims(events)
    lease_list = leases(events, end)
    free = FreeObservations(events)
    cuts = {start, end}
    for c in claims + stalls:
        cuts.update((c.start, c.end))
    for n in nodes:
        cuts.update((n.start, n.end if n.end is not None else end))
    for le in lease_list:
        cuts.update((le.start, le.end))
    cuts.update(free.times())
    cuts = sorted(t for t in cuts if start <= t <= end)
    acc = _Acc(nodes, free)
    claim_ix, stall_ix, lease_ix = _Index(claims), _Index(stalls), _Index(lease_list)
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            acc.add_slice(a, b, claim_ix, stall_ix, lease_ix)
    if not free:
        notes.append("no gpu_free observations (they come from the fill-in arbiter): GPUs training and "
                     "fill-in did not hold are unaccounted, not idle")
    busy, busy_notes = busy_gpu_seconds(events, start, end)
    wanted, wanted_source = _job_gpus(events, claims, notes)
    return acc.result(start, end, source, notes + busy_notes, has_leases=bool(lease_list),
                      busy=busy if any(e["kind"] == "fillin_busy" for e in events) else None,
                      bubble=bubble_gpu_seconds(events), job_gpus=wanted, job_gpus_source=wanted_source)


def _job_gpus(events: list[dict], claims: list[Claim], notes: list[str]) -> tuple[int | None, str | None]:
    """Goodput's GPUs: the most Ray assigned any worker group (`attempt` events' `gpus`); a log from before
    attempts recorded them falls back on the configured training.workers x gpus_per_worker, then on the
    largest group (each noted)."""
    wanted = observed_job_gpus(events)
    if wanted is not None:
        return wanted, "assigned"
    wanted = configured_job_gpus(events, gpus_per_worker(events))
    if wanted is not None:
        notes.append(f"attempt events do not record the GPUs Ray assigned: goodput is over the configured "
                     f"training.workers x gpus_per_worker ({wanted} GPUs)")
        return wanted, "configured"
    wanted = max((c.gpus for c in claims), default=0) or None
    notes.append(f"the events record neither the GPUs Ray assigned nor training.workers: goodput is over the "
                 f"largest group ({wanted} GPUs)")
    return wanted, "largest_group"



class _Index:
    """Intervals sorted by start, with the running max of their ends: `covering(m)` scans back only
    while an earlier interval can still reach m (O(1) for the non-overlapping claims and stalls)."""

    def __init__(self, items):
        self.items = sorted(items, key=lambda x: x.start)
        self.starts = [x.start for x in self.items]
        self.reach, top = [], float("-inf")
        for x in self.items:
            top = max(top, x.end)
            self.reach.append(top)

    def covering(self, m: float) -> list:
        out, j = [], bisect.bisect_right(self.starts, m) - 1
        while j >= 0 and self.reach[j] > m:
            if self.items[j].end > m:
                out.append(self.items[j])
            j -= 1
        return out[::-1]


class _Acc:
    """Accumulates slices: cluster totals, per-node rows, productive time."""

    def __init__(self, nodes: list[NodeSpan], free: FreeObservations):
        self.nodes, self.free = nodes, free
        self.totals = {s: 0.0 for s in STATES if s != "fillin"}
        self.fillin: dict[str, float] = {}
        self.causes: dict[str, float] = {}
        self.per_node = {n.node: {"gpus": n.gpus, "total": 0.0, "fillin": {}, "free_observed": 0.0,
                                  **{s: 0.0 for s in STATES if s != "fillin"}} for n in nodes}
        self.placed = True
        self.productive_wall = self.productive_gpu = 0.0
        self.slices: list[Slice] = []
        self.overcommit_s = 0.0

    def add_slice(self, a: float, b: float, claims: _Index, stalls: _Index, lease_list: _Index) -> None:
        m, dt = (a + b) / 2, b - a
        alive = {n.node: n.gpus for n in self.nodes if n.start <= m < (n.end if n.end is not None else float("inf"))}
        cap = sum(alive.values())
        stall = stalls.covering(m)
        claim = stall[0] if stall else next(iter(claims.covering(m)), None)
        used = {n: 0 for n in alive}
        state_gpus = {s: 0 for s in STATES}
        unheld: dict[str | None, int] = {}
        observed = {n: self.free.at(n, m) for n in alive}
        if claim is not None:
            g = self._claim(claim, alive, used, dt, state_gpus, unheld, observed)
            if claim.state == "training" and claim.cause == "productive":
                self.productive_wall += dt
                self.productive_gpu += g * dt
        fill = self._leases(lease_list.covering(m), alive, used, dt,
                            cap - sum(state_gpus[s] for s in HELD))
        state_gpus["fillin"] = sum(fill.values())
        rest = cap - sum(state_gpus[s] for s in HELD) - state_gpus["fillin"]
        for n, f in observed.items():
            if f is not None:
                self.per_node[n]["free_observed"] += min(f, alive[n]) * dt
        if claim is None or claim.placement:
            node_idle = {n: min(max(0, (observed[n] or 0) - unheld.get(n, 0)), alive[n] - used[n]) for n in alive}
            idle = min(rest, sum(node_idle.values()))
        else:
            node_idle = {}
            seen = sum(min(f, alive[n]) for n, f in observed.items() if f is not None)
            idle = max(0, min(rest, seen - unheld.get(None, 0)))
        state_gpus["idle"], state_gpus["unaccounted"] = idle, rest - idle
        for s in ("training", "recovering", "checkpoint_stall", "idle", "unaccounted"):
            self.totals[s] += state_gpus[s] * dt
        for w, g in fill.items():
            self.fillin[w] = self.fillin.get(w, 0.0) + g * dt
        for node, g in alive.items():
            row = self.per_node[node]
            row["total"] += g * dt
            if node_idle:
                row["idle"] += node_idle[node] * dt
                row["unaccounted"] += (g - used[node] - node_idle[node]) * dt
        self.slices.append(Slice(a, b, state_gpus, fill))

    def _claim(self, claim: Claim, alive: dict, used: dict, dt: float, state_gpus: dict, unheld: dict,
               observed: dict) -> int:
        """Book training's claim: its GPUs, per node where placed, capped at what is alive and -- for a
        group that holds them -- at what was not observed free (a GPU Ray shows free is nobody's: a dying
        group's GPUs on a lost node, or ones it already let go)."""
        def room(n: str) -> int:
            seen = observed.get(n)
            return alive[n] - used[n] - (min(seen, alive[n]) if claim.held and seen is not None else 0)

        cap = sum(max(0, room(n)) for n in alive)
        g = min(claim.gpus, cap)
        if claim.gpus > sum(alive.values()) and claim.held and claim.cause not in ("teardown", "shutdown"):
            self.overcommit_s += dt      # (a dying group's workers on a lost node are simply gone)
        if claim.placement:
            g = 0
            for node, ng in claim.placement:
                if node in alive:
                    take = max(0, min(ng, room(node)))
                    used[node] += take
                    g += take
                    self.per_node[node][claim.state] += take * dt
                    if not claim.held:
                        unheld[node] = unheld.get(node, 0) + take
        else:
            if g:
                self.placed = False
            if not claim.held:
                unheld[None] = g
        state_gpus[claim.state] = g
        key = f"{claim.state}:{claim.cause}"
        self.causes[key] = self.causes.get(key, 0.0) + g * dt
        return g

    def _leases(self, covering: list, alive: dict, used: dict, dt: float, free_total: int) -> dict[str, int]:
        fill: dict[str, int] = {}
        for le in covering:
            if le.node is not None and le.node in alive:
                g = max(0, min(le.gpus, alive[le.node] - used[le.node], free_total))
                used[le.node] += g
                row = self.per_node[le.node]["fillin"]
                row[le.workload] = row.get(le.workload, 0) + g * dt
            elif le.node is None:
                g = max(0, min(le.gpus, free_total))
            else:
                g = 0      # the lease's node is gone: nothing runs there
            if g < le.gpus:
                self.overcommit_s += dt
            free_total -= g
            fill[le.workload] = fill.get(le.workload, 0) + g
        return fill

    def result(self, start, end, source, notes, has_leases, busy, bubble, job_gpus, job_gpus_source) -> Ledger:
        reserved = sum(self.fillin.values())
        total = sum(self.totals.values()) + reserved
        busy_total = None if busy is None else sum(busy.values())
        gs = {"training": self.totals["training"], "checkpoint_stall": self.totals["checkpoint_stall"],
              "recovering": self.totals["recovering"], "fillin": reserved, "idle": self.totals["idle"],
              "unaccounted": self.totals["unaccounted"], "total": total,
              "fillin_reserved": reserved, "fillin_busy": busy_total,
              "fillin_by_workload": dict(self.fillin),
              "training_rolled_back": self.causes.get("training:rolled_back", 0.0), "bubble": bubble,
              "recovering_by_cause": {c.split(":")[1]: v for c, v in self.causes.items()
                                      if c.startswith("recovering:")}}
        if busy is not None:
            gs["fillin_busy_by_workload"] = dict(busy)
            if busy_total > reserved + 1e-6:
                notes.append(f"tenants measured {busy_total:.1f} busy GPU-s but held {reserved:.1f}: "
                             "busy time outside their leases")
        held = gs["training"] + gs["recovering"] + gs["checkpoint_stall"]
        spare = total - held
        if self.overcommit_s:
            notes.append(f"claims exceeded alive GPUs for {self.overcommit_s:.1f}s: capped at what was alive")
        if not self.placed:
            notes.append("events carry no worker placement: per-node rows split fill-in and observed-free "
                         "GPUs only (training's GPUs are counted in the cluster totals)")
        per_node = {}
        for node, row in self.per_node.items():
            out = {"gpus": row["gpus"], "total": _r(row["total"]), "fillin": _r(row["fillin"]),
                   "free_observed": _r(row["free_observed"])}
            if self.placed:
                out.update({s: _r(row[s]) for s in STATES if s != "fillin"})
            per_node[node] = out
        wall = end - start
        return Ledger(
            start=start, end=end, gpu_seconds=gs, per_node=per_node,
            goodput=self.productive_gpu / (job_gpus * wall) if job_gpus and wall > 0 else None,
            time_goodput=self.productive_wall / wall if wall > 0 else None,
            effective_training_time_ratio=self.productive_gpu / held if held > 0 else None,
            harvest_ratio=(busy_total / spare if spare > 0 else None) if busy_total is not None else None,
            harvest_ratio_reserved=(reserved / spare if spare > 0 else None) if has_leases else None,
            productive_gpu_seconds=self.productive_gpu, job_gpus=job_gpus, job_gpus_source=job_gpus_source,
            slices=tuple(self.slices),
            nodes_source=source, notes=tuple(notes))
