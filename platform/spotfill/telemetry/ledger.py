"""The cluster's GPU-seconds ledger from events.jsonl (pure).

Every GPU-second of every alive node inside the run's window lands in exactly one state:
  training          the worker group steps (the loop time between step events; rolled-back steps included,
                    counted apart as `training_rolled_back`)
  checkpoint_stall  the training loop waits on a checkpoint save (checkpoint_save.stall_s), and the final
                    checkpoint between the last step and `finish`
  recovering        training holds or waits for GPUs but does not step: startup before the first step,
                    restarts (failure -> detect -> new group -> restore -> first step)
  fillin:<workload> GPUs lent to fill-in (`lease` ... `reclaim` events)
  idle              alive GPUs nobody uses (the rest)
The time axis is cut at every change (node up/down, run windows, stalls, leases); in each slice the
training claim is served first, fill-in next, and idle is what remains, so the parts add up to
GPUs x wall time on alive nodes by construction. During a restart the claim is the next group's size.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

STATES = ("training", "fillin", "idle", "recovering", "checkpoint_stall")
LEASE_END_KINDS = ("reclaim", "release", "lease_end")


@dataclass(frozen=True)
class NodeSpan:
    """A node's life: `gpus` GPUs alive from `start` to `end` (None: still alive at the window's end)."""
    node: str
    gpus: int
    start: float
    end: float | None = None
    market: str | None = None


@dataclass(frozen=True)
class _Claim:
    start: float
    end: float
    gpus: int
    state: str                    # training | recovering | checkpoint_stall
    cause: str = ""               # training: "productive" | "rolled_back"; recovering: "startup" | "restart"
    placement: tuple = ()         # ((node, gpus), ...) when the events say where the workers ran


@dataclass(frozen=True)
class _Lease:
    start: float
    end: float
    node: str | None
    gpus: int
    workload: str


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
    gpu_seconds: dict             # STATES + total, fillin_by_workload, training_rolled_back, recovering_by_cause
    per_node: dict                # node -> {gpus, total, fillin, [training, recovering, checkpoint_stall, idle]}
    goodput: float | None         # productive training wall time / wall time
    effective_training_time_ratio: float | None   # productive training GPU-s / GPU-s training held
    harvest_ratio: float | None   # fill-in GPU-s / GPU-s not used by training (None without lease events)
    productive_gpu_seconds: float
    slices: tuple = ()
    nodes_source: str = "given"
    notes: tuple = ()

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def as_report(self) -> dict:
        """report.json's gpu_seconds / goodput / harvest_ratio keys (harvest_ratio only with fill-in)."""
        out = {"gpu_seconds": {k: _r(v) if isinstance(v, (float, dict)) else v for k, v in self.gpu_seconds.items()},
               "gpu_seconds_per_node": self.per_node,
               "goodput": _r(self.goodput, 4), "effective_training_time_ratio": _r(self.effective_training_time_ratio, 4),
               "ledger": {"start": _r(self.start), "end": _r(self.end), "wall_s": _r(self.wall_s),
                          "nodes_source": self.nodes_source, "notes": list(self.notes)}}
        if self.harvest_ratio is not None:
            out["harvest_ratio"] = _r(self.harvest_ratio, 4)
        return out


def _r(x, nd: int = 3):
    if isinstance(x, dict):
        return {k: _r(v, nd) for k, v in x.items()}
    return None if x is None else round(x, nd)


# ---- inputs -------------------------------------------------------------------------------------------

def run_window(events: list[dict]) -> tuple[float, float]:
    """job_start .. job_end when logged, else the first and last event."""
    ts = [e["t"] for e in events if "t" in e]
    if not ts:
        raise ValueError("no timed events")
    start = next((e["t"] for e in events if e["kind"] == "job_start"), min(ts))
    end = next((e["t"] for e in reversed(events) if e["kind"] == "job_end"), max(ts))
    return start, end


def nodes_from_events(events: list[dict]) -> list[NodeSpan]:
    """NodeSpans from `node_up` {node, gpus, market?} and `node_down` {node} events ([] if none)."""
    up: dict[str, dict] = {}
    spans: list[NodeSpan] = []
    for e in events:
        if e["kind"] == "node_up":
            up[str(e["node"])] = e
        elif e["kind"] == "node_down" and str(e["node"]) in up:
            u = up.pop(str(e["node"]))
            spans.append(NodeSpan(str(u["node"]), int(u["gpus"]), u["t"], e["t"], u.get("market")))
    spans += [NodeSpan(n, int(u["gpus"]), u["t"], None, u.get("market")) for n, u in up.items()]
    return spans


def nodes_from_report(report: dict) -> list[NodeSpan]:
    """NodeSpans from report.json's cluster.nodes when they carry `gpus` ([] otherwise)."""
    nodes = (report.get("cluster") or {}).get("nodes") or []
    return [NodeSpan(str(n["id"]), int(n["gpus"]), n["started"], n.get("ended"), n.get("market"))
            for n in nodes if n.get("gpus") is not None and n.get("started") is not None]


def _gpus_per_worker(events: list[dict]) -> int:
    js = next((e for e in events if e["kind"] == "job_start"), {})
    return int(js.get("gpus_per_worker") or 1)


def _attempts(events: list[dict]) -> dict[int, dict]:
    """attempt -> {world_size, placement, steps: [step events by time], saves, last_t}."""
    out: dict[int, dict] = {}
    for e in events:
        a = e.get("attempt")
        if a is None or e["kind"] not in ("attempt", "start", "resume", "step", "checkpoint_save", "planned_exit"):
            continue
        rec = out.setdefault(a, {"world_size": 0, "placement": (), "steps": [], "saves": []})
        if e.get("world_size"):
            rec["world_size"] = int(e["world_size"])
        if e.get("placement"):
            rec["placement"] = tuple(sorted((str(n), int(g)) for n, g in e["placement"].items()))
        if e["kind"] == "step":
            rec["steps"].append(e)
        elif e["kind"] == "checkpoint_save":
            rec["saves"].append(e)
    for rec in out.values():
        rec["steps"].sort(key=lambda e: e["t"])
    return out


def lineage_keys(events: list[dict]) -> set[tuple[int, int]]:
    """(attempt, step) of the newest attempt to run each step: the steps the final model contains."""
    newest: dict[int, int] = {}
    for e in events:
        if e["kind"] == "step" and e["attempt"] >= newest.get(e["step"], -1):
            newest[e["step"]] = e["attempt"]
    return {(a, s) for s, a in newest.items()}


def training_claims(events: list[dict], start: float, end: float) -> list[_Claim]:
    """The training job's use of GPUs over time, as non-overlapping claims (stalls on top, see ledger)."""
    gpw = _gpus_per_worker(events)
    attempts = _attempts(events)
    keep = lineage_keys(events)
    runs = []  # (start, last productive t, end, attempt)
    for a, rec in sorted(attempts.items()):
        if rec["steps"]:
            first, last = rec["steps"][0], rec["steps"][-1]
            kept = [s["t"] for s in rec["steps"] if (a, s["step"]) in keep]
            runs.append((first["t"] - first.get("step_s", 0.0), max(kept) if kept else None, last["t"], a))
    runs.sort()
    claims: list[_Claim] = []
    cur = start
    for i, (r0, kept_end, r1, a) in enumerate(runs):
        g, place = attempts[a]["world_size"] * gpw, attempts[a]["placement"]
        if r0 > cur:
            claims.append(_Claim(cur, r0, g, "recovering", "startup" if i == 0 else "restart", place))
        split = r0 if kept_end is None else kept_end
        if split > r0:
            claims.append(_Claim(r0, split, g, "training", "productive", place))
        if r1 > split:
            claims.append(_Claim(split, r1, g, "training", "rolled_back", place))
        cur = max(cur, r1)
    finish = next((e["t"] for e in events if e["kind"] == "finish"), None)
    last_a = max(attempts) if attempts else None
    if runs and finish is not None and finish > cur:
        a = runs[-1][3]
        claims.append(_Claim(cur, finish, attempts[a]["world_size"] * gpw, "checkpoint_stall", "final",
                             attempts[a]["placement"]))
    elif finish is None and last_a is not None and attempts[last_a]["world_size"]:
        later = [e for e in events if e.get("attempt") == last_a and e["t"] > cur]
        if later or not runs:   # a group started after the last step: training was still trying
            g = attempts[last_a]["world_size"] * gpw
            claims.append(_Claim(cur, end, g, "recovering", "startup" if not runs else "restart",
                                 attempts[last_a]["placement"]))
    return [c for c in claims if c.end > c.start]


def stall_claims(events: list[dict]) -> list[_Claim]:
    gpw = _gpus_per_worker(events)
    attempts = _attempts(events)
    out = []
    for a, rec in attempts.items():
        for e in rec["saves"]:
            if e.get("stall_s", 0) > 0:
                out.append(_Claim(e["t"] - e["stall_s"], e["t"], rec["world_size"] * gpw, "checkpoint_stall",
                                  "emergency" if e.get("emergency") else "periodic", rec["placement"]))
    return out


def leases(events: list[dict], end: float) -> list[_Lease]:
    """Fill-in leases: `lease` {lease_id?, tenant, workload?, node, gpus, start?, end?} closed by a
    `reclaim` / `release` / `lease_end` event with the same lease_id (or tenant and node), at its `end`
    field or its time; an open lease lasts to the window's end (node deaths cut it in the ledger)."""
    open_: dict[tuple, dict] = {}
    out: list[_Lease] = []

    def key(e: dict) -> tuple:
        return (e["lease_id"],) if e.get("lease_id") else (e.get("tenant"), str(e.get("node", e.get("node_id"))))

    def close(e: dict, t_end: float) -> None:
        out.append(_Lease(e.get("start", e["t"]), t_end, _node_of(e), int(e["gpus"]), workload_of(e)))

    for e in events:
        if e["kind"] == "lease":
            if e.get("end") is not None:
                close(e, e["end"])
            else:
                open_[key(e)] = e
        elif e["kind"] in LEASE_END_KINDS and key(e) in open_:
            close(open_.pop(key(e)), e.get("end", e["t"]))
    for e in open_.values():
        close(e, end)
    return out


def workload_of(lease_event: dict) -> str:
    """The fill-in workload: `workload`, else the tenant's prefix ("serve:app" -> "serve"), else the tenant."""
    w = lease_event.get("workload") or str(lease_event.get("tenant") or "fillin").split(":")[0]
    return str(w)


def _node_of(e: dict) -> str | None:
    n = e.get("node", e.get("node_id"))
    return None if n is None else str(n)


# ---- the sweep ----------------------------------------------------------------------------------------

def compute_ledger(events: list[dict], nodes: list[NodeSpan] | None = None,
                   window: tuple[float, float] | None = None) -> Ledger:
    """GPU-seconds by state over `window` (default run_window). Nodes: given, else node_up/node_down
    events, else one stand-in node as large as the largest worker group (noted: idle is then unknown)."""
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
                     "idle GPUs outside training's reach are not counted")
    stalls = stall_claims(events)
    lease_list = leases(events, end)
    cuts = {start, end}
    for c in claims + stalls:
        cuts.update((c.start, c.end))
    for n in nodes:
        cuts.update((n.start, n.end if n.end is not None else end))
    for le in lease_list:
        cuts.update((le.start, le.end))
    cuts = sorted(t for t in cuts if start <= t <= end)
    acc = _Acc(nodes)
    claim_ix, stall_ix, lease_ix = _Index(claims), _Index(stalls), _Index(lease_list)
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            acc.add_slice(a, b, claim_ix, stall_ix, lease_ix)
    return acc.result(start, end, source, notes, has_leases=bool(lease_list))


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

    def __init__(self, nodes: list[NodeSpan]):
        self.nodes = nodes
        self.totals = {s: 0.0 for s in STATES if s != "fillin"}
        self.fillin: dict[str, float] = {}
        self.causes: dict[str, float] = {}
        self.per_node = {n.node: {"gpus": n.gpus, "total": 0.0, "fillin": {}, "training": 0.0, "recovering": 0.0,
                                  "checkpoint_stall": 0.0, "idle": 0.0} for n in nodes}
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
        if claim is not None:
            g = min(claim.gpus, cap)
            if claim.gpus > cap:
                self.overcommit_s += dt
            state_gpus[claim.state] = g
            key = f"{claim.state}:{claim.cause}"
            self.causes[key] = self.causes.get(key, 0.0) + g * dt
            if claim.state == "training" and claim.cause == "productive":
                self.productive_wall += dt
                self.productive_gpu += g * dt
            if claim.placement:
                for node, ng in claim.placement:
                    if node in alive:
                        take = min(ng, alive[node] - used[node])
                        used[node] += take
                        self.per_node[node][claim.state] += take * dt
            elif g:
                self.placed = False
        fill: dict[str, int] = {}
        free_total = cap - state_gpus["training"] - state_gpus["recovering"] - state_gpus["checkpoint_stall"]
        for le in lease_list.covering(m):
            if le.node is not None and le.node in alive:
                g = min(le.gpus, alive[le.node] - used[le.node], free_total)
                used[le.node] += g
                self.per_node[le.node]["fillin"][le.workload] = self.per_node[le.node]["fillin"].get(le.workload, 0) + g * dt
            elif le.node is None:
                g = min(le.gpus, free_total)
            else:
                g = 0      # the lease's node is gone: nothing runs there
            if g < le.gpus:
                self.overcommit_s += dt
            free_total -= g
            fill[le.workload] = fill.get(le.workload, 0) + g
        state_gpus["fillin"] = sum(fill.values())
        state_gpus["idle"] = free_total
        for s in ("training", "recovering", "checkpoint_stall", "idle"):
            self.totals[s] += state_gpus[s] * dt
        for w, g in fill.items():
            self.fillin[w] = self.fillin.get(w, 0.0) + g * dt
        for node, g in alive.items():
            row = self.per_node[node]
            row["total"] += g * dt
            row["idle"] += (g - used[node]) * dt
        self.slices.append(Slice(a, b, state_gpus, fill))

    def result(self, start, end, source, notes, has_leases) -> Ledger:
        fillin = sum(self.fillin.values())
        total = sum(self.totals.values()) + fillin
        gs = {"training": self.totals["training"], "fillin": fillin, "idle": self.totals["idle"],
              "recovering": self.totals["recovering"], "checkpoint_stall": self.totals["checkpoint_stall"],
              "total": total, "fillin_by_workload": dict(self.fillin),
              "training_rolled_back": self.causes.get("training:rolled_back", 0.0),
              "recovering_by_cause": {c.split(":")[1]: v for c, v in self.causes.items()
                                      if c.startswith("recovering:")}}
        held = gs["training"] + gs["recovering"] + gs["checkpoint_stall"]
        spare = total - held
        if self.overcommit_s:
            notes.append(f"claims exceeded alive GPUs for {self.overcommit_s:.1f}s: capped at what was alive")
        if not self.placed:
            notes.append("events carry no worker placement: per-node rows split fill-in and idle only "
                         "(training's GPUs are counted in the cluster totals)")
        per_node = {}
        for node, row in self.per_node.items():
            out = {"gpus": row["gpus"], "total": _r(row["total"]), "fillin": _r(row["fillin"])}
            if self.placed:
                out.update({s: _r(row[s]) for s in ("training", "recovering", "checkpoint_stall", "idle")})
            per_node[node] = out
        wall = end - start
        return Ledger(
            start=start, end=end, gpu_seconds=gs, per_node=per_node,
            goodput=self.productive_wall / wall if wall > 0 else None,
            effective_training_time_ratio=self.productive_gpu / held if held > 0 else None,
            harvest_ratio=(fillin / spare if spare > 0 else None) if has_leases else None,
            productive_gpu_seconds=self.productive_gpu, slices=tuple(self.slices), nodes_source=source,
            notes=tuple(notes))
