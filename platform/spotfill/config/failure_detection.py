"""How fast a Ray cluster notices a node that is gone without a word: the GCS health-check settings (pure).

Ray's GCS checks every raylet over gRPC: a check every `period_ms`, each answered within `timeout_ms` or
failed, and `failure_threshold` failures in a row declare the node dead (its actors die, Ray Train restarts
the group). A killed process on a live host fails each check at once (the host answers the connection with
a reset); a host that vanished or froze answers nothing, so each check waits out its timeout. That second
case is a spot host lost without notice, and the one these bounds are for.

The settings are Ray's RayConfig names. The GCS process reads each from the environment as
`RAY_<name>` (`env()`): `cluster.yaml` exports them before `ray start --head`, deploy/kuberay puts them on the
head container. A cluster started from a Python process takes them as `_system_config`
(`system_config()`): the embedded test cluster (spotfill.sim.cluster).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class HealthCheck:
    period_ms: int
    timeout_ms: int
    failure_threshold: int

    def system_config(self) -> dict[str, int]:
        """Ray system-config entries (`ray.init(_system_config=...)`, `ray start --system-config`)."""
        return {f"health_check_{k}": v for k, v in asdict(self).items()}

    def env(self) -> dict[str, str]:
        """The same as environment variables of the GCS process (Ray reads `RAY_<name>` for every entry)."""
        return {f"RAY_{k}": str(v) for k, v in self.system_config().items()}

    def silent_node_bound_s(self) -> float:
        """Longest time from a host going silent (frozen, or gone without a TCP reset) to the GCS declaring
        its node dead: at worst it froze right after a passed check, so the next check starts one period
        later, and each of `failure_threshold` checks waits its timeout, a period apart."""
        return self.failure_threshold * (self.period_ms + self.timeout_ms) / 1000.0

    def silent_node_min_s(self) -> float:
        """Shortest such time: a check already in flight fails first, `failure_threshold` timeouts with
        `failure_threshold - 1` periods between them."""
        return (self.failure_threshold * self.timeout_ms + (self.failure_threshold - 1) * self.period_ms) / 1000.0

    def killed_node_bound_s(self) -> float:
        """A node whose processes were killed on a live host: each check fails at once (connection refused)."""
        return self.failure_threshold * self.period_ms / 1000.0

    def describe(self) -> str:
        return (f"a check every {self.period_ms / 1000:g}s, {self.timeout_ms / 1000:g}s timeout, "
                f"{self.failure_threshold} failures in a row: a silent node is declared dead within "
                f"{self.silent_node_bound_s():g}s")


# Ray 2.60's own defaults (src/ray/common/ray_config_def.h): a silent node is declared dead after 62-65 s.
RAY_DEFAULT = HealthCheck(period_ms=3000, timeout_ms=10000, failure_threshold=5)
# What cluster.yaml and deploy/kuberay set (tests/unit/test_cluster_yaml.py and test_kuberay_manifests.py
# check they agree with this): a silent node is dead within 20 s. A healthy raylet answers in milliseconds
# (in-region round trips are well under one); the timeout leaves 3 s for a loaded host, and a node is only
# given up after 4 checks in a row failed, about 15-20 s of silence, not for one lost packet.
CLUSTER = HealthCheck(period_ms=2000, timeout_ms=3000, failure_threshold=4)
# The embedded test cluster (spotfill.sim.cluster): every node is on loopback, so 1 s is plenty.
EMBEDDED = HealthCheck(period_ms=1000, timeout_ms=1000, failure_threshold=3)
