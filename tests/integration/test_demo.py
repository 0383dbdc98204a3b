"""`spotfill demo` as a user runs it (the default autoscaling story, a subprocess of this interpreter):
it exits 0, and its report holds the invariant that each fill-in tenant -- Serve, the batch job, the sweep --
was taken back at least once and carried on (lent again; a batch wave stopped with units left and every row
still written once; a sweep trial paused with its checkpoint and resumed from it). About 4-6 minutes on 2
cores, so `slow` (python -m pytest -m slow tests/integration/test_demo.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_default_demo_shows_every_tenant_taken_back_and_carrying_on(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "spotfill", "demo", "--out", str(out)], capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    report = json.loads((out / "report.json").read_text())
    inv = report["invariants"]["fillin_reclaimed_and_resumed"]
    assert inv["ok"], inv
    resumes = report["fillin"]["reclaimed_and_resumed"]
    assert set(resumes) == {"serve", "batch", "sweep"} and all(r["ok"] for r in resumes.values()), resumes
    # the tenants' own counters, not only the invariant's verdict
    assert report["fillin"]["sweep"]["paused"] >= 1 and report["fillin"]["sweep"]["resumed"] >= 1
    assert any(s["done"] < s["units"] for s in report["fillin"]["batch"]["stops"])
    sv = report["fillin"]["serve"]
    assert sv["requests_failed"] == 0 and sv["requests_ok"] > sv["requests_rejected_503"], sv
    assert "PASS fillin_reclaimed_and_resumed" in proc.stdout
