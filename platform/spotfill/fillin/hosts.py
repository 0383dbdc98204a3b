"""Which nodes fill-in may lend on when the cluster autoscales (pure: no Ray; time is an argument).

On an autoscaled cluster fill-in lends only on nodes training uses -- a lease on a node training left would
keep the autoscaler from removing it -- and gives back the leases on a node training left `idle_s` ago
(policy.reclaim_off_hosts). `HostTracker.update` is called once per snapshot with what the arbiter saw.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from spotfill.fillin.policy import Snapshot, ownership, training_hosts

RESOURCE_VIEW_LAG_S = 8.0  # a stopped replica's GPU shows as available within this (GCS resource view; on
                           # a loaded 2-core machine 3 s was measured too short: the claim came back short)
RESTART_GRACE_S = 120.0    # a registered job restarting (no training anywhere) keeps its nodes this long


@dataclass
class HostTracker:
    idle_s: float
    training_seen: dict[str, float] = field(default_factory=dict)    # node -> last time training held GPUs
    training_anywhere: float = 0.0                                    # last time training held GPUs anywhere
    lease_ended_on: dict[str, float] = field(default_factory=dict)   # node -> last time a lease on it ended
    last_hosts: frozenset[str] = frozenset()

    def update(self, snap: Snapshot, ended_on: Iterable[str], *, jobs: bool, between: bool,
               now: float, coming: Iterable[str] = ()) -> frozenset[str]:
        """The hosts now. `ended_on`: nodes where a lease ended since the last snapshot; `jobs`: a training job
        is registered; `between`: a registered job's group is down or being placed (a restart, a grow);
        `coming`: nodes a registered job waits to grow onto while its spares warm there (a node the
        autoscaler brought back): training's already, so their GPUs are lent meanwhile -- the window a grow
        onto ready nodes opens -- and its grow claims them back.

        GPUs in use that no lease holds are training's -- except just after a lease on the node ended: Ray's
        resource view still shows the stopped replica's GPU in use for a moment, which must not make the node
        look used. A job between groups has not left its nodes: their leases wait for its claim (a hand-back),
        not for the idle rule -- for at most RESTART_GRACE_S without training anywhere."""
        for node_id in ended_on:
            self.lease_ended_on[node_id] = now
        alive = {n.node_id for n in snap.nodes if n.alive}
        if jobs:
            for node_id, row in ownership(snap).items():
                if row["training"] > 0 and now - self.lease_ended_on.get(node_id, 0.0) > RESOURCE_VIEW_LAG_S:
                    self.training_seen[node_id] = now
                    self.training_anywhere = now
            for node_id in coming:
                if node_id in alive:
                    self.training_seen[node_id] = now
            if between and now - self.training_anywhere <= RESTART_GRACE_S:
                for node_id in self.training_seen:
                    if node_id in alive:
                        self.training_seen[node_id] = now
        self.training_seen = {k: v for k, v in self.training_seen.items() if k in alive}
        hosts = set(training_hosts(self.training_seen, now, self.idle_s))
        # a host whose training count cannot be read yet (a lease there ended within the view's lag) stays a
        # host meanwhile, for at most the lag: the idle clock must not run out on a view known to lag. A
        # demo's node where training had just started, beside a sweep trial that had just ended, was
        # reclaimed "idle" 10 s after the last sighting before the restart. A node that was no host stays
        # none (no lend right after an idle reclaim), and leases that keep ending (Serve's cold start) keep
        # a node training left a host no longer than idle_s + the lag.
        hosts |= {n for n in self.last_hosts
                  if n in alive and now - self.lease_ended_on.get(n, 0.0) <= RESOURCE_VIEW_LAG_S
                  and now - self.training_seen.get(n, -math.inf) <= self.idle_s + RESOURCE_VIEW_LAG_S}
        self.last_hosts = frozenset(hosts)
        return self.last_hosts
