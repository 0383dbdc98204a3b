"""The fill-in arbiter: one detached, named Ray actor on the head node (no CPUs, no GPUs reserved).

Thin around the pure decisions (fillin/policy.py, lending.py, hosts.py): every second it reads Ray's state
(fillin/cluster_view.py), reconciles (a lease on a dead node is gone, one on a draining node reclaimed) and
lends what training cannot use. Training claims GPUs through `claim(job, gpus, deadline_s)`: leases are
reclaimed in order, answered when the GPUs are free or at the deadline. Every decision is kept with its reason.

Every tenant is a fill-in `Tenant` (fillin/tenant.py): the arbiter never asks which class it is; the kinds,
their reclaim order and their classes are one registry (config/tenant_kinds.py).

Its lock is never held across a slow call: reads before it (a tenant whose holdings came late is unknown for
that round, not empty), decisions under it, tenant calls on threads of their own (fillin/tenant_calls.py).

It restarts (max_restarts=-1) and rebuilds from its state file on the head node; leases are adopted again.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from spotfill.fillin.arbiter_state import load, read_dashboard_url, state_text, write_atomically
from spotfill.fillin.busy import check_busy
from spotfill.fillin.cluster_view import READ_WAIT_S, HoldingsReads, View, read_demand, read_nodes
from spotfill.fillin.hosts import RESOURCE_VIEW_LAG_S, HostTracker
from spotfill.fillin.job_tenant import JobTenant, JobTenantSpec
from spotfill.fillin.journal import Journal, ReclaimOrder, lease_ended, lease_event, node_events, opening
from spotfill.fillin.lending import START_PATIENCE_S, TenantView, fair_share, lend_round, wait_to_record
from spotfill.fillin.let_go import LetGo
from spotfill.config.tenant_kinds import reclaim_order
from spotfill.fillin.policy import (Decision, DecisionLog, Lease, Snapshot, TrainingJob,
                                    claim_finished, decide_claim, extra_replicas, mark_reclaiming, ownership,
                                    pending_reclaims, reclaimable_by_node, rebuild_leases, reclaim_off_hosts,
                                    reconcile)
from spotfill.fillin.serve_tenant import ServeTenant, ServeTenantSpec
from spotfill.fillin.tenant import Tenant, tenant_class
from spotfill.fillin.tenant_calls import TenantCalls
from spotfill.fillin.turns import TURN_S, TurnClock, take_turns

from spotfill.fillin.arbiter_handle import (ARBITER_NAME, NAMESPACE, default_state_path, ensure_arbiter,  # noqa: F401
                                            get_arbiter)

log = logging.getLogger("spotfill.fillin.arbiter")
CLAIM_HOLD_S = 30.0        # freed GPUs stay reserved for the claiming job this long (its group takes them)
IDLE_RECLAIM_S = 10.0      # autoscaled cluster: leases on a node training left this long ago are reclaimed
RECORDS_EVERY_S = 2.0     # how often the training jobs announced in the GCS are read
FORCE_MARGIN_S = 1.0       # a job tenant still holding a reclaimed unit this long after its grace: forced
TENANT_EVENT_KINDS = ("fillin_start",)   # report_events journals these


class Arbiter:
    def __init__(self, gpu_resource: str = "GPU", order: tuple[str, ...] | None = None,
                 state_path: str | None = None, interval_s: float = 1.0, dashboard_url: str | None = None,
                 autoscaled: bool | None = None, launch_nodes: bool = False,
                 idle_reclaim_s: float = IDLE_RECLAIM_S, turn_s: float = TURN_S):
        logging.basicConfig(level=logging.INFO)
        self.gpu_resource, self.interval_s = gpu_resource, interval_s
        self.order = tuple(order) if order is not None else reclaim_order()     # the registry's, by default
        # Serve's scale endpoint and the job API live on the dashboard; found in the GCS when not given
        self.dashboard_url = dashboard_url or read_dashboard_url()
        self.forced: dict[str, float] = {}                    # job tenant -> when it was last forced
        # autoscaled cluster: lend only on nodes training uses, reclaim from nodes training left (so idle
        # nodes scale down), and never leave a replica pending (demand the autoscaler would buy a node
        # for) -- unless the user allowed fill-in to launch nodes (launch_nodes). None: found out here, on
        # the head (fillin/cluster_kind.py)
        if autoscaled is None:
            from spotfill.fillin.cluster_kind import detect
            autoscaled, self.cluster_kind = detect()
        else:
            self.cluster_kind = "autoscaled: set by the caller" if autoscaled else "fixed nodes: set by the caller"
        log.info("fill-in arbiter: the cluster is %s (%s)", "autoscaled" if autoscaled else "not autoscaled",
                 self.cluster_kind)
        self.autoscaled, self.launch_nodes = bool(autoscaled), bool(launch_nodes)
        self.records_read_at = 0.0                            # training records in the GCS, last read
        self.coming: set[str] = set()                         # nodes training waits to grow onto (read then)
        self.idle_reclaim_s = float(idle_reclaim_s)
        self.turn_s, self.turns = float(turn_s), TurnClock()  # fewer units than tenants: turns (fillin/turns.py)
        self.hosts = HostTracker(self.idle_reclaim_s)         # autoscaled: the nodes fill-in may lend on
        self.training_gpus = 0                                # GPUs in use that no lease holds (last round)
        self.state_path = state_path or default_state_path()
        self.lock = threading.RLock()
        self._stop = threading.Event()
        self.calls = TenantCalls(self.lock, self._stop)       # slow tenant calls, off the lock
        self.reads = HoldingsReads()                          # tenants' holdings, read off the lock
        self.view_seq = self.applied_seq = 0                  # views are applied in the order they began
        self.last_nodes: tuple = ()
        self.jobs: dict[str, TrainingJob] = {}
        # job -> (GPUs of its new group, hold until): free and reclaimed GPUs stay reserved for the claiming
        # job until its new group holds them all (or the hold ends) -- a start, restart or grow places the
        # whole group, so the hold is the group's size, not just what the claim had to free
        # job -> (GPUs held for its new group, until when, the nodes a pinned claim holds them on first)
        self.pending: dict[str, tuple[int, float, tuple[str, ...]]] = {}
        self.tenants: dict[str, Tenant] = {}
        self.asked_at: dict[str, float] = {}                  # tenant -> when it was last asked to grow
        self.waits: dict[str, str | None] = {}                # tenant -> why nothing was lendable, as recorded
        self.reasserted: dict[str, float] = {}                # serve tenant -> when its count was last re-sent
        self.lent_at: dict[str, list[float]] = {}             # tenant -> when each unit not yet taken was lent
        self.leases: tuple[Lease, ...] = ()
        self.reclaiming: dict[str, float] = {}                # lease id -> since
        self.decisions = DecisionLog()
        self.handbacks: list[dict] = []
        self.claims_in_flight = 0
        self.journal = Journal()                              # lease / reclaim / node / busy events for runs
        self.nodes_seen: dict[str, dict] = {}                 # GPU node id -> {"gpus", "since"}
        self.orders: list[ReclaimOrder] = []                  # reclaims asked for, their lease not ended yet
        self.let_go = LetGo()                                 # holders whose GPU is free while still listed
        self.started = time.time()
        self._saved: str | None = None                        # the state file's text as last written
        self.restored = load(self, self._keep, self._record)     # the state a previous arbiter wrote
        threading.Thread(target=self._loop, name="arbiter-tick", daemon=True).start()

    # -- persistence -----------------------------------------------------------------------------------
    def _keep(self, tenant) -> Tenant:
        return tenant.kept(self.calls)        # a Serve tenant as a Scaled: its scale calls go out off the lock

    def _save(self) -> None:
        text = state_text(self)
        if text != self._saved:                # most rounds change nothing: no file write (the head's CPU)
            write_atomically(self.state_path, text)
            self._saved = text

    def _record(self, decisions) -> None:
        for d in decisions:
            log.info("fill-in %s %s: %d GPU(s)%s -- %s", d.action, d.tenant, d.gpus,
                     f" on {d.node_id[:12]}" if d.node_id else "", d.reason)
        self.decisions.add(decisions)

    # -- registration ----------------------------------------------------------------------------------
    def register_tenant(self, spec: dict) -> dict:
        """A Serve deployment (app, deployment) deployed with external_scaler_enabled becomes a tenant; its
        replica count is set through the scale endpoint of the dashboard at `dashboard_url` (this cluster's,
        read from the GCS, when the spec leaves it empty)."""
        spec = dict(spec)
        if not spec.get("dashboard_url"):
            self.dashboard_url = self.dashboard_url or read_dashboard_url()
            if not self.dashboard_url:
                raise RuntimeError("no dashboard address: Serve's scale endpoint cannot be reached (start "
                                   "the head with the dashboard, or give dashboard_url)")
            spec["dashboard_url"] = self.dashboard_url
        tenant = self._register(ServeTenant(ServeTenantSpec(**spec)))
        return {"tenant": tenant.tenant, "scale_url": tenant.scale_url, "target": tenant.target}

    def register_kind(self, kind: str, spec: dict) -> dict:
        """A tenant of any kind in the registry (config/tenant_kinds.py), built by its class from `spec`."""
        tenant = self._register(tenant_class(kind).from_spec({**spec, "kind": kind}))
        return {"tenant": tenant.tenant, "target": tenant.target}

    def _register(self, built) -> Tenant:
        """Keep `built` under its name, carrying over what a tenant registered before under it was set; then a
        tick adopts what it already holds and lends what is spare."""
        with self.lock:
            tenant = self._keep(built)
            tenant.adopt_from(self.tenants.get(tenant.tenant))
            self.tenants[tenant.tenant] = tenant
        self.tick()
        return tenant

    def register_job_tenant(self, spec: dict) -> dict:
        """A batch or sweep driver (fillin/grant.py) asks for lent GPUs; it reads its target with
        `tenant_target` and yields to it within `grace_s`."""
        tenant = self._register(JobTenant(JobTenantSpec(**{"gpu_resource": self.gpu_resource, **spec})))
        return {"tenant": tenant.tenant, "target": tenant.target or 0}

    def tenant_target(self, tenant: str) -> dict:
        """What a job tenant may hold now ({"target": units, "known": bool}); a read, it changes nothing. An
        unknown tenant (the arbiter lost its state, or the tenant was unregistered) gets target 0 and known
        False: it must register again."""
        with self.lock:
            t = self.tenants.get(tenant)
            known = t is not None and t.pulls_target
            return {"target": (t.target or 0) if known else 0, "known": known}

    def set_demand(self, tenant: str, demand: int) -> bool:
        """How many units job tenant `tenant` could use now (fewer as its work runs out): a target above it
        comes down to it, not below what the tenant still holds. False: the tenant is unknown."""
        with self.lock:
            t = self.tenants.get(tenant)
            return t is not None and t.set_demand(demand, sum(1 for le in self.leases if le.tenant == tenant))

    def unregister_tenant(self, tenant: str) -> None:
        """The tenant is done: its leases end as it lets go of them (release events)."""
        with self.lock:
            if self.tenants.pop(tenant, None) is not None:
                self._record([Decision("drop", tenant, 0, at=time.time(), reason="tenant unregistered")])
                self._save()

    def register_job(self, job: str, min_workers: int, max_workers: int, gpus_per_worker: int = 1,
                     current_workers: int = 0, restarting: bool = False) -> None:
        with self.lock:
            self.jobs[job] = TrainingJob(job, int(min_workers), int(max_workers), int(current_workers),
                                         int(gpus_per_worker), bool(restarting))
            self._save()

    def release_job(self, job: str) -> None:
        with self.lock:
            self.jobs.pop(job, None)
            self.pending.pop(job, None)
            self._save()

    def report_busy(self, events: list) -> int:
        """A tenant's own measurement of its compute (fillin/busy.py): well-formed `fillin_busy` events are
        journaled, and so reach every training run's events.jsonl. Returns how many were kept."""
        good = check_busy(events, time.time())
        with self.lock:
            self.journal.add(good)
            for ev in (e for e in good if e.get("lease_id")):
                self.turns.busy(ev["lease_id"], ev["t0"])
        return len(good)

    def report_events(self, events: list) -> int:
        """A tenant's other events (TENANT_EVENT_KINDS), journaled like busy time; returns how many were kept."""
        good = [e for e in events if isinstance(e, dict) and e.get("kind") in TENANT_EVENT_KINDS and "t" in e]
        with self.lock:
            self.journal.add(good)
        return len(good)

    # -- reading (no lock held) ------------------------------------------------------------------------
    def _nodes(self):
        return read_nodes(self.gpu_resource)

    def _read(self, now: float, demand: bool = False) -> View:
        """Nodes and holdings as Ray shows them now (and the autoscaler's demand, when `demand` and a unit
        of some tenant is still starting on a cluster that must not launch nodes for fill-in)."""
        with self.lock:
            self.view_seq += 1
            seq, tenants = self.view_seq, dict(self.tenants)
            demand = demand and self.autoscaled and not self.launch_nodes and any(
                t.target is not None and t.target > sum(1 for le in self.leases if le.tenant == name)
                for name, t in tenants.items())
        holdings, unknown, errors = self.reads.read(tenants, READ_WAIT_S)
        nodes = tuple(self._nodes())           # after the holdings: a replica gone with its node is "lost"
        return View(seq, nodes, tuple(holdings), frozenset(tenants), frozenset(unknown), errors,
                    read_demand() if demand else None)

    def _snapshot(self, now: float) -> Snapshot:
        view = self._read(now)
        with self.lock:
            return self._apply(view, now)

    # -- applying what was read (lock held) ----------------------------------------------------------------
    def _apply(self, view: View, now: float) -> Snapshot:
        if view.seq < self.applied_seq:        # a newer view was applied meanwhile: this one is stale
            return self._current()
        self.applied_seq = view.seq
        nodes = list(view.nodes)
        self.last_nodes = view.nodes
        alive = {n.node_id for n in nodes if n.alive}
        unknown = set(view.unknown) | (set(self.tenants) - set(view.tenants))   # registered since the read
        for name, why in view.errors.items():
            log.warning("fill-in: what %s holds was not read this round (%s): its leases stay as they were",
                        name, why)
        before = {le.lease_id: le for le in self.leases}
        events, self.nodes_seen = node_events(self.nodes_seen, nodes, now)
        lost = reconcile(Snapshot(tuple(nodes), (), tuple(le for le in self.leases if le.node_id not in alive)),
                         now)
        self._record(lost)
        known = tuple(le for le in self.leases if le.node_id in alive)
        gone = self.let_go.listed([h.key for h in view.holdings], now, unknown)
        holdings = [h for h in view.holdings if h.node_id in alive and h.key not in gone]
        holdings = self._lent_holdings(holdings, known, now)
        leases, changes = rebuild_leases(holdings, known, now, unknown)
        leases = mark_reclaiming(leases, {n: t.target for n, t in self.tenants.items()}, self.reclaiming, now)
        leases, freed = self.let_go.settle(nodes, leases, now)
        changes += freed
        self._record(changes)
        ended, self.orders = lease_ended(list(lost) + list(changes), before, self.orders, now)
        events += ended
        events += [lease_event(le, now) for le in leases if le.lease_id not in before]
        self.journal.add(events)
        self.leases = leases
        self.reclaiming = {le.lease_id: le.reclaiming_since for le in self.leases if le.reclaiming_since}
        for job, (_, until, _) in list(self.pending.items()):
            if now > until:
                del self.pending[job]
        self.training_gpus = sum(row["training"] for row in ownership(Snapshot(
            tuple(n for n in nodes if n.alive), (), self.leases)).values())
        current = {le.lease_id for le in self.leases}
        self.turns.ended(set(before) - current)
        if self.autoscaled and not self.launch_nodes:        # the hosts fill-in may lend on (fillin/hosts.py)
            between = self.training_gpus == 0 or any(self._still_pending(j) for j in self.jobs)
            self.hosts.update(self._current(hosts=False), [le.node_id for le in before.values()
                                                            if le.lease_id not in current],
                              jobs=bool(self.jobs), between=between, now=now, coming=self.coming)
        return self._current()

    def _current(self, hosts: bool = True) -> Snapshot:
        """The snapshot of what was last applied (a read: it changes nothing); on an autoscaled cluster that
        must not launch nodes, with the hosts found when it was applied (unless `hosts` is False)."""
        jobs = tuple(replace(j, pending_gpus=self._still_pending(j.job),
                             pending_nodes=self.pending.get(j.job, (0, 0, ()))[2]) for j in self.jobs.values())
        snap = Snapshot(self.last_nodes, jobs, self.leases)
        return replace(snap, hosts=self.hosts.last_hosts) if hosts and self.autoscaled and not self.launch_nodes \
            else snap

    def _lent_holdings(self, holdings: list, known: tuple[Lease, ...], now: float) -> list:
        """A holding with no lease yet took the oldest unit lent to its tenant (Serve places a replica on a
        node of its choosing): its lease keeps that lend's time beside its own start (policy.rebuild_leases:
        the lease starts when the holder holds the GPU, not at the lend). Lends nobody took within
        START_PATIENCE_S are forgotten (the arbiter stops asking for them then)."""
        ids = {le.lease_id for le in known}
        out = []
        for h in holdings:
            lent = self.lent_at.get(h.tenant, [])
            while lent and now - lent[0] > START_PATIENCE_S:
                lent.pop(0)
            out.append(replace(h, lent_at=lent.pop(0)) if lent and h.key not in ids else h)
        return out

    def _still_pending(self, job: str) -> int:
        """GPUs held for `job`'s new group that it does not hold yet: the group's size minus the GPUs in use
        that no lease holds, less what the other registered jobs run (with one job: all of training's)."""
        held = self.pending.get(job, (0, 0.0, ()))[0]
        others = sum(j.running * j.gpus_per_worker for j in self.jobs.values() if j.job != job)
        return max(0, held - max(0, self.training_gpus - others))

    # -- the loop ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001
                log.exception("fill-in arbiter tick failed; next tick in %.1fs", self.interval_s)

    def _read_training_records(self, now: float) -> None:
        """Training jobs announced in the GCS (fillin/wiring.py: TrainingJob.fit announces itself whether or
        not an arbiter runs): register those not known yet; drop those whose driver has ended (its job's
        record was not withdrawn: the driver was killed), so their GPUs are lent again."""
        if now - self.records_read_at < RECORDS_EVERY_S:
            return
        self.records_read_at = now
        from spotfill import ray_compat
        from spotfill.fillin.wiring import TRAINING_KEY, announced_coming, announced_training
        try:
            records, dead = announced_training(), ray_compat.dead_job_ids()
            coming = announced_coming(now)
        except Exception as exc:  # noqa: BLE001 - next time
            log.warning("fill-in: training records not read from the GCS: %s", exc)
            return
        self.coming = coming                       # one reference swapped: the tick reads it whole
        for rec in records:
            name = rec.get("job")
            if not name:
                continue
            if rec.get("ray_job_id") in dead:
                ray_compat.kv_del(TRAINING_KEY + name)
                with self.lock:
                    if self.jobs.pop(name, None) is not None:
                        self.pending.pop(name, None)
                        self._record([Decision("drop", f"training:{name}", 0, at=now, reason=(
                            f"training job {name}'s driver (Ray job {rec.get('ray_job_id')}) has ended without "
                            f"withdrawing it: its GPUs may be lent again"))])
            elif name not in self.jobs:
                self.register_job(name, rec["min_workers"], rec["max_workers"], rec.get("gpus_per_worker", 1))
                with self.lock:
                    self._record([Decision("adopt", f"training:{name}", 0, at=now, reason=(
                        f"training job {name} ({rec['min_workers']}..{rec['max_workers']} workers) announced in "
                        f"the GCS: GPUs it may grow into are not lent"))])

    def tick(self) -> dict:
        self._read_training_records(time.time())
        view = self._read(time.time(), demand=True)
        with self.lock:
            now = time.time()
            snap = self._apply(view, now)
            drains = [d for d in reconcile(snap, now) if d.action == "reclaim"]
            self._apply_reclaims(drains, now, cause="node_draining")
            self._apply_reclaims(reclaim_off_hosts(snap, now, self.idle_reclaim_s), now, cause="node_idle")
            self._force_overdue(snap, now)
            # a replica the arbiter did not lend (Serve's cold start) goes at once: it would hold a GPU a
            # claimed group being placed waits for, or keep an idle node from scaling down
            self._stop_extra_replicas(now, cause="training_claim" if self.pending else "not_lent")
            if not self.claims_in_flight:
                self._lend(snap, now, view.demand)
            self._save()
            return {"leases": len(self.leases), "jobs": len(self.jobs)}

    def _views(self, demand=None) -> list[TenantView]:
        out = []
        for t in self.tenants.values():
            spec = t.spec
            out.append(TenantView(t.tenant, spec.kind, spec.gpus_per_replica,
                                  float(getattr(spec, "cpus_per_replica", 0.0)), spec.grace_s, t.target,
                                  t.wanted_units, scaled=not t.pulls_target, asked_at=self.asked_at.get(t.tenant),
                                  demand=bool(demand and demand.covers(t.shape(self.gpu_resource), t.pending_groups)),
                                  **self.turns.times(t.tenant)))
        return out

    def _lend(self, snap: Snapshot, now: float, demand=None) -> None:
        """Grow every tenant from one pool (lending.lend_round), then move one unit toward a fair share
        where one tenant holds more than its share and another wants more (lending.fair_share), or -- fewer
        units than tenants -- hand a unit held a turn to a tenant that waited a turn (lending.take_turns)."""
        guard = self.autoscaled and not self.launch_nodes
        self.turns.observe({name: t.wanted_units for name, t in self.tenants.items()}, snap, now)
        for g in lend_round(self._views(demand), snap, now, guard=guard,
                            launch_nodes=self.autoscaled and self.launch_nodes):
            tenant = self.tenants[g.tenant]
            if g.refusal is not None:
                self._record([g.refusal])
            if g.target is not None:
                tenant.set_target(g.target, takeover=g.takeover, again=g.reassert)
            if g.lends:
                self._record(list(g.lends))
                self.lent_at.setdefault(g.tenant, []).extend(
                    now for d in g.lends for _ in range(max(1, d.gpus // tenant.spec.gpus_per_replica)))
            if g.lends or g.reassert:
                self.asked_at[g.tenant] = now
            self._record(wait_to_record(g, self.waits))      # a tenant kept waiting, once per kind of reason
        fair = (fair_share(self._views(), snap, now, self.order, busy_since=self.turns.busy_since)
                or take_turns(self._views(), snap, now, self.turn_s, self.turns.busy_since))
        if fair is not None:
            self._apply_reclaims([fair], now, cause="fair_share")

    def _force_overdue(self, snap: Snapshot, now: float) -> None:
        """A job tenant still holding a reclaimed unit past its grace is stopped (once per grace), off the
        lock (TenantCalls); the decision is recorded when the stop has been made."""
        for name, tenant in self.tenants.items():
            if not tenant.forced_when_overdue:
                continue
            late = [le for le in snap.leases if le.tenant == name and le.reclaiming_since is not None
                    and now > le.reclaiming_since + le.grace_s + FORCE_MARGIN_S]
            if not late or now - self.forced.get(name, 0.0) < tenant.spec.grace_s + FORCE_MARGIN_S:
                continue
            self.forced[name] = now
            first = late[0]

            def done(how: str, name=name, late=late, first=first, at=now) -> None:
                self._record([Decision("reclaim", name, sum(le.gpus for le in late), at=at, node_id=first.node_id,
                                       lease_id=first.lease_id, reason=f"forced: {len(late)} unit(s) still held "
                                       f"{at - first.reclaiming_since:.1f}s after the reclaim (grace "
                                       f"{first.grace_s:g}s); {how}")])
            self.calls.force(tenant, self.dashboard_url, done)

    def _apply_reclaims(self, reclaims, now: float, cause: str = "training_claim", job: str | None = None,
                        requested_at: float | None = None) -> None:
        for d in reclaims:
            tenant = self.tenants.get(d.tenant)
            if tenant is None or d.lease_id in self.reclaiming:
                continue
            self.reclaiming[d.lease_id] = now
            self.leases = tuple(replace(le, reclaiming_since=now) if le.lease_id == d.lease_id else le
                                for le in self.leases)
            current = tenant.target if tenant.target is not None else len(
                [le for le in self.leases if le.tenant == d.tenant])
            if tenant.set_target(current - max(1, d.gpus // tenant.spec.gpus_per_replica)):
                self._record([d])
                # the lease of this tenant that ends next is this reclaim (journal.lease_ended)
                self.orders.append(ReclaimOrder(d.tenant, d.lease_id, requested_at or now, cause, d.reason, job))

    def _stop_extra_replicas(self, now: float, job: str | None = None, requested_at: float | None = None,
                             cause: str = "training_claim") -> None:
        """A Serve tenant running more replicas than the arbiter set -- beyond those it was asked to stop
        and has not yet -- is asked for the arbiter's count again at once (at most once a second). Serve
        adds a replica of its own when its cold-start rule sees requests queued while none runs (requests
        the Ingress forwarded as the last replica stopped): such a replica would hold a GPU training waits
        for, or keep a node fill-in gave back from going idle. Each extra one is a reclaim with `cause`
        (during a training claim its end is journaled as a hand-back from `requested_at`)."""
        for name, tenant in self.tenants.items():
            if tenant.pulls_target or tenant.target is None:     # a driver that pulls starts no unit itself
                continue
            held = [le for le in self.leases if le.tenant == name]
            stopping = sum(1 for o in self.orders if o.tenant == name)
            newest = extra_replicas(held, name, tenant.target, stopping)
            if not newest or now - self.reasserted.get(name, 0.0) < 1.0:
                continue
            self.reasserted[name] = now
            if not tenant.set_target(tenant.target, again=True):
                continue
            self._record([Decision("reclaim", name, le.gpus, at=now, node_id=le.node_id, lease_id=le.lease_id,
                                   deadline=now + le.grace_s, reason=(
                                       f"Serve runs {len(held)} replica(s), {stopping} stopping, more than the "
                                       f"{tenant.target} the arbiter set (its cold-start rule added one): asked "
                                       f"for {tenant.target} again" + (f" for {job}'s claim" if job else "")))
                          for le in newest])
            self.orders += [ReclaimOrder(name, le.lease_id, requested_at or now, cause,
                                         "an extra replica Serve started by itself", job) for le in newest]

    # -- training's claim ---------------------------------------------------------------------------------
    def claim(self, job: str, gpus: int, deadline_s: float = 10.0, gpus_per_worker: int = 1,
              min_workers: int | None = None, max_workers: int | None = None,
              nodes: list[str] | None = None) -> dict:
        """Make `gpus` GPUs available to `job`'s next worker group: reclaim leases as needed and answer
        when enough are free (or at `deadline_s` with what could be freed). `nodes`: the group is placed on
        these nodes only (where its warm spares are): GPUs are counted and leases reclaimed there. It reads
        Ray's state without the lock and never waits on a tenant's call (those go out on TenantCalls'
        threads)."""
        t0, started = time.monotonic(), time.time()
        gpw = max(1, int(gpus_per_worker))
        with self.lock:
            self.claims_in_flight += 1
        try:
            view = self._read(started)
            with self.lock:
                prev = self.jobs.get(job)
                snap = self._apply(view, started)
                own = min(sum(row["training"] for node, row in ownership(snap).items()
                              if nodes is None or node in nodes),
                          prev.running * prev.gpus_per_worker if prev else 0)
                wanted = max(0, int(gpus) - own)
            reclaimed: list[tuple[str, int]] = []     # (lease id, GPUs)
            settled = None             # when nothing reclaimed was left: Ray's resource view may lag the stop
            ended: dict[str, float] = {}   # lease reclaimed here -> when it ended
            while True:
                view = self._read(time.time())
                with self.lock:
                    now = time.time()
                    plan = decide_claim(self._apply(view, now), job, wanted, gpw, now, self.order, nodes)
                    live = {le.lease_id for le in self.leases}
                    ended.update({lid: now for lid, _ in reclaimed if lid not in live and lid not in ended})
                    # a lease reclaimed here just ended: no other is stopped until Ray's view had time to show its GPU
                    settling = any(now - t < RESOURCE_VIEW_LAG_S for t in ended.values()) and plan.free_now < wanted
                    new = [] if settling else [d for d in plan.reclaims if d.lease_id not in self.reclaiming]
                    self._apply_reclaims(new, now, job=job, requested_at=started)
                    self._stop_extra_replicas(now, job=job, requested_at=started)
                    reclaimed += [(d.lease_id, d.gpus) for d in new]
                    pending = settling or any(le.reclaiming_since for le in self.leases)
                done, settled = claim_finished(plan, time.monotonic() - t0, deadline_s, pending, bool(reclaimed),
                                               settled, RESOURCE_VIEW_LAG_S)
                if done:
                    break
                time.sleep(0.1)
            return self._answer(job, gpus, wanted, plan, reclaimed, gpw, min_workers, max_workers, prev, t0,
                                nodes)
        finally:
            with self.lock:
                self.claims_in_flight -= 1

    def _answer(self, job, gpus, wanted, plan, reclaimed, gpw, min_workers, max_workers, prev, t0,
                nodes=None) -> dict:
        waited = time.monotonic() - t0
        now = time.time()
        ok = plan.free_now >= wanted
        with self.lock:
            self.jobs[job] = TrainingJob(
                job, int(min_workers or (prev.min_workers if prev else 1)),
                int(max_workers or (prev.max_workers if prev else max(1, gpus // gpw))),
                current_workers=max(1, int(gpus) // gpw), gpus_per_worker=gpw)
            held, until, _ = self.pending.get(job, (0, 0.0, ()))
            # the whole new group stays held until it holds its GPUs: a claim that came back short (Ray's
            # resource view lags a stopped replica) must not see the reclaimed GPUs lent again, nor a grow
            # see the old group's GPUs lent while the group restarts larger. A later claim of the same start
            # (Ray Train may ask again) never shrinks what is held for it.
            self.pending[job] = (max(int(gpus), held if until > now else 0), now + CLAIM_HOLD_S,
                                 tuple(sorted(nodes or ())))
            why = (f"{plan.free_now} of {wanted} needed GPU(s) free after {waited:.2f}s"
                   + (f", {len(reclaimed)} lease(s) reclaimed" if reclaimed else "")
                   + ("" if ok else f"; short by {wanted - plan.free_now} (deadline or nothing left to reclaim)"))
            self._record([Decision("grant" if ok else "refuse", job, min(wanted, plan.free_now), at=now,
                                   reason=why)])
            if reclaimed:
                self.handbacks.append({"job": job, "seconds": round(waited, 3), "leases": len(reclaimed),
                                       "gpus": wanted, "ok": ok, "at": now})
            self._save()
        return {"ok": ok, "job": job, "gpus": int(gpus), "needed": wanted, "free": plan.free_now,
                "reclaimed": [lease_id for lease_id, _ in reclaimed], "waited_s": round(waited, 3), "reason": why}

    # -- reading ----------------------------------------------------------------------------------------
    def status(self, last: int = 20) -> dict:
        now = time.time()
        view = self._read(now)
        with self.lock:
            snap = self._apply(view, now)
            return {
                "gpu_resource": self.gpu_resource, "order": list(self.order), "since": self.started,
                "autoscaled": self.autoscaled, "cluster_kind": self.cluster_kind,
                "restored": self.restored, "nodes": ownership(snap),
                "jobs": [j.__dict__ for j in snap.jobs],
                "tenants": [{"tenant": t.tenant, "target": t.target, **t.spec.as_dict()}
                            for t in self.tenants.values()],
                "leases": [le.__dict__ for le in snap.leases],
                "pending_reclaims": pending_reclaims(snap.leases),
                "decisions": [d.as_dict() for d in self.decisions.items[-last:]],
                "handbacks": self.handbacks[-last:],
            }

    def journal_since(self, after: int | None = None) -> dict:
        """Fill-in events after journal number `after` ({"events", "seq"}): lease / reclaim / release /
        lease_end and node_up / node_down (fillin/journal.py). A new reader (after=None), or one the journal
        cannot serve (it fell behind, or the arbiter started over), gets the nodes alive and the leases
        open instead."""
        with self.lock:
            events, seq = self.journal.read(after)
            if events is None:
                events = opening(self.nodes_seen, self.leases)
            return {"events": events, "seq": seq}

    def reclaimable(self) -> dict:
        """GPUs (and their units' CPUs) per node that training gets back by claiming them (policy.reclaimable_by_node),
        from a fresh snapshot: a unit taken since the last tick is neither free in Ray's view nor a lease yet,
        and a restart sized in that moment came out a worker short (seen in a demo: 2 instead of 3)."""
        snap = self._snapshot(time.time())
        with self.lock:
            specs = {name: getattr(t, "spec", None) for name, t in self.tenants.items()}
            units = {name: (float(getattr(s, "cpus_per_replica", 0.0) or 0.0), s.gpus_per_replica)
                     for name, s in specs.items() if s is not None}
        return reclaimable_by_node(snap, units, self.gpu_resource)

    def ping(self) -> str:
        return "ok"
