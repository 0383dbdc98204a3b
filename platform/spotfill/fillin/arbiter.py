"""The fill-in arbiter: one detached, named Ray actor on the head node (no CPUs, no GPUs reserved).

Thin around fillin/policy.py: every second it builds a snapshot from Ray's state (nodes and their GPU
totals, what is available per node, draining nodes, what each tenant holds), reconciles (a lease on a dead
node is gone; one on a draining node is reclaimed), and lends what training cannot use to its tenants.
Training claims GPUs through `claim(job, gpus, deadline_s)`: the arbiter reclaims leases in order and
answers when the GPUs are free, or at the deadline with what it could free. Every decision is logged with
its reason and kept for `spotfill status`.

The actor restarts (max_restarts=-1) and rebuilds: training registrations, tenants and recent decisions
from its state file on the head node, leases from what the tenants are seen holding (adopted).
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import replace

from spotfill.fillin.policy import (lendable, DEFAULT_ORDER, Decision, DecisionLog, Lease, Node, Snapshot, TrainingJob,
                                    decide_claim, decide_lend, extra_replicas, minus_free, ownership, rebuild_leases,
                                    reclaim_off_hosts, reconcile, training_hosts)
from spotfill.fillin.journal import Journal, ReclaimOrder, lease_ended, lease_event, node_events, opening
from spotfill.fillin.job_tenant import JobTenant, JobTenantSpec
from spotfill.fillin.arbiter_state import read_state, restore, state_text, write_atomically
from spotfill.fillin.let_go import LetGo
from spotfill.fillin.serve_tenant import ServeTenant, ServeTenantSpec

log = logging.getLogger("spotfill.fillin.arbiter")
ARBITER_NAME = "spotfill-arbiter"
NAMESPACE = "spotfill"
CLAIM_HOLD_S = 30.0        # freed GPUs stay reserved for the claiming job this long (its group takes them)
START_PATIENCE_S = 30.0    # a replica asked for but not running after this long: stop asking for it
PLACE_PATIENCE_S = 10.0    # autoscaled cluster, launch_nodes off: a replica not placed after this long is
                           # taken back; at once when the autoscaler reports it as demand (it would launch a
                           # node for it) -- a replica whose worker process is still starting is not demand
IDLE_RECLAIM_S = 10.0      # autoscaled cluster: leases on a node training left this long ago are reclaimed
RESTART_GRACE_S = 120.0    # ... not while a registered job restarts (no training anywhere) for up to this
RESOURCE_VIEW_LAG_S = 8.0  # a stopped replica's GPU shows as available within this (GCS resource view; on
                           # a loaded 2-core machine 3 s was measured too short: the claim came back short)
RECORDS_EVERY_S = 2.0     # how often the training jobs announced in the GCS are read
RAYLET_PROBE_S = 0.5       # a live raylet answers a loopback/local-network connect in milliseconds
FORCE_MARGIN_S = 1.0       # a job tenant still holding a reclaimed unit this long after its grace: forced


class Arbiter:
    def __init__(self, gpu_resource: str = "GPU", order: tuple[str, ...] = DEFAULT_ORDER,
                 state_path: str | None = None, interval_s: float = 1.0, dashboard_url: str | None = None,
                 autoscaled: bool | None = None, launch_nodes: bool = False,
                 idle_reclaim_s: float = IDLE_RECLAIM_S):
        logging.basicConfig(level=logging.INFO)
        self.gpu_resource, self.order, self.interval_s = gpu_resource, tuple(order), interval_s
        # Serve's scale endpoint and the job API live on the dashboard; found in the GCS when not given
        self.dashboard_url = dashboard_url or self._dashboard_url()
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
        self.idle_reclaim_s = float(idle_reclaim_s)
        self.training_gpus = 0                                # GPUs in use that no lease holds (last tick)
        self.training_seen: dict[str, float] = {}             # node id -> last time training held GPUs on it
        self.training_anywhere = 0.0                          # last time training held GPUs on any node
        self.lease_ended_on: dict[str, float] = {}            # node id -> last time a lease on it ended
        self._last_hosts: frozenset[str] = frozenset()        # the nodes fill-in could lend on, last tick
        self.state_path = state_path or default_state_path()
        self.lock = threading.RLock()
        self.jobs: dict[str, TrainingJob] = {}
        # job -> (GPUs of its new group, hold until): free and reclaimed GPUs stay reserved for the claiming
        # job until its new group holds them all (or the hold ends) -- a start, restart or grow places the
        # whole group, so the hold is the group's size, not just what the claim had to free
        self.pending: dict[str, tuple[int, float]] = {}
        self.tenants: dict[str, ServeTenant | JobTenant] = {}
        self.asked_at: dict[str, float] = {}                  # tenant -> when it was last scaled up
        self.reasserted: dict[str, float] = {}                # serve tenant -> when its count was last re-sent
        self.promised: dict[str, list[tuple[str, int]]] = {}   # tenant -> (node, GPUs) lent, not yet taken
        self.lent_at: dict[str, list[float]] = {}               # tenant -> when each unit not yet taken was lent
        self.leases: tuple[Lease, ...] = ()
        self.reclaiming: dict[str, float] = {}                # lease id -> since
        self.decisions = DecisionLog()
        self.handbacks: list[dict] = []
        self.claims_in_flight = 0
        self.journal = Journal()                              # lease / reclaim / node events for the runs
        self.nodes_seen: dict[str, dict] = {}                 # GPU node id -> {"gpus", "since"}
        self.orders: list[ReclaimOrder] = []                  # reclaims asked for, their lease not ended yet
        self.let_go = LetGo()                                 # holders whose GPU is free while still listed
        self.started = time.time()
        self._saved: str | None = None                        # the state file's text as last written
        self.restored = self._load()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="arbiter-tick", daemon=True).start()

    # -- persistence -----------------------------------------------------------------------------------
    def _load(self) -> bool:
        state = read_state(self.state_path)
        if state is None:
            return False
        restore(self, state)
        self._record([Decision("adopt", "arbiter", 0, at=time.time(), reason=(
            f"arbiter restarted: {len(self.jobs)} training job(s), {len(self.tenants)} tenant(s) and "
            f"{len(self.leases)} lease record(s) read from {self.state_path}; leases re-checked against "
            f"what the tenants hold"))])
        return True

    def _save(self) -> None:
        text = state_text(self)
        if text != self._saved:                # most ticks change nothing: no file write (the head's CPU)
            write_atomically(self.state_path, text)
            self._saved = text

    def _record(self, decisions) -> None:
        for d in decisions:
            log.info("fill-in %s %s: %d GPU(s)%s -- %s", d.action, d.tenant, d.gpus,
                     f" on {d.node_id[:12]}" if d.node_id else "", d.reason)
        self.decisions.add(decisions)

    # -- registration ----------------------------------------------------------------------------------
    @staticmethod
    def _dashboard_url() -> str | None:
        try:
            from spotfill.ray_compat import dashboard_url
            return dashboard_url()
        except Exception as exc:  # noqa: BLE001 - a tenant registered with its own URL still works
            log.warning("fill-in: the dashboard's address could not be read from the GCS: %s", exc)
            return None

    def register_tenant(self, spec: dict) -> dict:
        """A Serve deployment (app, deployment) deployed with external_scaler_enabled becomes a tenant; its
        replica count is set through the scale endpoint of the dashboard at `dashboard_url` (this cluster's,
        read from the GCS, when the spec leaves it empty)."""
        with self.lock:
            spec = dict(spec)
            if not spec.get("dashboard_url"):
                self.dashboard_url = self.dashboard_url or self._dashboard_url()
                if not self.dashboard_url:
                    raise RuntimeError("no dashboard address: Serve's scale endpoint cannot be reached (start "
                                       "the head with the dashboard, or give dashboard_url)")
                spec["dashboard_url"] = self.dashboard_url
            tenant = ServeTenant(ServeTenantSpec(**spec))
            old = self.tenants.get(tenant.tenant)
            tenant.target = old.target if old else None
            self.tenants[tenant.tenant] = tenant
            self.tick()                         # adopt what it already holds, lend what is spare
            return {"tenant": tenant.tenant, "scale_url": tenant.scale_url, "target": tenant.target}

    def register_job_tenant(self, spec: dict) -> dict:
        """A batch or sweep driver (fillin/grant.py) asks for lent GPUs; it reads its target with
        `tenant_target` and yields to it within `grace_s`."""
        with self.lock:
            tenant = JobTenant(JobTenantSpec(**{"gpu_resource": self.gpu_resource, **spec}))
            old = self.tenants.get(tenant.tenant)
            tenant.target = old.target if isinstance(old, JobTenant) and old.spec.job_id == tenant.spec.job_id \
                else None
            self.tenants[tenant.tenant] = tenant
            self.tick()
            return {"tenant": tenant.tenant, "target": tenant.target or 0}

    def tenant_target(self, tenant: str, demand: int | None = None) -> dict:
        """What a job tenant may hold now ({"target": units, "known": bool}); `demand` updates how many
        units it could use (fewer as its work runs out). An unknown tenant (the arbiter lost its state,
        or the tenant was unregistered) gets target 0 and known False: it must register again."""
        with self.lock:
            t = self.tenants.get(tenant)
            if not isinstance(t, JobTenant):
                return {"target": 0, "known": False}
            if demand is not None and demand != t.spec.demand:
                t.spec = replace(t.spec, demand=max(0, int(demand)))
                if t.target is not None and t.target > t.wanted_units:
                    t.target = max(t.wanted_units, sum(1 for le in self.leases if le.tenant == tenant))
            return {"target": t.target or 0, "known": True}

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

    # -- snapshot --------------------------------------------------------------------------------------
    def _nodes(self) -> list[Node]:
        import ray

        from spotfill.ray_compat import available_resources_per_node, draining_node_ids
        from spotfill.train.capacity import reachable
        avail, draining = available_resources_per_node(), draining_node_ids()
        listed = [n for n in ray.nodes() if self.gpu_resource in (n.get("Resources") or {}) or not n.get("Alive")]
        # the GCS keeps a killed node "alive" for its health-check window; its raylet refuses a connect at
        # once: such a node lends nothing and gives training nothing (as train/elastic.py sizes restarts)
        answering = reachable({n["NodeID"]: (n["NodeManagerAddress"], n["NodeManagerPort"])
                               for n in listed if n.get("Alive")}, RAYLET_PROBE_S)
        nodes = []
        for n in listed:
            node_id, res = n["NodeID"], n.get("Resources") or {}
            free = int(avail.get(node_id, {}).get(self.gpu_resource, 0) + 1e-9)
            nodes.append(Node(node_id, int(res.get(self.gpu_resource, 0)), free,
                              bool(n.get("Alive")) and node_id in answering, node_id in draining))
        return nodes

    def _snapshot(self, now: float) -> Snapshot:
        holdings = [h for t in self.tenants.values() for h in self._holdings(t)]
        nodes = self._nodes()                  # after the holdings: a replica gone with its node is "lost"
        alive = {n.node_id for n in nodes if n.alive}
        before = {le.lease_id: le for le in self.leases}
        events, self.nodes_seen = node_events(self.nodes_seen, nodes, now)
        lost = reconcile(Snapshot(tuple(nodes), (), tuple(le for le in self.leases if le.node_id not in alive)),
                         now)
        self._record(lost)
        known = tuple(le for le in self.leases if le.node_id in alive)
        gone = self.let_go.listed([h.key for h in holdings], now)
        holdings = [h for h in holdings if h.node_id in alive and h.key not in gone]
        holdings = self._lent_holdings(holdings, known, now)
        leases, changes = rebuild_leases(holdings, known, now)
        leases, freed = self.let_go.settle(nodes, self._mark_reclaiming(leases), now)
        changes += freed
        self._record(changes)
        ended, self.orders = lease_ended(list(lost) + list(changes), before, self.orders, now)
        events += ended
        events += [lease_event(le, now) for le in leases if le.lease_id not in before]
        self.journal.add(events)
        self.leases = leases
        self.reclaiming = {le.lease_id: le.reclaiming_since for le in self.leases if le.reclaiming_since}
        for job, (_, until) in list(self.pending.items()):
            if now > until:
                del self.pending[job]
        self.training_gpus = sum(row["training"] for row in ownership(Snapshot(
            tuple(n for n in nodes if n.alive), (), self.leases)).values())
        jobs = tuple(replace(j, pending_gpus=self._still_pending(j.job)) for j in self.jobs.values())
        snap = Snapshot(tuple(nodes), jobs, self.leases)
        if self.autoscaled and not self.launch_nodes:
            snap = replace(snap, hosts=self._hosts(snap, before, now))
        return snap

    def _lent_holdings(self, holdings: list, known: tuple[Lease, ...], now: float) -> list:
        """A holding with no lease yet took the oldest unit lent to its tenant (Serve places a replica on a
        node of its choosing): its lease starts at that lend. Lends nobody took within START_PATIENCE_S are
        forgotten (the arbiter stops asking for them then)."""
        ids = {le.lease_id for le in known}
        out = []
        for h in holdings:
            lent = self.lent_at.get(h.tenant, [])
            while lent and now - lent[0] > START_PATIENCE_S:
                lent.pop(0)
            out.append(replace(h, since=lent.pop(0), lent=True) if lent and h.key not in ids else h)
        return out

    def _still_pending(self, job: str) -> int:
        """GPUs held for `job`'s new group that it does not hold yet: the group's size minus the GPUs in use
        that no lease holds, less what the other registered jobs run (with one job: all of training's)."""
        held, _ = self.pending.get(job, (0, 0.0))
        others = sum(j.running * j.gpus_per_worker for j in self.jobs.values() if j.job != job)
        return max(0, held - max(0, self.training_gpus - others))

    def _hosts(self, snap: Snapshot, before: dict, now: float) -> frozenset[str]:
        """Nodes training used within idle_reclaim_s (fill-in lends only there). GPUs in use that no lease
        holds are training's -- except just after a lease on the node ended: Ray's resource view still
        shows the stopped replica's GPU in use for a moment, which must not make the node look used."""
        current = {le.lease_id for le in snap.leases}
        for le in before.values():
            if le.lease_id not in current:
                self.lease_ended_on[le.node_id] = now
        alive = {n.node_id for n in snap.nodes if n.alive}
        if self.jobs:
            for node_id, row in ownership(snap).items():
                if row["training"] > 0 and now - self.lease_ended_on.get(node_id, 0.0) > RESOURCE_VIEW_LAG_S:
                    self.training_seen[node_id] = now
                    self.training_anywhere = now
            # a registered job whose group is down or being placed (a restart, a grow) has not left its
            # nodes: their leases wait for its claim (a hand-back), not for the idle rule -- for at most
            # RESTART_GRACE_S without training anywhere (a job that ended unreleased lets go then)
            between = self.training_gpus == 0 or any(self._still_pending(j) for j in self.jobs)
            if between and now - self.training_anywhere <= RESTART_GRACE_S:
                for node_id in self.training_seen:
                    if node_id in alive:
                        self.training_seen[node_id] = now
        self.training_seen = {k: v for k, v in self.training_seen.items() if k in alive}
        hosts = set(training_hosts(self.training_seen, now, self.idle_reclaim_s))
        # a host whose training count cannot be read yet (a lease there ended within the view's lag) stays a
        # host meanwhile, for at most the lag: the idle clock must not run out on a view known to lag. A
        # demo's node where training had just started, beside a sweep trial that had just ended, was
        # reclaimed "idle" 10 s after the last sighting before the restart. A node that was no host stays
        # none (no lend right after an idle reclaim), and leases that keep ending (Serve's cold start) keep
        # a node training left a host no longer than idle_reclaim_s + the lag.
        hosts |= {n for n in self._last_hosts
                  if n in alive and now - self.lease_ended_on.get(n, 0.0) <= RESOURCE_VIEW_LAG_S
                  and now - self.training_seen.get(n, -math.inf) <= self.idle_reclaim_s + RESOURCE_VIEW_LAG_S}
        self._last_hosts = frozenset(hosts)
        return self._last_hosts

    @staticmethod
    def _holdings(tenant: ServeTenant):
        try:
            return tenant.holdings()
        except Exception as exc:  # noqa: BLE001 - a state-API hiccup must not stop the arbiter
            log.warning("fill-in: cannot read what %s holds: %s", tenant.tenant, exc)
            return []

    def _mark_reclaiming(self, leases: tuple[Lease, ...]) -> tuple[Lease, ...]:
        """Serve stops replicas of its own choosing: per tenant, as many leases as it holds beyond its
        target are going away -- those the arbiter chose when still held, else the newest."""
        out = []
        for name, tenant in self.tenants.items():
            mine = [le for le in leases if le.tenant == name]
            going = max(0, len(mine) - tenant.target) if tenant.target is not None else 0
            mine.sort(key=lambda le: (le.lease_id not in self.reclaiming, -le.granted_at))
            for i, le in enumerate(mine):
                since = self.reclaiming.get(le.lease_id, time.time()) if i < going else None
                out.append(replace(le, reclaiming_since=since))
        return tuple(out) + tuple(le for le in leases if le.tenant not in self.tenants)

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
        from spotfill.fillin.wiring import TRAINING_KEY, announced_training
        try:
            records, dead = announced_training(), ray_compat.dead_job_ids()
        except Exception as exc:  # noqa: BLE001 - next time
            log.warning("fill-in: training records not read from the GCS: %s", exc)
            return
        for rec in records:
            name = rec.get("job")
            if not name:
                continue
            if rec.get("ray_job_id") in dead:
                ray_compat.kv_del(TRAINING_KEY + name)
                if self.jobs.pop(name, None) is not None:
                    self.pending.pop(name, None)
                    self._record([Decision("drop", f"training:{name}", 0, at=now, reason=(
                        f"training job {name}'s driver (Ray job {rec.get('ray_job_id')}) has ended without "
                        f"withdrawing it: its GPUs may be lent again"))])
            elif name not in self.jobs:
                self.register_job(name, rec["min_workers"], rec["max_workers"], rec.get("gpus_per_worker", 1))
                self._record([Decision("adopt", f"training:{name}", 0, at=now, reason=(
                    f"training job {name} ({rec['min_workers']}..{rec['max_workers']} workers) announced in "
                    f"the GCS: GPUs it may grow into are not lent"))])

    def tick(self) -> dict:
        with self.lock:
            now = time.time()
            self._read_training_records(now)
            snap = self._snapshot(now)
            drains = [d for d in reconcile(snap, now) if d.action == "reclaim"]
            self._apply_reclaims(drains, now, cause="node_draining")
            self._apply_reclaims(reclaim_off_hosts(snap, now, self.idle_reclaim_s), now, cause="node_idle")
            self._force_overdue(snap, now)
            # a replica the arbiter did not lend (Serve's cold start) goes at once: it would hold a GPU a
            # claimed group being placed waits for, or keep an idle node from scaling down
            self._stop_extra_replicas(now, cause="training_claim" if self.pending else "not_lent")
            if not self.claims_in_flight:
                self._grow_all(snap, now)
            self._save()
            return {"leases": len(self.leases), "jobs": len(self.jobs)}

    def _grow_all(self, snap: Snapshot, now: float) -> None:
        """Lend to every tenant from one pool: GPUs lent but not taken yet (a replica or actor starting) are
        not free to lend again, and tenants that hold least go first, each up to a fair share of what is
        lendable now (a lone tenant takes it all)."""
        held = {name: sum(1 for le in snap.leases if le.tenant == name) for name in self.tenants}
        for name in list(self.promised):
            t = self.tenants.get(name)
            if t is None or t.target is None or t.target <= held.get(name, 0):
                del self.promised[name]        # taken (or given up): Ray's view counts it now
        snap = minus_free(snap, [p for ps in self.promised.values() for p in ps])
        spare = sum(lendable(snap).values())
        hungry = [t for t in self.tenants.values()
                  if t.target is None or t.target < t.wanted_units and t.target <= held[t.tenant]]
        share = max(1, spare // max(1, len(hungry)))
        for tenant in sorted(self.tenants.values(), key=lambda t: (held[t.tenant], t.tenant)):
            lends = self._grow(tenant, snap, now, cap_gpus=share)
            if lends:
                self.promised.setdefault(tenant.tenant, []).extend((d.node_id, d.gpus) for d in lends if d.node_id)
                self.lent_at.setdefault(tenant.tenant, []).extend(
                    now for d in lends for _ in range(max(1, d.gpus // tenant.spec.gpus_per_replica)))
                snap = minus_free(snap, [(d.node_id, d.gpus) for d in lends if d.node_id])

    def _grow(self, tenant: ServeTenant, snap: Snapshot, now: float, cap_gpus: int | None = None) -> list:
        """Scale `tenant` toward what it wants from what is lendable; returns the lend decisions made."""
        spec = tenant.spec
        held = sum(1 for le in snap.leases if le.tenant == tenant.tenant)
        first = tenant.target is None          # just registered: take over the count Serve deployed with
        if first:
            tenant.target = held
        if tenant.target > held:               # replicas still starting: wait for them, not twice
            guard = self.autoscaled and not self.launch_nodes
            # a job tenant's actors come with its Data or Tune executor, which on a busy node takes longer
            # than PLACE_PATIENCE_S to start them (a batch job lent a GPU every 10 s here, and refused each
            # time before its actor was up); a request the autoscaler reports as demand is refused at once
            patience = PLACE_PATIENCE_S if guard and not isinstance(tenant, JobTenant) else START_PATIENCE_S
            demand = guard and self._replica_is_demand(spec)
            if not demand and now - self.asked_at.get(tenant.tenant, now) < patience:
                return []
            self._record([Decision("refuse", tenant.tenant, (tenant.target - held) * spec.gpus_per_replica,
                                   at=now, reason=(
                                       "a replica waits for a GPU: the autoscaler sees it as demand and would "
                                       "launch a node (launch_nodes is off)" if demand else
                                       f"replicas not placed within {patience:g}s")
                                   + f"; asking for {held} instead of {tenant.target}")])
            tenant.set_replicas(held)
            return []
        if held > tenant.target and isinstance(tenant, ServeTenant) and now - self.asked_at.get(
                tenant.tenant, 0.0) >= START_PATIENCE_S and not any(
                le.reclaiming_since and now - le.reclaiming_since < le.grace_s + 1.0 for le in snap.leases
                if le.tenant == tenant.tenant):
            # Serve runs more replicas than the arbiter set (its own autoscaling added one): ask again
            tenant.set_replicas(tenant.target)
            self.asked_at[tenant.tenant] = now
        wanted = (tenant.wanted_units - tenant.target) * spec.gpus_per_replica
        if cap_gpus is not None:
            wanted = min(wanted, max(spec.gpus_per_replica, cap_gpus))
        if wanted <= 0:
            if first and not tenant.set_replicas(held):
                tenant.target = None
            return []
        lends = [d for d in decide_lend(snap, tenant.tenant, spec.kind, wanted, now, grace_s=spec.grace_s)
                 if d.action == "lend"]
        if not lends and self.autoscaled and self.launch_nodes and \
                now - self.asked_at.get(tenant.tenant, 0.0) >= START_PATIENCE_S:
            # the user allowed fill-in to grow the cluster: one more replica, pending until the autoscaler
            # launches a node for it (training still reclaims it first)
            lends = [Decision("lend", tenant.tenant, spec.gpus_per_replica, at=now, reason=(
                "launch_nodes: nothing lendable on the nodes up; a pending replica asks the autoscaler "
                "for a node"))]
        replicas = sum(d.gpus for d in lends) // spec.gpus_per_replica
        if replicas and tenant.set_replicas(tenant.target + replicas):
            self.asked_at[tenant.tenant] = now
            self._record(lends)
            return lends
        elif first and not tenant.set_replicas(held):
            tenant.target = None               # Serve not reachable yet: take over on a later tick
        return []

    def _replica_is_demand(self, spec) -> bool:
        """Does the autoscaler see a replica-shaped request ({gpu_resource: N}, no CPU) waiting for
        resources? (Training asks in CPU+GPU bundles; Serve's Generator replica asks for the GPU alone.)"""
        import ray
        from ray.autoscaler.v2.sdk import get_cluster_status
        try:
            status = get_cluster_status(ray.get_runtime_context().gcs_address)
        except Exception as exc:  # noqa: BLE001 - no answer: the patience rule still applies
            log.warning("fill-in: cannot read the autoscaler's demand: %s", exc)
            return False
        shape = {self.gpu_resource: float(spec.gpus_per_replica)}
        return any(dict(b.bundle) == shape for d in status.resource_demands.ray_task_actor_demand
                   for b in d.bundles_by_count)

    def _force_overdue(self, snap: Snapshot, now: float) -> None:
        """A job tenant still holding a reclaimed unit past its grace is stopped (once per grace)."""
        for name, tenant in self.tenants.items():
            if not isinstance(tenant, JobTenant):
                continue
            late = [le for le in snap.leases if le.tenant == name and le.reclaiming_since is not None
                    and now > le.reclaiming_since + le.grace_s + FORCE_MARGIN_S]
            if not late or now - self.forced.get(name, 0.0) < tenant.spec.grace_s + FORCE_MARGIN_S:
                continue
            self.forced[name] = now
            try:
                how = tenant.force_release(self.dashboard_url)
            except Exception as exc:  # noqa: BLE001 - the next tick tries again
                how = f"could not stop it: {type(exc).__name__}: {exc}"
            self._record([Decision("reclaim", name, sum(le.gpus for le in late), at=now, node_id=late[0].node_id,
                                   lease_id=late[0].lease_id, reason=f"forced: {len(late)} unit(s) still held "
                                   f"{now - late[0].reclaiming_since:.1f}s after the reclaim (grace "
                                   f"{late[0].grace_s:g}s); {how}")])

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
            if tenant.set_replicas(current - max(1, d.gpus // tenant.spec.gpus_per_replica)):
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
            if not isinstance(tenant, ServeTenant) or tenant.target is None:
                continue
            held = [le for le in self.leases if le.tenant == name]
            stopping = sum(1 for o in self.orders if o.tenant == name)
            newest = extra_replicas(held, name, tenant.target, stopping)
            if not newest or now - self.reasserted.get(name, 0.0) < 1.0:
                continue
            self.reasserted[name] = now
            if not tenant.set_replicas(tenant.target):
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
              min_workers: int | None = None, max_workers: int | None = None) -> dict:
        """Make `gpus` GPUs available to `job`'s next worker group: reclaim leases as needed and answer
        when enough are free (or at `deadline_s` with what could be freed)."""
        t0, started = time.monotonic(), time.time()
        gpw = max(1, int(gpus_per_worker))
        with self.lock:
            self.claims_in_flight += 1
            prev = self.jobs.get(job)
            snap = self._snapshot(started)
            own = min(sum(row["training"] for row in ownership(snap).values()),
                      prev.running * prev.gpus_per_worker if prev else 0)
            wanted = max(0, int(gpus) - own)
        reclaimed: list[tuple[str, int]] = []     # (lease id, GPUs)
        settled_at = None          # when no reclaimed lease was left: Ray's resource view may lag the stop
        try:
            while True:
                with self.lock:
                    now = time.time()
                    plan = decide_claim(self._snapshot(now), job, wanted, gpw, now, self.order)
                    new = [d for d in plan.reclaims if d.lease_id not in self.reclaiming]
                    self._apply_reclaims(new, now, job=job, requested_at=started)
                    self._stop_extra_replicas(now, job=job, requested_at=started)
                    reclaimed += [(d.lease_id, d.gpus) for d in new]
                    pending = any(le.reclaiming_since for le in self.leases)
                if plan.free_now >= wanted or time.monotonic() - t0 > deadline_s:
                    break
                if plan.short_by and not pending:
                    # nothing (left) to reclaim: answer now, or -- when leases were just stopped -- once
                    # the GPUs they held show as available (the replica is gone before its GPU is free)
                    settled_at = settled_at or time.monotonic()
                    if not reclaimed or time.monotonic() - settled_at > RESOURCE_VIEW_LAG_S:
                        break
                time.sleep(0.1)
            return self._answer(job, gpus, wanted, plan, reclaimed, gpw, min_workers, max_workers, prev, t0)
        finally:
            with self.lock:
                self.claims_in_flight -= 1

    def _answer(self, job, gpus, wanted, plan, reclaimed, gpw, min_workers, max_workers, prev, t0) -> dict:
        waited = time.monotonic() - t0
        now = time.time()
        ok = plan.free_now >= wanted
        with self.lock:
            self.jobs[job] = TrainingJob(
                job, int(min_workers or (prev.min_workers if prev else 1)),
                int(max_workers or (prev.max_workers if prev else max(1, gpus // gpw))),
                current_workers=max(1, int(gpus) // gpw), gpus_per_worker=gpw)
            held, until = self.pending.get(job, (0, 0.0))
            # the whole new group stays held until it holds its GPUs: a claim that came back short (Ray's
            # resource view lags a stopped replica) must not see the reclaimed GPUs lent again, nor a grow
            # see the old group's GPUs lent while the group restarts larger. A later claim of the same start
            # (Ray Train may ask again) never shrinks what is held for it.
            self.pending[job] = (max(int(gpus), held if until > now else 0), now + CLAIM_HOLD_S)
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
        with self.lock:
            now = time.time()
            snap = self._snapshot(now)
            return {
                "gpu_resource": self.gpu_resource, "order": list(self.order), "since": self.started,
                "autoscaled": self.autoscaled, "cluster_kind": self.cluster_kind,
                "restored": self.restored, "nodes": ownership(snap),
                "jobs": [j.__dict__ for j in snap.jobs],
                "tenants": [{"tenant": t.tenant, "target": t.target, **t.spec.as_dict()}
                            for t in self.tenants.values()],
                "leases": [le.__dict__ for le in snap.leases],
                "pending_reclaims": [{"lease_id": le.lease_id, "tenant": le.tenant, "node_id": le.node_id,
                                      "gpus": le.gpus, "since": le.reclaiming_since,
                                      "deadline": le.reclaiming_since + le.grace_s}
                                     for le in snap.leases if le.reclaiming_since is not None],
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
        """GPUs per node that training gets back by claiming them: every lease on a node that is alive and
        not draining, reclaiming or not ({node_id: {gpu_resource: gpus}}). Read from a fresh snapshot, not
        the last tick's leases: a unit a tenant took since then is neither free in Ray's view nor a lease
        yet, and a restart sized in that moment came out a worker short (seen in a demo: 2 instead of 3)."""
        with self.lock:
            snap = self._snapshot(time.time())
            usable = {n.node_id for n in snap.nodes if n.alive and not n.draining}
            out: dict[str, dict[str, float]] = {}
            for le in snap.leases:
                if le.node_id in usable:
                    row = out.setdefault(le.node_id, {self.gpu_resource: 0.0})
                    row[self.gpu_resource] += le.gpus
            return out

    def ping(self) -> str:
        return "ok"


def default_state_path() -> str:
    """The arbiter's state file on the head node, one per cluster (the head node's id): a new cluster on the
    same machine must not adopt the tenants, targets and dashboard URL of an earlier one."""
    import ray
    head = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "no-cluster"
    return os.path.join(tempfile.gettempdir(), "spotfill-arbiter", head[:16], "state.json")


def ensure_arbiter(gpu_resource: str = "GPU", order: tuple[str, ...] = DEFAULT_ORDER,
                   state_path: str | None = None, runtime_env: dict | None = None, dashboard_url: str | None = None,
                   autoscaled: bool | None = None, launch_nodes: bool = False, idle_reclaim_s: float = IDLE_RECLAIM_S):
    """The arbiter actor: found by name, else started detached on the head node (0 CPUs). `autoscaled`:
    the cluster is scaled by Ray's autoscaler -- fill-in lends only on nodes training uses, gives a node
    back idle_reclaim_s after training left it, and never leaves a replica pending (autoscaler demand)
    unless `launch_nodes` (the user allows fill-in to make the autoscaler launch nodes); None (the default):
    the arbiter finds out on the head (fillin/cluster_kind.py). Callers go through fillin/wiring.py."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next((n["NodeID"] for n in ray.nodes() if n.get("Alive")
                 and "node:__internal_head__" in (n.get("Resources") or {})), None)
    options = dict(name=ARBITER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                   num_cpus=0, max_restarts=-1, max_task_retries=-1, max_concurrency=16)
    if head:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    if runtime_env:
        options["runtime_env"] = runtime_env
    handle = ray.remote(Arbiter).options(**options).remote(gpu_resource, tuple(order), state_path,
                                                           dashboard_url=dashboard_url, autoscaled=autoscaled,
                                                           launch_nodes=launch_nodes, idle_reclaim_s=idle_reclaim_s)
    ray.get(handle.ping.remote(), timeout=60)
    return handle


def get_arbiter():
    """The running arbiter actor, or None."""
    import ray
    try:
        return ray.get_actor(ARBITER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None
