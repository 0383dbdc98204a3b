"""The device a process computes on, chosen from what Ray assigned it, and the precision that device supports.

Ray assigns whole GPUs through its `GPU` resource: an actor or task that asked for `num_gpus` gets
CUDA_VISIBLE_DEVICES set to its GPUs (so they are cuda:0.. inside the process) and `ray.get_gpu_ids()` lists
them. A process Ray assigned no GPU computes on the CPU, even on a machine that has GPUs (they belong to
someone else: training, or another tenant). A process Ray assigned GPUs on a machine without CUDA (the embedded
cluster declares Ray's `GPU` resource on CPU machines) computes on the CPU too -- the same code path, every test.

Precision: bf16 only where the GPU has bf16 tensor cores (compute capability 8.0 and newer: A100, L4, A10G,
L40S, H100, H200, B200); fp16 (with loss scaling in training) on older GPUs (T4, V100); fp32 on the CPU.

`choose_device` and `choose_precision` are pure (no torch, no ray) and unit-tested; `assigned_device`,
`device_capability` and `compute_dtype` read the live process.
"""
from __future__ import annotations

import os

BF16_MIN_CAPABILITY = (8, 0)     # Ampere: the first GPUs with bf16 tensor cores
PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def choose_device(gpu_ids: list, cuda_devices: int) -> str:
    """"cuda:0" when Ray assigned this process at least one GPU and CUDA sees a device; else "cpu".
    `gpu_ids`: what Ray assigned (ray.get_gpu_ids()); `cuda_devices`: torch.cuda.device_count() (0 without
    CUDA). Ray narrows CUDA_VISIBLE_DEVICES to the assigned GPUs, so the first assigned one is cuda:0."""
    return "cuda:0" if gpu_ids and cuda_devices > 0 else "cpu"


def choose_train_device(gpu_resource: str, cuda_devices: int, ray_train_device: str | None) -> str:
    """A Ray Train worker's device: the one Ray Train assigned it (`ray.train.torch.get_device()`, which
    answers cuda:N from Ray's GPU ids even where torch has no CUDA) when the job asks for Ray's GPU resource
    and CUDA sees a device; else the CPU (a logical resource such as GPU_SLOT assigns no device)."""
    if gpu_resource != "GPU" or cuda_devices <= 0 or not ray_train_device:
        return "cpu"
    return ray_train_device


def choose_precision(requested: str, device: str, capability: tuple[int, int] | None) -> str:
    """The training/inference precision for `device` ("cpu" or "cuda:N"): `requested` unless "auto";
    auto: bf16 on a GPU with bf16 tensor cores, fp16 on an older GPU, fp32 on the CPU. A request the device
    cannot honour (bf16 or fp16 on the CPU, bf16 on a pre-Ampere GPU) raises ValueError naming both."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r}: accepted {', '.join(PRECISIONS)}")
    on_gpu = device.startswith("cuda")
    bf16_ok = on_gpu and capability is not None and tuple(capability) >= BF16_MIN_CAPABILITY
    if requested == "auto":
        return ("bf16" if bf16_ok else "fp16") if on_gpu else "fp32"
    if requested == "bf16" and on_gpu and not bf16_ok:
        raise ValueError(f"precision 'bf16' on a GPU of compute capability {capability}: bf16 needs "
                         f">= {BF16_MIN_CAPABILITY[0]}.{BF16_MIN_CAPABILITY[1]}; use fp16 or auto")
    if requested in ("bf16", "fp16") and not on_gpu:
        raise ValueError(f"precision {requested!r} on the CPU: use fp32 or auto")
    return requested


def ray_gpu_ids() -> list:
    """The GPUs Ray assigned this process ([] outside Ray, or when it asked for none)."""
    try:
        import ray
        if not ray.is_initialized():
            return []
        return list(ray.get_gpu_ids())
    except Exception:  # noqa: BLE001 - no Ray worker context: nothing assigned
        return []


def assigned_device(gpu_ids: list | None = None):
    """The torch.device this process computes on (see choose_device)."""
    import torch
    ids = ray_gpu_ids() if gpu_ids is None else gpu_ids
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device(choose_device(ids, count))


def device_capability(device) -> tuple[int, int] | None:
    import torch
    if getattr(device, "type", str(device)) != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))


def precision_for(device, requested: str = "auto") -> str:
    return choose_precision(requested, str(device), device_capability(device))


def compute_dtype(device, requested: str = "auto"):
    """The torch dtype for inference on `device`: bf16, fp16 or fp32 as precision_for decides."""
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision_for(device, requested)]


def visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as Ray set it (None when unset)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")
