"""cluster.yaml's start commands, run for real: the head's `ray start --head` line and the workers' `ray start`
line, as `ray up` would run them on EC2, here on 127.0.0.1.

The commands are taken from the file and changed only where this machine differs from an EC2 node: ports
(free ones, so other clusters on the machine are not touched), loopback addresses, a private temp dir, the
instance-metadata address (the IMDS stand-in, which says the instance is spot), the bootstrap config path
(the prepared cluster.yaml, as `ray up` writes it) and the `ray` executable; `ray stop` (which would end
every Ray process of the user) and the spot-watch daemon are not run. `ray up`'s own environment
(RAY_UP_enable_autoscaler_v2 and what it exports) is not given: the file must turn autoscaler v2 on by itself.

What the head really runs is then read from the head: the GCS's autoscaler-v2 flag (what Ray's clients
read), the monitor process's entrypoint (v2's), the head node as autoscaler v2 sees it (its cloud instance
id and node type, without which v2 never scales), the worker's labels, and the health-check settings in
force, measured: a worker whose processes are frozen (SIGSTOP: no TCP reset, like a host that vanished) is
declared dead within CLUSTER.silent_node_bound_s(), where Ray's defaults take over a minute.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from spotfill.config.failure_detection import CLUSTER, RAY_DEFAULT
from test_jobs_submit import MARK, RAY, _free_ports, _head_processes, _stop_head

ROOT = Path(__file__).resolve().parents[2]
INSTANCE_ID = "i-0headstandin00001"
IMDS = "http://169.254.169.254"


def _rewrite(cmd: str, subs: list[tuple[str, str]]) -> str:
    """Each (old, new) replaced; each old must occur: a changed cluster.yaml fails here, loudly."""
    for old, new in subs:
        assert old in cmd, f"{old!r} not in {cmd!r}"
        cmd = cmd.replace(old, new)
    return cmd


def _isolation(temp_dir: str, n_ports: int = 7) -> str:
    """Flags that keep a second Ray node on this machine off every default port and the default temp dir."""
    nm, agent, agent_grpc, renv, metrics, dash, client = _free_ports(n_ports)
    return (f" --node-ip-address=127.0.0.1 --temp-dir={temp_dir} --node-manager-port={nm}"
            f" --dashboard-agent-listen-port={agent} --dashboard-agent-grpc-port={agent_grpc}"
            f" --runtime-env-agent-port={renv} --metrics-export-port={metrics} --dashboard-port={dash}"
            f" --ray-client-server-port={client} --num-cpus=1 --object-store-memory=100000000"
            f" --disable-usage-stats"), nm


def _ray_start(cmds: list[str]) -> str:
    found = [c for c in cmds if "ray start" in c]
    assert len(found) == 1, cmds
    return found[0]


def _run(cmd: str, env: dict, cwd: str) -> None:
    out = subprocess.run(["bash", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def head():
    from ray.autoscaler._private.util import prepare_config

    from spotfill.testing.imds import ImdsStandin

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    cfg = prepare_config(copy.deepcopy(raw))
    temp_dir = tempfile.mkdtemp(prefix="sfhead-", dir="/tmp")
    bootstrap = os.path.join(temp_dir, "ray_bootstrap_config.yaml")
    Path(bootstrap).write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    # no cloud: the autoscaler's AWS provider finds no credentials instead of trying the network
    # RAY_AUTH_MODE=disabled: as on a fresh EC2 node. Here a ~/.ray/auth_token of the machine's user would
    # turn token auth on for the head (Ray 2.60 does when the mode is unset) but not for the joining worker.
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null", **{MARK: temp_dir})
    imds = ImdsStandin(instance_id=INSTANCE_ID, life_cycle="spot").start()
    gcs, om_head, om_worker = _free_ports(3)
    try:
        flags, _ = _isolation(temp_dir)
        head_cmd = _rewrite(_ray_start(cfg["head_start_ray_commands"]), [
            ("ray start --head", f"{RAY} start --head" + flags), ("--port=6379", f"--port={gcs}"),
            ("--object-manager-port=8076", f"--object-manager-port={om_head}"),
            ("--autoscaling-config=~/ray_bootstrap_config.yaml", f"--autoscaling-config={bootstrap}"),
            (IMDS, imds.url)])
        _run(head_cmd, env, temp_dir)
        flags, worker_nm = _isolation(temp_dir)
        worker_cmd = _rewrite(_ray_start(cfg["worker_start_ray_commands"]), [
            ("ray start", f"{RAY} start" + flags), ("$RAY_HEAD_IP:6379", f"127.0.0.1:{gcs}"),
            ("--object-manager-port=8076", f"--object-manager-port={om_worker}"), (IMDS, imds.url)])
        _run(worker_cmd, env, temp_dir)
        yield {"address": f"127.0.0.1:{gcs}", "temp_dir": temp_dir, "cfg": cfg, "worker_nm": worker_nm}
    finally:
        _stop_head(temp_dir)          # SIGKILL reaches frozen processes too
        imds.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def gcs(head):
    from ray._raylet import GcsClient
    return GcsClient(address=head["address"])


def _nodes(gcs) -> dict:
    """node id (hex) -> autoscaler v2's NodeState, from the GCS (what the v2 autoscaler reads)."""
    from ray.autoscaler.v2.sdk import get_cluster_status
    status = get_cluster_status(gcs.address)
    return {n.node_id: n for n in status.active_nodes + status.idle_nodes + status.failed_nodes}


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def test_head_runs_autoscaler_v2(head, gcs):
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    assert is_autoscaler_v2(fetch_from_server=True, gcs_client=gcs)       # the GCS's flag, as clients read it
    procs = _head_processes(head["temp_dir"])
    monitors = [part for p in procs for part in p.info["cmdline"] or [] if os.path.basename(part) == "monitor.py"]
    assert len(monitors) == 1, [p.info["cmdline"] for p in procs]
    assert monitors[0].endswith(os.path.join("autoscaler", "v2", "monitor.py")), monitors
    # v2 scales nothing until it sees the head as a running instance: its ray node must carry the head's
    # cloud instance id and node type (from the instance metadata here: no `ray up` exported them)
    nodes = _wait(lambda: [n for n in _nodes(gcs).values() if n.ray_node_type_name == head["cfg"]["head_node_type"]],
                  30, "the head in autoscaler v2's view")
    assert nodes[0].instance_id == INSTANCE_ID


def test_worker_joins_labelled_with_its_market(head, gcs):
    def worker():
        return [n for n in _gcs_nodes(gcs) if n["labels"].get("spotfill.io/role") == "gpu-worker"]
    (w,) = _wait(worker, 60, "the worker node to join")
    assert w["labels"]["spotfill.io/market-type"] == "spot"       # the IMDS stand-in's instance-life-cycle


def _gcs_nodes(gcs) -> list[dict]:
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    out = []
    for node_id, info in gcs.get_all_node_info(timeout=10).items():
        out.append({"id": node_id.hex(), "alive": info.state == GcsNodeInfo.ALIVE, "labels": dict(info.labels),
                    "port": info.node_manager_port})
    return out


def test_a_silent_worker_is_declared_dead_within_the_cluster_bound(head, gcs):
    """The health-check settings the head exports are the ones in force: SIGSTOP the worker (raylet and
    everything under it) and time the GCS until it declares the node dead."""
    from spotfill.sim.freeze import freeze_process_tree

    (w,) = _wait(lambda: [n for n in _gcs_nodes(gcs) if n["port"] == head["worker_nm"] and n["alive"]], 60,
                 "the worker node alive")
    raylets = [p for p in _head_processes(head["temp_dir"]) if (p.info["cmdline"] or [""])[0].endswith("raylet")
               and f"--node_manager_port={head['worker_nm']}" in " ".join(p.info["cmdline"])]
    assert len(raylets) == 1, raylets
    time.sleep(1.0)            # past the first checks of the node
    t0 = time.time()
    frozen = freeze_process_tree([raylets[0].pid])
    assert frozen
    _wait(lambda: not next(n for n in _gcs_nodes(gcs) if n["id"] == w["id"])["alive"],
          RAY_DEFAULT.silent_node_bound_s() + 30, "the GCS to declare the frozen worker dead")
    took = time.time() - t0
    print(f"worker declared dead {took:.2f}s after it froze")
    # a reset (killed processes) would fail the checks at once; the silent node's checks time out
    assert CLUSTER.silent_node_min_s() - 1.0 <= took <= CLUSTER.silent_node_bound_s() + 3.0, took
    assert took < RAY_DEFAULT.silent_node_min_s()
