"""Fill-in is second on the host CPU too (pure: the os module only, no Ray).

The arbiter lends fill-in only the GPUs training cannot use, but a lent GPU's node also runs training's
host-side work on the same CPU cores (data loading, the optimizer step, kernel launches, collectives). A
fill-in process (a Serve replica of serving/app.py, a batch UnitWorker, a sweep trial) calls
`lower_cpu_priority()` when it starts: every thread of the process gets nice `cpu_nice` (default 19, the
lowest priority), and threads it starts later inherit it. The kernel then gives fill-in only the CPU time
training leaves unused; fill-in still gets all of it when training waits.

Ray starts every worker process at nice 15 (its `worker_niceness`), training's workers included, so nice
19 alone leaves fill-in about 30% of a core training wants (CFS weights 15 vs 36). Fill-in threads are
therefore also put in the SCHED_IDLE scheduling class (`cpu_idle`, default on; Linux): the kernel runs
them only when the core would otherwise idle, and a waking training thread preempts them at once.

Linux keeps a nice value (and a scheduling policy) per thread (setpriority on a process id changes only that thread), so each thread
listed in /proc/<pid>/task is reniced. Raising one's own nice value needs no privilege; a nice value
already higher than asked is left as it is. `cpu_nice: 0` turns the feature off.

Configured by `SPOTFILL_FILLIN_CPU_NICE` / `SPOTFILL_FILLIN_CPU_IDLE` (0/1) in a fill-in process's
environment (scenario keys `fillin.cpu_nice` / `fillin.cpu_idle`, Serve app arguments `cpu_nice` /
`cpu_idle`); unset -> DEFAULT_NICE / on.
"""
from __future__ import annotations

import os

from spotfill.config.errors import ConfigError

DEFAULT_NICE = 19
ENV = "SPOTFILL_FILLIN_CPU_NICE"
IDLE_ENV = "SPOTFILL_FILLIN_CPU_IDLE"


def configured_idle(value=None, field: str = "fillin.cpu_idle") -> bool:
    """SCHED_IDLE for fill-in threads: `value`, else $SPOTFILL_FILLIN_CPU_IDLE (1/0, true/false), else on."""
    if value is None:
        value = os.environ.get(IDLE_ENV)
        if value in (None, ""):
            return True
        field = IDLE_ENV
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    if not isinstance(value, bool):
        raise ConfigError(field, value, accepted="true or false")
    return value


def configured_nice(value=None, field: str = "fillin.cpu_nice") -> int:
    """The nice value for fill-in processes: `value`, else $SPOTFILL_FILLIN_CPU_NICE, else DEFAULT_NICE.
    An integer 0..19 (0: fill-in runs at the default priority, like training)."""
    if value is None:
        value = os.environ.get(ENV)
        if value in (None, ""):
            return DEFAULT_NICE
        field = ENV
    accepted = "an integer from 0 (off) to 19 (lowest CPU priority)"
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
        raise ConfigError(field, value, accepted=accepted)
    n = value
    return n


def thread_ids(pid: int | None = None) -> list[int]:
    """The threads of process `pid` (this one by default); [pid] where /proc is not available."""
    pid = pid or os.getpid()
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return [pid]


def lower_cpu_priority(nice=None, pid: int | None = None, idle=None) -> dict:
    """Give every thread of process `pid` (default: this one) at least nice `nice` (see configured_nice)
    and, with `idle` (configured_idle), the SCHED_IDLE policy. Returns {"nice", "idle", "threads"}
    (threads changed); never raises for a thread that exits meanwhile."""
    n, sched_idle = configured_nice(nice), configured_idle(idle)
    sched_idle = sched_idle and hasattr(os, "SCHED_IDLE")
    changed = 0
    for tid in thread_ids(pid):
        try:
            done = False
            if n > 0 and os.getpriority(os.PRIO_PROCESS, tid) < n:
                os.setpriority(os.PRIO_PROCESS, tid, n)
                done = True
            if sched_idle and os.sched_getscheduler(tid) != os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                done = True
            changed += done
        except (ProcessLookupError, PermissionError):
            continue
    return {"nice": n, "idle": sched_idle, "threads": changed}


def thread_policy(pid: int) -> dict[int, int]:
    """Scheduling policy of each thread of `pid` (os.SCHED_OTHER, os.SCHED_IDLE, ...)."""
    out = {}
    for tid in thread_ids(pid):
        try:
            out[tid] = os.sched_getscheduler(tid)
        except OSError:
            continue
    return out


def thread_nice(pid: int) -> dict[int, int]:
    """Nice value of each thread of `pid`, from /proc/<pid>/task/<tid>/stat (field 19)."""
    out = {}
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()     # after "pid (comm) ": field 3 is fields[0]
        out[tid] = int(fields[16])
    return out
