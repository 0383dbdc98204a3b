"""A worker group's teardown without waiting on the dead.

Ray Train shuts a worker group down by first running its backend's shutdown on every worker (torch's
process-group teardown, waited for up to 30 s), then asking every worker to run its shutdown hooks and
waiting up to 5 s (its shutdown patience) for all of them before it kills them. A worker whose node died without notice
cannot answer until the GCS declares that node dead (its health checks: seconds here, 15-30 s with Ray's
defaults), so after every hard loss the restart sat behind that wait. Measured on the local cluster: the
new group's worker processes started 1.2 s after the restart was decided, right when the GCS declared the
node dead.

UnreachableWorkerReaper runs just before that shutdown: it asks every worker for its metadata, kills those
that do not answer within a short probe (their process or node is gone), and reports them in events.jsonl
(`workers_reaped`). Live workers still shut down gracefully. A failing probe never blocks the teardown.
"""
from __future__ import annotations

import logging
import time

import ray

from spotfill.ray_compat import WorkerGroupCallback, unreachable_workers, usable

log = logging.getLogger(__name__)

PROBE_S = 0.3     # a live worker answers a metadata call in milliseconds, even mid-step (its own thread);
                  # a slow one reaped by mistake only skips its graceful shutdown: the group is going anyway


class UnreachableWorkerReaper(WorkerGroupCallback):
    # ahead of Ray Train's own callbacks (ray_compat.callbacks_first): its backend callback's torch
    # process-group shutdown is the first thing that waits on dead workers
    spotfill_runs_first = True

    def __init__(self, sink_name: str, namespace: str, probe_s: float = PROBE_S):
        self.sink_name, self.namespace, self.probe_s = sink_name, namespace, probe_s
        self.enabled = usable("teardown_reaper")    # off (one warning) where Ray moved what it reads

    def before_worker_group_shutdown(self, worker_group) -> None:
        if not self.enabled:
            return
        try:
            t0 = time.time()
            gone = unreachable_workers(worker_group, self.probe_s)
            for _, _, actor in gone:
                ray.kill(actor, no_restart=True)
            if gone:
                sink = ray.get_actor(self.sink_name, namespace=self.namespace)
                sink.event.remote("workers_reaped", ranks=[r for r, _, _ in gone],
                                  nodes=sorted({n for _, n, _ in gone if n}), probe_s=round(time.time() - t0, 3),
                                  reason=f"no answer within {self.probe_s}s (process or node gone): killed so "
                                         f"the group's teardown does not wait out Ray Train's shutdown patience")
        except Exception as exc:  # never block or fail the teardown
            log.warning("spotfill: could not probe the worker group before its shutdown: %s", exc)
