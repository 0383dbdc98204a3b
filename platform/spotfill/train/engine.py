"""The DeepSpeed engine a worker trains with: its config from the job config and the batch shape.

The optimizer is torch's AdamW handed to deepspeed.initialize as a client optimizer (ZeRO supports it):
DeepSpeed's own "AdamW" resolves to FusedAdam, whose JIT op costs a build lock, a compile on first use and
~2 s of py-cpuinfo probing on every worker start -- on the recovery critical path. The update is the same
decoupled-weight-decay Adam; the config keeps the "optimizer" section so the parameters live in one place.
It is torch's fused implementation (one kernel over all parameters, CPU and GPU, no JIT op): torch's
default on a CPU is a Python loop of per-tensor ops, which took 600 ms where FusedAdam takes 330 ms on the
57M model (one thread) -- 6% of every step, the whole of spotfill's step overhead there.
JIT ops DeepSpeed still loads (the CPU shared-memory comm op) build in a cache folder of this environment
and through a lock that cannot outlive its owner (spotfill.ray_compat.opcache); on a GPU nothing is JIT-built
(DeepSpeed's CUDA accelerator has no such comm op), so an arch list such as TORCH_CUDA_ARCH_LIST=9.0a, which
DeepSpeed's op builder cannot parse, never reaches it.

The learning rate: DeepSpeed's WarmupCosineLR gives lr x iteration / warmup, and a fresh one stands at
iteration -1 ("not started": lr 0) when the first optimizer step runs and at iteration 0 (lr 0 again) for
the second -- two steps that train nothing. build_engine starts the schedule at iteration 1
(FIRST_ITERATION): optimizer step k trains at lr x k / warmup_steps during the warm-up, then the cosine.
DeepSpeed takes at least 2 warm-up steps (a smaller training.warmup_steps acts as 2: the first step trains
at lr / 2). A restored engine takes the iteration its checkpoint saved.
"""
from __future__ import annotations

import os
import sys

from spotfill.config.job import JobConfig


def ds_config(job: JobConfig, micro: int, accum: int, precision: str, universal: bool) -> dict:
    t = job.training
    cfg = {
        "train_batch_size": t.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": t.weight_decay}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": t.steps, "warmup_num_steps": max(1, t.warmup_steps), "warmup_type": "linear",
            "warmup_min_ratio": 0.0, "cos_min_ratio": t.min_lr / t.lr}},
        # ZeRO-1/2 save their optimizer state in DeepSpeed's elastic layout: it loads at any world size
        # without a universal-checkpoint conversion (load_checkpoint below)
        "zero_optimization": {"stage": t.zero_stage, **({"elastic_checkpoint": True} if t.zero_stage in (1, 2)
                                                        else {})},
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


def resolve_precision(requested: str, device) -> str:
    """The precision a worker trains in on `device` (spotfill.devices.choose_precision: auto = bf16 where the
    GPU has bf16 tensor cores, fp16 with loss scaling on older GPUs, fp32 on the CPU). A precision the device
    cannot run fails the worker with a one-line ConfigError naming training.precision."""
    from spotfill.config.errors import ConfigError
    from spotfill.devices import device_capability, choose_precision
    try:
        return choose_precision(requested, str(device), device_capability(device))
    except ValueError as exc:
        raise ConfigError("training.precision", requested, reason=str(exc),
                          accepted="auto, or a precision the workers' device supports") from None


def jit_cache_dir(base: str | None = None) -> str:
    """This environment's own JIT op cache (interpreter, torch and DeepSpeed versions in its name)."""
    from importlib.metadata import version

    from spotfill.ray_compat.opcache import extensions_dir
    base = base or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return extensions_dir(base, sys.executable, sys.version.split()[0], version("torch"), version("deepspeed"))


def load_checkpoint(engine, load_dir: str, tag: str, elastic: bool) -> dict:
    """Load checkpoint `tag` into `engine` (optimizer and LR scheduler states included); returns its client
    state. `elastic`: a ZeRO-1/2 checkpoint in DeepSpeed's elastic layout (what ds_config saves), loaded at
    any data-parallel size without conversion (spotfill.ray_compat.zero_load_elastic); else DeepSpeed's own
    load (the saved size, or a universal checkpoint)."""
    if elastic:
        from spotfill.ray_compat import zero_load_elastic
        return zero_load_elastic(engine, load_dir, tag)
    _, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=True,
                                             load_lr_scheduler_states=True)
    if client_state is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {load_dir}")
    return client_state


FUSED_DEVICES = ("cpu", "cuda")   # where torch (>= 2.4) has a fused AdamW kernel for floating-point params


def client_optimizer(params, optimizer: dict):
    """torch.optim.AdamW from the config's "optimizer" section (the only type spotfill configures): fused
    when every parameter is floating point on a CPU or a CUDA device (DeepSpeed moves a model built on the
    CPU to the GPU after this: both have the kernel), else torch's default (torch checks only at the first
    step, too late to choose)."""
    import torch

    if optimizer.get("type", "").lower() != "adamw":
        raise ValueError(f"optimizer.type {optimizer.get('type')!r}: spotfill builds AdamW only")
    p = optimizer.get("params", {})
    params = list(params)
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    fused = all(t.is_floating_point() and t.device.type in FUSED_DEVICES for t in tensors)
    return torch.optim.AdamW(params, lr=p["lr"], betas=tuple(p.get("betas", (0.9, 0.999))),
                             eps=p.get("eps", 1e-8), weight_decay=p.get("weight_decay", 0.0),
                             **({"fused": True} if fused else {}))


FIRST_ITERATION = 1      # the scheduler iteration the first optimizer step trains at (lr x 1 / warmup)


def start_lr_schedule(engine) -> None:
    """Move a fresh DeepSpeed LR scheduler (iteration -1: lr 0) to FIRST_ITERATION, so the first optimizer
    step trains; a scheduler that has started (or none) is left alone."""
    sched = getattr(engine, "lr_scheduler", None)
    if sched is not None and getattr(sched, "last_batch_iteration", None) == -1:
        sched.step(FIRST_ITERATION)


def build_engine(model, config: dict, device=None):
    """deepspeed.initialize over the model's trainable parameters, with torch's AdamW as the client
    optimizer (no JIT op), on `device` -- the GPU Ray assigned this worker: DeepSpeed would otherwise pick
    cuda:LOCAL_RANK, another worker's GPU wherever a worker holds more than one or CUDA_VISIBLE_DEVICES lists
    its neighbours' too -- and the LR schedule started (start_lr_schedule). Returns the engine."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", jit_cache_dir())
    from spotfill.config import constants
    from spotfill.ray_compat import (guard_jit_op_builds, new_groups_timeout, skip_deepspeed_muon,
                                     skip_deepspeed_shm_comm)
    guard_jit_op_builds()
    skip_deepspeed_muon()    # no torch.compile/inductor import for an optimizer spotfill never builds
    skip_deepspeed_shm_comm()   # no JIT build of an inference-only comm op as DeepSpeed's comm starts
    # DeepSpeed's groups (its ZeRO data-parallel group is a new_group clone of the world) time out with the
    # default group Ray Train made, not after torch's global 30 minutes
    new_groups_timeout(constants.COLLECTIVE_TIMEOUT_S)
    import deepspeed

    config = dict(config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = client_optimizer(params, config.pop("optimizer")) if "optimizer" in config else None
    engine, _, _, _ = deepspeed.initialize(args=deepspeed_args(device), model=model, model_parameters=params,
                                           optimizer=optimizer, config=config)
    start_lr_schedule(engine)
    return engine


def deepspeed_args(device):
    """deepspeed.initialize's `args`: `device_rank` = the CUDA device index to run on (DeepSpeed's engine
    sets it as the current device and its own); None on the CPU, where DeepSpeed's default applies."""
    import argparse
    if device is None or getattr(device, "type", str(device)) != "cuda":
        return None
    return argparse.Namespace(device_rank=int(device.index or 0))
