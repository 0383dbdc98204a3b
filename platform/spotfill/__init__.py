"""spotfill: elastic DeepSpeed training on Ray across spot GPUs, with spare-GPU fill-in."""
from __future__ import annotations

__version__ = "0.1.0"


def plan(**inputs):
    """Plan a training run (memory, FLOPs, time, cost, IO, DeepSpeed config); see spotfill.planner.plan.

    Imported lazily so `import spotfill` stays light (no ray/torch)."""
    from spotfill.planner import plan as _plan

    return _plan(**inputs)
