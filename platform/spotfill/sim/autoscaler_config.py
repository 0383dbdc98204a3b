"""Node types for Ray's fake multi-node autoscaler, shaped like cluster.yaml's (pure: no Ray import).

    node_types:
      gpu_spot:     {gpus: 2, market: spot, min_workers: 0, max_workers: 2, priority: 10}
      gpu_ondemand: {gpus: 2, market: on-demand, min_workers: 0, max_workers: 1, priority: 0}

Every type carries `gpus` of `cluster.gpu_resource` (Ray's GPU resource by default, which Ray assigns on CPU
machines too; a logical one such as GPU_SLOT as an option) and as many CPUs, and the Ray labels cluster.yaml gives its nodes (`spotfill.io/market-type`,
`spotfill.io/role`). `fake_cluster_config` turns them into an autoscaler config that Ray's autoscaler v2
reads (the same keys `ray up` reads); `priority` orders the types as cluster.yaml's do (spot before
on-demand for a demand both can hold).
"""
from __future__ import annotations

from dataclasses import dataclass

from spotfill.config.errors import ConfigError

MARKET_LABEL = "spotfill.io/market-type"
ROLE_LABEL = "spotfill.io/role"
MARKETS = ("spot", "on-demand")
HEAD_TYPE = "ray.head.default"         # the fake provider's head node type name
NODE_TYPE_KEYS = {"gpus", "market", "min_workers", "max_workers", "priority"}
OBJECT_STORE_BYTES = 150 * 1024 * 1024  # per launched node, as the embedded cluster's static nodes


@dataclass(frozen=True)
class NodeTypeSpec:
    name: str
    gpus: int = 1
    market: str = "spot"
    min_workers: int = 0
    max_workers: int = 2
    priority: int = 0

    def labels(self) -> dict[str, str]:
        return {MARKET_LABEL: self.market, ROLE_LABEL: "gpu-worker"}

    def resources(self, gpu_resource: str) -> dict[str, float]:
        return {"CPU": self.gpus, gpu_resource: self.gpus, "object_store_memory": OBJECT_STORE_BYTES}


def _int(path: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(path, value, accepted=f"an integer >= {minimum}")
    return value


def parse_node_types(raw, path: str = "cluster.autoscaler.node_types") -> list[NodeTypeSpec]:
    """Validated node types (ConfigError naming the field otherwise)."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(path, raw, accepted="a mapping of node type name -> {gpus, market, min_workers, "
                                              "max_workers, priority}")
    out = []
    for name, spec in raw.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or not name or name == HEAD_TYPE:
            raise ConfigError(path, name, accepted=f"a node type name other than {HEAD_TYPE}")
        if not isinstance(spec, dict):
            raise ConfigError(where, spec, accepted="a mapping")
        for key in spec:
            if key not in NODE_TYPE_KEYS:
                raise ConfigError(f"{where}.{key}", spec[key], reason="unknown key", accepted=sorted(NODE_TYPE_KEYS))
        market = spec.get("market", "spot")
        if market not in MARKETS:
            raise ConfigError(f"{where}.market", market, accepted=list(MARKETS))
        t = NodeTypeSpec(name, gpus=_int(f"{where}.gpus", spec.get("gpus", 1), 1), market=market,
                         min_workers=_int(f"{where}.min_workers", spec.get("min_workers", 0), 0),
                         max_workers=_int(f"{where}.max_workers", spec.get("max_workers", 2), 0),
                         priority=_int(f"{where}.priority", spec.get("priority", 0), 0))
        if t.min_workers > t.max_workers:
            raise ConfigError(f"{where}.min_workers", t.min_workers, accepted=f"<= max_workers ({t.max_workers})")
        out.append(t)
    return out


def fake_cluster_config(node_types: list[NodeTypeSpec], gpu_resource: str, head_cpus: int,
                        provider: dict, idle_timeout_s: float, upscaling_speed: float = 1.0,
                        max_workers: int | None = None) -> dict:
    """An autoscaler config for a local fake cluster: a head with no GPU slots (like cluster.yaml's) and
    the given worker types. `provider` is the provider section (type and its own keys); `max_workers` caps
    the worker nodes of all types together (cluster.yaml's top-level max_workers; default: the types' sum)."""
    types = {HEAD_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "min_workers": 0, "max_workers": 0,
                         "labels": {MARKET_LABEL: "on-demand", ROLE_LABEL: "head"}}}
    for t in node_types:
        types[t.name] = {"resources": t.resources(gpu_resource), "node_config": {}, "labels": t.labels(),
                         "min_workers": t.min_workers, "max_workers": t.max_workers, "priority": t.priority}
    return {
        "cluster_name": "spotfill-fake",
        "max_workers": sum(t.max_workers for t in node_types) if max_workers is None else max_workers,
        "upscaling_speed": upscaling_speed,
        "idle_timeout_minutes": idle_timeout_s / 60.0,
        "provider": {"use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, **provider},
        "available_node_types": types,
        "head_node_type": HEAD_TYPE,
        "auth": {}, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }
