"""torch.distributed's private names: the default timeout of process groups created without one.

Ray Train creates a run's default process group with TorchConfig(timeout_s) (public). DeepSpeed creates
more groups itself -- its ZeRO data-parallel group is `new_group(ranks)`, a clone of the world group --
without a timeout, and torch gives those its global default instead (30 minutes; NCCL's, 10). torch 2.13's
new_group() takes that default from distributed_c10d._get_default_timeout(backend), which reads the
module's `default_pg_timeout` (and `default_pg_nccl_timeout` for NCCL). Hook deepspeed_group_timeout
(catalog.py) checks both names, and that the function still reads them.
"""
from __future__ import annotations

from spotfill.ray_compat.hooks import usable


def new_groups_timeout(seconds: float) -> bool:
    """Process groups this process creates from now on without a timeout of their own (DeepSpeed's) time
    out after `seconds`, as the default group does. Returns whether it is set: False where this torch keeps
    the default elsewhere (one warning; DeepSpeed's groups then keep torch's global default)."""
    if not usable("deepspeed_group_timeout"):
        return False
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    value = timedelta(seconds=seconds)
    c10d.default_pg_timeout = value
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):   # None: torch built without NCCL
        c10d.default_pg_nccl_timeout = value
    return True
