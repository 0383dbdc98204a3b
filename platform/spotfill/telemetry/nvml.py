"""NVML readings of one NVIDIA GPU (utilisation, memory), shown beside MFU; None wherever NVML is not.

nvidia-ml-py (`import pynvml`) is optional: without it, without an NVIDIA driver, or for a device NVML
cannot find, `GpuSampler.open(...)` returns None and no reading is ever made up. NVML's "GPU utilisation"
is the share of time any kernel ran (one busy SM reads 100%): it is shown next to MFU, never instead of it.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def _nvml():
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class GpuSampler:
    def __init__(self, nvml, handle):
        self._nvml, self._handle = nvml, handle

    @classmethod
    def open(cls, uuid: str | None = None, visible_index: int = 0, nvml=None) -> "GpuSampler | None":
        """The sampler of the GPU with `uuid` (torch's device property), else the `visible_index`-th
        device of CUDA_VISIBLE_DEVICES; None when NVML or the device is not there."""
        nvml = nvml or _nvml()
        if nvml is None:
            return None
        try:
            nvml.nvmlInit()
            handle = None
            if uuid:
                u = str(uuid)
                handle = nvml.nvmlDeviceGetHandleByUUID(u if u.startswith("GPU-") else f"GPU-{u}")
            else:
                visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
                pick = visible[visible_index] if visible_index < len(visible) else str(visible_index)
                handle = (nvml.nvmlDeviceGetHandleByIndex(int(pick)) if pick.isdigit()
                          else nvml.nvmlDeviceGetHandleByUUID(pick))
            return cls(nvml, handle)
        except Exception as exc:   # no driver, no such device: no readings
            log.info("NVML unavailable (%s): GPU utilisation and memory are not reported", exc)
            return None

    def sample(self) -> dict | None:
        """{"gpu_util", "gpu_mem_util"} as fractions, {"gpu_mem_used_gb", "gpu_mem_total_gb"} (1e9 bytes);
        None when NVML fails."""
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
            mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        except Exception:
            return None
        return {"gpu_util": util.gpu / 100.0, "gpu_mem_util": util.memory / 100.0,
                "gpu_mem_used_gb": round(mem.used / 1e9, 3), "gpu_mem_total_gb": round(mem.total / 1e9, 3)}
