"""Warm standby Serve replicas: a lent GPU computes seconds after the lend, not after a cold start.

A Generator replica started cold pays, after Serve places it on a lent GPU: a worker process start, the
imports (torch, Ray Serve, FastAPI, spotfill's engine), and loading the run's newest checkpoint from storage
(consolidating ZeRO shards). On the embedded 2-core demo that was 20-50 s of a lease spent holding a GPU
and computing nothing.

A standby is a Ray worker process started BEFORE any lend, on each node whose GPUs may be lent, with the
Generator's job and runtime_env: the Ingress's keeper (`StandbyKeeper`, a thread of the always-up Ingress
replica, whose job and runtime_env the Generator's replicas share) asks the node's raylet to prestart it
(ray_compat.prestart_workers) after leaving a token in the GCS key-value store. The process's setup hook
(`start`, Ray's worker_process_setup_hook) claims the token, and -- in SCHED_IDLE, on CPU time training
leaves -- imports what a replica imports and loads the newest checkpoint into host memory (the CPU, fp32),
holding no GPU and never touching CUDA (Ray sets the process's CUDA_VISIBLE_DEVICES for the GPU it assigns
when an actor lands on it: CUDA initialised before that would see the wrong devices). Its state is a
record in the key-value store (warming -> ready, with the checkpoint and its host bytes).

Lending a GPU is unchanged: the arbiter raises the Generator's replica count, Serve places the replica on a
node with a free GPU, and Ray's worker pool hands the replica's actor an idle worker of the same job and
runtime_env -- the standby. The replica's constructor `take`s the standby's model (wake: weights to the
assigned device) instead of loading one, and reports how it started (warm or cold, init_s, wake_s). The
keeper then starts a new standby on that node. Reclaim is unchanged too: Serve stops the replica, its
process exits, its device memory is gone with it, and only then is the GPU free again.

Training comes first: a node where training's spare processes are still warming up gets its standby after
them (a raylet starts only as many processes at once as its node has CPUs and drops the rest).

A node's standbys hold host memory: a model over the budget (SPOTFILL_STANDBY_HOST_MEMORY_FRACTION of the
node's memory, 0.25 by default) is not loaded by the standby (one line in the replica's log naming the
budget; the standby keeps its imports, the replica loads the model itself).
"""
from __future__ import annotations

from spotfill.fillin import standby as sb
from spotfill.fillin.standby import Keeper, take as _take

HOOK = "spotfill.serving.standby.start"
TOKEN_PREFIX = "spotfill:serve-standby-token:"        # <app>:<node>:<offered t>:<rand> -> the app's arguments
RECORD_PREFIX = "spotfill:serve-standby:"             # <app>:<node>:<pid> -> a standby's state
KIND = "serve"


def start() -> None:
    """The worker processes' setup hook: a process that claims a standby token of its node warms up as a
    standby (fillin/standby.py); any other process (the Ingress's, one Serve starts for a replica when no
    standby is there) returns at once."""
    sb.start(KIND, TOKEN_PREFIX, RECORD_PREFIX, _warm)


def _warm(args: dict) -> None:
    import tempfile

    import torch
    torch.set_num_threads(1)
    import spotfill.serving.app  # noqa: F401 -- what the replica's actor class needs: Serve, FastAPI, the engine
    from spotfill.fillin.generate import load_newest
    from spotfill.generation import decoders, engine  # noqa: F401
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore
    sb.imported()
    try:
        work = tempfile.mkdtemp(prefix="spotfill-standby-")
        loaded = load_newest(CheckpointStore(open_storage(args["checkpoint"])), work, args.get("model", "auto"))
    except Exception as exc:  # noqa: BLE001 -- the replica loads (and reports) it itself when lent
        sb.not_held(f"standby: no checkpoint loaded ({type(exc).__name__}: {exc})")
        return
    if loaded is None:
        sb.not_held("standby: no committed checkpoint yet")
        return
    sb.hold(loaded, sb.model_bytes(loaded.model), args["checkpoint"], tag=loaded.tag, load_s=round(loaded.load_s, 3))


def take(app: str, checkpoint: str) -> dict | None:
    """This process's standby for `app` serving `checkpoint`, handed to the replica being created in it
    (fillin/standby.take); None in a process that is no standby of that app."""
    return _take(KIND, app, checkpoint)


def start_event(tenant: str, meter, t_init: float, standby: dict | None, first_load: dict) -> dict:
    """The `fillin_start` event of a lent replica (fillin/standby.start_event)."""
    return sb.start_event(tenant, "serve", meter, t_init, standby, first_load)


class StandbyKeeper(Keeper):
    """Keeps `per_node` standby processes of this app on every alive node that has `gpu_resource` (see the
    module's doc). Runs in a replica of the app (the Ingress): the prestarted processes get its job and
    runtime_env, which the Generator's replicas share."""

    def __init__(self, app: str, checkpoint: str, model: str, gpu_resource: str, per_node: int):
        super().__init__(TOKEN_PREFIX, RECORD_PREFIX, app, {"checkpoint": checkpoint, "model": model},
                         gpu_resource, per_node)
