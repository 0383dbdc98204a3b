"""The fill-in arbiter's decisions, from a snapshot of the cluster (pure: no Ray; time is an argument).

Training is first. A GPU is lent to a fill-in tenant only when training cannot use it now:
  * beyond its max     -- the job already runs `max_workers` workers;
  * a fragment          -- fewer free GPUs on a node than one worker needs (`gpus_per_worker`);
  * while it waits      -- the job cannot reach `min_workers` even with every free and leased GPU, so it
                           cannot start; its share is lent until capacity returns (then its claim reclaims).
Whole GPUs only (fractional GPUs are bookkeeping, not isolation). Draining and dead nodes lend nothing.

A training claim ("I need G more GPUs") is answered from free GPUs first; the rest is reclaimed from leases
in `order` (default sweeps -> batch -> serve; newest lease first within a kind). A lease on a node that is
gone is dropped; one on a draining node is reclaimed. Every decision carries its reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from spotfill.config.tenant_kinds import reclaim_order

DEFAULT_ORDER = reclaim_order()          # ("sweep", "batch", "serve"): the registry's ranks (config/tenant_kinds.py)
ACTIONS = ("lend", "refuse", "reclaim", "drop", "grant", "adopt", "wait")   # wait: a tenant wants GPUs, none lendable


@dataclass(frozen=True)
class Node:
    node_id: str
    total_gpus: int
    free_gpus: int                  # not held by anyone (Ray's available resources, whole GPUs)
    alive: bool = True
    draining: bool = False
    free_cpus: float | None = None  # Ray's available CPUs (None: not known -- not counted)


@dataclass(frozen=True)
class TrainingJob:
    job: str
    min_workers: int
    max_workers: int
    current_workers: int = 0
    gpus_per_worker: int = 1
    restarting: bool = False        # its group is down and about to start again (counts as 0 running)
    pending_gpus: int = 0           # claimed and freed, not yet taken by its new group: never lent
    pending_nodes: tuple[str, ...] = ()     # where that group is pinned (its warm nodes): held there first

    @property
    def running(self) -> int:
        return 0 if self.restarting else self.current_workers


@dataclass(frozen=True)
class Lease:
    lease_id: str
    tenant: str                     # e.g. "serve:spotfill-serve"
    kind: str                       # "sweep" | "batch" | "serve" (reclaim order)
    node_id: str
    gpus: int
    reclaim_method: str = "serve_scale"
    grace_s: float = 3.0
    granted_at: float = 0.0         # when its holder began holding the GPUs (not the lend decision)
    reclaiming_since: float | None = None
    lent_at: float | None = None    # the lend decision it took (None: adopted, nobody lent it)


@dataclass(frozen=True)
class Snapshot:
    nodes: tuple[Node, ...] = ()
    jobs: tuple[TrainingJob, ...] = ()
    leases: tuple[Lease, ...] = ()
    # nodes fill-in may lend on (None: every node). On an autoscaled cluster only nodes training uses
    # (training_hosts): a lease on a node with no training would keep it from scaling down
    hosts: frozenset[str] | None = None

    def node(self, node_id: str) -> Node | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def leased_on(self, node_id: str, *, reclaiming: bool | None = None) -> int:
        return sum(le.gpus for le in self.leases if le.node_id == node_id
                   and (reclaiming is None or (le.reclaiming_since is not None) == reclaiming))


@dataclass(frozen=True)
class Decision:
    action: str                     # one of ACTIONS
    tenant: str
    gpus: int
    reason: str
    at: float
    node_id: str | None = None
    lease_id: str | None = None
    deadline: float | None = None   # reclaim: when the tenant's grace ends

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class ClaimPlan:
    """How a training claim of `wanted` GPUs is met: `free_now` usable GPUs already free, the leases to
    reclaim, and what is missing even then (`short_by`)."""
    job: str
    wanted: int
    free_now: int
    decisions: tuple[Decision, ...] = ()
    short_by: int = 0

    @property
    def reclaims(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "reclaim")

    @property
    def ready(self) -> bool:
        return not self.reclaims and self.short_by == 0


# -- what training can use -------------------------------------------------------------------------------
def _usable_nodes(snap: Snapshot) -> list[Node]:
    return sorted((n for n in snap.nodes if n.alive and not n.draining), key=lambda n: n.node_id)


def feasible_workers(snap: Snapshot, job: TrainingJob) -> int:
    """Workers the job could run if every free and leased GPU were its own (its running ones included)."""
    gpw = max(1, job.gpus_per_worker)
    extra = sum(_back_on(n, snap.leased_on(n.node_id)) // gpw for n in _usable_nodes(snap))
    return job.running + extra


def reserved_for_training(snap: Snapshot) -> tuple[dict[str, int], list[str]]:
    """Free GPUs per node that training could take now (whole workers, up to each job's max), and why.
    Jobs are served in snapshot order; a job waiting below min reserves nothing."""
    left = {n.node_id: n.free_gpus for n in _usable_nodes(snap)}
    reserved = {node_id: 0 for node_id in left}
    why: list[str] = []
    for job in snap.jobs:
        gpw = max(1, job.gpus_per_worker)
        pending = job.pending_gpus
        pinned = set(job.pending_nodes)       # a group pinned to its warm nodes takes its GPUs there: held
        for node_id in sorted(left, key=lambda k: (k not in pinned, -left[k], k)):   # there, not elsewhere
            # until the pinned group is placed, every free GPU of its nodes is held: Ray packs its bundles
            # onto those nodes as it likes, and a GPU lent there meanwhile may be one it takes (a demo's batch
            # unit, lent a GPU of a pinned node, waited 30 s for it and was refused; the lease thrashed 6 times)
            take = left[node_id] if (pending and node_id in pinned) else min(pending, left[node_id])
            reserved[node_id] += take
            left[node_id] -= take
            pending = max(0, pending - take)
        if job.pending_gpus:
            why.append(f"{job.job} claimed {job.pending_gpus} GPU(s) its group has not taken yet")
        need = max(0, job.max_workers - job.running)
        if need == 0:
            why.append(f"{job.job} runs its max {job.max_workers} workers")
            continue
        if feasible_workers(snap, job) < job.min_workers:
            why.append(f"{job.job} waits below min ({feasible_workers(snap, job)} of "
                       f"min_workers={job.min_workers} possible)")
            continue
        for node_id in sorted(left, key=lambda k: (k not in pinned, -left[k], k)):
            take = min(need, left[node_id] // gpw)
            reserved[node_id] += take * gpw
            left[node_id] -= take * gpw
            need -= take
        why.append(f"{job.job} may grow by {max(0, job.max_workers - job.running) - need} workers "
                   f"({gpw} GPUs each)")
    return reserved, why


def lendable(snap: Snapshot, gpus_per_unit: int = 1, cpus_per_unit: float = 0.0) -> dict[str, int]:
    """Free GPUs per node that training cannot use now (on the snapshot's hosts only). With `cpus_per_unit`
    (a unit of the tenant asks for CPUs beside its GPUs, e.g. a Tune trial's bundle): no more GPUs on a node
    than whole units its free CPUs can also hold -- a GPU lent where the unit's CPUs are taken (by training)
    leaves the unit pending, demand an autoscaler would launch a node for."""
    reserved, _ = reserved_for_training(snap)
    out = {}
    for n in _usable_nodes(snap):
        spare = n.free_gpus - reserved.get(n.node_id, 0)
        if cpus_per_unit > 0 and n.free_cpus is not None:
            spare = min(spare, int(n.free_cpus / cpus_per_unit + 1e-9) * max(1, gpus_per_unit))
        if spare > 0 and (snap.hosts is None or n.node_id in snap.hosts):
            out[n.node_id] = spare
    return out


def training_hosts(training_seen: dict[str, float], now: float, idle_s: float) -> frozenset[str]:
    """Nodes fill-in may lend on when the cluster autoscales: those where training held GPUs within the
    last `idle_s` seconds (`training_seen`: node -> last time it did). A restart's gap shorter than
    `idle_s` keeps a node a host; a node training left for longer is given back to the autoscaler."""
    return frozenset(node for node, t in training_seen.items() if now - t <= idle_s)


def reclaim_off_hosts(snap: Snapshot, now: float, idle_s: float) -> tuple[Decision, ...]:
    """On an autoscaled cluster, leases on nodes that are no longer hosts (no training there for `idle_s`,
    e.g. training ended) are reclaimed, so the node goes idle and the autoscaler can remove it."""
    if snap.hosts is None:
        return ()
    return tuple(
        Decision("reclaim", le.tenant, le.gpus, at=now, node_id=le.node_id, lease_id=le.lease_id,
                 deadline=now + le.grace_s,
                 reason=f"no training on the node for {idle_s:g}s: given back so the autoscaler can "
                        f"scale the idle node down")
        for le in snap.leases if le.reclaiming_since is None and le.node_id not in snap.hosts
        and (node := snap.node(le.node_id)) is not None and node.alive and not node.draining)


def ownership(snap: Snapshot) -> dict[str, dict[str, int]]:
    """GPUs per node by owner: training, each tenant kind, reclaiming, idle."""
    out: dict[str, dict[str, int]] = {}
    for n in sorted(snap.nodes, key=lambda n: n.node_id):
        row = {"total": n.total_gpus, "idle": n.free_gpus, "training": 0, "reclaiming": 0}
        for le in snap.leases:
            if le.node_id == n.node_id:
                key = "reclaiming" if le.reclaiming_since is not None else le.kind
                row[key] = row.get(key, 0) + le.gpus
        row["training"] = max(0, n.total_gpus - n.free_gpus - snap.leased_on(n.node_id))
        out[n.node_id] = row
    return out


# -- decisions ---------------------------------------------------------------------------------------------
def minus_free(snap: Snapshot, taken) -> Snapshot:
    """`snap` with the (node, GPUs) or (node, GPUs, CPUs) in `taken` no longer free."""
    less: dict[str, list[float]] = {}
    for item in taken:
        row = less.setdefault(item[0], [0, 0.0])
        row[0] += item[1]
        row[1] += item[2] if len(item) > 2 else 0.0
    if not less:
        return snap

    def minus(n: Node) -> Node:
        gpus, cpus = less.get(n.node_id, (0, 0.0))
        return replace(n, free_gpus=max(0, n.free_gpus - gpus),
                       free_cpus=None if n.free_cpus is None else max(0.0, n.free_cpus - cpus))
    return replace(snap, nodes=tuple(minus(n) for n in snap.nodes))


def minus_anywhere(snap: Snapshot, gpus: int) -> Snapshot:
    """`snap` with `gpus` lendable GPUs no longer free, wherever they are (smallest lendable amount first, as
    decide_lend takes them): units a tenant was given and has not taken yet, on a node not known -- a
    finished Tune trial's successor asks for its group wherever one fits."""
    spare = lendable(snap)
    taken = []
    for node_id in sorted(spare, key=lambda k: (spare[k], k)):
        if gpus <= 0:
            break
        take = min(gpus, spare[node_id])
        taken.append((node_id, take))
        gpus -= take
    return minus_free(snap, taken)


def decide_lend(snap: Snapshot, tenant: str, kind: str, wanted: int, now: float, *,
                method: str = "serve_scale", grace_s: float = 3.0, gpus_per_unit: int = 1,
                cpus_per_unit: float = 0.0) -> tuple[Decision, ...]:
    """Lend up to `wanted` whole GPUs to `tenant`: fragments first (smallest lendable amount per node),
    one decision per node; a `refuse` decision (with the reason) when nothing can be lent."""
    wanted = int(wanted)
    spare = lendable(snap, gpus_per_unit, cpus_per_unit)
    decisions: list[Decision] = []
    for node_id in sorted(spare, key=lambda k: (spare[k], k)):
        if wanted <= 0:
            break
        take = min(wanted, spare[node_id])
        wanted -= take
        decisions.append(Decision("lend", tenant, take, at=now, node_id=node_id, deadline=None,
                                  reason=f"{spare[node_id]} free GPU(s) on the node that training cannot "
                                         f"use now; {method} reclaim, grace {grace_s:g}s"))
    if not decisions:
        _, why = reserved_for_training(snap)
        if cpus_per_unit > 0 and lendable(snap):
            why.append(f"the nodes with lendable GPUs lack the {cpus_per_unit:g} free CPU(s) a unit asks for")
        if snap.hosts is not None:
            off = sum(n.free_gpus for n in _usable_nodes(snap) if n.node_id not in snap.hosts)
            if off:
                why.append(f"{off} free GPU(s) on nodes training does not use (autoscaled cluster: fill-in "
                           f"neither keeps a node from scaling down nor makes the autoscaler launch one)")
        decisions.append(Decision("refuse", tenant, 0, at=now, reason="nothing lendable: " + (
            "; ".join(why) if why and any(n.free_gpus for n in snap.nodes) else "no free GPUs")))
    return tuple(decisions)


def _back_on(node: Node, coming: int) -> int:
    """GPUs free on `node` once `coming` more come back -- never more than it has: the state API can list a
    holder that has already let go beside the one that took its GPU (two 1-GPU leases on a 1-GPU node),
    and counting both would free a GPU twice while a lease elsewhere goes unreclaimed."""
    return min(node.total_gpus, node.free_gpus + coming)


def _usable_gpus(snap: Snapshot, gpw: int, extra: dict[str, int]) -> int:
    return sum(_back_on(n, extra.get(n.node_id, 0)) // gpw * gpw for n in _usable_nodes(snap))


def decide_claim(snap: Snapshot, job: str, wanted: int, gpus_per_worker: int, now: float,
                 order: Iterable[str] = DEFAULT_ORDER, nodes: Iterable[str] | None = None) -> ClaimPlan:
    """Meet training's claim of `wanted` GPUs: free whole workers first, then reclaim leases in `order`
    (newest first within a kind). Leases already reclaiming count as coming back. `nodes`: the group goes
    on these nodes only (its warm spares are there, train.readiness.warm_placement): only their GPUs count
    and only their leases are reclaimed -- a free GPU on another node is no use to it."""
    if nodes is not None:
        keep = frozenset(nodes)
        snap = replace(snap, nodes=tuple(n for n in snap.nodes if n.node_id in keep),
                       leases=tuple(le for le in snap.leases if le.node_id in keep))
    gpw, order = max(1, int(gpus_per_worker)), tuple(order)
    coming: dict[str, int] = {}
    for le in snap.leases:
        if le.reclaiming_since is not None:
            coming[le.node_id] = coming.get(le.node_id, 0) + le.gpus
    free_now = _usable_gpus(snap, gpw, {})
    have = _usable_gpus(snap, gpw, coming)
    usable_ids = {n.node_id for n in _usable_nodes(snap)}
    rank = {kind: i for i, kind in enumerate(order)}
    candidates = sorted((le for le in snap.leases if le.reclaiming_since is None and le.node_id in usable_ids),
                        key=lambda le: (rank.get(le.kind, len(rank)), -le.granted_at, le.lease_id))
    chosen: list[Lease] = []
    for le in candidates:
        if have >= wanted:
            break
        trial = dict(coming)
        trial[le.node_id] = trial.get(le.node_id, 0) + le.gpus
        chosen.append(le)
        coming, have = trial, _usable_gpus(snap, gpw, trial)
    for le in reversed(list(chosen)):     # one at a time, last chosen first: of two leases that free the same
        if not _helps(snap, gpw, coming, le):   # GPU, the one first in reclaim order stays
            chosen.remove(le)
            coming[le.node_id] -= le.gpus
    decisions = tuple(
        Decision("reclaim", le.tenant, le.gpus, at=now, node_id=le.node_id, lease_id=le.lease_id,
                 deadline=now + le.grace_s,
                 reason=f"training job {job} claims {wanted} GPU(s), {free_now} free; {le.kind} is "
                        f"#{rank.get(le.kind, len(rank)) + 1} in reclaim order {'>'.join(order)}")
        for le in chosen)
    short = max(0, wanted - _usable_gpus(snap, gpw, coming))
    if not decisions and short == 0:
        decisions = (Decision("grant", job, wanted, at=now,
                              reason=f"{free_now} usable GPU(s) free, {wanted} claimed"),)
    return ClaimPlan(job, wanted, free_now, decisions, short)


def claim_finished(plan: ClaimPlan, waited_s: float, deadline_s: float, pending: bool, reclaimed: bool,
                   settled_s: float | None, lag_s: float) -> tuple[bool, float | None]:
    """Is a claim answered now? (done, settled_s). Yes when enough GPUs are free or the deadline passed; or
    when nothing is left to reclaim (`pending`: no lease is still being reclaimed) and it is still short --
    at once when it reclaimed nothing, else once the GPUs it reclaimed had `lag_s` to show as available in
    Ray's resource view (a stopped replica is gone before its GPU shows free). `settled_s`: when (seconds
    into the claim) nothing was left to reclaim, carried from one call to the next."""
    if plan.free_now >= plan.wanted or waited_s > deadline_s:
        return True, settled_s
    if plan.short_by and not pending:
        settled_s = waited_s if settled_s is None else settled_s
        if not reclaimed or waited_s - settled_s > lag_s:
            return True, settled_s
    return False, settled_s


def _helps(snap: Snapshot, gpw: int, coming: dict[str, int], lease: Lease) -> bool:
    """Does reclaiming `lease` add usable GPUs, given everything else coming back?"""
    without = dict(coming)
    without[lease.node_id] -= lease.gpus
    return _usable_gpus(snap, gpw, coming) > _usable_gpus(snap, gpw, without)


def extra_replicas(leases: Iterable[Lease], tenant: str, target: int | None, stopping: int) -> list[Lease]:
    """The leases of a scale-by-count tenant (Serve) beyond what the arbiter set: it holds more than
    `target` plus the `stopping` units it was asked to stop and has not let go of yet (Serve's cold-start
    rule starts a replica by itself when it sees requests while none runs). Newest first: those are the
    ones it started by itself."""
    if target is None:
        return []
    held = sorted((le for le in leases if le.tenant == tenant), key=lambda le: (-le.granted_at, le.lease_id))
    return held[:max(0, len(held) - max(0, stopping) - target)]


def pending_reclaims(leases: Iterable[Lease]) -> list[dict]:
    """The leases being reclaimed, as the arbiter's status lists them (`spotfill status`)."""
    return [{"lease_id": le.lease_id, "tenant": le.tenant, "node_id": le.node_id, "gpus": le.gpus,
             "since": le.reclaiming_since, "deadline": le.reclaiming_since + le.grace_s}
            for le in leases if le.reclaiming_since is not None]


def reconcile(snap: Snapshot, now: float) -> tuple[Decision, ...]:
    """Leases on a node that is gone are dropped; leases on a draining node are reclaimed."""
    decisions = []
    for le in snap.leases:
        node = snap.node(le.node_id)
        if node is None or not node.alive:
            decisions.append(Decision("drop", le.tenant, le.gpus, at=now, node_id=le.node_id,
                                      lease_id=le.lease_id, reason="node lost: the lease died with it"))
        elif node.draining and le.reclaiming_since is None:
            decisions.append(Decision("reclaim", le.tenant, le.gpus, at=now, node_id=le.node_id,
                                      lease_id=le.lease_id, deadline=now + le.grace_s,
                                      reason="node draining (spot notice): move the tenant off it"))
    return tuple(decisions)


@dataclass(frozen=True)
class Holding:
    """What a tenant is seen holding on the cluster (e.g. a Serve replica using 1 GPU on a node)."""
    tenant: str
    kind: str
    node_id: str
    gpus: int
    key: str                        # stable id of the holder (replica actor id, placement group id)
    reclaim_method: str = "serve_scale"
    grace_s: float = 3.0
    since: float | None = None      # since when its holder holds them, where Ray says (an actor's start)
    lent_at: float | None = None    # the lend it took (None: the arbiter lent it nothing)


def rebuild_leases(holdings: Iterable[Holding], known: Iterable[Lease], now: float,
                   unknown: Iterable[str] = ()) -> tuple[tuple[Lease, ...], tuple[Decision, ...]]:
    """Leases from what tenants are seen holding: a known lease keeps its history (grant time,
    reclaiming); a holding with no lease record (the arbiter restarted) is adopted; a known lease with no
    holding left is dropped (its tenant let go). The lease id is the holder's key. A new lease starts when
    its holder began holding (`since`, never later than now; else now, when it is first seen) -- never at
    the lend decision it took (`lent_at`, kept beside it): between the two the tenant's worker was still
    being placed and started, and the GPU was nobody's. The leases of `unknown` tenants (what they hold
    could not be read this time) stay as they were: a failed read is not "holds nothing"."""
    unknown = set(unknown)
    known = tuple(known)
    by_id = {le.lease_id: le for le in known}
    leases, decisions = [], []
    seen = set()
    for h in holdings:
        if h.tenant in unknown:
            continue
        seen.add(h.key)
        old = by_id.get(h.key)
        if old is not None:
            leases.append(replace(old, node_id=h.node_id, gpus=h.gpus))
            continue
        leases.append(Lease(h.key, h.tenant, h.kind, h.node_id, h.gpus, h.reclaim_method, h.grace_s,
                            granted_at=min(now, h.since) if h.since else now, lent_at=h.lent_at))
        if h.lent_at is not None:
            continue                # the lend taking effect: decided (and logged) when it was made
        decisions.append(Decision("adopt", h.tenant, h.gpus, at=now, node_id=h.node_id, lease_id=h.key,
                                  reason="tenant holds GPUs with no lease record (deployed before it registered, "
                                         "replaced a lost replica, or the arbiter restarted): adopted"))
    for le in known:
        if le.tenant in unknown:
            leases.append(le)
        elif le.lease_id not in seen:
            decisions.append(Decision("drop", le.tenant, le.gpus, at=now, node_id=le.node_id,
                                      lease_id=le.lease_id, reason="tenant no longer holds it "
                                      + ("(reclaimed)" if le.reclaiming_since is not None else "(released)")))
    return tuple(leases), tuple(decisions)


def mark_reclaiming(leases: Iterable[Lease], targets: dict[str, int | None], reclaiming: dict[str, float],
                    now: float) -> tuple[Lease, ...]:
    """Per tenant (`targets`: tenant -> the count it was set to, None: not decided yet), as many of its
    leases as it holds beyond its target are going away -- Serve stops replicas of its own choosing: those
    the arbiter chose (`reclaiming`: lease id -> since) while still held, else the newest, marked from `now`.
    Leases of tenants not in `targets` (unregistered) are left as they are."""
    leases = tuple(leases)
    out = []
    for name, target in targets.items():
        mine = sorted((le for le in leases if le.tenant == name),
                      key=lambda le: (le.lease_id not in reclaiming, -le.granted_at, le.lease_id))
        going = max(0, len(mine) - target) if target is not None else 0
        out += [replace(le, reclaiming_since=reclaiming.get(le.lease_id, now) if i < going else None)
                for i, le in enumerate(mine)]
    return tuple(out) + tuple(le for le in leases if le.tenant not in targets)


@dataclass
class DecisionLog:
    """The last `keep` decisions, oldest first."""
    keep: int = 200
    items: list[Decision] = field(default_factory=list)

    def add(self, decisions: Iterable[Decision]) -> None:
        self.items.extend(decisions)
        del self.items[:-self.keep]


def reclaimable_by_node(snap: Snapshot, units: dict[str, tuple[float, int]], gpu_resource: str
                        ) -> dict[str, dict[str, float]]:
    """Arbiter.reclaimable: every lease on a node alive and not draining, reclaiming or not, as
    {node_id: {gpu_resource: gpus[, "CPU": their units' CPUs]}}; `units`: tenant -> (CPUs per unit, GPUs per
    unit). A unit's CPUs (a Tune trial's bundle) come back with it: sized on GPUs alone, a demo restart came
    out a worker short where a trial held the node's spare CPU."""
    usable = {n.node_id for n in snap.nodes if n.alive and not n.draining}
    out: dict[str, dict[str, float]] = {}
    for le in snap.leases:
        if le.node_id not in usable:
            continue
        row = out.setdefault(le.node_id, {gpu_resource: 0.0})
        row[gpu_resource] += le.gpus
        cpus, gpus_per_unit = units.get(le.tenant, (0.0, 1))
        if cpus > 0:
            row["CPU"] = row.get("CPU", 0.0) + cpus * max(1, le.gpus // max(1, gpus_per_unit))
    return out
