"""An embedded local Ray cluster for the demo, tests and benchmarks.

Each worker node is a real raylet (ray.cluster_utils.Cluster) carrying `gpus` of Ray's own `GPU` resource
(Ray accepts num_gpus on a machine without GPUs: it assigns them, sets CUDA_VISIBLE_DEVICES, and the code
that follows Ray's assignment -- spotfill.devices -- runs as on a GPU cluster, computing on the CPU) and as
many logical CPUs; a logical resource such as GPU_SLOT instead is an option. The head carries no GPUs, like
cluster.yaml's head. Node failure detection is tightened (GCS health checks every second) so a lost node is
noticed in seconds; cluster.yaml and deploy/kuberay tighten it too, with values for a real network
(config/failure_detection.py).
Every node binds to loopback (LOOPBACK): nothing of the embedded cluster is reachable from the network.
"""
from __future__ import annotations

import logging
import os
import time

from spotfill.config.failure_detection import EMBEDDED as EMBEDDED_HEALTH_CHECK
from spotfill.testing import ports

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# A process outside this one (a `jobs/pretrain.py` driver) reaches the cluster at 127.0.0.1 with this set.
LOOPBACK_CLIENT_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Node arguments that keep a node on loopback (Ray would otherwise use the machine's network address).
LOOPBACK_NODE = {"node_ip_address": LOOPBACK, "dashboard_host": LOOPBACK}
# The head runs the dashboard (Serve's scale endpoint and the job API live there; with node_ip_address set,
# Ray leaves it off unless asked). Its port is left to Ray (None): the dashboard binds 8265, else the first
# free one of the 50 after it, itself -- so a cluster starts beside another local Ray, also one started at the
# same moment (a port given explicitly is checked once before the dashboard binds it, and a head whose port
# was taken in between dies). The dashboard agent's HTTP port likewise (Ray's fixed 52365 on every head).
# Where the dashboard ended up: the address the head registers (ray_compat.dashboard_url).
HEAD_DASHBOARD = {"include_dashboard": True, "dashboard_port": None, "dashboard_agent_listen_port": None}
# GCS health checks on loopback (config/failure_detection.py EMBEDDED): a frozen node is declared dead within
# 6 s, a killed one within 3 s. Real clusters get theirs from cluster.yaml / deploy/kuberay (CLUSTER).
FAST_FAILURE_DETECTION = EMBEDDED_HEALTH_CHECK.system_config()


def free_port(preferred: int = 0) -> int:
    """`preferred` when it is free on 127.0.0.1, else a free one outside the ranges Ray and the kernel
    allocate from (testing.ports)."""
    return preferred if preferred and ports.bindable(LOOPBACK, preferred) else ports.free_port(LOOPBACK)


class EmbeddedCluster:
    def __init__(self, gpu_resource: str = "GPU", head_cpus: int = 2,
                 system_config: dict | None = None, cpu_layout: dict | None = None):
        """`cpu_layout` (sim.cpu_layout.plan_layout): the head's processes (and this driver's threads) run on
        its "head" cores, the i-th node added on its "nodes"[i]; None: every process on every core."""
        from ray.cluster_utils import Cluster

        from spotfill.ray_compat import single_host_loopback

        self.gpu_resource = gpu_resource
        self.cpu_layout = cpu_layout
        self._driver_affinity = None
        self.training_pinned: set[int] = set()     # training worker processes moved to the layout's "training"
        if cpu_layout is not None:    # before the head starts: its processes are this one's children
            from spotfill.sim.cpu_layout import pin_threads, thread_affinities
            self._driver_affinity = thread_affinities(os.getpid())
            pin_threads(os.getpid(), cpu_layout["head"])
        self._loopback_before = single_host_loopback(True)   # the driver connects on 127.0.0.1 too
        # ... and so do the processes the nodes start: the dashboard's Serve module ray.init()s to reach the
        # Serve controller (the scale endpoint fill-in uses), and without this it rewrites the head's
        # 127.0.0.1 address to the machine's network address, where the loopback GCS does not listen.
        self._env_before = {k: os.environ.get(k) for k in LOOPBACK_CLIENT_ENV}
        os.environ.update(LOOPBACK_CLIENT_ENV)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **LOOPBACK_NODE, **HEAD_DASHBOARD, "num_cpus": head_cpus,
            "num_gpus": 0, "_system_config": {**FAST_FAILURE_DETECTION, **(system_config or {})}})
        self.nodes: list = []          # index -> ray node handle (None once removed)
        self.frozen: list = []         # processes freeze_node stopped (killed at shutdown)
        self.node_ids: list[str] = []
        # what report.json's cluster.nodes starts from (sim/nodes.py): the head and every node added here
        self.records: list[dict] = [{"id": self.cluster.head_node.node_id, "type": "head", "market": "on-demand",
                                     "gpus": 0,
                                     "launched_by": "static", "started": round(time.time(), 3)}]
        self._pinning = None
        if cpu_layout is not None and cpu_layout.get("training"):
            import threading
            self._pinning = threading.Event()
            threading.Thread(target=self._pin_training, name="pin-training-workers", daemon=True).start()

    def _pin_training(self) -> None:
        """Each training worker onto the layout's training core(s), as soon as it is seen (every 0.5 s)."""
        from spotfill.sim.cpu_layout import pin_training_workers
        while not self._pinning.wait(0.5):
            if pin_training_workers(os.getpid(), self.cpu_layout["training"], self.training_pinned):
                log.info("training worker(s) on cores %s: %d so far", self.cpu_layout["training"],
                         len(self.training_pinned))

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, gpus: int, launched_by: str = "static") -> int:
        """Add a worker node; returns its index (position in the order nodes were added). launched_by:
        static (the scenario's cluster.nodes) or scenario (an add_node event)."""
        node = self.cluster.add_node(**LOOPBACK_NODE, num_cpus=gpus, **node_gpus(self.gpu_resource, gpus))
        if self.cpu_layout is not None:
            self._pin_node(node, len(self.nodes))
        self.nodes.append(node)
        self.node_ids.append(node.node_id)
        self.records.append({"id": node.node_id, "type": None, "market": "on-demand", "gpus": gpus,
                             "launched_by": launched_by,
                             "started": round(time.time(), 3)})
        log.info("node %d added (%d %s, id %s)", len(self.nodes) - 1, gpus, self.gpu_resource, node.node_id[:12])
        return len(self.nodes) - 1

    def _pin_node(self, node, index: int) -> None:
        """The node's raylet, whatever it started already and every thread of them onto the node's cores
        (the workers it starts later inherit them from the raylet)."""
        from spotfill.ray_compat import node_raylet_pids
        from spotfill.sim.cpu_layout import pin_process_tree
        layout = self.cpu_layout["nodes"]
        if index < len(layout):
            cores = layout[index]
        elif self.cpu_layout.get("training"):
            cores = self.cpu_layout["head"]     # training apart: every node's processes share the other cores
        else:
            raise ValueError(f"cpu_layout has cores for {len(layout)} nodes; node {index} was added")
        n = pin_process_tree(node_raylet_pids(node), cores)
        log.info("node %d runs on cores %s (%d processes pinned)", index, cores, n)

    def alive(self, index: int) -> bool:
        return 0 <= index < len(self.nodes) and self.nodes[index] is not None

    def kill_workers(self, index: int) -> int:
        """SIGKILL the node's worker processes (the first half of a hard loss; remove_node follows): a mass
        preemption kills every node's workers before removing the nodes one by one. Returns how many."""
        from spotfill.ray_compat import kill_node_workers
        node = self.nodes[index]
        return kill_node_workers(node) if node is not None else 0

    def remove_node(self, index: int, graceful: bool) -> None:
        node = self.nodes[index]
        if node is None:
            return
        if not graceful:                   # a hard loss: the node's workers die with it, at once
            self.kill_workers(index)
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.nodes[index] = None
        for r in self.records:
            if r["id"] == self.node_ids[index] and "ended" not in r:
                r["ended"] = round(time.time(), 3)
        log.info("node %d removed (%s)", index, "graceful" if graceful else "killed")

    def freeze_node(self, index: int) -> int:
        """SIGSTOP every process of the node (its raylet and everything under it): no TCP reset, nothing
        answers (sim/freeze.py). Killed at shutdown. Returns how many processes were stopped."""
        from spotfill.ray_compat import node_raylet_pids
        from spotfill.sim.freeze import freeze_process_tree
        procs = freeze_process_tree(node_raylet_pids(self.nodes[index]))
        self.frozen.extend(procs)
        log.info("node %d frozen (%d processes stopped)", index, len(procs))
        return len(procs)

    def refresh(self) -> list[int]:
        """Nothing launches nodes here but the scenario (the autoscaling cluster's counterpart does)."""
        return []

    def node_report(self) -> dict:
        """report.json's `cluster` section: every node that took part (needs ray.init; call before shutdown)."""
        import ray

        from spotfill.ray_compat import node_death_reason_name
        from spotfill.sim.nodes import cluster_section
        seen = [{"id": n["NodeID"], "alive": bool(n.get("Alive")),
                 "death_reason": node_death_reason_name(n.get("DeathReason")),
                 "death_message": n.get("DeathReasonMessage") or ""} for n in ray.nodes()]
        return cluster_section(self.records, [], seen, time.time())

    def drain_node(self, index: int, deadline_s: float, message: str, reason: str = "PREEMPTION") -> None:
        """Ray drain with a deadline, as `spotfill spot-watch` does on a spot notice."""
        from spotfill.spot.watcher import drain_ray_node
        drain_ray_node(self.node_ids[index], deadline_s=time.time() + deadline_s, message=message,
                       reason=f"DRAIN_NODE_REASON_{reason}", address=self.address)

    def shutdown(self) -> None:
        import ray

        from spotfill.ray_compat import single_host_loopback
        from spotfill.sim.freeze import kill_frozen
        if self._pinning is not None:
            self._pinning.set()
        try:
            ray.shutdown()
        finally:
            kill_frozen(self.frozen)
            self.cluster.shutdown()
            single_host_loopback(self._loopback_before)
            for tid, cpus in (self._driver_affinity or {}).items():
                try:
                    os.sched_setaffinity(tid, cpus)
                except OSError:        # a thread that has ended
                    pass
            for k, v in self._env_before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def quiet_expected_node_deaths() -> None:
    """On the embedded cluster nodes die on purpose (scenario kills and deadline removals), and Ray's driver
    prints each raylet's last 20 log lines to stdout when it does, burying the run's own output. Keep the
    first line of such messages, as one log line; every other message prints as before.

    The hook (the driver's printer of raylet log lines) is in spotfill.ray_compat."""
    from spotfill.ray_compat import wrap_driver_stdstream

    def quiet(original, data, ignore_prefix: bool):
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and lines and any(
                marker in lines[0] for marker in ("Raylet is terminated", "has been marked dead")):
            log.warning("ray: %s", lines[0].splitlines()[0][:300])
            return
        original(data, ignore_prefix)

    wrap_driver_stdstream(quiet)


def node_gpus(gpu_resource: str, gpus: int) -> dict:
    """A node's accelerator arguments: Ray's GPU resource as num_gpus, a logical one as a custom resource."""
    return {"num_gpus": gpus} if gpu_resource == "GPU" else {"num_gpus": 0, "resources": {gpu_resource: gpus}}


def worker_env() -> dict[str, str]:
    """Environment for workers of the embedded cluster: find the library where this process found it."""
    from spotfill.fillin.wiring import library_env
    return library_env()
