"""An embedded local Ray cluster scaled by Ray's own autoscaler (v2) with its fake multi-node provider.

The head is a real Ray head started in this process (ray.cluster_utils.Cluster, as EmbeddedCluster) with an
autoscaling config, so its monitor process runs autoscaler v2 -- the same code that scales a `ray up`
cluster -- over `spotfill.testing.fake_market.MarketFakeProvider`: Ray's fake multi-node provider (every
launched "instance" is a real raylet on this machine carrying logical GPU slots) behind a spot market the
caller can close (`set_unavailable`). Worker types look like cluster.yaml's (sim/autoscaler_config.py). The
head carries no GPU slots: training workers only ever run on nodes the autoscaler launched.

Everything binds to 127.0.0.1: the GCS port is chosen here and given to the provider, and the monitor (and
so every node it starts) runs with Ray's single-host setting.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time

from spotfill.sim.autoscaler_config import HEAD_TYPE, MARKET_LABEL, NodeTypeSpec, fake_cluster_config
from spotfill.sim.cluster import FAST_FAILURE_DETECTION, HEAD_DASHBOARD, LOOPBACK, LOOPBACK_NODE, free_port, node_gpus

log = logging.getLogger(__name__)
PROVIDER_MODULE = "spotfill.testing.fake_market.MarketFakeProvider"


@contextlib.contextmanager
def _env(**values: str):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class AutoscalingCluster:
    def __init__(self, node_types: list[NodeTypeSpec], gpu_resource: str = "GPU", head_cpus: int = 2,
                 idle_timeout_s: float = 10.0, allocate_timeout_s: int = 10, workdir: str | None = None,
                 system_config: dict | None = None, max_workers: int | None = None):
        from ray.cluster_utils import Cluster

        from spotfill.config import constants
        from spotfill.ray_compat import FAKE_HEAD_NODE_ID, single_host_loopback
        from spotfill.sim.cluster import worker_env

        self.gpu_resource = gpu_resource
        self.node_types = {t.name: t for t in node_types}
        self.head_node_id = FAKE_HEAD_NODE_ID
        self.workdir = workdir or tempfile.mkdtemp(prefix="spotfill-autoscaler-")
        os.makedirs(self.workdir, exist_ok=True)
        self.market_file = os.path.join(self.workdir, "market.json")
        self.log_file = os.path.join(self.workdir, "provider.jsonl")
        self.config_file = os.path.join(self.workdir, "autoscaler.yaml")
        for path in (self.market_file, self.log_file):
            if os.path.exists(path):
                os.unlink(path)
        port = free_port()
        self.gcs_address = f"{LOOPBACK}:{port}"
        config = fake_cluster_config(node_types, gpu_resource, head_cpus, idle_timeout_s=idle_timeout_s,
                                     max_workers=max_workers, provider={
            "type": "external", "module": PROVIDER_MODULE, "gcs_address": self.gcs_address,
            "head_node_id": FAKE_HEAD_NODE_ID, "launch_multiple": True,
            "market_file": self.market_file, "log_file": self.log_file})
        with open(self.config_file, "w") as f:
            json.dump(config, f, indent=1)      # JSON is YAML: preflight reads it like ~/ray_bootstrap_config.yaml
        self._loopback_before = single_host_loopback(True)
        self._env_before = os.environ.get(constants.AUTOSCALER_CONFIG_ENV)
        os.environ[constants.AUTOSCALER_CONFIG_ENV] = self.config_file
        # The head's processes (GCS, raylet, the autoscaler's monitor and every node it launches) inherit
        # this environment: autoscaler v2, the fake provider, loopback, a 1 s autoscaler loop, and a short
        # wait for a launched instance that never runs Ray (an unfulfilled spot request).
        with _env(RAY_FAKE_CLUSTER="1", RAY_enable_autoscaler_v2="1", RAY_CLOUD_INSTANCE_ID=FAKE_HEAD_NODE_ID,
                  AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                  RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S=str(int(allocate_timeout_s)),
                  PYTHONPATH=worker_env()["PYTHONPATH"]):
            self.cluster = Cluster(initialize_head=True, head_node_args={
                **LOOPBACK_NODE, **HEAD_DASHBOARD, "num_cpus": head_cpus, "num_gpus": 0, "gcs_server_port": port,
                "dashboard_port": free_port(),
                "autoscaling_config": self.config_file,
                # the head's node type as the provider lists it: autoscaler v2 reconciles Ray's nodes before
                # the provider's instances, and a head node reported without its type (a race at start-up)
                # failed every round after ("ALLOCATED update must have instance_type"; nothing launched)
                "env_vars": {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID,
                             "RAY_NODE_TYPE_NAME": HEAD_TYPE},
                "labels": {MARKET_LABEL: "on-demand", "spotfill.io/role": "head"},
                "_system_config": {**FAST_FAILURE_DETECTION, **(system_config or {})}})
        self.started = time.time()
        # Node indices as scenarios use them: nodes added here (static / scenario) and nodes the autoscaler
        # launched, in the order they appeared. records: what report.json's cluster.nodes starts from.
        self.node_ids: list[str] = []
        self.records: list[dict] = [{"id": self.head_node_id, "type": "head", "market": "on-demand", "gpus": 0,
                                     "launched_by": "static", "started": round(self.started, 3)}]
        self._static: dict[str, object] = {}
        self._dead_at: dict[str, float] = {}

    @property
    def address(self) -> str:
        return self.cluster.address

    # --- scenario node indices (the runner's interface, as EmbeddedCluster's) ----------------------------

    def refresh(self) -> list[int]:
        """Take in nodes the autoscaler launched since the last call; returns their new indices."""
        import ray
        now = round(time.time(), 3)
        for n in ray.nodes():
            if not n.get("Alive"):
                self._dead_at.setdefault(n["NodeID"], now)
        new = []
        for e in self.provider_log():
            if e["event"] == "launched" and e["node_id"] not in self.node_ids:
                self.node_ids.append(e["node_id"])
                new.append(len(self.node_ids) - 1)
        return new

    def add_node(self, gpus: int, launched_by: str = "scenario") -> int:
        """A node outside the autoscaler (static, or added by a scenario event): on-demand, no type."""
        node = self.cluster.add_node(**LOOPBACK_NODE, num_cpus=gpus, **node_gpus(self.gpu_resource, gpus),
                                     labels={MARKET_LABEL: "on-demand", "spotfill.io/role": "gpu-worker"})
        self.refresh()
        self.node_ids.append(node.node_id)
        self._static[node.node_id] = node
        self.records.append({"id": node.node_id, "type": None, "market": "on-demand", "gpus": gpus,
                             "launched_by": launched_by,
                             "started": round(time.time(), 3)})
        return len(self.node_ids) - 1

    def alive(self, index: int) -> bool:
        import ray
        if not 0 <= index < len(self.node_ids):
            return False
        return any(n["NodeID"] == self.node_ids[index] and n.get("Alive") for n in ray.nodes())

    def kill_workers(self, index: int) -> int:
        """The first half of a hard loss (remove_node follows): a listed node's worker processes SIGKILLed;
        a launched node terminated outright (as remove_node does). Returns processes killed."""
        from spotfill.ray_compat import kill_node_workers
        node = self._static.get(self.node_ids[index])
        return kill_node_workers(node) if node is not None else self.terminate_node(self.node_ids[index])

    def remove_node(self, index: int, graceful: bool) -> None:
        node_id = self.node_ids[index]
        node = self._static.pop(node_id, None)
        if node is not None:
            self.cluster.remove_node(node, allow_graceful=graceful)
        else:
            self.terminate_node(node_id)
        for r in self.records:
            if r["id"] == node_id and "ended" not in r:
                r["ended"] = round(time.time(), 3)

    # --- what the cluster looks like ------------------------------------------------------------------

    def worker_nodes(self, alive_only: bool = True) -> list[dict]:
        """Launched worker nodes as Ray sees them: node_id, type, market, alive, resources (needs ray.init)."""
        import ray
        types = {e["node_id"]: e["node_type"] for e in self.provider_log() if e["event"] == "launched"}
        out = []
        for n in ray.nodes():
            if n["NodeID"] == self.head_node_id or (alive_only and not n.get("Alive")):
                continue
            labels = n.get("Labels") or {}
            out.append({"node_id": n["NodeID"], "type": types.get(n["NodeID"]),
                        "market": labels.get(MARKET_LABEL), "alive": bool(n.get("Alive")),
                        "resources": dict(n.get("Resources") or {})})
        return out

    def resource_request(self) -> list[dict]:
        """The cluster's standing resource request (what `ray.autoscaler.sdk.request_resources` set, Ray
        Train's autoscaling coordinator included), as autoscaler v2 reports it: [{bundle, count}]."""
        from ray.autoscaler.v2.sdk import get_cluster_status
        status = get_cluster_status(self.gcs_address)
        return [{"bundle": dict(b.bundle), "count": b.count}
                for d in status.resource_demands.cluster_constraint_demand for b in d.bundles_by_count]

    def leftovers(self) -> dict:
        """What could keep a launched node alive after a run: placement groups not removed, and alive
        actors on launched (non-head) nodes. Both empty when nothing was left behind."""
        import ray
        from ray.util.state import list_actors
        pgs = [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg.get("state") != "REMOVED"]
        actors = [{"class": a.class_name, "name": a.name, "node": a.node_id}
                  for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
                  if a.node_id != self.head_node_id]
        return {"placement_groups": pgs, "actors_on_launched_nodes": actors}

    def provider_log(self) -> list[dict]:
        """Every launch, refusal and termination the fake provider made, in order."""
        if not os.path.exists(self.log_file):
            return []
        with open(self.log_file) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait_for(self, predicate, timeout_s: float, what: str, poll_s: float = 0.5):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(poll_s)
        raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")

    # --- what the cloud does --------------------------------------------------------------------------

    def set_unavailable(self, node_type: str, how: str | None = "refuse") -> None:
        """Close (how = "refuse" | "unfulfilled") or reopen (None) the market for a node type."""
        from spotfill.testing.fake_market import read_market, write_market
        market = read_market(self.market_file)
        if how is None:
            market.pop(node_type, None)
        else:
            market[node_type] = how
        write_market(self.market_file, market)

    def drain_node(self, index: int, deadline_s: float, message: str, reason: str = "PREEMPTION") -> None:
        """Ray drain with a deadline, as `spotfill spot-watch` does on a spot notice (node by index)."""
        from spotfill.spot.watcher import drain_ray_node
        drain_ray_node(self.node_ids[index], deadline_s=time.time() + deadline_s, message=message,
                       reason=f"DRAIN_NODE_REASON_{reason}", address=self.address)

    def terminate_node(self, node_id: str) -> int:
        """The cloud takes the instance back: every process of that node is killed (SIGKILL), as a spot
        instance vanishes at its deadline. The autoscaler then finds the node dead. Returns processes killed."""
        procs = [p for p in self._provider_descendants() if node_id in " ".join(_cmdline(p))]
        for p in list(procs):             # and what they started (the node's workers)
            with contextlib.suppress(Exception):
                procs.extend(c for c in p.children(recursive=True) if c not in procs)
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
        log.info("node %s terminated (%d processes killed)", node_id[-8:], len(procs))
        return len(procs)

    def _provider_descendants(self) -> list:
        """Processes started by the autoscaler's monitor (the launched nodes), found from this process."""
        import psutil
        monitors = [p for p in psutil.Process().children(recursive=True)
                    if any("monitor.py" in part for part in _cmdline(p))
                    and f"--gcs-address={self.gcs_address}" in _cmdline(p)]
        out = []
        for m in monitors:
            with contextlib.suppress(Exception):
                out.extend(m.children(recursive=True))
        return out

    def node_report(self) -> dict:
        """report.json's `cluster` section: every node that took part (needs ray.init; call before shutdown)."""
        import ray

        from spotfill.ray_compat import node_death_reason_name
        from spotfill.sim.nodes import cluster_section
        seen = [{"id": n["NodeID"], "alive": bool(n.get("Alive")),
                 "death_reason": node_death_reason_name(n.get("DeathReason")),
                 "death_message": n.get("DeathReasonMessage") or "", "dead_at": self._dead_at.get(n["NodeID"])}
                for n in ray.nodes()]
        return cluster_section(self.records, self.provider_log(), seen, time.time(),
                               gpus_by_type={name: t.gpus for name, t in self.node_types.items()})

    def shutdown(self) -> None:
        import ray

        from spotfill.config import constants
        from spotfill.ray_compat import single_host_loopback
        try:
            ray.shutdown()
        finally:
            launched = self._provider_descendants()
            for p in launched:
                with contextlib.suppress(Exception):
                    p.kill()
            self.cluster.shutdown()
            single_host_loopback(self._loopback_before)
            if self._env_before is None:
                os.environ.pop(constants.AUTOSCALER_CONFIG_ENV, None)
            else:
                os.environ[constants.AUTOSCALER_CONFIG_ENV] = self._env_before


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:
        return []
