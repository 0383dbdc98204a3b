"""Asking a node's raylet for warm spare worker processes (the Ray side of train.spares): how many a training
worker asks for, the ask itself, and the warm-up state a worker reports (train.warm's marks)."""
from __future__ import annotations

import logging

from spotfill.config import constants
from spotfill.config.job import JobConfig
from spotfill.ray_compat import WorkerGroupCallback

log = logging.getLogger("spotfill.train.worker_loop")


def warm_state() -> dict:
    """This worker process's warm-up (train.warm): held back or not (its class: low, idle, normal), when its
    imports finished (`warm_after_t`, null: a process whose hook did not run), and when and why its hold-back
    ended early (`woken_t`, `woken_by`: "restart", or "hold_max" after SPOTFILL_SPARE_HOLD_MAX_S)."""
    from spotfill.train.warm import marks
    return {"idle": marks.get("warm_idle"), "class": marks.get("warm_class"), "reserve": marks.get("warm_reserve"),
            "warm_after_t": marks.get("warm_after_t"), "woken_t": marks.get("warm_woken_t"),
            "woken_by": marks.get("warm_woken_by")}


def spares_to_ask(job: JobConfig, rank: int, node_id: str, nodes_by_rank: list[str]) -> int:
    """How many spares this node should hold for the next worker group, asked by the node's first rank (the
    others ask none): SPOTFILL_WARM_SPARES for each slot of the node -- its group's workers and each slot the
    group does not use (GPUs lent to fill-in or free): a restart after a loss sizes the group to every slot
    of the nodes that are left (train.readiness.restart_size), and a worker placed there without a spare
    starts cold (seen in a demo: a survivor with 3 GPUs, 1 worker and 2 spares restarted 3 workers, the third
    cold, 20 s of imports). One ask per node: `prestart_spares` takes the spares already there off it (those
    a grow left: train.readiness.GrowPlanner's reserve), which a separate ask per rank could not."""
    mine = [r for r, n in enumerate(nodes_by_rank) if n == node_id]
    if not mine or mine[0] != rank:
        return 0
    return constants.WARM_SPARES * max(len(mine), node_slots(job, node_id))


def node_slots(job: JobConfig, node_id: str) -> int:
    """Workers the node could hold by its total of training's GPU resource, at most training's max (0 when
    Ray's node list does not say)."""
    import ray
    try:
        total = next((n.get("Resources", {}).get(job.cluster.gpu_resource, 0.0) for n in ray.nodes()
                      if n.get("NodeID") == node_id), 0.0)
    except Exception:  # noqa: BLE001 -- unknown: no spares beyond the workers' own
        return 0
    gpw = max(1.0, float(job.cluster.gpus_per_worker or 1))
    return min(int(total // gpw), job.training.max_workers)


def prestart_spares(count: int) -> None:
    """Have this node's raylet start spare worker processes for the next worker group until the node holds
    `count` (spares_to_ask: one set per slot; those already there, warming or ready, count), on a thread, off
    the step loop: they
    import torch and DeepSpeed (spotfill.train.warm, their setup hook) while this group trains, and the
    actors of the group after a restart land on them instead of on cold processes. Spares the next group
    does not take stay idle for SPOTFILL_WARM_SPARE_KEEP_ALIVE_S, then Ray's idle-worker policy applies;
    Ray kills them with the job. They count against the node's memory (train.spares.spares_within_memory, with
    the spares already there): beyond it, fewer are asked. A failure costs nothing but the head start: it is
    logged."""
    import ray

    from spotfill.ray_compat import prestart_workers
    from spotfill.train.elastic import ready_spares
    from spotfill.train.spares import host_memory_bytes, offer, spares_within_memory

    if count <= 0:
        return

    def ask():
        node = ray.get_runtime_context().get_node_id()
        held = ready_spares(warming=True).get(node, 0)      # spares already there (warming or ready)
        n, why = spares_within_memory(max(0, count - held), host_memory_bytes(), held,
                                      constants.WARM_SPARE_RSS_MB << 20, constants.WARM_SPARE_MEMORY_FRACTION)
        if why:
            log.info("spares on this node: %s", why)
        if held:
            log.info("spares on this node: %d wanted, %d already there, %d asked", count, held, n)
        if n:
            offer(node, n)    # they warm up held back (train.spares)
            prestart_workers(n, keep_alive_s=constants.WARM_SPARE_KEEP_ALIVE_S)

    # a failure: the next group starts cold processes, as stock Ray does
    _in_background("spotfill-prestart-spares", ask,
                   "spare worker processes not started (%s: %s); the next worker group starts cold")


def _in_background(name: str, ask, failed: str) -> None:
    """Run `ask` on a daemon thread, off the caller's loop; an exception is logged with `failed` (formatted
    with its type and message) and costs only the head start the ask was for."""
    import threading

    def run():
        try:
            ask()
        except Exception as exc:  # noqa: BLE001 -- a head start lost, never the caller's work
            log.warning(failed, type(exc).__name__, exc)

    threading.Thread(target=run, name=name, daemon=True).start()


# Ray Train's controller starts two helper actors of its own with every worker group, on its own node and in
# its own runtime_env: the SynchronizationActor (before the workers) and the DatasetManager (after them). Each
# took a new process there: a warm grow of a demo here waited 2.3-3.1 s for the first, while the group's
# actors, created on warm spares in 0.15 s, were reported up only as it came (the controller's `worker actors
# created` 3.0-3.9 s of a 6.4-8.2 s group start).
CONTROLLER_HELPERS = 2
HELPERS_AFTER_S = 30.0        # well after the group's own helpers took their processes (the DatasetManager's
                              # lease is issued as the group starts) and out of its start's CPU: at 5 s, in a
                              # quick demo here, their imports shared the CPUs with a spot notice's emergency
                              # save. A group that stops before then asks at its shutdown (a head start of
                              # the teardown and the placement: ~1-2 s)


def prestart_controller_helpers(count: int = CONTROLLER_HELPERS) -> None:
    """From Ray Train's controller: have this node's raylet start `count` idle processes in the controller's
    runtime_env (on a thread), so that the next worker group's helper actors land on them. They import only
    Ray (no setup hook: the controller's runtime_env is the job's, not the training workers'), kept idle for
    SPOTFILL_WARM_SPARE_KEEP_ALIVE_S. A failure costs the next start its head start, and is logged."""
    from spotfill.ray_compat import prestart_workers
    _in_background("spotfill-prestart-helpers",
                   lambda: prestart_workers(count, keep_alive_s=constants.WARM_SPARE_KEEP_ALIVE_S),
                   "Ray Train's helper processes not prestarted (%s: %s); the next group starts them cold")


class ControllerHelperSpares(WorkerGroupCallback):
    """The worker group callback (RunConfig(callbacks=[...]), spotfill runs) that prestarts the controller's
    helper processes once per worker group: HELPERS_AFTER_S after its start, or at its shutdown when it stops
    before then -- never both, so idle processes do not pile up over restarts."""

    def __init__(self, after_s: float | None = None):
        self.after_s = HELPERS_AFTER_S if after_s is None else after_s
        self._timer = None           # made in the controller (a callback is pickled there before it runs)
        self._asked = False

    def after_worker_group_start(self, worker_group) -> None:
        import threading
        self._cancel()
        self._asked = False
        self._timer = threading.Timer(self.after_s, self._ask)
        self._timer.daemon = True
        self._timer.start()

    def before_worker_group_shutdown(self, worker_group) -> None:
        self._cancel()
        if not self._asked:
            self._ask()

    def _cancel(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _ask(self) -> None:
        self._asked = True
        prestart_controller_helpers()
