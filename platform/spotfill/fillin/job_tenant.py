"""The job tenant adapter: a Ray job (a Ray Data batch job, a Ray Tune sweep) that runs on lent GPUs.

Serve is scaled from outside (serve_tenant.py). A batch or sweep driver instead *pulls* its grant: it
registers with the arbiter (fillin/grant.py, `ArbiterGrant`), states how many units it could use
(`demand`), and polls `tenant_target` -- the number of units it may hold now. When training claims GPUs the
arbiter lowers that target; the driver yields within its grace (Data: stops reading and lets its actor pool
go; Tune: pauses trials with a checkpoint). A driver that has not let go when the grace is over is forced:
the arbiter kills the holders it marked (`force_release`), and the reclaim is recorded as forced.

What a job tenant holds is read from Ray's public state API, so it survives an arbiter restart like Serve's
leases do: every GPU bundle of a placement group the job created (Tune's trial groups), and every live actor
of the job that asked for the GPU resource outside a placement group (Ray Data's actor pool). One Holding
per unit; its key (lease id) is the actor id, or `<placement group id>:<bundle index>`. An actor whose
constructor runs holds its GPU already, but Ray's state API gives it no node (PENDING_CREATION: node_id None,
its process's pid set): its node is the one of the live worker with that pid (`constructing_nodes`).
Unseen, its GPU looked like training's, and the unit "not placed" -- a demo's batch unit constructing on a
warming standby was given up after 30 s, again and again.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

from spotfill.config.tenant_kinds import kinds_of
from spotfill.fillin.policy import Holding

log = logging.getLogger(__name__)
LIVE_ACTOR = ("ALIVE", "PENDING_CREATION", "RESTARTING")


@dataclass(frozen=True)
class JobTenantSpec:
    name: str                          # e.g. "eval-ckpt-300"
    kind: str                          # a kind the registry keeps as a JobTenant: "batch" | "sweep"
    job_id: str                        # the driver's Ray job id (hex), whose actors / groups it holds
    max_replicas: int = 4              # units it may ever hold
    gpus_per_replica: int = 1          # GPUs one unit (an actor, a trial) holds
    cpus_per_replica: float = 0.0      # CPUs one unit asks for beside its GPUs (a Tune trial's bundle): lent
                                       # only where the node has them free too
    grace_s: float = 5.0               # how long it has to let go of a reclaimed unit
    gpu_resource: str = "GPU"
    demand: int | None = None          # units it could use now (None: max_replicas)

    def __post_init__(self):
        kinds = kinds_of(f"{__name__}:JobTenant")          # config/tenant_kinds.py
        if self.kind not in kinds:
            raise ValueError(f"job tenant kind {self.kind!r}: accepted {', '.join(kinds)}")

    @property
    def tenant(self) -> str:
        return f"{self.kind}:{self.name}"

    def as_dict(self) -> dict:
        return asdict(self)


class JobTenant:
    """The arbiter's handle on a job tenant -- a fill-in `Tenant` (fillin/tenant.py) that pulls its target:
    what it holds, the target it reads, the demand it states, forcing it to let go."""

    scale_url = None
    pulls_target = True
    forced_when_overdue = True

    def __init__(self, spec: JobTenantSpec):
        self.spec = spec
        self.target: int | None = None      # units the driver may hold now (None: not decided yet)
        self.pending_groups: frozenset[str] = frozenset()   # its placement groups waiting (last read)

    @classmethod
    def from_spec(cls, spec: dict) -> "JobTenant":
        return cls(JobTenantSpec(**spec))

    def kept(self, calls) -> "JobTenant":
        return self                         # no slow call but force_release (TenantCalls.force)

    @property
    def tenant(self) -> str:
        return self.spec.tenant

    def adopt_from(self, old) -> None:
        """The target set for the same driver (same Ray job) registered before under this name; a new
        driver starts undecided."""
        same = old is not None and old.pulls_target and getattr(old.spec, "job_id", None) == self.spec.job_id
        self.target = old.target if same else None

    def set_demand(self, demand: int, held: int) -> bool:
        if int(demand) != self.spec.demand:
            self.spec = replace(self.spec, demand=max(0, int(demand)))
            if self.target is not None and self.target > self.wanted_units:
                self.target = max(self.wanted_units, held)
        return True

    def shape(self, gpu_resource: str | None = None) -> dict[str, float]:
        """One unit's resource request, as the autoscaler reports it when it waits (in its own GPU resource)."""
        return {self.spec.gpu_resource: float(self.spec.gpus_per_replica),
                **({"CPU": float(self.spec.cpus_per_replica)} if self.spec.cpus_per_replica else {})}

    @property
    def wanted_units(self) -> int:
        demand = self.spec.max_replicas if self.spec.demand is None else self.spec.demand
        return max(0, min(int(demand), self.spec.max_replicas))

    def holdings(self) -> list[Holding]:
        from ray.util.state import list_actors, list_placement_groups

        res = self.spec.gpu_resource
        out: list[Holding] = []
        groups = list_placement_groups(filters=[("creator_job_id", "=", self.spec.job_id)], detail=True,
                                       limit=1000, raise_on_missing_output=False)
        self.pending_groups = frozenset(pg.placement_group_id for pg in groups if pg.state == "PENDING")
        for pg in groups:
            if pg.state != "CREATED":
                continue
            for i, bundle in enumerate(pg.bundles or []):
                gpus = int((bundle.get("unit_resources") or {}).get(res, 0) + 1e-9)
                if gpus and bundle.get("node_id"):
                    out.append(self._holding(bundle["node_id"], gpus, f"{pg.placement_group_id}:{i}"))
        actors = list_actors(filters=[("job_id", "=", self.spec.job_id)], detail=True, limit=10000,
                             raise_on_missing_output=False)
        nodes = {}
        if any(_constructing(a) for a in actors):
            from ray.util.state import list_workers
            nodes = constructing_nodes(actors, list_workers(filters=[("is_alive", "=", True)], limit=10000,
                                                             raise_on_missing_output=False))
        for a in actors:
            node_id = a.node_id or nodes.get(a.actor_id)
            if a.state not in LIVE_ACTOR or not node_id or a.placement_group_id:
                continue
            gpus = int((a.required_resources or {}).get(res, 0) + 1e-9)
            if gpus:
                out.append(self._holding(node_id, gpus, a.actor_id))
        return out

    def _holding(self, node_id: str, gpus: int, key: str) -> Holding:
        return Holding(self.tenant, self.spec.kind, node_id, gpus, key=key, reclaim_method="job_yield",
                       grace_s=self.spec.grace_s)

    def set_replicas(self, n: int) -> bool:
        """The driver reads this target (`tenant_target`) and grows or yields to it."""
        self.target = max(0, min(int(n), self.spec.max_replicas))
        return True

    def set_target(self, n: int, *, takeover: bool = False, again: bool = False) -> bool:
        return self.set_replicas(n)         # read by its driver: nothing to send, nothing to take over

    def force_release(self, dashboard_url: str | None = None) -> str:
        """The driver did not let go within its grace: stop its Ray job. Ray then ends every actor and
        placement group the job holds; what the job committed stays (exactly-once outputs), and a rerun
        resumes. A job submitted through the Jobs API is stopped there (its driver gets SIGTERM, then
        SIGKILL); a driver started by hand is killed by pid on its node. Returns how it was stopped."""
        import ray
        from ray.util.state import list_jobs

        job = next((j for j in list_jobs(filters=[("job_id", "=", self.spec.job_id)], limit=10,
                                         raise_on_missing_output=False)), None)
        if job is None or str(job.status) not in ("RUNNING", "JobStatus.RUNNING", "PENDING", "JobStatus.PENDING"):
            return "job already ended"
        if job.submission_id and dashboard_url:
            from ray.job_submission import JobSubmissionClient
            url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
            JobSubmissionClient(url).stop_job(job.submission_id)
            return f"stopped job {job.submission_id} through the Jobs API"
        info = job.driver_info
        if info is None:
            raise LookupError(f"job {self.spec.job_id} has no driver to stop")
        node = next((n["NodeID"] for n in ray.nodes() if n.get("Alive")
                     and n.get("NodeManagerAddress") == info.node_ip_address), None)
        if node is None:
            raise LookupError(f"driver node {info.node_ip_address} of job {self.spec.job_id} not found")
        ray.get(_kill_pid_task().options(scheduling_strategy=_on_node(node)).remote(int(info.pid)), timeout=30)
        return f"killed driver pid {info.pid} on {info.node_ip_address}"


def _constructing(actor) -> bool:
    """An actor whose constructor runs in a leased worker: PENDING_CREATION with a process, no node yet."""
    return actor.state == "PENDING_CREATION" and not actor.node_id and bool(actor.pid)


def constructing_nodes(actors, workers) -> dict[str, str]:
    """actor id -> node of each constructing actor (`_constructing`), from the live workers (Ray's state API
    rows: pid, node_id): the node of the one live worker with its pid. A pid two nodes share (real nodes
    number their processes apart) says nothing: that actor stays unseen, as before."""
    by_pid: dict[int, set] = {}
    for w in workers:
        if getattr(w, "pid", None) and getattr(w, "node_id", None):
            by_pid.setdefault(int(w.pid), set()).add(w.node_id)
    out = {}
    for a in actors:
        found = by_pid.get(int(a.pid or 0), set()) if _constructing(a) else set()
        if len(found) == 1:
            out[a.actor_id] = next(iter(found))
    return out


def _on_node(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _kill_pid_fn(pid: int) -> bool:
    import os
    import signal
    import time
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(30):
            time.sleep(0.1)
            os.kill(pid, 0)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


_KILL_TASK = None


def _kill_pid_task():
    """`_kill_pid_fn` as a Ray task (made on first use: no Ray import at module import)."""
    global _KILL_TASK
    if _KILL_TASK is None:
        import ray
        _KILL_TASK = ray.remote(num_cpus=0, max_retries=0)(_kill_pid_fn)
    return _KILL_TASK
