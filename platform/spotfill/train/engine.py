"""The DeepSpeed engine a worker trains with: its config from the job config and the batch shape."""
from __future__ import annotations

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
        "zero_optimization": {"stage": t.zero_stage},
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
    return cfg


def resolve_precision(requested: str, on_gpu: bool) -> str:
    if requested == "auto":
        return "bf16" if on_gpu else "fp32"
    return requested


def build_engine(model, config: dict):
    """deepspeed.initialize over the model's trainable parameters; returns the engine."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    return engine
