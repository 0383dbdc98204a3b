"""Chaos: seeded random timelines of drains, hard kills, returning nodes and a storage outage (loopback S3
the runner controls). Every step finishes with no sample lost or repeated, and every invariant holds."""
from __future__ import annotations

import json

import pytest

from spotfill.sim.outcomes import digest
from spotfill.sim.runner import run_scenario
from spotfill.sim.scenario import chaos_scenario, parse_scenario


def _run(seed: int, tmp_path, steps: int) -> dict:
    data = chaos_scenario(seed, steps=steps)
    report = run_scenario(parse_scenario(data, f"chaos-{seed}"), str(tmp_path), quiet=True)
    assert report["ok"], json.dumps(data["events"]) + "\n" + digest(report)
    tr = report["training"]
    assert tr["steps_completed"] == steps
    assert tr["samples"] == {"consumed": steps * 12, "duplicates": 0, "missing": 0,
                             "source": "checkpoint-ledger"}
    return report


@pytest.mark.slow   # CI's time budget: run with `python -m pytest -m slow`
def test_chaos_with_storage_outage(tmp_path):
    report = _run(3, tmp_path, steps=160)   # drain, storage outage, node back, drain
    assert any(e["action"] == "storage_outage" and e["fired"] for e in report["events"])


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 4, 5, 6, 7])
def test_chaos_soak(seed, tmp_path):
    _run(seed, tmp_path, steps=300)
