"""Fill-in on a cluster, wired in one place: the arbiter, the training jobs it must put first, the tenants.

Every way spotfill runs calls these, the same way: `jobs/pretrain.py` and the SDK (TrainingJob.fit announces
its job), a deployed Serve app (spotfill/serving/app.py registers itself -- `serve deploy`, `serve run`, `spotfill
serve` alike), batch and sweep drivers submitted with `ray job submit` (fillin/grant.py), `spotfill status`,
and the scenario runner behind `spotfill demo`, which adds only fake nodes, a timeline and invariants.
Deploying spotfill's own Serve app is spotfill/serving/deploy.py (the app sits above fill-in).

    arbiter(...)            the running arbiter, or one started detached on the head. Whether the cluster
                            autoscales is found out on the head (fillin/cluster_kind.py), not passed in.
    announce_training(...)  a training job that fill-in must never take GPUs from: recorded in the GCS's
                            key-value store (an arbiter started later reads it) and told to a running arbiter
    register_serve_app(...) a Serve application deployed with `external_scaler_enabled` becomes a tenant
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

from spotfill.fillin.arbiter import ensure_arbiter
# training's side of the protocol (train/arbiter_link.py), re-exported: fill-in's one place to wire things
from spotfill.train.arbiter_link import (TRAINING_KEY, announce_training, get_arbiter,  # noqa: F401
                                         training_record, withdraw_training)
from spotfill.fillin.policy import DEFAULT_ORDER

log = logging.getLogger("spotfill.fillin.wiring")


# -- where the library is, for processes Ray starts --------------------------------------------
def library_env() -> dict[str, str]:
    """PYTHONPATH that finds the spotfill this process imported (a checkout's platform/ or site-packages),
    ahead of the caller's."""
    import spotfill
    platform_dir = os.path.dirname(os.path.dirname(os.path.abspath(spotfill.__file__)))
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": platform_dir + (os.pathsep + path if path else "")}


def runtime_env() -> dict:
    """A runtime_env whose workers import spotfill from where this process found it (the Serve app too:
    spotfill/serving/app.py)."""
    return {"env_vars": library_env()}


def connect_ray(runtime_env: dict | None = None) -> None:
    """Connect a driver to its job's cluster (RAY_ADDRESS inside a Ray job) or start a local one."""
    import ray

    if not ray.is_initialized():
        ray.init(runtime_env=runtime_env or None, log_to_driver=True)


# -- the arbiter ------------------------------------------------------------------------------------------
def arbiter(gpu_resource: str = "GPU", *, order: tuple[str, ...] = DEFAULT_ORDER, state_path: str | None = None,
            runtime_env: dict | None = None, autoscaled: bool | None = None, launch_nodes: bool = False,
            idle_reclaim_s: float | None = None, dashboard_url: str | None = None, turn_s: float | None = None):
    """The running arbiter, else one started detached on the head with these settings. `autoscaled` None:
    the arbiter finds out on the head whether an autoscaler may add and remove nodes (the settings of an
    arbiter already running are its own)."""
    running = get_arbiter()
    if running is not None:
        return running
    return ensure_arbiter(gpu_resource, order=tuple(order), state_path=state_path, runtime_env=runtime_env,
                          dashboard_url=dashboard_url, autoscaled=autoscaled, launch_nodes=launch_nodes,
                          idle_reclaim_s=idle_reclaim_s, turn_s=turn_s)


# -- training jobs ----------------------------------------------------------------------------------------
def _records(prefix: str, what: str) -> list[dict]:
    """The JSON records under `prefix` in the GCS key-value store (an unreadable one is logged and skipped)."""
    from spotfill import ray_compat
    out = []
    for key in ray_compat.kv_list(prefix):
        try:
            out.append(json.loads(ray_compat.kv_get(key)))
        except (TypeError, ValueError):
            log.warning("fill-in: unreadable %s record %s ignored", what, key)
    return out


def announced_training() -> list[dict]:
    """Every training record in the GCS key-value store (the arbiter reads these on its ticks)."""
    return _records(TRAINING_KEY, "training")


def announced_coming(now: float) -> set[str]:
    """The nodes training runs wait to grow onto (train.arbiter_link.announce_coming), whose time has not run
    out."""
    from spotfill.train.arbiter_link import COMING_KEY, coming_nodes
    return coming_nodes(_records(COMING_KEY, "coming-nodes"), now)


# -- Serve tenants ----------------------------------------------------------------------------------------
def register_serve_app(app: str, deployment: str, *, gpu_resource: str = "GPU", max_replicas: int = 4,
                       grace_s: float = 3.0, gpus_per_replica: int = 1, dashboard_url: str = "",
                       runtime_env: dict | None = None) -> dict:
    """Make the Serve deployment `app`/`deployment` (deployed with external_scaler_enabled) a fill-in tenant:
    the arbiter (started if absent) sets its replica count through Serve's scale endpoint on the dashboard
    (`dashboard_url`, found by the arbiter when empty). Returns the arbiter's answer."""
    import ray
    handle = arbiter(gpu_resource, runtime_env=runtime_env)
    return ray.get(handle.register_tenant.remote({
        "app": app, "deployment": deployment, "dashboard_url": dashboard_url, "max_replicas": int(max_replicas),
        "gpus_per_replica": int(gpus_per_replica), "grace_s": float(grace_s)}), timeout=60)


def register_in_background(app: str, deployment: str, retry_s: float = 2.0, **kwargs) -> threading.Thread:
    """register_serve_app from a thread that retries until it succeeds (a Serve replica's constructor must
    not wait on the arbiter's start, and a restarting GCS or arbiter only delays the registration)."""
    def run() -> None:
        delay = retry_s
        while True:
            try:
                answer = register_serve_app(app, deployment, **kwargs)
                log.info("fill-in: %s/%s registered with the arbiter (%s)", app, deployment, answer.get("tenant"))
                return
            except Exception as exc:  # noqa: BLE001 - retried
                log.warning("fill-in: registering %s/%s with the arbiter failed (%s: %s); retrying in %.0fs",
                            app, deployment, type(exc).__name__, exc, delay)
                time.sleep(delay)
                delay = min(30.0, delay * 2)

    thread = threading.Thread(target=run, name=f"fillin-register-{app}", daemon=True)
    thread.start()
    return thread
