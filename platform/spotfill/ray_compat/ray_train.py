"""Ray Train's private names: controller and worker-group callbacks, the elastic policy, the placement-group
cleaner, worker processes (setup hook, prestarted spares) and a worker's preemption notice.

The base classes spotfill's callbacks and policy subclass at import are resolved here with a stand-in where
Ray lacks them (hooks.stand_in_base): importing never fails; building a required callback raises the
feature's RayCompatError, and robustness swaps are skipped after their one warning.
"""
from __future__ import annotations

import functools
import os

from spotfill.ray_compat.hooks import stand_in_base, usable

_CB = "ray.train.v2._internal.execution.callback"
_PG = "ray.train.v2._internal.callbacks.placement_group_callback"
_PGC = "ray.train.v2._internal.execution.controller.placement_group_cleaner"

# Ray Train's controller callback (a DeveloperAPI with no public import path in 2.60): fill-in claims
# GPUs in `before_controller_execute_resize_decision`, before a group starts, restarts or grows.
ControllerCallback = stand_in_base(f"{_CB}:ControllerCallback", "train_controller_callbacks")
WorkerGroupCallback = stand_in_base(f"{_CB}:WorkerGroupCallback", "train_controller_callbacks")
ElasticScalingPolicy = stand_in_base("ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy",
                                     "drain_aware_restarts")


def node_label_selector(node_ids) -> dict | None:
    """A worker-group label selector placing every worker on one of `node_ids`, through the node-id label
    Ray gives every node (the controller callback hook `on_controller_start_worker_group` returns it);
    None where the hook or the label is gone (warning once): the group is then placed by Ray alone."""
    if not node_ids or not usable("warm_placement"):
        return None
    from ray._raylet import RAY_NODE_ID_KEY
    return {RAY_NODE_ID_KEY: f"in({','.join(sorted(node_ids))})"}


def local_preemption_info():
    """This worker's preemption notice (a PreemptionInfo or None), read locally: no collective.

    ray.train.get_preemption_info() reads this same field (train_fn_utils.DistributedTrainFnUtils) and then
    broadcasts rank 0's value through Ray Train's SynchronizationActor: an actor round trip per step. The
    step's flags all_reduce already makes every rank act on any rank's notice, so the local value is enough.
    Where Ray moved the field, the public call (every rank calls this at the same point of each step)."""
    if usable("local_preemption_info"):
        from ray.train.v2._internal.execution import context
        return context.get_train_context().preemption_context.preemption_info
    import ray.train
    return ray.train.get_preemption_info()


def unreachable_workers(worker_group, timeout_s: float) -> list:
    """The workers of a Ray Train worker group that do not answer a metadata call within `timeout_s`
    (their process or node is gone), as (world_rank, node_id, actor) tuples."""
    import ray

    workers = list(worker_group.get_workers())
    refs = {w.actor.get_metadata.remote(): (rank, w) for rank, w in enumerate(workers)}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    answered = set()
    for ref in ready:
        try:
            ray.get(ref, timeout=0)
            answered.add(ref)
        except Exception:
            pass
    return [(rank, getattr(w.metadata, "node_id", None), w.actor)
            for ref, (rank, w) in refs.items() if ref not in answered]


@functools.lru_cache(maxsize=None)
def _gcs_checked_cleaner_classes() -> tuple[type, type]:
    import ray.train.v2._internal.callbacks.placement_group_callback as pg_callback
    import ray.train.v2._internal.execution.controller.placement_group_cleaner as pg_cleaner

    from spotfill.ray_compat.ray_core import gcs_actor_alive

    class GcsCheckedPlacementGroupCleaner(pg_cleaner.PlacementGroupCleaner):
        """Ray Train's placement-group cleaner, deciding "the controller is dead" through the GCS.

        Stock, a State API miss (dashboard slow or restarting, the actor not yet in its cache) made the
        cleaner remove a healthy run's placement group -- killing every worker (ray-project/ray#65447). The
        cleaner runs in its own detached actor process, so replacing the module's liveness function there
        touches nothing else."""

        def __init__(self, controller_actor_id, check_interval_s, get_actor_timeout_s, stop_timeout):
            super().__init__(controller_actor_id, check_interval_s, get_actor_timeout_s, stop_timeout)
            pg_cleaner.is_actor_alive = gcs_actor_alive

    class GcsCheckedPlacementGroupCleanerCallback(pg_callback.PlacementGroupCleanerCallback):
        """Launches GcsCheckedPlacementGroupCleaner instead of Ray's (in the controller actor's process)."""

        cleaner_cls = GcsCheckedPlacementGroupCleaner

        def after_controller_start(self, train_run_context):
            pg_callback.PlacementGroupCleaner = self.cleaner_cls
            return super().after_controller_start(train_run_context)

    for cls in (GcsCheckedPlacementGroupCleaner, GcsCheckedPlacementGroupCleanerCallback):
        cls.__module__, cls.__qualname__ = __name__, cls.__name__   # pickled by reference (module __getattr__)
    return GcsCheckedPlacementGroupCleaner, GcsCheckedPlacementGroupCleanerCallback


def __getattr__(name: str):
    if name in ("GcsCheckedPlacementGroupCleaner", "GcsCheckedPlacementGroupCleanerCallback"):
        cleaner, callback = _gcs_checked_cleaner_classes()
        return cleaner if name == "GcsCheckedPlacementGroupCleaner" else callback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_spotfill_controller(trainer_cls, make_policy=None):
    """A subclass of `trainer_cls` whose controller gets `make_policy(scaling_config)` instead of Ray's
    ElasticScalingPolicy, when given (the policy is built on the driver and handed to the controller
    actor), the GCS-checked placement-group cleaner instead of Ray's, and its callbacks marked
    `spotfill_runs_first` ahead of Ray's own (which the controller lists before RunConfig's). A swap this
    Ray cannot take (drain_aware_restarts, gcs_checked_pg_cleaner) is skipped, said once when the trainer is
    built: Ray's own policy or cleaner runs."""

    class Trainer(trainer_cls):
        def __init__(self, *args, **kwargs):
            if make_policy:
                usable("drain_aware_restarts")
            usable("gcs_checked_pg_cleaner")
            super().__init__(*args, **kwargs)

        def _initialize_and_run_controller(self, **kwargs):
            if (make_policy and usable("drain_aware_restarts")
                    and isinstance(kwargs.get("scaling_policy"), ElasticScalingPolicy)):
                kwargs["scaling_policy"] = make_policy(self.scaling_config)
            callbacks = list(kwargs.get("callbacks") or [])
            if usable("gcs_checked_pg_cleaner"):
                import ray.train.v2._internal.callbacks.placement_group_callback as pg_callback
                swap = _gcs_checked_cleaner_classes()[1]
                callbacks = [swap() if type(cb) is pg_callback.PlacementGroupCleanerCallback else cb
                             for cb in callbacks]
            kwargs["callbacks"] = callbacks_first(callbacks)
            return super()._initialize_and_run_controller(**kwargs)

    Trainer.__name__ = Trainer.__qualname__ = f"Spotfill{trainer_cls.__name__}"
    return Trainer


def callbacks_first(callbacks: list) -> list:
    """`callbacks` with those marked `spotfill_runs_first` moved to the front, order otherwise kept.
    The worker-group teardown reaper must run before Ray Train's backend callback, whose torch
    process-group shutdown waits on every worker -- the dead ones too -- for up to 30 s."""
    return sorted(callbacks, key=lambda cb: not getattr(cb, "spotfill_runs_first", False))


def worker_setup_hook_env(hook: str, env: dict[str, str], job_runtime_env: dict | None = None) -> dict[str, str]:
    """`env` (a runtime_env's env_vars) with `hook` ("module.function") as the worker processes' setup
    hook: Ray's `worker_process_setup_hook` in the form Ray's job-level runtime_env turns it into (the env
    var its default_worker.py reads at process start), here for the processes of one runtime_env (Ray Train's
    worker_runtime_env), which Ray does not convert itself. A hook already set -- in `env`, this process's
    environment or the job's runtime_env (`job_runtime_env`, the user's) -- is kept: nothing is added; so
    where this Ray reads no such variable (warm_worker_setup_hook)."""
    if not usable("warm_worker_setup_hook"):
        return dict(env)
    import ray._private.ray_constants as ray_constants
    name = ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    job = job_runtime_env or {}
    if (env.get(name) or os.environ.get(name) or job.get("worker_process_setup_hook")
            or (job.get("env_vars") or {}).get(name)):
        return dict(env)
    return {**env, name: hook}


def prestart_workers(num_workers: int, keep_alive_s: int, timeout_s: float = 5.0,
                     node_id: str | None = None) -> bool:
    """Ask this node's raylet (node `node_id`'s, when given: a node new to the run) to start `num_workers` idle worker processes now, with the runtime_env of the
    calling worker (the exact serialized string its own task carried, so the raylet's runtime_env hash
    matches) for the calling job, kept idle for `keep_alive_s` even above Ray's idle-worker soft limit.
    Actors the next worker group creates on this node with that runtime_env land on them instead of
    spawning processes (Ray's worker pool hands a new lease an idle worker of the same job and runtime_env
    hash), and the processes' setup hook (spotfill.train.warm) has had their imports running since they
    started. Ray's public API has no call for this (the raylet's PrestartWorkers RPC, Ray 2.60). False
    (nothing asked) where this Ray has no such RPC (prestart_spare_workers)."""
    if not usable("prestart_spare_workers"):
        return False
    import ray
    from ray._private import grpc_utils
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    ctx = ray.get_runtime_context()
    node_id = node_id or ctx.get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
    if node is None:
        raise RuntimeError(f"node {node_id[:12]} is not in the cluster's node list")
    request = node_manager_pb2.PrestartWorkersRequest(
        language=common_pb2.Language.Value("PYTHON"), job_id=bytes.fromhex(ctx.get_job_id()),
        keep_alive_duration_secs=int(keep_alive_s), num_workers=int(num_workers))
    request.runtime_env_info.serialized_runtime_env = ctx.get_runtime_env_string() or "{}"
    channel = grpc_utils.init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=timeout_s)
    finally:
        channel.close()
    return True


def torch_train_backend():
    """Ray Train's torch Backend class (ray.train.torch.config._TorchBackend), or None (after one warning)
    where it is gone: then Ray's own backend choice applies (NCCL for any GPU worker, which fails where the
    GPU resource has no CUDA device behind it)."""
    if not usable("device_aware_torch_backend"):
        return None
    from ray.train.torch.config import _TorchBackend
    return _TorchBackend
