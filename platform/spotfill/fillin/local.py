"""Serve fill-in on a cluster: deploy serving/app.py with the external scaler and hand its Generator to the
arbiter as a tenant. Used by `spotfill serve` (on a local embedded cluster) and the integration tests."""
from __future__ import annotations

import logging
import os

from spotfill.config.errors import ConfigError

log = logging.getLogger(__name__)


def repo_root() -> str:
    """The folder holding serving/ (next to platform/, where spotfill is imported from)."""
    import spotfill
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(spotfill.__file__))))
    if not os.path.isfile(os.path.join(root, "serving", "app.py")):
        raise ConfigError("serving", root, reason="serving/app.py not found next to platform/",
                          accepted="a spotfill checkout (serving/ lives in the repository, not the package)")
    return root


def runtime_env() -> dict:
    """Workers import spotfill and serving/ from where this process found them."""
    from spotfill.sim.cluster import worker_env
    env = worker_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], repo_root()])
    return {"env_vars": env}


# Serve places a replica on the node it fits best (the fewest GPUs left: a lent fragment on a small node before
# a node whose free GPUs training may still take as a whole group), not spread over the emptiest nodes
SERVE_CONTROLLER_ENV = {"RAY_SERVE_USE_PACK_SCHEDULING_STRATEGY": "1",
                        # Serve's control loop runs every 0.1 s by default, each pass reading the node list
                        # from the GCS: 0.5 s makes it (and the GCS's share) a fifth, beside training, and a
                        # scale-down the arbiter asks for starts at most 0.5 s later (hand-back target 5 s)
                        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                        # the HTTP proxy (started by the controller, with its environment) exports cached
                        # request metrics once a second, not every 0.1 s (serving/app.py QUIET_METRICS)
                        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def serve_controller_env(gpu_resource: str = "GPU") -> dict:
    """The Serve controller's environment for fill-in: pack replicas, best fit by GPUs first (a custom GPU
    resource such as GPU_SLOT is ranked first too; Serve ranks GPU, CPU, memory, then custom ones)."""
    env = dict(SERVE_CONTROLLER_ENV)
    if gpu_resource != "GPU":
        env["RAY_SERVE_HIGH_PRIORITY_CUSTOM_RESOURCES"] = gpu_resource
    return env


def start_serve(port: int, gpu_resource: str = "GPU") -> None:
    """Serve's controller and HTTP proxy (on the head, 127.0.0.1:`port`), packing replicas."""
    from ray import serve
    serve.start(http_options={"host": "127.0.0.1", "port": int(port), "location": "HeadOnly"},
                controller_options={"runtime_env": {"env_vars": serve_controller_env(gpu_resource)}})


def deploy_serve(checkpoint: str, *, port: int, dashboard_url: str, gpu_resource: str = "GPU_SLOT",
                 max_replicas: int = 2, arbiter=None, replicas: int = 1, **serve_args) -> dict:
    """Deploy the generation app on HTTP 127.0.0.1:`port` and register it with the arbiter (started if
    absent), which adopts the `replicas` Serve deployed and lends GPUs. `replicas=0` (an autoscaled
    cluster): only the arbiter's lends create replicas, so Serve never asks for a GPU the arbiter did not
    lend -- no demand the autoscaler would buy a node for. Returns {"url", "arbiter"}."""
    import sys
    import threading

    import ray
    from ray import serve

    root = repo_root()
    if root not in sys.path:
        sys.path.insert(0, root)
    from serving.app import APP_NAME, GENERATOR, GRACEFUL, ServeArgs, build
    from spotfill.fillin.arbiter import ensure_arbiter

    args = ServeArgs.parse({"checkpoint": checkpoint, "gpu_resource": gpu_resource, "replicas": int(replicas),
                            "max_replicas": max(1, int(max_replicas)), **serve_args})
    start_serve(port, gpu_resource)
    # serve.run returns once the app runs (its Ingress replica up); the arbiter is told about the tenant
    # meanwhile, so the Generator's replicas start on lent GPUs while the Ingress starts (the scale
    # endpoint refuses until Serve knows the deployment: the arbiter asks again on its next tick)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            serve.run(build(args), name=APP_NAME, route_prefix="/", blocking=False, external_scaler_enabled=True)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller below
            failed.append(exc)

    runner = threading.Thread(target=run, name="serve-run", daemon=True)
    runner.start()
    arbiter = arbiter or ensure_arbiter(gpu_resource, runtime_env=runtime_env())
    ray.get(arbiter.register_tenant.remote({
        "app": APP_NAME, "deployment": GENERATOR, "dashboard_url": dashboard_url, "max_replicas": max_replicas,
        "grace_s": GRACEFUL["graceful_shutdown_timeout_s"]}))
    runner.join()
    if failed:
        raise failed[0]
    return {"url": f"http://127.0.0.1:{port}", "arbiter": arbiter}
