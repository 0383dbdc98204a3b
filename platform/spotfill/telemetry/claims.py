"""Training's hold on GPUs over time, from the worker groups' own events (pure).

A worker group holds its GPUs from the moment it is placed until its teardown -- whether it steps, saves,
waits or is dying. Its GPUs are what Ray assigned it: its `attempt` event's `gpus` (the sum over its workers
of the GPU resource Ray assigned each, train/worker_loop.py); a log from before attempts recorded them, or a
group that never began an attempt, falls back on the plan: world_size (or group_start `workers`) x job_start
`gpus_per_worker`. Placed and torn down:
  placed     `group_start` {group, workers} (Ray Train started it; the sink numbers groups), else the
             attempt's `attempt` event (rank 0 began), else its start/resume minus `startup_s`
  torn down  `group_end` {group} (Ray Train shut it down), else the next group's placement, else the
             attempt's `finish`, else the end of the window (nothing says it let go)
Inside that life: recovering before its first step (startup / restart), training from its first step to
its last (the part after the final lineage's last step is `rolled_back`), checkpoint_stall for the final
save up to `finish`, and recovering after its last step until teardown (`teardown`: a dying or exiting
group; `shutdown` after `finish`). Between one group's teardown and the next one's placement training
holds nothing but waits for the next group's GPUs: recovering (`startup` before the first group,
`restart` after), marked not held (`held=False`: those GPUs may show free to Ray). Checkpoint saves'
`stall_s` lie on top (stall_claims). Step events may stand for many steps (events.step_span).
"""
from __future__ import annotations

from dataclasses import dataclass

from spotfill.telemetry.events import first_step, step_span

GROUP_KINDS = ("attempt", "start", "resume", "step", "checkpoint_save", "planned_exit")


@dataclass(frozen=True)
class Claim:
    start: float
    end: float
    gpus: int
    state: str                    # training | recovering | checkpoint_stall
    cause: str = ""               # training: productive | rolled_back; recovering: startup | restart |
    placement: tuple = ()         # teardown | shutdown; checkpoint_stall: periodic | emergency | final
    held: bool = True             # False: training waits for these GPUs but no group holds them yet


def gpus_per_worker(events: list[dict]) -> int:
    """The configured GPUs per worker (job_start `gpus_per_worker`, default 1): only the fallback where
    the events do not record what Ray assigned."""
    js = next((e for e in events if e["kind"] == "job_start"), {})
    return int(js.get("gpus_per_worker") or 1)


def assigned_gpus(e: dict) -> int | float | None:
    """The GPUs Ray assigned a worker group, as its `attempt` event records them (None: not recorded)."""
    g = e.get("gpus")
    if g is None:
        return None
    g = float(g)
    return int(g) if g.is_integer() else g


def group_gpus(rec: dict, gpw: int) -> int | float:
    """An attempt's GPUs (`attempts()` record): what Ray assigned, else world_size x gpus_per_worker."""
    return rec["gpus"] if rec["gpus"] is not None else rec["world_size"] * gpw


def observed_job_gpus(events: list[dict]) -> int | float | None:
    """The most GPUs Ray assigned any of the job's worker groups (None: no attempt event records them)."""
    seen = [g for e in events if e["kind"] == "attempt" and (g := assigned_gpus(e)) is not None]
    return max(seen) if seen else None


def lineage_keys(events: list[dict]) -> set[tuple[int, int]]:
    """(attempt, step) of the step events the final model's lineage holds: those whose steps no newer
    attempt ran again. A step event standing for many steps (a span) is in or out whole: spans never
    cross a checkpoint, and restarts resume from one."""
    ranges: dict[int, list[int]] = {}
    for e in events:
        if e["kind"] == "step":
            lo, hi = first_step(e), int(e["step"])
            r = ranges.setdefault(e["attempt"], [lo, hi])
            r[0], r[1] = min(r[0], lo), max(r[1], hi)
    keep = set()
    for e in events:
        if e["kind"] == "step":
            a, s = e["attempt"], int(e["step"])
            if not any(b > a and lo <= s <= hi for b, (lo, hi) in ranges.items()):
                keep.add((a, s))
    return keep


def _group_keys(events: list[dict]) -> dict[int, tuple]:
    """id(event) -> (run, group) for group_start / group_end / attempt events: the sink numbers groups from
    1 in each run, and a run dir may hold several runs' events (each begins with job_start)."""
    run, out = 0, {}
    for e in events:
        if e["kind"] == "job_start":
            run += 1
        elif e["kind"] in ("group_start", "group_end", "attempt") and e.get("group") is not None:
            out[id(e)] = (run, e["group"])
    return out


def attempts(events: list[dict]) -> dict[int, dict]:
    """attempt -> {world_size, gpus (Ray assigned; None: not recorded), placement, group, steps (by time),
    saves, attempt_t, ready_t, finish_t}."""
    out: dict[int, dict] = {}
    keys = _group_keys(events)
    for e in events:
        a = e.get("attempt")
        if a is None or e["kind"] not in GROUP_KINDS + ("finish",):
            continue
        rec = out.setdefault(a, {"world_size": 0, "gpus": None, "placement": (), "steps": [], "saves": [],
                                 "group": None, "attempt_t": None, "ready_t": None, "finish_t": None})
        if e.get("world_size"):
            rec["world_size"] = int(e["world_size"])
        if e.get("placement"):
            rec["placement"] = tuple(sorted((str(n), int(g)) for n, g in e["placement"].items()))
        kind = e["kind"]
        if kind == "attempt":
            rec["attempt_t"] = e["t"]
            rec["group"] = keys.get(id(e))
            rec["gpus"] = assigned_gpus(e)
        elif kind in ("start", "resume") and rec["ready_t"] is None:
            rec["ready_t"] = e["t"] - float(e.get("startup_s") or 0.0)
        elif kind == "step":
            rec["steps"].append(e)
        elif kind == "checkpoint_save":
            rec["saves"].append(e)
        elif kind == "finish":
            rec["finish_t"] = e["t"]
    for rec in out.values():
        rec["steps"].sort(key=lambda e: e["t"])
    done = next((e for e in events if e["kind"] == "finish" and e.get("attempt") is None), None)
    if done is not None:     # a finish that names no attempt: the newest one that stepped before it
        stepped = [a for a, rec in out.items() if rec["steps"] and rec["steps"][0]["t"] <= done["t"]]
        if stepped and out[max(stepped)]["finish_t"] is None:
            out[max(stepped)]["finish_t"] = done["t"]
    return out


def _step_start(e: dict) -> float:
    """When the first step an event stands for began."""
    span = step_span(e)
    if span["steps"] == 1:
        return e["t"] - float(e.get("step_s") or 0.0)
    return span["first_t"] - float(span.get("step_s") or 0.0) / span["steps"]


@dataclass
class _Group:
    start: float                 # placed
    end: float | None            # torn down (None: no evidence yet)
    gpus: int
    attempt: int | None
    placement: tuple = ()
    end_evidence: bool = False


def _groups(events: list[dict], recs: dict[int, dict], gpw: int) -> list[_Group]:
    """One _Group per worker group the events show, ordered by placement."""
    keys = _group_keys(events)
    starts = {keys[id(e)]: e for e in events if e["kind"] == "group_start" and id(e) in keys}
    ends = {}
    for e in events:
        if e["kind"] == "group_end" and id(e) in keys:
            ends.setdefault(keys[id(e)], e["t"])
    groups: list[_Group] = []
    claimed = set()
    for a, rec in sorted(recs.items()):
        g = rec["group"]
        marks = [t for t in (rec["attempt_t"], rec["ready_t"]) if t is not None]
        if rec["steps"]:
            marks.append(_step_start(rec["steps"][0]))
        if g in starts:
            marks.append(starts[g]["t"])
            claimed.add(g)
        if not marks:
            continue
        end = ends.get(g)
        groups.append(_Group(min(marks), end, group_gpus(rec, gpw), a, rec["placement"], end is not None))
    for g, e in starts.items():      # placed but never began an attempt (failed while starting): the plan
        if g not in claimed and e.get("workers"):
            end = ends.get(g)
            groups.append(_Group(e["t"], end, int(e["workers"]) * gpw, None, (), end is not None))
    groups.sort(key=lambda x: x.start)
    for cur, nxt in zip(groups, groups[1:]):
        if cur.end is None or cur.end > nxt.start:
            cur.end = nxt.start
    if groups and groups[-1].end is None and groups[-1].attempt is not None:
        last = recs[groups[-1].attempt]
        groups[-1].end = last["finish_t"] if last["finish_t"] is not None else None
    return groups


def training_claims(events: list[dict], start: float, end: float) -> list[Claim]:
    """Training's GPUs over time as non-overlapping claims (stall_claims lie on top; see module doc)."""
    gpw = gpus_per_worker(events)
    recs = attempts(events)
    keep = lineage_keys(events)
    claims: list[Claim] = []
    prev_end = start
    for i, g in enumerate(_groups(events, recs, gpw)):
        g_end = end if g.end is None else g.end
        first = "startup" if i == 0 else "restart"
        claims.append(Claim(prev_end, g.start, g.gpus, "recovering", first, g.placement, held=False))
        rec = recs.get(g.attempt) if g.attempt is not None else None
        steps = rec["steps"] if rec else []
        if not steps:
            claims.append(Claim(g.start, g_end, g.gpus, "recovering", first, g.placement))
            prev_end = max(prev_end, g_end)
            continue
        s0, s1 = _step_start(steps[0]), steps[-1]["t"]
        kept = [e["t"] for e in steps if (g.attempt, int(e["step"])) in keep]
        split = max(kept) if kept else s0
        claims.append(Claim(g.start, s0, g.gpus, "recovering", first, g.placement))
        claims.append(Claim(s0, split, g.gpus, "training", "productive", g.placement))
        claims.append(Claim(split, s1, g.gpus, "training", "rolled_back", g.placement))
        done = rec["finish_t"]
        if done is not None and done >= s1:
            claims.append(Claim(s1, done, g.gpus, "checkpoint_stall", "final", g.placement))
            claims.append(Claim(done, g_end, g.gpus, "recovering", "shutdown", g.placement))
        else:
            claims.append(Claim(s1, g_end, g.gpus, "recovering", "teardown", g.placement))
        prev_end = max(prev_end, g_end)
    return [Claim(max(c.start, start), min(c.end, end), c.gpus, c.state, c.cause, c.placement, c.held)
            for c in claims if min(c.end, end) > max(c.start, start)]


def stall_claims(events: list[dict]) -> list[Claim]:
    """Each checkpoint save's `stall_s` before its event, on the saving group's GPUs."""
    gpw = gpus_per_worker(events)
    out = []
    for rec in attempts(events).values():
        for e in rec["saves"]:
            if e.get("stall_s", 0) > 0:
                out.append(Claim(e["t"] - e["stall_s"], e["t"], group_gpus(rec, gpw), "checkpoint_stall",
                                 "emergency" if e.get("emergency") else "periodic", rec["placement"]))
    return out
