"""Every notice source against its HTTP stand-in (or a real signal): the notice, a withdrawn notice, a
malformed answer, and a metadata server that stops answering (the watcher keeps going and says so once);
GCP's wait_for_change, Azure's acknowledgement, early-warning records, Kubernetes' SIGTERM; the CLI's
--source; and notice -> drain latency (printed, not asserted: run with -s)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from spotfill.spot import watcher as spot
from spotfill.spot.sources.aws import AwsSource
from spotfill.spot.sources.azure import AzureSource
from spotfill.spot.sources.gcp import GcpSource
from spotfill.spot.sources.kubernetes import KubernetesSource
from spotfill.testing.azure_events import AzureEventsStandin
from spotfill.testing.gcp_metadata import MAINTENANCE_PATH, PREEMPTED_PATH, GcpMetadataStandin
from spotfill.testing.imds import ImdsStandin
from spotfill.testing.kube_api import KubeApiStandin

PLATFORM = str(Path(__file__).resolve().parents[2] / "platform")
TIMEOUT_S = 0.3


class RecordingDrain:
    def __init__(self, fail_first: int = 0):
        self.calls: list[spot.Decision] = []
        self.at: list[float] = []
        self.fail_left = fail_first

    def __call__(self, decision):
        self.calls.append(decision)
        self.at.append(time.monotonic())
        if self.fail_left > 0:
            self.fail_left -= 1
            raise spot.DrainError("GCS unreachable (simulated)")
        return "node fake"


class Aws:
    """Adapter: one way to publish / withdraw / garble a notice per stand-in."""
    name, garbled_drains = "aws", True      # IMDS: a 200 on instance-action is a notice even when garbled

    def __init__(self):
        self.server = ImdsStandin().start()

    def source(self):
        return AwsSource(self.server.url, timeout_s=TIMEOUT_S)

    def publish(self):
        self.server.set_notice("terminate", 120)
        self.published = time.monotonic()

    def withdraw(self):
        self.server.clear_notice()

    def garble(self):
        with self.server._lock:
            self.server._notice = "not json"           # served as json.dumps("not json"): a JSON string

    def warn_on(self):
        self.server.set_rebalance()

    def warn_off(self):
        self.server.clear_rebalance()

    def hang(self, on: bool):
        self.server.set_delay(2.0 if on else 0.0)


class Gcp(Aws):
    name, garbled_drains = "gcp", False

    def __init__(self):
        self.server = GcpMetadataStandin().start()

    def source(self):
        return GcpSource(self.server.url, timeout_s=TIMEOUT_S)

    def publish(self):
        self.server.set_preempted(True)
        self.published = self.server.published_at

    def withdraw(self):
        self.server.set_preempted(False)

    def garble(self):
        self.server.set_value(PREEMPTED_PATH, "<html>500</html>")

    def warn_on(self):
        self.server.set_maintenance("MIGRATE_ON_HOST_MAINTENANCE")

    def warn_off(self):
        self.server.set_maintenance("NONE")


class Azure(Gcp):
    name = "azure"

    def __init__(self):
        self.server = AzureEventsStandin().start()

    def source(self):
        return AzureSource(self.server.url, timeout_s=TIMEOUT_S)

    def publish(self):
        self.event = self.server.add_event("Preempt", 30)
        self.published = self.server.published_at

    def withdraw(self):
        self.server.remove_event(self.event)

    def garble(self):
        self.server.set_raw("<html>")

    def warn_on(self):
        self.warning = self.server.add_event("Freeze", 300)

    def warn_off(self):
        self.server.remove_event(self.warning)


class Kube(Gcp):
    name = "kubernetes"

    def __init__(self):
        self.server = KubeApiStandin().start()

    def source(self):
        return KubernetesSource(self.server.url, node_name=self.server.node_name, deadline_s=30,
                                timeout_s=TIMEOUT_S, token_path="/nonexistent")

    def publish(self):
        self.server.set_taint("cloud.google.com/impending-node-termination")
        self.published = self.server.published_at

    def withdraw(self):
        self.server.clear_taints()

    def garble(self):
        self.server.set_raw("{not json")

    def warn_on(self):
        pytest.skip("Kubernetes has no early warning")


@pytest.fixture(params=[Aws, Gcp, Azure, Kube], ids=lambda c: c.name)
def platform(request):
    p = request.param()
    try:
        yield p
    finally:
        p.server.stop()


def test_notice_drains_once_with_a_deadline(platform):
    drain = RecordingDrain()
    w = spot.SpotWatcher(platform.source(), drain)
    assert w.poll_once().status == "no-notice"
    platform.publish()
    out = w.poll_once()
    assert out.status == "drained" and len(drain.calls) == 1
    d = drain.calls[0]
    assert d.reason == "DRAIN_NODE_REASON_PREEMPTION" and 0 < d.remaining_s <= 121
    assert [w.poll_once().status for _ in range(2)] == ["already-drained"] * 2 and len(drain.calls) == 1


def test_withdrawn_notice(platform, caplog):
    drain = RecordingDrain(fail_first=1)
    w = spot.SpotWatcher(platform.source(), drain)
    platform.publish()
    assert w.poll_once().status == "drain-failed"
    platform.withdraw()                                          # gone before a drain went through: none
    assert w.poll_once().status == "no-notice" and len(drain.calls) == 1
    platform.publish()
    assert w.poll_once().status == "drained"
    platform.withdraw()                                          # gone after the drain: said once
    with caplog.at_level(logging.WARNING, logger="spotfill.spot.watcher"):
        assert [w.poll_once().status for _ in range(3)] == ["no-notice"] * 3
    assert sum("withdrawn after this node was drained" in r.getMessage() for r in caplog.records) == 1
    assert len(drain.calls) == 2


def test_malformed_answer_is_reported_once(platform, caplog):
    drain = RecordingDrain()
    w = spot.SpotWatcher(platform.source(), drain)
    platform.garble()
    with caplog.at_level(logging.WARNING, logger="spotfill.spot.watcher"):
        statuses = [w.poll_once().status for _ in range(3)]
    if platform.garbled_drains:
        assert statuses == ["drained", "already-drained", "already-drained"]
        assert drain.calls[0].deadline_s is not None
    else:
        assert statuses == ["no-notice"] * 3 and drain.calls == []
    assert sum("unusable answer" in r.getMessage() for r in caplog.records) == 1


def test_server_that_stops_answering_is_said_once_and_survived(platform, caplog):
    drain = RecordingDrain()
    w = spot.SpotWatcher(platform.source(), drain)
    assert w.poll_once().status == "no-notice"
    platform.hang(True)
    with caplog.at_level(logging.INFO, logger="spotfill.spot.watcher"):
        outs = [w.poll_once() for _ in range(3)]
        assert [o.status for o in outs] == ["imds-error"] * 3 and "timed out" in outs[0].detail
        platform.hang(False)
        platform.publish()
        assert w.poll_once().status == "drained"
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("metadata poll failed" in m for m in msgs) == 1
    assert sum("reachable again" in m for m in msgs) == 1


def test_early_warning_is_recorded_not_drained_and_withdrawn(platform):
    drain, warns = RecordingDrain(), []
    w = spot.SpotWatcher(platform.source(), drain, warn=lambda n, withdrawn, now: warns.append((n.event, withdrawn)))
    platform.warn_on()
    statuses = [w.poll_once().status for _ in range(3)]
    assert len(set(statuses)) == 1 and statuses[0] not in ("drained", "no-notice")
    assert drain.calls == [] and len(warns) == 1 and warns[0][1] is False
    platform.warn_off()
    w.poll_once()
    assert len(warns) == 2 and warns[1][1] is True and drain.calls == []


def test_gcp_wait_for_change_wakes_the_watcher_before_its_poll_interval():
    with GcpMetadataStandin() as server:
        drain = RecordingDrain()
        w = spot.SpotWatcher(GcpSource(server.url, timeout_s=TIMEOUT_S), drain)
        stop = threading.Event()
        t = threading.Thread(target=w.run, args=(30.0, stop), daemon=True)   # a poll every 30 s only
        t.start()
        _until(lambda: server.waiting == 2, "both wait_for_change watches to be held")
        server.set_preempted(True)
        _until(lambda: drain.calls, "the drain")                 # long before the next 30 s poll
        stop.set()
        t.join(timeout=10)
        assert len(drain.calls) == 1 and drain.calls[0].kind == "preempted"
        assert server.count("GET", PREEMPTED_PATH) >= 2 and server.count("GET", MAINTENANCE_PATH) >= 1


def test_azure_acknowledges_only_once_this_nodes_work_left():
    with AzureEventsStandin() as server:
        left = threading.Event()
        w = spot.SpotWatcher(AzureSource(server.url, timeout_s=TIMEOUT_S), RecordingDrain(), left=left.is_set)
        event = server.add_event("Preempt", 30)
        assert w.poll_once().status == "drained"
        assert w.poll_once().status == "already-drained" and server.acked == []
        left.set()
        w.poll_once()
        w.poll_once()
        assert server.acked == [event]                           # once
        other = server.add_event("Preempt", 30)
        left.clear()
        assert w.poll_once().status == "drained"
        server.remove_event(other)                               # cancelled before the work left: no ack
        left.set()
        w.poll_once()
        assert server.acked == [event]


def test_kubernetes_sigterm_is_the_notice_and_ends_the_watcher():
    source = KubernetesSource("", deadline_s=120)                # no API server: SIGTERM only
    drain = RecordingDrain()
    w = spot.SpotWatcher(source, drain)
    assert w.poll_once().status == "no-notice"
    previous = signal.signal(signal.SIGTERM, source.on_sigterm)
    try:
        t = threading.Thread(target=w.run, args=(30.0, threading.Event()), daemon=True)
        t.start()
        time.sleep(0.2)
        sent = time.time()
        os.kill(os.getpid(), signal.SIGTERM)                     # what the kubelet sends the sidecar
        t.join(timeout=10)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not t.is_alive(), "the watcher ends once the SIGTERM notice is drained"
    (d,) = drain.calls
    assert d.kind == "SIGTERM" and d.deadline_s == pytest.approx(sent + 120, abs=1.0)


def test_notice_to_drain_latency_per_source():
    """notice published by the stand-in -> drain requested, the watcher's run loop as deployed (AWS and
    Azure at a 0.5 s poll, GCP with wait_for_change at a 30 s poll, Kubernetes SIGTERM). Printed."""
    results = {}
    for cls, poll_s in ((Aws, 0.5), (Gcp, 30.0), (Azure, 0.5), (Kube, 0.5)):
        p = cls()
        try:
            times = []
            for _ in range(3):
                drain = RecordingDrain()
                w = spot.SpotWatcher(p.source(), drain)
                stop = threading.Event()
                t = threading.Thread(target=w.run, args=(poll_s, stop), daemon=True)
                t.start()
                time.sleep(0.3)
                p.publish()
                _until(lambda: drain.calls, f"{cls.name} drain")
                times.append(drain.at[0] - p.published)
                stop.set()
                t.join(timeout=10)
                p.withdraw()
            results[cls.name] = max(times)
        finally:
            p.server.stop()
    source = KubernetesSource("", deadline_s=120)
    drain = RecordingDrain()
    stop = threading.Event()
    t = threading.Thread(target=spot.SpotWatcher(source, drain).run, args=(30.0, stop), daemon=True)
    t.start()
    time.sleep(0.2)
    sent = time.monotonic()
    source.on_sigterm()
    _until(lambda: drain.calls, "SIGTERM drain")
    results["kubernetes-sigterm"] = drain.at[0] - sent
    stop.set()
    t.join(timeout=10)
    print("\nnotice -> drain requested (max of 3, s): " + ", ".join(f"{k} {v:.3f}" for k, v in results.items()))
    assert set(results) == {"aws", "gcp", "azure", "kubernetes", "kubernetes-sigterm"}


def _until(pred, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# --- CLI -------------------------------------------------------------------------------------------
def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([PLATFORM, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "spotfill", "spot-watch", *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("standin,source", [(GcpMetadataStandin, "gcp"), (AzureEventsStandin, "azure")])
def test_cli_once_with_a_source(standin, source):
    with standin() as server:
        r = run_cli("--once", "--source", source, "--endpoint", server.url)
    assert r.returncode == 0 and "no notice" in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert f"notice source {source}" in r.stderr


@pytest.mark.parametrize("args,field", [
    (["--source", "openstack"], "--source"),
    (["--source", "gcp", "--deadline-s", "30"], "--deadline-s"),
    (["--endpoint", "http://a", "--imds-endpoint", "http://b"], "--endpoint"),
    (["--source", "kubernetes", "--deadline-s", "x"], "--deadline-s"),
])
def test_cli_bad_source_flags_exit_2_one_line(args, field):
    r = run_cli("--once", *args)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert field in r.stderr and "Traceback" not in r.stderr
