"""train/preflight.py's pure decisions: a job the cluster can never hold, or a resource no node has, is a
one-line ConfigError in seconds instead of a placement group that waits forever."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spotfill.config.errors import ConfigError
from spotfill.train.preflight import (NodeType, node_types_from_config, resource_problem, seq_len_problem,
                                      worker_needs)

ROOT = Path(__file__).resolve().parents[2]
# What ray.nodes() reports for the embedded cluster: a head without slots and two 2-slot workers.
HEAD = {"CPU": 2.0, "memory": 1e9, "object_store_memory": 2e8, "node:127.0.0.1": 1.0, "node:__internal_head__": 1.0}
WORKER = {"CPU": 2.0, "GPU_SLOT": 2.0, "memory": 1e9, "object_store_memory": 1.5e8, "node:127.0.0.1": 1.0}
NEED = {"GPU_SLOT": 1.0, "CPU": 1.0}


def test_worker_needs_leave_zero_amounts_out():
    assert worker_needs("GPU", 1, 8) == {"GPU": 1.0, "CPU": 8.0}
    assert worker_needs("GPU_SLOT", 0.5, 0) == {"GPU_SLOT": 0.5}


def test_misspelled_gpu_resource_names_what_the_nodes_offer():
    problem = resource_problem({"GPU_SLTO": 1.0, "CPU": 1.0}, "GPU_SLTO", 1, [HEAD, WORKER])
    err = problem.error()
    assert isinstance(err, ConfigError) and err.exit_code == 2 and err.value == "GPU_SLTO"
    assert str(err) == ("cluster.gpu_resource: 'GPU_SLTO' is not a resource of any node (counted the 2 nodes "
                        "alive now; Ray 2.60 exposes no public API for the node types an autoscaler could add, "
                        "and no ~/ray_bootstrap_config.yaml is on this node); accepted: a resource the nodes "
                        "offer: CPU, GPU_SLOT, memory, object_store_memory")
    assert "\n" not in str(err)


@pytest.mark.parametrize("nodes, min_workers, fits", [
    ([HEAD, WORKER], 2, True),
    ([HEAD, WORKER], 3, False),
    ([HEAD, WORKER, WORKER], 4, True),
    ([HEAD, {**WORKER, "CPU": 1.0}], 2, False),      # 2 slots but 1 CPU: one worker per node fits
])
def test_minimum_workers_against_the_alive_nodes(nodes, min_workers, fits):
    problem = resource_problem(NEED, "GPU_SLOT", min_workers, nodes)
    assert (problem is None) == fits
    if not fits:
        assert problem.field == "training.workers" and problem.value == min_workers


def test_too_many_workers_message_says_what_the_cluster_holds():
    err = resource_problem(NEED, "GPU_SLOT", 3, [HEAD, WORKER]).error()
    assert str(err) == ("training.workers: a minimum of 3 workers ({GPU_SLOT: 1, CPU: 1} each) can never be "
                        "placed: the cluster holds at most 2 (GPU_SLOT 2 in total, at most 2 per node; CPU 4 in "
                        "total, at most 2 per node; counted the 2 nodes alive now; Ray 2.60 exposes no public API "
                        "for the node types an autoscaler could add, and no ~/ray_bootstrap_config.yaml is on "
                        "this node); accepted: a minimum <= 2, a smaller cluster.cpus_per_worker, "
                        "or more nodes")


def test_a_worker_bigger_than_any_node_never_fits():
    problem = resource_problem({"GPU_SLOT": 3.0}, "GPU_SLOT", 1, [HEAD, WORKER, WORKER])
    assert problem is not None and "holds at most 0" in problem.reason


def test_placement_group_and_marker_resources_are_not_offered():
    pg = {**WORKER, "GPU_SLOT_group_0_abc": 1.0, "bundle_group_abc": 1.0, "accelerator_type:A10G": 1.0}
    problem = resource_problem({"GPU": 1.0}, "GPU", 1, [pg])
    assert problem.accepted == "a resource the nodes offer: CPU, GPU_SLOT, memory, object_store_memory"


def test_repository_cluster_yaml_node_types_let_a_fresh_cluster_autoscale():
    # cluster.yaml: a CPU-only head is all that runs at first; the GPU types start at 0 nodes.
    types = node_types_from_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()))
    by_name = {t.name: t for t in types}
    assert by_name["gpu_spot_g5"] == NodeType("gpu_spot_g5", {"CPU": 48.0, "GPU": 4.0}, 8)
    assert by_name["head_cpu_ondemand"].max_count == 0
    head = {"CPU": 1.0, "memory": 8e9}
    need = worker_needs("GPU", 1, 8)
    assert resource_problem(need, "GPU", 8, [head], types) is None          # examples/gpu-125m.yaml's max
    assert resource_problem(need, "GPU", 4, [head], None).field == "cluster.gpu_resource"  # alive nodes only
    too_many = resource_problem(need, "GPU", 200, [head], types)
    # 8 g5 x 4 GPUs + 2 p4d x 8 + 2 on-demand g5 x 4 (CPUs: 48 / 8 and 96 / 8 per node are no tighter)
    assert too_many.field == "training.workers" and "holds at most 56 " in too_many.reason
    assert "what the autoscaler may add: 2 x gpu_ondemand_g5, 8 x gpu_spot_g5, 2 x gpu_spot_p4d" in too_many.reason
    assert resource_problem(need, "GPUS", 1, [head], types).field == "cluster.gpu_resource"


def test_cluster_wide_max_workers_caps_each_type():
    types = node_types_from_config({"max_workers": 2, "available_node_types": {
        "gpu": {"resources": {"GPU": 4}, "max_workers": 10}, "cpu": {"resources": {"CPU": 4}}}})
    assert types == [NodeType("cpu", {"CPU": 4.0}, 2), NodeType("gpu", {"GPU": 4.0}, 2)]
    assert resource_problem({"GPU": 1.0}, "GPU", 8, [], types) is None
    assert resource_problem({"GPU": 1.0}, "GPU", 9, [], types) is not None


def test_node_type_without_stated_resources_is_inconclusive():
    types = [NodeType("auto", {}, 4)]           # e.g. resources left to the cloud provider to detect
    assert resource_problem(NEED, "GPU_SLTO", 1, [HEAD], types) is None


def test_seq_len_must_match_the_prepared_dataset():
    assert seq_len_problem(None, {"seq_len": 64}, "/d") is None
    assert seq_len_problem(64, {"seq_len": 64}, "/d") is None
    err = seq_len_problem(1024, {"seq_len": 64}, "s3://b/data").error()
    assert str(err) == ("training.seq_len: 1024 does not match the prepared dataset's seq_len 64 (data.path "
                        "s3://b/data); accepted: 64, leave it out, or prepare the data with --seq-len 1024")
    assert err.field == "training.seq_len" and err.value == 1024
