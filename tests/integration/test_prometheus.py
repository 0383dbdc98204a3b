"""`spotfill_*` series reach a Ray node's Prometheus endpoint: events recorded in an actor (as the event
sink records them) show up at http://127.0.0.1:<metrics_export_port>/metrics (Ray prefixes `ray_`)."""
import time
import urllib.request

import pytest
from spotfill.testing.ports import free_port

ray = pytest.importorskip("ray")

WAIT_S = 60


@pytest.fixture(scope="module")
def metrics_port():
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 500}, logging_level="WARNING", log_to_driver=False)
    try:
        yield port
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
class Recorder:
    def record(self, events):
        from spotfill.telemetry.prometheus import record
        for e in events:
            record(e)
        return True


def events():
    ev = [{"t": 100.0, "kind": "job_start", "name": "promtest"},
          {"t": 101.0, "kind": "attempt", "attempt": 0, "world_size": 2},
          {"t": 102.0, "kind": "start", "attempt": 0, "step": 0, "world_size": 2, "startup_s": 1.0}]
    ev += [{"t": 102.0 + i, "kind": "step", "step": i, "attempt": 0, "world_size": 2, "loss": 3.0 - 0.1 * i,
            "tokens": 512, "step_s": 1.0, "data_wait_s": 0.25, "compute_s": 0.75} for i in range(1, 6)]
    ev += [{"t": 107.5, "kind": "checkpoint_save", "attempt": 0, "step": 5, "stall_s": 0.5, "emergency": False}]
    return ev


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_series_appear_on_the_node_metrics_endpoint(metrics_port):
    rec = Recorder.remote()
    assert ray.get(rec.record.remote(events()))
    # the node's own view of its export port agrees with the one we asked for
    assert ray.nodes()[0]["MetricsExportPort"] == metrics_port
    wanted = {
        'ray_spotfill_training_step{': "5.0",
        'ray_spotfill_world_size{': "2.0",
        'ray_spotfill_tokens_per_second{': "512.0",
        'ray_spotfill_checkpoint_stall_seconds{': "0.5",
    }
    deadline, text = time.monotonic() + WAIT_S, ""
    while time.monotonic() < deadline:
        text = scrape(metrics_port)
        if all(k in text for k in wanted) and 'state="training"' in text:
            break
        time.sleep(1.0)
    lines = [ln for ln in text.splitlines() if ln.startswith("ray_spotfill_")]
    for prefix, value in wanted.items():
        line = next((ln for ln in lines if ln.startswith(prefix) and 'job="promtest"' in ln), None)
        assert line is not None, f"{prefix} not on the endpoint after {WAIT_S}s; spotfill lines: {lines}"
        assert float(line.rsplit(" ", 1)[1]) == float(value), line
    # GPU-seconds by state: 5 steps x 1 s x 2 GPUs training; 0.5 s x 2 stall; 2 s before step 1 x 2 recovering
    gs = {s: next(float(ln.rsplit(" ", 1)[1]) for ln in lines
                  if ln.startswith("ray_spotfill_gpu_seconds_total{") and f'state="{s}"' in ln)
          for s in ("training", "checkpoint_stall", "recovering")}
    assert gs == {"training": 10.0, "checkpoint_stall": 1.0, "recovering": 4.0}
