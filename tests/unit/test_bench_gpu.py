"""benchmarks/gpu.py's search for the largest micro-batch that fits, on the CPU with training's real engine
(build_engine: DeepSpeed ZeRO-2 + torch's fused AdamW) over the tiny preset, in a fresh interpreter.

On the H200 a failed first deepspeed.initialize was retried on the model that engine had already hooked:
every retry died with AttributeError 'engine_timers' and the first error was hidden. Here the first
build_engine really builds (hooking the model) and then fails as an out-of-memory would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, sys
import torch
from benchmarks import gpu
from spotfill.train import engine as engine_mod

real, seen = engine_mod.build_engine, []

def failing_first(error):
    def build(model, config, device=None):
        seen.append(id(model))
        engine = real(model, config, device)      # the model is hooked by a real engine first
        if len(seen) == 1:
            raise error
        return engine
    return build

out = {}
engine_mod.build_engine = failing_first(torch.OutOfMemoryError("injected out of memory"))
r = gpu.train_throughput("tiny", "cpu", "fp32", steps=2, warmup=1, micro_batches=(4, 2))
out["oom"] = {"micro_batch": r["micro_batch"], "oom_at": r["oom_at"], "oom_errors": r["oom_errors"], "models": len(seen),
              "distinct": len(set(seen)) == len(seen), "tokens_s": r["tokens_s"], "optimizer": r["optimizer"],
              "split": [r["forward_backward_s"], r["optimizer_s"]], "flops_per_token": r["flops_per_token"]}
seen.clear()
engine_mod.build_engine = failing_first(ValueError("injected bad config"))
try:
    gpu.train_throughput("tiny", "cpu", "fp32", steps=2, warmup=1, micro_batches=(4, 2))
    out["other"] = None
except Exception as exc:
    out["other"] = {"type": type(exc).__name__, "message": str(exc), "models": len(seen)}
seen.clear()

def always_oom(model, config, device=None):
    seen.append(id(model))
    raise torch.OutOfMemoryError(f"injected out of memory {len(seen)}")

engine_mod.build_engine = always_oom
try:
    gpu.train_throughput("tiny", "cpu", "fp32", steps=2, warmup=1, micro_batches=(4, 2))
    out["none_fits"] = None
except Exception as exc:
    out["none_fits"] = {"type": type(exc).__name__, "message": str(exc), "cause": exc.__cause__ and str(exc.__cause__)}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path_factory.mktemp("bench_gpu") / "retry.py"
    script.write_text(_SCRIPT)
    path = os.pathsep.join([os.path.join(root, "platform"), root, os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": path})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, (proc.stdout[-2000:], proc.stderr[-3000:])
    return json.loads(line[len("RESULT "):])


def test_an_out_of_memory_moves_to_the_next_micro_batch_on_a_fresh_model(result):
    r = result["oom"]
    assert r["micro_batch"] == 2 and r["oom_at"] == [4], r
    assert r["oom_errors"] == ["OutOfMemoryError: injected out of memory"], r     # kept as text only
    assert r["models"] == 2 and r["distinct"], r        # the hooked model of the failed try is not reused
    assert r["tokens_s"] > 0 and r["optimizer"] == "torch.optim.AdamW (fused)", r    # what training steps with
    assert all(s is not None and s > 0 for s in r["split"]), r


def test_any_other_error_of_the_first_try_surfaces_as_it_is(result):
    assert result["other"] == {"type": "ValueError", "message": "injected bad config", "models": 1}


def test_when_nothing_fits_the_first_error_is_named(result):
    r = result["none_fits"]
    assert r["type"] == "RuntimeError" and "injected out of memory 1" in r["message"], r
    assert r["message"].startswith("tiny does not fit at any micro-batch of [4, 2]"), r
    assert r["cause"] is None, r        # named, not chained: the failed tries' frames are not kept
