"""The Serve tenant adapter: how a Ray Serve deployment grows onto lent GPUs and gives them back.

Grow and shrink go through Serve's public external-scaler path: the application is deployed with
`external_scaler_enabled: true`, and the dashboard's REST endpoint
`POST /api/v1/applications/<app>/deployments/<deployment>/scale {"target_num_replicas": n}` sets the
replica count (Ray 2.60: dashboard/modules/serve/serve_head.py -> ServeController.update_deployment_replicas).
Short graceful-shutdown settings on the deployment make a stopping replica drain in well under a second;
Serve routes no new request to a stopping replica. Serve cannot be told which replica to stop, so the
arbiter reclaims by count. What the tenant holds is read from Ray's public state API (its replica actors,
their nodes), which is also how leases are rebuilt after an arbiter restart.
"""
from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

from spotfill.fillin.policy import Holding

log = logging.getLogger(__name__)

# The replica count the arbiter last set, per Serve deployment (GCS key-value store, namespace spotfill): the
# app's Ingress forwards to the deployment's replicas only while it is above 0. Serve's cold-start rule
# starts a replica by itself while requests wait at a handle with none running; the arbiter stops it, but
# an Ingress that forwarded to it queued requests at the handle again -- a demo's notice restart saw 7 such
# replicas started and stopped in 20 s (the floor answered meanwhile).
TARGET_KEY = "fillin/serve-target/"


def publish_target(app: str, deployment: str, n: int) -> None:
    """Record the count the arbiter set (a failure is logged: the Ingress then forwards as before)."""
    try:
        from spotfill.ray_compat import kv_put
        kv_put(f"{TARGET_KEY}{app}/{deployment}", str(int(n)))
    except Exception as exc:  # noqa: BLE001 -- the Ingress keeps its last reading
        log.warning("serve tenant %s/%s: target %d not published (%s)", app, deployment, n, exc)


def lent_target(app: str, deployment: str) -> int | None:
    """The count the arbiter last set for the deployment; None when none was published (no arbiter)."""
    from spotfill.ray_compat import kv_get
    raw = kv_get(f"{TARGET_KEY}{app}/{deployment}")
    if raw is None:
        return None
    try:
        return int(raw.decode() if isinstance(raw, bytes) else raw)
    except ValueError:
        return None


@dataclass(frozen=True)
class ServeTenantSpec:
    app: str = "spotfill-serve"
    deployment: str = "Generator"
    dashboard_url: str = ""            # http://127.0.0.1:8265
    max_replicas: int = 4
    gpus_per_replica: int = 1
    grace_s: float = 3.0               # graceful_shutdown_timeout_s of the deployment
    kind: str = "serve"

    @property
    def tenant(self) -> str:
        return f"serve:{self.app}/{self.deployment}"

    def as_dict(self) -> dict:
        return asdict(self)


class ServeTenant:
    """Serve's side of a tenant: its scale call and what it holds. The arbiter keeps it as `kept()` -- a
    tenant_calls.Scaled, the fill-in `Tenant` (fillin/tenant.py) whose scale calls go out off its lock."""

    def __init__(self, spec: ServeTenantSpec):
        self.spec = spec
        url = spec.dashboard_url if "://" in spec.dashboard_url else f"http://{spec.dashboard_url}"
        self.scale_url = (f"{url.rstrip('/')}/api/v1/applications/{spec.app}/deployments/"
                          f"{spec.deployment}/scale")
        self.target: int | None = None      # last replica count asked for (None: not yet)

    @classmethod
    def from_spec(cls, spec: dict) -> "ServeTenant":
        return cls(ServeTenantSpec(**spec))

    def kept(self, calls):
        from spotfill.fillin.tenant_calls import Scaled
        return Scaled(self, calls)

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    @property
    def wanted_units(self) -> int:
        return self.spec.max_replicas

    def holdings(self) -> list[Holding]:
        """Replicas of the deployment that hold a GPU (alive, or starting on a node), one Holding each (its
        actor id is the lease id)."""
        from spotfill.ray_compat import gcs_actors

        name = f"ServeReplica:{self.spec.app}:{self.spec.deployment}"
        # a replica still starting already holds its GPU once it has a node: it is lent, and reclaimable.
        # Read from the GCS, not the State API: no dashboard round trip every tick
        return [Holding(self.tenant, self.spec.kind, a["node_id"], self.spec.gpus_per_replica, key=a["actor_id"],
                        reclaim_method="serve_scale", grace_s=self.spec.grace_s, since=a["start_time"])
                for a in gcs_actors(("ALIVE", "PENDING_CREATION")) if a["class_name"] == name and a["node_id"]]

    def set_replicas(self, n: int) -> bool:
        """Ask Serve for `n` replicas (0..max_replicas). False (logged) when Serve refused or is absent:
        e.g. the application is not deployed yet."""
        n = max(0, min(int(n), self.spec.max_replicas))
        body = json.dumps({"target_num_replicas": n}).encode()
        from spotfill.ray_compat import dashboard_auth_headers
        req = urllib.request.Request(self.scale_url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **dashboard_auth_headers()})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            detail = exc.read().decode(errors="replace")[:200] if isinstance(exc, urllib.error.HTTPError) else ""
            log.warning("serve tenant %s: scale to %d refused: %s %s", self.tenant, n, exc, detail)
            return False
        self.target = n
        publish_target(self.spec.app, self.spec.deployment, n)
        return True


def describe_serve_app(app: str, deployment: str, gpu_resource: str = "GPU", dashboard_url: str | None = None) -> dict:
    """What the arbiter needs to know about a deployed Serve application to lend it GPUs, read from the
    dashboard's Serve REST API (GET /api/serve/applications/; the dashboard the head registered when
    `dashboard_url` is None): {"grace_s", "gpus_per_replica", "dashboard_url"}. ConfigError when the app or
    deployment is not deployed, the app was deployed without external_scaler_enabled (the arbiter could not
    set its replica count), or its replicas ask for no `gpu_resource`."""
    import math

    from spotfill.config.errors import ConfigError
    from spotfill.ray_compat import dashboard_auth_headers
    if dashboard_url is None:
        from spotfill.ray_compat import dashboard_url as registered
        dashboard_url = registered() or "127.0.0.1:8265"
    url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    req = urllib.request.Request(f"{url.rstrip('/')}/api/serve/applications/", headers=dashboard_auth_headers())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            apps = json.loads(resp.read()).get("applications") or {}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConfigError("dashboard_url", dashboard_url, reason=f"Serve's REST API did not answer ({exc})",
                          accepted="the Ray dashboard's address, e.g. 127.0.0.1:8265") from None
    if app not in apps:
        raise ConfigError(f"serve app {app}", reason="not deployed", accepted=", ".join(sorted(apps)) or "none deployed")
    if not apps[app].get("external_scaler_enabled"):
        raise ConfigError(f"serve app {app}", reason="deployed without external_scaler_enabled, so the arbiter "
                          "cannot set its replica count", accepted="redeploy it with external_scaler_enabled: true")
    deployments = apps[app].get("deployments") or {}
    if deployment not in deployments:
        raise ConfigError(f"serve deployment {deployment}", reason=f"not a deployment of {app}",
                          accepted=", ".join(sorted(deployments)))
    cfg = deployments[deployment].get("deployment_config") or {}
    opts = cfg.get("ray_actor_options") or {}

    def gpus_in(resources: dict) -> float:
        if gpu_resource == "GPU":
            return float(resources.get("num_gpus") or resources.get("GPU") or 0)
        return float((resources.get("resources") or {}).get(gpu_resource) or resources.get(gpu_resource) or 0)
    gpus = gpus_in(opts) + sum(gpus_in(b) for b in cfg.get("placement_group_bundles") or [])
    if gpus <= 0:
        raise ConfigError(f"serve deployment {app}/{deployment}", reason=f"its replicas ask for no {gpu_resource}",
                          accepted=f"a deployment whose replicas use {gpu_resource} (ray_actor_options or "
                                   "placement_group_bundles)")
    return {"grace_s": float(cfg.get("graceful_shutdown_timeout_s") or 20.0), "gpus_per_replica": math.ceil(gpus),
            "dashboard_url": dashboard_url}


def lend_to_serve_app(app: str, deployment: str, *, max_replicas: int, gpu_resource: str = "GPU",
                      dashboard_url: str | None = None) -> dict:
    """Make any deployed Serve application with external_scaler_enabled a fill-in tenant by name (a Ray Serve
    LLM / vLLM deployment, or any other), checked first (describe_serve_app): the arbiter (started if absent)
    sets its replica count on GPUs training cannot use and takes them back for training, like spotfill's own
    app. Its GPUs per replica and grace come from the deployment. Returns the arbiter's answer."""
    from spotfill.config.errors import ConfigError
    from spotfill.fillin.wiring import register_serve_app
    if int(max_replicas) < 1:
        raise ConfigError("max_replicas", max_replicas, accepted="an integer >= 1")
    info = describe_serve_app(app, deployment, gpu_resource, dashboard_url)
    return register_serve_app(app, deployment, gpu_resource=gpu_resource, max_replicas=int(max_replicas),
                              grace_s=info["grace_s"], gpus_per_replica=info["gpus_per_replica"],
                              dashboard_url=info["dashboard_url"])
