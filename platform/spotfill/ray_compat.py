"""Every private Ray hook spotfill uses, in one place, resolved and checked at import.

Ray's public API covers almost everything spotfill needs; the few places it does not are listed here with
the Ray version they were read against (2.60.0). Importing this module resolves every hook and checks its
signature: if Ray moved one, the import fails at once with a message naming it -- never a silent
fallback deep inside a training run. tests/unit/test_ray_compat.py imports it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import os
import socket
import sys
import time
import types

import ray
import ray._private.ray_constants as _ray_constants
import ray._private.services as _services
import ray._private.state as _state
import ray._private.worker as _worker
import ray._raylet as _raylet
from ray.core.generated import autoscaler_pb2, common_pb2, gcs_pb2  # noqa: F401 (drain, node death, node list)
from ray.core.generated import node_manager_pb2 as _nm_pb2, node_manager_pb2_grpc as _nm_grpc
from ray._private import grpc_utils as _grpc_utils
import ray.experimental.internal_kv as _kv
import ray.autoscaler._private.fake_multi_node.node_provider as _fake_multinode
import ray.train.v2._internal.callbacks.placement_group_callback as _pg_callback
import ray.train.v2._internal.execution.controller.placement_group_cleaner as _pg_cleaner
from ray.train.torch import TorchTrainer as _TorchTrainer
from ray.train.v2._internal.execution import callback as _train_callback
from ray.train.v2._internal.execution import context as _train_context
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy
from ray.train.v2._internal.execution.worker_group import worker as _wg_worker
from ray.train.v2._internal.execution.worker_group import worker_group as _wg
from ray.util.state.exception import RayStateApiException
from ray.serve.handle import DeploymentResponse as _DeploymentResponse
from ray.tune.execution.tune_controller import TuneController as _TuneController
from ray.tune.experiment import Trial as _TuneTrial
from ray.tune.schedulers import TrialScheduler as _TrialScheduler
from ray.tune.search import Searcher as _TuneSearcher
import torch.utils.cpp_extension as _cpp_ext
from torch.utils.file_baton import FileBaton as _FileBaton

from spotfill.train.opcache import boot_id, owner_record, parse_owner, pid_alive, stale_reason

RAY_VERSION_CHECKED = "2.60.0"
log = logging.getLogger(__name__)


class RayCompatError(ImportError):
    """A private Ray hook spotfill relies on is missing or changed shape."""


def _require(owner, name: str, params: tuple[str, ...] | None = None):
    where = f"{getattr(owner, '__module__', owner)}.{getattr(owner, '__qualname__', '')}".rstrip(".")
    if not hasattr(owner, name):
        raise RayCompatError(f"spotfill needs {where}.{name} (checked against ray {RAY_VERSION_CHECKED}); "
                             f"installed ray {ray.__version__} does not have it")
    obj = getattr(owner, name)
    if params is not None:
        got = tuple(p for p in inspect.signature(obj).parameters if p != "self")
        if got[:len(params)] != params:
            raise RayCompatError(f"spotfill needs {where}.{name}{params} (checked against ray "
                                 f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} has {got}")
    return obj


# (owner, attribute, leading parameters) -- each one used below.
HOOKS = [
    (_train_context, "get_train_context", ()),
    (ElasticScalingPolicy, "_count_possible_workers", ("reserved_resources",)),
    (_TorchTrainer, "_initialize_and_run_controller", ("controller_init_kwargs",)),
    (_state.GlobalState, "get_draining_nodes", ()),
    (_state, "state", None),
    (_worker, "print_to_stdstream", ("data", "ignore_prefix")),
    (_services, "canonicalize_bootstrap_address_or_die", ("addr",)),
    (_raylet, "GcsClient", None),
    (gcs_pb2.GcsNodeInfo, "ALIVE", None),
    (autoscaler_pb2.DrainNodeReason, "Value", None),
    (_ray_constants, "ENABLE_RAY_CLUSTER", None),
    (_ray_constants, "WORKER_PROCESS_SETUP_HOOK_ENV_VAR", None),
    (ElasticScalingPolicy, "make_decision_for_running_worker_group", ("worker_group_state", "worker_group_status")),
    (_state.GlobalState, "available_resources_per_node", ()),
    (_state.GlobalState, "actor_table", ("actor_id", "job_id", "actor_state_name")),
    (_kv, "_internal_kv_get", ("key",)),
    (_kv, "_internal_kv_put", ("key", "value")),
    (_kv, "_internal_kv_list", ("prefix",)),
    (_kv, "_internal_kv_del", ("key",)),
    (_pg_cleaner, "is_actor_alive", ("actor_id", "timeout")),
    (_pg_cleaner.PlacementGroupCleaner, "__init__", ("controller_actor_id", "check_interval_s",
                                                     "get_actor_timeout_s", "stop_timeout")),
    (_pg_callback, "PlacementGroupCleaner", None),
    (_pg_callback.PlacementGroupCleanerCallback, "after_controller_start", ("train_run_context",)),
    (ControllerCallback, "after_controller_state_update", ("previous_state", "current_state")),
    (WorkerGroupCallback, "after_worker_group_start", ("worker_group",)),
    # torch's JIT extension build (DeepSpeed ops load through it): its lock and its version memo
    (_cpp_ext, "FileBaton", None),
    (_cpp_ext, "load", ("name", "sources")),
    (_cpp_ext, "JIT_EXTENSION_VERSIONER", None),
    (_cpp_ext.JIT_EXTENSION_VERSIONER, "entries", None),
    (_FileBaton, "wait", ()),
    (_FileBaton, "try_acquire", ()),
    (_train_callback.ControllerCallback, "before_controller_execute_resize_decision", ("resize_decision",)),
    # a worker group's teardown: reap workers whose node is gone before Ray Train's 5 s shutdown patience
    (WorkerGroupCallback, "before_worker_group_shutdown", ("worker_group",)),
    # the GPU-seconds ledger: when a group's GPUs were let go (train/sink.py, group_end)
    (WorkerGroupCallback, "after_worker_group_shutdown", ("worker_group_context",)),
    (_wg.WorkerGroup, "get_workers", ()),
    (_wg_worker.RayTrainWorker, "get_metadata", ()),
    # Ray's fake multi-node provider (local autoscaler tests, the demo's autoscaling cluster)
    (_fake_multinode, "FAKE_HEAD_NODE_ID", None),
    (common_pb2.NodeDeathInfo, "Reason", None),
    (_fake_multinode.FakeMultiNodeProvider, "__init__", ("provider_config", "cluster_name")),
    (_fake_multinode.FakeMultiNodeProvider, "_create_node_with_resources_and_labels",
     ("node_config", "tags", "count", "resources", "labels")),
    (_fake_multinode.FakeMultiNodeProvider, "terminate_node", ("node_id",)),
    (_fake_multinode.FakeMultiNodeProvider, "_terminate_node", ("node",)),
    # Tune's scheduler/searcher extension points (DeveloperAPI) the grant-driven sweep uses (fillin/sweep.py)
    (_TrialScheduler, "choose_trial_to_run", ("tune_controller",)),
    (_TrialScheduler, "on_trial_result", ("tune_controller", "trial", "result")),
    (_TrialScheduler, "on_trial_add", ("tune_controller", "trial")),
    (_TrialScheduler, "on_trial_error", ("tune_controller", "trial")),
    (_TrialScheduler, "on_trial_complete", ("tune_controller", "trial", "result")),
    (_TrialScheduler, "on_trial_remove", ("tune_controller", "trial")),
    (_TrialScheduler, "PAUSE", None),
    (_TuneController, "pause_trial", ("trial", "should_checkpoint")),
    (_TuneController, "get_trials", ()),
    (_TuneSearcher, "suggest", ("trial_id",)),
    (_TuneSearcher, "restore_from_dir", ("checkpoint_dir",)),
    (_TuneSearcher, "FINISHED", None),
    (_TuneTrial, "PAUSED", None),
    (_TuneTrial, "should_recover", ()),
    (_TuneController, "_unstage_trial_with_resources", ("trial",)),
    # a stopping trial actor is killed after TUNE_FORCE_TRIAL_CLEANUP_S -- unless it counts as started, then
    # only after the controller's _actor_force_cleanup_timeout (10 s, not configurable): tune_force_cleanup_after
    (_TuneController, "_cleanup_stopping_actors", ("force_all",)),
    # warm spare worker processes (prestart_workers): the raylet's PrestartWorkers RPC
    (_nm_grpc, "NodeManagerServiceStub", None),
    (_nm_grpc.NodeManagerServiceStub, "__init__", ("channel",)),
    (_nm_pb2, "PrestartWorkersRequest", None),
    (_grpc_utils, "init_grpc_channel", ("address",)),
    (common_pb2.Language, "Value", None),
    # Serve's DeveloperAPI the fill-in Ingress (serving/app.py) uses to tell a request a replica took from
    # one still waiting in the router (resolves on assignment)
    (_DeploymentResponse, "_to_object_ref", ()),
    # kill an actor known only by its id (a Ray Data pool actor never placed: kill_actor_id)
    (_raylet.CoreWorker, "kill_actor", None),
    (_raylet.ActorID, "from_hex", None),
    (_worker, "global_worker", None),
    # what the cluster says about itself: autoscaling (fillin/cluster_kind.py), the dashboard's address,
    # ended drivers (the arbiter drops their training records)
    (_state.GlobalState, "get_cluster_config", ()),
    (_state.GlobalState, "job_table", ()),
    (_ray_constants, "KV_NAMESPACE_DASHBOARD", None),
]
for _owner, _name, _params in HOOKS:
    _require(_owner, _name, _params)
_PRESTART_FIELDS = ("language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers")
if not set(_PRESTART_FIELDS) <= set(_nm_pb2.PrestartWorkersRequest.DESCRIPTOR.fields_by_name):
    raise RayCompatError(f"spotfill needs PrestartWorkersRequest{_PRESTART_FIELDS} (checked against ray "
                         f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} differs")
# the experiment state files a sweep rerun checks before Tune restores them (fillin/sweep_state.py)
from spotfill.fillin import sweep_state as _sweep_state  # noqa: E402 - pure, no Ray
for _tmpl, (_head, _tail) in ((_TuneController.CKPT_FILE_TMPL, _sweep_state.EXPERIMENT_STATE),
                              (_TuneSearcher.CKPT_FILE_TMPL, _sweep_state.SEARCHER_STATE)):
    if _tmpl != f"{_head}{{}}{_tail}":
        raise RayCompatError(f"spotfill expects Tune's state file {_head}{{}}{_tail} (checked against ray "
                             f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} writes {_tmpl}")
if "actor" not in getattr(_wg_worker.Worker, "__dataclass_fields__", {}):
    raise RayCompatError(f"spotfill needs ray.train.v2 Worker.actor (checked against ray {RAY_VERSION_CHECKED}); "
                         f"installed ray {ray.__version__} does not have it")

# DeepSpeed imports its Muon optimizer modules lazily -- ZeRO's optimizer check at initialize, its gradient
# reduction on every step -- and they apply torch.compile at import: ~1.5 s of torch._inductor imports on
# every worker start, on the recovery critical path, for an optimizer spotfill never builds (it trains with
# AdamW). Each module is located without importing DeepSpeed, and each name DeepSpeed imports from it is
# checked to be defined there.
MUON_MODULES = {
    "deepspeed.runtime.zero.muon.muon_optimizer": ("MuonWithAuxAdam",),
    "deepspeed.runtime.zero.muon.original_muon": ("MuonWithAuxAdam", "muon_update", "adam_update"),
}


def _muon_sources() -> dict[str, str]:
    spec = importlib.util.find_spec("deepspeed")
    out = {}
    for module, names in MUON_MODULES.items():
        path = os.path.join(os.path.dirname(spec.origin), *module.split(".")[1:]) + ".py" if spec else "?"
        text = open(path, encoding="utf-8").read() if os.path.isfile(path) else ""
        missing = [n for n in names if f"def {n}(" not in text and f"class {n}" not in text]
        if not text or missing:
            raise RayCompatError(f"spotfill expects DeepSpeed's {module} to define {', '.join(missing or names)} "
                                 f"(checked against deepspeed 0.19); the installed DeepSpeed does not ({path})")
        out[module] = path
    return out


_MUON_PATHS = _muon_sources()


# DeepSpeed ZeRO-1/2 internals the elastic (no conversion) resharding load uses, read against DeepSpeed
# 0.19: checked by name in the installed source at import (DeepSpeed itself is imported only by workers)
# and by signature when first used.
ZERO_ELASTIC_HOOKS = {
    "runtime/engine.py": ("_get_all_zero_checkpoints", "zero_elastic_checkpoint", "load_checkpoint"),
    "runtime/zero/stage_1_and_2.py": ("_load_global_state", "_partition_base_optimizer_state",
                                      "_restore_from_elastic_fp32_weights", "_link_all_hp_params",
                                      "_get_state_without_padding", "state_dict"),
}
ZERO_ELASTIC_KEYS = ("BASE_OPTIMIZER_STATE", "SINGLE_PARTITION_OF_FP32_GROUPS")


def _check_zero_elastic_sources() -> None:
    spec = importlib.util.find_spec("deepspeed")
    for rel, names in ZERO_ELASTIC_HOOKS.items():
        path = os.path.join(os.path.dirname(spec.origin), rel) if spec else "?"
        text = open(path, encoding="utf-8").read() if os.path.isfile(path) else ""
        missing = [n for n in names if f"def {n}(" not in text]
        if not text or missing:
            raise RayCompatError(f"spotfill needs DeepSpeed's {rel} to define {', '.join(missing or names)} "
                                 f"(checked against deepspeed 0.19); the installed DeepSpeed does not ({path})")


_check_zero_elastic_sources()


# DeepSpeed's PipelineEngine runs a step's schedule in `_exec_schedule`, dispatching every instruction
# through `self._INSTRUCTION_MAP[type(cmd)]` (deepspeed 0.19; unchanged since 2023). The bubble probe
# (train/bubble_probe.py) gives one engine instance its own copy of that map with timed wrappers: no fork,
# no subclass (deepspeed.initialize builds PipelineEngine itself). Checked in the source at import; the
# map and the dispatch again when first used.
PIPE_ENGINE_SOURCE = "runtime/pipe/engine.py"
PIPE_DISPATCH = "self._INSTRUCTION_MAP[type(cmd)]"


def _check_pipe_engine_source() -> None:
    spec = importlib.util.find_spec("deepspeed")
    path = os.path.join(os.path.dirname(spec.origin), PIPE_ENGINE_SOURCE) if spec else "?"
    text = open(path, encoding="utf-8").read() if os.path.isfile(path) else ""
    missing = [n for n in ("def _exec_schedule(", "_INSTRUCTION_MAP = {", PIPE_DISPATCH) if n not in text]
    if not text or missing:
        raise RayCompatError(f"spotfill needs DeepSpeed's {PIPE_ENGINE_SOURCE} to have {', '.join(missing)} "
                             f"(checked against deepspeed 0.19); the installed DeepSpeed does not ({path})")


_check_pipe_engine_source()


def pipe_instruction_map(engine) -> dict:
    """Give this PipelineEngine instance its own copy of the class's instruction map (type -> function
    taking (engine, **kwargs)) and return it: what the caller puts in it runs in place of DeepSpeed's
    functions for this engine only."""
    cls = type(engine)
    table = _require(cls, "_INSTRUCTION_MAP")
    run = _require(cls, "_exec_schedule", ("pipe_schedule",))
    if not isinstance(table, dict) or PIPE_DISPATCH not in inspect.getsource(run):
        raise RayCompatError(f"spotfill needs {cls.__name__}._exec_schedule to dispatch through "
                             f"{PIPE_DISPATCH} (checked against deepspeed 0.19)")
    engine._INSTRUCTION_MAP = dict(table)
    return engine._INSTRUCTION_MAP


# Ray's fake multi-node node provider (ray.autoscaler._private; what ray.cluster_utils.AutoscalingCluster
# runs): each "instance" it launches is a real raylet on this machine, node id = cloud instance id. The fake
# head's node id is fixed (FAKE_HEAD_NODE_ID); the provider needs RAY_FAKE_CLUSTER=1 in its environment.
FakeMultiNodeProvider = _fake_multinode.FakeMultiNodeProvider
FAKE_HEAD_NODE_ID = _fake_multinode.FAKE_HEAD_NODE_ID


def node_raylet_pids(node) -> list[int]:
    """The raylet process id(s) of a local test node (a ray._private.node.Node from
    ray.cluster_utils.Cluster); every worker of the node is a descendant of its raylet."""
    procs = getattr(node, "all_processes", None)
    if not isinstance(procs, dict):
        raise RayCompatError(f"spotfill needs ray._private.node.Node.all_processes (checked against ray "
                             f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} does not have it")
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
    None for a node that has not died (0, UNSPECIFIED)."""
    if not value:
        return None
    try:
        return common_pb2.NodeDeathInfo.Reason.Name(int(value))
    except (ValueError, TypeError):
        return str(value)


def local_preemption_info():
    """This worker's preemption notice (a PreemptionInfo or None), read locally: no collective.

    ray.train.get_preemption_info() reads this same field (train_fn_utils.DistributedTrainFnUtils) and then
    broadcasts rank 0's value through Ray Train's SynchronizationActor: an actor round trip per step. The
    step's flags all_reduce already makes every rank act on any rank's notice, so the local value is enough."""
    return _train_context.get_train_context().preemption_context.preemption_info


def draining_node_ids() -> dict:
    """Node id -> drain deadline (ms) of every draining node, as Ray Train's PreemptionWatcher reads it."""
    return _state.state.get_draining_nodes() or {}


# Ray Train's controller callback (a DeveloperAPI with no public import path in 2.60): fill-in claims
# GPUs in `before_controller_execute_resize_decision`, before a group starts, restarts or grows.
ControllerCallback = _train_callback.ControllerCallback


def gcs_client(address: str | None):
    """(gcs_address, GcsClient) for `address` ("auto"/None = the cluster `ray start` joined here), as the
    `ray drain-node` CLI builds it. No ray.init: a daemon needs no driver. Blocks (~40 s) when the GCS is
    unreachable."""
    gcs_address = _services.canonicalize_bootstrap_address_or_die(address or "auto")
    return gcs_address, _raylet.GcsClient(address=gcs_address)


def wrap_driver_stdstream(wrapper) -> None:
    """Install `wrapper(original, data, ignore_prefix)` around the driver's printer of worker/raylet log
    lines (looked up per message by the error-listener thread). Idempotent."""
    original = _worker.print_to_stdstream
    if getattr(original, "_spotfill_wrapped", False):
        return

    def print_to_stdstream(data, ignore_prefix: bool):
        return wrapper(original, data, ignore_prefix)

    print_to_stdstream._spotfill_wrapped = True
    _worker.print_to_stdstream = print_to_stdstream


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Node id -> resources available now (not reserved by any task, actor or placement group), from the
    GCS's view of each raylet's last report."""
    return _state.state.available_resources_per_node() or {}


def kv_get(key: str) -> bytes | None:
    """A value from the GCS key-value store (cluster-wide, outlives worker processes)."""
    return _kv._internal_kv_get(key, namespace="spotfill")


def kv_put(key: str, value: str) -> None:
    _kv._internal_kv_put(key, value, overwrite=True, namespace="spotfill")


def kv_list(prefix: str) -> list[str]:
    """Keys of the spotfill namespace that start with `prefix`."""
    return [k.decode() if isinstance(k, bytes) else k for k in _kv._internal_kv_list(prefix, namespace="spotfill")]


def kv_del(key: str) -> None:
    _kv._internal_kv_del(key, namespace="spotfill")


def gcs_actor_alive(actor_id: str, timeout=None) -> bool:
    """Whether the actor is alive, asked of the GCS (the owner of actor state), not the State API.

    Ray 2.60's is_actor_alive asks the dashboard's State API and reads a miss (None) as death; the GCS
    never forgets a live actor. A GCS that cannot answer raises RayStateApiException, which the cleaner
    loop treats as "unknown, keep monitoring"."""
    try:
        info = _state.state.actor_table(actor_id)
    except Exception as exc:
        raise RayStateApiException(f"GCS actor lookup failed: {exc}") from exc
    return bool(info) and info.get("State") != "DEAD"


def kill_actor_id(actor_id: str) -> None:
    """Kill the actor with this hex id, no restart (what ray.kill does with a handle). Ray's public kill
    needs a handle or a name; a Ray Data actor pool's actors have neither outside Data's executor, and one
    waiting for a GPU no one lent keeps the executor (and its iterator) waiting forever."""
    _worker.global_worker.core_worker.kill_actor(_raylet.ActorID.from_hex(actor_id), True)


def gcs_actors(states: tuple[str, ...] = ("ALIVE", "PENDING_CREATION")) -> list[dict]:
    """The cluster's actors in `states`, read from the GCS's actor table (one call per state): no State API,
    so no dashboard round trip (the fill-in arbiter reads this every second). Each: {"actor_id",
    "class_name", "state", "node_id" ("" while it has none), "start_time" (unix s, None until known)}."""
    out = []
    for state in states:
        for actor_id, a in _state.state.actor_table(None, actor_state_name=state).items():
            node = (a.get("Address") or {}).get("NodeID") or ""
            start = a.get("StartTime") or 0
            out.append({"actor_id": actor_id, "class_name": a.get("ActorClassName", ""), "state": a.get("State"),
                        "node_id": "" if set(node) <= {"f"} else node, "start_time": start / 1000.0 or None})
    return out


class GcsCheckedPlacementGroupCleaner(_pg_cleaner.PlacementGroupCleaner):
    """Ray Train's placement-group cleaner, deciding "the controller is dead" through the GCS.

    Stock, a State API miss (dashboard slow or restarting, the actor not yet in its cache) made the cleaner
    remove a healthy run's placement group -- killing every worker (ray-project/ray#65447). The cleaner runs
    in its own detached actor process, so replacing the module's liveness function there touches nothing
    else."""

    def __init__(self, controller_actor_id, check_interval_s, get_actor_timeout_s, stop_timeout):
        super().__init__(controller_actor_id, check_interval_s, get_actor_timeout_s, stop_timeout)
        _pg_cleaner.is_actor_alive = gcs_actor_alive


class GcsCheckedPlacementGroupCleanerCallback(_pg_callback.PlacementGroupCleanerCallback):
    """Launches GcsCheckedPlacementGroupCleaner instead of Ray's (in the controller actor's process)."""

    cleaner_cls = GcsCheckedPlacementGroupCleaner

    def after_controller_start(self, train_run_context):
        _pg_callback.PlacementGroupCleaner = self.cleaner_cls
        return super().after_controller_start(train_run_context)


def use_spotfill_controller(trainer_cls, make_policy=None):
    """A subclass of `trainer_cls` whose controller gets `make_policy(scaling_config)` instead of Ray's
    ElasticScalingPolicy, when given (the policy is built on the driver and handed to the controller
    actor), the GCS-checked placement-group cleaner instead of Ray's, and its callbacks marked
    `spotfill_runs_first` ahead of Ray's own (which the controller lists before RunConfig's)."""

    class Trainer(trainer_cls):
        def _initialize_and_run_controller(self, **kwargs):
            if make_policy and isinstance(kwargs.get("scaling_policy"), ElasticScalingPolicy):
                kwargs["scaling_policy"] = make_policy(self.scaling_config)
            callbacks = [GcsCheckedPlacementGroupCleanerCallback()
                         if type(cb) is _pg_callback.PlacementGroupCleanerCallback else cb
                         for cb in kwargs.get("callbacks") or []]
            kwargs["callbacks"] = callbacks_first(callbacks)
            return super()._initialize_and_run_controller(**kwargs)

    Trainer.__name__ = Trainer.__qualname__ = f"Spotfill{trainer_cls.__name__}"
    return Trainer


def callbacks_first(callbacks: list) -> list:
    """`callbacks` with those marked `spotfill_runs_first` moved to the front, order otherwise kept.
    The worker-group teardown reaper must run before Ray Train's backend callback, whose torch
    process-group shutdown waits on every worker -- the dead ones too -- for up to 30 s."""
    return sorted(callbacks, key=lambda cb: not getattr(cb, "spotfill_runs_first", False))


def skip_deepspeed_muon() -> bool:
    """Stand in for DeepSpeed's Muon optimizer modules with ones that define the names DeepSpeed imports
    from them (its isinstance checks answer False; the update functions are only reached for parameters
    marked use_muon) and apply no torch.compile: the engine is built and steps without importing
    torch._inductor. Building a Muon optimizer afterwards fails with a clear message. Returns False when a
    real module is already imported (then nothing is replaced)."""
    if any(m in sys.modules and not isinstance(sys.modules[m], _MuonStandIn) for m in MUON_MODULES):
        return False
    for module, names in MUON_MODULES.items():
        sys.modules.setdefault(module, _MuonStandIn(module, names))
    return True


class _MuonStandIn(types.ModuleType):
    def __init__(self, name: str, names: tuple[str, ...]):
        super().__init__(name, f"spotfill's stand-in for {name} (real file: {_MUON_PATHS[name]})")
        why = "DeepSpeed's Muon optimizer is not loaded in spotfill workers: spotfill trains with AdamW"

        class MuonWithAuxAdam:
            def __init__(self, *args, **kwargs):
                raise RuntimeError(why)

        def refuse(*args, **kwargs):
            raise RuntimeError(why)

        for n in names:
            setattr(self, n, MuonWithAuxAdam if n == "MuonWithAuxAdam" else refuse)


def unreachable_workers(worker_group, timeout_s: float) -> list:
    """The workers of a Ray Train worker group that do not answer a metadata call within `timeout_s`
    (their process or node is gone), as (world_rank, node_id, actor) tuples."""
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


def single_host_loopback(enabled: bool) -> bool:
    """Make this process treat Ray as single-host (the embedded cluster): node addresses default to
    127.0.0.1 and a 127.0.0.1 bootstrap address stays 127.0.0.1 -- ray.init(address="127.0.0.1:port")
    otherwise rewrites it to the machine's network address (services.get_node_ip_address), where a
    loopback-bound GCS does not listen. Returns the previous setting (pass it back to restore). Child
    processes get the same through RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in their environment."""
    previous = _ray_constants.ENABLE_RAY_CLUSTER
    _ray_constants.ENABLE_RAY_CLUSTER = not enabled
    return not previous


class StaleBuildLock(RuntimeError):
    """A JIT op build lock whose owner is gone was removed; the load starts over."""


class OwnedFileBaton(_FileBaton):
    """torch's JIT build lock, with its owner written in it and a wait that ends when the owner is gone
    (torch's own waits forever on a lock a killed worker left behind). Decisions: spotfill.train.opcache."""

    def try_acquire(self):
        got = super().try_acquire()
        if got:   # torch opens it read-only: record the owner through a second descriptor
            try:
                with open(self.lock_file_path, "w") as f:
                    f.write(owner_record(socket.gethostname(), boot_id(), os.getpid(), time.time()))
            except BaseException:
                self.release()    # never leave an ownerless lock behind
                raise
        return got

    def wait(self):
        while os.path.exists(self.lock_file_path):
            reason = self._stale()
            if reason:
                try:
                    os.remove(self.lock_file_path)
                except FileNotFoundError:
                    pass
                log.warning("removed stale JIT op build lock %s: %s", self.lock_file_path, reason)
                raise StaleBuildLock(f"{self.lock_file_path}: {reason}")
            time.sleep(self.wait_seconds)

    def _stale(self) -> str | None:
        try:
            age = time.time() - os.stat(self.lock_file_path).st_mtime
            with open(self.lock_file_path) as f:
                owner = parse_owner(f.read())
        except FileNotFoundError:
            return None
        return stale_reason(owner, age, socket.gethostname(), boot_id(), pid_alive)


def guard_jit_op_builds(retries: int = 3) -> None:
    """Make torch's JIT extension loads (DeepSpeed's ops) survive build locks left by killed processes:
    the lock records its owner, a waiter removes a stale one and the load starts over (building the op
    itself). Idempotent; this process only."""
    if getattr(_cpp_ext.load, "_spotfill_guarded", False):
        return
    original = _cpp_ext.load

    def load(*args, **kwargs):
        name = kwargs.get("name", args[0] if args else None)
        for _ in range(retries):
            try:
                return original(*args, **kwargs)
            except StaleBuildLock:
                # torch remembers it already "built" this op in this process; forget it, so the retry builds
                _cpp_ext.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
        return original(*args, **kwargs)

    load._spotfill_guarded = True
    _cpp_ext.FileBaton = OwnedFileBaton
    _cpp_ext.load = load


def _tune_controller_sets(attr: str) -> bool:
    import inspect
    try:
        return f"self.{attr}" in inspect.getsource(_TuneController.__init__)
    except (OSError, TypeError):
        return False


if not _tune_controller_sets("_actor_force_cleanup_timeout"):
    raise RayCompatError(f"spotfill needs TuneController._actor_force_cleanup_timeout (checked against ray "
                         f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} does not set it")


def tune_force_cleanup_after(controller, seconds: float) -> None:
    """Kill a stopping trial actor `seconds` after Tune asked it to stop, whatever it is doing. Ray 2.60's
    TuneController waits TUNE_FORCE_TRIAL_CLEANUP_S, and then, for an actor that started (created, even if
    its setup still runs), up to a fixed `_actor_force_cleanup_timeout` of 10 s more for its `stop()` --
    which is queued behind the actor's constructor or its current `train()` call. A fill-in trial starved of
    CPU held its GPU that long past a reclaim, beyond its grace (fillin/sweep.py). `controller`: as for
    tune_unstage_trial."""
    ctrl = getattr(controller, "_tune_controller", controller)
    if not hasattr(ctrl, "_actor_force_cleanup_timeout"):
        raise RayCompatError(f"spotfill needs TuneController._actor_force_cleanup_timeout (checked against ray "
                             f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} does not have it")
    ctrl._actor_force_cleanup_timeout = seconds


def tune_unstage_trial(controller, trial) -> bool:
    """Forget that Tune staged `trial` (placement group requested, actor not started yet) after the sweep's
    scheduler paused it (fillin/sweep.py: a claim arrived while the trial was starting). Ray 2.60's
    TuneController only unstages a trial when its actor starts; a paused trial left in its staged set is
    only ever started with a cached actor, i.e. never with reuse_actors off. `controller` is what Tune hands
    a TrialScheduler (a TrialRunnerWrapper around the controller) or the controller itself."""
    ctrl = getattr(controller, "_tune_controller", controller)
    staged = getattr(ctrl, "_staged_trials", None)
    if staged is None:
        raise RayCompatError(f"spotfill needs TuneController._staged_trials (checked against ray "
                             f"{RAY_VERSION_CHECKED}); installed ray {ray.__version__} does not have it")
    if trial in staged:
        ctrl._unstage_trial_with_resources(trial)
        return True
    return False


def zero_elastic_supported(engine) -> bool:
    """Whether `engine` (built with zero_optimization.elastic_checkpoint) saves ZeRO-1/2 optimizer state
    in DeepSpeed's elastic layout, which zero_load_resharded loads at any data-parallel size."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer) and bool(engine.optimizer.elastic_checkpoint)


def zero_load_elastic(engine, load_dir: str, tag: str) -> dict:
    """Load a ZeRO-1/2 checkpoint saved in DeepSpeed's elastic layout, at the saved data-parallel size or
    any other, exactly (fp32 master weights and every optimizer state), without universal conversion.

    DeepSpeed 0.19 has the pieces but not the path: engine._load_zero_checkpoint raises when the
    data-parallel size changed, its legacy loader indexes the saved ranks by the current rank (fails when
    growing), and both of its elastic-layout restores read a param-group "step" that torch's AdamW (the
    client optimizer spotfill uses) does not keep. So: the module, LR scheduler and client state through
    the public load (optimizer states off); then this rank's partition of every optimizer state and of the
    fp32 weights, and the learning rate from the restored scheduler -- at the saved size read from its own file, at another size merged from every saved rank's
    file and re-partitioned with DeepSpeed's own helpers. Returns the client state."""
    import torch
    import torch.distributed as dist
    from deepspeed.checkpoint import constants as ds_keys

    for key in ZERO_ELASTIC_KEYS:
        _require(ds_keys, key)
    opt, zc = engine.optimizer, engine._config.zero_config
    _require(type(engine), "_get_all_zero_checkpoints", ("load_dir", "tag"))
    _require(type(opt), "_partition_base_optimizer_state", ("state_key", "all_partition_states", "group_id"))
    _require(type(opt), "_restore_from_elastic_fp32_weights", ("all_state_dict",))
    _require(type(opt), "_load_global_state", ("sd",))
    _require(type(opt), "_link_all_hp_params", ())
    if not zero_elastic_supported(engine):
        raise RuntimeError("zero_load_elastic needs a ZeRO-1/2 engine built with "
                           "zero_optimization.elastic_checkpoint: true")
    _, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=False,
                                             load_lr_scheduler_states=True)
    if client_state is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {load_dir}")
    dp_rank, dp_world = dist.get_rank(group=opt.dp_process_group), dist.get_world_size(group=opt.dp_process_group)
    same = int(engine.loaded_checkpoint_dp_world_size) == dp_world
    zc.elastic_checkpoint = not same          # DeepSpeed reads every rank's file only when elastic is set
    try:
        saved = engine._get_all_zero_checkpoints(load_dir, tag)
    finally:
        zc.elastic_checkpoint = True
    if not saved or (same and saved[dp_rank] is None) or (not same and any(sd is None for sd in saved)):
        raise FileNotFoundError(f"ZeRO partitions of {tag!r} missing under {load_dir}")
    base, fp32 = ds_keys.BASE_OPTIMIZER_STATE, ds_keys.SINGLE_PARTITION_OF_FP32_GROUPS
    own = saved[dp_rank] if same else saved[0]
    if isinstance(own[base], dict):
        raise RuntimeError(f"checkpoint {tag!r} holds a rigid (non-elastic) ZeRO optimizer state")
    opt._load_global_state(own)

    def put(dst, value):                      # this rank's share, zero-padded to the live partition
        value = value.reshape(-1)
        if value.numel() < dst.numel():
            value = torch.cat([value, value.new_zeros(dst.numel() - value.numel())])
        dst.data.copy_(value.reshape(dst.shape).to(dtype=dst.dtype, device=dst.device))

    for i, group in enumerate(opt.optimizer.param_groups):
        p = group["params"][0]
        for key in own[base][i]:
            if same:
                mine = own[base][i][key]
            else:
                values = [sd[base][i][key] for sd in saved]
                partitioned = all(torch.is_tensor(v) and v.shape == sd[fp32][i].shape for v, sd in zip(values, saved))
                mine = opt._partition_base_optimizer_state(key, values, i, is_partition_state=partitioned)
            dst = opt.optimizer.state[p].get(key)
            if torch.is_tensor(mine) and torch.is_tensor(dst):
                put(dst, mine)
            else:
                opt.optimizer.state[p][key] = mine.clone() if torch.is_tensor(mine) else mine
    if same:
        for current, part in zip(opt.single_partition_of_fp32_groups, own[fp32]):
            put(current, part)
    else:
        opt._restore_from_elastic_fp32_weights(saved)
    opt._link_all_hp_params()
    # The elastic layout keeps optimizer states, not param groups: the learning rate the saved optimizer
    # held is the one the restored scheduler gives at its iteration (DeepSpeed's schedulers set it so).
    sched = engine.lr_scheduler
    if sched is not None and hasattr(sched, "last_batch_iteration"):
        sched.step(sched.last_batch_iteration)
    return client_state


def worker_setup_hook_env(hook: str, env: dict[str, str], job_runtime_env: dict | None = None) -> dict[str, str]:
    """`env` (a runtime_env's env_vars) with `hook` ("module.function") as the worker processes' setup
    hook: Ray's `worker_process_setup_hook` in the form Ray's job-level runtime_env turns it into (the env
    var its default_worker.py reads at process start), here for the processes of one runtime_env (Ray Train's
    worker_runtime_env), which Ray does not convert itself. A hook already set -- in `env`, this process's
    environment or the job's runtime_env (`job_runtime_env`, the user's) -- is kept: nothing is added."""
    name = _ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    job = job_runtime_env or {}
    if (env.get(name) or os.environ.get(name) or job.get("worker_process_setup_hook")
            or (job.get("env_vars") or {}).get(name)):
        return dict(env)
    return {**env, name: hook}


def prestart_workers(num_workers: int, keep_alive_s: int, timeout_s: float = 5.0) -> None:
    """Ask this node's raylet to start `num_workers` idle worker processes now, with the runtime_env of the
    calling worker (the exact serialized string its own task carried, so the raylet's runtime_env hash
    matches) for the calling job, kept idle for `keep_alive_s` even above Ray's idle-worker soft limit.
    Actors the next worker group creates on this node with that runtime_env land on them instead of
    spawning processes (Ray's worker pool hands a new lease an idle worker of the same job and runtime_env
    hash), and the processes' setup hook (spotfill.train.warm) has had their imports running since they
    started. Ray's public API has no call for this (the raylet's PrestartWorkers RPC, Ray 2.60)."""
    ctx = ray.get_runtime_context()
    node_id = ctx.get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"]), None)
    if node is None:
        raise RuntimeError(f"node {node_id[:12]} is not in the cluster's node list")
    request = _nm_pb2.PrestartWorkersRequest(
        language=common_pb2.Language.Value("PYTHON"), job_id=bytes.fromhex(ctx.get_job_id()),
        keep_alive_duration_secs=int(keep_alive_s), num_workers=int(num_workers))
    request.runtime_env_info.serialized_runtime_env = ctx.get_runtime_env_string() or "{}"
    channel = _grpc_utils.init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        _nm_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=timeout_s)
    finally:
        channel.close()


# -- Ray Serve: the running replicas of a deployment, pushed by the controller ------------------------------
# Serve's routers learn a deployment's running replicas from the controller's long poll
# (LongPollNamespace.DEPLOYMENT_TARGETS): one pending call per listener, answered when the set changes (a
# replica starts running, or is told to stop and gets no new request). The fill-in Ingress listens to the
# same push instead of calling serve.status() every 0.1 s. Importing ray.serve costs about 0.4 s on top of
# this module, so these hooks are resolved and checked by check_serve_hooks() -- when serving/app.py is
# imported (every Serve process of the app) and by tests/unit/test_ray_compat.py -- not by every process
# that imports this module (training workers).
def _serve_hooks() -> list:
    from ray.serve._private import common as _serve_common, constants as _serve_constants
    from ray.serve._private import long_poll as _serve_long_poll
    return [
        (_serve_long_poll, "LongPollClient", None),
        (_serve_long_poll.LongPollClient, "__init__", ("host_actor", "key_listeners", "call_in_event_loop",
                                                       "client_id")),
        (_serve_long_poll.LongPollClient, "stop", ()),
        (_serve_long_poll.LongPollNamespace, "DEPLOYMENT_TARGETS", None),
        (_serve_common, "DeploymentID", None),
        (_serve_common.DeploymentID, "__init__", ("name", "app_name")),
        (_serve_common, "DeploymentTargetInfo", None),
        (_serve_common.DeploymentTargetInfo, "__init__", ("is_available", "running_replicas")),
        (_serve_constants, "SERVE_CONTROLLER_NAME", None),
        (_serve_constants, "SERVE_NAMESPACE", None),
    ]


def check_serve_hooks() -> None:
    """Resolve and check the private Serve hooks watch_running_replicas uses (RayCompatError if one moved)."""
    for owner, name, params in _serve_hooks():
        _require(owner, name, params)


def watch_running_replicas(app: str, deployment: str, on_change, event_loop):
    """Call `on_change(ids)` with the ids of the running replicas of `app`'s `deployment` (their
    `serve.get_replica_context().replica_id.unique_id`) each time the Serve controller announces a change (no
    call while nothing changes; none at all before the deployment's first running replica). A replica told to
    stop leaves the list at once. The callbacks run on `event_loop`, which must keep running. Returns the
    listener; its `is_running` turns False when the controller went away (a new controller: watch again)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve._private.long_poll import LongPollClient, LongPollNamespace
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    key = (LongPollNamespace.DEPLOYMENT_TARGETS, DeploymentID(name=deployment, app_name=app))
    def ids(info) -> list[str]:
        return [str(getattr(getattr(r, "replica_id", None), "unique_id", r)) for r in info.running_replicas]
    return LongPollClient(controller, {key: lambda info: on_change(ids(info))},
                          call_in_event_loop=event_loop,
                          client_id=f"spotfill-replica-watch:{app}/{deployment}:{os.getpid()}")


# -- what the cluster says about itself (the fill-in arbiter, on the head) ----------------------------------
def cluster_config_node_groups() -> list[tuple[int, int]] | None:
    """(min_count, max_count) of every node group in the cluster config an autoscaler reported to the GCS
    (what Ray Data's autoscaling check reads), or None when none was reported."""
    config = _state.state.get_cluster_config()
    if config is None:
        return None
    return [(int(g.min_count), int(g.max_count)) for g in config.node_group_configs if g.resources]


def dashboard_url() -> str | None:
    """The dashboard's address as the head registered it in the GCS (Serve's scale endpoint lives there)."""
    raw = _kv._internal_kv_get("webui:url", namespace=_ray_constants.KV_NAMESPACE_DASHBOARD)
    return raw.decode() if isinstance(raw, bytes) else raw


def dead_job_ids() -> set[str]:
    """Hex ids of the Ray jobs (drivers) the GCS knows to have ended."""
    return {j["JobID"] for j in _state.state.job_table() if j.get("IsDead")}


# -- Ray Train's torch backend (train/backend.py chooses NCCL or gloo on the first worker) -------------------
_warned: set[str] = set()


def warn_once(hook: str, lost: str) -> None:
    """One warning per process for a robustness hook whose private name is gone."""
    if hook not in _warned:
        _warned.add(hook)
        log.warning("spotfill: %s is not in the installed ray %s (checked against %s): %s", hook, ray.__version__,
                    RAY_VERSION_CHECKED, lost)


def torch_train_backend():
    """Ray Train's torch Backend class (ray.train.torch.config._TorchBackend), or None when it is gone: then
    Ray's own backend choice applies (NCCL for any GPU worker, which fails where the GPU resource has no CUDA
    device behind it)."""
    try:
        from ray.train.torch.config import _TorchBackend
    except ImportError:
        warn_once("ray.train.torch.config._TorchBackend", "the torch backend follows Ray's choice (NCCL for "
                  "any GPU worker), not what the workers have")
        return None
    return _TorchBackend


def dashboard_auth_headers() -> dict[str, str]:
    """The Authorization header a request to this cluster's dashboard needs when the cluster runs with token
    authentication (RAY_AUTH_MODE=token; Ray 2.60 turns it on for local clusters when ~/.ray/auth_token
    exists): {} otherwise. Serve's scale endpoint (fill-in's external scaler) answers 401 without it."""
    try:
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    except ImportError:
        warn_once("ray._private.authentication.http_token_authentication.get_auth_headers_if_auth_enabled",
                  "requests to a dashboard with token authentication carry no token (Serve's scale endpoint "
                  "answers 401 there)")
        return {}
    return dict(get_auth_headers_if_auth_enabled({}) or {})
