"""Turns: fair share over time, for when there are fewer spare units than tenants that want one (pure: no
Ray; `now` is an argument).

With a share of 0 each (lending.fair_share moves nothing), `take_turns` decides: a tenant that has waited
`turn_s` with nothing takes a unit from a batch job or sweep that has held units without a break (a sweep's
next trial taking the unit its last one freed is no break) and computed `turn_s` since its first unit of that
hold first computed -- its oldest unit that has computed, so the sweep pauses a running trial with a
checkpoint, the batch job stops a wave that did work; a tenant none of whose units computed within `turn_s` of
the hold's start (plus a start's patience, START_PATIENCE_S) gives up its oldest, and a unit that has not
computed within that of its grant goes too -- and `lend_round` serves the longest-waiting tenant first, so the
freed unit goes where the turn said.

A turn is time computing, not time holding: a cold start (process, imports, the model's load: 15-25 s for a
demo's batch wave here, and the lease holds the GPU all along) no longer eats the turn it starts. With turns
of 30 s counted from the grant, a demo's batch job was lent a GPU six times and computed 0.7 s in all.

Serve is never made to give a replica up for a turn (it answers users; training's claims still take it). Without turns a demo's batch job waited for its first GPU
until the sweep ran out of trials.

`TurnClock` keeps what the decision needs from one round to the next: since when each tenant has waited with
nothing, since when it has held units without a break, and when each lease's holder first computed (the
tenants' `fillin_busy` reports, fillin/busy.py).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Mapping

from spotfill.fillin.lending import START_PATIENCE_S, TenantView, held_units, hungry, without_starting
from spotfill.fillin.policy import Decision, Snapshot, lendable

TURN_S = 300.0             # fewer units than tenants: a job tenant's unit held this long goes to a tenant that
                           # has waited this long with nothing (several times a unit's start, model load included)
HOLD_BREAK_S = 5.0         # a tenant holding nothing this long has had a break (a sweep between two trials has not)


class TurnClock:
    """Per tenant: waiting since / holding since; per lease: first computed. Updated each lending round."""

    def __init__(self):
        self.waiting_since: dict[str, float] = {}   # tenant -> since when it wants units and holds none
        self.holding_since: dict[str, float] = {}   # tenant -> since when it holds units without a break
        self.held_at: dict[str, float] = {}         # tenant -> when it was last seen holding units
        self.busy_since: dict[str, float] = {}      # lease id -> when its holder first computed
        self.computing_since: dict[str, float] = {}  # tenant -> when, in its current hold, a unit first computed

    def times(self, tenant: str) -> dict:
        """The clock's fields of `tenant`'s TenantView: waiting_since, holding_since, computing_since."""
        return {"waiting_since": self.waiting_since.get(tenant), "holding_since": self.holding_since.get(tenant),
                "computing_since": self.computing_since.get(tenant)}

    def busy(self, lease_id: str, t0: float) -> None:
        self.busy_since.setdefault(lease_id, float(t0))

    def ended(self, lease_ids: Iterable[str]) -> None:
        for lid in lease_ids:
            self.busy_since.pop(lid, None)

    def observe(self, wanted: Mapping[str, int], snap: Snapshot, now: float) -> None:
        """`wanted`: each registered tenant's units wanted now; `snap`: the round's leases."""
        holding = {le.tenant for le in snap.leases}
        for name, units in wanted.items():
            if units > 0 and name not in holding:
                self.waiting_since.setdefault(name, now)
            else:
                self.waiting_since.pop(name, None)
            if name in holding:
                since = self.holding_since.setdefault(name, now)
                self.held_at[name] = now
                first = first_compute(name, snap, self.busy_since)
                if first is not None and name not in self.computing_since:
                    self.computing_since[name] = max(first, since)
            elif now - self.held_at.get(name, 0.0) > HOLD_BREAK_S:
                self.holding_since.pop(name, None)
                self.computing_since.pop(name, None)
        for name in (set(self.waiting_since) | set(self.held_at)) - set(wanted):
            for d in (self.waiting_since, self.holding_since, self.held_at, self.computing_since):
                d.pop(name, None)
        if len(self.busy_since) > 4 * len(snap.leases) + 64:     # reports of leases that ended before they came
            live = {le.lease_id for le in snap.leases}
            self.busy_since = {k: v for k, v in self.busy_since.items() if k in live}


def take_turns(tenants: Iterable[TenantView], snap: Snapshot, now: float, turn_s: float = TURN_S,
               busy_since: Mapping[str, float] | None = None) -> Decision | None:
    """A reclaim that hands a batch job's or sweep's unit to a tenant that has waited `turn_s` with nothing,
    or None (see the module's doc). One at a time; nothing while a lease is being reclaimed or a unit is
    lendable to the waiting tenant. `busy_since`: lease id -> when its holder first computed (fillin/busy.py
    reports)."""
    busy_since = busy_since or {}
    tenants = [t for t in tenants if t.wanted > 0]
    if len(tenants) < 2 or any(le.reclaiming_since is not None for le in snap.leases):
        return None
    free = without_starting(tenants, snap)
    waiting = sorted((t for t in tenants if held_units(snap, t.tenant) == 0 and hungry(t, snap)
                      and t.waiting_since is not None and now - t.waiting_since >= turn_s
                      and lendable(free, t.gpus_per_unit, t.cpus_per_unit) == {}),
                     key=lambda t: (t.waiting_since, t.tenant))
    if not waiting:
        return None
    p = waiting[0]
    donors = {t.tenant: _with_compute(t, snap, busy_since) for t in tenants if not t.scaled and t.tenant != p.tenant}
    donors = {name: t for name, t in donors.items() if _turn_over(t, now, turn_s)}
    usable = {n.node_id for n in snap.nodes if n.alive and not n.draining}
    leases = sorted((le for le in snap.leases if le.tenant in donors and le.node_id in usable
                     and le.gpus >= max(1, p.gpus_per_unit)
                     and (le.lease_id in busy_since or now - le.granted_at >= turn_s + START_PATIENCE_S)),
                    key=lambda le: (le.granted_at, le.lease_id))
    if not leases:
        return None
    le = leases[0]
    d = donors[le.tenant]
    held = now - d.holding_since
    used = (f"has computed {now - d.computing_since:.0f}s of the {held:.0f}s it held GPUs" if d.computing_since
            is not None else f"has held GPUs {held:.0f}s and computed on none")
    return Decision("reclaim", le.tenant, le.gpus, at=now, node_id=le.node_id, lease_id=le.lease_id,
                    deadline=now + le.grace_s, reason=(
                        f"turns: {p.tenant} has waited {now - p.waiting_since:.0f}s with no GPU while fewer are "
                        f"lendable than tenants want one; {le.tenant} {used} (turn "
                        f"{turn_s:g}s of computing): its oldest unit "
                        + ("that computed" if le.lease_id in busy_since else "(not computing yet)")
                        + f" goes to {p.tenant}"))


def _with_compute(t: TenantView, snap: Snapshot, busy_since: Mapping[str, float]) -> TenantView:
    """`t` with its hold's first compute from its leases' reports where its view has none (TurnClock keeps it
    past the leases that computed; a view built without the clock still counts what its leases report)."""
    if t.computing_since is not None or t.holding_since is None:
        return t
    first = first_compute(t.tenant, snap, busy_since)
    return t if first is None else replace(t, computing_since=max(first, t.holding_since))


def first_compute(tenant: str, snap: Snapshot, busy_since: Mapping[str, float]) -> float | None:
    """When the first of `tenant`'s current units first computed (None: none has)."""
    return min((busy_since[le.lease_id] for le in snap.leases if le.tenant == tenant and le.lease_id in busy_since),
               default=None)


def _turn_over(t: TenantView, now: float, turn_s: float) -> bool:
    """A donor's turn is over: it computed `turn_s` since its hold's first compute, or in a hold of `turn_s`
    plus a start's patience (START_PATIENCE_S) none of its units computed at all. Without the patience two
    tenants whose cold starts outlast a turn took the unit from each other every 30 s in a demo, neither
    ever computing."""
    if t.holding_since is None:
        return False
    if t.computing_since is not None:
        return now - t.computing_since >= turn_s
    return now - t.holding_since >= turn_s + START_PATIENCE_S
