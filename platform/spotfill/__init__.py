"""spotfill: elastic DeepSpeed training on Ray across spot GPUs, with spare-GPU fill-in."""
from __future__ import annotations

__version__ = "0.1.0"
