"""Ray core's private names: the GCS's state and key-value store, node drains, the local test cluster.

Each function checks its hook (catalog.py) where spotfill's own code has no other gate: required ones raise
RayCompatError when used, robustness ones fall back after one warning. The rest are thin readers whose
callers gate the feature (fill-in's arbiter: `fillin_arbiter`; elastic sizing: `drain_aware_restarts`).
"""
from __future__ import annotations

from spotfill.ray_compat.hooks import RayCompatError, require, usable

_FAKE = "ray.autoscaler._private.fake_multi_node.node_provider"


def _state():
    import ray._private.state as state
    return state.state


def draining_node_ids() -> dict:
    """Node id -> drain deadline (ms) of every draining node, as Ray Train's PreemptionWatcher reads it."""
    return _state().get_draining_nodes() or {}


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Node id -> resources available now (not reserved by any task, actor or placement group), from the
    GCS's view of each raylet's last report."""
    return _state().available_resources_per_node() or {}


def kv_get(key: str) -> bytes | None:
    """A value from the GCS key-value store (cluster-wide, outlives worker processes)."""
    from ray.experimental import internal_kv
    return internal_kv._internal_kv_get(key, namespace="spotfill")


def kv_put(key: str, value: str) -> None:
    from ray.experimental import internal_kv
    internal_kv._internal_kv_put(key, value, overwrite=True, namespace="spotfill")


def kv_list(prefix: str) -> list[str]:
    """Keys of the spotfill namespace that start with `prefix`."""
    from ray.experimental import internal_kv
    return [k.decode() if isinstance(k, bytes) else k
            for k in internal_kv._internal_kv_list(prefix, namespace="spotfill")]


def kv_del(key: str) -> int:
    """Delete `key`; returns how many keys were deleted (1 for the one caller that took it, 0 otherwise)."""
    from ray.experimental import internal_kv
    return int(internal_kv._internal_kv_del(key, namespace="spotfill") or 0)


def gcs_actor_alive(actor_id: str, timeout=None) -> bool:
    """Whether the actor is alive, asked of the GCS (the owner of actor state), not the State API.

    Ray 2.60's is_actor_alive asks the dashboard's State API and reads a miss (None) as death; the GCS
    never forgets a live actor. A GCS that cannot answer raises RayStateApiException, which the cleaner
    loop treats as "unknown, keep monitoring"."""
    from ray.util.state.exception import RayStateApiException
    try:
        info = _state().actor_table(actor_id)
    except Exception as exc:
        raise RayStateApiException(f"GCS actor lookup failed: {exc}") from exc
    return bool(info) and info.get("State") != "DEAD"


def gcs_actors(states: tuple[str, ...] = ("ALIVE", "PENDING_CREATION")) -> list[dict]:
    """The cluster's actors in `states`, read from the GCS's actor table (one call per state): no State API,
    so no dashboard round trip (the fill-in arbiter reads this every second). Each: {"actor_id",
    "class_name", "state", "node_id" ("" while it has none), "start_time" (unix s, None until known)}."""
    out = []
    for state in states:
        for actor_id, a in _state().actor_table(None, actor_state_name=state).items():
            node = (a.get("Address") or {}).get("NodeID") or ""
            start = a.get("StartTime") or 0
            out.append({"actor_id": actor_id, "class_name": a.get("ActorClassName", ""), "state": a.get("State"),
                        "node_id": "" if set(node) <= {"f"} else node, "start_time": start / 1000.0 or None})
    return out


def kill_actor_id(actor_id: str) -> bool:
    """Kill the actor with this hex id, no restart (what ray.kill does with a handle); False when this Ray
    has no way to (hook kill_stuck_batch_actors). Ray's public kill needs a handle or a name; a Ray Data
    actor pool's actors have neither outside Data's executor, and one waiting for a GPU no one lent keeps
    the executor (and its iterator) waiting forever."""
    if not usable("kill_stuck_batch_actors"):
        return False
    import ray._private.worker as worker
    import ray._raylet as raylet
    worker.global_worker.core_worker.kill_actor(raylet.ActorID.from_hex(actor_id), True)
    return True


def gcs_client(address: str | None):
    """(gcs_address, GcsClient) for `address` ("auto"/None = the cluster `ray start` joined here), as the
    `ray drain-node` CLI builds it. No ray.init: a daemon needs no driver. Blocks (~40 s) when the GCS is
    unreachable."""
    require("spot_drain")
    import ray._private.services as services
    import ray._raylet as raylet
    gcs_address = services.canonicalize_bootstrap_address_or_die(address or "auto")
    return gcs_address, raylet.GcsClient(address=gcs_address)


def gcs_kv_put(gcs, key: str, value: str, timeout_s: float = 10.0) -> None:
    """Put `key` = `value` in the spotfill namespace of the GCS key-value store through a daemon's GcsClient
    (from gcs_client(); no ray.init) -- what kv_get / kv_list read inside jobs."""
    gcs.internal_kv_put(key.encode(), value.encode(), True, b"spotfill", timeout=timeout_s)


def wrap_driver_stdstream(wrapper) -> None:
    """Install `wrapper(original, data, ignore_prefix)` around the driver's printer of worker/raylet log
    lines (looked up per message by the error-listener thread). Idempotent; nothing (after one warning)
    where this Ray has no such printer."""
    if not usable("quiet_node_deaths"):
        return
    import ray._private.worker as worker
    original = worker.print_to_stdstream
    if getattr(original, "_spotfill_wrapped", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        return wrapper(original, data, ignore_prefix)

    print_to_stdstream._spotfill_wrapped = True
    worker.print_to_stdstream = print_to_stdstream


def single_host_loopback(enabled: bool) -> bool:
    """Make this process treat Ray as single-host (the embedded cluster): node addresses default to
    127.0.0.1 and a 127.0.0.1 bootstrap address stays 127.0.0.1 -- ray.init(address="127.0.0.1:port")
    otherwise rewrites it to the machine's network address (services.get_node_ip_address), where a
    loopback-bound GCS does not listen. Returns the previous setting (pass it back to restore). Child
    processes get the same through RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in their environment."""
    require("single_host_cluster")
    import ray._private.ray_constants as ray_constants
    previous = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = not enabled
    return not previous


def node_raylet_pids(node) -> list[int]:
    """The raylet process id(s) of a local test node (a ray._private.node.Node from
    ray.cluster_utils.Cluster); every worker of the node is a descendant of its raylet."""
    require("local_node_processes")
    procs = getattr(node, "all_processes", None)
    if not isinstance(procs, dict):
        raise RayCompatError(f"a local node's processes: {type(node).__name__}.all_processes is not a dict")
    return [info.process.pid for info in procs.get("raylet", [])]


def kill_node_workers(node) -> int:
    """SIGKILL every worker process of a local test node: the children of its raylet. A real node loss takes
    them with it at once; removing a local node kills the raylet only, and its workers ran on (and stepped)
    until they noticed. Returns how many were killed."""
    import psutil

    killed = 0
    for pid in node_raylet_pids(node):
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for child in children:
            try:
                child.kill()
                killed += 1
            except psutil.Error:
                pass
    return killed


def node_death_reason_name(value) -> str | None:
    """ray.nodes()' DeathReason (a NodeDeathInfo.Reason number) by name, e.g. AUTOSCALER_DRAIN_PREEMPTED;
    None for a node that has not died (0, UNSPECIFIED); the number as text where this Ray cannot name it."""
    if not value:
        return None
    if not usable("node_death_reasons"):
        return str(value)
    from ray.core.generated import common_pb2
    try:
        return common_pb2.NodeDeathInfo.Reason.Name(int(value))
    except (ValueError, TypeError):
        return str(value)


# -- what the cluster says about itself (the fill-in arbiter, on the head) ----------------------------------
def cluster_config_node_groups() -> list[tuple[int, int]] | None:
    """(min_count, max_count) of every node group in the cluster config an autoscaler reported to the GCS
    (what Ray Data's autoscaling check reads), or None when none was reported -- or this Ray cannot say
    (gcs_cluster_config)."""
    if not usable("gcs_cluster_config"):
        return None
    config = _state().get_cluster_config()
    if config is None:
        return None
    return [(int(g.min_count), int(g.max_count)) for g in config.node_group_configs if g.resources]


def dashboard_url() -> str | None:
    """The dashboard's address as the head registered it in the GCS (Serve's scale endpoint lives there);
    None where this Ray does not keep it there (gcs_dashboard_url)."""
    if not usable("gcs_dashboard_url"):
        return None
    import ray._private.ray_constants as ray_constants
    from ray.experimental import internal_kv
    raw = internal_kv._internal_kv_get("webui:url", namespace=ray_constants.KV_NAMESPACE_DASHBOARD)
    return raw.decode() if isinstance(raw, bytes) else raw


def dead_job_ids() -> set[str]:
    """Hex ids of the Ray jobs (drivers) the GCS knows to have ended; none where this Ray cannot list them
    (gcs_dead_jobs)."""
    if not usable("gcs_dead_jobs"):
        return set()
    return {j["JobID"] for j in _state().job_table() if j.get("IsDead")}


def dashboard_auth_headers() -> dict[str, str]:
    """The Authorization header a request to this cluster's dashboard needs when the cluster runs with token
    authentication (RAY_AUTH_MODE=token; Ray 2.60 turns it on for local clusters when ~/.ray/auth_token
    exists): {} otherwise, and where this Ray has no such helper (dashboard_token_auth)."""
    if not usable("dashboard_token_auth"):
        return {}
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    return dict(get_auth_headers_if_auth_enabled({}) or {})


def __getattr__(name: str):
    """The spot watcher's protobuf modules and Ray's fake multi-node provider (ray.autoscaler._private;
    what ray.cluster_utils.AutoscalingCluster runs: each "instance" it launches is a real raylet on this
    machine, node id = cloud instance id; the fake head's node id is fixed, FAKE_HEAD_NODE_ID; the provider
    needs RAY_FAKE_CLUSTER=1 in its environment), resolved when first imported. The provider class may be
    a stand-in (hooks.stand_in_base): building one raises the feature's RayCompatError."""
    if name in ("gcs_pb2", "autoscaler_pb2"):
        require("spot_drain")
        import importlib
        return importlib.import_module(f"ray.core.generated.{name}")
    if name == "FakeMultiNodeProvider":     # subclassed at import (testing.fake_market): a stand-in if moved
        from spotfill.ray_compat.hooks import stand_in_base
        return stand_in_base(f"{_FAKE}:{name}", "fake_multinode_cluster")
    if name == "FAKE_HEAD_NODE_ID":
        require("fake_multinode_cluster")
        from spotfill.ray_compat.hooks import resolve
        return resolve(f"{_FAKE}:{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

