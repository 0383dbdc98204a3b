"""Export the event stream as `spotfill_*` metrics through Ray's metrics API (ray.util.metrics), so the
metrics endpoint of the node whose process records them carries them (Ray prefixes `ray_`:
`ray_spotfill_training_step`, `ray_spotfill_gpu_seconds_total{state=...}`; see docs/metrics.md).

`record(event)` is the hook: the event sink calls it for every event it writes (EventLog's `on_event`).
It never raises: a metrics failure is logged once and training goes on.
"""
from __future__ import annotations

import logging
import threading

from spotfill.telemetry.live import METRICS, LiveMetrics, MetricUpdate

log = logging.getLogger(__name__)


class Exporter:
    """Ray metric objects, created on first use with the tag keys they are first used with."""

    def __init__(self):
        self.live = LiveMetrics()
        self._metrics: dict[str, object] = {}
        self._lock = threading.Lock()
        self._warned = False

    def record(self, event: dict) -> MetricUpdate | None:
        try:
            with self._lock:
                update = self.live.update(event)
                self.apply(update)
            return update
        except Exception as exc:  # telemetry must never stop training
            if not self._warned:
                self._warned = True
                log.warning("spotfill metrics export failed (later failures not logged): %s", exc)
            return None

    def apply(self, update: MetricUpdate) -> None:
        for (name, tags), value in update.gauges.items():
            self._metric(name, tags).set(float(value), tags=dict(tags))
        for (name, tags), value in update.counters.items():
            if value > 0:
                self._metric(name, tags).inc(float(value), tags=dict(tags))

    def _metric(self, name: str, tags: tuple):
        key = f"{name}|{','.join(k for k, _ in tags)}"
        m = self._metrics.get(key)
        if m is None:
            from ray.util.metrics import Counter, Gauge
            kind, description = METRICS[name]
            cls = Counter if kind == "counter" else Gauge
            m = cls(name, description=description, tag_keys=tuple(k for k, _ in tags))
            self._metrics[key] = m
        return m


_exporter: Exporter | None = None
_exporter_lock = threading.Lock()


def exporter() -> Exporter:
    global _exporter
    with _exporter_lock:
        if _exporter is None:
            _exporter = Exporter()
        return _exporter


def record(event: dict) -> None:
    """The event sink's per-event hook."""
    exporter().record(event)
