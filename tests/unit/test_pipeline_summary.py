"""report.json's training.pipeline from step events (train/pipeline_summary.py)."""
from __future__ import annotations

import pytest

from spotfill.train.pipeline_summary import pipeline_section
from spotfill.train.summary import training_section


def _step(attempt, step, bubble, fill, rows, m=4, frac=0.25):
    return {"kind": "step", "attempt": attempt, "step": step, "t": float(step), "loss": 1.0, "world_size": 4,
            "tokens": 64, "step_s": 1.0, "stages": 2, "micro_batches": m, "bubble_s": bubble,
            "bubble_fill_s": fill, "bubble_fill_rows": rows, "bubble_fraction": frac}


def test_no_pipeline_no_section():
    assert pipeline_section([{"kind": "step", "step": 1}]) is None
    report = training_section([{"kind": "step", "attempt": 0, "step": 1, "t": 1.0, "loss": 1.0, "world_size": 1,
                                "tokens": 8, "step_s": 0.1}], 1, 8)
    assert "pipeline" not in report


def test_bubbles_and_harvest_over_the_lineage():
    """Attempt 0 ran steps 1-3 at 2 replicas, attempt 1 (after a loss, 1 replica: 8 micro-batches) redid
    step 3 and ran 4: the redone step counts once; fill rows add up per attempt."""
    events = [_step(0, 1, 0.5, 0.0, 0), _step(0, 2, 0.5, 0.2, 10), _step(0, 3, 0.5, 0.3, 25),
              _step(1, 3, 0.4, 0.2, 8, m=8, frac=0.1), _step(1, 4, 0.4, 0.2, 16, m=8, frac=0.1)]
    got = training_section(events, 4, 16)["pipeline"]
    assert got["stages"] == 2 and got["micro_batches"] == [4, 8]
    assert got["bubble_fraction_theory"] == [0.2, pytest.approx(1 / 9, abs=1e-4)]
    assert got["bubble_gpu_s"] == pytest.approx(0.5 + 0.5 + 0.4 + 0.4)
    assert got["bubble_fill_gpu_s"] == pytest.approx(0.0 + 0.2 + 0.2 + 0.2)
    assert got["bubble_fill_share"] == pytest.approx(0.6 / 1.8, abs=1e-4)
    assert got["bubble_fill_rows"] == 10 + 16 and got["bubble_fraction"] == pytest.approx(0.175)  # median of 4
