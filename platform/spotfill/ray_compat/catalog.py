"""Every private Ray/torch/DeepSpeed hook spotfill uses: its class, what it does, and why that class.

The class was decided from each hook's call sites: a hook is *robustness* when the code that uses it has a
plain path that still does the job (stock Ray, stock torch, a public API), only slower or less sturdy; it is
*required* when the feature it serves has no such path. `python -m spotfill.ray_compat` prints this table
against the installed versions; docs/compatibility.md explains it.
"""
from __future__ import annotations

import importlib.util
import inspect
import os

from spotfill.ray_compat.hooks import REQUIRED, ROBUSTNESS, Hook

RAY, TORCH, DS = "ray 2.60", "torch 2.11 to 2.13", "deepspeed 0.19"
_CB = "ray.train.v2._internal.execution.callback"
_WG = "ray.train.v2._internal.execution.worker_group"
_PGC = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
_STATE = "ray._private.state"
_KV = "ray.experimental.internal_kv"
_TUNE = "ray.tune.execution.tune_controller:TuneController"
_FAKE = "ray.autoscaler._private.fake_multi_node.node_provider"
_C10D = "torch.distributed.distributed_c10d"

# DeepSpeed imports its Muon optimizer modules lazily (ZeRO's optimizer check at initialize, its gradient
# reduction on every step) and they apply torch.compile at import. Each is located without importing
# DeepSpeed, and each name DeepSpeed imports from it is checked to be defined there.
MUON_MODULES = {
    "deepspeed.runtime.zero.muon.muon_optimizer": ("MuonWithAuxAdam",),
    "deepspeed.runtime.zero.muon.original_muon": ("MuonWithAuxAdam", "muon_update", "adam_update"),
}
# DeepSpeed ZeRO-1/2 internals the elastic (no conversion) resharding load uses, checked by name in the
# installed source (the driver checks before any worker starts, without importing DeepSpeed) and by
# signature when first used (ray_compat.deepspeed_engine). At another data-parallel size each rank copies its
# window of the merge of the saved partitions (ray_compat/zero_merge.py redoes DeepSpeed's
# flatten_dense_tensors_aligned + get_data_parallel_partitions arithmetic with the optimizer's
# nccl_start_alignment_factor; the load also checks the window's size against the live partition).
ZERO_ELASTIC_SOURCES = {
    "runtime/engine.py": ("_get_all_zero_checkpoint_names", "zero_elastic_checkpoint", "load_checkpoint"),
    "runtime/zero/stage_1_and_2.py": ("_load_global_state", "flatten_dense_tensors_aligned",
                                      "get_data_parallel_partitions", "_link_all_hp_params",
                                      "_get_state_without_padding", "state_dict"),
}
# attributes the ZeRO optimizer's __init__ sets (`self.<name> =` in the source; on the live optimizer)
ZERO_ELASTIC_ATTRS = {"runtime/zero/stage_1_and_2.py": ("nccl_start_alignment_factor",)}

# DeepSpeed 0.19's checkpoint file names (engine._get_ckpt_name, _get_rank_zero_ckpt_name): the module file
# of model-parallel rank 00, and one ZeRO partition per data-parallel rank. A restoring node brings only the
# files its ranks load (train/checkpoint_files.py reads these names); checked in the source that builds them.
DS_CHECKPOINT_NAMES = {
    "runtime/engine.py": ('"mp_rank_" + mp_rank_str + "_model_states.pt"', "zero_pp_rank_{}",
                          'f\'{"bf16_" if bf16_mode else ""}zero_pp_rank_{dp_rank}\'',
                          'f"{file_prefix}_mp_rank_{mp_rank:02d}_optim_states.pt"',
                          'f"{filename}_mp_rank_{mp_rank_str}_model_states.pt"'),
}


# DeepSpeed's PipelineEngine runs a step's schedule in `_exec_schedule`, dispatching every instruction
# through `self._INSTRUCTION_MAP[type(cmd)]` (deepspeed 0.19; unchanged since 2023). The bubble probe
# (train/bubble_probe.py) gives one engine instance its own copy of that map with timed wrappers: no fork,
# no subclass (deepspeed.initialize builds PipelineEngine itself). Checked in the source (the driver, without
# importing DeepSpeed), the map and the dispatch again when first used (ray_compat.deepspeed_engine).
PIPE_ENGINE_SOURCE = "runtime/pipe/engine.py"
PIPE_DISPATCH = "self._INSTRUCTION_MAP[type(cmd)]"


def deepspeed_source(rel: str) -> tuple[str, str]:
    """(path, text) of a file of the installed DeepSpeed, found without importing it ("" when absent)."""
    spec = importlib.util.find_spec("deepspeed")
    path = os.path.join(os.path.dirname(spec.origin), rel) if spec and spec.origin else f"deepspeed/{rel}"
    return path, (open(path, encoding="utf-8").read() if os.path.isfile(path) else "")


def _muon_files() -> str | None:
    for module, names in MUON_MODULES.items():
        path, text = deepspeed_source(os.path.join(*module.split(".")[1:]) + ".py")
        missing = [n for n in names if f"def {n}(" not in text and f"class {n}" not in text]
        if not text or missing:
            return f"{module} defining {', '.join(missing or names)} ({path})"
    return None


def _shm_comm_source() -> str | None:
    """DeepSpeed's TorchBackend takes its shm op from the module's build_shm_op and copes with None."""
    path, text = deepspeed_source(os.path.join("comm", "torch.py"))
    for needed in ("self.shm_comm_op = build_shm_op()", "if self.shm_comm_op != None"):
        if needed not in text:
            return f"deepspeed/comm/torch.py with {needed!r} ({path})"
    return None


def _zero_elastic_files() -> str | None:
    for rel, names in ZERO_ELASTIC_SOURCES.items():
        path, text = deepspeed_source(rel)
        missing = [n for n in names if f"def {n}(" not in text]
        missing += [n for n in ZERO_ELASTIC_ATTRS.get(rel, ()) if f"self.{n} =" not in text]
        if not text or missing:
            return f"{rel} defining {', '.join(missing or names)} ({path})"
    return None


def _checkpoint_names() -> str | None:
    for rel, forms in DS_CHECKPOINT_NAMES.items():
        path, text = deepspeed_source(rel)
        missing = [f for f in forms if f not in text]
        if not text or missing:
            return f"{rel} naming checkpoint files {missing[0] if missing else 'as 0.19 does'} ({path})"
    return None


def _pipe_engine_file() -> str | None:
    path, text = deepspeed_source(PIPE_ENGINE_SOURCE)
    missing = [n for n in ("def _exec_schedule(", "_INSTRUCTION_MAP = {", PIPE_DISPATCH) if n not in text]
    return f"{PIPE_ENGINE_SOURCE} with {', '.join(missing)} ({path})" if not text or missing else None


def _sets_in_init(owner: str, attr: str):
    def check() -> str | None:
        from spotfill.ray_compat.hooks import resolve
        cls = resolve(owner)
        try:
            if f"self.{attr}" in inspect.getsource(cls.__init__):
                return None
        except (OSError, TypeError):
            pass
        return f"{owner.replace(':', '.')}.{attr} (not set by its __init__)"
    check.__name__ = f"sets_{attr}"
    return check


def _worker_has_actor() -> str | None:
    from spotfill.ray_compat.hooks import resolve
    fields = getattr(resolve(f"{_WG}.worker:Worker"), "__dataclass_fields__", {})
    return None if "actor" in fields else f"{_WG}.worker.Worker.actor (missing)"


def _train_context_has_preemption() -> str | None:
    from spotfill.ray_compat.hooks import resolve
    cls = resolve("ray.train.v2._internal.execution.context:TrainContext")
    ok = "preemption_context" in getattr(cls, "__dataclass_fields__", {})
    return None if ok else "ray.train.v2._internal.execution.context.TrainContext.preemption_context (missing)"


def _prestart_fields() -> str | None:
    from spotfill.ray_compat.hooks import resolve
    want = ("language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers")
    got = resolve("ray.core.generated.node_manager_pb2:PrestartWorkersRequest").DESCRIPTOR.fields_by_name
    missing = [f for f in want if f not in got]
    return f"PrestartWorkersRequest fields {missing} (missing)" if missing else None


# The experiment state files a sweep rerun checks before Tune restores them (fillin/sweep_state.py reads
# them by these names; ray_compat imports no fill-in module).
TUNE_EXPERIMENT_STATE = ("experiment_state-", ".json")    # TuneController.CKPT_FILE_TMPL
TUNE_SEARCHER_STATE = ("searcher-state-", ".pkl")         # Searcher.CKPT_FILE_TMPL


def _tune_state_files() -> str | None:
    """Tune writes its state files under the names fillin/sweep_state.py reads."""
    from spotfill.ray_compat.hooks import resolve
    for owner, (head, tail) in ((_TUNE, TUNE_EXPERIMENT_STATE),
                                ("ray.tune.search:Searcher", TUNE_SEARCHER_STATE)):
        tmpl = resolve(f"{owner}.CKPT_FILE_TMPL")
        if tmpl != f"{head}{{}}{tail}":
            return f"{owner.replace(':', '.')}.CKPT_FILE_TMPL {head}{{}}{tail} (it writes {tmpl})"
    return None


def _torch_locks_itself() -> str | None:
    import torch.utils.cpp_extension as cpp_ext
    if hasattr(cpp_ext, "FileLock") and not hasattr(cpp_ext, "FileBaton"):
        return ("torch's own JIT build lock is an OS lock (filelock) the kernel releases when its holder dies, "
                "so a killed builder leaves no stale lock")
    return None


def _new_group_default_read() -> str | None:
    """torch's _get_default_timeout still reads the module defaults new_groups_timeout sets (a torch that
    kept the default elsewhere would leave the setting without effect, silently)."""
    from spotfill.ray_compat.hooks import resolve
    try:
        if "default_pg_timeout" in inspect.getsource(resolve(f"{_C10D}:_get_default_timeout")):
            return None
    except (OSError, TypeError):
        pass
    return f"{_C10D}._get_default_timeout reading default_pg_timeout"


def _hooks(*hooks: Hook) -> dict[str, Hook]:
    return {h.name: h for h in hooks}


HOOKS = _hooks(
    # -- torch -------------------------------------------------------------------------------------------
    Hook("jit_build_lock_guard", ROBUSTNESS, "torch", TORCH,
         "torch's JIT op build lock (DeepSpeed's ops build through it) records its owner; a waiter removes a "
         "lock whose owner is gone and builds the op itself",
         "a JIT op build lock left by a killed process is not removed: the next load of that op on that "
         "machine waits on it forever (delete the `lock` file under TORCH_EXTENSIONS_DIR)",
         "train.engine.build_engine installs it; ops load with torch's plain lock without it",
         names=("torch.utils.cpp_extension:FileBaton", "torch.utils.cpp_extension:load(name, sources)",
                "torch.utils.cpp_extension:JIT_EXTENSION_VERSIONER.entries",
                "torch.utils.file_baton:FileBaton.__init__(lock_file_path, wait_seconds)",
                "torch.utils.file_baton:FileBaton.try_acquire", "torch.utils.file_baton:FileBaton.wait",
                "torch.utils.file_baton:FileBaton.release"),
         not_needed=_torch_locks_itself),
    Hook("deepspeed_group_timeout", ROBUSTNESS, "torch", TORCH,
         "DeepSpeed's process groups (its ZeRO data-parallel group, a new_group clone of the world) time out "
         "after SPOTFILL_COLLECTIVE_TIMEOUT_S, as the run's default group does",
         "DeepSpeed's groups keep torch's global default timeout (30 minutes; NCCL 10): a rank waiting for a "
         "silent peer in ZeRO's gradient reduction waits that long before Ray Train restarts the group (the "
         "default group's collectives still give up after SPOTFILL_COLLECTIVE_TIMEOUT_S)",
         "train.engine builds the engine all the same; DeepSpeed's groups then take torch's own default",
         names=(f"{_C10D}:_get_default_timeout(backend)", f"{_C10D}:default_pg_timeout"),
         checks=(_new_group_default_read,)),
    # -- DeepSpeed ---------------------------------------------------------------------------------------
    Hook("deepspeed_muon_stand_in", ROBUSTNESS, "deepspeed", DS,
         "DeepSpeed's Muon optimizer modules are replaced by stand-ins that apply no torch.compile",
         "every worker imports DeepSpeed's Muon modules, whose torch.compile costs ~1.5 s of torch._inductor "
         "imports per worker start, on the recovery path",
         "train.engine and train.worker_loop only skip an import: DeepSpeed's real modules work",
         checks=(_muon_files,)),
    Hook("deepspeed_shm_comm_skip", ROBUSTNESS, "deepspeed", DS,
         "DeepSpeed's comm backend starts without its shared-memory all-reduce op (used only by its "
         "inference_all_reduce), so no worker JIT-builds or loads it",
         "on a CPU accelerator every fresh machine's first worker start JIT-builds the op (31.7 s of g++ on "
         "2 cores, inside deepspeed.initialize) and every later start checks and loads the cached build",
         "train.engine and train.pipeline only skip a build: DeepSpeed builds and loads the op as before",
         names=("deepspeed.comm.torch:build_shm_op",), checks=(_shm_comm_source,)),
    Hook("zero_elastic_load", REQUIRED, "deepspeed", DS,
         "loads a ZeRO-1/2 checkpoint in DeepSpeed's elastic layout at any data-parallel size, exactly",
         "resuming a ZeRO-1/2 run (training.zero_stage 1 or 2) from its checkpoint",
         "train.engine.load_checkpoint has no other way to restore these checkpoints (DeepSpeed 0.19's own "
         "load refuses another data-parallel size); the driver checks before any worker starts",
         checks=(_zero_elastic_files,)),
    Hook("restore_node_files", ROBUSTNESS, "deepspeed", DS,
         "a restoring node brings only the checkpoint files its ranks load: the module file and, at the saved "
         "data-parallel size, its own ranks' ZeRO partitions (DeepSpeed's file names say whose partition a file "
         "holds)",
         "every restoring node downloads every file of the checkpoint (all ranks' ZeRO partitions)",
         "train.restore has the plain path: bring the whole checkpoint to every node (it also does so for any "
         "file name train.checkpoint_files does not know)",
         checks=(_checkpoint_names,)),
    Hook("pipe_bubble_probe", REQUIRED, "deepspeed", DS,
         "one PipelineEngine instance gets its own instruction map with timed wrappers (the bubble probe)",
         "pipeline-parallel training (training.pipeline_stages > 1: its bubble probe times every instruction "
         "of a stage and fills the bubbles)",
         "train.pipeline builds a BubbleProbe for every pipeline engine; it has no path without the map; the "
         "driver checks before any worker starts",
         names=("deepspeed.runtime.pipe.module:PipelineModule",),
         checks=(_pipe_engine_file, _sets_in_init("deepspeed.runtime.pipe.module:PipelineModule", "_local_start"),
                 _sets_in_init("deepspeed.runtime.pipe.module:PipelineModule", "_local_stop"))),
    # -- Ray Train ---------------------------------------------------------------------------------------
    Hook("train_controller_callbacks", REQUIRED, "ray", RAY,
         "Ray Train's controller and worker-group callbacks report each controller state change to the "
         "run's event sink",
         "training (each attempt's cause in events.jsonl and the failure budget training.max_failures)",
         "train.sink.RestartCauseCallback counts unplanned failures against training.max_failures (Ray's own "
         "budget is off); without it a failing run would restart forever",
         names=(f"{_CB}:ControllerCallback.after_controller_state_update(previous_state, current_state)",
                f"{_CB}:WorkerGroupCallback.after_worker_group_start(worker_group)",
                f"{_WG}.worker_group:WorkerGroup.get_worker_group_state")),
    Hook("ledger_group_end", ROBUSTNESS, "ray", RAY,
         "the GPU-seconds ledger learns when a worker group's GPUs were let go (train/sink.py, group_end)",
         "the GPU-seconds ledger dates a worker group's end from the run's other events, not from its teardown",
         "train.sink.RestartCauseCallback's hook is simply not called; the ledger falls back on other events",
         names=(f"{_CB}:WorkerGroupCallback.after_worker_group_shutdown(worker_group_context)",)),
    Hook("device_aware_torch_backend", ROBUSTNESS, "ray", RAY,
         "the torch.distributed backend follows what the first worker has (NCCL with CUDA, else gloo)",
         "the torch backend follows Ray's choice (NCCL for any GPU worker), which fails where the GPU resource "
         "has no CUDA device behind it",
         "train.backend then keeps Ray's TorchConfig backend",
         names=("ray.train.torch.config:_TorchBackend.on_start(worker_group, backend_config)",)),
    Hook("warm_placement", ROBUSTNESS, "ray", RAY,
         "a restart after a loss or notice is placed on the nodes whose warm spares it counted on (a label "
         "selector on Ray's node-id label, returned from the controller's start-worker-group hook)",
         "Ray places the restarted group where it fits, possibly on a node new to the run: its workers then "
         "start cold (process start and imports) although the survivors' spares were warm",
         "train.elastic.DrainAwareElasticPolicy returns no selector; the group starts, only slower",
         names=(f"{_CB}:ControllerCallback.on_controller_start_worker_group(scaling_config, num_workers)",
                "ray._raylet:RAY_NODE_ID_KEY")),
    Hook("fillin_claims", REQUIRED, "ray", RAY,
         "training claims the GPUs fill-in lent before a worker group starts, restarts or grows",
         "fill-in beside training (the claim of lent GPUs before a worker group starts)",
         "train.fillin_claims.FillinClaimCallback: without the claim training would wait for tenants that "
         "are never told to hand back",
         names=(f"{_CB}:ControllerCallback.before_controller_execute_resize_decision(resize_decision)",)),
    Hook("drain_aware_restarts", ROBUSTNESS, "ray", RAY,
         "restarts are sized from the free capacity of nodes that are alive and not draining; rank 0 grows "
         "the group gracefully when capacity returns",
         "restarts are sized by Ray Train's own elastic policy, which counts draining and just-lost nodes "
         "(a restart after a loss can wait out RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) and the group does not "
         "grow back until its next restart (where TorchTrainer._initialize_and_run_controller itself moved, the "
         "teardown reaper also runs after Ray's own teardown callbacks)",
         "train.elastic: SpotfillTorchTrainer falls back to TorchTrainer's controller and policy",
         names=("ray.train.torch:TorchTrainer._initialize_and_run_controller",
                "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy._count_possible_workers"
                "(reserved_resources)",
                "ray.train.v2._internal.execution.scaling_policy:ElasticScalingPolicy."
                "make_decision_for_running_worker_group(worker_group_state, worker_group_status)",
                f"{_STATE}:state", f"{_STATE}:GlobalState.get_draining_nodes",
                f"{_STATE}:GlobalState.available_resources_per_node",
                f"{_KV}:_internal_kv_get(key)", f"{_KV}:_internal_kv_put(key, value)")),
    Hook("gcs_checked_pg_cleaner", ROBUSTNESS, "ray", RAY,
         "Ray Train's placement-group cleaner asks the GCS, not the State API, whether the controller lives",
         "Ray Train's own cleaner runs: a State API miss (dashboard slow or restarting) can make it remove a "
         "healthy run's placement group and kill every worker (ray-project/ray#65447); the run then "
         "restarts from its last checkpoint",
         "train.elastic keeps Ray's PlacementGroupCleanerCallback when it cannot swap it",
         names=("ray.train.torch:TorchTrainer._initialize_and_run_controller",
                f"{_PGC}:is_actor_alive(actor_id, timeout)",
                f"{_PGC}:PlacementGroupCleaner.__init__(controller_actor_id, check_interval_s, "
                "get_actor_timeout_s, stop_timeout)",
                "ray.train.v2._internal.callbacks.placement_group_callback:PlacementGroupCleaner",
                "ray.train.v2._internal.callbacks.placement_group_callback:PlacementGroupCleanerCallback."
                "after_controller_start(train_run_context)",
                f"{_STATE}:state", f"{_STATE}:GlobalState.actor_table(actor_id, job_id, actor_state_name)",
                "ray.util.state.exception:RayStateApiException")),
    Hook("teardown_reaper", ROBUSTNESS, "ray", RAY,
         "before a worker group's teardown, workers that do not answer (node gone) are killed",
         "after a hard node loss the teardown waits for the GCS to declare the node dead (Ray Train's 5 s "
         "shutdown patience, its 30 s backend shutdown) before the restart",
         "train.teardown.UnreachableWorkerReaper does nothing when off; Ray's teardown still completes",
         names=(f"{_CB}:WorkerGroupCallback.before_worker_group_shutdown(worker_group)",
                f"{_WG}.worker_group:WorkerGroup.get_workers",
                f"{_WG}.worker:RayTrainWorker.get_metadata"),
         checks=(_worker_has_actor,)),
    Hook("local_preemption_info", ROBUSTNESS, "ray", RAY,
         "each worker reads its preemption notice locally (the step's own all_reduce shares it)",
         "each step calls ray.train.get_preemption_info() (public), one actor round trip per step",
         "train.worker_loop: every rank calls it at the same point of every step, as the public call needs",
         names=("ray.train.v2._internal.execution.context:get_train_context",
                "ray.train:get_preemption_info"),
         checks=(_train_context_has_preemption,)),
    Hook("warm_worker_setup_hook", ROBUSTNESS, "ray", RAY,
         "worker processes import torch and DeepSpeed from the moment they start (spotfill.train.warm)",
         "each restart's workers import torch and DeepSpeed on the recovery critical path",
         "train.job: the worker runtime_env simply has no setup hook",
         names=("ray._private.ray_constants:WORKER_PROCESS_SETUP_HOOK_ENV_VAR",
                # the hook imports Ray Train's worker actor module (train.warm) and torch._dynamo (which
                # torch's optimizers load on first use) ahead of the actor
                "ray.train.v2._internal.execution.worker_group.worker", "torch._dynamo",
                # a spare warming in SCHED_IDLE is woken when a training worker of its node is gone: those
                # are found by the process title Ray gives an actor's process (ray::<class name>)
                "ray.train.v2._internal.execution.worker_group.worker:RayTrainWorker")),
    Hook("prestart_spare_workers", ROBUSTNESS, "ray", RAY,
         "each node's raylet starts spare worker processes for the next worker group",
         "a restart's workers start as cold processes (as with stock Ray)",
         "train.worker_loop already treats a failed prestart as 'start cold'",
         names=("ray.core.generated.node_manager_pb2_grpc:NodeManagerServiceStub.__init__(channel)",
                "ray.core.generated.node_manager_pb2:PrestartWorkersRequest",
                "ray._private.grpc_utils:init_grpc_channel(address)",
                "ray.core.generated.common_pb2:Language.Value"),
         checks=(_prestart_fields,)),
    # -- Ray core ----------------------------------------------------------------------------------------
    Hook("gcs_kv", REQUIRED, "ray", RAY,
         "live numbers and small run state in the GCS key-value store (outlives worker processes)",
         "`spotfill status` (it reads the running jobs' live numbers from Ray's key-value store)",
         "cli.status has nothing else to read; the event sink stops publishing after one warning",
         names=(f"{_KV}:_internal_kv_get(key)", f"{_KV}:_internal_kv_put(key, value)",
                f"{_KV}:_internal_kv_list(prefix)", f"{_KV}:_internal_kv_del(key)")),
    Hook("fillin_arbiter", REQUIRED, "ray", RAY,
         "the arbiter reads each node's free resources, draining nodes and the tenants' actors from the GCS",
         "fill-in (the arbiter that lends idle GPUs to Serve, batch and sweep tenants)",
         "fillin.arbiter cannot tell a free GPU from a held one without them",
         names=(f"{_STATE}:state", f"{_STATE}:GlobalState.available_resources_per_node",
                f"{_STATE}:GlobalState.get_draining_nodes",
                f"{_STATE}:GlobalState.actor_table(actor_id, job_id, actor_state_name)")),
    Hook("gcs_cluster_config", ROBUSTNESS, "ray", RAY,
         "whether the cluster autoscales, from the cluster config an autoscaler reported to the GCS",
         "fill-in decides whether the cluster autoscales from the head's autoscaler config file alone",
         "fillin.cluster_kind already decides from the head's files when the GCS says nothing",
         names=(f"{_STATE}:state", f"{_STATE}:GlobalState.get_cluster_config")),
    Hook("gcs_dashboard_url", ROBUSTNESS, "ray", RAY,
         "the dashboard's address as the head registered it in the GCS (Serve's scale endpoint lives there)",
         "a Serve tenant must register with its own dashboard URL",
         "fillin.arbiter already takes a tenant's own URL when the GCS gives none",
         names=(f"{_KV}:_internal_kv_get(key)", "ray._private.ray_constants:KV_NAMESPACE_DASHBOARD")),
    Hook("gcs_dead_jobs", ROBUSTNESS, "ray", RAY,
         "the arbiter drops the training record of a driver that ended without withdrawing it",
         "a killed training driver's record stays: its GPUs are not lent again until the record is removed",
         "fillin.arbiter keeps the records it has",
         names=(f"{_STATE}:state", f"{_STATE}:GlobalState.job_table")),
    Hook("dashboard_token_auth", ROBUSTNESS, "ray", RAY,
         "requests to the dashboard carry the cluster's token when it runs with token authentication",
         "requests to a dashboard with token authentication carry no token (Serve's scale endpoint answers "
         "401 there: fill-in cannot scale Serve tenants on such a cluster)",
         "fillin.serve_tenant sends its request without the header",
         names=("ray._private.authentication.http_token_authentication:get_auth_headers_if_auth_enabled",)),
    Hook("kill_stuck_batch_actors", ROBUSTNESS, "ray", RAY,
         "a batch wave's Ray Data pool actor that waits for a GPU no one lent is killed by its id",
         "a batch wave stuck on such an actor is not cut short: it ends when Ray Data gives up",
         "fillin.batch logs the actors it could not kill and carries on",
         names=("ray._raylet:CoreWorker.kill_actor", "ray._raylet:ActorID.from_hex",
                "ray._private.worker:global_worker")),
    Hook("spot_drain", REQUIRED, "ray", RAY,
         "the spot watcher drains its Ray node through the GCS, as `ray drain-node` does, and records early "
         "warnings in the GCS key-value store",
         "`spotfill spot-watch` (draining this node in Ray on a spot notice)",
         "spot.watcher has no public API to drain a node",
         names=("ray._private.services:canonicalize_bootstrap_address_or_die(addr)", "ray._raylet:GcsClient",
                "ray._raylet:InnerGcsClient.drain_node", "ray._raylet:InnerGcsClient.get_all_node_info",
                "ray._raylet:InnerGcsClient.internal_kv_put",
                "ray.core.generated.gcs_pb2:GcsNodeInfo.ALIVE",
                "ray.core.generated.autoscaler_pb2:DrainNodeReason.Value")),
    Hook("single_host_cluster", REQUIRED, "ray", RAY,
         "a process treats Ray as single-host: a 127.0.0.1 address stays 127.0.0.1",
         "the local cluster bound to 127.0.0.1 (`spotfill demo`, `spotfill serve`, `spotfill status` on it)",
         "sim.cluster, sim.autoscaling, cli.status: ray.init would rewrite the address to one the "
         "loopback-bound GCS does not listen on",
         names=("ray._private.ray_constants:ENABLE_RAY_CLUSTER",)),
    Hook("quiet_node_deaths", ROBUSTNESS, "ray", RAY,
         "the demo prints one line per node it kills on purpose",
         "the demo prints each killed node's last 20 raylet log lines",
         "sim.cluster: purely what the driver prints",
         names=("ray._private.worker:print_to_stdstream(data, ignore_prefix)",)),
    Hook("node_death_reasons", ROBUSTNESS, "ray", RAY,
         "a dead node's reason by name (e.g. AUTOSCALER_DRAIN_PREEMPTED) in report.json",
         "report.json's cluster.nodes give Ray's reason number instead of its name",
         "sim.cluster and sim.autoscaling only report it",
         names=("ray.core.generated.common_pb2:NodeDeathInfo.Reason.Name",)),
    Hook("local_node_processes", REQUIRED, "ray", RAY,
         "a local test node's raylet pid, to kill its workers with it as a real node loss does, or to freeze "
         "the node",
         "a scenario's kill_node and freeze_node on the local cluster (`spotfill demo`)",
         "sim.cluster: removing a local node kills its raylet only, its workers would run on; freezing one "
         "stops the processes under its raylet",
         names=("ray._private.node:Node",), checks=(_sets_in_init("ray._private.node:Node", "all_processes"),)),
    Hook("fake_multinode_cluster", REQUIRED, "ray", RAY,
         "Ray's fake multi-node provider launches local nodes for the autoscaler",
         "the autoscaling local cluster (`spotfill demo` without --static, scenarios with autoscaling)",
         "sim.autoscaling and testing.fake_market subclass it; nothing else launches nodes locally",
         names=(f"{_FAKE}:FAKE_HEAD_NODE_ID",
                f"{_FAKE}:FakeMultiNodeProvider.__init__(provider_config, cluster_name)",
                f"{_FAKE}:FakeMultiNodeProvider._create_node_with_resources_and_labels"
                "(node_config, tags, count, resources, labels)",
                f"{_FAKE}:FakeMultiNodeProvider.terminate_node(node_id)",
                f"{_FAKE}:FakeMultiNodeProvider._terminate_node(node)")),
    # -- Ray Serve ---------------------------------------------------------------------------------------
    Hook("serve_replica_watch", ROBUSTNESS, "ray", RAY,
         "the fill-in Ingress learns the running Generator replicas from the Serve controller's push",
         "the Ingress polls serve.status() instead (about 10% of a core on a 2-core node), which "
         "names no replica: a request on a replica told to stop continues on another only once that "
         "replica is gone (after its grace)",
         "serving/app.py's Ingress polls the public serve.status() when the push is not there",
         names=("ray.serve._private.long_poll:LongPollClient.__init__(host_actor, key_listeners, "
                "call_in_event_loop, client_id)",
                "ray.serve._private.long_poll:LongPollClient.stop",
                "ray.serve._private.long_poll:LongPollNamespace.DEPLOYMENT_TARGETS",
                "ray.serve._private.common:DeploymentID.__init__(name, app_name)",
                "ray.serve._private.common:DeploymentTargetInfo.__init__(is_available, running_replicas)",
                "ray.serve._private.common:RunningReplicaInfo.__init__(replica_id)",
                "ray.serve._private.common:ReplicaID.__init__(unique_id)",
                "ray.serve._private.constants:SERVE_CONTROLLER_NAME",
                "ray.serve._private.constants:SERVE_NAMESPACE")),
    # -- Ray Tune ----------------------------------------------------------------------------------------
    Hook("tune_fillin_sweep", REQUIRED, "ray", RAY,
         "a Tune scheduler and searcher that start, pause and resume trials as fill-in grants come and go",
         "the fill-in Tune sweep (jobs/sweep.py)",
         "fillin.sweep is built on these Tune extension points and restores from Tune's state files",
         names=tuple(f"ray.tune.schedulers:TrialScheduler.{m}" for m in (
             "choose_trial_to_run(tune_controller)", "on_trial_result(tune_controller, trial, result)",
             "on_trial_add(tune_controller, trial)", "on_trial_error(tune_controller, trial)",
             "on_trial_complete(tune_controller, trial, result)", "on_trial_remove(tune_controller, trial)",
             "PAUSE")) + (
             f"{_TUNE}.pause_trial(trial, should_checkpoint)", f"{_TUNE}.get_trials",
             f"{_TUNE}._unstage_trial_with_resources(trial)",
             "ray.tune.search:Searcher.suggest(trial_id)", "ray.tune.search:Searcher.restore_from_dir"
             "(checkpoint_dir)", "ray.tune.search:Searcher.FINISHED",
             "ray.tune.experiment:Trial.PAUSED", "ray.tune.experiment:Trial.should_recover"),
         checks=(_sets_in_init(_TUNE, "_staged_trials"), _tune_state_files)),
    Hook("tune_fast_trial_cleanup", ROBUSTNESS, "ray", RAY,
         "a stopping trial actor is killed after the sweep's cleanup time, started or not",
         "a stopping trial that started holds its GPU up to 10 s more after a reclaim (Tune's fixed "
         "_actor_force_cleanup_timeout), beyond the tenant's grace",
         "fillin.sweep leaves Tune's timeout as it is",
         names=(f"{_TUNE}._cleanup_stopping_actors(force_all)",),
         checks=(_sets_in_init(_TUNE, "_actor_force_cleanup_timeout"),)),
    Hook("tune_trial_runtime_env", ROBUSTNESS, "ray", RAY,
         "a sweep's warm standby processes are prestarted with the runtime_env Tune gives its trial actors",
         "a lent sweep trial starts in a fresh process (process start and imports on the lent GPU's time)",
         "fillin.sweep's trials start cold (their start events say so)",
         names=("ray.tune.execution.class_cache:DEFAULT_ENV_VARS",
                "ray.tune.execution.class_cache:ENV_VARS_TO_PROPAGATE")),
    Hook("tune_restore_from_memory", ROBUSTNESS, "ray", RAY,
         "a resumed sweep trial restores the state its pause kept in host memory, reading no storage",
         "every resumed sweep trial reads its checkpoint from storage (a round trip per resume)",
         "fillin.sweep's trials restore from the storage checkpoint, as Tune does",
         names=("ray.train._internal.session:_TrainingResult.__init__(checkpoint, metrics)",
                "ray.tune:Trainable.save(checkpoint_dir)", "ray.tune:Trainable.restore(checkpoint_path)",
                "ray.tune:Checkpoint.from_directory(path)")),
)
