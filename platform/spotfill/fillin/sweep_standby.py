"""Warm standbys for a sweep's trial actors: a lent GPU runs a trial's first step seconds after the lend.

A trial started cold pays, once Ray places its actor on a lent GPU: a worker process start and the imports of
torch, Ray Tune and the trainable's code -- most of a trial's 15-25 s setup on the 2-core demo. Its weights and
optimizer state come from the sweep's state keeper (host memory, fillin/sweep_keeper.py) or its checkpoint.

The sweep keeps `fillin.standby_per_node` standby processes on every GPU node (fillin/standby.py): the driver
gives its job this module's setup hook (`job_runtime_env`), and a keeper actor of the job (0 CPU, on the head)
created with the runtime_env Tune gives its trial actors (its env vars: ray_compat.tune_trial_runtime_env) has
the raylets prestart processes of that runtime_env, so Ray's worker pool hands a trial's actor one of them. A standby claims only its own job's tokens and, in SCHED_IDLE,
imports what a trial imports; it holds no model (a trial's state is its own, restored by the trial). The trial
takes it in its setup and reports a `fillin_start` event (warm: on a standby with the imports done).
"""
from __future__ import annotations

import logging

from spotfill.fillin import standby as sb

log = logging.getLogger("spotfill.fillin.sweep_standby")
HOOK = "spotfill.fillin.sweep_standby.start"
TOKEN_PREFIX = "spotfill:sweep-standby-token:"        # <job id>:<node>:<offered t>:<rand> -> {}
RECORD_PREFIX = "spotfill:sweep-standby:"             # <job id>:<node>:<pid> -> a standby's state
KIND = "sweep"
HELD = "imports"             # what a sweep standby holds: the trial's imports (no model)


def start() -> None:
    """The setup hook of the sweep job's worker processes (see the module's doc)."""
    sb.start(KIND, TOKEN_PREFIX, RECORD_PREFIX, _warm, owner_of_process=sb.job_id)


def _warm(args: dict) -> None:
    import numpy  # noqa: F401
    import torch
    torch.set_num_threads(1)
    import ray.tune  # noqa: F401 -- the trial actor's class is a tune.Trainable
    from spotfill.config import presets  # noqa: F401
    from spotfill.fillin import busy, sweep_trial  # noqa: F401
    from spotfill.train import data, model  # noqa: F401
    sb.imported()
    sb.hold(HELD, 0, HELD)


def take() -> dict | None:
    """This process's standby of this sweep job, handed to the trial being set up in it (None: no standby)."""
    try:
        job = sb.job_id()
    except Exception:  # noqa: BLE001 -- outside Ray: no standby
        return None
    return sb.take(KIND, job, HELD)


def job_runtime_env(runtime_env: dict | None, per_node: int) -> dict:
    """The sweep driver's runtime_env with this module's setup hook among its env vars (kept off where the
    job has a setup hook of its own, or with no standby asked)."""
    env = dict(runtime_env or {})
    if per_node <= 0:
        return env
    from spotfill.ray_compat import worker_setup_hook_env
    env["env_vars"] = worker_setup_hook_env(HOOK, dict(env.get("env_vars") or {}), runtime_env)
    return env


def start_keeper(gpu_resource: str, per_node: int):
    """The sweep job's keeper actor (0 CPU, on the head node, the job's runtime_env): `per_node` standbys of
    this job on every node with `gpu_resource`. Returns its handle, or None with none asked or on failure."""
    if per_node <= 0:
        return None
    try:
        from spotfill.ray_compat import tune_trial_runtime_env
        trial_env = tune_trial_runtime_env()         # the keeper's = a trial actor's: Ray hands trials its processes
        if trial_env is None:
            return None
        return sb.start_job_keeper(TOKEN_PREFIX, RECORD_PREFIX, {}, gpu_resource, per_node, trial_env)
    except Exception as exc:  # noqa: BLE001 -- every trial starts cold then, and its start event says so
        log.warning("sweep: no warm standbys (%s: %s); trials start cold", type(exc).__name__, exc)
        return None
