"""A job's live numbers from its event stream (pure): what the live view, `spotfill status` and the event
sink's published snapshot show.

`Progress.update(event)` folds one event in and returns the one line a person should read about it, or
None (most steps: a step line is printed when STEP_LINE_EVERY_S of event time has passed, and for the
first step of every worker group and the last step). `snapshot()` is a JSON-able dict (the sink puts it in
Ray's key-value store for `spotfill status`); `Progress.from_snapshot` reads it back. GPUs by state come
from the same attribution as the Prometheus series (live.LiveMetrics); idle needs the cluster's capacity,
which only the viewer knows (`capacity` argument of gpus_by_state).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from spotfill.telemetry.ledger import LEASE_END_KINDS, workload_of
from spotfill.telemetry.live import LiveMetrics

STEP_LINE_EVERY_S = 10.0
LAST_EVENTS = 8
PHASE_NAMES = {"data_wait_s": "data wait", "forward_backward_s": "forward+backward", "optimizer_s": "optimizer",
               "collective_wait_s": "collective wait"}
NOTABLE_STATES = ("RESTARTING", "RESCHEDULING", "RESIZING", "ERRORED", "ABORTED")


def node_tail(e: dict) -> str:
    """A lease event's node as its id's last 8 hex digits: distinct for Ray's random ids and for the
    fake autoscaler's, which share their first 48 (ff...f00001)."""
    return "..." + str(e.get("node") or e.get("node_id") or "?")[-8:]


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "--:--:--"


def _fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


@dataclass
class Progress:
    job: str = "spotfill"
    steps_target: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    world_size: int = 0
    attempt: int | None = None
    state: str = "starting"               # starting | training | recovering | finished | failed
    split: dict = field(default_factory=dict)   # last step: data_wait_s, forward_backward_s, ...
    gpu: dict = field(default_factory=dict)     # last NVML reading (gpu_util, gpu_mem_used_gb, ...)
    device: str | None = None
    checkpoints: int = 0
    last_checkpoint_step: int | None = None
    last_stall_s: float | None = None
    restarts: int = 0
    started: float | None = None
    updated: float | None = None
    events: deque = field(default_factory=lambda: deque(maxlen=LAST_EVENTS))   # (t, line)
    live: LiveMetrics = field(default_factory=LiveMetrics)
    snapshot_gpus: dict | None = None          # read back from a snapshot (no LiveMetrics behind it)
    snapshot_gpu_seconds: dict | None = None
    _last_step_line: float | None = None
    _group_first_step: bool = True

    # -- folding events in ------------------------------------------------------------------------
    def update(self, e: dict, fold_live: bool = True) -> str | None:
        """Fold `e` in; `fold_live=False` when `self.live` is shared with a caller that already folded it
        (the event sink shares the Prometheus exporter's)."""
        kind, t = e.get("kind"), e.get("t")
        if fold_live:
            self.live.update(e)
        if t is not None:
            self.updated = max(self.updated or t, t)
        line = self._line(kind, e)
        if line is not None:
            self.events.append((t, line))
        return line

    def note(self, text: str, t: float | None = None) -> str:
        """A line from outside the event stream (the demo's own actions)."""
        self.events.append((t if t is not None else time.time(), text))
        return text

    def _line(self, kind: str, e: dict) -> str | None:
        if kind == "job_start":
            self.job = str(e.get("name") or self.job)
            self.steps_target = e.get("steps") or self.steps_target
            self.started = e.get("t")
            return f"job {self.job} started: {self.steps_target} steps, workers {e.get('workers')}"
        if kind == "step":
            return self._step(e)
        if kind == "attempt":
            # a run's first group may not be attempt 0 (numbering continues over one checkpoint store)
            restart = self.attempt is not None and e.get("cause") != "first start"
            self.attempt = e.get("attempt")
            if restart:
                self.restarts += 1
                self.state = "recovering"
                self.world_size = int(e.get("world_size") or self.world_size)   # the group being started
                return f"restart {e.get('attempt')} on {e.get('world_size')} workers: {e.get('cause', 'cause unknown')}"
            return None
        if kind in ("start", "resume"):
            self.state, self.world_size, self.attempt = "recovering", int(e.get("world_size") or 0), e.get("attempt")
            self.device = e.get("device") or self.device
            self._group_first_step = True
            where = f"from step {e.get('step')}" if kind == "resume" else "from scratch"
            return (f"attempt {e.get('attempt')}: {kind} {where} on {e.get('world_size')} workers "
                    f"({e.get('device') or 'device ?'}, startup {_fmt(e.get('startup_s'), '.1f')}s)")
        if kind == "planned_exit":
            self.state = "recovering"
            detail = f" ({e['detail']})" if e.get("detail") else ""
            return f"planned exit at step {e.get('step')}: {e.get('reason')}{detail}"
        if kind == "checkpoint_save":
            self.last_stall_s = e.get("stall_s")
            if e.get("emergency") or e.get("grow"):
                return (f"{'emergency' if e.get('emergency') else 'grow'} checkpoint at step {e.get('step')}: "
                        f"stall {_fmt(e.get('stall_s'), '.2f')}s, committed {e.get('committed')}")
            return None
        if kind == "checkpoint":
            self.checkpoints += 1
            self.last_checkpoint_step = e.get("step")
            return f"checkpoint committed at step {e.get('step')} ({_fmt(e.get('upload_s'), '.2f')}s upload)"
        if kind == "checkpoint_skipped":
            return f"checkpoint at step {e.get('step')} skipped: {e.get('reason')}"
        if kind == "checkpoint_quarantined":
            return f"checkpoint {e.get('tag')} quarantined: {e.get('reason')}"
        if kind == "fresh_start":
            return f"fresh start: {e.get('cause')}"
        if kind == "data_mismatch":
            return f"data mismatch on rank {e.get('rank')}: {e.get('reason')}"
        if kind == "controller_state" and e.get("state") in NOTABLE_STATES:
            why = f": {e.get('failure')}" if e.get("failure") else ""
            return f"Ray Train controller {e.get('previous')} -> {e.get('state')}{why}"
        if kind == "lease":
            return f"lent {e.get('gpus')} GPU(s) on node {node_tail(e)} to {workload_of(e)}"
        if kind in LEASE_END_KINDS:
            took = f" in {e['reclaim_s']:.2f}s" if e.get("reclaim_s") is not None else ""
            why = e.get("cause") or e.get("reason")
            return f"{kind} of {workload_of(e)}'s GPU(s) on node {node_tail(e)}{took}" + (f": {why}" if why else "")
        if kind == "finish":
            self.state = "finished" if e.get("ok") else "failed"
            return ("training finished" if e.get("ok") else f"training failed: {e.get('reason')}") + \
                f" at step {self.step}"
        return None

    def _step(self, e: dict) -> str | None:
        t = e.get("t")
        self.step = max(self.step, int(e.get("step") or 0))
        self.loss, self.world_size = e.get("loss", self.loss), int(e.get("world_size") or self.world_size)
        self.tokens_per_s = e.get("tokens_per_s") or ((e.get("tokens") or 0) / e["step_s"] if e.get("step_s") else None)
        self.mfu, self.hfu = e.get("mfu"), e.get("hfu")
        self.split = {k: e[k] for k in ("step_s", "data_wait_s", "forward_backward_s", "optimizer_s",
                                       "collective_wait_s") if e.get(k) is not None}
        if e.get("gpu_util") is not None:
            self.gpu = {k: e[k] for k in ("gpu_util", "gpu_mem_util", "gpu_mem_used_gb", "gpu_mem_total_gb")
                        if k in e}
        self.state = "training"
        due = (self._group_first_step or self._last_step_line is None or t is None
               or t - self._last_step_line >= STEP_LINE_EVERY_S or self.step == self.steps_target)
        self._group_first_step = False
        if not due:
            return None
        self._last_step_line = t
        return self.step_line()

    # -- what is shown ------------------------------------------------------------------------------
    def step_line(self) -> str:
        of = f"/{self.steps_target}" if self.steps_target else ""
        util = f" MFU {self.mfu:.1%}" if self.mfu is not None else ""
        return (f"step {self.step}{of} loss {_fmt(self.loss, '.4f')} {_fmt(self.tokens_per_s, ',.0f')} tokens/s"
                f"{util} world {self.world_size}")

    def gpus_by_state(self, capacity: float | None = None) -> dict:
        """GPUs now: training / recovering (the group's, by the live attribution), fill-in per workload,
        idle (capacity minus the rest, when the capacity is known)."""
        lm = self.live
        out: dict = {"training": 0, "recovering": 0}
        if lm.mode in ("training", "recovering"):
            out[lm.mode] = lm.gpus
        fill: dict[str, int] = {}
        for workload, _node, n in lm.leases.values():
            fill[workload] = fill.get(workload, 0) + n
        out["fillin"] = fill
        if capacity is not None:
            out["idle"] = max(0.0, capacity - out["training"] - out["recovering"] - sum(fill.values()))
        return out

    def split_shares(self) -> dict:
        s = self.split.get("step_s")
        if not s:
            return {}
        return {PHASE_NAMES[k]: self.split[k] / s for k in PHASE_NAMES if k in self.split}

    def snapshot(self, capacity: float | None = None) -> dict:
        return {"job": self.job, "state": self.state, "step": self.step, "steps_target": self.steps_target,
                "loss": self.loss, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "hfu": self.hfu,
                "world_size": self.world_size, "attempt": self.attempt, "restarts": self.restarts,
                "device": self.device, "split": dict(self.split), "gpu": dict(self.gpu),
                "checkpoints": self.checkpoints, "last_checkpoint_step": self.last_checkpoint_step,
                "last_stall_s": self.last_stall_s, "gpus": self.gpus_by_state(capacity),
                "gpu_seconds": {k: round(v, 3) for k, v in self.live.totals.items()},
                "started": self.started, "updated": self.updated,
                "last_events": [[t, line] for t, line in self.events]}

    @classmethod
    def from_snapshot(cls, snap: dict) -> "Progress":
        p = cls()
        for k in ("job", "state", "step", "steps_target", "loss", "tokens_per_s", "mfu", "hfu", "world_size",
                  "attempt", "restarts", "device", "split", "gpu", "checkpoints", "last_checkpoint_step",
                  "last_stall_s", "started", "updated"):
            if k in snap:
                setattr(p, k, snap[k])
        p.events.extend((t, line) for t, line in snap.get("last_events") or [])
        p.snapshot_gpus = snap.get("gpus") or {}       # what the publisher saw
        p.snapshot_gpu_seconds = snap.get("gpu_seconds") or {}
        return p

    def gpus(self, capacity: float | None = None) -> dict:
        snap = self.snapshot_gpus
        if snap is not None:
            out = dict(snap)
            if capacity is not None and "idle" not in out:
                out["idle"] = max(0.0, capacity - out.get("training", 0) - out.get("recovering", 0)
                                  - sum((out.get("fillin") or {}).values()))
            return out
        return self.gpus_by_state(capacity)

    def gpu_seconds(self) -> dict:
        snap = self.snapshot_gpu_seconds
        return dict(snap) if snap is not None else {k: round(v, 3) for k, v in self.live.totals.items()}

    def summary_lines(self, capacity: float | None = None, now: float | None = None) -> list[str]:
        """The live view as plain lines (what `spotfill status` prints per job)."""
        g = self.gpus(capacity)
        fill = ", ".join(f"{w} {n}" for w, n in sorted((g.get("fillin") or {}).items()))
        gpus = (f"GPUs: training {g.get('training', 0):g}, recovering {g.get('recovering', 0):g}"
                + (f", fill-in {fill}" if fill else "") + (f", idle {g['idle']:g}" if "idle" in g else ""))
        shares = self.split_shares()
        split = ", ".join(f"{k} {v:.0%}" for k, v in shares.items())
        mfu = (f"MFU {self.mfu:.1%} HFU {self.hfu:.1%}" if self.mfu is not None
               else f"MFU n/a ({'no known GPU peak' if self.device not in (None, 'cpu') else 'CPU'})")
        nvml = (f", NVML util {self.gpu['gpu_util']:.0%} mem {self.gpu.get('gpu_mem_used_gb', 0):.1f} GB"
                if self.gpu.get("gpu_util") is not None else "")
        age = f", last event {now - self.updated:.0f}s ago" if now and self.updated else ""
        lines = [f"job {self.job}: {self.state}, attempt {self.attempt}, {self.restarts} restart(s){age}",
                 f"  {self.step_line()}",
                 f"  {mfu}{nvml}",
                 f"  {gpus}"]
        if split:
            lines.append(f"  step split: {split}")
        lines.append(f"  checkpoints: {self.checkpoints} committed, last at step {self.last_checkpoint_step}, "
                     f"last stall {_fmt(self.last_stall_s, '.3f')}s")
        gs = self.gpu_seconds()
        if gs:
            lines.append("  GPU-seconds so far: " + ", ".join(f"{k} {v:,.1f}" for k, v in sorted(gs.items())))
        return lines
