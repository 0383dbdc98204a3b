"""The spot watcher against a real HTTP IMDSv2 stand-in, the CLI as a subprocess, and one real Ray drain.

Most tests pass a drain callable that records calls; `test_real_ray_drain_*` drains a worker of a local
`ray.cluster_utils.Cluster` and checks what Ray (and Ray Train's preemption watcher) then report.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spotfill.spot import watcher as spot
from spotfill.testing.imds import INSTANCE_ACTION_PATH, TOKEN_PATH, ImdsStandin

PLATFORM = str(Path(__file__).resolve().parents[2] / "platform")


class RecordingDrain:
    """A drain callable that records decisions; can be told to fail the first N calls."""

    def __init__(self, fail_first: int = 0):
        self.calls: list[spot.Decision] = []
        self.fail_left = fail_first

    def __call__(self, decision: spot.Decision) -> str:
        self.calls.append(decision)
        if self.fail_left > 0:
            self.fail_left -= 1
            raise spot.DrainError("GCS unreachable (simulated)")
        return "node fake"


@pytest.fixture
def imds():
    with ImdsStandin() as server:
        yield server


def make_watcher(imds: ImdsStandin, drain=None, timeout_s: float = 0.5, **kw):
    drain = drain if drain is not None else RecordingDrain()
    return spot.SpotWatcher(spot.AwsSource(imds.url, timeout_s=timeout_s), drain, **kw), drain


def test_no_notice_is_404_and_uses_a_token(imds):
    watcher, drain = make_watcher(imds)
    assert watcher.poll_once().status == "no-notice"
    assert watcher.poll_once().status == "no-notice"
    assert drain.calls == []
    assert imds.count("GET", INSTANCE_ACTION_PATH, 404) == 2
    assert imds.count("PUT", TOKEN_PATH, 200) == 1              # token cached across polls
    assert imds.count(status=401) == 0


def test_notice_drains_once_with_deadline_and_reason(imds):
    watcher, drain = make_watcher(imds)
    when = imds.set_notice("terminate", seconds_from_now=90)
    out = watcher.poll_once()
    assert out.status == "drained" and len(drain.calls) == 1
    d = drain.calls[0]
    assert d.reason == "DRAIN_NODE_REASON_PREEMPTION"
    assert d.deadline_s == spot.parse_time(when) and 85 <= d.remaining_s <= 91
    for _ in range(3):
        assert watcher.poll_once().status == "already-drained"
    assert len(drain.calls) == 1
    imds.set_notice("stop", seconds_from_now=30)                 # a different notice: drained again
    assert watcher.poll_once().status == "drained" and len(drain.calls) == 2


def test_token_expiry_mid_run_refetches(imds):
    watcher, drain = make_watcher(imds)
    assert watcher.poll_once().status == "no-notice"
    imds.expire_tokens()
    imds.set_notice("terminate", 60)
    assert watcher.poll_once().status == "drained"
    assert imds.count("GET", INSTANCE_ACTION_PATH, 401) == 1
    assert imds.count("PUT", TOKEN_PATH, 200) == 2


def test_token_rejected_everywhere_is_an_imds_error_then_recovers(imds):
    watcher, _ = make_watcher(imds)
    imds.reject_tokens(True)
    out = watcher.poll_once()
    assert out.status == "imds-error" and "401" in out.detail
    imds.reject_tokens(False)
    assert watcher.poll_once().status == "no-notice"


def test_slow_response_times_out_and_next_poll_succeeds(imds):
    watcher, drain = make_watcher(imds, timeout_s=0.3)
    watcher.poll_once()                                          # token cached
    imds.set_notice("terminate", 60)
    imds.set_delay(2.0, count=1)
    t0 = time.monotonic()
    out = watcher.poll_once()
    assert out.status == "imds-error" and "timed out" in out.detail
    assert time.monotonic() - t0 < 1.5                           # bounded by the client timeout
    assert watcher.poll_once().status == "drained" and len(drain.calls) == 1


def test_5xx_is_survived(imds):
    watcher, drain = make_watcher(imds)
    imds.set_notice("terminate", 60)
    imds.set_failure(500)                                        # token PUT and GETs all fail
    assert [watcher.poll_once().status for _ in range(3)] == ["imds-error"] * 3
    imds.set_failure(0)
    assert watcher.poll_once().status == "drained" and len(drain.calls) == 1
    imds.set_failure(503, count=1)
    assert watcher.poll_once().status == "imds-error"
    assert watcher.poll_once().status == "already-drained" and len(drain.calls) == 1


def test_connection_refused_is_survived():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                                # closed again: nothing listens there
    watcher = spot.SpotWatcher(spot.AwsSource(f"http://127.0.0.1:{port}", timeout_s=0.5), RecordingDrain())
    out = watcher.poll_once()
    assert out.status == "imds-error" and "refused" in out.detail.lower()


def test_rebalance_is_logged_once_and_not_drained(imds, caplog):
    watcher, drain = make_watcher(imds)
    imds.set_rebalance()
    with caplog.at_level(logging.WARNING, logger="spotfill.spot.watcher"):
        assert [watcher.poll_once().status for _ in range(3)] == ["rebalance"] * 3
    assert drain.calls == []
    assert sum("rebalance recommendation" in r.getMessage() for r in caplog.records) == 1


def test_rebalance_drain_option_then_notice_sets_deadline(imds):
    watcher, drain = make_watcher(imds, on_rebalance="drain")
    imds.set_rebalance()
    assert watcher.poll_once().status == "drained"
    assert drain.calls[0].deadline_s is None
    assert watcher.poll_once().status == "already-drained"
    imds.set_notice("terminate", 100)
    assert watcher.poll_once().status == "drained"
    assert drain.calls[1].deadline_s is not None and len(drain.calls) == 2


def test_failed_drain_is_retried_next_poll(imds):
    watcher, drain = make_watcher(imds, drain=RecordingDrain(fail_first=1))
    imds.set_notice("terminate", 60)
    assert watcher.poll_once().status == "drain-failed"
    assert watcher.poll_once().status == "drained"
    assert watcher.poll_once().status == "already-drained"
    assert len(drain.calls) == 2


def test_run_loop_drains_exactly_once_and_stops(imds):
    watcher, drain = make_watcher(imds)
    stop = threading.Event()
    thread = threading.Thread(target=watcher.run, args=(0.05, stop), daemon=True)
    thread.start()
    time.sleep(0.2)
    imds.set_notice("terminate", 60)
    deadline = time.monotonic() + 5
    while not drain.calls and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)                                              # several more polls
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive() and len(drain.calls) == 1
    assert imds.count("GET", INSTANCE_ACTION_PATH, 200) >= 3


# --- CLI -------------------------------------------------------------------------------------------
def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PLATFORM, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "spotfill", "spot-watch", *args], capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_cli_once_no_notice_exits_0(imds):
    r = run_cli("--once", "--imds-endpoint", imds.url)
    assert r.returncode == 0, r.stderr
    assert "no notice" in r.stdout and "Traceback" not in r.stderr
    assert imds.count("GET", INSTANCE_ACTION_PATH, 404) == 1


@pytest.mark.parametrize("args,field", [
    (["--poll-s", "-1"], "--poll-s"), (["--poll-s", "0"], "--poll-s"), (["--poll-s", "x"], "--poll-s"),
    (["--imds-endpoint", "nope"], "--imds-endpoint"), (["--on-rebalance", "x"], "on-rebalance"),
    (["--node-id", "abc"], "--node-id"),
])
def test_cli_bad_usage_exits_2_one_line(args, field):
    r = run_cli("--once", *args)
    assert r.returncode == 2
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1 and field in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_once_imds_down_exits_1_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run_cli("--once", "--imds-endpoint", f"http://127.0.0.1:{port}", "--timeout-s", "0.5")
    assert r.returncode == 1 and "imds-error" in r.stdout and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("spotfill: failed:")


# --- real Ray --------------------------------------------------------------------------------------
@pytest.fixture
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1, resources={"GPU_SLOT": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster, worker
    finally:
        ray.shutdown()
        cluster.shutdown()


def _wait(pred, timeout_s: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_real_ray_drain_with_deadline_is_seen_by_ray_and_ray_train(ray_cluster, imds):
    import ray
    from ray.core.generated import common_pb2, gcs_pb2

    cluster, worker = ray_cluster

    @ray.remote(num_cpus=0, resources={"GPU_SLOT": 1})
    class Busy:                     # keeps the worker busy: an idle node exits as soon as it is drained
        def node(self):
            return ray.get_runtime_context().get_node_id()

    busy = Busy.remote()
    assert ray.get(busy.node.remote()) == worker.node_id

    # The daemon exactly as cluster.yaml starts it (no --node-id: "this node" is found by IP; head and
    # worker share the IP here, so it must pick the worker), polling the stand-in for a notice.
    assert spot.RayNodeDrainer(address=cluster.address).resolve() == worker.node_id
    with pytest.raises(spot.DrainError, match="not an alive node"):
        spot.RayNodeDrainer(address=cluster.address, node_id="ab" * 28).resolve()
    when = imds.set_notice("terminate", seconds_from_now=60)
    deadline_ms = int(spot.parse_time(when) * 1000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PLATFORM, os.environ.get("PYTHONPATH", "")])}
    daemon = subprocess.Popen([sys.executable, "-m", "spotfill", "spot-watch", "--imds-endpoint", imds.url,
                               "--poll-s", "0.2", "--address", cluster.address],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    gcs = ray._raylet.GcsClient(address=cluster.gcs_address)
    try:
        _wait(lambda: gcs.get_draining_nodes() or daemon.poll() is not None, 60, "the daemon's drain")
        time.sleep(1.0)                                          # a few more polls: no second drain
    finally:
        daemon.terminate()                                       # SIGTERM: a clean stop
        out, err = daemon.communicate(timeout=30)
    assert daemon.returncode == 0, err
    assert f"will drain Ray node {worker.node_id}" in err, err
    assert err.count("drain accepted") == 1, err

    # GCS: the node is draining with exactly the notice's deadline (what Ray Train polls) ...
    assert gcs.get_draining_nodes() == {worker.node_id: deadline_ms}
    assert ray._private.state.state.get_draining_nodes() == {worker.node_id: deadline_ms}
    _wait(lambda: gcs.get_all_node_info(timeout=5)[ray.NodeID.from_hex(worker.node_id)]
          .state_snapshot.state == gcs_pb2.NodeSnapshot.DRAINING, what="DRAINING node state")

    # ... so Ray Train's PreemptionWatcher (behind ray.train.get_preemption_info) reports it.
    from ray.train.v2._internal.execution.preemption import PreemptionWatcher

    ptw = PreemptionWatcher(node_to_ranks={worker.node_id: [0]}, poll_interval_s=0.1)
    try:
        info = _wait(ptw.get_latest_preemption_info, 10, "PreemptionInfo")
        assert info.deadline_ms == deadline_ms and info.preempted_ranks == [0]
    finally:
        ptw._stop_event.set()

    # When the work is gone the node exits, recorded as a preemption with our message.
    ray.kill(busy)
    dead = _wait(lambda: next((n for n in ray.nodes() if n["NodeID"] == worker.node_id and not n["Alive"]),
                              None), what="drained node to exit")
    assert dead["DeathReason"] == common_pb2.NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED
    assert dead["DeathReasonMessage"] == f"AWS spot instance-action: terminate at {when}"


def test_early_warning_record_keeps_the_grow_check_off_that_node(ray_cluster):
    """The watcher's early-warning record (written through the daemon's GcsClient, no ray.init) is what the
    grow check reads inside a job (spot.early_warning.without_warned, called by train.elastic.GrowCheck); a
    withdrawn warning stops counting."""
    import ray

    from spotfill.spot.early_warning import without_warned
    from spotfill.spot.sources.aws import parse_rebalance, reading

    cluster, worker = ray_cluster
    head = next(n["NodeID"] for n in ray.nodes() if n["NodeID"] != worker.node_id)
    drainer = spot.RayNodeDrainer(address=cluster.address)
    (notice,) = reading(None, parse_rebalance('{"noticeTime": "2026-11-29T12:00:00Z"}'), now=time.time()).notices
    candidates = {worker.node_id: {"GPU_SLOT": 1.0}, head: {"CPU": 1.0}}
    assert without_warned(candidates) == candidates
    drainer.warn(notice, False, time.time())
    assert without_warned(candidates) == {head: {"CPU": 1.0}}
    drainer.warn(notice, True, time.time())
    assert without_warned(candidates) == candidates
    assert not drainer.has_left()                                # nothing drained by it
