"""`spotfill bench` plumbing: the checkpoint benchmark at a tiny size (keys and sane values, not timing
targets), the run_all JSON envelope, the summary, and the CLI's usage errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLATFORM = os.path.join(REPO, "platform")
CONTRACT_CHECKPOINT_KEYS = {"params", "stall_s", "sync_save_upload_s", "stall_ratio", "upload_mb_s",
                            "raw_boto3_mb_s", "upload_ratio"}


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([PLATFORM, REPO, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> dict:
    """benchmarks/checkpoint.py run as a script (its own process and loopback S3 endpoint), tiny preset."""
    out = tmp_path_factory.mktemp("bench") / "checkpoint.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "checkpoint.py"), "--preset", "tiny",
                           "--repeats", "2", "--json", str(out)], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_checkpoint_section_keys_and_sane_values(tiny_checkpoint):
    r = tiny_checkpoint
    assert CONTRACT_CHECKPOINT_KEYS <= set(r)
    from spotfill.train.model import build_model, count_params
    assert r["params"] == count_params(build_model("tiny")) and r["preset"] == "tiny"
    for key in CONTRACT_CHECKPOINT_KEYS | {"bytes", "snapshot_s", "sync_save_s", "sync_upload_s",
                                           "background_upload_s"}:
        assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r[key])
    assert r["stall_ratio"] == pytest.approx(r["stall_s"] / r["sync_save_upload_s"], rel=1e-3, abs=1e-4)
    assert r["upload_ratio"] == pytest.approx(r["upload_mb_s"] / r["raw_boto3_mb_s"], rel=2e-2)
    # the stall is the snapshot plus back-pressure; the sync save pays a snapshot and an upload
    assert r["blocked_s"] >= 0 and r["snapshot_s"] <= r["stall_s"] + 1e-6
    assert r["sync_save_upload_s"] >= r["sync_upload_s"] > 0
    assert len(r["samples"]["stall_s"]) == len(r["samples"]["sync_save_upload_s"]) == r["repeats"] == 2
    assert r["snapshot_s_by_dir"] and all(v > 0 for v in r["snapshot_s_by_dir"].values())
    assert r["steps_to_hide_upload"] >= 1


def test_run_all_envelope_and_summary():
    sys.path.insert(0, REPO)
    from benchmarks.run import run_all, summary, targets

    result = run_all(True, ["gpu"])
    assert result["quick"] is True and result["machine"] and result["date"]
    assert "gpu" in result and not result.get("errors")
    for absent in ("recovery", "preemption", "fillin", "checkpoint", "overhead"):
        assert absent not in result  # not run: left out, never a placeholder
    import torch
    if not torch.cuda.is_available():
        assert result["gpu"] is None
    text = summary(result)
    assert "gpu" in text
    fake = {**result, "checkpoint": {"params": 1, "preset": "tiny", "bytes": 1e6, "repeats": 2, "stall_s": 0.5,
                                     "sync_save_upload_s": 2.0, "stall_ratio": 0.25, "upload_mb_s": 90.0,
                                     "raw_boto3_mb_s": 100.0, "upload_ratio": 0.9, "snapshot_dir": "/tmp"},
            "overhead": {"spotfill_tokens_s": 99.0, "plain_deepspeed_tokens_s": 100.0, "ratio": 0.99}}
    assert targets(fake) == {"checkpoint.stall_ratio": False, "checkpoint.upload_ratio": True,
                             "overhead.ratio": True}
    text = summary(fake)
    assert "stall_ratio 0.250 (target <= 0.1: MISSED)" in text and "ratio 0.990 (target >= 0.97: ok)" in text


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--bogus"], ["--only", ""],
                                  ["--json", "/nonexistent-dir/out.json"]])
def test_cli_usage_errors_exit_2_one_line(argv):
    proc = subprocess.run([sys.executable, "-m", "spotfill", "bench", *argv], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spotfill: error:") and "Traceback" not in proc.stderr


def test_cli_names_the_same_sections_as_the_runner():
    sys.path.insert(0, REPO)
    from benchmarks.run import SECTIONS
    from spotfill.cli.bench import SECTIONS as CLI_SECTIONS

    assert sorted(CLI_SECTIONS) == sorted(SECTIONS)


def test_recovery_summary_shows_stock_tuned_side_targets_and_breakdown():
    sys.path.insert(0, REPO)
    from benchmarks.run import summary, targets

    fake = {"recovery": {"spotfill_s": 4.0, "stock_ray_s": 40.0, "speedup": 10.0, "stock_tuned_s": 6.0,
                         "speedup_vs_tuned": 1.5, "lost_steps": 3,
                         "recovery_breakdown": {"spotfill": {"detect_s": 0.5, "decide_s": 0.6},
                                                "stock-tuned": {"detect_decide_workers_start_s": 3.0}}}}
    assert targets(fake) == {"recovery.speedup": True, "recovery.speedup_vs_tuned": False}
    text = summary(fake)
    assert "stock Ray with spotfill's Ray timeouts 6.0s -> 1.5x (target >= 2: MISSED)" in text
    assert "spotfill     detect_s 0.5, decide_s 0.6" in text and "stock-tuned  detect_decide" in text
    fake["recovery"]["with_fillin"] = {"spotfill_s": 5.5, "lost_steps": 2, "world_size_after": 2,
                                       "warm": {"n1": True}, "breakdown": {}, "ok": True}
    assert ("with Serve fill-in on the other GPUs: spotfill 5.5s, lost 2 steps, world size after 2, warm "
            "{'n1': True}") in summary(fake)
