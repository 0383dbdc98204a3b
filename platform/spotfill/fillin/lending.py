"""How the arbiter grows its tenants each second, and keeps their shares fair (pure: no Ray; `now` is an
argument).

`lend_round` serves every tenant from one pool: units a tenant was given and has not taken yet (a replica or
actor starting, a Tune trial between one trial's end and the next one's group) are not lent again; tenants
holding least go first, each up to a fair share of what is lendable now (a lone tenant takes it all).
`grow` is one tenant's step: wait for units still starting (and give up on them after a patience), take
over the count a tenant deployed with, ask for more where policy.decide_lend finds lendable GPUs.

`fair_share` rebalances what is already lent: while more than one tenant wants GPUs and nothing is left to
lend, a tenant holding a unit more than its share gives its newest unit (held at least MIN_HOLD_S) back to
one holding less than its share -- a sweep pauses a trial with a checkpoint, a batch job stops its wave
(its committed units stay), Serve stops a replica. Without it the first tenant to register kept every spare
GPU (a sweep held both spares for 100 s while a batch job waited for its first).

Fewer units than tenants that want one: they take turns (fillin/turns.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from spotfill.fillin.policy import Decision, Snapshot, decide_lend, lendable, minus_anywhere, minus_free

START_PATIENCE_S = 30.0    # a unit asked for but not running after this long: stop asking for it
PLACE_PATIENCE_S = 10.0    # autoscaled cluster, launch_nodes off: a Serve replica not placed after this long
                           # is taken back; at once when the autoscaler reports it as demand (it would launch
                           # a node for it) -- a replica whose worker process is still starting is not demand
MIN_HOLD_S = 20.0          # a lease younger than this is not taken back for another tenant's fair share


@dataclass(frozen=True)
class TenantView:
    """What lending needs to know about a tenant."""
    tenant: str
    kind: str
    gpus_per_unit: int = 1
    cpus_per_unit: float = 0.0       # CPUs a unit asks for beside its GPUs (a Tune trial's bundle)
    grace_s: float = 3.0
    target: int | None = None        # the count it was set to (None: not taken over yet)
    wanted: int = 0                  # units it could use now
    scaled: bool = False             # Serve: scaled by count from outside (it may run more than it was set to)
    asked_at: float | None = None    # when it was last asked to grow
    demand: bool = False             # the autoscaler reports a unit of it as waiting for resources
    waiting_since: float | None = None   # since when it has held nothing while wanting units (None: it holds)
    holding_since: float | None = None   # since when it has held units without a break (None: it holds none)
    computing_since: float | None = None  # since when, in that hold, one of its units first computed (None:
                                         # none has yet: its units are still starting)


@dataclass(frozen=True)
class Growth:
    """One tenant's step: the count to ask for now (None: leave it as it is) and why."""
    tenant: str
    target: int | None = None
    lends: tuple[Decision, ...] = ()
    refusal: Decision | None = None
    waiting: Decision | None = None  # it wants more and nothing is lendable: why (policy.decide_lend's reason)
    takeover: bool = False           # its first count: what it holds, taken over
    reassert: bool = False           # the same count asked for again (Serve runs more than it was set to)


def held_units(snap: Snapshot, tenant: str) -> int:
    return sum(1 for le in snap.leases if le.tenant == tenant)


def starting_gpus(t: TenantView, snap: Snapshot) -> int:
    """GPUs given to `t` and not taken yet: its target beyond what it holds."""
    if t.target is None:
        return 0
    return max(0, t.target - held_units(snap, t.tenant)) * max(1, t.gpus_per_unit)


def grow(t: TenantView, snap: Snapshot, now: float, *, cap_gpus: int | None = None, guard: bool = False,
         launch_nodes: bool = False) -> Growth:
    """Scale `t` toward what it wants from what is lendable in `snap`. `guard`: autoscaled cluster that must
    not make the autoscaler launch nodes; `launch_nodes`: autoscaled cluster where fill-in may."""
    gpu = max(1, t.gpus_per_unit)
    held = held_units(snap, t.tenant)
    first = t.target is None            # just registered: take over the count it runs with
    target = held if first else t.target
    if target > held:                   # units still starting: wait for them, not twice
        # a job tenant's actors come with its Data or Tune executor, which on a busy node takes longer than
        # PLACE_PATIENCE_S to start them (a batch job lent a GPU every 10 s here, and refused each time
        # before its actor was up); a unit the autoscaler reports as demand is refused at once
        patience = PLACE_PATIENCE_S if guard and t.scaled else START_PATIENCE_S
        demand = guard and t.demand
        if not demand and now - (t.asked_at if t.asked_at is not None else now) < patience:
            return Growth(t.tenant)
        why = ("a unit waits for resources: the autoscaler sees it as demand and would launch a node "
               "(launch_nodes is off)" if demand else f"units not placed within {patience:g}s")
        return Growth(t.tenant, held, refusal=Decision("refuse", t.tenant, (target - held) * gpu, at=now, reason=(
            f"{why}; asking for {held} instead of {target}")))
    reassert = (held > target and t.scaled
                and (t.asked_at is None or now - t.asked_at >= START_PATIENCE_S)
                and not any(le.reclaiming_since and now - le.reclaiming_since < le.grace_s + 1.0
                            for le in snap.leases if le.tenant == t.tenant))
    wanted = (t.wanted - target) * gpu
    if cap_gpus is not None:
        wanted = min(wanted, max(gpu, cap_gpus))
    lends: list[Decision] = []
    waiting = None
    if wanted > 0:
        decided = decide_lend(snap, t.tenant, t.kind, wanted, now, grace_s=t.grace_s,
                              method="serve_scale" if t.scaled else "job_yield", gpus_per_unit=gpu,
                              cpus_per_unit=t.cpus_per_unit)
        lends = [d for d in decided if d.action == "lend"]
        waiting = next((replace(d, action="wait", gpus=wanted) for d in decided if d.action == "refuse"), None)
        if not lends and launch_nodes and (t.asked_at is None or now - t.asked_at >= START_PATIENCE_S):
            # the user allowed fill-in to grow the cluster: one more unit, pending until the autoscaler
            # launches a node for it (training still reclaims it first)
            lends = [Decision("lend", t.tenant, gpu, at=now, reason=(
                "launch_nodes: nothing lendable on the nodes up; a pending unit asks the autoscaler for a node"))]
    units = sum(d.gpus for d in lends) // gpu
    if units:
        return Growth(t.tenant, target + units, lends=tuple(lends), takeover=first, reassert=reassert)
    return Growth(t.tenant, target if first or reassert else None, takeover=first, reassert=reassert,
                  waiting=None if lends else waiting)


def wait_to_record(g: Growth, recorded: dict[str, str | None]) -> list[Decision]:
    """[`g`'s `wait` decision] when its kind of reason is new for its tenant (`recorded`: tenant -> the last
    kind, updated here), else []. A kind is the reason with its counts aside ("3 free GPU(s)" and "5 free
    GPU(s)" are one): the arbiter's decision log keeps the last 200 decisions of every action."""
    kind = re.sub(r"\d+", "#", g.waiting.reason) if g.waiting is not None else None
    if kind == recorded.get(g.tenant):
        return []
    recorded[g.tenant] = kind
    return [g.waiting] if g.waiting is not None else []


def hungry(t: TenantView, snap: Snapshot) -> bool:
    """`t` wants more than it was set to, and holds what it was set to (nothing of it is still starting)."""
    return t.target is None or (t.target < t.wanted and t.target <= held_units(snap, t.tenant))


def without_starting(tenants: Iterable[TenantView], snap: Snapshot) -> Snapshot:
    """`snap` less the GPUs tenants were given and have not taken yet."""
    return minus_anywhere(snap, sum(starting_gpus(t, snap) for t in tenants))


def lend_round(tenants: Iterable[TenantView], snap: Snapshot, now: float, *, guard: bool = False,
               launch_nodes: bool = False) -> list[Growth]:
    """Every tenant's step this second, from one pool (see the module's doc)."""
    tenants = list(tenants)
    snap = without_starting(tenants, snap)
    spare = sum(lendable(snap).values())
    want = [t for t in tenants if hungry(t, snap)]
    share = max(1, spare // max(1, len(want)))
    out = []
    # holding least first; among equals, the one waiting longest (a unit a turn freed goes to whom it was for)
    for t in sorted(tenants, key=lambda t: (held_units(snap, t.tenant), t.waiting_since
                                            if t.waiting_since is not None else now, t.tenant)):
        g = grow(t, snap, now, cap_gpus=share, guard=guard, launch_nodes=launch_nodes)
        out.append(g)
        per = max(1, t.gpus_per_unit)
        snap = minus_free(snap, [(d.node_id, d.gpus, t.cpus_per_unit * d.gpus / per) for d in g.lends if d.node_id])
    return out


def fair_share(tenants: Iterable[TenantView], snap: Snapshot, now: float, order: Iterable[str] = (),
               min_hold_s: float = MIN_HOLD_S, busy_since: Mapping[str, float] | None = None) -> Decision | None:
    """A reclaim that moves one unit from a tenant above its fair share toward one below it, or None. One at
    a time: nothing while any lease is being reclaimed, or while something is still lendable (lending
    serves the hungry tenant then). The share: the GPUs fill-in holds plus what is lendable, split evenly
    between the tenants that want GPUs. `busy_since` (lease id -> when its holder first computed; None:
    not known, a lease's hold counts from its grant): a unit moves once it computed `min_hold_s`, or -- one
    that never computed -- once it held START_PATIENCE_S beyond that: a unit still starting cold (20-35 s
    in a demo here) is not taken away before its first compute, which would waste its start and the
    receiver's start alike."""
    tenants = [t for t in tenants if t.wanted > 0]
    if len(tenants) < 2 or any(le.reclaiming_since is not None for le in snap.leases):
        return None
    free = without_starting(tenants, snap)
    spare = sum(lendable(free).values())
    gpus = {t.tenant: sum(le.gpus for le in snap.leases if le.tenant == t.tenant) for t in tenants}
    pool = sum(gpus.values()) + spare
    share = pool // len(tenants)
    poor = [t for t in tenants if gpus[t.tenant] + max(1, t.gpus_per_unit) <= share and hungry(t, snap)
            and lendable(free, t.gpus_per_unit, t.cpus_per_unit) == {}]
    if not poor:
        return None
    rank = {kind: i for i, kind in enumerate(order)}
    donors = sorted((t for t in tenants if gpus[t.tenant] - max(1, t.gpus_per_unit) >= share),
                    key=lambda t: (-gpus[t.tenant], rank.get(t.kind, len(rank)), t.tenant))
    usable = {n.node_id for n in snap.nodes if n.alive and not n.draining}
    for donor in donors:
        leases = sorted((le for le in snap.leases if le.tenant == donor.tenant and le.node_id in usable
                         and _held_enough(le, now, min_hold_s, busy_since)),
                        key=lambda le: (-le.granted_at, le.lease_id))
        if leases:
            le, p = leases[0], poor[0]
            return Decision("reclaim", donor.tenant, le.gpus, at=now, node_id=le.node_id, lease_id=le.lease_id,
                            deadline=now + le.grace_s, reason=(
                                f"fair share: {p.tenant} holds {gpus[p.tenant]} GPU(s) and wants more, "
                                f"{donor.tenant} holds {gpus[donor.tenant]}; {len(tenants)} tenants want GPUs "
                                f"and fill-in can use {pool}, {share} each: {donor.tenant}'s newest unit (held "
                                f"{now - le.granted_at:.0f}s" + (f", computing {now - busy_since[le.lease_id]:.0f}s"
                                                                 if busy_since and le.lease_id in busy_since else "")
                                + f") goes to {p.tenant}"))
    return None


def _held_enough(le, now: float, min_hold_s: float, busy_since: Mapping[str, float] | None) -> bool:
    if busy_since is None:
        return now - le.granted_at >= min_hold_s
    if le.lease_id in busy_since:
        return now - busy_since[le.lease_id] >= min_hold_s
    return now - le.granted_at >= min_hold_s + START_PATIENCE_S

