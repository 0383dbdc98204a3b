"""`spotfill serve` refuses bad input before starting anything: one line on stderr and exit 2 -- a path with
no committed checkpoint names the committed runs nearby (a typo, or the storage root instead of the run's
folder), unless --wait-for-checkpoint; bad --draft / --num-draft-tokens / --port. And the Serve app's args
are refused at deploy, naming the key."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from spotfill.config.errors import ConfigError
from spotfill.serving.args import ServeArgs, check_deployable

ROOT = pathlib.Path(__file__).resolve().parents[2]


def spotfill(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "spotfill", "serve", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture
def runs(tmp_path):
    """Two committed runs under one storage root (checkpoints/latest is what commits them)."""
    for run in ("alpha", "beta"):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        (tmp_path / run / "checkpoints" / "latest").write_text('{"tag": "step-00000001", "step": 1}')
    return tmp_path


@pytest.mark.parametrize("where", ["root", "typo"])
def test_no_committed_checkpoint_exits_2_naming_the_runs_nearby(runs, where):
    path = str(runs) if where == "root" else f"file://{runs}/alhpa"
    res = spotfill("--checkpoint", path, "--duration", "1")
    assert res.returncode == 2 and res.stdout == "", res.stderr
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("spotfill: error: --checkpoint: no committed checkpoint there")
    assert "alpha" in line and "beta" in line and "--wait-for-checkpoint" in line and "Traceback" not in line


@pytest.mark.parametrize("args, flag", [
    (["--draft", "self:0"], "--draft"), (["--draft", "ftp://x"], "--draft"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens"), (["--port", "0"], "--port"),
    (["--max-queue-wait-s", "-1"], "--max-queue-wait-s"), (["--max-queue-wait-s", "601"], "--max-queue-wait-s"),
    (["--floor-replicas", "-1"], "--floor-replicas"), (["--checkpoint", "nonsense://x"], "--checkpoint")])
def test_bad_flags_exit_2_naming_the_flag(runs, args, flag):
    base = ["--checkpoint", f"{runs}/alpha"]
    res = spotfill(*(base + args if args[0] != "--checkpoint" else args))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"spotfill: error: {flag}"), res.stderr


@pytest.mark.parametrize("key, value", [
    ("reload_s", 0), ("reload_s", -1), ("max_tokens", -1), ("max_tokens", 1.5), ("retry_after_s", -1),
    ("max_queue_wait_s", -2), ("gpu_resource", ""), ("gpu_resource", "GPU SLOT"), ("checkpoint", "nonsense://x"),
    ("model", "huge"), ("draft", "self:x"), ("num_draft_tokens", 17), ("max_batch", 0), ("max_generation_s", 1.5)])
def test_bad_app_args_are_refused_at_deploy_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=f"^serving.app args {key}"):
        ServeArgs.parse({"checkpoint": "file:///x", key: value})


def test_a_misspelled_gpu_resource_or_an_unreadable_checkpoint_is_refused_at_deploy(runs):
    args = ServeArgs.parse({"checkpoint": f"{runs}/alpha", "gpu_resource": "GPU_SOLT"})
    with pytest.raises(ConfigError, match="gpu_resource: no node of the cluster declares it.*GPU_SLOT"):
        check_deployable(args, {"CPU": 4.0, "GPU_SLOT": 2.0, "node:127.0.0.1": 1.0})
    (runs / "alpha" / "checkpoints" / "latest").unlink()
    (runs / "alpha" / "checkpoints" / "latest").mkdir()            # there, but not a readable file
    with pytest.raises(ConfigError, match="checkpoint: its committed checkpoint cannot be read"):
        check_deployable(ServeArgs.parse({"checkpoint": f"{runs}/alpha"}))
    assert check_deployable(ServeArgs.parse({"checkpoint": f"{runs}/beta"}))["tag"] == "step-00000001"


def test_a_port_in_use_exits_2_naming_the_flag_and_a_free_one(runs):
    """A second `spotfill serve` on the same --port (or any server there): one line before anything starts."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = spotfill("--checkpoint", f"{runs}/alpha", "--port", str(port), "--duration", "1")
    assert res.returncode == 2 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"spotfill: error: --port: in use on 127.0.0.1"), res.stderr
    assert "accepted: a free port, e.g. --port " in res.stderr and "Traceback" not in res.stderr


def test_port_free_says_whether_a_server_could_listen_there():
    import socket

    from spotfill.cli.serve import port_free
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert port_free(held.getsockname()[1]) == 0
    assert port_free(0) > 0


def test_the_embedded_cluster_leaves_the_dashboards_ports_to_ray(monkeypatch):
    """Ray's dashboard finds a free port itself (8265, else one of the 50 after it) only when none is given:
    a port given -- even one checked free a moment before -- is refused when another local Ray took it in
    between (two `spotfill serve` started together: the second died with a traceback on 8265)."""
    import ray.cluster_utils

    from spotfill.sim import cluster as sim_cluster
    seen = {}

    class FakeCluster:
        def __init__(self, initialize_head, head_node_args):
            seen.update(head_node_args)
            self.head_node = type("Head", (), {"node_id": "head"})()

    monkeypatch.setattr(ray.cluster_utils, "Cluster", FakeCluster)
    monkeypatch.setattr(sim_cluster.os, "environ", dict(os.environ))
    c = sim_cluster.EmbeddedCluster()
    from spotfill.ray_compat import single_host_loopback
    single_host_loopback(c._loopback_before)
    assert seen["include_dashboard"] is True
    assert seen["dashboard_port"] is None and seen["dashboard_agent_listen_port"] is None
