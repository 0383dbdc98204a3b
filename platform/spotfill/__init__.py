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
    "load_job_config": ("spotfill.config.job", "load_job_config"),
    "load_prepare_config": ("spotfill.config.job", "load_prepare_config"),
    "prepare": ("spotfill.train.prepare", "prepare"),
}
__all__ = ["plan", "TrainingJob", *_LAZY]
_SDK: dict = {}


def plan(**inputs):
    """Plan a training run (memory, FLOPs, time, cost, IO, DeepSpeed config); see spotfill.planning.planner.plan."""
    from spotfill.planning.planner import plan as _plan

    return _plan(**inputs)


def _training_job():
    """spotfill.train.job.TrainingJob with spotfill's own fill-in wired in. Training sits below fill-in
    (README: layers), so train.job's TrainingJob takes what runs in a pipeline's bubbles as an argument; the
    SDK's brings spotfill's bubble filler by default (`training.bubble_fill` works as documented), and
    `bubble_filler=` replaces it."""
    if "TrainingJob" not in _SDK:
        from spotfill.train.job import TrainingJob as _Base

        class TrainingJob(_Base):
            __doc__ = _Base.__doc__

            def __init__(self, config, runtime_env: dict | None = None, live: bool = False, bubble_filler=None):
                if bubble_filler is None:
                    from spotfill.fillin.bubble_fill import bubble_filler
                super().__init__(config, runtime_env=runtime_env, live=live, bubble_filler=bubble_filler)

        TrainingJob.__module__, TrainingJob.__qualname__ = "spotfill", "TrainingJob"
        _SDK["TrainingJob"] = TrainingJob
    return _SDK["TrainingJob"]


def __getattr__(name: str):
    if name == "TrainingJob":
        return _training_job()
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'spotfill' has no attribute {name!r}")
