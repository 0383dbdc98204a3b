"""The torch.distributed backend follows what the first worker has, not Ray's GPU resource alone."""
from spotfill.train.backend import choose_backend
from spotfill.train.preflight import storage_check_node


def test_nccl_only_where_a_cuda_device_and_nccl_are_both_there():
    assert choose_backend(cuda_devices=1, nccl_built=True) == "nccl"
    # `ray start --num-gpus 3` on a laptop: Ray assigns the GPU resource, torch has no CUDA device ->
    # NCCL would fail at once ("Distributed package doesn't have NCCL built in")
    assert choose_backend(cuda_devices=0, nccl_built=False) == "gloo"
    assert choose_backend(cuda_devices=0, nccl_built=True) == "gloo"
    assert choose_backend(cuda_devices=2, nccl_built=False) == "gloo"


def test_the_worker_side_storage_check_runs_on_a_node_with_the_accelerator():
    nodes = [{"NodeID": "head", "Alive": True, "Resources": {"CPU": 2}},
             {"NodeID": "b-gpu", "Alive": True, "Resources": {"CPU": 2, "GPU": 1}},
             {"NodeID": "a-gpu-dead", "Alive": False, "Resources": {"GPU": 1}},
             {"NodeID": "c-gpu", "Alive": True, "Resources": {"GPU": 2}}]
    assert storage_check_node(nodes, "GPU") == "b-gpu"
    assert storage_check_node(nodes[:1], "GPU") is None       # an autoscaled cluster before its first GPU node
