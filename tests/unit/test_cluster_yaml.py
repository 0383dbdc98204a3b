"""cluster.yaml: valid for Ray's own cluster-launcher validation, and shaped the way spotfill needs.

Ray's checks used: `prepare_config` + `validate_config` (JSON schema, what `ray up` runs before touching
the cloud), autoscaler v2's `AutoscalingConfig` (what the head's autoscaler reads), the AWS provider's
`_create_default_inbound_rules` (the ingress `ray up` authorizes) and `parse_node_labels_string` (what
`ray start --labels` parses). No cloud access.
"""
from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


@pytest.fixture(scope="module")
def cfg(raw) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


def _gpu_types(cfg):
    return {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}


def test_ray_validation_and_autoscaler_v2_accept_it(cfg):
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]
    assert cfg["provider"]["availability_zone"]
    assert cfg["cluster_name"] and cfg["max_workers"] > 0 and cfg["idle_timeout_minutes"] > 0
    types = AutoscalingConfig(cfg, skip_content_hash=True).get_node_type_configs()
    assert set(types) == set(cfg["available_node_types"])


def test_head_is_on_demand_cpu_and_runs_no_training(cfg):
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["resources"]["CPU"] <= 2
    assert "InstanceMarketOptions" not in head["node_config"]
    assert re.match(r"^(m|c|r)\d", head["node_config"]["InstanceType"])    # a CPU family


def test_gpu_workers_are_spot_with_on_demand_fallback(cfg):
    gpu = _gpu_types(cfg)
    assert all(t["resources"]["GPU"] > 0 for t in gpu.values())
    spot = {k: t for k, t in gpu.items() if "InstanceMarketOptions" in t["node_config"]}
    ondemand = {k: t for k, t in gpu.items() if "InstanceMarketOptions" not in t["node_config"]}
    assert spot and ondemand
    for t in spot.values():
        assert t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        assert t["labels"]["spotfill.io/market-type"] == "spot"
    for t in ondemand.values():
        assert t["min_workers"] == 0 and t["labels"]["spotfill.io/market-type"] == "on-demand"
        assert t.get("priority", 0) < min(s.get("priority", 0) for s in spot.values())
    assert cfg["provider"]["cache_stopped_nodes"] is False      # spot instances cannot be stopped


def test_every_node_has_an_image_and_imdsv2(cfg):
    for t in cfg["available_node_types"].values():
        assert t["node_config"]["ImageId"]                      # never Ray's old default DLAMI
        assert t["node_config"]["MetadataOptions"]["HttpTokens"] == "required"


def test_only_ssh_is_open(cfg):
    from ray.autoscaler._private.aws.config import _create_default_inbound_rules

    extra = cfg["provider"].get("security_group", {}).get("IpPermissions", [])
    rules = _create_default_inbound_rules({"sg-self"}, extra)
    for rule in rules:
        if rule.get("UserIdGroupPairs"):                        # intra-cluster: the group itself only
            assert rule["UserIdGroupPairs"] == [{"GroupId": "sg-self"}] and not rule.get("IpRanges")
        else:
            assert (rule["IpProtocol"], rule["FromPort"], rule["ToPort"]) == ("tcp", 22, 22)


def test_setup_installs_this_project(cfg):
    assert cfg["file_mounts"].get("~/spotfill") == "."
    assert any('pip install -e "$HOME/spotfill[hf]"' in c for c in cfg["setup_commands"])


def test_dashboard_bound_to_localhost(cfg):
    head_cmds = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds and "0.0.0.0" not in head_cmds


def _labels_arg(cmd: str) -> str:
    m = re.search(r'--labels="([^"]*)"', cmd)
    assert m, cmd
    return m.group(1)


def test_worker_start_labels_market_type(cfg):
    from ray._private.label_utils import parse_node_labels_string

    start = [c for c in cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(start) == 1 and "instance-life-cycle" in start[0]
    for market in ("spot", "on-demand"):
        labels = parse_node_labels_string(_labels_arg(start[0]).replace("$MARKET", market))
        assert labels["spotfill.io/market-type"] == market
    head = [c for c in cfg["head_start_ray_commands"] if "ray start" in c][0]
    assert parse_node_labels_string(_labels_arg(head))["spotfill.io/market-type"] == "on-demand"


def test_spot_watch_daemon_on_every_worker(cfg):
    from spotfill.cli.main import build_parser

    cmds = cfg["worker_start_ray_commands"]
    watch = [c for c in cmds if "spotfill spot-watch" in c]
    assert len(watch) == 1
    cmd = watch[0]
    assert cmds.index(cmd) > next(i for i, c in enumerate(cmds) if "ray start" in c)   # after Ray is up
    assert "nohup" in cmd and re.search(r"&\s*(echo|$)", cmd) and "< /dev/null" in cmd
    # The flags it uses exist: parse them with spotfill's own parser.
    argv = shlex.split(cmd.split("nohup", 1)[1].split(">", 1)[0].replace("$RAY_HEAD_IP", "10.0.0.1"))
    args = build_parser().parse_args(argv[1:])
    assert args.command == "spot-watch" and args.address == "10.0.0.1:6379" and not args.once


# ---------------------------------------------------------------------------------------------------
# The head's environment: read back by Ray itself, in the shell `ray up` runs the command in
# ---------------------------------------------------------------------------------------------------
RAY_READS = ("import json, os, ray; print(json.dumps({'v2': ray._config.enable_autoscaler_v2(), "
             "'period_ms': ray._config.health_check_period_ms(), 'timeout_ms': ray._config.health_check_timeout_ms(), "
             "'failure_threshold': ray._config.health_check_failure_threshold(), "
             "'instance': os.environ.get('RAY_CLOUD_INSTANCE_ID'), 'type': os.environ.get('RAY_NODE_TYPE_NAME')}))")


def _head_env_as_ray_reads_it(cfg, imds_url: str, ray_up_env: dict | None = None) -> dict:
    """The head's `ray start` line with `ray start ...` swapped for a Python process that prints what Ray's
    config reader (RayConfig, the GCS's too) and autoscaler v2 get from that environment. `ray_up_env`:
    what `ray up` exports in front of each start command (its own `with_envs`)."""
    import json
    import os
    import subprocess
    import sys

    from ray.autoscaler._private.util import with_envs

    start = [c for c in cfg["head_start_ray_commands"] if "ray start --head" in c]
    assert len(start) == 1
    prefix = start[0].split("ray start --head", 1)[0].replace("http://169.254.169.254", imds_url)
    cmd = prefix + f"{shlex.quote(sys.executable)} -c {shlex.quote(RAY_READS)}"
    if ray_up_env:
        (cmd,) = with_envs([cmd], ray_up_env)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_head_turns_on_autoscaler_v2_and_the_health_checks_itself(cfg):
    """Without `ray up`'s exports (RAY_UP_enable_autoscaler_v2=0, or another launcher): v2 on, the head known
    to v2 by its instance id (from the instance metadata) and node type, and the health-check settings of
    spotfill.config.failure_detection.CLUSTER -- as Ray's own config reader reads them."""
    from spotfill.config.failure_detection import CLUSTER
    from spotfill.testing.imds import ImdsStandin

    with ImdsStandin(instance_id="i-0fromimds0000001") as imds:
        got = _head_env_as_ray_reads_it(cfg, imds.url)
    assert got["v2"] is True
    assert (got["period_ms"], got["timeout_ms"], got["failure_threshold"]) == \
        (CLUSTER.period_ms, CLUSTER.timeout_ms, CLUSTER.failure_threshold)
    assert got["instance"] == "i-0fromimds0000001" and got["type"] == cfg["head_node_type"]


def test_ray_ups_own_head_identity_wins(cfg):
    """`ray up` (RAY_UP_enable_autoscaler_v2 unset or 1) exports the head's instance id and type in front of
    the command: they are kept, and the metadata service is not needed."""
    got = _head_env_as_ray_reads_it(cfg, "http://127.0.0.1:9", ray_up_env={
        "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": "i-0fromrayup000001",
        "RAY_NODE_TYPE_NAME": cfg["head_node_type"]})
    assert got["v2"] is True and got["instance"] == "i-0fromrayup000001" and got["type"] == cfg["head_node_type"]


# ---------------------------------------------------------------------------------------------------
# Worker credentials
# ---------------------------------------------------------------------------------------------------
def test_every_gpu_worker_has_an_instance_profile(cfg):
    """Ray's AWS bootstrap gives an instance profile to the head only (`_configure_iam_role` fills
    `head_node`, "not to workers with the same node type as the head"); each GPU worker type names one in
    its own node_config, and it is the one docs/cluster-lifecycle.md says how to create."""
    gpu = _gpu_types(cfg)
    profiles = {k: t["node_config"].get("IamInstanceProfile") for k, t in gpu.items()}
    assert all(profiles.values()), profiles
    (profile,) = {tuple(sorted(p.items())) for p in profiles.values()}       # one profile for every worker
    name = dict(profile).get("Name") or dict(profile)["Arn"].rsplit("/", 1)[-1]
    head = cfg["available_node_types"][cfg["head_node_type"]]["node_config"]
    assert "IamInstanceProfile" not in head                                  # Ray creates the head's
    doc = (ROOT / "docs" / "cluster-lifecycle.md").read_text()
    assert f"--instance-profile-name {name}" in doc and f"role/{name}" in doc


def test_worker_policy_in_the_docs_allows_what_storage_calls():
    """The S3 actions spotfill's storage layer calls (storage/s3.py: list, get, head, put -- multipart for
    large files --, delete, abort of a failed multipart upload) are all in the documented worker policy."""
    import json

    doc = (ROOT / "docs" / "cluster-lifecycle.md").read_text()
    block = re.search(r"```json\n(\{.*?\})\n```", doc, re.S)
    assert block, "no JSON policy block in docs/cluster-lifecycle.md"
    policy = json.loads(block.group(1))
    actions = {a for st in policy["Statement"] if st["Effect"] == "Allow"
               for a in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])}
    needed = {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}
    assert needed <= actions, needed - actions
    assert not any(a in ("*", "s3:*") for a in actions)
