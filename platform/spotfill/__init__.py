"""spotfill: elastic DeepSpeed training on Ray across spot GPUs, with spare-GPU fill-in.

The public SDK (imported lazily so `import spotfill` stays light: no ray, no torch):

    import spotfill
    job = spotfill.load_job_config("examples/tiny-cpu.yaml")
    spotfill.prepare(spotfill.load_prepare_config("examples/prepare-stdlib.yaml"))
    report = spotfill.TrainingJob(job).fit()
    spotfill.plan(params="7B", gpus=8, gpu_type="a100-80gb")
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "TrainingJob": ("spotfill.train.job", "TrainingJob"),
    "load_job_config": ("spotfill.config.job", "load_job_config"),
    "load_prepare_config": ("spotfill.config.job", "load_prepare_config"),
    "prepare": ("spotfill.train.prepare", "prepare"),
}
__all__ = ["plan", *_LAZY]


def plan(**inputs):
    """Plan a training run (memory, FLOPs, time, cost, IO, DeepSpeed config); see spotfill.planning.planner.plan."""
    from spotfill.planning.planner import plan as _plan

    return _plan(**inputs)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'spotfill' has no attribute {name!r}")
