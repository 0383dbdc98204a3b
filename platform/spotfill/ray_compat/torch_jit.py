"""torch's private names: the JIT extension build lock (DeepSpeed's ops build through torch.utils.cpp_extension).

torch up to 2.13 locks an op's build with a FileBaton: a lock FILE whose mere existence blocks, so a
builder killed mid-build (spot loss, OOM) leaves a lock every later load waits on forever. The guard here
writes the owner into the lock and lets a waiter remove one whose owner is gone (decisions:
spotfill.ray_compat.opcache). torch 2.14 locks with an OS lock the kernel releases when its holder dies; there
the guard is not needed and is not applied (hook jit_build_lock_guard, catalog.py).
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import time

from spotfill.ray_compat.hooks import usable

log = logging.getLogger(__name__)


class StaleBuildLock(RuntimeError):
    """A JIT op build lock whose owner is gone was removed; the load starts over."""


@functools.lru_cache(maxsize=None)
def owned_file_baton() -> type:
    """torch's FileBaton subclass that records its owner (built when first used: torch is imported then)."""
    from torch.utils.file_baton import FileBaton

    from spotfill.ray_compat.opcache import boot_id, owner_record, parse_owner, pid_alive, stale_reason

    class OwnedFileBaton(FileBaton):
        """torch's JIT build lock, with its owner written in it and a wait that ends when the owner is gone
        (torch's own waits forever on a lock a killed worker left behind)."""

        def try_acquire(self):
            got = super().try_acquire()
            if got:   # torch opens it read-only: record the owner through a second descriptor
                try:
                    with open(self.lock_file_path, "w") as f:
                        f.write(owner_record(socket.gethostname(), boot_id(), os.getpid(), time.time()))
                except BaseException:
                    self.release()    # never leave an ownerless lock behind
                    raise
            return got

        def wait(self):
            while os.path.exists(self.lock_file_path):
                reason = self._stale()
                if reason:
                    try:
                        os.remove(self.lock_file_path)
                    except FileNotFoundError:
                        pass
                    log.warning("removed stale JIT op build lock %s: %s", self.lock_file_path, reason)
                    raise StaleBuildLock(f"{self.lock_file_path}: {reason}")
                time.sleep(self.wait_seconds)

        def _stale(self) -> str | None:
            try:
                age = time.time() - os.stat(self.lock_file_path).st_mtime
                with open(self.lock_file_path) as f:
                    owner = parse_owner(f.read())
            except FileNotFoundError:
                return None
            return stale_reason(owner, age, socket.gethostname(), boot_id(), pid_alive)

    OwnedFileBaton.__module__ = __name__
    return OwnedFileBaton


def guard_jit_op_builds(retries: int = 3) -> bool:
    """Make torch's JIT extension loads (DeepSpeed's ops) survive build locks left by killed processes:
    the lock records its owner, a waiter removes a stale one and the load starts over (building the op
    itself). Idempotent; this process only. Returns whether the guard is installed: False where this torch
    locks differently (2.14's OS lock needs no guard; anything else: one warning, loads work unguarded)."""
    if not usable("jit_build_lock_guard"):
        return False
    import torch.utils.cpp_extension as cpp_ext

    if getattr(cpp_ext.load, "_spotfill_guarded", False):
        return True
    original = cpp_ext.load

    def load(*args, **kwargs):
        name = kwargs.get("name", args[0] if args else None)
        for _ in range(retries):
            try:
                return original(*args, **kwargs)
            except StaleBuildLock:
                # torch remembers it already "built" this op in this process; forget it, so the retry builds
                cpp_ext.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
        return original(*args, **kwargs)

    load._spotfill_guarded = True
    cpp_ext.FileBaton = owned_file_baton()
    cpp_ext.load = load
    return True
