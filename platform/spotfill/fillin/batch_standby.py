"""Warm standbys for a batch job's GPU actors: a lent GPU runs its first unit a second after the lend.

A wave's actor started cold pays, after Ray places it on a lent GPU: a worker process start, the imports
(torch, Ray Data, spotfill's engine) and the pinned model read from the job's output storage (`_plan/model.pt`)
-- 10-20 s of a lease spent computing nothing on the 2-core demo, longer for a real model from S3.

The job keeps `cluster.standby_per_node` standby processes on every GPU node (fillin/standby.py): a keeper
actor of the job (0 CPU, 0 GPU, on the driver's node) runs the keeper with the runtime_env the wave's actors
are given (`actor_runtime_env`: the job's, plus this module's setup hook), so the processes it has the
raylets prestart are of the job and runtime_env those actors have, and Ray's worker pool hands them to the
actors. A standby's setup hook claims a token of its own job (the owner: a standby never serves another
job), imports what a `UnitWorker` imports, and reads the plan's pinned model and tokenizer into host memory
(the CPU, fp32). The `UnitWorker` that lands on it takes them (wake: weights to the device Ray assigned) and
reports a `fillin_start` event (warm or cold, the constructor's seconds, wake or load). A standby holding
another plan's model (the job was rerun on another checkpoint) is taken for its imports; the actor loads.
"""
from __future__ import annotations

import json
import logging

from spotfill.fillin import standby as sb

log = logging.getLogger("spotfill.fillin.batch_standby")
HOOK = "spotfill.fillin.batch_standby.start"
TOKEN_PREFIX = "spotfill:batch-standby-token:"        # <job id>:<node>:<offered t>:<rand> -> the plan's place
RECORD_PREFIX = "spotfill:batch-standby:"             # <job id>:<node>:<pid> -> a standby's state
KIND = "batch"


def plan_key(output: str, plan: dict) -> str:
    """What a standby holds and an actor needs: the job's output and the checkpoint its plan pinned."""
    return f"{output}#{plan.get('checkpoint_tag')}"


def start() -> None:
    """The setup hook of the job's actor processes (see the module's doc)."""
    sb.start(KIND, TOKEN_PREFIX, RECORD_PREFIX, _warm, owner_of_process=sb.job_id)


def _warm(args: dict) -> None:
    import torch
    torch.set_num_threads(1)
    import pyarrow  # noqa: F401 -- what a UnitWorker needs: its parts are parquet
    import ray.data  # noqa: F401
    from spotfill.fillin import batch_plan as bp
    from spotfill.fillin.batch import plan_model, plan_tokenizer
    from spotfill.fillin.generate import batch_engine  # noqa: F401
    from spotfill.storage.base import open_storage
    sb.imported()
    try:
        out = open_storage(args["output"])
        plan = json.loads(out.get_bytes(bp.PLAN_KEY))
        model, tokenizer = plan_model(out, plan), plan_tokenizer(out, plan)
    except Exception as exc:  # noqa: BLE001 -- the actor loads (and reports) it itself when lent
        sb.not_held(f"standby: the plan's model not loaded ({type(exc).__name__}: {exc})")
        return
    sb.hold((model, tokenizer), sb.model_bytes(model), plan_key(args["output"], plan),
            tag=plan.get("checkpoint_tag"))


def take(output: str, plan: dict) -> dict | None:
    """This process's standby of this job holding `plan`'s model, handed to the UnitWorker being created in
    it ({"loaded": (model, tokenizer) or None, ...}: fillin/standby.take); None in a process that is none."""
    try:
        job = sb.job_id()
    except Exception:  # noqa: BLE001 -- outside Ray: no standby
        return None
    return sb.take(KIND, job, plan_key(output, plan))


def actor_runtime_env(job_runtime_env: dict | None) -> dict:
    """The runtime_env of the job's GPU actors and of its keeper (the same, so their serialized runtime_env
    -- the worker pool's key -- is the same): the job's env vars plus this module's setup hook (kept off
    where the job already has a setup hook of its own: then no process becomes a standby)."""
    from spotfill.ray_compat import worker_setup_hook_env
    return {"env_vars": worker_setup_hook_env(HOOK, {}, job_runtime_env)}


def start_keeper(output: str, gpu_resource: str, per_node: int, runtime_env: dict):
    """The job's keeper actor (fillin/standby.start_job_keeper): `per_node` standbys of this job on every node
    with `gpu_resource`. Returns its handle or None when `per_node` is 0."""
    if per_node <= 0:
        return None
    return sb.start_job_keeper(TOKEN_PREFIX, RECORD_PREFIX, {"output": output}, gpu_resource, per_node,
                               runtime_env)


def start_standbys(cfg) -> tuple[dict | None, object]:
    """(the runtime_env of the job's wave actors, its keeper actor) for a batch job of config `cfg` (its
    `cluster.standby_per_node` standbys per GPU node); (None, None) with none asked."""
    per_node = cfg.cluster.standby_per_node
    if not per_node:
        return None, None
    try:
        import ray
        env = actor_runtime_env(ray.get_runtime_context().runtime_env)
        return env, start_keeper(cfg.output, cfg.cluster.gpu_resource, per_node, env)
    except Exception as exc:  # noqa: BLE001 -- every actor starts cold then, and its start event says so
        log.warning("batch %s: no warm standbys (%s: %s); lent actors start cold", cfg.name, type(exc).__name__, exc)
        return None, None


stop_keeper = sb.stop_keeper
