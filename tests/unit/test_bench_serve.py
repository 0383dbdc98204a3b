"""`spotfill bench --only serve` on the tiny preset: the CONTRACTS keys are there with measured values, the
old loop and the engine side by side, and the summary prints them. (No Ray: one process, one model.)"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.run import summary  # noqa: E402
from benchmarks.serve import bench_serve  # noqa: E402


def test_serve_section_keys_and_summary():
    out = bench_serve(True, new_tokens=8)
    for key in ("batch1", "batch8"):
        assert out["tokens_per_s"][key] > 0 and out["toy_loop_tokens_per_s"][key] > 0
        assert out["specdec"]["tokens_per_s"][key] > 0
    sd = out["specdec"]
    assert sd["draft"] == "self:1" and sd["num_draft_tokens"] == 4
    assert 0.0 <= sd["acceptance_rate"] <= 1.0 and 1.0 <= sd["mean_accepted_length"] <= 5.0
    # every engine side generated exactly what was asked (ignore_eos): 8 tokens per request
    assert out["runs"]["engine_batch8"]["tokens"] == 64 and out["runs"]["specdec_fixed_batch1"]["tokens"] == 8
    text = summary({"serve": out})
    assert "serve       tiny (random weights) on cpu: engine" in text and "mean accepted length" in text
