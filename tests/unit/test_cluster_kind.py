"""Whether the arbiter treats the cluster as autoscaled: from the head's autoscaler config and the GCS."""
from spotfill.fillin.cluster_kind import decide
from spotfill.train.preflight import NodeType, node_types_from_config


def test_a_ray_up_config_with_spot_workers_that_scale_is_autoscaled():
    types = node_types_from_config({"max_workers": 8, "available_node_types": {
        "head": {"resources": {"CPU": 4}, "max_workers": 0},
        "gpu_spot": {"resources": {"GPU": 8}, "min_workers": 0, "max_workers": 4}}})
    autoscaled, why = decide(types, None)
    assert autoscaled and "gpu_spot" in why and "0..4" in why


def test_node_types_pinned_at_their_minimum_are_fixed_nodes():
    types = [NodeType("gpu", {"GPU": 8}, max_count=2, min_count=2), NodeType("head", {"CPU": 4}, 0, 0)]
    assert decide(types, None) == (False, "every node type the autoscaler knows runs a fixed number of nodes")


def test_no_config_anywhere_is_a_fixed_cluster():
    autoscaled, why = decide(None, None)
    assert not autoscaled and "fixed nodes" in why


def test_the_gcs_cluster_config_counts_when_the_head_has_no_file():
    assert decide(None, [(1, 1), (0, -1)])[0] is True       # KubeRay: an unbounded worker group
    assert decide(None, [(2, 2)])[0] is False


def test_min_workers_are_read_from_the_config_and_capped_by_max():
    (t,) = node_types_from_config({"available_node_types": {"g": {"min_workers": 5, "max_workers": 3}}})
    assert (t.min_count, t.max_count) == (3, 3)
