"""`python -m spotfill plan` end to end in subprocesses: output, --json, --ds-config, one-line errors."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

PLATFORM = str(pathlib.Path(__file__).resolve().parents[2] / "platform")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PLATFORM, env.get("PYTHONPATH")) if p)
    return env


def _spotfill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spotfill", *args], capture_output=True, text=True,
                          env=_env(), timeout=60)


def test_plan_prints_a_readable_table():
    res = _spotfill("plan", "--params", "7B", "--gpus", "8", "--gpu-type", "a100-80gb")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for label in ("memory per GPU", "model states", "activations", "total", "FITS", "train time", "cost",
                  "checkpoint", "pipeline bubble", "recommendation", "headroom"):
        assert label in out
    assert "8 x a100-80gb" in out and "Traceback" not in out + res.stderr


def test_plan_json_and_ds_config(tmp_path):
    ds_path = tmp_path / "ds.json"
    res = _spotfill("plan", "--params", "7B", "--gpus", "8", "--zero", "2", "--micro-batch", "2",
                    "--activation-checkpointing", "--json", "--ds-config", str(ds_path))
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["inputs"]["zero"] == 2 and out["inputs"]["activation_checkpointing"] == "full"
    assert out["inputs"]["micro_batch"] == 2 and out["fits"] is True
    ds = json.loads(ds_path.read_text())
    assert ds == out["deepspeed_config"]
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8 == ds["train_batch_size"]
    assert ds["zero_optimization"]["stage"] == 2 and "activation_checkpointing" in ds


def test_list_gpus():
    res = _spotfill("plan", "--list-gpus")
    assert res.returncode == 0, res.stderr
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "l4", "a10g", "l40s", "b200"):
        assert name in res.stdout
    assert "datasheet" in res.stdout


BAD = {
    "negative params": (["--params=-7B"], "--params"),
    "negative params number": (["--params", "-7000000000"], "--params"),
    "unparsable params": (["--params", "abc"], "--params"),
    "unknown gpu": (["--params", "7B", "--gpu-type", "v100"], "--gpu-type"),
    "zero stage 4": (["--params", "7B", "--zero", "4"], "--zero"),
    "pp greater than layers": (["--params", "7B", "--pp", "64"], "--pp"),
    "tp not dividing heads": (["--params", "7B", "--tp", "3"], "--tp"),
    "zero gpus": (["--params", "7B", "--gpus", "0"], "--gpus"),
}


@pytest.fixture(scope="module")
def bad_runs():
    """Start every bad invocation at once (each is a fresh interpreter) and collect the results."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "spotfill", "plan", *args], env=_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in BAD.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        results[name] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line_naming_the_flag(bad_runs, case):
    code, out, err = bad_runs[case]
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and BAD[case][1] in lines[0]


@pytest.mark.parametrize("args,flag", [
    ([], "--params"), (["--params", "-7000000000"], "--params"),
    (["--params", "1B", "--ds-config", "/nonexistent/dir/ds.json"], "--ds-config"),
    (["--params", "7B", "--zero", "0", "--offload", "cpu"], "--offload"),
    (["--params", "7B", "--pp", "2", "--zero", "3"], "--zero")])
def test_more_bad_inputs_in_process(capsys, args, flag):
    from spotfill.cli.main import main

    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0]


def test_import_spotfill_stays_light():
    code = ("import sys, spotfill; r = spotfill.plan(params='1B', gpus=2); assert r['fits']; "
            "heavy = [m for m in ('ray', 'torch', 'deepspeed', 'boto3') if m in sys.modules]; "
            "assert not heavy, heavy")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert res.returncode == 0, res.stderr
