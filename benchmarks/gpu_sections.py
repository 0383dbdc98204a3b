"""How the GPU check (benchmarks/gpu_check.py) spends its budget and runs a section: each section's cap is its
weight's share of the budget left, and each runs in a process group of its own that is killed whole -- its
pytest, its Ray processes and anything they started -- when it overruns its cap or when it ends.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time

KILL_GRACE_S = 5.0        # SIGTERM to SIGKILL; the share of a cap kept back for that and the kill itself


def caps(weights: dict[str, float], budget_s: float) -> dict[str, float]:
    """The caps if every section ran to its cap: each section's share of the budget by weight (the shares
    add to the budget, so the last section is never left without time)."""
    total = sum(weights.values())
    return {name: budget_s * w / total for name, w in weights.items()}


def share(name: str, remaining: list[str], weights: dict[str, float], left_s: float) -> float:
    """The cap of `name`, the first of the sections `remaining` (itself included), when `left_s` of the
    budget is left: its weight's share of what is left. A section that ends early gives its time to the
    ones after it; one that runs to its cap takes only its own share."""
    total = sum(weights[n] for n in remaining)
    return max(0.0, left_s) * weights[name] / total if total else 0.0


def _descendants(pid: int) -> list:
    import psutil
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def kill_tree(pgid: int, known: dict) -> list[int]:
    """SIGTERM then SIGKILL the process group `pgid` and every process in `known` (psutil.Process objects
    seen under the section's process, so that ones that left its group -- a daemon with a session of its
    own -- go too); psutil checks each one's start time, so a reused PID is never hit. The PIDs still alive
    at the SIGTERM."""
    import psutil
    alive = [p for p in known.values() if p.is_running()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        if sig == signal.SIGTERM:
            _gone, alive_after = psutil.wait_procs(alive, timeout=KILL_GRACE_S)
            hit = [p.pid for p in alive]
            alive = alive_after
            deadline = time.time() + KILL_GRACE_S
            while time.time() < deadline and _group_alive(pgid):
                time.sleep(0.2)
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    return hit


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_process_group(cmd: list[str], timeout_s: float, cwd: str | None = None, env: dict | None = None,
                      poll_s: float = 1.0) -> dict:
    """Run `cmd` in a session of its own for at most `timeout_s`, then kill whatever of it is left (its
    group and every descendant it was seen with). {"rc": exit code or "timeout", "tail": the output's last
    2500 characters, "killed": the PIDs still running at the end}. Output goes to a file, not a pipe, so a
    grandchild holding it cannot keep this waiting."""
    known: dict = {}
    with tempfile.TemporaryFile("w+b") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + timeout_s
        rc = None
        while rc is None:
            for p in _descendants(proc.pid):
                known.setdefault(p.pid, p)         # psutil.Process: its start time keeps PID reuse apart
            try:
                rc = proc.wait(timeout=max(0.01, min(poll_s, deadline - time.time())))
            except subprocess.TimeoutExpired:
                if time.time() >= deadline:
                    rc = "timeout"
        killed = kill_tree(proc.pid, known)
        if rc == "timeout":
            proc.wait()
        log.seek(0)
        tail = log.read().decode(errors="replace")[-2500:]
    return {"rc": rc, "tail": tail, "killed": killed}
