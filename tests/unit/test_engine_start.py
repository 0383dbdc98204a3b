"""The DeepSpeed engine a worker trains with, built by spotfill.train.engine.build_engine from the job's
ds_config, on the CPU in a fresh interpreter: the first optimizer step trains (DeepSpeed's WarmupCosineLR
gave lr 0 to the first two), and nothing on the way JIT-builds a DeepSpeed op that a GPU would build too --
with TORCH_CUDA_ARCH_LIST=9.0a set, the H200 image's value, which DeepSpeed's op builder cannot parse."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

LR, WARMUP, STEPS = 1e-3, 4, 20

_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo")
from deepspeed.ops.op_builder.builder import OpBuilder
loads = []
_load, _jit = OpBuilder.load, OpBuilder.jit_load
def load(self, *a, **k):
    loads.append(type(self).__name__)
    return _load(self, *a, **k)
def jit_load(self, *a, **k):
    loads.append(type(self).__name__)
    return _jit(self, *a, **k)
OpBuilder.load, OpBuilder.jit_load = load, jit_load
from spotfill.config.job import JobConfig, from_mapping
from spotfill.train.engine import build_engine, ds_config
from spotfill.train.model import build_model
lr, warmup, steps = float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
job = from_mapping(JobConfig, {"storage": "/unused", "data": {"path": "/unused"}, "training": {
    "model": "tiny", "global_batch": 2, "max_micro_batch": 2, "steps": steps, "warmup_steps": warmup, "lr": lr}})
torch.manual_seed(0)
engine = build_engine(build_model("tiny", seq_len=16, vocab_size=64), ds_config(job, 2, 1, "fp32", False))
x = torch.randint(0, 64, (2, 17))
trained = []
for _ in range(warmup + 1):
    before = [p.detach().clone() for p in engine.module.parameters()]
    used = engine.get_lr()[0]
    out = engine(x[:, :-1])
    engine.backward(torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1)))
    engine.step()
    trained.append([used, any(not torch.equal(a, p.detach()) for a, p in zip(before, engine.module.parameters()))])
from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
print("RESULT " + json.dumps({"trained": trained, "loads": loads, "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
                              "cuda_has_shm_op": CUDA_Accelerator().create_op_builder("ShareMemCommBuilder") is not None,
                              "optimizer": type(engine.optimizer.optimizer).__name__}))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path_factory.mktemp("engine") / "start.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join([os.path.join(root, "platform"), root, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0a", "PYTHONPATH": path}     # this checkout's spotfill
    proc = subprocess.run([sys.executable, str(script), str(port), str(LR), str(WARMUP), str(STEPS)],
                          capture_output=True, text=True, timeout=300, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, (proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(line[len("RESULT "):])


def test_the_first_optimizer_step_trains_and_the_warm_up_rises_linearly(run):
    """Optimizer step k of the warm-up trains at lr x k / warmup_steps: worked by hand for lr 1e-3 over 4
    steps, 2.5e-4, 5e-4, 7.5e-4; the step after the warm-up is the cosine's first, just under lr. Every step
    moves the weights (an lr of 0 leaves AdamW's weights where they were)."""
    lrs = [used for used, _ in run["trained"]]
    assert lrs[:3] == pytest.approx([2.5e-4, 5e-4, 7.5e-4], rel=1e-9), lrs
    assert 0.99 * LR < lrs[3] < LR and lrs[4] < lrs[3], lrs
    assert all(moved for _, moved in run["trained"]), run["trained"]


def test_no_deepspeed_op_is_jit_built_on_the_gpu_path_with_an_arch_list_deepspeed_cannot_parse(run):
    """With TORCH_CUDA_ARCH_LIST=9.0a the engine builds and steps with torch's fused AdamW (no FusedAdam JIT
    op, whose build failed on the H200 parsing '9.0a'); the one op DeepSpeed loads here is the CPU
    accelerator's shared-memory comm op, which its CUDA accelerator does not have."""
    assert run["arch_list"] == "9.0a"
    assert run["optimizer"] == "AdamW"
    assert set(run["loads"]) <= {"ShareMemCommBuilder"}, run["loads"]
    assert run["cuda_has_shm_op"] is False
