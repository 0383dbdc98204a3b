"""Preflight: the job's needs against what the cluster can ever offer, decided in seconds, before any worker
(GPU time) starts. Without it, a misspelled `cluster.gpu_resource` or a `training.workers` minimum the
cluster cannot hold leaves Ray Train waiting for a placement group forever.

The decisions are pure (no Ray import): `resource_problem` takes the alive nodes' total resources and, where
the cluster autoscales, the node types the autoscaler could add; `seq_len_problem` takes the prepared
dataset's manifest. Each returns None or a `Problem` whose `error()` is a one-line ConfigError (exit 2).

Where the node types come from. Ray 2.60 has no public API that lists an autoscaler's node types:
`ray.autoscaler.sdk` only acts on a cluster-config file you hand it (`ray up`, `fillout_defaults`), and
autoscaler v2's `get_cluster_status` (ray.autoscaler.v2.sdk, not a stable public API) lists nodes and
pending launches by type name, without the types' resources or max counts. A `ray up` cluster (such as
this repository's cluster.yaml) keeps the autoscaler's config at ~/ray_bootstrap_config.yaml on the head,
where job drivers run: `available_node_types` there (resources x max_workers) is what the autoscaler can
add, and preflight reads it when present. Elsewhere only the alive nodes count, and the message says so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from spotfill.config.errors import ConfigError
from spotfill.train.capacity import count_workers

# The autoscaler config `ray up` leaves on the head node (cluster.yaml's --autoscaling-config).
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
NO_PUBLIC_NODE_TYPES = ("Ray 2.60 exposes no public API for the node types an autoscaler could add, and "
                        f"no {BOOTSTRAP_CONFIG} is on this node")
_HIDDEN_PREFIXES = ("node:", "accelerator_type:")   # per-node marker resources, not something to ask for


@dataclass(frozen=True)
class NodeType:
    """A node type an autoscaler may launch: its resources (empty: not stated), how many at most and at
    least (min_workers: kept up whatever the demand)."""
    name: str
    resources: dict = field(default_factory=dict)
    max_count: int = 0
    min_count: int = 0


@dataclass(frozen=True)
class Problem:
    """Why the job can never run as configured; `error()` is the one-line ConfigError."""
    field: str
    value: Any
    reason: str
    accepted: str

    def error(self) -> ConfigError:
        err = ConfigError(self.field, reason=self.reason, accepted=self.accepted)
        err.value = self.value
        return err


def worker_needs(gpu_resource: str, gpus_per_worker: float, cpus_per_worker: float) -> dict[str, float]:
    """What one Ray Train worker asks for (TrainingJob's resources_per_worker)."""
    need = {gpu_resource: float(gpus_per_worker), "CPU": float(cpus_per_worker)}
    return {k: v for k, v in need.items() if v > 0}


def _offered(resources: dict) -> set[str]:
    return {r for r, v in resources.items() if v > 0 and not r.startswith(_HIDDEN_PREFIXES) and "_group_" not in r}


def _counted(nodes: list[dict], node_types: list[NodeType] | None) -> str:
    alive = f"counted the {len(nodes)} node{'s' if len(nodes) != 1 else ''} alive now"
    if node_types is None:
        return f"{alive}; {NO_PUBLIC_NODE_TYPES}"
    kinds = ", ".join(f"{t.max_count} x {t.name}" for t in node_types if t.max_count > 0) or "none"
    return f"{alive} and what the autoscaler may add: {kinds}"


def _fmt(value: float) -> str:
    return f"{value:g}"


def resource_problem(need: dict[str, float], gpu_resource: str, min_workers: int, nodes: list[dict],
                     node_types: list[NodeType] | None = None) -> Problem | None:
    """None when `min_workers` workers, each needing `need`, can ever be placed (one worker per node bundle)
    on the alive `nodes` (total resources each) plus up to `max_count` of each autoscaler node type;
    otherwise the Problem. `node_types` None: the cluster's node types are unknown (only the alive nodes
    count). A node type whose resources are not stated makes the check inconclusive (None)."""
    types = node_types or []
    if any(not t.resources and t.max_count > 0 for t in types):
        return None
    offered = set().union(*(_offered(n) for n in nodes), *(_offered(t.resources) for t in types))
    counted = _counted(nodes, node_types)
    if gpu_resource not in offered:
        return Problem("cluster.gpu_resource", gpu_resource,
                       reason=f"{gpu_resource!r} is not a resource of any node ({counted})",
                       accepted=f"a resource the nodes offer: {', '.join(sorted(offered)) or 'none'}")
    fit = count_workers(dict(enumerate(nodes)), need, min_workers)
    fit += sum(count_workers({0: t.resources}, need, min_workers) * t.max_count for t in types)
    if fit >= min_workers:
        return None
    each = ", ".join(f"{r}: {_fmt(v)}" for r, v in need.items())
    offer = "; ".join(f"{r} {_fmt(sum(n.get(r, 0) for n in nodes))} in total, at most "
                      f"{_fmt(max([n.get(r, 0) for n in nodes] + [t.resources.get(r, 0) for t in types]))}"
                      f" per node" for r in need)
    return Problem("training.workers", min_workers,
                   reason=f"a minimum of {min_workers} workers ({{{each}}} each) can never be placed: the "
                          f"cluster holds at most {fit} ({offer}; {counted})",
                   accepted=f"a minimum <= {fit}, a smaller cluster.cpus_per_worker, or more nodes")


def seq_len_problem(seq_len: int | None, manifest: dict, data_path: str) -> Problem | None:
    """`training.seq_len`, when set, must be the prepared dataset's: the model is built for the samples the
    shards hold, so a mismatch means the data was prepared for another model (or the config is stale)."""
    have = int(manifest["seq_len"])
    if seq_len is None or seq_len == have:
        return None
    return Problem("training.seq_len", seq_len,
                   reason=f"{seq_len} does not match the prepared dataset's seq_len {have} (data.path {data_path})",
                   accepted=f"{have}, leave it out, or prepare the data with --seq-len {seq_len}")


def node_types_from_config(config: dict) -> list[NodeType]:
    """Node types from a Ray cluster config (cluster.yaml / ~/ray_bootstrap_config.yaml): resources and
    max_workers of each `available_node_types` entry, the cluster-wide `max_workers` as a cap."""
    cap = config.get("max_workers")
    types = []
    for name, spec in sorted((config.get("available_node_types") or {}).items()):
        spec = spec or {}
        count = int(spec.get("max_workers", cap or 0) or 0)
        if cap is not None:
            count = min(count, int(cap))
        types.append(NodeType(name, {k: float(v) for k, v in (spec.get("resources") or {}).items()}, count,
                              min(count, int(spec.get("min_workers", 0) or 0))))
    return types


# --- thin: what Ray and this node say ------------------------------------------------------------------

def alive_node_resources() -> list[dict]:
    """Total resources of every alive node (ray.nodes(), public)."""
    import ray

    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


def autoscaler_node_types(path: str | None = None) -> list[NodeType] | None:
    """The node types of the `ray up` autoscaler config on this node (or the one SPOTFILL_AUTOSCALER_CONFIG
    names), or None when there is none."""
    import yaml

    from spotfill.config import constants
    path = os.path.expanduser(path or constants.autoscaler_config_path(BOOTSTRAP_CONFIG))
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return node_types_from_config(yaml.safe_load(f) or {})
    except (OSError, yaml.YAMLError, TypeError, ValueError, AttributeError):
        return None


def preflight(config, manifest: dict, runtime_env: dict | None = None) -> None:
    """Everything checkable before workers start, beyond the config's own validation: the environment's
    numbers, training.seq_len against the dataset, and (connecting to Ray; starting a local instance
    with `runtime_env` when none is connected, as fit() would) the cluster's resources. Raises ConfigError,
    or RayCompatError where the installed DeepSpeed lacks an internal the job needs: ZeRO-1/2 checkpoints
    resume through some, pipeline stages run under a probe that needs another (ray_compat)."""
    import ray

    from spotfill.config import constants
    from spotfill.ray_compat import require

    constants.check_env()
    t, c = config.training, config.cluster
    if t.zero_stage in (1, 2):
        require("zero_elastic_load")     # read in DeepSpeed's source: no import, before any worker starts
    if t.pipeline_stages > 1:
        require("pipe_bubble_probe")
    problem = seq_len_problem(t.seq_len, manifest, config.data.path)
    if problem:
        raise problem.error()
    if not ray.is_initialized():
        ray.init(runtime_env=runtime_env or None)
    problem = resource_problem(worker_needs(c.gpu_resource, c.gpus_per_worker, c.cpus_per_worker),
                               c.gpu_resource, t.min_workers, alive_node_resources(), autoscaler_node_types())
    if problem:
        raise problem.error()


def storage_check_node(nodes: list[dict], gpu_resource: str) -> str | None:
    """The node a worker-side storage check runs on: an alive node that has the accelerator resource
    (training's workers run there), the first by node id; None when no such node is up yet (an autoscaled
    cluster before its first GPU node)."""
    ids = sorted(n["NodeID"] for n in nodes if n.get("Alive") and (n.get("Resources") or {}).get(gpu_resource, 0) > 0)
    return ids[0] if ids else None


def _check_storage_here(uris: list[tuple[str, str, bool]]) -> dict:
    """Runs on a worker node: each (field, uri, write) checked as training's workers will use it."""
    import socket
    import time as _time

    from spotfill.storage.base import open_storage
    t0 = _time.perf_counter()
    for name, uri, write in uris:
        try:
            open_storage(uri).check(write=write)
        except ConfigError as exc:
            return {"ok": False, "field": name, "uri": uri, "error": exc.reason or str(exc),
                    "host": socket.gethostname()}
    return {"ok": True, "host": socket.gethostname(), "seconds": round(_time.perf_counter() - t0, 3)}


def check_storage_from_worker(config, runtime_env: dict | None = None, timeout_s: float = 120.0) -> dict:
    """Check the job's storage (write) and data (read) from a node training's workers run on, with the
    workers' environment: on a cluster whose workers get credentials of their own (an instance profile),
    a driver-side check alone passes while every worker fails. Runs with no GPU (a task on that node:
    fill-in may hold its GPUs). Raises ConfigError naming the field and the node; returns {"ok", "node",
    ...} or {"skipped": why} when no worker node is up yet."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = storage_check_node(ray.nodes(), config.cluster.gpu_resource)
    if node is None:
        return {"skipped": f"no alive node with {config.cluster.gpu_resource} yet: the workers check storage "
                           f"as they start"}
    task = ray.remote(_check_storage_here).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        runtime_env=runtime_env or None)
    uris = [("storage", config.storage, True), ("data.path", config.data.path, False)]
    try:
        out = ray.get(task.remote(uris), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return {"skipped": f"the check on node {node[:12]} did not finish in {timeout_s:g}s"}
    if not out["ok"]:
        raise ConfigError(out["field"], out["uri"], reason=f"reachable from the driver but not from worker node "
                          f"{node[:12]} ({out['host']}): {out['error']}",
                          accepted="storage the workers can reach with their own credentials (cluster.yaml: "
                                   "an instance profile for every worker type)")
    return {"ok": True, "node": node, **out}
