"""The planner's pipeline advice (planning/pipeline_advice.py): which stage counts it tries, that memory
drives the stage count up and bubble cost keeps it down, and what the bubbles can carry."""
from __future__ import annotations

import pytest

from spotfill.planning.pipeline_advice import fill_capacity, stage_candidates, step_share
from spotfill.planning.planner import plan


def test_stage_candidates_divide_the_layers_and_fit_the_gpus():
    assert stage_candidates(32, 1, None, 64) == [1, 2, 4, 8, 16]
    assert stage_candidates(32, 2, 8, 64) == [1, 2, 4]          # tp x S must divide the 8 GPUs
    assert stage_candidates(12, 1, 6, 64) == [1, 2, 3, 6]


def test_step_share_is_the_schedules_idle_share():
    assert step_share(1, 8) == 0.0 and step_share(2, 4) == pytest.approx(0.2)
    assert step_share(8, 32) == pytest.approx(7 / 39)


def test_fill_capacity_from_a_plans_bubbles():
    got = fill_capacity(2, 4, gpu_hours=1000.0, step_seconds=10.0, params=10 ** 9, peak_flops=1e15, mfu=0.4)
    assert got["bubble_step_fraction"] == pytest.approx(0.2) and got["bubble_gpu_hours"] == pytest.approx(200.0)
    assert got["bubble_seconds_per_step"] == pytest.approx(2.0)
    flops = 200.0 * 3600 * 1e15 * 0.4 * 0.5
    assert got["fill_forward_flops"] == pytest.approx(flops)
    assert got["fill_forward_tokens"] == pytest.approx(flops / 2e9)
    assert fill_capacity(1, 4, 1000.0, 10.0, 10 ** 9, 1e15, 0.4)["fill_forward_tokens"] == 0.0


def test_memory_pushes_stages_up_and_the_bubble_is_charged():
    """A 70B model with ZeRO-1 on 64 A100-80GB: too big below 8 stages; 8 fits and costs fewer GPU-hours
    than 16 (a bigger bubble): the planner recommends 8 and the micro-batches it searched with."""
    p = plan(params="70B", gpus=64, gpu_type="a100-80gb", zero=1)["pipeline"]
    rows = {r["stages"]: r for r in p["candidates"]}
    assert [s for s, r in rows.items() if not r["fits"]] == [1, 2, 4]
    assert rows[16]["bubble_fraction"] > rows[8]["bubble_fraction"]
    assert rows[16]["gpu_hours"] > rows[8]["gpu_hours"]
    assert p["recommended"]["stages"] == 8
    assert p["job_config"] == {"training.pipeline_stages": 8, "training.micro_batches": rows[8]["micro_batches"],
                               "training.zero_stage": 1}
    assert p["fill"]["bubble_step_fraction"] == pytest.approx(rows[8]["bubble_fraction"])
    assert p["fill"]["fill_forward_tokens"] > 0


def test_no_pipeline_when_the_model_fits_without_one():
    p = plan(params="1B", gpus=8, gpu_type="a100-80gb")["pipeline"]
    assert p["recommended"]["stages"] == 1 and p["recommended"]["bubble_fraction"] == 0.0
    assert p["this_plan"]["bubble_gpu_hours"] == 0.0


def test_the_plans_own_pipeline_bubble_is_reported():
    r = plan(params="7B", gpus=16, gpu_type="a100-80gb", pp=2, micro_batches=8, zero=1)
    assert r["pipeline"]["this_plan"]["bubble_step_fraction"] == pytest.approx(1 / 9)
    assert r["pipeline"]["this_plan"]["bubble_gpu_hours"] == pytest.approx(r["gpu_hours"] / 9)
