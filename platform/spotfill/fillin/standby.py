"""Warm standby processes for fill-in tenants: a lent GPU computes a second after the lend, not after a cold
start (process start, imports of torch and the tenant's code, the model loaded from storage).

A standby is a Ray worker process started BEFORE any lend, on each node whose GPUs may be lent, with the job
and runtime_env of the tenant's GPU actors: a keeper (`Keeper`, a thread of a process that has exactly that
runtime_env: Serve's Ingress replica, a batch job's keeper actor) leaves a token in the GCS key-value store
and asks the node's raylet to prestart a worker (ray_compat.prestart_workers). The process's setup hook (Ray's
worker_process_setup_hook: the kind's `start`) claims the token and -- in SCHED_IDLE, on CPU time training
leaves (SPOTFILL_STANDBY_WARM_CLASS=low: nice 19, a bounded share of it) -- imports what the tenant's actor imports
and loads the model into host memory (the CPU, fp32), holding no GPU and never touching CUDA: Ray sets the
process's CUDA_VISIBLE_DEVICES for the GPU it assigns when an actor lands on it, and CUDA initialised before
that would see the wrong devices. Its state is a record
in the key-value store (warming -> ready, with what it holds and its host bytes).

Lending a GPU is the tenant's own: the tenant's actor is placed on a node with a free lent GPU, and Ray's
worker pool hands it an idle worker of the same job and runtime_env -- the standby. The actor's constructor
`take`s the standby's model (wake: weights to the assigned device) instead of loading one, and reports how it
started (`start_event`: warm or cold, init_s, wake_s). The keeper then starts a new standby on that node.
Reclaim ends the actor, its process exits, its device memory is gone with it, and only then is the GPU free.

Training comes first: a node where training's spare processes are starting gets its standby after them (a
raylet starts only as many processes at once as its node has CPUs and drops the rest); it then warms up beside
them, below their priority. A node's
standbys hold host memory: a model over the budget (SPOTFILL_STANDBY_HOST_MEMORY_FRACTION of the node's
memory, 0.25 by default) is not held (one line naming the budget; the actor loads it itself when lent).

The kinds: serving/standby.py (Serve's Generator replicas) and fillin/batch_standby.py (a batch job's Ray
Data actors). Each kind has its own token and record prefixes; a standby claims only tokens of its owner
(Serve: the app; batch: the job).
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid

log = logging.getLogger("spotfill.fillin.standby")
TOKEN_TTL_S = 120.0          # a token no process claimed within this long is stale (its prestart was dropped)
REASK_S = 15.0               # a node asked for a standby that never recorded itself is asked again after this
KEEP_ALIVE_S = 3600          # the raylet keeps a prestarted idle process this long (then it may end it)
RECORD_TTL_S = 3600.0
CHECK_S = 2.0                # how often a keeper looks at the nodes
SPARE_START_S = 10.0         # a node's standby waits this long after a training spare there began its warm-up
BUDGET_ENV = "SPOTFILL_STANDBY_HOST_MEMORY_FRACTION"
_STANDBY: dict = {}          # this process's standby: {"kind", "owner", "key", "loaded", "record", ...}
_HOOK: dict = {}             # a process whose setup hook found no token: why (a cold start's event says it)


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


def records_by_node(records: dict[str, str | bytes | None], now: float, prefix: str) -> dict[str, int]:
    """Standbys per node from {key: value} records (keys `<prefix><owner>:<node>:<pid>`) whose keep-alive has
    not run out."""
    out: dict[str, int] = {}
    for key, raw in records.items():
        parts = key[len(prefix):].split(":") if key.startswith(prefix) else []
        if len(parts) != 3 or raw is None:
            continue
        try:
            until = float(json.loads(raw)["until_t"])
        except (ValueError, KeyError, TypeError):
            continue
        if until > now:
            out[parts[1]] = out.get(parts[1], 0) + 1
    return out


def training_starting(records: dict[str, str | bytes | None], now: float,
                      within_s: float = SPARE_START_S) -> set[str]:
    """Nodes where training's spare processes are starting (train.readiness records: a spare began its warm-up
    less than `within_s` ago, so those asked with it may still be starting): a raylet starts only as many
    processes at once as its node has CPUs and drops the rest, so a standby is asked there after them --
    training's transitions come first. Once they started, a standby warms beside them in SCHED_IDLE, behind
    their nice-19 warm-up: it waited for their whole warm-up before, and a node training was moving onto
    (its spares re-warming after each restart) had no standby for minutes -- every lend there a cold start
    (demo: batch started cold 1-3 times and warm never)."""
    from spotfill.train.readiness import starting_nodes
    return starting_nodes(records, now, within_s)


def fits_budget(model_bytes: int, node_bytes: int, fraction: float) -> tuple[bool, str]:
    """(whether a standby may hold a model of `model_bytes` in host memory, the line saying why not)."""
    budget = int(node_bytes * fraction)
    if model_bytes <= budget:
        return True, ""
    return False, (f"standby: the model's {model_bytes / 2**30:.2f} GiB of weights exceed the standby host-memory "
                   f"budget of {budget / 2**30:.2f} GiB ({fraction:g} of the node's {node_bytes / 2**30:.1f} GiB, "
                   f"{BUDGET_ENV}): its actors on this node load it when lent")


def claim_token(prefix: str, node: str, app_keys, take, now: float, owner: str | None = None) -> dict | None:
    """Take one of node `node`'s standby tokens (keys `<prefix><owner>:<node>:<offered t>:<rand>`; of any owner
    when `owner` is None); `app_keys(prefix)` lists keys, `take(key)` returns the value of a key it deleted,
    None when another process took it; stale ones are dropped."""
    for key in sorted(app_keys(prefix)):
        parts = key[len(prefix):].split(":")
        if len(parts) != 4 or parts[1] != node or (owner is not None and parts[0] != owner):
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


def device_visibility(gpu_ids: list, visible: str | None, cuda_initialised_before: bool) -> tuple[bool, str]:
    """Whether a lent actor on a standby's process computes on exactly the GPUs of its lease: Ray assigned it
    `gpu_ids` and set CUDA_VISIBLE_DEVICES (`visible`) to them when the actor landed -- which CUDA honours only
    if the process had not initialised CUDA before (a standby never does: `cuda_initialised_before`). (ok, the
    line saying what is wrong.) No GPU assigned: the CPU, nothing to check."""
    ids = [str(g) for g in gpu_ids or []]
    if not ids:
        return True, ""
    if cuda_initialised_before:
        return False, (f"standby: CUDA was initialised in this process before Ray assigned GPU(s) {','.join(ids)}: "
                       "it may see and compute on devices that are not its lease")
    seen = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if seen != ids:
        return False, (f"standby: the process sees CUDA_VISIBLE_DEVICES={visible!r}, its lease is GPU(s) "
                       f"{','.join(ids)}")
    return True, ""


def check_device(gpu_ids: list, cuda_initialised_before: bool) -> dict:
    """Before a lent actor wakes a standby's model: its device is exactly its lease's (device_visibility), or
    RuntimeError with the line (the actor fails; Ray starts the next one in a fresh process)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ok, why = device_visibility(gpu_ids, visible, cuda_initialised_before)
    if not ok:
        raise RuntimeError(why)
    return {"gpu_ids": [str(g) for g in gpu_ids or []], "cuda_visible_devices": visible}


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (false where torch is not imported or has no CUDA)."""
    import sys
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 -- a torch without CUDA
        return False


def model_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the standby process ---------------------------------------------------------------------------------
def _kv():
    from spotfill.ray_compat import kv_del, kv_get, kv_list, kv_put
    return kv_get, kv_put, kv_list, kv_del


def _take_key(key: str):
    kv_get, _, _, kv_del = _kv()
    value = kv_get(key)
    return value if value is not None and kv_del(key) == 1 else None


def node_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def budget_fraction() -> float:
    return float(os.environ.get(BUDGET_ENV, "0.25"))


def record(state: str, **extra) -> None:
    """This standby's state in the key-value store (warming -> ready), kept RECORD_TTL_S."""
    try:
        _, kv_put, _, _ = _kv()
        now = time.time()
        kv_put(_STANDBY["record"], json.dumps({"state": state, "t": round(now, 3), "until_t": now + RECORD_TTL_S,
                                               **extra}))
    except Exception:  # noqa: BLE001 -- unrecorded: the keeper asks for another after REASK_S
        pass


def start(kind: str, token_prefix: str, record_prefix: str, warm, owner_of_process=None) -> None:
    """A kind's worker setup hook: a process that claims one of its node's `token_prefix` tokens (of its own
    owner: `owner_of_process()`, None for any) becomes a standby and, in SCHED_IDLE, runs `warm(args)`, which
    sets `_STANDBY`'s "loaded" (and "key": what it holds) and calls `record("ready", ...)`; any other process
    (one Ray starts for an actor when no standby is there) returns at once."""
    if _STANDBY:
        return
    args, why = None, "no token of its node and owner"
    for attempt in range(3):          # the GCS answers slowly on a busy node: a standby is not lost to that
        try:
            import ray
            node = ray.get_runtime_context().get_node_id()
            owner = owner_of_process() if owner_of_process else None
            _, _, kv_list, _ = _kv()
            args = claim_token(token_prefix, node, kv_list, _take_key, time.time(), owner)
            break
        except Exception as exc:  # noqa: BLE001 -- no token readable: tried again, then a plain process
            why = f"tokens not readable ({type(exc).__name__}: {exc})"
            time.sleep(0.5 * (attempt + 1))
    if args is None:
        _HOOK.update(kind=kind, t=round(time.time(), 3), why=why)      # said by a cold start's event
        return
    _STANDBY.update(kind=kind, owner=args["owner"], args=args, started_t=round(time.time(), 3), loaded=None,
                    record=f"{record_prefix}{args['owner']}:{node}:{os.getpid()}")
    from spotfill.config import constants
    low = constants.STANDBY_WARM_CLASS == "low"
    # SCHED_IDLE by default: training first. On a node whose CPUs training keeps busy its warm-up then crawls,
    # and a lent actor Ray hands its process waits for it (PENDING_CREATION: the arbiter sees it as held,
    # fillin/job_tenant.constructing_nodes). `low` (nice 19) warms it sooner, at a bounded cost to the steps;
    # either way the hold ends after SPOTFILL_STANDBY_HOLD_MAX_S (held_warm)
    held_warm(low, constants.STANDBY_HOLD_MAX_S, lambda: (record("warming"), warm(args)), _STANDBY)


def held_warm(low: bool, hold_max_s: float, run, marks: dict) -> dict:
    """Run `run()` held back -- nice 19 (`low`) or SCHED_IDLE -- for at most `hold_max_s` (0: all of it): a
    watcher process (train.spares' wake watcher, with no training worker to watch) puts its threads back
    after the bound. Sets in `marks` (and returns it): "idle" (held back at all), "warm_class", and when the
    bound ended the hold, "woken_t" and "woken_by"."""
    from spotfill.config import constants
    from spotfill.train.spares import bounded_hold
    with bounded_hold(True, low, hold_max_s, [], constants.SPARE_WAKE_POLL_S) as held:
        marks["idle"], marks["warm_class"] = held["idle"], held["class"]
        run()
    if "woken_by" in held:
        marks["woken_t"], marks["woken_by"] = held["woken_t"], held["woken_by"]
    return marks


def hold(loaded, size: int, key, **extra) -> bool:
    """In `warm`: keep `loaded` (its weights `size` bytes) if the node's budget allows, and record ready;
    False (recorded ready, holding nothing, with the budget's line) when it does not."""
    ok, why = fits_budget(size, node_bytes(), budget_fraction())
    if not ok:
        return not_held(why, host_bytes=0)
    _STANDBY.update(loaded=loaded, key=key, host_bytes=size, ready_t=round(time.time(), 3))
    record("ready", host_bytes=size, **extra)
    return True


def not_held(note: str, **extra) -> bool:
    """In `warm`: the standby keeps its imports but holds no model (`note` says why)."""
    _STANDBY["note"] = note
    record("ready", tag=None, note=note, **extra)
    return False


def imported() -> None:
    """In `warm`: the tenant's imports are done (their seconds go to the start event)."""
    _STANDBY["imports_s"] = round(time.time() - _STANDBY["started_t"], 3)


def take(kind: str, owner: str, key) -> dict | None:
    """This process's standby of `kind` for `owner` holding `key` (what the actor needs: the checkpoint it
    serves, the plan it runs), handed to the actor being created in it (its record goes: it is the tenant's
    actor now): {"loaded" (None when it holds no model or another key), "note", "imports_s", "started_t",
    "ready_t", "idle", "host_bytes"}; None in a process that is no standby of that kind and owner."""
    if not _STANDBY or _STANDBY.get("kind") != kind or _STANDBY.get("owner") != owner:
        return None
    from spotfill.devices import ray_gpu_ids
    mine = dict(_STANDBY)
    mine["device"] = check_device(ray_gpu_ids(), cuda_initialised())     # exactly its lease's GPU(s)
    if mine.get("key") != key:
        mine["loaded"] = None
        mine.setdefault("note", f"standby: it held {mine.get('key')!r}, the actor needs {key!r}")
    _STANDBY["loaded"] = None                  # the actor owns the model now
    try:
        _, _, _, kv_del = _kv()
        kv_del(mine["record"])
    except Exception:  # noqa: BLE001 -- a stale record ends with its keep-alive
        pass
    return mine


def start_event(tenant: str, workload: str, meter, t_init: float, standby: dict | None, load: dict) -> dict:
    """The `fillin_start` event of a lent actor whose constructor began at `t_init` (unix s): warm when it
    took a standby holding the model (`wake_s`: its weights to the device), else cold (`load_s`: loaded from
    storage); `process_age_s`: how long its process existed before (a standby's: seconds to minutes)."""
    from spotfill.telemetry.process import process_start_time
    now, started = time.time(), process_start_time()
    warm = bool(standby and standby.get("loaded") is not None)
    event = {"kind": "fillin_start", "t": round(now, 3), "tenant": tenant, "workload": workload,
             "node": meter.node, "lease_id": meter.lease_id, "warm": warm, "standby": standby is not None,
             "process_age_s": None if started is None else round(t_init - started, 3),
             "init_s": round(now - t_init, 3), "wake_s": load.get("wake_s"),
             "load_s": None if warm else load.get("load_s"), "tag": load.get("tag")}
    if standby is None and _HOOK.get("kind") == workload:
        event["standby_note"] = f"not a standby: {_HOOK['why']} (checked at +{_HOOK['t'] - (started or now):.1f}s)"
    if standby is not None:
        event.update(standby_imports_s=standby.get("imports_s"), standby_note=standby.get("note"),
                     host_bytes=standby.get("host_bytes"), device=standby.get("device"))
        if standby.get("note"):
            log.warning("%s", standby["note"])
    log.info("%s started %s in %.2fs (%s)", workload, "warm" if warm else "cold", now - t_init,
             f"wake {event['wake_s']}s" if warm else f"load {event['load_s']}s")
    return event


# -- the keeper ------------------------------------------------------------------------------------------
class Keeper:
    """Keeps `per_node` standby processes of one owner on every alive node that has `gpu_resource`. Runs in
    a process whose job and runtime_env the tenant's GPU actors share: the processes it has prestarted get
    them, so Ray hands those actors the standbys."""

    def __init__(self, token_prefix: str, record_prefix: str, owner: str, args: dict, gpu_resource: str,
                 per_node: int):
        self.token_prefix, self.record_prefix, self.owner = token_prefix, record_prefix, owner
        self.args = json.dumps({**args, "owner": owner})
        self.gpu_resource, self.per_node = gpu_resource, int(per_node)
        self.asked: dict[str, float] = {}
        self.asks = 0

    def check(self) -> dict[str, int]:
        import ray

        from spotfill.ray_compat import prestart_workers
        kv_get, kv_put, kv_list, _ = _kv()
        now = time.time()
        nodes = {n["NodeID"]: float(n["Resources"].get(self.gpu_resource, 0)) for n in ray.nodes() if n["Alive"]}
        keys = kv_list(f"{self.record_prefix}{self.owner}:")
        have = records_by_node({k: kv_get(k) for k in keys}, now, self.record_prefix)
        from spotfill.train.readiness import RECORD_PREFIX as SPARES
        for node in training_starting({k: kv_get(k) for k in kv_list(SPARES)}, now):
            nodes.pop(node, None)                   # training's spares start first there
        asks = standby_asks(nodes, have, self.asked, now, self.per_node)
        for node, n in asks.items():
            self.asked[node] = now
            for _ in range(n):
                kv_put(f"{self.token_prefix}{self.owner}:{node}:{now:.3f}:{uuid.uuid4().hex[:8]}", self.args)
            try:
                prestart_workers(n, KEEP_ALIVE_S, node_id=node)
                self.asks += n
            except Exception as exc:  # noqa: BLE001 -- asked again after REASK_S
                log.warning("standby: node %s's raylet did not start a standby: %s", node[-8:], exc)
        for node in [n for n in self.asked if n not in nodes]:
            del self.asked[node]
        return asks

    def run(self, stop=None) -> None:
        while stop is None or not stop.is_set():
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 -- the GCS may be restarting: try again
                log.warning("standby keeper: %s", exc)
            if stop is not None:
                stop.wait(CHECK_S)
            else:
                time.sleep(CHECK_S)


def job_id() -> str:
    """This process's Ray job (a job-scoped standby's owner: its tokens are claimed by its own processes)."""
    import ray
    return ray.get_runtime_context().get_job_id()


def start_job_keeper(token_prefix: str, record_prefix: str, args: dict, gpu_resource: str, per_node: int,
                     runtime_env: dict):
    """A job's keeper actor (0 CPU, on the head node: it outlives any GPU node's loss) running `Keeper` for
    this job with `runtime_env` -- the runtime_env of the tenant's GPU actors, so the processes it has the
    raylets prestart are ones Ray's worker pool hands them. Returns its handle (kill it when the job ends)."""
    import ray

    from spotfill.fillin.arbiter_handle import head_node_strategy

    @ray.remote(num_cpus=0, max_restarts=0)
    class StandbyKeeper:
        def __init__(self, owner: str):
            import threading
            self.keeper = Keeper(token_prefix, record_prefix, owner, args, gpu_resource, per_node)
            self.stop = threading.Event()
            threading.Thread(target=self.keeper.run, args=(self.stop,), daemon=True, name="standby-keeper").start()

    options = {"runtime_env": runtime_env}
    head = head_node_strategy()
    if head is not None:
        options["scheduling_strategy"] = head
    return StandbyKeeper.options(**options).remote(job_id())


def stop_keeper(keeper) -> None:
    """The job is done: its keeper goes (its standbys end with the job, or with their keep-alive)."""
    if keeper is None:
        return
    import ray
    try:
        ray.kill(keeper)
    except Exception as exc:  # noqa: BLE001 -- it goes with the job
        log.debug("standby keeper not killed: %s", exc)
