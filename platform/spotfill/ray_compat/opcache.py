"""DeepSpeed's JIT ops: one build cache per environment, and build locks that cannot outlive their owner
(pure decisions; the torch patch that applies them is in spotfill.ray_compat).

torch builds a JIT op under `$TORCH_EXTENSIONS_DIR/<op>/` and guards the build with an empty `lock` file
(torch.utils.file_baton.FileBaton): whoever creates it builds, everyone else waits -- forever -- until it
disappears. A worker killed mid-build (what spot training does all day) leaves it behind and every later
load on that machine hangs. Two virtual environments sharing `~/.cache/torch_extensions` also rebuild
each other's ops (different torch/DeepSpeed versions write the same folder).

spotfill's baton writes its owner (host, boot, pid) into the lock; a waiter removes a lock whose owner is
gone (same machine and boot, process dead), or that records no owner and is older than STALE_UNOWNED_S.
"""
from __future__ import annotations

import hashlib
import json
import os

STALE_UNOWNED_S = 300.0   # no owner recorded (a plain torch baton): longer than any op build takes
STALE_FOREIGN_S = 3600.0  # owner on another machine (shared home): cannot check its process


def extensions_dir(base: str, executable: str, python_version: str, torch_version: str,
                   deepspeed_version: str) -> str:
    """The JIT op cache folder for one environment: interpreter, torch and DeepSpeed versions."""
    key = hashlib.sha1("|".join((executable, python_version, torch_version, deepspeed_version)).encode())
    major_minor = "".join(python_version.split(".")[:2])
    return os.path.join(base, f"spotfill-py{major_minor}-torch{torch_version.split('+')[0]}-"
                              f"ds{deepspeed_version}-{key.hexdigest()[:10]}")


def owner_record(host: str, boot_id: str, pid: int, t: float) -> str:
    return json.dumps({"host": host, "boot_id": boot_id, "pid": pid, "t": t})


def parse_owner(text: str) -> dict | None:
    try:
        owner = json.loads(text)
    except ValueError:
        return None
    return owner if isinstance(owner, dict) and {"host", "boot_id", "pid"} <= set(owner) else None


def stale_reason(owner: dict | None, age_s: float, host: str, boot_id: str, pid_alive) -> str | None:
    """Why a build lock is stale, or None while its owner may still be building. `pid_alive(pid)` is only
    asked about processes of this machine and boot."""
    if owner is None:
        if age_s > STALE_UNOWNED_S:
            return f"no owner recorded and {age_s:.0f}s old (> {STALE_UNOWNED_S:.0f}s)"
        return None
    if owner["host"] != host:
        if age_s > STALE_FOREIGN_S:
            return f"owner on {owner['host']} and {age_s:.0f}s old (> {STALE_FOREIGN_S:.0f}s)"
        return None
    if owner["boot_id"] != boot_id:
        return f"owner pid {owner['pid']} ran before this machine rebooted"
    if not pid_alive(int(owner["pid"])):
        return f"owner pid {owner['pid']} is dead"
    return None


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
