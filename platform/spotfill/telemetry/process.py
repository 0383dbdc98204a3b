"""Facts about the calling process that transitions are measured with."""
from __future__ import annotations

import os
import time


_started: list[float] = []


def process_start_time() -> float | None:
    """This process's creation time (unix s) from /proc; None where there is no /proc. A worker whose
    process started before the moment it was asked for (a restart, a lend) was a warm one. Read once and
    kept: /proc counts from boot, and the unix time of boot drifts against the wall clock on a VM whose clock
    is slewed (measured: 0.16 s over a worker's 16 s warm-up, enough to date the process after its own
    start-up hook) -- so the first read, at the process's start (train.warm), is the one kept."""
    if _started:
        return _started[0]
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            booted = time.time() - float(f.read().split()[0])     # /proc/stat's btime is whole seconds
        _started.append(booted + ticks / os.sysconf("SC_CLK_TCK"))
        return _started[0]
    except (OSError, ValueError, IndexError):
        return None
