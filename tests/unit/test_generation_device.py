"""A serving replica computes where Ray put it: the GPU Ray assigned (cuda:0 inside the process), else the
CPU -- never a GPU it was not lent -- in bf16 where that GPU supports it; and the engine builds its inputs and
cache on the model's device (a model on the `meta` device fails at once on a CPU tensor)."""
import pytest
import torch

from spotfill import devices
from spotfill.generation.decoders import GPTDecoder
from spotfill.generation.replica import replica_device
from spotfill.train.model import GPT, preset


@pytest.fixture
def machine(monkeypatch):
    """A machine with `cuda` CUDA devices of compute capability `cap`, and what Ray assigned this process."""
    def set_up(assigned, cuda=1, cap=(9, 0)):
        monkeypatch.setattr(devices, "ray_gpu_ids", lambda: list(assigned))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
    return set_up


def test_no_gpu_assigned_means_the_cpu_even_on_a_gpu_machine(machine):
    machine([], cuda=8)
    assert replica_device() == (torch.device("cpu"), torch.float32)


def test_the_assigned_gpu_in_bf16_or_fp16_by_capability(machine):
    machine(["5"], cuda=1, cap=(9, 0))               # Ray narrowed CUDA_VISIBLE_DEVICES to GPU 5: cuda:0
    assert replica_device() == (torch.device("cuda:0"), torch.bfloat16)
    machine(["5"], cuda=1, cap=(7, 5))
    assert replica_device() == (torch.device("cuda:0"), torch.float16)


def test_a_gpu_resource_ray_cannot_map_to_cuda_means_the_cpu(machine):
    machine(["0"], cuda=0)                           # the embedded cluster's GPU on a CPU machine
    assert replica_device() == (torch.device("cpu"), torch.float32)


def test_the_decoder_builds_inputs_and_cache_on_the_models_device():
    torch.manual_seed(0)
    model = GPT(preset("tiny")).to("meta")
    dec = GPTDecoder(model)
    cache = dec.new_cache(2)
    assert cache[0][0].device.type == "meta"
    logits = dec.forward(cache, 0, [[1, 2, 3], [4, 5, 6]], [0, 0])
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, 3, model.cfg.vocab_size)
