"""Holders that let go before the state API says so (pure; no Ray).

A reclaimed Ray Data actor or Serve replica frees its GPU when its worker disconnects from the raylet; the
state API lists the actor until its process has exited and the GCS has marked it dead -- seconds later on a
busy machine (CI: 6.6 s for a batch actor whose GPU showed free at 0.5 s). Training's hand-back is done when
the GPU is free, and a holder still listed after that must not be counted as holding: it made the arbiter
keep a lease that no longer held anything (a reclaim order it then closed 6 s late, and a lend it repeated
because the tenant looked as if it held what it had been lent).

`LetGo` keeps, from one snapshot to the next, which reclaiming leases Ray's resource view shows as freed and
which holders were let go that way (so a listing that still shows them does not adopt them again).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from spotfill.fillin.policy import Decision, Lease, Node

CONFIRM_S = 1.0        # the view shows the GPUs free this long (a raylet report just missed is not a hand-back)
FORGET_S = 120.0       # a holder the state API lists this long after it let go is taken at its word again


def freed_in_view(nodes: Iterable[Node], leases: Iterable[Lease]) -> tuple[Lease, ...]:
    """Reclaiming leases whose GPUs Ray's resource view shows free: on their node nothing is in use beyond
    the leases that stay. A node where something without a lease (training) also holds GPUs is left to the
    listing: its in-use count cannot tell a freed lease from training leaving."""
    leases = tuple(leases)
    out: list[Lease] = []
    for n in nodes:
        if not n.alive:
            continue
        on = [le for le in leases if le.node_id == n.node_id]
        going = [le for le in on if le.reclaiming_since is not None]
        staying = sum(le.gpus for le in on if le.reclaiming_since is None)
        if going and n.total_gpus - n.free_gpus <= staying:
            out += going
    return tuple(out)


@dataclass
class LetGo:
    seen_free: dict[str, float] = field(default_factory=dict)   # lease id -> first snapshot its GPUs showed free
    gone: dict[str, float] = field(default_factory=dict)        # holder key -> when it was let go this way
    tenant_of: dict[str, str] = field(default_factory=dict)     # holder key -> its tenant

    def listed(self, keys: Iterable[str], now: float, unknown: Iterable[str] = ()) -> set[str]:
        """Of the holder keys the state API lists now, those let go already (to be ignored). A key no
        longer listed, or listed past FORGET_S, is forgotten -- unless its tenant is `unknown` (what it holds
        could not be read this time: absent from the listing is not "no longer listed")."""
        keys, unknown = set(keys), set(unknown)
        self.gone = {k: t for k, t in self.gone.items()
                     if (k in keys or self.tenant_of.get(k) in unknown) and now - t <= FORGET_S}
        self.tenant_of = {k: v for k, v in self.tenant_of.items() if k in self.gone}
        return set(self.gone)

    def settle(self, nodes: Iterable[Node], leases: tuple[Lease, ...], now: float
               ) -> tuple[tuple[Lease, ...], tuple[Decision, ...]]:
        """The leases that stay, and a drop for each reclaiming lease whose GPUs the view has shown free
        for CONFIRM_S (its holder is remembered as gone)."""
        free = freed_in_view(nodes, leases)
        self.seen_free = {le.lease_id: self.seen_free.get(le.lease_id, now) for le in free}
        done = [(le, self.seen_free.pop(le.lease_id)) for le in free
                if now - self.seen_free[le.lease_id] >= CONFIRM_S]
        self.gone.update((le.lease_id, now) for le, _ in done)
        self.tenant_of.update((le.lease_id, le.tenant) for le, _ in done)
        # dated when the GPUs first showed free: the hand-back ended then (journal.lease_ended)
        drops = tuple(Decision("drop", le.tenant, le.gpus, at=since, node_id=le.node_id, lease_id=le.lease_id,
                               reason=f"tenant let go (reclaimed): its GPU(s) show free in Ray's resource view "
                                      f"{since - le.reclaiming_since:.1f}s after the reclaim; the state API "
                                      f"still lists the holder while its process exits")
                      for le, since in done)
        ids = {le.lease_id for le, _ in done}
        return tuple(le for le in leases if le.lease_id not in ids), drops
