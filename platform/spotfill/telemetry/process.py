"""Facts about the calling process that transitions are measured with."""
from __future__ import annotations

import os
import time


def process_start_time() -> float | None:
    """This process's creation time (unix s) from /proc; None where there is no /proc. A worker whose
    process started before the moment it was asked for (a restart, a lend) was a warm one."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            booted = time.time() - float(f.read().split()[0])     # /proc/stat's btime is whole seconds
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
