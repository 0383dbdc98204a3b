"""The README's "## Python SDK" example runs as a newcomer would run it.

The python block is taken from README.md verbatim and run by this interpreter in a subprocess, against a
Ray head this module starts the way the README says (`ray start --head --num-cpus=2 --num-gpus=2`), bound to 127.0.0.1 with its own ports and temp dir, found through RAY_ADDRESS (with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, without which Ray rewrites a 127.0.0.1 address to the machine's). The subprocess runs in
a copy of the repository's `examples/` whose /tmp/spotfill paths point into this test's tmp dir, so a
previous run's checkpoints cannot leak in; spotfill is imported from this checkout (as `pip install -e .`
would), by the driver and by the head's workers.

Run under the shared lock: flock /tmp/spotfill-ray.lock timeout 900 python3 -m pytest -q -x <this file>
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from spotfill.sim.cluster import LOOPBACK_CLIENT_ENV
from test_jobs_submit import MARK, RAY, _free_ports, _stop_head   # this folder's head helpers

REPO = Path(__file__).resolve().parents[2]
PLATFORM = str(REPO / "platform")


def readme_sdk_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Python SDK\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in '## Python SDK', found {len(blocks)}"
    return blocks[0]


@pytest.fixture(scope="module")
def head():
    temp_dir = tempfile.mkdtemp(prefix="sfsdk-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # `ray start --head` turns token auth on for a local head; a driver given RAY_ADDRESS must then carry
    # the token (as in test_jobs_submit): one made up here, for this head only.
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [PLATFORM, env.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex * 2,
               **{MARK: temp_dir}, **LOOPBACK_CLIENT_ENV)
    gcs, client, nm, om, agent, agent_grpc, renv, metrics = _free_ports(8)
    cmd = [RAY, "start", "--head", "--num-cpus=2", "--num-gpus=2",   # the README's command
           "--node-ip-address=127.0.0.1", f"--port={gcs}", "--include-dashboard=false",
           "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}", f"--node-manager-port={nm}",
           f"--object-manager-port={om}", f"--dashboard-agent-listen-port={agent}",
           f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={renv}",
           f"--metrics-export-port={metrics}", "--object-store-memory=200000000", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    try:
        out = subprocess.run(cmd, env=env, cwd=temp_dir, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        yield {"address": f"127.0.0.1:{gcs}", "env": env}
    finally:
        _stop_head(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def examples(tmp_path) -> Path:
    """tmp_path/examples: the repository's examples with /tmp/spotfill/ moved under tmp_path."""
    root = tmp_path / "sdk"
    (root / "examples").mkdir(parents=True)
    for src in (REPO / "examples").glob("*.yaml"):
        (root / "examples" / src.name).write_text(src.read_text().replace("/tmp/spotfill/", f"{tmp_path}/spotfill/"))
    assert f"{tmp_path}/spotfill/checkpoints/tiny-cpu" in (root / "examples" / "tiny-cpu.yaml").read_text()
    return root


def test_readme_python_sdk_example_runs(head, examples, tmp_path):
    code = readme_sdk_block()
    assert "spotfill.TrainingJob" in code and "spotfill.prepare" in code and "spotfill.plan" in code
    env = {**head["env"], "RAY_ADDRESS": head["address"]}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], cwd=examples, env=env, capture_output=True, text=True,
                       timeout=600)
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    # the example's own two lines (Ray may interleave worker log lines on stdout)
    printed = [ln for ln in r.stdout.splitlines() if not ln.startswith("(")]
    loss = [ln for ln in printed if re.match(r"^\d+\.\d+(e-?\d+)? \{", ln)]
    memory = [ln for ln in printed if ln.startswith("{'params'")]
    assert len(loss) == 1 and float(loss[0].split(" ", 1)[0]) > 0, r.stdout[-3000:]  # final_loss, samples
    assert ast.literal_eval(memory[-1])["total"] > 0, r.stdout[-3000:]              # plan()'s memory_per_gpu_gb
    report = json.loads((tmp_path / "spotfill" / "runs" / "tiny-cpu" / "report.json").read_text())
    assert report["ok"] is True and report["training"]["steps_completed"] == 20, report
    assert (tmp_path / "spotfill" / "data" / "stdlib-json-64" / "manifest.json").is_file()
    print(f"\nREADME SDK example: {seconds:.1f}s")
