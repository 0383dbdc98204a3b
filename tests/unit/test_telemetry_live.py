"""Live metrics from the event stream (pure): the same GPU-seconds as the ledger, event by event."""
import json

import pytest

from spotfill.telemetry.events import EventLog
from spotfill.telemetry.ledger import compute_ledger
from spotfill.telemetry.live import METRICS, LiveMetrics
from test_telemetry_ledger import NODES, fillin_log, hard_loss_log


def feed(events):
    live, updates = LiveMetrics(), []
    for e in events:
        updates.append(live.update(e))
    return live, updates


def test_gpu_seconds_match_the_ledger_on_the_hard_loss_log():
    ev = hard_loss_log()
    live, _ = feed(ev)
    gs = compute_ledger(ev, NODES).gpu_seconds
    # by hand (test_telemetry_ledger): training 76, checkpoint_stall 8
    assert live.totals["training"] == pytest.approx(76.0) == gs["training"]
    assert live.totals["checkpoint_stall"] == pytest.approx(8.0) == gs["checkpoint_stall"]
    # recovering, event by event: 0->10 on the first group's 4; the gap 25->40 ending in attempt 1 and its
    # start 40->45 on the new group's 2. (The ledger sees more: the hung group kept its 4 until n1 died.)
    assert live.totals["recovering"] == pytest.approx(4 * 10 + 2 * 15 + 2 * 5)
    assert gs["recovering"] == pytest.approx(4 * 10 + 4 * 5 + 2 * 10 + 2 * 5)


def test_a_group_end_books_the_teardown_on_the_old_group():
    ev = hard_loss_log() + [{"t": 35.0, "kind": "group_end", "group": 1}]
    live, _ = feed(sorted(ev, key=lambda e: e["t"]))
    # 25->35 on the old group's 4 GPUs, 35->40 (ending in attempt 1) and 40->45 on the new group's 2
    assert live.totals["recovering"] == pytest.approx(4 * 10 + 4 * 10 + 2 * 5 + 2 * 5)


def test_step_gauges_and_counters():
    live, updates = feed(hard_loss_log())
    steps = [u for e, u in zip(hard_loss_log(), updates) if e["kind"] == "step"]
    last = steps[-1].gauges
    tags = (("job", "j"),)
    assert last[("spotfill_training_step", tags)] == 10 and last[("spotfill_world_size", tags)] == 2
    assert last[("spotfill_tokens_per_second", tags)] == pytest.approx(100 / 2.0)
    assert last[("spotfill_data_wait_fraction", tags)] == pytest.approx(0.25)
    assert steps[-1].counters[("spotfill_tokens_total", tags)] == 100
    restarts = [u.counters for u in updates if any(k[0] == "spotfill_restarts_total" for k in u.counters)]
    assert len(restarts) == 1                                   # attempt 1 is the one restart
    for u in updates:
        assert {k[0] for k in list(u.gauges) + list(u.counters)} <= set(METRICS)


def test_fillin_accrues_while_a_lease_is_open():
    ev = sorted(fillin_log(), key=lambda e: e["t"])
    live, updates = feed(ev)
    # serve: 2 GPUs 10->50 = 80; batch: 1 GPU from 60 to the last event (100) = 40
    assert live.totals["fillin"] == pytest.approx(120.0)
    reclaim = next(u for e, u in zip(ev, updates) if e["kind"] == "reclaim")
    assert reclaim.gauges[("spotfill_fillin_gpus", (("job", "spotfill"), ("node", "n1"), ("workload", "serve")))] == 0


def test_event_log_calls_its_observer_for_every_event_but_samples(tmp_path):
    seen = []
    log = EventLog(str(tmp_path / "events.jsonl"), on_event=seen.append)
    log.write("job_start", name="j")
    log.write_many([{"t": 1.0, "kind": "step", "step": 1}, {"t": 1.0, "kind": "samples", "ids": [1]}])
    log.close()
    assert [e["kind"] for e in seen] == ["job_start", "step"]
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in lines] == ["job_start", "step", "samples"]


def test_a_failing_observer_never_breaks_the_log(tmp_path):
    def boom(_e):
        raise RuntimeError("metrics down")
    log = EventLog(str(tmp_path / "events.jsonl"), on_event=boom)
    log.write("job_start")
    log.close()
    assert "job_start" in (tmp_path / "events.jsonl").read_text()


def test_grafana_dashboard_uses_only_exported_series():
    import pathlib
    import re
    path = pathlib.Path(__file__).parents[2] / "deploy" / "grafana" / "spotfill.json"
    dash = json.loads(path.read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in re.findall(r"ray_(spotfill_\w+)", t["expr"])}
    assert used and used <= set(METRICS), used - set(METRICS)
    assert {"spotfill_gpu_seconds_total", "spotfill_training_step", "spotfill_tokens_per_second",
            "spotfill_world_size", "spotfill_checkpoint_stall_seconds"} <= used


def test_step_split_and_nvml_gauges():
    lm = LiveMetrics(job="j")
    lm.update({"t": 1.0, "kind": "job_start", "name": "j"})
    u = lm.update({"t": 2.0, "kind": "step", "step": 1, "attempt": 0, "world_size": 1, "tokens": 100,
                   "step_s": 0.5, "data_wait_s": 0.05, "forward_backward_s": 0.3, "optimizer_s": 0.1,
                   "collective_wait_s": 0.05, "mfu": None, "gpu_util": 0.97, "gpu_mem_used_gb": 12.5})
    g = {name: v for (name, _tags), v in u.gauges.items()}
    assert g["spotfill_forward_backward_fraction"] == 0.6 and g["spotfill_optimizer_fraction"] == 0.2
    assert g["spotfill_collective_wait_fraction"] == 0.1 and g["spotfill_data_wait_fraction"] == 0.1
    assert g["spotfill_gpu_utilization"] == 0.97 and g["spotfill_gpu_memory_used_bytes"] == 12.5e9
    assert "spotfill_mfu" not in g          # null on a CPU: no series rather than a made-up zero


def test_a_later_runs_first_group_is_not_a_restart():
    lm = LiveMetrics(job="j")
    u = lm.update({"t": 1.0, "kind": "attempt", "attempt": 3, "world_size": 1, "cause": "first start"})
    assert not [k for k in u.counters if k[0] == "spotfill_restarts_total"]
    u = lm.update({"t": 2.0, "kind": "attempt", "attempt": 4, "world_size": 1, "cause": "planned: grow"})
    assert [k for k in u.counters if k[0] == "spotfill_restarts_total"]


def test_live_gpu_seconds_count_the_gpus_ray_assigned_as_the_ledger_does():
    from test_telemetry_ledger import assigned_log
    ev = assigned_log()
    live, _ = feed(ev)
    gs = compute_ledger(ev).gpu_seconds
    # the attempt records 2 GPUs Ray assigned; the plan (2 workers x 2 gpus_per_worker) would say 4
    assert live.totals["training"] == pytest.approx(2 * 10) == gs["training"]
    assert live.totals["checkpoint_stall"] == pytest.approx(2 * 1) == gs["checkpoint_stall"]
