"""A training worker's engine start builds no JIT op: DeepSpeed's CPU comm backend would JIT-build its
shared-memory all-reduce op (`deepspeed_shm_comm`, used only by its inference_all_reduce) inside
deepspeed.initialize -- 31.7 s of g++ on the 2-core development machine, the default demo's first group
waited 32.5 s for it (ray_compat.skip_deepspeed_shm_comm). Each start runs in its own interpreter with a
fresh, empty JIT cache, as a fresh machine's first worker would."""
from __future__ import annotations

import os
import subprocess
import sys

from spotfill.testing.ports import free_port

PLATFORM = os.path.dirname(os.path.dirname(os.path.abspath(__import__("spotfill").__file__)))
STEP = r"""
import os, sys
from spotfill.testing.tiny_step import init_single_process, take_step, tiny_engine
init_single_process(int(sys.argv[1]))
engine = tiny_engine()
loss, moved = take_step(engine)
assert moved, "no parameter moved"
print("STEP", sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])))
"""


def test_a_training_engine_starts_and_steps_without_building_a_jit_op(tmp_path):
    ext = tmp_path / "torch_extensions"
    ext.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext),
           "PYTHONPATH": os.pathsep.join([PLATFORM, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", STEP, str(free_port())], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STEP []" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "deepspeed_shm_comm" not in proc.stdout + proc.stderr      # neither built nor loaded
    assert "deepspeed_shm_comm_skip is off" not in proc.stderr


def test_the_skip_leaves_deepspeed_a_backend_without_the_op():
    import importlib

    from spotfill.ray_compat import skip_deepspeed_shm_comm
    ds_torch = importlib.import_module("deepspeed.comm.torch")   # deepspeed.comm.torch is also torch there
    original = ds_torch.build_shm_op
    try:
        assert skip_deepspeed_shm_comm() is True and skip_deepspeed_shm_comm() is True     # idempotent
        assert ds_torch.build_shm_op() is None and ds_torch.build_shm_op.spotfill_skipped
    finally:
        ds_torch.build_shm_op = original
