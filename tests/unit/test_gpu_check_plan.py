"""The GPU check's own guarantees, on the CPU: its sections' caps fit its budget (none is cut), the 1b
micro-batch is sized from the device's memory, a failed out-of-memory try leaves nothing alive, a section
that overruns is killed with everything it started and its scratch folder goes, the Ray Train / plain bf16
MFU ratio is reported, and the carried wheels' requirements are checked against the image's package list."""
from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import time
import weakref

import psutil
import pytest

from benchmarks import gpu, gpu_check, gpu_dry_run
from benchmarks.gpu_sections import KILL_GRACE_S, caps, run_process_group, share

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100_FREE = 84.5e9       # torch.cuda.mem_get_info on an H100 80GB HBM3 (85.0e9 in all, less the context)
H200_FREE = 149.5e9      # an H200 (143771 MiB)


# -- the budget -----------------------------------------------------------------------------------------
def test_every_section_gets_its_share_when_each_runs_to_its_cap():
    """The worst case: every section runs to its cap. Before, the caps added to 555 s against a 360 s budget
    and serve was skipped; now each one's cap is its share and the last one still gets its own."""
    budget = gpu_check.DEFAULT_BUDGET_S
    left, got = budget, {}
    names = list(gpu_check.SECTIONS)
    for i, name in enumerate(names):
        got[name] = share(name, names[i:], gpu_check.SECTIONS, left)
        left -= got[name]
    assert got == pytest.approx(caps(gpu_check.SECTIONS, budget))
    assert sum(got.values()) == pytest.approx(budget)
    assert min(got.values()) >= 15, got           # 15 s: below it gpu_check skips a section
    assert got["serve"] >= 60 and got["ray_train"] >= 120 and got["bench_gpu"] >= 110, got


def test_a_section_that_ends_early_gives_its_time_to_the_ones_after_it():
    names = list(gpu_check.SECTIONS)
    full = share("serve", ["serve"], gpu_check.SECTIONS, 200.0)
    assert full == 200.0
    assert share("tenants", names[4:], gpu_check.SECTIONS, 200.0) < 200.0


def test_the_default_budget_fits_one_device_command_with_the_install():
    """600 s is the device tool's limit on one command: the install (~40 s), the budget and each section's
    kill grace (SIGTERM to SIGKILL) must end well inside it."""
    assert gpu_check.DEFAULT_BUDGET_S + 40 + len(gpu_check.SECTIONS) * KILL_GRACE_S <= 560
    sh = open(os.path.join(REPO, "benchmarks", "gpu_check.sh")).read()
    assert re.search(r"GPU_CHECK_BUDGET_S:-(\d+)", sh).group(1) == str(gpu_check.DEFAULT_BUDGET_S)


# -- the batch from the device's memory -------------------------------------------------------------------
def test_1b_runs_at_micro_batch_8_on_an_h100_and_16_on_an_h200():
    """1b x 16 x 2048 needed 83-88 GB on a GPU (activations ~50 GB, ZeRO-2 states ~21 GB, logits 10-13 GB):
    more than an H100's 80 GB, within an H200's 141 GB."""
    est = gpu.memory_estimate("1b", 16)
    assert 78e9 <= est["total"] <= 90e9, est
    assert est["model_states"] == 16 * 1_243_152_384             # bf16 ZeRO-2 at world size 1: 16 B/param
    assert gpu.fitting_micro_batches("1b", H100_FREE) == (8, 4, 2, 1)
    assert gpu.fitting_micro_batches("1b", H200_FREE) == (16, 8, 4, 2, 1)
    assert gpu.fitting_micro_batches("1b", None) == (16, 8, 4, 2, 1)      # unknown: try them all
    assert gpu.fitting_micro_batches("1b", 1e9) == (1,)                    # none fits: the smallest
    assert gpu.fitting_micro_batches("125m", H100_FREE)[0] == 16


def test_the_estimate_counts_the_models_parameters():
    from spotfill.train.model import build_model, count_params
    for preset in ("tiny", "125m"):
        assert gpu.memory_estimate(preset, 1)["params"] == count_params(build_model(preset)), preset


# -- an out-of-memory try leaves nothing behind -----------------------------------------------------------
class _Activations:
    pass


def test_a_failed_try_is_freed_before_the_next_one():
    """The failed try's frames hold its engine and activations (here: an object in a reference cycle, as an
    engine and its hooks are). Before the next try nothing may keep them: not the kept exception nor its
    traceback, not an uncollected cycle -- and the cache goes back to the device (free_memory)."""
    torch = pytest.importorskip("torch")
    refs, seen, freed = [], [], []

    def attempt(micro):
        seen.append((micro, [r() is None for r in refs]))
        if micro == 4:
            activations = _Activations()
            activations.cycle = activations
            refs.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return {"tokens_s": 1.0}

    gc.disable()            # the cycle goes only when first_that_fits collects it
    try:
        micro, result, ooms = gpu.first_that_fits((4, 2), attempt, lambda: freed.append(len(seen)))
    finally:
        gc.enable()
    assert (micro, result) == (2, {"tokens_s": 1.0})
    assert seen == [(4, []), (2, [True])], seen          # at the try at 2, the failed try's objects are gone
    assert ooms == [{"micro_batch": 4, "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB"}]
    assert freed == [1]


def test_the_bench_section_keeps_the_125m_figures_when_1b_fails(monkeypatch):
    def bench(quick, preset, baseline=False):
        if preset == "1b":
            raise RuntimeError("1b does not fit at any micro-batch of [1]: first error OutOfMemoryError")
        return {"mfu": 0.4, "tokens_s": 1000.0}

    monkeypatch.setattr(gpu, "bench_gpu", bench)
    monkeypatch.delenv("GPU_CHECK_RESULT", raising=False)
    out = gpu_check.section_bench_gpu(False)
    assert out["125m"] == {"mfu": 0.4, "tokens_s": 1000.0}
    assert out["1b"]["error"].startswith("RuntimeError: 1b does not fit") and out["ok"] is False


# -- a section that overruns: killed whole, scratch removed -------------------------------------------------
_SPAWNER = r"""
import os, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)]
open(sys.argv[1], "w").write(" ".join(str(k.pid) for k in kids))
time.sleep(float(sys.argv[2]))
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("own_life", [120.0, 0.5], ids=["overruns", "ends-leaving-children"])
def test_a_section_leaves_no_process_behind(tmp_path, own_life):
    """A pytest (a child in the section's group) and a Ray daemon (a session of its own) the section
    started: both end when the section overruns its cap -- and when it ends on its own without them."""
    pids = tmp_path / "pids"
    t0 = time.time()
    ran = run_process_group([sys.executable, "-c", _SPAWNER, str(pids), str(own_life)], timeout_s=4.0, poll_s=0.2)
    assert ran["rc"] == ("timeout" if own_life > 4 else 0), ran
    assert time.time() - t0 < 4.0 + 3 * KILL_GRACE_S
    kids = [int(p) for p in pids.read_text().split()]
    deadline = time.time() + 5
    while any(_alive(p) for p in kids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in kids), kids


def test_a_section_killed_at_its_cap_keeps_what_it_saved_and_its_scratch_goes(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, timeout_s, cwd=None, env=None):
        scratch = env["GPU_CHECK_SCRATCH"]
        seen["scratch"] = scratch
        with open(os.path.join(scratch, "checkpoint.pt"), "wb") as f:
            f.write(b"x" * 1024)
        with open(env["GPU_CHECK_RESULT"], "w") as f:
            json.dump({"ok": False, "partial": True, "125m": {"mfu": 0.4}}, f)
        return {"rc": "timeout", "tail": "...", "killed": [123]}

    monkeypatch.setattr(gpu_check, "run_process_group", fake_run)

    class Args:
        out, cpu_dry_run = str(tmp_path / "gpu_check.json"), True
    rec = gpu_check.run_child("bench_gpu", Args, 30.0)
    assert not os.path.exists(seen["scratch"]) and rec["scratch_removed"] is True
    assert rec["125m"] == {"mfu": 0.4} and rec["ok"] is False and rec["error"].startswith("ran past its 30s cap")
    assert rec["killed_after"] == [123]


# -- the ratio ------------------------------------------------------------------------------------------
def test_the_ray_train_to_plain_bf16_ratio_is_reported():
    sections = {"bench_gpu": {"1b": {"mfu": 0.50, "micro_batch": 8, "plain_bf16": {"mfu": 0.56, "micro_batch": 8}}},
                "ray_train": {"mfu_median": 0.49, "micro_batch": 8}}
    c = gpu_check.comparison(sections)
    assert c["ray_train_to_plain_bf16"] == pytest.approx(0.875, abs=1e-4)
    assert c["ray_train_to_deepspeed"] == pytest.approx(0.98, abs=1e-4)
    assert c["deepspeed_to_plain_bf16"] == pytest.approx(0.8929, abs=1e-4)
    assert c["meets_target"] is False and c["target_ray_train_to_plain_bf16"] == 0.9 and c["same_micro_batch"]
    assert gpu_check.comparison({})["meets_target"] is None


# -- the carried wheels against the image -----------------------------------------------------------------
def test_a_requirement_outside_the_image_and_the_carried_set_is_named():
    image = gpu_dry_run.image_packages()
    assert "torch" in image and "jsonschema" not in image and "rpds-py" not in image
    wheels = {"ray": ["click>=7.0", "jsonschema", "pandas; extra == 'data'",
                      "importlib-metadata; python_version < '3.8'"],
              "referencing": ["rpds-py>=0.7.0", "attrs>=22.2.0"]}
    assert gpu_dry_run.unmet(wheels, image) == {"ray": ["jsonschema"], "referencing": ["rpds-py>=0.7.0"]}
    wheels.update({"jsonschema": [], "rpds_py": []})
    assert gpu_dry_run.unmet(wheels, image) == {}


def test_bad_budget_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--budget-s", "0", "--out",
                           os.devnull], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "platform"), REPO])})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert proc.stderr.startswith("--budget-s: 0; accepted:"), proc.stderr


# -- the vLLM section ---------------------------------------------------------------------------------------
def test_the_vllm_section_is_opt_in_and_skipped_saying_why_without_vllm():
    """Not in the default run (its budget stays the six sections'), runnable with --only vllm; without vLLM
    it returns at once with the reason and the extra to install, starting nothing."""
    import importlib.util

    from benchmarks import gpu_vllm
    assert "vllm" not in gpu_check.SECTIONS and "vllm" in gpu_check.OPT_IN
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    rec = gpu_vllm.run(True, time.time() + 60)
    assert set(rec) == {"skipped"} and "pip install 'spotfill[llm]'" in rec["skipped"]
    assert gpu_check.vllm_skip_reason().startswith("skipped: vLLM is not installed")
