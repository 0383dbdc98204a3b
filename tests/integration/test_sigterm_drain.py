"""What a pod's SIGTERM does to a Ray 2.60 worker node -- the premise of docs/kubernetes.md.

A KubeRay worker pod runs `ray start --block` (bash execs it: it is the container's PID 1), and that is
the process the kubelet sends SIGTERM to. Each node here is started exactly that way, as a subprocess that
joins a local `ray.cluster_utils.Cluster` (set up as tests/integration/test_spot_watch.py's), with a busy actor on it (an idle drained node exits
at once), and Ray Train's own PreemptionWatcher watching it:

1. SIGTERM to `ray start --block`: Ray drains the node itself (reason PREEMPTION, deadline = now +
   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S), Ray Train reports the preemption (what spotfill's worker loop
   reads through ray_compat.local_preemption_info -> emergency checkpoint), `ray start` waits for the work
   to leave, and the node then exits recorded as AUTOSCALER_DRAIN_PREEMPTED.
2. SIGTERM straight to the raylet (`ray stop`, or anything that signals it directly): no drain at all;
   the GCS records EXPECTED_TERMINATION "received SIGTERM" and Ray Train sees nothing -- for training
   this is a hard node loss.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

SLOT = "KR_SLOT"
DRAIN_TIMEOUT_S = 60
SIGTERM_MESSAGE = "Node received SIGTERM; draining before shutdown."


def _wait(pred, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        ray.init(address=c.address)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


class PodNode:
    """A worker node started like a KubeRay pod's container: `ray start --address=... --block`."""

    def __init__(self, cluster, label: str, drain_timeout_s: float):
        known = {n["NodeID"] for n in ray.nodes()}
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(drain_timeout_s)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={cluster.address}",
             "--num-cpus=1", "--num-gpus=0",
             f"--resources={json.dumps({SLOT + label: 1})}", "--block", "--disable-usage-stats"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.node_id = _wait(lambda: next((n["NodeID"] for n in ray.nodes()
                                           if n["Alive"] and n["NodeID"] not in known), None),
                             60, "the pod's node to join")

        @ray.remote(num_cpus=0, resources={SLOT + label: 1})
        class Busy:                     # training's worker on this node
            def node(self):
                return ray.get_runtime_context().get_node_id()

        self.busy = Busy.remote()
        assert ray.get(self.busy.node.remote(), timeout=60) == self.node_id

    def raylet_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-x", "raylet"], capture_output=True, text=True)
        pids = out.stdout.split()
        assert len(pids) == 1, f"raylet of `ray start` {self.proc.pid}: {pids}"
        return int(pids[0])

    def death(self) -> dict:
        return _wait(lambda: next((n for n in ray.nodes() if n["NodeID"] == self.node_id and not n["Alive"]),
                                  None), 60, "the node to be recorded dead")

    def stop(self):
        """End our own `ray start` (SIGTERM: it stops its children), by force if it hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=30)


def _watcher(node_id: str):
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    return PreemptionWatcher(node_to_ranks={node_id: [0]}, poll_interval_s=0.1)


def _draining() -> dict:
    return ray._private.state.state.get_draining_nodes() or {}


def test_pod_sigterm_drains_the_node_with_a_deadline_ray_train_sees(cluster):
    from ray.core.generated import common_pb2

    pod = PodNode(cluster, "a", DRAIN_TIMEOUT_S)
    watcher = _watcher(pod.node_id)
    try:
        time.sleep(0.5)
        assert watcher.get_latest_preemption_info() is None and pod.node_id not in _draining()
        sent = time.time()
        pod.proc.send_signal(signal.SIGTERM)         # what the kubelet does to the container's PID 1

        deadline_ms = _wait(lambda: _draining().get(pod.node_id), 30, "the SIGTERM drain")
        assert abs(deadline_ms / 1000 - (sent + DRAIN_TIMEOUT_S)) < 10
        info = _wait(watcher.get_latest_preemption_info, 10, "Ray Train's PreemptionInfo")
        assert info.deadline_ms == deadline_ms and info.preempted_ranks == [0]
        time.sleep(1.0)
        assert pod.proc.poll() is None, "`ray start` must wait while work is still on the node"

        ray.kill(pod.busy)                           # training moved off (emergency checkpoint taken)
        dead = pod.death()
        assert dead["DeathReason"] == common_pb2.NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED
        assert dead["DeathReasonMessage"] == SIGTERM_MESSAGE
        assert pod.proc.wait(timeout=30) == 1        # Ray's handler exits 1 once the node has gone
        assert time.time() - sent < DRAIN_TIMEOUT_S, "it left when the work left, not at the deadline"
    finally:
        watcher._stop_event.set()
        pod.stop()


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_sigterm_to_the_raylet_itself_is_no_drain(cluster):
    from ray.core.generated import common_pb2

    pod = PodNode(cluster, "b", DRAIN_TIMEOUT_S)
    watcher = _watcher(pod.node_id)
    seen_draining = []
    try:
        os.kill(pod.raylet_pid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            seen_draining.append(pod.node_id in _draining())
            node = next(n for n in ray.nodes() if n["NodeID"] == pod.node_id)
            if not node["Alive"]:
                break
            time.sleep(0.1)
        dead = pod.death()
        assert dead["DeathReason"] == common_pb2.NodeDeathInfo.EXPECTED_TERMINATION
        assert dead["DeathReasonMessage"] == "received SIGTERM"
        time.sleep(0.5)                              # a few more watcher polls
        assert not any(seen_draining) and watcher.get_latest_preemption_info() is None
    finally:
        watcher._stop_event.set()
        pod.stop()
