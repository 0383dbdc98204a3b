"""The arbiter's journal: what fill-in writes into a training run's events.jsonl (pure: no Ray).

The arbiter sees every lease begin and end (it rebuilds its leases from what the tenants hold, every tick)
and every GPU node come and go. It turns those into the event kinds the GPU-seconds ledger reads
(spotfill.telemetry.ledger) and keeps them in a bounded, numbered journal; each training run's driver
copies the journal into its own events.jsonl (train/job.py, LeaseForwarder).

    node_up    {node, gpus}                            a GPU node (t: when the arbiter first saw it)
    node_down  {node}                                  it is gone
    gpu_free   {node, free}                            the node's GPUs held by nobody (Ray's available
                                                       resources), at first sight and at every change: the
                                                       ledger's evidence that GPUs were idle
    lease      {lease_id, tenant, workload, node, gpus, start, lent_at}
               start: when the holder began holding the GPUs; lent_at: the lend decision it took (null:
               adopted, nobody lent it)
    reclaim    {lease_id, ..., start, end, requested_at, reclaim_s, cause, reason, job}
               the lease ended because spotfill took the GPUs back: `cause` training_claim (a training job's
               claim; `reclaim_s` = that claim -> this GPU free, the hand-back), node_draining, node_idle
               (autoscaled cluster: training left the node, which is given back to scale down), or
               not_lent (a replica Serve started by itself, its cold start, outside any claim); a lease on a
               draining node whose node went before its hand-back was seen ends as its node_draining reclaim
               with `node_lost: true` and `reclaim_s` null
    release    {lease_id, ..., end}                    the tenant let the GPUs go by itself
    lease_end  {lease_id, ..., end, reason}            the lease's node died with it
    handback_incomplete {tenant, lease_id, requested_at, waited_s, cause, reason, job}
               a reclaim asked for ORDER_TTL_S ago whose GPUs were never seen given back (the tenant did
               not let go, or its scale call never got through): reported, not forgotten
    fillin_busy {tenant, workload, node, lease_id, gpus, busy_s, t0, t1}
               a tenant's own measurement of its compute (fillin/busy.py), journaled as it came

Serve stops replicas of its own choosing, so a reclaim order is matched to the first lease of that tenant
that ends after it (oldest order first), not to the lease id the arbiter picked.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Iterable

from spotfill.fillin.policy import Decision, Lease, Node

ORDER_TTL_S = 120.0         # a reclaim order no lease ended for within this is reported as incomplete


@dataclass(frozen=True)
class ReclaimOrder:
    tenant: str
    lease_id: str                     # the lease the arbiter chose (Serve may stop another of the tenant's)
    requested_at: float               # training's claim began (or the drain was seen)
    cause: str                        # "training_claim" | "node_draining" | "node_idle" | "not_lent" |
                                      # "fair_share"
    reason: str
    job: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _lease_fields(le: Lease) -> dict:
    return {"lease_id": le.lease_id, "tenant": le.tenant, "workload": le.kind, "node": le.node_id,
            "gpus": le.gpus, "start": round(le.granted_at, 3),
            "lent_at": None if le.lent_at is None else round(le.lent_at, 3)}


def lease_event(le: Lease, t: float) -> dict:
    return {"t": t, "kind": "lease", **_lease_fields(le)}


def lease_ended(decisions: Iterable[Decision], known: dict[str, Lease], orders: list[ReclaimOrder],
                now: float) -> tuple[list[dict], list[ReclaimOrder]]:
    """Events for the leases `decisions` drop (known: lease id -> the lease as it was). A lease lost with
    its node -> lease_end; one the tenant let go while a reclaim order for that tenant is open -> reclaim
    (the oldest order is used up); else release. An order no lease ended for within ORDER_TTL_S ends as a
    handback_incomplete event. Returns the events and the orders still open."""
    left = [o for o in orders if now - o.requested_at < ORDER_TTL_S]
    events = [{"t": now, "kind": "handback_incomplete", "tenant": o.tenant, "lease_id": o.lease_id,
               "requested_at": round(o.requested_at, 3), "waited_s": round(now - o.requested_at, 3),
               "cause": o.cause, "reason": o.reason, "job": o.job}
              for o in orders if now - o.requested_at >= ORDER_TTL_S]
    for d in decisions:
        if d.action != "drop" or d.lease_id not in known:
            continue
        le = known[d.lease_id]
        end = min(now, d.at or now)     # a drop may date from before this snapshot (let_go: first seen free)
        base = {"t": now, **_lease_fields(le), "end": round(end, 3)}
        if "node lost" in d.reason:
            # the node died: an open order for this lease is void (Serve will not stop another replica
            # for it, its target already counts the loss) -- except a spot notice's: the tenant was told to
            # move off the node the notice named, and that node then going is what the notice said. A
            # drained node's raylet exits as soon as nothing runs there, i.e. right after the tenant let go,
            # often before the arbiter's next look sees the GPU free (a demo's sweep paused its trial with a
            # checkpoint 0.4 s after the notice's reclaim; the node was gone at the next look, 4 s later).
            # It ends as that reclaim, `node_lost` said, and no hand-back time: none was seen.
            drained = next((o for o in left if o.lease_id == le.lease_id and o.cause == "node_draining"), None)
            left = [o for o in left if o.lease_id != le.lease_id]
            if drained is not None and drained.requested_at <= end:
                events.append({**base, "kind": "reclaim", "requested_at": round(drained.requested_at, 3),
                               "reclaim_s": None, "cause": drained.cause, "node_lost": True,
                               "reason": f"{drained.reason}; the node was gone before the hand-back was seen",
                               "job": drained.job})
                continue
            events.append({**base, "kind": "lease_end", "reason": d.reason})
            continue
        # a lease that ended before an order was placed is not its hand-back
        order = next((o for o in left if o.tenant == le.tenant and o.requested_at <= end), None)
        if order is None:
            events.append({**base, "kind": "release", "reason": d.reason})
            continue
        left.remove(order)
        events.append({**base, "kind": "reclaim", "requested_at": round(order.requested_at, 3),
                       "reclaim_s": round(end - order.requested_at, 3), "cause": order.cause,
                       "reason": order.reason, "job": order.job})
    return events, left


def node_events(seen: dict[str, dict], nodes: Iterable[Node], now: float) -> tuple[list[dict], dict[str, dict]]:
    """node_up for a GPU node alive and not seen before, node_down for a seen node now dead or gone,
    gpu_free for an alive node's free GPUs when first seen or changed. `seen`: node id -> {"gpus", "since",
    "free", "free_since"}; returns the events and the new `seen`."""
    events, out, listed = [], dict(seen), set()
    for n in nodes:
        listed.add(n.node_id)
        if n.alive and n.node_id not in out:
            out[n.node_id] = {"gpus": n.total_gpus, "since": now}
            events.append({"t": now, "kind": "node_up", "node": n.node_id, "gpus": n.total_gpus})
        if n.alive and out[n.node_id].get("free") != n.free_gpus:
            out[n.node_id] = {**out[n.node_id], "free": n.free_gpus, "free_since": now}
            events.append({"t": now, "kind": "gpu_free", "node": n.node_id, "free": n.free_gpus})
        elif not n.alive and n.node_id in out:
            del out[n.node_id]
            events.append({"t": now, "kind": "node_down", "node": n.node_id})
    for node_id in [k for k in out if k not in listed]:
        del out[node_id]
        events.append({"t": now, "kind": "node_down", "node": node_id})
    return events, out


def opening(seen: dict[str, dict], leases: Iterable[Lease]) -> list[dict]:
    """What a reader that starts now needs first: the GPU nodes alive, their free GPUs and the leases open,
    each at the time it began (the ledger cuts everything to the run's window)."""
    events = [{"t": v["since"], "kind": "node_up", "node": k, "gpus": v["gpus"]} for k, v in sorted(seen.items())]
    events += [{"t": v["free_since"], "kind": "gpu_free", "node": k, "free": v["free"]}
               for k, v in sorted(seen.items()) if v.get("free") is not None]
    events += [lease_event(le, le.granted_at) for le in leases]
    return sorted(events, key=lambda e: e["t"])


@dataclass
class Journal:
    """Numbered events, the last `keep` of them. `read(after)` -> (events after that number, the newest
    number); a reader that is new, or fell behind what is kept, or saw a journal that started over (an
    arbiter restarted without its state) gets `opening` instead, from the caller."""
    keep: int = 2000
    seq: int = 0
    items: list = field(default_factory=list)      # [seq, event]

    def add(self, events: Iterable[dict]) -> None:
        for e in events:
            self.seq += 1
            self.items.append([self.seq, e])
        del self.items[:-self.keep]

    def read(self, after: int | None) -> tuple[list[dict] | None, int]:
        """None for the events when the reader must start from `opening`."""
        oldest = self.items[0][0] if self.items else self.seq + 1
        if after is None or after > self.seq or after < oldest - 1:
            return None, self.seq
        return [e for s, e in self.items if s > after], self.seq
