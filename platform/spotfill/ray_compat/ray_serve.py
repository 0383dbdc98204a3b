"""Ray Serve's private names: the running replicas of a deployment, pushed by the controller.

Serve's routers learn a deployment's running replicas from the controller's long poll
(LongPollNamespace.DEPLOYMENT_TARGETS): one pending call per listener, answered when the set changes (a
replica starts running, or is told to stop and gets no new request). The fill-in Ingress listens to the
same push instead of calling serve.status() every 0.1 s; where this Ray lacks the push (hook
serve_replica_watch), it polls the public serve.status() instead. Importing ray.serve costs about 0.4 s,
so nothing here is imported by the processes that do not serve (training workers).
"""
from __future__ import annotations

import logging
import os
import threading

from spotfill.ray_compat.hooks import usable

log = logging.getLogger(__name__)
POLL_S = 0.25     # the fallback's serve.status() period


def check_serve_hooks() -> bool:
    """Whether the controller's push of running replicas is there (False: one warning, the Ingress polls)."""
    return usable("serve_replica_watch")


def watch_running_replicas(app: str, deployment: str, on_change, event_loop):
    """Call `on_change(n, ids)` with the number of running replicas of `app`'s `deployment` and their ids
    (`serve.get_replica_context().replica_id.unique_id`) each time the Serve controller announces a change (no
    call while nothing changes; none at all before the deployment's first running replica). A replica told to
    stop leaves the set at once. The callbacks run on `event_loop`, which must keep running. Returns the
    listener; its `is_running` turns False when the controller went away (a new controller: watch again).
    Where this Ray lacks the push (hook serve_replica_watch), a StatusPoller reports `on_change(n, None)`:
    serve.status() counts the running replicas but names none."""
    import ray

    if not check_serve_hooks():
        return StatusPoller(app, deployment, on_change, event_loop)
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve._private.long_poll import LongPollClient, LongPollNamespace
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    key = (LongPollNamespace.DEPLOYMENT_TARGETS, DeploymentID(name=deployment, app_name=app))

    def ids(info) -> list[str]:      # RunningReplicaInfo.replica_id.unique_id (a plain id as it is)
        return [str(getattr(getattr(r, "replica_id", None), "unique_id", r)) for r in info.running_replicas]
    return LongPollClient(controller, {key: lambda info: on_change(len(info.running_replicas), ids(info))},
                          call_in_event_loop=event_loop,
                          client_id=f"spotfill-replica-watch:{app}/{deployment}:{os.getpid()}")


class StatusPoller:
    """The replica watch over the public serve.status(), every POLL_S: `on_change(n, None)` (on
    `event_loop`) when the count of RUNNING replicas changes (serve.status() names no replica); `is_running` turns False when serve.status() fails."""

    def __init__(self, app: str, deployment: str, on_change, event_loop, poll_s: float = POLL_S):
        self.app, self.deployment, self.on_change, self.loop = app, deployment, on_change, event_loop
        self.poll_s = poll_s
        self.is_running = True
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="replica-status-poll").start()

    def running(self) -> int | None:
        from ray import serve
        app = serve.status().applications.get(self.app)
        dep = app.deployments.get(self.deployment) if app else None
        return None if dep is None else int(dep.replica_states.get("RUNNING", 0))

    def _run(self) -> None:
        last = None
        try:
            while not self._stop.wait(0 if last is None else self.poll_s):
                n = self.running()
                if n is not None and n != last and (last is not None or n > 0):
                    self.loop.call_soon_threadsafe(self.on_change, n, None)
                last = n if n is not None else last if last is not None else 0
        except Exception as exc:  # noqa: BLE001 - the controller went away: the caller watches again
            log.warning("replica status poll ended: %s", exc)
        self.is_running = False

    def stop(self) -> None:
        self._stop.set()
