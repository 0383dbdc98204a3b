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

import json
import logging
import os
import time
import uuid

log = logging.getLogger("spotfill.serving.standby")
HOOK = "spotfill.serving.standby.start"
TOKEN_PREFIX = "spotfill:serve-standby-token:"        # <app>:<node>:<offered t>:<rand> -> the app's arguments
RECORD_PREFIX = "spotfill:serve-standby:"             # <app>:<node>:<pid> -> a standby's state
TOKEN_TTL_S = 120.0          # a token no process claimed within this long is stale (its prestart was dropped)
REASK_S = 15.0               # a node asked for a standby that never recorded itself is asked again after this
KEEP_ALIVE_S = 3600          # the raylet keeps a prestarted idle process this long (then it may end it)
RECORD_TTL_S = 3600.0
CHECK_S = 2.0                # how often the keeper looks at the nodes
_STANDBY: dict = {}          # this process's standby: {"app", "checkpoint", "loaded", "record", "t": ...}


# -- pure decisions --------------------------------------------------------------------------------------
def standby_asks(nodes: dict[str, float], have: dict[str, int], asked: dict[str, float], now: float,
                 per_node: int, reask_s: float = REASK_S) -> dict[str, int]:
    """Standby processes to ask each node's raylet for now: `nodes` maps each alive node to the GPUs it has
    that may be lent (0: none, never asked); it should have `per_node` standbys (at most its GPUs), `have`
    are those recorded (warming or ready); a node asked less than `reask_s` ago is left alone (its standbys
    are starting)."""
    out = {}
    for node, gpus in nodes.items():
        want = min(int(per_node), int(gpus))
        missing = want - int(have.get(node, 0))
        if missing > 0 and now - asked.get(node, float("-inf")) >= reask_s:
            out[node] = missing
    return out


def records_by_node(records: dict[str, str | bytes | None], now: float) -> dict[str, int]:
    """Standbys per node from {key: value} records whose keep-alive has not run out."""
    out: dict[str, int] = {}
    for key, raw in records.items():
        parts = key[len(RECORD_PREFIX):].split(":") if key.startswith(RECORD_PREFIX) else []
        if len(parts) != 3 or raw is None:
            continue
        try:
            until = float(json.loads(raw)["until_t"])
        except (ValueError, KeyError, TypeError):
            continue
        if until > now:
            out[parts[1]] = out.get(parts[1], 0) + 1
    return out


def training_warming(records: dict[str, str | bytes | None], now: float) -> set[str]:
    """Nodes where training's spare processes are still warming up (train.readiness records without a
    ready time): a raylet starts only as many processes at once as its node has CPUs and drops the rest, so
    a standby waits there until training's spares are up -- training's transitions come first."""
    from spotfill.train.readiness import ready_by_node
    ready = ready_by_node(records, now)
    return {node for node, n in ready_by_node(records, now, warming=True).items() if n > ready.get(node, 0)}


def fits_budget(model_bytes: int, node_bytes: int, fraction: float) -> tuple[bool, str]:
    """(whether a standby may hold a model of `model_bytes` in host memory, the line saying why not)."""
    budget = int(node_bytes * fraction)
    if model_bytes <= budget:
        return True, ""
    return False, (f"standby: the model's {model_bytes / 2**30:.2f} GiB of weights exceed the standby host-memory "
                   f"budget of {budget / 2**30:.2f} GiB ({fraction:g} of the node's {node_bytes / 2**30:.1f} GiB, "
                   "SPOTFILL_STANDBY_HOST_MEMORY_FRACTION): replicas on this node load it when lent")


def claim_token(node: str, app_keys, take, now: float) -> dict | None:
    """Take one of node `node`'s standby tokens (any app's; `app_keys(prefix)` lists keys, `take(key)` returns
    the value of a key it deleted, None when another process took it); stale ones are dropped."""
    for key in sorted(app_keys(TOKEN_PREFIX)):
        parts = key[len(TOKEN_PREFIX):].split(":")
        if len(parts) != 4 or parts[1] != node:
            continue
        value = take(key)
        if value is None:
            continue
        try:
            offered = float(parts[2])
            args = json.loads(value)
        except (ValueError, TypeError):
            continue
        if now - offered <= TOKEN_TTL_S:
            return args
    return None


# -- the standby process ---------------------------------------------------------------------------------
def _kv():
    from spotfill.ray_compat import kv_del, kv_get, kv_list, kv_put
    return kv_get, kv_put, kv_list, kv_del


def _take_key(key: str):
    kv_get, _, _, kv_del = _kv()
    value = kv_get(key)
    return value if value is not None and kv_del(key) == 1 else None


def _node_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _record(state: str, **extra) -> None:
    try:
        _, kv_put, _, _ = _kv()
        now = time.time()
        kv_put(_STANDBY["record"], json.dumps({"state": state, "t": round(now, 3), "until_t": now + RECORD_TTL_S,
                                               **extra}))
    except Exception:  # noqa: BLE001 -- unrecorded: the keeper asks for another after REASK_S
        pass


def start() -> None:
    """The worker processes' setup hook: a process that claims a standby token warms up as a standby (see
    the module's doc); any other process (the Ingress's, one Serve starts for a replica when no standby is
    there) returns at once."""
    if _STANDBY:
        return
    try:
        import ray
        ctx = ray.get_runtime_context()
        node = ctx.get_node_id()
        _, _, kv_list, _ = _kv()
        args = claim_token(node, kv_list, _take_key, time.time())
    except Exception:  # noqa: BLE001 -- no token readable: a process started for an actor
        return
    if args is None:
        return
    _STANDBY.update(app=args["app"], checkpoint=args["checkpoint"], model=args.get("model", "auto"),
                    started_t=round(time.time(), 3), record=f"{RECORD_PREFIX}{args['app']}:{node}:{os.getpid()}")
    from spotfill.train.spares import idle_while
    with idle_while(True) as idle:          # CPU time training leaves on this node
        _STANDBY["idle"] = idle
        _record("warming")
        _warm(args)


def _warm(args: dict) -> None:
    import tempfile

    import torch
    torch.set_num_threads(1)
    import spotfill.serving.app  # noqa: F401 -- what the replica's actor class needs: Serve, FastAPI, the engine
    from spotfill.fillin.generate import load_newest
    from spotfill.generation import decoders, engine  # noqa: F401
    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore
    _STANDBY["imports_s"] = round(time.time() - _STANDBY["started_t"], 3)
    try:
        work = tempfile.mkdtemp(prefix="spotfill-standby-")
        loaded = load_newest(CheckpointStore(open_storage(args["checkpoint"])), work, args.get("model", "auto"))
    except Exception as exc:  # noqa: BLE001 -- the replica loads (and reports) it itself when lent
        _STANDBY["note"] = f"standby: no checkpoint loaded ({type(exc).__name__}: {exc})"
        _record("ready", tag=None, note=_STANDBY["note"])
        return
    if loaded is None:
        _STANDBY["note"] = "standby: no committed checkpoint yet"
        _record("ready", tag=None, note=_STANDBY["note"])
        return
    size = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    ok, why = fits_budget(size, _node_bytes(), float(os.environ.get("SPOTFILL_STANDBY_HOST_MEMORY_FRACTION", "0.25")))
    if not ok:
        _STANDBY["note"] = why
        _record("ready", tag=None, host_bytes=0, note=why)
        return
    _STANDBY.update(loaded=loaded, work=work, host_bytes=size, ready_t=round(time.time(), 3))
    _record("ready", tag=loaded.tag, host_bytes=size, load_s=round(loaded.load_s, 3))


def take(app: str, checkpoint: str) -> dict | None:
    """This process's standby for `app` serving `checkpoint`, handed to the replica being created in it
    (its record goes: it is a replica now): {"loaded" (or None when it holds no model), "note", "imports_s",
    "started_t", "ready_t", "idle", "host_bytes"}; None in a process that is no standby of that app."""
    if not _STANDBY or _STANDBY.get("app") != app or _STANDBY.get("checkpoint") != checkpoint:
        return None
    mine = dict(_STANDBY)
    _STANDBY["loaded"] = None                  # the replica owns the model now
    try:
        _, _, _, kv_del = _kv()
        kv_del(mine["record"])
    except Exception:  # noqa: BLE001 -- a stale record ends with its keep-alive
        pass
    return mine


def start_event(tenant: str, meter, t_init: float, standby: dict | None, first_load: dict) -> dict:
    """The `fillin_start` event of a lent replica whose constructor began at `t_init` (unix s): warm when it
    took a standby holding the model (`wake_s`: its weights to the device), else cold (`load_s`: loaded from
    storage); `process_age_s`: how long its process existed before (a standby's: seconds to minutes)."""
    from spotfill.telemetry.process import process_start_time
    now, started = time.time(), process_start_time()
    warm = bool(standby and standby.get("loaded") is not None)
    event = {"kind": "fillin_start", "t": round(now, 3), "tenant": tenant, "workload": "serve",
             "node": meter.node, "lease_id": meter.lease_id, "warm": warm, "standby": standby is not None,
             "process_age_s": None if started is None else round(t_init - started, 3),
             "init_s": round(now - t_init, 3), "wake_s": first_load.get("wake_s"),
             "load_s": None if warm else first_load.get("load_s"), "tag": first_load.get("tag")}
    if standby is not None:
        event.update(standby_imports_s=standby.get("imports_s"), standby_note=standby.get("note"),
                     host_bytes=standby.get("host_bytes"))
        if standby.get("note"):
            log.warning("%s", standby["note"])
    log.info("replica started %s in %.2fs (%s)", "warm" if warm else "cold", now - t_init,
             f"wake {event['wake_s']}s" if warm else f"load {event['load_s']}s")
    return event


# -- the keeper (a thread of the Ingress replica) --------------------------------------------------------
class StandbyKeeper:
    """Keeps `per_node` standby processes of this app on every alive node that has `gpu_resource` (see the
    module's doc). Runs in a replica of the app (the Ingress): the prestarted processes get its job and
    runtime_env, which the Generator's replicas share."""

    def __init__(self, app: str, checkpoint: str, model: str, gpu_resource: str, per_node: int):
        self.app, self.checkpoint, self.model = app, checkpoint, model
        self.gpu_resource, self.per_node = gpu_resource, int(per_node)
        self.asked: dict[str, float] = {}
        self.asks = 0

    def check(self) -> dict[str, int]:
        import ray

        from spotfill.ray_compat import prestart_workers
        kv_get, kv_put, kv_list, _ = _kv()
        now = time.time()
        nodes = {n["NodeID"]: float(n["Resources"].get(self.gpu_resource, 0)) for n in ray.nodes() if n["Alive"]}
        keys = kv_list(f"{RECORD_PREFIX}{self.app}:")
        have = records_by_node({k: kv_get(k) for k in keys}, now)
        from spotfill.train.readiness import RECORD_PREFIX as SPARES
        for node in training_warming({k: kv_get(k) for k in kv_list(SPARES)}, now):
            nodes.pop(node, None)                   # training's spares start first there
        asks = standby_asks(nodes, have, self.asked, now, self.per_node)
        args = json.dumps({"app": self.app, "checkpoint": self.checkpoint, "model": self.model})
        for node, n in asks.items():
            self.asked[node] = now
            for _ in range(n):
                kv_put(f"{TOKEN_PREFIX}{self.app}:{node}:{now:.3f}:{uuid.uuid4().hex[:8]}", args)
            try:
                prestart_workers(n, KEEP_ALIVE_S, node_id=node)
                self.asks += n
            except Exception as exc:  # noqa: BLE001 -- asked again after REASK_S
                log.warning("standby: node %s's raylet did not start a standby: %s", node[-8:], exc)
        for node in [n for n in self.asked if n not in nodes]:
            del self.asked[node]
        return asks

    def run(self) -> None:
        while True:
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 -- the GCS may be restarting: try again
                log.warning("standby keeper: %s", exc)
            time.sleep(CHECK_S)
