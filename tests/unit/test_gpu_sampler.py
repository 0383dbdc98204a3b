"""NVML readings are optional and never made up (telemetry.nvml), and rank 0's host timer sums the phases
of every micro-batch (train.step_timer)."""
import importlib.util
from types import SimpleNamespace

import pytest

from spotfill.telemetry.nvml import GpuSampler
from spotfill.train import step_timer


class FakeNvml:
    """Records the calls spotfill makes; answers like NVML on a device with 80 GB, 40 GB used."""

    def __init__(self, fail_init=False, fail_sample=False):
        self.calls, self.fail_init, self.fail_sample = [], fail_init, fail_sample

    def nvmlInit(self):
        self.calls.append("init")
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(("uuid", uuid))
        return "h"

    def nvmlDeviceGetHandleByIndex(self, i):
        self.calls.append(("index", i))
        return "h"

    def nvmlDeviceGetUtilizationRates(self, h):
        if self.fail_sample:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=40_000_000_000, total=80_000_000_000)


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="nvidia-ml-py is installed here")
def test_without_nvidia_ml_py_there_is_no_sampler():
    assert GpuSampler.open(uuid="abc") is None


def test_readings_are_fractions_and_gigabytes():
    nv = FakeNvml()
    s = GpuSampler.open(uuid="58c3b6a6-0000", nvml=nv)
    assert nv.calls == ["init", ("uuid", "GPU-58c3b6a6-0000")]
    assert s.sample() == {"gpu_util": 0.97, "gpu_mem_util": 0.41, "gpu_mem_used_gb": 40.0, "gpu_mem_total_gb": 80.0}


def test_visible_devices_pick_the_physical_index(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    nv = FakeNvml()
    assert GpuSampler.open(visible_index=1, nvml=nv) is not None
    assert nv.calls[-1] == ("index", 5)


def test_no_driver_or_a_lost_gpu_gives_no_reading():
    assert GpuSampler.open(uuid="x", nvml=FakeNvml(fail_init=True)) is None
    assert GpuSampler.open(uuid="x", nvml=FakeNvml(fail_sample=True)).sample() is None


def test_host_timer_sums_phases_over_micro_batches(monkeypatch):
    clock = iter([10.0, 10.3, 10.35, 11.0, 11.2, 11.3])    # two micro-batches: mark, backward, step each
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: next(clock))
    t = step_timer.HostTimer()
    t.begin()
    for _ in range(2):
        t.mark()
        t.backward_done()
        t.step_done()
    fb, opt = t.read()
    assert fb == pytest.approx(0.3 + 0.2) and opt == pytest.approx(0.05 + 0.1)


def test_cpu_device_has_no_peak():
    assert step_timer.device_info("cpu", "fp32") == {"device": "cpu", "gpu_type": None, "peak_flops_per_gpu": None}
    assert isinstance(step_timer.make_timer(SimpleNamespace(type="cpu")), step_timer.HostTimer)
