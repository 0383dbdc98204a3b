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
    type = "serve"

    def __init__(self, spec: ServeTenantSpec):
        self.spec = spec
        url = spec.dashboard_url if "://" in spec.dashboard_url else f"http://{spec.dashboard_url}"
        self.scale_url = (f"{url.rstrip('/')}/api/v1/applications/{spec.app}/deployments/"
                          f"{spec.deployment}/scale")
        self.target: int | None = None      # last replica count asked for (None: not yet)

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
        return True
