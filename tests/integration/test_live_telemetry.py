"""Per-step metrics, the live view and `spotfill status --address` on a real run: a tiny model trained by
two workers on an embedded cluster (one spot-labelled node with 2 GPU slots).

- every step event carries the split (data wait, forward+backward, optimizer, collective wait) adding up to
  the step, tokens/s, and MFU/HFU null (CPU: no peak), and the group's start event the model's FLOPs per
  token and, with full activation checkpointing, its hardware FLOPs per token, checked against the tiny
  preset's size worked out by hand;
- report.json's training section carries the split and null MFU/HFU;
- the live view prints plain lines (stderr is not a TTY here);
- while the job runs, `spotfill status --address` (a separate process) shows its live numbers and the
  node's market type; after it, the job is gone from the status.

Run under the shared lock: flock /tmp/spotfill-ray.lock timeout 900 python -m pytest -q <this file>
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from spotfill.telemetry.events import read_events

# Slow (CI's 40-minute budget): about 100 s on 2 cores; the live view runs in CI in
# tests/unit/test_telemetry_live.py. Run with -m slow.
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 900
# tiny preset (presets.py): vocab 257, 64 positions, 2 layers of width 64, 4x MLP, untied head:
#   wte 257*64 = 16,448   wpe 64*64 = 4,096   per block: 2 LayerNorms 2*128, qkv 64*192+192 = 12,480,
#   proj 64*64+64 = 4,160, MLP 64*256+256 + 256*64+64 = 33,088 -> 49,984; two blocks 99,968;
#   ln_f 128; head 64*257 = 16,448.  All parameters: 137,088
#   PaLM's N leaves out the lookups wte and wpe: 137,088 - 16,448 - 4,096 = 116,544
#   FLOPs/token = 6N + 12*L*h*s = 699,264 + 12*2*64*64 = 699,264 + 98,304 = 797,568
#   with training.activation_checkpointing: full, the blocks' forward runs again in backward:
#   hardware FLOPs/token = 797,568 + 2 * 99,968 + 4*L*h*s (32,768) = 1,030,272
TINY_PARAMS, TINY_FLOPS_PER_TOKEN, TINY_HARDWARE_FLOPS_PER_TOKEN = 137_088, 797_568.0, 1_030_272.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    from spotfill.config.job import PrepareConfig, from_mapping
    from ray.cluster_utils import Cluster

    from spotfill.ray_compat import single_host_loopback
    from spotfill.sim.cluster import FAST_FAILURE_DETECTION, LOOPBACK_NODE, worker_env
    from spotfill.train.prepare import prepare

    # the embedded cluster's layout without its dashboard (nothing here needs it; its fixed port may be taken)
    before = single_host_loopback(True)
    c = Cluster(initialize_head=True, head_node_args={**LOOPBACK_NODE, "num_cpus": 1, "include_dashboard": False,
                                                      "_system_config": dict(FAST_FAILURE_DETECTION)})  # Ray adds to the dict it is given
    try:
        c.add_node(**LOOPBACK_NODE, num_cpus=2, resources={"GPU_SLOT": 2},
                   labels={"spotfill.io/market-type": "spot", "spotfill.io/role": "gpu-worker"})
        ray.init(address=c.address, runtime_env={"env_vars": worker_env()}, log_to_driver=False,
                 logging_level="WARNING")
        data = str(tmp_path_factory.mktemp("data"))
        prepare(from_mapping(PrepareConfig, {"source": os.path.dirname(json.__file__), "output": data,
                                             "seq_len": 64, "suffixes": [".py"]}))
        yield c, data
    finally:
        ray.shutdown()
        c.shutdown()
        single_host_loopback(before)


def _status(address: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "platform")}
    return subprocess.run([sys.executable, "-m", "spotfill", "status", "--address", address, *extra],
                          env=env, capture_output=True, text=True, timeout=120)


def test_step_metrics_live_view_and_status(cluster, tmp_path, capsys):
    from spotfill.config.job import JobConfig, from_mapping
    from spotfill.ray_compat import kv_list
    from spotfill.sim.cluster import worker_env
    from spotfill.train.job import TrainingJob

    c, data = cluster
    cfg = from_mapping(JobConfig, {
        "name": "live-telemetry", "run_dir": str(tmp_path / "run"), "storage": str(tmp_path / "ckpt"),
        "data": {"path": data}, "cluster": {"gpu_resource": "GPU_SLOT"},
        "training": {"model": "tiny", "workers": [2, 2], "steps": STEPS, "global_batch": 16,
                     "checkpoint_every": 300, "activation_checkpointing": "full"}})
    job = TrainingJob(cfg, runtime_env={"env_vars": worker_env()}, live=True)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(report=job.fit()), daemon=True)
    thread.start()
    # wait for training to step, then ask the status command (its own process, its own Ray driver)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any(
            e["kind"] == "step" and e["step"] >= 20 for e in read_events(job.events_path, {"step"})):
        assert thread.is_alive(), "training ended before its 20th step"
        time.sleep(0.5)
    st = _status(c.address)
    js = _status(c.address, "--json")
    steps_at_status = max(e["step"] for e in read_events(job.events_path, {"step"}))
    thread.join(timeout=600)
    assert "report" in result, "training did not finish"
    assert st.returncode == 0, st.stderr[-3000:]
    assert steps_at_status < STEPS, "training finished before the status was read: raise STEPS"
    out = st.stdout
    assert "training jobs (1):" in out and "job live-telemetry: training" in out, out
    assert f"/{STEPS} loss " in out and "world 2" in out and "MFU n/a (CPU)" in out, out
    assert "step split: data wait" in out and "collective wait" in out, out
    assert "spot" in out and "gpu-worker" in out, out                    # the node's market type and role
    assert "fill-in arbiter: none on this cluster" in out
    live = json.loads(js.stdout)["live_jobs"]
    assert live[0]["job"] == "live-telemetry" and live[0]["sink_alive"] and live[0]["mfu"] is None
    assert [n["market"] for n in json.loads(js.stdout)["cluster_nodes"] if n["gpus"]] == ["spot"]

    # after the run the job is gone from the live list
    assert kv_list("jobs/") == []

    events = list(read_events(job.events_path))
    # the worker group's placement and teardown, as Ray Train's controller saw them: the ledger's evidence
    # of when training held its GPUs
    groups = [(e["kind"], e["group"]) for e in events if e["kind"] in ("group_start", "group_end")]
    attempt = next(e for e in events if e["kind"] == "attempt")
    finish = next(e for e in events if e["kind"] == "finish")
    assert groups == [("group_start", 1), ("group_end", 1)] and attempt["group"] == 1
    assert next(e for e in events if e["kind"] == "group_start")["t"] <= attempt["t"]
    assert next(e for e in events if e["kind"] == "group_end")["t"] >= finish["t"]
    start = next(e for e in events if e["kind"] == "start")
    assert start["params"] == TINY_PARAMS and start["flops_per_token"] == TINY_FLOPS_PER_TOKEN
    assert start["hardware_flops_per_token"] == TINY_HARDWARE_FLOPS_PER_TOKEN and start["recompute"] == "full"
    assert start["device"] == "cpu" and start["peak_flops_per_gpu"] is None
    steps = [e for e in events if e["kind"] == "step"]
    assert len(steps) == STEPS
    for e in steps:
        assert e["forward_backward_s"] > 0 and e["optimizer_s"] > 0 and e["collective_wait_s"] >= 0
        parts = e["data_wait_s"] + e["forward_backward_s"] + e["optimizer_s"] + e["collective_wait_s"]
        assert parts == pytest.approx(e["step_s"], rel=1e-6, abs=1e-9)
        assert e["tokens_per_s"] == pytest.approx(e["tokens"] / e["step_s"])
        assert e["mfu"] is None and e["hfu"] is None
    # two ranks wait for each other in the step's gather: some collective wait is measured
    assert sum(e["collective_wait_s"] for e in steps) > 0

    tr = json.loads(open(os.path.join(job.run_dir, "report.json")).read())["training"]
    assert tr["mfu"] is None and tr["hfu"] is None and tr["peak_flops_per_gpu"] is None
    assert tr["flops_per_token"] == TINY_FLOPS_PER_TOKEN and tr["devices"] == ["cpu"]
    split = tr["step_time_split_s"]
    assert {"data_wait", "forward_backward", "optimizer", "collective_wait", "checkpoint_stall"} <= set(split)
    assert split["data_wait"] + split["forward_backward"] + split["optimizer"] + split["collective_wait"] == \
        pytest.approx(sum(e["step_s"] for e in steps), rel=1e-3)

    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("[spotfill] ")]
    text = "\n".join(lines)
    assert "job live-telemetry started" in text and "attempt 0: start from scratch on 2 workers (cpu" in text
    assert "checkpoint committed at step 300" in text and f"training finished at step {STEPS}" in text
    assert f"step {STEPS}/{STEPS} loss" in text
