"""Live metrics from the event stream, one event at a time (pure): what prometheus.py exports.

`LiveMetrics.update(event)` returns a `MetricUpdate`: gauges to set and counters to add, each keyed by
(metric name, tags). GPU-seconds are attributed as the ledger does, incrementally: the time since the
previous event goes to the state the new event reveals --
  step             step_s on the group's GPUs is training; before a group's first step, the rest of the gap
                   is recovering (startup / restart); between steps the whole gap is training
  checkpoint_save  stall_s is checkpoint_stall, the rest of the gap stays in the current state
  planned_exit / group_end   the gap is recovering on the group's GPUs (it stopped stepping: teardown)
  attempt / start / resume   the gap is recovering (the group stopped stepping), on the new group's GPUs
                   (the ledger's convention between groups: the claim is the next size)
The live numbers cannot see a node die: a dying group's GPUs on a lost node count until its group_end,
where the ledger (report) stops them at the node's death.
  finish           the gap since the last step is checkpoint_stall (the final save); then nothing counts
A group's GPUs are what Ray assigned it (its `attempt` event's `gpus`), else -- a log from before attempts
recorded them -- world_size x job_start's gpus_per_worker, as the ledger counts them (claims.py).
Fill-in GPU-seconds accrue per workload while `lease` events are open (until reclaim / release).
Idle needs the node timeline, which the stream may not have: the ledger (report) carries it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from spotfill.telemetry.claims import assigned_gpus
from spotfill.telemetry.ledger import LEASE_END_KINDS, workload_of

START_KINDS = ("attempt", "start", "resume")


@dataclass(frozen=True)
class MetricUpdate:
    gauges: dict = field(default_factory=dict)       # (name, tags tuple) -> value
    counters: dict = field(default_factory=dict)     # (name, tags tuple) -> increment (> 0)


@dataclass
class LiveMetrics:
    job: str = "spotfill"
    gpus_per_worker: int = 1
    last_t: float | None = None
    mode: str = "stopped"          # stopped | recovering | training
    gpus: int = 0
    assigned_attempt: int | None = None    # the attempt whose `gpus` Ray's assignment gave (not the plan)
    leases: dict = field(default_factory=dict)       # key -> (workload, node, gpus)
    totals: dict = field(default_factory=dict)       # state -> GPU-seconds (for tests and status)

    def update(self, e: dict) -> MetricUpdate:
        kind, t = e.get("kind"), e.get("t")
        if kind == "job_start":
            self.job = str(e.get("name") or self.job)
            self.gpus_per_worker = int(e.get("gpus_per_worker") or 1)
        g, c = {}, {}
        dt = 0.0 if (t is None or self.last_t is None) else max(0.0, t - self.last_t)
        if kind == "attempt" and assigned_gpus(e) is not None:
            self.gpus, self.assigned_attempt = assigned_gpus(e), e.get("attempt")
        elif kind in START_KINDS and e.get("world_size") and (
                self.assigned_attempt is None or e.get("attempt") != self.assigned_attempt):
            self.gpus = int(e["world_size"]) * self.gpus_per_worker
        self._accrue(c, dt, kind, e)
        if t is not None and (self.last_t is None or t > self.last_t):
            self.last_t = t
        self._gauges(g, c, kind, e)
        return MetricUpdate(g, c)

    def _tags(self, **more) -> tuple:
        return tuple(sorted({"job": self.job, **{k: str(v) for k, v in more.items()}}.items()))

    def _add(self, c: dict, state: str, gpu_s: float) -> None:
        if gpu_s > 0:
            key = ("spotfill_gpu_seconds_total", self._tags(state=state))
            c[key] = c.get(key, 0.0) + gpu_s
            self.totals[state] = self.totals.get(state, 0.0) + gpu_s

    def _accrue(self, c: dict, dt: float, kind: str, e: dict) -> None:
        for workload, _node, n in self.leases.values():
            if dt > 0:
                key = ("spotfill_gpu_seconds_total", self._tags(state="fillin", workload=workload))
                c[key] = c.get(key, 0.0) + dt * n
                self.totals["fillin"] = self.totals.get("fillin", 0.0) + dt * n
        if kind == "job_start":
            self.mode = "recovering"
            return
        if self.mode == "stopped":
            return
        if kind == "step":
            stepping = min(dt, e.get("step_s", dt))
            self._add(c, "training", stepping * self.gpus)
            self._add(c, self.mode, (dt - stepping) * self.gpus)
            self.mode = "training"
        elif kind == "checkpoint_save":
            stall = min(dt, e.get("stall_s", 0.0))
            self._add(c, "checkpoint_stall", stall * self.gpus)
            self._add(c, self.mode, (dt - stall) * self.gpus)
        elif kind in START_KINDS or kind in ("planned_exit", "group_end"):
            # group_end: the gap is the dying or exiting group's teardown, on its own GPUs
            self._add(c, "recovering", dt * self.gpus)
            self.mode = "recovering"
        elif kind == "finish":
            self._add(c, "checkpoint_stall" if self.mode == "training" else self.mode, dt * self.gpus)
            self.mode = "stopped"
        else:
            self._add(c, self.mode, dt * self.gpus)

    def _gauges(self, g: dict, c: dict, kind: str, e: dict) -> None:
        tags = self._tags()
        if kind == "step":
            g[("spotfill_training_step", tags)] = e["step"]
            g[("spotfill_world_size", tags)] = e.get("world_size", 0)
            if e.get("loss") is not None:
                g[("spotfill_training_loss", tags)] = e["loss"]
            if e.get("step_s"):
                g[("spotfill_step_seconds", tags)] = e["step_s"]
                g[("spotfill_tokens_per_second", tags)] = e.get("tokens", 0) / e["step_s"]
                g[("spotfill_data_wait_fraction", tags)] = e.get("data_wait_s", 0.0) / e["step_s"]
                for phase in ("forward_backward", "optimizer", "collective_wait"):
                    if e.get(f"{phase}_s") is not None:
                        g[(f"spotfill_{phase}_fraction", tags)] = e[f"{phase}_s"] / e["step_s"]
            for k in ("mfu", "hfu"):
                if e.get(k) is not None:
                    g[(f"spotfill_{k}", tags)] = e[k]
            if e.get("gpu_util") is not None:
                g[("spotfill_gpu_utilization", tags)] = e["gpu_util"]
            if e.get("gpu_mem_used_gb") is not None:
                g[("spotfill_gpu_memory_used_bytes", tags)] = e["gpu_mem_used_gb"] * 1e9
            c[("spotfill_tokens_total", tags)] = float(e.get("tokens", 0))
        elif kind == "checkpoint_save":
            g[("spotfill_checkpoint_stall_seconds", tags)] = e.get("stall_s", 0.0)
            kind_tag = "emergency" if e.get("emergency") else ("grow" if e.get("grow") else "periodic")
            c[("spotfill_checkpoint_saves_total", self._tags(kind=kind_tag))] = 1.0
        elif kind == "checkpoint":
            c[("spotfill_checkpoints_committed_total", tags)] = 1.0
        elif kind in ("start", "resume"):
            g[("spotfill_world_size", tags)] = e.get("world_size", 0)
            for k in ("restore_prep_s", "load_s", "startup_s"):
                if e.get(k) is not None:
                    g[(f"spotfill_restore_{k[:-2]}_seconds", tags)] = e[k]
        elif kind == "attempt" and e.get("attempt", 0) > 0 and e.get("cause") != "first start":
            # (a run's first group can carry a later attempt number: numbering continues over one store)
            c[("spotfill_restarts_total", self._tags(cause=str(e.get("cause", "unknown"))[:60]))] = 1.0
        elif kind == "planned_exit":
            c[("spotfill_planned_exits_total", self._tags(reason=e.get("reason", "unknown")))] = 1.0
        elif kind == "lease":
            key = e.get("lease_id") or (e.get("tenant"), e.get("node"))
            self.leases[key] = (workload_of(e), str(e.get("node", e.get("node_id"))), int(e.get("gpus", 0)))
            self._lease_gauges(g)
        elif kind in LEASE_END_KINDS:
            key = e.get("lease_id") or (e.get("tenant"), e.get("node"))
            if key in self.leases:
                old = self.leases.pop(key)
                g[("spotfill_fillin_gpus", self._tags(workload=old[0], node=old[1]))] = 0
            self._lease_gauges(g)
            if kind == "reclaim" and e.get("reclaim_s") is not None:
                g[("spotfill_handback_seconds", tags)] = e["reclaim_s"]
        if kind == "finish":
            g[("spotfill_job_running", tags)] = 0
        elif kind == "job_start":
            g[("spotfill_job_running", tags)] = 1

    def _lease_gauges(self, g: dict) -> None:
        per: dict[tuple, int] = {}
        for workload, node, n in self.leases.values():
            per[(workload, node)] = per.get((workload, node), 0) + n
        for (workload, node), n in per.items():
            g[("spotfill_fillin_gpus", self._tags(workload=workload, node=node))] = n


# metric name -> (type, description): what prometheus.py registers and docs/metrics.md explains
METRICS = {
    "spotfill_training_step": ("gauge", "last finished optimizer step"),
    "spotfill_training_loss": ("gauge", "loss of the last step (mean over ranks)"),
    "spotfill_world_size": ("gauge", "workers in the running group"),
    "spotfill_step_seconds": ("gauge", "wall time of the last step"),
    "spotfill_tokens_per_second": ("gauge", "tokens of the last step / its step time"),
    "spotfill_data_wait_fraction": ("gauge", "share of the last step spent waiting for data"),
    "spotfill_forward_backward_fraction": ("gauge", "share of the last step in forward and backward"),
    "spotfill_optimizer_fraction": ("gauge", "share of the last step in the optimizer step"),
    "spotfill_collective_wait_fraction": ("gauge", "share of the last step waiting in the step's collective "
                                                   "(for the slowest rank)"),
    "spotfill_gpu_utilization": ("gauge", "NVML utilisation of rank 0's GPU (share of time a kernel ran)"),
    "spotfill_gpu_memory_used_bytes": ("gauge", "NVML memory in use on rank 0's GPU"),
    "spotfill_mfu": ("gauge", "model FLOPs utilisation of the last step (when the GPU peak is known)"),
    "spotfill_hfu": ("gauge", "hardware FLOPs utilisation of the last step (recompute counted)"),
    "spotfill_checkpoint_stall_seconds": ("gauge", "training stall of the last checkpoint save"),
    "spotfill_restore_restore_prep_seconds": ("gauge", "last restore: download and conversion"),
    "spotfill_restore_load_seconds": ("gauge", "last restore: engine.load_checkpoint"),
    "spotfill_restore_startup_seconds": ("gauge", "last group start: training function entry to ready"),
    "spotfill_fillin_gpus": ("gauge", "GPUs lent to fill-in, per workload and node"),
    "spotfill_handback_seconds": ("gauge", "last reclaim: training's claim to the GPUs free"),
    "spotfill_job_running": ("gauge", "1 while the job runs"),
    "spotfill_gpu_seconds_total": ("counter", "GPU-seconds by state (training, checkpoint_stall, recovering, fillin)"),
    "spotfill_tokens_total": ("counter", "tokens trained (every step, rolled-back ones included)"),
    "spotfill_checkpoint_saves_total": ("counter", "checkpoint saves by kind (periodic, emergency, grow)"),
    "spotfill_checkpoints_committed_total": ("counter", "checkpoints committed to storage"),
    "spotfill_restarts_total": ("counter", "worker-group restarts by cause"),
    "spotfill_planned_exits_total": ("counter", "planned exits by reason (preemption, grow)"),
}
