"""Every private Ray, torch and DeepSpeed name spotfill uses, in one package, checked when first used.

Ray's, torch's and DeepSpeed's public APIs cover almost everything spotfill needs; the few places they do
not are hooks, each listed in catalog.py with its class, what it does, what is lost without it and why:

- robustness hooks make spotfill faster or sturdier, and the code using them has a plain path (stock Ray,
  stock torch, a public call). Where the installed version lacks one of their names, they are off, with ONE
  warning per process naming the hook, what is lost and the versions that have it:
  jit_build_lock_guard, deepspeed_muon_stand_in, drain_aware_restarts, gcs_checked_pg_cleaner,
  teardown_reaper, local_preemption_info, warm_worker_setup_hook, prestart_spare_workers,
  kill_stuck_batch_actors, quiet_node_deaths, node_death_reasons, serve_replica_watch,
  tune_fast_trial_cleanup, tune_restore_from_memory, tune_trial_runtime_env, ledger_group_end, device_aware_torch_backend,
  gcs_cluster_config, gcs_dashboard_url, gcs_dead_jobs, dashboard_token_auth, deepspeed_group_timeout,
  restore_node_files.
- required hooks are what a feature is built on. Where one is missing, that feature -- only when it is
  used -- fails with a RayCompatError: one line naming the feature and the versions that have the hook
  (the CLI and the job scripts print it and exit 1): zero_elastic_load (resuming ZeRO-1/2 runs),
  pipe_bubble_probe (pipeline-parallel training),
  train_controller_callbacks (training's restart accounting), fillin_claims, fillin_arbiter, gcs_kv
  (`spotfill status`), spot_drain (`spotfill spot-watch`), single_host_cluster, local_node_processes,
  fake_multinode_cluster (the local and autoscaling demo clusters), tune_fillin_sweep.

Importing this package imports no Ray, torch or DeepSpeed: each part (ray_core, ray_train, ray_serve,
ray_tune, torch_jit, torch_dist, deepspeed_engine) loads when one of its names is first used, so importing
spotfill's entry points never fails because a private name moved. `python -m spotfill.ray_compat` prints
every hook's state against the installed versions; docs/compatibility.md lists the versions spotfill is
tested with.
"""
from __future__ import annotations

import importlib

from spotfill.ray_compat.hooks import (REQUIRED, ROBUSTNESS, TESTED, RayCompatError, problem, require,  # noqa: F401
                                       status, usable)

_PARTS = {
    "ray_core": ("draining_node_ids", "available_resources_per_node", "kv_get", "kv_put", "kv_list", "kv_del",
                 "gcs_actor_alive", "gcs_actors", "kill_actor_id", "gcs_client", "gcs_kv_put", "wrap_driver_stdstream",
                 "single_host_loopback", "node_raylet_pids", "kill_node_workers", "node_death_reason_name",
                 "gcs_pb2", "autoscaler_pb2", "FakeMultiNodeProvider", "FAKE_HEAD_NODE_ID",
                 "cluster_config_node_groups", "dashboard_url", "dead_job_ids", "dashboard_auth_headers"),
    "ray_train": ("ControllerCallback", "WorkerGroupCallback", "ElasticScalingPolicy", "local_preemption_info",
                  "unreachable_workers", "GcsCheckedPlacementGroupCleaner", "GcsCheckedPlacementGroupCleanerCallback",
                  "use_spotfill_controller", "callbacks_first", "worker_setup_hook_env", "prestart_workers",
                  "torch_train_backend", "node_label_selector"),
    "names": ("RAY_TRAIN_WORKER_MODULE", "DYNAMO_MODULE", "RAY_TRAIN_WORKER_TITLE"),
    "ray_serve": ("check_serve_hooks", "watch_running_replicas"),
    "ray_tune": ("require_sweep", "tune_force_cleanup_after", "tune_unstage_trial", "tune_checkpoint_parts",
                 "tune_result_on_local_dir", "tune_trial_runtime_env"),
    "torch_jit": ("guard_jit_op_builds", "StaleBuildLock"),
    "torch_dist": ("new_groups_timeout",),
    "deepspeed_engine": ("skip_deepspeed_muon", "skip_deepspeed_shm_comm", "zero_elastic_supported",
                         "zero_load_elastic",
                         "pipe_instruction_map", "pipe_stage_layers"),
    "catalog": ("HOOKS", "MUON_MODULES"),
}
_WHERE = {name: part for part, names in _PARTS.items() for name in names}


def __getattr__(name: str):
    part = _WHERE.get(name)
    if part is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{part}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
