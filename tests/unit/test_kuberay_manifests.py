"""deploy/kuberay: the RayCluster and RayJob validate against KubeRay's own CRD schemas, and say what spotfill
needs (the same market-type labels as cluster.yaml, GPUs per worker group, a preStop drain that fits in the
grace period).

The CRDs are vendored from KubeRay v1.7.0 (deploy/kuberay/crds/README.md); their git blob ids are checked
here, so an edited copy fails. Each CRD's ``spec.versions[name=v1].schema.openAPIV3Schema`` is turned into a
JSON Schema (draft 4, OpenAPI 3.0's base) the way the Kubernetes API server reads it:

- an object with ``properties`` and no ``x-kubernetes-preserve-unknown-fields`` is closed (unknown fields are
  errors: ``kubectl apply`` validates strictly by default since Kubernetes 1.27),
- ``x-kubernetes-int-or-string`` accepts an integer or a string, ``nullable`` accepts null,
- ``x-kubernetes-list-type`` / ``-list-map-keys`` / ``-map-type`` only matter for merges: ignored,
- ``x-kubernetes-validations`` (CEL) cannot be evaluated here, so a manifest that sets a field carrying CEL
  rules is rejected rather than waved through (ours sets none).
No cluster and no Ray runtime are needed.
"""
from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "deploy" / "kuberay"
CRDS = KUBERAY / "crds"
CRD_BLOBS = {      # `git ls-tree v1.7.0 ray-operator/config/crd/bases/` in ray-project/kuberay
    "ray.io_rayclusters.yaml": "ff0be58ada3bd457605eff1f258c16df21e61e21",
    "ray.io_rayjobs.yaml": "c7d3f081af8cf08c256a8c33a0c3b6ea28b816a0",
}
CEL_NOT_EVALUATED = "field has x-kubernetes-validations (CEL) rules this test cannot evaluate"


# ---------------------------------------------------------------------------------------------------
# CRD schema -> JSON Schema
# ---------------------------------------------------------------------------------------------------
def to_json_schema(node):
    """Structural OpenAPI v3 schema (a CRD's) -> draft-4 JSON Schema with the API server's semantics."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key.startswith("x-kubernetes-") or key == "nullable":
            continue
        else:
            out[key] = to_json_schema(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    closed = "properties" in node and "additionalProperties" not in node
    if closed and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if "x-kubernetes-validations" in node:
        out["not"] = {"description": CEL_NOT_EVALUATED}
    return out


def crd_schema(filename: str, version: str = "v1") -> dict:
    crd = yaml.safe_load((CRDS / filename).read_text())
    served = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served and served[0]["served"] and served[0]["storage"], f"{filename}: {version} not served/stored"
    return to_json_schema(served[0]["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def validators() -> dict:
    out = {}
    for kind, filename in (("RayCluster", "ray.io_rayclusters.yaml"), ("RayJob", "ray.io_rayjobs.yaml")):
        schema = crd_schema(filename)
        jsonschema.Draft4Validator.check_schema(schema)
        out[kind] = jsonschema.Draft4Validator(schema)
    return out


def errors(validators, manifest: dict) -> list[str]:
    """Schema errors, as '<path>: <message>' lines; [] when the manifest is valid."""
    found = validators[manifest["kind"]].iter_errors(manifest)
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in found)


def load(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


@pytest.fixture(scope="module")
def cluster() -> dict:
    return load("raycluster.yaml")


@pytest.fixture(scope="module")
def job() -> dict:
    return load("rayjob.yaml")


def gpu_groups(spec: dict) -> dict:
    return {g["groupName"]: g for g in spec["workerGroupSpecs"]}


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]     # KubeRay: the Ray container is the first one


# ---------------------------------------------------------------------------------------------------
# The vendored CRDs and the validator itself
# ---------------------------------------------------------------------------------------------------
def test_vendored_crds_are_the_release_files():
    for filename, blob in CRD_BLOBS.items():
        got = subprocess.run(["git", "hash-object", str(CRDS / filename)], capture_output=True, text=True,
                             check=True).stdout.strip()
        assert got == blob, f"{filename} differs from KubeRay v1.7.0's"
    readme = (CRDS / "README.md").read_text()
    assert "v1.7.0" in readme and all(blob in readme for blob in CRD_BLOBS.values())


def test_our_manifests_validate(validators, cluster, job):
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert errors(validators, cluster) == []
    assert errors(validators, job) == []
    for manifest in (cluster, job):      # a DNS-1035 name: what KubeRay requires of both kinds
        assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", manifest["metadata"]["name"])


def _broken(manifest: dict, edit) -> dict:
    broken = copy.deepcopy(manifest)
    edit(broken["spec"] if broken["kind"] == "RayCluster" else broken["spec"]["rayClusterSpec"])
    return broken


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
@pytest.mark.parametrize("edit, expect", [
    # misspelled field in a closed object
    (lambda s: s.__setitem__("enableInTreeAutoScaling", True), "'enableInTreeAutoScaling' was unexpected"),
    (lambda s: gpu_groups(s)["gpu-spot"]["template"]["spec"].__setitem__("terminationGracePeriod", 150),
     "'terminationGracePeriod' was unexpected"),
    # wrong types
    (lambda s: gpu_groups(s)["gpu-spot"].__setitem__("maxReplicas", "two"), "'two' is not of type 'integer'"),
    (lambda s: ray_container(gpu_groups(s)["gpu-spot"])["resources"]["limits"].__setitem__("nvidia.com/gpu",
                                                                                            "four"),
     "does not match"),
    (lambda s: s["headGroupSpec"].__setitem__("rayStartParams", {"num-cpus": 1}), "1 is not of type 'string'"),
    # missing required fields
    (lambda s: gpu_groups(s)["gpu-ondemand"].pop("groupName"), "'groupName' is a required property"),
    (lambda s: s.pop("headGroupSpec"), "'headGroupSpec' is a required property"),
    (lambda s: ray_container(gpu_groups(s)["gpu-spot"]).pop("name"), "'name' is a required property"),
    # a field with CEL rules is refused, not waved through
    (lambda s: s.__setitem__("managedBy", "ray.io/kuberay-operator"), "should not be valid under"),
])
def test_a_broken_manifest_fails(validators, cluster, job, kind, edit, expect):
    if kind == "RayCluster":
        broken = _broken(cluster, lambda s: edit(s))
    else:
        broken = _broken(job, lambda s: edit(s))
    found = errors(validators, broken)
    assert any(expect in e for e in found), found


def test_a_broken_rayjob_field_fails(validators, job):
    for edit, expect in (
        (lambda j: j["spec"].__setitem__("shutdownAfterJobFinish", True), "'shutdownAfterJobFinish' was unexpected"),
        (lambda j: j["spec"].__setitem__("shutdownAfterJobFinishes", "yes"), "'yes' is not of type 'boolean'"),
        (lambda j: j["spec"].__setitem__("runtimeEnvYAML", {"working_dir": "/opt/spotfill"}), "is not of type 'string'"),
    ):
        broken = copy.deepcopy(job)
        edit(broken)
        assert any(expect in e for e in errors(validators, broken)), expect


# ---------------------------------------------------------------------------------------------------
# What spotfill needs, read the way Ray 2.60's KubeRay autoscaler reads it
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def autoscaling(cluster) -> dict:
    """The autoscaling config Ray's in-tree autoscaler derives from the RayCluster (and validates)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    return _derive_autoscaling_config_from_ray_cr(copy.deepcopy(cluster))


def test_autoscaler_v2_reads_spot_first_with_on_demand_fallback(cluster, autoscaling):
    from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["autoscalerOptions"]["version"] == "v2"
    types = AutoscalingConfig(autoscaling, skip_content_hash=True).get_node_type_configs()
    spot, ondemand = types["gpu-spot"], types["gpu-ondemand"]
    assert spot.labels["spotfill.io/market-type"] == "spot"
    assert ondemand.labels["spotfill.io/market-type"] == "on-demand"
    assert spot.priority > ondemand.priority and spot.min_worker_nodes == ondemand.min_worker_nodes == 0
    assert spot.resources["GPU"] == ondemand.resources["GPU"] == 4
    head = autoscaling["available_node_types"][autoscaling["head_node_type"]]
    assert head["resources"]["CPU"] == 1 and head["resources"].get("GPU", 0) == 0
    assert autoscaling["idle_timeout_minutes"] > 0


def test_labels_are_cluster_yaml_market_types(cluster):
    """Same label keys and the same (market type, role) pairs as cluster.yaml's node types."""
    aws = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"]
    ours = [cluster["spec"]["headGroupSpec"]["labels"]] + [g["labels"] for g in cluster["spec"]["workerGroupSpecs"]]
    assert {tuple(sorted(t["labels"].items())) for t in aws.values()} == {tuple(sorted(l.items())) for l in ours}
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        # KubeRay >= 1.5 rejects labels in rayStartParams (validateRayGroupLabels); use the top-level field.
        assert "labels" not in group.get("rayStartParams", {})


def _affinity_terms(group: dict) -> list[dict]:
    req = group["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [{e["key"]: (e["operator"], tuple(e.get("values", ()))) for e in t["matchExpressions"]}
            for t in req["nodeSelectorTerms"]]


SPOT_NODE_LABELS = {"karpenter.sh/capacity-type": "spot", "eks.amazonaws.com/capacityType": "SPOT",
                    "cloud.google.com/gke-spot": "true"}


def _matches(term: dict, node_labels: dict) -> bool:
    for key, (op, values) in term.items():
        ok = {"In": lambda: node_labels.get(key) in values, "Exists": lambda: key in node_labels,
              "DoesNotExist": lambda: key not in node_labels}[op]()
        if not ok:
            return False
    return True


@pytest.mark.parametrize("node", [
    ({"karpenter.sh/capacity-type": "spot"}, "spot"),
    ({"karpenter.sh/capacity-type": "on-demand"}, "on-demand"),
    ({"eks.amazonaws.com/capacityType": "SPOT"}, "spot"),
    ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, "on-demand"),
    ({"cloud.google.com/gke-nodepool": "gpu", "cloud.google.com/gke-spot": "true"}, "spot"),
    ({"cloud.google.com/gke-nodepool": "gpu"}, "on-demand"),
    ({"cloud.google.com/gke-nodepool": "gpu", "cloud.google.com/gke-preemptible": "true"}, None),
])
def test_groups_land_on_their_market(cluster, node):
    labels, market = node
    groups = {**gpu_groups(cluster["spec"]), "head": cluster["spec"]["headGroupSpec"]}
    for name, group in groups.items():
        want = group["labels"]["spotfill.io/market-type"] == market
        got = any(_matches(t, labels) for t in _affinity_terms(group))
        assert got == want, (name, labels)


def test_gpu_groups_request_whole_gpus_and_head_none(cluster):
    for group in cluster["spec"]["workerGroupSpecs"]:
        res = ray_container(group)["resources"]
        assert int(res["limits"]["nvidia.com/gpu"]) > 0
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
    head = ray_container(cluster["spec"]["headGroupSpec"])["resources"]
    assert not any("gpu" in k for part in head.values() for k in part)


def _prestop(group: dict) -> str:
    cmd = ray_container(group)["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[:2] == ["/bin/bash", "-c"]
    return cmd[2]


def test_prestop_drains_with_preemption_inside_the_grace_period(cluster):
    """Ray's own CLI parser accepts the hook's `ray drain-node` flags; the deadline is spotfill's notice budget
    and fits in terminationGracePeriodSeconds with room for shutdown."""
    from ray.scripts.scripts import drain_node

    from spotfill.spot.watcher import DEFAULT_NOTICE_DEADLINE_S

    for group in cluster["spec"]["workerGroupSpecs"]:
        script = _prestop(group)
        first = script.split(";", 1)[0].split(">", 1)[0]
        argv = shlex.split(first)
        assert argv[:2] == ["ray", "drain-node"]
        params = drain_node.make_context("drain-node", argv[2:]).params
        assert params["reason"] == "DRAIN_NODE_REASON_PREEMPTION" and params["node_id"] is None
        deadline = params["deadline_remaining_seconds"]
        grace = group["template"]["spec"]["terminationGracePeriodSeconds"]
        assert deadline == DEFAULT_NOTICE_DEADLINE_S
        assert grace >= deadline + 20, "SIGTERM and shutdown need time after the hook's deadline"
        wait = re.search(r"end=\$\(\(SECONDS \+ (\d+)\)\)", script)
        assert wait and int(wait.group(1)) <= deadline and "grep -qsx raylet /proc/[0-9]*/comm" in script


def test_prestop_hook_drains_then_waits_for_the_raylet_to_leave(cluster, tmp_path):
    """The hook itself, run by bash in a private PID namespace (a container's view) with `ray` stubbed: it
    calls `ray drain-node` first, waits while a process named `raylet` lives, and returns once it is gone."""
    import shutil
    import time

    if not shutil.which("unshare") or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --pid --mount-proc` (root) for a private process table")
    script = _prestop(cluster["spec"]["workerGroupSpecs"][0])
    (tmp_path / "ray").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/called\n")
    (tmp_path / "ray").chmod(0o755)
    shutil.copy(shutil.which("sleep"), tmp_path / "raylet")          # a process whose comm is "raylet"
    container = f"{tmp_path}/raylet 3 & sleep 0.2; {script}"
    t0 = time.monotonic()
    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", container],
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": "p-1"},
                          timeout=60, capture_output=True, text=True)
    waited = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    assert 2.5 < waited < 15, f"waited {waited:.1f}s for a raylet that lived 3 s"
    called = (tmp_path / "called").read_text()
    assert called.startswith("drain-node --reason DRAIN_NODE_REASON_PREEMPTION") and "p-1" in called


def test_rayjob_runs_pretrain_on_the_same_cluster(cluster, job):
    import importlib.util

    from spotfill.config.job import load_job_config

    spec = job["spec"]
    assert spec["rayClusterSpec"] == cluster["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    docker = (KUBERAY / "Dockerfile").read_text()
    assert re.search(rf"^COPY .* \. {re.escape(env['working_dir'])}$", docker, re.M)
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["python", "jobs/pretrain.py"]
    loader = importlib.util.spec_from_file_location("pretrain_entry", ROOT / "jobs" / "pretrain.py")
    pretrain = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(pretrain)
    args = pretrain.build_parser().parse_args(argv[2:])
    cfg = load_job_config(str(ROOT / args.config))
    assert cfg.cluster.gpu_resource == "GPU"
    gpus = {g["groupName"]: int(ray_container(g)["resources"]["limits"]["nvidia.com/gpu"]) * g["maxReplicas"]
            for g in cluster["spec"]["workerGroupSpecs"]}
    need = cfg.training.workers[-1] * cfg.cluster.gpus_per_worker
    assert gpus["gpu-spot"] >= need and gpus["gpu-ondemand"] >= need     # either market can hold `max`


def test_one_ray_version_everywhere(cluster):
    import ray

    docker = (KUBERAY / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:(\S+?)-py(\d)(\d+)-gpu$", docker, re.M)
    assert base and base.group(1) == cluster["spec"]["rayVersion"] == ray.__version__
    import tomllib

    from packaging.requirements import Requirement
    deps = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    declared = next(r for r in deps if r.name == "ray")
    assert ray.__version__ in declared.specifier, declared    # the image's Ray is one the tested range holds
    assert {"train", "tune", "serve", "data", "default"} <= declared.extras


def test_autoscaler_gives_up_on_a_pending_spot_pod_well_before_ray_default(cluster):
    """The fallback knob is one Ray 2.60's autoscaler v2 reads (InstanceReconcileConfig, read in a fresh
    interpreter with the manifest's env), set below its one-hour default and above a GPU node's
    provisioning + image pull."""
    import os
    import sys

    env = {e["name"]: e["value"] for e in cluster["spec"]["autoscalerOptions"]["env"]}
    name = "RAY_AUTOSCALER_RECONCILE_ALLOCATE_STATUS_TIMEOUT_S"
    code = ("from ray.autoscaler.v2.instance_manager.config import InstanceReconcileConfig as C; "
            "print(C().allocate_status_timeout_s)")
    base = {k: v for k, v in os.environ.items() if k != name}
    default = int(subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True,
                                 check=True).stdout)
    read = int(subprocess.run([sys.executable, "-c", code], env={**base, name: env[name]}, capture_output=True,
                              text=True, check=True).stdout)
    assert read == int(env[name]) and 300 <= read < default == 3600


def test_head_sets_the_clusters_health_checks(cluster):
    """The GCS runs in the head container: its environment carries spotfill's health-check settings
    (config/failure_detection.py CLUSTER, the same as cluster.yaml's head), as Ray's config reader reads them."""
    from spotfill.config.failure_detection import CLUSTER
    from test_failure_detection import ray_reads

    env = {e["name"]: e["value"] for e in ray_container(cluster["spec"]["headGroupSpec"]).get("env", [])}
    health = {k: v for k, v in env.items() if k.startswith("RAY_health_check_")}
    assert health == CLUSTER.env()
    assert ray_reads(health) == CLUSTER


def _sidecar(group: dict) -> dict:
    (side,) = [c for c in group["template"]["spec"]["containers"] if c["name"] == "spot-watch"]
    return side


def test_spot_watch_sidecar_hears_sigterm_and_the_node_with_the_prestop_budget(cluster):
    """Every GPU pod runs `spotfill spot-watch --source kubernetes` beside the Ray container (which stays first):
    its flags parse with spotfill's own parser, its deadline is the preStop drain's, it has no preStop (the
    kubelet signals it at once), the values it expands come from the downward API, and its ServiceAccount
    may read nodes (spot-watch-rbac.yaml)."""
    from spotfill.cli.main import build_parser
    from spotfill.cli.spot_watch import build_source

    rbac = list(yaml.safe_load_all((KUBERAY / "spot-watch-rbac.yaml").read_text()))
    account = next(d for d in rbac if d["kind"] == "ServiceAccount")["metadata"]["name"]
    role = next(d for d in rbac if d["kind"] == "ClusterRole")
    assert {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]} in role["rules"]
    binding = next(d for d in rbac if d["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["subjects"][0]["name"] == account
    for group in cluster["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert ray_container(group)["name"] == "ray-worker" and pod["serviceAccountName"] == account
        side = _sidecar(group)
        assert "lifecycle" not in side and "nvidia.com/gpu" not in side["resources"]["limits"]
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in side["env"]}
        assert env == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP",
                       "RAY_CLUSTER": "metadata.labels['ray.io/cluster']"}
        argv = [re.sub(r"\$\((\w+)\)", lambda m: {"RAY_CLUSTER": "spotfill", "POD_IP": "10.1.2.3"}[m.group(1)], a)
                for a in side["command"]]
        assert argv[:2] == ["spotfill", "spot-watch"]
        args = build_parser().parse_args(argv[1:])
        assert args.source == "kubernetes" and args.address == "spotfill-head-svc:6379" and args.node_ip == "10.1.2.3"
        deadline = build_source("kubernetes", args, 1.0).deadline_s
        first = _prestop(group).split(";", 1)[0].split(">", 1)[0]
        drain_node_deadline = float(re.search(r"--deadline-remaining-seconds (\d+)", first).group(1))
        assert deadline == drain_node_deadline <= pod["terminationGracePeriodSeconds"] - 20
