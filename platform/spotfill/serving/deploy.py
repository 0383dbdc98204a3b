"""Deploying spotfill's Serve generation app (spotfill/serving/app.py) on a cluster: Serve's controller set up
for fill-in (replicas packed onto lent GPUs), the app deployed with `external_scaler_enabled` so the fill-in
arbiter sets its Generator's replica count. Used by `spotfill serve` and the scenario runner."""
from __future__ import annotations


# Serve places a replica on the node it fits best (the fewest GPUs left: a lent fragment on a small node before
# a node whose free GPUs training may still take as a whole group), not spread over the emptiest nodes
SERVE_CONTROLLER_ENV = {"RAY_SERVE_USE_PACK_SCHEDULING_STRATEGY": "1",
                        # Serve's control loop runs every 0.1 s by default, each pass reading the node list
                        # from the GCS: 0.5 s makes it (and the GCS's share) a fifth, beside training, and a
                        # scale-down the arbiter asks for starts at most 0.5 s later (hand-back target 5 s)
                        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                        # the HTTP proxy (started by the controller, with its environment) exports cached
                        # request metrics once a second, not every 0.1 s (spotfill/serving/app.py QUIET_METRICS)
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


def deploy_serve(checkpoint: str, *, port: int, gpu_resource: str = "GPU", max_replicas: int = 2,
                 replicas: int = 0, **serve_args) -> dict:
    """Deploy spotfill's generation app (spotfill/serving/app.py) on HTTP 127.0.0.1:`port`. With `replicas` 0 (the
    default) only the arbiter's lends create Generator replicas -- the app registers itself with the arbiter
    as `serve deploy serving/config.yaml` does -- so Serve never asks for a GPU the arbiter did not lend. The
    arbiter must already run with the caller's settings, or is started with the defaults. Returns {"url"}."""
    from ray import serve

    from spotfill.serving.app import APP_NAME, ServeArgs, build

    args = ServeArgs.parse({"checkpoint": checkpoint, "gpu_resource": gpu_resource, "replicas": int(replicas),
                            "max_replicas": max(1, int(max_replicas)), **serve_args})
    start_serve(port, gpu_resource)
    serve.run(build(args), name=APP_NAME, route_prefix="/", blocking=False, external_scaler_enabled=True)
    return {"url": f"http://127.0.0.1:{port}"}
