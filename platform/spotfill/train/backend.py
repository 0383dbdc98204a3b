"""The torch.distributed backend, chosen from what the training workers really have.

Ray Train 2.60 picks NCCL whenever a worker asks for Ray's `GPU` resource (its TorchTrainer fills in
TorchConfig.backend at construction: ray/train/v2/torch/torch_trainer.py). Ray assigns that resource on
machines without GPUs too (the embedded cluster, `ray start --num-gpus N` on a laptop), and there NCCL fails
at once: "Distributed package doesn't have NCCL built in". So with `choose_on_worker` the backend is decided
on the group's first worker, as each group starts, from what that process sees: NCCL where torch has it and
CUDA sees a device, gloo otherwise.

The collective timeout (TorchConfig.timeout_s) is the process-group timeout every collective honours.
"""
from __future__ import annotations

import dataclasses
import logging

from ray.train.torch import TorchConfig

log = logging.getLogger("spotfill.train.backend")


def choose_backend(cuda_devices: int, nccl_built: bool) -> str:
    """"nccl" when this worker has a CUDA device and torch was built with NCCL; else "gloo"."""
    return "nccl" if cuda_devices > 0 and nccl_built else "gloo"


def probe_worker() -> dict:
    """What a training worker process has (runs on the worker)."""
    import torch
    import torch.distributed as dist
    return {"cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "nccl_built": bool(dist.is_available() and dist.is_nccl_available())}


def _device_aware_backend_cls():
    from spotfill.ray_compat import torch_train_backend

    base = torch_train_backend()
    if base is None:           # the hook is gone (a warning said so): Ray's own choice
        return None

    class DeviceAwareTorchBackend(base):
        def on_start(self, worker_group, backend_config):
            if getattr(backend_config, "choose_on_worker", False):
                seen = worker_group.execute_single(0, probe_worker)
                backend = choose_backend(seen["cuda_devices"], seen["nccl_built"])
                log.info("torch.distributed backend %s: the first worker sees %d CUDA device(s), NCCL %s",
                         backend, seen["cuda_devices"], "built" if seen["nccl_built"] else "not built")
                backend_config = dataclasses.replace(backend_config, backend=backend)
            return super().on_start(worker_group, backend_config)

    return DeviceAwareTorchBackend


@dataclasses.dataclass
class DeviceAwareTorchConfig(TorchConfig):
    """TorchConfig whose backend is chosen on the first worker (choose_backend) -- whatever Ray's trainer
    filled in -- unless `choose_on_worker` is off."""

    choose_on_worker: bool = True

    @property
    def backend_cls(self):
        return _device_aware_backend_cls() or super().backend_cls
