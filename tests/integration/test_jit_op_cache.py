"""DeepSpeed JIT op loading survives a build lock left by a killed process (defect: torch's FileBaton
waits forever), in this environment's own cache folder. No Ray: each load runs in its own interpreter,
as a worker would, under a timeout that turns a hang into a failure."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from spotfill.train.engine import jit_cache_dir
from spotfill.ray_compat.opcache import STALE_UNOWNED_S, boot_id, owner_record

PLATFORM = os.path.dirname(os.path.dirname(os.path.abspath(__import__("spotfill").__file__)))
OP = "deepspeed_shm_comm"          # the op DeepSpeed's CPU comm backend loads at every engine start
LOAD = """
import sys, time
if sys.argv[1] == "guarded":
    from spotfill.ray_compat import guard_jit_op_builds
    guard_jit_op_builds()
from deepspeed.accelerator import get_accelerator
t = time.time()
get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
print(f"loaded in {time.time() - t:.1f}s")
"""


def _load(mode: str, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": jit_cache_dir(),
           "PYTHONPATH": os.pathsep.join([PLATFORM, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", LOAD, mode], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


@pytest.fixture(scope="module")
def lock_path():
    built = _load("guarded", 1200)           # builds the op once in this environment's folder if needed
    assert built.returncode == 0, built.stderr[-2000:]
    path = os.path.join(jit_cache_dir(), OP, "lock")
    yield path
    if os.path.exists(path):
        os.remove(path)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_own_cache_folder_per_environment():
    assert os.path.basename(jit_cache_dir()).startswith("spotfill-py")
    assert os.path.isdir(os.path.join(jit_cache_dir(), OP))


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_lock_of_a_killed_builder_blocks_torch_forever_but_not_spotfill(lock_path):
    with open(lock_path, "w") as f:
        f.write(owner_record(socket.gethostname(), boot_id(), _dead_pid(), time.time()))
    with pytest.raises(subprocess.TimeoutExpired):   # torch's own baton: waits on the lock, no end
        _load("plain", 20)
    assert os.path.exists(lock_path)
    done = _load("guarded", 180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stale JIT op build lock" in done.stderr and "is dead" in done.stderr
    assert not os.path.exists(lock_path)


def test_an_old_ownerless_lock_is_removed_too(lock_path):
    open(lock_path, "w").close()                        # what a plain torch baton leaves
    old = time.time() - 2 * STALE_UNOWNED_S
    os.utime(lock_path, (old, old))
    done = _load("guarded", 180)
    assert done.returncode == 0 and "no owner recorded" in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(lock_path)
