"""Filling a pipeline's bubbles leaves training bit-identical: two 2-stage pipelines (2 processes each, gloo)
train the same steps on the same data, one running a batch job's evaluation units in its bubbles -- every
step's loss and every stage's parameter digest are equal, while fill work really ran (rows evaluated inside
bubbles, whole units committed with the same numbers the batch job's own workers compute)."""
from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest
import torch.multiprocessing as mp

from benchmarks.pipeline import make_plan, prepare_local, side_rank

STEPS = 9
# micro-batches of 32 rows: the last stage's bubbles on the tiny model are then several ms at each point;
# with 4 rows they were 1-2 ms, under fill_budget's 2 ms floor at every point, and it never filled


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _side(tmp, name: str, data: str, fill: str | None) -> list[dict]:
    work = tmp / name
    work.mkdir()
    training = {"model": "tiny", "workers": [2], "steps": STEPS, "global_batch": 128, "pipeline_stages": 2,
                "micro_batches": 4, "zero_stage": 1, "warmup_steps": 3, **({"bubble_fill": fill} if fill else {})}
    spec = {"job": {"name": "identical", "storage": str(tmp / "ckpt"), "data": {"path": data},
                    "training": training},
            "world": 2, "port": _port(), "work": str(work), "steps": STEPS, "ready": str(work / "ready.json"),
            "stop": str(work / "stop"), "out": str(work / "out")}
    mp.spawn(side_rank, args=(spec,), nprocs=2, join=True)
    return [json.loads((work / f"out-{r}").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bubbles")
    data, plan_dir = str(tmp / "data"), str(tmp / "fill")
    prepare_local(data, min_rows=2048)
    make_plan(plan_dir, data, "tiny", rows_per_unit=8)
    return _side(tmp, "plain", data, None), _side(tmp, "filled", data, plan_dir), plan_dir


def test_losses_and_parameters_are_bit_identical_with_and_without_filling(runs):
    plain, filled, _ = runs
    for rank in range(2):
        p, f = plain[rank]["steps"], filled[rank]["steps"]
        assert len(p) == len(f) == STEPS
        assert [s["loss"] for s in p] == [s["loss"] for s in f]
        assert [s["digest"] for s in p] == [s["digest"] for s in f]
        assert len({s["digest"] for s in p}) >= STEPS - 1    # the parameters changed (the first LR is 0)
    # fill work ran inside both stages' bubbles once their bubbles were measured (3 steps)
    for rank in range(2):
        steps = filled[rank]["steps"]
        assert steps[-1]["fill_rows"] > 0 and sum(s["fill_s"] for s in steps[3:]) > 0
        assert all(s["fill_s"] == 0 for s in steps[:3]) and plain[rank]["filler"] is None


def test_units_filled_in_bubbles_hold_what_the_batch_job_computes(runs):
    import pyarrow.parquet as pq

    from spotfill.fillin import batch_plan as bp
    from spotfill.fillin.batch import eval_rows, plan_model, read_back
    from spotfill.storage.base import open_storage
    from spotfill.train.data import ShardReader
    _, filled, plan_dir = runs
    out = open_storage(plan_dir)
    plan = json.loads(out.get_bytes(bp.PLAN_KEY))
    committed = sorted(k for k in out.list(f"{bp.COMMITS}/"))
    assert committed, "no unit was completed inside the bubbles"
    summary = read_back(out, plan)
    assert summary["duplicates"] == 0
    model = plan_model(out, plan)
    reader = ShardReader(open_storage(plan["eval_data"]), os.path.join(plan_dir, "cache"))
    for key in committed:
        unit_id = os.path.basename(key)[:-len(".json")]
        table = pq.read_table(os.path.join(plan_dir, "eval", f"part-{unit_id}.parquet")).to_pydict()
        rows = np.asarray(table["row"])
        nll, _ = eval_rows(model, reader.rows(rows))
        assert table["nll"] == nll
