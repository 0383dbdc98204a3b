"""The device and precision a process computes with, from Ray's assignment and the GPU's capability."""
import pytest

from spotfill.devices import choose_device, choose_precision


def test_a_process_ray_assigned_a_gpu_computes_on_it_when_cuda_sees_one():
    assert choose_device(["3"], cuda_devices=1) == "cuda:0"     # Ray narrowed CUDA_VISIBLE_DEVICES to "3"


def test_no_gpu_from_ray_means_the_cpu_even_on_a_gpu_machine():
    assert choose_device([], cuda_devices=8) == "cpu"           # the machine's GPUs are someone else's


def test_a_gpu_from_ray_on_a_machine_without_cuda_means_the_cpu():
    assert choose_device([0], cuda_devices=0) == "cpu"          # the embedded cluster's GPU resource on a CPU


@pytest.mark.parametrize("device,cap,want", [
    ("cpu", None, "fp32"),
    ("cuda:0", (9, 0), "bf16"),     # H100/H200
    ("cuda:0", (8, 0), "bf16"),     # A100
    ("cuda:0", (8, 9), "bf16"),     # L4, L40S
    ("cuda:0", (7, 5), "fp16"),     # T4: no bf16 tensor cores
    ("cuda:0", (7, 0), "fp16"),     # V100
])
def test_auto_precision_follows_the_device(device, cap, want):
    assert choose_precision("auto", device, cap) == want


def test_precisions_the_device_cannot_run_are_refused_with_both_named():
    with pytest.raises(ValueError, match=r"bf16.*\(7, 5\)"):
        choose_precision("bf16", "cuda:0", (7, 5))
    with pytest.raises(ValueError, match="CPU"):
        choose_precision("fp16", "cpu", None)
    with pytest.raises(ValueError, match="accepted"):
        choose_precision("int8", "cpu", None)
    assert choose_precision("fp16", "cuda:0", (9, 0)) == "fp16"   # an explicit choice the GPU supports stays


def test_a_train_worker_uses_ray_trains_device_only_where_cuda_has_one():
    from spotfill.devices import choose_train_device
    assert choose_train_device("GPU", cuda_devices=2, ray_train_device="cuda:1") == "cuda:1"
    # Ray Train answers cuda:N from Ray's GPU ids even on a CPU build of torch (seen: cuda:1 with
    # CUDA_VISIBLE_DEVICES=0,1 on this CPU machine): the CPU then
    assert choose_train_device("GPU", cuda_devices=0, ray_train_device="cuda:1") == "cpu"
    assert choose_train_device("GPU_SLOT", cuda_devices=8, ray_train_device="cuda:0") == "cpu"
