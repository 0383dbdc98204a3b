"""examples/cluster-gcp.yaml and examples/cluster-azure.yaml: valid for Ray's own cluster-launcher
validation (what `ray up` runs before touching the cloud), shaped like cluster.yaml, and starting
`spotfill spot-watch` with their cloud's notice source. No cloud access."""
from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"gcp": ROOT / "examples" / "cluster-gcp.yaml", "azure": ROOT / "examples" / "cluster-azure.yaml"}


def is_spot(cloud: str, node_config: dict) -> bool:
    if cloud == "gcp":
        return node_config.get("scheduling", {}).get("provisioningModel") == "SPOT"
    return node_config["azure_arm_parameters"].get("priority") == "Spot"


@pytest.fixture(scope="module", params=sorted(EXAMPLES))
def example(request):
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = prepare_config(copy.deepcopy(yaml.safe_load(EXAMPLES[request.param].read_text())))
    validate_config(cfg)
    return request.param, cfg


def test_provider_and_spot_workers_with_on_demand_fallback(example):
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

    cloud, cfg = example
    assert cfg["provider"]["type"] == cloud and cfg["provider"]["cache_stopped_nodes"] is False
    assert set(AutoscalingConfig(cfg, skip_content_hash=True).get_node_type_configs()) == set(cfg["available_node_types"])
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and not is_spot(cloud, head["node_config"])
    gpu = {k: t for k, t in cfg["available_node_types"].items() if k != cfg["head_node_type"]}
    spot = {k: t for k, t in gpu.items() if is_spot(cloud, t["node_config"])}
    ondemand = {k: t for k, t in gpu.items() if k not in spot}
    assert spot and ondemand and all(t["resources"]["GPU"] > 0 for t in gpu.values())
    for name, t in gpu.items():
        market = "spot" if name in spot else "on-demand"
        assert t["labels"] == {"spotfill.io/market-type": market, "spotfill.io/role": "gpu-worker"}
        assert name.startswith("gpu_spot_" if market == "spot" else "gpu_ondemand_")   # the start command's case
    assert max(t["priority"] for t in ondemand.values()) < min(t["priority"] for t in spot.values())


def test_workers_label_their_market_and_run_the_clouds_spot_watch(example):
    from ray._private.label_utils import parse_node_labels_string

    from spotfill.cli.main import build_parser
    from spotfill.cli.spot_watch import build_source, resolve_source

    cloud, cfg = example
    cmds = cfg["worker_start_ray_commands"]
    start = next(c for c in cmds if "ray start" in c)
    case = start.split("ray start", 1)[0].split(";", 1)[1]        # the `case ... esac;` line
    for name, t in cfg["available_node_types"].items():
        if name == cfg["head_node_type"]:
            continue
        out = subprocess.run(["bash", "-c", f"{case} echo $MARKET"], env={"RAY_NODE_TYPE_NAME": name},
                             capture_output=True, text=True, check=True).stdout.strip()
        label = re.search(r'--labels="([^"]*)"', start).group(1).replace("$MARKET", out)
        assert parse_node_labels_string(label) == t["labels"]
    (watch,) = [c for c in cmds if "spotfill spot-watch" in c]
    assert cmds.index(watch) > cmds.index(start)
    argv = shlex.split(watch.split("nohup", 1)[1].split(">", 1)[0].replace("$RAY_HEAD_IP", "10.0.0.1"))
    args = build_parser().parse_args(argv[1:])
    assert resolve_source(args)[0] == cloud and args.address == "10.0.0.1:6379"
    assert build_source(cloud, args, 1.0).name == cloud
