"""The pipeline bench's arithmetic on made-up records (benchmarks/pipeline.py results): the bubble share of
the plain side, the fill share against the standalone rate, the slowdown against the plain slices around
each filled one, and the bit-identical check."""
from __future__ import annotations

import pytest

from benchmarks.pipeline import CHUNK, results
from benchmarks.run import summary


def _side(t0: float, step_s: float, n: int, bubble: float, fill: float = 0.0, rows_per_step: int = 0,
          digest: str = "d", loss: float = 1.0) -> list[dict]:
    return [{"steps": [{"step": i + 1, "end_t": t0 + (i + 1) * step_s, "step_s": step_s, "loss": loss + i,
                        "bubble_s": bubble, "fill_s": fill, "wall_s": step_s,
                        "fill_rows": rows_per_step * (i + 1), "digest": f"{digest}{i}"} for i in range(n)],
             "overruns": [0.0, 0.001] if fill else []} for _ in range(2)]


WINDOWS = {"plain": [(0.0, 10.0), (30.0, 40.0)], "filled": [(10.0, 20.0)], "alone": [(20.0, 30.0)]}


def _alone(rate: float) -> list[dict]:
    """Chunks of CHUNK rows at `rate` rows/s inside the standalone window."""
    step = CHUNK / rate
    return [{"end_t": [20.0 + k * step for k in range(1, int(10 / step))]} for _ in range(2)]


def test_bubble_fill_share_slowdown_and_identity():
    plain = _side(0.0, 0.5, 80, bubble=0.1)                  # 0.1 s of bubble a 0.5 s step on each rank
    filled = _side(0.0, 0.51, 78, bubble=0.1, fill=0.06, rows_per_step=30)
    got = results(plain, filled, _alone(100.0), WINDOWS, 2, 4, 1000)
    assert got["bubble_fraction_measured"] == pytest.approx(0.2) and got["bubble_fraction_theory"] == 0.2
    assert got["bubble_stage"] == [0.2, 0.2]
    # 60 rows a step (2 ranks) in 0.2 bubble-seconds: 300 rows/s against 100 standalone
    assert got["fill_share"] == pytest.approx(3.0, rel=0.02)
    assert got["slowdown"] == pytest.approx(0.02, abs=0.001)
    assert got["loss_identical"] is True and got["steps_compared"] == 78
    assert got["overrun_s"] == {"p50": 0.0005, "p99": 0.001}
    assert "pipeline    2 stages x 4 micro-batches" in summary({"pipeline": {**got, "model": "tiny"}})


def test_a_changed_loss_or_digest_is_not_identical():
    plain = _side(0.0, 0.5, 80, bubble=0.1)
    assert results(plain, _side(0.0, 0.5, 80, 0.1, loss=1.5), _alone(100.0), WINDOWS, 2, 4, 1000)[
        "loss_identical"] is False
    assert results(plain, _side(0.0, 0.5, 80, 0.1, digest="x"), _alone(100.0), WINDOWS, 2, 4, 1000)[
        "loss_identical"] is False
