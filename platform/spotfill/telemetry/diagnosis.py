"""Where the GPU-seconds that did not train the model went, with evidence and a remedy (pure).

Lost GPU-seconds = total - fill-in (lent, not lost) - productive compute. Productive compute is the final
lineage's step time minus its data wait (and collective wait, when steps measure `collective_wait_s`).
Each cause carries its GPU-seconds, its share of the lost total, the numbers behind it, and a remedy:
  data_stall        lineage steps waiting for the next batch (step.data_wait_s)
  collective_wait   steps waiting in collectives / on stragglers (step.collective_wait_s, when measured)
  step_overhead     loop time between step events outside step_s (logging, event sink, host syncs)
  checkpoint_stall  the training loop blocked on checkpoint saves (ledger)
  rolled_back       steps run and then lost to a restart from an older checkpoint (ledger)
  recovery          startup and restarts: detect, decide, workers start, state load, first step (ledger)
  idle_capacity     GPUs observed free that neither training nor fill-in used (ledger)
  unaccounted       alive GPUs no event accounts for (ledger): no remedy but to observe them

`recovery_breakdown` splits each restart into phases from the attempt / resume / step events and, when
present, the controller_state events (Ray Train controller: RUNNING -> RESTARTING|RESIZING -> SCHEDULING).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from spotfill.config.failure_detection import CLUSTER, RAY_DEFAULT
from spotfill.telemetry.claims import attempts, group_gpus
from spotfill.telemetry.events import step_count, step_totals
from spotfill.telemetry.ledger import Ledger, lineage_keys

RESTART_STATES = ("RESTARTING", "RESCHEDULING", "RESIZING")
MINOR_SHARE = 0.05    # a cause under 5% of the lost GPU-seconds (data stall: of step time) needs no action


@dataclass(frozen=True)
class Finding:
    cause: str
    gpu_seconds: float
    share_of_lost: float
    evidence: dict
    remedy: str

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gpu_seconds"], d["share_of_lost"] = round(self.gpu_seconds, 3), round(self.share_of_lost, 4)
        return d


@dataclass(frozen=True)
class Recovery:
    """One restart, fault to first finished step. None where the events do not show the phase."""
    attempt: int
    cause: str                          # the attempt event's cause, else the planned exit's reason
    fault_t: float
    fault_source: str                   # report | planned_exit | last_step
    detect_s: float | None              # fault -> the controller leaves RUNNING
    decide_s: float | None              # -> SCHEDULING (the new group's size decided)
    workers_start_s: float | None       # -> the training function runs on the new workers
    state_load_s: float | None          # restore (download, convert) + engine.load_checkpoint
    setup_s: float | None               # model and engine build
    first_step_s: float | None          # restored -> first step finished
    total_s: float | None
    detail: dict
    warm: dict | None = None            # node -> its workers' processes all started before the fault
                                        # (warm spares) or not (started cold for this restart); None:
                                        # the start event does not list its workers
    ready_wait_s: float | None = None   # a grow onto new nodes: how long it waited for their spares
    sizing: str | None = None           # why the controller chose the group's size (group_sizing event)

    @property
    def slowest(self) -> str | None:
        phases = {k: getattr(self, k) for k in ("detect_s", "decide_s", "workers_start_s", "state_load_s",
                                                "setup_s", "first_step_s") if getattr(self, k) is not None}
        if self.detect_s is None and self.detail.get("fault_to_workers_up_s") is not None:
            phases["fault_to_workers_up_s"] = self.detail["fault_to_workers_up_s"]   # the three, unsplit
        return max(phases, key=phases.get) if phases else None

    def as_dict(self) -> dict:
        d = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        d["slowest"] = self.slowest
        return d


def recovery_breakdown(events: list[dict], faults: list[float] | None = None) -> list[Recovery]:
    """One Recovery per worker group that started after an earlier one had stepped. `faults`: the times
    the runner fired node events (report.json preemptions[].at); the latest one before the new group's
    attempt event is its fault, else the old group's planned exit, else its last step."""
    events = sorted((e for e in events if "t" in e), key=lambda e: e["t"])
    out: list[Recovery] = []
    by_attempt: dict[int, dict] = {}
    for e in events:
        a = e.get("attempt")
        if a is None:
            continue
        rec = by_attempt.setdefault(a, {})
        if e["kind"] in ("attempt", "start", "resume", "planned_exit"):
            rec.setdefault(e["kind"], e)
        elif e["kind"] == "step":
            rec.setdefault("first_step", e)
            rec["last_step"] = e
    controller = [e for e in events if e["kind"] in ("controller_state", "group_sizing")]
    last_progress: dict | None = None
    for a in sorted(by_attempt):
        rec = by_attempt[a]
        began = rec.get("attempt") or rec.get("start") or rec.get("resume")
        if last_progress is not None and began is not None:
            out.append(_one_recovery(a, rec, last_progress, began["t"], faults or [], controller))
        if "last_step" in rec:
            last_progress = rec
    return out


def _one_recovery(a: int, rec: dict, prev: dict, began_t: float, faults: list[float],
                  controller: list[dict]) -> Recovery:
    prev_t = prev["last_step"]["t"]
    fired = [f for f in faults if prev.get("attempt", prev["last_step"])["t"] <= f <= began_t]
    if fired:
        fault_t, source = max(fired), "report"
    elif "planned_exit" in prev:
        fault_t, source = prev["planned_exit"]["t"], "planned_exit"
    else:
        fault_t, source = prev_t, "last_step"
    cause = ((rec.get("attempt") or {}).get("cause") or (prev.get("planned_exit") or {}).get("reason")
             or "unplanned: no reason on record")
    sizing = [e for e in controller if e["kind"] == "group_sizing" and fault_t <= e["t"] <= began_t]
    controller = [e for e in controller if e["kind"] == "controller_state"]
    restart = next((e for e in controller if e["t"] >= fault_t and e["state"] in RESTART_STATES), None)
    sched = next((e for e in controller if restart and e["t"] >= restart["t"] and e["state"] == "SCHEDULING"), None)
    up = rec.get("resume") or rec.get("start")
    entered = up["t"] - up.get("startup_s", 0.0) if up else None
    first = rec.get("first_step")
    load = None
    setup = None
    if up is not None and "restore_prep_s" in up:
        load = up.get("restore_prep_s", 0.0) + up.get("load_s", 0.0)
        setup = max(0.0, up.get("startup_s", 0.0) - load)
    detect = decide = workers = None
    if restart is not None and sched is not None and entered is not None:
        detect, decide, workers = restart["t"] - fault_t, sched["t"] - restart["t"], entered - sched["t"]
    detail = {"fault_to_workers_up_s": round(entered - fault_t, 3) if entered is not None else None,
              "controller_events": bool(restart and sched)}
    for k in ("download_s", "convert_s", "bytes", "from_world_size", "world_size", "universal", "reads",
              "read_bytes_storage", "read_bytes_local"):
        if up is not None and k in up:
            detail[k] = up[k]
    return Recovery(
        attempt=a, cause=cause, fault_t=fault_t, fault_source=source, detect_s=detect, decide_s=decide,
        workers_start_s=workers, state_load_s=load, setup_s=setup,
        first_step_s=(first["t"] - up["t"]) if (first and up) else None,
        total_s=(first["t"] - fault_t) if first else None, detail=detail,
        warm=workers_warm((up or {}).get("workers"), sizing[-1]["t"] if sizing else (sched or {}).get("t", fault_t)),
        ready_wait_s=(prev.get("planned_exit") or {}).get("ready_wait_s") if source == "planned_exit" else None,
        sizing=sizing[-1].get("reason") if sizing else None)


def workers_warm(workers: list | None, decided_t: float) -> dict | None:
    """Per node, whether every worker process of a restarted group there started before the restart was
    decided (its group_sizing event; else the controller's SCHEDULING, else the fault): a spare warmed ahead
    of it, not a process started cold for it. None without the start event's list."""
    if not workers:
        return None
    out: dict[str, bool] = {}
    for node, started in workers:
        out[node] = out.get(node, True) and started is not None and started < decided_t
    return out


def _lineage_step_sums(events: list[dict], gpw: int) -> dict:
    """GPU-seconds of the final lineage's steps by phase (a step event may stand for many: its span)."""
    keep = lineage_keys(events)
    gpus = {a: group_gpus(rec, gpw) for a, rec in attempts(events).items()}    # Ray's assignment, else the plan
    sums = {"step": 0.0, "data_wait": 0.0, "collective": 0.0, "forward_backward": 0.0, "optimizer": 0.0,
            "steps": 0, "collective_measured": False}
    for e in events:
        if e["kind"] == "step" and (e["attempt"], e["step"]) in keep:
            g = gpus[e["attempt"]] if e["attempt"] in gpus else e.get("world_size", 1) * gpw
            sums["steps"] += step_count(e)
            sums["step"] += step_totals(e, "step_s") * g
            sums["data_wait"] += step_totals(e, "data_wait_s") * g
            sums["forward_backward"] += step_totals(e, "forward_backward_s") * g
            sums["optimizer"] += step_totals(e, "optimizer_s") * g
            collective = step_totals(e, "collective_wait_s", None)
            if collective is not None:
                sums["collective_measured"] = True
                sums["collective"] += collective * g
    return sums


def _node_loss_detection() -> str:
    """What decides how fast a node lost without notice is noticed, with the numbers Ray and spotfill's
    cluster files give it (config/failure_detection.py), never a setting this run is assumed to have."""
    ours = " ".join(f"{k}={v}" for k, v in CLUSTER.env().items())
    return (f"a node lost without notice is declared dead by the GCS's health checks ({RAY_DEFAULT.failure_threshold} "
            f"failed checks in a row with Ray's defaults: {RAY_DEFAULT.silent_node_bound_s():g}s for a host that went "
            f"silent; cluster.yaml and deploy/kuberay set {ours} on the head: {CLUSTER.silent_node_bound_s():g}s) -- "
            "set them on the head of a cluster started otherwise, and keep the spot watcher running so losses "
            "arrive as notices")


RECOVERY_REMEDIES = {
    "detect_s": "failure detection dominates: " + _node_loss_detection(),
    # an announced preemption: the group leaves RUNNING once its emergency checkpoint has committed
    "detect_s_planned": "the planned exit dominates (a notice's group leaves after its emergency checkpoint "
                        "commits): keep checkpoint saves fast (snapshot to host memory, a nearby bucket)",
    "decide_s": "the controller's resize decision dominates: lower the elastic policy's capacity probe and "
                "Ray Train's worker-group start timeout",
    "workers_start_s": "starting workers dominates: pre-pull the image / keep the runtime env cached on every "
                       "node, and keep warm spare capacity (fill-in hands GPUs back fast)",
    "fault_to_workers_up_s": "detecting the fault and starting the new workers dominates (controller_state "
                             "events would split it): " + _node_loss_detection() + "; keep images and runtime "
                             "envs cached on every node",
    "state_load_s": "loading the checkpoint dominates: keep checkpoints in a nearby bucket, and avoid the "
                    "universal conversion on the critical path (same world size restores directly)",
    "setup_s": "model and engine build dominates: cache the model/tokenizer on local disk, avoid re-compiling",
    "first_step_s": "the first step after restore dominates (warm-up, allocator, compile): expected once per "
                    "restart; fewer restarts is the remedy (announced preemptions need no restart from scratch)",
}


def _recovery_remedy(worst: str | None, recoveries: list[Recovery]) -> str:
    """The remedy for the most frequent slowest phase; a detection phase only spent on planned exits (the
    emergency checkpoint before leaving) is not a detection problem."""
    if worst == "detect_s" and all(not r.cause.startswith("unplanned") for r in recoveries if r.slowest == worst):
        worst = "detect_s_planned"
    return RECOVERY_REMEDIES.get(worst, "startup and restarts: fewer restarts (announced preemptions, "
                                 "checkpoint before the deadline) and faster restore")


def diagnose(events: list[dict], ledger: Ledger, recoveries: list[Recovery] | None = None,
             checkpoint_every: int | None = None, prefetch: int | None = None) -> list[Finding]:
    """Findings, largest first, whose GPU-seconds add up to the lost total (see module doc)."""
    js = next((e for e in events if e["kind"] == "job_start"), {})
    gpw = int(js.get("gpus_per_worker") or 1)
    checkpoint_every = checkpoint_every or js.get("checkpoint_every")
    prefetch = prefetch or js.get("prefetch")
    gs = ledger.gpu_seconds
    sums = _lineage_step_sums(events, gpw)
    productive = ledger.productive_gpu_seconds
    compute = productive - sums["data_wait"] - sums["collective"]
    overhead = max(0.0, productive - sums["step"])
    compute -= overhead
    lost = gs["total"] - gs["fillin"] - compute
    recoveries = recovery_breakdown(events) if recoveries is None else recoveries
    step_s = sums["step"] or 1.0
    saves = [e for e in events if e["kind"] == "checkpoint_save"]
    f: list[tuple[str, float, dict, str]] = []
    share_dw = sums["data_wait"] / step_s
    f.append(("data_stall", sums["data_wait"],
              {"data_wait_share_of_step": round(share_dw, 4), "steps": sums["steps"], "prefetch": prefetch},
              f"data wait {share_dw:.0%} of step time: raise data.prefetch"
              f"{f' (now {prefetch})' if prefetch else ''}, use more loader workers or faster/closer storage"))
    if sums["collective_measured"]:
        share = sums["collective"] / step_s
        f.append(("collective_wait", sums["collective"], {"collective_wait_share_of_step": round(share, 4),
                                                          "forward_backward_share_of_step":
                                                              round(sums["forward_backward"] / step_s, 4),
                                                          "optimizer_share_of_step":
                                                              round(sums["optimizer"] / step_s, 4)},
                  f"collective wait {share:.0%} of step time: look for a straggler node (slowest rank), "
                  "raise gradient accumulation so all-reduces are rarer, or overlap communication"))
    f.append(("step_overhead", overhead, {"loop_s_outside_steps_gpu_s": round(overhead, 3)},
              "time between steps outside the step itself: log fewer events per step or batch them"))
    stalls = [e["stall_s"] for e in saves]
    f.append(("checkpoint_stall", gs["checkpoint_stall"],
              {"saves": len(saves), "emergency": sum(1 for e in saves if e.get("emergency")),
               "stall_s_max": round(max(stalls), 4) if stalls else 0.0,
               "stall_s_mean": round(sum(stalls) / len(stalls), 4) if stalls else 0.0,
               "checkpoint_every": checkpoint_every},
              "checkpoints block training: raise training.checkpoint_every"
              f"{f' (now {checkpoint_every})' if checkpoint_every else ''} or keep saves asynchronous "
              "(snapshot to host memory, upload in the background)"))
    f.append(("rolled_back", gs["training_rolled_back"], {"checkpoint_every": checkpoint_every},
              "steps redone after a hard loss: checkpoint more often (lower training.checkpoint_every) and run "
              "the spot watcher so notices turn losses into announced preemptions"))
    slow = [r.slowest for r in recoveries if r.slowest]
    worst = max(set(slow), key=slow.count) if slow else None
    f.append(("recovery", gs["recovering"],
              {"restarts": len(recoveries), "by_cause": {k: round(v, 3) for k, v in gs["recovering_by_cause"].items()},
               "slowest_phase": worst,
               "recovery_s": [round(r.total_s, 3) for r in recoveries if r.total_s is not None]},
              _recovery_remedy(worst, recoveries)))
    f.append(("idle_capacity", gs["idle"], {"idle_share_of_total": round(gs["idle"] / gs["total"], 4)
                                            if gs["total"] else 0.0, "fillin_gpu_s": round(gs["fillin"], 3)},
              "GPUs observed free sat unused: enable fill-in (Serve / batch / sweeps) on spare GPUs, raise "
              "training.workers max to use them, or release nodes that stay idle"))
    f.append(("unaccounted", gs["unaccounted"],
              {"unaccounted_share_of_total": round(gs["unaccounted"] / gs["total"], 4) if gs["total"] else 0.0,
               "nodes_source": ledger.nodes_source},
              "capacity was inferred (no node timeline): these may be GPUs that were already gone; record "
              "node_up/node_down events (or report.json cluster.nodes with gpus) to know" if ledger.nodes_source
              == "inferred" else "no event says what these alive GPUs did (neither training, a tenant, nor an "
              "observation that they were free): run the fill-in arbiter, whose journal records each node's "
              "free GPUs, before fill-in is recommended for them"))
    denom = lost if lost > 0 else 1.0
    out = []
    for cause, gpu_s, ev, remedy in f:
        if gpu_s <= 0:
            continue
        small = (share_dw < MINOR_SHARE) if cause == "data_stall" else (gpu_s / denom < MINOR_SHARE)
        if small:
            remedy = f"minor ({gpu_s / denom:.1%} of the lost GPU-seconds): no action needed"
        out.append(Finding(cause, gpu_s, gpu_s / denom, ev, remedy))
    return sorted(out, key=lambda x: -x.gpu_seconds)


def diagnosis_report(events: list[dict], ledger: Ledger, faults: list[float] | None = None) -> dict:
    """report.json's `diagnosis` and `recoveries` keys."""
    recs = recovery_breakdown(events, faults)
    findings = diagnose(events, ledger, recs)
    lost = sum(x.gpu_seconds for x in findings)
    return {"diagnosis": {"lost_gpu_seconds": round(lost, 3), "findings": [x.as_dict() for x in findings]},
            "recoveries": [r.as_dict() for r in recs]}
