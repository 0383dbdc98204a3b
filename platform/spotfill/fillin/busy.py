"""Busy time, measured by the tenant: how long a lent GPU actually computed.

A lease says a tenant *held* a GPU (report.json `gpu_seconds.fillin_reserved`); it does not say the tenant
used it -- worker start, imports, loading a checkpoint, an idle replica and the reclaim grace are all held
time. Each tenant therefore times its own compute (a batch unit's evaluation or generation, a sweep trial's
optimizer steps, a Serve generation step) and reports it as `fillin_busy` events:

    fillin_busy {tenant, workload, node, lease_id, gpus, busy_s, t0, t1}
        the tenant's `gpus` GPUs computed `busy_s` seconds (each) between t0 and t1

sent to the fill-in arbiter (`Arbiter.report_busy`), which journals them; every training run's driver copies
the journal into its events.jsonl (train/arbiter_link.py LeaseForwarder), where the GPU-seconds ledger books them as
`gpu_seconds.fillin_busy` and the harvest ratio is computed on them (telemetry/ledger.py). `lease_id` is the
holder's key as the arbiter's lease has it (the actor id; a placement group's `<group id>:<bundle index>`),
so the report can say, per lease, how long after the lend its GPU first computed (`lend_to_busy_s`).

`BusyMeter` is the pure part (spans in, events out; overlapping spans -- concurrent requests -- count once).
`BusyReporter` runs in the tenant's process and sends what the meter took, at most every FLUSH_S, without
waiting for an answer; with no arbiter on the cluster (a job on GPUs of its own) nothing is sent.

Serve's Generator (serving/app.py) reports through `serve_reporter(app, deployment)`:

    self.busy = serve_reporter(app_name, deployment_name)     # in the replica's constructor
    with self.busy.measure():                                   # around each generation step (one batch)
        ...
    self.busy.flush()                                           # when the replica shuts down
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

log = logging.getLogger("spotfill.fillin.busy")
FLUSH_S = 2.0              # a tenant sends what it measured at most this often (and when it stops)
ARBITER_RETRY_S = 10.0     # no arbiter found: look again after this long


class BusyMeter:
    """Compute spans -> `fillin_busy` events. Thread-safe; overlapping spans count once."""

    def __init__(self, tenant: str, workload: str, gpus: int = 1, node: str | None = None,
                 lease_id: str | None = None, clock: Callable[[], float] = time.time):
        self.tenant, self.workload, self.gpus = tenant, workload, int(gpus)
        self.node, self.lease_id, self.clock = node, lease_id, clock
        self._lock = threading.Lock()
        self._t0: float | None = None        # first span's start since the last take
        self._t1 = 0.0                       # the last span's end
        self._busy = 0.0
        self._covered = float("-inf")        # spans are counted up to here (overlaps count once)
        self.total_s = 0.0                   # everything measured, for the tenant's own summary

    def add(self, start: float, end: float) -> None:
        with self._lock:
            start = max(start, self._covered)
            if end <= start:
                return
            self._t0 = start if self._t0 is None else self._t0
            self._t1 = max(self._t1, end)
            self._busy += end - start
            self.total_s += end - start
            self._covered = end

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        start = self.clock()
        try:
            yield
        finally:
            self.add(start, self.clock())

    def due(self, now: float, every_s: float = FLUSH_S) -> bool:
        with self._lock:
            return self._t0 is not None and now - self._t0 >= every_s

    def take(self) -> dict | None:
        """The event for what was measured since the last take (None: nothing)."""
        with self._lock:
            if self._t0 is None:
                return None
            event = {"t": round(self._t1, 3), "kind": "fillin_busy", "tenant": self.tenant,
                     "workload": self.workload, "node": self.node, "lease_id": self.lease_id, "gpus": self.gpus,
                     "busy_s": round(self._busy, 4), "t0": round(self._t0, 3), "t1": round(self._t1, 3)}
            self._t0, self._busy = None, 0.0
            return event


def check_busy(events: list, now: float) -> list[dict]:
    """The well-formed `fillin_busy` events of a tenant's report (the arbiter journals only these): a tenant
    name, t0 <= t1 <= now (+ 5 s of clock skew), 0 <= busy_s, at most t1 - t0 (capped)."""
    out = []
    for e in events if isinstance(events, list) else []:
        try:
            if not isinstance(e, dict) or e.get("kind") != "fillin_busy" or not isinstance(e.get("tenant"), str):
                continue
            t0, t1, busy = float(e["t0"]), float(e["t1"]), float(e["busy_s"])
            if not (0.0 <= busy and t0 <= t1 <= now + 5.0):
                continue
            out.append({**e, "t": t1, "busy_s": round(min(busy, t1 - t0), 4), "gpus": int(e.get("gpus") or 1)})
        except (KeyError, TypeError, ValueError):
            continue
    return out


def holder_key(gpu_resource: str = "GPU") -> str | None:
    """The arbiter's lease id for the GPU this process holds: `<group id>:<bundle index>` inside a placement
    group (the first bundle asking for `gpu_resource`; Tune's trial groups), else the actor id (a Serve
    replica, a Ray Data actor)."""
    import ray
    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    if pg:
        from ray.util import get_current_placement_group
        current = get_current_placement_group()
        specs = current.bundle_specs if current is not None else []
        index = next((i for i, b in enumerate(specs) if float(b.get(gpu_resource, 0)) > 0), 0)
        return f"{pg}:{index}"
    return ctx.get_actor_id()


class BusyReporter:
    """A tenant process's meter and its link to the arbiter (see the module's doc)."""

    def __init__(self, tenant: str, workload: str, gpus: int = 1, gpu_resource: str = "GPU",
                 flush_s: float = FLUSH_S):
        import ray
        node, key = None, None
        try:        # never ray.init() here: outside a Ray worker the meter measures, unmatched to a lease
            if ray.is_initialized():
                node, key = ray.get_runtime_context().get_node_id(), holder_key(gpu_resource)
        except Exception as exc:  # noqa: BLE001 - outside a Ray worker: measured, not matched to a lease
            log.debug("no Ray context for the busy meter: %s", exc)
        self.meter = BusyMeter(tenant, workload, gpus, node=node, lease_id=key)
        self.flush_s = flush_s
        self._arbiter, self._looked_at = None, float("-inf")
        self.sent = self.dropped = 0

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        with self.meter.measure():
            yield
        if self.meter.due(time.time(), self.flush_s):
            self.flush()

    def flush(self) -> None:
        """Send what was measured (never raises, never waits for the arbiter)."""
        event = self.meter.take()
        if event is None:
            return
        arbiter = self._find_arbiter()
        if arbiter is None:
            self.dropped += 1
            return
        try:
            arbiter.report_busy.remote([event])
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 - busy time is telemetry: the tenant's work goes on
            self.dropped += 1
            self._arbiter = None
            log.debug("busy time not sent: %s", exc)

    def send(self, events: list[dict]) -> bool:
        """Send other events of this tenant to the arbiter's journal (Arbiter.report_events: how a replica
        started); never raises, never waits."""
        arbiter = self._find_arbiter()
        if arbiter is None:
            return False
        try:
            arbiter.report_events.remote(events)
            return True
        except Exception as exc:  # noqa: BLE001 - telemetry: the tenant's work goes on
            log.debug("events not sent: %s", exc)
            return False

    def _find_arbiter(self):
        if self._arbiter is None and time.monotonic() - self._looked_at >= ARBITER_RETRY_S:
            self._looked_at = time.monotonic()
            try:
                import ray

                from spotfill.fillin.arbiter_handle import get_arbiter
                self._arbiter = get_arbiter() if ray.is_initialized() else None
            except Exception as exc:  # noqa: BLE001
                log.debug("no arbiter for busy time: %s", exc)
        return self._arbiter


def serve_reporter(app: str, deployment: str, gpus: int = 1, gpu_resource: str = "GPU") -> BusyReporter:
    """The busy meter of a Serve replica of `app`/`deployment` (tenant `serve:<app>/<deployment>`, as
    fillin/serve_tenant.py names it)."""
    return BusyReporter(f"serve:{app}/{deployment}", "serve", gpus, gpu_resource)
